//! Qwen3 (dense), as `Qwen3ForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen3-0.6B>; report: arXiv:2505.09388.
//!
//! Differs from Qwen2 by RMSNorm on each head of q and k (`q_norm`, `k_norm`) before rotary
//! embedding, no q/k/v bias by default, and an explicit `head_dim` that need not equal
//! hidden_size / num_attention_heads.

use serde::Deserialize;

use super::common::{CommonKeys, FamilyShape};
use super::Family;
use crate::config::hf_keys::Refusals;

/// The `config.json` keys only Qwen3 reads, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3Keys {
    #[serde(default = "head_dim")]
    pub head_dim: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
}

fn head_dim() -> usize {
    128
}

impl Family for Qwen3Keys {
    const FAMILY: &'static str = "Qwen3";
    const CLASS: &'static str = "Qwen3ForCausalLM";
    const MODEL_TYPE: &'static str = "qwen3";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];

    fn shape(&self, _common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.use_sliding_window {
            let msg = "true gives the layers from `max_window_layers` on a sliding window of \
                       `sliding_window` tokens; tallow's Qwen3 attends to every token";
            refusals.push("use_sliding_window", msg);
        }
        FamilyShape {
            layer_types: &["full_attention"],
            head_dim: Some(self.head_dim),
            max_position_embeddings: 32768,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: true,
            sliding_window: None,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }
}
