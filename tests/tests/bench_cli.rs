//! `tallow estimate` against `tallow bench`'s measured peaks, on CPU, for a grid of configs of a
//! random ~105M-parameter Llama (benchmarks/models/llama-105m.json), DoRA included: every cell's estimated
//! peak must be within 10% of the peak the counting allocator measured (the bound).
//!
//! Its own test binary: the cells are separate `tallow train` processes that take the two cores,
//! and nothing else should run next to them.

use std::path::{Path, PathBuf};

use tallow_tests::*;

/// Relative bound on |estimated - measured| / measured.
const TOLERANCE: f64 = 0.10;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs `tallow bench --json` with these grid arguments; returns the rows.
fn bench(config: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let mut a = vec![
        "bench".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--steps".into(),
        "2".into(),
        "--json".into(),
    ];
    a.extend(args.iter().map(|s| s.to_string()));
    let r = tallow(&a);
    assert_eq!(r.code, 0, "tallow {a:?}: {}", r.stderr);
    serde_json::from_str::<serde_json::Value>(&r.stdout)
        .unwrap_or_else(|e| panic!("bench --json is not JSON ({e}): {}", r.stdout))
        .as_array()
        .expect("bench --json prints an array")
        .clone()
}

#[test]
fn estimate_is_within_10_percent_of_the_measured_peak_on_a_grid_of_20_configs() {
    let dir = scratch("bench-grid");
    let model = dir.join("llama-105m");
    make_random_model(
        env!("CARGO_BIN_EXE_make-random-model"),
        &repo().join("benchmarks/models/llama-105m.json"),
        &model,
        8,
    );
    let config = dir.join("base.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {:?}\ndtype = \"bf16\"\n[lora]\nrank = 16\nalpha = 32\n\
             dropout = 0.0\n[data]\ntrain = {:?}\nmax_seq_len = 128\nshuffle = false\n\
             [train]\nmicro_batch_size = 1\ngrad_accum = 1\nlr = 1e-4\nschedule = \"constant\"\n\
             device = \"cpu\"\noutput_dir = {:?}\n",
            model.display().to_string(),
            model.join("bench.jsonl").display().to_string(),
            dir.join("run").display().to_string()
        ),
    )
    .unwrap();
    // LoRA and full fine-tuning, checkpointing, both AdamWs: 8 cells ...
    let mut rows = bench(
        &config,
        &[
            "--grid",
            "train.method=lora,full",
            "--grid",
            "train.checkpointing=false,true",
            "--grid",
            "train.optimizer=adamw,adamw8bit",
        ],
    );
    // ... and for LoRA: NF4, micro-batch 2, a longer sequence, rank 64 with dropout: 8 more.
    rows.extend(bench(
        &config,
        &[
            "--set",
            "lora.dropout=0.05",
            "--grid",
            "model.quantize=none,nf4",
            "--grid",
            "train.micro_batch_size=1,2",
            "--grid",
            "data.max_seq_len=128,256",
            "--set",
            "lora.rank=64",
        ],
    ));
    // ... and DoRA (its unfused linear, the magnitude, the weight norm's f32 transient), with
    // dropout (PEFT's second base matmul), dense and NF4 (QDoRA), checkpointing off and on: 4.
    rows.extend(bench(
        &config,
        &[
            "--set",
            "lora.dora=true",
            "--set",
            "lora.dropout=0.05",
            "--grid",
            "model.quantize=none,nf4",
            "--grid",
            "train.checkpointing=false,true",
        ],
    ));
    assert_eq!(rows.len(), 20);
    let mut report = String::new();
    let mut worst: f64 = 0.0;
    for r in &rows {
        for key in [
            "config",
            "measured_peak_bytes",
            "estimated_peak_bytes",
            "tokens_per_s",
            "oom",
            "phases",
        ] {
            assert!(r.get(key).is_some(), "row without `{key}`: {r}");
        }
        assert!(r["config"].is_object());
        assert_eq!(r["oom"], false, "{r}");
        assert!(r["error"].is_null(), "cell failed: {r}");
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        for phase in ["load", "forward", "backward", "optimizer"] {
            assert!(r["phases"][phase].as_u64().unwrap() > 0, "{phase}: {r}");
        }
        let measured = r["measured_peak_bytes"].as_u64().unwrap() as f64;
        let estimated = r["estimated_peak_bytes"].as_u64().unwrap() as f64;
        let err = (estimated - measured) / measured;
        worst = worst.max(err.abs());
        report += &format!(
            "{}: measured {:.1} MiB, estimated {:.1} MiB ({:+.1}%)\n",
            r["config"],
            measured / 1048576.0,
            estimated / 1048576.0,
            100.0 * err
        );
    }
    eprintln!("{report}");
    assert!(
        worst <= TOLERANCE,
        "an estimate is {:.1}% off (bound {:.0}%):\n{report}",
        100.0 * worst,
        100.0 * TOLERANCE
    );
}
