//! Memory-efficient ("chunked") causal attention: softmax(q kᵀ + mask) v computed one block of
//! queries at a time, keeping for the backward only the output and each query row's
//! log-sum-exp, never anything T x T. The backward recomputes each block's probabilities from
//! q, k and the log-sum-exp (FlashAttention's recurrence, arXiv:2205.14135, with whole key rows
//! per query block: a block's scores are O(T), so no online rescaling is needed).
//!
//! The mask is never a (T, T) tensor either: it is each token's segment id (rows packed
//! together), causality and an optional sliding window ([`AttentionMask`]); a block reads only
//! the keys from its first allowed key to its last query.
//!
//! Two implementations of the same maths, chosen by device and dtype:
//! - f32 / f64 on the CPU, and bf16 without soft-capping: one fused kernel, rayon over (batch,
//!   kv head) groups, blocks of [`CPU_BLOCK`] query rows ([`crate::kernels::fused::small_gemm`] for the
//!   products). bf16 inputs are widened to f32 and the kernel rounds to bf16 where the tensor-op
//!   path does (the scores, the probabilities, dP and dS, the outputs), except that dK and dV
//!   are summed over all blocks in f32 and rounded once, as one eager matmul would;
//! - anywhere else (CUDA, f16, soft-capped bf16): Candle tensor ops over blocks of queries, as
//!   many rows per block as keep a block's f32 scores under [`BLOCK_SCORE_BYTES`]
//!   ([`block_rows`]).
//!
//! Both are wrapped in one custom op ([`chunked_attention`]) whose backward is the matching
//! block loop, so the autograd graph holds q, k, v, the output and the log-sum-exp only.
//!
//! bf16 and f16 on CUDA take kernels of tallow's own instead (`super::flash_attn`, whose
//! `chunked_attention_capped` and `attention_tokens` route between them and this module); the
//! tensor-op path here is their twin.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::kernels::fused::{
    add_at_b, data, group_grads, narrow_bf16, small_gemm, storage_data, uninit, widen_bf16, Real,
};
use crate::kernels::matmul::InStorage;

type R<T> = candle_core::Result<T>;

/// Query rows per block of the CPU kernel (its scores: 64 x keys, per thread).
pub const CPU_BLOCK: usize = 64;

/// The most a block's f32 scores (B x H x rows x keys) take on the tensor-op path: 64 MiB, a
/// small fraction of any GPU's memory, while blocks stay large enough to keep the matmuls busy.
pub const BLOCK_SCORE_BYTES: usize = 64 << 20;

/// Which keys each query may attend to, without a (T, T) tensor: key j is visible to query i
/// iff j <= i, both are in the same segment, and (with a sliding window w) i - j < w.
#[derive(Clone, Debug)]
pub struct AttentionMask {
    /// (B, T) u32 segment ids, on the device of the attention's tensors.
    pub segments: Tensor,
    pub window: Option<usize>,
    /// For each row and position, the first key it may attend to.
    first: Arc<Vec<Vec<usize>>>,
    /// The same (B, T) u32 on the device, for the CUDA kernels (`super::flash_attn`).
    first_keys: Tensor,
}

impl AttentionMask {
    /// `segments`: B rows of T ids (all zeros for an ordinary batch), each id one run of
    /// consecutive tokens, as packing lays documents out; an id that comes back after another
    /// is refused (`AttentionImpl::Eager` takes any ids).
    pub fn new(segments: &[Vec<u32>], window: Option<usize>, device: &Device) -> R<Self> {
        let b = segments.len();
        let t = segments.first().map_or(0, |s| s.len());
        let flat: Vec<u32> = segments.iter().flatten().copied().collect();
        let first = segments
            .iter()
            .map(|s| first_keys(s, window))
            .collect::<R<Vec<_>>>()?;
        let keys: Vec<u32> = first.iter().flatten().map(|&j| j as u32).collect();
        Ok(Self {
            segments: Tensor::from_vec(flat, (b, t), device)?,
            window,
            first: Arc::new(first),
            first_keys: Tensor::from_vec(keys, (b, t), device)?,
        })
    }

    /// Each position's first visible key, (B, T) u32 on the attention's device: key j is
    /// visible to the query at position p iff first <= j <= p.
    pub fn first_keys(&self) -> &Tensor {
        &self.first_keys
    }

    /// The keys a block of query positions [p0, p1) reads: from the first key any row of any
    /// batch entry may attend to, to the block's last position.
    fn key_range(&self, p0: usize, p1: usize) -> (usize, usize) {
        let lo = (0..self.first.len())
            .map(|b| self.row_key_range(b, p0, p1).0)
            .min()
            .unwrap_or(p0);
        (lo, p1)
    }

    /// The same for one batch row.
    fn row_key_range(&self, b: usize, p0: usize, p1: usize) -> (usize, usize) {
        let lo = self.first[b][p0..p1].iter().copied().min().unwrap_or(p0);
        (lo, p1)
    }

    /// Additive mask of a block (0 or -inf, f32): queries [p0, p1) x keys [lo, hi), per batch
    /// row, from the device segment ids. -> (B, 1, 1, p1 - p0, hi - lo)
    fn block(&self, p0: usize, p1: usize, lo: usize, hi: usize) -> R<Tensor> {
        let dev = self.segments.device();
        let b = self.first.len();
        let sq = self.segments.narrow(1, p0, p1 - p0)?; // (B, m)
        let sk = self.segments.narrow(1, lo, hi - lo)?; // (B, nk)
        let same = sq.unsqueeze(2)?.broadcast_eq(&sk.unsqueeze(1)?)?; // (B, m, nk)
        let i = Tensor::arange(p0 as u32, p1 as u32, dev)?.unsqueeze(1)?; // (m, 1)
        let j = Tensor::arange(lo as u32, hi as u32, dev)?.unsqueeze(0)?; // (1, nk)
        let mut ok = i.broadcast_ge(&j)?; // (m, nk): j <= i
        if let Some(w) = self.window {
            ok = (ok * i.broadcast_lt(&(j + w as f64)?)?)?; // i - j < w
        }
        let ok = same.broadcast_mul(&ok.unsqueeze(0)?)?; // (B, m, nk)
        let (m, nk) = (p1 - p0, hi - lo);
        let zeros = Tensor::zeros((b, m, nk), DType::F32, dev)?;
        let neg = Tensor::full(f32::NEG_INFINITY, (b, m, nk), dev)?;
        ok.where_cond(&zeros, &neg)?.reshape((b, 1, 1, m, nk))
    }
}

/// For each position of a row, the first key it may attend to: the start of its segment's
/// run, and no earlier than the window allows. Position i then sees exactly keys first..=i.
fn first_keys(seg: &[u32], window: Option<usize>) -> R<Vec<usize>> {
    let mut seen: HashSet<u32> = HashSet::new();
    let mut start = 0;
    let mut out = Vec::with_capacity(seg.len());
    for (i, s) in seg.iter().enumerate() {
        if i > 0 && *s != seg[i - 1] {
            if seen.contains(s) {
                candle_core::bail!(
                    "chunked attention: segment id {s} comes back at position {i}; each packed \
                     document must be one run of tokens (model.attention = \"eager\" takes any ids)"
                );
            }
            start = i;
        }
        seen.insert(*s);
        out.push(match window {
            Some(w) => start.max((i + 1).saturating_sub(w)),
            None => start,
        });
    }
    Ok(out)
}

/// softmax(q kᵀ + mask) v, causal with `mask`'s segments and window, nothing T x T kept.
/// q: (B, KV, n_rep * T, D) carrying the 1/sqrt(D) scale, the n_rep query heads of each kv head
/// adjacent; k, v: (B, KV, T, D) -> (B, KV, n_rep * T, D).
pub fn chunked_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttentionMask) -> R<Tensor> {
    attention(q, k, v, mask, None, None)
}

/// [`chunked_attention`] with the scores soft-capped before the mask and softmax (Gemma 2's
/// `attn_logit_softcapping`): softmax(cap * tanh(q kᵀ / cap) + mask) v. None: no capping.
/// The backward multiplies dS by the cap's derivative 1 - tanh².
pub fn chunked_attention_capped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    softcap: Option<f64>,
) -> R<Tensor> {
    attention(q, k, v, mask, None, softcap)
}

/// [`chunked_attention`] through the tensor-op path with `rows` positions per block, whatever
/// the device and dtype: what `tallow doctor` compares with the CPU kernel.
pub fn chunked_attention_tensor_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    rows: usize,
    softcap: Option<f64>,
) -> R<Tensor> {
    attention(q, k, v, mask, Some(rows.max(1)), softcap)
}

/// [`chunked_attention`]; `rows` forces the tensor-op path with blocks of that many positions
/// (tests run it on the CPU).
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    rows: Option<usize>,
    softcap: Option<f64>,
) -> R<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (b, kv, r, d) = q.dims4()?;
    let (kb, kkv, t, kd) = k.dims4()?;
    if (kb, kkv, kd) != (b, kv, d) || v.shape() != k.shape() || t == 0 || r % t != 0 {
        candle_core::bail!(
            "chunked attention: q {:?}, k {:?}, v {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    if mask.first.len() != b || mask.first.iter().any(|s| s.len() != t) {
        candle_core::bail!("chunked attention: the mask is not {b} rows of {t} ids");
    }
    let kernel_dtype = crate::kernels::dispatch::chunked_kernel(
        crate::kernels::dispatch::Backend::of(q.device()),
        q.dtype(),
        softcap.is_some(),
    );
    let fused = kernel_dtype && k.dtype() == q.dtype() && v.dtype() == q.dtype();
    let tracked = q.track_op() || k.track_op() || v.track_op();
    if !fused || rows.is_some() {
        let n_rep = r / t;
        let rows = rows.unwrap_or_else(|| block_rows(b, kv * n_rep, t));
        let (y, lse) = generic_fwd(&q.detach(), &k.detach(), &v.detach(), mask, rows, softcap)?;
        if !tracked {
            return Ok(y);
        }
        let op = ChunkedAttention {
            mask: mask.clone(),
            lse: Mutex::new(Some(lse)),
            y: Mutex::new(Some(y)),
            generic: true,
            rows,
            softcap,
        };
        return q.apply_op3(&k, &v, op);
    }
    let op = ChunkedAttention {
        mask: mask.clone(),
        lse: Mutex::new(None),
        y: Mutex::new(None),
        generic: false,
        rows: CPU_BLOCK,
        softcap,
    };
    q.apply_op3(&k, &v, op)
}

struct ChunkedAttention {
    mask: AttentionMask,
    /// (B, KV, n_rep * T) f32 (tensor-op path) or q's dtype (CPU kernel) log-sum-exp per row,
    /// taken by the backward.
    lse: Mutex<Option<Tensor>>,
    /// The output, computed by the tensor-op path before the op is applied and taken by the
    /// forward (so the op does not keep a second copy); `None` with the CPU kernel.
    y: Mutex<Option<Tensor>>,
    /// The tensor-op path (else the CPU kernel).
    generic: bool,
    /// Positions per block of the tensor-op path.
    rows: usize,
    /// Scores soft-capped to (-cap, cap) before the mask (Gemma 2).
    softcap: Option<f64>,
}

/// The forward of an op whose output was computed before it was applied (the tensor-op path,
/// and its use as `flash_attn`'s twin): a copy of that output's storage, taken from `slot`
/// (the op then drops the output, so the graph keeps one copy); `op` names it in errors.
pub(super) fn take_output<S: InStorage>(slot: &Mutex<Option<Tensor>>, op: &str) -> R<(S, Shape)> {
    let Some(y) = slot.lock().expect("output lock").take() else {
        candle_core::bail!("{op}: the output was not computed before the op")
    };
    let (s, l) = y.storage_and_layout();
    match S::of(&s) {
        Some(c) => Ok((c.try_clone(l)?, y.shape().clone())),
        None => candle_core::bail!("{op}: the output is not on {}", S::DEVICE),
    }
}

impl CustomOp3 for ChunkedAttention {
    fn name(&self) -> &'static str {
        "chunked-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        if self.generic {
            return take_output(&self.y, "chunked attention");
        }
        let (b, kv, r, d) = ql.shape().dims4()?;
        let t = kl.shape().dims4()?.2;
        let dims = (b, kv, r, t, d);
        let op = "chunked attention";
        macro_rules! go {
            ($ty:ty, $var:ident) => {{
                let (q, k, v) = (data(q, ql, op)?, data(k, kl, op)?, data(v, vl, op)?);
                let (y, lse) = cpu_fwd::<$ty>(q, k, v, &self.mask, dims, self.softcap, false);
                (
                    CpuStorage::$var(y),
                    Tensor::from_vec(lse, (b, kv, r), &Device::Cpu)?,
                )
            }};
        }
        let (y, lse) = match q.dtype() {
            DType::F32 => go!(f32, F32),
            DType::F64 => go!(f64, F64),
            DType::BF16 => {
                let wide = |s, l| Ok::<_, candle_core::Error>(widen_bf16(data(s, l, op)?));
                let (q, k, v) = (wide(q, ql)?, wide(k, kl)?, wide(v, vl)?);
                let (y, lse) = cpu_fwd::<f32>(&q, &k, &v, &self.mask, dims, self.softcap, true);
                let lse = Tensor::from_vec(lse, (b, kv, r), &Device::Cpu)?;
                (CpuStorage::BF16(narrow_bf16(&y)), lse)
            }
            d => candle_core::bail!("chunked attention: dtype {d:?} (f32 / f64 / bf16 only)"),
        };
        *self.lse.lock().expect("lse lock") = Some(lse);
        Ok((y, ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _q: &candle_core::CudaStorage,
        _ql: &Layout,
        _k: &candle_core::CudaStorage,
        _kl: &Layout,
        _v: &candle_core::CudaStorage,
        _vl: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        take_output(&self.y, "chunked attention")
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> R<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().expect("lse lock").take().ok_or_else(|| {
            candle_core::Error::Msg("chunked attention: backward run twice".into())
        })?;
        let dy = dy.contiguous()?;
        let saved = Saved {
            q,
            k,
            v,
            y,
            dy: &dy,
            lse: &lse,
        };
        let (dq, dk, dv) = if self.generic {
            generic_bwd(saved, &self.mask, self.rows, self.softcap)?
        } else {
            cpu_bwd(saved, &self.mask, self.softcap)?
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

// ---------------------------------------------------------------------------------------------
// The CPU kernel (f32 / f64).

/// One block of the CPU kernel: query positions p0..p0 + m of one repeat (rows i0..i0 + m of the
/// group), against keys lo..lo + nk.
struct CpuBlock {
    p0: usize,
    m: usize,
    i0: usize,
    lo: usize,
    nk: usize,
}

/// The blocks of a group of `r` query rows (n_rep repeats of T positions) in batch row `bi`.
fn cpu_blocks(
    mask: &AttentionMask,
    bi: usize,
    r: usize,
    t: usize,
) -> impl Iterator<Item = CpuBlock> + '_ {
    (0..r).step_by(t).flat_map(move |rep| {
        (0..t).step_by(CPU_BLOCK).map(move |p0| {
            let p1 = (p0 + CPU_BLOCK).min(t);
            let (lo, hi) = mask.row_key_range(bi, p0, p1);
            CpuBlock {
                p0,
                m: p1 - p0,
                i0: rep + p0,
                lo,
                nk: hi - lo,
            }
        })
    })
}

/// Scores of a block of rows against keys [lo, lo + nk), soft-capped (cap * tanh(s / cap))
/// when `cap` is given, masked (-inf) where not allowed: s (m, nk) = q_blk kᵀ.
#[allow(clippy::too_many_arguments)]
fn block_scores<T: Real>(
    s: &mut [T],
    q: &[T],
    k: &[T],
    mask: &AttentionMask,
    bi: usize,
    (p0, m): (usize, usize),
    (lo, nk): (usize, usize),
    d: usize,
    cap: Option<T>,
    round: bool,
) {
    small_gemm(s, nk, false, q, d, &k[lo * d..], d, true, (m, nk, d));
    if round {
        round_all(s); // q kᵀ as a bf16 matmul gives it
    }
    if let Some(c) = cap {
        let inv = c.recip();
        for x in s.iter_mut() {
            *x = c * (*x * inv).tanh();
        }
    }
    let first = &mask.first[bi];
    for (ri, row) in s.chunks_mut(nk).enumerate() {
        let p = p0 + ri;
        // keys first[p]..=p are visible: -inf before and after
        let (a, b) = (first[p] - lo, p + 1 - lo);
        row[..a].fill(T::NEG_INF);
        row[b..].fill(T::NEG_INF);
    }
}

/// Every value of a buffer rounded to bf16 precision (the kernel's bf16 mode).
fn round_all<T: Real>(x: &mut [T]) {
    x.iter_mut().for_each(|v| *v = v.round_bf16());
}

/// Forward of one (b, kv) group: q (R, D), k, v (T, D) -> y (R, D), lse (R).
#[allow(clippy::too_many_arguments, clippy::assign_op_pattern)] // `Real` has no `+=`
fn group_fwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &AttentionMask,
    bi: usize,
    y: &mut [T],
    lse: &mut [T],
    (t, d): (usize, usize),
    cap: Option<T>,
    round: bool,
) {
    let mut s = uninit::<T>(CPU_BLOCK * t);
    for CpuBlock { p0, m, i0, lo, nk } in cpu_blocks(mask, bi, q.len() / d, t) {
        let s = &mut s[..m * nk];
        block_scores(
            s,
            &q[i0 * d..],
            k,
            mask,
            bi,
            (p0, m),
            (lo, nk),
            d,
            cap,
            round,
        );
        for (ri, row) in s.chunks_mut(nk).enumerate() {
            let mx = row
                .iter()
                .copied()
                .fold(T::NEG_INF, |a, x| if x > a { x } else { a });
            // The exps in a loop of their own; the sum keeps its order.
            row.iter_mut()
                .for_each(|x| *x = (*x - mx).exp_nonpositive());
            let sum = row.iter().fold(T::zero(), |a, &x| a + x);
            let inv = sum.recip();
            for x in row.iter_mut() {
                *x = *x * inv;
            }
            lse[i0 + ri] = T::from_f64(mx.to_f64() + sum.to_f64().ln());
        }
        if round {
            round_all(s); // P cast to v's dtype before P v
        }
        small_gemm(
            &mut y[i0 * d..],
            d,
            false,
            s,
            nk,
            &v[lo * d..],
            d,
            false,
            (m, d, nk),
        ); // P v
    }
}

fn cpu_fwd<T: Real>(
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &AttentionMask,
    (b, kv, r, t, d): (usize, usize, usize, usize, usize),
    softcap: Option<f64>,
    round: bool,
) -> (Vec<T>, Vec<T>) {
    let cap = softcap.map(T::from_f64);
    let mut y = uninit::<T>(b * kv * r * d);
    let mut lse = uninit::<T>(b * kv * r);
    y.par_chunks_mut(r * d)
        .zip(lse.par_chunks_mut(r))
        .enumerate()
        .for_each(|(g, (y, lse))| {
            let ts = g * t * d..(g + 1) * t * d;
            let q = &q[g * r * d..(g + 1) * r * d];
            let kv_in = (&k[ts.clone()], &v[ts]);
            group_fwd(
                q,
                kv_in.0,
                kv_in.1,
                mask,
                g / kv,
                y,
                lse,
                (t, d),
                cap,
                round,
            );
        });
    (y, lse)
}

/// q, k, v, y, dy, lse of one group.
type GroupInputs<'a, T> = (&'a [T], &'a [T], &'a [T], &'a [T], &'a [T], &'a [T]);

/// Backward of one group: dq (R, D) written; dk, dv (T, D) accumulated (zeroed by the caller).
#[allow(clippy::too_many_arguments, clippy::assign_op_pattern)] // `Real` has no `*=`
fn group_bwd<T: Real>(
    (q, k, v, y, dy, lse): GroupInputs<T>,
    mask: &AttentionMask,
    bi: usize,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    (t, d): (usize, usize),
    cap: Option<T>,
    round: bool,
) {
    let mut p = uninit::<T>(CPU_BLOCK * t);
    let mut ds = uninit::<T>(CPU_BLOCK * t);
    // With soft-capping: the cap's derivative 1 - tanh² per score (a third block buffer).
    let mut dcap = uninit::<T>(if cap.is_some() { CPU_BLOCK * t } else { 0 });
    for CpuBlock { p0, m, i0, lo, nk } in cpu_blocks(mask, bi, q.len() / d, t) {
        let hi = lo + nk;
        let (p, ds) = (&mut p[..m * nk], &mut ds[..m * nk]);
        let (qb, dyb) = (&q[i0 * d..(i0 + m) * d], &dy[i0 * d..(i0 + m) * d]);
        block_scores(p, qb, k, mask, bi, (p0, m), (lo, nk), d, cap, round);
        if let Some(c) = cap {
            // p holds c * tanh(s / c) (or -inf where masked, whose P is 0 anyway)
            let inv = c.recip();
            for (g, x) in dcap[..m * nk].iter_mut().zip(p.iter()) {
                let th = if *x == T::NEG_INF {
                    T::zero()
                } else {
                    *x * inv
                };
                *g = T::one() - th * th;
            }
        }
        for (ri, row) in p.chunks_mut(nk).enumerate() {
            let l = lse[i0 + ri];
            for x in row.iter_mut() {
                *x = (*x - l).exp_nonpositive(); // exp(-inf) = 0 where masked
            }
        }
        small_gemm(ds, nk, false, dyb, d, &v[lo * d..], d, true, (m, nk, d)); // dP = dY vᵀ
        if round {
            round_all(ds); // a bf16 matmul's dP
        }
        for (ri, (row, prow)) in ds.chunks_mut(nk).zip(p.chunks(nk)).enumerate() {
            let i = i0 + ri;
            let di = dy[i * d..(i + 1) * d]
                .iter()
                .zip(&y[i * d..(i + 1) * d])
                .fold(T::zero(), |a, (g, o)| a + *g * *o);
            for (x, pv) in row.iter_mut().zip(prow) {
                *x = *pv * (*x - di); // dS = P (dP - rowsum(dY Y))
            }
        }
        if cap.is_some() {
            for (x, g) in ds.iter_mut().zip(&dcap[..m * nk]) {
                *x = *x * *g; // through the cap: dS_raw = dS (1 - tanh²)
            }
        }
        if round {
            round_all(ds); // dS and P cast to q's dtype for their matmuls
            round_all(p);
        }
        small_gemm(
            &mut dq[i0 * d..],
            d,
            false,
            ds,
            nk,
            &k[lo * d..],
            d,
            false,
            (m, d, nk),
        ); // dQ = dS k
        add_at_b(&mut dk[lo * d..hi * d], ds, nk, qb, (m, nk, d)); // dK += dSᵀ q
        add_at_b(&mut dv[lo * d..hi * d], p, nk, dyb, (m, nk, d)); // dV += Pᵀ dY
    }
}

/// What a backward reads: the op's inputs and output, the output's gradient (contiguous) and
/// the forward's log-sum-exp.
pub(super) struct Saved<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub y: &'a Tensor,
    pub dy: &'a Tensor,
    pub lse: &'a Tensor,
}

fn cpu_bwd(
    saved: Saved,
    mask: &AttentionMask,
    softcap: Option<f64>,
) -> R<(Tensor, Tensor, Tensor)> {
    let Saved {
        q,
        k,
        v,
        y,
        dy,
        lse,
    } = saved;
    let (b, kv, r, d) = q.dims4()?;
    let t = k.dim(2)?;
    let (q, k, v, y) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        y.contiguous()?,
    );
    let guards = [
        q.storage_and_layout(),
        k.storage_and_layout(),
        v.storage_and_layout(),
        y.storage_and_layout(),
        dy.storage_and_layout(),
    ];
    let (lse_st, lse_l) = lse.storage_and_layout();
    let op = "chunked attention";
    let dims = (b, kv, r, t, d);
    let dev = Device::Cpu;
    macro_rules! go {
        ($ty:ty) => {{
            let mut sl: Vec<&[$ty]> = Vec::with_capacity(5);
            for (st, l) in &guards {
                sl.push(storage_data::<$ty>(st, l, op)?);
            }
            let lse = storage_data::<$ty>(&lse_st, lse_l, op)?;
            let ins = (sl[0], sl[1], sl[2], sl[3], sl[4], lse);
            let (dq, dk, dv) = bwd_groups::<$ty>(ins, mask, dims, softcap, false);
            (
                Tensor::from_vec(dq, (b, kv, r, d), &dev)?,
                Tensor::from_vec(dk, (b, kv, t, d), &dev)?,
                Tensor::from_vec(dv, (b, kv, t, d), &dev)?,
            )
        }};
    }
    Ok(match q.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => {
            let mut wide = Vec::with_capacity(5);
            for (st, l) in &guards {
                wide.push(widen_bf16(storage_data(st, l, op)?));
            }
            let lse = storage_data::<f32>(&lse_st, lse_l, op)?;
            let ins = (
                &wide[0][..],
                &wide[1][..],
                &wide[2][..],
                &wide[3][..],
                &wide[4][..],
                lse,
            );
            let (dq, dk, dv) = bwd_groups::<f32>(ins, mask, dims, softcap, true);
            drop(wide);
            (
                Tensor::from_vec(narrow_bf16(&dq), (b, kv, r, d), &dev)?,
                Tensor::from_vec(narrow_bf16(&dk), (b, kv, t, d), &dev)?,
                Tensor::from_vec(narrow_bf16(&dv), (b, kv, t, d), &dev)?,
            )
        }
        d => candle_core::bail!("chunked attention: dtype {d:?}"),
    })
}

/// dq, dk, dv of every (b, kv) group, on rayon's threads ([`group_bwd`]).
fn bwd_groups<T: Real>(
    (q, k, v, y, dy, lse): GroupInputs<T>,
    mask: &AttentionMask,
    (_b, kv, r, t, d): (usize, usize, usize, usize, usize),
    softcap: Option<f64>,
    round: bool,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let cap = softcap.map(T::from_f64);
    group_grads((q.len(), k.len()), (r, t, d), |g, dq, dk, dv| {
        let (qs, ts) = (g * r * d..(g + 1) * r * d, g * t * d..(g + 1) * t * d);
        let ins = (
            &q[qs.clone()],
            &k[ts.clone()],
            &v[ts],
            &y[qs.clone()],
            &dy[qs],
            &lse[g * r..(g + 1) * r],
        );
        group_bwd(ins, mask, g / kv, dq, dk, dv, (t, d), cap, round)
    })
}

// ---------------------------------------------------------------------------------------------
// The tensor-op path (CUDA, bf16 / f16): the same blocks in Candle ops, no graph.

/// Query positions per block on the tensor-op path: a block's f32 scores, B x H x rows x T,
/// stay under [`BLOCK_SCORE_BYTES`]; a multiple of 16, at least 16, at most T.
pub fn block_rows(b: usize, heads: usize, t: usize) -> usize {
    let per_row = (b * heads * t * 4).max(1);
    ((BLOCK_SCORE_BYTES / per_row) / 16 * 16)
        .max(16)
        .min(t.max(1))
}

/// The dtype the tensor-op path's softmax and sums run in: f32, or f64 for f64 inputs.
fn acc(x: &Tensor) -> DType {
    match x.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The pieces of one block of the tensor-op path: q's rows, k and v over its keys, and the raw
/// scores q kᵀ in q's dtype, as eager attention computes them; `spec` describes the block to
/// the block kernels (`super::attn_block`, CUDA), which apply the cap and the mask themselves.
struct Block {
    p0: usize,
    m: usize,
    lo: usize,
    nk: usize,
    /// (B, KV, n_rep * m, D)
    q: Tensor,
    /// (B, KV, nk, D)
    k: Tensor,
    v: Tensor,
    /// (B, KV, n_rep * m, nk)
    s: Tensor,
    spec: super::attn_block::Block,
}

/// The blocks of query positions [p0, p1) of the tensor-op path, `rows` each.
fn blocks(t: usize, rows: usize) -> Vec<(usize, usize)> {
    (0..t)
        .step_by(rows.max(1))
        .map(|p0| (p0, (p0 + rows).min(t)))
        .collect()
}

fn block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    (p0, p1): (usize, usize),
    softcap: Option<f64>,
) -> R<Block> {
    let (b, kv, r, d) = q.dims4()?;
    let t = k.dim(2)?;
    let n_rep = r / t;
    let m = p1 - p0;
    let (lo, hi) = mask.key_range(p0, p1);
    let nk = hi - lo;
    let qb = q
        .reshape((b, kv, n_rep, t, d))?
        .narrow(3, p0, m)?
        .reshape((b, kv, n_rep * m, d))?; // (B, KV, n_rep*m, D), copied
    let kb = k.narrow(2, lo, nk)?.contiguous()?; // (B, KV, nk, D)
    let vb = v.narrow(2, lo, nk)?.contiguous()?;
    let s = qb.matmul(&kb.t()?)?; // (B, KV, n_rep*m, nk)
    let spec = super::attn_block::Block {
        segments: mask.segments.clone(),
        m,
        nk,
        heads: kv * n_rep,
        t,
        p0,
        lo,
        window: mask.window.unwrap_or(0),
        cap: softcap.unwrap_or(0.0) as f32,
    };
    Ok(Block {
        p0,
        m,
        lo,
        nk,
        q: qb,
        k: kb,
        v: vb,
        s,
        spec,
    })
}

/// The block's scores as the tensor ops use them: soft-capped (cap tanh(s / cap) in q's
/// dtype, as transformers' eager attention), in [`acc`]'s dtype, plus the mask:
/// (B, KV, n_rep, m, nk); with `derivative`, also the cap's 1 - tanh² (same shape, the
/// backward's).
fn masked_scores(
    bl: &Block,
    mask: &AttentionMask,
    softcap: Option<f64>,
    derivative: bool,
) -> R<(Tensor, Option<Tensor>)> {
    let (b, kv, rows, nk) = bl.s.dims4()?;
    let shape = (b, kv, rows / bl.m, bl.m, nk);
    let acc = acc(&bl.s);
    let mut s = bl.s.clone();
    let mut dcap = None;
    if let Some(c) = softcap {
        s = ((s / c)?.tanh()? * c)?;
        if derivative {
            let th = (s.to_dtype(acc)? / c)?;
            dcap = Some((1.0 - th.sqr()?)?.reshape(shape)?);
        }
    }
    let add = mask.block(bl.p0, bl.p0 + bl.m, bl.lo, bl.lo + nk)?;
    let s = s
        .to_dtype(acc)?
        .reshape(shape)?
        .broadcast_add(&add.to_dtype(acc)?)?;
    Ok((s, dcap))
}

/// y (B, KV, n_rep * T, D) and lse (B, KV, n_rep * T) in [`acc`]'s dtype.
pub(super) fn generic_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    rows: usize,
    softcap: Option<f64>,
) -> R<(Tensor, Tensor)> {
    let (b, kv, r, d) = q.dims4()?;
    let t = k.dim(2)?;
    let n_rep = r / t;
    // CUDA: each block's element-wise work as two kernels around its two matmuls
    let kernels = super::attn_block::takes(q);
    let mut ys = Vec::new();
    let mut lses = Vec::new();
    for range in blocks(t, rows) {
        let bl = block(q, k, v, mask, range, softcap)?;
        let (m, nk) = (bl.m, bl.nk);
        // P in v's dtype (B, KV, n_rep*m, nk), the rows' log-sum-exp (B, KV, n_rep, m)
        let (p, lse) = if kernels {
            let lse =
                bl.s.apply_op1_no_bwd(&super::attn_block::Lse(bl.spec.clone()))?;
            let probs = super::attn_block::Probs {
                block: bl.spec.clone(),
                lt: m,
                lp0: 0,
            };
            let p = bl.s.apply_op2_no_bwd(&lse, &probs)?;
            (p, lse.reshape((b, kv, n_rep, m))?)
        } else {
            let (s, _) = masked_scores(&bl, mask, softcap, false)?;
            let mx = s.max_keepdim(D::Minus1)?; // (B, KV, n_rep, m, 1)
            let e = s.broadcast_sub(&mx)?.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            let p = e.broadcast_div(&sum)?.to_dtype(v.dtype())?; // softmax in f32, cast back
            let lse = (mx + sum.log()?)?.squeeze(D::Minus1)?;
            (p.reshape((b, kv, n_rep * m, nk))?, lse)
        };
        ys.push(p.matmul(&bl.v)?.reshape((b, kv, n_rep, m, d))?); // (B, KV, n_rep, m, D)
        lses.push(lse);
    }
    let y = Tensor::cat(&ys, 3)?.reshape((b, kv, r, d))?;
    let lse = Tensor::cat(&lses, 3)?.reshape((b, kv, r))?;
    Ok((y, lse))
}

pub(super) fn generic_bwd(
    saved: Saved,
    mask: &AttentionMask,
    rows: usize,
    softcap: Option<f64>,
) -> R<(Tensor, Tensor, Tensor)> {
    let Saved {
        q,
        k,
        v,
        y,
        dy,
        lse,
    } = saved;
    let (b, kv, r, d) = q.dims4()?;
    let t = k.dim(2)?;
    let n_rep = r / t;
    // Detached, every one: the output y is the op's own (recorded) result, and Candle records
    // the op of any tensor derived from a recorded one, so rowsum(dY Y) and through it each
    // block's f32 probabilities and dS would stay alive in the dQ pieces until the end of this
    // backward (measured on the CUDA path, `TALLOW_CUDA_PATHS_ON_CPU`: 4 blocks' worth at the
    // peak of a 4096-token checkpointed backward). Candle hands dY over detached already.
    let (q, k, v, y, dy) = (q.detach(), k.detach(), v.detach(), y.detach(), dy.detach());
    let lse = lse.detach();
    let dy5 = dy.reshape((b, kv, n_rep, t, d))?;
    // CUDA: D, and each block's P and dS, one kernel each
    let kernels = super::attn_block::takes(&q);
    // rowsum(dY Y) in f32: (B, KV, n_rep, T, 1); on CUDA no f32 copies of dY, Y
    let di = if kernels {
        dy.contiguous()?
            .apply_op2_no_bwd(&y.contiguous()?, &super::attn_block::RowDot)?
    } else {
        (dy.to_dtype(acc(&q))? * y.to_dtype(acc(&q))?)?.sum_keepdim(D::Minus1)?
    }
    .reshape((b, kv, n_rep, t, 1))?;
    let lse = lse.reshape((b, kv, n_rep, t, 1))?;
    // The kernels' row statistics for the whole sequence: (log-sum-exp, then D), and the
    // log-sum-exp alone.
    let flat = if kernels {
        let lse_all = lse.flatten_all()?;
        Some((Tensor::cat(&[&lse_all, &di.flatten_all()?], 0)?, lse_all))
    } else {
        None
    };
    let dk = Tensor::zeros((b, kv, t, d), acc(&q), q.device())?;
    let dv = Tensor::zeros((b, kv, t, d), acc(&q), q.device())?;
    let mut dqs = Vec::new();
    for range in blocks(t, rows) {
        let bl = block(&q, &k, &v, mask, range, softcap)?;
        let (m, nk) = (bl.m, bl.nk);
        let dyb = dy5.narrow(3, bl.p0, m)?.reshape((b, kv, n_rep * m, d))?;
        let dp = dyb.matmul(&bl.v.t()?)?; // dY vᵀ (B, KV, n_rep*m, nk), in q's dtype
                                          // P and dS = P (dP - rowsum(dY Y)) in q's dtype (B, KV, n_rep*m, nk)
        let (p, ds) = match &flat {
            Some((stats, lse_all)) => {
                let probs = super::attn_block::Probs {
                    block: bl.spec.clone(),
                    lt: t,
                    lp0: bl.p0,
                };
                let p = bl.s.apply_op2_no_bwd(lse_all, &probs)?;
                let ds = super::attn_block::Ds(bl.spec.clone());
                (p, bl.s.apply_op3_no_bwd(&dp, stats, &ds)?)
            }
            None => {
                let (s, dcap) = masked_scores(&bl, mask, softcap, true)?;
                let p = s.broadcast_sub(&lse.narrow(3, bl.p0, m)?)?.exp()?; // (B, KV, n_rep, m, nk)
                let dp = dp.to_dtype(acc(&q))?.reshape((b, kv, n_rep, m, nk))?;
                let mut ds = (p.clone() * dp.broadcast_sub(&di.narrow(3, bl.p0, m)?)?)?;
                if let Some(g) = &dcap {
                    ds = (ds * g)?; // through the cap: dS_raw = dS (1 - tanh²)
                }
                (
                    p.to_dtype(q.dtype())?.reshape((b, kv, n_rep * m, nk))?,
                    ds.to_dtype(q.dtype())?.reshape((b, kv, n_rep * m, nk))?,
                )
            }
        };
        dqs.push(ds.matmul(&bl.k)?.reshape((b, kv, n_rep, m, d))?); // dS k
        if kernels {
            // CUDA: dK[lo..] += dSᵀ q and dV[lo..] += Pᵀ dY, each one gemm into the f32 sums
            let at = super::attn_block::AccumulateTn { lo: bl.lo };
            dk.inplace_op3(&ds.contiguous()?, &bl.q.contiguous()?, &at)?;
            dv.inplace_op3(&p.contiguous()?, &dyb.contiguous()?, &at)?;
            continue;
        }
        let dkb = ds.t()?.matmul(&bl.q)?.to_dtype(acc(&q))?; // (B, KV, nk, D): dSᵀ q
        let dvb = p.t()?.matmul(&dyb)?.to_dtype(acc(&q))?; // Pᵀ dY
        dk.slice_set(&(dk.narrow(2, bl.lo, nk)? + dkb)?, 2, bl.lo)?;
        dv.slice_set(&(dv.narrow(2, bl.lo, nk)? + dvb)?, 2, bl.lo)?;
    }
    let dq = Tensor::cat(&dqs, 3)?.reshape((b, kv, r, d))?;
    Ok((dq, dk.to_dtype(k.dtype())?, dv.to_dtype(v.dtype())?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::Var;

    /// Row 0 packs three documents (40, 70, 40 tokens), row 1 is one: blocks cross document
    /// and window boundaries.
    pub(crate) fn segments(t: usize) -> Vec<Vec<u32>> {
        let row0 = (0..t)
            .map(|i| match i {
                0..40 => 0,
                40..110 => 1,
                _ => 2,
            })
            .collect();
        vec![row0, vec![7; t]]
    }

    /// Value and the gradients of sum(y * w) for q, k, v through `f`.
    pub(crate) fn run(
        f: impl Fn(&Tensor, &Tensor, &Tensor) -> R<Tensor>,
        qkv: &[Var; 3],
        w: &Tensor,
    ) -> R<Vec<Tensor>> {
        let y = f(qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor())?;
        let g = (&y * w)?.sum_all()?.backward()?;
        let mut out = vec![y];
        for v in qkv {
            out.push(g.get(v.as_tensor()).expect("a gradient").clone());
        }
        Ok(out)
    }

    pub(crate) fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let scale = b.abs().unwrap().max_all().unwrap();
        let (d, s) = (
            diff.to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            scale
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
        );
        d / s.max(1e-30)
    }

    pub(crate) fn inputs(dtype: DType, t: usize) -> R<([Var; 3], Tensor)> {
        let dev = Device::Cpu;
        let (b, kv, n_rep, d) = (2, 2, 2, 8);
        let q = (Tensor::randn(0f32, 1., (b, kv, n_rep * t, d), &dev)? * 0.5)?;
        let k = Tensor::randn(0f32, 1., (b, kv, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (b, kv, t, d), &dev)?;
        let w = Tensor::randn(0f32, 1., (b, kv, n_rep * t, d), &dev)?.to_dtype(dtype)?;
        let var = |x: Tensor| Var::from_tensor(&x.to_dtype(dtype)?);
        Ok(([var(q)?, var(k)?, var(v)?], w))
    }

    /// The CPU kernel and the tensor-op path (blocks of 16 and of 64 positions) give eager
    /// attention's output and gradients (the (T, T) mask of `ops::attention_mask`, HF's eager
    /// maths) within 1e-5 relative in f32, packed rows, with and without a sliding window.
    /// Breaking the window on purpose gives 0.77 (CPU kernel, window ignored in `first_keys`)
    /// and 0.60 (tensor-op path, window dropped from the block mask) in y.
    #[test]
    fn matches_eager_attention_values_and_gradients() -> R<()> {
        let t = 150;
        let segs = segments(t);
        for window in [None, Some(20)] {
            let (qkv, w) = inputs(DType::F32, t)?;
            let dense = crate::nn::ops::attention_mask(&segs, window, DType::F32, &Device::Cpu)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let eager = run(
                |q, k, v| {
                    let (b, kv, r, _) = q.dims4()?;
                    let s = q
                        .matmul(&k.t()?)?
                        .reshape((b, kv, r / t, t, t))?
                        .broadcast_add(&dense.unsqueeze(2)?)?;
                    let e = s
                        .broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?
                        .exp()?;
                    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?; // softmax
                    p.reshape((b, kv, r, t))?.matmul(v)
                },
                &qkv,
                &w,
            )?;
            let mask = AttentionMask::new(&segs, window, &Device::Cpu)?;
            for rows in [None, Some(16), Some(64)] {
                let got = run(|q, k, v| attention(q, k, v, &mask, rows, None), &qkv, &w)?;
                for (name, (a, b)) in ["y", "dq", "dk", "dv"].iter().zip(got.iter().zip(&eager)) {
                    let e = max_rel(a, b);
                    assert!(e < 1e-5, "window {window:?} rows {rows:?} {name}: {e:e}");
                }
            }
        }
        Ok(())
    }

    /// The block kernels' twins (`super::super::attn_block`: the CUDA path's ops, taken under
    /// `TALLOW_CUDA_PATHS_ON_CPU`) against the tensor ops they replace, blocks of 16 positions
    /// over packed rows, with and without a window and a soft-cap: f32 within 1e-5 relative in
    /// y, dq, dk, dv (measured at most 8e-7); bf16 y and dq within 0.01 E (E the bf16 effect,
    /// as in the test below; measured at most 3e-3 E: the twins' P is exp(s - lse) where the
    /// tensor ops divide by the sum, and D = rowsum(dY Y) sums in another order, a bf16
    /// rounding apart at rare times); bf16 dk and dv within 1.5 E of the f32 result (measured
    /// 0.91-0.96 E: nearer than the tensor ops, as they are summed over the blocks in f32 and
    /// rounded once; a block left out is off by far more, and the f32 case above holds their
    /// sums to the tensor ops').
    /// The window left out of the twins' score gives 0.99 (f32, y).
    #[test]
    fn block_kernels_twins_match_the_tensor_ops() -> R<()> {
        use crate::kernels::dispatch::with_cuda_paths_on_cpu;
        let t = 150;
        let segs = segments(t);
        let names = ["y", "dq", "dk", "dv"];
        for (window, cap) in [(None, None), (Some(20), None), (Some(20), Some(1.5))] {
            let mask = AttentionMask::new(&segs, window, &Device::Cpu)?;
            let f = |q: &Tensor, k: &Tensor, v: &Tensor| attention(q, k, v, &mask, Some(16), cap);
            let (qkv, w) = inputs(DType::F32, t)?;
            let ops = run(f, &qkv, &w)?;
            let twins = with_cuda_paths_on_cpu(|| run(f, &qkv, &w))?;
            for (name, (a, b)) in names.iter().zip(twins.iter().zip(&ops)) {
                let e = max_rel(a, b);
                eprintln!("f32 window {window:?} cap {cap:?} {name}: {e:e}");
                assert!(e < 1e-5, "f32 window {window:?} cap {cap:?} {name}: {e:e}");
            }
            let mean_abs = |a: &Tensor, b: &Tensor| -> R<f64> {
                let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?;
                d.abs()?.mean_all()?.to_scalar::<f64>()
            };
            let (qkv16, w16) = inputs(DType::BF16, t)?;
            let ops16 = run(f, &qkv16, &w16)?;
            let twins16 = with_cuda_paths_on_cpu(|| run(f, &qkv16, &w16))?;
            let wide: [Var; 3] = [0, 1, 2].map(|i| {
                Var::from_tensor(&qkv16[i].as_tensor().to_dtype(DType::F32).unwrap()).unwrap()
            });
            let f32s = run(f, &wide, &w16.to_dtype(DType::F32)?)?;
            for (i, name) in names.iter().enumerate() {
                assert_eq!(twins16[i].dtype(), DType::BF16);
                let got = mean_abs(&twins16[i], &ops16[i])?;
                let effect = mean_abs(&f32s[i], &ops16[i])?;
                eprintln!("bf16 window {window:?} cap {cap:?} {name}: {got:.3e} vs E {effect:.3e}");
                if i < 2 {
                    assert!(got <= 0.01 * effect, "bf16 {name}: {got:e} vs E {effect:e}");
                    continue;
                }
                // dK and dV: the CUDA path sums every block's product in f32 and rounds once
                // (`attn_block::AccumulateTn`, as the CPU kernel does), where the tensor ops
                // round each block's product to bf16 first: nearer the f32 result than they are
                let off = mean_abs(&twins16[i], &f32s[i])?;
                eprintln!("  {name} from f32: twins {off:.3e}, tensor ops {effect:.3e}");
                assert!(
                    off <= 1.5 * effect,
                    "bf16 {name}: {off:e} from f32 vs E {effect:e}"
                );
            }
        }
        Ok(())
    }

    /// The tensor-op backward returns gradients with no op recorded: computed from the op's
    /// recorded output y, a recorded dQ would hold every block's f32 probabilities and dS until
    /// the gradients are dropped (4 blocks' worth at the peak of a 4096-token checkpointed
    /// backward on the CUDA path, 1095 MiB against 565 detached). Leaving y attached in
    /// `generic_bwd` fails it ("dq records an op").
    #[test]
    fn tensor_op_backward_gives_detached_gradients() -> R<()> {
        let t = 150;
        let mask = AttentionMask::new(&segments(t), None, &Device::Cpu)?;
        let (qkv, _) = inputs(DType::F32, t)?;
        let y = attention(
            qkv[0].as_tensor(),
            qkv[1].as_tensor(),
            qkv[2].as_tensor(),
            &mask,
            Some(16),
            None,
        )?;
        let g = y.sqr()?.sum_all()?.backward()?;
        for (name, v) in ["dq", "dk", "dv"].iter().zip(&qkv) {
            let grad = g.get(v.as_tensor()).expect("a gradient");
            assert!(!grad.track_op(), "{name} records an op");
        }
        Ok(())
    }

    /// bf16 on the CPU kernel against the tensor-op path in bf16 (HF's rounding points: bf16
    /// scores, f32 softmax, bf16 probabilities and matmul outputs), packed rows with a window:
    /// mean |kernel - tensor ops| over y, dq, dk, dv, measured against the bf16 effect
    /// E = mean |f32 kernel - tensor ops| on the same (bf16) inputs. With the tensor-op path in
    /// one block (which rounds dK and dV once, as the kernel does) the kernel is within 0.01 E
    /// (measured 1e-3 E: y and dq all but bit for bit); with blocks of 16 rows, whose dK and
    /// dV the tensor-op path rounds per block, within 0.5 E (measured 0.36 E, y and dq 0).
    /// Leaving out any one of the kernel's roundings (scores, P, dP, dS) fails it.
    #[test]
    fn bf16_kernel_rounds_as_the_tensor_op_path() -> R<()> {
        let t = 150;
        let segs = segments(t);
        let mask = AttentionMask::new(&segs, Some(60), &Device::Cpu)?;
        let (qkv, w) = inputs(DType::BF16, t)?;
        let mean_abs = |a: &Tensor, b: &Tensor| -> R<f64> {
            let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?;
            d.abs()?.mean_all()?.to_scalar::<f64>()
        };
        let kernel = run(|q, k, v| attention(q, k, v, &mask, None, None), &qkv, &w)?;
        let wide: [Var; 3] = [0, 1, 2]
            .map(|i| Var::from_tensor(&qkv[i].as_tensor().to_dtype(DType::F32).unwrap()).unwrap());
        let f32k = run(
            |q, k, v| attention(q, k, v, &mask, None, None),
            &wide,
            &w.to_dtype(DType::F32)?,
        )?;
        for (rows, bound) in [(t, 0.01), (16, 0.5)] {
            let ops = run(
                |q, k, v| attention(q, k, v, &mask, Some(rows), None),
                &qkv,
                &w,
            )?;
            for (i, name) in ["y", "dq", "dk", "dv"].iter().enumerate() {
                assert_eq!(kernel[i].dtype(), DType::BF16);
                let got = mean_abs(&kernel[i], &ops[i])?;
                let effect = mean_abs(&f32k[i], &ops[i])?;
                eprintln!("rows {rows} {name}: {got:.3e} vs effect {effect:.3e}");
                assert!(
                    got <= bound * effect,
                    "rows {rows} {name}: {got:e} vs E {effect:e}"
                );
            }
        }
        Ok(())
    }

    /// Finite differences in f64 on a small case (T 70: two CPU blocks; tensor-op blocks of
    /// 16): the analytic gradient of sum(y * w) within 1e-6 relative (1e-8 absolute below
    /// 1e-2) of central differences (step 1e-5) at sampled entries of q, k and v. A dropped `- rowsum(dY Y)` term is off by
    /// order 1.
    #[test]
    fn gradients_match_finite_differences() -> R<()> {
        let t = 70;
        let segs = vec![(0..t).map(|i| (i >= 30) as u32).collect::<Vec<u32>>(); 2];
        let mask = AttentionMask::new(&segs, Some(25), &Device::Cpu)?;
        for rows in [None, Some(16)] {
            let (qkv, w) = inputs(DType::F64, t)?;
            let f = |q: &Tensor, k: &Tensor, v: &Tensor| attention(q, k, v, &mask, rows, None);
            let got = run(f, &qkv, &w)?;
            let loss = |x: [&Tensor; 3]| -> f64 {
                let y = attention(x[0], x[1], x[2], &mask, rows, None).unwrap();
                (y * &w)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let base: Vec<Tensor> = qkv.iter().map(|v| v.as_tensor().detach()).collect();
            for which in 0..3 {
                let flat = base[which].flatten_all()?.to_vec1::<f64>()?;
                let grad = got[which + 1].flatten_all()?.to_vec1::<f64>()?;
                for idx in (0..flat.len()).step_by(flat.len() / 7 + 1) {
                    let h = 1e-5;
                    let at = |delta: f64| -> f64 {
                        let mut x = flat.clone();
                        x[idx] += delta;
                        let x = Tensor::from_vec(x, base[which].shape(), &Device::Cpu).unwrap();
                        let mut ins = [&base[0], &base[1], &base[2]];
                        ins[which] = &x;
                        loss(ins)
                    };
                    let fd = (at(h) - at(-h)) / (2.0 * h);
                    // Relative, or absolute 1e-8 below |fd| = 1e-2: the central difference's
                    // own rounding (eps * |sum(y w)| / h) reached 2.8e-9 at |fd| = 1e-4 on one
                    // draw of the (unseeded) inputs.
                    let e = (fd - grad[idx]).abs() / fd.abs().max(1e-2);
                    assert!(
                        e < 1e-6,
                        "rows {rows:?} input {which} [{idx}]: fd {fd} vs {}",
                        grad[idx]
                    );
                }
            }
        }
        Ok(())
    }

    /// Soft-capped scores (Gemma 2's `attn_logit_softcapping`): the CPU kernel and the tensor-op
    /// path (blocks of 16) against eager attention with the cap written out
    /// (cap * tanh(s / cap), then mask and softmax) within 1e-5 relative in f32, and their
    /// gradients against f64 central differences within 1e-6 (1e-8 absolute below 1e-2). q is scaled up so that most
    /// scores pass the cap of 1.5. Breaking the cap's derivative on purpose (dS not multiplied
    /// by 1 - tanh²) is off by 2.4 (CPU kernel) and 2.5 (tensor-op path) relative in dq.
    #[test]
    fn softcapped_scores_match_eager_and_finite_differences() -> R<()> {
        let t = 70;
        let cap = 1.5;
        let segs = vec![(0..t).map(|i| (i >= 30) as u32).collect::<Vec<u32>>(); 2];
        let dense = crate::nn::ops::attention_mask(&segs, Some(25), DType::F32, &Device::Cpu)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mask = AttentionMask::new(&segs, Some(25), &Device::Cpu)?;
        let (qkv, w) = inputs(DType::F32, t)?;
        let q4 = (qkv[0].as_tensor() * 4.0)?.detach();
        let qkv = [Var::from_tensor(&q4)?, qkv[1].clone(), qkv[2].clone()];
        let eager = run(
            |q, k, v| {
                let (b, kv, r, _) = q.dims4()?;
                let s = q.matmul(&k.t()?)?;
                let frac =
                    (s.abs()?.ge(cap)?.to_dtype(DType::F32)?.mean_all()?).to_scalar::<f32>()?;
                assert!(frac > 0.3, "only {frac} of the scores pass the cap");
                let s = ((s / cap)?.tanh()? * cap)?
                    .reshape((b, kv, r / t, t, t))?
                    .broadcast_add(&dense.unsqueeze(2)?)?;
                let e = s
                    .broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?
                    .exp()?;
                let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
                p.reshape((b, kv, r, t))?.matmul(v)
            },
            &qkv,
            &w,
        )?;
        for rows in [None, Some(16)] {
            let got = run(
                |q, k, v| attention(q, k, v, &mask, rows, Some(cap)),
                &qkv,
                &w,
            )?;
            for (name, (a, b)) in ["y", "dq", "dk", "dv"].iter().zip(got.iter().zip(&eager)) {
                let e = max_rel(a, b);
                assert!(e < 1e-5, "rows {rows:?} {name}: {e:e}");
            }
            // f64 central differences
            let qkv64: Vec<Var> = qkv
                .iter()
                .map(|v| Var::from_tensor(&v.as_tensor().to_dtype(DType::F64).unwrap()).unwrap())
                .collect();
            let w64 = w.to_dtype(DType::F64)?;
            let qkv64 = [qkv64[0].clone(), qkv64[1].clone(), qkv64[2].clone()];
            let got = run(
                |q, k, v| attention(q, k, v, &mask, rows, Some(cap)),
                &qkv64,
                &w64,
            )?;
            let base: Vec<Tensor> = qkv64.iter().map(|v| v.as_tensor().detach()).collect();
            for which in 0..3 {
                let flat = base[which].flatten_all()?.to_vec1::<f64>()?;
                let grad = got[which + 1].flatten_all()?.to_vec1::<f64>()?;
                for idx in (0..flat.len()).step_by(flat.len() / 7 + 1) {
                    let h = 1e-5;
                    let at = |delta: f64| -> f64 {
                        let mut x = flat.clone();
                        x[idx] += delta;
                        let x = Tensor::from_vec(x, base[which].shape(), &Device::Cpu).unwrap();
                        let mut ins = [&base[0], &base[1], &base[2]];
                        ins[which] = &x;
                        let y = attention(ins[0], ins[1], ins[2], &mask, rows, Some(cap)).unwrap();
                        (y * &w64)
                            .unwrap()
                            .sum_all()
                            .unwrap()
                            .to_scalar::<f64>()
                            .unwrap()
                    };
                    let fd = (at(h) - at(-h)) / (2.0 * h);
                    // Relative, or absolute 1e-8 below |fd| = 1e-2: the central difference's
                    // own rounding (eps * |sum(y w)| / h) reached 2.8e-9 at |fd| = 1e-4 on one
                    // draw of the (unseeded) inputs.
                    let e = (fd - grad[idx]).abs() / fd.abs().max(1e-2);
                    assert!(
                        e < 1e-6,
                        "rows {rows:?} input {which} [{idx}]: fd {fd} vs {}",
                        grad[idx]
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn first_keys_follow_segments_and_window() {
        assert_eq!(
            first_keys(&[0, 0, 0, 1, 1, 1], None).unwrap(),
            vec![0, 0, 0, 3, 3, 3]
        );
        let w2 = first_keys(&[0, 0, 0, 0, 1, 1], Some(2)).unwrap();
        assert_eq!(w2, vec![0, 0, 1, 2, 4, 4]);
        let e = first_keys(&[0, 0, 1, 0], None).unwrap_err().to_string();
        assert!(e.contains("segment id 0 comes back at position 3"), "{e}");
    }

    /// The tensor-op path's blocks keep their f32 scores under the budget.
    #[test]
    fn block_rows_bound_the_block_scores() {
        for (b, h, t) in [(1, 32, 4096), (4, 32, 32768), (1, 8, 100), (1, 4, 10)] {
            let rows = block_rows(b, h, t);
            assert!(
                (rows.is_multiple_of(16) && rows >= 16) || rows == t,
                "{rows}"
            );
            assert!(rows == 16 || b * h * rows * t * 4 <= BLOCK_SCORE_BYTES);
        }
    }
}
