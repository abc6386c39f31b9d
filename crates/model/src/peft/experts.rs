//! PEFT's fused-expert adapter files: `target_parameters` on transformers 5's 3-D expert
//! tensors (PEFT 0.21's `ParamWrapper`), converted to and from the per-expert adapters tallow
//! trains.
//!
//! Per sparse layer PEFT keeps one LoRA per targeted tensor of `mlp.experts`, every expert
//! stacked (E experts, rank r):
//!
//! ```text
//!   A (r E, in)   expert e's A (r, in) is rows e r .. (e + 1) r
//!   B (out, r E)  expert e's B (out, r) is columns e, E + e, 2 E + e, ...  (B viewed (out, r, E))
//!   ΔW_e = scale · B_e A_e        (get_delta_weight: einsum "o r e, e r i -> e o i")
//! ```
//!
//! `gate_up_proj`'s out is 2 I (gate rows, then up rows): the gate and up projections share
//! A_e and each takes its half of B_e. With both tensors targeted PEFT nests its wrappers in
//! the `*Experts` module's parameter order, so `gate_up_proj`'s adapter is under
//! `mlp.experts.base_layer.` and `down_proj`'s under `mlp.experts.`; one alone is under
//! `mlp.experts.`.
//!
//! tallow keeps the adapters per expert ([`super::attach::attach_lora`]), named as PEFT's
//! per-expert modules of transformers 4.57 (the gate's A and B, the up's B, the down's A and
//! B), and converts here: [`stack`] on save, [`unstack`] on load.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::names::model_peft_prefix;
use crate::config::layout::{ExpertTargets, LoraPlan};
use crate::decoder::CausalLM;
use crate::error::{ModelError, Result};
use crate::io::weights::Weights;

/// One stacked adapter of a layer: the key prefix (`...mlp.experts.base_layer`) and, per
/// expert, the linears whose B rows it stacks (gate and up, or down); A is the first's.
struct Stacked {
    prefix: String,
    /// expert -> the per-expert key prefixes of its linears, in B's row order
    linears: Vec<Vec<String>>,
    /// (in, each linear's out)
    inp: usize,
    out: usize,
}

/// The stacked adapters of every sparse layer of `model` under `x`.
fn stacked(model: &CausalLM, x: &ExpertTargets) -> Vec<Stacked> {
    let c = &model.config;
    let Some(moe) = &c.moe else {
        return Vec::new();
    };
    let (e, i, hs) = (moe.num_experts, moe.expert_size, c.hidden_size);
    let mut v = Vec::new();
    for layer in (0..c.num_hidden_layers).filter(|&l| c.is_sparse(l)) {
        let fused = model_peft_prefix(model, layer, "mlp.experts");
        let expert = |n: &str, k: usize| {
            model_peft_prefix(
                model,
                layer,
                &format!("{}.experts.{k}.{n}", moe.names.block),
            )
        };
        if x.gate_up {
            v.push(Stacked {
                prefix: if x.down {
                    format!("{fused}.base_layer")
                } else {
                    fused.clone()
                },
                linears: (0..e)
                    .map(|k| vec![expert(x.names.gate, k), expert(x.names.up, k)])
                    .collect(),
                inp: hs,
                out: i,
            });
        }
        if x.down {
            v.push(Stacked {
                prefix: fused,
                linears: (0..e).map(|k| vec![expert(x.names.down, k)]).collect(),
                inp: i,
                out: hs,
            });
        }
    }
    v
}

/// Replaces the per-expert adapter tensors of `tensors` (as `lora_vars` names them) by PEFT's
/// stacked ones; the others pass through. A no-op without `plan.experts`.
pub(crate) fn stack(
    model: &CausalLM,
    plan: &LoraPlan,
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let Some(x) = &plan.experts else {
        return Ok(tensors);
    };
    let order: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().collect();
    let mut take = |name: String| {
        by_name
            .remove(&name)
            .ok_or_else(|| ModelError::Invalid(format!("no adapter tensor `{name}` to stack")))
    };
    let mut out = Vec::new();
    for s in stacked(model, x) {
        let mut a = Vec::with_capacity(s.linears.len());
        let mut b = Vec::with_capacity(s.linears.len());
        for linears in &s.linears {
            a.push(take(format!("{}.lora_A.weight", linears[0]))?); // (r, in)
            let halves = linears
                .iter()
                .map(|p| take(format!("{p}.lora_B.weight")))
                .collect::<Result<Vec<_>>>()?;
            b.push(Tensor::cat(&halves, 0)?); // (out', r), out' = out per linear, stacked
        }
        let a = Tensor::cat(&a, 0)?; // (r E, in)
        let b = Tensor::stack(&b, 2)?; // (out', r, E)
        let (o, r, e) = b.dims3()?;
        let b = b.reshape((o, r * e))?; // (out', r E): column k E + e is expert e's k-th
        out.push((format!("{}.lora_A.weight", s.prefix), a));
        out.push((format!("{}.lora_B.weight", s.prefix), b));
    }
    // the rest, in their order
    out.extend(
        order
            .into_iter()
            .filter_map(|n| by_name.remove(&n).map(|t| (n, t))),
    );
    Ok(out)
}

/// PEFT's stacked expert adapters in `weights` (read from `file`), split into the per-expert
/// tensors `lora_vars` names, f32 on `device`, with the stacked keys they came from. Empty
/// without `plan.experts`.
pub(crate) fn unstack(
    model: &CausalLM,
    plan: &LoraPlan,
    rank: usize,
    weights: &Weights,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, Vec<String>)> {
    let mut out = HashMap::new();
    let mut read = Vec::new();
    let Some(x) = &plan.experts else {
        return Ok((out, read));
    };
    for s in stacked(model, x) {
        let e = s.linears.len();
        let rows = s.out * s.linears[0].len();
        let (ka, kb) = (
            format!("{}.lora_A.weight", s.prefix),
            format!("{}.lora_B.weight", s.prefix),
        );
        let a = weights.load(&ka, &[rank * e, s.inp], DType::F32, device)?; // (r E, in)
        let b = weights.load(&kb, &[rows, rank * e], DType::F32, device)?; // (out', r E)
        let b = b.reshape((rows, rank, e))?; // (out', r, E)
        for (k, linears) in s.linears.iter().enumerate() {
            let ak = a.narrow(0, k * rank, rank)?.contiguous()?; // (r, in)
            let bk = b.narrow(2, k, 1)?.squeeze(2)?; // (out', r)
            out.insert(format!("{}.lora_A.weight", linears[0]), ak);
            for (h, p) in linears.iter().enumerate() {
                let half = bk.narrow(0, h * s.out, s.out)?.contiguous()?; // (out, r)
                out.insert(format!("{p}.lora_B.weight"), half);
            }
        }
        read.extend([ka, kb]);
    }
    Ok((out, read))
}
