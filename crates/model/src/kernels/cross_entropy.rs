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
    let m = row
        .iter()
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
    /// The row := g softmax(row), in place.
    fn softmax_scaled<T: Real>(row: &mut [T], g: f64) => softmax_scaled_body
);

#[inline(always)]
fn softmax_scaled_body<T: Real>(row: &mut [T], g: f64) {
    let (m, s) = max_sum_exp_body(row);
    let scale = T::from_f64(g / s);
    row.iter_mut()
        .for_each(|e| *e = (*e - m).exp_nonpositive() * scale);
}

/// Sum over rows of -log softmax(row)[label]: logits (n, V) f32 / f64 contiguous on the CPU,
/// `labels` n ids < V. One read of the logits, nothing allocated but the result.
pub fn ce_nll_sum(logits: &Tensor, labels: &[u32]) -> R<f64> {
    let (n, v) = logits.dims2()?;
    if labels.len() != n || labels.iter().any(|&y| y as usize >= v) {
        candle_core::bail!("cross-entropy: {n} rows need {n} labels below {v}");
    }
    let (st, l) = logits.storage_and_layout();
    fn run<T: Real>(x: &[T], labels: &[u32], v: usize) -> f64 {
        x.par_chunks(v)
            .zip(labels.par_iter())
            .map(|(row, &y)| {
                let (m, s) = max_sum_exp(row);
                m.to_f64() + s.ln() - row[y as usize].to_f64()
            })
            .sum()
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
/// normalized copies, the one-hot, the difference and its scaled copy).
pub fn ce_grad_in_place(logits: &Tensor, labels: &[u32], g: f64) -> R<()> {
    let (n, v) = logits.dims2()?;
    if labels.len() != n || labels.iter().any(|&y| y as usize >= v) {
        candle_core::bail!("cross-entropy: {n} rows need {n} labels below {v}");
    }
    logits.inplace_op1(&CeGrad {
        labels: labels.to_vec(),
        g,
        v,
    })
}

struct CeGrad {
    labels: Vec<u32>,
    g: f64,
    v: usize,
}

impl CeGrad {
    fn run<T: Real>(&self, x: &mut [T]) {
        x.par_chunks_mut(self.v)
            .zip(self.labels.par_iter())
            .for_each(|(row, &y)| {
                softmax_scaled(row, self.g);
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
            let got = ce_nll_sum(&x, &labels)?;
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
            ce_grad_in_place(&y, &labels, g)?;
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
