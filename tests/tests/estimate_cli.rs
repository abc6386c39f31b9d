//! `tallow estimate` (breakdown, JSON, `--budget` plans), out of memory during `tallow train`
//! (with `--memory-limit`, the CPU stand-in for a smaller GPU: name the phase, print the
//! breakdown and a plan, keep the last checkpoint), and `tallow bench`'s output formats and
//! plot. The 10% accuracy grid is in `bench_cli.rs`.

use std::path::{Path, PathBuf};

use tallow_tests::*;

/// A random 4-layer Llama (hidden 512, ~14M parameters) with long text rows.
fn small_model(dir: &Path) -> PathBuf {
    small_model_with(dir, "small", &[])
}

/// [`small_model`] into `dir/name`, with more of `make-random-model`'s flags.
fn small_model_with(dir: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let cfg = dir.join("config-small.json");
    std::fs::write(
        &cfg,
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
            "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": true, "bos_token_id": 320, "eos_token_id": 321,
            "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    let model = dir.join(name);
    make_random_model_with(
        env!("CARGO_BIN_EXE_make-random-model"),
        &cfg,
        &model,
        8,
        flags,
    );
    model
}

/// A model dir with nothing but the 105M Llama's config.json: no weights, no tokenizer.
fn only_config(dir: &Path) -> PathBuf {
    let model = dir.join("only-config");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/models/llama-105m.json"),
        model.join("config.json"),
    )
    .unwrap();
    model
}

fn rewrite(path: &Path, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(from));
    std::fs::write(path, text.replace(from, to)).unwrap();
    path.to_path_buf()
}

fn estimate_json(config: &Path, extra: &[&str]) -> serde_json::Value {
    let mut a = vec![
        "estimate".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--json".into(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    let r = tallow(&a);
    assert_eq!(r.code, 0, "tallow {a:?}: {}", r.stderr);
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.stdout))
}

fn total(v: &serde_json::Value) -> u64 {
    v["total_bytes"].as_u64().expect("total_bytes")
}

#[test]
fn estimate_reads_only_config_json_and_its_components_sum_to_the_total() {
    let dir = scratch("estimate-json");
    let model = only_config(&dir);
    let config = write_config(&dir, &model, "");
    let v = estimate_json(&config, &[]);
    let comps = v["components"].as_object().expect("components object");
    for name in [
        "frozen_weights",
        "trainable_params",
        "gradients",
        "optimizer_state",
        "activations",
        "logits_loss",
        "workspace",
        "overhead",
    ] {
        assert!(comps.contains_key(name), "no component {name}: {v}");
    }
    let sum: u64 = comps.values().map(|b| b.as_u64().unwrap()).sum();
    assert_eq!(sum, total(&v), "components must add up to the total");
    // 105M parameters in bf16 (the 8 layers' linears + tied embedding + norms).
    let frozen = comps["frozen_weights"].as_u64().unwrap();
    assert_eq!(
        frozen,
        2 * (8 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) + 2048 * 1024 + 1024)
    );

    // Each lever moves its own component the way it claims.
    let nf4 = estimate_json(&config, &["--set", "model.quantize=nf4"]);
    let nf4_frozen = nf4["components"]["frozen_weights"].as_u64().unwrap();
    assert!(
        (nf4_frozen as f64) < 0.30 * frozen as f64,
        "NF4 base {nf4_frozen} vs bf16 {frozen}"
    );
    let ckpt = estimate_json(&config, &["--set", "train.checkpointing=true"]);
    assert!(
        ckpt["components"]["activations"].as_u64().unwrap()
            < v["components"]["activations"].as_u64().unwrap() / 4
    );
    let full = estimate_json(&config, &["--set", "train.method=full"]);
    let full8 = estimate_json(
        &config,
        &[
            "--set",
            "train.method=full",
            "--set",
            "train.optimizer=adamw8bit",
        ],
    );
    let state = |v: &serde_json::Value| v["components"]["optimizer_state"].as_u64().unwrap();
    assert!(
        state(&full8) * 10 < state(&full) * 3,
        "adamw8bit < 30% of adamw"
    );
    // Activations grow with micro-batch x sequence: linearly with chunked attention (the
    // default), and with eager's scores as T^2.
    let long = estimate_json(&config, &["--set", "data.max_seq_len=256"]);
    let a = |v: &serde_json::Value| v["activation_bytes_per_layer"].as_u64().unwrap();
    assert_eq!(a(&long), 2 * a(&v));
    let eager = |t: &str| estimate_json(&config, &["--set", t, "--set", "model.attention=eager"]);
    assert!(a(&eager("data.max_seq_len=256")) > 2 * a(&eager("data.max_seq_len=128")));
    let mb2 = estimate_json(&config, &["--set", "train.micro_batch_size=2"]);
    assert_eq!(a(&mb2), 2 * a(&v));

    // The table: every component with bytes and a share.
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--budget",
        "24GiB",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "frozen_weights",
        "activations",
        "optimizer_state",
        "%",
        "total",
        "fits",
    ] {
        assert!(r.stdout.contains(want), "no `{want}` in:\n{}", r.stdout);
    }
}

#[test]
fn estimate_refuses_bad_budgets_and_missing_configs() {
    let dir = scratch("estimate-bad");
    let model = dir.join("only-config");
    std::fs::create_dir_all(&model).unwrap();
    let config = write_config(&dir, &model, "");
    let r = tallow(["estimate", "--config", config.to_str().unwrap()]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("config.json"), "{}", r.stderr);
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../benchmarks/models/llama-105m.json"),
        model.join("config.json"),
    )
    .unwrap();
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--budget",
        "12XB",
    ]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("--budget") && r.stderr.contains("XB"),
        "{}",
        r.stderr
    );
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--set",
        "train.micro_batch=2",
    ]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("micro_batch"), "{}", r.stderr);
}

#[test]
fn a_budget_that_fits_gives_the_largest_micro_batch_that_fits() {
    let dir = scratch("estimate-largest");
    let model = only_config(&dir);
    let config = write_config(&dir, &model, "");
    let v = estimate_json(&config, &["--budget", "2GiB"]);
    let plan = &v["plan"];
    assert_eq!(plan["fits"], true, "{plan}");
    let mb = plan["largest_micro_batch"].as_u64().unwrap();
    assert!(mb >= 1);
    let at = |mb: u64| {
        total(&estimate_json(
            &config,
            &["--set", &format!("train.micro_batch_size={mb}")],
        ))
    };
    assert!(at(mb) <= 2 << 30, "micro-batch {mb} does not fit");
    assert!(at(mb + 1) > 2 << 30, "micro-batch {} fits too", mb + 1);

    // The longest max_seq_len that fits, in the JSON and in the text.
    let n = plan["longest_max_seq_len"].as_u64().unwrap();
    let len = |n: u64| {
        total(&estimate_json(
            &config,
            &["--set", &format!("data.max_seq_len={n}")],
        ))
    };
    assert!(len(n) <= 2 << 30, "{n} tokens do not fit");
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--budget",
        "2GiB",
    ]);
    let want = format!("The longest data.max_seq_len that fits is {n} tokens.");
    assert!(r.stdout.contains(&want), "{}", r.stdout);
}

/// The trainable tensors' element counts as `tallow train` hands them to its optimizer (and to
/// the gradient all-reduce): the loaded model's `named_params` for a full fine-tune, the
/// attached adapters' `lora_vars` for LoRA.
fn loaded_trainable_sizes(model: &Path, config: &Path, full: bool) -> Vec<usize> {
    use candle_core::{DType, Device};
    use tallow_model::{attach_lora, lora_vars, LoadOptions};
    let opts = LoadOptions {
        train_base: full,
        ..LoadOptions::frozen(DType::F32, &Device::Cpu)
    };
    let (mut m, _) = tallow_model::load(model, &opts, None).unwrap();
    if full {
        return m
            .named_params()
            .into_iter()
            .filter_map(|(_, p)| p.var().map(|v| v.elem_count()))
            .collect();
    }
    let cfg = tallow_trainer::config::TrainConfig::load(config, &[]).unwrap();
    attach_lora(&mut m, &cfg.lora.spec(), 0).unwrap();
    lora_vars(&m).iter().map(|(_, v)| v.elem_count()).collect()
}

/// `--nproc N`: the estimate is one rank's. Without train.shard_optimizer every rank keeps all
/// the state, and only the optimizer phase changes: the gradient all-reduce's two f32 buckets
/// (DDP's 25 MiB, here computed from the loaded model's tensors), or the update's temporaries
/// after it, whichever is larger. With it, the optimizer state is the share `tallow_data_parallel::owners`
/// gives the rank the estimate names (the largest share), over the same tensors. With N = 1 no
/// rank field and no all-reduce line.
#[test]
fn per_rank_estimate_all_reduce_and_sharded_optimizer_state() {
    let dir = scratch("estimate-ranks");
    let model = small_model(&dir);
    let config = write_config(&dir, &model, "");
    for full in [false, true] {
        let method: &[&str] = if full {
            &["--set", "train.method=full"]
        } else {
            &[]
        };
        let sizes = loaded_trainable_sizes(&model, &config, full);
        let params: usize = sizes.iter().sum();
        let one = estimate_json(&config, method);
        assert!(one.get("ranks").is_none(), "{one}");
        assert!(one["components"].get("all_reduce").is_none(), "{one}");
        let state = |v: &serde_json::Value| v["components"]["optimizer_state"].as_u64().unwrap();
        assert_eq!(
            state(&one),
            8 * params as u64,
            "adamw: 8 bytes per parameter"
        );

        // The all-reduce: consecutive tensors in buckets of up to 25 MiB of f32.
        let cap = (25 << 20) / 4;
        let (mut largest, mut bucket) = (0usize, 0usize);
        for &n in &sizes {
            if bucket > 0 && bucket + n > cap {
                bucket = 0;
            }
            bucket += n;
            largest = largest.max(bucket);
        }
        let all_reduce = 2 * 4 * largest as u64;
        // adamw's temporaries (`kernels::adamw`'s two ops, moments in place): on the CPU each
        // tensor is a group of its own; an f32 one (LoRA's) needs only its new values (4 bytes
        // per element), a bf16 one (this model's, trained in full) its f32 copy, the new
        // values and their bf16 rounding (10)
        let per_elem = if full { 10 } else { 4 };
        let update = per_elem * *sizes.iter().max().unwrap() as u64;
        let two = estimate_json(&config, &[method, &["--nproc", "2"]].concat());
        assert_eq!(
            two["ranks"]["all_reduce_bytes"], all_reduce,
            "{}",
            two["ranks"]
        );
        assert_eq!(
            state(&two),
            state(&one),
            "not sharded: all the state on every rank"
        );
        for phase in ["load", "forward", "backward"] {
            assert_eq!(two["phases"][phase], one["phases"][phase], "{phase}");
        }
        let opt = |v: &serde_json::Value| v["phases"]["optimizer"].as_u64().unwrap();
        assert_eq!(
            opt(&two),
            opt(&one) - update + update.max(all_reduce),
            "full {full}: all-reduce {all_reduce}, update {update}"
        );
        if !full {
            assert!(
                all_reduce > update,
                "LoRA: the all-reduce is the high point"
            );
            assert!(opt(&two) > opt(&one));
        }

        for world in [2usize, 4] {
            let v = estimate_json(
                &config,
                &[
                    method,
                    &[
                        "--nproc",
                        &world.to_string(),
                        "--set",
                        "train.shard_optimizer=true",
                    ],
                ]
                .concat(),
            );
            let r = &v["ranks"];
            let owner = tallow_data_parallel::owners(&sizes, world);
            let mut share = vec![0u64; world];
            for (i, &n) in sizes.iter().enumerate() {
                share[owner[i]] += 8 * n as u64;
            }
            let rank = r["rank"].as_u64().unwrap() as usize;
            assert_eq!(state(&v), share[rank], "full {full}, {world} ranks: {r}");
            assert_eq!(share[rank], *share.iter().max().unwrap(), "{share:?}");
            assert_eq!(r["state_bytes"], share[rank]);
            assert_eq!(r["unsharded_state_bytes"], 8 * params as u64);
            assert!(state(&v) < state(&one) * 2 / world as u64 + 1, "{share:?}");
        }
    }

    // The table says it is per rank, and whose share.
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--nproc",
        "4",
        "--set",
        "train.shard_optimizer=true",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in ["per rank, 4 ranks", "all_reduce", "rank 0's share"] {
        assert!(r.stdout.contains(want), "no `{want}` in:\n{}", r.stdout);
    }
    let r = tallow([
        "estimate",
        "--config",
        config.to_str().unwrap(),
        "--nproc",
        "0",
    ]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

/// A full fine-tune with AdamW on a budget its steady state does not fit: step 1 fits (its
/// checkpoint is written), step 2 (optimizer state now allocated) runs out. The error names the
/// phase and prints the breakdown and a plan; the checkpoint is kept; resuming with the plan's
/// changes under the same limit finishes, with every measured peak under the budget.
#[test]
fn out_of_memory_names_the_phase_keeps_the_checkpoint_and_the_plan_fits_when_run() {
    let dir = scratch("estimate-oom");
    let model = small_model(&dir);
    let config = write_config(
        &dir,
        &model,
        "method = \"full\"\noptimizer = \"adamw\"\nmax_steps = 3\nsave_every = 1\n",
    );
    // Long rows: activations (what checkpointing saves) well above the estimate's error.
    let config = rewrite(&config, "max_seq_len = 128", "max_seq_len = 512");
    let plain = total(&estimate_json(&config, &[]));
    let ckpt = total(&estimate_json(
        &config,
        &["--set", "train.checkpointing=true"],
    ));
    assert!(ckpt < plain, "checkpointing must lower the estimate");
    let budget = ckpt + (plain - ckpt) / 2;

    // The plan for that budget.
    let v = estimate_json(&config, &["--budget", &budget.to_string()]);
    let plan = &v["plan"];
    assert_eq!(plan["fits"], false, "{plan}");
    assert_eq!(plan["possible"], true, "{plan}");
    let sets: Vec<String> = plan["sets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert!(
        sets.contains(&"train.checkpointing=true".to_string()),
        "{plan}"
    );
    let steps = plan["steps"].as_array().unwrap();
    assert!(steps.last().unwrap()["peak_bytes"].as_u64().unwrap() <= budget);

    // Without the plan: out of memory in step 2, the step-1 checkpoint kept.
    let limit = budget.to_string();
    let r = tallow([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--quiet",
        "--memory-limit",
        &limit,
    ]);
    assert_eq!(r.code, 1, "must fail: {}", r.stderr);
    assert!(r.stderr.contains("out of memory in the"), "{}", r.stderr);
    assert!(r.stderr.contains("phase of step 2"), "{}", r.stderr);
    assert!(
        r.stderr.contains("step-1"),
        "names the kept checkpoint: {}",
        r.stderr
    );
    assert!(r.stderr.contains("activations") && r.stderr.contains("Smallest set of changes"));
    assert!(
        r.stderr.contains("--set train.checkpointing=true"),
        "{}",
        r.stderr
    );
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"oom\""), "{metrics}");
    assert!(dir.join("run/checkpoints/step-1").is_dir());

    // With the plan: resumes from the kept checkpoint and finishes under the limit.
    let mut a = vec![
        "train".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--quiet".into(),
        "--resume".into(),
        "--memory-limit".into(),
        limit.clone(),
    ];
    for s in &sets {
        a.push("--set".into());
        a.push(s.clone());
    }
    let r = tallow(&a);
    assert_eq!(r.code, 0, "the plan must fit: {}", r.stderr);
    assert!(r.stderr.contains("resumed from"), "{}", r.stderr);
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let mut checked = 0;
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(p) = v.get("peak_bytes") {
            if v["step"].as_u64().unwrap() >= 2 {
                for phase in ["forward", "backward", "optimizer"] {
                    assert!(p[phase].as_u64().unwrap() <= budget, "{phase} over: {line}");
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2, "steps 2 and 3 measured: {metrics}");
}

#[test]
fn bench_formats_plot_and_an_out_of_memory_cell() {
    let dir = scratch("bench-formats");
    let model = small_model(&dir);
    // A warmup longer than the bench's steps: the cells run without it.
    let config = write_config(&dir, &model, "warmup_steps = 10\n");
    let config = rewrite(&config, "max_seq_len = 128", "max_seq_len = 256");
    let base = [
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--steps",
        "2",
        "--grid",
        "train.checkpointing=false,true",
    ];
    // JSON, with a memory limit between the two cells' estimates: the plain cell runs out and
    // is reported, the checkpointed one runs.
    let plain = total(&estimate_json(&config, &[]));
    let ckpt = total(&estimate_json(
        &config,
        &["--set", "train.checkpointing=true"],
    ));
    let limit = (ckpt + (plain - ckpt) / 2).to_string();
    let plot = dir.join("bench.svg");
    let (csv, md, json) = (dir.join("b.csv"), dir.join("b.md"), dir.join("b.json"));
    let mut a: Vec<&str> = base.to_vec();
    a.extend([
        "--json",
        "--memory-limit",
        &limit,
        "--plot",
        plot.to_str().unwrap(),
        "--export-csv",
        csv.to_str().unwrap(),
        "--export-markdown",
        md.to_str().unwrap(),
        "--export-json",
        json.to_str().unwrap(),
    ]);
    let r = tallow(&a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        std::fs::read_to_string(&json).unwrap(),
        r.stdout,
        "--export-json"
    );
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["config"]["train.checkpointing"], "false");
    assert_eq!(rows[0]["oom"], true, "{}", rows[0]);
    assert!(
        rows[0]["phases"][rows[0]["oom_phase"].as_str().unwrap()]
            .as_u64()
            .unwrap()
            > limit.parse::<u64>().unwrap()
    );
    assert_eq!(rows[1]["oom"], false, "{}", rows[1]);
    assert!(rows[1]["measured_peak_bytes"].as_u64().unwrap() <= limit.parse::<u64>().unwrap());

    // The plot: well-formed SVG with a bar per measured value and a label per cell.
    let svg = std::fs::read_to_string(&plot).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the plot is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert!(root.attribute("width").is_some() && root.attribute("viewBox").is_some());
    let bars = root
        .descendants()
        .filter(|n| n.attribute("class") == Some("bar"))
        .count();
    // measured: 2 cells (the OOM cell's peak is its measured overrun), estimated: 2,
    // tokens/s: 1 (the OOM cell has none).
    assert_eq!(bars, 5, "{svg}");
    let labels: Vec<String> = root
        .descendants()
        .filter(|n| n.attribute("class") == Some("label"))
        .map(|n| {
            n.descendants()
                .filter(|t| t.is_text())
                .filter_map(|t| t.text())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    assert_eq!(labels, ["checkpointing=false", "checkpointing=true"]);
    assert!(svg.contains(">OOM<"));

    // CSV and Markdown, exported by the same run (its cells are the expensive part).
    let csv = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(
        lines[0].starts_with("train.checkpointing,load_bytes,"),
        "{}",
        lines[0]
    );
    let header: Vec<&str> = lines[0].split(',').collect();
    for l in &lines[1..] {
        assert_eq!(l.split(',').count(), header.len(), "{l}");
    }
    let md = std::fs::read_to_string(&md).unwrap();
    let table: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
    assert_eq!(table.len(), 4, "{md}");
    assert!(
        table[2].starts_with("| checkpointing=false |"),
        "{}",
        table[2]
    );

    // Bad grids.
    let r = tallow([
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--grid",
        "lora.rank",
    ]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("SECTION.KEY=V1,V2"), "{}", r.stderr);
    let r = tallow([
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--grid",
        "lora.rnk=8,16",
    ]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("rnk"), "{}", r.stderr);
}

/// A DPO plan with the reference computed live suggests `preference.precompute_ref` as a speed
/// change at the same memory (never as a memory lever: benchmarks/preference.md measured the
/// same peak); with the cache on, or for a supervised run, there is no such line. Break: the
/// hint printed for every method -> the supervised run shows it.
#[test]
fn a_live_reference_dpo_plan_suggests_precompute_ref_for_speed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dpo = root.join("configs/quickstart-dpo.toml");
    let sup = root.join("configs/quickstart.toml");
    // The configs name their model relative to the repository root.
    let run_as = |cfg: &Path, sets: &[&str], json: bool| {
        let mut cmd = std::process::Command::new(tallow_bin());
        cmd.current_dir(&root).args([
            "estimate",
            "--config",
            cfg.to_str().unwrap(),
            "--budget",
            "8GiB",
        ]);
        if json {
            cmd.arg("--json");
        }
        for s in sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let run = |cfg: &Path, sets: &[&str]| run_as(cfg, sets, false);
    let hint = "Faster at the same memory: --set preference.precompute_ref=true";
    let live = run(&dpo, &["preference.precompute_ref=false"]);
    assert!(live.contains(hint), "{live}");
    let cached = run(&dpo, &["preference.precompute_ref=true"]);
    assert!(!cached.contains(hint), "{cached}");
    let supervised = run(&sup, &[]);
    assert!(!supervised.contains(hint), "{supervised}");
    // The JSON plan carries it too.
    let json = run_as(&dpo, &["preference.precompute_ref=false"], true);
    assert!(
        json.contains("\"speed\": \"Faster at the same memory"),
        "{json}"
    );
}

/// A pre-quantized bitsandbytes 4-bit checkpoint (`quantization_config` with `load_in_4bit`;
/// `make-random-model --bnb-4bit`, the layout of the real bitsandbytes fixture
/// `tiny-qwen2-bnb-4bit`, which is too small to measure): `tallow train` loads its decoder
/// linears as NF4 whatever `model.quantize` says, so the estimate counts them so: the same as
/// the dense twin quantized at load, and within 10% of the peak `tallow bench` measures. Before
/// the estimate read `quantization_config`, it counted them in bf16 (frozen weights 3.2x, the
/// peak +25.6%: this test's failure with the estimate's reading of it removed).
#[test]
fn a_bnb_4bit_checkpoint_is_estimated_as_it_loads_within_10_percent() {
    let dir = scratch("estimate-bnb");
    let bnb = small_model_with(&dir, "bnb", &["--bnb-4bit", "true"]);
    let dense = small_model_with(&dir, "dense", &[]);
    let config = |model: &Path, name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        rewrite(
            &write_config(&d, model, ""),
            "max_seq_len = 128",
            "max_seq_len = 256",
        )
    };
    let (bnb_cfg, dense_cfg) = (config(&bnb, "run-bnb"), config(&dense, "run-dense"));
    let frozen = |v: &serde_json::Value| v["components"]["frozen_weights"].as_u64().unwrap();
    let as_stored = estimate_json(&bnb_cfg, &[]);
    let quantized = estimate_json(&dense_cfg, &["--set", "model.quantize=nf4"]);
    let dense_bf16 = estimate_json(&dense_cfg, &[]);
    assert_eq!(frozen(&as_stored), frozen(&quantized));
    assert_eq!(total(&as_stored), total(&quantized));
    assert!(frozen(&as_stored) * 2 < frozen(&dense_bf16));
    let (measured, estimated) = bench_peaks(tallow(bench_args(&bnb_cfg)));
    assert_eq!(estimated as u64, total(&as_stored));
    assert_within_10_percent("bnb-4bit", measured, estimated);
}

/// `tallow bench` of `config`: two steps, JSON rows.
fn bench_args(config: &Path) -> [&str; 6] {
    let config = config.to_str().unwrap();
    ["bench", "--config", config, "--steps", "2", "--json"]
}

/// The first cell of a `tallow bench --json` run: (measured, estimated) peak bytes.
fn bench_peaks(r: Run) -> (f64, f64) {
    assert_eq!(r.code, 0, "{}", r.stderr);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&r.stdout).unwrap();
    let bytes = |k: &str| rows[0][k].as_u64().unwrap() as f64;
    (bytes("measured_peak_bytes"), bytes("estimated_peak_bytes"))
}

/// The estimate within 10% of the measured peak (both printed).
fn assert_within_10_percent(what: &str, measured: f64, estimated: f64) {
    let err = (estimated - measured) / measured;
    eprintln!(
        "{what}: measured {:.1} MiB, estimated {:.1} MiB ({:+.1}%)",
        measured / 1048576.0,
        estimated / 1048576.0,
        100.0 * err
    );
    assert!(
        err.abs() <= 0.10,
        "estimate {:+.1}% off the measured peak",
        100.0 * err
    );
}

/// Long context on the command line (issue 38): `--set data.max_seq_len=100000 --budget 24GiB`
/// for Llama-3.1-8B QLoRA r32 on CUDA gives the plan that reaches it (offloading the
/// checkpointed inputs, with the pinned host memory it takes) and the longest length with it;
/// a config that fits names the length the long-context levers reach; `--json` states the host
/// memory of an offloading config.
#[test]
fn a_long_context_budget_gives_the_plan_the_length_and_the_host_memory() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let config = root.join("configs/llama-3.1-8b/qlora.toml");
    let model = root.join("benchmarks/models/llama-3.1-8b-instruct.json");
    let base = [
        "estimate".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--set".into(),
        format!("model.path={}", model.display()),
        "--set".into(),
        "train.device=cuda".into(),
        "--set".into(),
        "lora.rank=32".into(),
    ];
    let run = |extra: &[&str]| {
        let r = tallow(base.iter().map(String::as_str).chain(extra.iter().copied()));
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.stdout
    };
    // The number after `prefix` in `text`, digits only.
    let number_after = |text: &str, prefix: &str| -> usize {
        let at = text
            .find(prefix)
            .unwrap_or_else(|| panic!("no `{prefix}` in:\n{text}"));
        let digits: String = text[at + prefix.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    let far = run(&["--set", "data.max_seq_len=100000", "--budget", "24GiB"]);
    assert!(far.contains("does not fit"), "{far}");
    assert!(
        far.contains("checkpointed inputs offloaded to host memory (")
            && far.contains("GiB pinned)")
            && far.contains("train.offload_checkpoints=true"),
        "{far}"
    );
    let with = number_after(
        &far,
        "With these changes, the longest data.max_seq_len that fits is ",
    );
    let without = number_after(
        &far,
        "Without these changes, the longest data.max_seq_len that fits is ",
    );
    assert!(with >= 100_000 && without < 100_000, "{far}");
    // The config as it is (1024 tokens) fits; offloading reaches the same length.
    let fits = run(&["--budget", "24GiB"]);
    assert_eq!(
        number_after(&fits, "With train.offload_checkpoints=true it is "),
        with,
        "{fits}"
    );
    assert!(
        fits.contains("of pinned host memory for the offloaded inputs"),
        "{fits}"
    );
    let r = tallow(base.iter().map(String::as_str).chain([
        "--set",
        "train.offload_checkpoints=true",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    // 32 layers x 1024 tokens x 4096 x 2 bytes (bf16)
    assert_eq!(v["host_bytes"].as_u64(), Some(32 * 1024 * 4096 * 2), "{v}");
    let text = run(&["--set", "train.offload_checkpoints=true"]);
    assert!(
        text.contains("host memory: 256.00 MiB of pinned RAM"),
        "{text}"
    );
}

/// LoRA over a Q4_K GGUF kept in its blocks (`model.quantize = "keep"`, issue 39): the
/// estimate counts the decoder linears as the file stores them (Q4_K, and Q8_0 for the down
/// projections, whose 1408-value rows are not whole 256-value blocks) and is within 10% of the
/// peak `tallow bench` measures. The same file dequantized into bf16 holds over twice the
/// frozen bytes, and a `--budget` between the two plans `model.quantize=keep` (before that lever
/// existed the plan said `nf4`: this test's failure). (Measured here: 57.1 MiB, estimated
/// 58.8 MiB, +2.8%. With `stored_blocks` left unread the estimate counts the kept blocks as
/// bf16: 73.6 MiB, +29%, and the frozen bytes' check fails, as seen.)
#[test]
fn a_gguf_kept_in_its_blocks_is_estimated_within_10_percent() {
    let dir = scratch("estimate-gguf-keep");
    let env = [("TALLOW_CACHE_DIR", dir.join("cache").display().to_string())];
    let dense = small_model_with(&dir, "dense", &[]);
    let f32_file = dir.join("f32.gguf");
    let r = tallow_env(
        [
            "export",
            "--model",
            dense.to_str().unwrap(),
            "--out",
            f32_file.to_str().unwrap(),
            "--outtype",
            "f32",
        ],
        &env,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let file = dir.join("q4_k.gguf");
    requantize_linears(&f32_file, &file);
    let run = dir.join("run-keep");
    std::fs::create_dir_all(&run).unwrap();
    let config = write_config(&run, &dense, "");
    let config = rewrite(
        &config,
        &format!("path = {:?}", dense.display().to_string()),
        &format!(
            "path = {:?}\nquantize = \"keep\"",
            file.display().to_string()
        ),
    );
    let config = rewrite(&config, "max_seq_len = 128", "max_seq_len = 256");
    let estimate = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["estimate", "--config", config.to_str().unwrap(), "--json"];
        args.extend(extra);
        let r = tallow_env(&args, &env);
        assert_eq!(r.code, 0, "{}", r.stderr);
        serde_json::from_str(&r.stdout).unwrap()
    };
    let frozen = |v: &serde_json::Value| v["components"]["frozen_weights"].as_u64().unwrap();
    let kept = estimate(&[]);
    let dequantized = estimate(&["--set", "model.quantize=none"]);
    assert!(frozen(&kept) * 2 < frozen(&dequantized));
    // With the other levers on, a budget between the two: the plan keeps the file's blocks
    // (not NF4, which would quantize the dequantized blocks again).
    let others = [
        "--set",
        "train.checkpointing=true",
        "--set",
        "train.checkpoint_every=1",
        "--set",
        "train.optimizer=adamw8bit",
    ];
    let with = |extra: &[&str]| estimate(&[&others[..], extra].concat());
    let (k, d) = (
        with(&["--set", "model.quantize=keep"]),
        with(&["--set", "model.quantize=none"]),
    );
    let budget = format!("{}B", (total(&k) + total(&d)) / 2);
    let planned = with(&["--set", "model.quantize=none", "--budget", &budget]);
    let sets: Vec<&str> = planned["plan"]["sets"]
        .as_array()
        .unwrap_or_else(|| panic!("{planned}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(sets, ["model.quantize=keep"], "{planned}");
    let (measured, estimated) = bench_peaks(tallow_env(bench_args(&config), &env));
    assert_eq!(estimated as u64, total(&kept));
    eprintln!(
        "gguf dequantized: estimated {:.1} MiB",
        total(&dequantized) as f64 / 1048576.0
    );
    assert_within_10_percent("gguf keep", measured, estimated);
}
