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
use crate::kernels::amx;
use crate::kernels::consts::ConstKey;
use crate::kernels::dispatch::Backend;
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
    let (value, stats) = nll_sum_no_grad(&h.detach(), &head.detach(), &targets.labels, softcap)?;
    // The backward recomputes the logits chunk by chunk: the graph keeps h, the head, the
    // labels and each row's statistics only.
    let labels = targets.labels.clone();
    ops::attach2(
        "fused-lm-head-nll",
        &h,
        head,
        value,
        move |h, head, _v, g| nll_bwd(&labels, h, head, g, softcap, stats.as_ref()),
    )
}

/// What the forward found of each row for the backward: on the CPU kernels' host path its max
/// and sum of exp; on the device ops' path (CUDA) its log-sum-exp, one (rows) f32 tensor per
/// chunk, on the device.
enum RowStats {
    Host(crate::kernels::cross_entropy::RowStats),
    Device(Vec<Tensor>),
}

/// Whether the cross-entropy of h's logits runs as the device ops of `kernels::cross_entropy`
/// (`kernels::dispatch::device_cross_entropy`).
fn device_ce(h: &Tensor) -> bool {
    crate::kernels::dispatch::device_cross_entropy(Backend::of(h.device()), ops::upcast(h.dtype()))
}

/// One chunk's logits, soft-capped when `softcap` is given (in the compute dtype, as
/// transformers caps them before the loss upcasts), then upcast. A bf16 chunk on a CPU with
/// AMX-BF16 runs on its tiles ([`amx_logits`]), rounded to bf16 as the bf16 matmul rounds.
/// h: (n, C), head: (V, C) -> (n, V) in [`ops::upcast`]'s dtype
fn chunk_logits(h: &Tensor, head: &Tensor, softcap: Option<f64>) -> candle_core::Result<Tensor> {
    let logits = match amx_logits(h, head)? {
        Some(l) => {
            let l = Tensor::from_vec(l, (h.dim(0)?, head.dim(0)?), h.device())?; // (n, V) f32
            match softcap {
                None => return Ok(l), // already bf16's values in f32: the upcast
                Some(_) => l.to_dtype(h.dtype())?,
            }
        }
        None => h.matmul(&head.t()?)?, // (n, V)
    };
    let logits = match softcap {
        Some(cap) => ((logits / cap)?.tanh()? * cap)?,
        None => logits,
    };
    logits.to_dtype(ops::upcast(h.dtype()))
}

/// The bf16 operands of an AMX product on the CPU: both bf16, contiguous, on the CPU.
fn amx_operands(h: &Tensor, head: &Tensor) -> bool {
    use candle_core::DType::BF16;
    Backend::of(h.device()) == Backend::Cpu
        && h.dtype() == BF16
        && head.dtype() == BF16
        && h.is_contiguous()
        && head.is_contiguous()
}

/// h Wᵀ of a chunk on AMX tiles (`amx::gemm_bf16_wt`: the head read as it is stored, only the
/// chunk's rows packed), each logit rounded to bf16 (kept in f32): for a bf16 chunk of at
/// least `amx::MIN_ROWS` rows on a CPU with AMX-BF16 and C a multiple of 32. None elsewhere
/// (Candle's bf16 matmul, both operands widened to f32; the same f32 products summed in
/// another order).
fn amx_logits(h: &Tensor, head: &Tensor) -> candle_core::Result<Option<Vec<f32>>> {
    if !amx_operands(h, head) || h.dim(0)? < amx::MIN_ROWS {
        return Ok(None);
    }
    let ((n, c), v) = (h.dims2()?, head.dim(0)?);
    let (hs, hl) = h.storage_and_layout();
    let x = crate::kernels::fused::storage_data::<half::bf16>(&hs, hl, "lm head rows")?;
    let (ws, wl) = head.storage_and_layout();
    let w = crate::kernels::fused::storage_data::<half::bf16>(&ws, wl, "lm head")?;
    let mut out = crate::kernels::fused::uninit::<f32>(n * v);
    Ok(amx::gemm_bf16_wt(&mut out, x, w, (n, v, c), true).then_some(out))
}

/// The head W (V, C) packed for AMX as the right operand of dlogits W (`amx::Packed`); None
/// where [`amx_operands`] do not hold or AMX does not take
/// the shape (V or C not a multiple of 32).
fn amx_head(h: &Tensor, head: &Tensor) -> candle_core::Result<Option<amx::Packed>> {
    if !amx_operands(h, head) {
        return Ok(None);
    }
    let (v, c) = head.dims2()?;
    let (st, l) = head.storage_and_layout();
    let w = crate::kernels::fused::storage_data::<half::bf16>(&st, l, "lm head")?;
    Ok(amx::Packed::new(w, false, (c, v))) // B = W (V, C)
}

/// `lhs (n, K) · B` in f32 on AMX tiles when `packed` is given and takes `lhs` (bf16,
/// contiguous, at least `amx::MIN_ROWS` rows); None otherwise.
fn amx_product(
    lhs: &Tensor,
    packed: Option<&amx::Packed>,
) -> candle_core::Result<Option<Vec<f32>>> {
    let Some(p) = packed else { return Ok(None) };
    let cols = p.cols();
    if !lhs.is_contiguous() || lhs.dtype() != candle_core::DType::BF16 {
        return Ok(None);
    }
    let n = lhs.dim(0)?;
    let (st, l) = lhs.storage_and_layout();
    let a = crate::kernels::fused::storage_data::<half::bf16>(&st, l, "lm head rows")?;
    let mut out = crate::kernels::fused::uninit::<f32>(n * cols);
    Ok(p.gemm(&mut out, a, n).then_some(out))
}

/// The chunked forward. h: (N, C), head: (V, C), labels: (N) -> scalar, and each row's
/// statistics for the backward ([`RowStats`]; none on the tensor-op path).
fn nll_sum_no_grad(
    h: &Tensor,
    head: &Tensor,
    labels: &Tensor,
    softcap: Option<f64>,
) -> Result<(Tensor, Option<RowStats>)> {
    let n = h.dim(0)?;
    let step = chunk_rows(head.dim(0)?);
    let up = ops::upcast(h.dtype());
    let mut total = Tensor::zeros((), up, h.device())?;
    // On the CPU (f32 / f64 logits): one pass per row, no logits-sized temporary.
    let host_labels = cpu_labels(labels, h)?;
    let mut host_total = 0f64;
    let mut stats = Vec::new();
    let device = device_ce(h);
    let mut lse = Vec::new();
    for start in (0..n).step_by(step) {
        let len = step.min(n - start);
        let hc = h.narrow(0, start, len)?;
        let logits = chunk_logits(&hc, head, softcap)?; // (n, V)
        if device {
            // one kernel: each row's NLL and log-sum-exp, (2, n)
            let rows =
                crate::kernels::cross_entropy::ce_rows(&logits, &labels.narrow(0, start, len)?)?;
            total = (total + rows.get(0)?.sum_all()?)?;
            lse.push(rows.get(1)?);
            continue;
        }
        if let Some(y) = &host_labels {
            let (nll, rows) =
                crate::kernels::cross_entropy::ce_nll_sum(&logits, &y[start..start + len])?;
            host_total += nll;
            stats.extend(rows);
            continue;
        }
        let logp = ops::log_softmax_last_dim(&logits)?;
        let picked = logp.gather(&labels.narrow(0, start, len)?.unsqueeze(1)?, 1)?; // (n, 1)
        total = (total - picked.sum_all()?)?;
    }
    if host_labels.is_some() {
        total = Tensor::new(host_total, h.device())?.to_dtype(up)?;
        return Ok((total, Some(RowStats::Host(stats))));
    }
    if device {
        return Ok((total, Some(RowStats::Device(lse))));
    }
    Ok((total, None))
}

/// The labels on the host when the CPU kernels take this batch's logits (CPU, logits in f32 /
/// f64); None elsewhere (the tensor-op path, which keeps everything on the device).
fn cpu_labels(labels: &Tensor, h: &Tensor) -> candle_core::Result<Option<Vec<u32>>> {
    let up = ops::upcast(h.dtype());
    if Backend::of(h.device()) == Backend::Cpu
        && matches!(up, candle_core::DType::F32 | candle_core::DType::F64)
    {
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
    stats: Option<&RowStats>,
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
    let (host_stats, device_lse) = match stats {
        Some(RowStats::Host(s)) => (Some(&s[..]), None),
        Some(RowStats::Device(l)) => (None, Some(l)),
        None => (None, None),
    };
    let device = device_ce(&h);
    let mut dh = Vec::new();
    let mut dw: Option<Tensor> = None;
    for (chunk, start) in (0..n).step_by(step).enumerate() {
        let len = step.min(n - start);
        let hc = h.narrow(0, start, len)?; // (n, C)
        let logits = chunk_logits(&hc, &w, softcap)?; // (n, V)
                                                      // The cap's derivative, before the logits' buffer becomes their gradient: (n, V)
        let dcap = match softcap {
            Some(cap) => Some((1.0 - (&logits / cap)?.sqr()?)?),
            None => None,
        };
        let dlogits = if host_labels.is_some() || device {
            // softmax - onehot, scaled, in the logits' own buffer: on the CPU by its host-side
            // kernel, on CUDA by one kernel with nothing read to the host
            match &host_labels {
                Some(y) => crate::kernels::cross_entropy::ce_grad_in_place(
                    &logits,
                    &y[start..start + len],
                    g_host,
                    host_stats.map(|s| &s[start..start + len]),
                )?,
                None => {
                    let y = labels.narrow(0, start, len)?;
                    let lse = match device_lse.and_then(|l| l.get(chunk)) {
                        Some(l) => l.clone(),
                        None => crate::kernels::cross_entropy::ce_rows(&logits, &y)?.get(1)?,
                    };
                    crate::kernels::cross_entropy::ce_grad_rows(&logits, &y, &lse, &g)?;
                }
            }
            let d = match &dcap {
                Some(dc) => (&logits * dc)?,
                None => logits.clone(),
            };
            // In the model's dtype (for f32 / f64 the same buffer): the CPU's cast on rayon's
            // threads, CUDA's `to_dtype` (one launch, which the CUDA path run on the CPU counts).
            let d = match &host_labels {
                Some(_) => crate::kernels::fused::cast(&d, h.dtype())?,
                None => d.to_dtype(h.dtype())?,
            };
            drop(logits);
            d
        } else {
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
        };
        let c = w.dim(1)?;
        dh.push(
            // On AMX the head is packed (2 bytes per element) for this product alone, after the
            // logits' f32 buffer is gone: the packed copy and dlogits are what is alive.
            match amx_product(&dlogits, amx_head(&h, &w)?.as_ref())? {
                Some(d) => {
                    Tensor::from_vec(crate::kernels::fused::narrow_bf16(&d), (len, c), h.device())?
                }
                None => dlogits.matmul(&w)?,
            },
        ); // (n, C)
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

    /// How many elements of `a` and `b` differ, and the largest difference in units of
    /// `allowed` (per element, same shape). All as f32.
    fn differences(a: &Tensor, b: &Tensor, allowed: &Tensor) -> Result<(usize, f32, usize)> {
        let f = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?)
        };
        let (a, b, allowed) = (f(a)?, f(b)?, f(allowed)?);
        let (mut differ, mut worst) = (0, 0f32);
        for ((x, y), t) in a.iter().zip(&b).zip(&allowed) {
            if x != y {
                differ += 1;
                worst = worst.max((x - y).abs() / t);
            }
        }
        Ok((differ, worst, a.len()))
    }

    /// A bf16 LM head on AMX tiles (a CPU with AMX-BF16) against Candle's bf16 matmul (the
    /// widened f32 twin, `amx::without_amx`): the same f32 products summed in another order,
    /// then rounded to bf16 alike. A logit may differ by one bf16 step (at most 2^-7 of its
    /// size) plus both sums' f32 error (2 C ε Σ|h||w|), and few do: measured on these fixed
    /// inputs 619 of 16.8M logits, up to 0.97 of the allowance (a one-step difference just above
    /// a power of two). dh within one bf16 step plus 1e-3 of its largest element (measured:
    /// 0.39 of it; unseeded inputs once went past it, as dh's sum over V = 2^17 terms can
    /// cancel), the loss to 1e-4 relative (measured 9e-8). Two full chunks of 128 rows (V = 2^17) and a
    /// tail of 12 rows, below AMX's 16, which runs the twin. Broken on purpose: the forward's
    /// rounding to bf16 left out (16.78M logits differ, the count fails), the backward's W
    /// packed transposed (dh 819 allowances off).
    #[test]
    fn bf16_head_on_amx_matches_the_widened_twin() -> Result<()> {
        use candle_core::DType::{BF16, F32};
        if !amx::available() {
            eprintln!("no AMX on this CPU: the AMX LM head is not exercised");
            return Ok(());
        }
        let dev = Device::Cpu;
        let (v, c, rows) = (1usize << 17, 64usize, 268usize);
        // fixed inputs: the allowances below were measured on them
        let seeded = crate::nn::linear::tests::seeded;
        let h = seeded(&[rows, c], 1., 11)?.to_dtype(BF16)?;
        let head = seeded(&[v, c], 0.5, 12)?.to_dtype(BF16)?;
        let labels: Vec<u32> = (0..rows as u32).map(|i| (i * 7919) % v as u32).collect();
        let step = 2f64.powi(-7);

        // one chunk's logits
        let hc = h.narrow(0, 0, 128)?;
        assert!(amx_logits(&hc, &head)?.is_some(), "AMX takes the head");
        let on = chunk_logits(&hc, &head, None)?;
        let twin = amx::without_amx(|| chunk_logits(&hc, &head, None))?;
        assert_eq!(on.dtype(), F32);
        let abs_sum = hc
            .to_dtype(F32)?
            .abs()?
            .matmul(&head.to_dtype(F32)?.abs()?.t()?)?; // Σ|h||w|, (128, V)
        let allowed =
            ((twin.abs()? * step)? + (abs_sum * (2.0 * c as f64 * f32::EPSILON as f64))?)?;
        let (differ, worst, all) = differences(&on, &twin, &allowed)?;
        eprintln!("logits: {differ} of {all} differ, at most {worst} of the allowance");
        assert!(worst <= 1.0, "a logit {worst} allowances off");
        assert!(differ * 1000 <= all, "{differ} of {all} logits differ");

        // the loss and dh over both chunks and the tail
        let labels = Tensor::new(labels.as_slice(), &dev)?;
        let run = || -> Result<(f32, Tensor)> {
            let (loss, stats) = nll_sum_no_grad(&h, &head, &labels, None)?;
            let loss = loss.to_scalar::<f32>()?;
            let g = Tensor::new(1f32, &dev)?;
            let (dh, _) = nll_bwd(&labels, &h, &head, &g, None, stats.as_ref())?;
            Ok((loss, dh.expect("dh")))
        };
        let (loss_on, dh_on) = run()?;
        let (loss_twin, dh_twin) = amx::without_amx(run)?;
        let rel = ((loss_on - loss_twin) / loss_twin).abs();
        eprintln!("loss {loss_on} vs {loss_twin} (rel {rel:.2e})");
        assert!(rel < 1e-4, "loss {loss_on} vs {loss_twin}");
        assert_eq!(dh_on.dtype(), BF16);
        let largest = dh_twin
            .to_dtype(F32)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()? as f64;
        let allowed = ((dh_twin.to_dtype(F32)?.abs()? * step)? + 1e-3 * largest)?;
        let (differ, worst, all) = differences(&dh_on, &dh_twin, &allowed)?;
        eprintln!("dh: {differ} of {all} differ, at most {worst} of the allowance");
        assert!(worst <= 1.0, "dh {worst} allowances off");
        Ok(())
    }
}
