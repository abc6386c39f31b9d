//! Llama 2 / 3 / 3.1 / 3.2 (and Mistral, same layout), as `LlamaForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/meta-llama/Llama-3.2-1B>; paper: arXiv:2302.13971.
//!
//! Features used from the shared decoder: GQA, optional q/k/v/o bias (`attention_bias`), optional
//! MLP bias, `rope_scaling` (llama3, linear), tied or untied embeddings, Mistral's sliding window.

use std::path::Path;

use serde::Deserialize;

use crate::config::raw::{
    check_act, check_attention_dropout, check_heads, rotary, RotaryKeys, TokenIds,
};
use crate::config::{Arch, DecoderConfig};
use crate::error::{ModelError, Result};
use crate::hf_keys::HfConfig;

/// `config.json` of `LlamaForCausalLM` / `MistralForCausalLM`, keys and defaults as in HF.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "silu")]
    pub hidden_act: String,
    #[serde(default = "max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "eps")]
    pub rms_norm_eps: f64,
    /// transformers 4 layout; transformers 5 writes `rope_parameters` instead.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub attention_dropout: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub pretraining_tp: Option<usize>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: TokenIds,
}

fn silu() -> String {
    "silu".into()
}
fn max_pos() -> usize {
    2048
}
fn eps() -> f64 {
    1e-6
}
impl HfConfig for LlamaConfig {
    const FAMILY: &'static str = "Llama";
    const IGNORED: &'static [&'static str] = &[];
}

impl LlamaConfig {
    fn rotary_keys(&self) -> RotaryKeys<'_> {
        RotaryKeys {
            rope_theta: self.rope_theta,
            rope_scaling: &self.rope_scaling,
            rope_parameters: &self.rope_parameters,
            layer_types: &self.layer_types,
            num_hidden_layers: self.num_hidden_layers,
        }
    }

    pub fn into_config(self, arch: Arch, path: &Path) -> Result<DecoderConfig> {
        check_act(&self.hidden_act, path)?;
        let kv = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        check_heads(self.hidden_size, self.num_attention_heads, kv, path)?;
        check_attention_dropout(self.attention_dropout, path)?;
        // Mistral's window applies to every layer (`sliding_window`); transformers 5 may spell
        // it out per layer, which must then agree with it.
        let (family, allowed): (&str, &[&str]) = match (arch, self.sliding_window) {
            (Arch::Mistral, Some(_)) => ("Mistral", &["sliding_attention"]),
            (Arch::Mistral, None) => ("Mistral", &["full_attention"]),
            _ => ("Llama", &["full_attention"]),
        };
        let (rope_theta, rope_scaling) = rotary(self.rotary_keys(), allowed, family, path)?;
        if self.pretraining_tp.unwrap_or(1) != 1 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: "pretraining_tp".into(),
                msg: "only 1 is supported".into(),
            });
        }
        Ok(DecoderConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: kv,
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: false,
            tie_word_embeddings: self.tie_word_embeddings,
            sliding_window: if arch == Arch::Mistral {
                self.sliding_window
            } else {
                None
            },
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_id.into_vec(),
            raw: serde_json::Value::Null,
        })
    }
}
