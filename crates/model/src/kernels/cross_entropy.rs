//! Cross-entropy over a chunk of LM-head logits (crate::nn::loss), with no logits-sized temporary.
//!
//! CPU only: CUDA computes the same from tensor ops (`crate::nn::loss`).

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
}
