//! Cross-entropy over a chunk of LM-head logits (crate::nn::loss), with no logits-sized temporary.
//!
//! Two forms of the same arithmetic:
//! - on the CPU, host-side ([`ce_nll_sum`], [`ce_grad_in_place`]): labels and row statistics on
//!   the host, the sum in f64;
//! - on the device, as graph-free ops on f32 logits ([`ce_rows`], [`ce_grad_rows`]): labels, the
//!   rows' NLL and log-sum-exp and the upstream gradient stay on the device (no sync). On CUDA
//!   each is one kernel of `kernels/tallow.cu` (`tallow_ce_rows_f32`, `tallow_ce_grad_f32`); on
//!   the CPU their twins below (what `TALLOW_CUDA_PATHS_ON_CPU=1` runs, and `tallow doctor`
//!   compares the kernels with).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Tensor};
use rayon::prelude::*;

use super::fused::{multiversion, storage_data, Real};

type R<T> = candle_core::Result<T>;

multiversion!(
    /// max and sum of exp(x - max) of a row (the exp in the row's type, the sum in f64: rows
    /// are a whole vocabulary long, up to ~256k terms).
    fn max_sum_exp<T: Real>(row: &[T]) -> (T, f64) => max_sum_exp_body
);

/// [`max_sum_exp`]'s body: eight running sums, so that the loop vectorizes (one f64 sum waits
/// on each add).
#[inline(always)]
fn max_sum_exp_body<T: Real>(row: &[T]) -> (T, f64) {
    // the max in sixteen lanes too (the same value: a max does not round)
    let mut maxes = [T::NEG_INF; 16];
    let mut lanes = row.chunks_exact(16);
    for c in &mut lanes {
        for (a, &b) in maxes.iter_mut().zip(c) {
            *a = if b > *a { b } else { *a };
        }
    }
    let m = maxes
        .iter()
        .chain(lanes.remainder())
        .copied()
        .fold(T::NEG_INF, |a, b| if b > a { b } else { a });
    let mut acc = [0f64; 8];
    let mut lanes = row.chunks_exact(8);
    for c in &mut lanes {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += (x - m).exp_nonpositive().to_f64();
        }
    }
    let tail: f64 = lanes
        .remainder()
        .iter()
        .map(|&x| (x - m).exp_nonpositive().to_f64())
        .sum();
    (m, acc.iter().sum::<f64>() + tail)
}

multiversion!(
    /// The row := exp(row - m) · scale, in place: g softmax(row), with m the row's max and
    /// scale g / its sum of exp(row - m).
    fn exp_scaled<T: Real>(row: &mut [T], m: T, scale: T) => exp_scaled_body
);

#[inline(always)]
fn exp_scaled_body<T: Real>(row: &mut [T], m: T, scale: T) {
    row.iter_mut()
        .for_each(|e| *e = (*e - m).exp_nonpositive() * scale);
}

/// Per row of a chunk of logits, its max and its sum of exp(row - max), as [`ce_nll_sum`] found
/// them: the backward's [`ce_grad_in_place`] on the same logits (recomputed bit for bit) reuses
/// them instead of a pass of its own.
pub type RowStats = Vec<(f64, f64)>;

/// Sum over rows of -log softmax(row)[label]: logits (n, V) f32 / f64 contiguous on the CPU,
/// `labels` n ids < V, and each row's [`RowStats`]. One read of the logits, nothing
/// logits-sized allocated.
pub fn ce_nll_sum(logits: &Tensor, labels: &[u32]) -> R<(f64, RowStats)> {
    let (n, v) = logits.dims2()?;
    if labels.len() != n || labels.iter().any(|&y| y as usize >= v) {
        candle_core::bail!("cross-entropy: {n} rows need {n} labels below {v}");
    }
    let (st, l) = logits.storage_and_layout();
    fn run<T: Real>(x: &[T], labels: &[u32], v: usize) -> (f64, RowStats) {
        let rows: Vec<(f64, (f64, f64))> = x
            .par_chunks(v)
            .zip(labels.par_iter())
            .map(|(row, &y)| {
                let (m, s) = max_sum_exp(row);
                let m = m.to_f64();
                (m + s.ln() - row[y as usize].to_f64(), (m, s))
            })
            .collect();
        (
            rows.iter().map(|r| r.0).sum(),
            rows.into_iter().map(|r| r.1).collect(),
        )
    }
    Ok(match logits.dtype() {
        DType::F32 => run(storage_data::<f32>(&st, l, "cross-entropy")?, labels, v),
        DType::F64 => run(storage_data::<f64>(&st, l, "cross-entropy")?, labels, v),
        d => candle_core::bail!("cross-entropy: dtype {d:?} (f32 / f64 only)"),
    })
}

/// Turns a chunk of logits (n, V) into the gradient of g * sum of its rows' NLL, in place:
/// g (softmax(row) - onehot(label)). The LM head's backward then multiplies this buffer with
/// the head: one logits-sized buffer per chunk instead of five (softmax's shifted / exp /
/// normalized copies, the one-hot, the difference and its scaled copy). `stats`: the rows'
/// [`RowStats`] from the forward, when these logits are the same bits; else found here.
pub fn ce_grad_in_place(
    logits: &Tensor,
    labels: &[u32],
    g: f64,
    stats: Option<&[(f64, f64)]>,
) -> R<()> {
    let (n, v) = logits.dims2()?;
    if labels.len() != n || labels.iter().any(|&y| y as usize >= v) {
        candle_core::bail!("cross-entropy: {n} rows need {n} labels below {v}");
    }
    if stats.is_some_and(|s| s.len() != n) {
        candle_core::bail!("cross-entropy: {n} rows need {n} row statistics");
    }
    logits.inplace_op1(&CeGrad {
        labels: labels.to_vec(),
        stats: stats.map(<[_]>::to_vec),
        g,
        v,
    })
}

struct CeGrad {
    labels: Vec<u32>,
    stats: Option<RowStats>,
    g: f64,
    v: usize,
}

impl CeGrad {
    fn run<T: Real>(&self, x: &mut [T]) {
        x.par_chunks_mut(self.v)
            .zip(self.labels.par_iter())
            .enumerate()
            .for_each(|(i, (row, &y))| {
                let (m, s) = match &self.stats {
                    Some(st) => (T::from_f64(st[i].0), st[i].1),
                    None => max_sum_exp(row),
                };
                exp_scaled(row, m, T::from_f64(self.g / s));
                row[y as usize] -= T::from_f64(self.g);
            });
    }
}

impl candle_core::InplaceOp1 for CeGrad {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> R<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("cross-entropy grad: logits must be contiguous");
        };
        match storage {
            CpuStorage::F32(x) => self.run(&mut x[a..b]),
            CpuStorage::F64(x) => self.run(&mut x[a..b]),
            s => candle_core::bail!("cross-entropy grad: dtype {:?} (f32 / f64 only)", s.dtype()),
        }
        Ok(())
    }
}

/// Per row of f32 logits (n, V) and its label (n, u32): the row's NLL and log-sum-exp, as one
/// (2, n) f32 tensor (row 0 the NLLs, row 1 the log-sum-exps) on the logits' device. Not
/// differentiable (the loss attaches its own backward).
pub fn ce_rows(logits: &Tensor, labels: &Tensor) -> R<Tensor> {
    logits
        .contiguous()?
        .apply_op2_no_bwd(&labels.contiguous()?, &CeRows)
}

/// In place: logits (n, V) f32 := g (softmax(row) - onehot(label)), the gradient of g * sum of
/// the rows' NLL, from the rows' log-sum-exp `lse` (n, f32, as [`ce_rows`] gave it) and the
/// upstream gradient `g` (a scalar tensor, f32), without reading either to the host.
pub fn ce_grad_rows(logits: &Tensor, labels: &Tensor, lse: &Tensor, g: &Tensor) -> R<()> {
    let lse_g = Tensor::cat(&[lse, &g.to_dtype(DType::F32)?.reshape(1)?], 0)?; // (n + 1)
    logits.inplace_op3(&labels.contiguous()?, &lse_g, &CeGradRows)
}

/// [`ce_rows`]' op.
struct CeRows;

/// The rows of f32 logits `x` (n rows of v) and their labels, checked.
fn ce_shapes(name: &str, xl: &Layout, yl: &Layout) -> R<(usize, usize)> {
    let (n, v) = xl.shape().dims2()?;
    if yl.shape().dims() != [n] {
        candle_core::bail!("{name}: {n} rows need {n} labels, got {:?}", yl.shape());
    }
    Ok((n, v))
}

impl candle_core::CustomOp2 for CeRows {
    fn name(&self) -> &'static str {
        "cross-entropy-rows"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
    ) -> R<(CpuStorage, candle_core::Shape)> {
        let (n, v) = ce_shapes(self.name(), xl, yl)?;
        let x = super::fused::data::<f32>(x, xl, "cross-entropy rows")?;
        let y = super::fused::data::<u32>(y, yl, "cross-entropy labels")?;
        if let Some(&bad) = y.iter().find(|&&l| l as usize >= v) {
            candle_core::bail!("cross-entropy rows: label {bad} is not below the vocabulary {v}");
        }
        let mut out = vec![0f32; 2 * n];
        let (nll, lse) = out.split_at_mut(n);
        nll.par_iter_mut()
            .zip(lse.par_iter_mut())
            .zip(x.par_chunks(v.max(1)).zip(y.par_iter()))
            .for_each(|((nll, lse), (row, &label))| {
                let (m, s) = max_sum_exp(row);
                let l = m as f64 + s.ln();
                *lse = l as f32;
                *nll = (l - row[label as usize] as f64) as f32;
            });
        Ok((CpuStorage::F32(out), candle_core::Shape::from((2, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
    ) -> R<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let (n, v) = ce_shapes(self.name(), xl, yl)?;
        let dev = x.device().clone();
        let xv = super::cuda::view::<f32>(x, xl, self.name())?;
        let yv = super::cuda::view::<u32>(y, yl, self.name())?;
        // SAFETY: the kernel writes all 2 n outputs (thread 0 of each row's block).
        let out = unsafe { dev.alloc::<f32>(2 * n)? };
        if n > 0 {
            let func = crate::kernels::cuda::func(&dev, "tallow_ce_rows_f32")?;
            let mut b = func.builder();
            b.arg(&xv);
            b.arg(&yv);
            b.arg(&out);
            b.arg(&v);
            b.arg(&n);
            // SAFETY: argument types and order match `tallow_ce_rows_f32` in kernels/tallow.cu.
            unsafe { b.launch(per_row(n).config()) }.w()?;
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            candle_core::Shape::from((2, n)),
        ))
    }
}

/// [`ce_grad_rows`]' op: the logits in place; inputs the labels and the rows' log-sum-exp
/// followed by g.
struct CeGradRows;

impl candle_core::InplaceOp3 for CeGradRows {
    fn name(&self) -> &'static str {
        "cross-entropy-grad-rows"
    }

    fn cpu_fwd(
        &self,
        x: &mut CpuStorage,
        xl: &Layout,
        y: &CpuStorage,
        yl: &Layout,
        lg: &CpuStorage,
        lgl: &Layout,
    ) -> R<()> {
        let (n, v) = ce_shapes(self.name(), xl, yl)?;
        let y = super::fused::data::<u32>(y, yl, "cross-entropy labels")?;
        let lg = super::fused::data::<f32>(lg, lgl, "cross-entropy row statistics")?;
        if lg.len() != n + 1 || y.iter().any(|&l| l as usize >= v) {
            candle_core::bail!("cross-entropy grad rows: {n} rows need {n} labels below {v} and {} statistics, got {}", n + 1, lg.len());
        }
        let Some((a, b)) = xl.contiguous_offsets() else {
            candle_core::bail!("cross-entropy grad rows: logits must be contiguous");
        };
        let CpuStorage::F32(x) = x else {
            candle_core::bail!("cross-entropy grad rows: logits must be f32");
        };
        let g = lg[n];
        x[a..b]
            .par_chunks_mut(v.max(1))
            .zip(y.par_iter().zip(&lg[..n]))
            .for_each(|(row, (&label, &lse))| {
                row.iter_mut().for_each(|e| *e = (*e - lse).exp() * g);
                row[label as usize] -= g;
            });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &mut candle_core::CudaStorage,
        xl: &Layout,
        y: &candle_core::CudaStorage,
        yl: &Layout,
        lg: &candle_core::CudaStorage,
        lgl: &Layout,
    ) -> R<()> {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let (n, v) = ce_shapes(self.name(), xl, yl)?;
        if lgl.shape().elem_count() != n + 1 {
            candle_core::bail!(
                "cross-entropy grad rows: {} statistics for {n} rows",
                lgl.shape().elem_count()
            );
        }
        let Some((a, b)) = xl.contiguous_offsets() else {
            candle_core::bail!("cross-entropy grad rows: logits must be contiguous");
        };
        let dev = x.device().clone();
        let yv = super::cuda::view::<u32>(y, yl, self.name())?;
        let lv = super::cuda::view::<f32>(lg, lgl, self.name())?;
        let xs = x.as_cuda_slice_mut::<f32>()?;
        let mut xv = xs.slice_mut(a..b);
        if n > 0 {
            let func = crate::kernels::cuda::func(&dev, "tallow_ce_grad_f32")?;
            let mut bld = func.builder();
            bld.arg(&mut xv);
            bld.arg(&yv);
            bld.arg(&lv);
            bld.arg(&v);
            bld.arg(&n);
            // SAFETY: argument types and order match `tallow_ce_grad_f32` in kernels/tallow.cu.
            unsafe { bld.launch(per_row(n).config()) }.w()?;
        }
        Ok(())
    }
}

/// One block of 256 threads per row of the logits.
#[cfg(feature = "cuda")]
fn per_row(n: usize) -> super::cuda::Grid {
    super::cuda::Grid::Rows {
        rows: n,
        threads: 256,
    }
}

#[cfg(test)]
mod ce_tests {
    use super::*;
    use candle_core::Device;

    /// The fused cross-entropy against log_softmax / softmax from tensor ops: the NLL sum and
    /// the in-place gradient, f64 (1e-12 relative) and f32 (1e-5).
    #[test]
    fn fused_cross_entropy_matches_the_tensor_ops() -> R<()> {
        let dev = Device::Cpu;
        for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let x = (Tensor::randn(0f64, 3., (5, 37), &dev)?).to_dtype(dt)?;
            let labels = [0u32, 36, 7, 7, 20];
            let lab = Tensor::new(&labels[..], &dev)?.unsqueeze(1)?;
            let logp = crate::nn::ops::log_softmax_last_dim(&x).unwrap();
            let want = -logp
                .gather(&lab, 1)?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            let (got, stats) = ce_nll_sum(&x, &labels)?;
            assert!(
                (got - want).abs() <= tol * want.abs(),
                "{dt:?}: {got} vs {want}"
            );
            let g = 0.25;
            let p = crate::nn::ops::softmax_last_dim(&x).unwrap();
            let onehot = lab
                .broadcast_eq(&Tensor::arange(0u32, 37, &dev)?.unsqueeze(0)?)?
                .to_dtype(dt)?;
            let want = ((p - onehot)? * g)?;
            let y = x.copy()?;
            ce_grad_in_place(&y, &labels, g, None)?;
            // the forward's row statistics give the same bits
            let z = x.copy()?;
            ce_grad_in_place(&z, &labels, g, Some(&stats))?;
            assert_eq!(
                (&y - &z)?
                    .abs()?
                    .max_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?,
                0.0
            );
            let d = (&y - &want)?
                .abs()?
                .max_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            assert!(d <= tol, "{dt:?}: gradient off by {d}");
            // a label out of range is refused
            assert!(ce_nll_sum(&x, &[0, 1, 2, 3, 37]).is_err());
        }
        Ok(())
    }

    /// The device form ([`ce_rows`], [`ce_grad_rows`], here their CPU twins) against the host
    /// form on the same f32 logits: the NLLs summed within 1e-5 relative, each row's
    /// log-sum-exp within 1e-5, the in-place gradient (g = 0.25 from a tensor) within 1e-6.
    /// Leaving out the label's -g (or the scale) moves the gradient by 0.25; a wrong row's
    /// lse moves the NLL by O(1).
    #[test]
    fn device_cross_entropy_ops_match_the_host_form() -> R<()> {
        let dev = Device::Cpu;
        let x = (Tensor::randn(0f32, 3., (5, 37), &dev)?).to_dtype(DType::F32)?;
        let labels = [0u32, 36, 7, 7, 20];
        let lab = Tensor::new(&labels[..], &dev)?;
        let (want, stats) = ce_nll_sum(&x, &labels)?;
        let rows = ce_rows(&x, &lab)?; // (2, n)
        let got = rows.get(0)?.sum_all()?.to_scalar::<f32>()? as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{got} vs {want}");
        for (i, &(m, s)) in stats.iter().enumerate() {
            let lse = rows.get(1)?.get(i)?.to_scalar::<f32>()? as f64;
            assert!((lse - (m + s.ln())).abs() <= 1e-5, "row {i}: {lse}");
        }
        let want = x.copy()?;
        ce_grad_in_place(&want, &labels, 0.25, None)?;
        let got = x.copy()?;
        let g = Tensor::new(0.25f32, &dev)?;
        ce_grad_rows(&got, &lab, &rows.get(1)?, &g)?;
        let d = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d <= 1e-6, "gradient off by {d}");
        assert!(ce_rows(&x, &Tensor::new(&[0u32, 1, 2, 3, 37], &dev)?).is_err());
        Ok(())
    }
}
