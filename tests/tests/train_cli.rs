//! `tallow train` / `merge` / `eval --adapter` end to end on the tiny fixture models:
//! accumulation, resume and merge equivalence, and bad input.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tallow_tests::*;

/// Writes a training config for `model` into `dir` and returns its path. `extra` lines are
/// appended to the [train] section.
fn config(dir: &Path, model: &str, lora: &str, train: &str) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\n{lora}\n[data]\ntrain = \"{}\"\neval = \"{}\"\nmax_seq_len = 32\n[train]\noutput_dir = \"{}\"\n{train}\n",
        model_dir(model).display(),
        data_file("text").display(),
        data_file("prompt_completion").display(),
        dir.join("run").display(),
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn train_ok(args: &[&str]) {
    let r = tallow(args);
    assert_eq!(
        r.code, 0,
        "tallow {args:?} failed:\n{}\n{}",
        r.stdout, r.stderr
    );
}

fn adapter(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        dir.join("run/adapter/adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

/// `micro_batch_size = 4, grad_accum = 1` and `micro_batch_size = 1, grad_accum = 4` give the
/// same adapter after 3 AdamW steps (dropout off: masks are drawn per micro-batch). Tolerance:
/// 1e-3 relative per tensor (f32; the sums are ordered differently, and AdamW divides by
/// sqrt(v), which magnifies rounding in entries with small v: measured 7.7e-5 with the tensor-op
/// cross-entropy, 1.1e-4 with the CPU kernel). Normalizing each micro-batch by its own target
/// count instead of the step's moves the adapters by 2.0 (relative): far outside.
#[test]
fn accumulation_equals_a_big_batch() {
    let lora = "rank = 4\nalpha = 8\ndropout = 0.0";
    let a = scratch("accum-a");
    let b = scratch("accum-b");
    let ca = config(
        &a,
        "tiny-llama",
        lora,
        "max_steps = 3\nlr = 1e-2\nmicro_batch_size = 4\ngrad_accum = 1",
    );
    let cb = config(
        &b,
        "tiny-llama",
        lora,
        "max_steps = 3\nlr = 1e-2\nmicro_batch_size = 1\ngrad_accum = 4",
    );
    train_ok(&["train", "--config", ca.to_str().unwrap(), "--quiet"]);
    train_ok(&["train", "--config", cb.to_str().unwrap(), "--quiet"]);
    let d = max_rel_diff(&adapter(&a), &adapter(&b));
    assert!(d < 1e-3, "adapters differ by {d} (relative)");
    // And the step losses agree.
    let la = std::fs::read_to_string(a.join("run/metrics.jsonl")).unwrap();
    let lb = std::fs::read_to_string(b.join("run/metrics.jsonl")).unwrap();
    let losses = |s: &str| -> Vec<f64> {
        s.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
            .collect()
    };
    let (xa, xb) = (losses(&la), losses(&lb));
    assert_eq!(xa.len(), 3);
    for (x, y) in xa.iter().zip(&xb) {
        assert!((x - y).abs() < 1e-5, "{xa:?} vs {xb:?}");
    }
}

/// `tallow train --config CONFIG --resume --quiet`, which must resume at `step` of `total`: the
/// CLI names the checkpoint and the step, and runs only the steps after it (a resume that
/// silently restarted would give the same bits, training being deterministic).
fn resume_at(config: &Path, step: usize, total: usize) {
    let r = tallow([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--resume",
        "--quiet",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let from = format!("step-{step} at step {step}");
    assert!(
        r.stderr.contains("resumed from") && r.stderr.contains(&from),
        "the CLI names the checkpoint and step it resumed from (`{from}`): {}",
        r.stderr
    );
    let run: Vec<usize> = r.stderr.lines().filter_map(step_line).collect();
    assert_eq!(
        run,
        (step + 1..=total).collect::<Vec<_>>(),
        "steps run after resuming: {}",
        r.stderr
    );
}

/// The step of a plain progress line (`step 4/10  loss ...`); None for other lines (`step 4:
/// eval loss ...`).
fn step_line(line: &str) -> Option<usize> {
    let (step, _total) = line
        .strip_prefix("step ")?
        .split_whitespace()
        .next()?
        .split_once('/')?;
    step.parse().ok()
}

/// A run killed after its step-2 checkpoint and resumed equals the uninterrupted run, bit for bit
/// (CPU, dropout on, shuffled data, cosine schedule, AdamW); also with activation checkpointing
/// and its token tiles (5 tokens: several per row).
#[test]
fn resumed_run_equals_uninterrupted_run_bit_for_bit() {
    let lora = "rank = 4\nalpha = 8\ndropout = 0.1";
    let plain = "max_steps = 4\nlr = 1e-2\nmicro_batch_size = 1\ngrad_accum = 2\nsave_every = 2\nwarmup_steps = 1";
    let tiled = format!("{plain}\ncheckpointing = true\ncheckpoint_tile_tokens = 5");
    for (name, train) in [("plain", plain), ("tiled", tiled.as_str())] {
        resumed_equals_uninterrupted(name, lora, train);
    }
    // A 2-step run with a constant schedule, resumed with max_steps = 4, equals a 4-step run.
    let c = scratch("resume-c");
    let d = scratch("resume-d");
    let t4 = "max_steps = 4\nlr = 1e-2\nschedule = \"constant\"\nmicro_batch_size = 2";
    let cc = config(&c, "tiny-qwen3", lora, t4);
    let cd = config(&d, "tiny-qwen3", lora, t4);
    train_ok(&["train", "--config", cc.to_str().unwrap(), "--quiet"]);
    train_ok(&[
        "train",
        "--config",
        cd.to_str().unwrap(),
        "--set",
        "train.max_steps=2",
        "--quiet",
    ]);
    resume_at(&cd, 2, 4);
    let (tc, td) = (adapter(&c), adapter(&d));
    assert!(
        tc.iter().all(|(k, t)| max_abs_diff(t, &td[k]) == 0.0),
        "2 + 2 steps differ from 4 steps"
    );
}

/// [`resumed_run_equals_uninterrupted_run_bit_for_bit`] for one `[train]` section.
fn resumed_equals_uninterrupted(name: &str, lora: &str, train: &str) {
    let a = scratch(&format!("resume-a-{name}"));
    let b = scratch(&format!("resume-b-{name}"));
    let ca = config(&a, "tiny-qwen3", lora, train);
    let cb = config(&b, "tiny-qwen3", lora, train);
    train_ok(&["train", "--config", ca.to_str().unwrap(), "--quiet"]);
    train_ok(&["train", "--config", cb.to_str().unwrap(), "--quiet"]);
    // Simulate a kill right after step 2: only the step-2 checkpoint survives.
    std::fs::remove_dir_all(b.join("run/checkpoints/step-4")).unwrap();
    std::fs::remove_dir_all(b.join("run/adapter")).unwrap();
    // Mark the step-1 metrics line: a resume keeps the lines of the steps it does not redo, a
    // silent restart (same bits, training is deterministic) would rewrite it.
    let metrics = b.join("run/metrics.jsonl");
    let marked = std::fs::read_to_string(&metrics)
        .unwrap()
        .replace("{\"step\":1,", "{\"step\":1,\"marker\":true,");
    assert!(marked.contains("\"marker\":true"), "{marked}");
    std::fs::write(&metrics, &marked).unwrap();
    resume_at(&cb, 2, 4);
    let lines = std::fs::read_to_string(&metrics).unwrap();
    let steps: Vec<(u64, bool)> = lines
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v.get("marker").is_some()))
        .collect();
    assert_eq!(
        steps,
        [(1, true), (2, false), (3, false), (4, false)],
        "metrics.jsonl: steps 1-2 kept from before the kill, 3-4 from the resumed run"
    );
    let (ta, tb) = (adapter(&a), adapter(&b));
    for (k, t) in &ta {
        let same = t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            == tb[k].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(same, "{name}: {k} differs after resume");
    }
}

/// `--resume` with nothing to resume from says so on stderr (as HF Trainer and torchtune make a
/// fresh start visible) and trains from step 0.
#[test]
fn resume_without_a_checkpoint_says_it_starts_from_step_0() {
    let a = scratch("resume-none");
    let c = config(&a, "tiny-llama", "rank = 4", "max_steps = 1");
    let r = tallow([
        "train",
        "--config",
        c.to_str().unwrap(),
        "--resume",
        "--quiet",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let want = format!(
        "no checkpoint in {}: starting from step 0",
        a.join("run/checkpoints").display()
    );
    assert!(r.stderr.contains(&want), "`{want}` not in: {}", r.stderr);
    assert!(!r.stderr.contains("resumed from"), "{}", r.stderr);
    let steps: Vec<usize> = r.stderr.lines().filter_map(step_line).collect();
    assert_eq!(steps, [1], "{}", r.stderr);
}

#[test]
fn resume_refuses_a_checkpoint_of_another_rank() {
    let a = scratch("resume-rank");
    let c = config(&a, "tiny-qwen2", "rank = 4\nalpha = 8", "max_steps = 1");
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let r = tallow([
        "train",
        "--config",
        c.to_str().unwrap(),
        "--resume",
        "--set",
        "lora.rank=8",
        "--quiet",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("cannot resume") && r.stderr.contains("rank"),
        "{}",
        r.stderr
    );
}

/// eval of the merged model equals eval with the adapter (f32, 1e-5 absolute), and the merged
/// directory is a complete HF model (config, weights, tokenizer).
#[test]
fn merged_model_equals_base_plus_adapter() {
    for model in ["tiny-llama", "tiny-qwen2"] {
        let a = scratch(&format!("merge-{model}"));
        let c = config(
            &a,
            model,
            "rank = 4\nalpha = 8\ndropout = 0.0",
            "max_steps = 3\nlr = 3e-2",
        );
        train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
        let adapter_dir = a.join("run/adapter");
        let merged = a.join("merged");
        train_ok(&[
            "merge",
            "--model",
            model_dir(model).to_str().unwrap(),
            "--adapter",
            adapter_dir.to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
            "--dtype",
            "f32",
        ]);
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(merged.join(f).exists(), "{model}: merged dir lacks {f}");
        }
        let data = data_file("messages");
        let loss = eval_loss;
        let base = loss(&[
            "eval",
            "--model",
            model_dir(model).to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--dtype",
            "f32",
            "--json",
        ]);
        let with_adapter = loss(&[
            "eval",
            "--model",
            model_dir(model).to_str().unwrap(),
            "--adapter",
            adapter_dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--dtype",
            "f32",
            "--json",
        ]);
        let merged_loss = loss(&[
            "eval",
            "--model",
            merged.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--dtype",
            "f32",
            "--json",
        ]);
        assert!(
            (with_adapter - base).abs() > 1e-3,
            "{model}: the adapter must change the model ({base} vs {with_adapter})"
        );
        assert!(
            (merged_loss - with_adapter).abs() < 1e-5,
            "{model}: merged {merged_loss} vs adapter {with_adapter}"
        );
    }
}

#[test]
fn unknown_config_key_is_an_error() {
    let a = scratch("badkey");
    let c = config(
        &a,
        "tiny-qwen2",
        "rank = 4",
        "max_steps = 1\nlearning_rate = 1e-3",
    );
    let r = tallow(["train", "--config", c.to_str().unwrap()]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("learning_rate") && r.stderr.contains("train.lr"),
        "{}",
        r.stderr
    );
}

#[test]
fn target_module_the_model_lacks_is_an_error() {
    let a = scratch("badtarget");
    let c = config(
        &a,
        "tiny-qwen2",
        "rank = 4\ntargets = [\"q_proj\", \"c_attn\"]",
        "max_steps = 1",
    );
    let r = tallow(["train", "--config", c.to_str().unwrap()]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("c_attn") && r.stderr.contains("q_proj"),
        "{}",
        r.stderr
    );
}

#[test]
fn adapter_of_another_model_is_refused() {
    let a = scratch("othershape");
    let c = config(&a, "tiny-qwen3", "rank = 4", "max_steps = 1");
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let r = tallow([
        "eval",
        "--model",
        model_dir("tiny-llama").to_str().unwrap(),
        "--adapter",
        a.join("run/adapter").to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("shape") && r.stderr.contains("different model"),
        "{}",
        r.stderr
    );
}

/// A loss that becomes NaN stops the run with a message that names the last good checkpoint,
/// which is kept.
#[test]
fn nan_loss_stops_and_keeps_the_last_good_checkpoint() {
    let a = scratch("nan");
    let c = config(&a, "tiny-qwen2", "rank = 4\nalpha = 8",
        "max_steps = 5\noptimizer = \"sgd\"\nlr = 1e30\nschedule = \"constant\"\nmax_grad_norm = 0.0\nsave_every = 1");
    let r = tallow(["train", "--config", c.to_str().unwrap(), "--quiet"]);
    assert_ne!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("not finite") && r.stderr.contains("step-"),
        "{}",
        r.stderr
    );
    assert!(a
        .join("run/checkpoints/step-1/trainable.safetensors")
        .exists());
    assert!(
        !a.join("run/adapter").exists(),
        "no adapter from a diverged run"
    );
}

/// `method = "full"` trains every weight and writes an HF-layout model that `tallow eval` loads;
/// its train-set loss is below the base model's.
#[test]
fn full_fine_tuning_writes_a_loadable_model_that_learned() {
    let a = scratch("full");
    let c = config(
        &a,
        "tiny-qwen3",
        "",
        "method = \"full\"\nmax_steps = 4\nlr = 1e-3\nmicro_batch_size = 4",
    );
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let out = a.join("run/model");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(out.join(f).exists(), "model/ lacks {f}");
    }
    let loss = |m: &Path| -> f64 {
        eval_loss(&[
            "eval",
            "--model",
            m.to_str().unwrap(),
            "--data",
            data_file("text").to_str().unwrap(),
            "--max-seq-len",
            "32",
            "--dtype",
            "f32",
            "--json",
        ])
    };
    let (before, after) = (loss(&model_dir("tiny-qwen3")), loss(&out));
    assert!(
        after < before - 0.1,
        "full fine-tuning did not lower the train loss: {before} -> {after}"
    );
}

/// Final and first `eval_loss` of a run's metrics.jsonl.
fn eval_losses(dir: &Path) -> (f64, f64) {
    let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let l: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["eval_loss"].as_f64())
        .collect();
    assert!(l.len() >= 2, "metrics.jsonl has eval losses {l:?}");
    (l[0], l[l.len() - 1])
}

/// `train.optimizer = "adamw8bit"` (issue: 8-bit optimizer state). Full fine-tuning, so the
/// projections and embeddings (>= 4096 elements) get 8-bit moments: after a short run both
/// optimizers lower the eval loss and end within 1% of each other.
#[test]
fn adamw8bit_full_fine_tuning_matches_adamw_eval_loss() {
    let run = |name: &str, optimizer: &str| {
        let dir = scratch(name);
        let c = config(
            &dir,
            "tiny-qwen3",
            "",
            &format!(
                "method = \"full\"\noptimizer = \"{optimizer}\"\nmax_steps = 6\nlr = 5e-3\nmicro_batch_size = 4"
            ),
        );
        train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
        eval_losses(&dir)
    };
    let (start_a, end_a) = run("opt-adamw", "adamw");
    let (start_b, end_b) = run("opt-adamw8bit", "adamw8bit");
    eprintln!("eval loss adamw {start_a} -> {end_a}, adamw8bit {start_b} -> {end_b}");
    assert_eq!(start_a, start_b);
    assert!(end_a < start_a - 0.01, "adamw: {start_a} -> {end_a}");
    assert!(end_b < start_b - 0.01, "adamw8bit: {start_b} -> {end_b}");
    assert!(
        (end_a - end_b).abs() <= 0.01 * end_a,
        "adamw {end_a} vs adamw8bit {end_b}: more than 1% apart"
    );
}

/// A full fine-tuning run with adamw8bit killed after its step-2 checkpoint and resumed equals
/// the uninterrupted run bit for bit: the 8-bit codes and scales round-trip through
/// optimizer.safetensors.
#[test]
fn adamw8bit_resumed_run_equals_uninterrupted_run_bit_for_bit() {
    let train = "method = \"full\"\noptimizer = \"adamw8bit\"\nmax_steps = 4\nlr = 1e-3\nmicro_batch_size = 2\nsave_every = 2\nwarmup_steps = 1";
    let a = scratch("resume8-a");
    let b = scratch("resume8-b");
    let ca = config(&a, "tiny-qwen3", "", train);
    let cb = config(&b, "tiny-qwen3", "", train);
    train_ok(&["train", "--config", ca.to_str().unwrap(), "--quiet"]);
    train_ok(&["train", "--config", cb.to_str().unwrap(), "--quiet"]);
    let opt = candle_core::safetensors::load(
        b.join("run/checkpoints/step-2/optimizer.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert!(
        opt.keys().any(|k| k.ends_with(".exp_avg.codes")),
        "no 8-bit state saved"
    );
    std::fs::remove_dir_all(b.join("run/checkpoints/step-4")).unwrap();
    std::fs::remove_dir_all(b.join("run/model")).unwrap();
    resume_at(&cb, 2, 4);
    let model = |d: &Path| {
        candle_core::safetensors::load(d.join("run/model/model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ta, tb) = (model(&a), model(&b));
    assert!(!ta.is_empty());
    for (k, t) in &ta {
        assert_eq!(max_abs_diff(t, &tb[k]), 0.0, "{k} differs after resume");
    }
}

/// The README's main job: `configs/quickstart.toml` trains the embedded tiny model in CI-sized
/// time, and its eval loss falls from the untrained ~6.6 by at least 80% (to ~0.27 measured).
#[test]
fn quickstart_learns_its_skill() {
    let root = fixtures().parent().unwrap().parent().unwrap().to_path_buf();
    let out = scratch("quickstart");
    let r = std::process::Command::new(tallow_bin())
        .current_dir(&root)
        .args([
            "train",
            "--config",
            "configs/quickstart.toml",
            "--quiet",
            "--set",
        ])
        .arg(format!("train.output_dir={}", out.join("run").display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let evals: Vec<(u64, f64)> = std::fs::read_to_string(out.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?))
        })
        .collect();
    let (first, last) = (evals.first().unwrap(), evals.last().unwrap());
    assert_eq!(first.0, 0);
    assert!(
        first.1 > 6.0,
        "the base model should know nothing: {first:?}"
    );
    assert!(
        last.1 < 0.2 * first.1,
        "eval loss fell only from {} to {}: {stdout}",
        first.1,
        last.1
    );
    assert!(out.join("run/adapter/adapter_model.safetensors").exists());
}

/// Activation checkpointing on (every layer, every second layer, every layer with its inputs
/// offloaded: on the CPU the same link-chained code path with no saving, every layer in tiles of
/// 5 tokens over batches of 4 rows) and off give the same
/// adapter after 3 AdamW steps with dropout on (the recomputation redraws the same masks).
/// Tolerance: 1e-4 relative per tensor (f32; the recomputed layer runs the same ops, so only the
/// order of gradient sums differs: measured <= 1.9e-5 after the 3 AdamW steps, which scale up
/// the differences of near-zero gradients; a tile drawing another row's dropout masks moves the
/// adapter by 1.9). The run reports per-phase peak memory in metrics.jsonl, and checkpointing
/// lowers the forward-phase peak.
#[test]
fn checkpointing_gives_the_same_adapter_and_a_lower_forward_peak() {
    const TOL: f64 = 1e-4;
    let lora = "rank = 4\nalpha = 8\ndropout = 0.1";
    let steps = "max_steps = 3\nlr = 1e-2\nmicro_batch_size = 4\ngrad_accum = 1";
    let plain = scratch("ckpt-off");
    let on = scratch("ckpt-on");
    let every2 = scratch("ckpt-every2");
    let offload = scratch("ckpt-offload");
    let tiles = scratch("ckpt-tiles");
    let cp = config(&plain, "tiny-qwen3", lora, steps);
    let co = config(
        &on,
        "tiny-qwen3",
        lora,
        &format!("{steps}\ncheckpointing = true"),
    );
    let c2 = config(
        &every2,
        "tiny-qwen3",
        lora,
        &format!("{steps}\ncheckpointing = true\ncheckpoint_every = 2"),
    );
    let cf = config(
        &offload,
        "tiny-qwen3",
        lora,
        &format!("{steps}\ncheckpointing = true\noffload_checkpoints = true"),
    );
    let ct = config(
        &tiles,
        "tiny-qwen3",
        lora,
        &format!("{steps}\ncheckpointing = true\ncheckpoint_tile_tokens = 5"),
    );
    for c in [&cp, &co, &c2, &cf, &ct] {
        train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    }
    let base = adapter(&plain);
    let diffs: Vec<(&str, f64)> = [
        ("every layer", &on),
        ("every 2nd layer", &every2),
        ("every layer, offloaded", &offload),
        ("every layer, tiles of 5 tokens", &tiles),
    ]
    .into_iter()
    .map(|(what, dir)| (what, max_rel_diff(&adapter(dir), &base)))
    .collect();
    assert!(
        diffs.iter().all(|(_, d)| *d < TOL),
        "checkpointing: adapter differs from the plain run's by more than {TOL} (relative): \
         {diffs:?}"
    );
    let forward_peak = |dir: &Path| -> u64 {
        let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                v["peak_bytes"]["forward"].as_u64()
            })
            .max()
            .expect("steps log peak_bytes.forward")
    };
    let (p_off, p_on) = (forward_peak(&plain), forward_peak(&on));
    assert!(
        p_on < p_off,
        "forward peak with checkpointing {p_on} is not below {p_off}"
    );
}

/// One device-to-host read per optimizer step (issue 15: each is a stream sync on CUDA): the
/// loss of every micro-batch and the gradient norm stay on the device and are read together,
/// with gradient accumulation and clipping on (the former loop read once per micro-batch and
/// once for the norm: 4 here).
#[test]
fn one_host_read_per_optimizer_step() {
    let a = scratch("host-reads");
    let c = config(
        &a,
        "tiny-llama",
        "rank = 4\ndropout = 0.1",
        "max_steps = 3\nmicro_batch_size = 1\ngrad_accum = 3\nmax_grad_norm = 0.5",
    );
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let metrics = std::fs::read_to_string(a.join("run/metrics.jsonl")).unwrap();
    let reads: Vec<u64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| v["host_reads"].as_u64().unwrap())
        .collect();
    assert_eq!(reads, [1, 1, 1], "{metrics}");
}

/// Memory is probed only on the steps that ask (issue 15: on CUDA each probe call is a stream
/// sync): with `log_every = 2`, steps 1 and 3 make no probe call and steps 2 and 4 measure every
/// phase (2 micro-batches x (forward, backward) x (reset, peak) + optimizer reset and peak +
/// live bytes = 11); under `--memory-limit` every step measures and also checks each phase's
/// peak against the limit (6 more reads: 17).
#[test]
fn memory_is_probed_only_on_logged_steps_or_under_a_limit() {
    use tallow_trainer::train::{train_with_limit, Event};
    let a = scratch("probes");
    let c = config(
        &a,
        "tiny-llama",
        "rank = 4",
        "max_steps = 4\nmicro_batch_size = 1\ngrad_accum = 2\nlog_every = 2\ndevice = \"cpu\"",
    );
    let cfg = tallow_trainer::TrainConfig::load(&c, &[]).unwrap();
    for (limit, want) in [(None, [0, 11, 0, 11]), (Some(u64::MAX), [17; 4])] {
        let mut probes = vec![];
        let mut on_event = |e: Event| {
            if let Event::Step(s) = e {
                probes.push(s.memory_probes);
            }
        };
        train_with_limit(&cfg, &Device::Cpu, false, limit, &mut on_event).unwrap();
        assert_eq!(probes, want, "--memory-limit {limit:?}");
    }
    // metrics.jsonl (of the last run, under the limit) has the logged steps only.
    let metrics = std::fs::read_to_string(a.join("run/metrics.jsonl")).unwrap();
    let logged: Vec<(u64, u64)> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["memory_probes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(logged, [(2, 17), (4, 17)], "{metrics}");
}

/// A random tiny Llama (the `tiny-llama` fixture's config) with `layers` decoder layers and
/// `rows` bench rows, made once in `dir/llama-{layers}`.
fn tiny_llama_with_layers(dir: &Path, layers: usize, rows: usize) -> PathBuf {
    let model = dir.join(format!("llama-{layers}"));
    if !model.exists() {
        let mut cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(model_dir("tiny-llama").join("config.json")).unwrap(),
        )
        .unwrap();
        cfg["num_hidden_layers"] = layers.into();
        let json = dir.join(format!("llama-{layers}.json"));
        std::fs::write(&json, cfg.to_string()).unwrap();
        make_random_model(env!("CARGO_BIN_EXE_make-random-model"), &json, &model, rows);
    }
    model
}

/// `ops_forward` / `ops_backward` (tensors Candle creates per step, `tallow_trainer::opcount`):
/// two identical runs count exactly the same, every step of a run with equal-shaped batches
/// counts the same, and each decoder layer adds the same number of ops (1 -> 2 -> 3 layers of a
/// random tiny Llama: equal differences, both positive). Exact (integers, no tolerance).
#[test]
fn op_counts_are_reproducible_and_grow_by_the_same_amount_per_layer() {
    let dir = scratch("op-counts");
    let counts = |layers: usize, run: &str| -> Vec<(u64, u64)> {
        let model = tiny_llama_with_layers(&dir, layers, 4);
        let out = dir.join(run);
        let config = dir.join(format!("{run}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\npath = {:?}\ndtype = \"f32\"\n[lora]\nrank = 4\ndropout = 0.0\n\
                 [data]\ntrain = {:?}\nmax_seq_len = 32\n[train]\nmax_steps = 3\n\
                 micro_batch_size = 1\ngrad_accum = 1\ndevice = \"cpu\"\noutput_dir = {:?}\n",
                model.display().to_string(),
                model.join("bench.jsonl").display().to_string(),
                out.display().to_string()
            ),
        )
        .unwrap();
        train_ok(&["train", "--config", config.to_str().unwrap(), "--quiet"]);
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("loss").is_some())
            .map(|v| {
                (
                    v["ops_forward"].as_u64().unwrap(),
                    v["ops_backward"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let two = counts(2, "two-a");
    assert_eq!(two.len(), 3);
    assert_eq!(counts(2, "two-b"), two, "two identical runs");
    // Step 1 also makes the per-device constants (loss arange, rope frequencies) that every
    // later step reuses: it counts those few ops more; after it, equal-shaped steps are equal.
    assert!(two[2] == two[1], "equal-shaped steps: {two:?}");
    assert!(
        two[0].0 >= two[1].0 && two[0].1 >= two[1].1 && two[0].1 - two[1].1 <= 4,
        "step 1 = a later step + the constants made once: {two:?}"
    );
    let (one, three) = (counts(1, "one")[1], counts(3, "three")[1]);
    let two = &two[1..];
    let per_layer =
        |a: (u64, u64), b: (u64, u64)| (b.0 as i64 - a.0 as i64, b.1 as i64 - a.1 as i64);
    let (d12, d23) = (per_layer(one, two[0]), per_layer(two[0], three));
    assert!(
        d12.0 > 0 && d12.1 > 0,
        "a layer adds ops: {one:?} -> {:?}",
        two[0]
    );
    assert_eq!(
        d12, d23,
        "every layer adds the same ops: {one:?} {:?} {three:?}",
        two[0]
    );
}

/// Device operations (launches on CUDA) per decoder layer on the CUDA path, counted on the CPU
/// under `TALLOW_CUDA_PATHS_ON_CPU=1` (`launches_forward` / `_backward` / `_optimizer`, step 2, a 2-layer
/// minus a 1-layer random tiny Llama; `scripts/op_counts.sh` makes the same table): each count
/// at most the one recorded in benchmarks/op-counts.md ("Launches per decoder layer"), so a
/// change that adds launches to a layer fails here until the table is updated on purpose
/// (exact integers: one extra op in a layer's forward fails it). Also checks the counts are
/// real: positive, the checkpointed backward above the plain one (it recomputes the layer).
#[test]
fn cuda_path_launches_per_layer_do_not_grow() {
    let dir = scratch("launches-per-layer");
    let table = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/op-counts.md"),
    )
    .unwrap();
    let section = &table[table
        .find("## Launches per decoder layer")
        .expect("the launches section")..];
    let recorded = |name: &str| -> (u64, u64, u64) {
        let row = section
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("no row {name:?} in benchmarks/op-counts.md"));
        let cells: Vec<u64> = row
            .split('|')
            .filter_map(|c| c.trim().parse().ok())
            .collect();
        (cells[0], cells[1], cells[2])
    };
    let launches = |layers: usize, sets: &[&str], run: &str| -> (u64, u64, u64) {
        let model = tiny_llama_with_layers(&dir, layers, 8);
        let out = dir.join(run);
        let config = dir.join(format!("{run}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\npath = {:?}\ndtype = \"bf16\"\n[lora]\nrank = 8\ndropout = 0.0\n\
                 targets = \"all-linear\"\n[data]\ntrain = {:?}\nmax_seq_len = 64\n\
                 [train]\nmax_steps = 2\nmicro_batch_size = 1\ngrad_accum = 1\nlog_every = 1\n\
                 device = \"cpu\"\noutput_dir = {:?}\n",
                model.display().to_string(),
                model.join("bench.jsonl").display().to_string(),
                out.display().to_string()
            ),
        )
        .unwrap();
        let mut args = vec!["train", "--config", config.to_str().unwrap(), "--quiet"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let r = tallow_env(&args, &[("TALLOW_CUDA_PATHS_ON_CPU", "1".into())]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let step2 = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("loss").is_some())
            .nth(1)
            .expect("step 2 logged");
        (
            step2["launches_forward"].as_u64().unwrap(),
            step2["launches_backward"].as_u64().unwrap(),
            step2["launches_optimizer"].as_u64().unwrap(),
        )
    };
    let variants: [(&str, &[&str]); 5] = [
        ("LoRA, chunked attention", &[]),
        ("LoRA dropout 0.05, chunked", &["lora.dropout=0.05"]),
        ("LoRA, eager attention", &["model.attention=\"eager\""]),
        (
            "QLoRA (NF4, double quant), chunked",
            &["model.quantize=\"nf4\""],
        ),
        (
            "LoRA, chunked, checkpointing",
            &["train.checkpointing=true"],
        ),
    ];
    let mut measured = Vec::new();
    let mut over = Vec::new();
    for (i, (name, sets)) in variants.iter().enumerate() {
        let one = launches(1, sets, &format!("v{i}-1"));
        let two = launches(2, sets, &format!("v{i}-2"));
        let per_layer = (two.0 - one.0, two.1 - one.1, two.2 - one.2);
        // a layer adds forward and backward launches; its optimizer launches may be none
        // (AdamW's f32 members, 32 a launch, and the norm's 32 gradients a launch are per
        // group, not per layer), but the step has some
        assert!(
            per_layer.0 > 0 && per_layer.1 > 0 && one.2 > 0,
            "{name}: {per_layer:?}, one layer's step {one:?}"
        );
        let (f, b, o) = recorded(name);
        if per_layer.0 > f || per_layer.1 > b || per_layer.2 > o {
            over.push(format!(
                "{name}: forward {} (table {f}), backward {} (table {b}), optimizer {} (table {o})",
                per_layer.0, per_layer.1, per_layer.2
            ));
        }
        measured.push(per_layer);
    }
    assert!(
        measured[3].1 > measured[0].1,
        "checkpointing recomputes the layer: {measured:?}"
    );
    assert!(
        over.is_empty(),
        "more launches per layer than benchmarks/op-counts.md:\n{}",
        over.join("\n")
    );
}

/// `data.alpaca_prompt` / `alpaca_prompt_no_input` reach training: Alpaca rows with a custom
/// template train exactly as the prompt_completion rows of that template (same adapter after
/// 2 steps, bit for bit: the same token ids and targets), and a template without its
/// placeholder is refused by key.
#[test]
fn alpaca_rows_train_as_prompt_completion_through_the_configured_template() {
    let work = scratch("alpaca-train");
    let rows = [
        ("Name a colour.", "", "Blue."),
        ("Add the numbers.", "2 and 3", "5"),
        ("Say hi.", "", "Hi!"),
        ("Translate.", "Good morning", "Bonjour"),
    ];
    let (alpaca, pc) = alpaca_and_prompt_completion(&rows, |instruction, input| {
        if input.is_empty() {
            format!("Q: {instruction}\nA: ")
        } else {
            format!("Q: {instruction} ({input})\nA: ")
        }
    });
    let run = |name: &str, data: &str, extra: &str| -> std::path::PathBuf {
        let dir = work.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("data.jsonl"), data).unwrap();
        let text = format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\nrank = 4\n[data]\ntrain = \"{}\"\n\
             max_seq_len = 48\nshuffle = false\n{extra}\n[train]\noutput_dir = \"{}\"\n\
             max_steps = 2\nlr = 1e-2\nmicro_batch_size = 2\n",
            model_dir("tiny-qwen2").display(),
            dir.join("data.jsonl").display(),
            dir.join("run").display(),
        );
        std::fs::write(dir.join("config.toml"), text).unwrap();
        dir
    };
    let a = run(
        "alpaca",
        &alpaca,
        "alpaca_prompt = \"Q: {instruction} ({input})\\nA: \"\nalpaca_prompt_no_input = \"Q: {instruction}\\nA: \"",
    );
    let b = run("pc", &pc, "");
    for d in [&a, &b] {
        train_ok(&[
            "train",
            "--config",
            d.join("config.toml").to_str().unwrap(),
            "--quiet",
        ]);
    }
    assert_eq!(
        max_rel_diff(&adapter(&a), &adapter(&b)),
        0.0,
        "alpaca rows train as their prompt_completion rows"
    );
    let r = tallow([
        "train",
        "--config",
        a.join("config.toml").to_str().unwrap(),
        "--set",
        "data.alpaca_prompt=\"Q: {instruction}\"",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("`data.alpaca_prompt` has no {input}"),
        "{}",
        r.stderr
    );
}

/// `train.log = ["jsonl", "tensorboard"]` writes an event file under `output_dir/tensorboard/`
/// whose records (CRCs checked) hold every logged step's loss, learning rate and grad norm and
/// the eval losses, equal to metrics.jsonl's (as f32); an unknown sink is refused with the valid
/// ones and a suggestion.
#[test]
fn tensorboard_log_holds_the_metrics_of_the_run() {
    let dir = scratch("tensorboard");
    let c = config(
        &dir,
        "tiny-llama",
        "rank = 4",
        "max_steps = 3\nlr = 1e-2\nmicro_batch_size = 2\neval_every = 2\nlog = [\"jsonl\", \"tensorboard\"]",
    );
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let tb = dir.join("run/tensorboard");
    let files: Vec<_> = std::fs::read_dir(&tb).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one event file per process");
    let name = files[0].file_name().to_string_lossy().to_string();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let events =
        tallow_trainer::tensorboard::read_events(&std::fs::read(files[0].path()).unwrap()).unwrap();
    let scalar = |tag: &str, step: i64| -> f64 {
        events
            .iter()
            .filter(|e| e.step == step)
            .flat_map(|e| e.summary.iter().flat_map(|s| &s.value))
            .find(|v| v.tag == tag)
            .and_then(|v| v.simple_value)
            .unwrap_or_else(|| panic!("no {tag} at step {step}")) as f64
    };
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let (mut steps, mut evals) = (0, 0);
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_i64().unwrap();
        let f32_of = |k: &str| v[k].as_f64().unwrap() as f32 as f64;
        if v.get("loss").is_some() {
            assert_eq!(scalar("train/loss", step), f32_of("loss"));
            assert_eq!(scalar("train/learning_rate", step), f32_of("lr"));
            assert_eq!(scalar("train/grad_norm", step), f32_of("grad_norm"));
            steps += 1;
        }
        if v.get("eval_loss").is_some() {
            assert_eq!(scalar("eval/loss", step), f32_of("eval_loss"));
            evals += 1;
        }
    }
    assert_eq!((steps, evals), (3, 3), "{metrics}");
    let r = tallow([
        "train",
        "--config",
        c.to_str().unwrap(),
        "--set",
        "train.log=[\"jsonl\", \"tensorbord\"]",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("train.log")
            && r.stderr.contains("\"tensorboard\"")
            && r.stderr.contains("did you mean"),
        "{}",
        r.stderr
    );
}

/// Stop step and best step that HF Trainer's rules give for `losses` (the eval losses after
/// steps 1, 2, ...): the best is the lowest loss so far; an eval resets the patience counter when
/// it beats the previous best by more than `threshold` (`EarlyStoppingCallback`), and the run
/// stops when the counter reaches `patience`. Written out here, apart from the trainer's code.
fn hf_early_stop(losses: &[f64], patience: usize, threshold: f64) -> (usize, usize) {
    let (mut best, mut best_step, mut counter) = (f64::INFINITY, 0, 0);
    for (i, &l) in losses.iter().enumerate() {
        let step = i + 1;
        if best.is_infinite() || (l < best && (l - best).abs() > threshold) {
            counter = 0;
        } else {
            counter += 1;
        }
        if l < best {
            (best, best_step) = (l, step);
        }
        if counter >= patience {
            return (step, best_step);
        }
    }
    (losses.len(), best_step)
}

/// The eval losses of a run's metrics.jsonl after step 0, in step order.
fn eval_losses_after_start(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            (v["step"].as_u64()? > 0).then_some(v["eval_loss"].as_f64()?)
        })
        .collect()
}

fn adapter_at(dir: &Path, name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        dir.join(format!("run/{name}/adapter_model.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
}

fn assert_same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>, what: &str) {
    assert_eq!(a.len(), b.len());
    for (k, t) in a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{what}: {k} differs");
    }
}

/// `train.early_stopping_patience` / `early_stopping_threshold` / `keep_best` /
/// `save_total_limit` (issue 21). A plain 14-step run (lr 0.05, constant: the eval loss on the
/// held-out rows falls, then wanders) gives the eval loss after every step; HF's rules on those
/// losses (`hf_early_stop`, written out in this test) say where a run with patience 3 stops and
/// which step was best. Then, bit for bit (constant lr, so a run cut at step k has step k's
/// weights):
/// - the patient run stops at that step; `adapter-last/` equals the plain run cut at the stop
///   step and `adapter/` the plain run cut at the best step;
/// - `save_total_limit = 2` with a checkpoint every step leaves the newest two and the best;
/// - the run killed between the best and the stop and resumed stops at the same step with the
///   same adapters, and resuming a stopped run runs no step;
/// - a threshold of 0.3 makes small improvements not count: the stop HF's rules give for it.
///
/// Breaks seen (each compared bit for bit or by step number): the threshold ignored: the
/// threshold run stops at HF's threshold-0 step (6), not 3; `adapter/` left at the last step's
/// weights: differs from the best step's; `save_total_limit` not sparing the best: the best's
/// checkpoint is removed and the run fails at its end naming it.
#[test]
fn early_stopping_and_keep_best_follow_hf_rules() {
    let lora = "rank = 4\nalpha = 8\ndropout = 0.0";
    let base =
        "lr = 0.05\nschedule = \"constant\"\nmicro_batch_size = 2\ngrad_accum = 1\neval_every = 1";
    let run = |name: &str, extra: &str| -> (PathBuf, Run) {
        let dir = scratch(name);
        let c = config(&dir, "tiny-llama", lora, &format!("{base}\n{extra}"));
        let r = tallow(["train", "--config", c.to_str().unwrap(), "--quiet"]);
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        (dir, r)
    };
    let (plain, _) = run("best-plain", "max_steps = 14");
    let losses = eval_losses_after_start(&plain);
    assert_eq!(losses.len(), 14);
    let (stop, best) = hf_early_stop(&losses, 3, 0.0);
    // The job must exercise all of it: a best before the stop, a stop before the end.
    assert!(
        best < stop && stop < 14,
        "losses {losses:?}: best {best}, stop {stop}"
    );

    let patient = "max_steps = 14\nearly_stopping_patience = 3\nkeep_best = true\nsave_every = 1\nsave_total_limit = 2";
    let (es, r) = run("best-es", patient);
    assert!(
        r.stdout.contains(&format!("done: {stop} steps")) && r.stdout.contains("stopped early"),
        "{}",
        r.stdout
    );
    assert!(
        r.stderr.contains(&format!("early stopping at step {stop}")),
        "{}",
        r.stderr
    );
    assert_eq!(eval_losses_after_start(&es), losses[..stop]);
    let (cut_stop, _) = run("best-cut-stop", &format!("max_steps = {stop}"));
    let (cut_best, _) = run("best-cut-best", &format!("max_steps = {best}"));
    assert_same(
        &adapter_at(&es, "adapter-last"),
        &adapter(&cut_stop),
        "adapter-last/ vs the stop step",
    );
    assert_same(
        &adapter_at(&es, "adapter"),
        &adapter(&cut_best),
        "adapter/ vs the best step",
    );
    let mut kept: Vec<String> = std::fs::read_dir(es.join("run/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    let mut want: Vec<String> = [best, stop - 1, stop]
        .iter()
        .map(|s| format!("step-{s}"))
        .collect();
    want.sort();
    assert_eq!(kept, want, "save_total_limit = 2 plus the best");

    // Killed between the best and the stop, then resumed: the same stop and adapters.
    let killed = scratch("best-resumed");
    let c = config(&killed, "tiny-llama", lora, &format!("{base}\n{patient}"));
    let cs = c.to_str().unwrap();
    train_ok(&[
        "train",
        "--config",
        cs,
        "--quiet",
        "--set",
        &format!("train.max_steps={}", best + 1),
    ]);
    train_ok(&["train", "--config", cs, "--quiet", "--resume"]);
    for name in ["adapter", "adapter-last"] {
        assert_same(&adapter_at(&killed, name), &adapter_at(&es, name), name);
    }
    // Resuming the stopped run: no step runs; the outputs stay.
    let r = tallow(["train", "--config", cs, "--resume", "--quiet"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains(&format!("done: {stop} steps")),
        "{}",
        r.stdout
    );
    assert!(
        !r.stderr.lines().any(|l| l.starts_with("step ")),
        "{}",
        r.stderr
    );
    assert_same(
        &adapter_at(&killed, "adapter"),
        &adapter_at(&es, "adapter"),
        "re-resumed",
    );

    // A threshold: HF's stop for it, which differs from the threshold-0 one with patience 2.
    let (stop_t, _) = hf_early_stop(&losses, 2, 0.3);
    assert_ne!(
        stop_t,
        hf_early_stop(&losses, 2, 0.0).0,
        "losses {losses:?}"
    );
    let (_, r) = run(
        "best-threshold",
        "max_steps = 14\nearly_stopping_patience = 2\nearly_stopping_threshold = 0.3",
    );
    assert!(
        r.stdout.contains(&format!("done: {stop_t} steps")),
        "{}",
        r.stdout
    );

    // Bad input: patience without eval data.
    let dir = scratch("best-no-eval");
    let c = config(&dir, "tiny-llama", lora, &format!("{base}\n{patient}"));
    let r = tallow([
        "train",
        "--config",
        c.to_str().unwrap(),
        "--set",
        "data.eval=",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains(
            "`train.early_stopping_patience` compares eval losses, but there is no eval data"
        ),
        "{}",
        r.stderr
    );
}

/// Data parallel without MPI in the build: `--nproc 2` on the CPU and a process started as a
/// rank (torchrun's variables) each stop before training, naming what is missing and how to
/// build it. (With `--features mpi`, tests/tests/distributed.rs runs the real thing.)
#[cfg(not(feature = "mpi"))]
#[test]
fn data_parallel_without_mpi_says_how_to_get_it() {
    let a = scratch("dp-no-mpi");
    let c = config(&a, "tiny-llama", "rank = 4\nalpha = 8", "max_steps = 1");
    let c = c.to_str().unwrap();
    let r = tallow([
        "train",
        "--config",
        c,
        "--nproc",
        "2",
        "--set",
        "train.device=cpu",
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("--nproc 2 on the CPU")
            && r.stderr.contains("built without it")
            && r.stderr.contains("--features mpi"),
        "{}",
        r.stderr
    );
    let out = std::process::Command::new(tallow_bin())
        .args(["train", "--config", c, "--set", "train.device=cpu"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 1 of 2 started by torchrun-style variables")
            && stderr.contains("no collectives for CPU ranks"),
        "{stderr}"
    );
    assert!(!a.join("run/metrics.jsonl").exists(), "nothing trained");
    // Inconsistent variables are refused by name.
    let out = std::process::Command::new(tallow_bin())
        .args(["train", "--config", c])
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("RANK=2 with WORLD_SIZE=2"), "{stderr}");
}

/// `tallow train ARGS` with stderr into the file `log` (not a terminal, as under Slurm, nohup or
/// `2> train.log`): the exit code and the file's text.
fn train_logged(args: &[&str], log: &Path) -> (i32, String) {
    let file = std::fs::File::create(log).unwrap();
    let out = std::process::Command::new(tallow_bin())
        .args(args)
        .stderr(file)
        .output()
        .unwrap();
    let text = std::fs::read_to_string(log).unwrap();
    (out.status.code().unwrap_or(-1), text)
}

/// Issue 34: with stderr not a terminal, the bar (which hides itself there and drops what is
/// printed through it) gives way to plain lines: the notes, one line per `log_every` steps and
/// the last, every evaluation and checkpoint; the same after `--resume`.
#[test]
fn logs_without_a_terminal_are_plain_lines() {
    let dir = scratch("plain-log");
    let c = config(
        &dir,
        "tiny-llama",
        "rank = 4\nalpha = 8",
        "max_steps = 3\nschedule = \"constant\"\nlog_every = 2\neval_every = 2\nsave_every = 2",
    );
    let c = c.to_str().unwrap();
    let lines = |text: &str, what: &str| -> Vec<usize> {
        text.lines()
            .filter(|l| l.contains(what))
            .filter_map(|l| l.strip_prefix("step ")?.split_once(':')?.0.parse().ok())
            .collect()
    };
    let steps = |text: &str| -> Vec<usize> { text.lines().filter_map(step_line).collect() };

    let (code, log) = train_logged(&["train", "--config", c], &dir.join("first.log"));
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("training 3 steps on 4 rows"), "{log}");
    assert!(log.contains("memory ("), "{log}");
    // log_every = 2: steps 2 and the last, 3; eval and checkpoint at 2 and the last (eval at 0).
    assert_eq!(steps(&log), [2, 3], "{log}");
    assert!(
        log.lines().any(|l| l.starts_with("step 2/3  loss ")
            && l.contains(" lr ")
            && l.contains(" tok/s")
            && l.contains(" grad_norm ")
            && l.contains(" peak fwd ")),
        "{log}"
    );
    assert_eq!(lines(&log, ": eval loss "), [0, 2, 3], "{log}");
    assert_eq!(lines(&log, ": checkpoint "), [2, 3], "{log}");

    let (code, log) = train_logged(
        &[
            "train",
            "--config",
            c,
            "--resume",
            "--set",
            "train.max_steps=7",
        ],
        &dir.join("resumed.log"),
    );
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("training 7 steps on 4 rows")
            && log.contains(&format!(
                "resumed from {} at step 3",
                dir.join("run/checkpoints/step-3").display()
            )),
        "{log}"
    );
    assert_eq!(steps(&log), [4, 6, 7], "{log}");
    assert_eq!(lines(&log, ": eval loss "), [4, 6, 7], "{log}");
    assert_eq!(lines(&log, ": checkpoint "), [4, 6, 7], "{log}");
}

/// A `tallow train` child running into `config` (long: `max_steps` 100000) with its output
/// discarded, once it holds the output dir's lock.
fn start_holder(config: &Path, lock: &Path) -> std::process::Child {
    let mut child = std::process::Command::new(tallow_bin())
        .args(["train", "--config", config.to_str().unwrap(), "--quiet"])
        .args(["--set", "train.max_steps=100000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !lock.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the first run ended ({status}) before taking {}",
                lock.display()
            );
        }
        assert!(
            t0.elapsed().as_secs() < 120,
            "no {} after 120 s",
            lock.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

/// Issue 34: a second run (or a `--nproc` launch) into an output dir a live run holds is refused
/// at once, naming the holder's PID and host and the lock file.
#[test]
fn a_second_run_into_a_held_output_dir_is_refused() {
    let dir = scratch("lock-held");
    let c = config(&dir, "tiny-llama", "rank = 4\nalpha = 8", "");
    let lock = dir.join("run/.tallow-lock");
    let mut first = start_holder(&c, &lock);
    let holder = format!(
        "process {} on {}",
        first.id(),
        tallow_trainer::lock::hostname()
    );
    let cs = c.to_str().unwrap();
    // max_steps = 1: a second run that is let in ends (with exit 0) instead of running on.
    let t0 = std::time::Instant::now();
    let second = tallow(["train", "--config", cs, "--set", "train.max_steps=1"]);
    let took = t0.elapsed();
    let nproc = tallow([
        "train",
        "--config",
        cs,
        "--set",
        "train.max_steps=1",
        "--set",
        "train.device=cpu",
        "--nproc",
        "2",
    ]);
    let still_running = first.try_wait().unwrap().is_none();
    first.kill().unwrap();
    first.wait().unwrap();
    assert_ne!(second.code, 0, "{}", second.stderr);
    assert!(
        second.stderr.contains("is in use by another run")
            && second.stderr.contains(&holder)
            && second.stderr.contains(&lock.display().to_string()),
        "`{holder}` and {} not in: {}",
        lock.display(),
        second.stderr
    );
    assert!(took.as_secs() < 30, "refused after {took:?}");
    assert!(still_running, "the first run ended while the second ran");
    assert_ne!(nproc.code, 0, "{}", nproc.stderr);
    assert!(nproc.stderr.contains(&holder), "{}", nproc.stderr);
}

/// Issue 34: a run killed with SIGKILL leaves its lock behind; `--resume` finds its process gone,
/// takes the lock over (saying so) and continues from the last checkpoint; the lock is removed
/// when the run ends.
#[test]
fn resume_takes_over_the_lock_of_a_killed_run() {
    let dir = scratch("lock-stale");
    let c = config(
        &dir,
        "tiny-llama",
        "rank = 4\nalpha = 8",
        "schedule = \"constant\"\nsave_every = 1",
    );
    let lock = dir.join("run/.tallow-lock");
    let mut first = start_holder(&c, &lock);
    let pid = first.id();
    let t0 = std::time::Instant::now();
    while !dir.join("run/checkpoints/step-1").exists() {
        assert!(
            t0.elapsed().as_secs() < 120,
            "no step-1 checkpoint after 120 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    first.kill().unwrap(); // SIGKILL: no Drop runs
    first.wait().unwrap();
    assert!(lock.exists(), "a killed run leaves its lock");
    let (step, _) = tallow_trainer::checkpoint::latest(&dir.join("run")).unwrap();
    let total = format!("train.max_steps={}", step + 1);
    let r = tallow([
        "train",
        "--config",
        c.to_str().unwrap(),
        "--resume",
        "--quiet",
        "--set",
        &total,
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let note = format!("(process {pid} on {}", tallow_trainer::lock::hostname());
    assert!(
        r.stderr.contains(&note) && r.stderr.contains("is gone; lock taken over"),
        "`{note}` not in: {}",
        r.stderr
    );
    assert!(
        r.stderr.contains(&format!("step-{step} at step {step}")),
        "{}",
        r.stderr
    );
    assert!(!lock.exists(), "the lock is removed at the end of the run");
}

/// `(step, eval loss)` of every evaluation after step 0 in a run's metrics.jsonl, in order.
fn evals_by_step(dir: &Path) -> Vec<(usize, f64)> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let step = v["step"].as_u64()? as usize;
            (step > 0).then_some((step, v["eval_loss"].as_f64()?))
        })
        .collect()
}

/// The steps whose eval loss is below every earlier one: each new best (HF's
/// `_determine_best_metric` with `eval_loss`: any decrease counts).
fn new_best_steps(evals: &[(usize, f64)]) -> Vec<usize> {
    let mut best = f64::INFINITY;
    let mut out = Vec::new();
    for &(step, loss) in evals {
        if loss < best {
            best = loss;
            out.push(step);
        }
    }
    out
}

/// The `N` of every `run/checkpoints/step-N`, ascending.
fn checkpoint_steps(dir: &Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(dir.join("run/checkpoints"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_prefix("step-")?.parse().ok()
        })
        .collect();
    steps.sort();
    steps
}

/// The trainable tensors of the checkpoint of `step`.
fn checkpoint_tensors(dir: &Path, step: usize) -> HashMap<String, Tensor> {
    let path = dir.join(format!("run/checkpoints/step-{step}/trainable.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Issue 41: `train.keep_best` with the default `save_every = 0`, where only keep_best's own
/// clause in `eval_and_checkpoint` writes the best step's checkpoint (the `keep_best` test above
/// saves every step, so it cannot see that clause go). 14 LoRA steps (tiny-llama, lr 0.05,
/// constant, dropout 0.1), evaluated every 2 steps: new bests at steps 2, 4 and 12, then a worse
/// loss at 14. Checked, bit for bit:
/// - the checkpoints are exactly the new bests and the last step (each new best is saved);
/// - `adapter/` holds the best checkpoint's tensors, `adapter-last/` the last step's;
/// - a run killed after the best (the later checkpoint and the outputs removed) resumes from the
///   best's checkpoint, runs only the steps after it, and ends with the same checkpoints, eval
///   losses and adapters as the uninterrupted run.
///
/// Break seen: `|| (t.keep_best && new_best)` removed from `eval_and_checkpoint`: the run fails
/// at its end with "train.keep_best: the best evaluation's checkpoint .../step-12 is gone".
#[test]
fn keep_best_without_save_every_checkpoints_each_new_best_and_resumes_exactly() {
    let lora = "rank = 4\nalpha = 8\ndropout = 0.1";
    let train = "max_steps = 14\nlr = 0.05\nschedule = \"constant\"\nmicro_batch_size = 2\n\
                 eval_every = 2\nkeep_best = true\nsave_every = 0";
    let a = scratch("best-nosave-a");
    let b = scratch("best-nosave-b");
    let ca = config(&a, "tiny-llama", lora, train);
    let cb = config(&b, "tiny-llama", lora, train);
    train_ok(&["train", "--config", ca.to_str().unwrap(), "--quiet"]);

    let evals = evals_by_step(&a);
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        (2..=14).step_by(2).collect::<Vec<_>>(),
        "evaluations: {evals:?}"
    );
    let bests = new_best_steps(&evals);
    let best = *bests.last().unwrap();
    // The job must exercise it: several new bests, the best before the end, and a worse
    // evaluation between two new bests (a checkpoint per evaluation would also be wrong).
    assert!(
        bests.len() >= 2 && best < 14 && bests.len() + 1 < evals.len(),
        "eval losses {evals:?}: new bests at {bests:?}"
    );
    let mut want = bests.clone();
    want.push(14);
    assert_eq!(
        checkpoint_steps(&a),
        want,
        "with save_every = 0 the checkpoints are the new bests {bests:?} and the last step"
    );
    assert_same(
        &adapter_at(&a, "adapter"),
        &checkpoint_tensors(&a, best),
        &format!("adapter/ vs step {best}'s checkpoint"),
    );
    assert_same(
        &adapter_at(&a, "adapter-last"),
        &checkpoint_tensors(&a, 14),
        "adapter-last/ vs step 14's checkpoint",
    );

    // Killed after the best: the best's checkpoint is the newest one left.
    train_ok(&["train", "--config", cb.to_str().unwrap(), "--quiet"]);
    std::fs::remove_dir_all(b.join("run/checkpoints/step-14")).unwrap();
    for out in ["adapter", "adapter-last"] {
        std::fs::remove_dir_all(b.join("run").join(out)).unwrap();
    }
    resume_at(&cb, best, 14);
    assert_eq!(checkpoint_steps(&b), want);
    assert_eq!(
        evals_by_step(&b),
        evals,
        "eval losses after the resume vs uninterrupted"
    );
    for out in ["adapter", "adapter-last"] {
        assert_same(
            &adapter_at(&b, out),
            &adapter_at(&a, out),
            &format!("{out}/ resumed vs uninterrupted"),
        );
    }
}

/// Issue 41: `keep_best` with full fine-tuning, where the outputs are whole HF models: tiny-qwen3,
/// lr 2e-2, constant, 8 steps, evaluated every step, `save_every = 0`: the eval loss falls to its
/// best at step 4 (5.408), then climbs to 6.599 at step 8. `model/` must be the best step's
/// weights and `model-last/` the last step's: each is a model `tallow eval` loads, whose loss on
/// the eval file is the one metrics.jsonl recorded for its step, and whose tensors are its step's
/// checkpoint's (bit for bit).
///
/// Tolerance on the losses: 1e-6 relative (measured 0: the same rows through the same f32
/// forward); the best and last losses are ~1.2 apart, so swapped outputs miss by 1e5 times it.
/// Break seen: `load_best` skipped in `finish`: model/ evaluates to step 8's 6.599, not 5.408.
#[test]
fn keep_best_with_full_fine_tuning_keeps_the_best_model_and_the_last() {
    let dir = scratch("best-full");
    let c = config(
        &dir,
        "tiny-qwen3",
        "",
        "method = \"full\"\nmax_steps = 8\nlr = 2e-2\nschedule = \"constant\"\n\
         micro_batch_size = 2\neval_every = 1\nkeep_best = true\nsave_every = 0",
    );
    train_ok(&["train", "--config", c.to_str().unwrap(), "--quiet"]);
    let evals = evals_by_step(&dir);
    let bests = new_best_steps(&evals);
    let best = *bests.last().unwrap();
    let loss_at = |step: usize| evals.iter().find(|e| e.0 == step).unwrap().1;
    assert!(
        best < 8 && (loss_at(8) - loss_at(best)).abs() > 1e-3,
        "eval losses {evals:?}: the best must come before the end, and differ from the last"
    );
    let mut want = bests.clone();
    want.push(8);
    assert_eq!(checkpoint_steps(&dir), want);
    for (out, step) in [("model", best), ("model-last", 8)] {
        let m = dir.join("run").join(out);
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(m.join(f).exists(), "{out}/ lacks {f}");
        }
        let got = eval_fixture(&m, None, "prompt_completion");
        let want = loss_at(step);
        assert!(
            (got - want).abs() <= 1e-6 * want,
            "{out}/: tallow eval gives {got}, metrics.jsonl has {want} at step {step}"
        );
        let weights =
            candle_core::safetensors::load(m.join("model.safetensors"), &Device::Cpu).unwrap();
        assert_same(
            &weights,
            &checkpoint_tensors(&dir, step),
            &format!("{out}/ vs step {step}'s checkpoint"),
        );
    }
}

/// A bf16 model on the CPU multiplies its base weights on AMX tiles where the CPU has them
/// (`kernels::amx`), and trains as the widened-f32 twin does (`TALLOW_CPU_AMX=0`): the two
/// differ only in the order of f32 sums before each rounding to bf16. Held: the step losses and
/// gradient norms of 3 AdamW steps and the final eval loss within 2e-3 relative (measured: step 1
/// equal, grad norms 4e-4, eval loss 3.4e-4; Adam then moves near-zero adapter entries apart, so
/// the adapters themselves are not compared); a wrongly packed weight moves the first loss by
/// O(1). The metrics name the path taken, and it is AMX exactly when /proc/cpuinfo lists
/// `amx_bf16` (on a CPU without it both runs are the twin and the comparison is trivially met).
#[test]
fn bf16_on_amx_trains_as_the_widened_twin() {
    const TOL: f64 = 2e-3;
    let has_amx = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.contains(" amx_bf16") && c.contains(" amx_tile"))
        .unwrap_or(false);
    let runs: Vec<(String, Vec<f64>)> = ["1", "0"]
        .into_iter()
        .map(|amx| {
            let dir = scratch(&format!("bf16-amx-{amx}"));
            let c = config(
                &dir,
                "tiny-qwen3",
                "rank = 4\nalpha = 8\ndropout = 0.1",
                "max_steps = 3\nlr = 1e-2\nmicro_batch_size = 4\ngrad_accum = 1",
            );
            let text = std::fs::read_to_string(&c)
                .unwrap()
                .replace("dtype = \"f32\"", "dtype = \"bf16\"");
            std::fs::write(&c, text).unwrap();
            let r = tallow_env(
                ["train", "--config", c.to_str().unwrap(), "--quiet"],
                &[("TALLOW_CPU_AMX", amx.to_string())],
            );
            assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
            let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
            let lines: Vec<serde_json::Value> = metrics
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            let path = lines[0]["bf16_cpu_matmul"].as_str().unwrap().to_string();
            let numbers = lines
                .iter()
                .flat_map(|v| ["loss", "grad_norm", "eval_loss"].map(|k| v[k].as_f64()))
                .flatten()
                .collect();
            (path, numbers)
        })
        .collect();
    let want = if has_amx { "amx" } else { "f32 gemm" };
    assert_eq!(
        runs[0].0, want,
        "default path (amx_bf16 in /proc/cpuinfo: {has_amx})"
    );
    assert_eq!(runs[1].0, "f32 gemm", "TALLOW_CPU_AMX=0");
    let (amx, twin) = (&runs[0].1, &runs[1].1);
    assert_eq!(amx.len(), twin.len());
    assert_eq!(
        amx.len(),
        3 * 2 + 2,
        "3 losses and grad norms, 2 eval losses"
    );
    let worst = amx
        .iter()
        .zip(twin)
        .map(|(a, t)| (a - t).abs() / t.abs())
        .fold(0.0, f64::max);
    assert!(
        worst <= TOL,
        "bf16 on AMX against the twin: {worst} relative (tolerance {TOL})\n{amx:?}\n{twin:?}"
    );
}
