//! Qwen2 / Qwen2.5, as `Qwen2ForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen2.5-0.5B>; report: arXiv:2407.10671.
//!
//! Differs from Llama by a bias on the q/k/v projections (not o_proj); small models tie the
//! embeddings (`tie_word_embeddings`).

use std::path::Path;

use serde::Deserialize;

use crate::config::raw::{
    check_act, check_attention_dropout, check_heads, rotary, RotaryKeys, TokenIds,
};
use crate::config::{Arch, DecoderConfig};
use crate::error::{ModelError, Result};
use crate::hf_keys::HfConfig;

/// `config.json` of `Qwen2ForCausalLM`, keys and defaults as in HF.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
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
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: TokenIds,
}

fn silu() -> String {
    "silu".into()
}
fn max_pos() -> usize {
    32768
}
fn eps() -> f64 {
    1e-6
}
impl HfConfig for Qwen2Config {
    const FAMILY: &'static str = "Qwen2";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];
}

impl Qwen2Config {
    fn rotary_keys(&self) -> RotaryKeys<'_> {
        RotaryKeys {
            rope_theta: self.rope_theta,
            rope_scaling: &self.rope_scaling,
            rope_parameters: &self.rope_parameters,
            layer_types: &self.layer_types,
            num_hidden_layers: self.num_hidden_layers,
        }
    }

    pub fn into_config(self, path: &Path) -> Result<DecoderConfig> {
        check_act(&self.hidden_act, path)?;
        let kv = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        check_heads(self.hidden_size, self.num_attention_heads, kv, path)?;
        check_attention_dropout(self.attention_dropout, path)?;
        if self.use_sliding_window {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: "use_sliding_window".into(),
                msg: "sliding-window Qwen2 is not supported; set it to false".into(),
            });
        }
        let (rope_theta, rope_scaling) =
            rotary(self.rotary_keys(), &["full_attention"], "Qwen2", path)?;
        Ok(DecoderConfig {
            arch: Arch::Qwen2,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: kv,
            head_dim: self.hidden_size / self.num_attention_heads,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            tie_word_embeddings: self.tie_word_embeddings,
            sliding_window: None,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_id.into_vec(),
            raw: serde_json::Value::Null,
        })
    }
}
