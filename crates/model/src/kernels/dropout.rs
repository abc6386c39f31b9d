//! LoRA dropout with a counter-based mask: no random generator, no stored mask.
//!
//! Element `i` of a contiguous input is kept when the high 32 bits of `mix(seed + (i + 1) * γ)`
//! (SplitMix64's output function, γ its golden-ratio increment) are at least `round(p · 2^32)`,
//! and kept elements are scaled by `1 / (1 - p)`. The mask is a pure function of (seed, i), so:
//! - the backward is the same op applied to dy (no mask is kept in the graph: an (M, in) f32
//!   tensor per adapter less than `x * mask`);
//! - a checkpointed layer's recompute, and a resumed run, draw the same masks;
//! - on CUDA there is no cuRAND generator to create per call (`Device::set_seed` makes a new one
//!   each time: thousands per step with dropout on every linear of a 7B model), only one
//!   element-wise kernel (`kernels/tallow.cu`, `tallow_dropout_f32`), bit-equal to the CPU loop
//!   here (`tallow doctor` checks it).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// SplitMix64's increment (2^64 / φ).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether element `i` survives: the high 32 bits of its hash against round(p · 2^32).
fn keep(seed: u64, i: usize, threshold: u32) -> bool {
    (mix(seed.wrapping_add((i as u64).wrapping_add(1).wrapping_mul(GAMMA))) >> 32) as u32
        >= threshold
}

/// `x ↦ x · mask / (1 - p)`, the mask drawn from `seed` as the module doc says. Its own backward:
/// dx = the same op on dy.
#[derive(Clone, Copy, Debug)]
pub struct DropoutOp {
    pub seed: u64,
    pub p: f32,
}

impl DropoutOp {
    /// round(p · 2^32), saturating (p < 1).
    pub(crate) fn threshold(&self) -> u32 {
        (self.p as f64 * 4_294_967_296.0)
            .round()
            .min(u32::MAX as f64) as u32
    }

    /// 1 / (1 - p), rounded once to f32.
    pub(crate) fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p as f64)) as f32
    }

    /// The op whose element `i` is this op's element `i + skip`: masks of a tensor's rows from
    /// row `skip / in` on, bit-equal to the whole tensor's (mix(seed + (i + 1) γ) with the
    /// seed moved on by `skip` γ).
    pub(crate) fn skip(self, skip: usize) -> Self {
        Self {
            seed: self.seed.wrapping_add((skip as u64).wrapping_mul(GAMMA)),
            ..self
        }
    }

    /// Applies the dropout to `x` (any float dtype; made contiguous).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.contiguous()?.apply_op1(*self)?)
    }

    pub(crate) fn run<T: Copy + Send + Sync + num_like::Scale>(&self, x: &[T]) -> Vec<T> {
        let (seed, threshold, scale) = (self.seed, self.threshold(), self.scale());
        let mut out = vec![T::zero(); x.len()];
        out.par_chunks_mut(1 << 14)
            .zip(x.par_chunks(1 << 14))
            .enumerate()
            .for_each(|(c, (o, x))| {
                let base = c << 14;
                for (j, (o, &v)) in o.iter_mut().zip(x).enumerate() {
                    if keep(seed, base + j, threshold) {
                        *o = v.scale(scale);
                    }
                }
            });
        out
    }
}

pub(crate) mod num_like {
    /// `x * s` in the element type, as the CUDA kernel computes it (f32 multiply for f32).
    pub trait Scale: Sized {
        fn zero() -> Self;
        fn scale(self, s: f32) -> Self;
    }
    impl Scale for f32 {
        fn zero() -> Self {
            0.0
        }
        fn scale(self, s: f32) -> Self {
            self * s
        }
    }
    impl Scale for f64 {
        fn zero() -> Self {
            0.0
        }
        fn scale(self, s: f32) -> Self {
            self * s as f64
        }
    }
    impl Scale for half::bf16 {
        fn zero() -> Self {
            half::bf16::ZERO
        }
        fn scale(self, s: f32) -> Self {
            half::bf16::from_f32(self.to_f32() * s)
        }
    }
    impl Scale for half::f16 {
        fn zero() -> Self {
            half::f16::ZERO
        }
        fn scale(self, s: f32) -> Self {
            half::f16::from_f32(self.to_f32() * s)
        }
    }
}

impl CustomOp1 for DropoutOp {
    fn name(&self) -> &'static str {
        "lora-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("lora-dropout: input must be contiguous");
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.run(&v[start..end])),
            CpuStorage::F64(v) => CpuStorage::F64(self.run(&v[start..end])),
            CpuStorage::BF16(v) => CpuStorage::BF16(self.run(&v[start..end])),
            CpuStorage::F16(v) => CpuStorage::F16(self.run(&v[start..end])),
            other => candle_core::bail!(
                "lora-dropout: unsupported dtype {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("lora-dropout: input must be contiguous");
        };
        let dev = s.device().clone();
        let x = s.as_cuda_slice::<f32>().map_err(|_| {
            candle_core::Error::Msg(format!(
                "lora-dropout on CUDA takes f32 (the adapter dtype), got {:?}",
                s.dtype()
            ))
        })?;
        let x = x.slice(start..end);
        let n = end - start;
        let func = crate::kernels::cuda::func(&dev, "tallow_dropout_f32")?;
        // SAFETY: every element is written by the kernel.
        let y = unsafe { dev.alloc::<f32>(n)? };
        let (seed, threshold, scale) = (self.seed, self.threshold(), self.scale());
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&y);
        b.arg(&n);
        b.arg(&seed);
        b.arg(&threshold);
        b.arg(&scale);
        // SAFETY: argument types and order match `tallow_dropout_f32` in kernels/tallow.cu.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.w()?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(y, dev),
            l.shape().clone(),
        ))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

thread_local! {
    static FIRST_ROW: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` on a tile of a batch's tokens that starts at row `first_row` of the flattened
/// (B * T, in) inputs: the LoRA dropout masks drawn inside are the whole batch's rows from
/// `first_row` on, so a layer run in tiles (activation checkpointing's token tiles) draws the
/// masks of the untiled forward. Per thread and scoped, like [`crate::nn::no_grad::no_grad`].
pub(crate) fn at_row<R>(first_row: usize, f: impl FnOnce() -> R) -> R {
    struct Restore(usize);
    impl Drop for Restore {
        fn drop(&mut self) {
            FIRST_ROW.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(FIRST_ROW.with(|r| r.replace(first_row)));
    f()
}

/// The first row of the tile this thread is running ([`at_row`]; 0 outside one).
pub(crate) fn first_row() -> usize {
    FIRST_ROW.with(|r| r.get())
}

/// LoRA dropout of one model, switched on per micro-batch by the trainer with a seed derived from
/// (run seed, step, micro-batch) and mixed with each adapter's id: masks are a pure function of
/// that, so a resumed run draws exactly the masks of an uninterrupted one, with no state to save.
pub struct Dropout {
    pub p: f32,
    /// u64::MAX = off (evaluation).
    seed: AtomicU64,
}

impl Dropout {
    pub fn new(p: f32) -> Self {
        Self {
            p,
            seed: AtomicU64::new(u64::MAX),
        }
    }

    /// Some(seed): training with that seed; None: no dropout.
    pub fn set(&self, seed: Option<u64>) {
        self.seed.store(seed.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The micro-batch seed while training with p > 0.
    pub fn seed(&self) -> Option<u64> {
        let s = self.seed.load(Ordering::Relaxed);
        (s != u64::MAX && self.p > 0.0).then_some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn drops_a_fraction_p_and_scales_the_rest() -> Result<()> {
        let x = Tensor::ones(100_000, DType::F32, &Device::Cpu)?;
        for p in [0.1f32, 0.3, 0.5] {
            let y: Vec<f32> = DropoutOp { seed: 42, p }.apply(&x)?.to_vec1()?;
            let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
            // Binomial sd at n = 1e5 is <= 0.0016; 0.01 is 6 sd, and far below p's spacing.
            assert!(
                (dropped - p as f64).abs() < 0.01,
                "p = {p}: dropped {dropped}"
            );
            let scale = 1.0 / (1.0 - p);
            assert!(y.iter().all(|&v| v == 0.0 || v == scale));
        }
        Ok(())
    }

    #[test]
    fn mask_is_a_pure_function_of_seed_and_index() -> Result<()> {
        let x = Tensor::ones(4096, DType::F32, &Device::Cpu)?;
        let a: Vec<f32> = DropoutOp { seed: 7, p: 0.3 }.apply(&x)?.to_vec1()?;
        let b: Vec<f32> = DropoutOp { seed: 7, p: 0.3 }.apply(&x)?.to_vec1()?;
        let c: Vec<f32> = DropoutOp { seed: 8, p: 0.3 }.apply(&x)?.to_vec1()?;
        assert_eq!(a, b, "same seed, same mask");
        let differ = a.iter().zip(&c).filter(|(u, v)| u != v).count();
        // Two independent masks with p = 0.3 differ in 2 p (1 - p) = 42% of places.
        assert!(
            differ > 1000,
            "another seed gives another mask ({differ} of 4096 differ)"
        );
        // A prefix of a longer input gets the same mask (index-based, not length-based).
        let short: Vec<f32> = DropoutOp { seed: 7, p: 0.3 }
            .apply(&x.narrow(0, 0, 100)?)?
            .to_vec1()?;
        assert_eq!(short, a[..100]);
        Ok(())
    }

    #[test]
    fn backward_is_the_same_mask_and_keeps_nothing() -> Result<()> {
        let x = Var::randn(0f32, 1., (64, 32), &Device::Cpu)?;
        let op = DropoutOp { seed: 3, p: 0.4 };
        let y = op.apply(x.as_tensor())?;
        let w = Tensor::randn(0f32, 1., (64, 32), &Device::Cpu)?;
        let g = (&y * &w)?.sum_all()?.backward()?;
        let dx = g.get(&x).expect("dx");
        // d/dx sum(w * x * m) = w * m
        let mask = op.apply(&Tensor::ones((64, 32), DType::F32, &Device::Cpu)?)?;
        let want = (&w * &mask)?;
        let diff = (dx - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // The value is x * mask exactly.
        let diff = (&y - (x.as_tensor() * &mask)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }
}
