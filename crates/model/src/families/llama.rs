//! Llama 2 / 3 / 3.1 / 3.2, as `LlamaForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/meta-llama/Llama-3.2-1B>; paper: arXiv:2302.13971.
//!
//! Features used from the shared decoder: GQA, optional q/k/v/o bias (`attention_bias`), optional
//! MLP bias, `rope_scaling` (llama3, linear), tied or untied embeddings.

use serde::Deserialize;

use super::common::{CommonKeys, FamilyShape};
use super::Family;
use crate::config::hf_keys::{Fixed, Refusals};

/// The `config.json` keys only Llama reads, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaKeys {
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub pretraining_tp: Option<usize>,
}

impl Family for LlamaKeys {
    const FAMILY: &'static str = "Llama";
    const CLASS: &'static str = "LlamaForCausalLM";
    const MODEL_TYPE: &'static str = "llama";
    const IGNORED: &'static [&'static str] = &[];
    /// LlamaModel builds no sliding layers, but transformers' KV cache reads the key: with a
    /// window, `generate` would keep only the last `sliding_window` tokens.
    const FIXED: &'static [Fixed] = &[Fixed {
        key: "sliding_window",
        accepted: &["null"],
        what: "makes the KV cache of `generate` keep only the last this many tokens",
    }];

    fn shape(&self, _common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.pretraining_tp.unwrap_or(1) != 1 {
            let msg = "splits each projection into this many slices (transformers 4's \
                       pretraining_tp > 1 path, whose rounding differs); tallow implements 1 only";
            refusals.push("pretraining_tp", msg);
        }
        FamilyShape {
            layer_types: &["full_attention"],
            head_dim: self.head_dim,
            max_position_embeddings: 2048,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: false,
            sliding_window: None,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }
}
