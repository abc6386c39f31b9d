//! Forward passes without an autograd graph (evaluation).
//!
//! Candle has no `no_grad` mode: an op records its inputs whenever one of them tracks
//! (`is_variable || op.is_some()`), so with LoRA A/B (or every weight, in full fine-tuning) as
//! `Var`s every op of an evaluation forward was recorded, and every intermediate on the path to
//! the loss stayed alive until the loss was dropped: evaluation held as much as a training
//! forward. Inside [`no_grad`], trainable weights enter the forward through [`enter`] detached
//! (same storage, no variable), so no op of the forward has a tracking input and Candle records
//! nothing: each intermediate is freed as soon as the forward stops using it.
//!
//! The switch is per thread (the forward runs on the caller's thread) and scoped: it is restored
//! when the closure returns or unwinds.

use std::cell::Cell;

use candle_core::Tensor;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every trainable weight entering the forward detached: nothing `f` computes
/// from the model tracks gradients (`track_op()` is false on its outputs).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON.with(|on| on.set(self.0));
        }
    }
    let _restore = Restore(ON.with(|on| on.replace(true)));
    f()
}

/// Whether this thread is inside [`no_grad`].
pub fn is_on() -> bool {
    ON.with(|on| on.get())
}

/// A weight as the forward reads it: detached inside [`no_grad`], else itself (a cheap handle
/// clone either way; the storage is shared).
pub fn enter(w: &Tensor) -> Tensor {
    if is_on() {
        w.detach()
    } else {
        w.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::linear::{Base, Linear, Param};
    use crate::nn::lora::Lora;
    use crate::peft::lora::lora_a_init;
    use candle_core::{DType, Device, Var};

    /// A linear layer with every kind of trainable weight: base, bias, LoRA A and B.
    fn trainable_linear(dev: &Device) -> crate::Result<Linear> {
        Ok(Linear {
            weight: Base::Dense(Param::new(Tensor::randn(0f32, 1., (6, 4), dev)?, true)?),
            bias: Some(Param::new(Tensor::randn(0f32, 1., 6, dev)?, true)?),
            adapter: Some(Box::new(Lora {
                a: Var::from_tensor(&lora_a_init(2, 4, 7, dev)?)?,
                b: Var::from_tensor(&Tensor::randn(0f32, 1., (6, 2), dev)?)?,
                scale: 2.0,
                dropout: None,
                id: 0,
            })),
        })
    }

    /// Inside `no_grad` the output equals the tracked forward's exactly and records no op; the
    /// switch is off again afterwards, also after a panic inside it.
    #[test]
    fn no_grad_forward_is_untracked_and_equal() -> crate::Result<()> {
        let dev = Device::Cpu;
        let lin = trainable_linear(&dev)?;
        let x = Tensor::randn(0f32, 1., (2, 3, 4), &dev)?;
        let tracked = lin.forward(&x)?;
        assert!(
            tracked.track_op(),
            "the training forward must record its ops"
        );
        let free = no_grad(|| lin.forward(&x))?;
        assert!(!free.track_op(), "no_grad forward recorded an op");
        let diff = (&tracked - &free)?
            .abs()?
            .max_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        assert_eq!(diff, 0.0);
        assert!(!is_on());
        let _ = std::panic::catch_unwind(|| no_grad(|| panic!("inside")));
        assert!(!is_on(), "the switch must be restored on unwind");
        assert!(lin.forward(&x)?.track_op());
        Ok(())
    }
}
