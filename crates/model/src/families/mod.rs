//! The model families: one small file each over the shared keys ([`common`]), and their
//! registration ([`Arch`] and the dispatch in [`DecoderConfig::from_json_str`]).
//!
//! A family file holds a serde struct of the `config.json` keys only it reads (HF's names word
//! for word), the keys of its transformers config class it ignores, and an `into_config` that
//! checks them and gives [`common::CommonKeys::into_config`] the family's [`FamilyShape`].
//!
//! Adding a Llama-like family: a file here, its `Arch` variant (class and `model_type` names in
//! `config::ARCHS`) and one line in `family`.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::config::{Arch, DecoderConfig};
use crate::error::{ModelError, Result};
use crate::hf_keys::{check_keys, field_names, KeyPolicy};

pub mod common;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use common::{CommonKeys, FamilyShape};

/// A family's own `config.json` keys (its serde fields), beyond [`CommonKeys`].
pub trait Family: DeserializeOwned {
    /// The family's name in messages ("Llama").
    const FAMILY: &'static str;
    /// Keys of the family's transformers config class that tallow ignores, each because it
    /// cannot change the output (say why next to it).
    const IGNORED: &'static [&'static str];
    /// Checks the family's keys; the decoder's config is built by
    /// [`CommonKeys::into_config`] from the [`FamilyShape`] this returns.
    fn shape(&self, arch: Arch, common: &CommonKeys, path: &Path) -> Result<FamilyShape>;
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

/// What the rest of the crate needs of a family, without naming its type.
struct Registered {
    policy: fn() -> KeyPolicy,
    parse: fn(Arch, &serde_json::Value, &Path) -> Result<DecoderConfig>,
}

fn registered<F: Family>() -> Registered {
    Registered {
        policy: policy::<F>,
        parse: parse::<F>,
    }
}

/// The registration: which family reads which architecture (one line a family).
fn family(arch: Arch) -> Registered {
    match arch {
        Arch::Llama | Arch::Mistral => registered::<llama::LlamaKeys>(),
        Arch::Qwen2 => registered::<qwen2::Qwen2Keys>(),
        Arch::Qwen3 => registered::<qwen3::Qwen3Keys>(),
    }
}

/// The key policy of `arch`'s family (what `config.json` keys it reads, ignores, refuses).
pub fn key_policy(arch: Arch) -> KeyPolicy {
    (family(arch).policy)()
}

/// Checks every key of `raw` against family `F` (read, ignored or refused by name), reads the
/// common keys and the family's own, and builds the config.
fn parse<F: Family>(arch: Arch, raw: &serde_json::Value, path: &Path) -> Result<DecoderConfig> {
    check_keys(&policy::<F>(), raw, path)?;
    let bad = |e: serde_json::Error| ModelError::Config {
        path: path.to_path_buf(),
        key: "(config.json)".into(),
        msg: e.to_string(),
    };
    let common = CommonKeys::deserialize(raw).map_err(bad)?;
    let own = F::deserialize(raw).map_err(bad)?;
    let shape = own.shape(arch, &common, path)?;
    common.into_config(shape, path)
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
        let arch = Arch::from_hf(architecture, model_type).ok_or_else(|| {
            ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: architecture.or(model_type).unwrap_or("<none>").to_string(),
                supported: Arch::supported(),
            }
        })?;
        check_quantization_config(&raw, path)?;
        let cfg = (family(arch).parse)(arch, &raw, path)?;
        Ok(DecoderConfig { raw, ..cfg })
    }
}
