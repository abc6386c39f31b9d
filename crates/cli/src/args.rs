//! Command-line arguments (clap derive). Each flag is documented where it is declared; checked
//! values (devices, dtypes, formats) are resolved by the command that uses them.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use tallow_trainer::config::Quantize;

#[derive(Parser)]
#[command(
    name = "tallow",
    version,
    about = "Fine-tune Llama, Mistral, Qwen, Gemma and Phi-3 models from the shell, in pure Rust"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// LoRA or full fine-tuning from a TOML config.
    Train(TrainArgs),
    /// Mean NLL and perplexity of a model on a JSONL dataset.
    Eval(EvalArgs),
    /// Fold a LoRA adapter into its base model and save an HF-layout model.
    Merge(MergeArgs),
    /// Write a model (and an adapter merged into it) as a GGUF file for llama.cpp / Ollama.
    Export(ExportArgs),
    /// Generate text after a prompt (streamed to stdout), from a model and optional adapter.
    Generate(GenerateArgs),
    /// Interactive multi-turn chat (reads lines from stdin; /reset clears, /exit quits).
    Chat(ChatArgs),
    /// Download a model or dataset repo from the Hugging Face Hub into the HF cache.
    Download(DownloadArgs),
    /// Upload a dir (an adapter, a merged model) to a Hugging Face Hub model repo as one commit,
    /// with a model card; the repo is created if needed.
    Upload(UploadArgs),
    /// Predicted peak memory of a training config (config.json only, no weights), with a plan
    /// that fits a --budget.
    Estimate(EstimateArgs),
    /// Run a grid of training configs a few steps each, one process per cell: measured peak
    /// memory per phase next to the estimate, and tokens/s.
    Bench(BenchArgs),
    /// Whether this build works here: build, driver, GPU, then a self-test of every op of a
    /// training step on the device against the CPU reference. Exit 1 if any check fails.
    Doctor(DoctorArgs),
}

#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// Device to test: auto | cpu | cuda | cuda:N (the CPU build hands cuda to tallow-cuda).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Dtypes to test, comma-separated: default f32 on the CPU, f32,bf16 on CUDA.
    #[arg(long, value_delimiter = ',')]
    pub dtype: Vec<String>,
    /// Print one JSON object {"ok", "build", "driver", "checks": [{"name", "ok", "max_abs_err",
    /// "tol"}...]} instead of the report.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct EstimateArgs {
    /// Training config (TOML); see configs/.
    #[arg(long)]
    pub config: PathBuf,
    /// Override any config key: `--set train.micro_batch_size=4`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Memory available (24GiB, 800MiB, 1.5GB): when the config does not fit, the smallest set
    /// of changes that does; when it fits, the largest micro-batch that still does.
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<String>,
    /// Ranks of a data-parallel run (`tallow train --nproc N`): the estimate is per rank, with
    /// the gradient all-reduce's buffers and, with train.shard_optimizer, the rank's share of
    /// the optimizer state; --budget may then shard the optimizer state.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub nproc: u64,
    /// Print one JSON object (total_bytes, components, phases, plan) instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Training config (TOML) every cell starts from.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key in every cell: `--set data.max_seq_len=256`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// A grid axis: `--grid model.quantize=none,nf4` (repeatable; cells are the product of the
    /// axes, the first axis varying slowest).
    #[arg(long, value_name = "SECTION.KEY=V1,V2,...")]
    pub grid: Vec<String>,
    /// Optimizer steps per cell (peaks are taken over all of them; 2 or more measures the steady
    /// state, with optimizer state allocated).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Emulate a device with this much memory (24GiB, 800MiB): a cell whose measured peak goes
    /// over it is reported as out of memory, as on a GPU of that size.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Print one JSON array of rows.
    #[arg(long, group = "format")]
    pub json: bool,
    /// Print CSV.
    #[arg(long, group = "format")]
    pub csv: bool,
    /// Print a Markdown table (the default).
    #[arg(long, group = "format")]
    pub markdown: bool,
    /// Also write the rows as JSON to FILE (as hyperfine's `--export-json`), whatever prints.
    #[arg(long, value_name = "FILE")]
    pub export_json: Option<PathBuf>,
    /// Also write the rows as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    pub export_csv: Option<PathBuf>,
    /// Also write the rows as a Markdown table to FILE.
    #[arg(long, value_name = "FILE")]
    pub export_markdown: Option<PathBuf>,
    /// Write a chart of peak memory (measured and estimated) and tokens/s per cell: .svg.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Where the cells run (each in its own subdirectory; kept). Default: a temp dir, each
    /// cell's run removed once measured.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Run each cell as a data-parallel job of N ranks (`tallow train --nproc N`): rank 0's
    /// measured peaks beside the per-rank estimate.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub nproc: u64,
}

/// Anywhere a model path is taken, a hub id `OWNER/NAME[@REVISION]` works too (from the HF
/// cache, downloaded when missing); see `tallow download`.
#[derive(clap::Args, Debug)]
pub struct DownloadArgs {
    /// Repo id: OWNER/NAME, optionally OWNER/NAME@REVISION.
    pub repo_id: String,
    /// Branch, tag or commit (default: main, or the @REVISION of the id).
    #[arg(long)]
    pub revision: Option<String>,
    /// Only files matching this glob (repeatable; `*` also matches `/`). Replaces the default
    /// set: config, tokenizer files, safetensors (+ index), generation config, chat template.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Leave out files matching this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// model | dataset
    #[arg(long, default_value = "model", value_parser = ["model", "dataset"])]
    pub repo_type: String,
    /// Put real files here instead of returning the cache snapshot (still cached in the HF
    /// cache, hard-linked when on the same disk).
    #[arg(long)]
    pub local_dir: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(clap::Args, Debug)]
pub struct UploadArgs {
    /// The repo: OWNER/NAME (created, public unless --private, when it does not exist).
    pub repo_id: String,
    /// The dir to upload: every file under it (hidden files and dirs left out), e.g. a run's
    /// `adapter/` or a `tallow merge` output. Without a README.md in it, the commit gets a model
    /// card made from the run (base model, data, config, final metrics); PATH is not written to.
    pub path: PathBuf,
    /// Create the repo private (an existing repo keeps its visibility).
    #[arg(long)]
    pub private: bool,
    /// The branch to commit to; a branch that does not exist is created from main (as
    /// `huggingface-cli upload --revision` does).
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The commit message (default "Upload <dir name> with tallow").
    #[arg(long, short = 'm')]
    pub message: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Training config (TOML); see configs/.
    #[arg(long)]
    pub config: PathBuf,
    /// Override any config key: `--set train.lr=1e-4 --set lora.rank=8`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub sets: Vec<String>,
    /// Continue from the newest checkpoint in train.output_dir.
    #[arg(long)]
    pub resume: bool,
    /// No progress bar: plain lines on stderr, the notes and one per logged step
    /// (train.log_every), as when stderr is not a terminal.
    #[arg(long)]
    pub quiet: bool,
    /// Emulate a device with this much memory (24GiB, 800MiB): a phase whose measured peak goes
    /// over it stops the run as out of memory (as a GPU of that size would), with the estimate's
    /// breakdown and a plan that fits. On CUDA the device's own memory is the limit anyway.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// Data parallel: start N local ranks of this run (one per GPU; CPU ranks through mpirun),
    /// each with `micro_batch_size` x `grad_accum` rows of every step. Under mpirun, torchrun
    /// or srun, leave it out: each process joins as the rank its launcher gives it.
    #[arg(long, value_name = "N")]
    pub nproc: Option<usize>,
}

#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// Base model directory, or a hub id OWNER/NAME[@REVISION].
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: PathBuf,
    /// Output directory (HF layout).
    #[arg(long)]
    pub out: PathBuf,
    /// Dtype of the saved weights: f32 | f16 | bf16 (default: the dtype in config.json, else bf16).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize the base before merging: none | nf4 (merge into the same NF4 round trip a QLoRA
    /// run trained on) | keep (a GGUF's block formats as stored). A bitsandbytes 4-bit
    /// checkpoint (`*-bnb-4bit`) is read as NF4 in any case; quantized weights are merged
    /// dequantized and saved in --dtype.
    #[arg(long, default_value = Quantize::None.name(), value_parser = quantize_parser())]
    pub quantize: Quantize,
    /// With --quantize nf4: quantize the per-block scales too (bitsandbytes double quantization).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub double_quant: bool,
    /// Read the model's config.json as if this key were absent (repeatable): for a key tallow
    /// refuses because transformers reads it, when you know it has no effect on this model.
    #[arg(long = "ignore-config-key", value_name = "KEY")]
    pub ignore_config_keys: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// Model directory, GGUF file, or hub id OWNER/NAME[@REVISION].
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory to merge into the model first (as `tallow merge` does).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Write the --adapter alone, in llama.cpp's GGUF LoRA layout (`llama-cli -m BASE.gguf
    /// --lora FILE`), instead of the merged model.
    #[arg(long)]
    pub adapter_only: bool,
    /// Output file.
    #[arg(long)]
    pub out: PathBuf,
    /// Output format: gguf.
    #[arg(long, default_value = "gguf")]
    pub format: String,
    /// Tensor type of the matrices: f32 | f16 | bf16 | q8_0 (norms and biases stay f32, as
    /// llama.cpp's converter keeps them) | q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m,
    /// q6_k (llama-quantize's mixes, its bytes).
    #[arg(long, default_value = "f16")]
    pub outtype: String,
    /// Read the model's config.json as if this key were absent (repeatable).
    #[arg(long = "ignore-config-key", value_name = "KEY")]
    pub ignore_config_keys: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// HF-layout model directory (config.json, safetensors, tokenizer.json), a GGUF file
    /// (docs/gguf.md), or a hub id OWNER/NAME[@REVISION] (from the HF cache, downloaded when
    /// missing).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL file: {"text"}, {"prompt","completion"}, {"messages"} or {"prompt", "chosen",
    /// "rejected"} rows; or hf://datasets/OWNER/NAME/path/to/file.jsonl.
    #[arg(long)]
    pub data: PathBuf,
    /// Row format: auto | text | prompt_completion | messages | alpaca | sharegpt |
    /// preference. Preference pairs report DPO's loss, reward accuracy and margins of the model
    /// (+ adapter) against the same model with its adapter off as the reference.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Preference pairs: DPO's beta for the loss and rewards (TRL's default).
    #[arg(long, default_value_t = 0.1)]
    pub beta: f64,
    /// Preference pairs: keep only the last this many prompt tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub max_prompt_len: usize,
    /// Rows are truncated to this many tokens (the default of a training config's
    /// `data.max_seq_len`, so the loss matches a run's eval with defaults).
    #[arg(long, default_value_t = tallow_trainer::DEFAULT_MAX_SEQ_LEN)]
    pub max_seq_len: usize,
    /// Rows per forward pass (padding does not change the result).
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Compute dtype: auto (bf16 on CUDA, f32 on CPU) | f32 | f16 | bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// auto | cpu | cuda | cuda:N
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Do not append the EOS token to text rows and completions.
    #[arg(long)]
    pub no_eos: bool,
    /// PEFT LoRA adapter directory to apply to the model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Store the decoder's linear weights quantized: none | nf4 (QLoRA base, bitsandbytes
    /// layout) | keep (a GGUF file's block formats as it stores them). A bitsandbytes 4-bit
    /// checkpoint (`*-bnb-4bit`) is read as NF4 in any case.
    #[arg(long, default_value = Quantize::None.name(), value_parser = quantize_parser())]
    pub quantize: Quantize,
    /// With --quantize nf4: quantize the per-block scales too (bitsandbytes double quantization).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub double_quant: bool,
    /// Read the model's config.json as if this key were absent (repeatable): for a key tallow
    /// refuses because transformers reads it, when you know it has no effect on this model.
    #[arg(long = "ignore-config-key", value_name = "KEY")]
    pub ignore_config_keys: Vec<String>,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

/// Model, adapter and decoding flags shared by `generate` and `chat`. Decoding defaults follow
/// transformers' `generate()`: each flag left out takes the model dir's generation_config.json
/// value, else transformers' default.
#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// HF-layout model directory (config.json, safetensors, tokenizer.json), or a GGUF file
    /// (docs/gguf.md).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory to apply to the model.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// At most this many new tokens [default: generation_config.json's max_new_tokens, else 128].
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// 0 = greedy (argmax); > 0 samples [default: generation_config.json's temperature (else
    /// 1.0) when it says do_sample: true, else 0].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// When sampling: keep the K most likely tokens, 0 = off [default: generation_config.json's
    /// top_k, else 50].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// When sampling: keep the most likely tokens up to probability P, 1.0 = off
    /// [default: generation_config.json's top_p, else 1.0].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Divide positive / multiply negative logits of ids already seen (prompt included) by R,
    /// also when greedy; 1.0 = off [default: generation_config.json's, else 1.0].
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Seed of the sampling RNG: the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compute dtype: auto (bf16 on CUDA, f32 on CPU) | f32 | f16 | bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// auto | cpu | cuda | cuda:N
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Store the decoder's linear weights quantized: none | nf4 | keep (a GGUF file's block
    /// formats). A bitsandbytes 4-bit checkpoint is read as NF4 in any case.
    #[arg(long, default_value = Quantize::None.name(), value_parser = quantize_parser())]
    pub quantize: Quantize,
    /// With --quantize nf4: quantize the per-block scales too (bitsandbytes double quantization).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub double_quant: bool,
    /// Read the model's config.json as if this key were absent (repeatable): for a key tallow
    /// refuses because transformers reads it, when you know it has no effect on this model.
    #[arg(long = "ignore-config-key", value_name = "KEY")]
    pub ignore_config_keys: Vec<String>,
    /// Recompute every position at every step through the training forward instead of using the
    /// KV cache (slow; for checking the cache).
    #[arg(long)]
    pub no_cache: bool,
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Read the prompt from this file (one trailing newline is dropped).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's chat template, with the assistant
    /// header after it (add_generation_prompt).
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object {"prompt_ids", "generated_ids", "text", ...} at the end instead of
    /// streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub decode: DecodeArgs,
    /// A system message at the start of the conversation.
    #[arg(long)]
    pub system: Option<String>,
}

/// `--quantize`: one of [`Quantize::NAMES`] (listed by `--help` and in the error for any other
/// value), parsed into a [`Quantize`].
fn quantize_parser() -> impl TypedValueParser<Value = Quantize> {
    PossibleValuesParser::new(Quantize::NAMES.iter().copied())
        .map(|name| Quantize::from_name(&name).expect("one of the possible values"))
}
