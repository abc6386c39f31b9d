//! The training config of `tallow train --config FILE [--set section.key=value]...`.
//!
//! A TOML file with five sections, `[model]`, `[lora]`, `[data]`, `[train]` and
//! `[preference]`; every key has a default except `model.path` and `data.train`. Each key is
//! declared once, in `sections.rs`. A config is read in three steps:
//!
//! 1. the file becomes a `toml::Table`; its sections and keys are checked against the key table
//!    (an unknown one is an error that lists the valid keys and suggests the closest), then each
//!    `--set section.key=value` is applied to the table;
//! 2. each section starts at its declared defaults and takes each key the table gives; a value
//!    of the wrong type is an error naming the key and the type it must have, a required key
//!    that is absent an error saying what to write;
//! 3. the result, a [`TrainConfig`], is checked by [`TrainConfig::validate`].
//!
//! [`TrainConfig::to_toml_string`] writes the resolved config back (every key, defaults filled
//! in) so that a run directory records exactly what ran; loading that text gives an equal config.
//!
//! The files, one job each:
//! - `sections.rs`: every key, declared once (doc line, name, type, default, its own check):
//!   [`ModelSection`], [`LoraSection`], [`DataSection`], [`TrainSection`],
//!   [`PreferenceSection`]; a new key is one entry there;
//! - `section.rs`: the `section!` macro that turns those declarations into the structs, their
//!   defaults, the key table's rows, reading and writing and the checks; each Rust type's TOML
//!   type (`KeyType`);
//! - `mod.rs`: [`TrainConfig`] and its entry points;
//! - `enums.rs`: the config's enums ([`ModelDtype`], [`Quantize`], [`Method`], [`LoraTargets`]);
//! - `choice.rs`: the `choices!` macro, which gives each enum one list of names that serde,
//!   parsing, the key table and the messages all read;
//! - `keys.rs`: the key table, other trainers' names for our keys, and the unknown-key check;
//! - `suggest.rs`: "did you mean" by edit distance;
//! - `load.rs`: text -> table -> `--set` -> sections -> [`TrainConfig`];
//! - `validate.rs`: [`TrainConfig::validate`]: the helpers of the keys' own checks, and the
//!   checks that read several keys;
//! - `error.rs`: [`ConfigError`] and [`InvalidValue`];
//! - `reference.rs` (tests): docs/config.md's key tables, written from the declarations.

pub(crate) mod choice;
mod enums;
mod error;
mod keys;
mod load;
#[cfg(test)]
mod reference;
pub(crate) mod section;
mod sections;
mod suggest;
#[cfg(test)]
mod tests;
mod validate;

use std::path::{Path, PathBuf};

use serde::Serialize;
use tallow_model::LoraSpec;

use crate::data::{DataOptions, PairRule};
use section::Section;

pub use crate::data::DEFAULT_MAX_SEQ_LEN;
pub use crate::optim::OptimizerKind;
pub use crate::schedule::Schedule;
pub use enums::{
    Attention, LogSink, LoraTargets, Method, ModelDtype, PreferenceLoss, Quantize, ALL_LINEAR,
};
pub use error::{ConfigError, InvalidValue};
pub use sections::{DataSection, LoraSection, ModelSection, PreferenceSection, TrainSection};

/// The linear layers of a decoder layer (Llama's names; Phi-3's fused ones are mapped) that LoRA can wrap, in the order of the
/// layer; `lora.targets = "all-linear"` means all of them. The model crate's list, so config
/// validation and adapter attachment cannot disagree.
pub use tallow_model::peft::LINEAR_MODULES as LORA_TARGETS;
pub use tallow_model::AdapterKind;

/// A checked training config: what `tallow train` runs.
///
/// Relative paths (`model.path`, `data.train`, `data.eval`, `lora.init`, `train.output_dir`) are
/// kept as written and resolved against the current directory of the process, not against the
/// config file's directory (as axolotl does), so the shipped configs run from the repo root.
///
/// Its `Serialize` writes every key of every section ([`TrainConfig::to_toml_string`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub lora: LoraSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub preference: PreferenceSection,
}

impl LoraSection {
    /// The adapter these keys describe, as the model crate attaches it. Its
    /// [`LoraSpec::scale`] is the factor the adapter output B·A·x is multiplied by: alpha / rank,
    /// or alpha / sqrt(rank) with `rslora`. (`init` is not part of it: an adapter loaded from
    /// `init` brings its own spec.)
    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets: self.targets().iter().map(|s| s.to_string()).collect(),
            rslora: self.rslora,
            kind: self.kind,
            target_parameters: self.target_parameters.clone(),
        }
    }

    /// The wrapped module names; `"all-linear"` expands to [`LORA_TARGETS`].
    pub fn targets(&self) -> Vec<&str> {
        self.targets.names()
    }
}

/// The split `data.train` reads from a whole hub dataset when `data.train_split` is not set.
pub const DEFAULT_TRAIN_SPLIT: &str = "train";
/// The split `data.eval` reads from a whole hub dataset when `data.eval_split` is not set
/// (TRL's `dataset_test_split` default).
pub const DEFAULT_EVAL_SPLIT: &str = "test";

impl DataSection {
    /// The split of `data.train` when it is a whole hub dataset.
    pub fn train_split(&self) -> &str {
        self.train_split.as_deref().unwrap_or(DEFAULT_TRAIN_SPLIT)
    }

    /// The split of `data.eval` when it is a whole hub dataset.
    pub fn eval_split(&self) -> &str {
        self.eval_split.as_deref().unwrap_or(DEFAULT_EVAL_SPLIT)
    }

    /// The options of [`crate::load_jsonl`].
    pub fn options(&self) -> DataOptions {
        DataOptions {
            format: self.format,
            max_seq_len: self.max_seq_len,
            add_eos: self.add_eos,
            alpaca: self.alpaca.clone(),
            max_prompt_len: 0,
            pair_rule: PairRule::Dpo,
        }
    }
}

impl TrainConfig {
    /// Whether every weight is trained: `train.method = "full"`, or a preference method with
    /// `preference.full`.
    pub fn trains_full(&self) -> bool {
        self.train.method == Method::Full
            || (self.train.method.preference() && self.preference.full)
    }

    /// The options of [`crate::load_jsonl`] for this run: `[data]`'s, with the preference
    /// section's prompt cut and the tokenization of the method's TRL trainer.
    pub fn data_options(&self) -> DataOptions {
        DataOptions {
            max_prompt_len: self.preference.max_prompt_len,
            pair_rule: match self.train.method {
                Method::Orpo => PairRule::Orpo,
                _ => PairRule::Dpo,
            },
            ..self.data.options()
        }
    }

    /// A config with every default and the two required paths.
    pub fn new(model_path: impl Into<PathBuf>, train_data: impl Into<PathBuf>) -> Self {
        TrainConfig {
            model: ModelSection {
                path: model_path.into(),
                ..ModelSection::defaults()
            },
            lora: LoraSection::defaults(),
            data: DataSection {
                train: train_data.into(),
                ..DataSection::defaults()
            },
            train: TrainSection::defaults(),
            preference: PreferenceSection::defaults(),
        }
    }

    /// Reads the TOML file at `path`, applies each `--set section.key=value` of `sets` in order,
    /// and checks the result.
    pub fn load(path: &Path, sets: &[String]) -> Result<TrainConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string(), sets)
    }

    /// Like [`TrainConfig::load`] on TOML text; `origin` (a file name) starts every error message.
    ///
    /// A `--set` value is parsed as a TOML value (`train.lr=1e-3`, `lora.targets=["q_proj"]`,
    /// `train.betas=[0.9,0.95]`, `data.pack=true`); a value that is not TOML, or any value of a
    /// string key, is taken as written (`model.path=/x/y`, `train.device=cuda:1`).
    pub fn from_toml_str(
        text: &str,
        origin: &str,
        sets: &[String],
    ) -> Result<TrainConfig, ConfigError> {
        load::from_toml_str(text, origin, sets)
    }

    /// The whole config as TOML, every key written and defaults filled in: what a run records in
    /// its output dir. [`TrainConfig::from_toml_str`] of the result gives an equal config.
    ///
    /// Panics if `train.seed` exceeds `i64::MAX` (TOML integers are signed 64-bit), which
    /// [`TrainConfig::validate`] rejects.
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).expect("a validated config serializes to TOML")
    }
}
