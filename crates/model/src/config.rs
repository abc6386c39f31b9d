//! The checked model configuration that the shared decoder runs from, and the dispatch from
//! `config.json` to the per-family raw configs (`llama.rs`, `qwen2.rs`, `qwen3.rs`).
//!
//! Each family file holds a serde struct whose fields are the HF `config.json` keys word for word
//! (raw, with HF's defaults) and an `into_config()` that validates it into [`DecoderConfig`].

use std::path::Path;

use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::{llama, qwen2, qwen3};

/// The model families tallow implements, with the HF class names that select them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub const SUPPORTED: &'static str =
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

    fn from_hf(architecture: Option<&str>, model_type: Option<&str>) -> Option<Self> {
        match architecture {
            Some("LlamaForCausalLM") => return Some(Self::Llama),
            Some("MistralForCausalLM") => return Some(Self::Mistral),
            Some("Qwen2ForCausalLM") => return Some(Self::Qwen2),
            Some("Qwen3ForCausalLM") => return Some(Self::Qwen3),
            Some(_) => return None,
            None => {}
        }
        match model_type {
            Some("llama") => Some(Self::Llama),
            Some("mistral") => Some(Self::Mistral),
            Some("qwen2") => Some(Self::Qwen2),
            Some("qwen3") => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// The HF class name, written into configs tallow saves.
    pub fn hf_class(&self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// How rotary frequencies are rescaled for long context (`rope_scaling` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 / 3.2: frequencies rescaled by wavelength band.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Positions divided by `factor` (equivalently, every frequency divided by it).
    Linear { factor: f64 },
}

/// Everything the decoder needs, checked. Built only by the family files' `into_config()`.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Bias on q/k/v projections (Qwen2 always; Llama when `attention_bias`); o_proj follows
    /// `o_bias`.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before rotary embedding.
    pub qk_norm: bool,
    pub tie_word_embeddings: bool,
    /// Mistral-style sliding-window attention: a token sees at most this many previous tokens.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw config.json, kept so that saved models carry every key the user had.
    pub raw: serde_json::Value,
}

/// `quantization_config` of a pre-quantized checkpoint: bitsandbytes 4-bit (nf4) is read
/// (`*-bnb-4bit` repos); anything else (8-bit, GPTQ, AWQ, ...) is refused by name.
fn check_quantization_config(raw: &serde_json::Value, path: &Path) -> Result<()> {
    let Some(q) = raw.get("quantization_config") else {
        return Ok(());
    };
    let bad = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: "quantization_config".into(),
        msg,
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    if method != "bitsandbytes" {
        return Err(bad(format!(
            "quant_method `{method}` is not supported; tallow reads bitsandbytes 4-bit (nf4) \
             checkpoints, or quantizes an unquantized one itself (--quantize nf4)"
        )));
    }
    if q.get("load_in_8bit").and_then(|v| v.as_bool()) == Some(true) {
        return Err(bad(
            "bitsandbytes 8-bit (LLM.int8) checkpoints are not supported; use the unquantized \
             model, or --quantize nf4"
                .into(),
        ));
    }
    let qt = q.get("bnb_4bit_quant_type").and_then(|v| v.as_str());
    if qt.is_some_and(|t| t != "nf4") {
        return Err(bad(format!(
            "bnb_4bit_quant_type `{}` is not supported; tallow reads nf4 only",
            qt.unwrap_or("")
        )));
    }
    Ok(())
}

impl DecoderConfig {
    /// Reads `dir/config.json` and validates it for its family.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let architecture = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str());
        let model_type = raw.get("model_type").and_then(|m| m.as_str());
        let arch = Arch::from_hf(architecture, model_type).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: architecture.or(model_type).unwrap_or("<none>").to_string(),
                supported: Arch::SUPPORTED.to_string(),
            }
        })?;
        check_quantization_config(&raw, path)?;
        let parse_err = |e: serde_json::Error| ModelError::Config {
            path: path.to_path_buf(),
            key: "(config.json)".into(),
            msg: e.to_string(),
        };
        let cfg = match arch {
            Arch::Llama | Arch::Mistral => llama::LlamaConfig::deserialize(&raw)
                .map_err(parse_err)?
                .into_config(arch, path)?,
            Arch::Qwen2 => qwen2::Qwen2Config::deserialize(&raw)
                .map_err(parse_err)?
                .into_config(path)?,
            Arch::Qwen3 => qwen3::Qwen3Config::deserialize(&raw)
                .map_err(parse_err)?
                .into_config(path)?,
        };
        Ok(DecoderConfig { raw, ..cfg })
    }

    /// Number of parameters of the full model (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.o_bias {
            attn += h;
        }
        if self.qk_norm {
            attn += 2 * self.head_dim;
        }
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layer = attn + mlp + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

/// Shared helpers for the family files.
pub(crate) mod raw {
    use super::*;

    /// `eos_token_id` is an int, a list of ints, or null in HF configs.
    #[derive(Debug, Clone, Deserialize, Default)]
    #[serde(untagged)]
    pub enum TokenIds {
        One(u32),
        Many(Vec<u32>),
        #[default]
        None,
    }

    impl TokenIds {
        pub fn into_vec(self) -> Vec<u32> {
            match self {
                TokenIds::One(i) => vec![i],
                TokenIds::Many(v) => v,
                TokenIds::None => vec![],
            }
        }
    }

    /// Parses `rope_scaling` (null, or an object with `rope_type` or the older `type`).
    pub fn rope_scaling(v: &Option<serde_json::Value>, path: &Path) -> Result<Option<RopeScaling>> {
        let Some(v) = v else { return Ok(None) };
        if v.is_null() {
            return Ok(None);
        }
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: "rope_scaling".into(),
            msg,
        };
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|t| t.as_str())
            .ok_or_else(|| err("no `rope_type`".into()))?;
        let num = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_f64())
                .ok_or_else(|| err(format!("`{kind}` scaling needs a number `{k}`")))
        };
        match kind {
            "default" => Ok(None),
            "llama3" => Ok(Some(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            })),
            "linear" => Ok(Some(RopeScaling::Linear {
                factor: num("factor")?,
            })),
            other => Err(err(format!(
                "rope type `{other}` is not supported (supported: default, llama3, linear)"
            ))),
        }
    }

    pub fn check_act(act: &str, path: &Path) -> Result<()> {
        if act != "silu" {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: "hidden_act".into(),
                msg: format!("`{act}` is not supported (only `silu`)"),
            });
        }
        Ok(())
    }

    pub fn check_heads(hidden: usize, heads: usize, kv: usize, path: &Path) -> Result<()> {
        let err = |key: &str, msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: key.into(),
            msg,
        };
        if heads == 0 || kv == 0 || hidden == 0 {
            return Err(err("num_attention_heads", "sizes must be positive".into()));
        }
        if heads % kv != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads {heads}"),
            ));
        }
        Ok(())
    }
}
