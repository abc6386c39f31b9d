//! The raw config: what serde reads and writes, one struct per section, plain strings for paths
//! (`""` for an optional path that is not set) and `deny_unknown_fields`. The defaults live here
//! and only here; [`RawConfig::into_config`] turns the raw structs into the checked sections and
//! `From<&TrainConfig>` turns them back, for [`TrainConfig::to_toml_string`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{
    Attention, ConfigError, DataSection, LoraSection, LoraTargets, Method, ModelDtype,
    ModelSection, OptimizerKind, Quantize, Schedule, TrainConfig, TrainSection,
};
use crate::data::{Format, DEFAULT_MAX_SEQ_LEN};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawConfig {
    pub model: RawModel,
    pub lora: RawLora,
    pub data: RawData,
    pub train: RawTrain,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawModel {
    pub path: Option<String>,
    pub dtype: ModelDtype,
    pub quantize: Quantize,
    pub double_quant: bool,
    pub attention: Attention,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            path: None,
            dtype: ModelDtype::default(),
            quantize: Quantize::None,
            double_quant: true,
            attention: Attention::default(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawLora {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub targets: LoraTargets,
    pub rslora: bool,
    pub dora: bool,
    pub init: String,
}

impl Default for RawLora {
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: 32.0,
            dropout: 0.05,
            targets: LoraTargets::default(),
            rslora: false,
            dora: false,
            init: String::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawData {
    pub train: Option<String>,
    pub eval: String,
    pub format: Format,
    pub max_seq_len: usize,
    pub add_eos: bool,
    pub shuffle: bool,
    pub pack: bool,
}

impl Default for RawData {
    fn default() -> Self {
        Self {
            train: None,
            eval: String::new(),
            format: Format::Auto,
            max_seq_len: DEFAULT_MAX_SEQ_LEN,
            add_eos: true,
            shuffle: true,
            pack: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawTrain {
    pub method: Method,
    pub micro_batch_size: usize,
    pub grad_accum: usize,
    pub max_steps: usize,
    pub epochs: usize,
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub weight_decay: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    pub max_grad_norm: f64,
    pub seed: u64,
    pub device: String,
    pub output_dir: String,
    pub log_every: usize,
    pub eval_every: usize,
    pub save_every: usize,
    pub checkpointing: bool,
    pub checkpoint_every: usize,
    pub tf32: bool,
    pub threads: usize,
}

impl Default for RawTrain {
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
            output_dir: "runs/example".into(),
            log_every: 1,
            eval_every: 0,
            save_every: 0,
            checkpointing: false,
            checkpoint_every: 1,
            tf32: true,
            threads: 0,
        }
    }
}

impl Default for LoraSection {
    fn default() -> Self {
        RawLora::default().into_section()
    }
}

impl Default for TrainSection {
    fn default() -> Self {
        RawTrain::default().into_section()
    }
}

/// `""` means "not set" for the optional paths.
fn optional_path(s: String) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

pub(super) fn path_string(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl RawLora {
    fn into_section(self) -> LoraSection {
        LoraSection {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets: self.targets,
            rslora: self.rslora,
            dora: self.dora,
            init: optional_path(self.init),
        }
    }
}

impl RawTrain {
    fn into_section(self) -> TrainSection {
        TrainSection {
            method: self.method,
            micro_batch_size: self.micro_batch_size,
            grad_accum: self.grad_accum,
            max_steps: self.max_steps,
            epochs: self.epochs,
            optimizer: self.optimizer,
            lr: self.lr,
            weight_decay: self.weight_decay,
            betas: self.betas,
            eps: self.eps,
            schedule: self.schedule,
            warmup_steps: self.warmup_steps,
            max_grad_norm: self.max_grad_norm,
            seed: self.seed,
            device: self.device,
            output_dir: PathBuf::from(self.output_dir),
            log_every: self.log_every,
            eval_every: self.eval_every,
            save_every: self.save_every,
            checkpointing: self.checkpointing,
            checkpoint_every: self.checkpoint_every,
            tf32: self.tf32,
            threads: self.threads,
        }
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
            },
            lora: self.lora.into_section(),
            data: DataSection {
                train: PathBuf::from(train),
                eval: optional_path(d.eval),
                format: d.format,
                max_seq_len: d.max_seq_len,
                add_eos: d.add_eos,
                shuffle: d.shuffle,
                pack: d.pack,
            },
            train: self.train.into_section(),
        })
    }
}

impl From<&TrainConfig> for RawConfig {
    fn from(c: &TrainConfig) -> Self {
        let opt = |p: &Option<PathBuf>| p.as_deref().map(path_string).unwrap_or_default();
        let t = &c.train;
        RawConfig {
            model: RawModel {
                path: Some(path_string(&c.model.path)),
                dtype: c.model.dtype,
                quantize: c.model.quantize,
                double_quant: c.model.double_quant,
                attention: c.model.attention,
            },
            lora: RawLora {
                rank: c.lora.rank,
                alpha: c.lora.alpha,
                dropout: c.lora.dropout,
                targets: c.lora.targets.clone(),
                rslora: c.lora.rslora,
                dora: c.lora.dora,
                init: opt(&c.lora.init),
            },
            data: RawData {
                train: Some(path_string(&c.data.train)),
                eval: opt(&c.data.eval),
                format: c.data.format,
                max_seq_len: c.data.max_seq_len,
                add_eos: c.data.add_eos,
                shuffle: c.data.shuffle,
                pack: c.data.pack,
            },
            train: RawTrain {
                method: t.method,
                micro_batch_size: t.micro_batch_size,
                grad_accum: t.grad_accum,
                max_steps: t.max_steps,
                epochs: t.epochs,
                optimizer: t.optimizer,
                lr: t.lr,
                weight_decay: t.weight_decay,
                betas: t.betas,
                eps: t.eps,
                schedule: t.schedule,
                warmup_steps: t.warmup_steps,
                max_grad_norm: t.max_grad_norm,
                seed: t.seed,
                device: t.device.clone(),
                output_dir: path_string(&t.output_dir),
                log_every: t.log_every,
                eval_every: t.eval_every,
                save_every: t.save_every,
                checkpointing: t.checkpointing,
                checkpoint_every: t.checkpoint_every,
                tf32: t.tf32,
                threads: t.threads,
            },
        }
    }
}
