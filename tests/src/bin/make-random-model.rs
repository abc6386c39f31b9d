//! Dev tool: a random-weight model with the shapes of a hand-written config.json, a fixture
//! tokenizer, and a JSONL file of long text rows, for memory and speed benchmarks (no hub
//! needed). Weights ~ N(0, 0.02), norms 1.
//!
//!   cargo run --release -p tallow-tests --bin make-random-model -- \
//!       CONFIG_JSON OUT_DIR [--dtype bf16|f32] [--rows 64] [--row-words 600] [--bnb-4bit true]
//!       [--shrink true]
//!
//! Writes OUT_DIR/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
//! bench.jsonl}. Tensors are generated and written one shard (~2 GB) at a time.
//!
//! `--bnb-4bit true` writes a pre-quantized checkpoint as transformers saves a bitsandbytes
//! 4-bit model (NF4, double quantization, `QuantState.as_dict(packed=True)`'s tensors and a
//! `quantization_config` in config.json), its decoder linears quantized by tallow's NF4
//! quantizer: a `*-bnb-4bit` repo of any size for the estimate's tests, where the real
//! bitsandbytes fixture (`tiny-qwen2-bnb-4bit`) is too small to measure.
//!
//! `--shrink true` keeps the config's architecture (family, biases, tying, rope scaling) at toy
//! sizes, as `scripts/bench_peft_reference.py make-model --shrink` does: hidden 64, 2 layers,
//! 4 heads (2 key/value heads), vocabulary 384 (just above the fixture tokenizer's ids).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use tallow_model::kernels::blockwise8::dynamic_map;
use tallow_model::kernels::nf4::{Absmax, Nf4Weight, NF4_CODE};
use tallow_model::DecoderConfig;

fn usage() -> ! {
    eprintln!(
        "usage: make-random-model CONFIG_JSON OUT_DIR [--dtype bf16|f32] [--rows N] \
         [--row-words N] [--bnb-4bit true|false] [--shrink true|false]"
    );
    std::process::exit(2)
}

/// The tensors transformers saves for one bitsandbytes NF4 weight with double quantization
/// (`{name}`, `.absmax`, `.quant_map`, `.nested_absmax`, `.nested_quant_map`,
/// `.quant_state.bitsandbytes__nf4`), from tallow's quantization of `w`.
fn bnb_tensors(
    name: &str,
    w: &Tensor,
    dtype: DType,
) -> Result<Vec<(String, Tensor)>, Box<dyn std::error::Error>> {
    let q = Nf4Weight::quantize(w, true)?;
    let Absmax::Double { nested, offset } = &q.absmax else {
        unreachable!("double quantization asked for")
    };
    let n = q.elem_count();
    let state = serde_json::json!({
        "quant_type": "nf4",
        "blocksize": q.block,
        "dtype": if dtype == DType::BF16 { "bfloat16" } else { "float32" },
        "shape": [q.shape.0, q.shape.1],
        "nested_blocksize": nested.block,
        "nested_offset": offset,
    });
    let state = state.to_string().into_bytes();
    let cpu = &Device::Cpu;
    Ok(vec![
        (
            name.to_string(),
            q.bnb_packed()?.reshape((n.div_ceil(2), 1))?,
        ),
        (format!("{name}.absmax"), nested.codes.clone()),
        (
            format!("{name}.quant_map"),
            Tensor::new(&NF4_CODE[..], cpu)?,
        ),
        (format!("{name}.nested_absmax"), nested.absmax.clone()),
        (
            format!("{name}.nested_quant_map"),
            Tensor::new(&dynamic_map(true)[..], cpu)?,
        ),
        (
            format!("{name}.quant_state.bitsandbytes__nf4"),
            Tensor::from_vec(state.clone(), state.len(), cpu)?,
        ),
    ])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        usage();
    }
    let (config, out) = (PathBuf::from(&args[0]), PathBuf::from(&args[1]));
    let (mut dtype, mut rows, mut row_words) = (DType::BF16, 64usize, 600usize);
    let (mut bnb, mut shrink) = (false, false);
    let mut it = args[2..].iter();
    while let Some(flag) = it.next() {
        let v = it.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--dtype" => {
                dtype = match v.as_str() {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    _ => usage(),
                }
            }
            "--rows" => rows = v.parse()?,
            "--row-words" => row_words = v.parse()?,
            "--bnb-4bit" => bnb = v.parse()?,
            "--shrink" => shrink = v.parse()?,
            _ => usage(),
        }
    }
    std::fs::create_dir_all(&out)?;
    std::fs::copy(&config, out.join("config.json"))?;
    if shrink {
        // scripts/bench_peft_reference.py's SHRINK, key for key
        let mut raw: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config)?)?;
        for (k, v) in [
            ("hidden_size", 64),
            ("intermediate_size", 128),
            ("num_hidden_layers", 2),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("vocab_size", 384),
            ("bos_token_id", 320),
            ("eos_token_id", 321),
        ] {
            raw[k] = v.into();
        }
        if raw.get("head_dim").is_some() {
            raw["head_dim"] = 16.into();
        }
        if raw.get("max_window_layers").is_some() {
            raw["max_window_layers"] = 2.into();
        }
        std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&raw)?)?;
    }
    let c = DecoderConfig::from_dir(&out)?;
    if bnb {
        // what transformers writes for a model loaded with BitsAndBytesConfig(load_in_4bit=True,
        // bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        let mut raw = c.raw.clone();
        raw["quantization_config"] = serde_json::json!({
            "quant_method": "bitsandbytes", "load_in_4bit": true, "load_in_8bit": false,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
            "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": null,
        });
        std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&raw)?)?;
    }
    let linears: Vec<String> = (0..c.num_hidden_layers)
        .flat_map(|i| {
            c.layer_linears()
                .into_iter()
                .map(move |l| format!("model.layers.{i}.{}.weight", l.path))
        })
        .collect();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizers/bos");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tok.join(f), out.join(f))?;
    }

    // Shards of at most ~2 GB, with an index when there is more than one.
    let shapes = c.hf_tensor_shapes();
    let limit = 2usize << 30;
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![vec![]];
    let mut size = 0;
    for (n, s) in shapes {
        let bytes = s.iter().product::<usize>() * dtype.size_in_bytes();
        if size + bytes > limit && !shards.last().unwrap().is_empty() {
            shards.push(vec![]);
            size = 0;
        }
        size += bytes;
        shards.last_mut().unwrap().push((n, s));
    }
    let n_shards = shards.len();
    let mut index = serde_json::Map::new();
    let mut params = 0usize;
    for (k, shard) in shards.into_iter().enumerate() {
        let file = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n_shards:05}.safetensors", k + 1)
        };
        let mut tensors = HashMap::new();
        for (n, s) in shard {
            params += s.iter().product::<usize>();
            let t = if n.ends_with("norm.weight") {
                Tensor::ones(s.as_slice(), DType::F32, &Device::Cpu)?
            } else if n.ends_with(".bias") {
                Tensor::zeros(s.as_slice(), DType::F32, &Device::Cpu)?
            } else {
                Tensor::randn(0f32, 0.02, s.as_slice(), &Device::Cpu)?
            };
            if bnb && linears.contains(&n) {
                for (k, v) in bnb_tensors(&n, &t.to_dtype(dtype)?, dtype)? {
                    index.insert(k.clone(), file.clone().into());
                    tensors.insert(k, v);
                }
                continue;
            }
            index.insert(n.clone(), file.clone().into());
            tensors.insert(n, t.to_dtype(dtype)?);
        }
        candle_core::safetensors::save(&tensors, out.join(&file))?;
    }
    if n_shards > 1 {
        let idx = serde_json::json!({"metadata": {}, "weight_map": index});
        std::fs::write(
            out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&idx)?,
        )?;
    }

    // Text rows of `row_words` words from a fixed list, deterministic.
    let words = "the of and to in is was for on that with as by at from his her their which \
                 this be are model train data memory layer weight"
        .split(' ')
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>();
    let mut f = std::io::BufWriter::new(std::fs::File::create(out.join("bench.jsonl"))?);
    let mut s: u64 = 1;
    for _ in 0..rows {
        let text: Vec<&str> = (0..row_words)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                words[(s >> 33) as usize % words.len()]
            })
            .collect();
        writeln!(f, "{}", serde_json::json!({ "text": text.join(" ") }))?;
    }
    println!(
        "{} parameters, {} shard(s) in {}",
        params,
        n_shards,
        out.display()
    );
    Ok(())
}
