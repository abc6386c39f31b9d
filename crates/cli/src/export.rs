//! `tallow export --format gguf`: a model (with an adapter merged into it) as the GGUF file
//! llama.cpp's converter would write for it, for llama.cpp, Ollama and LM Studio (docs/gguf.md).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use tallow_model::io::gguf::write::{write_gguf, write_gguf_lora, LoraPair, OutType, Source};
use tallow_model::merge_lora;
use tallow_trainer::config::Quantize;

use crate::args::ExportArgs;
use crate::model;

pub fn run(a: ExportArgs) -> Result<()> {
    if a.format != "gguf" {
        bail!("--format {}: tallow exports gguf", a.format);
    }
    let Some(out) = OutType::parse(&a.outtype) else {
        bail!(
            "--outtype {}: expected f32, f16, bf16, q8_0, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, \
             q5_k_s, q5_k_m or q6_k",
            a.outtype
        );
    };
    let dir = model::dir(&a.model)?;
    if a.adapter_only {
        return adapter_only(&a, &dir, out);
    }
    // Merged in f32 on the CPU, rounded once to the output type.
    let opts = model::options(
        Quantize::None,
        false,
        DType::F32,
        &Device::Cpu,
        &a.ignore_config_keys,
    );
    let (mut m, _) = model::load(&dir, &opts, a.adapter.as_deref())?;
    if a.adapter.is_some() {
        merge_lora(&mut m)?;
    }
    let mut tensors: Vec<(String, Tensor)> = m
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.tensor().clone()))
        .collect();
    for (n, w) in m.nf4_weights() {
        tensors.push((n, w.dequantize()?));
    }
    let read = |name: &str| -> Result<Option<String>> {
        let p = dir.join(name);
        match p.exists() {
            true => Ok(Some(
                std::fs::read_to_string(&p).with_context(|| format!("{}", p.display()))?,
            )),
            false => Ok(None),
        }
    };
    let json = |name: &str| -> Result<serde_json::Value> {
        Ok(match read(name)? {
            Some(t) => serde_json::from_str(&t)
                .with_context(|| format!("{}: not valid JSON", dir.join(name).display()))?,
            None => serde_json::Value::Null,
        })
    };
    let tokenizer = json("tokenizer.json")?;
    let spm_path = dir.join("tokenizer.model");
    let tokenizer_model = match spm_path.exists() {
        true => Some(std::fs::read(&spm_path).with_context(|| format!("{}", spm_path.display()))?),
        false => None,
    };
    // a GGUF model dir without tokenizer.model: the file's own tokenizer keys
    let linked = dir.join(tallow_model::io::gguf::LINK);
    let gguf_tokenizer = match tokenizer_model.is_none() && linked.exists() {
        true => Some(tallow_model::io::gguf::GgufFile::open(&linked)?.tokenizer_keys()),
        false => None,
    };
    if tokenizer.is_null() && tokenizer_model.is_none() && gguf_tokenizer.is_none() {
        bail!(
            "{}: no tokenizer.json or tokenizer.model to write into the GGUF",
            dir.display()
        );
    }
    let chat_template = read("chat_template.jinja")?;
    let name = display_name(&a.model);
    let config = m.config.to_hf_json(DType::F32);
    let notes = write_gguf(
        &a.out,
        &tensors,
        &Source {
            name: &name,
            config: &config,
            tokenizer: &tokenizer,
            tokenizer_config: &json("tokenizer_config.json")?,
            chat_template: chat_template.as_deref(),
            tokenizer_model: tokenizer_model.as_deref(),
            added_tokens: &json("added_tokens.json")?,
            gguf_tokenizer: gguf_tokenizer.as_deref(),
            hyper: &m.config.gguf_hyper(),
        },
        out,
    )
    .with_context(|| format!("writing {}", a.out.display()))?;
    for n in notes {
        eprintln!("note: {n}");
    }
    println!(
        "exported {}{} -> {} (GGUF, {})",
        a.model.display(),
        a.adapter
            .as_ref()
            .map(|p| format!(" + {}", p.display()))
            .unwrap_or_default(),
        a.out.display(),
        a.outtype
    );
    Ok(())
}

/// `general.name` from the model's dir or file name, as llama.cpp's converter spells it
/// ("tiny-qwen2" -> "Tiny Qwen2").
fn display_name(path: &std::path::Path) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    stem.split(['-', '_'])
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `--adapter-only`: the PEFT adapter in llama.cpp's GGUF LoRA layout. llama.cpp scales a pair by
/// alpha / rank, so an rsLoRA adapter (alpha / sqrt(rank)) is written with alpha * sqrt(rank);
/// what llama.cpp cannot apply (DoRA, per-module alphas, trained embeddings or head) is refused.
fn adapter_only(a: &ExportArgs, dir: &std::path::Path, out: OutType) -> Result<()> {
    let Some(adapter) = &a.adapter else {
        bail!("--adapter-only needs --adapter DIR");
    };
    if out.is_k_quant() {
        bail!(
            "--outtype {}: an adapter is written in f32, f16, bf16 or q8_0 (llama.cpp's \
             convert_lora_to_gguf.py types); the k-quant mixes are for the model",
            a.outtype
        );
    }
    let cfg_path = adapter.join("adapter_config.json");
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&cfg_path).with_context(|| format!("{}", cfg_path.display()))?,
    )
    .with_context(|| format!("{}: not valid JSON", cfg_path.display()))?;
    let refuse = |key: &str, why: &str| -> Result<()> {
        bail!(
            "{}: `{key}`: {why}; merge it instead (tallow export without --adapter-only)",
            cfg_path.display()
        )
    };
    if cfg["use_dora"].as_bool() == Some(true) {
        refuse("use_dora", "llama.cpp's LoRA layout has no DoRA magnitudes")?;
    }
    if cfg["alpha_pattern"]
        .as_object()
        .is_some_and(|m| !m.is_empty())
    {
        refuse("alpha_pattern", "llama.cpp applies one alpha to every pair")?;
    }
    if cfg["modules_to_save"]
        .as_array()
        .is_some_and(|m| !m.is_empty())
    {
        refuse(
            "modules_to_save",
            "llama.cpp's LoRA layout holds LoRA pairs only",
        )?;
    }
    let rank = cfg["r"].as_f64().unwrap_or(8.0);
    let mut alpha = cfg["lora_alpha"].as_f64().unwrap_or(rank);
    if cfg["use_rslora"].as_bool() == Some(true) {
        alpha *= rank.sqrt();
    }
    let file = adapter.join("adapter_model.safetensors");
    let tensors = candle_core::safetensors::load(&file, &Device::Cpu)
        .with_context(|| format!("{}", file.display()))?;
    let mut pairs = Vec::new();
    for (name, t) in &tensors {
        let Some(module) = name
            .strip_prefix("base_model.model.")
            .and_then(|n| n.strip_suffix(".lora_A.weight"))
        else {
            if !name.ends_with(".lora_B.weight") {
                bail!("{}: `{name}` is not a LoRA A or B tensor", file.display());
            }
            continue;
        };
        let b_name = format!("base_model.model.{module}.lora_B.weight");
        let b = tensors
            .get(&b_name)
            .with_context(|| format!("{}: no `{b_name}` beside `{name}`", file.display()))?;
        pairs.push(LoraPair {
            weight: format!("{module}.weight"),
            a: t.clone(),
            b: b.clone(),
        });
    }
    let config = tallow_model::DecoderConfig::from_dir_ignoring(dir, &a.ignore_config_keys)?
        .to_hf_json(DType::F32);
    write_gguf_lora(
        &a.out,
        &pairs,
        alpha as f32,
        &config,
        &display_name(adapter),
        out,
    )
    .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "exported {} ({} LoRA pairs, alpha {alpha}) -> {} (GGUF LoRA adapter, {})",
        adapter.display(),
        pairs.len(),
        a.out.display(),
        a.outtype
    );
    Ok(())
}
