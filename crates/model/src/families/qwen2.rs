//! Qwen2 / Qwen2.5, as `Qwen2ForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen2.5-0.5B>; report: arXiv:2407.10671.
//!
//! Differs from Llama by a bias on the q/k/v projections (not o_proj); small models tie the
//! embeddings (`tie_word_embeddings`).

use serde::Deserialize;

use super::common::{CommonKeys, FamilyShape};
use super::Family;
use crate::config::hf_keys::Refusals;

/// The `config.json` keys only Qwen2 reads, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Keys {
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Not a key of Qwen2Config, but Qwen2's attention and rotary init read it
    /// (`getattr(config, "head_dim", hidden_size // num_attention_heads)`, 4.57 and 5.x):
    /// accepted when it is that quotient.
    #[serde(default)]
    pub head_dim: Option<usize>,
}

impl Family for Qwen2Keys {
    const FAMILY: &'static str = "Qwen2";
    const CLASS: &'static str = "Qwen2ForCausalLM";
    const MODEL_TYPE: &'static str = "qwen2";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.use_sliding_window {
            let msg = "true gives the layers from `max_window_layers` on a sliding window of \
                       `sliding_window` tokens; tallow's Qwen2 attends to every token";
            refusals.push("use_sliding_window", msg);
        }
        super::common::check_derived_head_dim(self.head_dim, common, "Qwen2", refusals);
        FamilyShape {
            layer_types: &["full_attention"],
            head_dim: None,
            max_position_embeddings: 32768,
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }
}
