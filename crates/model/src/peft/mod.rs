//! Adapters on the linear layers, side by side: [`lora`] (LoRA) and [`dora`] (DoRA, LoRA plus a
//! magnitude vector). This module attaches fresh ones, saves and loads
//! `adapter_model.safetensors` + `adapter_config.json` exactly as PEFT writes them, merges them
//! into the base weights, and saves a model in HF layout.
//!
//! PEFT key of a module's adapter: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
//! (A: (r, in)), `...lora_B.weight` (B: (out, r)) and, for DoRA, `...lora_magnitude_vector`
//! (m: (out)). On the text tower of an image-text Gemma 3 (`DecoderConfig::text_tower`) the
//! modules are those of transformers' (>= 4.50) `Gemma3ForConditionalGeneration`,
//! `base_model.model.model.language_model.layers.{i}...`, and `target_modules` is a regex
//! over the language model's modules only ([`text_tower_targets`]), so PEFT puts no adapter on
//! the vision tower's `q_proj` / `k_proj` / `v_proj`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::decoder::CausalLM;
use crate::error::{ModelError, Result};
use crate::io::weights::Weights;
use crate::io::{replace_dir, save_safetensors, staging_dir, write_atomic};
use crate::nn::linear::{Base, Param};

pub mod dora;
pub mod lora;

pub use dora::Dora;
pub use lora::{lora_a_init, mix_seed, Dropout, Lora};

thread_local! {
    static ADAPTERS_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every adapter of every model switched off on this thread: each linear computes
/// its base `x W^T (+ b)` only, as PEFT's `disable_adapter()` context. DPO's reference is the
/// same weights with the adapters off. Scoped: restored when `f` returns or unwinds.
pub fn adapters_off<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ADAPTERS_OFF.with(|off| off.set(self.0));
        }
    }
    let _restore = Restore(ADAPTERS_OFF.with(|off| off.replace(true)));
    f()
}

/// Whether adapters apply on this thread (false inside [`adapters_off`]).
pub fn adapters_active() -> bool {
    !ADAPTERS_OFF.with(|off| off.get())
}

/// The adapter a linear layer may carry.
#[derive(Clone)]
pub enum Adapter {
    Lora(Lora),
    Dora(Dora),
}

impl Adapter {
    /// The LoRA matrices (A, B, scale, dropout), which DoRA has too.
    pub fn lora(&self) -> &Lora {
        match self {
            Adapter::Lora(l) => l,
            Adapter::Dora(d) => &d.lora,
        }
    }

    pub fn lora_mut(&mut self) -> &mut Lora {
        match self {
            Adapter::Lora(l) => l,
            Adapter::Dora(d) => &mut d.lora,
        }
    }

    /// Every trainable tensor with its key suffix after the module's PEFT prefix, in PEFT's
    /// order: `lora_A.weight`, `lora_B.weight` (, `lora_magnitude_vector`).
    pub fn vars(&self) -> Vec<(&'static str, &Var)> {
        let l = self.lora();
        let mut v = vec![("lora_A.weight", &l.a), ("lora_B.weight", &l.b)];
        if let Adapter::Dora(d) = self {
            v.push(("lora_magnitude_vector", &d.magnitude));
        }
        v
    }
}

/// The modules LoRA can target, by their HF names (the module part of
/// [`crate::config::layout::LINEAR_PATHS`]).
pub const LINEAR_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Phi-3's fused linears, by PEFT's names (the module part of
/// [`crate::config::layout::FUSED_LINEAR_PATHS`]).
pub const FUSED_MODULES: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

/// Every module name LoRA can target on some family (a training config is checked against
/// these before the model is read; `DecoderConfig::resolve_lora_targets` then checks them
/// against the model).
pub const KNOWN_MODULES: [&str; 9] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
];

/// What adapter to attach: PEFT's `LoraConfig` fields that tallow supports.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (`q_proj`, ...).
    pub targets: Vec<String>,
    pub rslora: bool,
    /// DoRA (PEFT's `use_dora`): a magnitude vector per output feature (DoRA, Liu et al. 2024).
    pub dora: bool,
}

impl LoraSpec {
    /// alpha / r, or alpha / sqrt(r) with rsLoRA.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}

/// `adapter_config.json`, the keys PEFT 0.17 writes (and reads back).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PeftConfig {
    peft_type: String,
    #[serde(default)]
    task_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    target_modules: serde_json::Value,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    rank_pattern: HashMap<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: HashMap<String, serde_json::Value>,
    #[serde(default)]
    layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    inference_mode: bool,
    #[serde(default)]
    init_lora_weights: serde_json::Value,
}

use crate::config::layout::module_name;

/// The PEFT module name (key prefix) of layer `i`'s linear `path` (`self_attn.q_proj`).
pub fn peft_prefix(i: usize, path: &str) -> String {
    format!("base_model.model.model.layers.{i}.{path}")
}

/// [`peft_prefix`] for `model`: under `model.language_model` for an image-text Gemma 3's text
/// tower.
pub fn model_peft_prefix(model: &CausalLM, i: usize, path: &str) -> String {
    if model.config.text_tower {
        format!("base_model.model.model.language_model.layers.{i}.{path}")
    } else {
        peft_prefix(i, path)
    }
}

/// `target_modules` for the text tower of an image-text model: PEFT full-matches a string
/// against each module's name, so this regex takes the language model's modules `names` and
/// none of the vision tower's.
pub fn text_tower_targets(names: &[&str]) -> String {
    format!(r".*\.language_model\..*\.({})", names.join("|"))
}

/// The module names of a [`text_tower_targets`] regex, None for any other string.
fn parse_text_tower_targets(s: &str) -> Option<Vec<String>> {
    let inner = s
        .strip_prefix(r".*\.language_model\..*\.(")?
        .strip_suffix(')')?;
    let names: Vec<String> = inner.split('|').map(str::to_string).collect();
    names
        .iter()
        .all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(names)
}

/// Attaches fresh adapters (A Kaiming-uniform from `seed`, B zeros, f32) to the targeted linear
/// layers of every decoder layer.
/// With `spec.dora`, each is a DoRA adapter whose magnitude starts as the row norms of W.
pub fn attach_lora(model: &mut CausalLM, spec: &LoraSpec, seed: u64) -> Result<()> {
    let targets = model.config.resolve_lora_targets(&spec.targets)?;
    let device = model.device().clone();
    let mut id = 0u64;
    for layer in model.layers.iter_mut() {
        for (path, lin) in layer.linears_mut() {
            if !targets.contains(&module_name(path)) {
                lin.adapter = None;
                continue;
            }
            let (out, inp) = (lin.out_features(), lin.in_features());
            let lora = Lora {
                a: Var::from_tensor(&lora_a_init(spec.rank, inp, mix_seed(seed, id), &device)?)?,
                b: Var::zeros((out, spec.rank), DType::F32, &device)?,
                scale: spec.scale(),
                dropout: None,
                id,
            };
            lin.adapter = Some(if spec.dora {
                Adapter::Dora(Dora::new(lin, lora)?)
            } else {
                Adapter::Lora(lora)
            });
            id += 1;
        }
    }
    set_dropout_rate(model, spec.dropout);
    Ok(())
}

/// Gives every adapter of `model` one shared dropout of probability `p` (none when p = 0).
/// Used after attaching, and to apply a run's dropout to adapters loaded from disk.
pub fn set_dropout_rate(model: &mut CausalLM, p: f64) {
    let dropout = (p > 0.0).then(|| Arc::new(Dropout::new(p as f32)));
    for layer in model.layers.iter_mut() {
        for (_, lin) in layer.linears_mut() {
            if let Some(a) = lin.adapter.as_mut() {
                a.lora_mut().dropout = dropout.clone();
            }
        }
    }
}

/// Switches LoRA dropout on with `seed` (training) or off (None).
pub fn set_dropout(model: &CausalLM, seed: Option<u64>) {
    for layer in &model.layers {
        for (_, lin) in layer.linears() {
            if let Some(d) = lin.lora().and_then(|l| l.dropout.as_ref()) {
                d.set(seed);
                return; // one Dropout is shared by every adapter of the model
            }
        }
    }
}

/// Every adapter variable with its PEFT key, layer by layer, A before B (then DoRA's magnitude).
pub fn lora_vars(model: &CausalLM) -> Vec<(String, Var)> {
    let mut out = Vec::new();
    for (i, layer) in model.layers.iter().enumerate() {
        for (path, lin) in layer.linears() {
            if let Some(a) = &lin.adapter {
                let p = model_peft_prefix(model, i, path);
                for (suffix, v) in a.vars() {
                    out.push((format!("{p}.{suffix}"), v.clone()));
                }
            }
        }
    }
    out
}

/// Writes `dir/adapter_model.safetensors` and `dir/adapter_config.json` as PEFT does; the
/// directory is staged and renamed into place.
pub fn save_peft(model: &CausalLM, spec: &LoraSpec, dir: &Path, base_model: &str) -> Result<()> {
    let staged = staging_dir(dir)?;
    let tensors: Vec<(String, Tensor)> = lora_vars(model)
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(
        &staged.join("adapter_model.safetensors"),
        &tensors,
        Some(meta),
    )?;
    // The model's own names (all seven Llama names on Phi-3 are its four), so PEFT loads it.
    let mut targets = model.config.resolve_lora_targets(&spec.targets)?;
    targets.sort();
    let cfg = PeftConfig {
        peft_type: "LORA".into(),
        task_type: Some("CAUSAL_LM".into()),
        r: spec.rank,
        lora_alpha: spec.alpha,
        lora_dropout: spec.dropout,
        target_modules: if model.config.text_tower {
            serde_json::json!(text_tower_targets(&targets))
        } else {
            serde_json::json!(targets)
        },
        use_rslora: spec.rslora,
        use_dora: spec.dora,
        bias: Some("none".into()),
        base_model_name_or_path: Some(base_model.to_string()),
        fan_in_fan_out: false,
        rank_pattern: HashMap::new(),
        alpha_pattern: HashMap::new(),
        layers_to_transform: None,
        modules_to_save: None,
        inference_mode: true,
        init_lora_weights: serde_json::json!(true),
    };
    let json = serde_json::to_string_pretty(&cfg).expect("serializable");
    write_atomic(&staged.join("adapter_config.json"), json.as_bytes())?;
    replace_dir(&staged, dir)
}

/// Reads `dir/adapter_config.json` into a [`LoraSpec`], refusing PEFT features tallow lacks.
pub fn read_peft_config(dir: &Path) -> Result<LoraSpec> {
    let path = dir.join("adapter_config.json");
    let cfg: PeftConfig = crate::io::parse_json(&crate::io::read_text(&path)?, &path)?;
    let bad = |key: &str, msg: &str| ModelError::Config {
        path: path.clone(),
        key: key.into(),
        msg: msg.into(),
    };
    if cfg.peft_type != "LORA" {
        return Err(bad("peft_type", "only LORA adapters are supported"));
    }
    if !cfg.rank_pattern.is_empty() || !cfg.alpha_pattern.is_empty() {
        return Err(bad(
            "rank_pattern",
            "per-module ranks / alphas are not supported",
        ));
    }
    if cfg
        .layers_to_transform
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(bad(
            "layers_to_transform",
            "adapters on a subset of layers are not supported",
        ));
    }
    if cfg.fan_in_fan_out {
        return Err(bad("fan_in_fan_out", "must be false for Llama / Qwen"));
    }
    let targets: Vec<String> = match &cfg.target_modules {
        serde_json::Value::String(s) if s == "all-linear" => {
            LINEAR_MODULES.iter().map(|s| s.to_string()).collect()
        }
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        serde_json::Value::String(s) if parse_text_tower_targets(s).is_some() => {
            parse_text_tower_targets(s).unwrap_or_default()
        }
        _ => {
            return Err(bad(
                "target_modules",
                "expected a list of module names, \"all-linear\", or tallow's text-tower \
                 regex (`.*\\.language_model\\..*\\.(q_proj|...)`)",
            ))
        }
    };
    Ok(LoraSpec {
        rank: cfg.r,
        alpha: cfg.lora_alpha,
        dropout: cfg.lora_dropout,
        targets,
        rslora: cfg.use_rslora,
        dora: cfg.use_dora,
    })
}

/// Attaches the adapter saved in `dir` (ours or PEFT's) to `model`; returns its spec. Every
/// expected tensor must be present with the shape the model implies.
pub fn load_peft(model: &mut CausalLM, dir: &Path) -> Result<LoraSpec> {
    let spec = read_peft_config(dir)?;
    attach_lora(model, &spec, 0)?;
    let file = dir.join("adapter_model.safetensors");
    let weights = Weights::from_files(dir, std::slice::from_ref(&file))?;
    let device = model.device().clone();
    let vars = lora_vars(model);
    for (name, var) in &vars {
        if !weights.contains(name) {
            return Err(ModelError::MissingTensor {
                dir: dir.to_path_buf(),
                name: name.clone(),
                hint: " (the adapter was made for another model or another set of target modules)"
                    .into(),
            });
        }
        let shape = var.dims().to_vec();
        let t = weights.load(name, &shape, DType::F32, &device).map_err(|e| match e {
            ModelError::ShapeMismatch { path, name, expected, found } => ModelError::Invalid(format!(
                "{}: tensor `{name}` has shape {found:?} but this model needs {expected:?}: the adapter \
                 was trained on a different model (or rank)",
                path.display()
            )),
            other => other,
        })?;
        var.set(&t)?;
    }
    let known: std::collections::HashSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(extra) = weights.names().find(|n| !known.contains(n)) {
        return Err(ModelError::Invalid(format!(
            "{}: tensor `{extra}` has no place in this model (different number of layers or modules?)",
            file.display()
        )));
    }
    Ok(spec)
}

/// Folds every adapter into its base weight: W <- W + s B A for LoRA, W <- m ⊙ (W + s B A) /
/// ||W + s B A|| for DoRA (in f32, stored back in the weight's dtype), and removes the adapters.
/// An NF4 base is dequantized first and stays dense.
pub fn merge_lora(model: &mut CausalLM) -> Result<()> {
    for layer in model.layers.iter_mut() {
        for (_, lin) in layer.linears_mut() {
            let Some(adapter) = lin.adapter.clone() else {
                continue;
            };
            // An NF4 base is merged into its dequantized weight (as PEFT's `merge_and_unload`
            // does for bitsandbytes 4-bit layers) and becomes dense: W + s B A is not NF4.
            let merged = match &adapter {
                Adapter::Lora(lora) => {
                    let w = lin.weight.dense()?; // (out, in)
                    let delta = (lora.b.matmul(lora.a.as_tensor())? * lora.scale)?; // (out, in)
                    (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?
                }
                Adapter::Dora(dora) => dora.merged_weight(lin)?,
            };
            lin.adapter = None;
            lin.weight = Base::Dense(match &lin.weight {
                Base::Dense(Param::Trainable(_)) => Param::Trainable(Var::from_tensor(&merged)?),
                _ => Param::Frozen(merged),
            });
        }
    }
    Ok(())
}

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
