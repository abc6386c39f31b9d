//! The decoder-only causal LM shared by the Llama, Qwen2 and Qwen3 families: written once, with
//! the family differences (biases, qk-norm, head_dim, rope scaling, tying) taken from
//! [`DecoderConfig`]. Tensor names follow the HF safetensors keys (`model.layers.0.self_attn.q_proj.weight`).
//!
//! This is training code: the forward is cache-free, returns every position, and every op has a
//! backward. Inference with a key/value cache reuses these layers from [`crate::generate`]. Shape legend: B = batch, T = time, C = hidden size, H = heads, KV = key/value heads,
//! D = head dim, I = intermediate size, V = vocab.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::checkpointing::Checkpointing;
use crate::config::DecoderConfig;
use crate::error::{ModelError, Result};
use crate::layout::{LinearSpec, LINEAR_PATHS};
use crate::linear::{adapter_input, Base, Linear, Param};
use crate::no_grad::enter;
use crate::ops;
use crate::quant::nf4::{Nf4Options, Nf4Weight};
use crate::weights::Weights;

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Storage and compute dtype of the base weights.
    pub dtype: DType,
    pub device: Device,
    /// Make every base weight a trainable variable (full fine-tuning). False: all frozen.
    pub train_base: bool,
    /// Some: store the linear weights of the decoder layers in NF4 (QLoRA), quantized at load one
    /// tensor at a time; embeddings, norms and lm_head stay in `dtype`. A bitsandbytes 4-bit
    /// checkpoint loads as NF4 whatever this says.
    pub quantize: Option<Nf4Options>,
}

impl LoadOptions {
    pub fn frozen(dtype: DType, device: &Device) -> Self {
        Self {
            dtype,
            device: device.clone(),
            train_base: false,
            quantize: None,
        }
    }

    /// [`LoadOptions::frozen`] with the decoder's linear weights in NF4.
    pub fn nf4(dtype: DType, device: &Device, double_quant: bool) -> Self {
        Self {
            quantize: Some(Nf4Options { double_quant }),
            ..Self::frozen(dtype, device)
        }
    }
}

/// Multi-head self-attention with grouped-query heads and rotary embedding.
#[derive(Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen3: RMSNorm over D on each q / k head.
    pub q_norm: Option<Param>,
    pub k_norm: Option<Param>,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) eps: f64,
}

impl Attention {
    /// x: (B, T, C), cos/sin: (B, 1, T, D), mask: (B, 1, T, T) -> (B, T, C)
    /// Projections, qk-norm (Qwen3) and rotary embedding of the queries and keys: what the
    /// training forward and the cached (generation) forward share.
    /// x: (B, T, C), cos/sin: (B, 1, T, D) -> q (B, H, T, D), k and v (B, KV, T, D)
    pub(crate) fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // x in f32 once for the three adapters (bf16 models), not once per projection.
        let xa = adapter_input(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?;
        let xa = xa.as_ref();
        let q = self.q_proj.forward_with(x, xa)?.reshape((b, t, h, d))?; // (B, T, H, D)
        let k = self.k_proj.forward_with(x, xa)?.reshape((b, t, kv, d))?; // (B, T, KV, D)
        let v = self.v_proj.forward_with(x, xa)?.reshape((b, t, kv, d))?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (
                ops::rms_norm(&q, &enter(qn.tensor()), self.eps)?,
                ops::rms_norm(&k, &enter(kn.tensor()), self.eps)?,
            ),
            _ => (q, k),
        };
        // Heads moved in front of time by the rotary op itself (one pass on the CPU). The
        // attention scale 1/sqrt(D) is folded into q's rotary embedding (no extra tensor), so
        // the graph keeps no unscaled (B, H, T, T) scores.
        let q = ops::rope_heads(&q, cos, sin, 1.0 / (d as f64).sqrt())?; // (B, H, T, D)
        let k = ops::rope_heads(&k, cos, sin, 1.0)?; // (B, KV, T, D)
        let v = v.transpose(1, 2)?.contiguous()?; // (B, KV, T, D)
        Ok((q, k, v))
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: &Mask) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = self.qkv(x, cos, sin)?;
        // Grouped-query attention without copying k and v per query head (HF's repeat_kv):
        // the n_rep = H / KV query heads that share a kv head are adjacent, so q viewed as
        // (B, KV, n_rep * T, D) multiplies each kv head once, in a larger matmul.
        let n_rep = h / kv;
        let q = q.reshape((b, kv, n_rep * t, d))?; // (B, H, T, D) -> (B, KV, n_rep*T, D), a view

        // Scores in the compute dtype (q carries the 1/sqrt(D) scale, see `qkv`), softmax in
        // f32, cast back, as HF's eager attention; kept grouped (a reshape to (B, H, T, T) would
        // be a graph node whose backward zeroes and adds a score-sized buffer). Chunked (the
        // default) keeps no (T, T) scores; eager reads the causal mask of ops::attention_mask.
        let y = match mask {
            Mask::Dense(m) => ops::causal_attention(&q, &k, &v, m)?,
            Mask::Chunked(m) => crate::chunked::chunked_attention(&q, &k, &v, m)?,
        }; // (B, KV, n_rep*T, D)
        let y = y.reshape((b, h, t, d))?; // (B, H, T, D)
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))?; // (B, T, H*D)
        self.o_proj.forward(&y)
    }
}

/// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
#[derive(Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// x: (B, T, C) -> (B, T, C), through (B, T, I)
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let xa = adapter_input(&[&self.gate_proj, &self.up_proj], x)?; // one f32 copy of x
        let g = self.gate_proj.forward_with(x, xa.as_ref())?;
        let u = self.up_proj.forward_with(x, xa.as_ref())?;
        self.down_proj.forward(&ops::swiglu(&g, &u)?)
    }
}

/// One pre-norm decoder layer. Cloning is cheap (tensors are shared), which activation
/// checkpointing uses to keep a handle on the layer in the graph.
#[derive(Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Param,
    pub post_attention_layernorm: Param,
    pub(crate) eps: f64,
}

impl DecoderLayer {
    /// x: (B, T, C) -> (B, T, C)
    pub fn forward(&self, x: &Tensor, rope: &RopeMask) -> Result<Tensor> {
        self.mlp_half(&self.attention_residual(x, rope)?)
    }

    /// The training forward's first half, [`DecoderLayer::attention_half`] with the batch's
    /// rotary tables and mask. x: (B, T, C) -> (B, T, C)
    pub(crate) fn attention_residual(&self, x: &Tensor, rope: &RopeMask) -> Result<Tensor> {
        self.attention_half(x, |h| {
            self.self_attn.forward(h, &rope.cos, &rope.sin, &rope.mask)
        })
    }

    /// The pre-norm block around an attention: x + attn(norm(x)), then + mlp(norm(.)). The
    /// training forward and the cached forward differ only in `attn`.
    /// x: (B, T, C) -> (B, T, C)
    pub(crate) fn block(
        &self,
        x: &Tensor,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.mlp_half(&self.attention_half(x, attn)?)
    }

    /// The block's first residual half: x + attn(norm(x)). x: (B, T, C) -> (B, T, C)
    pub(crate) fn attention_half(
        &self,
        x: &Tensor,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = ops::rms_norm(x, &enter(self.input_layernorm.tensor()), self.eps)?;
        Ok((x + attn(&h)?)?)
    }

    /// The block's second residual half: x + mlp(norm(x)). Token-wise (each row of the output
    /// reads only its own row), which activation checkpointing uses to run it in tiles of
    /// tokens. x: (B, T, C) -> (B, T, C)
    pub(crate) fn mlp_half(&self, x: &Tensor) -> Result<Tensor> {
        let h = ops::rms_norm(x, &enter(self.post_attention_layernorm.tensor()), self.eps)?;
        Ok((x + self.mlp.forward(&h)?)?)
    }

    /// Every linear layer of this block with its path relative to the layer
    /// ([`LINEAR_PATHS`], HF's names: `self_attn.q_proj`, ...).
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let (a, m) = (&self.self_attn, &self.mlp);
        let l = [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ];
        LINEAR_PATHS.into_iter().zip(l).collect()
    }

    /// [`DecoderLayer::linears`], mutable (for attaching adapters).
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        let l = [
            &mut a.q_proj,
            &mut a.k_proj,
            &mut a.v_proj,
            &mut a.o_proj,
            &mut m.gate_proj,
            &mut m.up_proj,
            &mut m.down_proj,
        ];
        LINEAR_PATHS.into_iter().zip(l).collect()
    }
}

/// The per-batch inputs every layer shares: rotary tables and the additive attention mask.
#[derive(Clone)]
pub struct RopeMask {
    /// (B, 1, T, D)
    pub cos: Tensor,
    pub sin: Tensor,
    pub mask: Mask,
}

/// `*ForCausalLM`: embeddings, decoder layers, final norm, LM head (tied or not).
pub struct CausalLM {
    pub config: DecoderConfig,
    /// (V, C)
    pub embed_tokens: Param,
    pub layers: Vec<DecoderLayer>,
    /// (C)
    pub norm: Param,
    /// (V, C); None when tied to `embed_tokens`.
    pub lm_head: Option<Param>,
    pub(crate) inv_freq: Vec<f32>,
    dtype: DType,
    device: Device,
    /// Activation checkpointing, when on (see [`crate::checkpointing`]).
    checkpointing: Option<Checkpointing>,
    /// How the training / eval forward computes attention (`model.attention`).
    pub attention: AttentionImpl,
}

/// `model.attention`: how the full-sequence forward computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// Blocks of queries, nothing T x T kept ([`crate::chunked`]); the default.
    #[default]
    Chunked,
    /// HF's eager attention: the (T, T) mask, scores and probabilities of every layer.
    Eager,
}

/// The attention mask of a batch, in the form its [`AttentionImpl`] reads.
#[derive(Clone)]
pub enum Mask {
    /// (B, 1, T, T), 0 or -inf
    Dense(Tensor),
    /// Per-token segment ids and the window ([`crate::chunked::AttentionMask`]).
    Chunked(crate::chunked::AttentionMask),
}

impl CausalLM {
    /// Loads an HF-layout model directory (config.json + safetensors).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let config = DecoderConfig::from_dir(dir)?;
        let weights = Weights::from_dir(dir)?;
        Self::from_weights(config, &weights, opts)
    }

    pub fn from_weights(config: DecoderConfig, w: &Weights, opts: &LoadOptions) -> Result<Self> {
        let c = &config;
        let (dt, dev, tr) = (opts.dtype, &opts.device, opts.train_base);
        let param = |name: &str, shape: &[usize]| -> Result<Param> {
            Param::new(w.load(name, shape, dt, dev)?, tr)
        };
        if opts.quantize.is_some() && tr {
            return Err(ModelError::Invalid(
                "NF4 base weights are frozen: quantization works with LoRA (QLoRA) only; \
                 for full fine-tuning load the model unquantized"
                    .into(),
            ));
        }
        // A decoder linear weight: dense, quantized to NF4 right after loading (the
        // full-precision tensor is dropped before the next one is read), or a bitsandbytes 4-bit
        // tensor read as it is.
        let base = |name: &str, out: usize, inp: usize| -> Result<Base> {
            if w.dtype(name)? == DType::U8 {
                if tr {
                    return Err(ModelError::Invalid(format!(
                        "{}: `{name}` is 4-bit (a bitsandbytes checkpoint): its weights cannot \
                         be trained; use LoRA, or the unquantized model for full fine-tuning",
                        w.dir().display()
                    )));
                }
                return Ok(Base::Nf4(Arc::new(Nf4Weight::from_bnb(
                    w,
                    name,
                    (out, inp),
                    dt,
                    dev,
                )?)));
            }
            match opts.quantize {
                None => Ok(Base::Dense(param(name, &[out, inp])?)),
                Some(q) => {
                    // Quantized on the CPU from f32 (the kernel path), then moved: the device
                    // only ever receives the 4-bit weight.
                    let full = w.load(name, &[out, inp], DType::F32, &Device::Cpu)?;
                    let mut nf4 = Nf4Weight::quantize(&full, q.double_quant)?;
                    drop(full);
                    nf4.dtype = dt;
                    Ok(Base::Nf4(Arc::new(nf4.to_device(dev)?)))
                }
            }
        };
        let linear = |name: &str, s: &LinearSpec| -> Result<Linear> {
            Ok(Linear {
                weight: base(&format!("{name}.weight"), s.out, s.inp)?,
                bias: if s.bias {
                    Some(param(&format!("{name}.bias"), &[s.out])?)
                } else {
                    None
                },
                adapter: None,
            })
        };
        let (hs, d) = (c.hidden_size, c.head_dim);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            // The seven linears in LINEAR_PATHS order (crate::layout).
            let mut lins = c
                .layer_linears()
                .iter()
                .map(|s| linear(&format!("{p}.{}", s.path), s))
                .collect::<Result<Vec<_>>>()?
                .into_iter();
            let mut next = || lins.next().expect("seven linears");
            let norm = |n: &str| param(&format!("{p}.{n}"), &[d]);
            let self_attn = Attention {
                q_proj: next(),
                k_proj: next(),
                v_proj: next(),
                o_proj: next(),
                q_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.q_norm.weight"))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.k_norm.weight"))
                    .transpose()?,
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: d,
                eps: c.rms_norm_eps,
            };
            let mlp = Mlp {
                gate_proj: next(),
                up_proj: next(),
                down_proj: next(),
            };
            layers.push(DecoderLayer {
                self_attn,
                mlp,
                input_layernorm: param(&format!("{p}.input_layernorm.weight"), &[hs])?,
                post_attention_layernorm: param(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[hs],
                )?,
                eps: c.rms_norm_eps,
            });
        }
        let embed_tokens = param("model.embed_tokens.weight", &[c.vocab_size, hs])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(param("lm_head.weight", &[c.vocab_size, hs])?)
        };
        Ok(Self {
            inv_freq: ops::rope_inv_freq(d, c.rope_theta, c.rope_scaling.as_ref()),
            embed_tokens,
            layers,
            norm: param("model.norm.weight", &[hs])?,
            lm_head,
            dtype: dt,
            device: dev.clone(),
            config,
            checkpointing: None,
            attention: AttentionImpl::default(),
        })
    }

    /// Activation checkpointing of every `every`-th decoder layer (`None`: off). With it on,
    /// the gradients of the checkpointed layers' variables do not come out of `backward()`:
    /// collect them with [`CausalLM::take_checkpoint_grads`] after each backward.
    pub fn set_checkpointing(&mut self, every: Option<usize>) {
        self.checkpointing = every.map(|e| Checkpointing::new(e.max(1)));
    }

    /// With checkpointing on: keep the checkpointed layers' inputs in host memory between the
    /// forward and the backward (`train.offload_checkpoints`; no saving on the CPU, where the
    /// host copy is the tensor itself). See [`crate::checkpointing`].
    pub fn set_offload_checkpoints(&mut self, on: bool) {
        if let Some(c) = &mut self.checkpointing {
            c.offload = on;
        }
    }

    /// With checkpointing on: tokens per tile of the checkpointed layers' MLP half (None: the
    /// hidden size). Tests set small tiles to run several on tiny models.
    pub fn set_checkpoint_tile_rows(&mut self, rows: Option<usize>) {
        if let Some(c) = &mut self.checkpointing {
            c.tile_rows = rows.map(|r| r.max(1));
        }
    }

    /// The gradients of variables inside checkpointed layers from the backward passes since the
    /// last call (one store per layer and backward). Empty when checkpointing is off.
    pub fn take_checkpoint_grads(&self) -> Vec<candle_core::backprop::GradStore> {
        self.checkpointing
            .as_ref()
            .map(Checkpointing::take_grads)
            .unwrap_or_default()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The output projection (V, C): `lm_head.weight`, or the embeddings when tied.
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens).tensor()
    }

    /// Rotary tables and mask for a batch. `segments` (B rows of T ids) marks rows packed
    /// together; None = one sequence per row.
    pub fn rope_mask(&self, b: usize, t: usize, segments: Option<&[Vec<u32>]>) -> Result<RopeMask> {
        let plain;
        let segments = match segments {
            Some(s) => s,
            None => {
                plain = vec![vec![0u32; t]; b];
                &plain
            }
        };
        if segments.len() != b || segments.iter().any(|s| s.len() != t) {
            return Err(ModelError::Invalid(format!(
                "segments must be {b} rows of {t} ids"
            )));
        }
        let positions = ops::positions_from_segments(segments, &self.device)?; // (B, T)
        let (cos, sin) = ops::rope_tables(&positions, &self.inv_freq, self.dtype)?;
        let window = self.config.sliding_window;
        let mask = match self.attention {
            AttentionImpl::Eager => Mask::Dense(ops::attention_mask(
                segments,
                window,
                self.dtype,
                &self.device,
            )?),
            AttentionImpl::Chunked => Mask::Chunked(crate::chunked::AttentionMask::new(
                segments,
                window,
                &self.device,
            )?),
        };
        Ok(RopeMask { cos, sin, mask })
    }

    /// Embeds token ids. input_ids: (B, T) u32 -> (B, T, C)
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let w = enter(self.embed_tokens.tensor());
        let flat = input_ids.flatten_all()?; // (B*T)
        Ok(w.index_select(&flat, 0)?
            .reshape((b, t, self.config.hidden_size))?)
    }

    /// Final hidden states after the last norm, for every position.
    /// input_ids: (B, T) u32 -> (B, T, C)
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        segments: Option<&[Vec<u32>]>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let rope = self.rope_mask(b, t, segments)?;
        let mut x = self.embed(input_ids)?;
        match &self.checkpointing {
            Some(c) => x = c.forward_layers(&self.layers, x, &rope)?,
            None => {
                for layer in &self.layers {
                    x = layer.forward(&x, &rope)?;
                }
            }
        }
        ops::rms_norm(&x, &enter(self.norm.tensor()), self.config.rms_norm_eps)
    }

    /// Full logits, upcast to f32 (f64 for an f64 model). Only for small inputs (tests, debugging):
    /// training and eval use the chunked loss in [`crate::loss`].
    /// input_ids: (B, T) -> (B, T, V)
    pub fn logits(&self, input_ids: &Tensor) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, None)?;
        let logits = h.broadcast_matmul(&self.lm_head_weight().t()?)?;
        Ok(logits.to_dtype(ops::upcast(self.dtype))?)
    }

    /// Every dense weight with its HF safetensors name (tied lm_head listed once, as the
    /// embeddings). NF4 linear weights are not listed: see [`CausalLM::nf4_weights`].
    pub fn named_params(&self) -> Vec<(String, &Param)> {
        let mut out: Vec<(String, &Param)> =
            vec![("model.embed_tokens.weight".into(), &self.embed_tokens)];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let a = &l.self_attn;
            for (n, lin) in l.linears() {
                if let Some(w) = lin.weight.param() {
                    out.push((format!("{p}.{n}.weight"), w));
                }
                if let Some(b) = &lin.bias {
                    out.push((format!("{p}.{n}.bias"), b));
                }
            }
            if let Some(qn) = &a.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), qn));
            }
            if let Some(kn) = &a.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), kn));
            }
            out.push((format!("{p}.input_layernorm.weight"), &l.input_layernorm));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                &l.post_attention_layernorm,
            ));
        }
        out.push(("model.norm.weight".into(), &self.norm));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".into(), h));
        }
        out
    }

    /// Every NF4 linear weight with its HF safetensors name.
    pub fn nf4_weights(&self) -> Vec<(String, &Arc<Nf4Weight>)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (n, lin) in l.linears() {
                if let Base::Nf4(w) = &lin.weight {
                    out.push((format!("model.layers.{i}.{n}.weight"), w));
                }
            }
        }
        out
    }
}
