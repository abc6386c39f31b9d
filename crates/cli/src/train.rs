//! `tallow train`: read the config, run the training loop, show progress.

use anyhow::{Context, Result};
use candle_core::Device;
use tallow_trainer::config::TrainConfig;
use tallow_trainer::error::TrainError;
use tallow_trainer::estimate::{estimate, plan};
use tallow_trainer::memory::{human_bytes, parse_bytes};
use tallow_trainer::train::{train_dist, Event};

use crate::args::TrainArgs;
use crate::device::parse_device_at;
use crate::progress::Progress;

pub fn run(a: TrainArgs) -> Result<()> {
    let cfg = TrainConfig::load(&a.config, &a.sets)?;
    // Data parallel: this process is a rank its launcher started, or starts N of them.
    let launch = tallow_data_parallel::rank::from_env()?;
    match (a.nproc, &launch) {
        (Some(n), Some(l)) if n != l.world => anyhow::bail!(
            "--nproc {n} in a process that {} started as rank {} of {}: leave --nproc out \
             under a launcher",
            l.launcher.name(),
            l.rank,
            l.world
        ),
        (Some(n), None) if n > 1 => {
            // Refused before any rank starts when a live run holds the output dir (rank 0
            // takes the lock itself).
            tallow_trainer::lock::check(&cfg.train.output_dir)?;
            return crate::spawn_ranks::run(n, &cfg.train.device);
        }
        _ => {}
    }
    let rank = launch.as_ref().map_or(0, |l| l.rank);
    let main = rank == 0;
    let push_to = (!cfg.train.push_to_hub.is_empty()).then(|| cfg.train.push_to_hub.clone());
    if let (Some(repo), true) = (&push_to, main) {
        // Before training: a missing, rejected or read-only token must not surface after a
        // long run (the repo id itself was checked with the config).
        let who = tallow_hub::Hub::from_env()
            .check_write_token(repo)
            .with_context(|| format!("train.push_to_hub = {repo:?}: checked before training"))?;
        eprintln!(
            "will upload to {repo} as {} at the end of the run",
            who.name
        );
    }
    // Before the first tensor op: every CPU pool takes train.threads (default physical cores,
    // shared among the ranks of this machine).
    let threads = match (&launch, cfg.train.threads) {
        (Some(l), 0) => candle_core::utils::get_num_threads()
            .checked_div(l.local_world.unwrap_or(1))
            .unwrap_or(1)
            .max(1),
        (_, n) => n,
    };
    tallow_trainer::threads::apply(threads);
    let local_rank = launch.as_ref().map_or(0, |l| l.local_rank);
    let device = parse_device_at(&cfg.train.device, local_rank).context("train.device")?;
    let dist = tallow_data_parallel::init(
        launch.as_ref(),
        &device,
        std::time::Duration::from_secs(cfg.train.dist_timeout_s as u64),
    )
    .context("data-parallel start-up")?;
    let limit = match &a.memory_limit {
        Some(l) => Some(parse_bytes(l).map_err(|e| anyhow::anyhow!("--memory-limit {e}"))?),
        None => None,
    };
    // Rank 0 alone shows progress and notes; the other ranks print only their errors. Off a
    // terminal, and with --quiet, the bar is plain lines: one per train.log_every steps.
    let mut progress = if main {
        Progress::new(
            "step",
            "{bar:30} step {pos}/{len}  {msg}  [{elapsed_precise} < {eta_precise}]",
            a.quiet,
        )
    } else {
        Progress::silent()
    };
    // Development switch (benchmarks/cuda.md, "Where a step's time goes"): device time per op
    // name over the steps after the run's first, printed when the run ends (main.rs).
    let mut op_times = OpTimes::new(&device);
    let mut on_event = |e: Event| match e {
        Event::Start {
            total_steps,
            start_step,
            trainable_params,
            rows,
            resumed_from,
            load_peak_bytes,
            load_live_bytes,
            memory,
        } => {
            op_times.start(start_step, total_steps);
            progress.start(
                total_steps as u64,
                start_step as u64,
                cfg.train.log_every as u64,
            );
            if dist.world > 1 {
                let t = &cfg.train;
                progress.note(&format!(
                    "data parallel: {} ranks ({}), {} rows per step ({} per rank: micro-batch {} \
                     x grad_accum {}){}",
                    dist.world,
                    dist.backend(),
                    t.micro_batch_size * t.grad_accum * dist.world,
                    t.micro_batch_size * t.grad_accum,
                    t.micro_batch_size,
                    t.grad_accum,
                    if t.shard_optimizer {
                        ", optimizer state sharded"
                    } else {
                        ""
                    }
                ));
            }
            let from = resumed_from
                .map(|p| format!(", resumed from {} at step {start_step}", p.display()))
                .unwrap_or_default();
            progress.note(&format!("training {total_steps} steps on {rows} rows, {trainable_params} trainable parameters{from}"));
            if let (Some(p), Some(l)) = (load_peak_bytes, load_live_bytes) {
                progress.note(&format!(
                    "memory ({memory}): {} in use after loading, peak {} while loading",
                    human_bytes(l),
                    human_bytes(p)
                ));
            }
        }
        Event::Step(s) => {
            // Preference runs: the step's reward accuracy beside the loss (TRL's
            // rewards/accuracies).
            let acc = s
                .preference
                .as_ref()
                .and_then(|p| p.get("rewards/accuracies"))
                .map(|a| format!("  reward acc {a:.2}"))
                .unwrap_or_default();
            let mut msg = format!(
                "loss {:.4}{acc}  lr {:.2e}  {:.0} tok/s  grad_norm {:.3}",
                s.loss, s.lr, s.tokens_per_s, s.grad_norm
            );
            let p = &s.peak_bytes;
            if let (Some(f), Some(b), Some(o)) = (p.forward, p.backward, p.optimizer) {
                msg += &format!(
                    "  peak fwd {} bwd {} opt {}",
                    human_bytes(f),
                    human_bytes(b),
                    human_bytes(o)
                );
            }
            progress.update(s.step as u64, &msg);
            op_times.step_done(s.step);
        }
        Event::Eval { step, loss } => progress.note(&format!("step {step}: eval loss {loss:.4}")),
        Event::Checkpoint { step, path } => {
            progress.note(&format!("step {step}: checkpoint {}", path.display()))
        }
        Event::Note(n) => progress.note(&n),
    };
    let summary = match train_dist(&cfg, &device, a.resume, limit, &dist, &mut on_event) {
        Ok(s) => s,
        Err(e @ TrainError::OutOfMemory { .. }) => {
            progress.finish();
            return Err(out_of_memory(e, &a, &cfg, &device));
        }
        Err(e) if dist.world > 1 => {
            return Err(anyhow::Error::from(e).context(format!("rank {rank} of {}", dist.world)))
        }
        Err(e) => return Err(e.into()),
    };
    progress.finish();
    if !main {
        return Ok(());
    }
    let mut line = format!("done: {} steps in {:.1}s", summary.steps, summary.elapsed_s);
    if let Some(l) = summary.last_loss {
        line += &format!(", last train loss {l:.4}");
    }
    if let (Some(a), Some(b)) = (summary.eval_loss_start, summary.eval_loss_end) {
        line += &format!(", eval loss {a:.4} -> {b:.4}");
    }
    if summary.stopped_early {
        line += " (stopped early)";
    }
    if let Some((step, l)) = summary.best_eval {
        line += &format!(", best eval loss {l:.4} at step {step}");
    }
    println!("{line}\noutput: {}", summary.output.display());
    if let Some(last) = &summary.output_last {
        println!("last step's output: {}", last.display());
    }
    let p = &summary.peak_bytes;
    if let (Some(l), Some(f), Some(b), Some(o)) =
        (summary.load_peak_bytes, p.forward, p.backward, p.optimizer)
    {
        println!(
            "peak memory: load {}, forward {}, backward {}, optimizer {}",
            human_bytes(l),
            human_bytes(f),
            human_bytes(b),
            human_bytes(o)
        );
    }
    if let Some(repo) = push_to {
        let message = format!(
            "tallow train: {} steps{}",
            summary.steps,
            summary
                .last_loss
                .map(|l| format!(", last train loss {l:.4}"))
                .unwrap_or_default()
        );
        let private = cfg.train.hub_private_repo;
        match crate::upload::push(&repo, &summary.output, private, "main", Some(&message)) {
            Ok(info) => println!("uploaded: {}", info.commit_url),
            Err(e) => {
                // The run's outputs are untouched; the same upload can be run again by hand.
                return Err(e.context(format!(
                    "training finished and {} is saved, but the upload to {repo} failed; retry \
                     with: tallow upload {repo} {}{}",
                    summary.output.display(),
                    summary.output.display(),
                    if private { " --private" } else { "" }
                )));
            }
        }
    }
    Ok(())
}

/// The OOM error with what to do about it: the estimate's breakdown for this config and the plan
/// that fits the memory there was (the GPU's total, or --memory-limit).
fn out_of_memory(
    e: TrainError,
    a: &TrainArgs,
    cfg: &TrainConfig,
    device: &Device,
) -> anyhow::Error {
    let TrainError::OutOfMemory { limit_bytes, .. } = &e else {
        return e.into();
    };
    let kind = if device.is_cuda() { "cuda" } else { "cpu" };
    let mut help = String::new();
    match crate::estimate::model_config(cfg) {
        Ok(model) => {
            let origin = a.config.display().to_string();
            let est = estimate(&model, cfg, kind);
            help += &crate::estimate::describe(&origin, &model, cfg, &est);
            if let Some(budget) = limit_bytes {
                let p = plan(&model, cfg, kind, *budget);
                help += &crate::estimate::describe_plan(&p, &origin, &a.sets);
            }
        }
        Err(err) => help += &format!("(no estimate: {err:#})\n"),
    }
    eprintln!("{help}");
    e.into()
}

/// `TALLOW_OP_TIMES=1`: times the device's ops by name (`candle_core::launches::set_timing`, one
/// synchronization per op) from the end of the run's first step (CUDA's JIT, the pool's first
/// allocations) to the end of its last, leaving out the host's work between steps; main.rs
/// prints the totals.
struct OpTimes {
    device: Option<Device>,
    first: usize,
    last: usize,
}

impl OpTimes {
    fn new(device: &Device) -> Self {
        let on = std::env::var("TALLOW_OP_TIMES").is_ok_and(|v| v == "1");
        OpTimes {
            device: on.then(|| device.clone()),
            first: 0,
            last: 0,
        }
    }

    fn start(&mut self, start_step: usize, total_steps: usize) {
        (self.first, self.last) = (start_step + 1, total_steps);
    }

    /// After step `step` (1-based) has logged: start, pause between steps, or stop.
    fn step_done(&self, step: usize) {
        let Some(device) = &self.device else { return };
        if step == self.last {
            candle_core::launches::set_timing(None);
        } else if step == self.first {
            let d = device.clone();
            candle_core::launches::set_timing(Some(Box::new(move || {
                let _ = d.synchronize();
            })));
        } else {
            candle_core::launches::timing_pause();
        }
    }
}
