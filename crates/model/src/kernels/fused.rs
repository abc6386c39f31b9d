//! Fused CPU kernels for the element-wise chains of a training step, each a forward / backward
//! pair (llm.c style) behind a Candle custom op: one pass over memory forward, one backward,
//! rayon over rows (the way the matmuls are threaded), no intermediate tensors and no copy of the
//! value into the graph.
//!
//! | op | forward | backward | replaces (Candle ops, passes) |
//! | --- | --- | --- | --- |
//! | [`masked_softmax`] | softmax(scores + mask) per row | dS = P (dP - sum(dP P)) | mask add, softmax, copy; 3 in backward |
//! | [`rms_norm`] | w * x / sqrt(mean(x^2) + eps) | dx = r (g - xn mean(g xn)), g = dy w | 5 + copy; 8 in backward |
//! | [`rope_heads`] | (B, T, H, D) -> (B, H, T, D), rotary, scale | the transpose of each | transpose copy, 5 + copy; 6 |
//! | [`swiglu`] | silu(g) * u | dg, du in one pass | 2; ~7 |
//! | [`causal_attention`] | softmax(q kᵀ + mask) v, keys up to each 64-row block only | dQ, dK, dV per block | 2 matmuls, softmax, their backward |
//!
//! They run for f32 and f64 CPU tensors, and SwiGLU, rotary and RMSNorm for bf16 too
//! (`Kernel::kernel_bf16`: in f32, rounded where PyTorch's bf16 ops round); [`crate::nn::ops`]
//! dispatches to them there and keeps the device-generic tensor-op path for CUDA (and the other
//! ops in bf16 / f16 on the CPU) until a kernel exists. Each
//! does the same IEEE operations in the same order as that path where it can (so f32 results
//! agree to the last bit or within an ulp); `tests` compare the two, values and gradients, and
//! `crate::nn::ops`' finite-difference tests run through these kernels in f64.
//!
//! bf16 on the CPU: the chunked attention kernel and the LoRA linear widen bf16 operands to f32
//! ([`widen_bf16`]) and round back where the bf16 graph would ([`round_bf16`], [`narrow_bf16`]:
//! to nearest, ties to even, `half`'s bits without its branches), on rayon's threads.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

type R<T> = candle_core::Result<T>;

/// The float types the fused kernels compute in (f32, f64).
pub trait Real:
    candle_core::WithDType
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::SubAssign
    + PartialOrd
{
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn recip(self) -> Self;
    fn tanh(self) -> Self;
    /// The value rounded to bf16 precision (to nearest, ties to even) and back.
    fn round_bf16(self) -> Self;
    /// exp of a value <= 0 (a softmax's x - max), in a form loops vectorize: f32's is
    /// [`exp_nonpositive_f32`], f64's the library exp.
    fn exp_nonpositive(self) -> Self;
    const NEG_INF: Self;
}

macro_rules! real {
    ($t:ty, $round_bf16:expr, $exp_nonpositive:expr) => {
        impl Real for $t {
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn recip(self) -> Self {
                1.0 / self
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn round_bf16(self) -> Self {
                $round_bf16(self)
            }
            #[inline(always)]
            fn exp_nonpositive(self) -> Self {
                $exp_nonpositive(self)
            }
            const NEG_INF: Self = <$t>::NEG_INFINITY;
        }
    };
}
real!(f32, round_bf16, exp_nonpositive_f32);
real!(f64, |x| half::bf16::from_f64(x).to_f64(), f64::exp);

/// exp(x) for x <= 0 in f32 without a call or a branch, so that a loop over it vectorizes
/// (libm's `expf` is a call per element: 5% of a bf16 step on a 32000-word vocabulary, in the
/// cross-entropy's three passes over the logits). Cody-Waite reduction x = n ln2 + r,
/// |r| <= ln2 / 2, and the polynomial of Cephes' `expf` (Stephen L. Moshier; the same
/// coefficients as sse_mathfun's `exp_ps`, zlib licence) for exp(r); scaled by 2^n through the
/// exponent bits. Within 2 ulp of the exact value (a test
/// sweeps [-88, 0]); below -87.3 (the smallest normal's log) the result is 0 rather than a
/// subnormal, a difference below 1.2e-38, and exp(-inf) is 0 as a masked softmax needs. NaN
/// stays NaN.
#[inline(always)]
pub(crate) fn exp_nonpositive_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (no SSE4.1 `round`)
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(-87.336_54, 0.0);
    let n = (c * LOG2E + ROUND) - ROUND;
    let r = c - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let e = p * r * r + r + 1.0;
    let scaled = e * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x.is_nan() {
        x
    } else if x < -87.336_54 {
        0.0
    } else {
        scaled
    }
}

/// Which wide instruction sets this CPU has, detected once: 2 for AVX-512 (F, BW, VL, DQ),
/// 1 for AVX2 + FMA, 0 for neither (the build targets baseline x86-64, SSE2).
#[inline]
pub(crate) fn simd_level() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return 2;
        }
        if has!("avx2") && has!("fma") {
            return 1;
        }
    }
    0
}

/// `fn $name(args) -> ret` (or `fn $name<T: Real>`) that runs `$body` (an `#[inline(always)]` function of the
/// same arguments) compiled for AVX-512 or AVX2 when [`simd_level`] says the CPU has it, so
/// that its loops vectorize at that width. The same operations in the same order whichever
/// width runs (Rust does not contract a * b + c into an FMA): the same bits.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident$(<$T:ident: Real>)?($($a:ident: $t:ty),*) $(-> $r:ty)? => $body:ident) => {
        $(#[$m])*
        $vis fn $name$(<$T: Real>)?($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn v4$(<$T: Real>)?($($a: $t),*) $(-> $r)? {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3$(<$T: Real>)?($($a: $t),*) $(-> $r)? {
                    $body($($a),*)
                }
                match $crate::kernels::fused::simd_level() {
                    // SAFETY: the CPU has the features each function is compiled for.
                    2 => return unsafe { v4($($a),*) },
                    1 => return unsafe { v3($($a),*) },
                    _ => {}
                }
            }
            $body($($a),*)
        }
    };
}
pub(crate) use multiversion;

/// The contiguous elements of a CPU storage.
pub(crate) fn data<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &str,
) -> R<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&T::cpu_storage_as_slice(s)?[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// [`data`] of a tensor's storage (`storage_and_layout`), which must be on the CPU.
pub(crate) fn storage_data<'a, T: candle_core::WithDType>(
    s: &'a candle_core::Storage,
    l: &Layout,
    op: &str,
) -> R<&'a [T]> {
    match s {
        candle_core::Storage::Cpu(c) => data(c, l, op),
        _ => candle_core::bail!("{op}: a tensor is not on the CPU"),
    }
}

/// softmax(row + mask) in place over the first `keys` entries (the scores are in `row`), the
/// rest zeroed: the value of the masked softmax and of the attention op, row by row.
fn masked_softmax_row<T: Real>(row: &mut [T], mask: &[T], keys: usize) {
    let mut max = T::NEG_INF;
    for (v, &m) in row[..keys].iter_mut().zip(mask) {
        *v += m;
        if *v > max {
            max = *v;
        }
    }
    let mut sum = T::zero();
    for e in row[..keys].iter_mut() {
        *e = (*e - max).exp_nonpositive();
        sum += *e;
    }
    for e in row[..keys].iter_mut() {
        *e /= sum;
    }
    row[keys..].iter_mut().for_each(|e| *e = T::zero());
}

/// dS = P * (dP - sum(dP * P)) in place over the first `keys` entries (`row` holds dP).
fn softmax_bwd_row<T: Real>(row: &mut [T], p: &[T], keys: usize) {
    let mut dot = T::zero();
    for (&d, &pv) in row[..keys].iter().zip(p) {
        dot += d * pv;
    }
    for (d, &pv) in row[..keys].iter_mut().zip(p) {
        *d = pv * (*d - dot);
    }
}

/// What differs from one fused op over `N` CPU inputs of one dtype (f32 / f64) to the next: its
/// name, the checks of its inputs' shapes, its kernel and its backward. [`Fused`] makes it a
/// Candle `CustomOp2` / `CustomOp3` (contiguity, the common dtype, the f32 / f64 dispatch).
trait Kernel<const N: usize>: Send + Sync + 'static {
    /// The op's name, in its errors ("fused-...").
    const NAME: &'static str;
    /// What the kernel reads of the inputs' shapes.
    type Dims: Copy;
    /// Checks the inputs' layouts (an error names the mismatch): the kernel's dims and the
    /// output's shape.
    fn check(&self, layouts: [&Layout; N]) -> R<(Self::Dims, Shape)>;
    /// The output's elements from the inputs' contiguous elements.
    fn kernel<T: Real>(&self, inputs: [&[T]; N], dims: Self::Dims) -> R<Vec<T>>;
    /// The same for bf16 inputs, where the op has a bf16 kernel (computing in f32 and rounding
    /// where PyTorch's bf16 ops round); none by default.
    fn kernel_bf16(&self, _inputs: [&[bf16]; N], _dims: Self::Dims) -> R<Vec<bf16>> {
        candle_core::bail!("{}: dtype bf16 (f32 / f64 only)", Self::NAME)
    }
    /// The inputs' gradients (Candle's `bwd`); none by default: the backward ops, applied
    /// with `apply_op*_no_bwd`, are never differentiated.
    fn grads(&self, _args: [&Tensor; N], _res: &Tensor, _grad: &Tensor) -> R<[Option<Tensor>; N]> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
    /// The op on CUDA, for ops that have a kernel in `kernels/tallow.cu` (f32 and bf16: the
    /// dispatch rule, `super::dispatch::fused_with_bf16`, sends them nothing else): its launch
    /// on the inputs' contiguous elements, one kernel. None by default (the rule never sends
    /// those ops to CUDA).
    #[cfg(feature = "cuda")]
    fn cuda(&self, _inputs: [gpu::In<'_>; N], _dims: Self::Dims) -> R<candle_core::CudaStorage> {
        candle_core::bail!("{}: no CUDA kernel (CPU only)", Self::NAME)
    }
}

/// The launch of one kernel of `kernels/tallow.cu` over the contiguous inputs of a [`Kernel`],
/// in their dtype (f32 or bf16: the kernel named `<name>_f32` / `<name>_bf16`).
#[cfg(feature = "cuda")]
mod gpu {
    use super::R;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};

    /// An input: its storage and layout.
    pub(super) type In<'a> = (&'a CudaStorage, &'a Layout);

    /// A scalar argument after the pointers.
    #[derive(Clone, Copy)]
    pub(super) enum Arg {
        Size(usize),
        F32(f32),
        I32(i32),
    }

    pub(super) use crate::kernels::cuda::Grid;

    /// Launches `<name>_<dtype>(inputs..., out, args...)` with an output of `out_len`
    /// elements of the inputs' dtype, which the kernel writes in full.
    pub(super) fn launch<const N: usize>(
        name: &str,
        inputs: [In<'_>; N],
        out_len: usize,
        grid: Grid,
        args: &[Arg],
    ) -> R<CudaStorage> {
        match inputs[0].0.dtype() {
            DType::F32 => launch_as::<f32, N>(name, "f32", inputs, out_len, grid, args),
            DType::BF16 => launch_as::<half::bf16, N>(name, "bf16", inputs, out_len, grid, args),
            d => candle_core::bail!("{name}: no CUDA kernel for {d:?} (f32, bf16)"),
        }
    }

    fn launch_as<T: CudaDType + DeviceRepr, const N: usize>(
        name: &str,
        suffix: &str,
        inputs: [In<'_>; N],
        out_len: usize,
        grid: Grid,
        args: &[Arg],
    ) -> R<CudaStorage> {
        let dev = inputs[0].0.device().clone();
        let views = inputs
            .iter()
            .map(|(s, l)| crate::kernels::cuda::view::<T>(s, l, name))
            .collect::<R<Vec<_>>>()?;
        // SAFETY: every element is written by the kernel (each kernel's comment says how).
        let out = unsafe { dev.alloc::<T>(out_len)? };
        if !grid.is_empty() {
            let func = crate::kernels::cuda::func(&dev, &format!("{name}_{suffix}"))?;
            let mut b = func.builder();
            for v in &views {
                b.arg(v);
            }
            b.arg(&out);
            for a in args {
                match a {
                    Arg::Size(v) => b.arg(v),
                    Arg::F32(v) => b.arg(v),
                    Arg::I32(v) => b.arg(v),
                };
            }
            // SAFETY: each caller's argument list matches its kernel in kernels/tallow.cu.
            unsafe { b.launch(grid.config()) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    /// Threads per row for a row of `c` elements: a multiple of 32, at most 1024.
    pub(super) fn row_threads(c: usize) -> u32 {
        (c.div_ceil(32) * 32).clamp(32, 256) as u32
    }
}

/// [`Kernel::check`], then [`Kernel::cuda`]: the CUDA forward of a [`Fused`] op.
#[cfg(feature = "cuda")]
fn fused_cuda_fwd<K: Kernel<N>, const N: usize>(
    op: &K,
    inputs: [gpu::In<'_>; N],
) -> R<(candle_core::CudaStorage, Shape)> {
    let dtypes = inputs.map(|(s, _)| s.dtype());
    if dtypes.iter().any(|&d| d != dtypes[0]) {
        candle_core::bail!("{}: inputs of dtypes {dtypes:?}", K::NAME);
    }
    let (dims, shape) = op.check(inputs.map(|(_, l)| l))?;
    Ok((op.cuda(inputs, dims)?, shape))
}

/// A [`Kernel`] as a Candle custom op.
struct Fused<K>(K);

/// [`Kernel::check`], then [`Kernel::kernel`] on the inputs' dtype: the CPU forward of a
/// [`Fused`] op.
fn fused_fwd<K: Kernel<N>, const N: usize>(
    op: &K,
    inputs: [(&CpuStorage, &Layout); N],
) -> R<(CpuStorage, Shape)> {
    let dtypes = inputs.map(|(s, _)| s.dtype());
    if dtypes.iter().any(|&d| d != dtypes[0]) {
        candle_core::bail!("{}: inputs of dtypes {dtypes:?}", K::NAME);
    }
    let (dims, shape) = op.check(inputs.map(|(_, l)| l))?;
    fn slices<'a, T: Real, const N: usize>(
        inputs: [(&'a CpuStorage, &Layout); N],
        name: &str,
    ) -> R<[&'a [T]; N]> {
        let mut out = [&[][..]; N];
        for (o, (s, l)) in out.iter_mut().zip(inputs) {
            *o = data(s, l, name)?;
        }
        Ok(out)
    }
    let out = match dtypes[0] {
        DType::F32 => CpuStorage::F32(op.kernel(slices(inputs, K::NAME)?, dims)?),
        DType::F64 => CpuStorage::F64(op.kernel(slices(inputs, K::NAME)?, dims)?),
        DType::BF16 => {
            let mut bf = [&[][..]; N];
            for (o, (s, l)) in bf.iter_mut().zip(inputs) {
                *o = data(s, l, K::NAME)?;
            }
            CpuStorage::BF16(op.kernel_bf16(bf, dims)?)
        }
        d => candle_core::bail!("{}: dtype {d:?} (f32 / f64 only)", K::NAME),
    };
    Ok((out, shape))
}

/// `Ok` when `ok`, else the error of inputs whose shapes do not fit, each shape after its
/// label: "fused-rms-norm: weight [4] for input [2, 3]".
fn fits(ok: bool, op: &str, shapes: &[(&str, &Shape)]) -> R<()> {
    if ok {
        return Ok(());
    }
    let shapes: Vec<String> = shapes
        .iter()
        .map(|(what, s)| format!("{what} {s:?}"))
        .collect();
    candle_core::bail!("{op}: {}", shapes.join(" "))
}

/// Candle's `CustomOp2` / `CustomOp3` for a [`Fused`] kernel of 2 / 3 inputs (each given as
/// its storage, layout and gradient names): the name, the CPU forward and the backward, all
/// from the [`Kernel`].
macro_rules! custom_op {
    ($op:ident, $n:literal, $(($s:ident, $l:ident, $d:ident)),+) => {
        impl<K: Kernel<$n>> $op for Fused<K> {
            fn name(&self) -> &'static str {
                K::NAME
            }

            fn cpu_fwd(&self, $($s: &CpuStorage, $l: &Layout),+) -> R<(CpuStorage, Shape)> {
                fused_fwd(&self.0, [$(($s, $l)),+])
            }

            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $($s: &candle_core::CudaStorage, $l: &Layout),+
            ) -> R<(candle_core::CudaStorage, Shape)> {
                fused_cuda_fwd(&self.0, [$(($s, $l)),+])
            }

            fn bwd(
                &self,
                $($s: &Tensor,)+
                res: &Tensor,
                grad: &Tensor,
            ) -> R<($(custom_op!(@grad $d)),+)> {
                let [$($d),+] = self.0.grads([$($s),+], res, grad)?;
                Ok(($($d),+))
            }
        }
    };
    (@grad $d:ident) => {
        Option<Tensor>
    };
}
custom_op!(CustomOp2, 2, (a, al, da), (b, bl, db));
custom_op!(CustomOp3, 3, (a, al, da), (b, bl, db), (c, cl, dc));

/// An output buffer of `n` elements that the kernel then writes in full: not zeroed first (a
/// zeroed allocation costs a memset, or the kernel's zeroing of fresh pages, per call).
pub(crate) fn uninit<T: candle_core::WithDType>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: Candle's element types (integers, f16, bf16, f32, f64) have no invalid bit
    // patterns, and every caller writes all n elements before the buffer is read (each
    // kernel's loops cover its whole output).
    #[allow(clippy::uninit_vec)]
    unsafe {
        v.set_len(n)
    };
    v
}

/// Elements per rayon task of the bf16 conversions below.
const CONVERT_CHUNK: usize = 1 << 14;

/// bf16 values widened to f32 (exact), on rayon's threads. Candle's own `to_dtype` and its bf16
/// matmul widen on one thread, and the matmul widens the whole storage behind a view.
pub(crate) fn widen_bf16(x: &[half::bf16]) -> Vec<f32> {
    let mut out = uninit::<f32>(x.len());
    out.par_chunks_mut(CONVERT_CHUNK)
        .zip(x.par_chunks(CONVERT_CHUNK))
        .for_each(|(o, x)| widen_into(o, x));
    out
}

multiversion!(
    fn widen_into(o: &mut [f32], x: &[half::bf16]) => widen_body
);

/// bf16's bits widened to f32 (exact), in a form loops vectorize.
#[inline(always)]
fn wide(x: half::bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

#[inline(always)]
fn widen_body(o: &mut [f32], x: &[half::bf16]) {
    // the bits shifted up (`half`'s to_f32 also quiets a signaling NaN, in a branch that keeps
    // the loop from vectorizing)
    o.iter_mut().zip(x).for_each(|(o, x)| *o = wide(*x))
}

/// f32 values rounded to bf16 (to nearest, ties to even: Candle's, `half`'s and PyTorch's
/// rounding), on rayon's threads.
pub(crate) fn narrow_bf16(x: &[f32]) -> Vec<half::bf16> {
    let mut out = uninit::<half::bf16>(x.len());
    out.par_chunks_mut(CONVERT_CHUNK)
        .zip(x.par_chunks(CONVERT_CHUNK))
        .for_each(|(o, x)| narrow_into(o, x));
    out
}

multiversion!(
    fn narrow_into(o: &mut [half::bf16], x: &[f32]) => narrow_body
);

#[inline(always)]
fn narrow_body(o: &mut [half::bf16], x: &[f32]) {
    o.iter_mut()
        .zip(x)
        .for_each(|(o, &v)| *o = half::bf16::from_bits((round_bf16(v).to_bits() >> 16) as u16))
}

/// `t` in `dtype`, bf16 <-> f32 on the CPU on rayon's threads ([`widen_bf16`],
/// [`narrow_bf16`]: the bits of Candle's conversions, which run on one thread); any other
/// conversion, device or layout through Candle's `to_dtype`. The result is outside the graph:
/// for values inside a backward or a no-grad pass.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    let par = t.device().is_cpu()
        && t.is_contiguous()
        && matches!(
            (t.dtype(), dtype),
            (DType::BF16, DType::F32) | (DType::F32, DType::BF16)
        );
    if !par {
        return t.to_dtype(dtype);
    }
    let (st, l) = t.storage_and_layout();
    let out = if dtype == DType::F32 {
        CpuStorage::F32(widen_bf16(storage_data::<bf16>(&st, l, "cast")?))
    } else {
        CpuStorage::BF16(narrow_bf16(storage_data::<f32>(&st, l, "cast")?))
    };
    drop(st);
    Ok(Tensor::from_storage(
        candle_core::Storage::Cpu(out),
        t.shape().clone(),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// x rounded to bf16 and back: the value a bf16 tensor holds after an op that computed x in
/// f32. The same bits as `half::bf16::from_f32` (to nearest, ties to even; NaN stays NaN,
/// quieted), without its branches, so that loops over it vectorize.
#[inline(always)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    f32::from_bits(if nan {
        (b | 0x0040_0000) & 0xffff_0000
    } else {
        rounded
    })
}

/// x rounded to the nearest bf16 (ties to even), as [`round_bf16`].
#[inline]
pub(crate) fn to_bf16(x: f32) -> bf16 {
    bf16::from_bits((round_bf16(x).to_bits() >> 16) as u16)
}

/// Rows per rayon task: about 16 KiB of elements, at least one row.
pub(crate) fn rows_per_task(row: usize) -> usize {
    (4096 / row.max(1)).max(1)
}

// ---------------------------------------------------------------------------------------------
// Softmax over the last dim of scores + an additive mask (0 / -inf), broadcast over heads.

/// softmax(scores + mask) over the last dim: scores (B, X, Y, S), mask (B, 1, T, S) with Y a
/// multiple of T (row y of the scores takes mask row y mod T: (B, H, T, S) scores, or grouped
/// query heads as (B, KV, n_rep * T, S)) -> the scores' shape. Same dtype (f32 / f64).
pub fn masked_softmax(scores: &Tensor, mask: &Tensor) -> R<Tensor> {
    scores
        .contiguous()?
        .apply_op2(&mask.contiguous()?, Fused(MaskedSoftmax))
}

struct MaskedSoftmax;

fn softmax_fwd<T: Real>(
    s: &[T],
    m: &[T],
    dims: (usize, usize, usize, usize),
    t_mask: usize,
) -> R<Vec<T>> {
    let (_b, h, t, n) = dims;
    let mut out = uninit::<T>(s.len());
    let per = rows_per_task(n);
    out.par_chunks_mut(per * n)
        .zip(s.par_chunks(per * n))
        .enumerate()
        .for_each(|(task, (o, x))| {
            for (k, (orow, xrow)) in o.chunks_mut(n).zip(x.chunks(n)).enumerate() {
                let r = task * per + k; // row of (B, H, T)
                let (bi, ti) = (r / (h * t), r % t_mask);
                orow.copy_from_slice(xrow);
                masked_softmax_row(orow, &m[(bi * t_mask + ti) * n..][..n], n);
            }
        });
    Ok(out)
}

impl Kernel<2> for MaskedSoftmax {
    const NAME: &'static str = "fused-masked-softmax";
    /// The scores' (B, X, Y, S) and the mask's T.
    type Dims = ((usize, usize, usize, usize), usize);

    fn check(&self, [sl, ml]: [&Layout; 2]) -> R<(Self::Dims, Shape)> {
        let dims = sl.shape().dims4()?;
        let (b, _, y, n) = dims;
        let (mb, one, t, mn) = ml.shape().dims4()?;
        let ok = (mb, one, mn) == (b, 1, n) && t > 0 && y % t == 0;
        let shapes = [("mask", ml.shape()), ("for scores", sl.shape())];
        fits(ok, Self::NAME, &shapes)?;
        Ok(((dims, t), sl.shape().clone()))
    }

    fn kernel<T: Real>(&self, [s, m]: [&[T]; 2], (dims, t): Self::Dims) -> R<Vec<T>> {
        softmax_fwd(s, m, dims, t)
    }

    fn grads(
        &self,
        [scores, _mask]: [&Tensor; 2],
        p: &Tensor,
        dp: &Tensor,
    ) -> R<[Option<Tensor>; 2]> {
        let ds = p.apply_op2_no_bwd(&dp.contiguous()?, &Fused(SoftmaxBwd))?;
        Ok([Some(ds.to_dtype(scores.dtype())?), None])
    }
}

/// dS = P * (dP - sum(dP * P)) per row.
struct SoftmaxBwd;

fn softmax_bwd<T: Real>(p: &[T], dp: &[T], n: usize) -> R<Vec<T>> {
    let mut out = uninit::<T>(p.len());
    let per = rows_per_task(n);
    out.par_chunks_mut(per * n)
        .zip(p.par_chunks(per * n).zip(dp.par_chunks(per * n)))
        .for_each(|(o, (p, dp))| {
            for ((orow, prow), drow) in o.chunks_mut(n).zip(p.chunks(n)).zip(dp.chunks(n)) {
                orow.copy_from_slice(drow);
                softmax_bwd_row(orow, prow, n);
            }
        });
    Ok(out)
}

impl Kernel<2> for SoftmaxBwd {
    const NAME: &'static str = "fused-masked-softmax-bwd";
    /// The row length.
    type Dims = usize;

    fn check(&self, [pl, dl]: [&Layout; 2]) -> R<(usize, Shape)> {
        let ok = pl.shape() == dl.shape();
        fits(ok, Self::NAME, &[("dP", dl.shape()), ("for P", pl.shape())])?;
        let n = pl.shape().dims().last().copied().unwrap_or(1);
        Ok((n, pl.shape().clone()))
    }

    fn kernel<T: Real>(&self, [p, dp]: [&[T]; 2], n: usize) -> R<Vec<T>> {
        softmax_bwd(p, dp, n)
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = w * (x / sqrt(mean(x^2) + eps)) over the last dim.

/// x: (..., C), w: (C) -> (..., C), same dtype (f32 / f64). The gradient of w, when w is
/// trained, comes from the tensor-op formula (LoRA leaves the norms frozen).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> R<Tensor> {
    let op = RmsNorm {
        eps,
        plus_one: false,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, Fused(op))
}

/// Gemma's RMSNorm in bf16 (`ops::rms_norm_plus_one`'s graph): y = r((x r_s) (1 + w)), r_s =
/// 1 / sqrt(mean(x²) + eps) and the products in f32, rounded once. x: (..., C) bf16, w: (C)
/// bf16 -> (..., C) bf16.
pub fn rms_norm_plus_one_bf16(x: &Tensor, w: &Tensor, eps: f64) -> R<Tensor> {
    let op = RmsNorm {
        eps,
        plus_one: true,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, Fused(op))
}

struct RmsNorm {
    eps: f64,
    /// Gemma's `x_normed * (1 + w)` (bf16 only: f32 / f64 run Llama's form with 1 + w).
    plus_one: bool,
}

fn rms_fwd<T: Real>(x: &[T], w: &[T], eps: f64) -> R<Vec<T>> {
    let c = w.len();
    let mut out = uninit::<T>(x.len());
    let per = rows_per_task(c);
    // Candle's mean: the sum times 1 / C.
    let (eps, inv_n) = (T::from_f64(eps), T::from_f64(1.0 / c as f64));
    out.par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c))
        .for_each(|(o, x)| {
            for (orow, xrow) in o.chunks_mut(c).zip(x.chunks(c)) {
                let mut ss = T::zero();
                for &v in xrow {
                    ss += v * v;
                }
                let s = (ss * inv_n + eps).sqrt();
                for ((o, &v), &wv) in orow.iter_mut().zip(xrow).zip(w) {
                    *o = v / s * wv;
                }
            }
        });
    Ok(out)
}

impl Kernel<2> for RmsNorm {
    const NAME: &'static str = "fused-rms-norm";
    type Dims = ();

    fn check(&self, [xl, wl]: [&Layout; 2]) -> R<((), Shape)> {
        let c = xl.shape().dims().last().copied().unwrap_or(0);
        let ok = wl.shape().dims() == [c];
        let shapes = [("weight", wl.shape()), ("for input", xl.shape())];
        fits(ok, Self::NAME, &shapes)?;
        Ok(((), xl.shape().clone()))
    }

    fn kernel<T: Real>(&self, [x, w]: [&[T]; 2], (): ()) -> R<Vec<T>> {
        if self.plus_one {
            candle_core::bail!("{}: the 1 + w form is bf16 only", Self::NAME);
        }
        rms_fwd(x, w, self.eps)
    }

    /// transformers' `LlamaRMSNorm` in bf16: the normalization in f32, cast to bf16, times w
    /// rounded: y = r(r(x / sqrt(mean(x²) + eps)) · w). Gemma's (`plus_one`): y = r((x r_s)
    /// (1 + w)), r_s = 1 / sqrt(mean(x²) + eps), in f32.
    fn kernel_bf16(&self, [x, w]: [&[bf16]; 2], (): ()) -> R<Vec<bf16>> {
        let c = w.len();
        let w = widen_bf16(w);
        if self.plus_one {
            let w1: Vec<f32> = w.iter().map(|&v| v + 1.0).collect();
            let (eps, inv_n) = (self.eps as f32, (1.0 / c as f64) as f32);
            let mut out = uninit::<bf16>(x.len());
            out.par_chunks_mut(rows_per_task(c) * c)
                .zip(x.par_chunks(rows_per_task(c) * c))
                .for_each(|(o, x)| {
                    for (orow, xrow) in o.chunks_mut(c).zip(x.chunks(c)) {
                        let mut ss = 0f32;
                        for &v in xrow {
                            ss += v.to_f32() * v.to_f32();
                        }
                        let r = (ss * inv_n + eps).sqrt().recip();
                        for ((o, &v), &wv) in orow.iter_mut().zip(xrow).zip(&w1) {
                            *o = to_bf16(v.to_f32() * r * wv);
                        }
                    }
                });
            return Ok(out);
        }
        let (eps, inv_n) = (self.eps as f32, (1.0 / c as f64) as f32);
        let mut out = uninit::<bf16>(x.len());
        out.par_chunks_mut(rows_per_task(c) * c)
            .zip(x.par_chunks(rows_per_task(c) * c))
            .for_each(|(o, x)| {
                let mut xf = vec![0f32; c];
                for (orow, xrow) in o.chunks_mut(c).zip(x.chunks(c)) {
                    let mut ss = 0f32;
                    for (f, &v) in xf.iter_mut().zip(xrow) {
                        *f = v.to_f32();
                        ss += *f * *f;
                    }
                    let s = (ss * inv_n + eps).sqrt();
                    for ((o, &v), &wv) in orow.iter_mut().zip(&xf).zip(&w) {
                        *o = to_bf16(round_bf16(v / s) * wv);
                    }
                }
            });
        Ok(out)
    }

    /// `tallow_rms_norm_*`: one block per row.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 2], (): ()) -> R<candle_core::CudaStorage> {
        let name = if self.plus_one {
            "tallow_rms_norm_p1"
        } else {
            "tallow_rms_norm"
        };
        rms_launch(name, inputs, self.eps)
    }

    fn grads(&self, [x, w]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> R<[Option<Tensor>; 2]> {
        let bwd = Fused(RmsNormBwd {
            eps: self.eps,
            plus_one: self.plus_one,
        });
        let dx = x.apply_op3_no_bwd(w, &dy.contiguous()?, &bwd)?;
        let dw = if w.track_op() && self.plus_one {
            // as `ops::rms_norm_plus_one`'s backward: sum over rows of dy · xn, in f32
            let c = w.elem_count();
            let xf = x.to_dtype(DType::F32)?;
            let r =
                ((xf.sqr()?.mean_keepdim(candle_core::D::Minus1)? + self.eps)?.sqrt()?).recip()?;
            let prod = (dy.to_dtype(DType::F32)? * xf.broadcast_mul(&r)?)?;
            Some(prod.reshape(((), c))?.sum(0)?.to_dtype(w.dtype())?.detach())
        } else if w.track_op() && x.dtype() == DType::BF16 {
            // as `ops::rms_norm_generic`'s backward: sum over rows of dy · bf16(xn), in f32
            let c = w.elem_count();
            let xf = x.to_dtype(DType::F32)?;
            let r =
                ((xf.sqr()?.mean_keepdim(candle_core::D::Minus1)? + self.eps)?.sqrt()?).recip()?;
            let xn = xf
                .broadcast_mul(&r)?
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?;
            let prod = (dy.to_dtype(DType::F32)? * xn)?;
            Some(
                prod.reshape(((), c))?
                    .sum(0)?
                    .to_dtype(DType::BF16)?
                    .detach(),
            )
        } else if w.track_op() {
            // sum over rows of dy * xn
            let c = w.elem_count();
            let r =
                ((x.sqr()?.mean_keepdim(candle_core::D::Minus1)? + self.eps)?.sqrt()?).recip()?;
            let xn = x.broadcast_mul(&r)?;
            Some((dy * xn)?.reshape(((), c))?.sum(0)?.detach())
        } else {
            None
        };
        Ok([Some(dx), dw])
    }
}

/// An RMSNorm kernel (forward or backward) on x (rows of C), w (C) and, backward, dy: one
/// block per row; eps and 1 / C in f32, as the CPU kernels take them (`T::from_f64`).
#[cfg(feature = "cuda")]
fn rms_launch<const N: usize>(
    name: &str,
    inputs: [gpu::In<'_>; N],
    eps: f64,
) -> R<candle_core::CudaStorage> {
    let (n, c) = (
        inputs[0].1.shape().elem_count(),
        inputs[1].1.shape().elem_count(),
    );
    let (rows, threads) = (n / c.max(1), gpu::row_threads(c));
    let args = [
        gpu::Arg::Size(c),
        gpu::Arg::F32(eps as f32),
        gpu::Arg::F32((1.0 / c as f64) as f32),
    ];
    gpu::launch(name, inputs, n, gpu::Grid::Rows { rows, threads }, &args)
}

/// dx = r * (g - xn * mean(g * xn)), g = dy * w, xn = x * r, r = 1 / sqrt(mean(x^2) + eps).
struct RmsNormBwd {
    eps: f64,
    /// Gemma's form: g = dy (1 + w) in f32, not rounded (bf16 only).
    plus_one: bool,
}

fn rms_bwd<T: Real>(x: &[T], w: &[T], dy: &[T], eps: f64) -> R<Vec<T>> {
    let c = w.len();
    let mut out = uninit::<T>(x.len());
    let per = rows_per_task(c);
    let (eps, inv_n) = (T::from_f64(eps), T::from_f64(1.0 / c as f64));
    out.par_chunks_mut(per * c)
        .zip(x.par_chunks(per * c).zip(dy.par_chunks(per * c)))
        .for_each(|(o, (x, dy))| {
            for ((orow, xrow), drow) in o.chunks_mut(c).zip(x.chunks(c)).zip(dy.chunks(c)) {
                let mut ss = T::zero();
                for &v in xrow {
                    ss += v * v;
                }
                let r = (ss * inv_n + eps).sqrt().recip();
                let mut dot = T::zero();
                for ((&v, &d), &wv) in xrow.iter().zip(drow).zip(w) {
                    dot += d * wv * (v * r);
                }
                let mean = dot * inv_n;
                for (((o, &v), &d), &wv) in orow.iter_mut().zip(xrow).zip(drow).zip(w) {
                    *o = (d * wv - v * r * mean) * r;
                }
            }
        });
    Ok(out)
}

impl Kernel<3> for RmsNormBwd {
    const NAME: &'static str = "fused-rms-norm-bwd";
    type Dims = ();

    fn check(&self, [xl, _wl, dl]: [&Layout; 3]) -> R<((), Shape)> {
        let ok = xl.shape() == dl.shape();
        fits(ok, Self::NAME, &[("dy", dl.shape()), ("for x", xl.shape())])?;
        Ok(((), xl.shape().clone()))
    }

    fn kernel<T: Real>(&self, [x, w, dy]: [&[T]; 3], (): ()) -> R<Vec<T>> {
        if self.plus_one {
            candle_core::bail!("{}: the 1 + w form is bf16 only", Self::NAME);
        }
        rms_bwd(x, w, dy, self.eps)
    }

    /// `tallow_rms_norm_bwd_*`: one block per row.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 3], (): ()) -> R<candle_core::CudaStorage> {
        let name = if self.plus_one {
            "tallow_rms_norm_p1_bwd"
        } else {
            "tallow_rms_norm_bwd"
        };
        rms_launch(name, inputs, self.eps)
    }

    /// `ops::rms_norm_generic`'s bf16 backward: r = 1 / sqrt(mean(x²) + eps) and xn = x r in
    /// f32, g = r(dy · w) (the bf16 product), dx = r((g - xn mean(g xn)) r).
    fn kernel_bf16(&self, [x, w, dy]: [&[bf16]; 3], (): ()) -> R<Vec<bf16>> {
        let c = w.len();
        let (eps, inv_n) = (self.eps as f32, (1.0 / c as f64) as f32);
        let plus_one = self.plus_one;
        let mut out = uninit::<bf16>(x.len());
        let per = rows_per_task(c) * c;
        out.par_chunks_mut(per)
            .zip(x.par_chunks(per).zip(dy.par_chunks(per)))
            .for_each(|(o, (x, dy))| {
                let (mut xn, mut g) = (vec![0f32; c], vec![0f32; c]);
                for ((orow, xrow), drow) in o.chunks_mut(c).zip(x.chunks(c)).zip(dy.chunks(c)) {
                    let mut ss = 0f32;
                    for &v in xrow {
                        let f = v.to_f32();
                        ss += f * f;
                    }
                    let r = (ss * inv_n + eps).sqrt().recip();
                    let mut dot = 0f32;
                    for i in 0..c {
                        xn[i] = xrow[i].to_f32() * r;
                        g[i] = if plus_one {
                            drow[i].to_f32() * (w[i].to_f32() + 1.0)
                        } else {
                            round_bf16(drow[i].to_f32() * w[i].to_f32())
                        };
                        dot += g[i] * xn[i];
                    }
                    let mean = dot * inv_n;
                    for i in 0..c {
                        orow[i] = to_bf16((g[i] - xn[i] * mean) * r);
                    }
                }
            });
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding with the head transpose: (B, T, H, D) -> (B, H, T, D).

/// `scale * (x * cos + rotate_half(x) * sin)` with the heads moved in front of time, in one pass:
/// x (B, T, H, D) contiguous, cos / sin (B, 1, T, D) -> (B, H, T, D). Same dtype (f32 / f64).
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> R<Tensor> {
    let tables = rope_tables(cos, sin)?; // (2, B, 1, T, D)
    let op = Rope {
        scale,
        backward: false,
    };
    x.contiguous()?.apply_op2(&tables, Fused(op))
}

thread_local! {
    /// The stacked tables of the last two (cos, sin) pairs, by tensor id (ids are never
    /// reused): every layer of a step rotates q and k with the same tables (two pairs for Gemma
    /// 3's sliding and global layers), so the stack is made once per step, not twice per layer
    /// (two copies each on CUDA).
    static TABLES: std::cell::RefCell<Vec<(candle_core::TensorId, candle_core::TensorId, Tensor)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// cos and sin stacked, (2, B, 1, T, D), detached; made once per pair of tables.
fn rope_tables(cos: &Tensor, sin: &Tensor) -> R<Tensor> {
    let key = (cos.id(), sin.id());
    if let Some(t) = TABLES.with(|c| {
        c.borrow()
            .iter()
            .find(|(a, b, _)| (*a, *b) == key)
            .map(|(_, _, t)| t.clone())
    }) {
        return Ok(t);
    }
    let t = Tensor::stack(&[cos.contiguous()?, sin.contiguous()?], 0)?.detach();
    TABLES.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() == 2 {
            c.remove(0);
        }
        c.push((key.0, key.1, t.clone()));
    });
    Ok(t)
}

/// Forward: x (B, T, H, D) -> (B, H, T, D). Backward (`backward`): dy (B, H, T, D) -> dx
/// (B, T, H, D), dx = scale * (dy * cos + R^T(dy * sin)), R^T([z1, z2]) = [z2, -z1].
struct Rope {
    scale: f64,
    backward: bool,
}

/// `round`: each product and sum rounded to bf16 as the bf16 graph of [`apply_rope_scaled`]
/// (and transformers' `q * cos + rotate_half(q) * sin` in bf16) rounds it (a constant of the
/// row loops, [`rope_rows_as`], so the f32 / f64 loop has no branch for it).
///
/// [`apply_rope_scaled`]: crate::nn::ops::apply_rope_scaled
fn rope_run<T: Real>(
    x: &[T],
    cs: &[T],
    dims: (usize, usize, usize, usize),
    scale: f64,
    round: bool,
    backward: bool,
) -> R<Vec<T>> {
    // Forward: x is (B, T, H, D), out (B, H, T, D); backward: x is (B, H, T, D), out (B, T, H, D).
    let (b, t, h, d) = dims;
    let (cos, sin) = cs.split_at(b * t * d);
    let scale = T::from_f64(scale);
    let mut out = uninit::<T>(x.len());
    // One task per block of output rows (D-vectors), about 16 KiB of them.
    let rows = rows_per_task(d);
    out.par_chunks_mut(rows * d)
        .enumerate()
        .for_each(|(task, o)| {
            rope_rows::<T>(
                o,
                task * rows,
                x,
                (cos, sin),
                (t, h, d),
                scale,
                (round, backward),
            )
        });
    Ok(out)
}

multiversion!(
    /// Output rows `row0..` of the rotary op (its forward or backward) into `o`.
    fn rope_rows<T: Real>(o: &mut [T], row0: usize, x: &[T], cs: (&[T], &[T]), thd: (usize, usize, usize), scale: T, rb: (bool, bool)) => rope_rows_body
);

/// [`rope_rows`]'s body: `rb` = (round, backward), matched once for all rows.
#[inline(always)]
fn rope_rows_body<T: Real>(
    o: &mut [T],
    row0: usize,
    x: &[T],
    cs: (&[T], &[T]),
    thd: (usize, usize, usize),
    scale: T,
    rb: (bool, bool),
) {
    match rb {
        (false, false) => rope_rows_as::<T, false, false>(o, row0, x, cs, thd, scale),
        (true, false) => rope_rows_as::<T, true, false>(o, row0, x, cs, thd, scale),
        (false, true) => rope_rows_as::<T, false, true>(o, row0, x, cs, thd, scale),
        (true, true) => rope_rows_as::<T, true, true>(o, row0, x, cs, thd, scale),
    }
}

/// The rows of [`rope_rows`], with the rounding and the direction as constants.
#[inline(always)]
fn rope_rows_as<T: Real, const ROUND: bool, const BACKWARD: bool>(
    o: &mut [T],
    row0: usize,
    x: &[T],
    (cos, sin): (&[T], &[T]),
    (t, h, d): (usize, usize, usize),
    scale: T,
) {
    for (i, o) in o.chunks_mut(d).enumerate() {
        let row = row0 + i;
        // Output row index -> (bi, ti) and the input row.
        let (bi, ti, src) = if BACKWARD {
            // out (B, T, H, D): row = (bi * t + ti) * h + hi; input (B, H, T, D)
            let (bt, hi) = (row / h, row % h);
            let (bi, ti) = (bt / t, bt % t);
            (bi, ti, ((bi * h + hi) * t + ti) * d)
        } else {
            // out (B, H, T, D): row = (bi * h + hi) * t + ti; input (B, T, H, D)
            let (bh, ti) = (row / t, row % t);
            let (bi, hi) = (bh / h, bh % h);
            (bi, ti, ((bi * t + ti) * h + hi) * d)
        };
        let c = &cos[(bi * t + ti) * d..][..d];
        let s = &sin[(bi * t + ti) * d..][..d];
        if BACKWARD {
            rope_bwd_row::<T, ROUND>(o, &x[src..src + d], c, s, scale);
        } else {
            rope_fwd_row::<T, ROUND>(o, &x[src..src + d], c, s, scale);
        }
    }
}

/// o = x cos + rotate_half(x) sin (then times `scale` unless it is 1), rotate_half(x) being
/// (-x[half..], x[..half]).
#[inline(always)]
fn rope_fwd_row<T: Real, const ROUND: bool>(o: &mut [T], x: &[T], c: &[T], s: &[T], scale: T) {
    let rb = |v: T| if ROUND { v.round_bf16() } else { v };
    let d = o.len();
    let half = d / 2;
    let (x, c, s) = (&x[..d], &c[..d], &s[..d]);
    let (lo, hi) = o.split_at_mut(half);
    for k in 0..half {
        lo[k] = rb(rb(x[k] * c[k]) + rb(-x[k + half] * s[k]));
        hi[k] = rb(rb(x[half + k] * c[half + k]) + rb(x[k] * s[half + k]));
    }
    if scale != T::one() {
        o.iter_mut().for_each(|v| *v = rb(*v * scale));
    }
}

/// The transpose of [`rope_fwd_row`]: o = g cos + (g[half..] sin[half..], -g[..half] sin[..half]),
/// with g = x scale (rounded) unless the scale is 1.
#[inline(always)]
fn rope_bwd_row<T: Real, const ROUND: bool>(o: &mut [T], x: &[T], c: &[T], s: &[T], scale: T) {
    let rb = |v: T| if ROUND { v.round_bf16() } else { v };
    let d = o.len();
    let half = d / 2;
    let (x, c, s) = (&x[..d], &c[..d], &s[..d]);
    let one = scale == T::one();
    let g = |j: usize| if one { x[j] } else { rb(x[j] * scale) };
    let (lo, hi) = o.split_at_mut(half);
    for k in 0..half {
        lo[k] = rb(rb(g(k) * c[k]) + rb(g(k + half) * s[k + half]));
        hi[k] = rb(rb(g(half + k) * c[half + k]) - rb(g(k) * s[k]));
    }
}

impl Kernel<2> for Rope {
    const NAME: &'static str = "fused-rope";
    /// (B, T, H, D) of the forward's input (the backward's output).
    type Dims = (usize, usize, usize, usize);

    fn check(&self, [xl, cl]: [&Layout; 2]) -> R<(Self::Dims, Shape)> {
        let (b, t, h, d) = if self.backward {
            let (b, h, t, d) = xl.shape().dims4()?;
            (b, t, h, d)
        } else {
            xl.shape().dims4()?
        };
        let ok = cl.shape().dims() == [2, b, 1, t, d] && d % 2 == 0;
        let shapes = [("tables", cl.shape()), ("for x", xl.shape())];
        fits(ok, Self::NAME, &shapes)?;
        let shape = if self.backward {
            Shape::from((b, t, h, d))
        } else {
            Shape::from((b, h, t, d))
        };
        Ok(((b, t, h, d), shape))
    }

    fn kernel<T: Real>(&self, [x, cs]: [&[T]; 2], dims: Self::Dims) -> R<Vec<T>> {
        rope_run::<T>(x, cs, dims, self.scale, false, self.backward)
    }

    /// In f32 on the widened inputs, rounded to bf16 where the bf16 graph rounds.
    fn kernel_bf16(&self, [x, cs]: [&[bf16]; 2], dims: Self::Dims) -> R<Vec<bf16>> {
        let (x, cs) = (widen_bf16(x), widen_bf16(cs));
        let y = rope_run::<f32>(&x, &cs, dims, self.scale, true, self.backward)?;
        Ok(narrow_bf16(&y))
    }

    /// `tallow_rope_*`: one thread per (output row, pair of elements k, k + D/2).
    #[cfg(feature = "cuda")]
    fn cuda(&self, [x, cs]: [gpu::In<'_>; 2], dims: Self::Dims) -> R<candle_core::CudaStorage> {
        let (b, t, h, d) = dims;
        let n = x.1.shape().elem_count();
        let args = [
            gpu::Arg::Size(b),
            gpu::Arg::Size(t),
            gpu::Arg::Size(h),
            gpu::Arg::Size(d),
            gpu::Arg::F32(self.scale as f32),
            gpu::Arg::I32(self.backward as i32),
        ];
        gpu::launch("tallow_rope", [x, cs], n, gpu::Grid::Elems(n / 2), &args)
    }

    fn grads(
        &self,
        [_x, tables]: [&Tensor; 2],
        _y: &Tensor,
        dy: &Tensor,
    ) -> R<[Option<Tensor>; 2]> {
        let bwd = Rope {
            scale: self.scale,
            backward: true,
        };
        let dx = dy.contiguous()?.apply_op2_no_bwd(tables, &Fused(bwd))?;
        Ok([Some(dx), None])
    }
}

// ---------------------------------------------------------------------------------------------
// Causal attention core: softmax(q kᵀ + mask) v, skipping the keys after each row block.

/// Rows per block of the causal attention: the keys after a block's last row are never read.
const ATT_BLOCK: usize = 64;

/// y = softmax(q kᵀ + mask) v for a causal `mask` (every key after its query masked: what
/// `ops::attention_mask` builds, packed rows and sliding windows included), computed per block
/// of 64 query rows over the keys up to the block's last row only (about half the matmul work
/// of the full (T, T) scores at long T). q: (B, KV, n_rep * T, D) (carrying the 1/sqrt(D)
/// scale), k, v: (B, KV, T, D), mask: (B, 1, T, T) -> (B, KV, n_rep * T, D). The probabilities
/// are kept in the op for the backward, as the eager path keeps them in the graph.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> R<Tensor> {
    let op = CausalAttention {
        mask: mask.contiguous()?.detach(),
        probs: std::sync::Mutex::new(None),
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, Fused(op))
}

struct CausalAttention {
    mask: Tensor,
    /// (B, KV, n_rep * T, T) probabilities of the forward, zero after each block's last key.
    probs: std::sync::Mutex<Option<Tensor>>,
}

/// Keys a block of query rows [i0, i1) reads: up to its last query position when the block
/// lies within one repeat of the T positions (query row i is position i mod T), else all T.
fn block_keys(i0: usize, i1: usize, t: usize) -> usize {
    if i0 / t == (i1 - 1) / t {
        (i1 - 1) % t + 1
    } else {
        t
    }
}

/// The blocks of [`ATT_BLOCK`] query rows of `r` rows over `t` keys: (first row, end row, keys
/// read), see [`block_keys`].
fn att_blocks(r: usize, t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..r).step_by(ATT_BLOCK).map(move |i0| {
        let i1 = (i0 + ATT_BLOCK).min(r);
        (i0, i1, block_keys(i0, i1, t))
    })
}

/// `dst (m, n) [+]= lhs (m, k) * rhs (k, n)` with row stride `dst_rs` for dst and the given
/// (column, row) strides for lhs and rhs, single-threaded (the caller parallelizes over heads).
///
/// # Safety
/// Every element the dimensions and strides reach lies inside its slice.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_strided<T: Real>(
    dst: &mut [T],
    dst_rs: usize,
    read_dst: bool,
    lhs: &[T],
    (lhs_cs, lhs_rs): (usize, usize),
    rhs: &[T],
    (rhs_cs, rhs_rs): (usize, usize),
    (m, n, k): (usize, usize, usize),
) {
    gemm::gemm(
        m,
        n,
        k,
        dst.as_mut_ptr(),
        1,
        dst_rs as isize,
        read_dst,
        lhs.as_ptr(),
        lhs_cs as isize,
        lhs_rs as isize,
        rhs.as_ptr(),
        rhs_cs as isize,
        rhs_rs as isize,
        T::one(),
        T::one(),
        false,
        false,
        false,
        gemm::Parallelism::None,
    )
}

/// `dst (m, n) [+]= lhs (m, k) * rhs` (rhs (n, k) used transposed when `rhs_t`, else (k, n)), row
/// strides given, single-threaded (the caller parallelizes over heads).
#[allow(clippy::too_many_arguments)]
pub(crate) fn small_gemm<T: Real>(
    dst: &mut [T],
    dst_rs: usize,
    read_dst: bool,
    lhs: &[T],
    lhs_rs: usize,
    rhs: &[T],
    rhs_rs: usize,
    rhs_t: bool,
    mnk: (usize, usize, usize),
) {
    let (m, n, k) = mnk;
    let rhs_strides = if rhs_t { (rhs_rs, 1) } else { (1, rhs_rs) };
    assert!(m == 0 || (dst.len() >= (m - 1) * dst_rs + n && lhs.len() >= (m - 1) * lhs_rs + k));
    // SAFETY: the bounds above hold for dst and lhs; rhs holds n rows (rhs_t) or k rows of
    // rhs_rs elements by the callers' construction (slices of whole (T, D) head matrices).
    unsafe {
        gemm_strided(
            dst,
            dst_rs,
            read_dst,
            lhs,
            (1, lhs_rs),
            rhs,
            rhs_strides,
            mnk,
        )
    }
}

#[allow(clippy::too_many_arguments)]
/// Forward of one (b, kv) head group: q (R, D), k, v (T, D), mask (T, T) -> y (R, D), p (R, T).
fn attention_group<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &[T],
    y: &mut [T],
    p: &mut [T],
    t: usize,
    d: usize,
) {
    for (i0, i1, keys) in att_blocks(q.len() / d, t) {
        let m = i1 - i0;
        let prow = &mut p[i0 * t..i1 * t];
        small_gemm(prow, t, false, &q[i0 * d..], d, k, d, true, (m, keys, d)); // scores
        for (ri, row) in prow.chunks_mut(t).enumerate() {
            let ti = (i0 + ri) % t;
            masked_softmax_row(row, &mask[ti * t..][..t], keys);
        }
        let yrow = &mut y[i0 * d..];
        small_gemm(yrow, d, false, prow, t, v, d, false, (m, d, keys)); // p v
    }
}

/// Backward of one head group: dq (R, D); dk, dv (T, D) accumulated (zeroed by the caller).
#[allow(clippy::too_many_arguments)]
fn attention_group_bwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    p: &[T],
    dy: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    t: usize,
    d: usize,
) {
    let mut ds = vec![T::zero(); ATT_BLOCK * t];
    for (i0, i1, keys) in att_blocks(q.len() / d, t) {
        let m = i1 - i0;
        let prow = &p[i0 * t..i1 * t];
        let ds = &mut ds[..m * t];
        small_gemm(ds, t, false, &dy[i0 * d..], d, v, d, true, (m, keys, d)); // dP = dY vᵀ
        for (row, prow) in ds.chunks_mut(t).zip(prow.chunks(t)) {
            softmax_bwd_row(row, prow, keys);
        }
        let dqrow = &mut dq[i0 * d..];
        small_gemm(dqrow, d, false, ds, t, k, d, false, (m, d, keys)); // dS k
        add_at_b(dk, ds, t, &q[i0 * d..i1 * d], (m, keys, d)); // dK += dSᵀ q
        add_at_b(dv, prow, t, &dy[i0 * d..i1 * d], (m, keys, d)); // dV += Pᵀ dY
    }
}

/// `dst (n, d) += aᵀ b` for a (m, n) (row stride `a_rs`) and b (m, d): the key-side gradients of
/// attention (dK += dSᵀ q, dV += Pᵀ dY), with `a` read transposed through its strides.
pub(crate) fn add_at_b<T: Real>(
    dst: &mut [T],
    a: &[T],
    a_rs: usize,
    b: &[T],
    (m, n, d): (usize, usize, usize),
) {
    assert!(m == 0 || (dst.len() >= n * d && a.len() >= (m - 1) * a_rs + n && b.len() >= m * d));
    // SAFETY: dst holds n rows of d, a m rows of a_rs (n used), b m rows of d: checked above.
    unsafe { gemm_strided(dst, d, true, a, (a_rs, 1), b, (1, d), (n, d, m)) }
}

fn attention_fwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &[T],
    (b, kv, r, t, d): (usize, usize, usize, usize, usize),
) -> (Vec<T>, Vec<T>) {
    let mut y = uninit::<T>(b * kv * r * d);
    let mut p = uninit::<T>(b * kv * r * t);
    y.par_chunks_mut(r * d)
        .zip(p.par_chunks_mut(r * t))
        .enumerate()
        .for_each(|(g, (y, p))| {
            let bi = g / kv;
            attention_group(
                &q[g * r * d..(g + 1) * r * d],
                &k[g * t * d..(g + 1) * t * d],
                &v[g * t * d..(g + 1) * t * d],
                &mask[bi * t * t..(bi + 1) * t * t],
                y,
                p,
                t,
                d,
            )
        });
    (y, p)
}

/// The backward of [`attention_fwd`] over all (b, kv) head groups: dq (B, KV, R, D), dk, dv
/// (B, KV, T, D).
#[allow(clippy::type_complexity)]
fn attention_bwd<T: Real>(
    [q, k, v, p, dy]: [&[T]; 5],
    (_b, _kv, r, t, d): (usize, usize, usize, usize, usize),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    group_grads((q.len(), k.len()), (r, t, d), |g, dq, dk, dv| {
        let (qs, ts, ps) = (
            g * r * d..(g + 1) * r * d,
            g * t * d..(g + 1) * t * d,
            g * r * t..(g + 1) * r * t,
        );
        attention_group_bwd(
            &q[qs.clone()],
            &k[ts.clone()],
            &v[ts],
            &p[ps],
            &dy[qs],
            dq,
            dk,
            dv,
            t,
            d,
        )
    })
}

/// dq (groups of R x D rows), dk and dv (groups of T x D, zeroed) of an attention backward
/// over (batch, kv head) groups, one rayon task per group: `f(g, dq, dk, dv)` writes group g's
/// dq and accumulates its dk, dv. q_len and kv_len: dq's and dk's (dv's) lengths.
pub(crate) fn group_grads<T: Real>(
    (q_len, kv_len): (usize, usize),
    (r, t, d): (usize, usize, usize),
    f: impl Fn(usize, &mut [T], &mut [T], &mut [T]) + Sync,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut dq = uninit::<T>(q_len);
    let mut dk = vec![T::zero(); kv_len];
    let mut dv = vec![T::zero(); kv_len];
    dq.par_chunks_mut(r * d)
        .zip(dk.par_chunks_mut(t * d).zip(dv.par_chunks_mut(t * d)))
        .enumerate()
        .for_each(|(g, (dq, (dk, dv)))| f(g, dq, dk, dv));
    (dq, dk, dv)
}

impl Kernel<3> for CausalAttention {
    const NAME: &'static str = "fused-causal-attention";
    /// (B, KV, R, T, D): R = n_rep * T query rows, T keys.
    type Dims = (usize, usize, usize, usize, usize);

    fn check(&self, [ql, kl, vl]: [&Layout; 3]) -> R<(Self::Dims, Shape)> {
        let (b, kv, r, d) = ql.shape().dims4()?;
        let (kb, kkv, t, kd) = kl.shape().dims4()?;
        let ok = (kb, kkv, kd) == (b, kv, d) && vl.shape() == kl.shape() && t > 0 && r % t == 0;
        let shapes = [("q", ql.shape()), ("k", kl.shape()), ("v", vl.shape())];
        fits(ok, Self::NAME, &shapes)?;
        if self.mask.dims4()? != (b, 1, t, t) {
            candle_core::bail!("{}: mask {:?} for {t} keys", Self::NAME, self.mask.shape());
        }
        Ok(((b, kv, r, t, d), ql.shape().clone()))
    }

    fn kernel<T: Real>(&self, [q, k, v]: [&[T]; 3], dims: Self::Dims) -> R<Vec<T>> {
        let (b, kv, r, t, _) = dims;
        let (ms, ml) = self.mask.storage_and_layout();
        let mask = storage_data(&ms, ml, "fused-causal-attention mask")?;
        let (y, p) = attention_fwd(q, k, v, mask, dims);
        let p = Tensor::from_vec(p, (b, kv, r, t), &candle_core::Device::Cpu)?;
        *self.probs.lock().expect("probs lock") = Some(p);
        Ok(y)
    }

    fn grads(&self, [q, k, v]: [&Tensor; 3], _y: &Tensor, dy: &Tensor) -> R<[Option<Tensor>; 3]> {
        let p = self
            .probs
            .lock()
            .expect("probs lock")
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg("fused-causal-attention: backward run twice".into())
            })?;
        let (b, kv, r, d) = q.dims4()?;
        let t = k.dim(2)?;
        let dims = (b, kv, r, t, d);
        let dy = dy.contiguous()?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let guards = [&q, &k, &v, &p, &dy].map(|x| x.storage_and_layout());
        macro_rules! go {
            ($ty:ty) => {{
                let mut sl: [&[$ty]; 5] = [&[]; 5];
                for (s, (st, l)) in sl.iter_mut().zip(&guards) {
                    *s = storage_data(st, l, Self::NAME)?;
                }
                let (dq, dk, dv) = attention_bwd(sl, dims);
                let dev = candle_core::Device::Cpu;
                (
                    Tensor::from_vec(dq, (b, kv, r, d), &dev)?,
                    Tensor::from_vec(dk, (b, kv, t, d), &dev)?,
                    Tensor::from_vec(dv, (b, kv, t, d), &dev)?,
                )
            }};
        }
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => go!(f32),
            DType::F64 => go!(f64),
            d => candle_core::bail!("{}: dtype {d:?}", Self::NAME),
        };
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(g) * u.

/// silu(g) * u, g and u the same shape and dtype (f32 / f64).
pub fn swiglu(g: &Tensor, u: &Tensor) -> R<Tensor> {
    g.contiguous()?.apply_op2(&u.contiguous()?, Fused(SwiGlu))
}

/// A gate's (SwiGLU's, GeGLU's) forward shapes: g and u alike, the output theirs.
fn gate_shapes(op: &str, [gl, ul]: [&Layout; 2]) -> R<((), Shape)> {
    let ok = gl.shape() == ul.shape();
    fits(ok, op, &[("up", ul.shape()), ("for gate", gl.shape())])?;
    Ok(((), gl.shape().clone()))
}

/// A gate's backward shapes: g, u and dh alike, the output (2, ...) = (dg, du).
fn gate_bwd_shapes(op: &str, [gl, ul, dl]: [&Layout; 3]) -> R<((), Shape)> {
    let ok = gl.shape() == ul.shape() && gl.shape() == dl.shape();
    let shapes = [("g", gl.shape()), ("u", ul.shape()), ("dh", dl.shape())];
    fits(ok, op, &shapes)?;
    let mut dims = vec![2];
    dims.extend_from_slice(gl.shape().dims());
    Ok(((), Shape::from(dims)))
}

/// A gate's gradients from its backward op `bwd` (one (2, ...) tensor: dg, du).
fn gate_grads<K: Kernel<3>>(bwd: K, g: &Tensor, u: &Tensor, dh: &Tensor) -> R<[Option<Tensor>; 2]> {
    let both = g.apply_op3_no_bwd(u, &dh.contiguous()?, &Fused(bwd))?; // (2, ...): dg, du
    Ok([Some(both.get(0)?), Some(both.get(1)?)])
}

/// A gate's CUDA kernel (`name`: forward or backward), one thread per element of g, writing
/// `outputs` values per element (1: the gate; 2: dg and du).
#[cfg(feature = "cuda")]
fn gate_launch<const N: usize>(
    name: &str,
    inputs: [gpu::In<'_>; N],
    outputs: usize,
) -> R<candle_core::CudaStorage> {
    let n = inputs[0].1.shape().elem_count();
    let args = [gpu::Arg::Size(n)];
    gpu::launch(name, inputs, outputs * n, gpu::Grid::Elems(n), &args)
}

struct SwiGlu;

/// sigmoid(v) and silu(v) from one exp of -|v| (<= 0, so [`Real::exp_nonpositive`]: no call
/// per element, and the loops over it vectorize): v >= 0 as Candle's silu, v / (1 + e^-v);
/// v < 0 as v e^v / (1 + e^v), the same value without exp of a positive argument. Within a
/// few f32 ulp of Candle's `v / (1 + exp(-v))` (libm's exp; `silu_is_within_six_ulp_of_candles`).
#[inline(always)]
fn sigmoid_silu<T: Real>(v: T) -> (T, T) {
    let neg = v < T::zero();
    let e = (if neg { v } else { -v }).exp_nonpositive();
    let d = T::one() + e;
    let num = if neg { e } else { T::one() };
    (num / d, v * num / d)
}

/// silu(v) = v sigmoid(v), as [`sigmoid_silu`].
#[inline(always)]
fn silu<T: Real>(v: T) -> T {
    sigmoid_silu(v).1
}

const CHUNK: usize = 8192;

/// `f(g, u)` of each element pair, on rayon's threads: SwiGLU's forward in every dtype.
fn swiglu_map<T: candle_core::WithDType>(
    g: &[T],
    u: &[T],
    f: impl Fn(&mut [T], &[T], &[T]) + Sync,
) -> Vec<T> {
    let mut out = uninit::<T>(g.len());
    out.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| f(o, g, u));
    out
}

multiversion!(
    /// o = silu(g) u over a chunk.
    fn swiglu_chunk<T: Real>(o: &mut [T], g: &[T], u: &[T]) => swiglu_chunk_body
);

#[inline(always)]
fn swiglu_chunk_body<T: Real>(o: &mut [T], g: &[T], u: &[T]) {
    let n = o.len();
    let (g, u) = (&g[..n], &u[..n]);
    for i in 0..n {
        o[i] = silu(g[i]) * u[i];
    }
}

multiversion!(
    /// o = r(r(silu(g)) u) over a chunk of bf16 (r: rounding to bf16).
    fn swiglu_chunk_bf16(o: &mut [bf16], g: &[bf16], u: &[bf16]) => swiglu_chunk_bf16_body
);

#[inline(always)]
fn swiglu_chunk_bf16_body(o: &mut [bf16], g: &[bf16], u: &[bf16]) {
    let n = o.len();
    let (g, u) = (&g[..n], &u[..n]);
    for i in 0..n {
        o[i] = to_bf16(round_bf16(silu(wide(g[i]))) * wide(u[i]));
    }
}

fn swiglu_fwd<T: Real>(g: &[T], u: &[T]) -> R<Vec<T>> {
    Ok(swiglu_map(g, u, swiglu_chunk))
}

impl Kernel<2> for SwiGlu {
    const NAME: &'static str = "fused-swiglu";
    type Dims = ();

    fn check(&self, layouts: [&Layout; 2]) -> R<((), Shape)> {
        gate_shapes(Self::NAME, layouts)
    }

    fn kernel<T: Real>(&self, [g, u]: [&[T]; 2], (): ()) -> R<Vec<T>> {
        swiglu_fwd(g, u)
    }

    fn kernel_bf16(&self, [g, u]: [&[bf16]; 2], (): ()) -> R<Vec<bf16>> {
        Ok(swiglu_map(g, u, swiglu_chunk_bf16))
    }

    /// `tallow_swiglu_*`: one thread per element.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 2], (): ()) -> R<candle_core::CudaStorage> {
        gate_launch("tallow_swiglu", inputs, 1)
    }

    fn grads(&self, [g, u]: [&Tensor; 2], _h: &Tensor, dh: &Tensor) -> R<[Option<Tensor>; 2]> {
        gate_grads(SwiGluBwd, g, u, dh)
    }
}

/// dg = dh * u * (s * (1 - silu(g)) + silu(g)) (Candle's silu derivative), du = dh * silu(g),
/// s = sigmoid(g); written as one (2, ...) tensor.
struct SwiGluBwd;

/// `f(dg, du, g, u, dh)` over chunks, on rayon's threads, written as one (2, ...) buffer:
/// SwiGLU's backward in every dtype.
fn swiglu_bwd_map<T: candle_core::WithDType>(
    g: &[T],
    u: &[T],
    dh: &[T],
    f: impl Fn(&mut [T], &mut [T], &[T], &[T], &[T]) + Sync,
) -> Vec<T> {
    let n = g.len();
    let mut out = uninit::<T>(2 * n);
    let (dg, du) = out.split_at_mut(n);
    dg.par_chunks_mut(CHUNK)
        .zip(du.par_chunks_mut(CHUNK))
        .zip(
            g.par_chunks(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .zip(dh.par_chunks(CHUNK)),
        )
        .for_each(|((dg, du), ((g, u), dh))| f(dg, du, g, u, dh));
    out
}

multiversion!(
    /// SwiGLU's backward over a chunk (Candle's silu derivative).
    fn swiglu_bwd_chunk<T: Real>(dg: &mut [T], du: &mut [T], g: &[T], u: &[T], dh: &[T]) => swiglu_bwd_chunk_body
);

#[inline(always)]
fn swiglu_bwd_chunk_body<T: Real>(dg: &mut [T], du: &mut [T], g: &[T], u: &[T], dh: &[T]) {
    let n = dg.len();
    let (du, g, u, dh) = (&mut du[..n], &g[..n], &u[..n], &dh[..n]);
    for i in 0..n {
        let (s, y) = sigmoid_silu(g[i]);
        dg[i] = dh[i] * u[i] * (s * (T::one() - y) + y);
        du[i] = dh[i] * y;
    }
}

multiversion!(
    /// PyTorch's bf16 backward of `silu(g) * u` over a chunk (see `SwiGluBwd::kernel_bf16`).
    fn swiglu_bwd_chunk_bf16(dg: &mut [bf16], du: &mut [bf16], g: &[bf16], u: &[bf16], dh: &[bf16]) => swiglu_bwd_chunk_bf16_body
);

#[inline(always)]
fn swiglu_bwd_chunk_bf16_body(
    dg: &mut [bf16],
    du: &mut [bf16],
    g: &[bf16],
    u: &[bf16],
    dh: &[bf16],
) {
    let n = dg.len();
    let (du, g, u, dh) = (&mut du[..n], &g[..n], &u[..n], &dh[..n]);
    for i in 0..n {
        let (gv, d) = (wide(g[i]), wide(dh[i]));
        let (s, y) = sigmoid_silu(gv);
        let a = round_bf16(y);
        let da = round_bf16(d * wide(u[i]));
        dg[i] = to_bf16(da * (s * (1.0 + gv * (1.0 - s))));
        du[i] = to_bf16(d * a);
    }
}

fn swiglu_bwd<T: Real>(g: &[T], u: &[T], dh: &[T]) -> R<Vec<T>> {
    Ok(swiglu_bwd_map(g, u, dh, swiglu_bwd_chunk))
}

impl Kernel<3> for SwiGluBwd {
    const NAME: &'static str = "fused-swiglu-bwd";
    type Dims = ();

    fn check(&self, layouts: [&Layout; 3]) -> R<((), Shape)> {
        gate_bwd_shapes(Self::NAME, layouts)
    }

    fn kernel<T: Real>(&self, [g, u, dh]: [&[T]; 3], (): ()) -> R<Vec<T>> {
        swiglu_bwd(g, u, dh)
    }

    /// `tallow_swiglu_bwd_*`: one thread per element, writing its dg and du.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 3], (): ()) -> R<candle_core::CudaStorage> {
        gate_launch("tallow_swiglu_bwd", inputs, 2)
    }

    /// PyTorch's bf16 backward of `silu(g) * u`: the product's, du = r(dh · a) and
    /// d_a = r(dh · u) with a = r(silu(g)), then silu's in f32, rounded once:
    /// dg = r(d_a · s (1 + g (1 - s))), s = sigmoid(g).
    fn kernel_bf16(&self, [g, u, dh]: [&[bf16]; 3], (): ()) -> R<Vec<bf16>> {
        Ok(swiglu_bwd_map(g, u, dh, swiglu_bwd_chunk_bf16))
    }
}

// ---------------------------------------------------------------------------------------------
// GeGLU (Gemma): gelu_tanh(g) * u.

/// gelu_tanh(g) * u (`crate::nn::ops::geglu`'s value and gradients), g and u the same shape
/// and dtype (f32 / f64 / bf16).
pub fn geglu(g: &Tensor, u: &Tensor) -> R<Tensor> {
    g.contiguous()?.apply_op2(&u.contiguous()?, Fused(GeGlu))
}

struct GeGlu;

/// Candle's affine: x * mul + add, rounded apart.
#[inline(always)]
fn affine<T: Real>(x: T, mul: T, add: T) -> T {
    x * mul + add
}

/// gelu's tanh approximation of x as `ops::gelu_tanh` computes it from Candle's ops, in
/// their order: (act, t) with inner = (x (x² C) + x) k, t = tanh(inner),
/// act = ((t + 1) x) / 2, C = 0.044715, k = sqrt(2 / pi).
#[inline(always)]
fn gelu_tanh<T: Real>(x: T) -> (T, T) {
    let (c, k) = (
        T::from_f64(0.044715),
        T::from_f64((2.0 / std::f64::consts::PI).sqrt()),
    );
    let (zero, half) = (T::zero(), T::from_f64(0.5));
    let x2 = x * x;
    let inner = affine(x * affine(x2, c, zero) + x, k, zero);
    let t = inner.tanh();
    (affine((t + T::one()) * x, half, zero), t)
}

/// gelu_tanh's derivative as `ops::gelu_tanh` computes it: (t + 1) / 2 + ((x (1 - t²))
/// (k (3 C x² + 1))) / 2.
#[inline(always)]
fn gelu_tanh_grad<T: Real>(x: T, t: T) -> T {
    let (c3, k) = (
        T::from_f64(3.0 * 0.044715),
        T::from_f64((2.0 / std::f64::consts::PI).sqrt()),
    );
    let (zero, one, half) = (T::zero(), T::one(), T::from_f64(0.5));
    let dinner = affine(affine(x * x, c3, one), k, zero);
    let one_minus_t2 = affine(t * t, -one, one);
    affine(affine(t, one, one), half, zero) + affine(x * one_minus_t2 * dinner, half, zero)
}

impl Kernel<2> for GeGlu {
    const NAME: &'static str = "fused-geglu";
    type Dims = ();

    fn check(&self, layouts: [&Layout; 2]) -> R<((), Shape)> {
        gate_shapes(Self::NAME, layouts)
    }

    fn kernel<T: Real>(&self, [g, u]: [&[T]; 2], (): ()) -> R<Vec<T>> {
        Ok(swiglu_map(g, u, |o, g, u| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = gelu_tanh(g).0 * u;
            }
        }))
    }

    /// The gelu in f32 rounded once, then the bf16 product: r(r(gelu(g)) u).
    fn kernel_bf16(&self, [g, u]: [&[bf16]; 2], (): ()) -> R<Vec<bf16>> {
        Ok(swiglu_map(g, u, |o, g, u| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = to_bf16(round_bf16(gelu_tanh(wide(g)).0) * wide(u));
            }
        }))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 2], (): ()) -> R<candle_core::CudaStorage> {
        gate_launch("tallow_geglu", inputs, 1)
    }

    fn grads(&self, [g, u]: [&Tensor; 2], _h: &Tensor, dh: &Tensor) -> R<[Option<Tensor>; 2]> {
        gate_grads(GeGluBwd, g, u, dh)
    }
}

/// dg = (dh u) gelu'(g), du = dh gelu(g) (bf16: dh, u widened, du = r(dh r(gelu(g))), dg
/// rounded once), written as one (2, ...) tensor.
struct GeGluBwd;

impl Kernel<3> for GeGluBwd {
    const NAME: &'static str = "fused-geglu-bwd";
    type Dims = ();

    fn check(&self, layouts: [&Layout; 3]) -> R<((), Shape)> {
        gate_bwd_shapes(Self::NAME, layouts)
    }

    fn kernel<T: Real>(&self, [g, u, dh]: [&[T]; 3], (): ()) -> R<Vec<T>> {
        Ok(swiglu_bwd_map(g, u, dh, |dg, du, g, u, dh| {
            for i in 0..dg.len() {
                let (act, t) = gelu_tanh(g[i]);
                dg[i] = dh[i] * u[i] * gelu_tanh_grad(g[i], t);
                du[i] = dh[i] * act;
            }
        }))
    }

    fn kernel_bf16(&self, [g, u, dh]: [&[bf16]; 3], (): ()) -> R<Vec<bf16>> {
        Ok(swiglu_bwd_map(g, u, dh, |dg, du, g, u, dh| {
            for i in 0..dg.len() {
                let (gv, d) = (wide(g[i]), wide(dh[i]));
                let (act, t) = gelu_tanh(gv);
                dg[i] = to_bf16(d * wide(u[i]) * gelu_tanh_grad(gv, t));
                du[i] = to_bf16(d * round_bf16(act));
            }
        }))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: [gpu::In<'_>; 3], (): ()) -> R<candle_core::CudaStorage> {
        gate_launch("tallow_geglu_bwd", inputs, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`exp_nonpositive_f32`] within 2 ulp of the exact exp (f64) over [-87.3, 0] (4M points,
    /// both ends included; measured: 0.98 ulp), below that within 1.2e-38 of it, NaN kept.
    /// With the reduction's low part (LN2_LO) dropped it is 4.5e5 ulp off.
    #[test]
    fn exp_nonpositive_is_within_two_ulp() {
        let ulp = |v: f64| {
            let f = v as f32;
            (f32::from_bits(f.to_bits() + 1) - f) as f64
        };
        let n = 1 << 22;
        let mut worst = 0f64;
        for i in 0..=n {
            let x = -87.336_54f32 * (i as f32 / n as f32);
            let want = (x as f64).exp();
            let got = exp_nonpositive_f32(x) as f64;
            worst = worst.max((got - want).abs() / ulp(want));
        }
        eprintln!("exp_nonpositive_f32: at most {worst} ulp");
        assert!(worst <= 2.0, "{worst} ulp");
        for x in [-87.5f32, -100.0, -1e30, f32::NEG_INFINITY] {
            assert!(exp_nonpositive_f32(x) <= 1.2e-38, "{x}");
        }
        assert!(exp_nonpositive_f32(f32::NAN).is_nan());
        assert_eq!(exp_nonpositive_f32(0.0), 1.0);
    }
    use crate::nn::ops;
    use candle_core::{Device, Var};

    /// silu (and sigmoid) from one exp of -|v| within 6 f32 ulp of Candle's
    /// `v / (1 + exp(-v))` with libm's exp, over [-87, 87] (2M points; measured: 4 ulp for
    /// silu, 3 for sigmoid); below -87 both are within 1e-35 of 0. Dropping the v < 0 branch (exp of
    /// a positive argument through the nonpositive exp) is off by order 1 there.
    #[test]
    fn silu_is_within_six_ulp_of_candles() {
        let ulps = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        let (mut worst_silu, mut worst_sig) = (0, 0);
        let n = 1 << 21;
        for i in 0..=n {
            let v = -87.0f32 + 174.0 * (i as f32 / n as f32);
            let (sig, y) = sigmoid_silu(v);
            let want_sig = 1.0 / (1.0 + (-v).exp());
            let want = v / (1.0 + (-v).exp());
            worst_silu = worst_silu.max(ulps(y, want));
            worst_sig = worst_sig.max(ulps(sig, want_sig));
        }
        eprintln!("silu: at most {worst_silu} ulp, sigmoid {worst_sig} ulp");
        assert!(
            worst_silu <= 6 && worst_sig <= 6,
            "{worst_silu} / {worst_sig} ulp"
        );
        for v in [-87.5f32, -88.0, -100.0, -1e30] {
            let (sig, y) = sigmoid_silu(v);
            assert!(sig.abs() < 1e-35 && y.abs() < 1e-35, "{v}: {sig} {y}");
        }
        assert!(sigmoid_silu(f32::NAN).1.is_nan());
        assert_eq!(sigmoid_silu(f32::INFINITY).1, f32::INFINITY);
        assert_eq!(sigmoid_silu(0.0f32), (0.5, 0.0));
    }

    /// The branch-free bf16 rounding gives `half`'s bits (Candle's conversion) for every f32
    /// whose low 16 bits are one of a set that covers ties (0x8000), just below and above them,
    /// zero and all ones, under every high half: all signs, exponents (zero, subnormal, the
    /// largest finite, inf, NaN) and mantissas. Rounding half up instead of to even, or letting a
    /// NaN's low payload round into inf, fails it; so does the conversions' round trip.
    #[test]
    fn bf16_rounding_matches_half_bit_for_bit() {
        let lows = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff];
        for high in 0..=0xffffu32 {
            for low in lows {
                let x = f32::from_bits(high << 16 | low);
                let want = half::bf16::from_f32(x).to_bits();
                let got = (round_bf16(x).to_bits() >> 16) as u16;
                assert_eq!(got, want, "{:#010x}", x.to_bits());
            }
        }
        let xs: Vec<f32> = (0..70_000).map(|i| (i as f32 - 35_000.0) * 0.37).collect();
        let narrowed = narrow_bf16(&xs);
        let widened = widen_bf16(&narrowed);
        for ((x, n), w) in xs.iter().zip(&narrowed).zip(&widened) {
            assert_eq!(*n, half::bf16::from_f32(*x));
            assert_eq!(*w, n.to_f32());
        }
    }

    /// Values and gradients (of every tracked input) of `f` on the inputs, for a fixed
    /// random upstream gradient.
    fn value_and_grads(
        f: &dyn Fn(&[Tensor]) -> crate::Result<Tensor>,
        inputs: &[Var],
    ) -> Vec<Tensor> {
        let ts: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let probe = var(y.dims(), y.dtype(), 99).as_tensor().clone(); // the same for both paths
        let g = (&y * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let mut out = vec![y];
        for v in inputs {
            out.push(g.get(v).expect("gradient").clone());
        }
        out
    }

    /// Largest |a - b| / (1 + |b|) over pairs of tensors.
    fn rel_err(a: &[Tensor], b: &[Tensor]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(a, b)| {
                assert_eq!(a.dims(), b.dims());
                let [a, b] = [a, b].map(|t| {
                    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    t.to_vec1::<f64>().unwrap()
                });
                a.iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
                    .fold(0.0, f64::max)
            })
            .fold(0.0, f64::max)
    }

    /// bf16 outputs (y, dx, dw) of a kernel against the graph it replaces: at most 1 bf16 ulp
    /// apart, in at most 1% of the elements.
    fn assert_bf16_within_an_ulp(what: &str, fused: &[Tensor], graph: &[Tensor]) {
        for (i, name) in ["y", "dx", "dw"].iter().enumerate() {
            let [a, b] = [&fused[i], &graph[i]].map(|t| {
                assert_eq!(t.dtype(), DType::BF16);
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            });
            let ulps = a
                .iter()
                .zip(&b)
                .map(|(a, b)| (a - b).abs() / (b.abs().log2().floor().exp2() / 128.0).max(1e-30))
                .fold(0.0, f64::max);
            let differ = a.iter().zip(&b).filter(|(a, b)| a != b).count() as f64 / a.len() as f64;
            eprintln!("{what} {name}: {ulps} ulps, {differ} of the elements differ");
            assert!(
                ulps <= 1.0 && differ <= 0.01,
                "{what} {name}: {ulps} ulps, {differ} differ"
            );
        }
    }

    fn var(shape: &[usize], dtype: DType, seed: u64) -> Var {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.random::<f64>() * 2.0 - 1.0).collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        Var::from_tensor(&t).unwrap()
    }

    /// Each fused kernel against the tensor-op path it replaces, value and gradients, in f32
    /// (tolerance 1e-5 relative: a few ulps of reordered sums; a wrong term, index or sign is
    /// O(1e-1)) and f64 (1e-12).
    #[test]
    fn fused_kernels_match_the_tensor_op_paths() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            // RMSNorm: x (2, 5, 48), w (48)
            let (x, w) = (var(&[2, 5, 48], dtype, 1), var(&[48], dtype, 2));
            let fused = value_and_grads(
                &|t| ops::rms_norm(&t[0], &t[1], 1e-6),
                &[x.clone(), w.clone()],
            );
            let generic = value_and_grads(&|t| ops::rms_norm_generic(&t[0], &t[1], 1e-6), &[x, w]);
            for i in 0..3 {
                let e = rel_err(&fused[i..i + 1], &generic[i..i + 1]);
                assert!(e < tol, "{dtype:?} rms_norm output {i}: {e}");
            }

            // Masked softmax: scores (2, 3, 6, 6), a packed-rows causal mask
            let s = var(&[2, 3, 6, 6], dtype, 3);
            let segments = vec![vec![0, 0, 0, 1, 1, 1], vec![0; 6]];
            let mask = ops::attention_mask(&segments, Some(4), dtype, &Device::Cpu).unwrap();
            let fused = value_and_grads(
                &|t| ops::masked_softmax(&t[0], &mask),
                std::slice::from_ref(&s),
            );
            let generic = value_and_grads(&|t| ops::masked_softmax_generic(&t[0], &mask), &[s]);
            let e = rel_err(&fused, &generic);
            assert!(e < tol, "{dtype:?} masked_softmax: {e}");
            // Grouped query heads: (2, 3, 2 * 6, 6) scores, row y takes mask row y mod 6.
            let s = var(&[2, 3, 12, 6], dtype, 7);
            let fused = value_and_grads(
                &|t| ops::masked_softmax(&t[0], &mask),
                std::slice::from_ref(&s),
            );
            let generic = value_and_grads(
                &|t| {
                    Ok(
                        ops::masked_softmax_generic(&t[0].reshape((2, 6, 6, 6))?, &mask)?
                            .reshape((2, 3, 12, 6))?,
                    )
                },
                &[s],
            );
            let e = rel_err(&fused, &generic);
            assert!(e < tol, "{dtype:?} grouped masked_softmax: {e}");

            // Rotary with the head transpose: x (2, 5, 3, 8) -> (2, 3, 5, 8), scaled and not
            let x = var(&[2, 5, 3, 8], dtype, 4);
            let pos = Tensor::new(&[[0u32, 1, 2, 0, 1], [0, 1, 2, 3, 4]], &Device::Cpu).unwrap();
            let inv = ops::rope_inv_freq(8, 10000.0, None);
            let (cos, sin) = ops::rope_tables(&pos, &inv, dtype).unwrap();
            for scale in [1.0, 0.35] {
                let fused = value_and_grads(
                    &|t| ops::rope_heads(&t[0], &cos, &sin, scale),
                    std::slice::from_ref(&x),
                );
                let generic = value_and_grads(
                    &|t| {
                        ops::apply_rope_scaled(
                            &t[0].transpose(1, 2)?.contiguous()?,
                            &cos,
                            &sin,
                            scale,
                        )
                    },
                    std::slice::from_ref(&x),
                );
                let e = rel_err(&fused, &generic);
                assert!(e < tol, "{dtype:?} rope scale {scale}: {e}");
            }

            // Causal attention, grouped heads (B 2, KV 2, n_rep 2), packed rows and a sliding
            // window; T 70: a 64-row block spans two repeats, the last block is partial; T 45:
            // a block holds more than one whole repeat.
            for (tt, window) in [(70, None), (70, Some(20)), (45, None)] {
                let dd = 8;
                let q = var(&[2, 2, 2 * tt, dd], dtype, 11);
                let k = var(&[2, 2, tt, dd], dtype, 12);
                let v = var(&[2, 2, tt, dd], dtype, 13);
                let segments = vec![
                    (0..tt as u32).map(|i| i / 30).collect::<Vec<_>>(),
                    vec![0; tt],
                ];
                let mask = ops::attention_mask(&segments, window, dtype, &Device::Cpu).unwrap();
                let inputs = [q, k, v];
                let fused = value_and_grads(
                    &|t| ops::causal_attention(&t[0], &t[1], &t[2], &mask),
                    &inputs,
                );
                let eager = value_and_grads(
                    &|t| {
                        let s = t[0].matmul(&t[1].t()?)?;
                        let p = ops::masked_softmax_generic(&s.reshape((2, 4, tt, tt))?, &mask)?;
                        Ok(p.reshape((2, 2, 2 * tt, tt))?.matmul(&t[2])?)
                    },
                    &inputs,
                );
                let e = rel_err(&fused, &eager);
                assert!(
                    e < tol,
                    "{dtype:?} causal attention T {tt} window {window:?}: {e}"
                );
            }

            // SwiGLU: g, u (3, 7, 40)
            let (g, u) = (var(&[3, 7, 40], dtype, 5), var(&[3, 7, 40], dtype, 6));
            let fused = value_and_grads(&|t| ops::swiglu(&t[0], &t[1]), &[g.clone(), u.clone()]);
            let generic = value_and_grads(&|t| Ok((t[0].silu()? * &t[1])?), &[g, u]);
            let e = rel_err(&fused, &generic);
            assert!(e < tol, "{dtype:?} swiglu: {e}");
        }
    }

    /// The bf16 rotary kernel (with the head transpose) against the bf16 graph it replaces
    /// (a transposed copy, then [`ops::apply_rope_scaled`] in Candle's bf16 ops, each product
    /// and sum rounded): value and dx bit for bit, unscaled and scaled by a power of two. A
    /// scale that bf16 cannot hold (1/sqrt(D) for most head sizes) the kernel applies in f32,
    /// where Candle's bf16 `affine` first rounds the scale itself to bf16 (0.35 -> 0.3496):
    /// there the two differ by that rounding.
    #[test]
    fn bf16_rope_kernel_rounds_as_the_graph() {
        let x = var(&[2, 5, 3, 8], DType::BF16, 4);
        let pos = Tensor::new(&[[0u32, 1, 2, 0, 1], [0, 1, 2, 3, 4]], &Device::Cpu).unwrap();
        let inv = ops::rope_inv_freq(8, 10000.0, None);
        let (cos, sin) = ops::rope_tables(&pos, &inv, DType::BF16).unwrap();
        for scale in [1.0, 0.125] {
            let run = |fused: bool| {
                value_and_grads(
                    &|t| {
                        if fused {
                            ops::rope_heads(&t[0], &cos, &sin, scale)
                        } else {
                            let xt = t[0].transpose(1, 2)?.contiguous()?;
                            ops::apply_rope_scaled(&xt, &cos, &sin, scale)
                        }
                    },
                    std::slice::from_ref(&x),
                )
            };
            let (fused, graph) = (run(true), run(false));
            assert_eq!(fused[0].dtype(), DType::BF16);
            assert_eq!(rel_err(&fused, &graph), 0.0, "bf16 rope scale {scale}");
        }
    }

    /// bf16 x (2, 3, 96), rows of scale 1e-2 .. 1e2, and w (96) around 1, for the RMSNorm
    /// kernels against their graphs.
    fn bf16_rms_inputs() -> [Var; 2] {
        let scale = Tensor::new(&[0.01f32, 0.1, 1.0, 10.0, 100.0, 3.0], &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 1))
            .unwrap();
        let x = var(&[2, 3, 96], DType::F32, 21)
            .as_tensor()
            .broadcast_mul(&scale)
            .unwrap();
        let x = Var::from_tensor(&x.to_dtype(DType::BF16).unwrap()).unwrap();
        let w = Var::from_tensor(
            &var(&[96], DType::F32, 22)
                .as_tensor()
                .affine(0.2, 1.0)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        [x, w]
    }

    /// The bf16 RMSNorm kernel against the bf16 graph it replaces ([`ops::rms_norm_generic`]:
    /// the normalization in f32, each bf16 product rounded, the backward as written there),
    /// value, dx and dw, rows of scale 1e-2 .. 1e2: they differ only in the order of the f32
    /// sums of x² and g·xn, so at most 1 bf16 ulp in at most 1% of the elements (measured:
    /// equal); skipping the rounding of x / rms before the weight multiply moves 28% of the
    /// values, and of dy·w in the backward 27% of dx.
    #[test]
    fn bf16_rms_norm_kernel_rounds_as_the_graph() {
        let inputs = bf16_rms_inputs();
        let fused = value_and_grads(&|t| ops::rms_norm(&t[0], &t[1], 1e-6), &inputs);
        let graph = value_and_grads(&|t| ops::rms_norm_generic(&t[0], &t[1], 1e-6), &inputs);
        assert_bf16_within_an_ulp("bf16 rms_norm", &fused, &graph);
    }

    /// Gemma's bf16 RMSNorm kernel (`1 + w`, [`rms_norm_plus_one_bf16`]) against the graph it
    /// replaces ([`ops::rms_norm_plus_one_generic`]): value, dx and dw, the same bounds as
    /// Llama's form above (measured: equal). Rounding dy (1 + w) to bf16 in the backward, as
    /// Llama's form does, moves 26% of dx, by up to 25 ulps.
    #[test]
    fn bf16_gemma_rms_norm_kernel_rounds_as_the_graph() {
        let inputs = bf16_rms_inputs();
        let fused = value_and_grads(&|t| ops::rms_norm_plus_one(&t[0], &t[1], 1e-6), &inputs);
        let graph = value_and_grads(
            &|t| ops::rms_norm_plus_one_generic(&t[0], &t[1], 1e-6),
            &inputs,
        );
        assert_bf16_within_an_ulp("bf16 gemma rms_norm", &fused, &graph);
    }

    /// The fused GeGLU against `ops::geglu_generic` (Candle's ops in transformers' order),
    /// value and both gradients, f32 and bf16: the same IEEE operations in the same order, so
    /// equal values (compared with `==`: where gelu(g) is exactly 0, for g below about -5, the
    /// two give du = +0 and -0). Computing the derivative's 1 - t² as (1 - t)(1 + t) moves dg by an
    /// ulp in 346 of 960 values; the bf16 kernel without the rounding of gelu(g) before the
    /// product differs in 158 of 960.
    #[test]
    fn geglu_kernel_matches_the_tensor_ops_bit_for_bit() {
        for dt in [DType::F32, DType::BF16] {
            // g in [-6, 6]: both tails of tanh saturate
            let g = var(&[3, 5, 64], DType::F32, 31)
                .as_tensor()
                .affine(6.0, 0.0)
                .unwrap();
            let g = Var::from_tensor(&g.to_dtype(dt).unwrap()).unwrap();
            let inputs = [g, var(&[3, 5, 64], dt, 32)];
            let fused = value_and_grads(&|t| Ok(geglu(&t[0], &t[1])?), &inputs);
            let graph = value_and_grads(&|t| ops::geglu_generic(&t[0], &t[1]), &inputs);
            for (i, (a, b)) in fused.iter().zip(&graph).enumerate() {
                let [a, b] = [a, b].map(|t| {
                    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    t.to_vec1::<f64>().unwrap()
                });
                let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
                assert_eq!(
                    differ,
                    0,
                    "{dt:?} output {i}: {differ} of {} differ",
                    a.len()
                );
            }
        }
    }

    #[test]
    fn the_fused_ops_take_f32_and_f64_on_the_cpu_only() {
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(crate::kernels::dispatch::fused_for(&x));
        assert!(crate::kernels::dispatch::fused_for(
            &x.to_dtype(DType::F64).unwrap()
        ));
        assert!(!crate::kernels::dispatch::fused_for(
            &x.to_dtype(DType::BF16).unwrap()
        ));
        // SwiGLU and rotary have bf16 kernels of their own
        assert!(crate::kernels::dispatch::fused_with_bf16_for(
            &x.to_dtype(DType::BF16).unwrap()
        ));
        assert!(!crate::kernels::dispatch::fused_with_bf16_for(
            &x.to_dtype(DType::F16).unwrap()
        ));
    }
}
