//! Chunked attention on CUDA for bf16 / f16 q, k, v as kernels of tallow's own
//! (`kernels/flash_attn.cuh`, in the manner of FlashAttention-2): the forward is one launch and
//! the backward two (dK / dV, then dQ), whatever the sequence length, where the tensor-op path
//! of [`super::chunked`] takes about a dozen per block of query rows and layer. Nothing (T, T)
//! is stored; the graph keeps q, k, v, the output and each row's f32 log-sum-exp, as it does for
//! the tensor-op path. Grouped-query heads read their kv head directly; packed rows and sliding
//! windows are each position's first visible key ([`AttentionMask`]'s `first` on the device);
//! Gemma 2's soft-cap is applied in the kernels.
//!
//! The CPU twin is the tensor-op path itself (`chunked::generic_fwd` / `generic_bwd`), whose
//! arithmetic the kernels follow (the header says where they round): under
//! `TALLOW_CUDA_PATHS_ON_CPU` it computes the values and the op counts the kernels' launches
//! ([`LAUNCHES`]); `tallow doctor` compares the kernels on a GPU with it.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::chunked::{generic_bwd, generic_fwd, AttentionMask, Saved};

type R<T> = candle_core::Result<T>;

/// The largest head dim the kernels take (their shared-memory tiles, `FA_DMAX`); a larger
/// one keeps the tensor-op path.
pub const MAX_HEAD_DIM: usize = 256;

/// Query positions per block of the twin's tensor-op path: the kernels' tile, so that what the
/// twin allocates at a time (a block's scores, B x H x 16 x T) stays near the kernels' nothing,
/// and a `TALLOW_CUDA_PATHS_ON_CPU` run's peak near the GPU's.
pub const TWIN_ROWS: usize = 16;

/// Device launches of the forward and of the backward.
pub const LAUNCHES: (usize, usize) = (1, 2);

/// softmax(cap(q kᵀ) + mask) v through the kernels (the twin on the CPU). q: (B, KV, n_rep T, D)
/// carrying the scale, k, v: (B, KV, T, D), contiguous, all of one dtype.
pub(super) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    softcap: Option<f64>,
    tracked: bool,
) -> R<Tensor> {
    let (b, kv, r, _) = q.dims4()?;
    let t = k.dim(2)?;
    if b * kv * (r / t) > 65535 {
        candle_core::bail!(
            "chunked attention: {b} rows x {} heads is past the kernels' grid (65535); use a \
             smaller micro-batch",
            kv * (r / t)
        );
    }
    // The twin computes the output before the op (its forward hands a copy over).
    let precomputed = if q.device().is_cpu() {
        let (y, lse) = candle_core::launches::uncounted(|| {
            generic_fwd(
                &q.detach(),
                &k.detach(),
                &v.detach(),
                mask,
                TWIN_ROWS,
                softcap,
            )
        })?;
        Some((y, lse))
    } else {
        None
    };
    let (y, lse) = match precomputed {
        Some((y, lse)) => (Some(y), Some(lse)),
        None => (None, None),
    };
    let op = FlashAttention {
        mask: mask.clone(),
        softcap,
        y: Mutex::new(y),
        lse: Mutex::new(lse),
    };
    if tracked {
        q.apply_op3(k, v, op)
    } else {
        q.apply_op3_no_bwd(k, v, &op)
    }
}

struct FlashAttention {
    mask: AttentionMask,
    softcap: Option<f64>,
    /// The twin's output, taken by the forward.
    y: Mutex<Option<Tensor>>,
    /// (B, KV, n_rep T) f32, taken by the backward.
    lse: Mutex<Option<Tensor>>,
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        _q: &CpuStorage,
        _ql: &Layout,
        _k: &CpuStorage,
        _kl: &Layout,
        _v: &CpuStorage,
        _vl: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        let Some(y) = self.y.lock().expect("y lock").take() else {
            candle_core::bail!("flash attention: the twin's output was not computed")
        };
        let (s, l) = y.storage_and_layout();
        let out = match &*s {
            candle_core::Storage::Cpu(c) => c.try_clone(l)?,
            _ => candle_core::bail!("flash attention: the twin's output is not on the CPU"),
        };
        Ok((out, y.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        let (y, lse) = cuda::forward((q, ql), (k, kl), (v, vl), &self.mask, self.softcap)?;
        *self.lse.lock().expect("lse lock") = Some(lse);
        Ok((y, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> R<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse =
            self.lse.lock().expect("lse lock").take().ok_or_else(|| {
                candle_core::Error::Msg("flash attention: backward run twice".into())
            })?;
        let dy = dy.contiguous()?;
        if q.device().is_cpu() {
            let saved = Saved {
                q,
                k,
                v,
                y,
                dy: &dy,
                lse: &lse,
            };
            let (dq, dk, dv) = candle_core::launches::uncounted(|| {
                generic_bwd(saved, &self.mask, TWIN_ROWS, self.softcap)
            })?;
            candle_core::launches::add("flash-attention-dkdv");
            candle_core::launches::add("flash-attention-dq");
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        #[cfg(feature = "cuda")]
        {
            let (dq, dk, dv) = cuda::backward(q, k, v, y, &dy, &lse, &self.mask, self.softcap)?;
            Ok((Some(dq), Some(dk), Some(dv)))
        }
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("flash attention: a device tensor without the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, DType, Layout, Storage, Tensor};
    use half::{bf16, f16};

    use super::{AttentionMask, R};
    use crate::kernels::cuda::{func, view};

    /// Query rows (and keys) per tile of the kernels (`FA_M`, `FA_N`).
    const TILE: usize = 16;

    /// The kernels' tiles over T positions.
    fn tiles(t: usize) -> usize {
        t.div_ceil(TILE)
    }

    /// The kernels' `FaShape`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct FaShape {
        t: u64,
        d: u64,
        heads: u64,
        n_rep: u64,
        cap: f32,
        inv_cap: f32,
    }

    // SAFETY: a plain #[repr(C)] struct of four u64 and two f32 (40 bytes, 8-aligned), laid out
    // as the kernels' C struct.
    unsafe impl DeviceRepr for FaShape {}

    /// (B, KV, n_rep, T, D) of q (B, KV, n_rep T, D) and k (B, KV, T, D).
    fn dims(ql: &Layout, kl: &Layout) -> R<(usize, usize, usize, usize, usize)> {
        let (b, kv, r, d) = ql.shape().dims4()?;
        let t = kl.shape().dims4()?.2;
        Ok((b, kv, r / t, t, d))
    }

    fn shape(dims: (usize, usize, usize, usize, usize), softcap: Option<f64>) -> FaShape {
        let (_, kv, n_rep, t, d) = dims;
        // the cap and 1 / cap as the tensor-op path's kernels take them (`attn_block::Block`)
        let cap = softcap.unwrap_or(0.0) as f32;
        FaShape {
            t: t as u64,
            d: d as u64,
            heads: (kv * n_rep) as u64,
            n_rep: n_rep as u64,
            cap,
            inv_cap: if cap > 0.0 {
                (1.0 / cap as f64) as f32
            } else {
                0.0
            },
        }
    }

    fn config(tiles: usize, groups: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (tiles as u32, groups as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn suffix(dt: DType) -> R<&'static str> {
        match dt {
            DType::BF16 => Ok("bf16"),
            DType::F16 => Ok("f16"),
            dt => candle_core::bail!("flash attention: {dt:?} (bf16 / f16 only)"),
        }
    }

    /// The mask's first visible keys (B, T) u32 on the device, for `f`.
    fn with_first<X>(
        mask: &AttentionMask,
        f: impl FnOnce(&candle_core::cuda_backend::cudarc::driver::CudaView<'_, u32>) -> R<X>,
    ) -> R<X> {
        let (st, l) = mask.first_keys().storage_and_layout();
        let Storage::Cuda(c) = &*st else {
            candle_core::bail!("flash attention: the mask is not on the GPU")
        };
        f(&view::<u32>(c, l, "attention mask")?)
    }

    /// y (q's shape and dtype) and lse (B, KV, n_rep T) f32.
    pub(super) fn forward(
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
        mask: &AttentionMask,
        softcap: Option<f64>,
    ) -> R<(CudaStorage, Tensor)> {
        fn run<T: CudaDType + DeviceRepr>(
            (q, ql): (&CudaStorage, &Layout),
            (k, kl): (&CudaStorage, &Layout),
            (v, vl): (&CudaStorage, &Layout),
            mask: &AttentionMask,
            softcap: Option<f64>,
        ) -> R<(CudaStorage, Tensor)> {
            let dev = q.device().clone();
            let dims = dims(ql, kl)?;
            let (b, kv, n_rep, t, _) = dims;
            let s = shape(dims, softcap);
            let (qv, kv_, vv) = (
                view::<T>(q, ql, "attention q")?,
                view::<T>(k, kl, "attention k")?,
                view::<T>(v, vl, "attention v")?,
            );
            let rows = b * kv * n_rep * t;
            // SAFETY: the kernel writes every row of y and every lse.
            let y = unsafe { dev.alloc::<T>(ql.shape().elem_count())? };
            let lse = unsafe { dev.alloc::<f32>(rows)? };
            if rows > 0 {
                with_first(mask, |first| {
                    let f = func(&dev, &format!("tallow_fa_fwd_{}", suffix(q.dtype())?))?;
                    let mut bld = f.builder();
                    bld.arg(&qv);
                    bld.arg(&kv_);
                    bld.arg(&vv);
                    bld.arg(first);
                    bld.arg(&y);
                    bld.arg(&lse);
                    bld.arg(&s);
                    // SAFETY: argument types and order match `tallow_fa_fwd_*`.
                    unsafe { bld.launch(config(tiles(t), b * kv * n_rep)) }.w()?;
                    Ok(())
                })?;
            }
            let lse = Tensor::from_storage(
                Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, dev.clone())),
                (b, kv, n_rep * t),
                BackpropOp::none(),
                false,
            );
            Ok((CudaStorage::wrap_cuda_slice(y, dev), lse))
        }
        match q.dtype() {
            DType::BF16 => run::<bf16>((q, ql), (k, kl), (v, vl), mask, softcap),
            DType::F16 => run::<f16>((q, ql), (k, kl), (v, vl), mask, softcap),
            dt => candle_core::bail!("flash attention: {dt:?} (bf16 / f16 only)"),
        }
    }

    /// dq, dk, dv: two launches.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        y: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
        mask: &AttentionMask,
        softcap: Option<f64>,
    ) -> R<(Tensor, Tensor, Tensor)> {
        fn run<T: CudaDType + DeviceRepr>(
            ts: [&Tensor; 6],
            mask: &AttentionMask,
            softcap: Option<f64>,
        ) -> R<(Tensor, Tensor, Tensor)> {
            let [q, k, v, y, dy, lse] = ts;
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let (ys, yl) = y.storage_and_layout();
            let (dys, dyl) = dy.storage_and_layout();
            let (ls, ll) = lse.storage_and_layout();
            fn cuda(s: &Storage) -> R<&CudaStorage> {
                match s {
                    Storage::Cuda(c) => Ok(c),
                    _ => candle_core::bail!("flash attention: an input is not on the GPU"),
                }
            }
            let (qc, kc, vc, yc, dyc, lc) = (
                cuda(&qs)?,
                cuda(&ks)?,
                cuda(&vs)?,
                cuda(&ys)?,
                cuda(&dys)?,
                cuda(&ls)?,
            );
            let dev = qc.device().clone();
            let dims = dims(ql, kl)?;
            let (b, kv, n_rep, t, _) = dims;
            let s = shape(dims, softcap);
            let qv = view::<T>(qc, ql, "attention q")?;
            let kv_ = view::<T>(kc, kl, "attention k")?;
            let vv = view::<T>(vc, vl, "attention v")?;
            let yv = view::<T>(yc, yl, "attention y")?;
            let dyv = view::<T>(dyc, dyl, "attention dY")?;
            let lv = view::<f32>(lc, ll, "attention lse")?;
            // SAFETY: the kernels write every row of dq, dk and dv.
            let dq = unsafe { dev.alloc::<T>(ql.shape().elem_count())? };
            let dk = unsafe { dev.alloc::<T>(kl.shape().elem_count())? };
            let dv = unsafe { dev.alloc::<T>(kl.shape().elem_count())? };
            let sfx = suffix(q.dtype())?;
            if t > 0 {
                with_first(mask, |first| {
                    let f = func(&dev, &format!("tallow_fa_dkdv_{sfx}"))?;
                    let mut bld = f.builder();
                    for a in [&qv, &kv_, &vv, &dyv, &yv] {
                        bld.arg(a);
                    }
                    bld.arg(first);
                    bld.arg(&lv);
                    bld.arg(&dk);
                    bld.arg(&dv);
                    bld.arg(&s);
                    // SAFETY: argument types and order match `tallow_fa_dkdv_*`.
                    unsafe { bld.launch(config(tiles(t), b * kv)) }.w()?;
                    let f = func(&dev, &format!("tallow_fa_dq_{sfx}"))?;
                    let mut bld = f.builder();
                    for a in [&qv, &kv_, &vv, &dyv, &yv] {
                        bld.arg(a);
                    }
                    bld.arg(first);
                    bld.arg(&lv);
                    bld.arg(&dq);
                    bld.arg(&s);
                    // SAFETY: argument types and order match `tallow_fa_dq_*`.
                    unsafe { bld.launch(config(tiles(t), b * kv * n_rep)) }.w()?;
                    Ok(())
                })?;
            }
            candle_core::launches::add("flash-attention-dkdv");
            candle_core::launches::add("flash-attention-dq");
            let wrap = |slice: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
                        shape: &candle_core::Shape| {
                Tensor::from_storage(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())),
                    shape.clone(),
                    BackpropOp::none(),
                    false,
                )
            };
            Ok((
                wrap(dq, q.shape()),
                wrap(dk, k.shape()),
                wrap(dv, v.shape()),
            ))
        }
        let ts = [q, k, v, y, dy, lse];
        match q.dtype() {
            DType::BF16 => run::<bf16>(ts, mask, softcap),
            DType::F16 => run::<f16>(ts, mask, softcap),
            dt => candle_core::bail!("flash attention: {dt:?} (bf16 / f16 only)"),
        }
    }
}
