//! Gemma 2 (2B, 9B, 27B), as `Gemma2ForCausalLM` in HF transformers. Model card:
//! <https://huggingface.co/google/gemma-2-2b-it>; paper: arXiv:2408.00118. The maths follows
//! transformers' `models/gemma2/modeling_gemma2.py` (4.57 and 5.x agree).
//!
//! Llama's layer shapes (no biases unless `attention_bias`), with [`Variant`]'s departures:
//! - embeddings times sqrt(hidden_size), the factor rounded to the compute dtype;
//! - RMSNorm `x_normed * (1 + w)` in f32, then cast;
//! - four norms per layer: `post_attention_layernorm` on the attention OUTPUT before the
//!   residual add, `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the MLP;
//! - GeGLU MLP with gelu's tanh approximation (`hidden_activation = "gelu_pytorch_tanh"`);
//! - attention scale `query_pre_attn_scalar ** -0.5`;
//! - soft-capped attention scores (`attn_logit_softcapping`) and logits
//!   (`final_logit_softcapping`): `cap * tanh(x / cap)`;
//! - `sliding_window` on the `sliding_attention` layers only (`layer_types`; absent, as
//!   transformers 4.57 and 5.x build it: even layers slide, odd layers attend to everything);
//! - embeddings tied to the LM head unless config.json says otherwise.

use serde::Deserialize;

use super::common::{CommonKeys, FamilyShape};
use super::Family;
use crate::config::hf_keys::Refusals;
use crate::config::{Activation, Variant};

/// The `config.json` keys only Gemma 2 reads, with HF's defaults (`Gemma2Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma2Keys {
    #[serde(default = "head_dim")]
    pub head_dim: usize,
    #[serde(default = "gelu_tanh")]
    pub hidden_activation: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f64,
    /// Absent: HF's default 4096; null: every layer attends to everything.
    #[serde(default = "window")]
    pub sliding_window: Option<usize>,
    /// Absent: 30; null: no capping.
    #[serde(default = "final_cap")]
    pub final_logit_softcapping: Option<f64>,
    /// Absent: 50; null: no capping.
    #[serde(default = "attn_cap")]
    pub attn_logit_softcapping: Option<f64>,
    /// transformers 5: attention without the causal mask (an encoder); refused when true.
    #[serde(default)]
    pub use_bidirectional_attention: Option<bool>,
}

fn head_dim() -> usize {
    256
}
fn gelu_tanh() -> String {
    "gelu_pytorch_tanh".into()
}
fn query_pre_attn_scalar() -> f64 {
    256.0
}
fn window() -> Option<usize> {
    Some(4096)
}
fn final_cap() -> Option<f64> {
    Some(30.0)
}
fn attn_cap() -> Option<f64> {
    Some(50.0)
}

impl Family for Gemma2Keys {
    const FAMILY: &'static str = "Gemma 2";
    const CLASS: &'static str = "Gemma2ForCausalLM";
    const MODEL_TYPE: &'static str = "gemma2";
    /// `cache_implementation` ("hybrid" in Google's checkpoints) picks transformers' Python
    /// cache class for `generate`: the values are the same (tallow's KV cache applies each
    /// layer's window itself).
    const IGNORED: &'static [&'static str] = &["cache_implementation"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.hidden_activation != "gelu_pytorch_tanh" {
            let msg = format!(
                "the MLP's activation; `{}` is not supported (Gemma 2's MLP: gelu_pytorch_tanh)",
                self.hidden_activation
            );
            refusals.push("hidden_activation", msg);
        }
        if self.use_bidirectional_attention == Some(true) {
            let msg = "true drops the causal mask (an encoder); tallow's attention is causal";
            refusals.push("use_bidirectional_attention", msg);
        }
        for (key, v) in [
            ("query_pre_attn_scalar", Some(self.query_pre_attn_scalar)),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if v.is_some_and(|x| !(x > 0.0 && x.is_finite())) {
                refusals.push(key, "must be a positive number (or null)");
            }
        }
        // Which layers slide: `layer_types` when given (checked against num_hidden_layers by
        // `CommonKeys::into_config`), else transformers' rule `(i + 1) % 2` (even layers).
        let n = common.num_hidden_layers;
        let full_attention_layers: Vec<usize> = match (&common.layer_types, self.sliding_window) {
            (_, None) => Vec::new(), // no window: every layer attends to everything
            (Some(types), Some(_)) => (0..n)
                .filter(|&i| types.get(i).map(String::as_str) == Some("full_attention"))
                .collect(),
            (None, Some(_)) => (0..n).filter(|i| i % 2 == 1).collect(),
        };
        FamilyShape {
            layer_types: &["sliding_attention", "full_attention"],
            head_dim: Some(self.head_dim),
            max_position_embeddings: 8192,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: self.sliding_window,
            tie_word_embeddings: true,
            variant: Variant {
                act: Activation::GeluTanh,
                norm_plus_one: true,
                sandwich_norms: true,
                embed_scale: true,
                query_pre_attn_scalar: Some(self.query_pre_attn_scalar),
                attn_logit_softcapping: self.attn_logit_softcapping,
                final_logit_softcapping: self.final_logit_softcapping,
                full_attention_layers,
                rope_local_base_freq: None,
            },
        }
    }
}
