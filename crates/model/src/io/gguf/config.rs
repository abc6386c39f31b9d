//! A GGUF file's hyper-parameters as the `config.json` of the HF model it was converted from.
//!
//! The keys are llama.cpp's (`{arch}.embedding_length`, ...), renamed as transformers' GGUF loader
//! renames them (`GGUF_CONFIG_MAPPING` in transformers' `integrations/ggml.py`), with two
//! differences where that loader drops what the file says (docs/gguf.md):
//! - Qwen3's head dim is the file's `attention.key_length` (transformers' mapping leaves it
//!   out, so its config keeps Qwen3Config's default of 128);
//! - Llama 3.1 / 3.2's rope scaling, which llama.cpp stores as per-frequency factors in the
//!   tensor `rope_freqs.weight`, is read back as the `llama3` `rope_scaling` that produced them
//!   (transformers ignores the tensor and computes an unscaled rope).
//!
//! - Gemma 2 / 3's query scale is llama.cpp's rule (1 / sqrt(head_dim), and 1 / sqrt(hidden /
//!   heads) for the 27B models, as Google's configs have it), written as `query_pre_attn_scalar`
//!   (transformers' loader keeps Gemma's default 256, right for every size but the 27B); Gemma 2's
//!   soft-caps are the file's (the loader keeps the defaults 50 / 30, which Google's files carry);
//!   Gemma 3's sliding layers, local rope base and linear rope scaling are llama.cpp's reading of
//!   the file (the loader drops the scaling);
//! - Phi-3's partial rotary (`rope.dimension_count`, Phi-4-mini), LongRoPE (the tensors
//!   `rope_factors_long` / `rope_factors_short`, Phi-3-*-128k and 3.5) and sliding window
//!   (Phi-3-mini-4k's 2047, which llama.cpp disables) are read back (the loader drops all three).
//!
//! A key under `{arch}.` that changes the maths and that this reader does not map (a rope
//! scaling type, a sliding window, experts) is refused by name, all of them at once.

use serde_json::{json, Map, Value};

use super::{gemma_pattern, gemma_query_scalar, is_gemma, GgufFile};
use crate::error::{ModelError, Refusal, Result};

/// The architectures read, with their transformers class and `model_type`.
const ARCHS: [(&str, &str, &str); 6] = [
    ("llama", "LlamaForCausalLM", "llama"),
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("gemma2", "Gemma2ForCausalLM", "gemma2"),
    ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    ("phi3", "Phi3ForCausalLM", "phi3"),
];

/// `{arch}.` keys of one architecture only, and the config.json key each becomes (None: used
/// below, or ignored as both llama.cpp and transformers ignore it).
fn arch_keys(arch: &str) -> &'static [(&'static str, Option<&'static str>)] {
    match arch {
        "gemma2" => &[
            ("attn_logit_softcapping", Some("attn_logit_softcapping")),
            ("final_logit_softcapping", Some("final_logit_softcapping")),
            ("attention.sliding_window", None),
            ("attention.sliding_window_pattern", None),
        ],
        "gemma3" => &[
            ("final_logit_softcapping", Some("final_logit_softcapping")),
            ("rope.freq_base_swa", Some("rope_local_base_freq")),
            ("attention.sliding_window", None),
            ("attention.sliding_window_pattern", None),
            ("rope.scaling.type", None),
            ("rope.scaling.factor", None),
        ],
        "phi3" => &[
            (
                "rope.scaling.original_context_length",
                Some("original_max_position_embeddings"),
            ),
            ("rope.scaling.attn_factor", None),
            // Phi-3-mini-4k's 2047, which the original model applies; llama.cpp disables Phi-3's
            // window ("Phi SWA is currently disabled") and transformers' loader drops it. 0
            // (Phi-4-mini: none) is not written.
            ("attention.sliding_window", None),
        ],
        _ => &[],
    }
}

/// `{arch}.` keys and the config.json key each becomes (None: checked or used below).
const KEYS: [(&str, Option<&str>); 11] = [
    ("context_length", Some("max_position_embeddings")),
    ("embedding_length", Some("hidden_size")),
    ("block_count", Some("num_hidden_layers")),
    ("feed_forward_length", Some("intermediate_size")),
    ("attention.head_count", Some("num_attention_heads")),
    ("attention.head_count_kv", Some("num_key_value_heads")),
    ("attention.layer_norm_rms_epsilon", Some("rms_norm_eps")),
    ("rope.freq_base", Some("rope_theta")),
    ("vocab_size", Some("vocab_size")),
    ("rope.dimension_count", None),
    ("attention.key_length", None),
];

/// The HF `config.json` of `file`.
pub fn hf_config(file: &GgufFile) -> Result<Value> {
    let arch = file.arch()?.to_string();
    let Some(&(_, class, model_type)) = ARCHS.iter().find(|(a, _, _)| *a == arch) else {
        return Err(ModelError::UnsupportedArchitecture {
            path: file.path.clone(),
            found: format!("{arch} (GGUF `general.architecture`)"),
            supported: ARCHS.iter().map(|a| a.0).collect::<Vec<_>>().join(", ") + " as GGUF files",
        });
    };
    let prefix = format!("{arch}.");
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    if is_gemma(&arch) {
        c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    } else {
        c.insert("hidden_act".into(), json!("silu"));
    }
    let mut refusals = Vec::new();
    let mut keys: Vec<&String> = file.content.metadata.keys().collect();
    keys.sort();
    for key in keys {
        let Some(k) = key.strip_prefix(&prefix) else {
            continue;
        };
        let known = KEYS
            .iter()
            .chain(arch_keys(&arch))
            .find(|(name, _)| *name == k);
        match known {
            Some((_, Some(hf))) => {
                use candle_core::quantized::gguf_file::Value as G;
                let v = match file.get(key) {
                    Some(G::F32(_) | G::F64(_)) => json!(file.float(key)?),
                    _ => json!(file.int(key)?),
                };
                c.insert((*hf).into(), v);
            }
            Some((_, None)) => {}
            // value_length is the same as key_length in every dense family read here
            None if k == "attention.value_length" => {}
            // llama.cpp writes `none` for a model without rope scaling
            None if k == "rope.scaling.type" && file.string(key)? == Some("none") => {}
            None => refusals.push(Refusal {
                key: key.clone(),
                value: Some(describe(file, key)),
                msg: "a GGUF key tallow does not map to the model yet".into(),
            }),
        }
    }
    let int = |name: &str| -> Result<usize> {
        c.get(name)
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| ModelError::Config {
                path: file.path.clone(),
                key: format!(
                    "{prefix}{}",
                    KEYS.iter()
                        .find(|k| k.1 == Some(name))
                        .map_or(name, |k| k.0)
                ),
                msg: "missing from the file's metadata".into(),
            })
    };
    let (hidden, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    int("num_hidden_layers")?;
    int("intermediate_size")?;
    if !c.contains_key("num_key_value_heads") {
        c.insert("num_key_value_heads".into(), json!(heads));
    }
    let head_dim = match file.int(&format!("{prefix}attention.key_length"))? {
        Some(d) => d as usize,
        None => hidden / heads,
    };
    if let Some(rot) = file.int(&format!("{prefix}rope.dimension_count"))? {
        if rot as usize != head_dim && arch == "phi3" {
            c.insert(
                "partial_rotary_factor".into(),
                json!(rot as f64 / head_dim as f64),
            );
        } else if rot as usize != head_dim {
            refusals.push(Refusal {
                key: format!("{prefix}rope.dimension_count"),
                value: Some(rot.to_string()),
                msg: format!("partial rotary (head dim {head_dim}) is read from Phi-3 files only"),
            });
        }
    }
    if head_dim != hidden / heads || !matches!(arch.as_str(), "qwen2" | "phi3") {
        c.insert("head_dim".into(), json!(head_dim));
    }
    if is_gemma(&arch) {
        gemma(file, &arch, &mut c, hidden / heads, head_dim, &mut refusals)?;
    }
    if arch == "phi3" {
        if let Some(w) = file
            .int("phi3.attention.sliding_window")?
            .filter(|&w| w > 0)
        {
            c.insert("sliding_window".into(), json!(w));
        }
    }
    if !c.contains_key("vocab_size") {
        let n = match file.strings("tokenizer.ggml.tokens")? {
            Some(t) => t.len(),
            None => file.shape("token_embd.weight").map_or(0, |s| s[0]),
        };
        c.insert("vocab_size".into(), json!(n));
    }
    let bias = file.has_tensor("blk.0.attn_q.bias");
    match arch.as_str() {
        "llama" => {
            c.insert("attention_bias".into(), json!(bias));
            c.insert("mlp_bias".into(), json!(false));
        }
        "qwen3" | "gemma2" | "gemma3" => {
            c.insert("attention_bias".into(), json!(bias));
        }
        "qwen2" => {
            c.insert("use_sliding_window".into(), json!(false));
        }
        _ => {}
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(!file.has_tensor("output.weight")),
    );
    for (gg, hf) in [
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ] {
        if let Some(id) = file.int(gg)? {
            c.insert(hf.into(), json!(id));
        }
    }
    if file.has_tensor("rope_freqs.weight") {
        let factors: Vec<f32> = file.read_f32("rope_freqs.weight")?.to_vec1()?;
        let theta = c
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        let context = c
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .unwrap_or(8192);
        match llama3_scaling(&factors, theta, head_dim, context as f64) {
            Some(s) if arch == "llama" => {
                c.insert("rope_scaling".into(), s);
            }
            _ => refusals.push(Refusal {
                key: "rope_freqs.weight".into(),
                value: None,
                msg: "per-frequency rope factors that are not Llama 3's `llama3` scaling".into(),
            }),
        }
    }
    if file.has_tensor("rope_factors_long.weight") || file.has_tensor("rope_factors_short.weight") {
        match longrope(file, &c)? {
            Some(s) if arch == "phi3" => {
                c.insert("rope_scaling".into(), s);
            }
            _ => refusals.push(Refusal {
                key: "rope_factors_long.weight".into(),
                value: None,
                msg: "LongRoPE factors read from Phi-3 files only, with both tensors and \
                      `rope.scaling.attn_factor` as Phi-3's LongRoPE computes it"
                    .into(),
            }),
        }
    }
    if !refusals.is_empty() {
        return Err(ModelError::GgufRefused {
            path: file.path.clone(),
            refusals,
        });
    }
    Ok(Value::Object(c))
}

/// Gemma 2 / 3's keys as llama.cpp reads them (`llama_model_gemma{2,3}::load_arch_hparams`):
/// - the query scale: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models (Gemma
///   2: 46 layers, Gemma 3: 62), as `query_pre_attn_scalar`;
/// - which layers slide: with a window (`attention.sliding_window`; Gemma 2 without one: 4096),
///   `attention.sliding_window_pattern` as a count (layer i slides when i % n < n - 1) or one
///   bool per layer, by default every 2nd (Gemma 2) or 6th (Gemma 3) layer global; a Gemma 3
///   file without a window has no sliding layers;
/// - Gemma 3's local rope base (default 10000) and its linear rope scaling, which llama.cpp
///   applies to the global layers only (as transformers' Gemma 3 applies `rope_scaling`).
fn gemma(
    file: &GgufFile,
    arch: &str,
    c: &mut Map<String, Value>,
    per_head: usize,
    head_dim: usize,
    refusals: &mut Vec<Refusal>,
) -> Result<()> {
    use candle_core::quantized::gguf_file::Value as G;
    let key = |k: &str| format!("{arch}.{k}");
    let layers = c["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let scalar = gemma_query_scalar(arch, layers, per_head, head_dim);
    c.insert("query_pre_attn_scalar".into(), json!(scalar));
    let window = file.int(&key("attention.sliding_window"))?;
    let window = match (arch, window) {
        ("gemma2", None) => Some(4096),
        (_, w) => w.filter(|&w| w > 0),
    };
    let sliding: Vec<bool> = match (window, file.get(&key("attention.sliding_window_pattern"))) {
        (None, _) => vec![false; layers],
        (Some(_), Some(G::Array(a))) => a.iter().map(|v| matches!(v, G::Bool(true))).collect(),
        (Some(_), _) => {
            let n = file
                .int(&key("attention.sliding_window_pattern"))?
                .unwrap_or(gemma_pattern(arch) as i64)
                .max(1) as usize;
            (0..layers).map(|i| i % n < n - 1).collect()
        }
    };
    if sliding.len() != layers {
        refusals.push(Refusal {
            key: key("attention.sliding_window_pattern"),
            value: Some(format!("[{} values]", sliding.len())),
            msg: format!("one per layer expected ({layers})"),
        });
    }
    let types: Vec<&str> = sliding
        .iter()
        .map(|&s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    c.insert("layer_types".into(), json!(types));
    c.insert("sliding_window".into(), json!(window.unwrap_or(4096)));
    if arch == "gemma3" {
        if !c.contains_key("rope_local_base_freq") {
            c.insert("rope_local_base_freq".into(), json!(10000.0));
        }
        match file.string(&key("rope.scaling.type"))? {
            None | Some("none") => {}
            Some("linear") => match file.float(&key("rope.scaling.factor"))? {
                Some(f) if f > 0.0 => {
                    c.insert(
                        "rope_scaling".into(),
                        json!({"rope_type": "linear", "factor": f}),
                    );
                }
                _ => refusals.push(Refusal {
                    key: key("rope.scaling.factor"),
                    value: None,
                    msg: "linear rope scaling needs a positive factor".into(),
                }),
            },
            Some(other) => refusals.push(Refusal {
                key: key("rope.scaling.type"),
                value: Some(format!("{other:?}")),
                msg: "Gemma 3 files are read with linear rope scaling or none".into(),
            }),
        }
    }
    Ok(())
}

/// Phi-3's LongRoPE as the `rope_scaling` of its config.json, from the factors llama.cpp's
/// converter stores as tensors (`Phi3MiniModel.generate_extra_tensors`), or None when they are
/// not a pair of head_dim * partial / 2 factors each, or the stored attention factor is not
/// the one transformers computes from the contexts (sqrt(1 + ln(s) / ln(original)), s =
/// context / original, 1 when s <= 1).
fn longrope(file: &GgufFile, c: &Map<String, Value>) -> Result<Option<Value>> {
    let (Some(_), Some(_)) = (
        file.shape("rope_factors_long.weight"),
        file.shape("rope_factors_short.weight"),
    ) else {
        return Ok(None);
    };
    let long: Vec<f32> = file.read_f32("rope_factors_long.weight")?.to_vec1()?;
    let short: Vec<f32> = file.read_f32("rope_factors_short.weight")?.to_vec1()?;
    let num = |k: &str| c.get(k).and_then(Value::as_f64);
    let (Some(context), Some(original)) = (
        num("max_position_embeddings"),
        num("original_max_position_embeddings"),
    ) else {
        return Ok(None);
    };
    let hidden = num("hidden_size").unwrap_or(0.0);
    let heads = num("num_attention_heads").unwrap_or(1.0);
    let rotary = (hidden / heads * num("partial_rotary_factor").unwrap_or(1.0)) as usize;
    let scale = context / original;
    let want = if scale > 1.0 {
        (1.0 + scale.ln() / original.ln()).sqrt()
    } else {
        1.0
    };
    let stored = file.float("phi3.rope.scaling.attn_factor")?.unwrap_or(want);
    if long.len() != rotary / 2 || short.len() != long.len() || (stored - want).abs() > 1e-6 {
        return Ok(None);
    }
    Ok(Some(json!({
        "type": "longrope",
        "long_factor": long,
        "short_factor": short,
    })))
}

/// A metadata value as a refusal shows it: a string quoted, an array by its length, a number
/// or boolean as written.
fn describe(file: &GgufFile, key: &str) -> String {
    use candle_core::quantized::gguf_file::Value as G;
    match file.get(key) {
        Some(G::String(s)) => format!("{s:?}"),
        Some(G::Array(a)) => format!("[{} values]", a.len()),
        Some(G::Bool(b)) => b.to_string(),
        Some(G::F32(_) | G::F64(_)) => file
            .float(key)
            .ok()
            .flatten()
            .map_or(String::new(), |x| x.to_string()),
        Some(_) => file
            .int(key)
            .ok()
            .flatten()
            .map_or(String::new(), |x| x.to_string()),
        None => String::new(),
    }
}

/// llama.cpp's rope factors for Llama 3's scaling, computed as its converter computes them, in
/// f32 (`generate_extra_tensors` in conversion/llama.py; the formula of transformers'
/// `_compute_llama3_parameters`): per rotary frequency, 1 above the high band, `factor` below the
/// low band, and in between 1 / ((1 - s) / factor + s) with s = (original / wavelength - low) /
/// (high - low). The exporter writes them; the importer checks a file's against them.
pub(crate) fn llama3_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    original: f64,
) -> Vec<f32> {
    let (factor, low, high, original) = (factor as f32, low as f32, high as f32, original as f32);
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0f32 / (theta as f32).powf((2 * i) as f32 / head_dim as f32);
            let wavelen = (2.0 * std::f64::consts::PI) as f32 / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// The `llama3` rope scaling that gives `factors`, or None. Meta's Llama 3.1 / 3.2 / 3.3 all use
/// low_freq_factor 1 and high_freq_factor 4; the factor is the largest; the original context
/// comes from a factor in the smoothed band (or is the usual 8192, or the file's context, when
/// no factor falls there). Accepted only when it reproduces every factor to f32 precision.
pub(crate) fn llama3_scaling(
    factors: &[f32],
    theta: f64,
    head_dim: usize,
    context: f64,
) -> Option<Value> {
    if factors.len() != head_dim / 2 || factors.is_empty() {
        return None;
    }
    let factor = factors.iter().copied().fold(f32::MIN, f32::max) as f64;
    let (low, high) = (1.0, 4.0);
    let mut originals = vec![8192.0, context];
    for (i, &f) in factors.iter().enumerate() {
        let f = f as f64;
        if factor > 1.0 && f > 1.0 + 1e-4 && f < factor * (1.0 - 1e-4) {
            let s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor);
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            originals.insert(0, (wavelen * (s * (high - low) + low)).round());
            break;
        }
    }
    originals.into_iter().find_map(|original| {
        let want = llama3_factors(theta, head_dim, factor, low, high, original);
        let same = want
            .iter()
            .zip(factors)
            .all(|(&w, &f)| (w as f64 - f as f64).abs() <= 1e-5 * (w as f64).abs());
        same.then(|| {
            json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original as u64,
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_is_read_back_from_its_factors() {
        // Llama 3.1 8B's: theta 500000, head dim 128, factor 8, original 8192
        let f = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        let s = llama3_scaling(&f, 500000.0, 128, 131072.0).unwrap();
        assert_eq!(s["factor"], json!(8.0));
        assert_eq!(s["original_max_position_embeddings"], json!(8192));
        // Llama 3.2's factor 32
        let f = llama3_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192.0);
        assert_eq!(
            llama3_scaling(&f, 500000.0, 64, 131072.0).unwrap()["factor"],
            json!(32.0)
        );
        // factors from another formula are refused
        let mut g = f.clone();
        g[5] *= 1.01;
        assert!(llama3_scaling(&g, 500000.0, 64, 131072.0).is_none());
    }
}
