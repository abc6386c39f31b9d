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
    /// Mean NLL and perplexity of a model on a JSONL dataset.
    Eval(EvalArgs),
}

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// HF-layout model directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL file: {"text"}, {"prompt","completion"} or {"messages"} rows.
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
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
}
