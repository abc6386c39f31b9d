//! The training config of `tallow train --config FILE [--set section.key=value]...`.
//!
//! A TOML file with four sections, `[model]`, `[lora]`, `[data]` and `[train]`; every key has a
//! default except `model.path` and `data.train`. It is read in three steps, as candle's
//! `llama.rs` reads a model config:
//!
//! 1. the file becomes a `toml::Table`; its sections and keys are checked against the key table
//!    (an unknown one is an error that lists the valid keys and suggests the closest), then each
//!    `--set section.key=value` is applied to the table;
//! 2. each section is deserialized (serde defaults, `deny_unknown_fields`): `[model]` and
//!    `[data]`, which have required keys, into raw structs (`Raw*`, private: plain strings for
//!    paths), `[lora]` and `[train]` directly into their sections; a value of the wrong type is
//!    an error naming the key and the type it must have;
//! 3. the raw structs become a [`TrainConfig`], checked by [`TrainConfig::validate`].
//!
//! [`TrainConfig::to_toml_string`] writes the resolved config back (every key, defaults filled
//! in) so that a run directory records exactly what ran; loading that text gives an equal config.
//!
//! The files, one job each:
//! - `mod.rs`: the checked config ([`TrainConfig`] and its sections) and its entry points;
//! - `enums.rs`: the config's enums ([`ModelDtype`], [`Quantize`], [`Method`], [`LoraTargets`]);
//! - `choice.rs`: the `choices!` macro, which gives each enum one list of names that serde,
//!   parsing, the key table and the messages all read;
//! - `raw.rs`: the serde mirrors of `[model]` and `[data]`, the paths' serde forms and every
//!   default;
//! - `keys.rs`: the key table (each key's TOML type), other trainers' names for our keys, and
//!   the unknown-key check;
//! - `suggest.rs`: "did you mean" by edit distance;
//! - `load.rs`: text -> table -> `--set` -> raw sections -> [`TrainConfig`];
//! - `validate.rs`: [`TrainConfig::validate`], one function per section;
//! - `error.rs`: [`ConfigError`] and [`InvalidValue`].

pub(crate) mod choice;
mod enums;
mod error;
mod keys;
mod load;
mod raw;
mod suggest;
#[cfg(test)]
mod tests;
mod validate;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tallow_model::LoraSpec;

use crate::data::{DataOptions, Format};
use raw::{path_string, RawConfig};

pub use crate::data::DEFAULT_MAX_SEQ_LEN;
pub use crate::optim::OptimizerKind;
pub use crate::schedule::Schedule;
pub use enums::{
    Attention, LogSink, LoraTargets, Method, ModelDtype, PreferenceLoss, Quantize, ALL_LINEAR,
};
pub use error::{ConfigError, InvalidValue};

/// The linear layers of a Llama / Qwen decoder layer that LoRA can wrap, in the order of the
/// layer; `lora.targets = "all-linear"` means all of them. The model crate's list, so config
/// validation and adapter attachment cannot disagree.
pub use tallow_model::peft::LINEAR_MODULES as LORA_TARGETS;
pub use tallow_model::AdapterKind;

/// A checked training config: what `tallow train` runs.
///
/// Relative paths (`model.path`, `data.train`, `data.eval`, `lora.init`, `train.output_dir`) are
/// kept as written and resolved against the current directory of the process, not against the
/// config file's directory (as axolotl does), so the shipped configs run from the repo root.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub lora: LoraSection,
    pub data: DataSection,
    pub train: TrainSection,
    pub preference: PreferenceSection,
}

/// `[preference]`: the objective of `train.method = "dpo" | "orpo"` (TRL's `DPOConfig` /
/// `ORPOConfig` names where they exist). No key is required, so serde reads it directly
/// (defaults in `raw.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreferenceSection {
    /// DPO's beta: the strength of the pull towards the reference (default 0.1).
    pub beta: f64,
    /// DPO's loss: sigmoid | ipo (default sigmoid).
    pub loss: PreferenceLoss,
    /// With the sigmoid loss: the assumed probability that a pair's labels are flipped
    /// (conservative DPO / cDPO; default 0).
    pub label_smoothing: f64,
    /// ORPO's lambda, the weight of the odds-ratio term against the NLL (TRL's `beta` of
    /// `ORPOConfig`; default 0.1).
    pub lambda: f64,
    /// DPO: compute the reference log-probs once over the data before training and cache them
    /// in `output_dir/reference-logps.safetensors` (default false: computed in each step with
    /// the adapters off).
    pub precompute_ref: bool,
    /// Keep only the last this many tokens of a prompt (TRL's `max_prompt_length`); 0 (default)
    /// keeps it whole. Completions are then cut to fit `data.max_seq_len`.
    pub max_prompt_len: usize,
    /// Train every weight instead of adapters (default false). DPO then needs
    /// `precompute_ref`: the reference log-probs are taken from the base before the first step,
    /// so no second copy of the model is kept.
    pub full: bool,
}

/// `[model]`: the base model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSection {
    /// A local model dir in Hugging Face layout (`config.json`, safetensors, `tokenizer.json`).
    pub path: PathBuf,
    /// Storage and compute dtype of the frozen base (default bf16).
    pub dtype: ModelDtype,
    /// none | nf4: 4-bit storage of the decoder layers' linear weights (default none).
    pub quantize: Quantize,
    /// With nf4: quantize the per-block scales too (bitsandbytes double quantization, default true).
    pub double_quant: bool,
    /// chunked | eager: attention without or with (T, T) activations (default chunked).
    pub attention: Attention,
    /// `config.json` keys to read as if absent (default none): for a key tallow refuses
    /// because transformers reads it, when the user knows it has no effect on this model
    /// (`tallow_model::config::hf_keys`). Keys transformers never reads need no entry.
    pub ignore_config_keys: Vec<String>,
}

/// `[lora]`: the adapters, used when `train.method = "lora"`. No key is required, so serde
/// reads it directly (defaults in `raw.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// r, the inner dimension of B·A (default 16).
    pub rank: usize,
    /// The update B·A·x is scaled by alpha / rank, or alpha / sqrt(rank) with `rslora` (default 32).
    pub alpha: f64,
    /// Dropout on the adapter's input (default 0.05).
    pub dropout: f64,
    /// The wrapped linear layers (default all seven).
    pub targets: LoraTargets,
    /// Rank-stabilized LoRA scaling alpha / sqrt(rank) (Kalajdzievski 2023, arXiv:2312.03732).
    pub rslora: bool,
    /// The adapter kind: lora | dora (default lora). DoRA (Liu et al. 2024, arXiv:2402.09353),
    /// PEFT's `use_dora`: a trainable magnitude per output feature times the direction
    /// (W + s B A) / ||W + s B A||.
    pub kind: AdapterKind,
    /// A PEFT adapter dir to start from; rank, alpha and targets then come from it.
    #[serde(with = "raw::optional_path_str")]
    pub init: Option<PathBuf>,
}

/// `[data]`: the JSONL files and how rows become sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSection {
    /// The training JSONL file.
    pub train: PathBuf,
    /// An optional eval JSONL file.
    pub eval: Option<PathBuf>,
    /// The split read when `train` is a whole hub dataset (`hf://datasets/OWNER/NAME`);
    /// `None`: "train". An error with any other `train`.
    pub train_split: Option<String>,
    /// The split read when `eval` is a whole hub dataset; `None`: "test" (TRL's default).
    pub eval_split: Option<String>,
    /// The config (subset) of a whole hub dataset; `None`: the dataset's default config.
    pub dataset_config: Option<String>,
    /// Read at most this many training rows (0: all); shards past them are never downloaded.
    pub max_rows: usize,
    /// Row format; `Auto` picks from the keys of the first row.
    pub format: Format,
    /// Rows are cut to this many tokens (default [`DEFAULT_MAX_SEQ_LEN`], 1024).
    pub max_seq_len: usize,
    /// Append EOS to text rows and completions (default true).
    pub add_eos: bool,
    /// Shuffle rows each epoch, seeded by `train.seed`; false keeps file order (default true).
    pub shuffle: bool,
    /// Pack rows into `max_seq_len` sequences, attention kept inside each row (default false).
    pub pack: bool,
    /// The prompt of Alpaca rows (`alpaca_prompt`, `alpaca_prompt_no_input`; Stanford
    /// Alpaca's by default).
    pub alpaca: crate::data::AlpacaPrompt,
}

/// `[train]`: the optimization. No key is required, so serde reads it directly (defaults in
/// `raw.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// LoRA or full fine-tuning (default lora).
    pub method: Method,
    /// Sequences per forward/backward (default 1).
    pub micro_batch_size: usize,
    /// Micro-batches per optimizer step (default 8).
    pub grad_accum: usize,
    /// Optimizer steps to run; 0 runs `epochs` (default 0).
    pub max_steps: usize,
    /// Passes over the data when `max_steps` is 0 (default 1).
    pub epochs: usize,
    /// adamw | adamw8bit | sgd (default adamw); the type lives with the optimizers in [`crate::optim`].
    pub optimizer: OptimizerKind,
    /// Peak learning rate (default 2e-4).
    pub lr: f64,
    /// Decoupled weight decay (default 0).
    pub weight_decay: f64,
    /// AdamW (beta1, beta2), written `[0.9, 0.999]` in TOML (the default).
    pub betas: (f64, f64),
    /// AdamW epsilon (default 1e-8).
    pub eps: f64,
    /// Learning-rate schedule after warmup: constant | linear | cosine (default cosine); see
    /// [`crate::schedule`].
    pub schedule: Schedule,
    /// Steps of linear warmup from 0 to `lr` (default 0).
    pub warmup_steps: usize,
    /// Clip the global gradient norm to this; 0 disables clipping (default 1.0).
    pub max_grad_norm: f64,
    /// Seeds shuffling, LoRA init and dropout (default 42).
    pub seed: u64,
    /// auto | cpu | cuda | cuda:N (default auto).
    pub device: String,
    /// Where the run writes its resolved config, logs and checkpoints (default runs/example).
    #[serde(with = "raw::path_str")]
    pub output_dir: PathBuf,
    /// Log every this many optimizer steps (default 1).
    pub log_every: usize,
    /// Where the metrics go (default `["jsonl"]`; `"tensorboard"` adds event files under
    /// `output_dir/tensorboard/`). `metrics.jsonl` is the run's record (resume, `tallow bench`
    /// and plots read it), so `"jsonl"` must stay in the list.
    pub log: Vec<LogSink>,
    /// Evaluate every this many optimizer steps; 0 only at the end when `data.eval` is set.
    pub eval_every: usize,
    /// Save every this many optimizer steps; 0 only at the end.
    pub save_every: usize,
    /// Keep at most this many checkpoints in `output_dir/checkpoints/`, the newest (and, with
    /// `keep_best`, the best one besides); 0 (default) keeps them all. HF Trainer's
    /// `save_total_limit`.
    pub save_total_limit: usize,
    /// Stop the run after this many evaluations in a row without the eval loss improving on
    /// the best one by more than `early_stopping_threshold`; 0 (default) never stops early.
    /// Needs `data.eval` and `eval_every`. HF's `EarlyStoppingCallback`.
    pub early_stopping_patience: usize,
    /// The improvement of the eval loss that counts (default 0: any decrease).
    pub early_stopping_threshold: f64,
    /// At the end, `adapter/` (or `model/`) holds the weights of the evaluation with the
    /// lowest eval loss and `adapter-last/` (`model-last/`) the last step's (default false).
    /// Each new best eval is checkpointed. Needs `data.eval` and `eval_every`. HF's
    /// `load_best_model_at_end` with `metric_for_best_model = "eval_loss"`.
    pub keep_best: bool,
    /// Activation checkpointing: keep only decoder-layer inputs in the forward and recompute
    /// each layer in the backward (default false).
    pub checkpointing: bool,
    /// With `checkpointing`: checkpoint every n-th decoder layer (default 1 = all).
    pub checkpoint_every: usize,
    /// With `checkpointing`: keep the checkpointed layers' inputs in host memory between the
    /// forward and the backward (default false). On CUDA it frees them from GPU memory (one
    /// device-to-host copy per layer in the forward, one back in the backward); on the CPU it
    /// is accepted and has no effect (the same code runs; the host copy is the tensor itself).
    pub offload_checkpoints: bool,
    /// Data-parallel runs (`tallow train --nproc N`, mpirun, torchrun, Slurm): each rank keeps
    /// the optimizer state of 1/N of the trainable tensors, updates those and hands the updated
    /// weights to the others (ZeRO stage 1, DeepSpeed's `zero_optimization.stage = 1`); default
    /// false. No effect on one process.
    pub shard_optimizer: bool,
    /// Data-parallel runs: a rank that waits this many seconds for the others in one
    /// collective (a rank died or hangs) stops the whole job with a message (default 600,
    /// torch's NCCL default).
    pub dist_timeout_s: usize,
    /// TF32 tensor cores for f32 matmuls on CUDA (default true): an f32 model's matmuls and
    /// the f32 LoRA A/B products (10-bit mantissa inputs, f32 accumulation, as PyTorch's
    /// `allow_tf32`). bf16 / f16 matmuls are unaffected; no effect on the CPU.
    pub tf32: bool,
    /// CPU threads for the matmuls (gemm on rayon), tallow's fused kernels (rayon) and Candle's
    /// element-wise pool alike; 0 (default) = the number of physical cores, as PyTorch's
    /// `torch.get_num_threads()`. `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`, when set, win.
    pub threads: usize,
    /// `OWNER/NAME`: after the final save, upload `adapter/` (or `model/`) with a model card as
    /// one commit to this hub repo, created if needed ("" = no upload, the default). The
    /// token is checked before training starts. HF Trainer spells this `push_to_hub = true` plus
    /// `hub_model_id`; here one key holds the id.
    pub push_to_hub: String,
    /// A repo that `push_to_hub` creates is private (default false; HF Trainer's name). An
    /// existing repo keeps its visibility.
    pub hub_private_repo: bool,
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
    /// section's prompt cut.
    pub fn data_options(&self) -> DataOptions {
        DataOptions {
            max_prompt_len: self.preference.max_prompt_len,
            ..self.data.options()
        }
    }

    /// A config with every default and the two required paths.
    pub fn new(model_path: impl Into<PathBuf>, train_data: impl Into<PathBuf>) -> Self {
        let mut raw = RawConfig::default();
        raw.model.path = Some(path_string(&model_path.into()));
        raw.data.train = Some(path_string(&train_data.into()));
        raw.into_config("TrainConfig::new")
            .expect("both required keys are set")
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
        toml::to_string(&RawConfig::from(self)).expect("a validated config serializes to TOML")
    }
}
