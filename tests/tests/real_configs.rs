//! The `config.json` files of real checkpoints people fine-tune, as their Hub repos publish them
//! (`tests/fixtures/real-configs/`, each file's source in its `SOURCES.md`):
//! - every file of a family tallow implements loads (layout, parameter count, `tallow
//!   estimate`), except the two whose quantization tallow lacks (GPTQ, FP8), refused by name;
//! - the keys their transformers class never reads are ignored and named in the note, and a
//!   tiny random model with each file's real key set (`tiny/`, made by
//!   `scripts/make_real_config_fixtures.py`) gives transformers 4.57's and 5.x's logits and
//!   loss, from the file as published and as transformers 5 saves it again: ignoring those
//!   keys is harmless on the key sets real repos carry, not only on hand-made ones;
//! - a real file with a feature tallow lacks (Qwen2.5's YaRN, as its model card tells users to
//!   add) is refused with every offending key named in one message;
//! - a pre-quantized bitsandbytes 4-bit repo (unsloth's) is estimated as the NF4 it loads as.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use tallow_model::{lm_head_nll, CausalLM, DecoderConfig, LoadOptions, Targets};
use tallow_tests::*;

/// Logits and loss against transformers, f32: the bound of the other parity tests (the
/// differences seen are ~1e-6; a wrong rope, window or scale moves logits by ~1e-2 and more).
const TOLERANCE: f64 = 1e-4;

/// Files tallow refuses, and the key each one is refused for.
const REFUSED: &[(&str, &str)] = &[
    // GPTQ int4 weights: tallow reads bitsandbytes 4-bit only
    (
        "Qwen--Qwen1.5-32B-Chat-GPTQ-Int4.json",
        "quantization_config",
    ),
    // FBGEMM fp8 weights
    (
        "meta-llama--Llama-3.1-405B-Instruct-FP8.json",
        "quantization_config",
    ),
];

fn corpus_dir() -> PathBuf {
    fixtures().join("real-configs")
}

fn corpus() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().to_string()
}

fn load(path: &Path) -> Result<DecoderConfig, String> {
    let text = std::fs::read_to_string(path).unwrap();
    DecoderConfig::from_json_str(&text, path).map_err(|e| e.to_string())
}

/// The parameter count a repo's name gives ("Qwen2.5-0.5B" -> 0.5e9, "SmolLM2-135M" ->
/// 135e6), if any.
fn size_in_name(file: &str) -> Option<f64> {
    let repo = file.split("--").nth(1)?.trim_end_matches(".json");
    repo.split(['-', '_']).find_map(|part| {
        let lower = part.to_ascii_lowercase();
        let (num, scale) = if let Some(n) = lower.strip_suffix('b') {
            (n, 1e9)
        } else if let Some(n) = lower.strip_suffix('m') {
            (n, 1e6)
        } else {
            return None;
        };
        num.parse::<f64>().ok().map(|x| x * scale)
    })
}

/// What transformers reads from a config of `class` (either version): the fixture of
/// `tests/config_json.rs`.
fn transformers_reads(class: &str) -> Vec<String> {
    let p = fixtures().join("reference/config-keys.json");
    let sets: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let mut all = Vec::new();
    for classes in sets.as_object().unwrap().values() {
        let e = &classes[class];
        all.extend(e["keys"].as_object().unwrap().keys().cloned());
        all.extend(
            e["reads"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap().to_string()),
        );
    }
    all
}

#[test]
fn the_corpus_holds_forty_real_files_with_their_sources() {
    let files = corpus();
    assert!(files.len() >= 40, "{} files", files.len());
    let sources = std::fs::read_to_string(corpus_dir().join("SOURCES.md")).unwrap();
    for f in &files {
        let n = name(f);
        assert!(
            sources.contains(&format!("`{n}`")),
            "SOURCES.md has no line for {n}"
        );
    }
}

/// Every file loads (or is one of [`REFUSED`], refused for its key), with a parameter count
/// near the one its repo's name gives; the note names exactly the keys the class never reads.
#[test]
fn every_real_config_loads_and_notes_only_keys_transformers_never_reads() {
    let mut loaded = 0;
    for f in corpus() {
        let n = name(&f);
        let raw: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        if let Some((_, key)) = REFUSED.iter().find(|(file, _)| *file == n) {
            let e = load(&f).expect_err(&n);
            assert!(e.contains(&format!("`{key}` = ")), "{n}: {e}");
            continue;
        }
        let c = load(&f).unwrap_or_else(|e| panic!("{n}: {e}"));
        loaded += 1;
        // sizes: the layout gives the parameter count the repo is named for
        let params = c.num_params() as f64;
        if let Some(named) = size_in_name(&n) {
            let r = params / named;
            assert!(
                (0.7..1.35).contains(&r),
                "{n}: {params:.3e} parameters for a {named:.1e} model"
            );
        }
        // the note: unread keys are keys of the file that transformers never reads
        let class = raw["architectures"][0].as_str().unwrap();
        let top_class = if c.text_tower {
            class
        } else {
            c.arch.hf_class()
        };
        let reads = transformers_reads(if c.text_tower {
            "Gemma3ForCausalLM"
        } else {
            top_class
        });
        for k in &c.keys.unread {
            let key = k.strip_prefix("text_config.").unwrap_or(k);
            if c.text_tower && !k.starts_with("text_config.") {
                assert!(raw.get(k).is_some(), "{n}: {k}");
                continue;
            }
            assert!(!reads.contains(&key.to_string()), "{n}: {k} is read");
        }
        let note = c.keys.line();
        assert_eq!(note.is_some(), !c.keys.unread.is_empty(), "{n}");
    }
    assert_eq!(loaded + REFUSED.len(), corpus().len());
    // the keys nanotron, transformers.js, remote code and Qwen's converter leave behind
    let unread = |file: &str| load(&corpus_dir().join(file)).unwrap().keys.unread;
    assert_eq!(
        unread("HuggingFaceTB--SmolLM2-135M-Instruct.json"),
        [
            "is_llama_config",
            "rope_interleaved",
            "transformers.js_config"
        ]
    );
    assert_eq!(unread("Qwen--Qwen2.5-7B.json"), ["use_mrope"]);
    assert_eq!(
        unread("microsoft--Phi-3-mini-4k-instruct.json"),
        ["auto_map"]
    );
    assert_eq!(unread("google--gemma-2-9b.json"), ["sliding_window_size"]);
}

/// `tallow estimate` on each loadable file (a model dir with only its config.json).
#[test]
fn tallow_estimate_runs_on_every_real_config() {
    let dir = scratch("real-configs-estimate");
    for f in corpus() {
        let n = name(&f);
        let model = dir.join(n.trim_end_matches(".json"));
        std::fs::create_dir_all(&model).unwrap();
        std::fs::copy(&f, model.join("config.json")).unwrap();
        let config = model.join("train.toml");
        std::fs::write(
            &config,
            format!(
                "[model]\npath = {:?}\n[data]\ntrain = \"unused.jsonl\"\nmax_seq_len = 2048\n\
                 [train]\ndevice = \"cuda\"\n[lora]\nrank = 16\n",
                model.display().to_string()
            ),
        )
        .unwrap();
        let r = tallow([
            "estimate",
            "--config",
            &config.display().to_string(),
            "--json",
        ]);
        if let Some((_, key)) = REFUSED.iter().find(|(file, _)| *file == n) {
            assert_ne!(r.code, 0, "{n}");
            assert!(r.stderr.contains(&format!("`{key}`")), "{n}: {}", r.stderr);
            continue;
        }
        assert_eq!(r.code, 0, "{n}: {}", r.stderr);
        let v: Value = serde_json::from_str(&r.stdout).unwrap();
        let total = v["total_bytes"].as_u64().unwrap();
        let frozen = v["components"]["frozen_weights"].as_u64().unwrap();
        assert!(frozen > 0 && total > frozen, "{n}: {v}");
        let unread = load(&f).unwrap().keys.unread;
        for k in &unread {
            assert!(
                r.stderr.contains(k.as_str()),
                "{n}: the note lacks {k}: {}",
                r.stderr
            );
        }
    }
}

/// unsloth's bnb-4bit Llama-3.2-1B is estimated as NF4 (its decoder linears as stored, double
/// quantization, lm_head and embeddings dense), as `tallow train` loads it: the frozen weights of
/// Llama-3.2-1B-Instruct with `model.quantize = "nf4"`, not its bf16 size.
#[test]
fn a_bnb_4bit_repo_is_estimated_as_the_nf4_it_loads_as() {
    let dir = scratch("real-configs-bnb");
    let frozen = |file: &str, quantize: &str| -> u64 {
        let model = dir.join(file.trim_end_matches(".json"));
        std::fs::create_dir_all(&model).unwrap();
        std::fs::copy(corpus_dir().join(file), model.join("config.json")).unwrap();
        let config = model.join(format!("train-{quantize}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\npath = {:?}\nquantize = \"{quantize}\"\n[data]\ntrain = \"x.jsonl\"\n\
                 [train]\ndevice = \"cuda\"\n",
                model.display().to_string()
            ),
        )
        .unwrap();
        let r = tallow([
            "estimate",
            "--config",
            &config.display().to_string(),
            "--json",
        ]);
        assert_eq!(r.code, 0, "{file}: {}", r.stderr);
        let v: Value = serde_json::from_str(&r.stdout).unwrap();
        v["components"]["frozen_weights"].as_u64().unwrap()
    };
    let bnb = frozen("unsloth--Llama-3.2-1B-Instruct-bnb-4bit.json", "none");
    let nf4 = frozen("meta-llama--Llama-3.2-1B-Instruct.json", "nf4");
    let bf16 = frozen("meta-llama--Llama-3.2-1B-Instruct.json", "none");
    assert_eq!(bnb, nf4, "bnb-4bit {bnb} vs nf4 {nf4}");
    assert!(bnb * 2 < bf16, "bnb-4bit {bnb} vs bf16 {bf16}");
}

/// A real file plus a feature tallow lacks, as users add it: Qwen2.5's model card tells users
/// to add YaRN `rope_scaling` for contexts past 32k. Refused, with a second refused key (the
/// sliding window switched on) named in the same message.
#[test]
fn a_real_config_with_a_missing_feature_is_refused_naming_every_key() {
    let f = corpus_dir().join("Qwen--Qwen2.5-7B-Instruct.json");
    let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    raw["rope_scaling"] = json!({"factor": 4.0, "original_max_position_embeddings": 32768,
        "type": "yarn"});
    raw["use_sliding_window"] = json!(true);
    let e = DecoderConfig::from_json_str(&raw.to_string(), &f)
        .unwrap_err()
        .to_string();
    for needle in [
        "Qwen--Qwen2.5-7B-Instruct.json",
        "these 2 keys",
        "`rope_scaling` = {",
        "`yarn`",
        "`use_sliding_window` = true",
        "model.ignore_config_keys",
    ] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
}

fn tiny_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(corpus_dir().join("tiny"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// (logits (B, T, V), mean NLL of tokens 1.. of each row): what transformers' forward with
/// `labels = input_ids` returns.
fn logits_and_loss(model: &CausalLM, ids: &[Vec<u32>]) -> (Tensor, f64) {
    let flat: Vec<u32> = ids.iter().flatten().copied().collect();
    let input = Tensor::from_vec(flat, (ids.len(), ids[0].len()), &Device::Cpu).unwrap();
    let logits = model.logits(&input).unwrap();
    let h = model.forward_hidden(&input, None).unwrap();
    let targets: Vec<Vec<bool>> = ids
        .iter()
        .map(|r| (0..r.len()).map(|t| t > 0).collect())
        .collect();
    let t = Targets::new(ids, &targets, &Device::Cpu).unwrap();
    let nll = lm_head_nll(
        &h,
        model.lm_head_weight(),
        &t,
        model.config.variant.final_logit_softcapping,
    )
    .unwrap()
    .to_dtype(DType::F64)
    .unwrap()
    .to_scalar::<f64>()
    .unwrap();
    (logits, nll / t.count as f64)
}

/// Each real key set, on a tiny random model: tallow's logits and loss are transformers 4.57's
/// and 5.x's, from the config as published (its unread keys ignored) and as transformers 5
/// saves it again.
#[test]
fn tiny_models_with_real_key_sets_compute_what_transformers_computes() {
    let dirs = tiny_dirs();
    assert!(dirs.len() >= 20, "{} tiny models", dirs.len());
    let mut with_unread = 0;
    for dir in dirs {
        let n = name(&dir);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let ids = id_rows(&reference["ids"]);
        let tensors =
            candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
                .unwrap();
        let versions = reference["versions"].as_object().unwrap();
        assert!(
            versions.keys().any(|v| v.starts_with("4."))
                && versions.keys().any(|v| v.starts_with("5.")),
            "{n}: {versions:?}"
        );
        // the config as published, and as transformers 5 writes it
        let v5 = scratch(&format!("real-config-v5-{n}"));
        std::fs::copy(dir.join("model.safetensors"), v5.join("model.safetensors")).unwrap();
        std::fs::copy(dir.join("config-v5.json"), v5.join("config.json")).unwrap();
        for (layout, model_dir) in [("as published", dir.clone()), ("transformers 5", v5)] {
            let model = CausalLM::load(&model_dir, &LoadOptions::frozen(DType::F32, &Device::Cpu))
                .unwrap_or_else(|e| panic!("{n} {layout}: {e}"));
            if layout == "as published" && !model.config.keys.unread.is_empty() {
                with_unread += 1;
            }
            let (logits, loss) = logits_and_loss(&model, &ids);
            for (version, r) in versions {
                let want = &tensors[&format!("{version}.logits")];
                let d = max_abs_diff(&logits, want);
                assert!(
                    d < TOLERANCE,
                    "{n} ({layout}) vs transformers {version}: logits differ by {d}"
                );
                let l = r["loss"].as_f64().unwrap();
                assert!(
                    (loss - l).abs() < TOLERANCE,
                    "{n} ({layout}) vs transformers {version}: loss {loss} vs {l}"
                );
            }
        }
    }
    // the point of the test: files whose keys tallow ignores
    assert!(
        with_unread >= 5,
        "{with_unread} tiny models with unread keys"
    );
}

/// A refused key the user knows better about: `model.ignore_config_keys` lets `tallow
/// estimate` (and `train`) read the file as if the key were absent, without editing it, and the
/// note names it.
#[test]
fn ignore_config_keys_reads_a_refused_key_as_absent() {
    let dir = scratch("real-configs-ignore");
    let model = dir.join("smollm2");
    std::fs::create_dir_all(&model).unwrap();
    let f = corpus_dir().join("HuggingFaceTB--SmolLM2-135M-Instruct.json");
    let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    raw["pretraining_tp"] = json!(2);
    let text = raw.to_string();
    std::fs::write(model.join("config.json"), &text).unwrap();
    let config = dir.join("train.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {:?}\n[data]\ntrain = \"x.jsonl\"\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    let c = config.display().to_string();
    let refused = tallow(["estimate", "--config", &c]);
    assert_ne!(refused.code, 0);
    assert!(
        refused.stderr.contains("`pretraining_tp` = 2")
            && refused.stderr.contains("ignore_config_keys"),
        "{}",
        refused.stderr
    );
    let ok = tallow([
        "estimate",
        "--config",
        &c,
        "--set",
        "model.ignore_config_keys=[\"pretraining_tp\"]",
    ]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    assert!(
        ok.stderr.contains("pretraining_tp") && ok.stderr.contains("is_llama_config"),
        "the note names the dropped and the unread keys: {}",
        ok.stderr
    );
    // the file is untouched
    assert_eq!(
        std::fs::read_to_string(model.join("config.json")).unwrap(),
        text
    );
}

/// A bitsandbytes 8-bit (LLM.int8) repo: `tallow train` does not load int8 weights, so it is
/// refused by name, not estimated as something it would not load.
#[test]
fn a_bnb_8bit_repo_is_refused_by_name() {
    let f = corpus_dir().join("unsloth--Llama-3.2-1B-Instruct-bnb-4bit.json");
    let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    let q = &mut raw["quantization_config"];
    for (k, v) in [
        ("load_in_4bit", false),
        ("_load_in_4bit", false),
        ("load_in_8bit", true),
        ("_load_in_8bit", true),
    ] {
        q[k] = json!(v);
    }
    let e = DecoderConfig::from_json_str(&raw.to_string(), &f)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`quantization_config` = ") && e.contains("8-bit (LLM.int8)"),
        "{e}"
    );
}
