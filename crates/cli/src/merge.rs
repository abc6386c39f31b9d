//! `tallow merge`: base model + PEFT adapter -> one HF-layout model (W + s B A) that transformers
//! loads like any checkpoint.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use tallow_model::{merge_lora, save_hf_model};

use crate::args::MergeArgs;
use crate::device::parse_dtype;
use crate::model;

pub fn run(mut a: MergeArgs) -> Result<()> {
    // A hub id (`OWNER/NAME[@REV]`) becomes its cached snapshot dir.
    a.model = model::dir(&a.model)?;
    let dtype = match &a.dtype {
        Some(d) => parse_dtype(d, &Device::Cpu)?,
        None => config_dtype(&a.model).unwrap_or(DType::BF16),
    };
    // Merge in f32 on the CPU whatever the output dtype: the sum W + s B A is rounded once.
    // An NF4 base (a bitsandbytes 4-bit checkpoint, or --quantize nf4) is merged into its
    // dequantized weights, as PEFT's merge_and_unload does: the output is a dense model.
    let opts = model::options(
        a.quantize,
        a.double_quant,
        DType::F32,
        &Device::Cpu,
        &a.ignore_config_keys,
    );
    let (mut model, spec) = model::load(&a.model, &opts, Some(&a.adapter))?;
    let spec = spec.expect("an adapter was given, so load returns its spec");
    merge_lora(&mut model)?;
    save_hf_model(&model, &a.model, &a.out, dtype)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "merged {} (rank {}, alpha {}, {} modules) into {} -> {}",
        a.adapter.display(),
        spec.rank,
        spec.alpha,
        spec.targets.len(),
        a.model.display(),
        a.out.display()
    );
    Ok(())
}

/// `torch_dtype` / `dtype` of the base model's config.json.
fn config_dtype(dir: &std::path::Path) -> Option<DType> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    match v.get("torch_dtype").or_else(|| v.get("dtype"))?.as_str()? {
        "float32" => Some(DType::F32),
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}
