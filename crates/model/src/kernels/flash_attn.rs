//! Chunked attention on CUDA for bf16 / f16 q, k, v as kernels of tallow's own
//! (`kernels/flash_attn.cuh`, in the manner of FlashAttention-2): the forward is one launch and
//! the backward two (dK / dV, then dQ), whatever the sequence length, where the tensor-op path
//! of [`super::chunked`] takes about nine per block of query rows forward alone. Nothing (T, T)
//! is stored; the graph keeps q, k, v, the output and each row's f32 log-sum-exp, as it does for
//! the tensor-op path. Grouped-query heads read their kv head directly; packed rows and sliding
//! windows are each position's first visible key ([`AttentionMask::first_keys`]); Gemma 2's
//! soft-cap is applied in the kernels. The kernels read and write rows through strides, so the
//! decoder layer hands v over where its projection wrote it, (B, T, KV, D), and takes y back
//! as (B, T, H, D) ([`attention_tokens`]): no head transposes forward or backward.
//!
//! The CPU twin is the tensor-op path itself (`chunked::generic_fwd` / `generic_bwd`), whose
//! arithmetic the kernels follow (the header says where they round): under
//! `TALLOW_CUDA_PATHS_ON_CPU` it computes the values (and the layouts' copies, uncounted) and
//! the op counts the kernels' launches (the forward as the op, the backward's two by
//! [`count_backward`]); `tallow doctor` compares the kernels on a GPU with the CPU.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::chunked::{generic_bwd, generic_fwd, take_output, AttentionMask, Saved};

type R<T> = candle_core::Result<T>;

/// Query positions per block of the twin's tensor-op path: the kernels' tile, so that what the
/// twin allocates at a time (a block's scores, B x H x 16 x T) stays near the kernels' nothing,
/// and a `TALLOW_CUDA_PATHS_ON_CPU` run's peak near the GPU's.
pub const TWIN_ROWS: usize = 16;

/// Whether chunked attention over these q (B, KV, n_rep T, D), k, v takes the kernels: the
/// dispatch rule's [`super::dispatch::flash_attention`] for q's device, dtype and head dim, with
/// k and v of q's dtype.
pub fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let d = q.dims().last().copied().unwrap_or(0);
    super::dispatch::flash_attention(super::dispatch::Backend::of(q.device()), q.dtype(), d)
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
}

/// How the output is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Out {
    /// (B, KV, n_rep T, D), as `chunked_attention` returns it.
    Heads,
    /// (B, T, H, D), as the decoder layer's o_proj reads it.
    Tokens,
}

/// softmax(cap(q kᵀ) + mask) v through the kernels, y (B, T, H, D): the decoder layer's entry.
/// q: (B, KV, n_rep T, D) carrying the scale, k: (B, KV, T, D), v: (B, KV, T, D), contiguous or
/// the transposed view of a contiguous (B, T, KV, D), which the kernels read as it is (its
/// gradient comes back contiguous in v's shape).
pub fn attention_tokens(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    softcap: Option<f64>,
) -> R<Tensor> {
    let tracked = q.track_op() || k.track_op() || v.track_op();
    attention(q, k, v, mask, softcap, tracked, Out::Tokens)
}

/// Chunked attention, y (B, KV, n_rep T, D) as [`super::chunked::chunked_attention_capped`]
/// returns it: through the kernels where [`takes`] says so, else that function (the CPU kernel
/// or the tensor-op path).
pub fn chunked_attention_capped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    softcap: Option<f64>,
) -> R<Tensor> {
    if !takes(q, k, v) {
        return super::chunked::chunked_attention_capped(q, k, v, mask, softcap);
    }
    let tracked = q.track_op() || k.track_op() || v.track_op();
    attention(q, k, v, mask, softcap, tracked, Out::Heads)
}

/// v laid out (B, T, KV, D) under its (B, KV, T, D) shape.
fn tokens_major(v: &Tensor) -> bool {
    !v.is_contiguous() && v.transpose(1, 2).is_ok_and(|t| t.is_contiguous())
}

/// [`attention_tokens`] with the output laid out as `out`.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    softcap: Option<f64>,
    tracked: bool,
    out: Out,
) -> R<Tensor> {
    let (q, k) = (q.contiguous()?, k.contiguous()?);
    let v = if v.is_contiguous() || tokens_major(v) {
        v.clone()
    } else {
        v.contiguous()?
    };
    let (b, kv, r, d) = q.dims4()?;
    let (kb, kkv, t, kd) = k.dims4()?;
    // the kernels index by these sizes: anything else would read past a tensor
    if (kb, kkv, kd) != (b, kv, d) || v.shape() != k.shape() || t == 0 || r % t != 0 {
        candle_core::bail!(
            "chunked attention: q {:?}, k {:?}, v {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    if mask.first_keys().dims() != [b, t] {
        candle_core::bail!("chunked attention: the mask is not {b} rows of {t} positions");
    }
    let h = kv * (r / t);
    if b * h > 65535 {
        candle_core::bail!(
            "chunked attention: {b} rows x {h} heads is past the kernels' grid (65535); use a \
             smaller micro-batch"
        );
    }
    // The twin computes the output before the op (its forward hands a copy over).
    let (y, lse) = if q.device().is_cpu() {
        let (y, lse) = candle_core::launches::uncounted(|| -> R<(Tensor, Tensor)> {
            let (y, lse) = generic_fwd(
                &q.detach(),
                &k.detach(),
                &v.detach().contiguous()?,
                mask,
                TWIN_ROWS,
                softcap,
            )?;
            let y = match out {
                Out::Heads => y,
                Out::Tokens => y.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()?,
            };
            Ok((y, lse))
        })?;
        (Some(y), Some(lse))
    } else {
        (None, None)
    };
    let op = FlashAttention {
        mask: mask.clone(),
        softcap,
        out,
        y: Mutex::new(y),
        lse: Mutex::new(lse),
    };
    if tracked {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)
    }
}

struct FlashAttention {
    mask: AttentionMask,
    softcap: Option<f64>,
    out: Out,
    /// The twin's output, taken by the forward.
    y: Mutex<Option<Tensor>>,
    /// (B, KV, n_rep T) f32, taken by the backward.
    lse: Mutex<Option<Tensor>>,
}

/// The backward's two launches (dK / dV, dQ), counted where they run and where the twin runs.
fn count_backward() {
    candle_core::launches::add("flash-attention-dkdv");
    candle_core::launches::add("flash-attention-dq");
}

/// The output's shape for q (B, KV, n_rep T, D) and k (B, KV, T, D).
#[cfg(feature = "cuda")]
fn out_shape(out: Out, ql: &Layout, kl: &Layout) -> R<Shape> {
    let (b, kv, r, d) = ql.shape().dims4()?;
    let t = kl.shape().dims4()?.2;
    Ok(match out {
        Out::Heads => ql.shape().clone(),
        Out::Tokens => Shape::from((b, t, kv * (r / t), d)),
    })
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
        take_output(&self.y, "flash attention")
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
        let shape = out_shape(self.out, ql, kl)?;
        let (y, lse) = cuda::forward((q, ql), (k, kl), (v, vl), &self.mask, self.softcap, &shape)?;
        *self.lse.lock().expect("lse lock") = Some(lse);
        Ok((y, shape))
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
            let (dq, dk, dv) = candle_core::launches::uncounted(|| -> R<_> {
                let (b, kv, r, d) = q.dims4()?;
                // the twin's layouts: y and dY heads-major, v contiguous
                let heads = |x: &Tensor| -> R<Tensor> {
                    match self.out {
                        Out::Heads => Ok(x.clone()),
                        Out::Tokens => x.transpose(1, 2)?.contiguous()?.reshape((b, kv, r, d)),
                    }
                };
                let (y, dy, v) = (heads(y)?, heads(&dy)?, v.contiguous()?);
                let saved = Saved {
                    q,
                    k,
                    v: &v,
                    y: &y,
                    dy: &dy,
                    lse: &lse,
                };
                generic_bwd(saved, &self.mask, TWIN_ROWS, self.softcap)
            })?;
            count_backward();
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        #[cfg(feature = "cuda")]
        {
            let (dq, dk, dv) = cuda::backward([q, k, v, y, &dy, &lse], &self.mask, self.softcap)?;
            Ok((Some(dq), Some(dk), Some(dv)))
        }
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("flash attention: a device tensor without the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Shape, Tensor};
    use half::{bf16, f16};

    use super::{count_backward, AttentionMask, R};
    use crate::kernels::cuda::{func, storage, tensor, view};

    const OP: &str = "flash attention";

    /// Query rows (and keys) per tile of the kernels (`FA_M`, `FA_N`).
    const TILE: usize = 16;

    /// The kernels' `FaStrides`: row (b, head, p) at b * b + head * h + p * p.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct FaStrides {
        b: u64,
        h: u64,
        p: u64,
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
        q: FaStrides,
        k: FaStrides,
        v: FaStrides,
        y: FaStrides,
        dv: FaStrides,
    }

    // SAFETY: plain #[repr(C)] structs of u64 and f32 fields, laid out as the kernels' C structs
    // (four u64, two f32, then five triples of u64: 160 bytes, 8-aligned, no padding).
    unsafe impl DeviceRepr for FaShape {}

    /// A rank-4 tensor's strides over its first three dims; its rows must be contiguous.
    fn strides(l: &Layout, what: &str) -> R<FaStrides> {
        let st = l.stride();
        if st.len() != 4 || (st[3] != 1 && l.dims()[3] > 1) {
            candle_core::bail!("flash attention: {what}'s rows are not contiguous ({st:?})");
        }
        Ok(FaStrides {
            b: st[0] as u64,
            h: st[1] as u64,
            p: st[2] as u64,
        })
    }

    /// The strides of a contiguous tensor of `shape` (rank 4).
    fn contiguous(shape: &Shape) -> R<FaStrides> {
        strides(&Layout::contiguous(shape), "an output")
    }

    /// A tensor's elements from its layout's start (its strides say where its rows are).
    fn strided<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> R<CudaView<'a, T>> {
        Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
    }

    /// (B, KV, n_rep, T, D) of q (B, KV, n_rep T, D) and k (B, KV, T, D).
    fn dims(ql: &Layout, kl: &Layout) -> R<(usize, usize, usize, usize, usize)> {
        let (b, kv, r, d) = ql.shape().dims4()?;
        let t = kl.shape().dims4()?.2;
        Ok((b, kv, r / t, t, d))
    }

    /// The problem; the strides of q, k, v, y and dv.
    fn shape(
        dims: (usize, usize, usize, usize, usize),
        softcap: Option<f64>,
        [q, k, v, y, dv]: [FaStrides; 5],
    ) -> FaShape {
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
            q,
            k,
            v,
            y,
            dv,
        }
    }

    fn config(t: usize, groups: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (t.div_ceil(TILE) as u32, groups as u32, 1),
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
    fn with_first<X>(mask: &AttentionMask, f: impl FnOnce(&CudaView<'_, u32>) -> R<X>) -> R<X> {
        let (st, l) = mask.first_keys().storage_and_layout();
        f(&view::<u32>(storage(&st, OP)?, l, "attention mask")?)
    }

    /// y (`shape`, q's dtype, contiguous) and lse (B, KV, n_rep T) f32.
    pub(super) fn forward(
        (q, ql): (&CudaStorage, &Layout),
        (k, kl): (&CudaStorage, &Layout),
        (v, vl): (&CudaStorage, &Layout),
        mask: &AttentionMask,
        softcap: Option<f64>,
        out: &Shape,
    ) -> R<(CudaStorage, Tensor)> {
        fn run<T: CudaDType + DeviceRepr>(
            (q, ql): (&CudaStorage, &Layout),
            (k, kl): (&CudaStorage, &Layout),
            (v, vl): (&CudaStorage, &Layout),
            mask: &AttentionMask,
            softcap: Option<f64>,
            out: &Shape,
        ) -> R<(CudaStorage, Tensor)> {
            let dev = q.device().clone();
            let dims = dims(ql, kl)?;
            let (b, kv, n_rep, t, _) = dims;
            let st = [
                strides(ql, "q")?,
                strides(kl, "k")?,
                strides(vl, "v")?,
                contiguous(out)?,
                contiguous(vl.shape())?,
            ];
            let s = shape(dims, softcap, st);
            let (qv, kv_, vv) = (
                strided::<T>(q, ql)?,
                strided::<T>(k, kl)?,
                strided::<T>(v, vl)?,
            );
            let rows = b * kv * n_rep * t;
            // SAFETY: the kernel writes every row of y and every lse.
            let y = unsafe { dev.alloc::<T>(out.elem_count())? };
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
                    unsafe { bld.launch(config(t, b * kv * n_rep)) }.w()?;
                    Ok(())
                })?;
            }
            let lse = tensor(lse, &dev, (b, kv, n_rep * t));
            Ok((CudaStorage::wrap_cuda_slice(y, dev), lse))
        }
        let args = ((q, ql), (k, kl), (v, vl));
        match q.dtype() {
            DType::BF16 => run::<bf16>(args.0, args.1, args.2, mask, softcap, out),
            DType::F16 => run::<f16>(args.0, args.1, args.2, mask, softcap, out),
            dt => candle_core::bail!("flash attention: {dt:?} (bf16 / f16 only)"),
        }
    }

    /// dq, dk and dv, contiguous in q's, k's and v's shapes (v itself may be a tokens-major
    /// view): two launches. `ts`: q, k, v, y, dY (contiguous, y's shape), lse.
    pub(super) fn backward(
        ts: [&Tensor; 6],
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
            let dev = storage(&qs, OP)?.device().clone();
            let dims = dims(ql, kl)?;
            let (b, kv, n_rep, t, _) = dims;
            // dY must lie as y does (the kernels read both with y's strides), q and k as dq and
            // dk will
            if !dyl.is_contiguous() || !yl.is_contiguous() {
                candle_core::bail!("flash attention: y and dY must be contiguous");
            }
            if !ql.is_contiguous() || !kl.is_contiguous() {
                candle_core::bail!("flash attention: q and k must be contiguous");
            }
            let st = [
                contiguous(ql.shape())?,
                contiguous(kl.shape())?,
                strides(vl, "v")?,
                contiguous(yl.shape())?,
                contiguous(vl.shape())?,
            ];
            let s = shape(dims, softcap, st);
            let qv = view::<T>(storage(&qs, OP)?, ql, "attention q")?;
            let kv_ = view::<T>(storage(&ks, OP)?, kl, "attention k")?;
            let vv = strided::<T>(storage(&vs, OP)?, vl)?;
            let yv = view::<T>(storage(&ys, OP)?, yl, "attention y")?;
            let dyv = view::<T>(storage(&dys, OP)?, dyl, "attention dY")?;
            let lv = view::<f32>(storage(&ls, OP)?, ll, "attention lse")?;
            // SAFETY: the kernels write every row of dq, dk and dv.
            let dq = unsafe { dev.alloc::<T>(ql.shape().elem_count())? };
            let dk = unsafe { dev.alloc::<T>(kl.shape().elem_count())? };
            let dv = unsafe { dev.alloc::<T>(vl.shape().elem_count())? };
            let sfx = suffix(q.dtype())?;
            if t > 0 {
                with_first(mask, |first| {
                    // both kernels: q, k, v, dY, y, first, lse, their outputs, the problem
                    let launch = |kernel: &str, outs: &[&CudaSlice<T>], groups: usize| -> R<()> {
                        let f = func(&dev, &format!("tallow_fa_{kernel}_{sfx}"))?;
                        let mut bld = f.builder();
                        for a in [&qv, &kv_, &vv, &dyv, &yv] {
                            bld.arg(a);
                        }
                        bld.arg(first);
                        bld.arg(&lv);
                        for o in outs {
                            bld.arg(*o);
                        }
                        bld.arg(&s);
                        // SAFETY: argument types and order match `tallow_fa_dkdv_*` (outputs
                        // dk, dv) and `tallow_fa_dq_*` (output dq).
                        unsafe { bld.launch(config(t, groups)) }.w()?;
                        Ok(())
                    };
                    launch("dkdv", &[&dk, &dv], b * kv)?;
                    launch("dq", &[&dq], b * kv * n_rep)
                })?;
            }
            count_backward();
            Ok((
                tensor(dq, &dev, ql.shape()),
                tensor(dk, &dev, kl.shape()),
                tensor(dv, &dev, vl.shape()),
            ))
        }
        match ts[0].dtype() {
            DType::BF16 => run::<bf16>(ts, mask, softcap),
            DType::F16 => run::<f16>(ts, mask, softcap),
            dt => candle_core::bail!("flash attention: {dt:?} (bf16 / f16 only)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::R;
    use crate::kernels::chunked::tests::{inputs, max_rel, run, segments};
    use crate::kernels::chunked::{chunked_attention_tensor_ops, AttentionMask};

    /// Under `TALLOW_CUDA_PATHS_ON_CPU`, bf16 chunked attention takes the flash kernels' op
    /// : its forward counts one launch (the tensor-op path it
    /// twins, in blocks of 16 rows, issues about 9 per block: 89 here, 91 with the window and
    /// the cap), its value and gradients are the tensor-op
    /// path's bit for bit, with and without a window and a soft-cap; f32 keeps the tensor-op
    /// path. Dispatching bf16 past the flash op fails the launch count.
    #[test]
    fn bf16_on_the_cuda_path_takes_the_flash_op() -> R<()> {
        let t = 150;
        let segs = segments(t);
        crate::kernels::dispatch::with_cuda_paths_on_cpu(|| -> R<()> {
            for (window, cap) in [(None, None), (Some(20), Some(3.0))] {
                let (qkv, w) = inputs(DType::BF16, t)?;
                let mask = AttentionMask::new(&segs, window, &Device::Cpu)?;
                let (q, k, v) = (qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor());
                let before = candle_core::launches::count_on_this_thread();
                let y = super::chunked_attention_capped(q, k, v, &mask, cap)?;
                let launches = candle_core::launches::count_on_this_thread() - before;
                assert_eq!(launches, 1, "window {window:?} cap {cap:?}");
                let before = candle_core::launches::count_on_this_thread();
                chunked_attention_tensor_ops(q, k, v, &mask, 16, cap)?;
                let generic = candle_core::launches::count_on_this_thread() - before;
                assert!(generic > 10, "{generic}");
                let rows = super::TWIN_ROWS;
                drop(y);
                let got = run(
                    |q, k, v| super::chunked_attention_capped(q, k, v, &mask, cap),
                    &qkv,
                    &w,
                )?;
                let want = run(
                    |q, k, v| chunked_attention_tensor_ops(q, k, v, &mask, rows, cap),
                    &qkv,
                    &w,
                )?;
                for (name, (a, b)) in ["y", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                    let e = max_rel(a, b);
                    assert!(e == 0.0, "window {window:?} cap {cap:?} {name}: {e:e}");
                }
            }
            let (qkv, _) = inputs(DType::F32, t)?;
            let mask = AttentionMask::new(&segs, None, &Device::Cpu)?;
            let before = candle_core::launches::count_on_this_thread();
            super::chunked_attention_capped(
                qkv[0].as_tensor(),
                qkv[1].as_tensor(),
                qkv[2].as_tensor(),
                &mask,
                None,
            )?;
            let f32_launches = candle_core::launches::count_on_this_thread() - before;
            assert!(f32_launches > 1, "f32: {f32_launches}");
            Ok(())
        })
    }

    /// The kernels index by q's, k's, v's and the mask's sizes, so the entry refuses any that
    /// disagree (a mask for other rows, a v of another length) before anything runs. Without
    /// the mask's check the twin fails deep inside ("attn-lse: scores [2, 2, 32, 16] for a
    /// block of 16 x 16") and a GPU's kernels would read past the mask.
    #[test]
    fn sizes_that_disagree_are_refused() -> R<()> {
        crate::kernels::dispatch::with_cuda_paths_on_cpu(|| -> R<()> {
            let t = 40;
            let (qkv, _) = inputs(DType::BF16, t)?;
            let (q, k, v) = (qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor());
            let short = AttentionMask::new(&segments(t)[..1], None, &Device::Cpu)?;
            let e = super::chunked_attention_capped(q, k, v, &short, None).unwrap_err();
            assert!(
                e.to_string().contains("the mask is not 2 rows of 40"),
                "{e}"
            );
            let mask = AttentionMask::new(&segments(t), None, &Device::Cpu)?;
            let v = v.narrow(2, 0, t - 1)?;
            let e = super::attention_tokens(q, k, &v, &mask, None).unwrap_err();
            assert!(e.to_string().contains("chunked attention: q"), "{e}");
            Ok(())
        })
    }

    /// The decoder layer's entry to the flash op (`flash_attn::attention_tokens`): v handed over
    /// as the (B, KV, T, D) view of a (B, T, KV, D) tensor and y returned as (B, T, H, D), one
    /// launch forward and no copy of v, y and the gradients bit for bit those of the heads-major
    /// path (y transposed). Making v contiguous in the entry adds its copy to the launch count
    /// (2).
    #[test]
    fn the_flash_op_reads_v_and_writes_y_tokens_major() -> R<()> {
        let t = 70;
        let segs = segments(t);
        crate::kernels::dispatch::with_cuda_paths_on_cpu(|| -> R<()> {
            let (qkv, w) = inputs(DType::BF16, t)?;
            let (b, kv, r, d) = qkv[0].dims4()?;
            let h = kv * (r / t);
            let mask = AttentionMask::new(&segs, Some(20), &Device::Cpu)?;
            // v as the decoder layer has it: (B, T, KV, D) in memory
            let v_tokens = Var::from_tensor(&qkv[2].transpose(1, 2)?.contiguous()?)?;
            let v_view = v_tokens.transpose(1, 2)?;
            let before = candle_core::launches::count_on_this_thread();
            let y = super::attention_tokens(&qkv[0], &qkv[1], &v_view, &mask, None)?;
            assert_eq!(candle_core::launches::count_on_this_thread() - before, 1);
            assert_eq!(y.dims(), &[b, t, h, d]);
            let w_tokens = w.reshape((b, h, t, d))?.transpose(1, 2)?.contiguous()?;
            let g = (&y * &w_tokens)?.sum_all()?.backward()?;
            let dv_tokens = g.get(&v_tokens).expect("dv").clone(); // (B, T, KV, D)
            let dv_view = dv_tokens.transpose(1, 2)?;
            let want = run(
                |q, k, v| super::chunked_attention_capped(q, k, v, &mask, None),
                &qkv,
                &w,
            )?;
            let y_heads = y.transpose(1, 2)?.reshape((b, kv, r, d))?;
            let got = [
                y_heads,
                g.get(&qkv[0]).expect("dq").clone(),
                g.get(&qkv[1]).expect("dk").clone(),
                dv_view,
            ];
            for (name, (a, b)) in ["y", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                let e = max_rel(a, b);
                assert!(e == 0.0, "{name}: {e:e}");
            }
            Ok(())
        })
    }
}
