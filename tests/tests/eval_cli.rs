//! `tallow eval` end to end: the binary, the data pipeline and the model together against the
//! transformers reference losses, batch-size invariance, and bad input.

use candle_core::{DType, Device};
use tallow_model::{CausalLM, LoadOptions};
use tallow_tests::*;
use tallow_text::TextTokenizer;
use tallow_trainer::eval::evaluate;
use tallow_trainer::{load_jsonl, DataOptions, Format};

/// CLI loss equals transformers' loss within 1e-4 for every model and data format.
#[test]
fn eval_matches_transformers_for_every_model_and_format() {
    for model in MODELS {
        let reference = reference_json(model);
        for format in model_formats(model) {
            let dir = model_dir(model);
            let data = data_file(format);
            let out = eval_json(&[
                "eval",
                "--model",
                dir.to_str().unwrap(),
                "--data",
                data.to_str().unwrap(),
                "--max-seq-len",
                "32",
                "--dtype",
                "f32",
                "--json",
            ]);
            let f = &reference["formats"][format];
            let want = f["loss"].as_f64().unwrap();
            let got = out["loss"].as_f64().unwrap();
            assert!(
                (got - want).abs() < 1e-4,
                "{model} {format}: {got} vs {want}"
            );
            let tokens: u64 = f["n_targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .sum();
            assert_eq!(out["tokens"].as_u64().unwrap(), tokens);
            assert_eq!(
                out["skipped"].as_u64().unwrap(),
                f["skipped"].as_u64().unwrap()
            );
            assert!((out["perplexity"].as_f64().unwrap() - got.exp()).abs() < 1e-6 * got.exp());
        }
    }
}

/// Padding and batch size do not change the result (relative 1e-6 in f32).
#[test]
fn batch_size_and_padding_do_not_change_eval() {
    for model_name in MODELS {
        let dir = model_dir(model_name);
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let model = CausalLM::load(&dir, &LoadOptions::frozen(DType::F32, &Device::Cpu)).unwrap();
        let mut examples = Vec::new();
        for format in model_formats(model_name) {
            let opts = DataOptions {
                format: Format::Auto,
                max_seq_len: 32,
                add_eos: true,
                ..Default::default()
            };
            examples.extend(
                load_jsonl(&data_file(format), &tok, &opts)
                    .unwrap()
                    .examples,
            );
        }
        let lengths: std::collections::HashSet<usize> =
            examples.iter().map(|e| e.ids.len()).collect();
        assert!(
            lengths.len() > 2,
            "rows of different lengths, so batches are padded"
        );
        let one = evaluate(&model, &examples, 1, 0, |_| {}).unwrap();
        for bs in [2, 3, 64] {
            // Pad with a token id that is not 0 as well, to show the pad value is never read.
            let r = evaluate(&model, &examples, bs, 7, |_| {}).unwrap();
            assert_eq!(r.tokens, one.tokens);
            let rel = (r.loss - one.loss).abs() / one.loss;
            assert!(
                rel < 1e-6,
                "{model_name}: batch {bs} gives {} vs {}",
                r.loss,
                one.loss
            );
        }
    }
}

#[test]
fn malformed_jsonl_line_is_named_with_file_and_line() {
    let dir = scratch("malformed");
    let data = dir.join("bad.jsonl");
    std::fs::write(&data, "{\"text\": \"fine\"}\n\n{\"text\": \"broken\"\n").unwrap();
    let r = tallow([
        "eval",
        "--model",
        model_dir("tiny-qwen2").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("bad.jsonl") && r.stderr.contains(":3") || r.stderr.contains("line 3"),
        "{}",
        r.stderr
    );
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = scratch("arch");
    copy_model("tiny-qwen2", &dir);
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("Qwen2ForCausalLM", "GPT2LMHeadModel"),
    )
    .unwrap();
    let r = tallow([
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("GPT2LMHeadModel") && r.stderr.contains("Qwen3ForCausalLM"),
        "{}",
        r.stderr
    );
}

#[test]
fn truncated_safetensors_is_reported_as_such() {
    let dir = scratch("truncated");
    copy_model("tiny-qwen2", &dir);
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let r = tallow([
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("model.safetensors") && r.stderr.contains("truncated"),
        "{}",
        r.stderr
    );
}

#[test]
fn missing_tokenizer_is_reported() {
    let dir = scratch("notok");
    copy_model("tiny-qwen2", &dir);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let r = tallow([
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("tokenizer.json"), "{}", r.stderr);
}

#[test]
fn shape_mismatch_between_config_and_weights_is_reported() {
    let dir = scratch("shape");
    copy_model("tiny-qwen2", &dir);
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"intermediate_size\": 160", "\"intermediate_size\": 96"),
    )
    .unwrap();
    let r = tallow([
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("gate_proj.weight") && r.stderr.contains("shape"),
        "{}",
        r.stderr
    );
}

/// The CPU build hands `--device cuda` to `tallow-cuda` after checking the driver, device and
/// libraries; on a machine without them it names the first thing missing (tests/tests/gpu_cli.rs
/// goes through each case with a fake driver).
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_in_the_cpu_build_names_what_is_missing() {
    let r = tallow([
        "eval",
        "--model",
        model_dir("tiny-qwen2").to_str().unwrap(),
        "--data",
        data_file("text").to_str().unwrap(),
        "--device",
        "cuda",
    ]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.starts_with("error: --device cuda: "),
        "{}",
        r.stderr
    );
    assert!(
        [
            "no NVIDIA driver",
            "sees no GPU",
            "failed to initialize",
            "tallow-cuda"
        ]
        .iter()
        .any(|w| r.stderr.contains(w)),
        "{}",
        r.stderr
    );
}

/// A parquet copy of each data fixture (`scripts/make_parquet_fixtures.py`: snappy, rows spread
/// over several row groups, messages as a list of structs) gives exactly the rows of the JSONL
/// file, and `tallow eval` gives exactly the same loss on it.
#[test]
fn parquet_rows_equal_jsonl_rows() {
    let dir = model_dir("tiny-qwen3");
    let tok = TextTokenizer::from_model_dir(&dir).unwrap();
    let opts = DataOptions {
        format: Format::Auto,
        max_seq_len: 32,
        add_eos: true,
        ..Default::default()
    };
    for format in FORMATS {
        let jsonl = data_file(format);
        let parquet = jsonl.with_extension("parquet");
        let a = load_jsonl(&jsonl, &tok, &opts).unwrap();
        let b = load_jsonl(&parquet, &tok, &opts).unwrap();
        assert_eq!(a.format, b.format, "{format}");
        assert_eq!(a.examples.len(), b.examples.len(), "{format}");
        for (x, y) in a.examples.iter().zip(&b.examples) {
            assert_eq!(x.ids, y.ids, "{format}: token ids differ");
            assert_eq!(x.targets, y.targets, "{format}: targets differ");
        }
        let args = |p: &std::path::Path| {
            vec![
                "eval".to_string(),
                "--model".into(),
                dir.display().to_string(),
                "--data".into(),
                p.display().to_string(),
                "--json".into(),
            ]
        };
        let la = eval_loss(&args(&jsonl).iter().map(String::as_str).collect::<Vec<_>>());
        let lb = eval_loss(
            &args(&parquet)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        assert_eq!(
            la, lb,
            "{format}: eval loss differs between JSONL and parquet"
        );
    }
    // Not parquet at all: a clear error naming the file.
    let bad = scratch("bad-parquet").join("x.parquet");
    std::fs::write(&bad, b"not a parquet file").unwrap();
    let e = load_jsonl(&bad, &tok, &opts).err().unwrap().to_string();
    assert!(
        e.contains("cannot read parquet file") && e.contains("x.parquet"),
        "{e}"
    );
}

/// Alpaca and ShareGPT rows, auto-detected, evaluate exactly as the rows they map to: ShareGPT
/// (human / gpt / system) as the messages fixture, Alpaca as prompt_completion rows whose prompt
/// is Stanford Alpaca's template (with and without an input). And a bad ShareGPT role is named
/// with its file, line and turn.
#[test]
fn alpaca_and_sharegpt_rows_evaluate_as_the_rows_they_map_to() {
    let dir = model_dir("tiny-qwen3");
    let work = scratch("alpaca-sharegpt");
    let eval = |path: &std::path::Path, format: &str| {
        let d = dir.display().to_string();
        let p = path.display().to_string();
        eval_loss(&[
            "eval", "--model", &d, "--data", &p, "--format", format, "--json",
        ])
    };
    // ShareGPT: the messages fixture with ShareGPT's names.
    let messages = std::fs::read_to_string(data_file("messages")).unwrap();
    let mut share = String::new();
    for line in messages.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let turns: Vec<serde_json::Value> = v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let from = match m["role"].as_str().unwrap() {
                    "user" => "human",
                    "assistant" => "gpt",
                    other => other,
                };
                serde_json::json!({"from": from, "value": m["content"]})
            })
            .collect();
        share += &format!("{}\n", serde_json::json!({ "conversations": turns }));
    }
    let share_path = work.join("sharegpt.jsonl");
    std::fs::write(&share_path, share).unwrap();
    let want = eval(&data_file("messages"), "messages");
    assert_eq!(eval(&share_path, "auto"), want, "sharegpt (auto)");
    assert_eq!(eval(&share_path, "sharegpt"), want, "sharegpt");

    // Alpaca: the same rows as prompt_completion with the template written out.
    let rows = [
        ("Name a colour.", "", "Blue."),
        ("Add the numbers.", "2 and 3", "5"),
        ("Translate to French.", "Good morning", "Bonjour"),
    ];
    let (alpaca, pc) = alpaca_and_prompt_completion(&rows, |instruction, input| {
        if input.is_empty() {
            format!(
                "Below is an instruction that describes a task. Write a response that \
                 appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n\
                 ### Response:\n"
            )
        } else {
            format!(
                "Below is an instruction that describes a task, paired with an input that \
                 provides further context. Write a response that appropriately completes the \
                 request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n\
                 ### Response:\n"
            )
        }
    });
    let (alpaca_path, pc_path) = (work.join("alpaca.jsonl"), work.join("pc.jsonl"));
    std::fs::write(&alpaca_path, alpaca).unwrap();
    std::fs::write(&pc_path, pc).unwrap();
    let want = eval(&pc_path, "prompt_completion");
    assert_eq!(eval(&alpaca_path, "auto"), want, "alpaca (auto)");
    assert_eq!(eval(&alpaca_path, "alpaca"), want, "alpaca");

    // A turn from a role tallow does not read: file, line, turn and value named.
    let bad = work.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}\n\
         {\"conversations\": [{\"from\": \"function_call\", \"value\": \"{}\"}]}\n",
    )
    .unwrap();
    let r = tallow([
        "eval",
        "--model",
        &dir.display().to_string(),
        "--data",
        &bad.display().to_string(),
    ]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("bad.jsonl:2:")
            && r.stderr
                .contains("conversations[0].from is `function_call`"),
        "{}",
        r.stderr
    );
}
