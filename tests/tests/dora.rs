//! DoRA (`lora.kind = "dora"`, PEFT's `use_dora`) against PEFT 0.17.1 + transformers 4.57
//! (fixtures from `scripts/make_dora_fixtures.py`): adapters PEFT wrote load here and give
//! PEFT's loss, merged or not; one plain-SGD step from a non-zero adapter (magnitude away from
//! the weight norm) matches PEFT's update of A, B and the magnitude; an adapter tallow wrote
//! loads in PEFT with the loss tallow computes; NF4 (QDoRA) equals DoRA on the dequantized
//! weights.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use tallow_tests::*;

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn adapter(model: &str) -> std::path::PathBuf {
    fixtures().join(format!("adapters/{model}-peft-dora"))
}

/// Tolerance 1e-4 absolute on losses of ~6 (f32, different summation orders; tallow's weight
/// norm is expanded as ||W||² + 2 s W·BA + s² ||BA||², PEFT's is the norm of the summed weight:
/// ~1e-7 relative apart). What it catches: the norm not detached or taken over the wrong axis,
/// the magnitude ignored or loaded from the wrong key, each of which moves these losses by more
/// than 1e-2 (the magnitudes are ||W + s B A|| (1 ± 0.1)). Both config layouts: PEFT 0.17 +
/// transformers 4.57, and PEFT 0.21 + transformers 5 on the 5.x layout models.
#[test]
fn dora_adapters_written_by_peft_give_peft_loss() {
    for (layout, root) in layouts() {
        for model in MODELS {
            let reference = json_at(&root, &format!("peft-dora-{model}.json"));
            for format in model_formats(model) {
                let want = reference["adapter"]["formats"][format]["loss"]
                    .as_f64()
                    .unwrap();
                let got = eval_fixture(
                    &root.join("models").join(model),
                    Some(&adapter(model)),
                    format,
                );
                assert!(
                    (got - want).abs() < 1e-4,
                    "{layout} {model} {format}: {got} vs PEFT {want}"
                );
            }
        }
    }
}

/// `tallow merge` of a DoRA adapter writes W' = m (W + s B A) / ||W + s B A||: its eval equals
/// PEFT's `merge_and_unload` loss within 1e-4.
#[test]
fn merged_dora_gives_peft_merged_loss() {
    for model in MODELS {
        let out = scratch(&format!("dora-merge-{model}"));
        let merged = out.join("merged");
        let r = tallow([
            "merge",
            "--model",
            model_dir(model).to_str().unwrap(),
            "--adapter",
            adapter(model).to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
            "--dtype",
            "f32",
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let reference = json_at(&fixtures(), &format!("peft-dora-{model}.json"));
        for format in model_formats(model) {
            let want = reference["adapter"]["formats"][format]["merged_loss"]
                .as_f64()
                .unwrap();
            let got = eval_fixture(&merged, None, format);
            assert!(
                (got - want).abs() < 1e-4,
                "{model} {format}: merged {got} vs PEFT {want}"
            );
        }
    }
}

/// One SGD step (lr 0.5, no clipping, the 4 text rows in one micro-batch) from the PEFT DoRA
/// adapter: the update of A, B and the magnitude of every module within 1e-3 relative of
/// PEFT's (max |ours - ref| / max |ref| over after - before), the step's loss within 1e-5.
/// A norm that is not treated as a constant in backward changes the magnitude's and B's
/// gradients by far more than 1e-3. Both config layouts (PEFT 0.17 and 0.21).
#[test]
fn one_dora_sgd_step_matches_peft() {
    for (layout, root) in layouts() {
        for model in MODELS {
            one_dora_sgd_step(layout, &root, model);
        }
    }
}

fn one_dora_sgd_step(layout: &str, root: &Path, model: &str) {
    let what = format!("dora {layout} {model}");
    let init = adapter(model);
    let before = load(&init.join("adapter_model.safetensors"));
    assert!(before.keys().any(|k| k.ends_with(".lora_magnitude_vector")));
    let out = sgd_step_matches_reference(&what, root, model, &init, &format!("peft-dora-{model}"));
    let cfg = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
    assert!(cfg.contains("\"use_dora\": true"), "{cfg}");
}

/// `tests/fixtures/adapters/tiny-qwen2-tallow-dora` was written by `tallow train` (DoRA, three
/// target modules, 20 steps) and loaded by PEFT (`make_dora_fixtures.py --check-adapter`), which
/// checked every tensor landed in a parameter and recorded its losses: tallow's eval of the same
/// adapter agrees within 1e-4.
#[test]
fn dora_adapter_written_by_tallow_gives_the_loss_peft_computed() {
    let reference = json_at(&fixtures(), "tallow-dora-adapter-tiny-qwen2.json");
    let adapter = fixtures().join("adapters/tiny-qwen2-tallow-dora");
    for format in FORMATS {
        let want = reference["formats"][format]["loss"].as_f64().unwrap();
        let got = eval_fixture(&model_dir("tiny-qwen2"), Some(&adapter), format);
        assert!(
            (got - want).abs() < 1e-4,
            "{format}: tallow {got} vs PEFT {want}"
        );
    }
}
