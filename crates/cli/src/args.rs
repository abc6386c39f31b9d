//! Command-line arguments (clap derive). Each flag is documented where it is declared; checked
//! values (devices, dtypes, formats) are resolved by the command that uses them.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tallow",
    version,
    about = "Fine-tune Llama / Qwen models from the shell, in pure Rust"
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
    /// Download a model or dataset repo from the Hugging Face Hub into the HF cache.
    Download(DownloadArgs),
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
    /// No progress bar: one log line per logged step on stderr.
    #[arg(long)]
    pub quiet: bool,
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
    /// run trained on). A bitsandbytes 4-bit checkpoint (`*-bnb-4bit`) is read as NF4 in any
    /// case; NF4 weights are merged dequantized and saved in --dtype.
    #[arg(long, default_value = "none", value_parser = ["none", "nf4"])]
    pub quantize: String,
    /// With --quantize nf4: quantize the per-block scales too (bitsandbytes double quantization).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub double_quant: bool,
}

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// HF-layout model directory (config.json, safetensors, tokenizer.json), or a hub id
    /// OWNER/NAME[@REVISION] (from the HF cache, downloaded when missing).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL file: {"text"}, {"prompt","completion"} or {"messages"} rows; or
    /// hf://datasets/OWNER/NAME/path/to/file.jsonl.
    #[arg(long)]
    pub data: PathBuf,
    /// Row format: auto | text | prompt_completion | messages.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Rows are truncated to this many tokens.
    #[arg(long, default_value_t = 2048)]
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
    /// Store the decoder's linear weights in 4-bit: none | nf4 (QLoRA base, bitsandbytes
    /// layout). A bitsandbytes 4-bit checkpoint (`*-bnb-4bit`) is read as NF4 in any case.
    #[arg(long, default_value = "none", value_parser = ["none", "nf4"])]
    pub quantize: String,
    /// With --quantize nf4: quantize the per-block scales too (bitsandbytes double quantization).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub double_quant: bool,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}
