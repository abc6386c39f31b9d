//! `tallow eval`: load a model and a dataset, print the token-weighted loss.

use std::time::Instant;

use anyhow::{Context, Result};
use tallow_text::TextTokenizer;
use tallow_trainer::eval::evaluate;
use tallow_trainer::{load_jsonl, DataOptions, Format};

use crate::args::EvalArgs;
use crate::device::{dtype_name, parse_device, parse_dtype};
use crate::model;
use crate::progress::Progress;

pub fn run(a: EvalArgs) -> Result<()> {
    let start = Instant::now();
    let device = parse_device(&a.device)?;
    let dtype = parse_dtype(&a.dtype, &device)?;
    let format: Format = a.format.parse()?;
    if a.max_seq_len < 2 {
        anyhow::bail!("--max-seq-len {}: must be at least 2", a.max_seq_len);
    }

    let model_dir = model::dir(&a.model)?;
    let data_path = tallow_hub::resolve_data(&a.data)
        .with_context(|| format!("--data {}", a.data.display()))?;
    let tok = TextTokenizer::from_model_dir(&model_dir)?;
    let opts = DataOptions {
        format,
        max_seq_len: a.max_seq_len,
        add_eos: !a.no_eos,
        max_prompt_len: a.max_prompt_len,
        ..DataOptions::default()
    };
    let data = load_jsonl(&data_path, &tok, &opts)?;
    if data.examples.is_empty() {
        anyhow::bail!(
            "{}: no row has a target token left ({} skipped after truncation to {} tokens)",
            a.data.display(),
            data.skipped,
            a.max_seq_len
        );
    }
    let opts = model::options(
        a.quantize,
        a.double_quant,
        dtype,
        &device,
        &a.ignore_config_keys,
    );
    let (model, _) = model::load(&model_dir, &opts, a.adapter.as_deref())?;
    let pad = tok.batch_pad_id();
    if data.format == Format::Preference {
        return preference(&a, &model, &data, pad, start);
    }

    // Off a terminal: a line per tenth of the rows.
    let rows = data.examples.len() as u64;
    let mut progress = Progress::new(
        "eval rows",
        "eval {bar:30} {pos}/{len} rows  {elapsed_precise} (eta {eta})",
        false,
    );
    progress.start(rows, 0, rows.div_ceil(10));
    let r = evaluate(&model, &data.examples, a.batch_size, pad, |done| {
        progress.update(done as u64, "")
    })?;
    progress.finish();

    if a.json {
        let out = serde_json::json!({
            "loss": r.loss,
            "perplexity": r.perplexity,
            "tokens": r.tokens,
            "rows": r.rows,
            "skipped": data.skipped,
            "input_tokens": r.input_tokens,
            "format": data.format.name(),
            "model": a.model,
            "adapter": a.adapter,
            "data": a.data,
            "dtype": dtype_name(dtype),
            "quantize": a.quantize,
            "nf4_weights": model.nf4_weights().len(),
            "gguf_block_weights": model.ggml_weights().len(),
            "device": if device.is_cuda() { "cuda" } else { "cpu" },
            "elapsed_s": start.elapsed().as_secs_f64(),
        });
        println!("{out}");
    } else {
        println!(
            "loss {:.4}  perplexity {:.3}  target tokens {}  rows {} (skipped {})  format {}  {}  {:.1}s",
            r.loss,
            r.perplexity,
            r.tokens,
            r.rows,
            data.skipped,
            data.format.name(),
            dtype_name(dtype),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// `--format preference`: DPO's loss and TRL's reward metrics of the model (+ adapter), the
/// reference being the same model with its adapter off (without `--adapter` the two are the
/// same: every reward 0).
fn preference(
    a: &EvalArgs,
    model: &tallow_model::CausalLM,
    data: &tallow_trainer::Dataset,
    pad: u32,
    start: Instant,
) -> Result<()> {
    use tallow_trainer::config::PreferenceLoss;
    use tallow_trainer::preference::{evaluate, Objective};
    if !(a.beta > 0.0 && a.beta.is_finite()) {
        anyhow::bail!("--beta {}: must be > 0 (0.1 is TRL's default)", a.beta);
    }
    let objective = Objective::Dpo {
        beta: a.beta,
        loss: PreferenceLoss::Sigmoid,
        label_smoothing: 0.0,
    };
    let pairs = data.examples.len() / 2;
    let (loss, metrics) = evaluate(&objective, model, &data.examples, a.batch_size, pad)?;
    let get = |k: &str| metrics.get(k).unwrap_or(f64::NAN);
    if a.json {
        let mut out = serde_json::json!({
            "format": "preference",
            "dpo_loss": loss,
            "beta": a.beta,
            "pairs": pairs,
            "skipped": data.skipped,
            "model": a.model,
            "adapter": a.adapter,
            "data": a.data,
            "elapsed_s": start.elapsed().as_secs_f64(),
        });
        for (name, v) in &metrics.values {
            out[*name] = serde_json::json!(v);
        }
        println!("{out}");
    } else {
        println!(
            "dpo loss {loss:.4}  reward accuracy {:.3}  margin {:.4}  rewards chosen {:.4} \
             rejected {:.4}  logps chosen {:.2} rejected {:.2}  pairs {pairs} (skipped {})  \
             beta {}  {:.1}s",
            get("rewards/accuracies"),
            get("rewards/margins"),
            get("rewards/chosen"),
            get("rewards/rejected"),
            get("logps/chosen"),
            get("logps/rejected"),
            data.skipped,
            a.beta,
            start.elapsed().as_secs_f64()
        );
    }
    if a.adapter.is_none() {
        eprintln!(
            "note: without --adapter the model is its own reference, so every reward is 0; \
             give the adapter a preference run trained"
        );
    }
    Ok(())
}
