//! The LoRA linear on the CPU as one graph op: `y = x Wᵀ (+ b) + s · dropout(x) Aᵀ Bᵀ` with the
//! adapter's product accumulated into the base matmul's output, and one backward buffer for
//! dx. f32 / f64, and a bf16 model's (bf16 x, base and bias; f32 adapter, widened and rounded
//! back where the graph of Candle ops rounds). CUDA runs the linear as tensor ops
//! (`crate::nn::linear::Linear::forward_unfused`); which path a linear takes is
//! `crate::nn::dispatch`'s rule.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::kernels::amx;
use crate::kernels::dropout::DropoutOp;
use crate::kernels::fused::{round_bf16, rows_per_task, to_bf16, uninit, widen_bf16};
use crate::kernels::nf4::Nf4Weight;

/// The frozen base weight (N, K) of a one-op LoRA linear: dense in the compute dtype, or NF4.
#[derive(Clone)]
pub enum LoraBase {
    Dense(Tensor),
    Nf4(Arc<Nf4Weight>),
}

/// A LoRA linear on the CPU as one graph op (x, A, B) -> W x + b + s · B A dropout(x), for f32 /
/// f64 with a frozen dense or NF4 base and a frozen (or no) bias: the adapter's output is added
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

/// The dense base weight (N, K) in the compute dtype, on the CPU (NF4 dequantized, dropped by
/// the caller after use).
fn cpu_weight(base: &LoraBase) -> candle_core::Result<Tensor> {
    match base {
        LoraBase::Dense(w) => Ok(w.clone()),
        LoraBase::Nf4(w) => w.dequantize_candle(),
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
    let w = cpu_weight(base)?;
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
        let w = cpu_weight(&self.base)?;
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
        let mut dims = xl.shape().dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = n;
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (m, k, n) = self.mkn;
        let (a, b) = (a.detach(), b.detach());
        // The adapter's side runs in its own dtype: a bf16 x and dY widened to f32 (exact).
        let x2 = crate::kernels::fused::cast(&x.detach().reshape((m, k))?, a.dtype())?;
        let dy2 = dy.detach().contiguous()?.reshape((m, n))?;
        let dy2a = crate::kernels::fused::cast(&dy2, a.dtype())?;
        let xd = match &self.dropout {
            Some(op) => x2.apply_op1_no_bwd(op)?,
            None => x2,
        };
        let dyb = (dy2a.matmul(&b)? * self.scale)?; // s (dY B): (M, r)
        let xa = (xd.matmul(&a.t()?)? * self.scale)?; // s (xd Aᵀ): (M, r)
        let db = dy2a.t()?.matmul(&xa)?; // (N, r)
        let da = dyb.t()?.matmul(&xd)?; // (r, K)
        let dx = if x.track_op() {
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
        let w = cpu_weight(&self.base)?;
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
