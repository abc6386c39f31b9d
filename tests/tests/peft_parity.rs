//! Compatibility with PEFT 0.17.1 + transformers 4.57 (fixtures from
//! `scripts/make_peft_fixtures.py`) and PEFT 0.21 + transformers 5 on the models in the
//! transformers 5 config layout (`scripts/make_v5_fixtures.py`):
//! adapters PEFT wrote load here and give PEFT's loss; one plain-SGD step from a non-zero adapter
//! matches PEFT + torch; an adapter tallow wrote loads in PEFT with the same loss as here.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use tallow_tests::*;

/// Tolerance: 1e-4 absolute on losses of ~6 (f32, different summation orders). Both config
/// layouts: PEFT 0.17 + transformers 4.57 and PEFT 0.21 + transformers 5 (adapter "peft" only).
#[test]
fn adapters_written_by_peft_give_peft_loss() {
    for (layout, root) in layouts() {
        for model in MODELS {
            let reference = json_at(&root, &format!("peft-{model}.json"));
            for kind in ["peft", "peft-rslora"] {
                if reference["adapters"].get(kind).is_none() {
                    continue;
                }
                let adapter = fixtures().join(format!("adapters/{model}-{kind}"));
                for format in FORMATS {
                    let want = reference["adapters"][kind]["formats"][format]["loss"]
                        .as_f64()
                        .unwrap();
                    let got =
                        eval_fixture(&root.join("models").join(model), Some(&adapter), format);
                    assert!(
                        (got - want).abs() < 1e-4,
                        "{layout} {model} {kind} {format}: {got} vs PEFT {want}"
                    );
                }
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
    for (layout, root) in layouts() {
        for model in MODELS {
            one_sgd_step(layout, &root, model);
        }
    }
}

fn one_sgd_step(layout: &str, root: &std::path::Path, model: &str) {
    let dir = scratch(&format!("sgd-{model}-{}", layout.replace(' ', "-")));
    let init = fixtures().join(format!("adapters/{model}-peft"));
    let cfg = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\ninit = \"{}\"\ndropout = 0.0\n[data]\ntrain = \"{}\"\nmax_seq_len = 32\nshuffle = false\n\
         [train]\noptimizer = \"sgd\"\nlr = 0.5\nschedule = \"constant\"\nmax_grad_norm = 0.0\nmax_steps = 1\nmicro_batch_size = 4\ngrad_accum = 1\noutput_dir = \"{}\"\n",
        root.join("models").join(model).display(),
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

    let reference = json_at(root, &format!("peft-{model}.json"));
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let step: serde_json::Value =
        serde_json::from_str(metrics.lines().find(|l| l.contains("\"loss\"")).unwrap()).unwrap();
    let want = reference["sgd"]["sgd_loss_before"].as_f64().unwrap();
    assert!(
        (step["loss"].as_f64().unwrap() - want).abs() < 1e-5,
        "{layout} {model}: loss {} vs {want}",
        step["loss"]
    );

    let before = load(&init.join("adapter_model.safetensors"));
    let ours = load(&dir.join("run/adapter/adapter_model.safetensors"));
    let refs = load(&root.join(format!("reference/peft-{model}-sgd.safetensors")));
    assert_eq!(ours.len(), before.len());
    for (name, b) in &before {
        let du = (&ours[name] - b).unwrap();
        let dr = (&refs[&format!("after.{name}")] - b).unwrap();
        let rel = max_abs_diff(&du, &dr) / max_abs(&dr).max(1e-12);
        assert!(
            rel < 1e-3,
            "{layout} {model} {name}: update differs by {rel} (relative)"
        );
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
        let got = eval_fixture(&model_dir("tiny-qwen2"), Some(&adapter), format);
        assert!(
            (got - want).abs() < 1e-4,
            "{format}: tallow {got} vs PEFT {want}"
        );
    }
}
