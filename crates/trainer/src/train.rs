//! `tallow train`: LoRA or full fine-tuning. [`train_with_limit`] reads top to bottom in phases,
//! each a method of the run's `Session`: load (data, model, adapters, optimizer, resume), then for
//! each optimizer step forward and backward over `grad_accum` micro-batches with the loss scaled
//! by the step's total target tokens, then clip, step, log, evaluate, checkpoint; then the final
//! adapter or model.
//!
//! Loss of a step = (sum of target-token NLL over all its micro-batches) / (target tokens of the
//! step), so `micro_batch_size = 4, grad_accum = 1` and `micro_batch_size = 1, grad_accum = 4`
//! give the same update up to float error.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use tallow_data_parallel::Dist;
use tallow_model::nn::lora::mix_seed;
use tallow_model::{
    attach_lora, lm_head_nll, lora_vars, save_hf_model, save_peft, set_dropout, set_dropout_rate,
    CausalLM, LoadOptions, LoraSpec, Nf4Options,
};
use tallow_text::TextTokenizer;

use crate::batch::{pack, Batch, Row};
use crate::best::BestEval;
use crate::checkpoint::{self, CheckpointState, LoraState};
use crate::config::{AdapterKind, Quantize, TrainConfig};
use crate::data::{load_file, load_hub_split, DataOptions, Dataset, Example, Format};
use crate::error::{DataError, TrainError};
use crate::eval::evaluate;
use crate::grads::{norm_and_clip_coefficient, scale_in_place, GradAccumulator};
use crate::host;
use crate::lock::RunLock;
use crate::memory::{PhasePeaks, Probe};
use crate::opcount;
use crate::optim::sharded::Shard;
use crate::optim::{self, Optimizer};
use crate::preference::{self, Metrics, Objective, PairBatch};
use crate::schedule::lr_at;

/// The TensorBoard scalars of a logged step, under HF Trainer's tags where it has one
/// (`train/loss`, `train/learning_rate`, `train/grad_norm`); peaks in MiB.
fn step_scalars(log: &StepLog) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = [
        ("train/loss", log.loss),
        ("train/learning_rate", log.lr),
        ("train/grad_norm", log.grad_norm),
        ("train/tokens_per_s", log.tokens_per_s),
    ]
    .iter()
    .map(|(t, x)| (t.to_string(), *x))
    .collect();
    // Preference runs: TRL's tags (`train/rewards/accuracies`, ...).
    for (name, x) in log.preference.iter().flatten() {
        v.push((format!("train/{name}"), *x));
    }
    let p = &log.peak_bytes;
    for (tag, bytes) in [
        ("memory/peak_forward_mib", p.forward),
        ("memory/peak_backward_mib", p.backward),
        ("memory/peak_optimizer_mib", p.optimizer),
    ] {
        if let Some(b) = bytes {
            v.push((tag.to_string(), b as f64 / (1u64 << 20) as f64));
        }
    }
    v
}

fn tensorboard_error(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Invalid(format!(
        "{}: writing the TensorBoard event file: {e}",
        path.display()
    ))
}

/// One line of `metrics.jsonl` for an optimizer step.
#[derive(Debug, Clone, Serialize)]
pub struct StepLog {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// Input tokens of this step (targets and context, no padding).
    pub tokens: usize,
    pub target_tokens: usize,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
    /// Measured peak bytes per phase of this step (max over its micro-batches), see
    /// [`crate::memory`].
    pub peak_bytes: PhasePeaks,
    /// Bytes in use after the optimizer step (weights, adapters, optimizer state).
    pub live_bytes: Option<u64>,
    /// Bytes of the optimizer's state tensors (moments, 8-bit codes and scales).
    pub optimizer_state_bytes: u64,
    /// Device-to-host reads this step made ([`crate::host`]): 1, the loss and gradient norm read
    /// together (each read is a stream sync on CUDA).
    pub host_reads: u64,
    /// Memory probe calls this step made ([`crate::memory::probes`]; each a stream sync on
    /// CUDA): 0 on steps that are neither logged nor under `--memory-limit`.
    pub memory_probes: u64,
    /// Tensors Candle created in this step's forward passes (all micro-batches): one per op,
    /// kernel or view, see [`crate::opcount`]. The same on every device.
    pub ops_forward: u64,
    /// The same for the backward passes: Candle's gradient formulas, layers recomputed by
    /// activation checkpointing, and summing the gradients into the step's buffers.
    pub ops_backward: u64,
    /// Device operations this step's forward passes issued (kernels, copies, memsets, library
    /// calls; not views): on CUDA, launches. Counted the same on every device, so a CPU run
    /// under `TALLOW_CUDA_PATHS_ON_CPU=1` counts the CUDA path's (`benchmarks/op-counts.md`).
    pub launches_forward: u64,
    /// The same for the backward passes.
    pub launches_backward: u64,
    /// The same for the optimizer phase: the gradient norm, clipping and the update.
    pub launches_optimizer: u64,
    /// A mixture of experts with `output_router_logits`: the router's load-balancing loss
    /// (transformers' `aux_loss`, before `router_aux_loss_coef`), the mean over the step's
    /// micro-batches. `loss` stays the cross-entropy; the gradients include coef * aux.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Preference runs: TRL's metrics of the step (`rewards/chosen`, `rewards/accuracies`, ...,
    /// [`crate::preference::METRIC_NAMES`]), written as keys of the line.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub preference: Option<BTreeMap<&'static str, f64>>,
}

/// What the run reports as it goes (the CLI turns these into a progress bar and messages).
pub enum Event<'a> {
    Start {
        total_steps: usize,
        start_step: usize,
        trainable_params: usize,
        rows: usize,
        resumed_from: Option<&'a Path>,
        /// Peak bytes while loading data, model and adapters.
        load_peak_bytes: Option<u64>,
        /// Bytes in use once loaded (weights, adapters, data).
        load_live_bytes: Option<u64>,
        /// What the peaks measure ("host heap", "CUDA memory pool", "none").
        memory: &'static str,
    },
    Step(&'a StepLog),
    Eval {
        step: usize,
        loss: f64,
    },
    Checkpoint {
        step: usize,
        path: &'a Path,
    },
    Note(String),
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Optimizer steps done: `total_steps`, or fewer when early stopping ended the run.
    pub steps: usize,
    /// The run stopped early (`train.early_stopping_patience`).
    pub stopped_early: bool,
    /// Step and eval loss of the best evaluation after step 0 (with an eval set).
    pub best_eval: Option<(usize, f64)>,
    pub last_loss: Option<f64>,
    pub eval_loss_start: Option<f64>,
    pub eval_loss_end: Option<f64>,
    /// `adapter/` or `model/` in the output dir (with `keep_best`, the best evaluation's).
    pub output: PathBuf,
    /// With `keep_best`: `adapter-last/` or `model-last/`, the last step's.
    pub output_last: Option<PathBuf>,
    pub elapsed_s: f64,
    /// Measured peak bytes of the load phase and, per phase, over all steps of this run.
    pub load_peak_bytes: Option<u64>,
    pub peak_bytes: PhasePeaks,
}

/// What [`setup`] loads: the model with its trainable set, and the data.
struct Setup {
    /// `model.path` as a local dir (a hub id resolved to its cached snapshot).
    model_dir: PathBuf,
    model: CausalLM,
    /// The trainable variables, in a fixed order, with their checkpoint names.
    params: Vec<(String, Var)>,
    lora: Option<LoraSpec>,
    rows: Vec<Row>,
    eval: Vec<Example>,
    pad: u32,
    /// Rows of data.train / data.eval dropped at load (no target token left after
    /// truncation; a preference prompt that leaves no room).
    skipped: (usize, usize),
    /// What was read of whole hub datasets, for the log.
    notes: Vec<String>,
}

fn setup(cfg: &TrainConfig, device: &Device) -> Result<Setup, TrainError> {
    // Hub ids (`OWNER/NAME[@REV]`) and `hf://datasets/...` files come from the HF cache,
    // downloaded when missing; local paths are used as written.
    let hub = |key: &'static str| move |source| TrainError::Hub { key, source };
    let model_dir = tallow_hub::resolve_model(&cfg.model.path).map_err(hub("model.path"))?;
    // A GGUF file reads as the model dir tallow keeps for it (docs/gguf.md).
    let model_dir = tallow_model::io::gguf::as_model_dir(&model_dir)?;
    let model_dir = model_dir.as_path();
    let d = &cfg.data;
    let train_src = DataSource::open(&d.train, d.train_split(), d).map_err(hub("data.train"))?;
    let eval_src = match &d.eval {
        None => None,
        Some(p) => Some(DataSource::open(p, d.eval_split(), d).map_err(hub("data.eval"))?),
    };
    let tok = TextTokenizer::from_model_dir(model_dir)?;
    let data_opts = cfg.data_options();
    let train_set = train_src.load(&tok, &data_opts, d.max_rows)?;
    check_method_and_format(cfg, "data.train", train_set.format)?;
    if train_set.examples.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{}: no row has a target token left after truncation to {} tokens ({} skipped)",
            cfg.data.train.display(),
            cfg.data.max_seq_len,
            train_set.skipped
        )));
    }
    let mut notes = Vec::new();
    if let DataSource::Hub(split) = &train_src {
        notes.push(hub_note("data.train", split, &train_set));
    }
    let (eval, eval_skipped) = match &eval_src {
        None => (vec![], 0),
        Some(src) => {
            let set = src.load(&tok, &data_opts, 0)?;
            check_method_and_format(cfg, "data.eval", set.format)?;
            if let DataSource::Hub(split) = src {
                notes.push(hub_note("data.eval", split, &set));
            }
            (set.examples, set.skipped)
        }
    };
    let rows = if cfg.data.pack {
        pack(&train_set.examples, cfg.data.max_seq_len)
    } else {
        train_set.examples.iter().map(Row::from).collect()
    };

    let full = cfg.trains_full();
    if full && cfg.model.quantize.freezes_base() {
        return Err(TrainError::Invalid(format!(
            "model.quantize = \"{}\" needs train.method = \"lora\": quantized base weights \
             are frozen; set model.quantize = \"none\" for a full fine-tune",
            cfg.model.quantize
        )));
    }
    let opts = LoadOptions {
        dtype: cfg.model.dtype.to_dtype(),
        device: device.clone(),
        train_base: full,
        quantize: (cfg.model.quantize == Quantize::Nf4).then_some(Nf4Options {
            double_quant: cfg.model.double_quant,
        }),
        keep_blocks: cfg.model.quantize == Quantize::Keep,
        ignore_config_keys: cfg.model.ignore_config_keys.clone(),
    };
    // lora.init: the adapter a LoRA run continues from (a full fine-tune has none).
    let init = if full { None } else { cfg.lora.init.as_deref() };
    let (mut model, init_spec) = tallow_model::load(model_dir, &opts, init)?;
    // config.json keys left out of the reading (unread by transformers, or dropped on request)
    notes.extend(model.config.keys.line());
    model.attention = cfg.model.attention.into();
    if cfg.train.checkpointing {
        model.set_checkpointing(Some(cfg.train.checkpoint_every));
        model.set_offload_checkpoints(cfg.train.offload_checkpoints);
        let tile = cfg.train.checkpoint_tile_tokens;
        model.set_checkpoint_tile_rows((tile > 0).then_some(tile));
    }
    let (params, lora) = if full {
        let params = model
            .named_params()
            .into_iter()
            .filter_map(|(n, p)| p.var().map(|v| (n, v.clone())))
            .collect();
        (params, None)
    } else {
        let spec = if let (Some(mut spec), Some(init)) = (init_spec, init) {
            // rank / alpha / targets come from the adapter; dropout from this config.
            // The adapter brings its own kind, as its rank and targets; a kind the config asks
            // for explicitly (not the default) must be the adapter's.
            if cfg.lora.kind != AdapterKind::default() && cfg.lora.kind != spec.kind {
                return Err(TrainError::Invalid(format!(
                    "lora.kind = \"{}\", but the adapter in lora.init ({}) is {} (use_dora {} in \
                     its adapter_config.json): set lora.kind = \"{}\", or start from an adapter \
                     of that kind",
                    cfg.lora.kind.name(),
                    init.display(),
                    spec.kind.spec().label(),
                    spec.kind.spec().use_dora(),
                    spec.kind.name(),
                )));
            }
            if !spec.target_parameters.is_empty() && cfg.lora.dropout > 0.0 {
                return Err(TrainError::Invalid(format!(
                    "lora.dropout = {}, but the adapter in lora.init ({}) adapts the fused \
                     expert tensors (target_parameters {:?}), which take no dropout, as in PEFT: \
                     set lora.dropout = 0",
                    cfg.lora.dropout,
                    init.display(),
                    spec.target_parameters,
                )));
            }
            spec.dropout = cfg.lora.dropout;
            set_dropout_rate(&mut model, spec.dropout);
            spec
        } else {
            let spec = cfg.lora.spec();
            attach_lora(&mut model, &spec, cfg.train.seed)?;
            spec
        };
        (lora_vars(&model), Some(spec))
    };
    let pad = tok.batch_pad_id();
    Ok(Setup {
        model_dir: model_dir.to_path_buf(),
        model,
        params,
        lora,
        rows,
        eval,
        pad,
        skipped: (train_set.skipped, eval_skipped),
        notes,
    })
}

/// Preference pairs train only with `train.method = "dpo" | "orpo"`, and those need pairs.
fn check_method_and_format(cfg: &TrainConfig, key: &str, format: Format) -> Result<(), TrainError> {
    let method = cfg.train.method;
    match (method.preference(), format == Format::Preference) {
        (true, false) => Err(TrainError::Invalid(format!(
            "train.method = \"{}\" trains on preference pairs, but {key} has {} rows: give \
             rows with \"prompt\", \"chosen\" and \"rejected\" (strings, or lists of \
             messages), or set train.method = \"lora\"",
            method.name(),
            format.name()
        ))),
        (false, true) => Err(TrainError::Invalid(format!(
            "{key} holds preference pairs (prompt / chosen / rejected): set train.method = \
             \"dpo\" or \"orpo\" to train on them"
        ))),
        _ => Ok(()),
    }
}

/// `data.train: hf://datasets/o/n (split "train"): 2 of 3 shards, 6 rows`.
fn hub_note(key: &str, split: &tallow_hub::DatasetSplit, set: &Dataset) -> String {
    format!(
        "{key}: {}: {} of {} shards, {} rows ({} skipped after truncation)",
        split.name(),
        set.shards,
        split.files.len(),
        set.rows,
        set.skipped
    )
}

/// `data.train` / `data.eval`: a local file or one `hf://datasets/...` file (in the cache), or
/// one split of a whole hub dataset (its shards fetched as the rows are read).
enum DataSource {
    File(PathBuf),
    Hub(Box<tallow_hub::DatasetSplit>),
}

impl DataSource {
    /// Resolves `spec`; for a whole dataset, finds the files of `split` of `data.dataset_config`
    /// (downloading only the README).
    fn open(
        spec: &Path,
        split: &str,
        d: &crate::config::DataSection,
    ) -> Result<DataSource, tallow_hub::HubError> {
        match tallow_hub::whole_dataset(spec) {
            Some(id) => {
                let split = tallow_hub::Hub::from_env().dataset_split(
                    &id,
                    d.dataset_config.as_deref(),
                    split,
                )?;
                Ok(DataSource::Hub(Box::new(split)))
            }
            None => tallow_hub::resolve_data(spec).map(DataSource::File),
        }
    }

    fn load(
        &self,
        tok: &TextTokenizer,
        opts: &DataOptions,
        max_rows: usize,
    ) -> Result<Dataset, DataError> {
        match self {
            DataSource::File(p) => load_file(p, tok, opts, max_rows),
            DataSource::Hub(split) => load_hub_split(split, tok, opts, max_rows),
        }
    }
}

/// The rows of optimizer step `step`: epochs of `rows_per_step`-sized slices of a per-epoch
/// permutation (seeded by `seed` and the epoch; file order when not shuffling). The last step
/// of an epoch may have fewer rows. Pure function of `step`, so resuming needs no data state.
struct Schedule {
    n: usize,
    rows_per_step: usize,
    steps_per_epoch: usize,
    shuffle: bool,
    seed: u64,
}

impl Schedule {
    /// `n` rows, `rows_per_step` (micro-batch size x grad_accum) per optimizer step.
    fn new(n: usize, rows_per_step: usize, shuffle: bool, seed: u64) -> Schedule {
        Schedule {
            n,
            rows_per_step,
            steps_per_epoch: n.div_ceil(rows_per_step),
            shuffle,
            seed,
        }
    }

    fn rows(&self, step: usize) -> Vec<usize> {
        let epoch = step / self.steps_per_epoch;
        let i = step % self.steps_per_epoch;
        let mut order: Vec<usize> = (0..self.n).collect();
        if self.shuffle {
            let mut rng = rand::rngs::StdRng::seed_from_u64(mix_seed(self.seed, epoch as u64));
            order.shuffle(&mut rng);
        }
        let start = i * self.rows_per_step;
        order[start..(start + self.rows_per_step).min(self.n)].to_vec()
    }
}

fn append_metrics(path: &Path, value: &impl Serialize) -> Result<(), TrainError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
    writeln!(f, "{}", serde_json::to_string(value).expect("json"))
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))
}

/// Keeps only the metrics lines of steps <= `step` (a resumed run redoes the steps after its
/// checkpoint and logs them again).
fn truncate_metrics(path: &Path, step: usize) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    tallow_model::io::write_atomic(path, kept.as_bytes())?;
    Ok(())
}

/// The LoRA dropout seed of micro-batch `micro` of optimizer step `step` (0-based) of a run
/// seeded `run_seed`: every mask of the run is a pure function of it and the adapter id
/// (`Lora::dropout_mask`), so a resumed run draws the masks an uninterrupted one would.
pub fn dropout_seed(run_seed: u64, step: usize, micro: usize) -> u64 {
    mix_seed(run_seed, ((step as u64) << 20) | micro as u64)
}

/// Runs a training job as configured. `resume`: continue from the newest checkpoint in
/// `train.output_dir` (a fresh start when there is none).
pub fn train(
    cfg: &TrainConfig,
    device: &Device,
    resume: bool,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, TrainError> {
    train_with_limit(cfg, device, resume, None, on_event)
}

/// [`train`] on a device with `memory_limit` bytes (None: the device's own memory): a phase whose
/// measured peak goes over it stops the run with [`TrainError::OutOfMemory`], as running out of
/// GPU memory does.
pub fn train_with_limit(
    cfg: &TrainConfig,
    device: &Device,
    resume: bool,
    memory_limit: Option<u64>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, TrainError> {
    train_dist(cfg, device, resume, memory_limit, &Dist::single(), on_event)
}

/// [`train_with_limit`] as rank `dist.rank` of a data-parallel run of `dist.world` ranks: each
/// rank runs its block of every step's micro-batches (the step's rows are those of one process
/// with `grad_accum x world` micro-batches, its loss normalized by the step's target tokens
/// over all ranks), the gradients are summed over the ranks before the update, and every rank
/// applies the same update (with `train.shard_optimizer`, each its own tensors, then shares
/// them). Rank 0 alone writes `config.toml`, metrics, checkpoints and outputs.
pub fn train_dist(
    cfg: &TrainConfig,
    device: &Device,
    resume: bool,
    memory_limit: Option<u64>,
    dist: &Dist,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, TrainError> {
    // Load data, model, adapters and optimizer; resume; the step-0 metrics and evaluation.
    let mut run = Session::start(cfg, device, resume, memory_limit, dist, on_event)?;
    for step in run.start_step..run.total_steps {
        // Early stopping ended the run (in this process, or before the checkpoint resumed).
        if run.stopped_early {
            break;
        }
        // Forward + backward over the step's micro-batches, gradients summed on the device.
        let fb = run.forward_backward(step)?;
        // Clip, the step's one host read (loss and gradient norm), the optimizer update.
        let upd = run.update(step, fb)?;
        // The metrics line (logged steps) and the progress event (every step).
        let log = run.log(step, upd, on_event)?;
        // Evaluate and checkpoint when due; the last step does both, as does a new best eval
        // with `keep_best` and the eval that stops the run early.
        run.eval_and_checkpoint(&log, on_event)?;
    }
    // The PEFT adapter or the whole model, and the run's summary.
    run.finish(on_event)
}

/// A run from its load to its final save: what [`setup`] loaded, the optimizer, the step plan,
/// and what the loop carries from step to step. Its methods are the phases of
/// [`train_with_limit`], in the order they run.
struct Session<'a> {
    cfg: &'a TrainConfig,
    device: &'a Device,
    /// This rank of a data-parallel run (one process: `Dist::single()`).
    dist: &'a Dist,
    /// The trainable variables whose optimizer state this rank keeps and which it updates
    /// (indices into `vars`): all of them, or its share with `train.shard_optimizer`.
    shard: Shard,
    /// `train.output_dir`: `config.toml`, `metrics.jsonl`, `checkpoints/`, `adapter/` or `model/`.
    out: PathBuf,
    /// The memory probe, `--memory-limit` and `metrics.jsonl`.
    memory: Memory,
    /// `model.path` as a local dir (a hub id resolved to its cached snapshot).
    model_dir: PathBuf,
    model: CausalLM,
    /// The trainable variables, in a fixed order, with their checkpoint names.
    params: Vec<(String, Var)>,
    /// The same variables, in the same order: what the optimizer and the accumulator see.
    vars: Vec<Var>,
    lora: Option<LoraSpec>,
    rows: Vec<Row>,
    eval: Vec<Example>,
    pad: u32,
    opt: Box<dyn Optimizer>,
    plan: Schedule,
    /// What a checkpoint of this run must match to be resumed (its step and counters are 0).
    identity: CheckpointState,
    /// The first step this process runs (0, or the step of the checkpoint resumed).
    start_step: usize,
    total_steps: usize,
    trainable_params: usize,
    load_peak_bytes: Option<u64>,
    eval_loss_start: Option<f64>,
    /// Input tokens of all steps so far, those before a resume included.
    tokens_seen: u64,
    /// Training seconds before this process (from the checkpoint resumed).
    elapsed_before: f64,
    /// When this process's first step began.
    started: Instant,
    /// The gradients of the current step, summed over its micro-batches.
    acc: GradAccumulator,
    last_loss: Option<f64>,
    eval_loss_end: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    /// The best evaluation and the patience counter (carried by checkpoints).
    best_eval: BestEval,
    /// `train.early_stopping_patience` evaluations went without improvement.
    stopped_early: bool,
    /// The last optimizer step done.
    steps_done: usize,
    /// Peak bytes per phase over all steps of this process.
    run_peaks: PhasePeaks,
    /// `train.log` has "tensorboard": the event file of this process.
    tensorboard: Option<crate::tensorboard::EventWriter>,
    /// `train.method = "dpo" | "orpo"`: the objective (None: supervised).
    objective: Option<Objective>,
    /// `preference.precompute_ref`: each train row's reference log-prob sum.
    reference_cache: Option<Vec<f32>>,
    /// Rank 0: `out/.tallow-lock`, released when the session ends (returned or failed).
    _lock: Option<RunLock>,
}

/// [`Session::open_output`]'s result.
struct Output {
    dir: PathBuf,
    lock: Option<RunLock>,
    tensorboard: Option<crate::tensorboard::EventWriter>,
}

/// [`Session::plan`]'s result.
struct Planned {
    vars: Vec<Var>,
    opt: Box<dyn Optimizer>,
    objective: Option<Objective>,
    plan: Schedule,
    total_steps: usize,
    identity: CheckpointState,
    shard: Shard,
}

/// [`Session::begin`]'s result.
struct Begun {
    trainable_params: usize,
    load_peak_bytes: Option<u64>,
    eval_loss_start: Option<f64>,
    reference_cache: Option<Vec<f32>>,
}

/// What the forward and backward passes of a step leave for its update (the gradients
/// themselves are in [`Session::acc`]).
struct ForwardBackward {
    /// The step's summed target-token NLL (supervised), or its loss (preference), still on the
    /// device.
    nll_sum: Tensor,
    /// What `nll_sum` is divided by for the step's loss: its target tokens, or 1.
    loss_divisor: f64,
    /// Preference runs: the step's metric sums on the device, with its pairs and ORPO NLL
    /// tokens.
    preference: Option<(Tensor, usize, usize)>,
    /// A mixture of experts' load-balancing loss: (2) f64, its sum over this rank's
    /// micro-batches and their count (the metric is its mean; rank-local with data parallel).
    aux: Option<Tensor>,
    tally: StepTally,
}

/// A step after its optimizer update: its loss and gradient norm, read from the device.
struct Updated {
    loss: f64,
    grad_norm: f64,
    lr: f64,
    preference: Option<BTreeMap<&'static str, f64>>,
    aux_loss: Option<f64>,
    tally: StepTally,
}

/// What a step counts from its start to its metrics line.
struct StepTally {
    started: Instant,
    /// Whether this step measures memory (logged, or under `--memory-limit`).
    measure: bool,
    /// The probe and host-read counters when the step began.
    probes_before: u64,
    reads_before: u64,
    /// Input tokens (no padding) and target tokens of the step.
    tokens: usize,
    target_tokens: usize,
    peaks: PhasePeaks,
    ops_forward: opcount::Counts,
    ops_backward: opcount::Counts,
    /// Device operations of the optimizer step (the update; the gradient all-reduce of data
    /// parallel ranks included).
    launches_optimizer: u64,
}

impl<'a> Session<'a> {
    /// Phase "load", in four parts: [`Session::open_output`] (the lock, the resolved config,
    /// TensorBoard), [`Session::load`] (data, model and adapters; a device OOM or a peak over
    /// `--memory-limit` stops the run as out of memory), [`Session::plan`] (the optimizer, its
    /// shard, the step plan and the checkpoint identity), [`Session::resume`] (with `resume`,
    /// the newest checkpoint into the trainable variables and the optimizer); then
    /// [`Session::begin`] reports [`Event::Start`] and, on a fresh start, writes the step-0
    /// metrics line and evaluates once. Costs: the load, the probe's reset and its two reads
    /// (load peak and live bytes), and the evaluation (one host read) when there is an eval set.
    fn start(
        cfg: &'a TrainConfig,
        device: &'a Device,
        resume: bool,
        memory_limit: Option<u64>,
        dist: &'a Dist,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Self, TrainError> {
        let main = dist.is_main();
        let output = Self::open_output(cfg, main, on_event)?;
        set_tf32(device, cfg.train.tf32);
        let memory = Memory::start(device, memory_limit, output.dir.join("metrics.jsonl"), main);
        let loaded = Self::load(cfg, device, &memory, on_event)?;
        let planned = Self::plan(cfg, dist, &loaded);
        let mut opt = planned.opt;
        let resumed = match resume {
            true => Self::resume(
                &output.dir,
                device,
                &planned.identity,
                &loaded.params,
                (&planned.vars, &planned.shard),
                opt.as_mut(),
                &memory,
                main,
                on_event,
            )?,
            false => None,
        };
        if resumed.is_none() && main {
            let _ = std::fs::remove_file(&memory.metrics);
        }
        let (start_step, tokens_seen, elapsed_before) = match &resumed {
            Some(r) => (r.step, r.tokens_seen, r.elapsed_s),
            None => (0, 0, 0.0),
        };
        let best_eval = resumed
            .as_ref()
            .map(|r| r.best_eval.clone())
            .unwrap_or_default();
        // A run that stopped early and is resumed with the same patience stays stopped.
        let stopped_early = best_eval.exhausted(cfg.train.early_stopping_patience);
        let resumed_from = resumed.map(|r| r.dir);

        let mut tensorboard = output.tensorboard;
        let begun = Self::begin(
            cfg,
            &loaded,
            &planned.objective,
            (start_step, planned.total_steps),
            resumed_from.as_deref(),
            &memory,
            &mut tensorboard,
            dist,
            on_event,
        )?;

        let acc = GradAccumulator::new(&planned.vars);
        let Setup {
            model_dir,
            model,
            params,
            lora,
            rows,
            eval,
            pad,
            ..
        } = loaded;
        Ok(Session {
            cfg,
            device,
            dist,
            shard: planned.shard,
            out: output.dir,
            memory,
            model_dir,
            model,
            params,
            vars: planned.vars,
            lora,
            rows,
            eval,
            pad,
            opt,
            plan: planned.plan,
            identity: planned.identity,
            start_step,
            total_steps: planned.total_steps,
            trainable_params: begun.trainable_params,
            load_peak_bytes: begun.load_peak_bytes,
            eval_loss_start: begun.eval_loss_start,
            tokens_seen,
            elapsed_before,
            started: Instant::now(),
            acc,
            last_loss: None,
            eval_loss_end: None,
            last_checkpoint: resumed_from,
            best_eval,
            stopped_early,
            steps_done: start_step,
            run_peaks: PhasePeaks::default(),
            tensorboard,
            objective: planned.objective,
            reference_cache: begun.reference_cache,
            _lock: output.lock,
        })
    }

    /// `train.output_dir`: created; rank 0 takes `.tallow-lock` before writing anything (a
    /// second run, or a second data-parallel job, is refused; held until the session drops),
    /// writes the resolved config first (the run directory says what ran) and opens the
    /// TensorBoard event file when `train.log` asks for one.
    fn open_output(
        cfg: &TrainConfig,
        main: bool,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Output, TrainError> {
        let t = &cfg.train;
        let dir = t.output_dir.clone();
        std::fs::create_dir_all(&dir)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", dir.display())))?;
        if !main {
            return Ok(Output {
                dir,
                lock: None,
                tensorboard: None,
            });
        }
        let (lock, note) = RunLock::acquire(&dir)?;
        if let Some(n) = note {
            on_event(Event::Note(n));
        }
        tallow_model::io::write_atomic(&dir.join("config.toml"), cfg.to_toml_string().as_bytes())?;
        let tensorboard = match t.log.contains(&crate::config::LogSink::Tensorboard) {
            true => {
                let tb = dir.join("tensorboard");
                Some(
                    crate::tensorboard::EventWriter::create(&tb)
                        .map_err(|e| tensorboard_error(&tb, e))?,
                )
            }
            false => None,
        };
        Ok(Output {
            dir,
            lock: Some(lock),
            tensorboard,
        })
    }

    /// Data, model and adapters ([`setup`]) under the memory check, and their notes (rows that
    /// had nothing left to train after cutting to `data.max_seq_len`).
    fn load(
        cfg: &TrainConfig,
        device: &Device,
        memory: &Memory,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Setup, TrainError> {
        let loaded = memory.check(setup(cfg, device), "load", 0, &None)?;
        for n in &loaded.notes {
            on_event(Event::Note(n.clone()));
        }
        let unit = if cfg.train.method.preference() {
            "pairs"
        } else {
            "rows"
        };
        for (key, n) in [
            ("data.train", loaded.skipped.0),
            ("data.eval", loaded.skipped.1),
        ] {
            if n > 0 {
                on_event(Event::Note(format!(
                    "{key}: {n} {unit} skipped: nothing left to train after cutting to \
                     data.max_seq_len = {} tokens",
                    cfg.data.max_seq_len
                )));
            }
        }
        Ok(loaded)
    }

    /// The optimizer and its shard of the trainable tensors, the step plan (a data-parallel
    /// step is `grad_accum` micro-batches on each rank; preference runs schedule pairs, rows 2i
    /// and 2i + 1) and the identity a checkpoint of this run must match.
    fn plan(cfg: &TrainConfig, dist: &Dist, loaded: &Setup) -> Planned {
        let t = &cfg.train;
        let vars: Vec<Var> = loaded.params.iter().map(|(_, v)| v.clone()).collect();
        let opt: Box<dyn Optimizer> = optim::build(t.optimizer, t.betas, t.eps, t.weight_decay);
        let rows_per_step = t.micro_batch_size * t.grad_accum * dist.world;
        let objective = Objective::of(cfg);
        let units = match objective {
            Some(_) => loaded.rows.len() / 2,
            None => loaded.rows.len(),
        };
        let plan = Schedule::new(units, rows_per_step, cfg.data.shuffle, t.seed);
        let total_steps = if t.max_steps > 0 {
            t.max_steps
        } else {
            t.epochs * plan.steps_per_epoch
        };
        let identity = checkpoint_identity(
            cfg,
            &loaded.model,
            &loaded.params,
            loaded.lora.as_ref(),
            opt.name(),
            dist.world,
        );
        // train.shard_optimizer (ZeRO stage 1): this rank's tensors; else all of them.
        let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
        let shard = Shard::new(&sizes, dist, t.shard_optimizer);
        Planned {
            vars,
            opt,
            objective,
            plan,
            total_steps,
            identity,
            shard,
        }
    }

    /// `--resume`: the newest checkpoint's weights, optimizer state and counters ([`resume_from`]),
    /// or a note that there is none and the run starts from step 0.
    #[allow(clippy::too_many_arguments)]
    fn resume(
        out: &Path,
        device: &Device,
        identity: &CheckpointState,
        params: &[(String, Var)],
        vars: (&[Var], &Shard),
        opt: &mut dyn Optimizer,
        memory: &Memory,
        main: bool,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Option<Resumed>, TrainError> {
        let resumed = resume_from(
            out,
            device,
            identity,
            params,
            vars,
            opt,
            main.then_some(memory.metrics.as_path()),
        )?;
        if resumed.is_none() {
            on_event(Event::Note(format!(
                "no checkpoint in {}: starting from step 0",
                checkpoint::checkpoints_dir(out).display()
            )));
        }
        Ok(resumed)
    }

    /// The start of training: [`Event::Start`], the reference log-probs of every train row
    /// once (`preference.precompute_ref`), and on a fresh start the step-0 metrics line and the
    /// first evaluation.
    #[allow(clippy::too_many_arguments)]
    fn begin(
        cfg: &TrainConfig,
        loaded: &Setup,
        objective: &Option<Objective>,
        (start_step, total_steps): (usize, usize),
        resumed_from: Option<&Path>,
        memory: &Memory,
        tensorboard: &mut Option<crate::tensorboard::EventWriter>,
        dist: &Dist,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Begun, TrainError> {
        let main = dist.is_main();
        let trainable_params = loaded.params.iter().map(|(_, v)| v.elem_count()).sum();
        let load_peak_bytes = memory.probe.peak();
        let load_live_bytes = memory.probe.current();
        on_event(Event::Start {
            total_steps,
            start_step,
            trainable_params,
            rows: loaded.rows.len(),
            resumed_from,
            load_peak_bytes,
            load_live_bytes,
            memory: memory.probe.what(),
        });
        let reference_cache = match objective {
            Some(o) if o.needs_reference() && cfg.preference.precompute_ref => {
                let mut note = |n: String| on_event(Event::Note(n));
                // A full-weight run resumed has moved the weights: only the cache made
                // before its first step is its reference.
                let weights_moved = cfg.trains_full() && start_step > 0;
                Some(preference::reference_cache(
                    cfg,
                    &loaded.model,
                    &loaded.rows,
                    loaded.pad,
                    weights_moved,
                    main,
                    &mut note,
                )?)
            }
            _ => None,
        };
        let eval_start = if start_step == 0 {
            let mb = cfg.train.micro_batch_size;
            eval_loss(
                &loaded.model,
                &loaded.eval,
                mb,
                loaded.pad,
                *objective,
                dist,
            )?
        } else {
            None
        };
        // A bf16 model on the CPU multiplies its base weights on AMX tiles where the CPU has
        // them (`tallow_model::kernels::amx`), else widened to f32: said once, as the speed
        // differs by about 1.5x.
        use tallow_model::kernels::dispatch::Backend;
        let on_amx = (Backend::of(loaded.model.device()) == Backend::Cpu
            && loaded.model.dtype() == candle_core::DType::BF16)
            .then(tallow_model::kernels::amx::enabled);
        if let (Some(amx), true) = (on_amx, main) {
            on_event(Event::Note(format!(
                "bf16 base matmuls on the CPU: {}",
                if amx {
                    "AMX tiles"
                } else {
                    "widened to f32 (no AMX-BF16 on this CPU, or TALLOW_CPU_AMX=0)"
                }
            )));
        }
        if resumed_from.is_none() && main {
            let mut line = serde_json::json!({
                "step": 0,
                "load_peak_bytes": load_peak_bytes,
                "load_live_bytes": load_live_bytes,
                "trainable_params": trainable_params,
                "memory": memory.probe.what(),
            });
            if let Some(amx) = on_amx {
                line["bf16_cpu_matmul"] = if amx { "amx" } else { "f32 gemm" }.into();
            }
            append_metrics(&memory.metrics, &line)?;
        }
        if let Some(e) = &eval_start {
            if main {
                record_eval(&memory.metrics, tensorboard, 0, e)?;
            }
            on_event(Event::Eval {
                step: 0,
                loss: e.loss,
            });
        }
        Ok(Begun {
            trainable_params,
            load_peak_bytes,
            eval_loss_start: eval_start.as_ref().map(|e| e.loss),
            reference_cache,
        })
    }

    /// Whether step `done` (1-based) writes a metrics line: every `log_every`-th step and the
    /// last one.
    fn logged(&self, done: usize) -> bool {
        done.is_multiple_of(self.cfg.train.log_every.max(1)) || done == self.total_steps
    }

    /// Phase "forward" + "backward" of optimizer step `step` (0-based): over its `grad_accum`
    /// micro-batches ([`micro_batches`]), the loss is the micro-batch's NLL over the step's
    /// target tokens (its share of the step mean); the gradients are summed in the accumulator
    /// and the NLL on the device (no host read).
    fn forward_backward(&mut self, step: usize) -> Result<ForwardBackward, TrainError> {
        if let Some(objective) = self.objective {
            return self.forward_backward_pairs(step, objective);
        }
        let mut tally = self.tally_start(step);
        let step_rows: Vec<&Row> = self
            .plan
            .rows(step)
            .into_iter()
            .map(|i| &self.rows[i])
            .collect();
        // Over all ranks: the loss is the step's mean over every rank's targets.
        let step_targets: usize = step_rows.iter().map(|r| r.n_targets()).sum();
        tally.tokens = step_rows.iter().map(|r| r.ids.len()).sum();
        tally.target_tokens = step_targets;
        let micros: Vec<&[&Row]> = step_rows.chunks(self.cfg.train.micro_batch_size).collect();
        let (pad, device) = (self.pad, self.device);
        let prepare = |m: usize| Ok(Batch::from_rows(micros[m], pad, device)?);
        let n_micros = micros.len();
        let forward = |model: &CausalLM, batch: &Batch| -> Result<MicroForward, TrainError> {
            let valid = batch.valid();
            let share = aux_share(model, n_micros);
            let (hidden, aux) = model.forward_hidden_aux(
                &batch.input_ids,
                batch.segments.as_deref(),
                valid.as_deref(),
                share,
            )?; // (B, T, C), and a mixture of experts' load-balancing loss
            let nll = lm_head_nll(
                &hidden,
                model.lm_head_weight(),
                &batch.targets,
                model.config.variant.final_logit_softcapping,
            )?; // sum over targets
            let loss = (&nll / step_targets as f64)?; // this micro-batch's share of the step mean
            Ok(MicroForward::with_aux(
                loss,
                vec![nll.detach()],
                aux,
                share,
            )?)
        };
        let run = micro_batches(
            loop_parts!(self, step, &mut tally),
            micros.len(),
            &prepare,
            &forward,
        )?;
        Ok(ForwardBackward {
            // A rank with no micro-batch in a short last step adds nothing.
            nll_sum: run.sum(0, &[], self.device)?,
            loss_divisor: step_targets as f64,
            preference: None,
            aux: aux_sums(&run, 1, self.device)?,
            tally,
        })
    }

    /// [`Session::forward_backward`] of a preference run: each micro-batch of m pairs is one
    /// forward of 2m rows (chosen, then rejected); DPO's reference log-probs come from the
    /// cache (`precompute_ref`) or from a forward of the same batch with the adapters off and
    /// no graph, inside the forward phase. The loss shares ([`preference::micro_loss`]) are
    /// normalized by the step's pairs (and ORPO's NLL by its chosen tokens); the metric sums
    /// stay on the device for the step's one read.
    fn forward_backward_pairs(
        &mut self,
        step: usize,
        objective: Objective,
    ) -> Result<ForwardBackward, TrainError> {
        let mut tally = self.tally_start(step);
        let pair_ids = self.plan.rows(step);
        let step_pairs: Vec<(&Row, &Row)> = pair_ids
            .iter()
            .map(|&i| (&self.rows[2 * i], &self.rows[2 * i + 1]))
            .collect();
        tally.target_tokens = step_pairs
            .iter()
            .map(|(c, r)| c.n_targets() + r.n_targets())
            .sum();
        tally.tokens = step_pairs
            .iter()
            .map(|(c, r)| c.ids.len() + r.ids.len())
            .sum();
        let n_pairs = step_pairs.len();
        let chosen_tokens = preference::chosen_tokens(step_pairs.iter().copied());
        let mb = self.cfg.train.micro_batch_size;
        #[allow(clippy::type_complexity)]
        let micros: Vec<(&[(&Row, &Row)], &[usize])> =
            step_pairs.chunks(mb).zip(pair_ids.chunks(mb)).collect();
        let (pad, device, cache) = (self.pad, self.device, &self.reference_cache);
        let prepare = |m: usize| -> Result<_, TrainError> {
            let (micro, ids) = micros[m];
            Ok((PairBatch::new(micro, pad, device)?, ids))
        };
        let forward = |model: &CausalLM,
                       (pb, ids): &(PairBatch, &[usize])|
         -> Result<MicroForward, TrainError> {
            let reference = match (cache, objective.needs_reference()) {
                (_, false) => None,
                (Some(cache), true) => {
                    // (2m): the chosen rows' cached values, then the rejected rows'.
                    let v: Vec<f32> = ids
                        .iter()
                        .map(|&i| cache[2 * i])
                        .chain(ids.iter().map(|&i| cache[2 * i + 1]))
                        .collect();
                    Some(Tensor::from_vec(v, 2 * ids.len(), device)?)
                }
                (None, true) => Some(preference::reference_logps(model, pb)?),
            };
            let b = &pb.batch;
            // A mixture of experts: TRL's DPO and ORPO trainers add coef * aux of the
            // concatenated forward (chosen and rejected rows, padding not counted) to each
            // batch's loss.
            let share = aux_share(model, micros.len());
            let valid = b.valid();
            let (hidden, aux) = model.forward_hidden_aux(
                &b.input_ids,
                b.segments.as_deref(),
                valid.as_deref(),
                share,
            )?; // (2m, T, C)
            let ml = preference::micro_loss(
                &objective,
                model,
                &hidden,
                pb,
                reference.as_ref(),
                n_pairs,
                chosen_tokens,
            )?;
            let sums = vec![ml.loss.detach(), ml.sums];
            Ok(MicroForward::with_aux(ml.loss, sums, aux, share)?)
        };
        let run = micro_batches(
            loop_parts!(self, step, &mut tally),
            micros.len(),
            &prepare,
            &forward,
        )?;
        Ok(ForwardBackward {
            // A rank with no micro-batch in a short last step adds nothing.
            nll_sum: run.sum(0, &[], self.device)?,
            loss_divisor: 1.0,
            preference: Some((
                run.sum(1, &[preference::METRIC_NAMES.len()], self.device)?,
                n_pairs,
                chosen_tokens,
            )),
            aux: aux_sums(&run, 2, self.device)?,
            tally,
        })
    }

    /// A step's tally at its start: the clock, whether it measures memory (logged, or checked
    /// against --memory-limit; the others never probe: on CUDA each probe call synchronizes the
    /// stream), and the probe and host-read counters.
    fn tally_start(&self, step: usize) -> StepTally {
        StepTally {
            started: Instant::now(),
            measure: self.memory.limit.is_some() || self.logged(step + 1),
            probes_before: crate::memory::probes(),
            reads_before: host::reads(),
            tokens: 0,
            target_tokens: 0,
            peaks: PhasePeaks::default(),
            ops_forward: opcount::Counts::default(),
            ops_backward: opcount::Counts::default(),
            launches_optimizer: 0,
        }
    }

    /// Phase "optimizer" of step `step`: takes the summed gradients, clips them to
    /// `max_grad_norm`, reads the step's loss and gradient norm together (the one host read of
    /// the step, a stream sync on CUDA), stops on a non-finite value before the weights change,
    /// and steps the optimizer at the scheduled learning rate. A measuring step resets and
    /// reads the probe around it (2 probe calls; under `--memory-limit` 2 more, the checks of
    /// taking the gradients and of the update).
    fn update(&mut self, step: usize, fb: ForwardBackward) -> Result<Updated, TrainError> {
        let t = &self.cfg.train;
        let ForwardBackward {
            nll_sum,
            loss_divisor,
            preference,
            aux,
            mut tally,
        } = fb;
        let probe = self.memory.probe.on_step(tally.measure);
        probe.start_phase();
        let taken = self.acc.take().map_err(TrainError::from);
        let grads = self
            .memory
            .check(taken, "optimizer", step + 1, &self.last_checkpoint)?;
        // Data parallel: the gradients, loss and metric sums summed over the ranks, bucketed
        // (one process: no collective, and no extra check of the limit).
        let (mut grads, nll_sum, preference) = match self.dist.world {
            1 => (grads, nll_sum, preference),
            _ => self.memory.check(
                self.reduce(grads, nll_sum, preference),
                "optimizer",
                step + 1,
                &self.last_checkpoint,
            )?,
        };
        // The phase's device operations, counted from the gradient norm on (per parameter: its
        // sum of squares and, with clipping, its scaling) to the optimizer's update.
        let ops = opcount::mark();
        // the clipping's coefficient goes to an optimizer that scales each gradient as it
        // reads it (AdamW: in its f32 kernel, or group by group); for the others the
        // gradients are clipped here, in place
        let (grad_norm, mut clip) = norm_and_clip_coefficient(&grads, t.max_grad_norm)?;
        if !self.opt.applies_grad_scale() {
            if let Some(coef) = clip.take() {
                scale_in_place(&mut grads, &coef)?;
            }
        }
        // The one host read of the step: its loss and gradient norm together (and a preference
        // run's metric sums).
        let mut parts = vec![
            nll_sum.to_dtype(DType::F64)?.reshape(1)?,
            grad_norm
                .to_device(nll_sum.device())?
                .to_dtype(DType::F64)?
                .reshape(1)?,
        ];
        if let Some((sums, _, _)) = &preference {
            parts.push(sums.clone());
        }
        if let Some(aux) = &aux {
            parts.push(aux.to_device(nll_sum.device())?);
        }
        let read = {
            // Data parallel on CUDA: the all-reduce's result arrives here (NCCL is async).
            let _waiting = self
                .dist
                .waiting("reading the step's loss after the gradient all-reduce");
            host::read(&Tensor::cat(&parts, 0)?)?
        };
        let (loss, grad_norm) = (read[0] / loss_divisor, read[1]);
        let aux_loss = aux.is_some().then(|| {
            let [sum, n] = [read[read.len() - 2], read[read.len() - 1]];
            sum / n.max(1.0)
        });
        let preference = match (&preference, self.objective) {
            (Some((_, pairs, tokens)), Some(obj)) => Some(
                Metrics::from_sums(&obj, &read[2..], *pairs, *tokens)
                    .values
                    .into_iter()
                    .collect(),
            ),
            _ => None,
        };
        for (what, value) in [("loss", loss), ("gradient norm", grad_norm)] {
            if !value.is_finite() {
                return Err(TrainError::NonFinite {
                    step: step + 1,
                    what,
                    value,
                    kept: kept_message(&self.last_checkpoint),
                });
            }
        }
        let lr = lr_at(t.schedule, t.lr, step, t.warmup_steps, self.total_steps);
        let stepped = self.shard.step(
            self.opt.as_mut(),
            &self.vars,
            self.dist,
            &grads,
            clip.as_ref(),
            lr,
        );
        tally.launches_optimizer = opcount::since(ops).launches;
        self.memory
            .check(stepped, "optimizer", step + 1, &self.last_checkpoint)?;
        drop(grads);
        tally.peaks.optimizer = probe.peak();
        self.run_peaks = self.run_peaks.merge(&tally.peaks);
        Ok(Updated {
            loss,
            grad_norm,
            lr,
            preference,
            aux_loss,
            tally,
        })
    }

    /// The [`StepLog`] of step `step`: appended to `metrics.jsonl` on logged steps, reported as
    /// [`Event::Step`] on every step. No host read; a measuring step reads the live bytes (one
    /// probe call).
    fn log(
        &mut self,
        step: usize,
        upd: Updated,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<StepLog, TrainError> {
        let Updated {
            loss,
            grad_norm,
            lr,
            preference,
            aux_loss,
            tally,
        } = upd;
        let probe = self.memory.probe.on_step(tally.measure);
        let done = step + 1;
        self.tokens_seen += tally.tokens as u64;
        let dt = tally.started.elapsed().as_secs_f64();
        let log = StepLog {
            step: done,
            loss,
            lr,
            grad_norm,
            tokens: tally.tokens,
            target_tokens: tally.target_tokens,
            tokens_per_s: tally.tokens as f64 / dt.max(1e-9),
            elapsed_s: self.elapsed_before + self.started.elapsed().as_secs_f64(),
            peak_bytes: tally.peaks,
            host_reads: host::reads() - tally.reads_before,
            live_bytes: probe.current(),
            optimizer_state_bytes: self.opt.state_bytes() as u64,
            // After `live_bytes` (fields are evaluated in this order): it is a probe call too.
            memory_probes: crate::memory::probes() - tally.probes_before,
            ops_forward: tally.ops_forward.ops,
            ops_backward: tally.ops_backward.ops,
            launches_forward: tally.ops_forward.launches,
            launches_backward: tally.ops_backward.launches,
            launches_optimizer: tally.launches_optimizer,
            aux_loss,
            preference,
        };
        if self.logged(done) && self.dist.is_main() {
            append_metrics(&self.memory.metrics, &log)?;
            if let Some(tb) = &mut self.tensorboard {
                let scalars = step_scalars(&log);
                let tags: Vec<(&str, f64)> =
                    scalars.iter().map(|(t, x)| (t.as_str(), *x)).collect();
                tb.scalars(done, &tags)
                    .map_err(|e| tensorboard_error(tb.path(), e))?;
            }
        }
        on_event(Event::Step(&log));
        self.last_loss = Some(loss);
        Ok(log)
    }

    /// Evaluates (every `eval_every` steps) and checkpoints (every `save_every` steps) after the
    /// step `log` describes; the last step does both. An evaluation is one host read; a
    /// checkpoint copies the trainable tensors and the optimizer state to the host and writes
    /// them.
    fn eval_and_checkpoint(
        &mut self,
        log: &StepLog,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(), TrainError> {
        let t = &self.cfg.train;
        let done = log.step;
        self.steps_done = done;
        let last = done == self.total_steps;
        let mut new_best = false;
        if (t.eval_every > 0 && done.is_multiple_of(t.eval_every)) || last {
            let outcome = eval_loss(
                &self.model,
                &self.eval,
                t.micro_batch_size,
                self.pad,
                self.objective,
                self.dist,
            )?;
            if let Some(e) = outcome {
                let l = e.loss;
                if self.dist.is_main() {
                    record_eval(&self.memory.metrics, &mut self.tensorboard, done, &e)?;
                }
                on_event(Event::Eval {
                    step: done,
                    loss: l,
                });
                self.eval_loss_end = Some(l);
                new_best = self
                    .best_eval
                    .observe(done, l, t.early_stopping_threshold)
                    .new_best;
                if !last && self.best_eval.exhausted(t.early_stopping_patience) {
                    self.stopped_early = true;
                    on_event(Event::Note(early_stop_message(
                        &self.best_eval,
                        t.early_stopping_patience,
                        t.early_stopping_threshold,
                        done,
                    )));
                }
            }
        }
        let save_due = (t.save_every > 0 && done.is_multiple_of(t.save_every)) || last;
        if save_due || self.stopped_early || (t.keep_best && new_best) {
            let state = CheckpointState {
                step: done,
                tokens_seen: self.tokens_seen,
                elapsed_s: log.elapsed_s,
                best_eval: self.best_eval.clone(),
                ..self.identity.clone()
            };
            let trainable: Vec<(String, Tensor)> = self
                .params
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                .collect();
            // Every rank takes part (a sharded optimizer's state is gathered); rank 0 writes.
            let optimizer = self.optimizer_state()?;
            let path = match self.dist.is_main() {
                true => checkpoint::save(&self.out, &state, &trainable, &optimizer)?,
                false => checkpoint::checkpoints_dir(&self.out).join(format!("step-{done}")),
            };
            on_event(Event::Checkpoint {
                step: done,
                path: &path,
            });
            self.last_checkpoint = Some(path);
            if t.save_total_limit > 0 && self.dist.is_main() {
                let keep = t.keep_best.then(|| self.best_eval.best_step()).flatten();
                checkpoint::rotate(&self.out, t.save_total_limit, keep)?;
            }
        }
        Ok(())
    }

    /// The final output: a PEFT adapter in `adapter/`, or the whole model in HF layout in
    /// `model/` (a copy of every weight to the host), and the run's [`Summary`].
    fn finish(self, on_event: &mut dyn FnMut(Event)) -> Result<Summary, TrainError> {
        // Optimizer-state memory (adamw: 8 bytes per trainable parameter; adamw8bit: about 2).
        on_event(Event::Note(format!(
            "optimizer state ({}): {} for {} trainable parameters",
            self.opt.name(),
            crate::memory::human_bytes(self.opt.state_bytes() as u64),
            self.trainable_params
        )));

        // With keep_best: the last step's weights beside, then the best checkpoint's into the
        // trainable variables for the main output.
        let name = if self.lora.is_some() {
            "adapter"
        } else {
            "model"
        };
        let main = self.dist.is_main();
        let output_last = match (self.cfg.train.keep_best, self.best_eval.best_step()) {
            (true, Some(_)) if !main => Some(self.out.join(format!("{name}-last"))),
            (true, Some(best)) => {
                let last = self.out.join(format!("{name}-last"));
                self.save_output(&last)?;
                if best != self.steps_done {
                    self.load_best(best)?;
                }
                on_event(Event::Note(format!(
                    "keep_best: {}/ holds step {best}'s weights (eval loss {:.4}), {name}-last/ \
                     step {}'s",
                    name,
                    self.best_eval.best.map_or(f64::NAN, |(_, l)| l),
                    self.steps_done
                )));
                Some(last)
            }
            _ => None,
        };
        let output = self.out.join(name);
        if main {
            self.save_output(&output)?;
        }
        Ok(Summary {
            steps: self.steps_done,
            stopped_early: self.stopped_early,
            best_eval: self.best_eval.best,
            output_last,
            last_loss: self.last_loss,
            eval_loss_start: self.eval_loss_start,
            eval_loss_end: self.eval_loss_end,
            output,
            elapsed_s: self.elapsed_before + self.started.elapsed().as_secs_f64(),
            load_peak_bytes: self.load_peak_bytes,
            peak_bytes: self.run_peaks,
        })
    }
}

impl Session<'_> {
    /// Data parallel: sums the step's gradients, its loss sum and (preference runs) its metric
    /// sums over the ranks, in one bucketed all-reduce.
    #[allow(clippy::type_complexity)]
    fn reduce(
        &self,
        mut grads: Vec<Tensor>,
        nll_sum: Tensor,
        preference: Option<(Tensor, usize, usize)>,
    ) -> Result<(Vec<Tensor>, Tensor, Option<(Tensor, usize, usize)>), TrainError> {
        let n = grads.len();
        grads.push(nll_sum);
        if let Some((sums, _, _)) = &preference {
            grads.push(sums.clone());
        }
        let mut all = self.dist.all_reduce_sum(grads, "the gradient all-reduce")?;
        let preference =
            preference.map(|(_, pairs, tokens)| (all.pop().expect("sums"), pairs, tokens));
        let nll_sum = all.pop().expect("loss sum");
        debug_assert_eq!(all.len(), n);
        Ok((all, nll_sum, preference))
    }

    /// The optimizer state for a checkpoint, named by each tensor's index in the whole
    /// trainable list. With `train.shard_optimizer` every rank's share is gathered (each rank
    /// must call this; rank 0 gets the whole state, the others their own).
    fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let local = self.shard.global_state_names(self.opt.state());
        if self.shard.owns_all(self.vars.len()) {
            return Ok(local);
        }
        let cpu: Vec<(String, Tensor)> = local
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
            .collect::<candle_core::Result<_>>()?;
        let bytes = safetensors::serialize(cpu.iter().map(|(n, t)| (n.as_str(), t)), None)
            .map_err(|e| TrainError::Invalid(format!("optimizer state: {e}")))?;
        let parts = self
            .dist
            .all_gather_bytes(&bytes, "gathering the sharded optimizer state")?;
        let mut merged: BTreeMap<String, Tensor> = BTreeMap::new();
        for part in parts {
            merged.extend(candle_core::safetensors::load_buffer(&part, &Device::Cpu)?);
        }
        Ok(merged.into_iter().collect())
    }

    /// The PEFT adapter (LoRA runs) or the whole model in HF layout into `dir`.
    fn save_output(&self, dir: &Path) -> Result<(), TrainError> {
        match &self.lora {
            Some(spec) => save_peft(
                &self.model,
                spec,
                dir,
                &self.cfg.model.path.display().to_string(),
            ),
            None => save_hf_model(&self.model, &self.model_dir, dir, self.model.dtype()),
        }?;
        Ok(())
    }

    /// Sets the trainable variables to the checkpoint of step `step` (the best evaluation's,
    /// which `save_total_limit` never removes).
    fn load_best(&self, step: usize) -> Result<(), TrainError> {
        let dir = checkpoint::checkpoints_dir(&self.out).join(format!("step-{step}"));
        if !dir.join("state.json").exists() {
            return Err(TrainError::Invalid(format!(
                "train.keep_best: the best evaluation's checkpoint {} is gone (removed by hand?); \
                 the last step's weights are in the -last output",
                dir.display()
            )));
        }
        let ck = checkpoint::load(&dir, self.device)?;
        set_trainable(&self.params, &ck, &dir)
    }
}

/// What `train.early_stopping_patience` stopping the run says.
fn early_stop_message(best: &BestEval, patience: usize, threshold: f64, step: usize) -> String {
    let (best_step, best_loss) = best.best.unwrap_or((0, f64::NAN));
    format!(
        "early stopping at step {step}: {patience} evaluation(s) in a row without the eval loss \
         improving by more than {threshold}; best {best_loss:.4} at step {best_step}"
    )
}

/// An evaluation during training: the loss and, for a preference run, TRL's metrics.
struct EvalOutcome {
    loss: f64,
    preference: Vec<(&'static str, f64)>,
}

/// The mean loss over the eval set (None without one), at the training micro-batch and without
/// a graph ([`crate::eval`]): it needs less memory than the training forward that already ran at
/// this batch size. A preference run evaluates its objective on the eval pairs
/// ([`preference::evaluate`], the reference with the adapters off). One host read.
///
/// Data parallel: each rank evaluates its block of the eval rows and the NLL and token sums
/// are summed over the ranks; a preference evaluation runs whole on every rank (the same
/// result everywhere).
fn eval_loss(
    model: &CausalLM,
    eval: &[Example],
    micro_batch_size: usize,
    pad: u32,
    objective: Option<Objective>,
    dist: &Dist,
) -> Result<Option<EvalOutcome>, TrainError> {
    if eval.is_empty() {
        return Ok(None);
    }
    Ok(Some(match objective {
        None if dist.world > 1 => {
            let block = dist.block(eval.len(), eval.len().div_ceil(dist.world));
            let part = evaluate(model, &eval[block], micro_batch_size, pad, |_| {})?;
            let sums = Tensor::new(&[part.nll_sum, part.tokens as f64], model.device())?;
            let sums = dist.all_reduce_sum(vec![sums], "the evaluation's sums")?;
            let _waiting = dist.waiting("reading the evaluation's sums");
            let read = host::read(&sums[0])?;
            EvalOutcome {
                loss: read[0] / read[1],
                preference: vec![],
            }
        }
        None => EvalOutcome {
            loss: evaluate(model, eval, micro_batch_size, pad, |_| {})?.loss,
            preference: vec![],
        },
        Some(obj) => {
            let (loss, metrics) = preference::evaluate(&obj, model, eval, micro_batch_size, pad)?;
            EvalOutcome {
                loss,
                preference: metrics.values,
            }
        }
    }))
}

/// An evaluation's metrics line (`eval_loss`, and TRL's `eval_rewards/accuracies`, ...) and
/// TensorBoard scalars (`eval/loss`, `eval/rewards/accuracies`, ...).
fn record_eval(
    metrics: &Path,
    tensorboard: &mut Option<crate::tensorboard::EventWriter>,
    step: usize,
    e: &EvalOutcome,
) -> Result<(), TrainError> {
    let mut line = serde_json::json!({"step": step, "eval_loss": e.loss});
    let mut scalars = vec![("eval/loss".to_string(), e.loss)];
    for (name, x) in &e.preference {
        line[format!("eval_{name}")] = serde_json::json!(x);
        scalars.push((format!("eval/{name}"), *x));
    }
    append_metrics(metrics, &line)?;
    if let Some(tb) = tensorboard {
        let tags: Vec<(&str, f64)> = scalars.iter().map(|(t, x)| (t.as_str(), *x)).collect();
        tb.scalars(step, &tags)
            .map_err(|e| tensorboard_error(tb.path(), e))?;
    }
    Ok(())
}

/// What a checkpoint of this run must match to be resumed: method, architecture, model path,
/// LoRA shape, trainable tensors and their shapes, optimizer, quantization, number of ranks.
fn checkpoint_identity(
    cfg: &TrainConfig,
    model: &CausalLM,
    params: &[(String, Var)],
    lora: Option<&LoraSpec>,
    optimizer: &str,
    world_size: usize,
) -> CheckpointState {
    CheckpointState {
        step: 0,
        method: format!("{:?}", cfg.train.method).to_lowercase(),
        architecture: model.config.arch.hf_class().into(),
        model_path: cfg.model.path.display().to_string(),
        lora: lora.map(|s| LoraState {
            rank: s.rank,
            alpha: s.alpha,
            targets: s.targets.clone(),
            rslora: s.rslora,
            kind: Some(s.kind),
            dora: false,
        }),
        trainable: params
            .iter()
            .map(|(n, v)| (n.clone(), v.dims().to_vec()))
            .collect::<BTreeMap<_, _>>(),
        optimizer: optimizer.into(),
        quantize: match (cfg.model.quantize, cfg.model.double_quant) {
            (Quantize::Nf4, true) => format!("{}+double_quant", Quantize::Nf4),
            (q, _) => q.name().into(),
        },
        tokens_seen: 0,
        elapsed_s: 0.0,
        best_eval: BestEval::default(),
        world_size,
        tallow_version: env!("CARGO_PKG_VERSION").into(),
    }
}

/// Where a resumed run picks up.
struct Resumed {
    /// The checkpoint's directory.
    dir: PathBuf,
    step: usize,
    tokens_seen: u64,
    elapsed_s: f64,
    best_eval: BestEval,
}

/// Loads the newest checkpoint in `out` (None when there is none), after checking it is one of
/// a run like this (`identity`), into the trainable variables and the optimizer, and drops the
/// lines of `metrics` of the steps after it (the resumed run redoes them).
///
/// `vars` with the indices this rank's optimizer owns (all, or its `shard_optimizer` share: it
/// loads only those tensors' state). `metrics`: None on ranks other than 0.
fn resume_from(
    out: &Path,
    device: &Device,
    identity: &CheckpointState,
    params: &[(String, Var)],
    (vars, shard): (&[Var], &Shard),
    opt: &mut dyn Optimizer,
    metrics: Option<&Path>,
) -> Result<Option<Resumed>, TrainError> {
    let Some((_, dir)) = checkpoint::latest(out) else {
        return Ok(None);
    };
    let ck = checkpoint::load(&dir, device)?;
    checkpoint::check_compatible(&ck.state, identity, &dir)?;
    set_trainable(params, &ck, &dir)?;
    opt.load_state(
        &shard.owned_vars(vars),
        &shard.local_state_names(&ck.optimizer),
    )?;
    if let Some(metrics) = metrics {
        truncate_metrics(metrics, ck.state.step)?;
    }
    Ok(Some(Resumed {
        dir,
        step: ck.state.step,
        tokens_seen: ck.state.tokens_seen,
        elapsed_s: ck.state.elapsed_s,
        best_eval: ck.state.best_eval,
    }))
}

/// The session's [`LoopParts`] for step `$step`, each field borrowed on its own so that the
/// forward closure may borrow the rows beside them.
macro_rules! loop_parts {
    ($s:ident, $step:expr, $tally:expr) => {
        LoopParts {
            memory: &$s.memory,
            acc: &mut $s.acc,
            model: &$s.model,
            dist: $s.dist,
            train: &$s.cfg.train,
            last_checkpoint: &$s.last_checkpoint,
            step: $step,
            tally: $tally,
        }
    };
}
use loop_parts;

/// What one micro-batch's forward gives the loop: its share of the step's loss (what the
/// backward starts from) and the values the step sums on the device.
struct MicroForward {
    loss: Tensor,
    sums: Vec<Tensor>,
}

impl MicroForward {
    /// `loss` plus `share` x a mixture of experts' load-balancing loss `aux` when the forward
    /// recorded one, which then also goes into `sums` with a 1 (the micro-batches run, for the
    /// metric's mean; [`aux_sums`] reads the two).
    fn with_aux(
        loss: Tensor,
        mut sums: Vec<Tensor>,
        aux: Option<Tensor>,
        share: f64,
    ) -> candle_core::Result<Self> {
        let Some(aux) = aux else {
            return Ok(Self { loss, sums });
        };
        let aux = aux.to_dtype(loss.dtype())?;
        let loss = (loss + (&aux * share)?)?;
        let one = Tensor::ones((), aux.dtype(), aux.device())?;
        sums.push(aux.detach());
        sums.push(one);
        Ok(Self { loss, sums })
    }
}

/// The load-balancing loss's weight in each of a step's `n_micros` micro-batches:
/// `router_aux_loss_coef` / n, as transformers adds coef * aux to each forward's loss and the HF
/// Trainer divides each micro-batch's loss by the accumulation steps (0: a dense model).
fn aux_share(model: &CausalLM, n_micros: usize) -> f64 {
    model
        .config
        .moe
        .as_ref()
        .map_or(0.0, |m| m.router_aux_loss_coef / n_micros as f64)
}

/// The session's parts the micro-batch loop uses (borrowed apart from the rows and caches the
/// forward reads).
struct LoopParts<'a> {
    memory: &'a Memory,
    acc: &'a mut GradAccumulator,
    model: &'a CausalLM,
    dist: &'a Dist,
    train: &'a crate::config::TrainSection,
    last_checkpoint: &'a Option<PathBuf>,
    step: usize,
    /// The step's tally: whether it measures memory; the loop adds its peaks and op counts.
    tally: &'a mut StepTally,
}

/// What the loop leaves for the step: its sums (one per value of [`MicroForward::sums`]; None
/// on a rank with no micro-batch in a short last step), phase peaks and op counts.
struct MicroRun {
    sums: Vec<Option<Tensor>>,
    peaks: PhasePeaks,
    ops_forward: opcount::Counts,
    ops_backward: opcount::Counts,
}

impl MicroRun {
    /// Sum `i`, or zeros of `shape` (a rank that ran nothing adds nothing).
    fn sum(&self, i: usize, shape: &[usize], device: &Device) -> candle_core::Result<Tensor> {
        match self.sums.get(i).and_then(|s| s.clone()) {
            Some(s) => Ok(s),
            None if shape.is_empty() => Tensor::zeros((), DType::F32, device),
            None => Tensor::zeros(shape, DType::F64, device),
        }
    }
}

/// A mixture of experts' aux loss summed over this rank's micro-batches and their count, (2)
/// f64, from the sums at `i` and `i + 1` (where the forward put them); None when the model
/// recorded none.
fn aux_sums(run: &MicroRun, i: usize, device: &Device) -> candle_core::Result<Option<Tensor>> {
    if run.sums.len() != i + 2 {
        return Ok(None);
    }
    let part = |k| run.sum(k, &[], device)?.to_dtype(DType::F64);
    Ok(Some(Tensor::stack(&[part(i)?, part(i + 1)?], 0)?))
}

impl StepTally {
    fn add(&mut self, run: &MicroRun) {
        self.peaks = self.peaks.merge(&run.peaks);
        self.ops_forward += run.ops_forward;
        self.ops_backward += run.ops_backward;
    }
}

/// The micro-batch loop both objectives share: for this rank's block of the step's `n`
/// micro-batches (numbered over the whole step, so the dropout masks are those of one process
/// running them all), with each one's dropout seed, its batch (`prepare(m)`, before the
/// phase's probe), phase "forward" (`forward(model, batch)`, under the memory check), phase
/// "backward" ([`backward_micro`]), the sums kept on the device. A step
/// that measures memory resets and reads the probe around each pass (4 probe calls per
/// micro-batch, each a stream sync on CUDA; under `--memory-limit` one more per pass, its
/// check); the others make no probe call.
fn micro_batches<B>(
    p: LoopParts<'_>,
    n: usize,
    prepare: &dyn Fn(usize) -> Result<B, TrainError>,
    forward: &dyn Fn(&CausalLM, &B) -> Result<MicroForward, TrainError>,
) -> Result<MicroRun, TrainError> {
    let probe = p.memory.probe.on_step(p.tally.measure);
    let mut run = MicroRun {
        sums: Vec::new(),
        peaks: PhasePeaks::default(),
        ops_forward: opcount::Counts::default(),
        ops_backward: opcount::Counts::default(),
    };
    for m in p.dist.block(n, p.train.grad_accum) {
        set_dropout(p.model, Some(dropout_seed(p.train.seed, p.step, m)));
        let batch = prepare(m)?;
        probe.start_phase();
        let ops = opcount::mark();
        let out = p.memory.check(
            forward(p.model, &batch),
            "forward",
            p.step + 1,
            p.last_checkpoint,
        )?;
        run.ops_forward += opcount::since(ops);
        let forward_peak = probe.peak();
        probe.start_phase();
        run.ops_backward += backward_micro(
            p.memory,
            p.acc,
            p.model,
            &out.loss,
            p.step,
            p.last_checkpoint,
        )?;
        if run.sums.len() < out.sums.len() {
            run.sums.resize(out.sums.len(), None);
        }
        for (sum, value) in run.sums.iter_mut().zip(out.sums) {
            add_on_device(sum, value)?;
        }
        drop((out.loss, batch));
        run.peaks = run.peaks.merge(&PhasePeaks {
            forward: forward_peak,
            backward: probe.peak(),
            optimizer: None,
        });
    }
    set_dropout(p.model, None);
    p.tally.add(&run);
    Ok(run)
}

/// Phase "backward" of one micro-batch of step `step` (0-based): the gradients of `loss`, and
/// those checkpointed layers hand over separately, summed into `acc`, under the memory check.
/// Returns the tensors Candle created ([`opcount`]).
fn backward_micro(
    memory: &Memory,
    acc: &mut GradAccumulator,
    model: &CausalLM,
    loss: &Tensor,
    step: usize,
    last_checkpoint: &Option<PathBuf>,
) -> Result<opcount::Counts, TrainError> {
    let ops = opcount::mark();
    let mut run = || -> Result<(), TrainError> {
        acc.add(&loss.backward()?)?;
        for store in model.take_checkpoint_grads() {
            acc.add(&store)?;
        }
        Ok(())
    };
    memory.check(run(), "backward", step + 1, last_checkpoint)?;
    Ok(opcount::since(ops))
}

/// `sum += value` for a running sum kept on the device (read once at the end of the step).
fn add_on_device(sum: &mut Option<Tensor>, value: Tensor) -> candle_core::Result<()> {
    *sum = Some(match sum.take() {
        Some(acc) => (acc + value)?,
        None => value,
    });
    Ok(())
}

/// Sets each trainable variable to its tensor in the checkpoint `ck` read from `dir`.
fn set_trainable(
    params: &[(String, Var)],
    ck: &checkpoint::Loaded,
    dir: &Path,
) -> Result<(), TrainError> {
    for (name, var) in params {
        let saved = ck
            .trainable
            .get(name)
            .ok_or_else(|| TrainError::Resume(format!("{}: no tensor `{name}`", dir.display())))?;
        var.set(&saved.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// `train.tf32`: TF32 tensor cores for f32 matmuls when `device` is CUDA (Candle's switch,
/// process-wide; off by default in Candle, as in PyTorch). Nothing to do on the CPU.
fn set_tf32(device: &Device, on: bool) {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        candle_core::cuda::set_gemm_reduced_precision_f32(on);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (device, on);
}

/// What the last good checkpoint is, for error messages of a stopped run.
fn kept_message(last_checkpoint: &Option<PathBuf>) -> String {
    match last_checkpoint {
        Some(p) => format!(
            "The last good checkpoint is {} (continue with --resume).",
            p.display()
        ),
        None => "No checkpoint was written before it.".into(),
    }
}

/// The run's memory probe and what stops it as out of memory: a device OOM error, or a phase's
/// measured peak over `--memory-limit`.
struct Memory {
    probe: Probe,
    /// `--memory-limit` (a smaller device, emulated); None: the device's own memory.
    limit: Option<u64>,
    /// The GPU's memory on CUDA; None on the CPU.
    device_total: Option<u64>,
    /// `metrics.jsonl`, where an OOM is logged (with every other line of the run).
    metrics: PathBuf,
    /// Whether this process writes `metrics` (rank 0 of a data-parallel run).
    writes: bool,
}

impl Memory {
    /// The probe of `device`, its high-water mark reset for the load phase.
    fn start(device: &Device, limit: Option<u64>, metrics: PathBuf, writes: bool) -> Memory {
        let probe = Probe::for_device(device);
        let device_total = probe.device_total();
        probe.start_phase();
        Memory {
            probe,
            limit,
            device_total,
            metrics,
            writes,
        }
    }

    /// Turns a device out-of-memory error of `phase` into [`TrainError::OutOfMemory`] (other
    /// errors pass through), and stops the run as out of memory when the phase's measured peak
    /// went over the limit (`--memory-limit`: a smaller device, emulated). Either way the OOM is
    /// logged to `metrics.jsonl` as `{"step", "oom": {"phase", "peak_bytes", "limit_bytes"}}`.
    /// The peak is read (a probe call, a stream sync on CUDA) only on an OOM or under a limit.
    fn check<T>(
        &self,
        result: Result<T, TrainError>,
        phase: &'static str,
        step: usize,
        last_checkpoint: &Option<PathBuf>,
    ) -> Result<T, TrainError> {
        let (detail, peak_bytes, limit_bytes) = match result {
            Err(e) if e.is_device_oom() => (
                e.to_string(),
                self.probe.peak(),
                self.limit.or(self.device_total),
            ),
            Err(e) => return Err(e),
            // The peak is read only under a limit (on CUDA reading it synchronizes the device).
            Ok(v) => match self.limit.and_then(|l| Some((l, self.probe.peak()?))) {
                Some((l, p)) if p > l => (
                    format!(
                        "the measured peak {} is over --memory-limit {}",
                        crate::memory::human_bytes(p),
                        crate::memory::human_bytes(l)
                    ),
                    Some(p),
                    Some(l),
                ),
                _ => return Ok(v),
            },
        };
        if self.writes {
            let _ = append_metrics(
                &self.metrics,
                &serde_json::json!({"step": step, "oom": {
                    "phase": phase, "peak_bytes": peak_bytes, "limit_bytes": limit_bytes}}),
            );
        }
        Err(TrainError::OutOfMemory {
            phase,
            step,
            peak_bytes,
            limit_bytes,
            detail,
            kept: kept_message(last_checkpoint),
        })
    }
}
