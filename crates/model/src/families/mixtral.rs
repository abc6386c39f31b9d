//! Mixtral (8x7B, 8x22B), as `MixtralForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/mistralai/Mixtral-8x7B-v0.1>; paper: arXiv:2401.04088.
//!
//! Mistral's attention (its optional sliding window) with a sparse feed-forward in every
//! layer: a router picks `num_experts_per_tok` of `num_local_experts` SwiGLU experts of
//! `intermediate_size` per token, weighted by the chosen softmax probabilities renormalized to
//! sum to 1 (`crate::decoder::moe`). transformers 4.57 stores the block as
//! `block_sparse_moe` with experts `w1` (gate), `w3` (up), `w2` (down); 5.x as `mlp` with
//! the experts fused (both load).

use serde::Deserialize;

use super::common::{CommonKeys, FamilyExtras, FamilyShape};
use super::qwen3_moe::{aux_coef, check_router};
use super::Family;
use crate::config::hf_keys::Refusals;
use crate::config::{Moe, MoeNames};

/// The `config.json` keys only Mixtral reads, with HF's defaults (4.57 and 5.x agree).
#[derive(Debug, Clone, Deserialize)]
pub struct MixtralKeys {
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// null (the default): full attention.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default = "two")]
    pub num_experts_per_tok: usize,
    #[serde(default = "eight")]
    pub num_local_experts: usize,
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default = "aux_coef")]
    pub router_aux_loss_coef: f64,
    #[serde(default)]
    pub router_jitter_noise: f64,
}

fn two() -> usize {
    2
}
fn eight() -> usize {
    8
}

impl Family for MixtralKeys {
    const FAMILY: &'static str = "Mixtral";
    const CLASS: &'static str = "MixtralForCausalLM";
    const MODEL_TYPE: &'static str = "mixtral";
    const IGNORED: &'static [&'static str] = &[];

    fn shape(&self, _common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        check_router(self.num_local_experts, self.num_experts_per_tok, refusals);
        if self.router_jitter_noise != 0.0 {
            refusals.push(
                "router_jitter_noise",
                format!(
                    "{}: transformers multiplies the router's input by uniform noise in \
                     training; tallow routes without it (set 0)",
                    self.router_jitter_noise
                ),
            );
        }
        FamilyShape {
            layer_types: match self.sliding_window {
                Some(_) => &["sliding_attention"],
                None => &["full_attention"],
            },
            head_dim: self.head_dim,
            max_position_embeddings: 4096 * 32,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: self.sliding_window,
            tie_word_embeddings: false,
            variant: Default::default(),
        }
    }

    fn extras(&self, common: &CommonKeys) -> FamilyExtras {
        FamilyExtras {
            default_rope_theta: Some(1e6),
            moe: Some(Moe {
                num_experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
                // Mixtral's experts are `intermediate_size` wide
                expert_size: common.intermediate_size,
                norm_topk_prob: true,
                dense_layers: Vec::new(),
                sparse_step: 1,
                output_router_logits: self.output_router_logits,
                router_aux_loss_coef: self.router_aux_loss_coef,
                names: MoeNames {
                    block: "block_sparse_moe",
                    gate: "w1",
                    up: "w3",
                    down: "w2",
                },
                shared_expert_size: None,
            }),
            ..Default::default()
        }
    }
}
