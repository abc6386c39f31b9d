//! Phi-3, Phi-3.5 and Phi-4-mini, as `Phi3ForCausalLM` in HF transformers. Model cards:
//! <https://huggingface.co/microsoft/Phi-3.5-mini-instruct>,
//! <https://huggingface.co/microsoft/Phi-4-mini-instruct>; report: arXiv:2404.14219.
//!
//! Llama's block with three differences:
//! - fused projections: `self_attn.qkv_proj` (out = (H + 2 KV) D: q, then k, then v) and
//!   `mlp.gate_up_proj` (out = 2 I: gate, then up, as `Phi3MLP` chunks it), which LoRA and
//!   PEFT target as one module each (`crate::config::layout`);
//! - LongRoPE (`rope_scaling` type `longrope`, formerly `su`): per-frequency short / long
//!   factors and an attention factor on cos / sin (`RopeScaling::LongRope`);
//! - partial rotary embedding (`partial_rotary_factor`, Phi-4-mini 0.75): only the first
//!   head_dim * factor dims of each head rotate.
//!
//! No biases; `sliding_window` (Phi-3-mini-4k: 2047) is Mistral's window, through the same
//! mask and KV cache.

use serde::Deserialize;

use super::common::{CommonKeys, FamilyExtras, FamilyShape, RopeExtras};
use super::Family;
use crate::config::hf_keys::Refusals;

/// The `config.json` keys only Phi-3 reads, with HF's defaults (`Phi3Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Phi3Keys {
    /// LongRoPE's pretraining context (transformers 5 also copies it into `rope_parameters`).
    #[serde(default = "original_max")]
    pub original_max_position_embeddings: usize,
    #[serde(default = "one")]
    pub partial_rotary_factor: f64,
    /// Dropout on the attention and MLP outputs before each residual add, in training only
    /// (`Phi3DecoderLayer.resid_attn_dropout` / `resid_mlp_dropout`): tallow has none, so
    /// only 0 is accepted (every released Phi-3 config has 0.0).
    #[serde(default)]
    pub resid_pdrop: f64,
    /// null: full attention (Phi3Config's default; Phi-3.5-mini writes 262144).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Not a key of Phi3Config, but Phi-3's attention and rotary init read it
    /// (`getattr(config, "head_dim", hidden_size // num_attention_heads)`, 4.57 and 5.x):
    /// accepted when it is that quotient.
    #[serde(default)]
    pub head_dim: Option<usize>,
}

fn original_max() -> usize {
    4096
}

fn one() -> f64 {
    1.0
}

impl Family for Phi3Keys {
    const FAMILY: &'static str = "Phi-3";
    const CLASS: &'static str = "Phi3ForCausalLM";
    const MODEL_TYPE: &'static str = "phi3";
    /// `embd_pdrop`: Phi3Config keeps it, but transformers' Phi3Model (4.57 and 5.x) never
    /// applies it (no embedding dropout module).
    const IGNORED: &'static [&'static str] = &["embd_pdrop"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.resid_pdrop != 0.0 {
            let msg = "drops the attention and MLP outputs before each residual add in training; \
                       tallow's decoder has no residual dropout (LoRA dropout is `lora.dropout` \
                       in the training config): set it to 0.0";
            refusals.push("resid_pdrop", msg);
        }
        super::common::check_derived_head_dim(self.head_dim, common, "Phi-3", refusals);
        FamilyShape {
            layer_types: match self.sliding_window {
                Some(_) => &["sliding_attention"],
                None => &["full_attention"],
            },
            head_dim: None,
            max_position_embeddings: 4096,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: self.sliding_window,
            // Phi3Config's default; Phi-4-mini's config.json sets true
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }

    fn extras(&self, _common: &CommonKeys) -> FamilyExtras {
        FamilyExtras {
            fused_projections: true,
            rope: Some(RopeExtras {
                partial_rotary_factor: self.partial_rotary_factor,
                original_max_position_embeddings: Some(self.original_max_position_embeddings),
            }),
            ..Default::default()
        }
    }
}
