//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), as `Qwen2MoeForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B>; report: arXiv:2407.10671.
//!
//! Qwen2's attention (q/k/v bias, `qkv_bias`) with Qwen3-MoE's sparse block plus a shared
//! expert: every token also goes through one SwiGLU MLP of `shared_expert_intermediate_size`,
//! whose output is scaled by sigmoid(`shared_expert_gate`(x)) and added to the routed experts'
//! (`crate::decoder::moe`).

use serde::Deserialize;

use super::common::{CommonKeys, FamilyExtras, FamilyShape};
use super::qwen3_moe::{aux_coef, QwenSparse};
use super::Family;
use crate::config::hf_keys::Refusals;

/// The `config.json` keys only Qwen2-MoE reads, with HF's defaults (4.57 and 5.x agree).
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen2MoeKeys {
    /// Not a key of Qwen2MoeConfig: its attention reads `getattr(config, "head_dim",
    /// hidden_size // num_attention_heads)`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "yes")]
    pub qkv_bias: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default = "moe_intermediate_size")]
    pub moe_intermediate_size: usize,
    #[serde(default = "shared_expert_intermediate_size")]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "four")]
    pub num_experts_per_tok: usize,
    #[serde(default = "sixty")]
    pub num_experts: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default = "aux_coef")]
    pub router_aux_loss_coef: f64,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn four() -> usize {
    4
}
fn sixty() -> usize {
    60
}
fn moe_intermediate_size() -> usize {
    1408
}
fn shared_expert_intermediate_size() -> usize {
    5632
}

impl Qwen2MoeKeys {
    fn sparse(&self) -> QwenSparse<'_> {
        QwenSparse {
            family: Self::FAMILY,
            use_sliding_window: self.use_sliding_window,
            decoder_sparse_step: self.decoder_sparse_step,
            num_experts: self.num_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            moe_intermediate_size: self.moe_intermediate_size,
            norm_topk_prob: self.norm_topk_prob,
            mlp_only_layers: &self.mlp_only_layers,
            output_router_logits: self.output_router_logits,
            router_aux_loss_coef: self.router_aux_loss_coef,
            shared_expert_size: Some(self.shared_expert_intermediate_size),
        }
    }
}

impl Family for Qwen2MoeKeys {
    const FAMILY: &'static str = "Qwen2-MoE";
    const CLASS: &'static str = "Qwen2MoeForCausalLM";
    const MODEL_TYPE: &'static str = "qwen2_moe";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        self.sparse().check(common, refusals);
        FamilyShape {
            layer_types: &["full_attention"],
            head_dim: self.head_dim,
            max_position_embeddings: 32768,
            qkv_bias: self.qkv_bias,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }

    fn extras(&self, _common: &CommonKeys) -> FamilyExtras {
        FamilyExtras {
            moe: Some(self.sparse().moe()),
            ..Default::default()
        }
    }
}
