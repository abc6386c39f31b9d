//! `tallow export --format gguf`: a model (with an adapter merged into it) as the GGUF file
//! llama.cpp's converter would write for it, for llama.cpp, Ollama and LM Studio (docs/gguf.md).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use tallow_model::io::gguf::write::{write_gguf, OutType, Source};
use tallow_model::merge_lora;
use tallow_trainer::config::Quantize;

use crate::args::ExportArgs;
use crate::model;

pub fn run(a: ExportArgs) -> Result<()> {
    if a.format != "gguf" {
        bail!("--format {}: tallow exports gguf", a.format);
    }
    let Some(out) = OutType::parse(&a.outtype) else {
        bail!("--outtype {}: expected f32, f16, bf16 or q8_0", a.outtype);
    };
    let dir = model::dir(&a.model)?;
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
    if tokenizer.is_null() {
        bail!(
            "{}: no tokenizer.json to write into the GGUF",
            dir.display()
        );
    }
    let chat_template = read("chat_template.jinja")?;
    let name = display_name(&a.model);
    let config = m.config.to_hf_json(DType::F32);
    write_gguf(
        &a.out,
        &tensors,
        &Source {
            name: &name,
            config: &config,
            tokenizer: &tokenizer,
            tokenizer_config: &json("tokenizer_config.json")?,
            chat_template: chat_template.as_deref(),
        },
        out,
    )
    .with_context(|| format!("writing {}", a.out.display()))?;
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
