//! Models tallow writes (`tallow merge`, full fine-tuning's `model/`) load in transformers 4.57
//! and 5.x with the same loss, whichever layout the source `config.json` had.
//!
//! `scripts/make_saved_model_fixtures.py` ran these same commands, loaded each output in both
//! transformers versions and recorded `config.json` as tallow wrote it and each version's loss
//! per format (`tests/fixtures/reference/saved-models.json`). Here tallow runs them again: it
//! must write the same `config.json` (the one both versions were seen to read right; it carries
//! the rotary settings in both layouts), and its eval of the output must give the losses
//! transformers computed, within 1e-4 (f32; what a wrong rope theta moves is 1e-3 .. 1e-1).
//!
//! Among them, the merge of an image-text Gemma 3 (`tiny-gemma3-mm`, Gemma3ForConditionalGeneration,
//! with its PEFT adapter) is a text-only Gemma3ForCausalLM: both transformers versions load it,
//! and the loss they computed is the one PEFT computed with the adapter on the image-text model
//! (`<root>/reference/tiny-gemma3-mm.json`'s `peft`), within 1e-4 (the adapter moves the loss by
//! 0.05 .. 0.33; a merge in f32 moves it by ~2e-6).

use std::path::Path;

use tallow_tests::*;

/// Kept in step with `FULL_CONFIG` of scripts/make_saved_model_fixtures.py.
fn full_config(model: &Path, out: &Path) -> String {
    format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[data]\ntrain = \"{}\"\nmax_seq_len = 32\nshuffle = false\n\
         [train]\nmethod = \"full\"\noptimizer = \"sgd\"\nlr = 0.05\nschedule = \"constant\"\nmax_grad_norm = 0.0\n\
         max_steps = 2\nmicro_batch_size = 2\ngrad_accum = 1\noutput_dir = \"{}\"\n",
        model.display(),
        data_file("text").display(),
        out.display()
    )
}

#[test]
fn merged_and_full_fine_tuned_models_give_the_loss_both_transformers_versions_compute() {
    let reference = json_at(&fixtures(), "saved-models.json");
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for name in ["merge-v4-tiny-gemma3-mm", "merge-v5-tiny-gemma3-mm"] {
        assert!(cases.iter().any(|c| c["name"] == name), "no case {name}");
    }
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let model = case["model"].as_str().unwrap();
        let layout = case["layout"].as_str().unwrap();
        let root = if layout.is_empty() {
            fixtures()
        } else {
            fixtures().join(layout)
        };
        let mdir = root.join("models").join(model);
        let dir = scratch(&format!("saved-{name}"));
        let saved = match case["kind"].as_str().unwrap() {
            "merge" => {
                let adapter = fixtures().join(format!("adapters/{model}-peft"));
                let out = dir.join("merged");
                let r = tallow([
                    "merge",
                    "--model",
                    mdir.to_str().unwrap(),
                    "--adapter",
                    adapter.to_str().unwrap(),
                    "--out",
                    out.to_str().unwrap(),
                ]);
                assert_eq!(r.code, 0, "{name}: {}", r.stderr);
                out
            }
            "full" => {
                let cfg = dir.join("full.toml");
                std::fs::write(&cfg, full_config(&mdir, &dir.join("run"))).unwrap();
                let r = tallow(["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
                assert_eq!(r.code, 0, "{name}: {}", r.stderr);
                dir.join("run/model")
            }
            other => panic!("kind {other}"),
        };
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            written, case["config"],
            "{name}: config.json differs from the one transformers 4.57 and 5 were seen to read"
        );
        // The image-text model's merge: transformers computed the adapter's loss (PEFT's).
        let adapter_loss = (model == "tiny-gemma3-mm")
            .then(|| json_at(&root, &format!("{model}.json"))["peft"].clone());
        for format in model_formats(model) {
            if let Some(peft) = &adapter_loss {
                let want = peft[format]["loss"].as_f64().unwrap();
                for (version, losses) in case["losses"].as_object().unwrap() {
                    let got = losses[format].as_f64().unwrap();
                    assert!(
                        (got - want).abs() < 1e-4,
                        "{name} {format}: transformers {version} {got} vs PEFT {want}"
                    );
                }
            }
            let got = eval_fixture(&saved, None, format);
            for (version, losses) in case["losses"].as_object().unwrap() {
                let want = losses[format].as_f64().unwrap();
                assert!(
                    (got - want).abs() < 1e-4,
                    "{name} {format}: tallow {got} vs transformers {version} {want}"
                );
            }
        }
    }
}
