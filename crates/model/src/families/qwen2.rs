//! Qwen2 / Qwen2.5, as `Qwen2ForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen2.5-0.5B>; report: arXiv:2407.10671.
//!
//! Differs from Llama by a bias on the q/k/v projections (not o_proj); small models tie the
//! embeddings (`tie_word_embeddings`).

use std::path::Path;

use serde::Deserialize;

use super::common::{refuse, CommonKeys, FamilyShape};
use super::Family;
use crate::error::Result;

/// The `config.json` keys only Qwen2 reads, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2Keys {
    #[serde(default)]
    pub use_sliding_window: bool,
}

impl Family for Qwen2Keys {
    const FAMILY: &'static str = "Qwen2";
    const CLASS: &'static str = "Qwen2ForCausalLM";
    const MODEL_TYPE: &'static str = "qwen2";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];

    fn shape(&self, _common: &CommonKeys, path: &Path) -> Result<FamilyShape> {
        if self.use_sliding_window {
            let msg = "sliding-window Qwen2 is not supported; set it to false";
            return Err(refuse("use_sliding_window", msg, path));
        }
        Ok(FamilyShape {
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
        })
    }
}
