//! NF4 base weights (QLoRA) end to end: `eval --quantize nf4` against the same model with its
//! weights replaced by their NF4 round trip, bitsandbytes 4-bit checkpoints (loading, reference
//! loss), training, merging, and bad input.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tallow_model::{Base, CausalLM, LoadOptions, Nf4Weight};
use tallow_tests::*;

/// The decoder linears (the ones NF4 quantizes), as PEFT names them.
use tallow_model::peft::KNOWN_MODULES as LINEARS;

fn bnb_dir() -> PathBuf {
    model_dir("tiny-qwen2-bnb-4bit")
}

fn is_decoder_linear(name: &str) -> bool {
    name.starts_with("model.layers.")
        && name.ends_with(".weight")
        && LINEARS.iter().any(|l| name.contains(&format!(".{l}.")))
}

/// Copies fixture `model` to `dest`, with every decoder linear weight replaced by its NF4 round
/// trip (quantize, dequantize, in f32), shard by shard.
fn write_round_trip_model(model: &str, dest: &Path, double_quant: bool) {
    copy_model(model, dest);
    for entry in std::fs::read_dir(dest).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for (name, t) in tensors.iter_mut() {
            if is_decoder_linear(name) {
                let w = t.to_dtype(DType::F32).unwrap();
                *t = Nf4Weight::quantize(&w, double_quant)
                    .unwrap()
                    .dequantize()
                    .unwrap();
            }
        }
        candle_core::safetensors::save(&tensors, &path).unwrap();
    }
}

fn eval_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "eval",
        "--model",
        model,
        "--data",
        "DATA",
        "--max-seq-len",
        "32",
        "--dtype",
        "f32",
        "--json",
    ];
    a.extend_from_slice(extra);
    a
}

fn eval_with(model: &Path, data: &Path, extra: &[&str]) -> serde_json::Value {
    let m = model.to_str().unwrap();
    let d = data.to_str().unwrap();
    let args: Vec<&str> = eval_args(m, extra)
        .into_iter()
        .map(|a| if a == "DATA" { d } else { a })
        .collect();
    eval_json(&args)
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// Done-when of the issue: eval of an NF4 model equals eval of the same model whose decoder
/// linear weights were replaced by their NF4 round trip. Tolerance 1e-5 relative: the same
/// weights in f32, but the NF4 forward multiplies with a freshly dequantized matrix through a
/// custom op, the reference with a loaded one (same matmul kernel; differences are summation
/// order at most).
#[test]
fn eval_nf4_equals_eval_of_the_round_trip_model() {
    for (model, dq) in [
        ("tiny-qwen2", true),
        ("tiny-qwen2", false),
        ("tiny-llama", true),
        ("tiny-qwen3", true),
        ("tiny-mistral", true),
        ("tiny-gemma2", true),
        ("tiny-phi3", true), // the fused qkv_proj / gate_up_proj quantized like any linear
        ("tiny-gemma3", true),
    ] {
        let dir = scratch(&format!("nf4-rt-{model}-{dq}"));
        write_round_trip_model(model, &dir, dq);
        let data = data_file("text");
        let dq_flag = if dq { "true" } else { "false" };
        let nf4 = eval_with(
            &model_dir(model),
            &data,
            &["--quantize", "nf4", "--double-quant", dq_flag],
        );
        let rt = eval_with(&dir, &data, &[]);
        let plain = eval_with(&model_dir(model), &data, &[]);
        let layers = match model {
            "tiny-gemma2" => 4,
            "tiny-gemma3" => 6,
            _ => 2,
        };
        let per_layer = if model == "tiny-phi3" { 4 } else { 7 }; // Phi-3's fused linears
        assert_eq!(
            nf4["nf4_weights"].as_u64(),
            Some(layers * per_layer),
            "{model}: {layers} layers x {per_layer}"
        );
        assert_eq!(rt["nf4_weights"].as_u64(), Some(0));
        let (a, b, p) = (
            nf4["loss"].as_f64().unwrap(),
            rt["loss"].as_f64().unwrap(),
            plain["loss"].as_f64().unwrap(),
        );
        assert!(
            rel(a, b) < 1e-5,
            "{model} dq={dq}: nf4 {a} vs round trip {b}"
        );
        // And the test can tell them apart: quantization moves the loss at least 20 times
        // further than the NF4 / round-trip difference.
        assert!(
            (a - b).abs() * 20.0 < (a - p).abs(),
            "{model}: nf4 {a}, round trip {b}, unquantized {p}"
        );
    }
}

/// The bitsandbytes checkpoint saved by transformers loads as the same NF4 weights tallow makes
/// from the original model: identical 4-bit codes and fp32 absmax; given bitsandbytes' offset,
/// identical nested codes and nested absmax, and bit-identical dequantized weights. With its own
/// offset (the correctly rounded mean; torch's fp32 mean depends on its summation order, see
/// `double_quantize`) tallow's offset is within 1 ulp and a nested code may move by one step
/// where that ulp crosses a rounding boundary (a few positions at most).
#[test]
fn bnb_4bit_checkpoint_loads_as_quantizing_the_original() {
    use tallow_model::kernels::blockwise8::quantize_blockwise;
    use tallow_model::kernels::nf4::Absmax;
    let opts = LoadOptions::frozen(DType::F32, &Device::Cpu);
    let bnb = CausalLM::load(&bnb_dir(), &opts).unwrap();
    let original = tallow_model::Weights::from_dir(&model_dir("tiny-qwen2")).unwrap();
    let a = bnb.nf4_weights();
    assert_eq!(a.len(), 14);
    let mut moved_codes = 0;
    for (name, wa) in a {
        let w = original.load(&name, &[wa.shape.0, wa.shape.1], DType::F32, &Device::Cpu);
        let w = w.unwrap();
        let plain = Nf4Weight::quantize(&w, false).unwrap();
        let ours = Nf4Weight::quantize(&w, true).unwrap();
        assert_eq!(wa.block, 64);
        let codes = |t: &Tensor| t.to_vec1::<u8>().unwrap();
        assert_eq!(
            codes(&wa.packed),
            codes(&plain.packed),
            "{name}: 4-bit codes"
        );
        let (
            Absmax::Double {
                nested: na,
                offset: oa,
            },
            Absmax::Double {
                nested: no,
                offset: oo,
            },
            Absmax::F32(fp32),
        ) = (&wa.absmax, &ours.absmax, &plain.absmax)
        else {
            panic!("{name}: double-quantized");
        };
        assert!(
            oa.to_bits().abs_diff(oo.to_bits()) <= 1,
            "{name}: {oa} vs {oo}"
        );
        let nested = quantize_blockwise(&(fp32 - *oa as f64).unwrap(), true, 256).unwrap();
        assert_eq!(max_abs_diff(&na.absmax, &nested.absmax), 0.0, "{name}");
        // Nested codes: one of the 1344 differs by one step (model.layers.0.mlp.down_proj, index
        // 131: 132 in bitsandbytes, 133 here) even with bitsandbytes' own offset, i.e. in the
        // 8-bit blockwise rounding of a value on a boundary (bitsandbytes' C++ CPU kernel vs
        // quantize_blockwise); allowed: single steps at a few positions.
        for (x, y) in codes(&na.codes).iter().zip(&codes(&nested.codes)) {
            assert!(x.abs_diff(*y) <= 1, "{name}: nested code {x} vs {y}");
            moved_codes += usize::from(x != y);
        }
        for (x, y) in codes(&na.codes).iter().zip(&codes(&no.codes)) {
            assert!(
                x.abs_diff(*y) <= 1,
                "{name}: nested code {x} vs {y} (own offset)"
            );
        }
        let same_offset = Nf4Weight {
            absmax: Absmax::Double {
                nested,
                offset: *oa,
            },
            ..plain.clone()
        };
        let (da, ds) = (wa.dequantize().unwrap(), same_offset.dequantize().unwrap());
        let d = max_abs_diff(&da, &ds) / max_abs(&ds);
        assert!(d < 1e-2, "{name}: dequantized differ by {d} (relative)");
    }
    assert!(moved_codes <= 4, "{moved_codes} nested codes moved");
    // The rest of the model (embeddings, norms, biases) is stored as is.
    let dense = CausalLM::load(&model_dir("tiny-qwen2"), &opts).unwrap();
    let la: HashMap<String, Tensor> = bnb
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.tensor().clone()))
        .collect();
    let mut n_dense = 0;
    for (n, p) in dense.named_params() {
        if is_decoder_linear(&n) {
            continue;
        }
        assert_eq!(max_abs_diff(&la[&n], p.tensor()), 0.0, "{n}");
        n_dense += 1;
    }
    assert_eq!(n_dense, la.len());
}

/// `tallow eval` of the bitsandbytes checkpoint equals transformers + bitsandbytes' loss on it
/// (reference/tiny-qwen2-bnb-4bit.json), within 1e-4 like the unquantized parity tests.
#[test]
fn eval_of_bnb_4bit_checkpoint_matches_transformers() {
    let p = fixtures().join("reference/tiny-qwen2-bnb-4bit.json");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let out = eval_with(&bnb_dir(), &data_file("text"), &[]);
    let got = out["loss"].as_f64().unwrap();
    let want = reference["loss"].as_f64().unwrap();
    assert_eq!(out["tokens"].as_u64(), reference["n_targets"].as_u64());
    assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    // Distinguishable from the unquantized model's loss.
    let unq = reference["loss_unquantized"].as_f64().unwrap();
    assert!((got - unq).abs() > 1e-3, "{got} vs unquantized {unq}");
}

fn train_config(dir: &Path, method: &str, quantize: &str) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\nquantize = \"{quantize}\"\n[lora]\nrank = 4\nalpha = 8\ndropout = 0.0\n[data]\ntrain = \"{}\"\neval = \"{}\"\nmax_seq_len = 32\n[train]\nmethod = \"{method}\"\noutput_dir = \"{}\"\nmax_steps = 6\nlr = 1e-2\nmicro_batch_size = 4\n",
        model_dir("tiny-qwen2").display(),
        data_file("text").display(),
        data_file("text").display(),
        dir.join("run").display(),
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// QLoRA: a short LoRA run on an NF4 base trains (its eval loss falls) and its adapter applies
/// to the NF4 base in `eval --quantize nf4 --adapter`.
#[test]
fn lora_training_on_an_nf4_base_lowers_the_eval_loss() {
    let dir = scratch("nf4-train");
    let cfg = train_config(&dir, "lora", "nf4");
    let r = tallow(["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let evals: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["eval_loss"].as_f64())
        .collect();
    assert!(evals.len() >= 2, "{metrics}");
    let (first, last) = (evals[0], *evals.last().unwrap());
    assert!(last < first - 0.05, "eval loss {first} -> {last}");
    // The run's end-of-training eval equals a fresh `eval --quantize nf4 --adapter`.
    let adapter = dir.join("run/adapter");
    let out = eval_with(
        &model_dir("tiny-qwen2"),
        &data_file("text"),
        &["--quantize", "nf4", "--adapter", adapter.to_str().unwrap()],
    );
    let l = out["loss"].as_f64().unwrap();
    assert!(rel(l, last) < 1e-5, "eval {l} vs end of training {last}");
}

/// Merging into an NF4 base (a bitsandbytes checkpoint, or --quantize nf4) writes a dense model
/// whose eval equals the unmerged NF4 base + adapter (f32 merge and save: 1e-5 relative).
#[test]
fn merge_into_an_nf4_base_equals_the_unmerged_model() {
    let adapter = fixtures().join("adapters/tiny-qwen2-peft");
    let data = data_file("text");
    let cases: [(PathBuf, &[&str]); 2] = [
        (bnb_dir(), &[]),
        (model_dir("tiny-qwen2"), &["--quantize", "nf4"]),
    ];
    for (i, (base, flags)) in cases.iter().enumerate() {
        let out = scratch(&format!("nf4-merge-{i}"));
        let merged = out.join("merged");
        let mut args = vec![
            "merge",
            "--model",
            base.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
            "--dtype",
            "f32",
        ];
        args.extend_from_slice(flags);
        let r = tallow(&args);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let cfg = std::fs::read_to_string(merged.join("config.json")).unwrap();
        assert!(!cfg.contains("quantization_config"), "a dense model now");
        let st =
            candle_core::safetensors::load(merged.join("model.safetensors"), &Device::Cpu).unwrap();
        assert!(st.values().all(|t| t.dtype() == DType::F32));
        let mut flags_adapter = flags.to_vec();
        flags_adapter.extend(["--adapter", adapter.to_str().unwrap()]);
        let unmerged = eval_with(base, &data, &flags_adapter)["loss"]
            .as_f64()
            .unwrap();
        let m = eval_with(&merged, &data, &[]);
        assert_eq!(m["nf4_weights"].as_u64(), Some(0));
        let ml = m["loss"].as_f64().unwrap();
        assert!(
            rel(ml, unmerged) < 1e-5,
            "case {i}: merged {ml} vs {unmerged}"
        );
    }
}

/// Rewrites the quant_state JSON of one weight of a copy of the bitsandbytes fixture.
fn damaged_bnb(name: &str, edit: impl Fn(&mut serde_json::Value) -> bool) -> PathBuf {
    let dir = scratch(name);
    copy_model("tiny-qwen2-bnb-4bit", &dir);
    let path = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let key = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4";
    let bytes = t[key].to_vec1::<u8>().unwrap();
    let mut state: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let fp4 = edit(&mut state);
    let new = serde_json::to_vec(&state).unwrap();
    t.remove(key);
    let new_key = if fp4 {
        key.replace("__nf4", "__fp4")
    } else {
        key.to_string()
    };
    let n = new.len();
    t.insert(new_key, Tensor::from_vec(new, n, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&t, &path).unwrap();
    dir
}

fn eval_fails(model: &Path, extra: &[&str]) -> String {
    let data = data_file("text");
    let mut args = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let r = tallow(&args);
    assert_ne!(r.code, 0, "expected a failure: {}", r.stdout);
    r.stderr
}

#[test]
fn fp4_checkpoint_is_refused_with_the_tensor_named() {
    let dir = damaged_bnb("nf4-fp4", |s| {
        s["quant_type"] = "fp4".into();
        true
    });
    let err = eval_fails(&dir, &[]);
    assert!(
        err.contains("fp4")
            && err.contains("model.layers.1.mlp.up_proj.weight")
            && err.contains("nf4"),
        "{err}"
    );
}

#[test]
fn unsupported_blocksize_is_refused() {
    let dir = damaged_bnb("nf4-block", |s| {
        s["blocksize"] = 100.into();
        false
    });
    let err = eval_fails(&dir, &[]);
    assert!(
        err.contains("blocksize 100") && err.contains("up_proj.weight"),
        "{err}"
    );
}

#[test]
fn other_quantization_methods_are_refused_by_name() {
    let dir = scratch("nf4-gptq");
    copy_model("tiny-qwen2-bnb-4bit", &dir);
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace(
            "\"quant_method\": \"bitsandbytes\"",
            "\"quant_method\": \"gptq\"",
        ),
    )
    .unwrap();
    let err = eval_fails(&dir, &[]);
    assert!(
        err.contains("quantization_config") && err.contains("gptq"),
        "{err}"
    );
}

#[test]
fn nf4_with_full_fine_tuning_is_an_error() {
    let dir = scratch("nf4-full");
    let cfg = train_config(&dir, "full", "nf4");
    let r = tallow(["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("model.quantize") && r.stderr.contains("lora"),
        "{}",
        r.stderr
    );
    // A bitsandbytes checkpoint cannot be fully fine-tuned either (library check).
    let opts = LoadOptions {
        train_base: true,
        ..LoadOptions::frozen(DType::F32, &Device::Cpu)
    };
    let err = CausalLM::load(&bnb_dir(), &opts).err().expect("an error");
    assert!(err.to_string().contains("4-bit"), "{err}");
}

/// The graph of an NF4 forward keeps no dequantized weight: the base stays 4-bit in the model.
#[test]
fn nf4_model_keeps_only_packed_weights() {
    let m = CausalLM::load(
        &model_dir("tiny-qwen2"),
        &LoadOptions::nf4(DType::F32, &Device::Cpu, true),
    )
    .unwrap();
    for l in &m.layers {
        for (n, lin) in l.linears() {
            assert!(matches!(lin.weight, Base::Nf4(_)), "{n}");
        }
    }
    // Embeddings and norms stay dense; 14 linears are NF4 and listed apart.
    assert_eq!(m.nf4_weights().len(), 14);
    assert!(m.named_params().iter().all(|(n, _)| !is_decoder_linear(n)));
}
