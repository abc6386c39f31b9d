//! Mistral 7B (v0.1-v0.3) and its Llama-shaped descendants, as `MistralForCausalLM` in HF
//! transformers. Model card: <https://huggingface.co/mistralai/Mistral-7B-v0.1>; paper:
//! arXiv:2310.06825.
//!
//! Llama's layout without biases, plus sliding-window attention: with `sliding_window = w` a
//! token sees itself and the w - 1 tokens before it, in training, eval and the KV cache. v0.2 and
//! later set `sliding_window` to null (full attention).

use serde::Deserialize;

use super::common::{CommonKeys, FamilyShape};
use super::Family;
use crate::config::hf_keys::Refusals;

/// The `config.json` keys only Mistral reads, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct MistralKeys {
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Absent: HF's default 4096; null: full attention.
    #[serde(default = "window")]
    pub sliding_window: Option<usize>,
}

fn window() -> Option<usize> {
    Some(4096)
}

impl Family for MistralKeys {
    const FAMILY: &'static str = "Mistral";
    const CLASS: &'static str = "MistralForCausalLM";
    const MODEL_TYPE: &'static str = "mistral";
    const IGNORED: &'static [&'static str] = &[];

    fn shape(&self, _common: &CommonKeys, _refusals: &mut Refusals) -> FamilyShape {
        FamilyShape {
            layer_types: match self.sliding_window {
                Some(_) => &["sliding_attention"],
                None => &["full_attention"],
            },
            head_dim: self.head_dim,
            max_position_embeddings: 131072,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: self.sliding_window,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }
}
