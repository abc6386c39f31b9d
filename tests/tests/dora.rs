//! DoRA (`lora.kind = "dora"`, PEFT's `use_dora`) against PEFT 0.17.1 + transformers 4.57
//! (fixtures from `scripts/make_dora_fixtures.py`): adapters PEFT wrote load here and give
//! PEFT's loss, merged or not; one plain-SGD step from a non-zero adapter (magnitude away from
//! the weight norm) matches PEFT's update of A, B and the magnitude, also with LoRA dropout
//! (PEFT given tallow's masks, `scripts/make_dora_dropout_fixtures.py`); an adapter tallow wrote
//! loads in PEFT with the loss tallow computes; QDoRA on the bitsandbytes 4-bit checkpoint gives
//! the loss and the SGD steps PEFT computes over bitsandbytes (`scripts/make_qdora_fixtures.py`).

use std::path::Path;

use tallow_tests::load_tensors as load;
use tallow_tests::*;

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

/// The families whose DoRA adapters have a dropout fixture (`make_dora_dropout_fixtures.py`):
/// plain Llama, Qwen2's q/k/v biases, Phi-3's fused modules, Gemma 2's soft-caps.
const DROPOUT_MODELS: [&str; 4] = ["tiny-llama", "tiny-qwen2", "tiny-phi3", "tiny-gemma2"];

/// The 4-bit checkpoint of tiny-qwen2 (bitsandbytes NF4, double quant) and its QDoRA adapter.
const QDORA_MODEL: &str = "tiny-qwen2-bnb-4bit";
const QDORA_REF: &str = "peft-qdora-tiny-qwen2-bnb-4bit";

/// Losses against PEFT (f32 both sides, summation orders apart).
const LOSS_TOL: f64 = 1e-5;
/// An SGD update against PEFT's, max |ours - ref| / max |ref| per tensor.
const UPDATE_TOL: f64 = 1e-3;

/// A path the fixture scripts recorded, relative to the repository root.
fn in_repo(path: &serde_json::Value) -> std::path::PathBuf {
    fixtures().join("../..").join(path.as_str().unwrap())
}

/// Every effect in `effects` (name -> how far a broken forward moves the value) must exceed
/// `margin` times `tol`: the test can tell each break from rounding.
fn check_effects(what: &str, effects: &serde_json::Value, tol: f64, margin: f64) {
    let effects = effects.as_object().unwrap();
    assert!(!effects.is_empty(), "{what}: no effects recorded");
    for (name, e) in effects {
        let e = e.as_f64().unwrap();
        assert!(
            e > margin * tol,
            "{what}: `{name}` moves it by only {e}, not {margin} x the tolerance {tol}"
        );
    }
}

/// One SGD step (lr 0.5, no clipping, the 4 text rows in one micro-batch) of `tallow train`
/// with `lora.dropout = DROPOUT_P` and `train.seed = DROPOUT_SEED` from the adapter `init` on
/// `model`, against a `make_dora_dropout_fixtures.dropout_step` reference: first that tallow
/// still draws the masks PEFT was given (exact), then the step's loss within [`LOSS_TOL`] and
/// every adapter tensor's update within [`UPDATE_TOL`] relative. The fixture's effect sizes
/// (the loss and the update under each broken forward: the `(m/n - 1) W xd` term dropped, W x
/// rescaled instead of W xd, m/n taken as 1, dropout off) must each be 100x the tolerance.
/// `rows_of`: the fixture model whose reference holds the text rows (the tokenizer's).
fn dropout_step_matches_peft(
    what: &str,
    model: &Path,
    rows_of: &str,
    init: &Path,
    reference: &serde_json::Value,
) {
    assert_eq!(reference["p"].as_f64().unwrap(), DROPOUT_P);
    assert_eq!(reference["seed"].as_u64().unwrap(), DROPOUT_SEED);
    check_effects(what, &reference["effects"]["loss"], LOSS_TOL, 100.0);
    check_effects(what, &reference["effects"]["update"], UPDATE_TOL, 100.0);

    // The masks: the DoRA adapter's ids are the LoRA adapter's, so PEFT was given the LoRA
    // dropout fixture's masks; tallow must draw exactly those for this adapter.
    let rows = reference_rows(&reference_json(rows_of), "text");
    let t = rows.iter().map(|(ids, _)| ids.len()).max().unwrap();
    let ours = dropout_keep_masks(model, init, DROPOUT_P, DROPOUT_SEED, rows.len(), t);
    let masks = load(&in_repo(&reference["masks"]));
    assert_eq!(ours.len(), masks.len(), "{what}");
    for (k, m) in &ours {
        assert!(
            values(m) == values(&masks[k]),
            "{what} {k}: tallow's dropout mask is not the one PEFT was given; regenerate"
        );
    }

    let (dir, loss) = one_sgd_step(
        &format!("dora-dropout-{}", what.replace(' ', "-")),
        model,
        init,
        DROPOUT_P,
        Some(DROPOUT_SEED),
    );
    let want = reference["loss"].as_f64().unwrap();
    assert!(
        (loss - want).abs() < LOSS_TOL,
        "{what}: loss {loss} vs PEFT with the same masks {want} (without dropout {})",
        reference["loss_without_dropout"]
    );

    let before = load(&init.join("adapter_model.safetensors"));
    assert!(before.keys().any(|k| k.ends_with(".lora_magnitude_vector")));
    assert_updates_match(
        what,
        &before,
        &load(&dir.join("run/adapter/adapter_model.safetensors")),
        &load(&in_repo(&reference["tensors"])),
        UPDATE_TOL,
    );
}

/// DoRA with LoRA dropout, the default configuration (`lora.dropout` 0.05): PEFT computes
/// `W x + b + (m/n - 1) W xd + (m/n) s B A xd` in training, a branch the other fixtures never
/// reach. One SGD step with dropout 0.3 from the PEFT DoRA adapters (magnitudes at ±10% of the
/// norm), PEFT given tallow's masks (`scripts/make_dora_dropout_fixtures.py`): loss within 1e-5
/// (the breaks move it by 9.2e-3 .. 0.75, dropout itself by 0.041 .. 0.39), every update of A,
/// B and the magnitude within 1e-3 relative (the breaks: 1.3 .. 7.3).
#[test]
fn one_dora_sgd_step_with_dropout_matches_peft_given_the_same_masks() {
    for model in DROPOUT_MODELS {
        let reference = json_at(&fixtures(), &format!("peft-dora-dropout-{model}.json"));
        dropout_step_matches_peft(
            &format!("dora dropout {model}"),
            &model_dir(model),
            model,
            &adapter(model),
            &reference,
        );
    }
}

fn qdora_adapter() -> std::path::PathBuf {
    fixtures().join(format!("adapters/{QDORA_MODEL}-peft-dora"))
}

/// QDoRA forward: a DoRA adapter on the bitsandbytes 4-bit checkpoint, with magnitudes at
/// 0.8 .. 1.2 of ||W + s B A|| (W the NF4-dequantized weight), as PEFT 0.17.1 over bitsandbytes
/// 0.50.2 computes it (`scripts/make_qdora_fixtures.py`). tallow's eval on every format within
/// 1e-5 of PEFT's loss; taking m/n as 1 moves it by 0.018 .. 0.11, and the same adapter on the
/// unquantized model by 4.9e-3 .. 0.063, each at least 100x the tolerance.
#[test]
fn qdora_adapter_gives_peft_loss_over_bitsandbytes_nf4() {
    let reference = json_at(&fixtures(), &format!("{QDORA_REF}.json"));
    let ratio = &reference["adapter"]["magnitude_over_norm"];
    let (lo, hi) = (ratio[0].as_f64().unwrap(), ratio[1].as_f64().unwrap());
    assert!(lo < 0.85 && hi > 1.15, "m / ||W + s B A|| in [{lo}, {hi}]");
    for format in FORMATS {
        let f = &reference["adapter"]["formats"][format];
        let want = f["loss"].as_f64().unwrap();
        for effect in ["loss_no_magnitude", "loss_unquantized"] {
            let moved = (f[effect].as_f64().unwrap() - want).abs();
            assert!(
                moved > 100.0 * LOSS_TOL,
                "{format}: {effect} moves it by {moved}"
            );
        }
        let got = eval_fixture(&model_dir(QDORA_MODEL), Some(&qdora_adapter()), format);
        assert!(
            (got - want).abs() < LOSS_TOL,
            "qdora {format}: {got} vs PEFT {want} (m/n = 1: {}, unquantized: {})",
            f["loss_no_magnitude"],
            f["loss_unquantized"]
        );
    }
}

/// QDoRA gradients: one SGD step (no dropout) of A, B and the magnitude from the QDoRA adapter
/// on the 4-bit checkpoint matches PEFT's over bitsandbytes (loss 1e-5, updates 1e-3 relative);
/// taking m/n as 1 moves the update by 1.5, the unquantized base by 1.2.
#[test]
fn one_qdora_sgd_step_matches_peft() {
    let reference = json_at(&fixtures(), &format!("{QDORA_REF}.json"));
    check_effects(
        "qdora",
        &reference["sgd"]["effects"]["update"],
        UPDATE_TOL,
        100.0,
    );
    sgd_step_matches_reference(
        "qdora",
        &fixtures(),
        QDORA_MODEL,
        &qdora_adapter(),
        QDORA_REF,
    );
}

/// QDoRA with dropout 0.3 (the second base matmul, W xd, on the NF4 weight), PEFT over
/// bitsandbytes given tallow's masks: loss within 1e-5 (the breaks move it by 1.2e-3 .. 0.011),
/// updates within 1e-3 relative (the breaks: 1.8 .. 3.2).
#[test]
fn one_qdora_sgd_step_with_dropout_matches_peft() {
    let reference = json_at(&fixtures(), &format!("{QDORA_REF}.json"));
    dropout_step_matches_peft(
        "qdora dropout",
        &model_dir(QDORA_MODEL),
        "tiny-qwen2",
        &qdora_adapter(),
        &reference["dropout_sgd"],
    );
}
