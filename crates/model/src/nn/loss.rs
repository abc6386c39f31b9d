//! Causal-LM cross-entropy fused with the LM head, chunked over positions.
//!
//! The full-vocabulary logits (positions x V, f32) are usually the largest activation of a
//! fine-tune. [`lm_head_nll`] never holds more than one chunk of them: the forward computes the
//! loss chunk by chunk outside the autograd graph, and the backward ([`nll_bwd`])
//! recomputes each chunk's logits to form dH = (softmax - onehot) W (and dW only when the head is
//! trainable). The graph keeps the selected hidden states and a reference to W, nothing of size V.
//!
//! Shape legend: N = target positions, C = hidden size, V = vocab.

use candle_core::Tensor;

use crate::error::{ModelError, Result};
use crate::kernels::consts::ConstKey;
use crate::nn::ops;

/// Elements of f32 logits per chunk (16 Mi elements = 64 MiB): bounds the transient memory.
pub const CHUNK_ELEMS: usize = 16 << 20;

/// Positions per chunk for a vocabulary of `v`.
fn chunk_rows(v: usize) -> usize {
    (CHUNK_ELEMS / v.max(1)).max(1)
}

/// Which positions of a (B, T) batch predict which token: built from token ids and the
/// per-token target flags of the data pipeline (`targets[t]` = token t is predicted from ids[..t]).
pub struct Targets {
    /// Flat indices b*T + t of the positions whose next token is a target. (N)
    pub positions: Tensor,
    /// The target token ids. (N) u32
    pub labels: Tensor,
    pub count: usize,
}

impl Targets {
    /// ids / targets: B rows of T (padded rows have `false` targets in the padding).
    pub fn new(
        ids: &[Vec<u32>],
        targets: &[Vec<bool>],
        device: &candle_core::Device,
    ) -> Result<Self> {
        let t = ids.first().map_or(0, |r| r.len());
        let mut pos = Vec::new();
        let mut lab = Vec::new();
        for (b, (row, tgt)) in ids.iter().zip(targets).enumerate() {
            if row.len() != t || tgt.len() != t {
                return Err(ModelError::Invalid(
                    "targets: rows must all have length T".into(),
                ));
            }
            // Position i predicts token i + 1.
            for i in 0..t.saturating_sub(1) {
                if tgt[i + 1] {
                    pos.push((b * t + i) as u32);
                    lab.push(row[i + 1]);
                }
            }
        }
        let count = pos.len();
        Ok(Self {
            positions: Tensor::from_vec(pos, count, device)?,
            labels: Tensor::from_vec(lab, count, device)?,
            count,
        })
    }
}

/// Sum of target-token NLL for a batch. hidden: (B, T, C) final hidden states; head: (V, C);
/// `softcap`: the model's `final_logit_softcapping` (Gemma 2: logits = cap * tanh(logits / cap)
/// before the softmax), None for the other families.
/// Returns a scalar (f32, f64 for an f64 model) that backpropagates into `hidden` and, when it
/// is a variable, `head`. Divide by the target count of the whole step for the mean.
pub fn lm_head_nll(
    hidden: &Tensor,
    head: &Tensor,
    targets: &Targets,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let (b, t, c) = hidden.dims3()?;
    if targets.count == 0 {
        return Ok(Tensor::zeros(
            (),
            ops::upcast(hidden.dtype()),
            hidden.device(),
        )?);
    }
    let h = hidden
        .reshape((b * t, c))?
        .index_select(&targets.positions, 0)?; // (N, C)
    let value = nll_sum_no_grad(&h.detach(), &head.detach(), &targets.labels, softcap)?;
    // The backward recomputes the logits chunk by chunk: the graph keeps h, the head and the
    // labels only.
    let labels = targets.labels.clone();
    ops::attach2(
        "fused-lm-head-nll",
        &h,
        head,
        value,
        move |h, head, _v, g| nll_bwd(&labels, h, head, g, softcap),
    )
}

/// One chunk's logits, soft-capped when `softcap` is given (in the compute dtype, as
/// transformers caps them before the loss upcasts), then upcast.
/// h: (n, C), head: (V, C) -> (n, V) in [`ops::upcast`]'s dtype
fn chunk_logits(h: &Tensor, head: &Tensor, softcap: Option<f64>) -> candle_core::Result<Tensor> {
    let logits = h.matmul(&head.t()?)?; // (n, V)
    let logits = match softcap {
        Some(cap) => ((logits / cap)?.tanh()? * cap)?,
        None => logits,
    };
    logits.to_dtype(ops::upcast(h.dtype()))
}

/// The chunked forward. h: (N, C), head: (V, C), labels: (N) -> scalar
fn nll_sum_no_grad(
    h: &Tensor,
    head: &Tensor,
    labels: &Tensor,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let n = h.dim(0)?;
    let step = chunk_rows(head.dim(0)?);
    let up = ops::upcast(h.dtype());
    let mut total = Tensor::zeros((), up, h.device())?;
    // On the CPU (f32 / f64 logits): one pass per row, no logits-sized temporary.
    let host_labels = cpu_labels(labels, h)?;
    let mut host_total = 0f64;
    for start in (0..n).step_by(step) {
        let len = step.min(n - start);
        let logits = chunk_logits(&h.narrow(0, start, len)?, head, softcap)?; // (n, V)
        if let Some(y) = &host_labels {
            host_total +=
                crate::kernels::cross_entropy::ce_nll_sum(&logits, &y[start..start + len])?;
            continue;
        }
        let logp = ops::log_softmax_last_dim(&logits)?;
        let picked = logp.gather(&labels.narrow(0, start, len)?.unsqueeze(1)?, 1)?; // (n, 1)
        total = (total - picked.sum_all()?)?;
    }
    if host_labels.is_some() {
        total = Tensor::new(host_total, h.device())?.to_dtype(up)?;
    }
    Ok(total)
}

/// The labels on the host when the CPU kernels take this batch's logits (CPU, logits in f32 /
/// f64); None elsewhere (the tensor-op path, which keeps everything on the device).
fn cpu_labels(labels: &Tensor, h: &Tensor) -> candle_core::Result<Option<Vec<u32>>> {
    let up = ops::upcast(h.dtype());
    if h.device().is_cpu() && matches!(up, candle_core::DType::F32 | candle_core::DType::F64) {
        Ok(Some(labels.to_vec1::<u32>()?))
    } else {
        Ok(None)
    }
}

/// The backward of [`lm_head_nll`]: the gradients of `grad` * sum NLL for h (N, C) and, when
/// it is trained, the head (V, C), recomputing the logits chunk by chunk.
/// d(sum NLL)/dlogits = softmax(logits) - onehot(label), per position; with soft-capping,
/// times the cap's derivative 1 - tanh² = 1 - (capped / cap)².
fn nll_bwd(
    labels: &Tensor,
    h: &Tensor,
    head: &Tensor,
    grad: &Tensor,
    softcap: Option<f64>,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let (n, _c) = h.dims2()?;
    let v = head.dim(0)?;
    let want_dw = head.track_op();
    let up = ops::upcast(h.dtype());
    let h = h.detach();
    let w = head.detach();
    let g = grad.to_dtype(up)?; // scalar
    let key = ConstKey::with("arange.u32", [v as u64]);
    // (1, V), uploaded once per device and vocabulary size (crate::kernels::consts)
    let vocab = crate::kernels::consts::cached(h.device(), key, |d| {
        Tensor::arange(0u32, v as u32, d)?.unsqueeze(0)
    })?;
    let step = chunk_rows(v);
    let host_labels = cpu_labels(labels, &h)?;
    // The CPU kernel takes the scale as a number (reading a CPU scalar costs no sync).
    let g_host = match &host_labels {
        Some(_) => g.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?,
        None => 0.0,
    };
    let mut dh = Vec::new();
    let mut dw: Option<Tensor> = None;
    for start in (0..n).step_by(step) {
        let len = step.min(n - start);
        let hc = h.narrow(0, start, len)?; // (n, C)
        let logits = chunk_logits(&hc, &w, softcap)?; // (n, V)
                                                      // The cap's derivative, before the logits' buffer becomes their gradient: (n, V)
        let dcap = match softcap {
            Some(cap) => Some((1.0 - (&logits / cap)?.sqr()?)?),
            None => None,
        };
        let dlogits = match &host_labels {
            // CPU: softmax - onehot, scaled, in the logits' own buffer.
            Some(y) => {
                crate::kernels::cross_entropy::ce_grad_in_place(
                    &logits,
                    &y[start..start + len],
                    g_host,
                )?;
                let d = match &dcap {
                    Some(dc) => (&logits * dc)?.to_dtype(h.dtype())?,
                    None => logits.to_dtype(h.dtype())?, // the same buffer in f32 / f64
                };
                drop(logits);
                d
            }
            None => {
                let p = ops::softmax_last_dim(&logits)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                drop(logits);
                let labels = labels.narrow(0, start, len)?.unsqueeze(1)?; // (n, 1)
                let onehot = labels.broadcast_eq(&vocab)?.to_dtype(up)?; // (n, V)
                let d = (p - onehot)?.broadcast_mul(&g)?; // (n, V)
                match &dcap {
                    Some(dc) => (d * dc)?.to_dtype(h.dtype())?,
                    None => d.to_dtype(h.dtype())?,
                }
            }
        };
        dh.push(dlogits.matmul(&w)?); // (n, C)
        if want_dw {
            let part = dlogits.t()?.matmul(&hc)?; // (V, C)
            dw = Some(match dw {
                Some(acc) => (acc + part)?,
                None => part,
            });
        }
    }
    let dh = Tensor::cat(&dh, 0)?;
    Ok((Some(dh), dw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The fused op against the plain (graph-keeping) formula, values and both gradients.
    #[test]
    fn fused_nll_matches_unfused_value_and_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let hidden = Var::randn(0f64, 1., (2, 5, 4), &dev)?;
        let head = Var::randn(0f64, 1., (7, 4), &dev)?;
        let ids = vec![vec![1u32, 2, 3, 4, 5], vec![6, 0, 1, 0, 0]];
        let tg = vec![
            vec![false, true, true, false, true],
            vec![false, false, true, false, false],
        ];
        let targets = Targets::new(&ids, &tg, &dev)?;
        assert_eq!(targets.count, 4);
        let fused = lm_head_nll(&hidden, &head, &targets, None)?;

        let logits = hidden.broadcast_matmul(&head.t()?)?.reshape((10, 7))?;
        let logp = ops::log_softmax_last_dim(&logits)?.index_select(&targets.positions, 0)?;
        let plain = logp
            .gather(&targets.labels.unsqueeze(1)?, 1)?
            .sum_all()?
            .neg()?;
        let (a, b) = (fused.to_scalar::<f64>()?, plain.to_scalar::<f64>()?);
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");

        let gf = fused.backward()?;
        let gp = plain.backward()?;
        for v in [&hidden, &head] {
            let d = (gf.get(v).unwrap() - gp.get(v).unwrap())?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?;
            assert!(d < 1e-12, "gradient differs by {d}");
        }
        Ok(())
    }

    /// Final-logit soft-capping (Gemma 2): the fused op against the formula written out
    /// (cap * tanh(logits / cap), log-softmax, pick), value and both gradients in f64 within
    /// 1e-12, with logits scaled so that many pass the cap. Breaking the backward (the cap's
    /// derivative left out) differs by 1.9 in the gradient; leaving the cap out of the forward
    /// gives 42.8 vs 19.0 (random inputs: numbers of one run).
    #[test]
    fn softcapped_nll_matches_the_formula() -> Result<()> {
        let dev = Device::Cpu;
        let cap = 2.0;
        let hidden = Var::from_tensor(&(Tensor::randn(0f64, 1., (2, 5, 4), &dev)? * 3.0)?)?;
        let head = Var::randn(0f64, 1., (7, 4), &dev)?;
        let ids = vec![vec![1u32, 2, 3, 4, 5], vec![6, 0, 1, 0, 0]];
        let tg = vec![
            vec![false, true, true, true, true],
            vec![false, true, true, false, true],
        ];
        let targets = Targets::new(&ids, &tg, &dev)?;
        let fused = lm_head_nll(&hidden, &head, &targets, Some(cap))?;
        let raw = hidden.broadcast_matmul(&head.t()?)?.reshape((10, 7))?;
        let frac = raw
            .abs()?
            .ge(cap)?
            .to_dtype(candle_core::DType::F64)?
            .mean_all()?;
        assert!(frac.to_scalar::<f64>()? > 0.2, "{frac}");
        let logits = ((raw / cap)?.tanh()? * cap)?;
        let logp = ops::log_softmax_last_dim(&logits)?.index_select(&targets.positions, 0)?;
        let plain = logp
            .gather(&targets.labels.unsqueeze(1)?, 1)?
            .sum_all()?
            .neg()?;
        let (a, b) = (fused.to_scalar::<f64>()?, plain.to_scalar::<f64>()?);
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        let uncapped = lm_head_nll(&hidden, &head, &targets, None)?.to_scalar::<f64>()?;
        assert!(
            (uncapped - a).abs() > 0.1,
            "the cap must matter: {uncapped} vs {a}"
        );
        let gf = fused.backward()?;
        let gp = plain.backward()?;
        for v in [&hidden, &head] {
            let d = (gf.get(v).unwrap() - gp.get(v).unwrap())?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?;
            assert!(d < 1e-12, "gradient differs by {d}");
        }
        Ok(())
    }

    #[test]
    fn frozen_head_gets_no_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let hidden = Var::randn(0f32, 1., (1, 3, 4), &dev)?;
        let head = Tensor::randn(0f32, 1., (5, 4), &dev)?;
        let targets = Targets::new(&[vec![1, 2, 3]], &[vec![false, true, true]], &dev)?;
        let g = lm_head_nll(&hidden, &head, &targets, None)?.backward()?;
        assert!(g.get(&head).is_none());
        assert!(g.get(&hidden).is_some());
        Ok(())
    }
}
