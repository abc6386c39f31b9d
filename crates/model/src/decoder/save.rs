//! A model saved in Hugging Face layout: `config.json`, `model.safetensors` and the tokenizer's
//! files, as transformers (4.57 and 5) loads it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};

use crate::decoder::CausalLM;
use crate::error::{ModelError, Result};
use crate::io::{replace_dir, save_safetensors, staging_dir, write_atomic};

/// Files of an HF model dir that travel with its weights.
const SIDE_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
];

/// Saves `model` in HF layout (config.json, model.safetensors, tokenizer files copied from
/// `src_dir`) to `out`, cast to `dtype` (NF4 weights dequantized; a `quantization_config` of
/// the source is dropped). The directory is staged and renamed into place.
pub fn save_hf_model(model: &CausalLM, src_dir: &Path, out: &Path, dtype: DType) -> Result<()> {
    if model
        .layers
        .iter()
        .any(|l| l.linears().iter().any(|(_, lin)| lin.adapter.is_some()))
    {
        return Err(ModelError::Invalid(
            "save_hf_model: merge the adapters first".into(),
        ));
    }
    let staged = staging_dir(out)?;
    let mut tensors: Vec<(String, Tensor)> = model
        .named_params()
        .into_iter()
        .map(|(n, p)| Ok((n, p.tensor().to_dtype(dtype)?)))
        .collect::<Result<_>>()?;
    // NF4 weights are written dequantized: the output is a plain HF checkpoint.
    for (n, w) in model.nf4_weights() {
        tensors.push((n, w.dequantize()?.to_dtype(dtype)?));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(&staged.join("model.safetensors"), &tensors, Some(meta))?;
    let cfg = model.config.to_hf_json(dtype);
    write_atomic(
        &staged.join("config.json"),
        serde_json::to_string_pretty(&cfg).expect("json").as_bytes(),
    )?;
    for f in SIDE_FILES {
        let src = src_dir.join(f);
        if src.exists() {
            let bytes = std::fs::read(&src).map_err(|source| ModelError::Io {
                path: src.clone(),
                source,
            })?;
            write_atomic(&staged.join(f), &bytes)?;
        }
    }
    replace_dir(&staged, out)
}
