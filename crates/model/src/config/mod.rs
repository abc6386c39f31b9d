//! The checked model configuration that the shared decoder runs from ([`DecoderConfig`]), and
//! the name of its family ([`Arch`]). Reading `config.json` is the families'
//! business (`crate::families`: the shared keys, one small file per family, the dispatch).

pub mod hf_keys;
pub mod layout;

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
    /// Phi-3 / 3.5 / 4-mini LongRoPE (`longrope`, formerly `su`; arXiv:2402.13753): each
    /// frequency divided by its own factor, `short_factor` while a sequence fits
    /// `original_max_position_embeddings`, `long_factor` beyond it (transformers'
    /// `_compute_longrope_parameters` and the `dynamic_rope_update` that picks the list:
    /// long when max(position_ids) + 1 > original_max_position_embeddings, in 4.57 and 5.x
    /// alike), and cos / sin multiplied by `attention_factor`
    /// (sqrt(1 + ln(max_position_embeddings / original) / ln(original)), 1 when that ratio
    /// is <= 1). One factor per rotary frequency (rotary dim / 2).
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
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

/// Where a family leaves the Llama layout (Gemma 2, Gemma 3); all off (`Default`) for the
/// others. transformers `modeling_gemma2.py` / `modeling_gemma3.py` are the reference for each
/// one.
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
    /// and Gemma 3's `full_attention` layers; the others slide).
    pub full_attention_layers: Vec<usize>,
    /// Gemma 3: the sliding layers' rotary theta (`rope_local_base_freq`, transformers 5's
    /// `rope_parameters.sliding_attention`), with no scaling; `rope_theta` and `rope_scaling`
    /// are the full-attention layers' only. None: one rotary table for every layer.
    pub rope_local_base_freq: Option<f64>,
}

/// A mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router (`gate`, E x C) picks
/// `top_k` of `num_experts` gated MLPs per token (`crate::decoder::moe`). transformers
/// `modeling_qwen3_moe.py` / `modeling_mixtral.py` (4.57 and 5.x) are the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    /// E: `num_experts` (Qwen3-MoE), `num_local_experts` (Mixtral).
    pub num_experts: usize,
    /// K: `num_experts_per_tok`.
    pub top_k: usize,
    /// Each expert's intermediate size: `moe_intermediate_size` (Qwen3-MoE), Mixtral's
    /// `intermediate_size`.
    pub expert_size: usize,
    /// The K chosen probabilities renormalized to sum to 1 (`norm_topk_prob`; Mixtral always).
    pub norm_topk_prob: bool,
    /// Layers that keep a dense MLP of `intermediate_size` (Qwen3-MoE's `mlp_only_layers`).
    pub dense_layers: Vec<usize>,
    /// Every `sparse_step`-th layer is sparse (Qwen3-MoE's `decoder_sparse_step`; 1: all).
    pub sparse_step: usize,
    /// `output_router_logits`: the training loss adds `router_aux_loss_coef` times the
    /// load-balancing loss (transformers' `load_balancing_loss_func`), as transformers does
    /// when it is set.
    pub output_router_logits: bool,
    pub router_aux_loss_coef: f64,
    /// The tensor names of the family's per-expert layout (transformers 4.57, and what
    /// transformers 5 saves by default).
    pub names: MoeNames,
    /// Qwen2-MoE: a shared expert of this intermediate size that every token goes through,
    /// its output scaled by sigmoid(`shared_expert_gate`(x)) and added to the routed ones.
    pub shared_expert_size: Option<usize>,
}

/// Where a family's sparse block and its experts' linears live inside a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeNames {
    /// The block's path in the 4.57 layout (`mlp`, Mixtral's `block_sparse_moe`); transformers
    /// 5's fused layout always says `mlp`.
    pub block: &'static str,
    /// Each expert's gate, up and down projections (`gate_proj`, ..., Mixtral's `w1`, `w3`,
    /// `w2`).
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl Moe {
    /// Whether decoder layer `layer` is sparse: transformers' test in
    /// `Qwen3MoeDecoderLayer.__init__` (Mixtral: every layer).
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.dense_layers.contains(&layer)
            && self.num_experts > 0
            && self.sparse_step > 0
            && (layer + 1).is_multiple_of(self.sparse_step)
    }

    /// The linears of one routed expert, [`MoeNames::linears`] of `expert_size`.
    pub fn expert_linears(&self, hidden: usize) -> [(&'static str, usize, usize); 3] {
        self.names.linears(self.expert_size, hidden)
    }
}

impl MoeNames {
    /// The linears of one gated MLP of width `width` (an expert, Qwen2-MoE's shared expert),
    /// (name, out, in): gate and up (width x C), down (C x width), in the order the 4.57
    /// layout lists them.
    pub fn linears(&self, width: usize, hidden: usize) -> [(&'static str, usize, usize); 3] {
        [
            (self.gate, width, hidden),
            (self.up, width, hidden),
            (self.down, hidden, width),
        ]
    }
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
    /// Qwen3 and Gemma 3: RMSNorm over each head of q and k before rotary embedding (Gemma 3's
    /// with `(1 + w)`, `Variant::norm_plus_one`).
    pub qk_norm: bool,
    /// Phi-3: q, k, v in one `qkv_proj` and gate, up in one `gate_up_proj` (see
    /// [`crate::config::layout`]).
    pub fused_projections: bool,
    /// The leading dims of each head that rotary embedding rotates: head_dim, or
    /// head_dim * `partial_rotary_factor` (Phi-4-mini: 0.75); the rest pass through.
    pub rotary_dim: usize,
    pub tie_word_embeddings: bool,
    /// Mistral-style sliding-window attention: a token sees at most this many previous tokens.
    pub sliding_window: Option<usize>,
    /// Gemma 2's departures from the Llama layout (none for the other families).
    pub variant: Variant,
    /// A mixture-of-experts model's sparse blocks (None: every layer a dense MLP).
    pub moe: Option<Moe>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint is an image-text model's (`Gemma3ForConditionalGeneration`) and tallow
    /// runs its text tower: weights under `language_model.model.*` (transformers <= 4.49
    /// saves) or `model.language_model.*` (later ones), the vision tower's not read, PEFT
    /// names under `model.language_model` (`crate::peft`). `raw` is then the tower's
    /// `Gemma3ForCausalLM` config, which is what merge and full fine-tuning write.
    pub text_tower: bool,
    /// A bitsandbytes 4-bit checkpoint (`quantization_config` with `load_in_4bit`): its decoder
    /// linears load as NF4 whatever `model.quantize` says, and the estimate counts them so.
    pub prequantized: Option<PreQuantized>,
    /// A GGUF checkpoint's decoder linear weights stored in a block format: HF name
    /// (`model.layers.0.mlp.down_proj.weight`) -> bytes in the file
    /// (`crate::io::gguf::block_bytes`), what `model.quantize = "keep"` holds. Not in
    /// config.json: set by whoever read the file (the estimate).
    pub stored_blocks: Option<std::collections::BTreeMap<String, u64>>,
    /// The keys tallow ignored: for the note at load ([`KeyNote::line`]).
    pub keys: KeyNote,
    /// The raw config.json, kept so that saved models carry every key the user had (less the
    /// ones `model.ignore_config_keys` dropped).
    pub raw: serde_json::Value,
}

/// What `quantization_config` of a bitsandbytes 4-bit checkpoint says about the stored weights.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PreQuantized {
    /// `bnb_4bit_use_double_quant`: the per-block scales are 8-bit with an f32 per 256 blocks.
    pub double_quant: bool,
    /// `llm_int8_skip_modules`: modules stored unquantized (`lm_head`, and in unsloth's
    /// "dynamic" repos whole layers' projections, `model.layers.1.mlp`); a linear whose name
    /// contains one of them is dense.
    pub skip_modules: Vec<String>,
}

impl PreQuantized {
    /// Whether the decoder linear `name` (`model.layers.3.mlp.down_proj`) is stored in 4 bits.
    /// transformers' bitsandbytes integration skips a module when a skip entry is a substring
    /// of its name.
    pub fn quantizes(&self, name: &str) -> bool {
        !self.skip_modules.iter().any(|m| name.contains(m.as_str()))
    }
}

/// The `config.json` keys that tallow left out of its reading, for one note line at load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyNote {
    /// The file (messages name it).
    pub path: std::path::PathBuf,
    /// The class whose reading decides (`LlamaForCausalLM`).
    pub class: String,
    /// Keys that the class never reads, so they cannot change what it computes (nanotron's
    /// `is_llama_config`, `auto_map`, ...): ignored as transformers ignores them.
    pub unread: Vec<String>,
    /// Keys the user asked to ignore (`model.ignore_config_keys`, `--ignore-config-key`) that
    /// the file has: read as if absent.
    pub dropped: Vec<String>,
    /// Keys the user asked to ignore that the file does not have (a typo, or a stale list).
    pub not_found: Vec<String>,
}

impl KeyNote {
    /// One line for the log, or None when tallow read the file whole.
    pub fn line(&self) -> Option<String> {
        let mut parts = Vec::new();
        if !self.unread.is_empty() {
            parts.push(format!(
                "ignored {} that transformers' {} never reads (so they cannot change what it \
                 computes): {}",
                plural(self.unread.len(), "key"),
                self.class,
                self.unread.join(", ")
            ));
        }
        if !self.dropped.is_empty() {
            parts.push(format!(
                "read as if absent, as `ignore_config_keys` asks: {}",
                self.dropped.join(", ")
            ));
        }
        if !self.not_found.is_empty() {
            parts.push(format!(
                "`ignore_config_keys` names keys the file does not have: {}",
                self.not_found.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| format!("note: {}: {}", self.path.display(), parts.join("; ")))
    }
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
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

    /// The hyper-parameters a GGUF export writes (`crate::io::gguf::write::Hyper`).
    pub fn gguf_hyper(&self) -> crate::io::gguf::write::Hyper {
        use crate::io::gguf::write::{Hyper, HyperRope};
        Hyper {
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate: self.intermediate_size,
            max_positions: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope: match &self.rope_scaling {
                None => HyperRope::None,
                Some(RopeScaling::Linear { factor }) => HyperRope::Linear(*factor),
                Some(RopeScaling::LongRope {
                    short_factor,
                    long_factor,
                    ..
                }) => HyperRope::LongRope {
                    long: long_factor.clone(),
                    short: short_factor.clone(),
                },
                Some(RopeScaling::Llama3 { .. }) => HyperRope::Other("llama3".into()),
            },
            rotary_dim: self.rotary_dim,
            sliding_window: self.sliding_window,
            query_pre_attn_scalar: self.variant.query_pre_attn_scalar,
            attn_logit_softcapping: self.variant.attn_logit_softcapping,
            final_logit_softcapping: self.variant.final_logit_softcapping,
            full_attention_layers: self.variant.full_attention_layers.clone(),
            rope_local_base_freq: self.variant.rope_local_base_freq,
        }
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
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                ..
            }) => {
                let mut m = serde_json::Map::new();
                m.insert("short_factor".into(), short_factor.clone().into());
                m.insert("long_factor".into(), long_factor.clone().into());
                ("longrope", m)
            }
        };
        // transformers 4.57's Phi3Config takes a `rope_scaling` of exactly `type`,
        // `short_factor` and `long_factor` (its `_rope_scaling_validation`); the original
        // context stays the top-level `original_max_position_embeddings` of the source.
        let legacy_key = if kind == "longrope" {
            "type"
        } else {
            "rope_type"
        };
        let mut legacy = params.clone();
        legacy.insert(legacy_key.into(), kind.into());
        params.insert("rope_type".into(), kind.into());
        if let Some(RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        }) = &self.rope_scaling
        {
            params.insert(
                "original_max_position_embeddings".into(),
                (*original_max_position_embeddings).into(),
            );
        }
        if self.rotary_dim != self.head_dim {
            let f = obj
                .get("partial_rotary_factor")
                .cloned()
                .unwrap_or_else(|| (self.rotary_dim as f64 / self.head_dim as f64).into());
            params.insert("partial_rotary_factor".into(), f);
        }
        obj.insert(
            "rope_scaling".into(),
            if self.rope_scaling.is_some() {
                legacy.into()
            } else {
                serde_json::Value::Null
            },
        );
        obj.insert("rope_theta".into(), self.rope_theta.into());
        if obj.get("rope_parameters").is_none_or(|p| p.is_null()) {
            params.insert("rope_theta".into(), self.rope_theta.into());
            let params = match self.variant.rope_local_base_freq {
                // Gemma 3 (transformers 5): one object per layer type, the sliding layers'
                // unscaled
                Some(local) => serde_json::json!({
                    "full_attention": params,
                    "sliding_attention": {"rope_type": "default", "rope_theta": local},
                }),
                None => params.into(),
            };
            obj.insert("rope_parameters".into(), params);
        }
        if let Some(local) = self.variant.rope_local_base_freq {
            obj.insert("rope_local_base_freq".into(), local.into()); // transformers 4
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
                json!({"is_encoder_decoder": true}),
                &["`is_encoder_decoder`"],
            );
            refused(
                json!({"partial_rotary_factor": 0.5}),
                &["`partial_rotary_factor` = 0.5", "rotary init", "1.0 only"],
            );
            // every offending key of the file in one message
            refused(
                json!({"attention_dropout": 0.1, "rope_scaling": {"rope_type": "yarn",
                    "factor": 4.0}, "is_causal": false, "hidden_act": "relu"}),
                &[
                    "these 4 keys",
                    "`attention_dropout` = 0.1",
                    "`rope_scaling` = {",
                    "`yarn`",
                    "`is_causal` = false",
                    "`hidden_act` = \"relu\"",
                    "model.ignore_config_keys",
                ],
            );
            // A key another family reads (Gemma 2's soft-cap) that this family's transformers
            // class never reads: ignored as transformers ignores it, and named in the note.
            let c = parse(&with(
                base(arch, mt),
                json!({"attn_logit_softcapping": 50.0, "is_llama_config": true}),
            ))
            .unwrap();
            assert_eq!(c.variant.attn_logit_softcapping, None, "{mt}");
            assert_eq!(c.keys.unread, ["attn_logit_softcapping", "is_llama_config"]);
            let note = c.keys.line().unwrap();
            assert!(
                note.contains("m/config.json")
                    && note.contains(arch)
                    && note.contains("never reads"),
                "{note}"
            );
            // a key the user asks to ignore is read as absent, and the note says so
            let v = with(base(arch, mt), json!({"attention_dropout": 0.1}));
            let ignore = ["attention_dropout".to_string(), "no_such_key".to_string()];
            let c = DecoderConfig::from_json_str_ignoring(
                &v.to_string(),
                Path::new("m/config.json"),
                &ignore,
            )
            .unwrap();
            assert_eq!(
                (&c.keys.dropped[..], &c.keys.not_found[..]),
                (&ignore[..1], &ignore[1..])
            );
            assert!(c.raw.get("attention_dropout").is_none());
            let note = c.keys.line().unwrap();
            assert!(
                note.contains("attention_dropout") && note.contains("no_such_key"),
                "{note}"
            );
        }
    }

    fn phi3(extra: Value) -> Value {
        with(
            base("Phi3ForCausalLM", "phi3"),
            with(
                json!({"original_max_position_embeddings": 16, "max_position_embeddings": 256,
                    "partial_rotary_factor": 0.5}),
                extra,
            ),
        )
    }

    /// Phi-3's LongRoPE, partial rotary and fused projections, read the same from the 4.57
    /// layout (`rope_scaling` with `type`, top-level original context and partial factor) and
    /// the 5.x one (`rope_parameters` holding both); the attention factor is transformers'
    /// sqrt(1 + ln(256 / 16) / ln(16)) = sqrt(2).
    #[test]
    fn phi3_longrope_reads_the_same_from_both_layouts() {
        // head_dim 16, partial 0.5: 8 rotary dims, 4 factors each
        let (short, long) = (json!([1.0, 1.1, 1.2, 1.3]), json!([2.0, 3.0, 4.0, 5.0]));
        let v4 = phi3(json!({"rope_theta": 1e4,
            "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}}));
        let v5 = phi3(
            json!({"rope_parameters": {"rope_type": "longrope", "type": "longrope",
            "rope_theta": 1e4, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}}),
        );
        let su = phi3(json!({"rope_scaling": {"type": "su", "short_factor": short,
            "long_factor": long}}));
        let want = RopeScaling::LongRope {
            short_factor: vec![1.0, 1.1, 1.2, 1.3],
            long_factor: vec![2.0, 3.0, 4.0, 5.0],
            original_max_position_embeddings: 16,
            attention_factor: 2f64.sqrt(),
        };
        for (layout, v) in [("v4", &v4), ("v5", &v5), ("su", &su)] {
            let c = parse(v).unwrap_or_else(|e| panic!("{layout}: {e}"));
            assert_eq!(c.rope_scaling.as_ref(), Some(&want), "{layout}");
            assert_eq!((c.head_dim, c.rotary_dim), (16, 8), "{layout}");
            assert!(
                c.fused_projections && c.sliding_window.is_none(),
                "{layout}"
            );
            // what tallow writes reads back the same
            let back = parse(&c.to_hf_json(candle_core::DType::F32)).unwrap();
            assert_eq!(back.rope_scaling.as_ref(), Some(&want), "{layout} written");
            assert_eq!(back.rotary_dim, 8, "{layout} written");
        }
        // 4.57's Phi3Config takes exactly `type`, `short_factor`, `long_factor`
        let written = parse(&v5).unwrap().to_hf_json(candle_core::DType::F32);
        let rs = written["rope_scaling"].as_object().unwrap();
        let mut keys: Vec<&str> = rs.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["long_factor", "short_factor", "type"]);
        // max_position_embeddings <= original: no attention factor
        let same = with(v4.clone(), json!({"max_position_embeddings": 16}));
        match parse(&same).unwrap().rope_scaling {
            Some(RopeScaling::LongRope {
                attention_factor, ..
            }) => assert_eq!(attention_factor, 1.0),
            other => panic!("{other:?}"),
        }
        // no rope scaling: plain rope on the rotary dims; embd_pdrop is ignored
        let plain = parse(&phi3(json!({"embd_pdrop": 0.1, "sliding_window": 2047}))).unwrap();
        assert_eq!((plain.rope_scaling, plain.rotary_dim), (None, 8));
        assert_eq!(plain.sliding_window, Some(2047));
    }

    #[test]
    fn phi3_keys_that_change_the_maths_are_refused_by_name() {
        let (short, long) = (json!([1.0, 1.1, 1.2, 1.3]), json!([2.0, 3.0, 4.0, 5.0]));
        let refused = |v: Value, needles: &[&str]| {
            let e = parse(&v)
                .err()
                .unwrap_or_else(|| panic!("{v} was accepted"))
                .to_string();
            for n in needles {
                assert!(e.contains(n), "`{n}` not in: {e}");
            }
        };
        refused(phi3(json!({"resid_pdrop": 0.1})), &["`resid_pdrop`", "0.1"]);
        refused(
            phi3(
                json!({"rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0],
                "long_factor": long}}),
            ),
            &["`rope_scaling`", "`short_factor` has 2 entries", "needs 4"],
        );
        refused(
            phi3(
                json!({"rope_scaling": {"type": "longrope", "short_factor": short,
                "long_factor": long, "attention_factor": 1.5}}),
            ),
            &["`rope_scaling`", "`attention_factor`"],
        );
        refused(
            phi3(
                json!({"rope_parameters": {"rope_type": "longrope", "short_factor": short,
                "long_factor": long, "original_max_position_embeddings": 32}}),
            ),
            &["`rope_parameters`", "32 here and 16 at the top level"],
        );
        refused(
            phi3(json!({"rope_parameters": {"rope_type": "default",
                "partial_rotary_factor": 0.75}})),
            &[
                "`rope_parameters`",
                "`partial_rotary_factor` 0.75",
                "0.5 at the top level",
            ],
        );
        refused(
            phi3(json!({"partial_rotary_factor": 0.3125})), // 5 of 16 dims
            &["`partial_rotary_factor`", "even"],
        );
        refused(phi3(json!({"head_dim": 32})), &["`head_dim`", "Phi-3"]);
        // LongRoPE and partial rotary are Phi-3's: other families refuse them
        refused(
            with(
                base("LlamaForCausalLM", "llama"),
                json!({"rope_scaling": {"type": "longrope", "short_factor": short,
                    "long_factor": long}}),
            ),
            &["`rope_scaling`", "`longrope`", "default, llama3, linear"],
        );
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

    fn gemma3(extra: Value) -> Value {
        with(
            json!({
                "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "sliding_window": 8, "query_pre_attn_scalar": 48,
            }),
            extra,
        )
    }

    /// Gemma 3's two rotary tables and its layer pattern, read the same from the 4.57 layout
    /// (`rope_theta` + `rope_scaling` for the global layers, `rope_local_base_freq`,
    /// `sliding_window_pattern`) and the 5.x one (`rope_parameters` per layer type,
    /// `layer_types`); what tallow writes reads back the same.
    #[test]
    fn gemma3_rope_and_layer_pattern_read_the_same_from_both_layouts() {
        let types = json!([
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention"
        ]);
        let v4 = gemma3(json!({"rope_theta": 1e5, "rope_local_base_freq": 1000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 3}));
        let v4_types = with(v4.clone(), json!({"layer_types": types.clone()}));
        let v5 = gemma3(json!({"layer_types": types.clone(), "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}));
        for (layout, v) in [("v4", &v4), ("v4 layer_types", &v4_types), ("v5", &v5)] {
            let c = parse(v).unwrap_or_else(|e| panic!("{layout}: {e}"));
            let back = parse(&c.to_hf_json(candle_core::DType::F32)).unwrap();
            for (what, c) in [("read", &c), ("written", &back)] {
                assert_eq!(c.rope_theta, 1e5, "{layout} {what}");
                assert_eq!(
                    c.rope_scaling,
                    Some(RopeScaling::Linear { factor: 4.0 }),
                    "{layout} {what}"
                );
                assert_eq!(
                    c.variant.rope_local_base_freq,
                    Some(1000.0),
                    "{layout} {what}"
                );
                assert_eq!(c.variant.full_attention_layers, [2, 5], "{layout} {what}");
                assert_eq!(c.sliding_window, Some(8), "{layout} {what}");
                assert!(c.qk_norm && c.variant.norm_plus_one && c.variant.sandwich_norms);
                assert!(c.tie_word_embeddings && c.variant.embed_scale);
                assert_eq!(c.attention_scale(), 1.0 / 48f64.sqrt());
                assert_eq!(c.layer_window(2), None, "{layout} {what}");
                assert_eq!(c.layer_window(3), Some(8), "{layout} {what}");
            }
        }
        // Gemma3TextConfig's defaults: pattern 6, global theta 1e6, local 1e4, 4 kv heads
        let mut bare = gemma3(json!({}));
        bare.as_object_mut().unwrap().remove("num_key_value_heads");
        let c = parse(&bare).unwrap();
        assert_eq!(c.variant.full_attention_layers, [5]);
        assert_eq!(
            (c.rope_theta, c.variant.rope_local_base_freq),
            (1e6, Some(1e4))
        );
        assert_eq!((c.num_key_value_heads, c.rope_scaling), (4, None));
    }

    #[test]
    fn gemma3_keys_that_change_the_maths_are_refused_by_name() {
        let refused = |v: Value, needles: &[&str]| {
            let e = parse(&v)
                .err()
                .unwrap_or_else(|| panic!("{v} was accepted"))
                .to_string();
            assert!(e.contains("m/config.json"), "{e}");
            for n in needles {
                assert!(e.contains(n), "`{n}` not in: {e}");
            }
        };
        let per_type = |full: Value, sliding: Value| {
            gemma3(
                json!({"rope_parameters": {"full_attention": full, "sliding_attention": sliding}}),
            )
        };
        let plain = json!({"rope_type": "default", "rope_theta": 1e4});
        refused(
            per_type(
                json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                plain.clone(),
            ),
            &["`rope_parameters.full_attention`", "`yarn`"],
        );
        refused(
            gemma3(json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})),
            &["`rope_scaling`", "`dynamic`"],
        );
        refused(
            per_type(
                plain.clone(),
                json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            ),
            &["`rope_parameters.sliding_attention`", "sliding layers"],
        );
        refused(
            with(
                per_type(
                    json!({"rope_type": "default", "rope_theta": 1e6}),
                    plain.clone(),
                ),
                json!({"rope_local_base_freq": 1000.0}),
            ),
            &["`rope_parameters`", "1000", "disagree"],
        );
        refused(
            gemma3(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})),
            &["`rope_parameters`", "`sliding_attention`"],
        );
        refused(
            gemma3(
                json!({"sliding_window_pattern": 2, "layer_types": ["sliding_attention",
                "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                "full_attention"]}),
            ),
            &["`sliding_window_pattern`", "stale"],
        );
        refused(
            gemma3(json!({"sliding_window": null})),
            &["`sliding_window`"],
        );
        refused(
            gemma3(json!({"use_bidirectional_attention": true})),
            &["`use_bidirectional_attention`"],
        );
        refused(
            gemma3(json!({"hidden_activation": "gelu"})),
            &["`hidden_activation`"],
        );
        refused(
            gemma3(json!({"partial_rotary_factor": 0.5})),
            &["`partial_rotary_factor`"],
        );
        refused(
            gemma3(json!({"attention_dropout": 0.1})),
            &["`attention_dropout`"],
        );
    }

    /// `Gemma3ForConditionalGeneration`: its `text_config` read as a `Gemma3ForCausalLM`
    /// config (the 4B's nested config gives a few keys; the rest are Gemma3TextConfig's
    /// defaults), the vision keys ignored, anything else at the top level refused by name.
    #[test]
    fn gemma3_image_text_config_reads_its_text_tower() {
        let cond = json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
            "initializer_range": 0.02, "mm_tokens_per_image": 256, "eos_token_id": [1, 106],
            "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                "model_type": "gemma3_text", "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"},
        });
        let c = parse(&cond).unwrap();
        assert!(c.text_tower);
        assert_eq!(c.arch.hf_class(), "Gemma3ForCausalLM");
        assert_eq!(
            (c.hidden_size, c.num_hidden_layers, c.vocab_size),
            (2560, 34, 262_208)
        );
        assert_eq!(
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            (8, 4, 256)
        );
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(
            (c.rope_theta, c.variant.rope_local_base_freq),
            (1e6, Some(1e4))
        );
        assert_eq!(c.variant.full_attention_layers, [5, 11, 17, 23, 29]);
        // what tallow writes from it is the text-only CausalLM
        let w = c.to_hf_json(candle_core::DType::BF16);
        assert_eq!(w["architectures"], json!(["Gemma3ForCausalLM"]));
        assert_eq!(w["model_type"], json!("gemma3_text"));
        let back = parse(&w).unwrap();
        assert!(!back.text_tower && back.hidden_size == 2560);
        // a top-level key Gemma3Config never reads is ignored and noted; a generic one with a
        // value tallow lacks is refused
        let unread = with(cond.clone(), json!({"audio_config": {}}));
        assert_eq!(parse(&unread).unwrap().keys.unread, ["audio_config"]);
        let bad = with(cond.clone(), json!({"is_encoder_decoder": true}));
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains("`is_encoder_decoder` = true"), "{e}");
        let mut bad = cond;
        bad["text_config"]["rope_scaling"] = json!({"rope_type": "yarn", "factor": 8.0});
        let e = parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("`text_config.rope_scaling`") && e.contains("`yarn`"),
            "{e}"
        );
    }
}
