//! An HF model (its tensors by HF name, `config.json`, `tokenizer.json`, `tokenizer_config.json`)
//! written as the GGUF file llama.cpp's `convert_hf_to_gguf.py` writes for it: the same metadata
//! keys and values, the same tensor names, shapes and types, and for f32 / f16 / Q8_0 the same
//! bytes (tests/tests/gguf.rs compares with the converter's own output); for Q4_K_M what
//! llama.cpp's `llama-quantize` then makes of the converter's f32 file ([`super::quants`] for its
//! blocks). `tallow export` calls it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value as G;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use serde_json::Value;

use super::spm;
use crate::error::{ModelError, Refusal, Result};

/// The tensor type of a GGUF export (`--outtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    BF16,
    Q8_0,
    /// llama-quantize's `Q4_K_M` mix: Q4_K, Q6_K for the output, the first, last and every third
    /// `attn_v` / `ffn_down`, Q5_0 / Q8_0 where rows are not whole 256-value blocks
    /// (`k_quant_type` below).
    Q4KM,
    /// llama-quantize's `Q3_K_S`: Q3_K (Q4_0 for rows of 32-value blocks), Q6_K for the output.
    Q3KS,
    /// llama-quantize's `Q3_K_M`: Q3_K; Q4_K for `attn_output`, the `ffn_down` (Q5_K for their
    /// first sixteenth) and the `attn_v` (Q5_K for the first 2).
    Q3KM,
    /// llama-quantize's `Q3_K_L`: Q3_K; Q5_K for `attn_v`, `attn_output` and `ffn_down`.
    Q3KL,
    /// llama-quantize's `Q4_K_S`: Q4_K, Q6_K for the output, Q5_K for the first 4 `attn_v` and
    /// the first eighth of the `ffn_down`.
    Q4KS,
    /// llama-quantize's `Q5_K_M`: the `Q4_K_M` mix with Q5_K (Q5_1 for rows of 32-value blocks).
    Q5KM,
    /// llama-quantize's `Q5_K_S`: Q5_K, Q6_K for the output.
    Q5KS,
    /// llama-quantize's `Q6_K`: Q6_K everywhere (Q8_0 for rows of 32-value blocks).
    Q6K,
}

impl OutType {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f32" => Self::F32,
            "f16" => Self::F16,
            "bf16" => Self::BF16,
            "q8_0" => Self::Q8_0,
            "q4_k_m" => Self::Q4KM,
            "q3_k_s" => Self::Q3KS,
            "q3_k_m" => Self::Q3KM,
            "q3_k_l" => Self::Q3KL,
            "q4_k_s" => Self::Q4KS,
            "q5_k_m" => Self::Q5KM,
            "q5_k_s" => Self::Q5KS,
            "q6_k" => Self::Q6K,
            _ => return None,
        })
    }

    /// Whether llama-quantize makes this type's file from the converter's f32 one (a k-quant
    /// mix), rather than the converter writing it.
    pub fn is_k_quant(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16 | Self::Q8_0)
    }

    /// `general.file_type` (llama.cpp's `LlamaFileType`).
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
            Self::Q4KM => 15,
            Self::Q3KS => 11,
            Self::Q3KM => 12,
            Self::Q3KL => 13,
            Self::Q4KS => 14,
            Self::Q5KS => 16,
            Self::Q5KM => 17,
            Self::Q6K => 18,
            Self::BF16 => 32,
        }
    }
}

/// What an export reads beside the tensors.
pub struct Source<'a> {
    /// The model's name (`general.name`).
    pub name: &'a str,
    pub config: &'a Value,
    pub tokenizer: &'a Value,
    pub tokenizer_config: &'a Value,
    /// `chat_template.jinja`, used when tokenizer_config.json has no template.
    pub chat_template: Option<&'a str>,
    /// `tokenizer.model` (SentencePiece), which the converter reads first when the model has one
    /// (Llama 2, Mistral, Gemma, Phi-3).
    pub tokenizer_model: Option<&'a [u8]>,
    /// `added_tokens.json` (Null when absent).
    pub added_tokens: &'a Value,
    /// The `tokenizer.*` keys of the GGUF file the model was read from (a GGUF model dir), when
    /// it has no `tokenizer.model`: written again as they are.
    pub gguf_tokenizer: Option<&'a [(String, G)]>,
    /// The model's checked hyper-parameters (what Gemma's and Phi-3's keys are written from).
    pub hyper: &'a Hyper,
}

/// A model's checked hyper-parameters as the export writes them (filled by
/// `crate::config::DecoderConfig::gguf_hyper`: the config room sits above this one).
#[derive(Debug, Clone)]
pub struct Hyper {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub max_positions: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope: HyperRope,
    /// The leading dims of each head that rotate (head_dim unless partial rotary).
    pub rotary_dim: usize,
    pub sliding_window: Option<usize>,
    pub query_pre_attn_scalar: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// Layers that attend to everything although `sliding_window` is set (Gemma).
    pub full_attention_layers: Vec<usize>,
    /// Gemma 3's sliding layers' rope base.
    pub rope_local_base_freq: Option<f64>,
}

/// The rope scaling of [`Hyper`].
#[derive(Debug, Clone, PartialEq)]
pub enum HyperRope {
    None,
    Linear(f64),
    LongRope {
        long: Vec<f64>,
        short: Vec<f64>,
    },
    /// Another type, by name (what a refusal shows).
    Other(String),
}

fn refuse(path: &Path, key: &str, value: Option<String>, msg: &str) -> ModelError {
    ModelError::GgufRefused {
        path: path.to_path_buf(),
        refusals: vec![Refusal {
            key: key.into(),
            value,
            msg: msg.into(),
        }],
    }
}

/// llama.cpp's architecture name for an HF `config.json`'s `model_type` (Mistral is llama.cpp's
/// `llama`, as its converter writes it).
fn gguf_arch(path: &Path, config: &Value) -> Result<&'static str> {
    match config["model_type"].as_str().unwrap_or("") {
        "llama" | "mistral" => Ok("llama"),
        "qwen2" => Ok("qwen2"),
        "qwen3" => Ok("qwen3"),
        "gemma2" => Ok("gemma2"),
        "gemma3_text" | "gemma3" => Ok("gemma3"),
        "phi3" => Ok("phi3"),
        other => Err(refuse(
            path,
            "model_type",
            Some(format!("{other:?}")),
            "GGUF export writes llama, mistral, qwen2, qwen3, gemma2, gemma3 and phi3 models and \
             adapters so far",
        )),
    }
}

/// Writes `tensors` (HF names, any dtype) and `src` to the GGUF file `path`, atomically.
/// Returns notes for the user: what llama.cpp will compute otherwise than the model, as the
/// converter's own file would (Mistral's sliding window, which its converter drops).
pub fn write_gguf(
    path: &Path,
    tensors: &[(String, Tensor)],
    src: &Source,
    out: OutType,
) -> Result<Vec<String>> {
    let c = src.config;
    let arch = gguf_arch(path, c)?;
    let int = |k: &str| c[k].as_u64().unwrap_or(0) as u32;
    let (hidden, heads) = (int("hidden_size"), int("num_attention_heads"));
    let kv = c["num_key_value_heads"]
        .as_u64()
        .map_or(heads, |n| n as u32);
    let head_dim = c["head_dim"]
        .as_u64()
        .map_or(hidden / heads.max(1), |d| d as u32);
    let layers = int("num_hidden_layers");
    let theta = rope_theta(c);

    // Tensors, by llama.cpp's names.
    let names: HashMap<String, String> = super::tensor_names(arch, layers as usize)
        .into_iter()
        .collect();
    let mut rows: Vec<(String, QTensor)> = Vec::new();
    let mut params = 0u64;
    if arch == "llama" {
        if let Some(f) = llama3_rope_freqs(c, theta, head_dim) {
            rows.push((
                "rope_freqs.weight".into(),
                QTensor::quantize(&f, GgmlDType::F32)?,
            ));
        }
    }
    let mut sorted: Vec<&(String, Tensor)> = tensors.iter().collect();
    sorted.sort_by_key(|(n, _)| hf_order(n));
    let d = src.hyper;
    if arch == "phi3" {
        if let HyperRope::LongRope {
            long: long_factor,
            short: short_factor,
        } = &d.rope
        {
            for (name, f) in [
                ("rope_factors_long.weight", long_factor),
                ("rope_factors_short.weight", short_factor),
            ] {
                let f: Vec<f32> = f.iter().map(|&x| x as f32).collect();
                let t = Tensor::new(f, &candle_core::Device::Cpu)?;
                rows.push((name.into(), QTensor::quantize(&t, GgmlDType::F32)?));
            }
        }
    }
    for (hf, t) in sorted {
        // Gemma's head is its embedding (the converter skips a stored lm_head)
        if super::is_gemma(arch) && hf == "lm_head.weight" {
            continue;
        }
        let Some(gg) = names.get(hf) else {
            return Err(refuse(
                path,
                hf,
                None,
                "a tensor GGUF export does not know the llama.cpp name of",
            ));
        };
        let mut t = t.to_dtype(DType::F32)?;
        if arch == "llama" {
            t = super::rotary_rows(&t, gg, heads as usize, kv as usize, true)?;
        }
        if super::norm_stored_plus_one(arch, gg) {
            t = (t + 1.0)?;
        }
        params += t.elem_count() as u64;
        rows.push((gg.clone(), QTensor::quantize(&t, tensor_type(&t, out))?));
    }

    // Metadata, in the converter's order.
    let family = match arch {
        "gemma2" | "gemma3" | "phi3" => Some(family_metadata(path, arch, d, c, out)?),
        _ => None,
    };
    let mut m: Vec<(String, G)> = Vec::new();
    let mut put = |k: &str, v: G| m.push((k.to_string(), v));
    let a = |k: &str| format!("{arch}.{k}");
    put("general.architecture", G::String(arch.into()));
    if let Some((Some((k, v)), _)) = &family {
        put(k, v.clone());
    }
    put("general.type", G::String("model".into()));
    put("general.name", G::String(src.name.into()));
    put("general.size_label", G::String(size_label(params)));
    let eps = G::F32(c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32);
    if let Some((_, keys)) = family {
        for (k, v) in keys {
            put(&k, v);
        }
    } else {
        put(&a("block_count"), G::U32(layers));
        put(&a("context_length"), G::U32(int("max_position_embeddings")));
        put(&a("embedding_length"), G::U32(hidden));
        put(&a("feed_forward_length"), G::U32(int("intermediate_size")));
        put(&a("attention.head_count"), G::U32(heads));
        put(&a("attention.head_count_kv"), G::U32(kv));
        put(&a("rope.freq_base"), G::F32(theta as f32));
        put(&a("attention.layer_norm_rms_epsilon"), eps);
        // the converter writes them when config.json names a head dim
        if c["head_dim"].as_u64().is_some() {
            put(&a("attention.key_length"), G::U32(head_dim));
            put(&a("attention.value_length"), G::U32(head_dim));
        }
        put("general.file_type", G::U32(out.file_type()));
        if arch == "llama" {
            put(&a("vocab_size"), G::U32(int("vocab_size")));
            put(&a("rope.dimension_count"), G::U32(head_dim));
        }
    }
    put("general.quantization_version", G::U32(2));
    for (k, v) in tokenizer_metadata(path, arch, src, int("vocab_size") as usize)? {
        put(&k, v);
    }
    if arch == "gemma3" && src.tokenizer_model.is_none() && src.gguf_tokenizer.is_none() {
        // the converter keeps as many embedding rows as tokenizer.json has tokens
        let vocab = src.tokenizer["model"]["vocab"]
            .as_object()
            .map_or(0, |v| v.len());
        let added = src.tokenizer["added_tokens"]
            .as_array()
            .map_or(0, |a| a.len());
        truncate_rows(&mut rows, "token_embd.weight", vocab + added)?;
    }
    if out.is_k_quant() {
        // llama.cpp's LLM_TYPE_70B, whose attn_v takes Q5_K rather than Q4_K
        let is_70b = layers == 80 && (arch == "qwen2" || (arch == "llama" && heads != kv));
        rows = llama_quantize(rows, layers as usize, out, is_70b)?;
        // llama-quantize sets these two again after copying the converter's keys, which moves
        // them last.
        for key in ["general.quantization_version", "general.file_type"] {
            let i = m.iter().position(|(k, _)| k == key).expect("written above");
            let kv = m.remove(i);
            m.push(kv);
        }
    }

    let mut notes = Vec::new();
    if let (Some(w), "llama") = (src.hyper.sliding_window, arch) {
        if w < src.hyper.max_positions {
            notes.push(format!(
                "sliding_window {w}: llama.cpp's `llama` architecture has no sliding window (its \
                 converter drops the key, as here), so the GGUF attends to every earlier token \
                 and differs from the model past {w} tokens"
            ));
        }
    }
    write_file(path, &m, &rows)?;
    Ok(notes)
}

/// Keeps the first `n` rows of tensor `name` of `rows` (dequantized, then in its type again).
fn truncate_rows(rows: &mut [(String, QTensor)], name: &str, n: usize) -> Result<()> {
    if let Some((_, q)) = rows.iter_mut().find(|(k, _)| k == name) {
        let t = q.dequantize(&candle_core::Device::Cpu)?;
        if n > 0 && n < t.dims()[0] {
            *q = QTensor::quantize(&t.narrow(0, 0, n)?, q.dtype())?;
        }
    }
    Ok(())
}

/// Gemma 2 / 3's and Phi-3's `{arch}.*` keys and `general.file_type`, in their converters'
/// order (`Gemma2Model` / `Gemma3Model` / `Phi3MiniModel.set_gguf_parameters`), with apart the
/// key the converter writes right after `general.architecture` (Phi-3's LongRoPE attention
/// factor, which it adds while it makes the factor tensors), after refusing
/// what llama.cpp would read otherwise than transformers computes it: a query scale that is not
/// llama.cpp's rule, sliding layers off its pattern, Gemma 2's rope theta (its converter writes
/// none, llama.cpp takes 10000), a rope scaling the converter does not write.
fn family_metadata(
    path: &Path,
    arch: &str,
    d: &Hyper,
    c: &Value,
    out: OutType,
) -> Result<FamilyKeys> {
    let a = |k: &str| format!("{arch}.{k}");
    let u = |n: usize| G::U32(n as u32);
    let f = |x: f64| G::F32(x as f32);
    let mut m: Vec<(String, G)> = Vec::new();
    let mut first = None;
    let mut refusals: Vec<Refusal> = Vec::new();
    let mut no = |key: &str, value: String, msg: &str| {
        refusals.push(Refusal {
            key: key.into(),
            value: Some(value),
            msg: msg.into(),
        })
    };
    let layers = d.layers;
    let eps = f(d.rms_norm_eps);
    let (hidden, heads, kv) = (d.hidden, d.heads, d.kv_heads);
    if super::is_gemma(arch) {
        let want = super::gemma_query_scalar(arch, layers, hidden / heads, d.head_dim);
        let q = d.query_pre_attn_scalar.unwrap_or(d.head_dim as f64);
        if q != want as f64 {
            no(
                "query_pre_attn_scalar",
                q.to_string(),
                &format!("llama.cpp scales a {layers}-layer {arch}'s queries by 1/sqrt({want})"),
            );
        }
        let every = super::gemma_pattern(arch);
        let full: Vec<usize> = (0..layers).filter(|i| i % every == every - 1).collect();
        if d.full_attention_layers != full {
            no(
                "layer_types",
                format!("full attention at {:?}", d.full_attention_layers),
                &format!("llama.cpp makes every {every}th layer global ({full:?})"),
            );
        }
    }
    let scaling = |no: &mut dyn FnMut(&str, String, &str)| {
        if d.rope != HyperRope::None {
            let r = &d.rope;
            no(
                "rope_scaling",
                format!("{r:?}"),
                "a rope scaling llama.cpp's converter does not write for this architecture",
            );
        }
    };
    match arch {
        "gemma2" => {
            if d.rope_theta != 10000.0 {
                no(
                    "rope_theta",
                    d.rope_theta.to_string(),
                    "llama.cpp's Gemma 2 converter writes no rope base; llama.cpp takes 10000",
                );
            }
            scaling(&mut no);
            m.extend([
                (a("context_length"), u(d.max_positions)),
                (a("embedding_length"), u(hidden)),
                (a("block_count"), u(layers)),
                (a("feed_forward_length"), u(d.intermediate)),
                (a("attention.head_count"), u(heads)),
                (a("attention.head_count_kv"), u(kv)),
                (a("attention.layer_norm_rms_epsilon"), eps),
                (a("attention.key_length"), u(d.head_dim)),
                (a("attention.value_length"), u(d.head_dim)),
                ("general.file_type".into(), G::U32(out.file_type())),
            ]);
            for (k, v) in [
                ("attn_logit_softcapping", d.attn_logit_softcapping),
                ("final_logit_softcapping", d.final_logit_softcapping),
            ] {
                match v {
                    Some(x) => m.push((a(k), f(x))),
                    None => no(k, "null".into(), "llama.cpp's Gemma 2 converter needs it"),
                }
            }
            m.push((
                a("attention.sliding_window"),
                u(d.sliding_window.unwrap_or(4096)),
            ));
        }
        "gemma3" => {
            if let Some(x) = d.attn_logit_softcapping {
                no(
                    "attn_logit_softcapping",
                    x.to_string(),
                    "llama.cpp's Gemma 3 has no attention soft-capping",
                );
            }
            m.extend([
                (a("block_count"), u(layers)),
                (a("context_length"), u(d.max_positions)),
                (a("embedding_length"), u(hidden)),
                (a("feed_forward_length"), u(d.intermediate)),
                (a("attention.head_count"), u(heads)),
                (a("attention.head_count_kv"), u(kv)),
            ]);
            match &d.rope {
                HyperRope::None => {}
                HyperRope::Linear(factor) => m.extend([
                    (a("rope.scaling.type"), G::String("linear".into())),
                    (a("rope.scaling.factor"), f(*factor)),
                ]),
                _ => scaling(&mut no),
            }
            m.push((a("rope.freq_base"), f(d.rope_theta)));
            m.push((
                a("rope.freq_base_swa"),
                f(d.rope_local_base_freq.unwrap_or(10000.0)),
            ));
            m.extend([
                (a("attention.layer_norm_rms_epsilon"), eps),
                (a("attention.key_length"), u(d.head_dim)),
                (a("attention.value_length"), u(d.head_dim)),
                ("general.file_type".into(), G::U32(out.file_type())),
            ]);
            if let Some(x) = d.final_logit_softcapping {
                m.push((a("final_logit_softcapping"), f(x)));
            }
            m.push((
                a("attention.sliding_window"),
                u(d.sliding_window.unwrap_or(4096)),
            ));
        }
        _ => {
            // phi3
            let original = c["original_max_position_embeddings"]
                .as_u64()
                .or_else(|| c["rope_parameters"]["original_max_position_embeddings"].as_u64())
                .unwrap_or(4096) as usize;
            if let HyperRope::LongRope { .. } = &d.rope {
                let scale = d.max_positions as f64 / original as f64;
                let attn = if scale > 1.0 {
                    (1.0 + scale.ln() / (original as f64).ln()).sqrt()
                } else {
                    1.0
                };
                first = Some((a("rope.scaling.attn_factor"), f(attn)));
            } else {
                scaling(&mut no);
            }
            m.extend([
                (a("context_length"), u(d.max_positions)),
                (a("rope.scaling.original_context_length"), u(original)),
                (a("embedding_length"), u(hidden)),
                (a("feed_forward_length"), u(d.intermediate)),
                (a("block_count"), u(layers)),
                (a("attention.head_count"), u(heads)),
                (a("attention.head_count_kv"), u(kv)),
                (a("attention.layer_norm_rms_epsilon"), eps),
                (a("rope.dimension_count"), u(d.rotary_dim)),
                (a("rope.freq_base"), f(d.rope_theta)),
                ("general.file_type".into(), G::U32(out.file_type())),
                (
                    a("attention.sliding_window"),
                    u(d.sliding_window.unwrap_or(0)),
                ),
            ]);
        }
    }
    if !refusals.is_empty() {
        return Err(ModelError::GgufRefused {
            path: path.to_path_buf(),
            refusals,
        });
    }
    Ok((first, m))
}

/// [`family_metadata`]'s keys: the one written right after `general.architecture`, if any, and
/// the rest.
type FamilyKeys = (Option<(String, G)>, Vec<(String, G)>);

/// `rows` (f32 matrices, as the converter writes them for an f32 export) as llama-quantize
/// writes them for the k-quant mix `out` without an importance matrix: in its tensor order (the
/// tensors outside the layers first, then each layer's, by name within each) with
/// [`k_quant_type`]'s types and llama.cpp's quantizers ([`super::quants`]).
fn llama_quantize(
    rows: Vec<(String, QTensor)>,
    layers: usize,
    out: OutType,
    is_70b: bool,
) -> Result<Vec<(String, QTensor)>> {
    let layer_of = |n: &str| -> i64 {
        n.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse().ok())
            .unwrap_or(-1)
    };
    let mut rows = rows;
    rows.sort_by(|(a, _), (b, _)| (layer_of(a), a).cmp(&(layer_of(b), b)));
    let mut st = KQuantState {
        out,
        is_70b,
        n_attention_wv: rows.iter().filter(|(n, _)| is_attn_v(n)).count(),
        i_attention_wv: 0,
        n_layer: layers,
        i_ffn_down: 0,
        tied: !rows.iter().any(|(n, _)| n == "output.weight"),
    };
    let mut out = Vec::with_capacity(rows.len());
    for (name, q) in rows {
        let dims = q.shape().dims().to_vec();
        let format = k_quant_type(&name, &dims, &mut st);
        if format == q.dtype() {
            out.push((name, q));
            continue;
        }
        let t = q.dequantize(&candle_core::Device::Cpu)?;
        let x = t.flatten_all()?.to_vec1::<f32>()?;
        let bytes = match format {
            GgmlDType::Q3K => super::quants::q3_k(&x),
            GgmlDType::Q4_0 => super::quants::q4_0(&x),
            GgmlDType::Q4K => super::quants::q4_k(&x),
            GgmlDType::Q5K => super::quants::q5_k(&x),
            GgmlDType::Q6K => super::quants::q6_k(&x),
            GgmlDType::Q5_0 => super::quants::q5_0(&x),
            GgmlDType::Q5_1 => super::quants::q5_1(&x),
            GgmlDType::Q8_0 => super::quants::q8_0(&x),
            _ => {
                out.push((name, QTensor::quantize(&t, format)?));
                continue;
            }
        };
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(bytes),
            &candle_core::Device::Cpu,
            format,
        )?;
        out.push((name, QTensor::new(storage, dims)?));
    }
    Ok(out)
}

/// llama-quantize's "attention-v-like" tensors (`category_is_attn_v`): `attn_v`, and Phi-3's
/// fused `attn_qkv`, which its later `ATTENTION_QKV` branch (Q5_K) never reaches.
fn is_attn_v(name: &str) -> bool {
    name.contains("attn_v.weight") || name.contains("attn_qkv.weight")
}

/// What [`k_quant_type`] counts as it goes through the tensors in llama-quantize's order.
struct KQuantState {
    out: OutType,
    /// llama.cpp's `LLM_TYPE_70B` (an 80-layer Llama with grouped-query heads, an 80-layer Qwen2).
    is_70b: bool,
    n_attention_wv: usize,
    i_attention_wv: usize,
    n_layer: usize,
    i_ffn_down: usize,
    /// No `output.weight`: the embedding is the head and takes the head's type.
    tied: bool,
}

/// The type llama-quantize gives tensor `name` (dims row-major, so the last is its row length)
/// in a `Q3_K_S` / `_M` / `_L`, `Q4_K_M` / `_S`, `Q5_K_M` / `_S` or `Q6_K` file (`st.out`) of a dense llama / qwen2 / qwen3 / gemma2 /
/// gemma3 / phi3 model, without an importance matrix (`llama_tensor_get_type` in llama.cpp's
/// src/llama-quant.cpp, the branches these architectures reach; the counters advance in the
/// order the tensors are met).
fn k_quant_type(name: &str, dims: &[usize], st: &mut KQuantState) -> GgmlDType {
    // Not quantized: vectors, norms, and anything that is not a weight.
    if dims.len() < 2 || !name.ends_with("weight") || name.contains("_norm.weight") {
        return GgmlDType::F32;
    }
    let ncols = dims[dims.len() - 1];
    let use_more_bits = |i: usize, n: usize| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
    let mut t = match st.out {
        OutType::Q3KS | OutType::Q3KM | OutType::Q3KL => GgmlDType::Q3K,
        OutType::Q5KM | OutType::Q5KS => GgmlDType::Q5K,
        OutType::Q6K => GgmlDType::Q6K,
        _ => GgmlDType::Q4K,
    };
    let more_bits = matches!(st.out, OutType::Q4KM | OutType::Q5KM);
    if name == "output.weight" || (st.tied && name == "token_embd.weight") {
        t = if !ncols.is_multiple_of(256) {
            GgmlDType::Q8_0
        } else {
            GgmlDType::Q6K
        };
    } else if is_attn_v(name) {
        let i = st.i_attention_wv;
        match st.out {
            OutType::Q3KM => {
                t = if i < 2 {
                    GgmlDType::Q5K
                } else {
                    GgmlDType::Q4K
                }
            }
            OutType::Q3KL => t = GgmlDType::Q5K,
            _ if more_bits && use_more_bits(i, st.n_attention_wv) => t = GgmlDType::Q6K,
            OutType::Q4KS if i < 4 => t = GgmlDType::Q5K,
            _ => {}
        }
        if st.is_70b && matches!(t, GgmlDType::Q3K | GgmlDType::Q4K) {
            t = GgmlDType::Q5K;
        }
        st.i_attention_wv += 1;
    } else if name.contains("ffn_down") {
        let i = st.i_ffn_down;
        match st.out {
            OutType::Q3KM if i < st.n_layer / 16 => t = GgmlDType::Q5K,
            OutType::Q3KM => t = GgmlDType::Q4K,
            OutType::Q3KL => t = GgmlDType::Q5K,
            _ if more_bits && use_more_bits(i, st.n_layer) => t = GgmlDType::Q6K,
            OutType::Q4KS if i < st.n_layer / 8 => t = GgmlDType::Q5K,
            _ => {}
        }
        st.i_ffn_down += 1;
    } else if name.contains("attn_output.weight") {
        match st.out {
            OutType::Q3KM => t = GgmlDType::Q4K,
            OutType::Q3KL => t = GgmlDType::Q5K,
            _ => {}
        }
    }
    // Rows that are not whole blocks of the type: the smaller-block fallback, else f16.
    if !ncols.is_multiple_of(t.block_size()) {
        t = match t {
            GgmlDType::Q3K => GgmlDType::Q4_0,
            GgmlDType::Q4K => GgmlDType::Q5_0,
            GgmlDType::Q5K => GgmlDType::Q5_1,
            GgmlDType::Q6K => GgmlDType::Q8_0,
            other => other,
        };
        if !ncols.is_multiple_of(t.block_size()) {
            t = GgmlDType::F16;
        }
    }
    t
}

/// The type a tensor is written in: vectors (norms, biases) stay f32, matrices take `out`, and a
/// matrix whose rows are not whole Q8_0 blocks is written f16, as llama.cpp's converter does.
fn tensor_type(t: &Tensor, out: OutType) -> GgmlDType {
    match (t.rank(), out) {
        (1, _) | (_, OutType::F32) => GgmlDType::F32,
        (_, OutType::F16) => GgmlDType::F16,
        (_, OutType::BF16) => GgmlDType::BF16,
        (_, OutType::Q8_0) if !t.dims()[t.rank() - 1].is_multiple_of(32) => GgmlDType::F16,
        (_, OutType::Q8_0) => GgmlDType::Q8_0,
        // f32 first, then llama-quantize's types ([`llama_quantize`])
        _ => GgmlDType::F32,
    }
}

/// Where an HF tensor goes in the file: the head, the embedding, then each layer in the order of
/// its HF names, then the final norm (as the converter meets them in a safetensors file, which
/// lists its tensors by name).
fn hf_order(name: &str) -> (usize, usize, String) {
    match name {
        "lm_head.weight" => return (0, 0, String::new()),
        "model.embed_tokens.weight" => return (0, 1, String::new()),
        _ => {}
    }
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let (i, tail) = rest.split_once('.').unwrap_or((rest, ""));
        return (1, i.parse().unwrap_or(0), tail.to_string());
    }
    (2, 0, name.to_string())
}

fn rope_theta(c: &Value) -> f64 {
    c["rope_theta"]
        .as_f64()
        .or_else(|| c["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10000.0)
}

/// `rope_freqs.weight` for a `llama3` rope scaling (`super::config::llama3_factors`).
fn llama3_rope_freqs(c: &Value, theta: f64, head_dim: u32) -> Option<Tensor> {
    let r = if c["rope_scaling"].is_object() {
        &c["rope_scaling"]
    } else {
        &c["rope_parameters"]
    };
    let kind = r["rope_type"].as_str().or_else(|| r["type"].as_str())?;
    if kind != "llama3" {
        return None;
    }
    let f = |k: &str, d: f64| r[k].as_f64().unwrap_or(d);
    let factors = super::config::llama3_factors(
        theta,
        head_dim as usize,
        f("factor", 8.0),
        f("low_freq_factor", 1.0),
        f("high_freq_factor", 4.0),
        f("original_max_position_embeddings", 8192.0),
    );
    Tensor::new(factors, &candle_core::Device::Cpu).ok()
}

/// gguf-py's `model_weight_count_rounded_notation`: "107K", "494M", "7.6B".
fn size_label(n: u64) -> String {
    let n = n as f64;
    let (scaled, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    let digits = format!("{}", scaled.round() as u64)
        .trim_start_matches('0')
        .len();
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

/// The `tokenizer.*` keys of the export: from `tokenizer.model` when the model has one (as the
/// converter reads it first), else those of the GGUF file the model was read from when that
/// holds a SentencePiece vocabulary (whose scores tokenizer.json does not keep), else from
/// tokenizer.json (byte-level BPE, which gives a GGUF file's keys back as they were).
fn tokenizer_metadata(
    path: &Path,
    arch: &str,
    src: &Source,
    vocab_size: usize,
) -> Result<Vec<(String, G)>> {
    if let Some(model) = src.tokenizer_model {
        return sentencepiece_metadata(path, arch, src, model, vocab_size);
    }
    if let Some(keys) = src.gguf_tokenizer {
        let spm = keys
            .iter()
            .any(|(k, v)| k == "tokenizer.ggml.model" && matches!(v, G::String(m) if m == "llama"));
        if spm {
            return Ok(keys.to_vec());
        }
    }
    if src.tokenizer.is_null() {
        return Err(refuse(
            path,
            "tokenizer.json",
            None,
            "the model has no tokenizer.json or tokenizer.model to write into the GGUF",
        ));
    }
    bpe_metadata(path, src, vocab_size)
}

/// llama.cpp's `tokenizer.ggml.*` for a SentencePiece model, as the converter writes them
/// ([`spm`]; Phi-3's build for `phi3`), then gguf-py's `SpecialVocab` keys, and for Llama a
/// leading `add_space_prefix` when tokenizer_config.json sets `add_prefix_space`, for Gemma a
/// trailing `add_space_prefix` false.
fn sentencepiece_metadata(
    path: &Path,
    arch: &str,
    src: &Source,
    model: &[u8],
    vocab_size: usize,
) -> Result<Vec<(String, G)>> {
    let pieces = spm::pieces(model).ok_or_else(|| {
        refuse(
            path,
            "tokenizer.model",
            None,
            "not a SentencePiece model (its protobuf does not parse)",
        )
    })?;
    let build = match arch {
        "phi3" => spm::Build::Phi3,
        _ => spm::Build::Base,
    };
    let (tokens, scores, types) = spm::vocabulary(
        &pieces,
        vocab_size,
        src.added_tokens,
        src.tokenizer_config,
        src.tokenizer,
        build,
        &looks_special,
    );
    let mut out: Vec<(String, G)> = Vec::new();
    if arch == "llama" {
        if let Some(on) = src.tokenizer_config["add_prefix_space"].as_bool() {
            out.push(("tokenizer.ggml.add_space_prefix".into(), G::Bool(on)));
        }
    }
    out.extend([
        ("tokenizer.ggml.model".into(), G::String("llama".into())),
        ("tokenizer.ggml.pre".into(), G::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            G::Array(tokens.into_iter().map(G::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            G::Array(scores.into_iter().map(G::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            G::Array(types.into_iter().map(G::I32).collect()),
        ),
    ]);
    let added: Vec<&Value> = src.tokenizer["added_tokens"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    out.extend(special_vocab(src, &added, vocab_size));
    if super::is_gemma(arch) {
        out.push(("tokenizer.ggml.add_space_prefix".into(), G::Bool(false)));
    }
    Ok(out)
}

/// gguf-py's `SpecialVocab.add_to_gguf` after the merges: special token ids, add-flags, the
/// chat template.
fn special_vocab(src: &Source, added: &[&Value], vocab_size: usize) -> Vec<(String, G)> {
    let mut out = Vec::new();
    let (ids, adds) = special_tokens(src, added, vocab_size);
    for (typ, id) in ids {
        let key = match typ {
            "unk" => "unknown",
            "sep" => "seperator",
            "pad" => "padding",
            t => t,
        };
        out.push((format!("tokenizer.ggml.{key}_token_id"), G::U32(id)));
    }
    for (typ, on) in adds {
        out.push((format!("tokenizer.ggml.add_{typ}_token"), G::Bool(on)));
    }
    let template = src.tokenizer_config["chat_template"]
        .as_str()
        .or(src.chat_template);
    if let Some(t) = template {
        out.push(("tokenizer.chat_template".into(), G::String(t.into())));
    }
    out
}

/// llama.cpp's `tokenizer.ggml.*` and `tokenizer.chat_template` for a byte-level BPE
/// tokenizer, as the converter's `get_vocab_base` and gguf-py's `SpecialVocab` write them.
fn bpe_metadata(path: &Path, src: &Source, vocab_size: usize) -> Result<Vec<(String, G)>> {
    let tj = src.tokenizer;
    let model = &tj["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(refuse(
            path,
            "tokenizer.json model.type",
            model["type"].as_str().map(|s| format!("{s:?}")),
            "GGUF export writes byte-level BPE tokenizers so far",
        ));
    }
    let pre = pre_name(&tj["pre_tokenizer"]).ok_or_else(|| {
        refuse(
            path,
            "tokenizer.json pre_tokenizer",
            None,
            "a pre-tokenizer llama.cpp does not name (its `tokenizer.ggml.pre`): llama.cpp would \
             split the text differently",
        )
    })?;
    let vocab = model["vocab"].as_object().cloned().unwrap_or_default();
    let added: Vec<&Value> = tj["added_tokens"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let mut by_id: Vec<Option<String>> = vec![None; vocab_size];
    for (t, id) in &vocab {
        if let Some(slot) = id.as_u64().and_then(|i| by_id.get_mut(i as usize)) {
            *slot = Some(t.clone());
        }
    }
    let added_by_id: HashMap<u64, &Value> = added
        .iter()
        .filter_map(|a| Some((a["id"].as_u64()?, *a)))
        .collect();
    let (mut tokens, mut types) = (Vec::new(), Vec::new());
    for (i, t) in by_id.iter().enumerate() {
        // NORMAL 1, CONTROL 3, USER_DEFINED 4, UNUSED 5
        let (token, ty) = match (added_by_id.get(&(i as u64)), t) {
            (Some(a), _) => {
                let content = a["content"].as_str().unwrap_or("").to_string();
                if a["special"].as_bool() == Some(true) || looks_special(&content) {
                    (content, 3)
                } else {
                    (content.replace('\u{2581}', " "), 4)
                }
            }
            (None, Some(t)) => (t.clone(), 1),
            (None, None) => (format!("[PAD{i}]"), 5),
        };
        tokens.push(G::String(token));
        types.push(G::I32(ty));
    }
    let merges: Vec<G> = model["merges"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|x| match x {
                    Value::String(s) => G::String(s.clone()),
                    Value::Array(p) => G::String(
                        p.iter()
                            .map(|s| s.as_str().unwrap_or("").replace(' ', "\u{0120}"))
                            .collect::<Vec<_>>()
                            .join(" "),
                    ),
                    _ => G::String(String::new()),
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out: Vec<(String, G)> = vec![
        ("tokenizer.ggml.model".into(), G::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), G::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), G::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), G::Array(types)),
        ("tokenizer.ggml.merges".into(), G::Array(merges)),
    ];
    out.extend(special_vocab(src, &added, vocab_size));
    Ok(out)
}

/// The converter's `does_token_look_special`.
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// llama.cpp's name for a tokenizer.json pre-tokenizer: the split regex it uses (the
/// reverse of [`super::tokenizer`]'s table), or GPT-2's byte-level regex.
fn pre_name(p: &Value) -> Option<&'static str> {
    if p["type"] == "ByteLevel" && p["use_regex"] == true {
        return Some("gpt-2");
    }
    let parts = p["pretokenizers"].as_array()?;
    let re = parts
        .iter()
        .find(|x| x["type"] == "Split")
        .and_then(|x| x["pattern"]["Regex"].as_str())?;
    ["llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"]
        .into_iter()
        .find(|name| super::tokenizer::split_regex(name) == Some(re))
}

type SpecialIds = Vec<(&'static str, u32)>;
type AddFlags = Vec<(&'static str, bool)>;

/// Special token ids and add-flags as gguf-py's `SpecialVocab` reads them: the post-processor
/// (BOS / EOS around a TemplateProcessing single sequence, a separator in its pair template;
/// none for ByteLevel), then tokenizer_config.json (`add_*_token`, `*_token` by added-token
/// content), then config.json's `*_token_id`.
fn special_tokens(src: &Source, added: &[&Value], vocab_size: usize) -> (SpecialIds, AddFlags) {
    const TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
    let tc = src.tokenizer_config;
    let token_str = |typ: &str| -> Option<String> {
        match &tc[format!("{typ}_token")] {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content")?.as_str().map(String::from),
            _ => None,
        }
    };
    let (bos, eos) = (token_str("bos"), token_str("eos"));
    let mut add: Vec<(&'static str, bool)> = Vec::new();
    let set_add =
        |add: &mut Vec<(&'static str, bool)>, typ: &'static str, on: bool, force| match add
            .iter_mut()
            .find(|(t, _)| *t == typ)
        {
            Some(e) if force => e.1 = on,
            Some(_) => {}
            None => add.push((typ, on)),
        };
    let pp = &src.tokenizer["post_processor"];
    let processors: Vec<&Value> = match pp["processors"].as_array() {
        Some(a) => a.iter().collect(),
        None if pp.is_object() => vec![pp],
        None => vec![],
    };
    for p in processors {
        match p["type"].as_str() {
            Some("ByteLevel") => {
                set_add(&mut add, "bos", false, false);
                set_add(&mut add, "eos", false, false);
            }
            Some("TemplateProcessing") => {
                let single = p["single"].as_array().cloned().unwrap_or_default();
                let pair = p["pair"].as_array().cloned().unwrap_or_default();
                let special = |x: Option<&Value>| -> Option<String> {
                    x?.get("SpecialToken")?
                        .get("id")?
                        .as_str()
                        .map(String::from)
                };
                let (mut first, mut last) = (None, None);
                if single.len() > 1 {
                    first = special(single.first());
                    if let Some(f) = &first {
                        set_add(&mut add, "bos", Some(f) == bos.as_ref(), true);
                    }
                    last = special(single.last());
                    if let Some(l) = &last {
                        set_add(&mut add, "eos", Some(l) == eos.as_ref(), true);
                    }
                }
                let start = usize::from(first.is_some() && special(pair.first()) == first);
                let stop = if last.is_some() && special(pair.last()) == last {
                    pair.len().saturating_sub(1)
                } else {
                    pair.len()
                };
                let inner = pair.get(start..stop).unwrap_or(&[]);
                let seq = |x: Option<&Value>| {
                    x.and_then(|v| v.get("Sequence")?.get("id")?.as_str().map(String::from))
                };
                if inner.len() > 2
                    && seq(inner.first()).as_deref() == Some("A")
                    && seq(inner.last()).as_deref() == Some("B")
                {
                    let middle = &inner[1..inner.len() - 1];
                    let is_sep = |x: Option<&Value>| {
                        special(x).is_some_and(|s| {
                            Some(&s) == eos.as_ref() || Some(s) == token_str("sep")
                        })
                    };
                    let sep = (is_sep(middle.first()) && last.is_none())
                        || (middle.len() == 2 && is_sep(middle.get(1)));
                    set_add(&mut add, "sep", sep, true);
                }
            }
            _ => {}
        }
    }
    let mut ids: Vec<(&'static str, u32)> = Vec::new();
    for typ in TYPES {
        if let Some(on) = tc[format!("add_{typ}_token")].as_bool() {
            set_add(&mut add, typ, on, false);
        }
        let id = token_str(typ).and_then(|t| {
            added
                .iter()
                .find(|a| a["content"].as_str() == Some(&t))
                .and_then(|a| a["id"].as_u64())
        });
        if let Some(id) = id.filter(|&i| (i as usize) < vocab_size) {
            ids.push((typ, id as u32));
        }
    }
    for typ in TYPES {
        if ids.iter().any(|(t, _)| *t == typ) {
            continue;
        }
        let v = &src.config[format!("{typ}_token_id")];
        let id = v.as_u64().or_else(|| v.as_array()?.first()?.as_u64());
        if let Some(id) = id.filter(|&i| (i as usize) < vocab_size) {
            ids.push((typ, id as u32));
        }
    }
    (ids, add)
}

/// One LoRA pair of an adapter: the adapted weight's HF name (`model.layers.0.self_attn.q_proj.weight`),
/// A (r, in) and B (out, r).
pub struct LoraPair {
    pub weight: String,
    pub a: Tensor,
    pub b: Tensor,
}

/// Writes a LoRA adapter of a model with `config` as the GGUF adapter file llama.cpp's
/// `convert_lora_to_gguf.py` writes (`llama-cli --lora FILE`): `general.type` "adapter",
/// `adapter.type` "lora", `adapter.lora.alpha`, and per adapted weight `{name}.lora_a` (A) and
/// `{name}.lora_b` (B; Llama's q / k rows in llama.cpp's rotary order), atomically. llama.cpp
/// scales each pair by alpha / rank: the caller passes the alpha that gives the adapter's scale.
pub fn write_gguf_lora(
    path: &Path,
    pairs: &[LoraPair],
    alpha: f32,
    config: &Value,
    name: &str,
    out: OutType,
) -> Result<()> {
    let arch = gguf_arch(path, config)?;
    let c = config;
    let int = |k: &str| c[k].as_u64().unwrap_or(0) as usize;
    let heads = int("num_attention_heads");
    let kv = c["num_key_value_heads"]
        .as_u64()
        .map_or(heads, |n| n as usize);
    let names: HashMap<String, String> = super::tensor_names(arch, int("num_hidden_layers"))
        .into_iter()
        .collect();
    let mut rows: Vec<(String, QTensor)> = Vec::new();
    let mut sorted: Vec<&LoraPair> = pairs.iter().collect();
    sorted.sort_by_key(|p| hf_order(&p.weight));
    for p in sorted {
        let Some(gg) = names.get(&p.weight) else {
            return Err(refuse(
                path,
                &p.weight,
                None,
                "an adapted weight llama.cpp's LoRA layout has no name for",
            ));
        };
        let a = p.a.to_dtype(DType::F32)?;
        let mut b = p.b.to_dtype(DType::F32)?;
        if arch == "llama" {
            // B's rows are the adapted weight's rows
            b = super::rotary_rows(&b, gg, heads, kv, true)?;
        }
        rows.push((
            format!("{gg}.lora_a"),
            QTensor::quantize(&a, tensor_type(&a, out))?,
        ));
        rows.push((
            format!("{gg}.lora_b"),
            QTensor::quantize(&b, tensor_type(&b, out))?,
        ));
    }
    let mut m: Vec<(String, G)> = vec![
        ("general.architecture".into(), G::String(arch.into())),
        ("general.type".into(), G::String("adapter".into())),
        ("adapter.type".into(), G::String("lora".into())),
        ("general.name".into(), G::String(name.into())),
        ("adapter.lora.alpha".into(), G::F32(alpha)),
    ];
    // (the converter writes no `general.file_type` into an adapter, whatever its type)
    m.push(("general.quantization_version".into(), G::U32(2)));
    write_file(path, &m, &rows)
}

/// `metadata` and `tensors` as a GGUF file at `path`: a temporary name, synced, renamed.
fn write_file(path: &Path, metadata: &[(String, G)], tensors: &[(String, QTensor)]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        candle_core::quantized::gguf_file::write(
            &mut f,
            &metadata
                .iter()
                .map(|(k, v)| (k.as_str(), v))
                .collect::<Vec<_>>(),
            &tensors
                .iter()
                .map(|(k, v)| (k.as_str(), v))
                .collect::<Vec<_>>(),
        )?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama-quantize's types for the `attn_v` and `ffn_down` of an 80-layer Llama with
    /// grouped-query heads (llama.cpp's 70B type, whose `attn_v` takes Q5_K rather than Q4_K) of
    /// hidden 64, so that each k-quant falls back to its 32-value block: 8 = Q6_K as Q8_0, 1 =
    /// Q5_K as Q5_1, 0 = Q4_K as Q5_0. Read from llama-quantize's `Q4_K_M` and `Q4_K_S` files of
    /// such a model (tiny-llama's config at 80 layers, converted by llama.cpp's converter and
    /// quantized by the llama-quantize scripts/make_gguf_fixtures.py builds, 2026-11-28), whose
    /// every tensor `tallow export` matched byte for byte; too large a file to commit.
    #[test]
    fn k_quant_types_follow_llama_quantize_on_an_80_layer_llama() {
        let code = |t: GgmlDType| match t {
            GgmlDType::Q8_0 => '8',
            GgmlDType::Q5_1 => '1',
            GgmlDType::Q5_0 => '0',
            _ => '?',
        };
        let cases = [
            (
                OutType::Q4KM,
                "88888888881181181181181181181181181181181181181181181181181181181181188888888888",
                "88888888880080080080080080080080080080080080080080080080080080080080088888888888",
            ),
            (
                OutType::Q4KS,
                "11111111111111111111111111111111111111111111111111111111111111111111111111111111",
                "11111111110000000000000000000000000000000000000000000000000000000000000000000000",
            ),
        ];
        for (out, attn_v, ffn_down) in cases {
            let mut st = KQuantState {
                out,
                is_70b: true,
                n_attention_wv: 80,
                i_attention_wv: 0,
                n_layer: 80,
                i_ffn_down: 0,
                tied: false,
            };
            let (mut v, mut d) = (String::new(), String::new());
            for i in 0..80 {
                v.push(code(k_quant_type(
                    &format!("blk.{i}.attn_v.weight"),
                    &[32, 64],
                    &mut st,
                )));
                d.push(code(k_quant_type(
                    &format!("blk.{i}.ffn_down.weight"),
                    &[64, 128],
                    &mut st,
                )));
            }
            assert_eq!((v.as_str(), d.as_str()), (attn_v, ffn_down), "{out:?}");
        }
    }
}
