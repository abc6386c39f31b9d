//! `tallow estimate`: the predicted peak memory of a training config, from config.json alone, and
//! with `--budget` the changes that make it fit.

use anyhow::{Context, Result};
use tallow_model::DecoderConfig;
use tallow_trainer::config::TrainConfig;
use tallow_trainer::estimate::{estimate_per_rank, plan_per_rank, Component, Estimate, Plan};
use tallow_trainer::memory::{human_bytes, parse_bytes};

use crate::args::EstimateArgs;

/// "cuda" when the config's device is (or, for auto, would be) a GPU.
pub fn device_kind(spec: &str) -> &'static str {
    if spec.starts_with("cuda") || (spec == "auto" && cfg!(feature = "cuda") && cuda_present()) {
        "cuda"
    } else {
        "cpu"
    }
}

fn cuda_present() -> bool {
    candle_core::Device::new_cuda(0).is_ok()
}

/// The model's config.json (local dir or hub id; only that file is fetched).
pub fn model_config(cfg: &TrainConfig) -> Result<DecoderConfig> {
    let path = tallow_hub::resolve_model_config(&cfg.model.path)
        .with_context(|| format!("model.path {}", cfg.model.path.display()))?;
    // A GGUF file: the config.json of the model dir tallow keeps for it (docs/gguf.md).
    // Its linears' block formats are read from the file's header, for `model.quantize = "keep"`.
    let (path, blocks) = match tallow_model::io::gguf::is_gguf(&path) {
        true => (
            tallow_model::io::gguf::model_dir(&path)
                .with_context(|| format!("model.path {}", cfg.model.path.display()))?
                .join("config.json"),
            Some(tallow_model::io::gguf::block_bytes(&path)?),
        ),
        false => (path, None),
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: cannot read the model's config.json", path.display()))?;
    let config =
        DecoderConfig::from_json_str_ignoring(&text, &path, &cfg.model.ignore_config_keys)?;
    Ok(DecoderConfig {
        stored_blocks: blocks,
        ..config
    })
}

pub fn run(a: EstimateArgs) -> Result<()> {
    let cfg = TrainConfig::load(&a.config, &a.sets)?;
    let model = model_config(&cfg)?;
    if let Some(note) = model.keys.line() {
        eprintln!("{note}");
    }
    let device = device_kind(&cfg.train.device);
    let world = a.nproc as usize;
    let est = estimate_per_rank(&model, &cfg, device, world);
    let budget = match &a.budget {
        Some(b) => Some(parse_bytes(b).map_err(|e| anyhow::anyhow!("--budget {e}"))?),
        None => None,
    };
    let plan = budget.map(|b| plan_per_rank(&model, &cfg, device, b, world));
    if a.json {
        let mut v = serde_json::to_value(&est)?;
        // {component name: value} objects
        let by_name = |value: &dyn Fn(&Component) -> serde_json::Value| -> serde_json::Value {
            let pairs = est
                .components
                .iter()
                .map(|c| (c.name.to_string(), value(c)));
            pairs.collect::<serde_json::Map<_, _>>().into()
        };
        v["components"] = by_name(&|c| serde_json::json!(c.bytes));
        v["details"] = by_name(&|c| serde_json::json!(c.detail));
        if let Some(p) = &plan {
            v["plan"] = serde_json::to_value(p)?;
            v["plan"]["speed"] = serde_json::json!(speed_hint(&cfg));
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!(
            "{}",
            describe(&a.config.display().to_string(), &model, &cfg, &est)
        );
        if let Some(p) = &plan {
            print!(
                "{}",
                describe_plan(p, &a.config.display().to_string(), &a.sets)
            );
            if let Some(h) = speed_hint(&cfg) {
                println!("{h}");
            }
        }
    }
    Ok(())
}

/// A change that keeps the memory and saves time, for the plan to suggest beside its memory
/// levers: DPO with the reference computed live runs a second forward of every pair each
/// step; `preference.precompute_ref` runs it once over the data before training. It is not a
/// memory lever: the reference forward keeps no graph and is freed before the training
/// forward, so the peak is the same (measured to the byte, benchmarks/preference.md).
fn speed_hint(cfg: &TrainConfig) -> Option<String> {
    use tallow_trainer::config::Method;
    (cfg.train.method == Method::Dpo && !cfg.preference.precompute_ref).then(|| {
        "Faster at the same memory: --set preference.precompute_ref=true computes the reference \
         log-probs once, before training, instead of a second forward of every pair each step \
         (measured: the same peak, 1.47x tokens/s; benchmarks/preference.md)."
            .to_string()
    })
}

/// The breakdown as a table, like the memory budgets users write by hand.
pub fn describe(origin: &str, m: &DecoderConfig, cfg: &TrainConfig, est: &Estimate) -> String {
    use tallow_trainer::config::Method;
    let method = match cfg.train.method {
        Method::Lora => format!("LoRA r{}", cfg.lora.rank),
        Method::Full => "full fine-tuning".into(),
        Method::Dpo | Method::Orpo => format!(
            "{}, {}, chosen + rejected per pair",
            cfg.train.method.name().to_uppercase(),
            if cfg.preference.full {
                "every weight".to_string()
            } else {
                format!("LoRA r{}", cfg.lora.rank)
            }
        ),
    };
    // A data-parallel job: every number is one rank's.
    let per_rank = est.ranks.as_ref().map(|r| {
        format!(
            ", per rank, {} ranks (global batch {} x {} x {}; optimizer state {})",
            r.world,
            r.world,
            cfg.train.micro_batch_size,
            cfg.train.grad_accum,
            if r.shard_optimizer {
                format!("sharded: rank {}'s share, the largest", r.rank)
            } else {
                "not sharded".into()
            }
        )
    });
    let mut s = format!(
        "{origin}: {} ({} layers, hidden {}, vocab {}), {method}, {}{}, {} optimizer, \
         micro-batch {} x {} tokens{}, on {}{}\n\n",
        m.arch.hf_class(),
        m.num_hidden_layers,
        m.hidden_size,
        m.vocab_size,
        cfg.model.dtype.name(),
        match cfg.model.quantize {
            tallow_trainer::config::Quantize::Nf4 => " + NF4",
            tallow_trainer::config::Quantize::Keep => " + GGUF blocks",
            tallow_trainer::config::Quantize::None => "",
        },
        cfg.train.optimizer,
        cfg.train.micro_batch_size,
        cfg.data.max_seq_len,
        if cfg.train.checkpointing {
            ", checkpointing"
        } else {
            ""
        },
        est.device,
        per_rank.as_deref().unwrap_or("")
    );
    s += &format!(
        "{:<18} {:>12} {:>7}  {}\n",
        "component", "bytes", "share", "what"
    );
    for c in &est.components {
        let share = 100.0 * c.bytes as f64 / est.total_bytes.max(1) as f64;
        s += &format!(
            "{:<18} {:>12} {:>6.1}%  {}\n",
            c.name,
            human_bytes(c.bytes),
            share,
            c.detail
        );
    }
    let rank = if est.ranks.is_some() {
        ", per rank"
    } else {
        ""
    };
    s += &format!(
        "{:<18} {:>12} {:>6.1}%  peak phase: {}{rank}\n\n",
        "total",
        human_bytes(est.total_bytes),
        100.0,
        est.peak_phase
    );
    let p = &est.phases;
    s += &format!(
        "per phase{rank}: load {}, forward {}, backward {}, optimizer {}\n",
        human_bytes(p.load),
        human_bytes(p.forward),
        human_bytes(p.backward),
        human_bytes(p.optimizer)
    );
    s += &format!(
        "activations: {} per layer for {} tokens (without checkpointing)\n",
        human_bytes(est.activation_bytes_per_layer),
        est.tokens_per_micro_batch
    );
    if est.host_bytes > 0 {
        s += &format!(
            "host memory: {} of pinned RAM for the offloaded checkpoint inputs (besides the \
             process's own)\n",
            human_bytes(est.host_bytes)
        );
    }
    if let Some(r) = &est.ranks {
        s += &format!(
            "{} ranks: the gradient all-reduce holds up to {} in the optimizer phase; ",
            r.world,
            human_bytes(r.all_reduce_bytes)
        );
        s += &if r.shard_optimizer {
            format!(
                "optimizer state: rank {}'s share (train.shard_optimizer), {} tensors, {} of \
                 the {} all ranks keep together\n",
                r.rank,
                r.owned_tensors,
                human_bytes(r.state_bytes),
                human_bytes(r.unsharded_state_bytes)
            )
        } else {
            format!(
                "optimizer state: all of it on every rank ({}; train.shard_optimizer = true \
                 splits it)\n",
                human_bytes(r.state_bytes)
            )
        };
    }
    s
}

/// The plan for a budget, with the command line that applies it: the config with the user's
/// `--set` flags, then the plan's.
pub fn describe_plan(p: &Plan, config: &str, user_sets: &[String]) -> String {
    let mut s = format!("\nbudget {}: ", human_bytes(p.budget_bytes));
    if p.fits {
        s += &format!("fits (predicted peak {}).", human_bytes(p.peak_bytes));
        if let Some(mb) = p.largest_micro_batch {
            s += &format!(" Largest micro-batch that fits: {mb}");
            if let Some(ga) = p.grad_accum_for_largest {
                s += &format!(" (with grad_accum {ga} for the same rows per step)");
            }
            s += ".";
        }
        s = s + "\n" + &longest_line(p, "");
        if let Some(l) = &p.longer_with {
            s += &format!(
                "With {} it is {} tokens{}{}.\n",
                l.sets.join(" "),
                l.longest_max_seq_len,
                past(p, l.longest_max_seq_len),
                host_note(l.host_bytes)
            );
        }
        return s;
    }
    if !p.possible {
        return s + &format!(
            "does not fit (predicted peak {}{}), and no combination of micro-batch 1, bf16, {}\
             checkpointing, adamw8bit, NF4 and shorter sequences (down to 64 tokens) brings it \
             under: use a smaller model or a larger device.\n",
            human_bytes(p.peak_bytes),
            if p.world > 1 { " per rank" } else { "" },
            if p.world > 1 {
                "sharded optimizer state, "
            } else {
                ""
            }
        );
    }
    s += &format!(
        "does not fit (predicted peak {}{}). Smallest set of changes that fits:\n",
        human_bytes(p.peak_bytes),
        if p.world > 1 { " per rank" } else { "" }
    );
    for (i, st) in p.steps.iter().enumerate() {
        s += &format!(
            "  {}. {:<40} -> {:>12}   {}\n",
            i + 1,
            st.what,
            human_bytes(st.peak_bytes),
            st.sets.join(" ")
        );
    }
    let sets: Vec<String> = user_sets
        .iter()
        .chain(&p.sets)
        .map(|x| format!("--set {x}"))
        .collect();
    let nproc = if p.world > 1 {
        format!("--nproc {} ", p.world)
    } else {
        String::new()
    };
    if let Some(n) = p.longest_with_plan {
        s += &format!(
            "With these changes, the longest data.max_seq_len that fits is {n} tokens{}.\n",
            past(p, n)
        );
    }
    s + &longest_line(p, "Without these changes, ")
        + &format!(
            "run: tallow train {nproc}--config {config} {}\n",
            sets.join(" ")
        )
}

/// The longest `data.max_seq_len` that fits the budget with the config's levers as they are.
/// `lead` starts the sentence ("Without these changes, "); empty: the line stands alone.
fn longest_line(p: &Plan, lead: &str) -> String {
    let what = match p.longest_max_seq_len {
        Some(n) => format!(
            "the longest data.max_seq_len that fits is {n} tokens{}",
            past(p, n)
        ),
        None => "not even 64 tokens fit".to_string(),
    };
    let mut line = format!("{lead}{what}.\n");
    line[..1].make_ascii_uppercase();
    line
}

/// A note when `n` tokens are past the positions the model was trained on.
fn past(p: &Plan, n: usize) -> String {
    if n > p.max_position_embeddings {
        format!(
            " (past the model's max_position_embeddings, {}: positions it was not trained on)",
            p.max_position_embeddings
        )
    } else {
        String::new()
    }
}

/// The pinned host memory the offloaded inputs take, when any.
fn host_note(bytes: u64) -> String {
    if bytes > 0 {
        format!(
            ", with {} of pinned host memory for the offloaded inputs",
            human_bytes(bytes)
        )
    } else {
        String::new()
    }
}
