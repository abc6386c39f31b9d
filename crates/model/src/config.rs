//! The checked model configuration that the shared decoder runs from, and the dispatch from
//! `config.json` to the per-family raw configs (`llama.rs`, `qwen2.rs`, `qwen3.rs`).
//!
//! Each family file holds a serde struct whose fields are the HF `config.json` keys word for word
//! (raw, with HF's defaults) and an `into_config()` that validates it into [`DecoderConfig`].

use std::path::Path;

use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::hf_keys::{check_keys, HfConfig};
use crate::{llama, qwen2, qwen3};

/// The model families tallow implements, with the HF class names that select them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub const SUPPORTED: &'static str =
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

    fn from_hf(architecture: Option<&str>, model_type: Option<&str>) -> Option<Self> {
        match architecture {
            Some("LlamaForCausalLM") => return Some(Self::Llama),
            Some("MistralForCausalLM") => return Some(Self::Mistral),
            Some("Qwen2ForCausalLM") => return Some(Self::Qwen2),
            Some("Qwen3ForCausalLM") => return Some(Self::Qwen3),
            Some(_) => return None,
            None => {}
        }
        match model_type {
            Some("llama") => Some(Self::Llama),
            Some("mistral") => Some(Self::Mistral),
            Some("qwen2") => Some(Self::Qwen2),
            Some("qwen3") => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// The HF class name, written into configs tallow saves.
    pub fn hf_class(&self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
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
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw config.json, kept so that saved models carry every key the user had.
    pub raw: serde_json::Value,
}

/// `quantization_config` of a pre-quantized checkpoint: bitsandbytes 4-bit (nf4) is read
/// (`*-bnb-4bit` repos); anything else (8-bit, GPTQ, AWQ, ...) is refused by name.
fn check_quantization_config(raw: &serde_json::Value, path: &Path) -> Result<()> {
    let Some(q) = raw.get("quantization_config") else {
        return Ok(());
    };
    let bad = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: "quantization_config".into(),
        msg,
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    if method != "bitsandbytes" {
        return Err(bad(format!(
            "quant_method `{method}` is not supported; tallow reads bitsandbytes 4-bit (nf4) \
             checkpoints, or quantizes an unquantized one itself (--quantize nf4)"
        )));
    }
    if q.get("load_in_8bit").and_then(|v| v.as_bool()) == Some(true) {
        return Err(bad(
            "bitsandbytes 8-bit (LLM.int8) checkpoints are not supported; use the unquantized \
             model, or --quantize nf4"
                .into(),
        ));
    }
    let qt = q.get("bnb_4bit_quant_type").and_then(|v| v.as_str());
    if qt.is_some_and(|t| t != "nf4") {
        return Err(bad(format!(
            "bnb_4bit_quant_type `{}` is not supported; tallow reads nf4 only",
            qt.unwrap_or("")
        )));
    }
    Ok(())
}

/// Checks every key of `raw` against family `T` (read, ignored or refused by name), then reads
/// the family struct.
fn parse<T: HfConfig>(raw: &serde_json::Value, path: &Path) -> Result<T> {
    check_keys::<T>(raw, path)?;
    T::deserialize(raw).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        key: "(config.json)".into(),
        msg: e.to_string(),
    })
}

impl DecoderConfig {
    /// Reads `dir/config.json` and validates it for its family.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let architecture = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str());
        let model_type = raw.get("model_type").and_then(|m| m.as_str());
        let arch = Arch::from_hf(architecture, model_type).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: architecture.or(model_type).unwrap_or("<none>").to_string(),
                supported: Arch::SUPPORTED.to_string(),
            }
        })?;
        check_quantization_config(&raw, path)?;
        let cfg = match arch {
            Arch::Llama | Arch::Mistral => {
                parse::<llama::LlamaConfig>(&raw, path)?.into_config(arch, path)?
            }
            Arch::Qwen2 => parse::<qwen2::Qwen2Config>(&raw, path)?.into_config(path)?,
            Arch::Qwen3 => parse::<qwen3::Qwen3Config>(&raw, path)?.into_config(path)?,
        };
        Ok(DecoderConfig { raw, ..cfg })
    }

    /// Every tensor of an HF checkpoint of this config, with its name and shape, in file order
    /// (what `CausalLM::from_weights` reads): for tools and self-tests that make random models.
    pub fn hf_tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (hs, d) = (self.hidden_size, self.head_dim);
        let (q, kv, i) = (
            self.num_attention_heads * d,
            self.num_key_value_heads * d,
            self.intermediate_size,
        );
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, hs],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let lin = [
                ("self_attn.q_proj", q, hs, self.qkv_bias),
                ("self_attn.k_proj", kv, hs, self.qkv_bias),
                ("self_attn.v_proj", kv, hs, self.qkv_bias),
                ("self_attn.o_proj", hs, q, self.o_bias),
                ("mlp.gate_proj", i, hs, self.mlp_bias),
                ("mlp.up_proj", i, hs, self.mlp_bias),
                ("mlp.down_proj", hs, i, self.mlp_bias),
            ];
            for (n, o, inp, bias) in lin {
                out.push((format!("{p}.{n}.weight"), vec![o, inp]));
                if bias {
                    out.push((format!("{p}.{n}.bias"), vec![o]));
                }
            }
            if self.qk_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
                out.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
            }
            out.push((format!("{p}.input_layernorm.weight"), vec![hs]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![hs]));
        }
        out.push(("model.norm.weight".into(), vec![hs]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".into(), vec![self.vocab_size, hs]));
        }
        out
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

    /// Number of parameters of the full model (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.o_bias {
            attn += h;
        }
        if self.qk_norm {
            attn += 2 * self.head_dim;
        }
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layer = attn + mlp + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

/// Shared helpers for the family files.
pub(crate) mod raw {
    use super::*;

    /// `eos_token_id` is an int, a list of ints, or null in HF configs.
    #[derive(Debug, Clone, Deserialize, Default)]
    #[serde(untagged)]
    pub enum TokenIds {
        One(u32),
        Many(Vec<u32>),
        #[default]
        None,
    }

    impl TokenIds {
        pub fn into_vec(self) -> Vec<u32> {
            match self {
                TokenIds::One(i) => vec![i],
                TokenIds::Many(v) => v,
                TokenIds::None => vec![],
            }
        }
    }

    /// The rotary keys of a family struct, as read (both transformers layouts and `layer_types`).
    pub struct RotaryKeys<'a> {
        pub rope_theta: Option<f64>,
        pub rope_scaling: &'a Option<serde_json::Value>,
        pub rope_parameters: &'a Option<serde_json::Value>,
        pub layer_types: &'a Option<Vec<String>>,
        pub num_hidden_layers: usize,
    }

    /// transformers' default `rope_theta` for Llama, Mistral, Qwen2 and Qwen3.
    pub const DEFAULT_THETA: f64 = 10000.0;

    /// `layer_types` checked against the types `family` runs (`allowed`), then the rotary theta
    /// and scaling from whichever layout the config has (see [`rope`]).
    pub fn rotary(
        keys: RotaryKeys,
        allowed: &[&str],
        family: &str,
        path: &Path,
    ) -> Result<(f64, Option<RopeScaling>)> {
        let types = layer_types(
            keys.layer_types,
            keys.num_hidden_layers,
            allowed,
            family,
            path,
        )?;
        rope(
            keys.rope_theta,
            keys.rope_scaling,
            keys.rope_parameters,
            &types,
            DEFAULT_THETA,
            path,
        )
    }

    /// The rotary settings, read from either layout transformers writes:
    /// - transformers 4: top-level `rope_theta` and `rope_scaling` (null, or an object with
    ///   `rope_type`, or the older `type`, and the type's parameters);
    /// - transformers 5: `rope_parameters`, one object with `rope_type`, `rope_theta` and the
    ///   type's parameters, or one such object per layer type
    ///   (`{"full_attention": {...}, "sliding_attention": {...}}`).
    ///
    /// `layer_types` are the layer types this model has (each one's parameters must agree:
    /// tallow runs one rotary table). When both layouts are present they must agree.
    pub fn rope(
        rope_theta: Option<f64>,
        rope_scaling: &Option<serde_json::Value>,
        rope_parameters: &Option<serde_json::Value>,
        layer_types: &[String],
        default_theta: f64,
        path: &Path,
    ) -> Result<(f64, Option<RopeScaling>)> {
        let legacy_scaling = match rope_scaling {
            Some(v) if !v.is_null() => Some(rope_object(v, "rope_scaling", path)?),
            _ => None,
        };
        let legacy = (
            rope_theta
                .or(legacy_scaling.as_ref().and_then(|r| r.theta))
                .unwrap_or(default_theta),
            legacy_scaling.and_then(|r| r.scaling),
        );
        let Some(params) = rope_parameters.as_ref().filter(|v| !v.is_null()) else {
            return Ok(legacy);
        };
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: "rope_parameters".into(),
            msg,
        };
        let is_single = params.as_object().is_some_and(|o| {
            o.contains_key("rope_type") || o.contains_key("type") || o.contains_key("rope_theta")
        });
        let parsed = if is_single {
            rope_object(params, "rope_parameters", path)?
        } else {
            // One object per layer type: the types this model has must all agree.
            let obj = params
                .as_object()
                .ok_or_else(|| err(format!("expected an object, found {params}")))?;
            let mut seen: Option<(String, RopeObject)> = None;
            for t in layer_types {
                let v = obj.get(t).ok_or_else(|| {
                    err(format!(
                        "no rotary parameters for layer type `{t}` (has: {})",
                        obj.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                })?;
                let r = rope_object(v, &format!("rope_parameters.{t}"), path)?;
                match &seen {
                    Some((first, r0)) if *r0 != r => {
                        return Err(err(format!(
                            "layer types `{first}` and `{t}` have different rotary parameters; \
                             tallow runs one rotary table for every layer of this family"
                        )))
                    }
                    Some(_) => {}
                    None => seen = Some((t.clone(), r)),
                }
            }
            seen.map(|(_, r)| r)
                .ok_or_else(|| err("the model has no layer types".into()))?
        };
        let theta = parsed.theta.or(rope_theta).unwrap_or(default_theta);
        let new = (theta, parsed.scaling);
        let has_legacy =
            rope_theta.is_some() || rope_scaling.as_ref().is_some_and(|v| !v.is_null());
        if has_legacy && new != legacy {
            return Err(err(format!(
                "this key (transformers 5) and `rope_theta` / `rope_scaling` (transformers 4) \
                 disagree: theta {} with {:?} here, theta {} with {:?} there; remove the stale one",
                new.0, new.1, legacy.0, legacy.1
            )));
        }
        Ok(new)
    }

    /// One rotary-parameter object: `rope_type` (or `type`; absent = default), an optional
    /// `rope_theta`, and the type's own numbers.
    #[derive(Debug, Clone, PartialEq)]
    pub struct RopeObject {
        pub theta: Option<f64>,
        pub scaling: Option<RopeScaling>,
    }

    fn rope_object(v: &serde_json::Value, key: &str, path: &Path) -> Result<RopeObject> {
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: key.into(),
            msg,
        };
        let obj = v
            .as_object()
            .ok_or_else(|| err(format!("expected an object, found {v}")))?;
        let kind = match obj.get("rope_type").or_else(|| obj.get("type")) {
            Some(t) => t
                .as_str()
                .ok_or_else(|| err(format!("`rope_type` must be a string, found {t}")))?,
            None if key == "rope_scaling" => return Err(err("no `rope_type`".into())),
            None => "default",
        };
        let num = |k: &str| {
            obj.get(k)
                .and_then(|x| x.as_f64())
                .ok_or_else(|| err(format!("`{kind}` scaling needs a number `{k}`")))
        };
        let theta = match obj.get("rope_theta") {
            None => None,
            Some(t) => Some(
                t.as_f64()
                    .ok_or_else(|| err(format!("`rope_theta` must be a number, found {t}")))?,
            ),
        };
        // transformers 5 keeps a partial rotary fraction here; the Llama / Qwen layout rotates
        // the whole head.
        if let Some(f) = obj.get("partial_rotary_factor") {
            if f.as_f64() != Some(1.0) {
                return Err(err(format!(
                    "`partial_rotary_factor` {f} is not supported (tallow rotates the whole head)"
                )));
            }
        }
        let scaling = match kind {
            "default" => None,
            "llama3" => Some(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            }),
            "linear" => Some(RopeScaling::Linear {
                factor: num("factor")?,
            }),
            other => {
                return Err(err(format!(
                    "rope type `{other}` is not supported (supported: default, llama3, linear)"
                )))
            }
        };
        Ok(RopeObject { theta, scaling })
    }

    /// `layer_types` (transformers >= 4.56 writes it for some families, 5.x for most): one entry
    /// per layer; `allowed` are the types this family runs. Absent: every layer `full_attention`.
    pub fn layer_types(
        types: &Option<Vec<String>>,
        num_layers: usize,
        allowed: &[&str],
        family: &str,
        path: &Path,
    ) -> Result<Vec<String>> {
        let Some(types) = types else {
            return Ok(vec!["full_attention".to_string()]);
        };
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: "layer_types".into(),
            msg,
        };
        if types.len() != num_layers {
            return Err(err(format!(
                "has {} entries but num_hidden_layers is {num_layers}",
                types.len()
            )));
        }
        let mut distinct: Vec<String> = Vec::new();
        for t in types {
            if !allowed.contains(&t.as_str()) {
                return Err(err(format!(
                    "layer type `{t}` is not supported by tallow's {family} (supported: {})",
                    allowed.join(", ")
                )));
            }
            if !distinct.contains(t) {
                distinct.push(t.clone());
            }
        }
        Ok(distinct)
    }

    /// `attention_dropout`: transformers drops attention probabilities while training; tallow's
    /// attention has no dropout, so only 0 is accepted.
    pub fn check_attention_dropout(p: f64, path: &Path) -> Result<()> {
        if p != 0.0 {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: "attention_dropout".into(),
                msg: format!(
                    "{p} is not supported (tallow's attention has no dropout); set it to 0.0 \
                     (LoRA dropout is `lora.dropout` in the training config)"
                ),
            });
        }
        Ok(())
    }

    pub fn check_act(act: &str, path: &Path) -> Result<()> {
        if act != "silu" {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: "hidden_act".into(),
                msg: format!("`{act}` is not supported (only `silu`)"),
            });
        }
        Ok(())
    }

    pub fn check_heads(hidden: usize, heads: usize, kv: usize, path: &Path) -> Result<()> {
        let err = |key: &str, msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: key.into(),
            msg,
        };
        if heads == 0 || kv == 0 || hidden == 0 {
            return Err(err("num_attention_heads", "sizes must be positive".into()));
        }
        if !heads.is_multiple_of(kv) {
            return Err(err(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads {heads}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

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
