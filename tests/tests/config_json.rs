//! `config.json` as transformers 4.57 and 5.x write it and read it. For each family's class,
//! `tests/fixtures/reference/config-keys.json` (made by `scripts/make_config_key_fixtures.py`
//! under each transformers version) holds every key its config class carries (`keys`) and every
//! name transformers reads from the config while it builds, trains and runs the model
//! (`reads`). The rule of `tallow_model::config::hf_keys`, checked here against those sets: every name
//! transformers reads is read by tallow, known not to change the output, or accepted with some
//! values only; any other key is ignored (as transformers ignores it) and named in the note.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};
use tallow_model::config::hf_keys::{key_use, KeyUse};
use tallow_model::families::key_policy;
use tallow_model::{Arch, DecoderConfig};
use tallow_tests::*;

fn key_sets() -> Value {
    let p = fixtures().join("reference/config-keys.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn use_of(class: &str, key: &str) -> KeyUse {
    let arch = Arch::from_hf(Some(class), None).unwrap_or_else(|| panic!("no family for {class}"));
    key_use(&key_policy(arch), key)
}

/// What transformers reads from a config of `class`, in either version.
fn reads_of(sets: &Value, class: &str) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for classes in sets.as_object().unwrap().values() {
        let entry = &classes[class];
        for k in entry["keys"].as_object().unwrap().keys() {
            all.insert(k.clone());
        }
        for k in entry["reads"].as_array().unwrap() {
            all.insert(k.as_str().unwrap().to_string());
        }
    }
    all
}

#[test]
fn every_key_transformers_reads_is_read_listed_or_refused() {
    let sets = key_sets();
    let versions: Vec<&String> = sets.as_object().unwrap().keys().collect();
    assert!(
        versions.iter().any(|v| v.starts_with("4."))
            && versions.iter().any(|v| v.starts_with("5.")),
        "key sets of both transformers majors: {versions:?}"
    );
    let mut unread = Vec::new();
    for (version, classes) in sets.as_object().unwrap() {
        assert_eq!(
            classes.as_object().unwrap().len(),
            tallow_model::families::FAMILIES.len(),
            "{version}: one class per family"
        );
        for (class, entry) in classes.as_object().unwrap() {
            let reads = entry["reads"].as_array().unwrap();
            // the traced reads include what the model's code reads beyond the config class
            assert!(reads.len() > 30, "{version} {class}: {} reads", reads.len());
            let keys = entry["keys"].as_object().unwrap().keys().cloned();
            for key in keys.chain(reads.iter().map(|k| k.as_str().unwrap().to_string())) {
                if use_of(class, &key) == KeyUse::Unread {
                    unread.push(format!("{version} {class}.{key}"));
                }
            }
        }
    }
    assert!(
        unread.is_empty(),
        "keys transformers reads that tallow would ignore unseen: {unread:?}"
    );
}

/// The config each class writes with all its defaults (every generic key included) loads,
/// with nothing to note, and reads the defaults' rope theta. The same config plus a key its
/// class never reads (another family's soft-cap, nanotron's flag) loads, the key named in the
/// note; plus a key it reads with a value tallow lacks, it is refused with the key, its value
/// and the file named.
#[test]
fn a_full_default_config_loads_unread_keys_are_noted_and_read_ones_refused() {
    let sets = key_sets();
    for (version, classes) in sets.as_object().unwrap() {
        for (class, entry) in classes.as_object().unwrap() {
            let reads = reads_of(&sets, class);
            let mut cfg = entry["keys"].clone();
            cfg["architectures"] = json!([class]);
            let path = Path::new("defaults/config.json");
            let c = DecoderConfig::from_json_str(&cfg.to_string(), path)
                .unwrap_or_else(|e| panic!("{version} {class}: {e}"));
            assert_eq!(c.arch.hf_class(), class);
            assert!(c.rope_theta > 0.0);
            assert_eq!(c.keys.line(), None, "{version} {class}");

            let foreign = [
                ("attn_logit_softcapping", json!(50.0)),
                ("final_logit_softcapping", json!(30.0)),
                ("query_pre_attn_scalar", json!(256)),
                ("is_llama_config", json!(true)),
                ("rope_interleaved", json!(false)),
                ("use_mrope", json!(false)),
            ];
            for (key, value) in foreign {
                if reads.contains(key) {
                    continue; // Gemma reads the soft-caps (config.rs tests)
                }
                let mut with = cfg.clone();
                with[key] = value;
                let c = DecoderConfig::from_json_str(&with.to_string(), path)
                    .unwrap_or_else(|e| panic!("{version} {class} + {key}: {e}"));
                assert_eq!(c.keys.unread, [key], "{version} {class}");
                let note = c.keys.line().unwrap();
                assert!(note.contains(key) && note.contains(class), "{note}");
            }

            let refused = [
                ("partial_rotary_factor", json!(0.3)),
                ("is_causal", json!(false)),
                ("attention_chunk_size", json!(8192)),
                ("use_bidirectional_attention", json!(true)),
                ("hidden_activation", json!("gelu")),
                ("attn_logit_softcapping", json!(0.0)),
                ("attention_dropout", json!(0.1)),
            ];
            for (key, value) in refused {
                // Phi-3 implements partial rotary (config.rs tests)
                if !reads.contains(key)
                    || use_of(class, key) == KeyUse::Read && key.starts_with("partial")
                {
                    continue;
                }
                let mut bad = cfg.clone();
                bad[key] = value.clone();
                let e = DecoderConfig::from_json_str(&bad.to_string(), path)
                    .err()
                    .unwrap_or_else(|| panic!("{version} {class}: `{key}` = {value} was accepted"))
                    .to_string();
                assert!(
                    e.contains("defaults/config.json") && e.contains(&format!("`{key}` = {value}")),
                    "{version} {class}: {e}"
                );
            }
        }
    }
}
