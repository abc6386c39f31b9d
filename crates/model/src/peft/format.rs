//! PEFT's files: `adapter_model.safetensors` + `adapter_config.json` written and read exactly
//! as PEFT does, and the PEFT names of a model's modules.
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

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::attach::{attach_lora, lora_vars, set_dropout_rate};
use super::experts::{stack, unstack};
use super::names::{parse_text_tower_targets, text_tower_targets};
use super::{AdapterKind, LoraSpec, LINEAR_MODULES};
use crate::decoder::CausalLM;
use crate::error::{ModelError, Result};
use crate::io::weights::Weights;
use crate::io::{replace_dir, save_safetensors, staging_dir, write_atomic};

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
    /// PEFT >= 0.17: LoRA on parameters (transformers 5's fused expert tensors), beside
    /// `target_modules` (`super::experts`). Left out when there are none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target_parameters: Option<Vec<String>>,
}

/// Writes `dir/adapter_model.safetensors` and `dir/adapter_config.json` as PEFT does; the
/// directory is staged and renamed into place.
pub fn save_peft(model: &CausalLM, spec: &LoraSpec, dir: &Path, base_model: &str) -> Result<()> {
    let plan = spec.plan(&model.config)?;
    let staged = staging_dir(dir)?;
    let tensors: Vec<(String, Tensor)> = lora_vars(model)
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    let tensors = stack(model, &plan, tensors)?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(
        &staged.join("adapter_model.safetensors"),
        &tensors,
        Some(meta),
    )?;
    // The model's own names (all seven Llama names on Phi-3 are its four), so PEFT loads it.
    let mut targets = plan.modules.clone();
    targets.sort();
    let params = plan.parameters();
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
        use_dora: spec.kind.spec().use_dora(),
        bias: Some("none".into()),
        base_model_name_or_path: Some(base_model.to_string()),
        fan_in_fan_out: false,
        rank_pattern: HashMap::new(),
        alpha_pattern: HashMap::new(),
        layers_to_transform: None,
        modules_to_save: None,
        inference_mode: true,
        init_lora_weights: serde_json::json!(true),
        target_parameters: (!params.is_empty())
            .then(|| params.iter().map(|p| p.to_string()).collect()),
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
        return Err(bad(
            "fan_in_fan_out",
            "must be false (the HF layout stores weights (out, in))",
        ));
    }
    let target_parameters = cfg.target_parameters.clone().unwrap_or_default();
    let targets: Vec<String> = match &cfg.target_modules {
        // PEFT: no modules when `target_parameters` names every target
        serde_json::Value::Null if !target_parameters.is_empty() => Vec::new(),
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
        kind: AdapterKind::from_use_dora(cfg.use_dora),
        target_parameters,
    })
}

/// Attaches the adapter saved in `dir` (ours or PEFT's) to `model`; returns its spec. Every
/// expected tensor must be present with the shape the model implies.
pub fn load_peft(model: &mut CausalLM, dir: &Path) -> Result<LoraSpec> {
    let spec = read_peft_config(dir)?;
    // PEFT's dropout is a training setting (the caller sets its own run's); it has no effect
    // here, so an adapter with target_parameters loads whatever it says.
    let attach_spec = LoraSpec {
        dropout: 0.0,
        ..spec.clone()
    };
    let plan = attach_spec.plan(&model.config)?;
    attach_lora(model, &attach_spec, 0)?;
    if spec.target_parameters.is_empty() {
        set_dropout_rate(model, spec.dropout);
    }
    let file = dir.join("adapter_model.safetensors");
    let weights = Weights::from_files(dir, std::slice::from_ref(&file))?;
    let device = model.device().clone();
    let (mut split, stacked) = unstack(model, &plan, spec.rank, &weights, &device)?;
    let vars = lora_vars(model);
    for (name, var) in &vars {
        let shape = var.dims().to_vec();
        let t = match split.remove(name) {
            Some(t) => t,
            None if !weights.contains(name) => {
                return Err(ModelError::MissingTensor {
                    dir: dir.to_path_buf(),
                    name: name.clone(),
                    hint: " (the adapter was made for another model or another set of target modules)"
                        .into(),
                })
            }
            None => weights.load(name, &shape, DType::F32, &device).map_err(|e| match e {
                ModelError::ShapeMismatch { path, name, expected, found } => ModelError::Invalid(format!(
                    "{}: tensor `{name}` has shape {found:?} but this model needs {expected:?}: the adapter \
                     was trained on a different model (or rank)",
                    path.display()
                )),
                other => other,
            })?,
        };
        var.set(&t)?;
    }
    let known: std::collections::HashSet<&str> = vars
        .iter()
        .map(|(n, _)| n.as_str())
        .chain(stacked.iter().map(String::as_str))
        .collect();
    if let Some(extra) = weights.names().find(|n| !known.contains(n)) {
        return Err(ModelError::Invalid(format!(
            "{}: tensor `{extra}` has no place in this model (different number of layers or modules?)",
            file.display()
        )));
    }
    Ok(spec)
}
