//! Every key of the training config, each declared once with [`section!`]: its doc line (the
//! field's doc comment and its row in docs/config.md), name, Rust type (which gives its TOML
//! type), default and its own check. The key table, reading and writing, the defaults and
//! docs/config.md's tables follow from here; a check that reads several keys is in
//! `validate.rs`.
//!
//! A new key is one entry here (then `TALLOW_UPDATE_DOCS=1 cargo test -p tallow-trainer --lib
//! config_reference` writes its row into docs/config.md).

use std::path::PathBuf;

use super::section::section;
use super::validate::{
    ensure, in_range, non_negative, not_empty, placeholders, positive, valid_device,
    validate_targets,
};
use super::{
    AdapterKind, Attention, LogSink, LoraTargets, Method, ModelDtype, OptimizerKind,
    PreferenceLoss, Quantize, Schedule,
};
use crate::data::{Format, ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, DEFAULT_MAX_SEQ_LEN};

section! {
    /// `[model]`: the base model.
    pub struct ModelSection("model") {
        /// A local model dir in Hugging Face layout (`config.json`, safetensors,
        /// `tokenizer.json`), or a hub id `OWNER/NAME[@REVISION]` (downloaded into the HF cache,
        /// [hub.md](hub.md)).
        path: PathBuf = PathBuf::new(),
            required "add `path = \"models/Qwen2.5-0.5B-Instruct\"` (a local model dir with \
                      config.json, safetensors and tokenizer.json) under [model]",
            check |p| not_empty(
                p,
                "is empty; set it to a local model dir or a hub id, e.g. \
                 \"Qwen/Qwen2.5-0.5B-Instruct\"",
            );
        /// Storage and compute dtype of the frozen base.
        dtype: ModelDtype = ModelDtype::Bf16;
        /// `nf4`: 4-bit storage of the decoder layers' linear weights (QLoRA); `keep`: a GGUF
        /// file's block formats (Q4_K, Q8_0, ...) as it stores them (docs/gguf.md); `none`
        /// keeps them in `model.dtype`.
        quantize: Quantize = Quantize::None;
        /// With nf4: quantize the per-block scales too (bitsandbytes double quantization).
        double_quant: bool = true;
        /// Attention without (`chunked`) or with (`eager`) its (T, T) activations.
        attention: Attention = Attention::Chunked;
        // The keys transformers reads: `tallow_model::config::hf_keys`.
        /// `config.json` keys to read as if absent, e.g. `["pretraining_tp"]`: for a key tallow
        /// refuses because transformers reads it, when you know it has no effect on this model.
        /// The file (in the Hub cache a shared blob) is not edited; the load note names the
        /// keys, and a merged or fully fine-tuned model is written without them. Keys
        /// transformers never reads need no entry: they are ignored and named in the note
        /// ([models.md](models.md#configjson-keys)).
        ignore_config_keys: Vec<String> = Vec::new();
    }
}

section! {
    /// `[lora]`: the adapters, used when `train.method` is not `full`.
    pub struct LoraSection("lora") {
        /// r, the inner dimension of B·A.
        rank: usize = 16,
            check |r| ensure(*r >= 1, "must be at least 1, found 0 (8 to 64 is usual)");
        /// The update B·A·x is scaled by alpha / rank, or alpha / sqrt(rank) with `rslora`.
        alpha: f64 = 32.0,
            check |a| positive(*a, "usually 2 x rank");
        /// Dropout on the adapter's input.
        dropout: f64 = 0.05,
            check |p| in_range(*p, 0.0..1.0, "0 turns dropout off");
        /// The wrapped linear layers: module names, or `"all-linear"` for the seven of a
        /// Llama-like decoder layer.
        targets: LoraTargets = LoraTargets::default(),
            check |t| validate_targets(&t.names());
        /// Rank-stabilized LoRA scaling alpha / sqrt(rank) (Kalajdzievski 2023,
        /// arXiv:2312.03732).
        rslora: bool = false;
        /// The adapter kind: `lora`, or DoRA (Liu et al. 2024, arXiv:2402.09353), as PEFT's
        /// `use_dora`: a trainable magnitude per output feature times the direction
        /// (W + s B A) / ||W + s B A||. Each kind is one file of `crates/model/src/peft/`
        /// ([architecture.md](architecture.md)).
        kind: AdapterKind = AdapterKind::Lora;
        /// PEFT's `target_parameters`: LoRA on a mixture of experts' fused expert tensors, as
        /// PEFT (>= 0.17) adapts transformers 5's experts: `"mlp.experts.gate_up_proj"` (one
        /// adapter per expert on gate and up together) and `"mlp.experts.down_proj"`. The
        /// routed experts are then adapted by these, and `targets` wraps the other linears.
        /// Needs `dropout = 0` and `kind = "lora"`, as in PEFT ([models.md](models.md#lora-on-the-experts)).
        target_parameters: Vec<String> = Vec::new(),
            check |p| tallow_model::config::layout::parse_expert_parameters(p).map(|_| ());
        /// A PEFT adapter dir to start from; rank, alpha and targets then come from it.
        init: Option<PathBuf> = None,
            check |p| ensure(
                !p.as_ref().is_some_and(|p| p.as_os_str().is_empty()),
                "is empty; leave the key out for a fresh adapter",
            );
    }
}

section! {
    /// `[data]`: the training data and how rows become sequences.
    pub struct DataSection("data") {
        /// The training data: a JSONL or parquet file, or
        /// `hf://datasets/OWNER/NAME[@REV]/path` ([data.md](data.md)).
        train: PathBuf = PathBuf::new(),
            required "add `train = \"data/train.jsonl\"` (a JSONL file) under [data]",
            check |p| not_empty(p, "is empty; set it to a JSONL file, e.g. \"data/train.jsonl\"");
        /// Held-out data in the same forms; evaluated at step 0, every `train.eval_every` steps
        /// and at the end.
        eval: Option<PathBuf> = None;
        // Not set: `DEFAULT_TRAIN_SPLIT`; `DataSection::train_split()` reads it.
        /// The split read when `data.train` is a whole hub dataset
        /// (`hf://datasets/OWNER/NAME[@REV]`, [hub.md](hub.md#whole-datasets)); not set:
        /// "train". An error with any other `data.train`.
        train_split: Option<String> = None;
        /// The split read when `data.eval` is a whole hub dataset; not set: "test" (TRL's
        /// default).
        eval_split: Option<String> = None;
        /// The config (subset) of a whole hub dataset (the README's `configs:`); not set: the
        /// dataset's default config.
        dataset_config: Option<String> = None;
        /// Read at most this many training rows, or preference pairs (0: all); shards past them
        /// are never downloaded.
        max_rows: usize = 0;
        /// The row format ([data.md](data.md)); `auto` picks it from the keys of the first row.
        format: Format = Format::Auto;
        /// Rows are cut to this many tokens.
        max_seq_len: usize = DEFAULT_MAX_SEQ_LEN,
            check |n| ensure(
                *n >= 2,
                format!("must be at least 2 (one input and one target token), found {n}"),
            );
        /// Append EOS to text rows and completions.
        add_eos: bool = true;
        /// Shuffle rows each epoch, seeded by `train.seed`; false keeps file order.
        shuffle: bool = true;
        /// Pack rows into `max_seq_len` sequences, attention kept inside each row.
        pack: bool = false;
        /// The prompt of Alpaca rows with an `input`; must contain `{instruction}` and
        /// `{input}` (Stanford Alpaca's by default).
        alpaca_prompt: String = ALPACA_PROMPT.into(), in alpaca.with_input,
            check |t| placeholders(t, &["{instruction}", "{input}"]);
        /// The prompt of Alpaca rows without one; must contain `{instruction}`.
        alpaca_prompt_no_input: String = ALPACA_PROMPT_NO_INPUT.into(), in alpaca.without_input,
            check |t| placeholders(t, &["{instruction}"]);
    }
    fields {
        /// The prompts of Alpaca rows: `data.alpaca_prompt` and `data.alpaca_prompt_no_input`.
        alpaca: crate::data::AlpacaPrompt,
    }
}

section! {
    /// `[train]`: the optimization and the run.
    pub struct TrainSection("train") {
        /// `lora`: LoRA / DoRA adapters (`[lora]`); `full`: every weight; `dpo`, `orpo`:
        /// preference tuning of adapters on prompt / chosen / rejected pairs (`[preference]`).
        method: Method = Method::Lora;
        /// Sequences per forward/backward.
        micro_batch_size: usize = 1,
            check |n| ensure(*n >= 1, "must be at least 1, found 0");
        /// Micro-batches per optimizer step.
        grad_accum: usize = 8,
            check |n| ensure(
                *n >= 1,
                "must be at least 1, found 0 (1 = one micro-batch per optimizer step)",
            );
        /// Optimizer steps to run; 0 runs `epochs`.
        max_steps: usize = 0;
        /// Passes over the data when `max_steps` is 0.
        epochs: usize = 1;
        // The optimizers: `crate::optim`.
        /// AdamW, AdamW with 8-bit state, or SGD.
        optimizer: OptimizerKind = OptimizerKind::AdamW;
        /// Peak learning rate.
        lr: f64 = 2e-4,
            check |lr| positive(*lr, "2e-4 is usual for LoRA");
        /// Decoupled weight decay.
        weight_decay: f64 = 0.0,
            check |w| non_negative(*w, "");
        /// AdamW (beta1, beta2).
        betas: (f64, f64) = (0.9, 0.999),
            check |b| ensure(
                [b.0, b.1].iter().all(|b| (0.0..1.0).contains(b)),
                format!(
                    "must both be in [0, 1), found [{}, {}] (usually [0.9, 0.999])",
                    b.0, b.1
                ),
            );
        /// AdamW epsilon.
        eps: f64 = 1e-8,
            check |e| positive(*e, "usually 1e-8");
        // The schedules: `crate::schedule`.
        /// Learning-rate schedule after warmup ([training.md](training.md)).
        schedule: Schedule = Schedule::Cosine;
        /// Steps of linear warmup from 0 to `lr`.
        warmup_steps: usize = 0;
        /// Clip the global gradient norm to this; 0 disables clipping.
        max_grad_norm: f64 = 1.0,
            check |n| non_negative(*n, " (0 disables clipping)");
        /// Seeds shuffling, LoRA init and dropout.
        seed: u64 = 42,
            check |s| ensure(
                *s <= i64::MAX as u64,
                format!("must be at most {} (a TOML integer), found {s}", i64::MAX),
            );
        /// Where to train: `auto`, `cpu`, `cuda` or `cuda:N`.
        device: String = "auto".into(),
            check |d| ensure(
                valid_device(d),
                format!("must be auto, cpu, cuda or cuda:N (N a GPU number), found {d:?}"),
            );
        /// Where the run writes its resolved config, logs and checkpoints.
        output_dir: PathBuf = PathBuf::from("runs/example"),
            check |p| not_empty(p, "is empty; set the dir the run writes to, e.g. \"runs/my-run\"");
        /// Log every this many optimizer steps.
        log_every: usize = 1,
            check |n| ensure(*n >= 1, "must be at least 1, found 0");
        /// Where the metrics go: `"tensorboard"` adds event files under
        /// `output_dir/tensorboard/`. `metrics.jsonl` is the run's record (resume,
        /// `tallow bench` and plots read it), so `"jsonl"` must stay in the list.
        log: Vec<LogSink> = vec![LogSink::Jsonl],
            check |sinks| ensure(
                sinks.contains(&LogSink::Jsonl),
                "must include \"jsonl\": metrics.jsonl is the run's record (resume, tallow bench \
                 and plots read it); add \"tensorboard\" beside it, e.g. [\"jsonl\", \
                 \"tensorboard\"]",
            );
        /// Evaluate every this many optimizer steps; 0 only at the end when `data.eval` is set.
        eval_every: usize = 0;
        /// Save every this many optimizer steps; 0 only at the end.
        save_every: usize = 0;
        /// Keep at most this many checkpoints in `output_dir/checkpoints/`, the newest (and,
        /// with `keep_best`, the best one besides); 0 keeps them all. HF Trainer's
        /// `save_total_limit`.
        save_total_limit: usize = 0;
        /// Stop the run after this many evaluations in a row without the eval loss improving
        /// on the best one by more than `early_stopping_threshold`; 0 never stops early. Needs
        /// `data.eval` and `eval_every`. HF's `EarlyStoppingCallback`.
        early_stopping_patience: usize = 0;
        /// The improvement of the eval loss that counts (0: any decrease).
        early_stopping_threshold: f64 = 0.0,
            check |t| non_negative(*t, " (the decrease of the eval loss that counts as better)");
        /// At the end, `adapter/` (or `model/`) holds the weights of the evaluation with the
        /// lowest eval loss and `adapter-last/` (`model-last/`) the last step's. Each new best
        /// eval is checkpointed. Needs `data.eval` and `eval_every`. HF's
        /// `load_best_model_at_end` with `metric_for_best_model = "eval_loss"`.
        keep_best: bool = false;
        /// Activation checkpointing: keep only decoder-layer inputs in the forward and
        /// recompute each layer in the backward.
        checkpointing: bool = false;
        /// With `checkpointing`: checkpoint every n-th decoder layer (1 = all).
        checkpoint_every: usize = 1,
            check |n| ensure(
                *n >= 1,
                "must be at least 1, found 0 (1 = checkpoint every decoder layer)",
            );
        /// With `checkpointing`: keep the checkpointed layers' inputs in host memory between
        /// the forward and the backward. On CUDA it frees them from GPU memory (one
        /// device-to-host copy per layer in the forward into pinned host memory, one back in
        /// the backward, both queued on the device's stream without host waits); on the CPU it
        /// is accepted and has no effect (the same code runs; the host copy is the tensor
        /// itself).
        offload_checkpoints: bool = false;
        /// With `checkpointing`: tokens per tile of the checkpointed layers' token-wise parts
        /// (the MLP half, the q/k/v and o projections with their adapters), which the
        /// forward and the recomputation run one tile at a time, so that only the attention
        /// itself spans the whole sequence (Arctic Long Sequence Training's TiledMLP,
        /// Unsloth's tiled MLP). 0 = the hidden size: a tile's (tokens x intermediate)
        /// tensors are then the size of one MLP weight. A value of at least
        /// `micro_batch_size` x `data.max_seq_len` runs each layer in one piece.
        checkpoint_tile_tokens: usize = 0;
        /// Data-parallel runs (`--nproc N`, mpirun, torchrun, Slurm): each rank keeps the
        /// optimizer state of 1/N of the trainable tensors, updates those and hands the new
        /// weights to the others (ZeRO stage 1; DeepSpeed's `zero_optimization.stage = 1`). No
        /// effect on one process. See [distributed.md](distributed.md).
        shard_optimizer: bool = false;
        /// Data-parallel runs: a rank that waits this many seconds for the others in one
        /// collective (a rank died or hangs) stops the whole job, naming itself and the wait
        /// (600 is torch's NCCL default).
        dist_timeout_s: usize = 600;
        /// TF32 tensor cores for f32 matmuls on CUDA: an f32 model's matmuls and the f32 LoRA
        /// A/B products (10-bit mantissa inputs, f32 accumulation, as PyTorch's `allow_tf32`).
        /// bf16 / f16 matmuls are unaffected; no effect on the CPU.
        tf32: bool = true;
        /// CPU threads for the matmuls (gemm on rayon), tallow's fused kernels (rayon) and
        /// Candle's element-wise pool alike; 0 = the number of physical cores, as PyTorch's
        /// `torch.get_num_threads()`. `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`, when set, win.
        threads: usize = 0;
        /// `OWNER/NAME`: after the final save, upload `adapter/` (or `model/`) with a model card
        /// as one commit to this hub repo, created if needed (`""`: no upload). The token is
        /// checked before training starts ([hub.md](hub.md)). HF Trainer spells this
        /// `push_to_hub = true` plus `hub_model_id`; here one key holds the id.
        push_to_hub: String = String::new(),
            // Checked here, before any training: a bad id must not surface after a long run.
            check |id| match id.as_str() {
                "" => Ok(()),
                id => tallow_hub::check_repo_id(id)
                    .map_err(|e| format!("must be a hub repo id OWNER/NAME: {e}")),
            };
        /// A repo that `push_to_hub` creates is private (HF Trainer's name). An existing repo
        /// keeps its visibility.
        hub_private_repo: bool = false;
    }
}

section! {
    /// `[preference]`: the objective of `train.method = "dpo" | "orpo"` (TRL's `DPOConfig` /
    /// `ORPOConfig` names where they exist).
    pub struct PreferenceSection("preference") {
        /// DPO's beta: how strongly the policy is held to the reference (0.1 is TRL's).
        beta: f64 = 0.1,
            check |b| positive(*b, "0.1 is TRL's default");
        /// DPO's loss: the paper's sigmoid, or IPO (TRL's `loss_type`).
        loss: PreferenceLoss = PreferenceLoss::Sigmoid;
        /// With the sigmoid loss: the assumed probability that a pair's labels are flipped
        /// (conservative DPO).
        label_smoothing: f64 = 0.0,
            check |p| in_range(*p, 0.0..0.5, "the probability that a pair's labels are flipped");
        /// ORPO's lambda, the weight of the odds-ratio term against the NLL (TRL's
        /// `ORPOConfig.beta`).
        lambda: f64 = 0.1,
            check |l| positive(*l, "0.1 is TRL's default");
        /// DPO: compute the reference log-probs once before training and cache them in
        /// `output_dir/reference-logps.safetensors` (reused on resume); false: computed in
        /// each step with the adapters off.
        precompute_ref: bool = false;
        /// Keep only the last this many tokens of a prompt (TRL's `max_prompt_length`); 0
        /// keeps it whole. Completions are then cut to fit `data.max_seq_len`; a prompt that
        /// leaves no room skips its pair (counted).
        max_prompt_len: usize = 0;
        /// Train every weight instead of adapters; DPO then needs `precompute_ref` (the
        /// reference is the base, read before the first step: no second copy of the model).
        full: bool = false;
    }
}

/// Sections without a required key have a `Default`: their declared defaults.
macro_rules! default_from_declarations {
    ($($name:ident),+) => {$(
        impl Default for $name {
            fn default() -> Self {
                <Self as super::section::Section>::defaults()
            }
        }
    )+};
}

default_from_declarations!(LoraSection, TrainSection, PreferenceSection);
