//! Inference: a key/value cache, the forward that uses it, the decoding loop, and
//! `generation_config.json`.
//!
//! Outside the training path: [`CausalLM::forward_hidden`] stays cache-free. The cached forward
//! here runs the same layer weights through the same [`crate::nn::linear::Linear::forward`],
//! [`crate::decoder::Mlp`] and [`crate::nn::ops`] functions; only attention differs, because the new
//! queries attend to keys and values kept from earlier calls.
//!
//! Shape legend: B = batch, t = positions fed in this call, P = positions already cached,
//! L = P + t (keys attended to), S = cache capacity, C = hidden size, H = heads,
//! KV = key/value heads, R = H / KV (queries per key/value head), D = head dim, V = vocab.
//!
//! What one decode step (t = 1) allocates, per layer: q/k/v/o projections and the MLP for one
//! position ((B, 1, C), (B, 1, I)), rotary tables for one position, and the attention scores and
//! probabilities of the one new query, (B, H, 1, L) floats. Nothing else grows with the
//! sequence: keys and values are written in place into the cache (preallocated once for
//! prompt + max_new_tokens positions) and read through a view of it (no copy, no repeat of the
//! key/value heads: queries are grouped per key/value head instead), no mask is built, and
//! logits are computed for the last position only, (B, V).

pub mod sampling;

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use serde_json::Value as Json;

use crate::decoder::{Attention, AttentionImpl, CausalLM, DecoderLayer};
use crate::error::{ModelError, Result};
use crate::generate::sampling::{Sampler, SamplingParams};
use crate::kernels::chunked::AttentionMask;
use crate::nn::ops;

/// Keys and values of every layer for the positions seen so far, in tensors allocated once.
pub struct KvCache {
    /// Per layer: (B, KV, S, D), keys after rotary embedding.
    k: Vec<Tensor>,
    /// Per layer: (B, KV, S, D)
    v: Vec<Tensor>,
    /// P: positions filled.
    len: usize,
    capacity: usize,
    batch: usize,
}

impl KvCache {
    /// A cache for `batch` rows of up to `capacity` positions (prompt + new tokens), zeroed.
    pub fn new(model: &CausalLM, batch: usize, capacity: usize) -> Result<Self> {
        let c = &model.config;
        let shape = (batch, c.num_key_value_heads, capacity, c.head_dim); // (B, KV, S, D)
        let mut k = Vec::with_capacity(c.num_hidden_layers);
        let mut v = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            k.push(Tensor::zeros(shape, model.dtype(), model.device())?);
            v.push(Tensor::zeros(shape, model.dtype(), model.device())?);
        }
        Ok(Self {
            k,
            v,
            len: 0,
            capacity,
            batch,
        })
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the memory is kept for reuse).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Bytes held by the cache tensors.
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

/// Additive mask for t new queries at positions P..P+t against L = P + t keys: query i sees key
/// j iff j <= P + i (and, with a sliding window w, P + i - j < w). (t, L), 0 or -inf, in `dtype`.
fn chunk_mask(
    past: usize,
    t: usize,
    window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let l = past + t;
    let mut m = vec![0f32; t * l];
    for i in 0..t {
        let q = past + i;
        for j in 0..l {
            if j > q || window.is_some_and(|w| q - j >= w) {
                m[i * l + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (t, l), device)?.to_dtype(dtype)?)
}

/// What one cached forward step of t new positions after `past` cached ones gives every layer.
#[derive(Clone, Copy)]
struct Step<'a> {
    /// (B, 1, t, D) rotary tables at the absolute positions P..P+t.
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// (t, L), or None (t = 1: the new query sees every cached key).
    mask: Option<&'a Tensor>,
    /// A prefill (nothing cached yet) with chunked attention: the prompt's attention through
    /// [`crate::kernels::chunked`], no (t, L) mask.
    chunked: Option<&'a AttentionMask>,
    past: usize,
    window: Option<usize>,
}

/// Attention of t new positions against the cache, writing their keys and values into it.
/// x: (B, t, C), caches (keys, values): (B, KV, S, D) -> (B, t, C)
fn attention_cached(
    a: &Attention,
    x: &Tensor,
    step: Step,
    (k_cache, v_cache): (&Tensor, &Tensor),
) -> Result<Tensor> {
    let Step {
        cos,
        sin,
        mask,
        past,
        window,
        ..
    } = step;
    let (b, t, _) = x.dims3()?;
    let (h, kv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
    let r = h / kv;
    let (q, k, v) = a.qkv(x, cos, sin)?; // q (B, H, t, D), k and v (B, KV, t, D)
    let (k, v) = (k.contiguous()?, v.contiguous()?);

    // Written in place: no new sequence-sized tensor.
    k_cache.slice_set(&k, 2, past)?;
    v_cache.slice_set(&v, 2, past)?;
    if let Some(m) = step.chunked {
        let q = q.reshape((b, kv, r * t, d))?; // (B, KV, R*t, D)
        let y = crate::kernels::flash_attn::chunked_attention_capped(&q, &k, &v, m, a.softcap)?;
        let y = y.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()?; // (B, t, H, D)
        return a.o_proj.forward(&y.reshape((b, t, h * d))?);
    }
    let l = past + t;
    // A single query never sees keys that fell out of the sliding window: drop them here, the
    // mask does it for a chunk.
    let start = match (mask, window) {
        (None, Some(w)) => l.saturating_sub(w),
        _ => 0,
    };
    let keys = k_cache.narrow(2, start, l - start)?; // (B, KV, L', D), a view
    let values = v_cache.narrow(2, start, l - start)?;

    // Grouped-query attention without repeating K/V: head h uses key/value head h / R (as
    // `ops::repeat_kv` lays them out), so the R query heads of one key/value head become rows.
    let q = q.reshape((b, kv, r * t, d))?; // (B, KV, R*t, D), rows ordered (R, t)
    let mut scores = q.matmul(&keys.t()?)?; // (B, KV, R*t, L'); q carries the scale (`qkv`)
    if let Some(cap) = a.softcap {
        scores = ops::softcap(&scores, cap)?; // Gemma 2, in the compute dtype as transformers
    }

    // Softmax in f32 and cast back, as the training forward (and HF's eager attention) does.
    let up = ops::upcast(scores.dtype());
    let mut scores = scores.to_dtype(up)?;
    if let Some(m) = mask {
        let lk = scores.dim(D::Minus1)?;
        scores = scores
            .reshape((b, kv, r, t, lk))? // (B, KV, R, t, L)
            .broadcast_add(&m.to_dtype(up)?)?
            .reshape((b, kv, r * t, lk))?; // (B, KV, R*t, L)
    }
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(values.dtype())?;
    let y = probs.matmul(&values)?; // (B, KV, R*t, D)
    let y = y.reshape((b, h, t, d))?; // (B, H, t, D)
    let y = y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))?; // (B, t, H*D)
    a.o_proj.forward(&y)
}

/// One decoder layer with the cache: [`DecoderLayer::forward`] with cached attention.
/// x: (B, t, C) -> (B, t, C)
fn layer_cached(
    layer: &DecoderLayer,
    x: &Tensor,
    step: Step,
    caches: (&Tensor, &Tensor),
) -> Result<Tensor> {
    layer.block(x, |h| attention_cached(&layer.self_attn, h, step, caches))
}

impl CausalLM {
    /// Runs t new positions (the prompt, then one token at a time) through the model, appending
    /// their keys and values to `cache`; returns the logits of the last position, upcast to f32.
    /// input_ids: (B, t) u32 -> (B, V)
    pub fn forward_cached(&self, input_ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let past = cache.len;
        if b != cache.batch || past + t > cache.capacity || t == 0 {
            return Err(ModelError::Invalid(format!(
                "KV cache: {t} new positions for {b} rows do not fit a cache of {} rows with \
                 {past} of {} positions used",
                cache.batch, cache.capacity
            )));
        }
        let dev = self.device();
        // LongRoPE: this call's longest position decides short or long factors, as in the
        // training forward (`generate` recomputes the cache when a generation crosses over).
        let positions = Tensor::arange(past as u32, (past + t) as u32, dev)?
            .unsqueeze(0)?
            .repeat((b, 1))?; // (B, t)
        let (cos, sin) = self.rotary.tables(&positions, past + t, self.dtype())?; // (B, 1, t, Dr)
        let local = self.rotary.local_tables(&positions, self.dtype())?; // Gemma 3's sliding layers
                                                                         // The prompt of an empty cache through chunked attention (nothing t x t); a later chunk
                                                                         // of several positions with the (t, L) mask; one position with none.
        let prefill = past == 0 && t > 1 && self.attention == AttentionImpl::Chunked;
        // The masks of one window (the config's, or None for Gemma 2's full-attention layers).
        let masks = |window: Option<usize>| -> Result<(Option<AttentionMask>, Option<Tensor>)> {
            let chunked = if prefill {
                Some(AttentionMask::new(&vec![vec![0u32; t]; b], window, dev)?)
            } else {
                None
            };
            let mask = if t > 1 && !prefill {
                Some(chunk_mask(past, t, window, self.dtype(), dev)?)
            } else {
                None
            };
            Ok((chunked, mask))
        };
        let windows: Vec<Option<usize>> = (0..self.layers.len())
            .map(|i| self.config.layer_window(i))
            .collect();
        let sliding = self.config.sliding_window;
        let (chunked_w, mask_w) = masks(sliding)?;
        let full = if sliding.is_some() && windows.contains(&None) {
            Some(masks(None)?)
        } else {
            None
        };
        let step_for = |window: Option<usize>| -> Step {
            let (chunked, mask) = match (&full, window) {
                (Some((c, m)), None) => (c, m),
                _ => (&chunked_w, &mask_w),
            };
            let (cos, sin) = match (&local, window) {
                (Some((c, s)), Some(_)) => (c, s), // a sliding layer of Gemma 3
                _ => (&cos, &sin),
            };
            Step {
                cos,
                sin,
                mask: mask.as_ref(),
                chunked: chunked.as_ref(),
                past,
                window,
            }
        };
        let mut x = self.embed(input_ids)?; // (B, t, C)
        for (i, layer) in self.layers.iter().enumerate() {
            let step = step_for(windows[i]);
            x = layer_cached(layer, &x, step, (&cache.k[i], &cache.v[i]))?;
        }
        cache.len = past + t;
        let last = x.narrow(1, t - 1, 1)?; // (B, 1, C)
        self.head(&last)
    }

    /// The logits of the last position by the training forward, recomputing every position
    /// (no cache): the reference the cached path is tested against.
    /// input_ids: (B, T) u32 -> (B, V)
    pub fn last_logits(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (_, t) = input_ids.dims2()?;
        let h = self.forward_hidden(input_ids, None)?; // (B, T, C), normed
        let last = h.narrow(1, t - 1, 1)?; // (B, 1, C)
        let logits = last.broadcast_matmul(&self.lm_head_weight().t()?)?; // (B, 1, V)
        let logits = self.cap_logits(logits)?;
        Ok(logits.squeeze(1)?.to_dtype(ops::upcast(self.dtype()))?)
    }

    /// Final norm and LM head. x: (B, 1, C) before the norm -> (B, V) f32
    fn head(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.final_norm(x)?;
        let logits = self.cap_logits(h.broadcast_matmul(&self.lm_head_weight().t()?)?)?; // (B, 1, V)
        Ok(logits.squeeze(1)?.to_dtype(ops::upcast(self.dtype()))?)
    }
}

/// The keys of `generation_config.json` that decoding uses. Absent keys are None; the caller
/// applies its own defaults (and command-line flags override these).
#[derive(Clone, Debug, Default)]
pub struct GenerationConfig {
    /// Ids that end generation: `eos_token_id` (an id or a list) of generation_config.json, else
    /// of config.json (as transformers falls back).
    pub eos_token_ids: Vec<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json` if there is one; `config_eos` (config.json's
    /// `eos_token_id`) is used when it names no `eos_token_id`.
    pub fn from_dir(dir: &Path, config_eos: &[u32]) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self {
                    eos_token_ids: config_eos.to_vec(),
                    ..Self::default()
                })
            }
            Err(source) => return Err(ModelError::Io { path, source }),
        };
        let j: Json = crate::io::parse_json(&text, &path)?;
        let bad = |key: &str, msg: &str| ModelError::Config {
            path: path.clone(),
            key: key.into(),
            msg: msg.into(),
        };
        let id = |v: &Json| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad("eos_token_id", "must be a token id or a list of token ids"))
        };
        let eos_token_ids = match j.get("eos_token_id") {
            None | Some(Json::Null) => config_eos.to_vec(),
            Some(Json::Array(ids)) => ids.iter().map(id).collect::<Result<_>>()?,
            Some(v) => vec![id(v)?],
        };
        let float = |key: &str| -> Result<Option<f64>> {
            match j.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(key, "must be a number")),
            }
        };
        let int = |key: &str| -> Result<Option<usize>> {
            match j.get(key) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| bad(key, "must be a non-negative integer")),
            }
        };
        let do_sample = match j.get("do_sample") {
            None | Some(Json::Null) => None,
            Some(v) => Some(
                v.as_bool()
                    .ok_or_else(|| bad("do_sample", "must be true or false"))?,
            ),
        };
        Ok(Self {
            eos_token_ids,
            do_sample,
            temperature: float("temperature")?,
            top_k: int("top_k")?,
            top_p: float("top_p")?,
            repetition_penalty: float("repetition_penalty")?,
            max_new_tokens: int("max_new_tokens")?,
        })
    }
}

/// How to decode.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// At most this many new tokens (a stop token included).
    pub max_new_tokens: usize,
    /// Generation ends after any of these ids (which is kept as the last generated id, as
    /// transformers returns it).
    pub stop_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// False: every step recomputes all positions through the training forward (slow; the
    /// reference for the cache).
    pub use_cache: bool,
}

/// The result of [`generate`], with timings.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated ids (prompt excluded), ending with the stop id when one was produced.
    pub ids: Vec<u32>,
    /// True when generation ended at a stop id (false: at max_new_tokens).
    pub stopped: bool,
    /// Time to the first new token: the prompt's forward (and the first sampling).
    pub prefill_secs: f64,
    /// Time for the remaining `ids.len() - 1` tokens, one forward each.
    pub decode_secs: f64,
    /// Bytes of the KV cache (0 without it).
    pub cache_bytes: usize,
}

/// Generates after `prompt` (one row), calling `on_token` with each new id as it is chosen.
pub fn generate(
    model: &CausalLM,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(ModelError::Invalid(
            "the prompt is empty: give at least one token to generate from".into(),
        ));
    }
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    let dev = model.device();
    let mut history = prompt.to_vec(); // prompt + generated, for the repetition penalty
    let mut out = Generation {
        ids: Vec::new(),
        stopped: false,
        prefill_secs: 0.0,
        decode_secs: 0.0,
        cache_bytes: 0,
    };
    if opts.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut cache = if opts.use_cache {
        let c = KvCache::new(model, 1, prompt.len() + opts.max_new_tokens)?;
        out.cache_bytes = c.bytes();
        Some(c)
    } else {
        None
    };
    let start = Instant::now();
    let mut decode_start = start;
    for step in 0..opts.max_new_tokens {
        let logits = match cache.as_mut() {
            // Prefill: the whole prompt; then the last token only.
            Some(c) => {
                // LongRoPE: once prompt + generated passes the original context while the cache
                // holds at most that many positions (keys rotated with the short factors), the
                // cache is dropped and everything recomputed with the long factors, as
                // transformers' Phi3ForCausalLM.prepare_inputs_for_generation does.
                let recompute = model
                    .rotary
                    .long_after()
                    .is_some_and(|orig| step > 0 && history.len() > orig && c.len() <= orig);
                if recompute {
                    c.reset();
                }
                let new = if step == 0 || recompute {
                    &history[..]
                } else {
                    &history[history.len() - 1..]
                };
                let x = Tensor::new(new, dev)?.unsqueeze(0)?; // (1, t)
                model.forward_cached(&x, c)?
            }
            None => {
                let x = Tensor::new(history.as_slice(), dev)?.unsqueeze(0)?; // (1, T)
                model.last_logits(&x)?
            }
        }; // (1, V)
        let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?; // syncs
        let id = sampler.next(logits, &history);
        history.push(id);
        out.ids.push(id);
        if step == 0 {
            out.prefill_secs = start.elapsed().as_secs_f64();
            decode_start = Instant::now();
        }
        on_token(id)?;
        if opts.stop_ids.contains(&id) {
            out.stopped = true;
            break;
        }
    }
    out.decode_secs = decode_start.elapsed().as_secs_f64();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::LoadOptions;
    use std::path::PathBuf;

    fn fixture_model(name: &str) -> CausalLM {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models")
            .join(name);
        CausalLM::load(&dir, &LoadOptions::frozen(DType::F32, &Device::Cpu)).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>());
        d.unwrap()
    }

    /// The cached forward (prompt in one chunk, then in uneven chunks, then token by token)
    /// gives the last-position logits of the training forward, for every family.
    #[test]
    fn cached_logits_match_the_training_forward() {
        let ids: Vec<u32> = vec![5, 17, 99, 3, 250, 8, 41, 77, 12, 199, 64, 2];
        for name in [
            "tiny-llama",
            "tiny-qwen2",
            "tiny-qwen3",
            "tiny-mistral",
            "tiny-gemma2",
            "tiny-phi3",
        ] {
            let model = fixture_model(name);
            let mut cache = KvCache::new(&model, 1, ids.len()).unwrap();
            // Chunks of 5, 1, 3, then 1 at a time: prefill, a decode step, a chunk after it.
            let mut fed = 0;
            for len in [5, 1, 3, 1, 1, 1] {
                let chunk = Tensor::new(&ids[fed..fed + len], &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let got = model.forward_cached(&chunk, &mut cache).unwrap();
                fed += len;
                let all = Tensor::new(&ids[..fed], &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let want = model.last_logits(&all).unwrap();
                let full = model.logits(&all).unwrap().narrow(1, fed - 1, 1).unwrap();
                let d = max_diff(&want, &full.squeeze(1).unwrap());
                // a few f32 ulps: tiny-gemma2's pre-cap logits reach 10-20 (measured 1.2e-6)
                assert!(d < 4e-6, "{name}: last_logits vs logits {d}");
                let d = max_diff(&got, &want);
                assert!(d < 1e-4, "{name}: {fed} positions: max diff {d}");
                assert_eq!(cache.len(), fed);
            }
            // Full: one more position is refused with a message.
            let x = Tensor::new(&[1u32], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let err = model
                .forward_cached(&x, &mut cache)
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("do not fit"), "{err}");
        }
    }

    /// A sliding window in the config limits what the cached path attends to, as the mask does
    /// in the training forward.
    #[test]
    fn cached_path_honours_the_sliding_window() {
        let mut model = fixture_model("tiny-qwen2");
        model.config.sliding_window = Some(3);
        let ids: Vec<u32> = vec![5, 17, 99, 3, 250, 8, 41];
        let mut cache = KvCache::new(&model, 1, ids.len()).unwrap();
        let x = Tensor::new(&ids[..4], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        model.forward_cached(&x, &mut cache).unwrap();
        for n in 5..=ids.len() {
            let x = Tensor::new(&ids[n - 1..n], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let got = model.forward_cached(&x, &mut cache).unwrap();
            let all = Tensor::new(&ids[..n], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let want = model.last_logits(&all).unwrap();
            assert!(max_diff(&got, &want) < 1e-4);
        }
    }

    #[test]
    fn generation_config_reads_eos_lists_and_falls_back_to_config_json() {
        let dir = std::env::temp_dir().join(format!("tallow-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let none = GenerationConfig::from_dir(&dir, &[7]).unwrap();
        assert_eq!(none.eos_token_ids, vec![7]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [3, 9], "do_sample": true, "temperature": 0.7, "top_k": 20}"#,
        )
        .unwrap();
        let g = GenerationConfig::from_dir(&dir, &[7]).unwrap();
        assert_eq!(g.eos_token_ids, vec![3, 9]);
        assert_eq!(g.do_sample, Some(true));
        assert_eq!(g.temperature, Some(0.7));
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.top_p, None);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .unwrap();
        let err = GenerationConfig::from_dir(&dir, &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
