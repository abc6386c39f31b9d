//! Helpers shared by the end-to-end and parity tests under `tests/tests/`.
//! Fixtures (tiny HF models, data, reference numbers from transformers) live in
//! `tests/fixtures/` and are made by `scripts/make_fixtures.py`.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub const MODELS: [&str; 3] = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"];
pub const FORMATS: [&str; 3] = ["text", "prompt_completion", "messages"];

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub fn model_dir(model: &str) -> PathBuf {
    fixtures().join("models").join(model)
}

pub fn data_file(format: &str) -> PathBuf {
    fixtures().join("data").join(format!("{format}.jsonl"))
}

/// `tests/fixtures/reference/<model>.json`
pub fn reference_json(model: &str) -> serde_json::Value {
    let p = fixtures().join("reference").join(format!("{model}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// `tests/fixtures/reference/<model>.safetensors` (logits and gradients)
pub fn reference_tensors(model: &str) -> HashMap<String, Tensor> {
    let p = fixtures()
        .join("reference")
        .join(format!("{model}.safetensors"));
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

/// Rows (ids, targets) of one format in a reference JSON.
pub fn reference_rows(reference: &serde_json::Value, format: &str) -> Vec<(Vec<u32>, Vec<bool>)> {
    reference["formats"][format]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let ids = r["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let tg = r["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_bool().unwrap())
                .collect();
            (ids, tg)
        })
        .collect()
}

/// max |a - b| over all elements, computed in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(candle_core::DType::F64).unwrap();
    let b = b.to_dtype(candle_core::DType::F64).unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// max |a| over all elements, in f64.
pub fn max_abs(a: &Tensor) -> f64 {
    a.to_dtype(candle_core::DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}
