//! Optimizers over the trainable set: [`adamw::AdamW`] (f32 moments, torch semantics),
//! [`adamw8bit::AdamW8bit`] (the same maths, moments stored blockwise 8-bit) and [`sgd::Sgd`].
//!
//! The trainer hands an optimizer exactly the trainable `Var`s, in a fixed order, together with
//! their gradients (already summed over micro-batches, averaged and clipped by the caller, see
//! [`crate::grads`]). Every update is written with Candle tensor ops only, so it runs unchanged
//! on the CPU and on CUDA; parameters may be f32, f16 or bf16 (the maths is done in f32 and the
//! result cast back to the parameter's dtype).
//!
//! Checkpoints: [`Optimizer::state`] names each tensor `"{i}.{what}"` where `i` is the index of the
//! parameter in the trainable list, plus [`STEP_KEY`] (a 0-d u32 tensor on the CPU: the number of
//! steps taken). [`Optimizer::load_state`] checks names and shapes against the parameters.

pub mod adamw;
pub mod adamw8bit;
pub mod sgd;
pub mod sharded;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};

pub use adamw::{AdamW, AdamWParams};
pub use adamw8bit::AdamW8bit;
pub use sgd::Sgd;

/// Name of the step counter in [`Optimizer::state`].
pub const STEP_KEY: &str = "step";

/// One optimizer over a fixed, ordered list of trainable variables (the trainer passes exactly
/// the trainable set).
pub trait Optimizer {
    /// Applies one update. `grads[i]` is the gradient of `params[i]` (already averaged/clipped by
    /// the caller, any float dtype), `lr` the learning rate of this step.
    fn step(&mut self, params: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()>;
    /// Whether [`Optimizer::step_scaled`] applies its scale as it reads the gradients (AdamW),
    /// so the trainer hands it the clipping coefficient instead of multiplying the gradients
    /// itself. Otherwise the trainer clips them in place first (each new gradient replacing
    /// the old one, so no more than one extra gradient is alive at a time).
    fn applies_grad_scale(&self) -> bool {
        false
    }
    /// [`Optimizer::step`] with the gradients first multiplied by `scale` (one f32 on their
    /// device, the gradient clipping's coefficient: `grads::norm_and_clip_coefficient`), so
    /// an optimizer that reads the gradients once can apply it as it reads them. By default
    /// the gradients are multiplied first (one op each, all of them alive beside the
    /// originals: the trainer clips in place instead unless [`Optimizer::applies_grad_scale`]).
    fn step_scaled(
        &mut self,
        params: &[Var],
        grads: &[Tensor],
        lr: f64,
        scale: Option<&Tensor>,
    ) -> candle_core::Result<()> {
        match scale {
            None => self.step(params, grads, lr),
            Some(s) => {
                let scaled = grads
                    .iter()
                    .map(|g| crate::grads::scaled_by(g, s))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                self.step(params, &scaled, lr)
            }
        }
    }
    /// Optimizer state as named tensors (for checkpoints): `"{i}.exp_avg"`, `"{i}.exp_avg_sq"`,
    /// ... per parameter and [`STEP_KEY`] (0-d u32 on the CPU).
    fn state(&self) -> Vec<(String, Tensor)>;
    /// Restores state saved by [`Optimizer::state`]; errors (naming the tensor) if names or shapes
    /// do not match `params`. Tensors are moved to each parameter's device.
    fn load_state(
        &mut self,
        params: &[Var],
        state: &HashMap<String, Tensor>,
    ) -> candle_core::Result<()>;
    /// Short name, as written in configs (`"adamw"`, `"adamw8bit"`, `"sgd"`).
    fn name(&self) -> &'static str;
    /// Bytes of optimizer state held (for reporting memory): by default the sum over
    /// [`Optimizer::state`] of elements times dtype size.
    fn state_bytes(&self) -> usize {
        self.state()
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

crate::config::choice::choices! {
    /// Which optimizer to build.
    pub enum OptimizerKind {
        /// [`AdamW`], torch.optim.AdamW semantics.
        AdamW = "adamw",
        /// [`AdamW8bit`]: AdamW with blockwise 8-bit moments (bitsandbytes `AdamW8bit`).
        AdamW8bit = "adamw8bit",
        /// [`Sgd`], torch.optim.SGD without momentum.
        Sgd = "sgd",
    }
}

crate::config::choice::any_case_from_str!(OptimizerKind, "optimizer");

/// Builds an optimizer. `betas` and `eps` are used by AdamW only; `weight_decay` is decoupled
/// for AdamW (`p -= lr*wd*p`) and coupled for SGD (`g += wd*p`), as in torch. The values are
/// assumed checked by the config (betas in [0, 1), eps > 0, weight_decay >= 0).
pub fn build(
    kind: OptimizerKind,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) -> Box<dyn Optimizer> {
    let hp = AdamWParams {
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay,
    };
    match kind {
        OptimizerKind::AdamW => Box::new(AdamW::new(hp)),
        OptimizerKind::AdamW8bit => Box::new(AdamW8bit::new(hp)),
        OptimizerKind::Sgd => Box::new(Sgd::new(weight_decay)),
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers shared by the optimizers.

/// Errors unless there is one gradient per parameter, each of its parameter's shape.
pub(crate) fn check_grads(params: &[Var], grads: &[Tensor]) -> candle_core::Result<()> {
    if params.len() != grads.len() {
        candle_core::bail!(
            "optimizer step: {} parameters but {} gradients",
            params.len(),
            grads.len()
        );
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        if p.shape() != g.shape() {
            candle_core::bail!(
                "optimizer step: gradient {i} has shape {:?} but its parameter has shape {:?}",
                g.shape(),
                p.shape()
            );
        }
    }
    Ok(())
}

/// The step counter as a checkpoint tensor (0-d u32 on the CPU).
pub(crate) fn step_tensor(step: u32) -> Tensor {
    // A 0-d tensor from a host value cannot fail on the CPU.
    Tensor::new(step, &Device::Cpu).expect("0-d u32 tensor on the CPU")
}

/// Reads [`STEP_KEY`] (any dtype, 0-d or one element); `None` if absent.
pub(crate) fn read_step(state: &HashMap<String, Tensor>) -> candle_core::Result<Option<u32>> {
    let Some(t) = state.get(STEP_KEY) else {
        return Ok(None);
    };
    let values = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    match values.as_slice() {
        [v] if *v >= 0.0 && v.fract() == 0.0 && *v <= u32::MAX as f64 => Ok(Some(*v as u32)),
        _ => candle_core::bail!(
            "optimizer state `{STEP_KEY}` must hold one non-negative integer, got {values:?}"
        ),
    }
}

/// The step counter of an optimizer with moments, and whether `state` holds any moments (it
/// holds none when saved before the first step; then the counter must be 0 unless there are no
/// parameters), after [`check_state_keys`] with the moments' names `allowed`. Errors if the
/// counter is missing.
pub(crate) fn read_moment_step(
    optimizer: &str,
    state: &HashMap<String, Tensor>,
    n_params: usize,
    allowed: &[&str],
) -> candle_core::Result<(u32, bool)> {
    check_state_keys(optimizer, state, n_params, allowed)?;
    let Some(t) = read_step(state)? else {
        candle_core::bail!("{optimizer} state has no `{STEP_KEY}` tensor");
    };
    let has_moments = state.keys().any(|k| k != STEP_KEY);
    if !has_moments && t != 0 && n_params > 0 {
        candle_core::bail!(
            "{optimizer} state says {t} steps were taken but holds no moments (`0.exp_avg`, ...)"
        );
    }
    Ok((t, has_moments))
}

/// Takes `"{i}.{what}"` from `state`, checks its shape against `param`, and returns it as a
/// contiguous f32 tensor on the parameter's device.
pub(crate) fn load_param_state(
    optimizer: &str,
    state: &HashMap<String, Tensor>,
    i: usize,
    what: &str,
    param: &Var,
) -> candle_core::Result<Tensor> {
    let key = format!("{i}.{what}");
    let Some(t) = state.get(&key) else {
        candle_core::bail!(
            "{optimizer} state has no `{key}` (parameter {i} of {:?}): was the checkpoint \
             written with another optimizer or another set of trainable parameters?",
            param.shape()
        );
    };
    if t.shape() != param.shape() {
        candle_core::bail!(
            "{optimizer} state `{key}` has shape {:?} but parameter {i} has shape {:?}: was \
             the checkpoint written for other trainable parameters?",
            t.shape(),
            param.shape()
        );
    }
    t.to_device(param.device())?
        .to_dtype(DType::F32)?
        .contiguous()
}

/// A state name `"{i}.{what}"` split into the parameter index and the rest (None for names
/// without an index, such as [`STEP_KEY`]).
pub(crate) fn state_index(name: &str) -> Option<(usize, &str)> {
    let (i, what) = name.split_once('.')?;
    Some((i.parse().ok()?, what))
}

/// Errors on a state name that is neither [`STEP_KEY`] nor `"{i}.{what}"` with `i < n_params`
/// and `what` in `allowed`.
pub(crate) fn check_state_keys(
    optimizer: &str,
    state: &HashMap<String, Tensor>,
    n_params: usize,
    allowed: &[&str],
) -> candle_core::Result<()> {
    for key in state.keys() {
        if key == STEP_KEY {
            continue;
        }
        let known =
            state_index(key).is_some_and(|(i, what)| i < n_params && allowed.contains(&what));
        if !known {
            candle_core::bail!(
                "{optimizer} state has an unexpected tensor `{key}` ({n_params} trainable \
                 parameters; expected names {STEP_KEY} and i.{{{}}}): was the checkpoint \
                 written with another optimizer or another set of trainable parameters?",
                allowed.join(",")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_parses_and_prints() {
        assert_eq!("adamw".parse::<OptimizerKind>(), Ok(OptimizerKind::AdamW));
        assert_eq!("AdamW".parse::<OptimizerKind>(), Ok(OptimizerKind::AdamW));
        assert_eq!("sgd".parse::<OptimizerKind>(), Ok(OptimizerKind::Sgd));
        assert_eq!(
            "adamw8bit".parse::<OptimizerKind>(),
            Ok(OptimizerKind::AdamW8bit)
        );
        assert_eq!(OptimizerKind::AdamW8bit.to_string(), "adamw8bit");
        let k: OptimizerKind = serde_json::from_str("\"adamw8bit\"").unwrap();
        assert_eq!(k, OptimizerKind::AdamW8bit);
        assert!("adam"
            .parse::<OptimizerKind>()
            .unwrap_err()
            .contains("adamw"));
        assert_eq!(OptimizerKind::AdamW.to_string(), "adamw");
        let k: OptimizerKind = serde_json::from_str("\"sgd\"").unwrap();
        assert_eq!(k, OptimizerKind::Sgd);
        assert_eq!(
            serde_json::to_string(&OptimizerKind::AdamW).unwrap(),
            "\"adamw\""
        );
    }

    #[test]
    fn build_gives_the_named_optimizer() {
        assert_eq!(
            build(OptimizerKind::AdamW, (0.9, 0.999), 1e-8, 0.0).name(),
            "adamw"
        );
        assert_eq!(
            build(OptimizerKind::Sgd, (0.9, 0.999), 1e-8, 0.0).name(),
            "sgd"
        );
        assert_eq!(
            build(OptimizerKind::AdamW8bit, (0.9, 0.999), 1e-8, 0.0).name(),
            "adamw8bit"
        );
    }

    #[test]
    fn step_round_trips_and_rejects_garbage() {
        let mut state = HashMap::new();
        assert_eq!(read_step(&state).unwrap(), None);
        state.insert(STEP_KEY.to_string(), step_tensor(7));
        assert_eq!(read_step(&state).unwrap(), Some(7));
        state.insert(
            STEP_KEY.to_string(),
            Tensor::new(&[2.5f64], &Device::Cpu).unwrap(),
        );
        assert!(read_step(&state).is_err());
    }
}
