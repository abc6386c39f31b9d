//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), as `Qwen3MoeForCausalLM` in HF transformers.
//! Model card: <https://huggingface.co/Qwen/Qwen3-30B-A3B>; report: arXiv:2505.09388.
//!
//! Qwen3's attention (q/k norms) with a sparse feed-forward: a router picks
//! `num_experts_per_tok` of `num_experts` SwiGLU experts of `moe_intermediate_size` per token
//! (`crate::decoder::moe`), their outputs weighted by the router's softmax probabilities
//! (renormalized over the chosen ones when `norm_topk_prob`). Layers in `mlp_only_layers`, and
//! those off the `decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`.

use serde::Deserialize;

use super::common::{CommonKeys, FamilyExtras, FamilyShape};
use super::Family;
use crate::config::hf_keys::Refusals;
use crate::config::{Moe, MoeNames};

/// The `config.json` keys only Qwen3-MoE reads, with HF's defaults (4.57 and 5.x agree).
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3MoeKeys {
    /// Not a key of Qwen3MoeConfig: its attention reads `getattr(config, "head_dim",
    /// hidden_size // num_attention_heads)`, and the released configs carry it.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default = "moe_intermediate_size")]
    pub moe_intermediate_size: usize,
    #[serde(default = "eight")]
    pub num_experts_per_tok: usize,
    /// transformers 5 saves it as `num_local_experts` (its config's `attribute_map`).
    #[serde(default = "num_experts", alias = "num_local_experts")]
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

fn one() -> usize {
    1
}
fn eight() -> usize {
    8
}
fn moe_intermediate_size() -> usize {
    768
}
fn num_experts() -> usize {
    128
}
pub(crate) fn aux_coef() -> f64 {
    0.001
}

/// Checks the router keys every MoE family shares; refusals by name.
pub(crate) fn check_router(experts: usize, top_k: usize, refusals: &mut Refusals) {
    if top_k == 0 || top_k > experts {
        refusals.push(
            "num_experts_per_tok",
            format!("{top_k} experts per token out of {experts}: must be 1 to {experts}"),
        );
    }
}

/// The sparse-block keys Qwen3-MoE and Qwen2-MoE share (HF's names), read by both families'
/// `shape` and `extras`.
pub(crate) struct QwenSparse<'a> {
    pub family: &'static str,
    pub use_sliding_window: bool,
    pub decoder_sparse_step: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub mlp_only_layers: &'a Option<Vec<usize>>,
    pub output_router_logits: bool,
    pub router_aux_loss_coef: f64,
    /// Qwen2-MoE's `shared_expert_intermediate_size`.
    pub shared_expert_size: Option<usize>,
}

impl QwenSparse<'_> {
    /// Refuses a sliding window, a sparse step of 0, a bad top-k and a dense layer that does
    /// not exist, by name.
    pub(crate) fn check(&self, common: &CommonKeys, refusals: &mut Refusals) {
        if self.use_sliding_window {
            let msg = format!(
                "true gives some layers a sliding window of `sliding_window` tokens; tallow's \
                 {} attends to every token",
                self.family
            );
            refusals.push("use_sliding_window", msg);
        }
        if self.decoder_sparse_step == 0 {
            refusals.push(
                "decoder_sparse_step",
                "0 divides by zero in transformers; 1 makes every layer sparse",
            );
        }
        check_router(self.num_experts, self.num_experts_per_tok, refusals);
        let layers = common.num_hidden_layers;
        if let Some(l) = self
            .mlp_only_layers
            .iter()
            .flatten()
            .find(|&&l| l >= layers)
        {
            refusals.push(
                "mlp_only_layers",
                format!("layer {l} does not exist ({layers} layers)"),
            );
        }
    }

    /// The sparse blocks, with Qwen's names (`mlp`, `gate_proj`, `up_proj`, `down_proj`).
    pub(crate) fn moe(&self) -> Moe {
        Moe {
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            expert_size: self.moe_intermediate_size,
            norm_topk_prob: self.norm_topk_prob,
            dense_layers: self.mlp_only_layers.clone().unwrap_or_default(),
            sparse_step: self.decoder_sparse_step,
            output_router_logits: self.output_router_logits,
            router_aux_loss_coef: self.router_aux_loss_coef,
            names: MoeNames {
                block: "mlp",
                gate: "gate_proj",
                up: "up_proj",
                down: "down_proj",
            },
            shared_expert_size: self.shared_expert_size,
        }
    }
}

impl Qwen3MoeKeys {
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
            shared_expert_size: None,
        }
    }
}

impl Family for Qwen3MoeKeys {
    const FAMILY: &'static str = "Qwen3-MoE";
    const CLASS: &'static str = "Qwen3MoeForCausalLM";
    const MODEL_TYPE: &'static str = "qwen3_moe";
    /// Only used with `use_sliding_window = true`, which is refused.
    const IGNORED: &'static [&'static str] = &["sliding_window", "max_window_layers"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        self.sparse().check(common, refusals);
        FamilyShape {
            layer_types: &["full_attention"],
            head_dim: self.head_dim,
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

    fn extras(&self, _common: &CommonKeys) -> FamilyExtras {
        FamilyExtras {
            moe: Some(self.sparse().moe()),
            ..Default::default()
        }
    }
}
