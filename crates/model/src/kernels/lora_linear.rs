//! The LoRA linear on the CPU as one graph op: `y = x Wᵀ (+ b) + s · dropout(x) Aᵀ Bᵀ` with the
//! adapter's product accumulated into the base matmul's output, and one backward buffer for
//! dx. f32 / f64, and a bf16 model's (bf16 x, base and bias; f32 adapter, widened and rounded
//! back where the graph of Candle ops rounds). On CUDA the same op (f32, and bf16 x with an f32
//! adapter) is the base's cuBLAS gemm and, for a bf16 x, three kernels of
//! `kernels/lora_gemm.cuh` on the bf16 rows ([`bf16_kernels`]); for an f32 x a few cuBLAS
//! calls whose alpha and beta do the scale and the accumulation
//! ([`LoraLinearOp::device_launches`] counts either); the CPU bodies below are its twins. Which
//! path a linear takes is `crate::kernels::dispatch`'s rule.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::kernels::amx;
use crate::kernels::dropout::DropoutOp;
use crate::kernels::fused::{round_bf16, rows_per_task, to_bf16, uninit, widen_bf16};
use crate::kernels::matmul::Dequantize;

/// The frozen base weight (N, K) of a one-op LoRA linear: dense in the compute dtype, or kept
/// quantized (NF4, GGML blocks) and dequantized for each matmul.
#[derive(Clone)]
pub enum LoraBase {
    Dense(Tensor),
    Quantized(Arc<dyn Dequantize>),
}

/// A LoRA linear on the CPU as one graph op (x, A, B) -> W x + b + s · B A dropout(x), for f32 /
/// f64 with a frozen dense or quantized base and a frozen (or no) bias: the adapter's output is added
/// into the base matmul's output buffer in place (no (M, out) add node), and the backward
/// returns dx = dY W + s · mask ⊙ (dY B) A in one buffer, dA and dB: Candle accumulates one
/// gradient per input instead of one per primitive (reshapes, the add, two matmuls, the scale),
/// each of which cost a zeroed (M, in) or (M, out) buffer and an add.
pub struct LoraLinearOp {
    pub base: LoraBase,
    pub bias: Option<Tensor>,
    pub scale: f64,
    pub dropout: Option<DropoutOp>,
    /// (M, K, N): rows, in, out.
    pub mkn: (usize, usize, usize),
}

/// The dense base weight (N, K) in the compute dtype, on the base's device (a quantized base
/// dequantized, which Candle counts as a launch on either side; dropped by the caller after
/// use).
fn dense_weight(base: &LoraBase) -> candle_core::Result<Tensor> {
    match base {
        LoraBase::Dense(w) => Ok(w.clone()),
        LoraBase::Quantized(w) => w.dequantize_candle(),
    }
}

/// `dst (M, N) := [dst +] beta * lhs (M, K) * rhs`, row-major buffers, with `rhs` given as a
/// row-major (N, K) matrix used transposed (`rhs_t`) or a row-major (K, N) one. `read_dst`
/// false: dst's old contents are ignored (it may be uninitialized). Candle's own CPU matmul
/// kernel (`gemm`), on as many threads as Candle gives it.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: crate::kernels::fused::Real>(
    dst: &mut [T],
    read_dst: bool,
    lhs: &[T],
    rhs: &[T],
    rhs_t: bool,
    (m, n, k): (usize, usize, usize),
    beta: T,
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= n * k);
    let (rhs_cs, rhs_rs) = if rhs_t {
        (k as isize, 1)
    } else {
        (1, n as isize)
    };
    let threads = candle_core::utils::get_num_threads();
    let par = if threads > 1 && m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths are checked above and the strides describe row-major (M, K), (M, N)
    // and (N, K) / (K, N) buffers inside them; T is f32 or f64 (gemm panics on other types).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            read_dst,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            T::one(),
            beta,
            false,
            false,
            false,
            par,
        )
    }
}

/// The contiguous elements of a tensor on the CPU, for `f` (the storage guard lives meanwhile).
fn with_cpu_slice<T: crate::kernels::fused::Real, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (st, l) = t.storage_and_layout();
    f(crate::kernels::fused::storage_data(
        &st,
        l,
        "lora linear weight",
    )?)
}

/// A bf16 tensor on the CPU widened to f32.
fn widened(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    let (st, l) = t.storage_and_layout();
    Ok(widen_bf16(crate::kernels::fused::storage_data(
        &st,
        l,
        "lora linear weight",
    )?))
}

/// A bf16 model's base product `dst (M, N) := lhs (M, K) · B`, B the base weight W (N_w, K_w):
/// Wᵀ when `rhs_t` (the forward's x Wᵀ), else W (the backward's dY W). On AMX tiles where the
/// CPU has them ([`amx::gemm_bf16`]); else its twin, what Candle's bf16 matmul computes: both
/// operands widened to f32 (`lhs32`, when the caller has it) and multiplied by `gemm`. The
/// result is rounded to bf16 by the caller.
fn base_product_bf16(
    base: &LoraBase,
    dst: &mut [f32],
    lhs: &[bf16],
    lhs32: Option<&[f32]>,
    rhs_t: bool,
    (m, n, k): (usize, usize, usize),
) -> candle_core::Result<()> {
    let w = dense_weight(base)?;
    let (st, l) = w.storage_and_layout();
    let wb: &[bf16] = crate::kernels::fused::storage_data(&st, l, "lora linear weight")?;
    if amx::gemm_bf16(dst, lhs, wb, rhs_t, (m, n, k)) {
        return Ok(());
    }
    let w32 = widen_bf16(wb);
    drop(st);
    let own;
    let lhs32 = match lhs32 {
        Some(l) => l,
        None => {
            own = widen_bf16(lhs);
            &own
        }
    };
    gemm_into(dst, false, lhs32, &w32, rhs_t, (m, n, k), 1.0);
    Ok(())
}

impl LoraLinearOp {
    /// y = x Wᵀ (+ bias) + s · dropout(x) Aᵀ Bᵀ, the adapter product accumulated by the gemm.
    fn run<T: crate::kernels::fused::Real + crate::kernels::dropout::num_like::Scale>(
        &self,
        x: &[T],
        a: &[T],
        b: &[T],
    ) -> candle_core::Result<Vec<T>> {
        let (m, k, n) = self.mkn;
        let r = a.len() / k;
        let mut y = crate::kernels::fused::uninit::<T>(m * n);
        // Start from the bias (then the base gemm accumulates onto it), or from nothing.
        let read = match &self.bias {
            Some(bias) => with_cpu_slice::<T, _>(bias, |bv| {
                y.chunks_mut(n).for_each(|row| row.copy_from_slice(bv));
                Ok(true)
            })?,
            None => false,
        };
        let w = dense_weight(&self.base)?;
        with_cpu_slice::<T, _>(&w, |wv| {
            gemm_into(&mut y, read, x, wv, true, (m, n, k), T::one());
            Ok(())
        })?;
        drop(w);
        let dropped;
        let xd: &[T] = match &self.dropout {
            Some(op) => {
                dropped = op.run(x);
                &dropped
            }
            None => x,
        };
        let mut xa = crate::kernels::fused::uninit::<T>(m * r);
        gemm_into(
            &mut xa,
            false,
            xd,
            a,
            true,
            (m, r, k),
            T::from_f64(self.scale),
        ); // s xd Aᵀ
        gemm_into(&mut y, true, &xa, b, true, (m, n, r), T::one()); // += (s xd Aᵀ) Bᵀ
        Ok(y)
    }

    /// A bf16 model's LoRA linear: x, the base and the bias bf16, A and B f32 (PEFT keeps a bf16
    /// model's adapter in f32). Rounded to bf16 where the unfused graph rounds: t = bf16(x Wᵀ)
    /// (Candle's bf16 matmul: an f32 product of the widened operands), t = bf16(t + bias),
    /// y = bf16(t + bf16(s · dropout(x) Aᵀ Bᵀ)), the adapter's side in f32 on x widened.
    fn run_bf16(&self, x: &[bf16], a: &[f32], b: &[f32]) -> candle_core::Result<Vec<bf16>> {
        let (m, k, n) = self.mkn;
        let r = a.len() / k;
        let x32 = widen_bf16(x); // (M, K)
        let mut t = uninit::<f32>(m * n); // (M, N)
        base_product_bf16(&self.base, &mut t, x, Some(&x32), true, (m, n, k))?; // x Wᵀ
        let bias = self.bias.as_ref().map(widened).transpose()?;
        let dropped;
        let xd: &[f32] = match &self.dropout {
            Some(op) => {
                dropped = op.run(&x32);
                &dropped
            }
            None => &x32,
        };
        let mut xa = uninit::<f32>(m * r);
        gemm_into(&mut xa, false, xd, a, true, (m, r, k), self.scale as f32); // s xd Aᵀ
        let mut l = uninit::<f32>(m * n);
        gemm_into(&mut l, false, &xa, b, true, (m, n, r), 1.0); // (s xd Aᵀ) Bᵀ
        Ok(sum_bf16(&t, &l, bias.as_deref(), n))
    }
}

/// r(r(t) + r(l)) of (rows, n) f32 buffers (r: rounding to bf16), with a bias c (n)
/// r(r(r(t) + c) + r(l)): the base's product and the adapter's, each rounded as the unfused
/// bf16 graph rounds them, summed and written as bf16 in one pass, on rayon's threads.
fn sum_bf16(t: &[f32], l: &[f32], bias: Option<&[f32]>, n: usize) -> Vec<bf16> {
    let rows = n * rows_per_task(n);
    let mut out = uninit::<bf16>(t.len());
    out.par_chunks_mut(rows)
        .zip(t.par_chunks(rows).zip(l.par_chunks(rows)))
        .for_each(|(o, (t, l))| sum_rows_bf16(o, t, l, bias, n));
    out
}

crate::kernels::fused::multiversion!(
    /// [`sum_bf16`] over whole rows.
    fn sum_rows_bf16(o: &mut [bf16], t: &[f32], l: &[f32], bias: Option<&[f32]>, n: usize) => sum_rows_bf16_body
);

#[inline(always)]
fn sum_rows_bf16_body(o: &mut [bf16], t: &[f32], l: &[f32], bias: Option<&[f32]>, n: usize) {
    match bias {
        None => {
            let len = o.len();
            let (t, l) = (&t[..len], &l[..len]);
            for i in 0..len {
                o[i] = to_bf16(round_bf16(t[i]) + round_bf16(l[i]));
            }
        }
        Some(c) => {
            let c = &c[..n];
            for ((o, t), l) in o.chunks_mut(n).zip(t.chunks(n)).zip(l.chunks(n)) {
                for j in 0..n {
                    o[j] = to_bf16(round_bf16(round_bf16(t[j]) + c[j]) + round_bf16(l[j]));
                }
            }
        }
    }
}

impl candle_core::CustomOp3 for LoraLinearOp {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    // x: (..., K), a: (r, K), b: (N, r) -> (..., N)
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k, n) = self.mkn;
        let (Some((x0, x1)), Some((a0, a1)), Some((b0, b1))) = (
            xl.contiguous_offsets(),
            al.contiguous_offsets(),
            bl.contiguous_offsets(),
        ) else {
            candle_core::bail!("lora linear: inputs must be contiguous");
        };
        if x1 - x0 != m * k {
            candle_core::bail!(
                "lora linear: input has {} elements, expected {m} x {k}",
                x1 - x0
            );
        }
        let y = match (x, a, b) {
            (CpuStorage::F32(x), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32(self.run(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64(self.run(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            (CpuStorage::BF16(x), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::BF16(self.run_bf16(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            _ => candle_core::bail!(
                "lora linear: x, A and B must all be f32 or all f64, or x bf16 with A, B f32"
            ),
        };
        if crate::kernels::dispatch::cuda_paths_on_cpu() {
            // The twin of the CUDA body: its launches beyond the op's own one.
            let bf16 = matches!(x, CpuStorage::BF16(_));
            count_launches(self.device_launches(bf16).forward - 1);
        }
        Ok((y, out_shape(xl, n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (_, _, n) = self.mkn;
        Ok((
            device::forward(self, x, xl, a, al, b, bl)?,
            out_shape(xl, n),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.detach().contiguous()?;
        let want_dx = x.track_op();
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (dx, da, db) = device::backward(self, x, a, b, &dy, want_dx)?;
            return Ok((dx, Some(da), Some(db)));
        }
        if crate::kernels::dispatch::cuda_paths_on_cpu() {
            // The twin of the CUDA body: these tensor ops compute its values; the count is its
            // launches (and the NF4 dequantization, which is a counted op on either side).
            let grads = candle_core::launches::uncounted(|| self.cpu_bwd(x, a, b, &dy, want_dx))?;
            let bf16 = x.dtype() == candle_core::DType::BF16;
            let dequant = want_dx && matches!(self.base, LoraBase::Quantized(_));
            count_launches(self.device_launches(bf16).backward(want_dx) + dequant as usize);
            return Ok(grads);
        }
        self.cpu_bwd(x, a, b, &dy, want_dx)
    }
}

/// `n` device launches issued (the launch count of `candle_core::launches`).
fn count_launches(n: usize) {
    for _ in 0..n {
        candle_core::launches::add("lora-linear");
    }
}

/// x's shape (..., K) with the last dim `n`.
fn out_shape(xl: &Layout, n: usize) -> Shape {
    let mut dims = xl.shape().dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = n;
    Shape::from(dims)
}

/// Rows per chunk of the one-op linear's adapter side on CUDA ([`device`]) for input K and output
/// N: its f32 buffers (x widened, the adapter's product, dY widened, dx's adapter share) hold
/// at most 2^24 elements each (64 MiB), whatever the sequence's length. `tallow estimate`
/// counts them so.
pub fn chunk_rows(k: usize, n: usize) -> usize {
    ((1usize << 24) / k.max(n).max(1)).max(1)
}

/// The launches of the one-op linear's CUDA body ([`device`]), for a bf16 or an f32 x: what its
/// CPU twin counts under `TALLOW_CUDA_PATHS_ON_CPU` and the body counts on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLaunches {
    /// The forward, the op's own launch included.
    pub forward: usize,
    dropout: bool,
    /// Chunks of rows of the adapter's side ([`chunk_rows`]).
    chunks: usize,
    /// The adapter's side as tallow's kernels ([`bf16_kernels`]); `chunks` is then 1 with
    /// rows, 0 without.
    kernels: bool,
}

/// Whether a one-op linear's CUDA body takes `kernels/lora_gemm.cuh`'s kernels for its
/// adapter side: for a bf16 x (with its f32 adapter). They read the bf16 rows of x and dY
/// directly, so the body needs no f32 copies of them (and no chunks of rows), and fold the
/// scale, the bias, LoRA dropout's mask and the bf16 rounding sum in: the forward is the base's
/// gemm and 2 launches, the backward dY W and 3. An f32 x keeps cuBLAS (its operands are
/// already f32).
pub fn bf16_kernels(bf16: bool) -> bool {
    bf16
}

impl DeviceLaunches {
    /// The backward's: for dx (when x needs it) dY W over every row; then (an f32 x, cuBLAS)
    /// per chunk dY B and x Aᵀ (both scaled by alpha), dB and dA (summed over the chunks by
    /// beta), with x's dropout mask applied; and for dx (s dY B) A, accumulated by beta (no
    /// dropout) or apart, masked and added (dropout).
    pub fn backward(&self, dx: bool) -> usize {
        if self.kernels {
            // dY W; then with rows s dY B and s x Aᵀ (one launch), dB and dA (one; zeros
            // without rows) and dx's rounding sum of (s dY B) A
            let rows = (self.chunks > 0) as usize;
            return dx as usize + rows + 1 + (dx as usize) * rows;
        }
        let d = self.dropout as usize;
        let adapter = 4 + d;
        let dx_share = match (dx, self.dropout) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 2 + d,
        };
        dx as usize + self.chunks * (adapter + dx_share)
    }
}

impl LoraLinearOp {
    /// [`DeviceLaunches`] of this op: for a bf16 x see [`bf16_kernels`]; for an f32 x the
    /// forward is x Wᵀ over every row (onto the bias's rows, copied there first), then per
    /// chunk of rows s · xd Aᵀ and the product with Bᵀ, and the dropout mask's kernel when
    /// there is dropout.
    pub fn device_launches(&self, bf16: bool) -> DeviceLaunches {
        let (m, k, n) = self.mkn;
        let dropout = self.dropout.is_some();
        if bf16_kernels(bf16) {
            // x Wᵀ, then with rows s x Aᵀ and the product with Bᵀ summed into the output
            let rows = (m > 0) as usize;
            return DeviceLaunches {
                forward: 1 + 2 * rows,
                dropout,
                chunks: rows,
                kernels: true,
            };
        }
        let chunks = m.div_ceil(chunk_rows(k, n));
        let (d, bias) = (dropout as usize, self.bias.is_some() as usize);
        DeviceLaunches {
            forward: 1 + bias + chunks * (2 + d),
            dropout,
            chunks,
            kernels: false,
        }
    }

    /// The backward on the CPU: the adapter's gradients from tensor ops, dx from one op.
    fn cpu_bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        dy: &Tensor,
        want_dx: bool,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (m, k, n) = self.mkn;
        let (a, b) = (a.detach(), b.detach());
        // The adapter's side runs in its own dtype: a bf16 x and dY widened to f32 (exact).
        let x2 = crate::kernels::fused::cast(&x.detach().reshape((m, k))?, a.dtype())?;
        let dy2 = dy.reshape((m, n))?;
        let dy2a = crate::kernels::fused::cast(&dy2, a.dtype())?;
        let xd = match &self.dropout {
            Some(op) => x2.apply_op1_no_bwd(op)?,
            None => x2,
        };
        let dyb = (dy2a.matmul(&b)? * self.scale)?; // s (dY B): (M, r)
        let xa = (xd.matmul(&a.t()?)? * self.scale)?; // s (xd Aᵀ): (M, r)
        let db = dy2a.t()?.matmul(&xa)?; // (N, r)
        let da = dyb.t()?.matmul(&xd)?; // (r, K)
        let dx = if want_dx {
            let dx = dy2.apply_op2_no_bwd(
                &dyb,
                &LoraLinearDx {
                    base: self.base.clone(),
                    a: a.clone(),
                    dropout: self.dropout,
                    mkn: self.mkn,
                },
            )?;
            Some(dx.reshape(x.shape())?)
        } else {
            None
        };
        Ok((dx, Some(da), Some(db)))
    }
}

/// dx = dY W + mask ⊙ (s dY B) A in one buffer: (M, N), (M, r) -> (M, K).
struct LoraLinearDx {
    base: LoraBase,
    a: Tensor,
    dropout: Option<DropoutOp>,
    mkn: (usize, usize, usize),
}

impl LoraLinearDx {
    fn run<T: crate::kernels::fused::Real + crate::kernels::dropout::num_like::Scale>(
        &self,
        dy: &[T],
        dyb: &[T],
    ) -> candle_core::Result<Vec<T>> {
        let (m, k, n) = self.mkn;
        let mut dx = crate::kernels::fused::uninit::<T>(m * k);
        let w = dense_weight(&self.base)?;
        with_cpu_slice::<T, _>(&w, |wv| {
            gemm_into(&mut dx, false, dy, wv, false, (m, k, n), T::one()); // dY W
            Ok(())
        })?;
        drop(w);
        with_cpu_slice::<T, _>(&self.a, |av| {
            let r = av.len() / k;
            match &self.dropout {
                None => gemm_into(&mut dx, true, dyb, av, false, (m, k, r), T::one()),
                Some(op) => {
                    // The mask applies to the adapter's share only: its own buffer, masked, added.
                    let mut lora = crate::kernels::fused::uninit::<T>(m * k);
                    gemm_into(&mut lora, false, dyb, av, false, (m, k, r), T::one());
                    let lora = op.run(&lora);
                    dx.iter_mut().zip(&lora).for_each(|(d, &l)| *d += l);
                }
            }
            Ok(())
        })?;
        Ok(dx)
    }

    /// [`LoraLinearDx::run`] for a bf16 model: dY bf16, s (dY B) f32 -> dx = bf16(bf16(dY W) +
    /// bf16(mask ⊙ (s dY B) A)), the base's share rounded as Candle's bf16 matmul rounds it and
    /// the adapter's as its f32 -> bf16 cast does (PEFT: one cast per adapted linear).
    fn run_bf16(&self, dy: &[bf16], dyb: &[f32]) -> candle_core::Result<Vec<bf16>> {
        let (m, k, n) = self.mkn;
        let mut base = uninit::<f32>(m * k);
        base_product_bf16(&self.base, &mut base, dy, None, false, (m, k, n))?; // dY W
        let mut lora = uninit::<f32>(m * k);
        with_cpu_slice::<f32, _>(&self.a, |av| {
            let r = av.len() / k;
            gemm_into(&mut lora, false, dyb, av, false, (m, k, r), 1.0); // (s dY B) A
            Ok(())
        })?;
        if let Some(op) = &self.dropout {
            lora = op.run(&lora);
        }
        Ok(sum_bf16(&base, &lora, None, k))
    }
}

impl CustomOp2 for LoraLinearDx {
    fn name(&self) -> &'static str {
        "lora-linear-dx"
    }

    fn cpu_fwd(
        &self,
        dy: &CpuStorage,
        dyl: &Layout,
        dyb: &CpuStorage,
        dybl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k, _) = self.mkn;
        let (Some((d0, d1)), Some((e0, e1))) =
            (dyl.contiguous_offsets(), dybl.contiguous_offsets())
        else {
            candle_core::bail!("lora linear dx: inputs must be contiguous");
        };
        let dx = match (dy, dyb) {
            (CpuStorage::F32(dy), CpuStorage::F32(dyb)) => {
                CpuStorage::F32(self.run(&dy[d0..d1], &dyb[e0..e1])?)
            }
            (CpuStorage::F64(dy), CpuStorage::F64(dyb)) => {
                CpuStorage::F64(self.run(&dy[d0..d1], &dyb[e0..e1])?)
            }
            (CpuStorage::BF16(dy), CpuStorage::F32(dyb)) => {
                CpuStorage::BF16(self.run_bf16(&dy[d0..d1], &dyb[e0..e1])?)
            }
            _ => candle_core::bail!("lora linear dx: f32 / f64, or dY bf16 with dY B f32"),
        };
        Ok((dx, Shape::from((m, k))))
    }
}

/// Thread blocks the gradient kernel aims for: enough to fill a large GPU (132 SMs on an
/// H100 / H200) about twice over, so that a short P (896 for Qwen2.5-0.5B) still keeps
/// every SM busy, by splitting the sum over M.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const GRAD_BLOCKS: usize = 264;

/// Rows of M per split of the gradient kernel and the splits, for `tiles` (problems x P
/// tiles x r tiles) blocks per split: at least 256 rows each (a multiple of 32).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn grad_splits(m: usize, tiles: usize) -> (usize, usize) {
    let want = GRAD_BLOCKS.div_ceil(tiles.max(1)).min(m / 256).max(1);
    let chunk = m.div_ceil(want).max(1).next_multiple_of(32);
    (m.div_ceil(chunk).max(1), chunk)
}

/// The one-op linear on CUDA: cuBLAS gemms (`super::cuda::gemm`, f32 accumulation) whose alpha
/// applies the LoRA scale and whose beta accumulates into the output, Candle's cast and copy
/// kernels, the dropout kernel and `kernels/tallow.cu`'s `tallow_lora_sum_*`. Step for step
/// the CPU bodies above ([`LoraLinearOp::run`], [`LoraLinearOp::run_bf16`], the tensor ops of
/// the CPU backward and [`LoraLinearDx`]): the same products and the same roundings, summed in
/// cuBLAS's order. Each launch is counted ([`count_launches`]; the op itself is counted by
/// Candle), as many as [`LoraLinearOp::device_launches`] says.
#[cfg(feature = "cuda")]
mod device {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, CudaViewMut, DevicePtrMut, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{CudaStorage, CustomOp1, DType, Layout, Result, Tensor};
    use half::bf16;

    use super::{count_launches, dense_weight, LoraLinearOp};
    use crate::kernels::cuda::{gemm, storage, tensor, view, GemmType, Grid, Operand};
    use crate::kernels::dropout::DropoutOp;

    const NAME: &str = "lora linear";

    /// `LgDrop` of kernels/lora_gemm.cuh: LoRA dropout's mask (`DropoutOp`'s seed, threshold
    /// and scale) on the rows of problem `which` (2: none).
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct LgDrop {
        seed: u64,
        threshold: u32,
        scale: f32,
        which: u32,
    }

    // SAFETY: a plain #[repr(C)] struct of integers and a float, laid out as the kernels' C
    // struct (8-byte seed, then three 4-byte fields, padded to 24 bytes on both sides).
    unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for LgDrop {}

    impl LgDrop {
        /// The op's dropout on problem `which` (0 or 1), or none.
        fn of(op: &LoraLinearOp, which: u32) -> Self {
            match op.dropout {
                Some(d) => LgDrop {
                    seed: d.seed,
                    threshold: d.threshold(),
                    scale: d.scale(),
                    which,
                },
                None => LgDrop::NONE,
            }
        }

        const NONE: LgDrop = LgDrop {
            seed: 0,
            threshold: 0,
            scale: 1.0,
            which: 2,
        };
    }

    /// dst (M, N) := lhs (M, K) · Wᵀ (`w_t`: the forward's x Wᵀ, N = W's rows) or lhs · W (the
    /// backward's dY W) + beta · dst, the base weight W in the compute dtype on the device (an
    /// NF4 base dequantized by its kernel first): one gemm.
    fn base_product<T: GemmType>(
        dev: &CudaDevice,
        op: &LoraLinearOp,
        dst: &mut impl DevicePtrMut<T>,
        (lhs, ll): (&CudaStorage, &Layout),
        w_t: bool,
        mnk: (usize, usize, usize),
        beta: f32,
    ) -> Result<()> {
        let lv = view::<T>(lhs, ll, NAME)?;
        let w = dense_weight(&op.base)?;
        let (st, l) = w.storage_and_layout();
        let wv = view::<T>(storage(&st, NAME)?, l, NAME)?;
        gemm(dev, dst, arg(&lv, false), arg(&wv, w_t), mnk, 1.0, beta)
    }

    /// A fresh buffer of `len` (every element is written before it is read).
    fn alloc<T: candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        dev: &CudaDevice,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        // SAFETY: the callers write every element (a gemm with beta 0, a cast, a kernel).
        unsafe { dev.alloc::<T>(len) }
    }

    /// `tallow_lora_sum_f32`: o += l, in place.
    fn sum_f32(
        dev: &CudaDevice,
        o: &mut CudaViewMut<'_, f32>,
        l: &CudaView<'_, f32>,
    ) -> Result<()> {
        let total = o.len();
        let grid = Grid::Elems(total);
        if grid.is_empty() {
            return Ok(());
        }
        let func = crate::kernels::cuda::func(dev, "tallow_lora_sum_f32")?;
        let mut b = func.builder();
        b.arg(o);
        b.arg(l);
        b.arg(&total);
        // SAFETY: argument types and order match `tallow_lora_sum_f32` in kernels/tallow.cu.
        unsafe { b.launch(grid.config()) }.w()?;
        Ok(())
    }

    /// Rows `r0..r1` of a row-major (M, cols) f32 input: a view of them, or with `dropout`
    /// masked into a new buffer (one launch; element i of the rows is element r0 · cols + i
    /// of the whole tensor's mask).
    enum Rows<'a> {
        Borrowed(CudaView<'a, f32>),
        Owned(CudaStorage),
    }

    impl Rows<'_> {
        fn view(&self) -> Result<CudaView<'_, f32>> {
            Ok(match self {
                Rows::Borrowed(v) => v.slice(..),
                Rows::Owned(s) => s.as_cuda_slice::<f32>()?.slice(..),
            })
        }
    }

    fn f32_rows<'a>(
        s: &'a CudaStorage,
        l: &Layout,
        (r0, r1): (usize, usize),
        cols: usize,
        dropout: Option<DropoutOp>,
        launched: &mut usize,
    ) -> Result<Rows<'a>> {
        let Some((o, _)) = l.contiguous_offsets() else {
            candle_core::bail!("{NAME}: inputs must be contiguous");
        };
        let (start, end) = (o + r0 * cols, o + r1 * cols);
        let part = Layout::contiguous_with_offset((r1 - r0, cols), start);
        if s.dtype() != DType::F32 {
            candle_core::bail!("{NAME}: {:?} rows on cuBLAS's body (f32 only)", s.dtype());
        }
        let Some(d) = dropout else {
            return Ok(Rows::Borrowed(s.as_cuda_slice::<f32>()?.slice(start..end)));
        };
        *launched += 1;
        Ok(Rows::Owned(d.skip(r0 * cols).cuda_fwd(s, &part)?.0))
    }

    /// The row ranges of the chunks of M rows.
    fn chunks(m: usize, rows: usize) -> impl Iterator<Item = (usize, usize)> {
        (0..m)
            .step_by(rows.max(1))
            .map(move |r0| (r0, (r0 + rows).min(m)))
    }

    /// An operand used as stored (`t` false) or transposed.
    fn arg<'a, T>(view: &'a CudaView<'a, T>, t: bool) -> Operand<'a, T> {
        Operand { view, t }
    }

    /// y = x Wᵀ (+ bias) + s · dropout(x) Aᵀ Bᵀ: x (M, K), A (r, K), B (N, r) -> (M, N). A
    /// bf16 x takes [`forward_kernels`]; an f32 x cuBLAS: the base product over every row at
    /// once, the adapter's chunk of rows by chunk of rows ([`super::chunk_rows`]), so that its
    /// dropped-out copies do not grow with the sequence.
    pub(super) fn forward(
        op: &LoraLinearOp,
        x: &CudaStorage,
        xl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<CudaStorage> {
        let (m, k, n) = op.mkn;
        if xl.shape().elem_count() != m * k || !al.shape().elem_count().is_multiple_of(k.max(1)) {
            candle_core::bail!(
                "{NAME}: input {:?} and A {:?} for ({m}, {k})",
                xl.shape(),
                al.shape()
            );
        }
        let r = al.shape().elem_count() / k.max(1);
        let dev = x.device().clone();
        let (av, bv) = (view::<f32>(a, al, NAME)?, view::<f32>(b, bl, NAME)?);
        match x.dtype() {
            DType::BF16 => return forward_kernels(op, (x, xl), &av, &bv, r),
            DType::F32 => {}
            dt => candle_core::bail!("{NAME}: {dt:?} on CUDA (f32, or bf16 with an f32 adapter)"),
        }
        // The base product, onto the bias's rows in the output; its gemm is a launch.
        let mut launched = 1;
        let mut out = CudaStorage::wrap_cuda_slice(alloc::<f32>(&dev, m * n)?, dev.clone());
        let mut beta = 0.0;
        if let Some(bias) = &op.bias {
            let (bs, bl) = bias.storage_and_layout();
            let Some((b0, _)) = bl.contiguous_offsets() else {
                candle_core::bail!("{NAME}: the bias must be contiguous");
            };
            storage(&bs, NAME)?.copy2d(&mut out, m, n, 0, n, b0, 0)?; // every row := bias
            launched += 1;
            beta = 1.0;
        }
        let dst = out.as_cuda_slice_mut::<f32>()?;
        base_product(&dev, op, dst, (x, xl), true, (m, n, k), beta)?;
        for (r0, r1) in chunks(m, super::chunk_rows(k, n)) {
            let rows = r1 - r0;
            // xa = s · xd Aᵀ (rows, r), then its product with Bᵀ
            let xd = f32_rows(x, xl, (r0, r1), k, op.dropout, &mut launched)?;
            let mut xa = alloc::<f32>(&dev, rows * r)?;
            let s = op.scale as f32;
            gemm(
                &dev,
                &mut xa,
                arg(&xd.view()?, false),
                arg(&av, true),
                (rows, r, k),
                s,
                0.0,
            )?;
            let xa = xa.slice(..);
            launched += 2; // this gemm and the next
                           // out += xa Bᵀ
            let mut o = out.as_cuda_slice_mut::<f32>()?.slice_mut(r0 * n..r1 * n);
            gemm(
                &dev,
                &mut o,
                arg(&xa, false),
                arg(&bv, true),
                (rows, n, r),
                1.0,
                1.0,
            )?;
        }
        debug_assert_eq!(launched, op.device_launches(false).forward);
        count_launches(launched - 1);
        Ok(out)
    }

    /// The launch configuration of `kernels/lora_gemm.cuh`'s kernels (static shared memory).
    fn grid3((x, y, z): (usize, usize, usize), threads: u32) -> Result<LaunchConfig> {
        let dim = |v: usize| -> Result<u32> {
            u32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{NAME}: grid of {v}")))
        };
        if y > 65535 {
            candle_core::bail!("{NAME}: {y} blocks in the grid's y (at most 65535)");
        }
        Ok(LaunchConfig {
            grid_dim: (dim(x)?, dim(y)?, dim(z)?),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// One problem of `tallow_lora_down_bf16` / `tallow_lora_grad_bf16`: its bf16 rows, its f32
    /// operand, its f32 output, its length (K or P) and the two strides.
    struct Problem<'a, 'b> {
        rows: &'a CudaView<'a, bf16>,
        operand: &'a CudaView<'a, f32>,
        out: &'a mut CudaViewMut<'b, f32>,
        len: u64,
        strides: (u64, u64),
    }

    /// Pushes one problem's arguments (or a second problem's nulls) onto a launch.
    fn push_problem<'p>(
        b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'p>,
        p: &'p mut Option<Problem<'_, '_>>,
        null: &'p u64,
    ) {
        match p {
            Some(p) => {
                b.arg(p.rows);
                b.arg(p.operand);
                b.arg(&mut *p.out);
                b.arg(&p.len);
                b.arg(&p.strides.0);
                b.arg(&p.strides.1);
            }
            None => {
                for _ in 0..6 {
                    b.arg(null);
                }
            }
        }
    }

    /// `tallow_lora_down_bf16`: C (M, r) := alpha · L · R for one problem, or two in one
    /// launch (blockIdx.z 1 the second).
    fn down(
        dev: &CudaDevice,
        first: Problem<'_, '_>,
        second: Option<Problem<'_, '_>>,
        (m, r): (usize, usize),
        alpha: f32,
        drop: LgDrop,
    ) -> Result<()> {
        let cfg = grid3(
            (
                m.div_ceil(64),
                r.div_ceil(32),
                1 + second.is_some() as usize,
            ),
            128,
        )?;
        if m == 0 {
            return Ok(());
        }
        let func = crate::kernels::cuda::func(dev, "tallow_lora_down_bf16")?;
        let (m, r, null) = (m as u64, r as u64, 0u64);
        let (mut first, mut second) = (Some(first), second);
        let mut b = func.builder();
        push_problem(&mut b, &mut first, &null);
        push_problem(&mut b, &mut second, &null);
        b.arg(&m);
        b.arg(&r);
        b.arg(&alpha);
        b.arg(&drop);
        // SAFETY: argument types and order match `tallow_lora_down_bf16(l0, r0, c0, k0, rsk0,
        // rsj0, l1, .., m, r, alpha, drop)` in kernels/lora_gemm.cuh; each buffer holds the matrix
        // its length and strides describe (the callers' shapes); a second problem's nulls are
        // read only by blocks of z 1, which a one-problem grid has none of.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// `tallow_lora_grad_bf16`: G := Lᵀ S for two problems in one launch, the sum over M split
    /// over [`grad_splits`] blocks per tile.
    fn grads(
        dev: &CudaDevice,
        first: Problem<'_, '_>,
        second: Problem<'_, '_>,
        (m, r): (usize, usize),
        drop: LgDrop,
    ) -> Result<()> {
        let (gx, gy) = (
            (first.len.max(second.len) as usize).div_ceil(32),
            r.div_ceil(32),
        );
        let (splits, chunk) = super::grad_splits(m, 2 * gx * gy);
        let cfg = grid3((gx, gy, 2 * splits), 128)?;
        if gx == 0 || gy == 0 {
            return Ok(());
        }
        let ws_p = first.len.max(second.len);
        let mut ws = alloc::<f32>(
            dev,
            if splits > 1 {
                2 * splits * ws_p as usize * r
            } else {
                1
            },
        )?;
        let mut held = crate::kernels::cuda::tickets(dev, 2 * gx * gy)?;
        let tickets = held.slice_mut();
        let func = crate::kernels::cuda::func(dev, "tallow_lora_grad_bf16")?;
        let (m, r, null, splits32, chunk) = (m as u64, r as u64, 0u64, splits as u32, chunk as u64);
        let (mut first, mut second) = (Some(first), Some(second));
        let mut b = func.builder();
        push_problem(&mut b, &mut first, &null);
        push_problem(&mut b, &mut second, &null);
        b.arg(&m);
        b.arg(&r);
        b.arg(&splits32);
        b.arg(&chunk);
        b.arg(&mut ws);
        b.arg(&ws_p);
        b.arg(&mut *tickets);
        b.arg(&drop);
        // SAFETY: argument types and order match `tallow_lora_grad_bf16(l0, s0, g0, p0, osp0,
        // osj0, l1, .., m, r, splits, chunk, ws, ws_p, tickets, drop)` in kernels/lora_gemm.cuh; each
        // buffer holds the matrix its length and strides describe; ws holds 2 x splits x ws_p
        // x r floats when there is more than one split (else it is not read); tickets holds at
        // least 2 x gx x gy zeros, and stays locked (this device's launches are ordered on its
        // one stream) while the kernel is queued.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// `tallow_lora_up_bf16`: o (M, N) bf16 := r(r(o) (+ bias) + r(S Rᵀ)), S (M, r) f32 and R
    /// (N, r) read at n · rsn + j · rsj. One launch.
    #[allow(clippy::too_many_arguments)]
    fn up_sum(
        dev: &CudaDevice,
        o: &mut CudaViewMut<'_, bf16>,
        s: &CudaView<'_, f32>,
        rm: &CudaView<'_, f32>,
        bias: Option<&CudaView<'_, bf16>>,
        (m, n, r): (usize, usize, usize),
        (rsn, rsj): (usize, usize),
        drop: LgDrop,
    ) -> Result<()> {
        let cfg = grid3((m.div_ceil(64), n.div_ceil(64), 1), 256)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let func = crate::kernels::cuda::func(dev, "tallow_lora_up_bf16")?;
        let null = 0u64;
        let (m, n, r, rsn, rsj) = (m as u64, n as u64, r as u64, rsn as u64, rsj as u64);
        let mut b = func.builder();
        b.arg(o);
        b.arg(s);
        b.arg(rm);
        match bias {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        b.arg(&m);
        b.arg(&n);
        b.arg(&r);
        b.arg(&rsn);
        b.arg(&rsj);
        b.arg(&drop);
        // SAFETY: argument types and order match `tallow_lora_up_bf16` in
        // kernels/lora_gemm.cuh; o holds (M, N), s (M, r), rm the (N, r) its strides describe,
        // the bias N elements; a null bias pointer is what the kernel reads as "no bias".
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// The forward for a bf16 x ([`super::bf16_kernels`]): x Wᵀ into the output (cuBLAS),
    /// s x Aᵀ from x's bf16 rows (dropout's mask applied as they are read), and the output's
    /// rounding sum with its product with Bᵀ and the bias: 3 launches, no f32 copy of x.
    fn forward_kernels(
        op: &LoraLinearOp,
        (x, xl): (&CudaStorage, &Layout),
        av: &CudaView<'_, f32>,
        bv: &CudaView<'_, f32>,
        r: usize,
    ) -> Result<CudaStorage> {
        let (m, k, n) = op.mkn;
        let dev = x.device().clone();
        let mut out = alloc::<bf16>(&dev, m * n)?;
        base_product(&dev, op, &mut out, (x, xl), true, (m, n, k), 0.0)?;
        let mut launched = 1;
        if m > 0 {
            let xv = view::<bf16>(x, xl, NAME)?;
            let mut xa = alloc::<f32>(&dev, m * r)?;
            let mut xa_out = xa.slice_mut(..);
            let first = Problem {
                rows: &xv,
                operand: av,
                out: &mut xa_out,
                len: k as u64,
                strides: (1, k as u64), // A (r, K): element (k, j) at j K + k
            };
            down(
                &dev,
                first,
                None,
                (m, r),
                op.scale as f32,
                LgDrop::of(op, 0),
            )?;
            let bias = op.bias.as_ref().map(|c| c.storage_and_layout());
            let bias = match &bias {
                Some((st, l)) => Some(view::<bf16>(storage(st, NAME)?, l, NAME)?),
                None => None,
            };
            // B (N, r): element (n, j) at n r + j
            let mut o = out.slice_mut(..);
            up_sum(
                &dev,
                &mut o,
                &xa.slice(..),
                bv,
                bias.as_ref(),
                (m, n, r),
                (r, 1),
                LgDrop::NONE,
            )?;
            launched += 2;
        }
        debug_assert_eq!(launched, op.device_launches(true).forward);
        count_launches(launched - 1);
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The backward for a bf16 x ([`super::bf16_kernels`]; dropout's mask as in the forward):
    /// dx = dY W (cuBLAS) when x needs it; s dY B and s x Aᵀ (one launch); dB = dYᵀ (s x Aᵀ)
    /// and dA = (s dY B)ᵀ x (one); dx's rounding sum with (s dY B) A (one). No f32 copies of x
    /// or dY.
    fn backward_kernels(
        op: &LoraLinearOp,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        dy: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let (m, k, n) = op.mkn;
        let r = a.elem_count() / k.max(1);
        let (xst, xl) = x.storage_and_layout();
        let (dyst, dyl) = dy.storage_and_layout();
        let (ast, al) = a.storage_and_layout();
        let (bst, bl) = b.storage_and_layout();
        let (xs, dys) = (storage(&xst, NAME)?, storage(&dyst, NAME)?);
        let dev = xs.device().clone();
        let av = view::<f32>(storage(&ast, NAME)?, al, NAME)?;
        let bv = view::<f32>(storage(&bst, NAME)?, bl, NAME)?;
        let (xv, dyv) = (view::<bf16>(xs, xl, NAME)?, view::<bf16>(dys, dyl, NAME)?);
        let mut launched = 0;
        let mut dx = None;
        if want_dx {
            let mut d = alloc::<bf16>(&dev, m * k)?;
            base_product(&dev, op, &mut d, (dys, dyl), false, (m, k, n), 0.0)?;
            launched += 1;
            dx = Some(d);
        }
        let s = op.scale as f32;
        let (mut g, mut xa) = (alloc::<f32>(&dev, m * r)?, alloc::<f32>(&dev, m * r)?);
        if m > 0 {
            let (mut g_out, mut xa_out) = (g.slice_mut(..), xa.slice_mut(..));
            let first = Problem {
                rows: &dyv,
                operand: &bv,
                out: &mut g_out,
                len: n as u64,
                strides: (r as u64, 1), // B (N, r): element (n, j) at n r + j
            };
            let second = Problem {
                rows: &xv,
                operand: &av,
                out: &mut xa_out,
                len: k as u64,
                strides: (1, k as u64), // A (r, K): element (k, j) at j K + k
            };
            down(&dev, first, Some(second), (m, r), s, LgDrop::of(op, 1))?;
            launched += 1;
        }
        // every element written (zeros without rows)
        let (mut db, mut da) = (alloc::<f32>(&dev, n * r)?, alloc::<f32>(&dev, r * k)?);
        {
            let (gv, xav) = (g.slice(..), xa.slice(..));
            let (mut db_out, mut da_out) = (db.slice_mut(..), da.slice_mut(..));
            let first = Problem {
                rows: &dyv,
                operand: &xav,
                out: &mut db_out,
                len: n as u64,
                strides: (r as u64, 1), // dB (N, r)
            };
            let second = Problem {
                rows: &xv,
                operand: &gv,
                out: &mut da_out,
                len: k as u64,
                strides: (1, k as u64), // dA (r, K)
            };
            grads(&dev, first, second, (m, r), LgDrop::of(op, 1))?;
            launched += 1;
        }
        if let Some(d) = &mut dx {
            if m > 0 {
                // A (r, K) as the (K, r) operand: element (k, j) at j K + k
                let mut o = d.slice_mut(..);
                let drop = LgDrop::of(op, 0);
                up_sum(
                    &dev,
                    &mut o,
                    &g.slice(..),
                    &av,
                    None,
                    (m, k, r),
                    (1, k),
                    drop,
                )?;
                launched += 1;
            }
        }
        debug_assert_eq!(launched, op.device_launches(true).backward(want_dx));
        count_launches(launched);
        let dx = dx.map(|d| tensor(d, &dev, x.dims()));
        Ok((dx, tensor(da, &dev, &[r, k]), tensor(db, &dev, &[n, r])))
    }

    /// dx (when `want_dx`), dA and dB of the forward above, for the upstream gradient dy (M, N)
    /// (contiguous). A bf16 x takes [`backward_kernels`]; an f32 x cuBLAS: dx = dY W over
    /// every row at once, then chunk by chunk of rows s dY B,
    /// s xd Aᵀ, dB += dYᵀ (s xd Aᵀ), dA += (s dY B)ᵀ xd (beta 1 after the first chunk) and dx's
    /// rows += mask ⊙ (s dY B) A, each product one gemm.
    pub(super) fn backward(
        op: &LoraLinearOp,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        dy: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        if super::bf16_kernels(x.dtype() == DType::BF16) {
            return backward_kernels(op, x, a, b, dy, want_dx);
        }
        let (m, k, n) = op.mkn;
        let r = a.elem_count() / k.max(1);
        let (xst, xl) = x.storage_and_layout();
        let (dyst, dyl) = dy.storage_and_layout();
        let (ast, al) = a.storage_and_layout();
        let (bst, bl) = b.storage_and_layout();
        let (xs, dys) = (storage(&xst, NAME)?, storage(&dyst, NAME)?);
        let dev = xs.device().clone();
        let av = view::<f32>(storage(&ast, NAME)?, al, NAME)?;
        let bv = view::<f32>(storage(&bst, NAME)?, bl, NAME)?;
        let mut launched = 0;
        // dA and dB are sums over the chunks; with no rows, zeros
        let (mut da, mut db) = if m == 0 {
            (
                dev.alloc_zeros::<f32>(r * k)?,
                dev.alloc_zeros::<f32>(n * r)?,
            )
        } else {
            (alloc::<f32>(&dev, r * k)?, alloc::<f32>(&dev, n * r)?)
        };
        // dx starts as the base's share dY W, every row at once
        let mut dx = None;
        if want_dx {
            let mut d = alloc::<f32>(&dev, m * k)?;
            base_product(&dev, op, &mut d, (dys, dyl), false, (m, k, n), 0.0)?;
            dx = Some(d);
        }
        launched += want_dx as usize;
        let s = op.scale as f32;
        for (i, (r0, r1)) in chunks(m, super::chunk_rows(k, n)).enumerate() {
            let rows = r1 - r0;
            let beta = if i == 0 { 0.0 } else { 1.0 };
            let dyr = f32_rows(dys, dyl, (r0, r1), n, None, &mut launched)?;
            let dyv = dyr.view()?;
            // s dY B (rows, r)
            let mut dyb = alloc::<f32>(&dev, rows * r)?;
            gemm(
                &dev,
                &mut dyb,
                arg(&dyv, false),
                arg(&bv, false),
                (rows, r, n),
                s,
                0.0,
            )?;
            let dybv = dyb.slice(..);
            {
                // the adapter's gradients, from x's rows in f32 (dropped out), freed before dx
                let xd = f32_rows(xs, xl, (r0, r1), k, op.dropout, &mut launched)?;
                let xd = xd.view()?;
                let mut xa = alloc::<f32>(&dev, rows * r)?;
                gemm(
                    &dev,
                    &mut xa,
                    arg(&xd, false),
                    arg(&av, true),
                    (rows, r, k),
                    s,
                    0.0,
                )?;
                let xa = xa.slice(..);
                gemm(
                    &dev,
                    &mut db,
                    arg(&dyv, true),
                    arg(&xa, false),
                    (n, r, rows),
                    1.0,
                    beta,
                )?;
                gemm(
                    &dev,
                    &mut da,
                    arg(&dybv, true),
                    arg(&xd, false),
                    (r, k, rows),
                    1.0,
                    beta,
                )?;
                launched += 4;
            }
            let Some(dx) = &mut dx else {
                continue;
            };
            // these rows of dx += mask ⊙ (s dY B) A
            let Some(drop) = op.dropout else {
                let mut o = dx.slice_mut(r0 * k..r1 * k);
                gemm(
                    &dev,
                    &mut o,
                    arg(&dybv, false),
                    arg(&av, false),
                    (rows, k, r),
                    1.0,
                    1.0,
                )?;
                launched += 1;
                continue;
            };
            let mut l = alloc::<f32>(&dev, rows * k)?;
            gemm(
                &dev,
                &mut l,
                arg(&dybv, false),
                arg(&av, false),
                (rows, k, r),
                1.0,
                0.0,
            )?;
            let l = CudaStorage::wrap_cuda_slice(l, dev.clone());
            // this gemm, the mask and the sum
            launched += 3;
            let l = drop
                .skip(r0 * k)
                .cuda_fwd(&l, &Layout::contiguous((rows, k)))?
                .0;
            let lv = l.as_cuda_slice::<f32>()?.slice(..);
            sum_f32(&dev, &mut dx.slice_mut(r0 * k..r1 * k), &lv)?;
        }
        debug_assert_eq!(launched, op.device_launches(false).backward(want_dx));
        count_launches(launched);
        let dx = dx.map(|d| tensor(d, &dev, x.dims()));
        Ok((dx, tensor(da, &dev, &[r, k]), tensor(db, &dev, &[n, r])))
    }
}

#[cfg(test)]
mod tests {
    use super::grad_splits;

    /// The gradient kernel's splits of M cover every row once, in chunks of a multiple of 32
    /// rows, none empty, at least 256 rows each when there is more than one, and fill about
    /// `GRAD_BLOCKS` blocks when M allows: Qwen2.5-0.5B's q_proj (P 896, r 16: 2 x 28 x 1
    /// tiles) at 4096 tokens takes 5 splits of 832 rows, a 7B's (2 x 128 tiles) 2; a tile
    /// grid of `GRAD_BLOCKS` or more is not split.
    #[test]
    fn grad_splits_cover_m_in_chunks_of_32() {
        for m in [0, 1, 31, 32, 33, 255, 256, 257, 1000, 4096, 65536, 1 << 20] {
            for tiles in [1, 2, 56, 256, 1000] {
                let (splits, chunk) = grad_splits(m, tiles);
                assert!(splits >= 1 && chunk % 32 == 0 && chunk >= 32, "{m} {tiles}");
                assert!(splits * chunk >= m, "{m} {tiles}: rows left out");
                assert!(
                    m == 0 || (splits - 1) * chunk < m,
                    "{m} {tiles}: an empty split"
                );
                if splits > 1 {
                    assert!(chunk >= 256, "{m} {tiles}: {chunk} rows a split");
                }
            }
        }
        assert_eq!(grad_splits(4096, 56), (5, 832));
        assert_eq!(grad_splits(4096, 256).0, 2);
        assert_eq!(grad_splits(4096, 264).0, 1);
    }
}
