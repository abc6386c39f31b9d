//! Compatibility with PEFT 0.17.1 (fixtures from `scripts/make_peft_fixtures.py`):
//! adapters PEFT wrote load here and give PEFT's loss; one plain-SGD step from a non-zero adapter
//! matches PEFT + torch; an adapter tallow wrote loads in PEFT with the same loss as here.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use tallow_tests::*;

/// Tolerance: 1e-4 absolute on losses of ~6 (f32, different summation orders).
#[test]
fn adapters_written_by_peft_give_peft_loss() {
    for model in MODELS {
        let reference = serde_json::from_str::<serde_json::Value>(
            &std::fs::read_to_string(fixtures().join(format!("reference/peft-{model}.json")))
                .unwrap(),
        )
        .unwrap();
        for kind in ["peft", "peft-rslora"] {
            let adapter = fixtures().join(format!("adapters/{model}-{kind}"));
            for format in FORMATS {
                let want = reference["adapters"][kind]["formats"][format]["loss"]
                    .as_f64()
                    .unwrap();
                let got = eval_loss(&[
                    "eval",
                    "--model",
                    model_dir(model).to_str().unwrap(),
                    "--adapter",
                    adapter.to_str().unwrap(),
                    "--data",
                    data_file(format).to_str().unwrap(),
                    "--max-seq-len",
                    "32",
                    "--dtype",
                    "f32",
                    "--json",
                ]);
                assert!(
                    (got - want).abs() < 1e-4,
                    "{model} {kind} {format}: {got} vs PEFT {want}"
                );
            }
        }
    }
}

fn load(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// One SGD step (lr 0.5, no clipping, all 4 text rows in one micro-batch) from the PEFT adapter:
/// the update of every adapter tensor within 1e-3 relative of PEFT's (max |ours - ref| / max |ref|
/// over the update after - before), and the step's loss within 1e-5 of PEFT's.
#[test]
fn one_sgd_step_matches_peft() {
    for model in MODELS {
        let dir = scratch(&format!("sgd-{model}"));
        let init = fixtures().join(format!("adapters/{model}-peft"));
        let cfg = format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\ninit = \"{}\"\ndropout = 0.0\n[data]\ntrain = \"{}\"\nmax_seq_len = 32\nshuffle = false\n\
             [train]\noptimizer = \"sgd\"\nlr = 0.5\nschedule = \"constant\"\nmax_grad_norm = 0.0\nmax_steps = 1\nmicro_batch_size = 4\ngrad_accum = 1\noutput_dir = \"{}\"\n",
            model_dir(model).display(),
            init.display(),
            data_file("text").display(),
            dir.join("run").display()
        );
        std::fs::write(dir.join("sgd.toml"), cfg).unwrap();
        let r = tallow([
            "train",
            "--config",
            dir.join("sgd.toml").to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);

        let reference = serde_json::from_str::<serde_json::Value>(
            &std::fs::read_to_string(fixtures().join(format!("reference/peft-{model}.json")))
                .unwrap(),
        )
        .unwrap();
        let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
        let step: serde_json::Value =
            serde_json::from_str(metrics.lines().find(|l| l.contains("\"loss\"")).unwrap())
                .unwrap();
        let want = reference["sgd"]["sgd_loss_before"].as_f64().unwrap();
        assert!(
            (step["loss"].as_f64().unwrap() - want).abs() < 1e-5,
            "{model}: loss {} vs {want}",
            step["loss"]
        );

        let before = load(&init.join("adapter_model.safetensors"));
        let ours = load(&dir.join("run/adapter/adapter_model.safetensors"));
        let refs = load(&fixtures().join(format!("reference/peft-{model}-sgd.safetensors")));
        assert_eq!(ours.len(), before.len());
        for (name, b) in &before {
            let du = (&ours[name] - b).unwrap();
            let dr = (&refs[&format!("after.{name}")] - b).unwrap();
            let rel = max_abs_diff(&du, &dr) / max_abs(&dr).max(1e-12);
            assert!(
                rel < 1e-3,
                "{model} {name}: update differs by {rel} (relative)"
            );
        }
    }
}

/// `tests/fixtures/adapters/tiny-qwen2-tallow` was written by `tallow train` (rsLoRA, three target
/// modules) and loaded by PEFT (`make_peft_fixtures.py --check-adapter`), which recorded its
/// losses: tallow's eval of the same adapter must agree within 1e-4.
#[test]
fn adapter_written_by_tallow_gives_the_loss_peft_computed() {
    let reference = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(fixtures().join("reference/tallow-adapter-tiny-qwen2.json"))
            .unwrap(),
    )
    .unwrap();
    let adapter = fixtures().join("adapters/tiny-qwen2-tallow");
    for format in FORMATS {
        let want = reference["formats"][format]["loss"].as_f64().unwrap();
        let got = eval_loss(&[
            "eval",
            "--model",
            model_dir("tiny-qwen2").to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--data",
            data_file(format).to_str().unwrap(),
            "--max-seq-len",
            "32",
            "--dtype",
            "f32",
            "--json",
        ]);
        assert!(
            (got - want).abs() < 1e-4,
            "{format}: tallow {got} vs PEFT {want}"
        );
    }
}
