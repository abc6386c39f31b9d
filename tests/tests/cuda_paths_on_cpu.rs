//! The two development switches for the CUDA path without a GPU (docs/cuda.md, "Status";
//! docs/memory.md, "Finding what holds the peak"): `TALLOW_CUDA_PATHS_ON_CPU=1` has CPU tensors
//! take CUDA's tensor-op paths, and `TALLOW_TRACE_PEAK=1` has `tallow train` end with the
//! tensors alive at its highest mark.

use std::path::{Path, PathBuf};

use tallow_tests::*;

/// A one-layer Llama at toy widths whose 1024-token rows make the attention's f32 blocks
/// (4 heads x 1024 x 1024 x 4 bytes = 16 MiB) the largest tensors of the step.
fn model(dir: &Path) -> PathBuf {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "bos_token_id": 320, "eos_token_id": 321, "tie_word_embeddings": false,
        "torch_dtype": "float32"
    });
    let json = dir.join("config-in.json");
    std::fs::write(&json, config.to_string()).unwrap();
    let out = dir.join("model");
    make_random_model_with(
        env!("CARGO_BIN_EXE_make-random-model"),
        &json,
        &out,
        2,
        &["--row-words", "1000"],
    );
    out
}

/// One training step, traced, with or without the CUDA paths: (loss, stderr).
fn traced_step(dir: &Path, model: &Path, cuda_paths: bool) -> (f64, String) {
    let out = dir.join(if cuda_paths {
        "run-cuda-paths"
    } else {
        "run-cpu"
    });
    let config = dir.join("job.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {:?}\ndtype = \"f32\"\n[lora]\nrank = 4\nalpha = 8\n\
             [data]\ntrain = {:?}\nmax_seq_len = 1024\nshuffle = false\n\
             [train]\nmax_steps = 1\ndevice = \"cpu\"\nlr = 1e-3\n",
            model.display().to_string(),
            model.join("bench.jsonl").display().to_string()
        ),
    )
    .unwrap();
    let mut env = vec![("TALLOW_TRACE_PEAK", "1".to_string())];
    if cuda_paths {
        env.push(("TALLOW_CUDA_PATHS_ON_CPU", "1".to_string()));
    }
    let set = format!("train.output_dir={:?}", out.display().to_string());
    let run = tallow_env(
        [
            "train",
            "--config",
            config.to_str().unwrap(),
            "--set",
            &set,
            "--quiet",
        ],
        &env,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let loss = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|v| v["loss"].as_f64())
        .expect("a logged loss");
    (loss, run.stderr)
}

/// Under `TALLOW_CUDA_PATHS_ON_CPU` the attention's backward is the tensor-op one CUDA runs
/// (`generic_bwd` in the trace's peak), without it the CPU kernel's (`cpu_bwd`, never
/// `generic_bwd`), and both give the same loss within 1e-5 relative (f32; measured ~1e-7; a
/// change of any op's maths moves it far more). The trace names its peak in MiB and the
/// allocation sites. Ignoring the switch in `dispatch::Backend::of` fails the first check; a
/// tracer that records nothing fails the "peak trace" one.
#[test]
fn cuda_paths_on_cpu_take_the_tensor_op_attention_and_the_trace_shows_it() {
    let dir = scratch("cuda-paths-on-cpu");
    let model = model(&dir);
    let (cpu_loss, cpu_err) = traced_step(&dir, &model, false);
    let (cuda_loss, cuda_err) = traced_step(&dir, &model, true);
    for err in [&cpu_err, &cuda_err] {
        assert!(
            err.contains("peak trace: ") && err.contains(" MiB live at the highest mark"),
            "{err}"
        );
    }
    let trace = |err: &str| -> String { err[err.find("peak trace: ").unwrap()..].to_string() };
    assert!(
        trace(&cuda_err).contains("generic_bwd@model/src/kernels/chunked.rs"),
        "the CUDA paths' peak is not in the tensor-op attention backward:\n{}",
        trace(&cuda_err)
    );
    assert!(
        !trace(&cpu_err).contains("generic_bwd@"),
        "the CPU run took the tensor-op attention:\n{}",
        trace(&cpu_err)
    );
    let rel = (cpu_loss - cuda_loss).abs() / cpu_loss.abs();
    assert!(
        rel < 1e-5,
        "loss {cpu_loss} (CPU) vs {cuda_loss} (CUDA paths): {rel:e}"
    );
}

/// `tallow doctor` on the CPU under `TALLOW_CUDA_PATHS_ON_CPU=1`, f32 and bf16: every op the
/// CUDA path takes runs through the CPU twins of tallow's CUDA kernels (RMSNorm in both
/// forms, rotary, SwiGLU, GeGLU against f64; the LM head's cross-entropy device ops, `kernels::cross_entropy::ce_rows`
/// / `ce_grad_rows`, against the textbook full-logits formula), and every check passes; the
/// loss's is held to 1e-4 in f32 (measured 8.9e-8). Dropping the label's -g from the gradient
/// twin fails the loss checks by 3.3 (f32 and bf16); without the switch the loss check runs the
/// host path instead, so this is the test that reaches the device ops' twins.
#[test]
fn doctor_passes_on_the_cuda_paths_twins() {
    let r = tallow_env(
        ["doctor", "--device", "cpu", "--dtype", "f32,bf16", "--json"],
        &[("TALLOW_CUDA_PATHS_ON_CPU", "1".into())],
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let report: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    let checks = report["checks"].as_array().unwrap();
    let failed: Vec<_> = checks.iter().filter(|c| c["ok"] != true).collect();
    assert!(failed.is_empty(), "{failed:?}");
    for name in [
        "rmsnorm",
        "gemma rmsnorm",
        "rope",
        "swiglu",
        "geglu",
        "fused loss",
    ] {
        for dt in ["f32", "bf16"] {
            assert!(
                checks.iter().any(|c| c["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(name) && n.ends_with(dt))),
                "no {name} {dt} check: {checks:?}"
            );
        }
    }
}
