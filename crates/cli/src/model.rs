//! What `eval`, `generate`, `chat` and `merge` do before their own work: `--model` resolved to a
//! local dir, then the model with its `--adapter` through [`tallow_model::load()`] (the load
//! `tallow train` calls too). The tokenizer is `tallow_text::TextTokenizer::from_model_dir` on
//! the same dir; `merge` needs none.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use tallow_model::{CausalLM, LoadOptions, LoraSpec};
use tallow_trainer::config::Quantize;

/// `--model` as a local dir: a hub id (`OWNER/NAME[@REVISION]`) becomes its cached snapshot,
/// downloaded when missing; a GGUF file its model dir; any other local path must be a directory.
pub fn dir(model: &Path) -> Result<PathBuf> {
    let dir =
        tallow_hub::resolve_model(model).with_context(|| format!("--model {}", model.display()))?;
    // A GGUF file reads as the model dir tallow keeps for it (docs/gguf.md).
    let dir = tallow_model::io::gguf::as_model_dir(&dir)
        .with_context(|| format!("--model {}", model.display()))?;
    if !dir.is_dir() {
        bail!(
            "--model {}: no such directory (give an HF-layout dir with config.json, safetensors \
             and tokenizer.json, a GGUF file, or a hub id OWNER/NAME[@REVISION])",
            model.display()
        );
    }
    Ok(dir)
}

/// Frozen base weights in `dtype` on `device`: quantized to NF4 with `--quantize nf4` (and
/// `--double-quant`), a GGUF's blocks kept with `--quantize keep`, dense otherwise; config.json read without the `--ignore-config-key`s.
pub fn options(
    quantize: Quantize,
    double_quant: bool,
    dtype: DType,
    device: &Device,
    ignore_config_keys: &[String],
) -> LoadOptions {
    let opts = match quantize {
        Quantize::Nf4 => LoadOptions::nf4(dtype, device, double_quant),
        Quantize::None => LoadOptions::frozen(dtype, device),
        Quantize::Keep => LoadOptions {
            keep_blocks: true,
            ..LoadOptions::frozen(dtype, device)
        },
    };
    LoadOptions {
        ignore_config_keys: ignore_config_keys.to_vec(),
        ..opts
    }
}

/// The model in `dir` with the adapter in `adapter` on it (and the adapter's spec). An error
/// names the step and directory ("loading the adapter from ..."), its cause the reason.
pub fn load(
    dir: &Path,
    opts: &LoadOptions,
    adapter: Option<&Path>,
) -> Result<(CausalLM, Option<LoraSpec>)> {
    if let Some(adapter) = adapter {
        if !adapter.is_dir() {
            bail!(
                "--adapter {}: no such directory (give a PEFT adapter dir with \
                 adapter_config.json and adapter_model.safetensors)",
                adapter.display()
            );
        }
    }
    let (model, spec) = tallow_model::load(dir, opts, adapter)?;
    // config.json keys left out of the reading (unread by transformers, or dropped on request)
    if let Some(note) = model.config.keys.line() {
        eprintln!("{note}");
    }
    Ok((model, spec))
}
