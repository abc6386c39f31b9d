//! The training config of `tallow train --config FILE [--set section.key=value]...`.
//!
//! A TOML file with four sections, `[model]`, `[lora]`, `[data]` and `[train]`; every key has a
//! default except `model.path` and `data.train`. It is read in three steps, as candle's
//! `llama.rs` reads a model config:
//!
//! 1. the file becomes a `toml::Table`; its sections and keys are checked against [`SECTIONS`]
//!    (an unknown one is an error that lists the valid keys and suggests the closest), then each
//!    `--set section.key=value` is applied to the table;
//! 2. each section is deserialized into a raw serde struct (`Raw*`, private: plain strings for
//!    paths, serde defaults, `deny_unknown_fields`); a value of the wrong type is an error naming
//!    the key and the type it must have;
//! 3. the raw structs become a [`TrainConfig`], checked by [`TrainConfig::validate`].
//!
//! [`TrainConfig::to_toml_string`] writes the resolved config back (every key, defaults filled
//! in) so that a run directory records exactly what ran; loading that text gives an equal config.

use crate::data::{DataOptions, Format};
pub use crate::optim::OptimizerKind;
pub use crate::schedule::Schedule;
use candle_core::DType;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use toml::{Table, Value};

/// The linear layers of a Llama / Qwen decoder layer that LoRA can wrap, in the order of the
/// layer; `lora.targets = "all-linear"` means all of them. The model crate's list, so config
/// validation and adapter attachment cannot disagree.
pub use tallow_model::peft::LINEAR_MODULES as LORA_TARGETS;

// ---------------------------------------------------------------------------------------------
// Enums of the config.
// ---------------------------------------------------------------------------------------------

/// `model.dtype`: storage and compute dtype of the frozen base weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelDtype {
    F32,
    F16,
    #[default]
    Bf16,
}

impl ModelDtype {
    /// The Candle dtype.
    pub fn to_dtype(self) -> DType {
        match self {
            ModelDtype::F32 => DType::F32,
            ModelDtype::F16 => DType::F16,
            ModelDtype::Bf16 => DType::BF16,
        }
    }

    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            ModelDtype::F32 => "f32",
            ModelDtype::F16 => "f16",
            ModelDtype::Bf16 => "bf16",
        }
    }
}

/// `model.quantize`: how the frozen linear weights inside the decoder layers are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantize {
    /// In `model.dtype`.
    #[default]
    None,
    /// 4-bit NormalFloat, bitsandbytes layout (QLoRA); embeddings, norms and lm_head stay in
    /// `model.dtype`.
    Nf4,
}

/// `train.method`: which weights are trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Low-rank adapters on `lora.targets`; the base stays frozen.
    #[default]
    Lora,
    /// Every weight of the model.
    Full,
}

/// `lora.targets`: the string `"all-linear"` or a list of names from [`LORA_TARGETS`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TargetsRepr", into = "TargetsRepr")]
pub enum LoraTargets {
    List(Vec<String>),
    AllLinear,
}

impl Default for LoraTargets {
    fn default() -> Self {
        LoraTargets::List(LORA_TARGETS.iter().map(|s| s.to_string()).collect())
    }
}

impl LoraTargets {
    /// The module names; `AllLinear` expands to [`LORA_TARGETS`].
    pub fn names(&self) -> Vec<&str> {
        match self {
            LoraTargets::List(list) => list.iter().map(String::as_str).collect(),
            LoraTargets::AllLinear => LORA_TARGETS.to_vec(),
        }
    }
}

/// How `lora.targets` is written in TOML.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum TargetsRepr {
    Name(String),
    List(Vec<String>),
}

impl TryFrom<TargetsRepr> for LoraTargets {
    type Error = String;

    fn try_from(repr: TargetsRepr) -> Result<Self, String> {
        match repr {
            TargetsRepr::Name(s) if s == "all-linear" => Ok(LoraTargets::AllLinear),
            TargetsRepr::Name(s) => Err(format!(
                "expected \"all-linear\" or a list of module names, found the string {s:?}"
            )),
            TargetsRepr::List(list) => Ok(LoraTargets::List(list)),
        }
    }
}

impl From<LoraTargets> for TargetsRepr {
    fn from(t: LoraTargets) -> Self {
        match t {
            LoraTargets::List(list) => TargetsRepr::List(list),
            LoraTargets::AllLinear => TargetsRepr::Name("all-linear".into()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checked config.
// ---------------------------------------------------------------------------------------------

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
}

/// `[lora]`: the adapters, used when `train.method = "lora"`.
#[derive(Debug, Clone, PartialEq)]
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
    /// DoRA (Liu et al. 2024, arXiv:2402.09353), as PEFT's `use_dora`: a trainable magnitude per
    /// output feature times the direction (W + s B A) / ||W + s B A|| (default false).
    pub dora: bool,
    /// A PEFT adapter dir to start from; rank, alpha and targets then come from it.
    pub init: Option<PathBuf>,
}

/// `[data]`: the JSONL files and how rows become sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct DataSection {
    /// The training JSONL file.
    pub train: PathBuf,
    /// An optional eval JSONL file.
    pub eval: Option<PathBuf>,
    /// Row format; `Auto` picks from the keys of the first row.
    pub format: Format,
    /// Rows are cut to this many tokens (default 1024).
    pub max_seq_len: usize,
    /// Append EOS to text rows and completions (default true).
    pub add_eos: bool,
    /// Shuffle rows each epoch, seeded by `train.seed`; false keeps file order (default true).
    pub shuffle: bool,
    /// Pack rows into `max_seq_len` sequences, attention kept inside each row (default false).
    pub pack: bool,
}

/// `[train]`: the optimization.
#[derive(Debug, Clone, PartialEq)]
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
    pub output_dir: PathBuf,
    /// Log every this many optimizer steps (default 1).
    pub log_every: usize,
    /// Evaluate every this many optimizer steps; 0 only at the end when `data.eval` is set.
    pub eval_every: usize,
    /// Save every this many optimizer steps; 0 only at the end.
    pub save_every: usize,
    /// Activation checkpointing: keep only decoder-layer inputs in the forward and recompute
    /// each layer in the backward (default false).
    pub checkpointing: bool,
    /// With `checkpointing`: checkpoint every n-th decoder layer (default 1 = all).
    pub checkpoint_every: usize,
    /// TF32 tensor cores for f32 matmuls on CUDA (default true): an f32 model's matmuls and
    /// the f32 LoRA A/B products (10-bit mantissa inputs, f32 accumulation, as PyTorch's
    /// `allow_tf32`). bf16 / f16 matmuls are unaffected; no effect on the CPU.
    pub tf32: bool,
    /// CPU threads for the matmuls (gemm on rayon), tallow's fused kernels (rayon) and Candle's
    /// element-wise pool alike; 0 (default) = the number of physical cores, as PyTorch's
    /// `torch.get_num_threads()`. `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`, when set, win.
    pub threads: usize,
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

impl LoraSection {
    /// The factor the adapter output B·A·x is multiplied by: alpha / rank, or alpha / sqrt(rank)
    /// with `rslora`.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }
    }

    /// The wrapped module names; `"all-linear"` expands to [`LORA_TARGETS`].
    pub fn targets(&self) -> Vec<&str> {
        self.targets.names()
    }
}

impl DataSection {
    /// The options of [`crate::load_jsonl`].
    pub fn options(&self) -> DataOptions {
        DataOptions {
            format: self.format,
            max_seq_len: self.max_seq_len,
            add_eos: self.add_eos,
        }
    }
}

impl TrainConfig {
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
        let mut table: Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin: origin.to_string(),
                message: e.to_string().trim_end().to_string(),
            })?;
        check_keys(&table, origin)?;

        // Which `--set` wrote each key, for error messages about values.
        let mut set_by: Vec<(String, String)> = Vec::new();
        for set in sets {
            let key = apply_set(&mut table, origin, set)?;
            set_by.retain(|(k, _)| *k != key);
            set_by.push((key, set.clone()));
        }
        let set_of = |key: &str| {
            set_by
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, s)| s.clone())
        };

        let raw = RawConfig {
            model: section(&table, "model", origin, &set_of)?,
            lora: section(&table, "lora", origin, &set_of)?,
            data: section(&table, "data", origin, &set_of)?,
            train: section(&table, "train", origin, &set_of)?,
        };
        let config = raw.into_config(origin)?;
        config.validate().map_err(|invalid| ConfigError::Invalid {
            origin: origin.to_string(),
            set: set_of(invalid.key),
            invalid,
        })?;
        Ok(config)
    }

    /// Checks every value; the error names the key, the value found and what it must be.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        let bad = |key: &'static str, message: String| Err(InvalidValue { key, message });
        let (m, l, d, t) = (&self.model, &self.lora, &self.data, &self.train);

        if m.path.as_os_str().is_empty() {
            return bad(
                "model.path",
                "is empty; set it to a local model dir or a hub id, e.g. \"Qwen/Qwen2.5-0.5B-Instruct\""
                    .into(),
            );
        }

        if l.rank < 1 {
            return bad(
                "lora.rank",
                "must be at least 1, found 0 (8 to 64 is usual)".into(),
            );
        }
        if !(l.alpha > 0.0 && l.alpha.is_finite()) {
            return bad(
                "lora.alpha",
                format!("must be > 0, found {} (usually 2 x rank)", l.alpha),
            );
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return bad(
                "lora.dropout",
                format!(
                    "must be in [0, 1), found {} (0 turns dropout off)",
                    l.dropout
                ),
            );
        }
        let names = l.targets();
        if names.is_empty() {
            return bad(
                "lora.targets",
                format!(
                    "is empty; list some of {} or write \"all-linear\"",
                    LORA_TARGETS.join(", ")
                ),
            );
        }
        for (i, name) in names.iter().enumerate() {
            if !LORA_TARGETS.contains(name) {
                let hint = closest(name, LORA_TARGETS.iter().copied())
                    .map(|c| format!("did you mean `{c}`? "))
                    .unwrap_or_default();
                return bad(
                    "lora.targets",
                    format!(
                        "has `{name}`, which is not a linear layer of a decoder layer; {hint}\
                         valid: {}, or the string \"all-linear\"",
                        LORA_TARGETS.join(", ")
                    ),
                );
            }
            if names[..i].contains(name) {
                return bad("lora.targets", format!("lists `{name}` twice"));
            }
        }
        if let Some(init) = &l.init {
            if init.as_os_str().is_empty() {
                return bad(
                    "lora.init",
                    "is empty; leave the key out for a fresh adapter".into(),
                );
            }
        }

        if d.train.as_os_str().is_empty() {
            return bad(
                "data.train",
                "is empty; set it to a JSONL file, e.g. \"data/train.jsonl\"".into(),
            );
        }
        if d.max_seq_len < 2 {
            return bad(
                "data.max_seq_len",
                format!(
                    "must be at least 2 (one input and one target token), found {}",
                    d.max_seq_len
                ),
            );
        }

        if t.micro_batch_size < 1 {
            return bad(
                "train.micro_batch_size",
                "must be at least 1, found 0".into(),
            );
        }
        if m.quantize == Quantize::Nf4 && t.method == Method::Full {
            return bad(
                "model.quantize",
                "is \"nf4\", which needs train.method = \"lora\" (QLoRA: NF4 base weights are                  frozen); set model.quantize = \"none\" for a full fine-tune (add                  train.optimizer = \"adamw8bit\" to save optimizer memory)"
                    .into(),
            );
        }
        if t.checkpoint_every < 1 {
            return bad(
                "train.checkpoint_every",
                "must be at least 1, found 0 (1 = checkpoint every decoder layer)".into(),
            );
        }
        if t.grad_accum < 1 {
            return bad(
                "train.grad_accum",
                "must be at least 1, found 0 (1 = one micro-batch per optimizer step)".into(),
            );
        }
        if t.max_steps == 0 && t.epochs < 1 {
            return bad(
                "train.epochs",
                "is 0 and `train.max_steps` is 0, so nothing would run; set epochs >= 1, or \
                 max_steps > 0 to count optimizer steps instead"
                    .into(),
            );
        }
        if t.max_steps > 0 && t.warmup_steps > t.max_steps {
            return bad(
                "train.warmup_steps",
                format!(
                    "is {} but `train.max_steps` is {}; warmup must fit in the run",
                    t.warmup_steps, t.max_steps
                ),
            );
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return bad(
                "train.lr",
                format!("must be > 0, found {} (2e-4 is usual for LoRA)", t.lr),
            );
        }
        if !(t.weight_decay >= 0.0 && t.weight_decay.is_finite()) {
            return bad(
                "train.weight_decay",
                format!("must be >= 0, found {}", t.weight_decay),
            );
        }
        if ![t.betas.0, t.betas.1]
            .iter()
            .all(|b| (0.0..1.0).contains(b))
        {
            return bad(
                "train.betas",
                format!(
                    "must both be in [0, 1), found [{}, {}] (usually [0.9, 0.999])",
                    t.betas.0, t.betas.1
                ),
            );
        }
        if !(t.eps > 0.0 && t.eps.is_finite()) {
            return bad(
                "train.eps",
                format!("must be > 0, found {} (usually 1e-8)", t.eps),
            );
        }
        if !(t.max_grad_norm >= 0.0 && t.max_grad_norm.is_finite()) {
            return bad(
                "train.max_grad_norm",
                format!(
                    "must be >= 0 (0 disables clipping), found {}",
                    t.max_grad_norm
                ),
            );
        }
        if t.seed > i64::MAX as u64 {
            return bad(
                "train.seed",
                format!(
                    "must be at most {} (a TOML integer), found {}",
                    i64::MAX,
                    t.seed
                ),
            );
        }
        if !valid_device(&t.device) {
            return bad(
                "train.device",
                format!(
                    "must be auto, cpu, cuda or cuda:N (N a GPU number), found {:?}",
                    t.device
                ),
            );
        }
        if t.output_dir.as_os_str().is_empty() {
            return bad(
                "train.output_dir",
                "is empty; set the dir the run writes to, e.g. \"runs/my-run\"".into(),
            );
        }
        if t.log_every < 1 {
            return bad("train.log_every", "must be at least 1, found 0".into());
        }
        Ok(())
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

fn valid_device(spec: &str) -> bool {
    match spec {
        "auto" | "cpu" | "cuda" => true,
        s => s
            .strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())),
    }
}

// ---------------------------------------------------------------------------------------------
// The raw config: what serde reads. The defaults live here and only here.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawConfig {
    model: RawModel,
    lora: RawLora,
    data: RawData,
    train: RawTrain,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawModel {
    path: Option<String>,
    dtype: ModelDtype,
    quantize: Quantize,
    double_quant: bool,
}

impl Default for RawModel {
    fn default() -> Self {
        Self {
            path: None,
            dtype: ModelDtype::default(),
            quantize: Quantize::None,
            double_quant: true,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawLora {
    rank: usize,
    alpha: f64,
    dropout: f64,
    targets: LoraTargets,
    rslora: bool,
    dora: bool,
    init: String,
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
struct RawData {
    train: Option<String>,
    eval: String,
    format: Format,
    max_seq_len: usize,
    add_eos: bool,
    shuffle: bool,
    pack: bool,
}

impl Default for RawData {
    fn default() -> Self {
        Self {
            train: None,
            eval: String::new(),
            format: Format::Auto,
            max_seq_len: 1024,
            add_eos: true,
            shuffle: true,
            pack: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawTrain {
    method: Method,
    micro_batch_size: usize,
    grad_accum: usize,
    max_steps: usize,
    epochs: usize,
    optimizer: OptimizerKind,
    lr: f64,
    weight_decay: f64,
    betas: (f64, f64),
    eps: f64,
    schedule: Schedule,
    warmup_steps: usize,
    max_grad_norm: f64,
    seed: u64,
    device: String,
    output_dir: String,
    log_every: usize,
    eval_every: usize,
    save_every: usize,
    checkpointing: bool,
    checkpoint_every: usize,
    tf32: bool,
    threads: usize,
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

/// `""` means "not set" for the optional paths.
fn optional_path(s: String) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

fn path_string(p: &Path) -> String {
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
    fn into_config(self, origin: &str) -> Result<TrainConfig, ConfigError> {
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

// ---------------------------------------------------------------------------------------------
// The keys, for unknown-key and wrong-type errors. A test keeps this in step with the raw structs.
// ---------------------------------------------------------------------------------------------

/// The TOML type a key takes.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Str,
    Uint,
    Float,
    Bool,
    /// Two floats.
    Pair,
    /// `"all-linear"` or a list of strings.
    Targets,
    /// One of these strings.
    Choice(&'static [&'static str]),
}

impl Kind {
    fn expected(self) -> String {
        match self {
            Kind::Str => "a string".into(),
            Kind::Uint => "a whole number >= 0".into(),
            Kind::Float => "a number".into(),
            Kind::Bool => "true or false".into(),
            Kind::Pair => "a list of two numbers, e.g. [0.9, 0.999]".into(),
            Kind::Targets => {
                "\"all-linear\" or a list of module names, e.g. [\"q_proj\", \"v_proj\"]".into()
            }
            Kind::Choice(names) => {
                let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
                format!("one of {}", quoted.join(", "))
            }
        }
    }
}

/// Every section and its keys, in the order [`TrainConfig::to_toml_string`] writes them.
const SECTIONS: [(&str, &[(&str, Kind)]); 4] = [
    (
        "model",
        &[
            ("path", Kind::Str),
            ("dtype", Kind::Choice(&["f32", "f16", "bf16"])),
            ("quantize", Kind::Choice(&["none", "nf4"])),
            ("double_quant", Kind::Bool),
        ],
    ),
    (
        "lora",
        &[
            ("rank", Kind::Uint),
            ("alpha", Kind::Float),
            ("dropout", Kind::Float),
            ("targets", Kind::Targets),
            ("rslora", Kind::Bool),
            ("dora", Kind::Bool),
            ("init", Kind::Str),
        ],
    ),
    (
        "data",
        &[
            ("train", Kind::Str),
            ("eval", Kind::Str),
            (
                "format",
                Kind::Choice(&["auto", "text", "prompt_completion", "messages"]),
            ),
            ("max_seq_len", Kind::Uint),
            ("add_eos", Kind::Bool),
            ("shuffle", Kind::Bool),
            ("pack", Kind::Bool),
        ],
    ),
    (
        "train",
        &[
            ("method", Kind::Choice(&["lora", "full"])),
            ("micro_batch_size", Kind::Uint),
            ("grad_accum", Kind::Uint),
            ("max_steps", Kind::Uint),
            ("epochs", Kind::Uint),
            ("optimizer", Kind::Choice(&["adamw", "adamw8bit", "sgd"])),
            ("lr", Kind::Float),
            ("weight_decay", Kind::Float),
            ("betas", Kind::Pair),
            ("eps", Kind::Float),
            ("schedule", Kind::Choice(&["constant", "linear", "cosine"])),
            ("warmup_steps", Kind::Uint),
            ("max_grad_norm", Kind::Float),
            ("seed", Kind::Uint),
            ("device", Kind::Str),
            ("output_dir", Kind::Str),
            ("log_every", Kind::Uint),
            ("eval_every", Kind::Uint),
            ("save_every", Kind::Uint),
            ("checkpointing", Kind::Bool),
            ("checkpoint_every", Kind::Uint),
            ("tf32", Kind::Bool),
            ("threads", Kind::Uint),
        ],
    ),
];

/// Names other trainers (HF TrainingArguments, PEFT, axolotl, torchtune, litgpt) use for our keys.
const ALIASES: &[(&str, &str)] = &[
    ("learning_rate", "train.lr"),
    ("lora_r", "lora.rank"),
    ("r", "lora.rank"),
    ("lora_alpha", "lora.alpha"),
    ("lora_dropout", "lora.dropout"),
    ("target_modules", "lora.targets"),
    ("lora_target_modules", "lora.targets"),
    ("lora_targets", "lora.targets"),
    ("use_rslora", "lora.rslora"),
    ("use_dora", "lora.dora"),
    ("peft_use_dora", "lora.dora"),
    ("lora_model_dir", "lora.init"),
    ("adapter", "lora.init"),
    ("base_model", "model.path"),
    ("model_name_or_path", "model.path"),
    ("checkpoint_dir", "model.path"),
    ("torch_dtype", "model.dtype"),
    ("load_in_4bit", "model.quantize"),
    ("bnb_4bit_quant_type", "model.quantize"),
    ("quantization", "model.quantize"),
    ("bnb_4bit_use_double_quant", "model.double_quant"),
    ("gradient_checkpointing", "train.checkpointing"),
    ("activation_checkpointing", "train.checkpointing"),
    ("enable_activation_checkpointing", "train.checkpointing"),
    ("precision", "model.dtype"),
    ("dataset", "data.train"),
    ("datasets", "data.train"),
    ("train_file", "data.train"),
    ("eval_file", "data.eval"),
    ("validation_file", "data.eval"),
    ("val_file", "data.eval"),
    ("sequence_len", "data.max_seq_len"),
    ("seq_len", "data.max_seq_len"),
    ("max_length", "data.max_seq_len"),
    ("max_seq_length", "data.max_seq_len"),
    ("block_size", "data.max_seq_len"),
    ("cutoff_len", "data.max_seq_len"),
    ("sample_packing", "data.pack"),
    ("packing", "data.pack"),
    ("batch_size", "train.micro_batch_size"),
    ("micro_batch", "train.micro_batch_size"),
    ("per_device_train_batch_size", "train.micro_batch_size"),
    ("gradient_accumulation_steps", "train.grad_accum"),
    ("gradient_accumulation_iters", "train.grad_accum"),
    ("num_epochs", "train.epochs"),
    ("num_train_epochs", "train.epochs"),
    ("max_iters", "train.max_steps"),
    ("num_steps", "train.max_steps"),
    ("optim", "train.optimizer"),
    ("lr_scheduler", "train.schedule"),
    ("lr_scheduler_type", "train.schedule"),
    ("scheduler", "train.schedule"),
    ("warmup", "train.warmup_steps"),
    ("num_warmup_steps", "train.warmup_steps"),
    ("lr_warmup_steps", "train.warmup_steps"),
    ("grad_clip", "train.max_grad_norm"),
    ("max_norm", "train.max_grad_norm"),
    ("gradient_clip_val", "train.max_grad_norm"),
    ("adam_beta1", "train.betas"),
    ("adam_beta2", "train.betas"),
    ("beta1", "train.betas"),
    ("beta2", "train.betas"),
    ("adam_epsilon", "train.eps"),
    ("epsilon", "train.eps"),
    ("out_dir", "train.output_dir"),
    ("save_dir", "train.output_dir"),
    ("logging_steps", "train.log_every"),
    ("log_interval", "train.log_every"),
    ("eval_steps", "train.eval_every"),
    ("eval_interval", "train.eval_every"),
    ("save_steps", "train.save_every"),
    ("save_interval", "train.save_every"),
];

/// Names other trainers use for our sections.
const SECTION_ALIASES: &[(&str, &str)] = &[
    ("training", "train"),
    ("trainer", "train"),
    ("optimizer", "train"),
    ("optim", "train"),
    ("dataset", "data"),
    ("datasets", "data"),
    ("peft", "lora"),
    ("adapter", "lora"),
];

fn section_keys(section: &str) -> Option<&'static [(&'static str, Kind)]> {
    SECTIONS
        .iter()
        .find(|(name, _)| *name == section)
        .map(|(_, keys)| *keys)
}

fn key_kind(section: &str, key: &str) -> Option<Kind> {
    section_keys(section)?
        .iter()
        .find(|(name, _)| *name == key)
        .map(|(_, kind)| *kind)
}

fn section_list() -> String {
    let names: Vec<String> = SECTIONS.iter().map(|(s, _)| format!("[{s}]")).collect();
    names.join(", ")
}

fn valid_keys(section: &str) -> String {
    let keys: Vec<&str> = section_keys(section)
        .unwrap_or_default()
        .iter()
        .map(|(k, _)| *k)
        .collect();
    keys.join(", ")
}

/// Edit distance counting insertions, deletions, substitutions and swaps of two neighbours
/// (`rnak` -> `rank` is 1): the optimal-string-alignment variant of Damerau-Levenshtein.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j] = distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=b.len() {
        d[0][j] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The candidate nearest to `word`, if it is near enough to be a typo (at most a third of the
/// word's length away, and at least 1).
fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

fn normalize(word: &str) -> String {
    word.trim().to_ascii_lowercase().replace('-', "_")
}

/// A suggestion for the unknown key `section.key` (section known), as `section.key`.
fn suggest_key(section: &str, key: &str) -> Option<String> {
    let norm = normalize(key);
    let own = section_keys(section).unwrap_or_default();
    // Spelling variants of one of our keys (`max-seq-len`, `LR`).
    if own.iter().any(|(k, _)| *k == norm) {
        return Some(format!("{section}.{norm}"));
    }
    // Another trainer's name for it (`learning_rate`).
    if let Some((_, full)) = ALIASES.iter().find(|(alias, _)| *alias == norm) {
        return Some(full.to_string());
    }
    // A typo of a key of this section.
    if let Some(k) = closest(&norm, own.iter().map(|(k, _)| *k)) {
        return Some(format!("{section}.{k}"));
    }
    // A key of another section (`lora.lr`), or a typo of one.
    suggest_anywhere(&norm)
}

/// The section-qualified key nearest to `key`, over every section.
fn suggest_anywhere(key: &str) -> Option<String> {
    let all = SECTIONS
        .iter()
        .flat_map(|(s, keys)| keys.iter().map(move |(k, _)| (*s, *k)));
    if let Some((s, k)) = all.clone().find(|(_, k)| *k == key) {
        return Some(format!("{s}.{k}"));
    }
    if let Some((_, full)) = ALIASES.iter().find(|(alias, _)| *alias == key) {
        return Some(full.to_string());
    }
    let limit = (key.chars().count() / 3).max(1);
    all.map(|(s, k)| (edit_distance(key, k), s, k))
        .filter(|&(d, _, _)| d <= limit)
        .min_by_key(|&(d, _, _)| d)
        .map(|(_, s, k)| format!("{s}.{k}"))
}

/// A suggestion for an unknown section name, as `[section]`.
fn suggest_section(name: &str) -> Option<String> {
    let norm = normalize(name);
    if let Some((s, _)) = SECTIONS.iter().find(|(s, _)| *s == norm) {
        return Some(format!("[{s}]"));
    }
    if let Some((_, s)) = SECTION_ALIASES.iter().find(|(alias, _)| *alias == norm) {
        return Some(format!("[{s}]"));
    }
    closest(&norm, SECTIONS.iter().map(|(s, _)| *s)).map(|s| format!("[{s}]"))
}

/// Rejects unknown sections and keys of the file, before any `--set`.
fn check_keys(table: &Table, origin: &str) -> Result<(), ConfigError> {
    for (name, value) in table {
        let Value::Table(sec) = value else {
            if section_keys(name).is_some() {
                return Err(ConfigError::NotATable {
                    origin: origin.to_string(),
                    section: name.clone(),
                });
            }
            return Err(ConfigError::KeyOutsideSection {
                origin: origin.to_string(),
                key: name.clone(),
                suggestion: suggest_anywhere(&normalize(name)),
            });
        };
        if section_keys(name).is_none() {
            return Err(ConfigError::UnknownSection {
                origin: origin.to_string(),
                set: None,
                section: name.clone(),
                suggestion: suggest_section(name),
            });
        }
        for key in sec.keys() {
            if key_kind(name, key).is_none() {
                return Err(ConfigError::UnknownKey {
                    origin: origin.to_string(),
                    set: None,
                    section: name.clone(),
                    key: key.clone(),
                    suggestion: suggest_key(name, key),
                });
            }
        }
    }
    Ok(())
}

/// Applies one `--set section.key=value` to `table`; returns `section.key`.
fn apply_set(table: &mut Table, origin: &str, set: &str) -> Result<String, ConfigError> {
    let bad = |message: String| ConfigError::BadSet {
        origin: origin.to_string(),
        set: set.to_string(),
        message,
    };
    let Some((path, text)) = set.split_once('=') else {
        return Err(bad(
            "expected section.key=value, e.g. --set train.lr=1e-3".into()
        ));
    };
    let (path, text) = (path.trim(), text.trim());
    let Some((section, key)) = path.split_once('.') else {
        if section_keys(path).is_some() {
            return Err(bad(format!(
                "`{path}` is a section: write {path}.KEY=value with KEY one of {}",
                valid_keys(path)
            )));
        }
        let hint = suggest_anywhere(&normalize(path))
            .map(|s| format!(", e.g. `{s}`"))
            .unwrap_or_default();
        return Err(bad(format!(
            "`{path}` needs its section: write section.key=value{hint}; sections: {}",
            section_list()
        )));
    };
    if section_keys(section).is_none() {
        return Err(ConfigError::UnknownSection {
            origin: origin.to_string(),
            set: Some(set.to_string()),
            section: section.to_string(),
            suggestion: suggest_section(section),
        });
    }
    let Some(kind) = key_kind(section, key) else {
        return Err(ConfigError::UnknownKey {
            origin: origin.to_string(),
            set: Some(set.to_string()),
            section: section.to_string(),
            key: key.to_string(),
            suggestion: suggest_key(section, key),
        });
    };
    let value = set_value(text, kind);
    let sec = table
        .entry(section.to_string())
        .or_insert_with(|| Value::Table(Table::new()));
    match sec {
        Value::Table(sec) => {
            sec.insert(key.to_string(), value);
        }
        // `check_keys` already rejected a known section that is not a table.
        _ => unreachable!("section `{section}` is a table"),
    }
    Ok(format!("{section}.{key}"))
}

/// The TOML value of a `--set` value: parsed as TOML where it parses, else the text as a string.
/// String keys take the text as written unless it is a quoted TOML string, so
/// `model.path=2024` or `train.device=cuda:1` mean what they say.
fn set_value(text: &str, kind: Kind) -> Value {
    let parsed = text.parse::<Value>().ok();
    match (kind, parsed) {
        (Kind::Str | Kind::Choice(_), Some(Value::String(s))) => Value::String(s),
        (Kind::Str | Kind::Choice(_), _) => Value::String(text.to_string()),
        (_, Some(v)) => v,
        (_, None) => Value::String(text.to_string()),
    }
}

/// Deserializes one section (absent: all defaults). On a type error, finds the key by
/// deserializing the section's keys one at a time.
fn section<T: DeserializeOwned + Default>(
    table: &Table,
    name: &'static str,
    origin: &str,
    set_of: &dyn Fn(&str) -> Option<String>,
) -> Result<T, ConfigError> {
    let Some(Value::Table(sec)) = table.get(name) else {
        return Ok(T::default());
    };
    Value::Table(sec.clone()).try_into::<T>().map_err(|err| {
        for (key, value) in sec {
            let one = Table::from_iter([(key.clone(), value.clone())]);
            if Value::Table(one).try_into::<T>().is_err() {
                let kind = key_kind(name, key).expect("check_keys passed");
                let suggestion = match (kind, value) {
                    (Kind::Choice(names), Value::String(s)) => {
                        closest(&normalize(s), names.iter().copied()).map(str::to_string)
                    }
                    _ => None,
                };
                let full = format!("{name}.{key}");
                return ConfigError::WrongType {
                    origin: origin.to_string(),
                    set: set_of(&full),
                    key: full,
                    expected: kind.expected(),
                    found: describe(value),
                    suggestion,
                };
            }
        }
        // Not reached while each field deserializes on its own; keep serde's message.
        ConfigError::Parse {
            origin: origin.to_string(),
            message: format!("in [{name}]: {}", err.message()),
        }
    })
}

/// A TOML value as the error messages name it: `the string "x"`, `the integer 3`.
fn describe(value: &Value) -> String {
    match value {
        Value::String(_) => format!("the string {value}"),
        Value::Integer(_) => format!("the integer {value}"),
        Value::Float(_) => format!("the number {value}"),
        Value::Boolean(_) => format!("{value}"),
        Value::Datetime(_) => format!("the date {value}"),
        Value::Array(_) => format!("the list {value}"),
        Value::Table(_) => "a table".into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------

/// A value that [`TrainConfig::validate`] rejects: `key` names it (`train.lr`), `message` says
/// what was found and what it must be.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{key}` {message}")]
pub struct InvalidValue {
    pub key: &'static str,
    pub message: String,
}

/// An error while reading a training config. `origin` is the file (or the name given to
/// [`TrainConfig::from_toml_str`]); `set` is the `--set` argument the problem came from, if any.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Not TOML.
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },

    #[error(
        "{origin}: {}unknown section `[{section}]`{}valid sections: {}",
        from_set(.set), hint_then(.suggestion), section_list()
    )]
    UnknownSection {
        origin: String,
        set: Option<String>,
        section: String,
        suggestion: Option<String>,
    },

    #[error(
        "{origin}: {}unknown key `{section}.{key}`{}valid keys in [{section}]: {}",
        from_set(.set), hint_then(.suggestion), valid_keys(.section)
    )]
    UnknownKey {
        origin: String,
        set: Option<String>,
        section: String,
        key: String,
        suggestion: Option<String>,
    },

    /// A plain key at the top of the file, before any `[section]` header.
    #[error(
        "{origin}: key `{key}` is outside any section{}every key goes under one of {}",
        hint_then(.suggestion), section_list()
    )]
    KeyOutsideSection {
        origin: String,
        key: String,
        suggestion: Option<String>,
    },

    #[error(
        "{origin}: `{section}` must be a table: write `[{section}]` on its own line with its keys \
         below it"
    )]
    NotATable { origin: String, section: String },

    #[error(
        "{origin}: {}`{key}` must be {expected}, found {found}{}",
        from_set(.set), did_you_mean(.suggestion)
    )]
    WrongType {
        origin: String,
        set: Option<String>,
        key: String,
        expected: String,
        found: String,
        suggestion: Option<String>,
    },

    #[error("{origin}: missing key `{key}`: {hint}")]
    Missing {
        origin: String,
        key: &'static str,
        hint: &'static str,
    },

    /// A `--set` argument that is not `section.key=value`.
    #[error("{origin}: --set `{set}`: {message}")]
    BadSet {
        origin: String,
        set: String,
        message: String,
    },

    #[error("{origin}: {}{invalid}", from_set(.set))]
    Invalid {
        origin: String,
        set: Option<String>,
        invalid: InvalidValue,
    },
}

fn from_set(set: &Option<String>) -> String {
    set.as_ref()
        .map(|s| format!("--set `{s}`: "))
        .unwrap_or_default()
}

/// `; did you mean `x`? ` or `; `, before more text.
fn hint_then(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean `{s}`? "))
        .unwrap_or_else(|| "; ".into())
}

fn did_you_mean(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean `{s}`?"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[model]\npath = \"models/m\"\n[data]\ntrain = \"d.jsonl\"\n";

    fn parse(text: &str, sets: &[&str]) -> Result<TrainConfig, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_toml_str(text, "configs/x.toml", &sets)
    }

    fn err(text: &str, sets: &[&str]) -> String {
        match parse(text, sets) {
            Ok(c) => panic!("expected an error, got {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// `MINIMAL` with `--set key=value`, expected to fail validation; returns the message.
    fn invalid(set: &str) -> String {
        let e = err(MINIMAL, &[set]);
        assert!(e.starts_with("configs/x.toml: --set `"), "{e}");
        e
    }

    fn contains_all(haystack: &str, needles: &[&str]) {
        for n in needles {
            assert!(haystack.contains(n), "{haystack:?} lacks {n:?}");
        }
    }

    #[test]
    fn defaults() {
        let c = parse(MINIMAL, &[]).unwrap();
        assert_eq!(c, TrainConfig::new("models/m", "d.jsonl"));
        assert_eq!(c.model.path, PathBuf::from("models/m"));
        assert_eq!(c.model.dtype, ModelDtype::Bf16);
        let l = &c.lora;
        assert_eq!(
            (l.rank, l.alpha, l.dropout, l.rslora),
            (16, 32.0, 0.05, false)
        );
        assert_eq!(l.targets(), LORA_TARGETS.to_vec());
        assert_eq!(l.init, None);
        assert_eq!(l.scale(), 2.0);
        let d = &c.data;
        assert_eq!(d.train, PathBuf::from("d.jsonl"));
        assert_eq!(d.eval, None);
        assert_eq!(d.format, Format::Auto);
        assert_eq!(d.max_seq_len, 1024);
        assert!(d.add_eos && d.shuffle && !d.pack);
        let t = &c.train;
        assert_eq!(t.method, Method::Lora);
        assert_eq!((t.micro_batch_size, t.grad_accum), (1, 8));
        assert_eq!((t.max_steps, t.epochs), (0, 1));
        assert_eq!(t.optimizer, OptimizerKind::AdamW);
        assert_eq!(
            (t.lr, t.weight_decay, t.betas, t.eps),
            (2e-4, 0.0, (0.9, 0.999), 1e-8)
        );
        assert_eq!(t.schedule, Schedule::Cosine);
        assert_eq!((t.warmup_steps, t.max_grad_norm, t.seed), (0, 1.0, 42));
        assert_eq!(t.device, "auto");
        assert_eq!(t.output_dir, PathBuf::from("runs/example"));
        assert_eq!((t.log_every, t.eval_every, t.save_every), (1, 0, 0));
        assert!(
            t.tf32,
            "TF32 is on by default (it only acts on CUDA f32 matmuls)"
        );
        assert_eq!(LoraSection::default(), c.lora);
        assert_eq!(TrainSection::default(), c.train);
        assert_eq!(
            d.options(),
            DataOptions {
                format: Format::Auto,
                max_seq_len: 1024,
                add_eos: true
            }
        );
    }

    #[test]
    fn enums_parse() {
        let one = |set: &str| parse(MINIMAL, &[set]).unwrap();
        for (name, dtype, dt) in [
            ("f32", ModelDtype::F32, DType::F32),
            ("f16", ModelDtype::F16, DType::F16),
            ("bf16", ModelDtype::Bf16, DType::BF16),
        ] {
            let c = one(&format!("model.dtype={name}"));
            assert_eq!(c.model.dtype, dtype);
            assert_eq!(dtype.to_dtype(), dt);
            assert_eq!(dtype.name(), name);
        }
        for (name, f) in [
            ("auto", Format::Auto),
            ("text", Format::Text),
            ("prompt_completion", Format::PromptCompletion),
            ("messages", Format::Messages),
        ] {
            assert_eq!(one(&format!("data.format={name}")).data.format, f);
        }
        assert_eq!(one("train.method=full").train.method, Method::Full);
        assert_eq!(one("train.method=\"lora\"").train.method, Method::Lora);
        assert_eq!(
            one("train.optimizer=sgd").train.optimizer,
            OptimizerKind::Sgd
        );
        assert_eq!(
            one("train.optimizer=adamw").train.optimizer,
            OptimizerKind::AdamW
        );
        for (name, s) in [
            ("constant", Schedule::Constant),
            ("linear", Schedule::Linear),
            ("cosine", Schedule::Cosine),
        ] {
            assert_eq!(one(&format!("train.schedule={name}")).train.schedule, s);
        }
        let all = one("lora.targets=all-linear");
        assert_eq!(all.lora.targets, LoraTargets::AllLinear);
        assert_eq!(all.lora.targets(), LORA_TARGETS.to_vec());
        let text = format!("{MINIMAL}[lora]\ntargets = \"all-linear\"\n");
        assert_eq!(
            parse(&text, &[]).unwrap().lora.targets,
            LoraTargets::AllLinear
        );
    }

    /// Every `Choice` name in `SECTIONS` is accepted by serde, so the two lists agree.
    #[test]
    fn choice_names_deserialize() {
        for (section, keys) in SECTIONS {
            for (key, kind) in keys {
                if let Kind::Choice(names) = kind {
                    for name in *names {
                        let set = format!("{section}.{key}={name}");
                        parse(MINIMAL, &[&set]).unwrap_or_else(|e| panic!("{set}: {e}"));
                    }
                }
            }
        }
    }

    #[test]
    fn set_overrides() {
        let c = parse(
            MINIMAL,
            &[
                "train.lr=1e-3",
                "model.path=/x/y",
                "lora.targets=[\"q_proj\", \"v_proj\"]",
                "train.betas=[0.9,0.95]",
                "data.pack=true",
                "lora.rank=8",
                "lora.alpha=16",
                "train.device=cuda:1",
                "data.eval=data/eval.jsonl",
                "data.train=\"quoted.jsonl\"",
                "train.output_dir=2024",
                "train.seed = 7",
            ],
        )
        .unwrap();
        assert_eq!(c.train.lr, 1e-3);
        assert_eq!(c.model.path, PathBuf::from("/x/y"));
        assert_eq!(c.lora.targets(), vec!["q_proj", "v_proj"]);
        assert_eq!(c.train.betas, (0.9, 0.95));
        assert!(c.data.pack);
        assert_eq!((c.lora.rank, c.lora.alpha), (8, 16.0));
        assert_eq!(c.train.device, "cuda:1");
        assert_eq!(c.data.eval, Some(PathBuf::from("data/eval.jsonl")));
        assert_eq!(c.data.train, PathBuf::from("quoted.jsonl"));
        assert_eq!(c.train.output_dir, PathBuf::from("2024"));
        assert_eq!(c.train.seed, 7);
        // A later --set wins; --set fills a section and a required key the file lacks.
        let c = parse(
            "[model]\npath = \"m\"\n",
            &["train.lr=1", "train.lr=0.5", "data.train=t.jsonl"],
        )
        .unwrap();
        assert_eq!(c.train.lr, 0.5);
        assert_eq!(c.data.train, PathBuf::from("t.jsonl"));
    }

    #[test]
    fn set_errors() {
        let e = err(MINIMAL, &["train.lr"]);
        contains_all(
            &e,
            &["configs/x.toml", "--set `train.lr`", "section.key=value"],
        );
        let e = err(MINIMAL, &["lr=1e-3"]);
        contains_all(&e, &["--set `lr=1e-3`", "needs its section", "`train.lr`"]);
        let e = err(MINIMAL, &["lora=8"]);
        contains_all(
            &e,
            &["`lora` is a section: write lora.KEY=value", "rank, alpha"],
        );
        let e = err(MINIMAL, &["train.learning_rate=1e-3"]);
        contains_all(
            &e,
            &[
                "--set `train.learning_rate=1e-3`",
                "unknown key `train.learning_rate`",
                "did you mean `train.lr`?",
            ],
        );
        let e = err(MINIMAL, &["optim.lr=1e-3"]);
        contains_all(
            &e,
            &[
                "--set `optim.lr=1e-3`",
                "unknown section `[optim]`",
                "`[train]`",
            ],
        );
        let e = err(MINIMAL, &["train.lr=fast"]);
        contains_all(
            &e,
            &[
                "--set `train.lr=fast`",
                "`train.lr` must be a number",
                "the string \"fast\"",
            ],
        );
    }

    #[test]
    fn nf4_with_full_fine_tuning_is_invalid() {
        let e = err(MINIMAL, &["model.quantize=nf4", "train.method=full"]);
        assert!(
            e.contains("`model.quantize` is \"nf4\", which needs train.method = \"lora\""),
            "{e}"
        );
        assert!(parse(MINIMAL, &["model.quantize=nf4", "train.method=lora"]).is_ok());
    }

    #[test]
    fn unknown_key_names_file_key_and_suggestion() {
        let text = format!("{MINIMAL}[train]\nlearning_rate = 1e-3\n");
        let e = err(&text, &[]);
        assert_eq!(
            e,
            "configs/x.toml: unknown key `train.learning_rate`; did you mean `train.lr`? valid keys \
             in [train]: method, micro_batch_size, grad_accum, max_steps, epochs, optimizer, lr, \
             weight_decay, betas, eps, schedule, warmup_steps, max_grad_norm, seed, device, \
             output_dir, log_every, eval_every, save_every, checkpointing, checkpoint_every, tf32, \
             threads"
        );
        // A typo, by edit distance.
        let e = err(&format!("{MINIMAL}[lora]\nrnak = 8\n"), &[]);
        contains_all(
            &e,
            &["unknown key `lora.rnak`", "did you mean `lora.rank`?"],
        );
        // A key of another section.
        let e = err(&format!("{MINIMAL}[lora]\nlr = 1e-3\n"), &[]);
        contains_all(&e, &["unknown key `lora.lr`", "did you mean `train.lr`?"]);
        // Dashes for underscores.
        let e = err(
            "[model]\npath = \"m\"\n[data]\ntrain = \"t\"\nmax-seq-len = 8\n",
            &[],
        );
        contains_all(
            &e,
            &["did you mean `data.max_seq_len`?", "valid keys in [data]"],
        );
        // Nothing close: no suggestion, still the list.
        let e = err(&format!("{MINIMAL}[train]\nzzzzzzzz = 1\n"), &[]);
        assert!(!e.contains("did you mean"), "{e}");
        contains_all(
            &e,
            &[
                "unknown key `train.zzzzzzzz`",
                "valid keys in [train]: method",
            ],
        );
    }

    #[test]
    fn unknown_section() {
        let e = err(&format!("{MINIMAL}[training]\nlr = 1e-3\n"), &[]);
        assert_eq!(
            e,
            "configs/x.toml: unknown section `[training]`; did you mean `[train]`? valid \
             sections: [model], [lora], [data], [train]"
        );
        let e = err(&format!("{MINIMAL}[mdoel]\n"), &[]);
        contains_all(&e, &["`[mdoel]`", "did you mean `[model]`?"]);
        let e = err(&format!("seed = 1\n{MINIMAL}"), &[]);
        contains_all(
            &e,
            &[
                "key `seed` is outside any section",
                "did you mean `train.seed`?",
            ],
        );
        let e = err("model = \"m\"\n", &[]);
        contains_all(&e, &["`model` must be a table", "[model]"]);
    }

    #[test]
    fn wrong_type() {
        let e = err(&format!("{MINIMAL}[train]\nlr = \"fast\"\n"), &[]);
        assert_eq!(
            e,
            "configs/x.toml: `train.lr` must be a number, found the string \"fast\""
        );
        let e = err(&format!("{MINIMAL}[lora]\nrank = 16.0\n"), &[]);
        contains_all(
            &e,
            &["`lora.rank` must be a whole number >= 0", "the number 16.0"],
        );
        let e = err(&format!("{MINIMAL}[lora]\nrank = -1\n"), &[]);
        contains_all(&e, &["`lora.rank`", "the integer -1"]);
        let e = err(&format!("{MINIMAL}[train]\noptimizer = \"adam\"\n"), &[]);
        contains_all(
            &e,
            &[
                "`train.optimizer` must be one of \"adamw\", \"adamw8bit\", \"sgd\"",
                "found the string \"adam\"; did you mean `adamw`?",
            ],
        );
        let e = err(
            &format!("{MINIMAL}[train]\nbetas = [0.9, 0.95, 0.1]\n"),
            &[],
        );
        contains_all(&e, &["`train.betas` must be a list of two numbers"]);
        let e = err(&format!("{MINIMAL}[lora]\ntargets = \"q_proj\"\n"), &[]);
        contains_all(&e, &["`lora.targets` must be \"all-linear\" or a list"]);
        let e = err("[model]\npath = 3\n[data]\ntrain = \"t\"\n", &[]);
        contains_all(&e, &["`model.path` must be a string, found the integer 3"]);
        let e = err(
            "[model]\npath = \"m\"\n[data]\ntrain = \"t\"\npack = \"yes\"\n",
            &[],
        );
        contains_all(&e, &["`data.pack` must be true or false"]);
    }

    #[test]
    fn missing_required_keys() {
        let e = err("[data]\ntrain = \"t\"\n", &[]);
        contains_all(&e, &["configs/x.toml: missing key `model.path`", "[model]"]);
        let e = err("[model]\npath = \"m\"\n", &[]);
        contains_all(&e, &["configs/x.toml: missing key `data.train`", "[data]"]);
        let e = err("[model]\npath = \"m\"\n[data\n", &[]);
        contains_all(&e, &["configs/x.toml: TOML parse error at line 3"]);
    }

    #[test]
    fn validate_rules() {
        let cases = [
            ("lora.rank=0", "`lora.rank` must be at least 1"),
            ("lora.alpha=0", "`lora.alpha` must be > 0"),
            ("lora.dropout=1.0", "`lora.dropout` must be in [0, 1)"),
            ("lora.dropout=-0.1", "`lora.dropout` must be in [0, 1)"),
            ("lora.targets=[]", "`lora.targets` is empty"),
            ("lora.targets=[\"qproj\"]", "did you mean `q_proj`?"),
            ("lora.targets=[\"lm_head\"]", "valid: q_proj, k_proj"),
            (
                "lora.targets=[\"q_proj\",\"q_proj\"]",
                "lists `q_proj` twice",
            ),
            (
                "train.micro_batch_size=0",
                "`train.micro_batch_size` must be at least 1",
            ),
            (
                "train.grad_accum=0",
                "`train.grad_accum` must be at least 1",
            ),
            (
                "data.max_seq_len=1",
                "`data.max_seq_len` must be at least 2",
            ),
            ("train.lr=0", "`train.lr` must be > 0"),
            ("train.lr=nan", "`train.lr` must be > 0"),
            (
                "train.betas=[0.9,1.0]",
                "`train.betas` must both be in [0, 1)",
            ),
            (
                "train.betas=[-0.1,0.9]",
                "`train.betas` must both be in [0, 1)",
            ),
            ("train.eps=0", "`train.eps` must be > 0"),
            (
                "train.epochs=0",
                "`train.epochs` is 0 and `train.max_steps` is 0",
            ),
            ("train.weight_decay=-1", "`train.weight_decay` must be >= 0"),
            (
                "train.max_grad_norm=-1",
                "`train.max_grad_norm` must be >= 0",
            ),
            (
                "train.device=gpu",
                "`train.device` must be auto, cpu, cuda or cuda:N",
            ),
            ("train.device=cuda:", "`train.device` must be auto"),
            ("train.device=cuda:x", "`train.device` must be auto"),
            ("train.log_every=0", "`train.log_every` must be at least 1"),
            ("model.path=", "`model.path` is empty"),
            ("data.train=", "`data.train` is empty"),
            ("train.output_dir=", "`train.output_dir` is empty"),
        ];
        for (set, want) in cases {
            let e = invalid(set);
            contains_all(&e, &[want, &format!("--set `{set}`")]);
        }
        // Two keys together: warmup must fit in max_steps; epochs may be 0 with max_steps.
        let e = err(MINIMAL, &["train.max_steps=10", "train.warmup_steps=11"]);
        contains_all(
            &e,
            &["`train.warmup_steps` is 11 but `train.max_steps` is 10"],
        );
        parse(
            MINIMAL,
            &[
                "train.max_steps=10",
                "train.warmup_steps=10",
                "train.epochs=0",
            ],
        )
        .unwrap();
        parse(MINIMAL, &["train.warmup_steps=100"]).unwrap(); // epochs decide the length
        for device in ["auto", "cpu", "cuda", "cuda:0", "cuda:12"] {
            parse(MINIMAL, &[&format!("train.device={device}")]).unwrap();
        }
        // Errors from the file itself carry no --set.
        let e = err(&format!("{MINIMAL}[lora]\nrank = 0\n"), &[]);
        assert_eq!(
            e,
            "configs/x.toml: `lora.rank` must be at least 1, found 0 (8 to 64 is usual)"
        );
        // validate() on a config built in code.
        let mut c = TrainConfig::new("m", "t");
        c.train.lr = -1.0;
        assert_eq!(c.validate().unwrap_err().key, "train.lr");
    }

    #[test]
    fn scale_and_targets() {
        let mut l = LoraSection {
            rank: 16,
            alpha: 32.0,
            ..LoraSection::default()
        };
        assert_eq!(l.scale(), 2.0);
        l.rslora = true;
        assert_eq!(l.scale(), 8.0);
        l.targets = LoraTargets::List(vec!["v_proj".into()]);
        assert_eq!(l.targets(), vec!["v_proj"]);
    }

    #[test]
    fn to_toml_round_trip() {
        let default = TrainConfig::new("models/m", "d.jsonl");
        let c = parse(
            MINIMAL,
            &[
                "model.dtype=f16",
                "lora.targets=all-linear",
                "lora.rslora=true",
                "lora.init=adapters/a",
                "lora.dropout=0",
                "data.eval=e.jsonl",
                "data.format=messages",
                "train.method=full",
                "train.lr=3e-5",
                "train.eps=1e-10",
                "train.betas=[0.9,0.95]",
                "train.max_steps=100",
                "train.warmup_steps=7",
                "train.seed=9223372036854775807",
                "train.device=cuda:1",
            ],
        )
        .unwrap();
        for config in [default, c] {
            let text = config.to_toml_string();
            let back = TrainConfig::from_toml_str(&text, "resolved.toml", &[])
                .unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(back, config, "{text}");
            assert_eq!(back.to_toml_string(), text);
        }
    }

    /// `SECTIONS` (used for error messages and --set) lists exactly the keys of the raw structs,
    /// in the order `to_toml_string` writes them.
    #[test]
    fn key_table_matches_structs() {
        let text = TrainConfig::new("m", "t").to_toml_string();
        let table: Table = text.parse().unwrap();
        let mut sections_written = Vec::new();
        for line in text.lines() {
            if let Some(s) = line.strip_prefix('[') {
                sections_written.push(s.trim_end_matches(']').to_string());
            }
        }
        let expected: Vec<&str> = SECTIONS.iter().map(|(s, _)| *s).collect();
        assert_eq!(sections_written, expected);
        for (section, keys) in SECTIONS {
            let written: Vec<&str> = text
                .split(&format!("[{section}]\n"))
                .nth(1)
                .unwrap()
                .lines()
                .take_while(|l| !l.is_empty() && !l.starts_with('['))
                .map(|l| l.split(" = ").next().unwrap())
                .collect();
            let listed: Vec<&str> = keys.iter().map(|(k, _)| *k).collect();
            assert_eq!(written, listed, "[{section}]");
            assert_eq!(table[section].as_table().unwrap().len(), keys.len());
        }
    }

    #[test]
    fn every_alias_points_at_a_key() {
        for (alias, full) in ALIASES {
            let (s, k) = full.split_once('.').unwrap();
            assert!(key_kind(s, k).is_some(), "{alias} -> {full}");
            assert!(key_kind(s, alias).is_none(), "{alias} is a key of [{s}]");
        }
        for (alias, s) in SECTION_ALIASES {
            assert!(section_keys(s).is_some(), "{alias} -> {s}");
        }
    }

    #[test]
    fn edit_distances() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("rnak", "rank"), 1);
        assert_eq!(edit_distance("epoch", "epochs"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(closest("epoch", ["epochs", "eps"]), Some("epochs"));
        assert_eq!(closest("zzzz", ["epochs", "eps"]), None);
    }
}
