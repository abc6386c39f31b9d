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
//! A key under `{arch}.` that changes the maths and that this reader does not map (a rope
//! scaling type, a sliding window, experts) is refused by name, all of them at once.

use serde_json::{json, Map, Value};

use super::GgufFile;
use crate::error::{ModelError, Refusal, Result};

/// The architectures read, with their transformers class and `model_type`.
const ARCHS: [(&str, &str, &str); 3] = [
    ("llama", "LlamaForCausalLM", "llama"),
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
];

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
    c.insert("hidden_act".into(), json!("silu"));
    let mut refusals = Vec::new();
    let mut keys: Vec<&String> = file.content.metadata.keys().collect();
    keys.sort();
    for key in keys {
        let Some(k) = key.strip_prefix(&prefix) else {
            continue;
        };
        match KEYS.iter().find(|(name, _)| *name == k) {
            Some((_, Some(hf))) => {
                let v = if k.ends_with("epsilon") || k.ends_with("freq_base") {
                    json!(file.float(key)?)
                } else {
                    json!(file.int(key)?)
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
        if rot as usize != head_dim {
            refusals.push(Refusal {
                key: format!("{prefix}rope.dimension_count"),
                value: Some(rot.to_string()),
                msg: format!("partial rotary (head dim {head_dim}) is not read from GGUF yet"),
            });
        }
    }
    if head_dim != hidden / heads || arch != "qwen2" {
        c.insert("head_dim".into(), json!(head_dim));
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
        "qwen3" => {
            c.insert("attention_bias".into(), json!(bias));
        }
        _ => {
            c.insert("use_sliding_window".into(), json!(false));
        }
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
    if !refusals.is_empty() {
        return Err(ModelError::GgufRefused {
            path: file.path.clone(),
            refusals,
        });
    }
    Ok(Value::Object(c))
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
