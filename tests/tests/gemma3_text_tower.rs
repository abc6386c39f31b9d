//! The text tower of an image-text Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`):
//! `tests/fixtures/models/tiny-gemma3-mm` (saved by transformers 4.57, weights under the Hub's
//! `language_model.model.*`) and `v5/models/tiny-gemma3-mm` (saved by transformers 5, `text_config`
//! with `rope_parameters`, weights renamed to the module names `model.language_model.*`), both
//! with tiny-gemma3 as their language model and a tiny SigLIP vision tower
//! (`scripts/make_gemma3_mm_fixtures.py`). tallow reads the tower only; an adapter PEFT made on
//! the image-text model loads, and the one tallow writes has PEFT's names; a merge writes a
//! text-only Gemma3ForCausalLM.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use tallow_model::{load_peft, merge_lora, save_hf_model, save_peft, CausalLM, LoadOptions};
use tallow_tests::*;

/// Mean next-token NLL (the model has no final-logit soft-cap).
fn loss(model: &CausalLM, rows: &[(Vec<u32>, Vec<bool>)]) -> f64 {
    let (total, count) = nll_and_count(model, rows);
    total / count as f64
}

fn load(dir: &std::path::Path) -> CausalLM {
    CausalLM::load(dir, &LoadOptions::frozen(DType::F32, &Device::Cpu)).unwrap()
}

/// Both layouts: the tower's logits are tiny-gemma3's transformers logits (1e-4), its loss and
/// the PEFT adapter's loss are what transformers / PEFT computed on the image-text model (1e-4;
/// the adapter moves the loss by 0.05 .. 0.33); no vision tensor is read.
#[test]
fn the_text_tower_of_an_image_text_checkpoint_matches_transformers() {
    let text_ref = reference_json("tiny-gemma3");
    let logits = reference_tensors("tiny-gemma3");
    for (layout, root) in layouts() {
        let dir = root.join("models/tiny-gemma3-mm");
        let reference = json_at(&root, "tiny-gemma3-mm.json");
        let mut model = load(&dir);
        assert!(model.config.text_tower, "{layout}");
        assert_eq!(model.config.arch.hf_class(), "Gemma3ForCausalLM");
        // every text tensor, nothing else
        assert_eq!(
            model.named_params().len(),
            1 + 6 * (7 + 6) + 1,
            "{layout}: embeddings, 7 linears and 6 norms per layer, the final norm (tied head)"
        );
        for (k, (ids, _)) in reference_rows(&text_ref, "text").iter().enumerate() {
            let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let ours = model.logits(&input).unwrap().squeeze(0).unwrap();
            let diff = max_abs_diff(&ours, &logits[&format!("text.{k}.logits")]);
            assert!(diff < 1e-4, "{layout} text row {k}: logits off by {diff}");
        }
        for format in model_formats("tiny-gemma3") {
            let rows = reference_rows(&text_ref, format);
            let want = reference["formats"][format]["loss"].as_f64().unwrap();
            let got = loss(&model, &rows);
            assert!(
                (got - want).abs() < 1e-4,
                "{layout} {format}: {got} vs {want}"
            );
        }
        let adapter = fixtures().join("adapters/tiny-gemma3-mm-peft");
        let spec = load_peft(&mut model, &adapter).unwrap();
        for format in model_formats("tiny-gemma3") {
            let rows = reference_rows(&text_ref, format);
            let want = reference["peft"][format]["loss"].as_f64().unwrap();
            let base = reference["formats"][format]["loss"].as_f64().unwrap();
            let got = loss(&model, &rows);
            assert!(
                (got - want).abs() < 1e-4,
                "{layout} {format}: adapter {got} vs PEFT {want} (base {base})"
            );
        }

        // tallow writes PEFT's names and PEFT's regex target back
        let out = scratch(&format!("gemma3-mm-adapter-{}", layout.replace(' ', "-")));
        save_peft(&model, &spec, &out, "tiny-gemma3-mm").unwrap();
        let read = |d: &std::path::Path| -> HashMap<String, Tensor> {
            candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap()
        };
        let (theirs, ours) = (read(&adapter), read(&out));
        assert_eq!(theirs.len(), ours.len());
        for (k, t) in &theirs {
            assert!(
                k.starts_with("base_model.model.model.language_model.layers."),
                "{k}"
            );
            assert_eq!(max_abs_diff(t, &ours[k]), 0.0, "{k}");
        }
        let cfg = |d: &std::path::Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap())
                .unwrap()
        };
        assert_eq!(cfg(&out)["target_modules"], cfg(&adapter)["target_modules"]);

        // a merge is a text-only Gemma3ForCausalLM with the adapter's loss
        let rows = reference_rows(&text_ref, "text");
        let adapted = loss(&model, &rows);
        merge_lora(&mut model).unwrap();
        let merged = scratch(&format!("gemma3-mm-merged-{}", layout.replace(' ', "-")));
        save_hf_model(&model, &dir, &merged, DType::F32).unwrap();
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            cfg["architectures"],
            serde_json::json!(["Gemma3ForCausalLM"])
        );
        assert_eq!(cfg["model_type"], "gemma3_text");
        let back = load(&merged);
        assert!(!back.config.text_tower);
        let got = loss(&back, &rows);
        assert!(
            (got - adapted).abs() < 1e-5,
            "{layout}: merged {got} vs {adapted}"
        );
    }
}
