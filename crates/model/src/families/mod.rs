//! The model families: one small file each over the shared keys ([`common`]), and their
//! registration ([`FAMILIES`]), which [`Arch::from_hf`] and [`DecoderConfig::from_json_str`] read.
//!
//! A family file holds a serde struct of the `config.json` keys only it reads (HF's names word
//! for word), its HF class and `model_type`, the keys its transformers classes read that
//! tallow ignores (`IGNORED`) or accepts with some values only (`FIXED`), and a `shape` that
//! checks its keys and gives [`CommonKeys::into_config`] the family's [`FamilyShape`]. Keys
//! transformers never reads are ignored and noted (`crate::config::hf_keys`).
//!
//! Adding a Llama-like family: a file here, and its two lines below (`pub mod` and its row in
//! [`FAMILIES`]).

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::config::hf_keys::{check_keys, field_names, Fixed, KeyCheck, KeyPolicy, Refusals};
use crate::config::{Arch, DecoderConfig, KeyNote, PreQuantized};
use crate::error::{ModelError, Result};

pub mod common;
pub mod gemma2;
pub mod gemma3;
pub mod llama;
pub mod mistral;
pub mod mixtral;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;

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
    register::<qwen3_moe::Qwen3MoeKeys>(),
    register::<mixtral::MixtralKeys>(),
    register::<qwen2_moe::Qwen2MoeKeys>(),
];

/// A family's own `config.json` keys (its serde fields), beyond [`CommonKeys`].
pub trait Family: DeserializeOwned {
    /// The family's name in messages ("Llama").
    const FAMILY: &'static str;
    /// Its HF class (`architectures[0]`, "LlamaForCausalLM") and `model_type` ("llama").
    const CLASS: &'static str;
    const MODEL_TYPE: &'static str;
    /// Keys its transformers classes read that tallow ignores, each because it cannot change
    /// the output (say why next to it).
    const IGNORED: &'static [&'static str];
    /// Keys its transformers classes read that tallow accepts with some values only (beyond
    /// `hf_keys::GENERIC_FIXED`).
    const FIXED: &'static [Fixed] = &[];
    /// Checks the family's keys, each refused value into `refusals`; the decoder's config is
    /// built by [`CommonKeys::into_config`] from the [`FamilyShape`] this returns.
    fn shape(&self, common: &CommonKeys, refusals: &mut Refusals) -> FamilyShape;
    /// What the family adds beyond the Llama layout (fused projections, partial rotary,
    /// LongRoPE, a mixture of experts), from its keys and the shared ones; nothing by default.
    fn extras(&self, _common: &CommonKeys) -> FamilyExtras {
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
        class: F::CLASS,
        read,
        ignored: F::IGNORED,
        fixed: F::FIXED,
    }
}

/// A registered family, as the rest of the crate sees it: its names, and its key policy and
/// parser without naming its type.
pub struct Registered {
    pub arch: Arch,
    policy: fn() -> KeyPolicy,
    parse: fn(&serde_json::Value, &mut Refusals) -> Option<(DecoderConfig, KeyCheck)>,
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

/// Checks every key of `raw` against family `F` (read, ignored, fixed or unread), reads the
/// common keys and the family's own, and builds the config; every refusal goes into
/// `refusals`. None when the keys could not be read at all (a wrong type).
fn parse<F: Family>(
    raw: &serde_json::Value,
    refusals: &mut Refusals,
) -> Option<(DecoderConfig, KeyCheck)> {
    let check = check_keys(&policy::<F>(), raw, refusals);
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
    let mut read = |r: std::result::Result<(), serde_json::Error>| {
        if let Err(e) = r {
            refusals.push("(config.json)", e.to_string());
        }
    };
    let common = CommonKeys::deserialize(raw);
    let own = F::deserialize(raw);
    let (common, own) = match (common, own) {
        (Ok(c), Ok(o)) => (c, o),
        (c, o) => {
            read(c.map(|_| ()));
            read(o.map(|_| ()));
            return None;
        }
    };
    let shape = own.shape(&common, refusals);
    let extras = own.extras(&common);
    let arch = Arch {
        class: F::CLASS,
        model_type: F::MODEL_TYPE,
    };
    let cfg = common.into_config(arch, F::FAMILY, shape, extras, refusals)?;
    Some((cfg, check))
}

/// `quantization_config` of a pre-quantized checkpoint: bitsandbytes 4-bit (nf4) is read
/// (`*-bnb-4bit` repos); anything else (8-bit, GPTQ, AWQ, ...) is refused by name.
fn check_quantization_config(
    raw: &serde_json::Value,
    refusals: &mut Refusals,
) -> Option<PreQuantized> {
    let q = raw.get("quantization_config").filter(|q| !q.is_null())?;
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    let key = "quantization_config";
    if method != "bitsandbytes" {
        refusals.push(
            key,
            format!(
                "quant_method `{method}` is not supported; tallow reads bitsandbytes 4-bit (nf4) \
                 checkpoints, or quantizes an unquantized one itself (model.quantize = \"nf4\")"
            ),
        );
        return None;
    }
    let flag = |k: &str| q.get(k).and_then(|v| v.as_bool()) == Some(true);
    if flag("load_in_8bit") {
        refusals.push(
            key,
            "bitsandbytes 8-bit (LLM.int8) checkpoints are not supported: their weights are int8 \
             with outliers kept in 16 bits, which tallow does not load; use the unquantized \
             model, or model.quantize = \"nf4\"",
        );
        return None;
    }
    let qt = q.get("bnb_4bit_quant_type").and_then(|v| v.as_str());
    if qt.is_some_and(|t| t != "nf4") {
        refusals.push(
            key,
            format!(
                "bnb_4bit_quant_type `{}` is not supported; tallow reads nf4 only",
                qt.unwrap_or("")
            ),
        );
        return None;
    }
    let skip_modules = q
        .get("llm_int8_skip_modules")
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    Some(PreQuantized {
        double_quant: flag("bnb_4bit_use_double_quant"),
        skip_modules,
    })
}

/// Removes the keys of `ignore` from `raw`'s top level; returns (present and removed, absent).
fn drop_keys(raw: &mut serde_json::Value, ignore: &[String]) -> (Vec<String>, Vec<String>) {
    let (mut dropped, mut absent) = (Vec::new(), Vec::new());
    for k in ignore {
        match raw.as_object_mut().and_then(|o| o.remove(k)) {
            Some(_) => dropped.push(k.clone()),
            None => absent.push(k.clone()),
        }
    }
    (dropped, absent)
}

impl DecoderConfig {
    /// Reads `dir/config.json` and validates it for its family.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_dir_ignoring(dir, &[])
    }

    /// [`DecoderConfig::from_dir`], reading the file as if the keys of `ignore` were absent
    /// (`model.ignore_config_keys`).
    pub fn from_dir_ignoring(dir: &Path, ignore: &[String]) -> Result<Self> {
        let path = dir.join("config.json");
        Self::from_json_str_ignoring(&crate::io::read_text(&path)?, &path, ignore)
    }

    /// Parses config.json text; `path` is only used in messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        Self::from_json_str_ignoring(text, path, &[])
    }

    /// [`DecoderConfig::from_json_str`] with the keys of `ignore` dropped first.
    pub fn from_json_str_ignoring(text: &str, path: &Path, ignore: &[String]) -> Result<Self> {
        let mut raw: serde_json::Value = crate::io::parse_json(text, path)?;
        let architecture = raw
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .map(str::to_string);
        let model_type = raw
            .get("model_type")
            .and_then(|m| m.as_str())
            .map(str::to_string);
        let (dropped, not_found) = drop_keys(&mut raw, ignore);
        // An image-text Gemma 3: its text tower, as a Gemma3ForCausalLM config.
        let conditional = match architecture.as_deref() {
            Some(a) => a == gemma3::CONDITIONAL_CLASS,
            None => model_type.as_deref() == Some("gemma3"),
        };
        if conditional {
            return Self::text_tower_of(&raw, path, ignore, dropped);
        }
        let arch =
            Arch::from_hf(architecture.as_deref(), model_type.as_deref()).ok_or_else(|| {
                ModelError::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    found: architecture
                        .or(model_type)
                        .unwrap_or_else(|| "<none>".into()),
                    supported: Arch::supported(),
                }
            })?;
        let mut refusals = Refusals::new(path, arch.class, &raw);
        let prequantized = check_quantization_config(&raw, &mut refusals);
        let parsed = (registered(arch).parse)(&raw, &mut refusals);
        refusals.finish()?;
        let (cfg, check) = parsed.expect("no refusal means the config was built");
        Ok(DecoderConfig {
            prequantized,
            keys: KeyNote {
                path: path.to_path_buf(),
                class: arch.class.to_string(),
                unread: check.unread,
                dropped,
                not_found,
            },
            raw,
            ..cfg
        })
    }

    /// A `Gemma3ForConditionalGeneration` config: its text tower (`text_config`, read as a
    /// `Gemma3ForCausalLM` config with the same keys dropped), the top-level keys checked as
    /// that class reads them. Refusals of both levels are reported together, the tower's
    /// under `text_config.`.
    fn text_tower_of(
        raw: &serde_json::Value,
        path: &Path,
        ignore: &[String],
        dropped: Vec<String>,
    ) -> Result<Self> {
        let mut refusals = Refusals::new(path, gemma3::CONDITIONAL_CLASS, raw);
        let prequantized = check_quantization_config(raw, &mut refusals);
        let (text, unread) = gemma3::text_config_of(raw, &mut refusals)?;
        let tower = Self::from_json_str_ignoring(&text.to_string(), path, ignore);
        let tower = match tower {
            Ok(t) => Some(t),
            Err(ModelError::Refused { refusals: r, .. }) => {
                for mut r in r {
                    r.key = format!("text_config.{}", r.key);
                    refusals.push_refusal(r);
                }
                None
            }
            Err(e) => return Err(e),
        };
        refusals.finish()?;
        let cfg = tower.expect("no refusal means the tower was built");
        let mut keys = cfg.keys.clone();
        keys.class = gemma3::CONDITIONAL_CLASS.to_string();
        keys.unread = unread
            .into_iter()
            .chain(keys.unread.iter().map(|k| format!("text_config.{k}")))
            .collect();
        keys.dropped = dropped.into_iter().chain(keys.dropped).collect();
        // a key to ignore is "not found" only if neither level had it
        keys.not_found.retain(|k| !keys.dropped.contains(k));
        Ok(DecoderConfig {
            text_tower: true,
            prequantized,
            keys,
            ..cfg
        })
    }
}
