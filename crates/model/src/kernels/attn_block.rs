//! Chunked attention's tensor-op path (`super::chunked`, the path CUDA takes) with the
//! element-wise work of a block of query rows as three ops, one kernel each on CUDA
//! (`kernels/tallow.cu`'s `tallow_attn_lse_*`, `tallow_attn_probs_*`, `tallow_attn_ds_*`, f32 and
//! bf16), around the block's cuBLAS matmuls: each row's log-sum-exp ([`Lse`]), the
//! probabilities ([`Probs`]) and dS ([`Ds`]), each computing the mask from the segment ids
//! itself, and the backward's D = rowsum(dY Y) ([`RowDot`]). Candle's ops took about 25 launches for a block's forward (the mask from the ids,
//! the cast, the soft-cap, max, exp, sum, division, log) and 10 more in its backward. The CPU
//! bodies here are their twins: each element as the kernel computes it (the sums of a row in
//! another order), run in the kernels' place under `TALLOW_CUDA_PATHS_ON_CPU`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use half::bf16;

use crate::kernels::fused::{data, round_bf16};

type R<T> = candle_core::Result<T>;

/// Whether the tensor-op path of chunked attention over q of this device and dtype takes these
/// ops: on CUDA (or its twins under `TALLOW_CUDA_PATHS_ON_CPU`), f32 and bf16.
pub fn takes(q: &Tensor) -> bool {
    use crate::kernels::dispatch::Backend;
    Backend::of(q.device()) == Backend::Cuda && matches!(q.dtype(), DType::F32 | DType::BF16)
}

/// One block: scores (rows, nk) of rows = (B, KV, n_rep, m) for query positions
/// `p0 .. p0 + m` and keys `lo .. lo + nk`, `heads` = KV n_rep rows per batch entry and query
/// position, over sequences of `t` positions; key j is visible to query i when j <= i, both are
/// in the same segment (`segments`, (B, T) u32) and i - j < `window` (0: no window). `cap` > 0:
/// scores soft-capped to cap tanh(s / cap) first, in the scores' dtype.
#[derive(Clone, Debug)]
pub struct Block {
    pub segments: Tensor,
    pub m: usize,
    pub nk: usize,
    pub heads: usize,
    pub t: usize,
    pub p0: usize,
    pub lo: usize,
    pub window: usize,
    pub cap: f32,
}

impl Block {
    fn rows(&self, l: &Layout, op: &str) -> R<usize> {
        let n = l.shape().elem_count();
        if self.nk == 0
            || !n.is_multiple_of(self.nk)
            || n / self.nk != self.heads * self.m * self.batch()?
        {
            candle_core::bail!(
                "{op}: scores {:?} for a block of {} x {}",
                l.shape(),
                self.m,
                self.nk
            );
        }
        Ok(n / self.nk)
    }

    fn batch(&self) -> R<usize> {
        self.segments.dim(0)
    }

    /// The score of (row, j) as the kernel computes it: -inf where masked.
    fn score(&self, s: &[f32], seg: &[u32], half: bool, row: usize, j: usize) -> f32 {
        let (b, qi, kj) = (
            row / (self.heads * self.m),
            self.p0 + row % self.m,
            self.lo + j,
        );
        let sb = &seg[b * self.t..(b + 1) * self.t];
        if kj > qi || sb[kj] != sb[qi] || (self.window != 0 && qi - kj >= self.window) {
            return f32::NEG_INFINITY;
        }
        let mut v = s[row * self.nk + j];
        if self.cap > 0.0 {
            // Candle's affine in the scores' dtype: its multipliers rounded to it as well
            let rb = |x: f32| if half { round_bf16(x) } else { x };
            v = rb(v * rb(self.inv_cap()) + 0.0);
            v = rb(v.tanh());
            v = rb(v * rb(self.cap) + 0.0);
        }
        v
    }

    /// 1 / cap, computed in f64 and rounded, as Candle's affine takes `t / cap`.
    fn inv_cap(&self) -> f32 {
        (1.0 / self.cap as f64) as f32
    }

    fn segments_cpu(&self) -> R<Vec<u32>> {
        self.segments.flatten_all()?.to_vec1::<u32>()
    }
}

/// A CPU input widened to f32 (f32 as it is, bf16 exactly), and whether it was bf16.
fn widened(s: &CpuStorage, l: &Layout, op: &str) -> R<(Vec<f32>, bool)> {
    Ok(match s {
        CpuStorage::F32(_) => (data::<f32>(s, l, op)?.to_vec(), false),
        CpuStorage::BF16(_) => (
            data::<bf16>(s, l, op)?.iter().map(|v| v.to_f32()).collect(),
            true,
        ),
        _ => candle_core::bail!("{op}: f32 or bf16 scores"),
    })
}

/// f32 values in the scores' dtype.
fn narrowed(v: Vec<f32>, half: bool) -> CpuStorage {
    if half {
        CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect())
    } else {
        CpuStorage::F32(v)
    }
}

/// Each row's log-sum-exp over its visible keys: scores (rows, nk) -> (rows,) f32.
pub struct Lse(pub Block);

/// exp(score - lse) in the scores' dtype; row (g, i)'s log-sum-exp at `lse[g lt + lp0 + i]`
/// (g the row's (B, KV, n_rep) index): the block's own (lt = m, lp0 = 0) or the whole
/// sequence's (lt = T, lp0 = p0).
pub struct Probs {
    pub block: Block,
    pub lt: usize,
    pub lp0: usize,
}

/// dS = P (dP - D) in the scores' dtype (through the cap's derivative when capped), P =
/// exp(score - lse) in f32; `stats` (2, rows_all) f32 holds every query row's log-sum-exp, then
/// its D = rowsum(dY Y), the block's rows at g T + p0 + i.
pub struct Ds(pub Block);

/// D = rowsum(dY Y) of the attention backward: dy, y (rows, d) in the model dtype -> (rows,) f32,
/// each product and the sum in f32 (`tallow_attn_rowdot_*`: one block per row), where the
/// tensor ops made f32 copies of dY and Y and their product, each the size of the output.
pub struct RowDot;

impl CustomOp2 for RowDot {
    fn name(&self) -> &'static str {
        "attn-rowdot"
    }

    fn cpu_fwd(
        &self,
        dy: &CpuStorage,
        dyl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        let d = *dyl.shape().dims().last().unwrap_or(&1);
        if dyl.shape() != yl.shape() || d == 0 {
            candle_core::bail!(
                "{}: dY {:?} and Y {:?}",
                self.name(),
                dyl.shape(),
                yl.shape()
            );
        }
        let (dy, _) = widened(dy, dyl, self.name())?;
        let (y, _) = widened(y, yl, self.name())?;
        let out = dy
            .chunks(d)
            .zip(y.chunks(d))
            .map(|(a, b)| a.iter().zip(b).fold(0f32, |acc, (a, b)| acc + a * b))
            .collect::<Vec<f32>>();
        let rows = out.len();
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dy: &candle_core::CudaStorage,
        dyl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        let d = *dyl.shape().dims().last().unwrap_or(&1);
        if dyl.shape() != yl.shape() || d == 0 {
            candle_core::bail!(
                "{}: dY {:?} and Y {:?}",
                self.name(),
                dyl.shape(),
                yl.shape()
            );
        }
        let rows = dyl.shape().elem_count() / d;
        Ok((cuda::rowdot(dy, dyl, y, yl, rows, d)?, Shape::from(rows)))
    }
}

impl CustomOp1 for Lse {
    fn name(&self) -> &'static str {
        "attn-lse"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> R<(CpuStorage, Shape)> {
        let b = &self.0;
        let rows = b.rows(l, self.name())?;
        let (s, half) = widened(s, l, self.name())?;
        let seg = b.segments_cpu()?;
        let lse = (0..rows)
            .map(|row| {
                let x: Vec<f32> = (0..b.nk).map(|j| b.score(&s, &seg, half, row, j)).collect();
                let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = x.iter().map(|&v| (v - mx).exp()).sum();
                mx + sum.ln()
            })
            .collect();
        Ok((CpuStorage::F32(lse), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        let rows = self.0.rows(l, self.name())?;
        let out = cuda::launch(s, l, &self.0, cuda::Kind::Lse, rows)?;
        Ok((out, Shape::from(rows)))
    }
}

impl CustomOp2 for Probs {
    fn name(&self) -> &'static str {
        "attn-probs"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        sl: &Layout,
        lse: &CpuStorage,
        ll: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        let b = &self.block;
        let rows = b.rows(sl, self.name())?;
        let (s, half) = widened(s, sl, self.name())?;
        let lse = data::<f32>(lse, ll, "attention log-sum-exp")?;
        let seg = b.segments_cpu()?;
        let mut p = vec![0f32; rows * b.nk];
        for row in 0..rows {
            let l = lse[(row / b.m) * self.lt + self.lp0 + row % b.m];
            for j in 0..b.nk {
                p[row * b.nk + j] = (b.score(&s, &seg, half, row, j) - l).exp();
            }
        }
        Ok((narrowed(p, half), sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        sl: &Layout,
        lse: &candle_core::CudaStorage,
        ll: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        let rows = self.block.rows(sl, self.name())?;
        let kind = cuda::Kind::Probs {
            lse: (lse, ll),
            lt: self.lt,
            lp0: self.lp0,
        };
        let out = cuda::launch(s, sl, &self.block, kind, rows)?;
        Ok((out, sl.shape().clone()))
    }
}

impl CustomOp3 for Ds {
    fn name(&self) -> &'static str {
        "attn-ds"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        sl: &Layout,
        dp: &CpuStorage,
        dpl: &Layout,
        stats: &CpuStorage,
        stl: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        let b = &self.0;
        let rows = b.rows(sl, self.name())?;
        let (s, half) = widened(s, sl, self.name())?;
        let (dp, _) = widened(dp, dpl, self.name())?;
        let stats = data::<f32>(stats, stl, "attention row statistics")?;
        let all = stats.len() / 2;
        let seg = b.segments_cpu()?;
        let mut ds = vec![0f32; rows * b.nk];
        for row in 0..rows {
            let at = (row / b.m) * b.t + b.p0 + row % b.m;
            let (l, di) = (stats[at], stats[all + at]);
            for j in 0..b.nk {
                let e = row * b.nk + j;
                let x = b.score(&s, &seg, half, row, j);
                let mut d = (x - l).exp() * (dp[e] - di);
                if b.cap > 0.0 && x != f32::NEG_INFINITY {
                    let th = x * b.inv_cap() + 0.0;
                    d *= -(th * th) + 1.0; // Candle's affine(-1, 1) of th²
                }
                ds[e] = d;
            }
        }
        Ok((narrowed(ds, half), sl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        sl: &Layout,
        dp: &candle_core::CudaStorage,
        dpl: &Layout,
        stats: &candle_core::CudaStorage,
        stl: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let rows = self.0.rows(sl, self.name())?;
        if dp.dtype() != s.dtype() {
            candle_core::bail!(
                "{}: dP in {:?} for scores in {:?}",
                self.name(),
                dp.dtype(),
                s.dtype()
            );
        }
        let kind = cuda::Kind::Ds {
            dp: (dp, dpl),
            stats: (stats, stl),
        };
        let out = cuda::launch(s, sl, &self.0, kind, rows)?;
        Ok((out, sl.shape().clone()))
    }
}

/// The launches of the three kernels.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Storage};
    use half::bf16;

    use super::{Block, R};
    use crate::kernels::cuda::{func, view, Grid};

    /// `tallow_attn_rowdot_*` over `rows` rows of `d`.
    pub(super) fn rowdot(
        dy: &CudaStorage,
        dyl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
        rows: usize,
        d: usize,
    ) -> R<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            dy: &CudaStorage,
            dyl: &Layout,
            y: &CudaStorage,
            yl: &Layout,
            rows: usize,
            d: usize,
            suffix: &str,
        ) -> R<CudaStorage> {
            let dev = dy.device().clone();
            let (dyv, yv) = (
                view::<T>(dy, dyl, "attention dY")?,
                view::<T>(y, yl, "attention Y")?,
            );
            // SAFETY: thread 0 of each row's block writes its element.
            let out = unsafe { dev.alloc::<f32>(rows)? };
            if rows > 0 {
                let f = func(&dev, &format!("tallow_attn_rowdot_{suffix}"))?;
                let mut bld = f.builder();
                bld.arg(&dyv);
                bld.arg(&yv);
                bld.arg(&out);
                bld.arg(&d);
                // SAFETY: argument types and order match `tallow_attn_rowdot_*`.
                unsafe { bld.launch(Grid::Rows { rows, threads: 64 }.config()) }.w()?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match (dy.dtype(), y.dtype()) {
            (DType::F32, DType::F32) => run::<f32>(dy, dyl, y, yl, rows, d, "f32"),
            (DType::BF16, DType::BF16) => run::<bf16>(dy, dyl, y, yl, rows, d, "bf16"),
            (a, b) => candle_core::bail!("attention rowdot: dY {a:?} and Y {b:?}"),
        }
    }

    /// Which kernel, with its inputs beyond the scores.
    pub(super) enum Kind<'a> {
        Lse,
        Probs {
            lse: (&'a CudaStorage, &'a Layout),
            lt: usize,
            lp0: usize,
        },
        Ds {
            dp: (&'a CudaStorage, &'a Layout),
            stats: (&'a CudaStorage, &'a Layout),
        },
    }

    /// Runs `kind`'s kernel on the scores `s` (f32 or bf16) of block `b` with `rows` rows.
    pub(super) fn launch(
        s: &CudaStorage,
        sl: &Layout,
        b: &Block,
        kind: Kind<'_>,
        rows: usize,
    ) -> R<CudaStorage> {
        match s.dtype() {
            DType::F32 => launch_t::<f32>(s, sl, b, kind, rows, "f32"),
            DType::BF16 => launch_t::<bf16>(s, sl, b, kind, rows, "bf16"),
            dt => candle_core::bail!("chunked attention's block kernels: {dt:?} scores"),
        }
    }

    fn launch_t<T: CudaDType + DeviceRepr>(
        s: &CudaStorage,
        sl: &Layout,
        b: &Block,
        kind: Kind<'_>,
        rows: usize,
        suffix: &str,
    ) -> R<CudaStorage> {
        let dev = s.device().clone();
        let (seg_st, seg_l) = b.segments.storage_and_layout();
        let seg = match &*seg_st {
            Storage::Cuda(c) => view::<u32>(c, seg_l, "attention segments")?,
            _ => candle_core::bail!("attention: the segment ids are not on the CUDA device"),
        };
        let sv = view::<T>(s, sl, "attention scores")?;
        let n = rows * b.nk;
        let (m, nk, heads, t, p0, lo, window, cap) =
            (b.m, b.nk, b.heads, b.t, b.p0, b.lo, b.window, b.cap);
        let inv_cap = if cap > 0.0 { b.inv_cap() } else { 0.0 };
        macro_rules! block_args {
            ($bld:ident) => {
                $bld.arg(&m);
                $bld.arg(&nk);
                $bld.arg(&heads);
                $bld.arg(&t);
                $bld.arg(&p0);
                $bld.arg(&lo);
                $bld.arg(&window);
                $bld.arg(&cap);
                $bld.arg(&inv_cap);
            };
        }
        match kind {
            Kind::Lse => {
                // SAFETY: thread 0 of each row's block writes its element.
                let out = unsafe { dev.alloc::<f32>(rows)? };
                if rows > 0 {
                    let f = func(&dev, &format!("tallow_attn_lse_{suffix}"))?;
                    let mut bld = f.builder();
                    bld.arg(&sv);
                    bld.arg(&seg);
                    bld.arg(&out);
                    block_args!(bld);
                    // SAFETY: argument types and order match `tallow_attn_lse_*`.
                    unsafe { bld.launch(Grid::Rows { rows, threads: 128 }.config()) }.w()?;
                }
                Ok(CudaStorage::wrap_cuda_slice(out, dev))
            }
            Kind::Probs { lse, lt, lp0 } => {
                let lsev = view::<f32>(lse.0, lse.1, "attention log-sum-exp")?;
                // SAFETY: the kernel writes every one of the n elements.
                let out = unsafe { dev.alloc::<T>(n)? };
                if n > 0 {
                    let f = func(&dev, &format!("tallow_attn_probs_{suffix}"))?;
                    let mut bld = f.builder();
                    bld.arg(&sv);
                    bld.arg(&seg);
                    bld.arg(&lsev);
                    bld.arg(&out);
                    bld.arg(&rows);
                    bld.arg(&lt);
                    bld.arg(&lp0);
                    block_args!(bld);
                    // SAFETY: argument types and order match `tallow_attn_probs_*`.
                    unsafe { bld.launch(Grid::Elems(n).config()) }.w()?;
                }
                Ok(CudaStorage::wrap_cuda_slice(out, dev))
            }
            Kind::Ds { dp, stats } => {
                let dpv = view::<T>(dp.0, dp.1, "attention dP")?;
                let stv = view::<f32>(stats.0, stats.1, "attention row statistics")?;
                let all = stats.1.shape().elem_count() / 2;
                // SAFETY: the kernel writes every one of the n elements.
                let out = unsafe { dev.alloc::<T>(n)? };
                if n > 0 {
                    let f = func(&dev, &format!("tallow_attn_ds_{suffix}"))?;
                    let mut bld = f.builder();
                    bld.arg(&sv);
                    bld.arg(&seg);
                    bld.arg(&dpv);
                    bld.arg(&stv);
                    bld.arg(&out);
                    bld.arg(&rows);
                    bld.arg(&all);
                    block_args!(bld);
                    // SAFETY: argument types and order match `tallow_attn_ds_*`.
                    unsafe { bld.launch(Grid::Elems(n).config()) }.w()?;
                }
                Ok(CudaStorage::wrap_cuda_slice(out, dev))
            }
        }
    }
}

/// In place on an f32 accumulator `acc` (B, KV, T, D): its rows `lo .. lo + nk` += lhsᵀ · rhs
/// per (batch, kv head), lhs (B, KV, R, nk) and rhs (B, KV, R, D) in f32 or bf16 (one dtype),
/// each product summed in f32 and added without rounding to the inputs' dtype: chunked
/// attention's dK += dSᵀ q and dV += Pᵀ dY of one block (its backward's sums). On CUDA one
/// strided-batched cuBLAS gemm with beta 1 (bf16 inputs, f32 output), where the block's
/// product in bf16, its cast to f32, the add and the copy into the accumulator's rows were 4
/// launches; the CPU body is its twin. As the CPU kernel sums dK and dV (in f32, rounded once
/// at the end), not the tensor ops, which rounded each block's product to bf16 first.
pub struct AccumulateTn {
    pub lo: usize,
}

impl AccumulateTn {
    /// (batches, T, D, R, nk), checked against the three layouts (all contiguous).
    fn dims(
        &self,
        al: &Layout,
        ll: &Layout,
        rl: &Layout,
    ) -> R<(usize, usize, usize, usize, usize)> {
        let (b, kv, t, d) = al.shape().dims4()?;
        let (lb, lkv, r, nk) = ll.shape().dims4()?;
        let (rb, rkv, rr, rd) = rl.shape().dims4()?;
        if (lb, lkv, rb, rkv, rr, rd) != (b, kv, b, kv, r, d) || self.lo + nk > t {
            candle_core::bail!(
                "attention accumulate: {:?} += {:?}ᵀ {:?} at row {}",
                al.shape(),
                ll.shape(),
                rl.shape(),
                self.lo
            );
        }
        for l in [al, ll, rl] {
            if !l.is_contiguous() {
                candle_core::bail!("attention accumulate: inputs must be contiguous");
            }
        }
        Ok((b * kv, t, d, r, nk))
    }
}

impl candle_core::InplaceOp3 for AccumulateTn {
    fn name(&self) -> &'static str {
        "attn-accumulate"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        al: &Layout,
        lhs: &CpuStorage,
        ll: &Layout,
        rhs: &CpuStorage,
        rl: &Layout,
    ) -> R<()> {
        let (batches, t, d, r, nk) = self.dims(al, ll, rl)?;
        let (l, _) = widened(lhs, ll, "attention accumulate")?;
        let (x, _) = widened(rhs, rl, "attention accumulate")?;
        let CpuStorage::F32(acc) = acc else {
            candle_core::bail!("attention accumulate: the accumulator must be f32");
        };
        let acc = &mut acc[al.start_offset()..];
        for g in 0..batches {
            let (l, x) = (
                &l[g * r * nk..(g + 1) * r * nk],
                &x[g * r * d..(g + 1) * r * d],
            );
            for i in 0..nk {
                let row = &mut acc[(g * t + self.lo + i) * d..(g * t + self.lo + i + 1) * d];
                let mut sum = vec![0f32; d];
                for j in 0..r {
                    let a = l[j * nk + i];
                    for (s, &xv) in sum.iter_mut().zip(&x[j * d..(j + 1) * d]) {
                        *s += a * xv;
                    }
                }
                for (o, s) in row.iter_mut().zip(sum) {
                    *o += s;
                }
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        al: &Layout,
        lhs: &candle_core::CudaStorage,
        ll: &Layout,
        rhs: &candle_core::CudaStorage,
        rl: &Layout,
    ) -> R<()> {
        use candle_core::backend::BackendStorage;
        let (batches, t, d, r, nk) = self.dims(al, ll, rl)?;
        if batches == 0 || nk == 0 || d == 0 {
            return Ok(());
        }
        let dev = acc.device().clone();
        let int = |v: usize| -> R<i32> {
            i32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("attention accumulate: {v} is past cuBLAS's int"))
            })
        };
        let (data_type, compute) = match lhs.dtype() {
            DType::F32 => (
                <f32 as super::cuda::GemmType>::DATA,
                <f32 as super::cuda::GemmType>::compute(),
            ),
            DType::BF16 => (
                <bf16 as super::cuda::GemmType>::DATA,
                <bf16 as super::cuda::GemmType>::compute(),
            ),
            dt => candle_core::bail!("attention accumulate: {dt:?} on CUDA (f32 or bf16)"),
        };
        if rhs.dtype() != lhs.dtype() {
            candle_core::bail!("attention accumulate: one dtype for dS / P and q / dY");
        }
        let (a0, a1) = al.contiguous_offsets().expect("checked contiguous");
        let mut accv = acc.as_cuda_slice_mut::<f32>()?.slice_mut(a0..a1);
        let shape = Gemm {
            batches: int(batches)?,
            t,
            d: int(d)?,
            r: int(r)?,
            nk: int(nk)?,
            lo: self.lo,
        };
        match lhs.dtype() {
            DType::F32 => {
                shape.launch::<f32>(&dev, &mut accv, (lhs, ll), (rhs, rl), data_type, compute)
            }
            _ => shape.launch::<bf16>(&dev, &mut accv, (lhs, ll), (rhs, rl), data_type, compute),
        }
    }
}

/// [`AccumulateTn`]'s gemm on CUDA: sizes as cuBLAS takes them.
#[cfg(feature = "cuda")]
struct Gemm {
    batches: i32,
    t: usize,
    d: i32,
    r: i32,
    nk: i32,
    lo: usize,
}

#[cfg(feature = "cuda")]
impl Gemm {
    /// Column-major, per batch: accᵀ (D, nk) += rhsᵀ (D, R) · lhs (R, nk), rhs and lhs of T.
    fn launch<T: super::cuda::GemmType>(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        acc: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, f32>,
        (lhs, ll): (&candle_core::CudaStorage, &Layout),
        (rhs, rl): (&candle_core::CudaStorage, &Layout),
        data_type: candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t,
        compute: candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t,
    ) -> R<()> {
        use candle_core::cuda_backend::cudarc::cublas::{result, sys};
        use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
        use candle_core::cuda_backend::WrapErr;
        use sys::cublasOperation_t as Op;
        let x = super::cuda::view::<T>(rhs, rl, "attention accumulate")?;
        let l = super::cuda::view::<T>(lhs, ll, "attention accumulate")?;
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        let (x_ptr, _gx) = x.device_ptr(&stream);
        let (l_ptr, _gl) = l.device_ptr(&stream);
        let (c_ptr, _gc) = acc.device_ptr_mut(&stream);
        let d = self.d as usize;
        let c_ptr = c_ptr + (self.lo * d * std::mem::size_of::<f32>()) as u64;
        let (r, nk) = (self.r as i64, self.nk as i64);
        let (alpha, beta) = (1f32, 1f32);
        // SAFETY: per batch, rhs holds (R, D) at stride R·D, lhs (R, nk) at stride R·nk and the
        // accumulator (T, D) at stride T·D, rows lo .. lo + nk <= T (checked by `dims`); all on
        // the handle's stream; alpha and beta are f32 as the f32 compute types take them.
        unsafe {
            result::gemm_strided_batched_ex(
                *blas.handle(),
                Op::CUBLAS_OP_N,
                Op::CUBLAS_OP_T,
                self.d,
                self.nk,
                self.r,
                (&alpha) as *const f32 as *const _,
                x_ptr as *const _,
                data_type,
                self.d,
                r * d as i64,
                l_ptr as *const _,
                data_type,
                self.nk,
                r * nk,
                (&beta) as *const f32 as *const _,
                c_ptr as *mut _,
                <f32 as super::cuda::GemmType>::DATA,
                self.d,
                (self.t * d) as i64,
                self.batches,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()?;
        Ok(())
    }
}
