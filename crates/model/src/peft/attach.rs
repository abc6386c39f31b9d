//! Adapters on a model: attach fresh ones of a kind, switch their dropout, list their
//! variables, and fold them into the base weights.

use std::sync::Arc;

use candle_core::{DType, Var};

use super::lora::lora_a_init;
use super::names::model_peft_prefix;
use super::LoraSpec;
use crate::config::layout::module_name;
use crate::decoder::CausalLM;
use crate::error::Result;
use crate::kernels::dropout::Dropout;
use crate::nn::linear::{Base, Param};
use crate::nn::lora::{mix_seed, Lora};

/// Attaches fresh adapters (A Kaiming-uniform from `seed`, B zeros, f32) to the targeted linear
/// layers of every decoder layer.
/// Each is of `spec.kind` (DoRA: the magnitude starts as the row norms of W).
pub fn attach_lora(model: &mut CausalLM, spec: &LoraSpec, seed: u64) -> Result<()> {
    let targets = model.config.resolve_lora_targets(&spec.targets)?;
    let device = model.device().clone();
    let mut id = 0u64;
    for layer in model.layers.iter_mut() {
        for (path, lin) in layer.linears_mut() {
            if !targets.contains(&module_name(&path)) {
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
            lin.adapter = Some(spec.kind.spec().attach(lin, lora)?);
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
                let p = model_peft_prefix(model, i, &path);
                for (suffix, v) in a.vars() {
                    out.push((format!("{p}.{suffix}"), v.clone()));
                }
            }
        }
    }
    out
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
            let merged = adapter.merged_weight(lin)?;
            lin.adapter = None;
            lin.weight = Base::Dense(match &lin.weight {
                Base::Dense(Param::Trainable(_)) => Param::Trainable(Var::from_tensor(&merged)?),
                _ => Param::Frozen(merged),
            });
        }
    }
    Ok(())
}
