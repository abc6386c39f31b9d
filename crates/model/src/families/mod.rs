//! The model families: one small file each over the shared keys ([`common`]), and their
//! registration ([`FAMILIES`]), which [`Arch::from_hf`] and [`DecoderConfig::from_json_str`] read.
//!
//! A family file holds a serde struct of the `config.json` keys only it reads (HF's names word
//! for word), its HF class and `model_type`, the keys of its transformers config class it
//! ignores, and a `shape` that checks its keys and gives [`CommonKeys::into_config`] the
//! family's [`FamilyShape`].
//!
//! Adding a Llama-like family: a file here, and its two lines below (`pub mod` and its row in
//! [`FAMILIES`]).

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::config::{Arch, DecoderConfig};
use crate::error::{ModelError, Result};
use crate::hf_keys::{check_keys, field_names, KeyPolicy};

pub mod common;
pub mod gemma2;
pub mod gemma3;
pub mod llama;
pub mod mistral;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;

use common::{CommonKeys, FamilyExtras, FamilyShape};

/// The registration: every family tallow reads, one row each.
pub const FAMILIES: &[Registered] = &[
    register::<llama::LlamaKeys>(),
    register::<mistral::MistralKeys>(),
    register::<qwen2::Qwen2Keys>(),
    register::<qwen3::Qwen3Keys>(),
    register::<gemma2::Gemma2Keys>(),
    register::<phi3::Phi3Keys>(),
    register::<gemma3::Gemma3Keys>(),
];

/// A family's own `config.json` keys (its serde fields), beyond [`CommonKeys`].
pub trait Family: DeserializeOwned {
    /// The family's name in messages ("Llama").
    const FAMILY: &'static str;
    /// Its HF class (`architectures[0]`, "LlamaForCausalLM") and `model_type` ("llama").
    const CLASS: &'static str;
    const MODEL_TYPE: &'static str;
    /// Keys of the family's transformers config class that tallow ignores, each because it
    /// cannot change the output (say why next to it).
    const IGNORED: &'static [&'static str];
    /// Checks the family's keys; the decoder's config is built by
    /// [`CommonKeys::into_config`] from the [`FamilyShape`] this returns.
    fn shape(&self, common: &CommonKeys, path: &Path) -> Result<FamilyShape>;
    /// What the family adds beyond the Llama layout (fused projections, partial rotary,
    /// LongRoPE); nothing by default.
    fn extras(&self) -> FamilyExtras {
        FamilyExtras::default()
    }
    /// The family config class's defaults for shared keys that [`CommonKeys`] requires or
    /// defaults otherwise (a JSON object; keys absent from config.json take these values, as
    /// transformers does). Gemma 3's nested `text_config`s leave most sizes out.
    fn defaults() -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// The keys family `F` reads (the common ones and its own) and ignores.
pub fn policy<F: Family>() -> KeyPolicy {
    let mut read = field_names::<CommonKeys>().to_vec();
    read.extend_from_slice(field_names::<F>());
    KeyPolicy {
        family: F::FAMILY,
        read,
        ignored: F::IGNORED,
    }
}

/// A registered family, as the rest of the crate sees it: its names, and its key policy and
/// parser without naming its type.
pub struct Registered {
    pub arch: Arch,
    policy: fn() -> KeyPolicy,
    parse: fn(&serde_json::Value, &Path) -> Result<DecoderConfig>,
}

const fn register<F: Family>() -> Registered {
    Registered {
        arch: Arch {
            class: F::CLASS,
            model_type: F::MODEL_TYPE,
        },
        policy: policy::<F>,
        parse: parse::<F>,
    }
}

fn registered(arch: Arch) -> &'static Registered {
    FAMILIES
        .iter()
        .find(|f| f.arch == arch)
        .expect("an Arch is only made by the registration")
}

impl Arch {
    /// The family of a config: by its first `architectures` entry, else by `model_type`.
    pub fn from_hf(architecture: Option<&str>, model_type: Option<&str>) -> Option<Self> {
        let found = match architecture {
            Some(a) => FAMILIES.iter().find(|f| f.arch.class == a),
            None => FAMILIES
                .iter()
                .find(|f| Some(f.arch.model_type) == model_type),
        };
        found.map(|f| f.arch)
    }

    /// The class names tallow reads, for messages.
    pub fn supported() -> String {
        let mut classes: Vec<&str> = FAMILIES.iter().map(|f| f.arch.class).collect();
        classes.push(gemma3::CONDITIONAL_CLASS);
        classes.join(", ")
    }
}

/// The key policy of `arch`'s family (what `config.json` keys it reads, ignores, refuses).
pub fn key_policy(arch: Arch) -> KeyPolicy {
    (registered(arch).policy)()
}

/// Checks every key of `raw` against family `F` (read, ignored or refused by name), reads the
/// common keys and the family's own, and builds the config.
fn parse<F: Family>(raw: &serde_json::Value, path: &Path) -> Result<DecoderConfig> {
    check_keys(&policy::<F>(), raw, path)?;
    let bad = |e: serde_json::Error| ModelError::Config {
        path: path.to_path_buf(),
        key: "(config.json)".into(),
        msg: e.to_string(),
    };
    let filled;
    let raw = match (F::defaults(), raw.as_object()) {
        (serde_json::Value::Object(defaults), Some(obj)) => {
            let mut obj = obj.clone();
            for (k, v) in defaults {
                obj.entry(k).or_insert(v);
            }
            filled = serde_json::Value::Object(obj);
            &filled
        }
        _ => raw,
    };
    let common = CommonKeys::deserialize(raw).map_err(bad)?;
    let own = F::deserialize(raw).map_err(bad)?;
    let shape = own.shape(&common, path)?;
    let arch = Arch {
        class: F::CLASS,
        model_type: F::MODEL_TYPE,
    };
    common.into_config(arch, F::FAMILY, shape, own.extras(), path)
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

impl DecoderConfig {
    /// Reads `dir/config.json` and validates it for its family.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        Self::from_json_str(&crate::io::read_text(&path)?, &path)
    }

    /// Parses config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: serde_json::Value = crate::io::parse_json(text, path)?;
        let architecture = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str());
        let model_type = raw.get("model_type").and_then(|m| m.as_str());
        // An image-text Gemma 3: its text tower, as a Gemma3ForCausalLM config.
        let conditional = match architecture {
            Some(a) => a == gemma3::CONDITIONAL_CLASS,
            None => model_type == Some("gemma3"),
        };
        if conditional {
            check_quantization_config(&raw, path)?;
            let text = gemma3::text_config_of(&raw, path)?;
            let cfg = Self::from_json_str(&text.to_string(), path)?;
            return Ok(DecoderConfig {
                text_tower: true,
                ..cfg
            });
        }
        let arch = Arch::from_hf(architecture, model_type).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: architecture.or(model_type).unwrap_or("<none>").to_string(),
                supported: Arch::supported(),
            }
        })?;
        check_quantization_config(&raw, path)?;
        let cfg = (registered(arch).parse)(&raw, path)?;
        Ok(DecoderConfig { raw, ..cfg })
    }
}
