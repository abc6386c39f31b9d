//! `config.json` as transformers 4.57 and 5.x write it: every key of each family's transformers
//! config class is read or known to be harmless (`tallow_model::hf_keys`), a full config of each
//! class with its defaults loads, and a key that would change the maths and is not implemented
//! is refused by name. The key sets are `tests/fixtures/reference/config-keys.json`, made by
//! `scripts/make_config_key_fixtures.py` under each transformers version.

use std::path::Path;

use serde_json::{json, Value};
use tallow_model::families::key_policy;
use tallow_model::hf_keys::{key_use, KeyUse};
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

#[test]
fn every_key_of_each_transformers_config_class_is_read_or_listed() {
    let sets = key_sets();
    let versions: Vec<&String> = sets.as_object().unwrap().keys().collect();
    assert!(
        versions.iter().any(|v| v.starts_with("4."))
            && versions.iter().any(|v| v.starts_with("5.")),
        "key sets of both transformers majors: {versions:?}"
    );
    let mut unknown = Vec::new();
    for (version, classes) in sets.as_object().unwrap() {
        assert_eq!(
            classes.as_object().unwrap().len(),
            tallow_model::families::FAMILIES.len(),
            "{version}: one class per family"
        );
        for (class, entry) in classes.as_object().unwrap() {
            for key in entry["keys"].as_object().unwrap().keys() {
                if use_of(class, key) == KeyUse::Unknown {
                    unknown.push(format!("{version} {class}.{key}"));
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "keys neither read nor listed: {unknown:?}"
    );
}

/// The config each class writes with all its defaults (every generic key included) loads, and
/// reads the defaults' rope theta; the same config plus a key of another family is refused with
/// the key and the file named.
#[test]
fn a_full_default_config_loads_and_an_unknown_math_key_is_refused() {
    let sets = key_sets();
    for (version, classes) in sets.as_object().unwrap() {
        for (class, entry) in classes.as_object().unwrap() {
            let mut cfg = entry["keys"].clone();
            cfg["architectures"] = json!([class]);
            let path = Path::new("defaults/config.json");
            let c = DecoderConfig::from_json_str(&cfg.to_string(), path)
                .unwrap_or_else(|e| panic!("{version} {class}: {e}"));
            assert_eq!(c.arch.hf_class(), class);
            assert!(c.rope_theta > 0.0);

            // Gemma 2 and 3 read the soft-caps and query_pre_attn_scalar; they refuse values
            // they do not implement instead
            let gemma2 = class.starts_with("Gemma");
            let others = [
                ("attn_logit_softcapping", json!(50.0)),
                ("final_logit_softcapping", json!(30.0)),
                ("query_pre_attn_scalar", json!(256)),
            ];
            let gemma_refused = [
                ("use_bidirectional_attention", json!(true)),
                ("hidden_activation", json!("gelu")),
                ("attn_logit_softcapping", json!(0.0)),
            ];
            let own: &[(&str, serde_json::Value)] = if gemma2 { &gemma_refused } else { &others };
            for (key, value) in own
                .iter()
                .cloned()
                .chain([("partial_rotary_factor", json!(0.5))])
            {
                if use_of(class, key) == KeyUse::Read {
                    continue; // Phi-3 reads `partial_rotary_factor` (config.rs tests)
                }
                let mut bad = cfg.clone();
                bad[key] = value;
                let e = DecoderConfig::from_json_str(&bad.to_string(), path)
                    .err()
                    .unwrap_or_else(|| panic!("{version} {class}: `{key}` was accepted"))
                    .to_string();
                assert!(
                    e.contains("defaults/config.json") && e.contains(&format!("`{key}`")),
                    "{version} {class}: {e}"
                );
            }
        }
    }
}
