//! The raw config: what serde reads and writes, one struct per section, plain strings for paths
//! (`""` for an optional path that is not set) and `deny_unknown_fields`. `[model]` and `[data]`
//! have required keys, so they have raw mirrors here (`RawModel`, `RawData`); `[lora]` and
//! `[train]` have none and are read as their checked sections (their paths through
//! [`path_str`] / [`optional_path_str`]). The defaults live here and only here;
//! [`RawConfig::into_config`] turns the raw structs into the checked sections and
//! `From<&TrainConfig>` turns them back, for [`TrainConfig::to_toml_string`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{
    AdapterKind, Attention, ConfigError, DataSection, LogSink, LoraSection, LoraTargets, Method,
    ModelDtype, ModelSection, OptimizerKind, PreferenceLoss, PreferenceSection, Quantize, Schedule,
    TrainConfig, TrainSection,
};
use crate::data::{Format, DEFAULT_MAX_SEQ_LEN};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawConfig {
    pub model: RawModel,
    pub lora: LoraSection,
    pub data: RawData,
    pub train: TrainSection,
    pub preference: PreferenceSection,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawModel {
    pub path: Option<String>,
    pub dtype: ModelDtype,
    pub quantize: Quantize,
    pub double_quant: bool,
    pub attention: Attention,
    pub ignore_config_keys: Vec<String>,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            path: None,
            dtype: ModelDtype::default(),
            quantize: Quantize::None,
            double_quant: true,
            attention: Attention::default(),
            ignore_config_keys: Vec::new(),
        }
    }
}

impl Default for PreferenceSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            loss: PreferenceLoss::Sigmoid,
            label_smoothing: 0.0,
            lambda: 0.1,
            precompute_ref: false,
            max_prompt_len: 0,
            full: false,
        }
    }
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.05,
            targets: LoraTargets::default(),
            rslora: false,
            kind: AdapterKind::Lora,
            init: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawData {
    pub train: Option<String>,
    pub eval: String,
    pub train_split: String,
    pub eval_split: String,
    pub dataset_config: String,
    pub max_rows: usize,
    pub format: Format,
    pub max_seq_len: usize,
    pub add_eos: bool,
    pub shuffle: bool,
    pub pack: bool,
    pub alpaca_prompt: String,
    pub alpaca_prompt_no_input: String,
}

impl Default for RawData {
    fn default() -> Self {
        Self {
            train: None,
            eval: String::new(),
            train_split: String::new(),
            eval_split: String::new(),
            dataset_config: String::new(),
            max_rows: 0,
            format: Format::Auto,
            max_seq_len: DEFAULT_MAX_SEQ_LEN,
            add_eos: true,
            shuffle: true,
            pack: false,
            alpaca_prompt: crate::data::ALPACA_PROMPT.into(),
            alpaca_prompt_no_input: crate::data::ALPACA_PROMPT_NO_INPUT.into(),
        }
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            method: Method::Lora,
            micro_batch_size: 1,
            grad_accum: 8,
            max_steps: 0,
            epochs: 1,
            optimizer: OptimizerKind::AdamW,
            lr: 2e-4,
            weight_decay: 0.0,
            betas: (0.9, 0.999),
            eps: 1e-8,
            schedule: Schedule::Cosine,
            warmup_steps: 0,
            max_grad_norm: 1.0,
            seed: 42,
            device: "auto".into(),
            output_dir: PathBuf::from("runs/example"),
            log_every: 1,
            log: vec![LogSink::Jsonl],
            eval_every: 0,
            save_every: 0,
            save_total_limit: 0,
            early_stopping_patience: 0,
            early_stopping_threshold: 0.0,
            keep_best: false,
            checkpointing: false,
            checkpoint_every: 1,
            offload_checkpoints: false,
            shard_optimizer: false,
            dist_timeout_s: 600,
            tf32: true,
            threads: 0,
            push_to_hub: String::new(),
            hub_private_repo: false,
        }
    }
}

/// `""` means "not set" for the optional paths.
fn optional_path(s: String) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

/// `""` means "not set" for the optional strings.
fn nonempty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

pub(super) fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// `#[serde(with)]` for a path: written as a string (lossily, as [`path_string`]).
pub(super) mod path_str {
    use super::*;

    pub fn serialize<S: serde::Serializer>(p: &Path, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&path_string(p))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        String::deserialize(d).map(PathBuf::from)
    }
}

/// `#[serde(with)]` for an optional path: `""` when not set (TOML has no null).
pub(super) mod optional_path_str {
    use super::*;

    pub fn serialize<S: serde::Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&p.as_deref().map(path_string).unwrap_or_default())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<PathBuf>, D::Error> {
        String::deserialize(d).map(optional_path)
    }
}

impl RawConfig {
    /// Fills in the required keys; values are checked by [`TrainConfig::validate`].
    pub(super) fn into_config(self, origin: &str) -> Result<TrainConfig, ConfigError> {
        let missing = |key: &'static str, hint: &'static str| ConfigError::Missing {
            origin: origin.to_string(),
            key,
            hint,
        };
        let path = self.model.path.ok_or_else(|| {
            missing(
                "model.path",
                "add `path = \"models/Qwen2.5-0.5B-Instruct\"` (a local model dir with \
                 config.json, safetensors and tokenizer.json) under [model]",
            )
        })?;
        let d = self.data;
        let train = d.train.ok_or_else(|| {
            missing(
                "data.train",
                "add `train = \"data/train.jsonl\"` (a JSONL file) under [data]",
            )
        })?;
        Ok(TrainConfig {
            model: ModelSection {
                path: PathBuf::from(path),
                dtype: self.model.dtype,
                quantize: self.model.quantize,
                double_quant: self.model.double_quant,
                attention: self.model.attention,
                ignore_config_keys: self.model.ignore_config_keys,
            },
            lora: self.lora,
            data: DataSection {
                train: PathBuf::from(train),
                eval: optional_path(d.eval),
                train_split: nonempty(d.train_split),
                eval_split: nonempty(d.eval_split),
                dataset_config: nonempty(d.dataset_config),
                max_rows: d.max_rows,
                format: d.format,
                max_seq_len: d.max_seq_len,
                add_eos: d.add_eos,
                shuffle: d.shuffle,
                pack: d.pack,
                alpaca: crate::data::AlpacaPrompt {
                    with_input: d.alpaca_prompt,
                    without_input: d.alpaca_prompt_no_input,
                },
            },
            train: self.train,
            preference: self.preference,
        })
    }
}

impl From<&TrainConfig> for RawConfig {
    fn from(c: &TrainConfig) -> Self {
        let opt = |p: &Option<PathBuf>| p.as_deref().map(path_string).unwrap_or_default();
        RawConfig {
            model: RawModel {
                path: Some(path_string(&c.model.path)),
                dtype: c.model.dtype,
                quantize: c.model.quantize,
                double_quant: c.model.double_quant,
                attention: c.model.attention,
                ignore_config_keys: c.model.ignore_config_keys.clone(),
            },
            lora: c.lora.clone(),
            data: RawData {
                train: Some(path_string(&c.data.train)),
                eval: opt(&c.data.eval),
                train_split: c.data.train_split.clone().unwrap_or_default(),
                eval_split: c.data.eval_split.clone().unwrap_or_default(),
                dataset_config: c.data.dataset_config.clone().unwrap_or_default(),
                max_rows: c.data.max_rows,
                format: c.data.format,
                max_seq_len: c.data.max_seq_len,
                add_eos: c.data.add_eos,
                shuffle: c.data.shuffle,
                pack: c.data.pack,
                alpaca_prompt: c.data.alpaca.with_input.clone(),
                alpaca_prompt_no_input: c.data.alpaca.without_input.clone(),
            },
            train: c.train.clone(),
            preference: c.preference.clone(),
        }
    }
}
