//! The checked model configuration that the shared decoder runs from ([`DecoderConfig`]), and
//! the name of its family ([`Arch`]). Reading `config.json` is the families'
//! business (`crate::families`: the shared keys, one small file per family, the dispatch).

/// A model family tallow implements, as HF names it: the class in `architectures[0]` and the
/// `model_type`. Which families exist, and how each reads `config.json`, is the registration in
/// `crate::families` (`Arch::from_hf` and `Arch::supported` live there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    pub class: &'static str,
    pub model_type: &'static str,
}

impl Arch {
    /// The HF class name, written into configs tallow saves.
    pub fn hf_class(&self) -> &'static str {
        self.class
    }
}

/// How rotary frequencies are rescaled for long context (`rope_scaling` in config.json).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 / 3.2: frequencies rescaled by wavelength band.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Positions divided by `factor` (equivalently, every frequency divided by it).
    Linear { factor: f64 },
}

/// The MLP's activation (`hidden_act`, Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SwiGLU: silu(gate) * up (Llama, Mistral, Qwen).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of gelu (`gelu_pytorch_tanh`, Gemma).
    GeluTanh,
}

/// Where a family leaves the Llama layout (Gemma 2); all off (`Default`) for the others.
/// transformers `modeling_gemma2.py` is the reference for each one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Variant {
    pub act: Activation,
    /// RMSNorm weights stored as an offset from 1: `x_normed * (1 + w)`, the product in f32 and
    /// then cast (Gemma's `Gemma2RMSNorm`).
    pub norm_plus_one: bool,
    /// Four norms per layer: `post_attention_layernorm` normalizes the attention OUTPUT before
    /// the residual add, and `pre_feedforward_layernorm` / `post_feedforward_layernorm` wrap the
    /// MLP (Gemma 2).
    pub sandwich_norms: bool,
    /// Embeddings multiplied by sqrt(hidden_size), the factor rounded to the compute dtype first
    /// (`torch.tensor(hidden_size**0.5, dtype=hidden.dtype)`).
    pub embed_scale: bool,
    /// Attention scale `query_pre_attn_scalar ** -0.5` instead of `head_dim ** -0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores soft-capped before the mask: `cap * tanh(scores / cap)`.
    pub attn_logit_softcapping: Option<f64>,
    /// Logits soft-capped the same way before the loss / sampling.
    pub final_logit_softcapping: Option<f64>,
    /// Layers that attend to every earlier token although `sliding_window` is set (Gemma 2's
    /// `full_attention` layers; the others slide).
    pub full_attention_layers: Vec<usize>,
}

/// Everything the decoder needs, checked. Built only by the family files' `into_config()`.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Bias on q/k/v projections (Qwen2 always; Llama when `attention_bias`); o_proj follows
    /// `o_bias`.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Qwen3: RMSNorm over each head of q and k before rotary embedding.
    pub qk_norm: bool,
    pub tie_word_embeddings: bool,
    /// Mistral-style sliding-window attention: a token sees at most this many previous tokens.
    pub sliding_window: Option<usize>,
    /// Gemma 2's departures from the Llama layout (none for the other families).
    pub variant: Variant,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw config.json, kept so that saved models carry every key the user had.
    pub raw: serde_json::Value,
}

impl DecoderConfig {
    /// The sliding window of layer `layer`: `sliding_window`, except on the layers the family
    /// makes full-attention (Gemma 2's global layers).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        if self.variant.full_attention_layers.contains(&layer) {
            None
        } else {
            self.sliding_window
        }
    }

    /// The attention's scale on q kᵀ: `query_pre_attn_scalar ** -0.5` (Gemma 2) or
    /// `head_dim ** -0.5`.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self
            .variant
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// `config.json` for a model tallow writes (merge, full fine-tuning): the source's keys, with
    /// the rotary settings in both layouts (transformers 4 reads `rope_theta` / `rope_scaling`,
    /// transformers 5 prefers `rope_parameters`) and the weights' dtype under both names
    /// (`torch_dtype`, `dtype`), so either major loads the same model. A source's per-layer-type
    /// `rope_parameters` is kept as it is (it agrees with the rest: checked on load);
    /// `quantization_config` is dropped (the weights written are dense).
    pub fn to_hf_json(&self, dtype: candle_core::DType) -> serde_json::Value {
        let mut cfg = self.raw.clone();
        let Some(obj) = cfg.as_object_mut() else {
            return cfg;
        };
        let dtype = match dtype {
            candle_core::DType::BF16 => "bfloat16",
            candle_core::DType::F16 => "float16",
            _ => "float32",
        };
        obj.insert("torch_dtype".into(), dtype.into());
        obj.insert("dtype".into(), dtype.into());
        obj.remove("quantization_config");
        let num = |x: f64| -> serde_json::Value {
            if x.fract() == 0.0 && x.abs() < 1e15 {
                (x as i64).into()
            } else {
                x.into()
            }
        };
        let (kind, mut params) = match &self.rope_scaling {
            None => ("default", serde_json::Map::new()),
            Some(RopeScaling::Linear { factor }) => {
                let mut m = serde_json::Map::new();
                m.insert("factor".into(), (*factor).into());
                ("linear", m)
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let mut m = serde_json::Map::new();
                m.insert("factor".into(), (*factor).into());
                m.insert("low_freq_factor".into(), (*low_freq_factor).into());
                m.insert("high_freq_factor".into(), (*high_freq_factor).into());
                m.insert(
                    "original_max_position_embeddings".into(),
                    num(*original_max_position_embeddings),
                );
                ("llama3", m)
            }
        };
        params.insert("rope_type".into(), kind.into());
        obj.insert(
            "rope_scaling".into(),
            if self.rope_scaling.is_some() {
                params.clone().into()
            } else {
                serde_json::Value::Null
            },
        );
        obj.insert("rope_theta".into(), self.rope_theta.into());
        if obj.get("rope_parameters").is_none_or(|p| p.is_null()) {
            params.insert("rope_theta".into(), self.rope_theta.into());
            obj.insert("rope_parameters".into(), params.into());
        }
        cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use serde_json::{json, Value};
    use std::path::Path;

    fn parse(v: &Value) -> Result<DecoderConfig> {
        DecoderConfig::from_json_str(&v.to_string(), Path::new("m/config.json"))
    }

    fn base(arch: &str, model_type: &str) -> Value {
        json!({
            "architectures": [arch], "model_type": model_type, "vocab_size": 100,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
        })
    }

    fn with(mut v: Value, extra: Value) -> Value {
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    const FAMILIES: [(&str, &str); 3] = [
        ("LlamaForCausalLM", "llama"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
    ];

    /// Each rope type tallow supports, as transformers 4 writes it (top-level `rope_theta`,
    /// `rope_scaling`, `torch_dtype`) and as transformers 5 does (`rope_parameters`, `dtype`),
    /// single and per layer type: the same settings for every family.
    #[test]
    fn rope_settings_read_the_same_from_both_layouts() {
        let llama3 = json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
        let cases: Vec<(&str, Value, Option<RopeScaling>)> = vec![
            ("default", json!({}), None),
            (
                "linear",
                json!({"factor": 2.5}),
                Some(RopeScaling::Linear { factor: 2.5 }),
            ),
            (
                "llama3",
                llama3.clone(),
                Some(RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 64.0,
                }),
            ),
        ];
        for (arch, mt) in FAMILIES {
            for (kind, params, want) in &cases {
                let mut scaling = params.clone();
                scaling["rope_type"] = json!(kind);
                let v4 = with(
                    base(arch, mt),
                    json!({"rope_theta": 5e5, "torch_dtype": "float32",
                        "rope_scaling": if *kind == "default" { Value::Null } else { scaling.clone() }}),
                );
                let mut v5_params = scaling.clone();
                v5_params["rope_theta"] = json!(5e5);
                let v5 = with(
                    base(arch, mt),
                    json!({"rope_parameters": v5_params.clone(), "dtype": "float32"}),
                );
                let v5_per_type = with(
                    base(arch, mt),
                    json!({"rope_parameters": {"full_attention": v5_params.clone()},
                        "layer_types": ["full_attention", "full_attention"]}),
                );
                // the older `type` key of rope_scaling
                let mut old_type = params.clone();
                old_type["type"] = json!(kind);
                let v4_type = with(
                    base(arch, mt),
                    json!({"rope_theta": 5e5,
                        "rope_scaling": if *kind == "default" { Value::Null } else { old_type }}),
                );
                // both layouts present and agreeing (what tallow itself writes)
                let both = with(v4.clone(), json!({"rope_parameters": v5_params.clone()}));
                for (layout, v) in [
                    ("v4", &v4),
                    ("v4 type", &v4_type),
                    ("v5", &v5),
                    ("v5 per layer type", &v5_per_type),
                    ("both", &both),
                ] {
                    let c = parse(v).unwrap_or_else(|e| panic!("{mt} {kind} {layout}: {e}"));
                    assert_eq!(c.rope_theta, 5e5, "{mt} {kind} {layout}");
                    assert_eq!(&c.rope_scaling, want, "{mt} {kind} {layout}");
                }
            }
            // the default theta when neither layout gives one
            assert_eq!(parse(&base(arch, mt)).unwrap().rope_theta, 10000.0);
        }
    }

    #[test]
    fn rope_layouts_that_disagree_or_are_not_implemented_are_refused_by_name() {
        for (arch, mt) in FAMILIES {
            let refused = |extra: Value, needles: &[&str]| {
                let e = parse(&with(base(arch, mt), extra.clone()))
                    .err()
                    .unwrap_or_else(|| panic!("{mt}: {extra} was accepted"))
                    .to_string();
                assert!(e.contains("m/config.json"), "{e}");
                for n in needles {
                    assert!(e.contains(n), "{mt}: `{n}` not in: {e}");
                }
            };
            refused(
                json!({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
                &["`rope_parameters`", "rope_theta", "disagree", "stale"],
            );
            refused(
                json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}),
                &["`rope_parameters`", "`yarn`", "default, llama3, linear"],
            );
            refused(
                json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                &["`rope_scaling`", "`dynamic`"],
            );
            refused(
                json!({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}),
                &["`rope_parameters`", "needs a number `factor`"],
            );
            refused(
                json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                    "partial_rotary_factor": 0.5}}),
                &["partial_rotary_factor"],
            );
            refused(
                json!({"layer_types": ["full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
                &["`layer_types`", "`sliding_attention`"],
            );
            refused(
                json!({"rope_parameters": {"sliding_attention": {"rope_type": "default"}}}),
                &["`rope_parameters`", "`full_attention`"],
            );
            refused(
                json!({"layer_types": ["full_attention"]}),
                &["`layer_types`", "1 entries"],
            );
            refused(
                json!({"attention_dropout": 0.1}),
                &["`attention_dropout`", "0.1"],
            );
            refused(
                json!({"attn_logit_softcapping": 50.0}),
                &["`attn_logit_softcapping`", "not implemented", "50.0"],
            );
            refused(
                json!({"is_encoder_decoder": true}),
                &["`is_encoder_decoder`"],
            );
        }
    }

    #[test]
    fn mistral_layer_types_follow_its_window() {
        let m = with(
            base("MistralForCausalLM", "mistral"),
            json!({"sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention"],
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        );
        let c = parse(&m).unwrap();
        assert_eq!((c.sliding_window, c.rope_theta), (Some(8), 1e6));
        // HF's default window when the key is absent; null is full attention
        let absent = parse(&base("MistralForCausalLM", "mistral")).unwrap();
        assert_eq!(absent.sliding_window, Some(4096));
        let null = with(
            base("MistralForCausalLM", "mistral"),
            json!({"sliding_window": null}),
        );
        assert_eq!(parse(&null).unwrap().sliding_window, None);
        // a Llama has no window to set
        let llama = with(
            base("LlamaForCausalLM", "llama"),
            json!({"sliding_window": 8}),
        );
        let e = parse(&llama).unwrap_err().to_string();
        assert!(e.contains("`sliding_window`"), "{e}");
        let bad = with(
            m,
            json!({"layer_types": ["full_attention", "full_attention"]}),
        );
        let e = parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("`layer_types`") && e.contains("`full_attention`"),
            "{e}"
        );
    }
}
