//! Llama 2 / 3 / 3.1 / 3.2 (and Mistral, same layout), as `LlamaForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/meta-llama/Llama-3.2-1B>; paper: arXiv:2302.13971.
//!
//! Features used from the shared decoder: GQA, optional q/k/v/o bias (`attention_bias`), optional
//! MLP bias, `rope_scaling` (llama3, linear), tied or untied embeddings, Mistral's sliding window.

use std::path::Path;

use serde::Deserialize;

use super::common::{refuse, CommonKeys, FamilyShape};
use super::Family;
use crate::config::Arch;
use crate::error::Result;

/// The `config.json` keys only Llama (and Mistral) read, with HF's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaKeys {
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    /// Mistral: a token sees at most this many previous tokens.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub pretraining_tp: Option<usize>,
}

impl Family for LlamaKeys {
    const FAMILY: &'static str = "Llama";
    const IGNORED: &'static [&'static str] = &[];

    fn shape(&self, arch: Arch, _common: &CommonKeys, path: &Path) -> Result<FamilyShape> {
        if self.pretraining_tp.unwrap_or(1) != 1 {
            return Err(refuse("pretraining_tp", "only 1 is supported", path));
        }
        let mistral = arch == Arch::Mistral;
        let (family, layer_types): (_, &'static [&'static str]) =
            match (mistral, self.sliding_window) {
                (true, Some(_)) => ("Mistral", &["sliding_attention"]),
                (true, None) => ("Mistral", &["full_attention"]),
                _ => ("Llama", &["full_attention"]),
            };
        Ok(FamilyShape {
            arch,
            family,
            layer_types,
            head_dim: self.head_dim,
            max_position_embeddings: 2048,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: false,
            sliding_window: if mistral { self.sliding_window } else { None },
        })
    }
}
