//! Gemma 3 (text: 270M, 1B; and the language model of the 4B, 12B, 27B image-text models), as
//! `Gemma3ForCausalLM` in HF transformers, and the text tower of
//! `Gemma3ForConditionalGeneration` checkpoints ([`text_config_of`]). Model card:
//! <https://huggingface.co/google/gemma-3-1b-it>; report: arXiv:2503.19786. The maths follows
//! transformers' `models/gemma3/modeling_gemma3.py` (4.57 and 5.x agree).
//!
//! Gemma 2's layer ([`Variant`]: (1 + w) RMSNorm, sandwich norms, embeddings times
//! sqrt(hidden_size), GeGLU with gelu's tanh approximation, `query_pre_attn_scalar`), plus:
//! - `q_norm` / `k_norm`: (1 + w) RMSNorm over each head of q and k, before rotary embedding;
//! - two rotary tables: the `sliding_attention` layers use theta `rope_local_base_freq`
//!   (default 10000) unscaled, the `full_attention` layers `rope_theta` (default 1e6) with
//!   `rope_scaling` (4B/12B/27B: linear, factor 8); transformers 5 writes both as
//!   `rope_parameters` per layer type (`families::common::LocalRope`);
//! - which layers slide: `layer_types`, or (older configs) every `sliding_window_pattern`-th
//!   layer (6 in Google's) is global: layer i slides when (i + 1) % pattern != 0;
//! - the soft-caps exist as keys but are null in Google's configs (Gemma 2's code runs them
//!   when set).
//!
//! The window is transformers' (4.57 and 5.x, `masking_utils.sliding_window_overlay`): query q
//! sees key k when q - window < k <= q, as Mistral's and Gemma 2's.

use serde::Deserialize;
use serde_json::{json, Value};

use super::common::{CommonKeys, FamilyExtras, FamilyShape, LocalRope};
use super::Family;
use crate::config::hf_keys::{check_keys, KeyPolicy, Refusals};
use crate::config::{Activation, Variant};
use crate::error::{ModelError, Result};

/// The `config.json` keys only Gemma 3 reads, with HF's defaults (`Gemma3TextConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma3Keys {
    #[serde(default = "head_dim")]
    pub head_dim: usize,
    #[serde(default = "gelu_tanh")]
    pub hidden_activation: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f64,
    /// Absent: HF's default 4096. Gemma 3's sliding layers need one (null is refused).
    #[serde(default = "window")]
    pub sliding_window: Option<usize>,
    /// Every `sliding_window_pattern`-th layer attends to everything (absent: 6); read when
    /// `layer_types` is absent, as transformers does.
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// The sliding layers' rotary theta (transformers 4 layout; absent: 10000).
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// null (Google's configs) or absent: no capping.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Attention without the causal mask (EmbeddingGemma); refused when true.
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

/// `Gemma3TextConfig`'s default pattern: five sliding layers, then a global one.
const PATTERN: usize = 6;

impl Family for Gemma3Keys {
    const FAMILY: &'static str = "Gemma 3";
    const CLASS: &'static str = "Gemma3ForCausalLM";
    const MODEL_TYPE: &'static str = "gemma3_text";
    /// `cache_implementation` ("hybrid") picks transformers' Python cache class for
    /// `generate`: the values are the same (tallow's KV cache applies each layer's window).
    /// `_sliding_window_pattern` is the private copy transformers 4.57 saves beside
    /// `sliding_window_pattern`; loading never reads it (it reads `layer_types`, else
    /// `sliding_window_pattern`).
    const IGNORED: &'static [&'static str] = &["cache_implementation", "_sliding_window_pattern"];

    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape {
        if self.hidden_activation != "gelu_pytorch_tanh" {
            let msg = format!(
                "the MLP's activation; `{}` is not supported (Gemma 3's MLP: gelu_pytorch_tanh)",
                self.hidden_activation
            );
            refusals.push("hidden_activation", msg);
        }
        if self.use_bidirectional_attention == Some(true) {
            let msg = "true drops the causal mask (EmbeddingGemma); tallow's attention is causal";
            refusals.push("use_bidirectional_attention", msg);
        }
        for (key, v) in [
            ("query_pre_attn_scalar", Some(self.query_pre_attn_scalar)),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("rope_local_base_freq", self.rope_local_base_freq),
        ] {
            if v.is_some_and(|x| !(x > 0.0 && x.is_finite())) {
                refusals.push(key, "must be a positive number (or null)");
            }
        }
        let window = match self.sliding_window.filter(|&w| w > 0) {
            Some(w) => w,
            None => {
                let msg = "Gemma 3's sliding layers need a positive window";
                refusals.push("sliding_window", msg);
                1
            }
        };
        let n = common.num_hidden_layers;
        let mut pattern = self.sliding_window_pattern.unwrap_or(PATTERN);
        if pattern == 0 {
            refusals.push("sliding_window_pattern", "must be positive");
            pattern = PATTERN;
        }
        let by_pattern: Vec<usize> = (0..n).filter(|i| (i + 1) % pattern == 0).collect();
        let full_attention_layers: Vec<usize> = match &common.layer_types {
            Some(types) => {
                // checked against num_hidden_layers and the allowed names by into_config
                let full: Vec<usize> = (0..n)
                    .filter(|&i| types.get(i).map(String::as_str) == Some("full_attention"))
                    .collect();
                if self.sliding_window_pattern.is_some() && full != by_pattern {
                    let msg = format!(
                        "{pattern} makes layers {by_pattern:?} global but `layer_types` makes \
                         {full:?} global; remove the stale one"
                    );
                    refusals.push("sliding_window_pattern", msg);
                }
                full
            }
            None => by_pattern,
        };
        FamilyShape {
            layer_types: &["sliding_attention", "full_attention"],
            head_dim: Some(self.head_dim),
            max_position_embeddings: 131_072,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: true,
            sliding_window: Some(window),
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
                rope_local_base_freq: None, // set by into_config from `extras`
            },
        }
    }

    fn extras(&self, _common: &CommonKeys) -> FamilyExtras {
        FamilyExtras {
            local_rope: Some(LocalRope {
                rope_local_base_freq: self.rope_local_base_freq,
                default: 10_000.0,
            }),
            default_rope_theta: Some(1_000_000.0),
            ..Default::default()
        }
    }

    /// `Gemma3TextConfig`'s defaults for the sizes (the 4B's nested `text_config` gives only
    /// hidden_size, intermediate_size, num_hidden_layers, rope_scaling and sliding_window).
    fn defaults() -> Value {
        json!({
            "vocab_size": 262_208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "bos_token_id": 2,
            "eos_token_id": 1,
        })
    }
}

/// The image-text checkpoints' class; tallow reads its text tower only.
pub const CONDITIONAL_CLASS: &str = "Gemma3ForConditionalGeneration";

/// Top-level keys of a `Gemma3Config` (image-text) that do not change the text tower's output:
/// the vision tower's config and the image tokens' ids (tallow feeds no images), and the keys
/// every config has ([`crate::config::hf_keys::GENERIC_IGNORED`]).
const CONDITIONAL_KEYS: &[&str] = &[
    "text_config",
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "image_token_id",
    "boi_token_id",
    "eoi_token_id",
    // token ids: generation reads generation_config.json
    "bos_token_id",
    "eos_token_id",
    // read below (the tower's tying)
    "tie_word_embeddings",
];

/// The text tower's `config.json` of a `Gemma3ForConditionalGeneration` config (`text_config`),
/// as a `Gemma3ForCausalLM` config: its keys, the top-level `tie_word_embeddings` when the tower
/// has none, and the CausalLM's class and model_type. What tallow saves from such a base
/// (merge, full fine-tuning) is therefore a text-only `Gemma3ForCausalLM`. Returns it and the
/// top-level keys `Gemma3Config` never reads (ignored, for the note); a generic key with a
/// value tallow does not implement (`is_encoder_decoder: true`) goes into `refusals`.
pub fn text_config_of(raw: &Value, refusals: &mut Refusals) -> Result<(Value, Vec<String>)> {
    let path = refusals.path().to_path_buf();
    let err = |key: &str, msg: String| ModelError::Config {
        path: path.clone(),
        key: key.into(),
        msg,
    };
    let obj = raw
        .as_object()
        .ok_or_else(|| err("(config.json)", "expected an object".into()))?;
    let policy = KeyPolicy {
        family: "Gemma 3 (image-text)",
        class: CONDITIONAL_CLASS,
        read: CONDITIONAL_KEYS.to_vec(),
        ignored: &[],
        fixed: &[],
    };
    let unread = check_keys(&policy, raw, refusals).unread;
    let mut text = match obj.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        None | Some(Value::Null) => serde_json::Map::new(), // all Gemma3TextConfig defaults
        Some(other) => {
            return Err(err(
                "text_config",
                format!("expected an object, found {other}"),
            ))
        }
    };
    if let Some(mt) = text.get("model_type").and_then(Value::as_str) {
        if mt != Gemma3Keys::MODEL_TYPE {
            return Err(err(
                "text_config",
                format!("model_type `{mt}`: tallow reads a `gemma3_text` tower only"),
            ));
        }
    }
    if !text.contains_key("tie_word_embeddings") {
        if let Some(t) = obj.get("tie_word_embeddings") {
            text.insert("tie_word_embeddings".into(), t.clone());
        }
    }
    for k in ["torch_dtype", "dtype"] {
        if let (false, Some(v)) = (text.contains_key(k), obj.get(k)) {
            text.insert(k.into(), v.clone());
        }
    }
    text.insert("architectures".into(), json!([Gemma3Keys::CLASS]));
    text.insert("model_type".into(), json!(Gemma3Keys::MODEL_TYPE));
    Ok((Value::Object(text), unread))
}
