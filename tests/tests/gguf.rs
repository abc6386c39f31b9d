//! GGUF import (issue 39, docs/gguf.md): tiny models converted by llama.cpp's own
//! `convert_hf_to_gguf.py`, read by tallow, against what transformers 4.57 and 5 compute on the
//! same files and on the safetensors models they came from (`scripts/make_gguf_fixtures.py`,
//! `tests/fixtures/gguf/reference-v{4,5}.json`).
//!
//! Tolerance: mean next-token NLL within 1e-5 (f32). The effects it must see are 10-1000x that:
//! Q8_0 vs the f32 original 1.2e-3, Q4_K_M 1.0e-2, f16 vs original 6e-5, the Llama 3 rope
//! scaling 9.8e-3
//! (checked by breaking each on purpose: no q / k row un-permute, no `rope_scaling` from
//! `rope_freqs.weight`).

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use serde_json::Value;
use tallow_model::io::gguf;
use tallow_model::{CausalLM, LoadOptions};
use tallow_tests::*;
use tallow_text::TextTokenizer;

const TOL: f64 = 1e-5;

fn gguf_fixture(name: &str) -> PathBuf {
    fixtures().join("gguf").join(name)
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn references() -> Vec<(String, Value)> {
    ["4", "5"]
        .iter()
        .map(|v| {
            (
                format!("transformers {v}"),
                read_json(&gguf_fixture(&format!("reference-v{v}.json"))),
            )
        })
        .collect()
}

/// The model dir of a fixture file, in a cache of this test process.
fn dir_of(name: &str, cache: &Path) -> PathBuf {
    gguf::model_dir_in(&gguf_fixture(name), cache).unwrap()
}

fn ids_of(entry: &Value) -> Vec<Vec<u32>> {
    id_rows(&entry["ids"])
}

/// `tallow eval --json` of `model` on the text fixture in f32, with `extra` arguments: its
/// JSON line.
fn eval_json(env: &[(&str, String)], model: &Path, extra: &[String]) -> Value {
    let mut args = vec![
        "eval".to_string(),
        "--model".into(),
        model.display().to_string(),
        "--data".into(),
        data_file("text").display().to_string(),
        "--dtype".into(),
        "f32".into(),
        "--json".into(),
    ];
    args.extend_from_slice(extra);
    let run = tallow_env(&args, env);
    assert_eq!(run.code, 0, "{}", run.stderr);
    serde_json::from_str(run.stdout.lines().last().unwrap()).unwrap()
}

/// `tallow export --model MODEL --outtype OUTTYPE --out OUT` with `env`.
fn export(env: &[(&str, String)], model: &Path, outtype: &str, out: &Path) -> Run {
    tallow_env(
        [
            "export",
            "--model",
            model.to_str().unwrap(),
            "--outtype",
            outtype,
            "--out",
            out.to_str().unwrap(),
        ],
        env,
    )
}

/// `--adapter DIR` when there is one.
fn adapter_args(adapter: Option<&Path>) -> Vec<String> {
    adapter.map_or(Vec::new(), |a| {
        vec!["--adapter".into(), a.display().to_string()]
    })
}

/// Writes `config`: LoRA rank 4 over `model` in f32 on the CPU, on the text fixture (rows of at
/// most 64 tokens), into `out`; `model_keys` and `train_keys` are more lines of those sections.
fn write_lora_config(config: &Path, model: &Path, out: &Path, model_keys: &str, train_keys: &str) {
    std::fs::write(
        config,
        format!(
            "[model]\npath = {:?}\ndtype = \"f32\"\n{model_keys}[lora]\nrank = 4\n[data]\n\
             train = {:?}\nmax_seq_len = 64\n[train]\n{train_keys}device = \"cpu\"\n\
             output_dir = {:?}\n",
            model.display().to_string(),
            data_file("text").display().to_string(),
            out.display().to_string()
        ),
    )
    .unwrap();
}

/// tallow's ids are transformers 5's on every file, and 4.57's where 4.57 agrees with 5. 4.57
/// builds SentencePiece vocabularies otherwise: Llama's with a `Prepend("▁")` normalizer instead
/// of Metaspace's first-word-only prefix, so a text that starts with spaces differs; Phi-3's
/// without the `▁` between words; and for Gemma's one that cannot tokenize the texts at all
/// ("Encountered an unknown token but `unk_id` is missing", recorded as `tokenizer_error`), as
/// it cannot build a Phi-3 file's byte-level vocabulary ("'GGUFTokenizerSkeleton' object has no
/// attribute 'bos_token_id'").
#[test]
fn the_tokenizer_gives_transformers_gguf_ids() {
    let cache = scratch("gguf-tok");
    let refs = references();
    let v5 = &refs[1].1;
    for (who, reference) in &refs {
        let texts = reference["texts"].as_array().unwrap();
        for (name, entry) in reference["files"].as_object().unwrap() {
            if entry.get("tokenizer_error").is_some() {
                assert!(
                    who.ends_with('4')
                        && (name.starts_with("tiny-gemma") || name.starts_with("tiny-phi3")),
                    "{who}: {name}: {entry}"
                );
                continue;
            }
            if ids_of(entry) != ids_of(&v5["files"][name]) {
                assert!(
                    who.ends_with('4')
                        && (name.starts_with("tiny-llama-spm")
                            || name.starts_with("tiny-phi3-spm")),
                    "{who} and 5 differ on {name}"
                );
                continue;
            }
            let tok = TextTokenizer::from_model_dir(&dir_of(name, &cache)).unwrap();
            for (text, want) in texts.iter().zip(ids_of(entry)) {
                let got = tok.encode(text.as_str().unwrap(), true).unwrap();
                assert_eq!(got, want, "{who}, {name}: {text}");
            }
        }
    }
}

/// The whole tokenizer.json (vocabulary, merges, added tokens, normalizer, pre-tokenizer split,
/// post-processor's BOS, decoder) equals the one transformers 5 builds from the same file
/// (`integrations/gguf/gguf_tokenizer_mapping.py`). transformers 4.57 built another (GPT-2's
/// regex for every vocabulary, Qwen 2's NFC): its ids agree with 5's on the texts above, which
/// hold no case where the two differ.
#[test]
fn the_tokenizer_json_is_the_one_transformers_5_builds() {
    let cache = scratch("gguf-tokjson");
    let (_, reference) = references().pop().unwrap();
    for (name, entry) in reference["files"].as_object().unwrap() {
        let dir = dir_of(name, &cache);
        let ours = read_json(&dir.join("tokenizer.json"));
        let theirs = &entry["tokenizer_json"];
        let keys: Vec<&String> = theirs.as_object().unwrap().keys().collect();
        assert!(keys.len() >= 8, "{keys:?}");
        let vocab = theirs["model"]["vocab"].as_object().unwrap().len() as u64;
        for key in keys {
            let mut want = theirs[key].clone();
            if key == "added_tokens" {
                // transformers' GPT2Tokenizer adds its own default `<|endoftext|>` when the
                // vocabulary lacks it, with an id past the model's embedding rows (325 of 325 in
                // tiny-llama): not a token of the file, and an id the model cannot take
                want.as_array_mut()
                    .unwrap()
                    .retain(|t| t["id"].as_u64().unwrap() < vocab);
            }
            assert_eq!(ours[key], want, "{name}: tokenizer.json `{key}`");
        }
    }
}

#[test]
fn eval_matches_transformers_on_the_same_file_and_the_original_model() {
    let cache = scratch("gguf-eval");
    for (who, reference) in references() {
        for (name, entry) in reference["files"].as_object().unwrap() {
            if entry.get("tokenizer_error").is_some() {
                continue; // no ids (see the_tokenizer_gives_transformers_gguf_ids)
            }
            let model = CausalLM::load(
                &dir_of(name, &cache),
                &LoadOptions::frozen(DType::F32, &Device::Cpu),
            )
            .unwrap();
            let count = entry["count"].as_f64().unwrap();
            // every token but the first is a target
            let rows: Vec<(Vec<u32>, Vec<bool>)> = ids_of(entry)
                .into_iter()
                .map(|ids| {
                    let targets = (0..ids.len()).map(|t| t > 0).collect();
                    (ids, targets)
                })
                .collect();
            let got = nll_and_count(&model, &rows).0 / count;
            let original = entry["original_nll_sum"].as_f64().unwrap() / count;
            match (name.as_str(), entry["nll_sum"].as_f64()) {
                // f32 weights where llama.cpp and transformers' loader agree on what the file
                // means: transformers' number, which is the original's (SentencePiece
                // vocabularies; Gemma's norms stored as 1 + w, its sandwich norms, soft-caps,
                // sliding layers and query scale; Gemma 3's local rope base; Phi-3's fused
                // projections).
                (
                    "tiny-llama-spm-f32.gguf"
                    | "tiny-gemma2-spm-f32.gguf"
                    | "tiny-gemma3-spm-f32.gguf"
                    | "tiny-phi3-spm-f32.gguf",
                    Some(t),
                ) => {
                    let want = t / count;
                    assert!((got - want).abs() < TOL, "{who}, {name}: {got} vs {want}");
                    assert!(
                        (got - original).abs() < TOL,
                        "{who}, {name}: {got} vs {original}"
                    );
                }
                // Where transformers' GGUF loader reads what the file says: its number (gguf-py
                // dequantizes the blocks: Q8_0, and llama-quantize's Q4_K / Q6_K).
                (
                    "tiny-qwen2-q8_0.gguf"
                    | "tiny-gemma3-spm-q8_0.gguf"
                    | "tiny-phi3-spm-q8_0.gguf"
                    | "tiny-qwen2-f16.gguf"
                    | "tiny-llama-256-q4_k_m.gguf"
                    | "tiny-phi3-spm-q4_k_m.gguf"
                    | "tiny-llama-256-q8_0.gguf",
                    Some(t),
                ) => {
                    let want = t / count;
                    assert!((got - want).abs() < TOL, "{who}, {name}: {got} vs {want}");
                    // and the format's rounding is seen (Q8_0: 1.2e-3, and 9e-5 to 2.7e-4 on the
                    // Gemma 3 and Phi-3 files; f16: 6e-5, Q4_K_M: 7e-5 to 1.0e-2 of the mean)
                    assert!(
                        (got - original).abs() > 5.0 * TOL,
                        "{who}, {name}: {got} vs {original}"
                    );
                }
                // What transformers' loader drops and tallow reads back, computing the original
                // model: Llama 3's rope scaling (rope_freqs.weight; transformers computes an
                // unscaled rope), Phi-3's partial rotary (`rope.dimension_count`) and LongRoPE
                // (the tensors `rope_factors_long` / `_short`).
                ("tiny-llama-f32.gguf" | "tiny-phi3-longrope-f32.gguf", Some(t)) => {
                    assert!(
                        (got - original).abs() < TOL,
                        "{who}, {name}: {got} vs {original}"
                    );
                    assert!(
                        (t / count - original).abs() > 100.0 * TOL,
                        "{who}: {t} {original}"
                    );
                }
                // Gemma 3 in llama-quantize's Q4_K_M (Q4_K, Q5_0, Q8_0 blocks): transformers'
                // number (its blocks move the mean NLL by only 2.4e-5 from the original here, too
                // little to require seeing)
                ("tiny-gemma3-spm-q4_k_m.gguf", Some(t)) => {
                    let want = t / count;
                    assert!((got - want).abs() < TOL, "{who}, {name}: {got} vs {want}");
                }
                // Mistral as llama.cpp writes it (architecture `llama`, its sliding window
                // dropped by the converter): what transformers and llama.cpp compute from the
                // file, full attention, not the original's window of 8 tokens (5.5e-2 away)
                ("tiny-mistral-f32.gguf", Some(t)) => {
                    let want = t / count;
                    assert!((got - want).abs() < TOL, "{who}, {name}: {got} vs {want}");
                    assert!(
                        (want - original).abs() > 100.0 * TOL,
                        "{who}: {want} {original}"
                    );
                }
                // Qwen3's head dim: transformers cannot load the file (it keeps head_dim 128);
                // tallow computes the original model.
                ("tiny-qwen3-f32.gguf", None) => {
                    assert!(entry["error"].is_string());
                    assert!(
                        (got - original).abs() < TOL,
                        "{who}, {name}: {got} vs {original}"
                    );
                }
                other => panic!("{who}: no expectation for {other:?}"),
            }
        }
    }
}

#[test]
fn the_model_dir_holds_the_hf_config_and_is_reused() {
    let cache = scratch("gguf-dir");
    let dir = dir_of("tiny-llama-f32.gguf", &cache);
    let config = read_json(&dir.join("config.json"));
    let original = read_json(&model_dir("tiny-llama").join("config.json"));
    for key in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ] {
        assert_eq!(config[key], original[key], "{key}");
    }
    let (got, want) = (&config["rope_scaling"], &original["rope_scaling"]);
    for key in ["rope_type", "original_max_position_embeddings"] {
        assert_eq!(got[key], want[key], "rope_scaling.{key}");
    }
    for key in ["factor", "low_freq_factor", "high_freq_factor"] {
        assert_eq!(got[key].as_f64(), want[key].as_f64(), "rope_scaling.{key}");
    }
    let tc = read_json(&dir.join("tokenizer_config.json"));
    assert!(tc["chat_template"].as_str().unwrap().contains("bos_token"));
    // the same file: the same dir, not rewritten
    let before = std::fs::metadata(dir.join("config.json"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(dir_of("tiny-llama-f32.gguf", &cache), dir);
    let after = std::fs::metadata(dir.join("config.json"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(before, after);
}

/// Writes a copy of fixture `name` with metadata `edit`ed (candle's GGUF writer).
fn edited_copy(name: &str, to: &Path, edit: impl FnOnce(&mut Vec<(String, gguf_file::Value)>)) {
    let path = gguf_fixture(name);
    let mut f = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    edit(&mut meta);
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let mut out = std::fs::File::create(to).unwrap();
    gguf_file::write(
        &mut out,
        &meta
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .collect::<Vec<_>>(),
        &tensors
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .collect::<Vec<_>>(),
    )
    .unwrap();
}

/// `model.quantize = "keep"` / `LoadOptions::keep_blocks`: the decoder linears stay in the
/// file's blocks (llama-quantize's Q4_K_M mix of Q4_K and Q6_K; Q8_0), hold the bytes the
/// estimate reads from the header, and compute what the dequantized model computes, to the bit
/// in f32 (the same values through the same matmul): so transformers' number too.
#[test]
fn kept_blocks_compute_what_the_dequantized_model_computes() {
    let cache = scratch("gguf-keep");
    let (_, reference) = references().pop().unwrap();
    // (file, formats, decoder linears held in blocks: 7 per layer; Phi-3's 4 fused ones)
    for (name, formats, linears) in [
        ("tiny-llama-256-q4_k_m.gguf", vec!["Q4K", "Q6K"], 14),
        ("tiny-qwen2-q8_0.gguf", vec!["Q8_0"], 14),
        ("tiny-gemma3-spm-q8_0.gguf", vec!["Q8_0"], 42),
        ("tiny-phi3-spm-q8_0.gguf", vec!["Q8_0"], 8),
        (
            "tiny-gemma3-spm-q4_k_m.gguf",
            vec!["Q4K", "Q5_0", "Q8_0"],
            42,
        ),
    ] {
        let entry = &reference["files"][name];
        let dir = dir_of(name, &cache);
        let load = |keep_blocks| {
            let opts = LoadOptions {
                keep_blocks,
                ..LoadOptions::frozen(DType::F32, &Device::Cpu)
            };
            CausalLM::load(&dir, &opts).unwrap()
        };
        let (kept, dense) = (load(true), load(false));
        let blocks = kept.ggml_weights();
        assert_eq!(blocks.len(), linears, "{name}");
        assert!(dense.ggml_weights().is_empty());
        let found: std::collections::BTreeSet<String> = blocks
            .iter()
            .map(|(_, w)| format!("{:?}", w.format()))
            .collect();
        assert_eq!(found.into_iter().collect::<Vec<_>>(), formats, "{name}");
        let stored = gguf::block_bytes(&gguf_fixture(name)).unwrap();
        for (n, w) in &blocks {
            assert_eq!(stored[n], w.storage_bytes() as u64, "{name}: {n}");
        }
        let rows: Vec<(Vec<u32>, Vec<bool>)> = ids_of(entry)
            .into_iter()
            .map(|ids| {
                let targets = (0..ids.len()).map(|t| t > 0).collect();
                (ids, targets)
            })
            .collect();
        let (got, want) = (
            nll_and_count(&kept, &rows).0,
            nll_and_count(&dense, &rows).0,
        );
        assert_eq!(got, want, "{name}");
        let count = entry["count"].as_f64().unwrap();
        let t = entry["nll_sum"].as_f64().unwrap();
        assert!(
            (got / count - t / count).abs() < TOL,
            "{name}: {got} vs {t}"
        );
    }
    // Only for a GGUF file, whose blocks it keeps; frozen.
    let e = CausalLM::load(
        &model_dir("tiny-qwen2"),
        &LoadOptions {
            keep_blocks: true,
            ..LoadOptions::frozen(DType::F32, &Device::Cpu)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("not a GGUF file") && e.contains("nf4"), "{e}");
    let e = CausalLM::load(
        &dir_of("tiny-llama-256-q4_k_m.gguf", &cache),
        &LoadOptions {
            keep_blocks: true,
            train_base: true,
            ..LoadOptions::frozen(DType::F32, &Device::Cpu)
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("frozen") && e.contains("LoRA only"), "{e}");
}

/// LoRA over kept Q4_K / Q6_K blocks (`model.quantize = "keep"`) trains the adapter that LoRA
/// over the dequantized file trains, tensor for tensor (the forward and backward compute the
/// same values), and the adapter lowers the loss; `eval --quantize keep` gives the same loss.
#[test]
fn lora_trains_over_kept_blocks_as_over_the_dequantized_file() {
    let tmp = scratch("gguf-keep-cli");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    // (file, decoder linears): Llama's 7 per layer; Phi-3's fused qkv_proj / gate_up_proj and
    // o_proj / down_proj, 4 per layer; Gemma 3's 7 per layer over its sandwich norms
    for (name, linears) in [
        ("tiny-llama-256-q4_k_m.gguf", 14),
        ("tiny-phi3-spm-q4_k_m.gguf", 8),
        ("tiny-gemma3-spm-q4_k_m.gguf", 42),
    ] {
        let file = gguf_fixture(name);
        let eval = |quantize: &str, adapter: Option<&Path>| -> Value {
            let mut extra = vec!["--quantize".to_string(), quantize.into()];
            extra.extend(adapter_args(adapter));
            eval_json(&env, &file, &extra)
        };
        let train = |quantize: &str| -> PathBuf {
            let out = tmp.join(format!("{name}-out-{quantize}"));
            let config = tmp.join(format!("{name}-{quantize}.toml"));
            write_lora_config(
                &config,
                &file,
                &out,
                &format!("quantize = {quantize:?}\n"),
                "max_steps = 6\nlr = 1e-2\n",
            );
            let run = tallow_env(["train", "--config", config.to_str().unwrap()], &env);
            assert_eq!(run.code, 0, "{name}: {}", run.stderr);
            out.join("adapter")
        };
        let (kept, dense) = (train("keep"), train("none"));
        let tensors = |dir: &Path| {
            candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap()
        };
        let (a, b) = (tensors(&kept), tensors(&dense));
        assert_eq!(a.len(), 2 * linears, "{name}: LoRA A and B on every linear");
        for (n, t) in &a {
            let d = (t - &b[n]).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{name}: {n}");
        }
        let base = eval("keep", None);
        assert_eq!(
            base["gguf_block_weights"].as_u64(),
            Some(linears as u64),
            "{base}"
        );
        let loss = |v: &Value| v["loss"].as_f64().unwrap();
        let (with_kept, with_dense) = (eval("keep", Some(&kept)), eval("none", Some(&kept)));
        assert_eq!(with_dense["gguf_block_weights"].as_u64(), Some(0));
        assert!((loss(&with_kept) - loss(&with_dense)).abs() < TOL, "{name}");
        assert!(
            loss(&with_kept) < loss(&base) - 100.0 * TOL,
            "{name}: {} vs {}",
            loss(&with_kept),
            loss(&base)
        );
    }
    // A safetensors model has no blocks to keep (a full fine-tune is refused by the config).
    let run = tallow_env(
        [
            "eval",
            "--model",
            model_dir("tiny-qwen2").to_str().unwrap(),
            "--data",
            data_file("text").to_str().unwrap(),
            "--quantize",
            "keep",
        ],
        &env,
    );
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains("not a GGUF file"), "{}", run.stderr);
}

/// Gemma's keys as llama.cpp reads them (config.rs `gemma`), on edited copies of the Gemma
/// fixtures: the query scale of the 27B models (hidden / heads, not head_dim: Gemma 3 at 62
/// layers), the sliding pattern key (a count), a file without a window (no sliding layer),
/// and Gemma 3's linear rope scaling, which moves the loss (so the model computes it).
#[test]
fn gemma_keys_are_read_as_llama_cpp_reads_them() {
    let tmp = scratch("gguf-gemma-keys");
    let config_of = |file: &Path| -> Value {
        let dir = gguf::model_dir_in(file, &tmp.join("cache")).unwrap();
        read_json(&dir.join("config.json"))
    };
    let types = |c: &Value| -> Vec<String> {
        c["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap()[..1].to_string())
            .collect()
    };
    let set = |m: &mut Vec<(String, gguf_file::Value)>, key: &str, v: gguf_file::Value| {
        m.retain(|(k, _)| k != key);
        m.push((key.into(), v));
    };
    // as converted: head_dim 256 scales the queries; five sliding layers, then a global one
    let c = config_of(&gguf_fixture("tiny-gemma3-spm-f32.gguf"));
    assert_eq!(c["query_pre_attn_scalar"], 256, "{c}");
    assert_eq!(types(&c).concat(), "sssssf");
    assert_eq!(
        (
            c["sliding_window"].clone(),
            c["rope_local_base_freq"].clone()
        ),
        (4.into(), 10000.0.into())
    );
    let c = config_of(&gguf_fixture("tiny-gemma2-spm-f32.gguf"));
    assert_eq!(types(&c).concat(), "sf");
    assert_eq!(c["attn_logit_softcapping"], 50.0);
    assert_eq!(c["final_logit_softcapping"], 30.0);
    // the 27B's layer count: hidden / heads = 32 / 2
    let file = tmp.join("gemma3-27b.gguf");
    edited_copy("tiny-gemma3-spm-f32.gguf", &file, |m| {
        set(m, "gemma3.block_count", gguf_file::Value::U32(62))
    });
    assert_eq!(config_of(&file)["query_pre_attn_scalar"], 16);
    // a pattern of 3; no window at all
    let file = tmp.join("gemma3-pattern.gguf");
    edited_copy("tiny-gemma3-spm-f32.gguf", &file, |m| {
        set(
            m,
            "gemma3.attention.sliding_window_pattern",
            gguf_file::Value::U32(3),
        )
    });
    assert_eq!(types(&config_of(&file)).concat(), "ssfssf");
    let file = tmp.join("gemma3-no-window.gguf");
    edited_copy("tiny-gemma3-spm-f32.gguf", &file, |m| {
        m.retain(|(k, _)| k != "gemma3.attention.sliding_window")
    });
    assert_eq!(types(&config_of(&file)).concat(), "ffffff");
    // linear rope scaling (Gemma 3 4B / 12B / 27B: factor 8)
    let file = tmp.join("gemma3-linear.gguf");
    edited_copy("tiny-gemma3-spm-f32.gguf", &file, |m| {
        set(
            m,
            "gemma3.rope.scaling.type",
            gguf_file::Value::String("linear".into()),
        );
        set(m, "gemma3.rope.scaling.factor", gguf_file::Value::F32(8.0));
    });
    let c = config_of(&file);
    assert_eq!(c["rope_scaling"]["rope_type"], "linear", "{c}");
    assert_eq!(c["rope_scaling"]["factor"], 8.0, "{c}");
    let (_, reference) = references().pop().unwrap();
    let rows: Vec<(Vec<u32>, Vec<bool>)> = ids_of(&reference["files"]["tiny-gemma3-spm-f32.gguf"])
        .into_iter()
        .map(|ids| {
            let targets = (0..ids.len()).map(|t| t > 0).collect();
            (ids, targets)
        })
        .collect();
    let nll = |file: &Path| {
        let dir = gguf::model_dir_in(file, &tmp.join("cache")).unwrap();
        let model = CausalLM::load(&dir, &LoadOptions::frozen(DType::F32, &Device::Cpu)).unwrap();
        nll_and_count(&model, &rows).0
    };
    let (scaled, plain) = (nll(&file), nll(&gguf_fixture("tiny-gemma3-spm-f32.gguf")));
    assert!((scaled - plain).abs() > 1e-3, "{scaled} vs {plain}");
}

#[test]
fn keys_that_change_the_maths_are_refused_by_name() {
    let tmp = scratch("gguf-refused");
    let file = tmp.join("edited.gguf");
    edited_copy("tiny-qwen2-q8_0.gguf", &file, |m| {
        m.push(("qwen2.expert_count".into(), gguf_file::Value::U32(8)));
        m.push((
            "qwen2.rope.scaling.type".into(),
            gguf_file::Value::String("yarn".into()),
        ));
    });
    let e = gguf::model_dir_in(&file, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    for needle in [
        "edited.gguf",
        "these 2 keys",
        "`qwen2.expert_count` = 8",
        "`qwen2.rope.scaling.type` = \"yarn\"",
    ] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
    // an architecture tallow does not read
    edited_copy("tiny-qwen2-q8_0.gguf", &file, |m| {
        for (k, v) in m.iter_mut() {
            if k == "general.architecture" {
                *v = gguf_file::Value::String("falcon".into());
            }
        }
    });
    let e = gguf::model_dir_in(&file, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("falcon") && e.contains("llama, qwen2, qwen3, gemma2, gemma3, phi3"),
        "{e}"
    );
    // a T5 (Unigram) vocabulary (not read yet)
    edited_copy("tiny-qwen2-q8_0.gguf", &file, |m| {
        for (k, v) in m.iter_mut() {
            if k == "tokenizer.ggml.model" {
                *v = gguf_file::Value::String("t5".into());
            }
        }
    });
    let e = gguf::model_dir_in(&file, &tmp.join("cache"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`tokenizer.ggml.model` = \"t5\""), "{e}");
    // not a GGUF at all: read as a directory path, as before
    assert!(!gguf::is_gguf(&model_dir("tiny-qwen2").join("config.json")));
}

#[test]
fn eval_and_lora_training_take_a_gguf_file() {
    let tmp = scratch("gguf-cli");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    let file = gguf_fixture("tiny-qwen2-q8_0.gguf");
    // `tallow eval --json` of a model (+ adapter): its loss
    let eval = |model: &Path, adapter: Option<&Path>| -> f64 {
        eval_json(&env, model, &adapter_args(adapter))["loss"]
            .as_f64()
            .unwrap()
    };
    let loss = eval(&file, None);
    assert!(loss > 0.0);
    // the same as the model dir it reads as
    let dir = gguf::model_dir_in(&file, &tmp.join("cache").join("gguf")).unwrap();
    assert_eq!(loss, eval(&dir, None));

    let config = tmp.join("train.toml");
    write_lora_config(
        &config,
        &file,
        &tmp.join("out"),
        "",
        "max_steps = 2\nlr = 1e-3\n",
    );
    // the estimate reads the file's hyper-parameters
    let run = tallow_env(["estimate", "--config", config.to_str().unwrap()], &env);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout
            .contains("Qwen2ForCausalLM (2 layers, hidden 64, vocab 323)"),
        "{}",
        run.stdout
    );
    let run = tallow_env(["train", "--config", config.to_str().unwrap()], &env);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let adapter = tmp.join("out/adapter");
    assert!(
        adapter.join("adapter_model.safetensors").exists(),
        "{}",
        run.stderr
    );

    // The adapter on the GGUF base, and merged into it: the merged HF-layout model computes the
    // same loss.
    let merged = tmp.join("merged");
    let run = tallow_env(
        [
            "merge",
            "--model",
            file.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
            "--dtype",
            "f32",
        ],
        &env,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let (with_adapter, base) = (eval(&file, Some(&adapter)), eval(&file, None));
    let merged_loss = eval(&merged, None);
    assert!(
        (with_adapter - merged_loss).abs() < TOL,
        "{with_adapter} vs {merged_loss}"
    );
    assert!(
        (with_adapter - base).abs() > 100.0 * TOL,
        "the adapter changed nothing: {base}"
    );
    // and exported with the adapter merged in: the GGUF computes the same loss
    let exported = tmp.join("merged.gguf");
    let run = tallow_env(
        [
            "export",
            "--model",
            file.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--outtype",
            "f32",
            "--out",
            exported.to_str().unwrap(),
        ],
        &env,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let exported_loss = eval(&exported, None);
    assert!(
        (with_adapter - exported_loss).abs() < TOL,
        "{with_adapter} vs {exported_loss}"
    );

    // generate with the file's chat template
    let run = tallow_env(
        [
            "generate",
            "--model",
            file.to_str().unwrap(),
            "--prompt",
            "Hi",
            "--chat",
            "--max-new-tokens",
            "4",
            "--json",
        ],
        &env,
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let v: Value = serde_json::from_str(run.stdout.lines().last().unwrap()).unwrap();
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let im_start = tok.encode("<|im_start|>", false).unwrap();
    assert_eq!(v["prompt_ids"][0].as_u64(), Some(im_start[0] as u64), "{v}");
}

/// The metadata (as text, for comparison) and tensors (type, shape, bytes) of a GGUF file.
type Dump = (
    std::collections::BTreeMap<String, String>,
    std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>,
);

fn dump(path: &Path) -> Dump {
    let mut f = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let meta = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .collect();
    let tensors = content
        .tensor_infos
        .iter()
        .map(|(n, info)| {
            let q = content.tensor(&mut f, n, &Device::Cpu).unwrap();
            let bytes = q.data().unwrap().to_vec();
            (
                n.clone(),
                (
                    format!("{:?}", info.ggml_dtype),
                    info.shape.dims().to_vec(),
                    bytes,
                ),
            )
        })
        .collect();
    (meta, tensors)
}

/// `ours` is fixture `fixture`: every metadata key with the same type and value (`general.name`,
/// `.basename`, `.version`, `.finetune` aside: llama.cpp's converters derive them from the dir
/// name by heuristics of their own), every
/// tensor with the same type, shape and bytes.
fn assert_same_gguf(ours: &Path, fixture: &str) {
    let (mut ours_meta, ours) = dump(ours);
    let (mut theirs_meta, theirs) = dump(&gguf_fixture(fixture));
    // What llama.cpp's converter derives from the model dir's name by its heuristics
    // (`tiny-llama-256`: basename `tiny-llama`, version `256`).
    for key in [
        "general.name",
        "general.basename",
        "general.version",
        "general.finetune",
    ] {
        ours_meta.remove(key);
        theirs_meta.remove(key);
    }
    assert_eq!(ours_meta, theirs_meta, "{fixture}: metadata");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "{fixture}: tensor names"
    );
    for (name, (ty, shape, bytes)) in &theirs {
        let (oty, oshape, obytes) = &ours[name];
        assert_eq!((oty, oshape), (ty, shape), "{fixture}: {name}");
        assert!(obytes == bytes, "{fixture}: {name}: the bytes differ");
    }
}

/// `tallow export --format gguf` of each fixture model writes the file llama.cpp's converter
/// wrote for it (tests/fixtures/gguf/): every metadata key with the same type and value
/// (`general.name` aside: the converter derives it from the dir name by heuristics of its own),
/// every tensor with the same type, shape and bytes (Q8_0 blocks, f16 rounding, Llama's q / k
/// row order and its `rope_freqs.weight`, Gemma's norms stored as 1 + w, Phi-3's LongRoPE
/// factors and attention factor included; SentencePiece vocabularies read from
/// `tokenizer.model`). Exporting an imported file again in its type gives it back byte for byte.
#[test]
fn export_writes_what_llama_cpp_converter_writes() {
    let tmp = scratch("gguf-export");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    let cases = [
        ("tiny-llama", "f32", "tiny-llama-f32.gguf"),
        ("tiny-qwen2", "q8_0", "tiny-qwen2-q8_0.gguf"),
        ("tiny-qwen2", "f16", "tiny-qwen2-f16.gguf"),
        ("tiny-qwen3", "f32", "tiny-qwen3-f32.gguf"),
        ("tiny-mistral", "f32", "tiny-mistral-f32.gguf"),
    ];
    let compare = |model: &Path, outtype: &str, fixture: &str| {
        let out = tmp.join(format!("{fixture}-{}", outtype));
        let run = export(&env, model, outtype, &out);
        assert_eq!(run.code, 0, "{}", run.stderr);
        assert_same_gguf(&out, fixture);
        run.stderr
    };
    for (model, outtype, fixture) in cases {
        let stderr = compare(&model_dir(model), outtype, fixture);
        // Mistral's window, which the file cannot carry, is named
        assert_eq!(
            stderr.contains("note: sliding_window 8"),
            model == "tiny-mistral",
            "{model}: {stderr}"
        );
    }
    // SentencePiece models (tokenizer.model: Llama 2's and Mistral's build, Gemma's, Phi-3's):
    // the files the converter read (tests/fixtures/gguf/hf/NAME), with the weights of its own
    // f32 file of them (a `model.gguf` in the dir), so that Gemma's norms make the round trip
    // 1 + w -> w -> 1 + w
    let spm = [
        ("tiny-llama-spm", "f32"),
        ("tiny-gemma2-spm", "f32"),
        ("tiny-gemma3-spm", "f32"),
        ("tiny-gemma3-spm", "q8_0"),
        ("tiny-phi3-spm", "f32"),
        ("tiny-phi3-spm", "q8_0"),
    ];
    for (model, outtype) in spm {
        let dir = tmp.join(format!("{model}-{outtype}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "tokenizer.model", "tokenizer_config.json"] {
            std::fs::copy(gguf_fixture(&format!("hf/{model}/{f}")), dir.join(f)).unwrap();
        }
        let weights = gguf_fixture(&format!("{model}-f32.gguf"));
        std::fs::copy(weights, dir.join(gguf::LINK)).unwrap();
        compare(&dir, outtype, &format!("{model}-{outtype}.gguf"));
    }
    // A GGUF file exported again in its own type is itself (its SentencePiece vocabulary copied,
    // a byte-level one rebuilt from the tokenizer.json it was read as).
    for fixture in [
        "tiny-qwen2-q8_0.gguf",
        "tiny-llama-spm-f32.gguf",
        "tiny-gemma2-spm-f32.gguf",
        "tiny-gemma3-spm-q8_0.gguf",
        "tiny-phi3-spm-f32.gguf",
        "tiny-phi3-longrope-f32.gguf",
    ] {
        let outtype = fixture
            .rsplit('-')
            .next()
            .unwrap()
            .trim_end_matches(".gguf");
        compare(&gguf_fixture(fixture), outtype, fixture);
    }
}

/// `--outtype q3_k_s` ... `q6_k` (eight mixes) write what llama.cpp's
/// `llama-quantize` writes for those mixes (no importance matrix): the same types per tensor (Q4_K
/// or Q5_K; Q6_K for the head and, in the `_M` mixes, the first, last and every third `attn_v` /
/// `ffn_down`; Q5_K for `Q4_K_S`'s first 4 `attn_v`; Q6_K everywhere; the 32-value fallbacks), the same blocks byte for byte, the tensors in its order. The Llama
/// fixture is llama-quantize's Q4_K_M of tiny-llama-256-q8_0.gguf's values (8-bit codes, which
/// the 4- and 6-bit blocks must search: 92037 of its bytes differ from the Q4_K_M of the f32
/// original), which is what exporting that file is; the Gemma 3 and Phi-3 ones are its mixes of
/// the converter's f32 files.
#[test]
fn k_quant_export_writes_llama_quantize_bytes() {
    let tmp = scratch("gguf-kquant");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    // the tensors in llama-quantize's order: by data offset
    let order = |p: &Path| {
        let c = gguf_file::Content::read(&mut std::fs::File::open(p).unwrap()).unwrap();
        let mut t: Vec<(u64, String)> = c
            .tensor_infos
            .iter()
            .map(|(n, i)| (i.offset, n.clone()))
            .collect();
        t.sort();
        t.into_iter().map(|(_, n)| n).collect::<Vec<_>>()
    };
    // (source, --outtype, llama-quantize's file of the source, the block formats it holds)
    let cases = [
        (
            "tiny-llama-256-q8_0.gguf",
            "q4_k_m",
            "tiny-llama-256-q4_k_m-from-q8_0.gguf",
            &["F32", "Q4K", "Q6K"][..],
        ),
        // Gemma 3 and Phi-3: llama-quantize's mixes of the converter's f32 files (Gemma's norms
        // f32 as 1 + w, its tied embedding as the head; Phi-3's fused `attn_qkv` counted as an
        // `attn_v`, so its second layer's takes the 6-bit type, here Q8_0 for 64-wide rows;
        // rows of 32-value blocks in Q5_0 / Q5_1 / Q8_0)
        (
            "tiny-gemma3-spm-f32.gguf",
            "q4_k_m",
            "tiny-gemma3-spm-q4_k_m.gguf",
            &["F32", "Q4K", "Q5_0", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q5_k_m",
            "tiny-gemma3-spm-q5_k_m.gguf",
            &["F32", "Q5K", "Q5_1", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q6_k",
            "tiny-gemma3-spm-q6_k.gguf",
            &["F32", "Q6K", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q4_k_s",
            "tiny-gemma3-spm-q4_k_s.gguf",
            &["F32", "Q4K", "Q5_0", "Q5_1", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q5_k_s",
            "tiny-gemma3-spm-q5_k_s.gguf",
            &["F32", "Q5K", "Q5_1", "Q8_0"][..],
        ),
        // Q3_K in the 512-wide attn_output, Q4_0 for 32-value rows; the _M / _L mixes' Q4_K /
        // Q5_K for attn_output, attn_v (the _M's first 2 in Q5_K) and ffn_down
        (
            "tiny-gemma3-spm-f32.gguf",
            "q3_k_s",
            "tiny-gemma3-spm-q3_k_s.gguf",
            &["F32", "Q3K", "Q4_0", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q3_k_m",
            "tiny-gemma3-spm-q3_k_m.gguf",
            &["F32", "Q4K", "Q4_0", "Q5_0", "Q5_1", "Q8_0"][..],
        ),
        (
            "tiny-gemma3-spm-f32.gguf",
            "q3_k_l",
            "tiny-gemma3-spm-q3_k_l.gguf",
            &["F32", "Q4_0", "Q5K", "Q5_1", "Q8_0"][..],
        ),
        (
            "tiny-phi3-spm-f32.gguf",
            "q4_k_m",
            "tiny-phi3-spm-q4_k_m.gguf",
            &["F32", "Q5_0", "Q8_0"][..],
        ),
    ];
    for (source, outtype, fixture, formats) in cases {
        let out = tmp.join(format!("{source}-{outtype}"));
        let run = export(&env, &gguf_fixture(source), outtype, &out);
        assert_eq!(run.code, 0, "{}", run.stderr);
        assert_same_gguf(&out, fixture);
        assert_eq!(order(&out), order(&gguf_fixture(fixture)), "{fixture}");
        let (_, tensors) = dump(&out);
        let types: std::collections::BTreeSet<&str> =
            tensors.values().map(|(t, _, _)| t.as_str()).collect();
        assert_eq!(types.into_iter().collect::<Vec<_>>(), formats, "{fixture}");
    }
}

#[test]
fn export_refuses_what_it_cannot_write() {
    let tmp = scratch("gguf-export-bad");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    let out = tmp.join("x.gguf");
    // Gemma settings llama.cpp would compute otherwise: tiny-gemma3's query scale (48, where
    // llama.cpp takes head_dim 32) and its every-3rd-layer global pattern (llama.cpp: every
    // 6th), named together; tiny-gemma2's query scale
    let run = export(&env, &model_dir("tiny-gemma3"), "f16", &out);
    assert_ne!(run.code, 0);
    for needle in [
        "`query_pre_attn_scalar` = 48",
        "1/sqrt(32)",
        "`layer_types`",
        "every 6th layer global",
    ] {
        assert!(run.stderr.contains(needle), "`{needle}`: {}", run.stderr);
    }
    assert!(!out.exists());
    let run = export(&env, &model_dir("tiny-gemma2"), "f16", &out);
    assert_ne!(run.code, 0);
    assert!(
        run.stderr.contains("`query_pre_attn_scalar` = 64"),
        "{}",
        run.stderr
    );

    let run = tallow_env(
        [
            "export",
            "--model",
            model_dir("tiny-qwen2").to_str().unwrap(),
            "--outtype",
            "q4_k",
            "--out",
            out.to_str().unwrap(),
        ],
        &env,
    );
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains("--outtype q4_k"), "{}", run.stderr);
}

/// `tallow export --adapter-only` writes the adapter file llama.cpp's `convert_lora_to_gguf.py`
/// writes from the same PEFT adapter (key for key, tensor for tensor, byte for byte; Llama's q / k
/// B rows in llama.cpp's rotary order). An rsLoRA adapter is written with alpha * sqrt(r), so that
/// llama.cpp's alpha / r is PEFT's alpha / sqrt(r) (the converter writes alpha as it is); DoRA is
/// refused.
#[test]
fn adapter_only_export_writes_what_convert_lora_to_gguf_writes() {
    let tmp = scratch("gguf-lora");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    let export = |model: &str, adapter: &str, outtype: &str, out: &Path| {
        tallow_env(
            [
                "export",
                "--model",
                model_dir(model).to_str().unwrap(),
                "--adapter",
                fixtures().join("adapters").join(adapter).to_str().unwrap(),
                "--adapter-only",
                "--outtype",
                outtype,
                "--out",
                out.to_str().unwrap(),
            ],
            &env,
        )
    };
    for (model, adapter, outtype, fixture) in [
        (
            "tiny-llama",
            "tiny-llama-peft",
            "f32",
            "tiny-llama-peft-f32.gguf",
        ),
        (
            "tiny-qwen2",
            "tiny-qwen2-peft",
            "f16",
            "tiny-qwen2-peft-f16.gguf",
        ),
        (
            "tiny-mistral",
            "tiny-mistral-peft",
            "f16",
            "tiny-mistral-peft-f16.gguf",
        ),
        (
            "tiny-gemma2",
            "tiny-gemma2-peft",
            "f16",
            "tiny-gemma2-peft-f16.gguf",
        ),
        (
            "tiny-gemma3",
            "tiny-gemma3-peft",
            "f16",
            "tiny-gemma3-peft-f16.gguf",
        ),
        // Phi-3's fused qkv_proj / gate_up_proj pairs, as PEFT trains them
        (
            "tiny-phi3",
            "tiny-phi3-peft",
            "f16",
            "tiny-phi3-peft-f16.gguf",
        ),
    ] {
        let out = tmp.join(fixture);
        let run = export(model, adapter, outtype, &out);
        assert_eq!(run.code, 0, "{}", run.stderr);
        assert_same_gguf(&out, fixture);
    }
    let out = tmp.join("rslora.gguf");
    let run = export("tiny-qwen2", "tiny-qwen2-peft-rslora", "f32", &out);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let cfg = read_json(&fixtures().join("adapters/tiny-qwen2-peft-rslora/adapter_config.json"));
    let (r, alpha) = (
        cfg["r"].as_f64().unwrap(),
        cfg["lora_alpha"].as_f64().unwrap(),
    );
    let (meta, _) = dump(&out);
    assert_eq!(
        meta["adapter.lora.alpha"],
        format!("{:?}", gguf_file::Value::F32((alpha * r.sqrt()) as f32))
    );
    let run = export(
        "tiny-qwen2",
        "tiny-qwen2-peft-dora",
        "f32",
        &tmp.join("dora.gguf"),
    );
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains("`use_dora`"), "{}", run.stderr);
}

/// A truncated GGUF (its metadata cut, or its tensor data) stops eval with a message that names
/// the user's file, says what is missing and what to do; exit code non-zero.
#[test]
fn a_truncated_file_is_named_with_the_fix() {
    let tmp = scratch("gguf-truncated");
    let env = [("TALLOW_CACHE_DIR", tmp.join("cache").display().to_string())];
    let bytes = std::fs::read(gguf_fixture("tiny-qwen2-f16.gguf")).unwrap();
    for (keep, what) in [(2000, "array of 323 elements"), (100_000, "tensor `")] {
        let file = tmp.join(format!("cut-{keep}.gguf"));
        std::fs::write(&file, &bytes[..keep]).unwrap();
        let run = tallow_env(
            [
                "eval",
                "--model",
                file.to_str().unwrap(),
                "--data",
                data_file("text").to_str().unwrap(),
            ],
            &env,
        );
        assert_ne!(run.code, 0);
        for needle in [
            &format!("{}: not a readable GGUF file", file.display()),
            what,
            "truncated or corrupt",
        ] {
            assert!(
                run.stderr.contains(needle),
                "`{needle}` not in: {}",
                run.stderr
            );
        }
    }
}

/// Ranks of a data-parallel run (here: four processes at once) prepare the same file's model dir
/// in an empty cache: all four do stage one (without the clean-up the test finds 4 dirs), the
/// first rename wins, the others keep its dir and remove theirs; each reads the model and all
/// compute the same loss. (Replacing the dir each time, as before, did not fail here in three
/// runs: the window in which a rank reads a dir being replaced is short.)
#[test]
fn processes_preparing_the_same_file_at_once_all_read_it() {
    let tmp = scratch("gguf-race");
    let file = gguf_fixture("tiny-qwen2-f16.gguf");
    let children: Vec<_> = (0..4)
        .map(|_| {
            std::process::Command::new(tallow_bin())
                .args([
                    "eval",
                    "--model",
                    file.to_str().unwrap(),
                    "--data",
                    data_file("text").to_str().unwrap(),
                    "--dtype",
                    "f32",
                    "--json",
                ])
                .env("TALLOW_CACHE_DIR", tmp.join("cache"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut losses = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        losses.push(v["loss"].as_f64().unwrap());
    }
    assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
    let dirs = std::fs::read_dir(tmp.join("cache/gguf")).unwrap().count();
    assert_eq!(dirs, 1, "one model dir, no staging dirs left");
}
