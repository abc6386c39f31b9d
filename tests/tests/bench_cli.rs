//! `tallow estimate` against `tallow bench`'s measured peaks, on CPU, for a grid of configs of a
//! random ~105M-parameter Llama (benchmarks/models/llama-105m.json), DoRA included: every cell's estimated
//! peak must be within 10% of the peak the counting allocator measured (the bound).
//!
//! The grid is five tests (full fine-tuning, LoRA, LoRA's levers dense and NF4, DoRA) that run side by side with
//! the random shapes: each cell is its own `tallow train` process whose peak its own counting
//! allocator measures, so cells running at once do not change each other's numbers, and on two
//! cores one cell's single-threaded stretches (start-up, loading) overlap another's matmuls.

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

/// The grid's base config, on one random ~105M Llama made once for all the grid's tests.
fn grid_config() -> PathBuf {
    static CONFIG: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let dir = scratch("bench-grid");
            let model = dir.join("llama-105m");
            make_random_model(
                env!("CARGO_BIN_EXE_make-random-model"),
                &repo().join("benchmarks/models/llama-105m.json"),
                &model,
                8,
            );
            write_config(
                &dir,
                &model,
                "[lora]\nrank = 16\nalpha = 32\ndropout = 0.0\n",
            )
        })
        .clone()
}

/// Runs the grid cells of `args` (`tallow bench` runs each cell in a folder of its own) and
/// checks each cell's row and its estimate against the measured peak; `cells` rows expected.
fn grid_within_tolerance(name: &str, cells: usize, args: &[&str]) -> Vec<serde_json::Value> {
    rows_within_tolerance(name, cells, bench(&grid_config(), args))
}

/// Checks each of `rows` (`cells` expected) and its estimate against the measured peak.
fn rows_within_tolerance(
    name: &str,
    cells: usize,
    rows: Vec<serde_json::Value>,
) -> Vec<serde_json::Value> {
    assert_eq!(rows.len(), cells);
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
    eprintln!("{name}:\n{report}");
    assert!(
        worst <= TOLERANCE,
        "{name}: an estimate is {:.1}% off (bound {:.0}%):\n{report}",
        100.0 * worst,
        100.0 * TOLERANCE
    );
    rows
}

/// AdamW8bit's optimizer phase (measured) below AdamW's in every pair of `rows` that differ
/// only in `train.optimizer`: its moments take 2 bytes per parameter instead of 8, and its
/// update holds f32 copies of one group of at most `GROUP_ELEMS` elements at a time (or of one
/// larger tensor), so 8-bit must not raise the phase it is sold to shrink (issue 41: with
/// groups of 4Mi elements it held ~140 MiB of transients and peaked above AdamW).
fn adamw8bit_optimizer_phase_below_adamw(name: &str, rows: &[serde_json::Value]) {
    let phase = |r: &serde_json::Value| r["phases"]["optimizer"].as_u64().unwrap();
    let mut pairs = 0;
    let mut report = String::new();
    for eight in rows
        .iter()
        .filter(|r| r["config"]["train.optimizer"] == "adamw8bit")
    {
        let mut same = eight["config"].clone();
        same["train.optimizer"] = "adamw".into();
        let adamw = rows
            .iter()
            .find(|r| r["config"] == same)
            .unwrap_or_else(|| panic!("{name}: no adamw cell beside {}", eight["config"]));
        let (a, b) = (phase(adamw), phase(eight));
        report += &format!(
            "{}: optimizer phase adamw {:.1} MiB, adamw8bit {:.1} MiB\n",
            same,
            a as f64 / 1048576.0,
            b as f64 / 1048576.0
        );
        assert!(
            b < a,
            "{name}: adamw8bit's optimizer phase is above adamw's:\n{report}"
        );
        pairs += 1;
    }
    assert!(pairs > 0, "{name}: no adamw / adamw8bit pair");
    eprintln!("{name}:\n{report}");
}

/// Grid, part 1 of 5 (20 cells in all): full fine-tuning, checkpointing off and on, both AdamWs.
#[test]
fn estimate_is_within_10_percent_on_the_grid_full_fine_tuning() {
    grid_within_tolerance(
        "grid, full fine-tuning",
        4,
        &[
            "--set",
            "train.method=full",
            "--grid",
            "train.checkpointing=false,true",
            "--grid",
            "train.optimizer=adamw,adamw8bit",
        ],
    );
}

/// Grid, part 2 of 5: LoRA with checkpointing off and on and both AdamWs (4 cells); AdamW8bit's
/// optimizer phase below AdamW's.
#[test]
fn estimate_is_within_10_percent_on_the_grid_lora() {
    let rows = grid_within_tolerance(
        "grid, LoRA",
        4,
        &[
            "--grid",
            "train.checkpointing=false,true",
            "--grid",
            "train.optimizer=adamw,adamw8bit",
        ],
    );
    adamw8bit_optimizer_phase_below_adamw("grid, LoRA", &rows);
}

/// Grid, parts 3 and 4 of 5: LoRA with rank 64 and dropout, micro-batch 1 and 2, sequence 128
/// and 256 (4 cells each), dense (here) and NF4 (next).
#[test]
fn estimate_is_within_10_percent_on_the_grid_lora_levers() {
    lora_levers("none");
}

#[test]
fn estimate_is_within_10_percent_on_the_grid_lora_levers_nf4() {
    lora_levers("nf4");
}

fn lora_levers(quantize: &str) {
    let q = format!("model.quantize={quantize}");
    grid_within_tolerance(
        &format!("grid, LoRA levers, {quantize}"),
        4,
        &[
            "--set",
            "lora.dropout=0.05",
            "--set",
            &q,
            "--grid",
            "train.micro_batch_size=1,2",
            "--grid",
            "data.max_seq_len=128,256",
            "--set",
            "lora.rank=64",
        ],
    );
}

/// Grid, part 5 of 5: DoRA (its unfused linear, the magnitude, the weight norm's f32
/// transient), with dropout (PEFT's second base matmul), dense and NF4 (QDoRA), checkpointing
/// off and on: 4 cells.
#[test]
fn estimate_is_within_10_percent_on_the_grid_dora() {
    grid_within_tolerance(
        "grid, DoRA",
        4,
        &[
            "--set",
            "lora.kind=dora",
            "--set",
            "lora.dropout=0.05",
            "--grid",
            "model.quantize=none,nf4",
            "--grid",
            "train.checkpointing=false,true",
        ],
    );
}

/// The held-out grid of issue 41, on a shape the estimate was not fitted to: a random 77M
/// Llama (benchmarks/models/llama-77m.json: hidden 768, 12 layers, 12 heads over 4 kv heads,
/// intermediate 1216, a 32k vocabulary tied, so the LM head is a third of the parameters as on
/// small real models), bf16, LoRA r64 with the default dropout, 2 x 256 tokens packed, made once
/// for the grid's four tests.
fn grid_77m_config() -> PathBuf {
    static CONFIG: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let dir = scratch("bench-grid-77m");
            let model = dir.join("llama-77m");
            make_random_model(
                env!("CARGO_BIN_EXE_make-random-model"),
                &repo().join("benchmarks/models/llama-77m.json"),
                &model,
                8,
            );
            write_config(&dir, &model, "[lora]\nrank = 64\n")
        })
        .clone()
}

/// One NF4 x checkpointing pair of the 77M grid, both AdamWs (2 cells): each estimate within
/// 10% of its measured peak, and AdamW8bit's optimizer phase below AdamW's. On this shape the
/// LM head's backward is the backward's high point; the estimate once added every LoRA
/// gradient to it (the head runs first), +5.8% .. +10.9% over; and AdamW8bit's update of 4Mi
/// elements at a time put its optimizer phase ~20 MiB above AdamW's (issue 41).
fn grid_77m(quantize: &str, checkpointing: bool) {
    let name = format!("77M grid, quantize={quantize} checkpointing={checkpointing}");
    let q = format!("model.quantize={quantize}");
    let ck = format!("train.checkpointing={checkpointing}");
    let args = [
        "--set",
        "data.max_seq_len=256",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "data.pack=true",
        "--set",
        &q,
        "--set",
        &ck,
        "--grid",
        "train.optimizer=adamw,adamw8bit",
    ];
    let rows = rows_within_tolerance(&name, 2, bench(&grid_77m_config(), &args));
    adamw8bit_optimizer_phase_below_adamw(&name, &rows);
}

#[test]
fn estimate_is_within_10_percent_on_the_77m_grid_dense() {
    grid_77m("none", false);
}

#[test]
fn estimate_is_within_10_percent_on_the_77m_grid_dense_checkpointing() {
    grid_77m("none", true);
}

#[test]
fn estimate_is_within_10_percent_on_the_77m_grid_nf4() {
    grid_77m("nf4", false);
}

#[test]
fn estimate_is_within_10_percent_on_the_77m_grid_nf4_checkpointing() {
    grid_77m("nf4", true);
}

/// SplitMix64: the shape draws below, reproducible from a seed without a dependency.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in lo..=hi.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.range(0, xs.len() - 1)]
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// One random decoder: family, hidden size, layers, heads, kv heads, head dim, intermediate
/// size, vocabulary, tied or not, biases or not (each family's own switches).
fn random_config(d: &mut Draw) -> serde_json::Value {
    let family = d.pick(&["llama", "qwen2", "qwen3"]);
    let head_dim = d.pick(&[32usize, 64, 128]);
    let heads = d.range(2, 12);
    let kv = d.pick(
        &(1..=heads)
            .filter(|k| heads.is_multiple_of(*k))
            .collect::<Vec<_>>(),
    );
    // Llama and Qwen2 derive head_dim from hidden / heads; Qwen3 (and Llama's explicit key)
    // may give any head_dim.
    let hidden = if family == "qwen2" {
        heads * head_dim
    } else {
        64 * d.range(4, 14)
    };
    let mut c = serde_json::json!({
        "architectures": [match family {
            "llama" => "LlamaForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "Qwen3ForCausalLM",
        }],
        "model_type": family,
        "vocab_size": 1024 * d.range(2, 48),
        "hidden_size": hidden,
        "intermediate_size": 64 * d.range(4, 48),
        "num_hidden_layers": d.range(2, 6),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": d.coin(),
        "bos_token_id": 320,
        "eos_token_id": 321,
    });
    match family {
        "llama" => {
            c["head_dim"] = head_dim.into();
            c["attention_bias"] = d.coin().into();
            c["mlp_bias"] = d.coin().into();
        }
        "qwen3" => {
            c["head_dim"] = head_dim.into();
            c["attention_bias"] = d.coin().into();
        }
        _ => {}
    }
    c
}

/// The levers of one cell, as `--set` arguments: dtype, NF4, LoRA / DoRA / full fine-tuning,
/// rank, dropout, checkpointing, optimizer, micro-batch, sequence length, packing.
fn random_levers(d: &mut Draw) -> Vec<String> {
    let nf4 = d.range(0, 2) == 0;
    let method = if nf4 {
        "lora"
    } else {
        d.pick(&["lora", "lora", "full"])
    };
    let mut s = vec![
        format!("model.dtype={}", d.pick(&["f32", "bf16"])),
        format!("model.quantize={}", if nf4 { "nf4" } else { "none" }),
        format!("train.method={method}"),
        format!("lora.rank={}", d.pick(&[8, 16, 32])),
        format!("lora.dropout={}", d.pick(&["0.0", "0.05"])),
        format!(
            "lora.kind={}",
            if d.range(0, 3) == 0 { "dora" } else { "lora" }
        ),
        format!("train.checkpointing={}", d.coin()),
        format!("train.optimizer={}", d.pick(&["adamw", "adamw8bit", "sgd"])),
        format!("train.micro_batch_size={}", d.range(1, 2)),
        format!("data.max_seq_len={}", d.pick(&[64, 128, 256])),
        format!("data.pack={}", d.coin()),
    ];
    if method == "full" {
        s.retain(|x| !x.starts_with("lora."));
    }
    s
}

/// A test that draws random decoder shapes and levers (issue: "the estimate must hold on any
/// shape, not on one grid"): for each of 8 cells, the estimate within 10% of the measured peak.
/// The draw is seeded (`TALLOW_SHAPES_SEED` picks another one; the default is fixed so CI is
/// reproducible); a failure names the cell's config.json and levers.
#[test]
fn estimate_is_within_10_percent_on_random_shapes_and_levers() {
    let seed = std::env::var("TALLOW_SHAPES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_124u64);
    let mut d = Draw(seed);
    let dir = scratch("bench-shapes");
    let mut report = String::new();
    let mut worst: f64 = 0.0;
    for k in 0..8 {
        let cfg = random_config(&mut d);
        let cfg_path = dir.join(format!("shape-{k}.json"));
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
        let model = dir.join(format!("model-{k}"));
        make_random_model(
            env!("CARGO_BIN_EXE_make-random-model"),
            &cfg_path,
            &model,
            8,
        );
        let config = dir.join(format!("shape-{k}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\npath = {:?}\n[data]\ntrain = {:?}\nshuffle = false\n[train]\n\
                 grad_accum = 1\nlr = 1e-4\nschedule = \"constant\"\ndevice = \"cpu\"\n\
                 output_dir = {:?}\n",
                model.display().to_string(),
                model.join("bench.jsonl").display().to_string(),
                dir.join(format!("run-{k}")).display().to_string()
            ),
        )
        .unwrap();
        let levers = random_levers(&mut d);
        let mut args: Vec<&str> = Vec::new();
        for l in &levers {
            args.extend(["--set", l.as_str()]);
        }
        let rows = bench(&config, &args);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert!(r["error"].is_null(), "cell {k} failed: {r}");
        let measured = r["measured_peak_bytes"].as_u64().unwrap() as f64;
        let estimated = r["estimated_peak_bytes"].as_u64().unwrap() as f64;
        let err = (estimated - measured) / measured;
        worst = worst.max(err.abs());
        report += &format!(
            "cell {k}: {} {}\n  measured {:.1} MiB, estimated {:.1} MiB ({:+.1}%)\n",
            cfg,
            levers.join(" "),
            measured / 1048576.0,
            estimated / 1048576.0,
            100.0 * err
        );
    }
    eprintln!("seed {seed}\n{report}");
    assert!(
        worst <= TOLERANCE,
        "seed {seed}: an estimate is {:.1}% off (bound {:.0}%):\n{report}",
        100.0 * worst,
        100.0 * TOLERANCE
    );
}

/// A mixture of experts (issue 40): a random 113M Qwen3-MoE (benchmarks/models/qwen3-moe-113m.json:
/// 6 sparse layers of 32 experts, 4 per token, expert width 256, hidden 512, the load-balancing
/// loss on), LoRA r16 on the attention and every expert, 2 x 512 tokens; NF4 off and on, with
/// checkpointing off and on (4 cells): each estimate within 10% of its measured peak
/// (measured: -1.0% to +0.8%). Counting a sparse layer's MLP half as a dense MLP's puts the
/// estimate 15-18% low without checkpointing (seen to fail).
#[test]
fn estimate_is_within_10_percent_on_a_moe() {
    let dir = scratch("bench-moe");
    let model = dir.join("qwen3-moe-113m");
    make_random_model(
        env!("CARGO_BIN_EXE_make-random-model"),
        &repo().join("benchmarks/models/qwen3-moe-113m.json"),
        &model,
        8,
    );
    let config = write_config(&dir, &model, "[lora]\nrank = 16\ndropout = 0.0\n");
    let args = [
        "--set",
        "data.max_seq_len=512",
        "--set",
        "train.micro_batch_size=2",
        "--grid",
        "model.quantize=none,nf4",
        "--grid",
        "train.checkpointing=false,true",
    ];
    rows_within_tolerance("MoE grid", 4, bench(&config, &args));
}
