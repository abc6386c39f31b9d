//! Adapters on a model: attach fresh ones of a kind, switch their dropout, list their
//! variables, and fold them into the base weights.

use std::sync::Arc;

use candle_core::{DType, Var};

use super::lora::lora_a_init;
use super::names::model_peft_prefix;
use super::LoraSpec;
use crate::decoder::CausalLM;
use crate::error::Result;
use crate::kernels::dropout::Dropout;
use crate::nn::linear::{Base, Param};
use crate::nn::lora::{mix_seed, Lora};

/// Attaches fresh adapters (A Kaiming-uniform from `seed`, B zeros, f32) to the linears of
/// every decoder layer that `spec` targets ([`LoraSpec::plan`]).
/// Each is of `spec.kind` (DoRA: the magnitude starts as the row norms of W). Under a fused
/// `gate_up_proj` target an expert's up projection shares its gate projection's A (one
/// adapter on the two, as PEFT's on transformers 5's fused tensor): the one `Var` gathers
/// both gradients.
pub fn attach_lora(model: &mut CausalLM, spec: &LoraSpec, seed: u64) -> Result<()> {
    let plan = spec.plan(&model.config)?;
    let device = model.device().clone();
    let mut id = 0u64;
    for layer in model.layers.iter_mut() {
        // the A of the adapter attached last: an expert's gate projection's, for its up
        let mut last_a: Option<Var> = None;
        for (path, lin) in layer.linears_mut() {
            if !plan.wraps(&path) {
                lin.adapter = None;
                continue;
            }
            let (out, inp) = (lin.out_features(), lin.in_features());
            let a = match last_a.as_ref().filter(|_| plan.shares_a(&path)) {
                Some(a) => a.clone(),
                None => {
                    Var::from_tensor(&lora_a_init(spec.rank, inp, mix_seed(seed, id), &device)?)?
                }
            };
            last_a = Some(a.clone());
            let lora = Lora {
                a,
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
/// A routed expert's adapters are named per expert, as PEFT names them on transformers 4.57's
/// per-expert modules; an A shared by gate and up ([`attach_lora`]) is listed once, under the
/// gate's name (`format::save_peft` stacks them into PEFT's fused-expert keys).
pub fn lora_vars(model: &CausalLM) -> Vec<(String, Var)> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, layer) in model.layers.iter().enumerate() {
        for (path, lin) in layer.linears() {
            if let Some(a) = &lin.adapter {
                let p = model_peft_prefix(model, i, &path);
                for (suffix, v) in a.vars() {
                    if seen.insert(v.as_tensor().id()) {
                        out.push((format!("{p}.{suffix}"), v.clone()));
                    }
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
