//! Compatibility with PEFT 0.17.1 + transformers 4.57 (fixtures from
//! `scripts/make_peft_fixtures.py`) and PEFT 0.21 + transformers 5 on the models in the
//! transformers 5 config layout (`scripts/make_v5_fixtures.py`):
//! adapters PEFT wrote load here and give PEFT's loss; one plain-SGD step from a non-zero adapter
//! matches PEFT + torch; an adapter tallow wrote loads in PEFT with the same loss as here.

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
                for format in model_formats(model) {
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
    let init = fixtures().join(format!("adapters/{model}-peft"));
    sgd_step_matches_reference(
        &format!("{layout} {model}"),
        root,
        model,
        &init,
        &format!("peft-{model}"),
    );
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
