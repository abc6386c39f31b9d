//! AdamW's update of one parameter group as two ops over its flat f32 buffers (the optimizer is
//! `tallow_trainer::optim::adamw`): the moments updated in place ([`adamw_moments`]), then the
//! new parameters ([`adamw_param`]). On CUDA each is one kernel of `kernels/tallow.cu`
//! (`tallow_adamw_moments_f32`, `tallow_adamw_param_f32`) where Candle's tensor ops took 13
//! launches; on the CPU their twins here, one pass each. Both do the IEEE operations of the
//! tensor-op form (`optim::adamw::adamw_math`, torch's single-tensor AdamW) in the same order,
//! Candle's scalar products included (`t * c` is `t * c + 0`), so every path gives the same
//! bits (tested on the CPU; `tallow doctor`'s "adamw 3 steps" on a GPU).

use candle_core::{CpuStorage, Layout, Shape, Tensor};
use rayon::prelude::*;

type R<T> = candle_core::Result<T>;

/// The scalars of one AdamW step, in f32 as Candle's affine takes them (`T::from_f64`).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub beta1: f32,
    /// 1 - beta1 (computed in f64, then rounded)
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// 1 / sqrt(1 - beta2^t)
    pub inv_bias_correction2_sqrt: f32,
    pub eps: f32,
    /// lr / (1 - beta1^t)
    pub step_size: f32,
    /// 1 - lr * weight_decay, None without weight decay
    pub decay: Option<f32>,
}

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// Candle's CPU affine: x * mul + add, rounded apart.
#[inline(always)]
fn affine(x: f32, mul: f32, add: f32) -> f32 {
    x * mul + add
}

/// In place: `mv` (2, n) f32 = [m; v] <- [m b1 + g (1 - b1); v b2 + g² (1 - b2)], `g` (n) f32.
pub fn adamw_moments(mv: &Tensor, g: &Tensor, k: &AdamWStep) -> R<()> {
    mv.inplace_op2(&g.contiguous()?, &Moments(*k))
}

/// The new parameters (n) f32 from `p` (n) f32 and the updated `mv` (2, n):
/// p' - step_size m / (sqrt(v) / sqrt(1 - b2^t) + eps), p' = p (1 - lr wd) with weight decay.
pub fn adamw_param(p: &Tensor, mv: &Tensor, k: &AdamWStep) -> R<Tensor> {
    p.contiguous()?.apply_op2_no_bwd(mv, &Param(*k))
}

struct Moments(AdamWStep);

/// (n, the contiguous offsets of mv) for mv (2, n) and g (n), both f32.
fn moment_dims(mvl: &Layout, gl: &Layout) -> R<(usize, (usize, usize))> {
    let n = gl.shape().elem_count();
    if mvl.shape().dims() != [2, n] {
        candle_core::bail!("adamw moments: {:?} for a gradient of {n}", mvl.shape());
    }
    match mvl.contiguous_offsets() {
        Some(o) => Ok((n, o)),
        None => candle_core::bail!("adamw moments: must be contiguous"),
    }
}

impl candle_core::InplaceOp2 for Moments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(&self, mv: &mut CpuStorage, mvl: &Layout, g: &CpuStorage, gl: &Layout) -> R<()> {
        let (n, (a, b)) = moment_dims(mvl, gl)?;
        let g = super::fused::data::<f32>(g, gl, "adamw gradient")?;
        let CpuStorage::F32(mv) = mv else {
            candle_core::bail!("adamw moments: must be f32");
        };
        let (m, v) = mv[a..b].split_at_mut(n);
        let k = &self.0;
        m.par_chunks_mut(CHUNK)
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|((m, v), g)| {
                for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(g) {
                    *m = affine(*m, k.beta1, 0.0) + affine(g, k.one_minus_beta1, 0.0);
                    *v = affine(*v, k.beta2, 0.0) + affine(g * g, k.one_minus_beta2, 0.0);
                }
            });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        mv: &mut candle_core::CudaStorage,
        mvl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> R<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let (n, (a, b)) = moment_dims(mvl, gl)?;
        let dev = mv.device().clone();
        let gv = super::cuda::view::<f32>(g, gl, "adamw gradient")?;
        let mut mvv = mv.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
        if n == 0 {
            return Ok(());
        }
        let k = &self.0;
        let func = crate::kernels::cuda::func(&dev, "tallow_adamw_moments_f32")?;
        let mut bld = func.builder();
        bld.arg(&mut mvv);
        bld.arg(&gv);
        bld.arg(&n);
        bld.arg(&k.beta1);
        bld.arg(&k.one_minus_beta1);
        bld.arg(&k.beta2);
        bld.arg(&k.one_minus_beta2);
        let cfg = super::cuda::Grid::Elems(n).config();
        // SAFETY: argument types and order match `tallow_adamw_moments_f32`.
        unsafe { bld.launch(cfg) }.w()?;
        Ok(())
    }
}

struct Param(AdamWStep);

impl Param {
    /// n, for p (n) and mv (2, n) (each read where it is checked to be contiguous).
    fn elems(&self, pl: &Layout, mvl: &Layout) -> R<usize> {
        let n = pl.shape().elem_count();
        if mvl.shape().dims() != [2, n] {
            candle_core::bail!("adamw param: moments {:?} for {n} elements", mvl.shape());
        }
        Ok(n)
    }
}

impl candle_core::CustomOp2 for Param {
    fn name(&self) -> &'static str {
        "adamw-param"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        pl: &Layout,
        mv: &CpuStorage,
        mvl: &Layout,
    ) -> R<(CpuStorage, Shape)> {
        let n = self.elems(pl, mvl)?;
        let p = super::fused::data::<f32>(p, pl, "adamw param")?;
        let mv = super::fused::data::<f32>(mv, mvl, "adamw moments")?;
        let (m, v) = mv.split_at(n);
        let k = &self.0;
        let mut out = super::fused::uninit::<f32>(n);
        out.par_chunks_mut(CHUNK)
            .zip(
                p.par_chunks(CHUNK)
                    .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK))),
            )
            .for_each(|(o, (p, (m, v)))| {
                for (o, (&p, (&m, &v))) in o.iter_mut().zip(p.iter().zip(m.iter().zip(v))) {
                    let p = match k.decay {
                        Some(d) => affine(p, d, 0.0),
                        None => p,
                    };
                    let denom = affine(v.sqrt(), k.inv_bias_correction2_sqrt, k.eps);
                    *o = p - affine(m / denom, k.step_size, 0.0);
                }
            });
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        mv: &candle_core::CudaStorage,
        mvl: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        use candle_core::cuda_backend::WrapErr;
        let n = self.elems(pl, mvl)?;
        let dev = p.device().clone();
        let pv = super::cuda::view::<f32>(p, pl, "adamw param")?;
        let mvv = super::cuda::view::<f32>(mv, mvl, "adamw moments")?;
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(n)? };
        if n > 0 {
            let k = &self.0;
            let func = crate::kernels::cuda::func(&dev, "tallow_adamw_param_f32")?;
            let (decay, decay_on) = (k.decay.unwrap_or(1.0), k.decay.is_some() as i32);
            let mut bld = func.builder();
            bld.arg(&pv);
            bld.arg(&mvv);
            bld.arg(&out);
            bld.arg(&n);
            bld.arg(&decay);
            bld.arg(&decay_on);
            bld.arg(&k.inv_bias_correction2_sqrt);
            bld.arg(&k.eps);
            bld.arg(&k.step_size);
            let cfg = super::cuda::Grid::Elems(n).config();
            // SAFETY: argument types and order match `tallow_adamw_param_f32`.
            unsafe { bld.launch(cfg) }.w()?;
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(n),
        ))
    }
}

/// Members of one [`adamw_members`] launch (`TALLOW_ADAM_MEMBERS` in kernels/tallow.cu).
pub const MEMBERS: usize = 32;

/// AdamW's update of up to [`MEMBERS`] f32 parameters of one group as one op, with no copies:
/// each parameter and its f32 gradient (contiguous) read where they are and the parameter
/// written in place; `mv` the group's (2, len) moments, these members' elements from `base` on,
/// in order; `scale` (one f32 on their device: the gradient clipping's coefficient) multiplies
/// each gradient element first, one rounding, as the clipping's own multiply would. On CUDA
/// one kernel (`tallow_adamw_members_f32`, each element
/// `tallow_adamw_moments_f32`'s then `tallow_adamw_param_f32`'s operations); on the CPU (the
/// CUDA path's twin) the two ops' CPU bodies, the new values set into the parameters outside
/// the launch count, so one launch is counted as on the GPU.
pub fn adamw_members(
    mv: &Tensor,
    base: usize,
    params: &[&candle_core::Var],
    grads: &[Tensor],
    k: &AdamWStep,
    scale: Option<&Tensor>,
) -> R<()> {
    if let Some(s) = scale {
        if s.dtype() != candle_core::DType::F32 || s.elem_count() != 1 {
            candle_core::bail!("adamw members: the gradient scale must be one f32");
        }
    }
    if params.len() != grads.len() || params.is_empty() || params.len() > MEMBERS {
        candle_core::bail!(
            "adamw members: {} parameters, {} gradients (1 to {MEMBERS})",
            params.len(),
            grads.len()
        );
    }
    let mut start = vec![0usize];
    for (p, g) in params.iter().zip(grads) {
        if p.dtype() != candle_core::DType::F32 || g.dtype() != candle_core::DType::F32 {
            candle_core::bail!("adamw members: f32 parameters and gradients only");
        }
        if p.shape() != g.shape() || !p.is_contiguous() || !g.is_contiguous() {
            candle_core::bail!(
                "adamw members: parameter {:?} and gradient {:?} (contiguous, one shape)",
                p.shape(),
                g.shape()
            );
        }
        start.push(start.last().expect("start") + p.elem_count());
    }
    let op = Members {
        params: params.iter().map(|p| p.as_tensor().clone()).collect(),
        grads: grads.to_vec(),
        start,
        base,
        k: *k,
        scale: scale.cloned(),
        new: std::sync::Mutex::new(Vec::new()),
    };
    mv.inplace_op1(&op)?;
    let new = std::mem::take(&mut *op.new.lock().expect("new values lock"));
    if !new.is_empty() {
        // the CPU twin: its new values into the parameters, not a launch of the CUDA body
        candle_core::launches::uncounted(|| -> R<()> {
            for (p, v) in params.iter().zip(new) {
                p.set(&Tensor::from_vec(v, p.shape(), p.device())?)?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

struct Members {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    /// Each member's first element in the slice, then the slice's length.
    start: Vec<usize>,
    /// The slice's first element in the group's flat buffers.
    base: usize,
    k: AdamWStep,
    /// The gradient clipping's coefficient (one f32), or none.
    scale: Option<Tensor>,
    /// The CPU twin's new parameter values, set by the caller.
    new: std::sync::Mutex<Vec<Vec<f32>>>,
}

impl Members {
    /// len, and mv's contiguous offset, for the (2, len) moments holding this slice.
    fn dims(&self, mvl: &Layout) -> R<(usize, usize)> {
        let (len, total) = match mvl.shape().dims() {
            [2, len] => (*len, *self.start.last().expect("start")),
            d => candle_core::bail!("adamw members: moments {d:?}, not (2, len)"),
        };
        if self.base + total > len {
            candle_core::bail!(
                "adamw members: elements {}..{} of moments of {len}",
                self.base,
                self.base + total
            );
        }
        match mvl.contiguous_offsets() {
            Some((o, _)) => Ok((len, o)),
            None => candle_core::bail!("adamw members: the moments must be contiguous"),
        }
    }
}

impl candle_core::InplaceOp1 for Members {
    fn name(&self) -> &'static str {
        "adamw-members"
    }

    fn cpu_fwd(&self, mv: &mut CpuStorage, mvl: &Layout) -> R<()> {
        let (len, o) = self.dims(mvl)?;
        let CpuStorage::F32(mv) = mv else {
            candle_core::bail!("adamw members: the moments must be f32");
        };
        let (m, v) = mv[o..o + 2 * len].split_at_mut(len);
        let k = &self.k;
        let sc = match &self.scale {
            Some(s) => {
                Some(candle_core::launches::uncounted(|| s.flatten_all()?.to_vec1::<f32>())?[0])
            }
            None => None,
        };
        let mut new = Vec::with_capacity(self.params.len());
        for (j, (p, g)) in self.params.iter().zip(&self.grads).enumerate() {
            // host reads of the twin's inputs, not launches of the CUDA body
            let (p, g) = candle_core::launches::uncounted(|| -> R<_> {
                Ok((
                    p.flatten_all()?.to_vec1::<f32>()?,
                    g.flatten_all()?.to_vec1::<f32>()?,
                ))
            })?;
            let (a, b) = (self.base + self.start[j], self.base + self.start[j + 1]);
            let mut out = vec![0f32; p.len()];
            // the two ops' CPU bodies, element by element (`Moments`, then `Param`)
            for (i, o) in out.iter_mut().enumerate() {
                let (m, v) = (&mut m[a + i], &mut v[a + i]);
                let g = match sc {
                    Some(c) => g[i] * c,
                    None => g[i],
                };
                *m = affine(*m, k.beta1, 0.0) + affine(g, k.one_minus_beta1, 0.0);
                *v = affine(*v, k.beta2, 0.0) + affine(g * g, k.one_minus_beta2, 0.0);
                let p = match k.decay {
                    Some(d) => affine(p[i], d, 0.0),
                    None => p[i],
                };
                let denom = affine(v.sqrt(), k.inv_bias_correction2_sqrt, k.eps);
                *o = p - affine(*m / denom, k.step_size, 0.0);
            }
            debug_assert_eq!(b - a, out.len());
            new.push(out);
        }
        *self.new.lock().expect("new values lock") = new;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, mv: &mut candle_core::CudaStorage, mvl: &Layout) -> R<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        use candle_core::Storage;

        /// `TallowAdamMembers` of kernels/tallow.cu.
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Table {
            p: [u64; MEMBERS],
            g: [u64; MEMBERS],
            start: [u64; MEMBERS + 1],
            count: u64,
        }
        // SAFETY: a #[repr(C)] struct of u64 arrays, laid out as the kernel's C struct (device
        // pointers as 64-bit integers).
        unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for Table {}

        let (len, o) = self.dims(mvl)?;
        let total = *self.start.last().expect("start");
        let dev = mv.device().clone();
        let stream = dev.cuda_stream();
        let mut table = Table {
            p: [0; MEMBERS],
            g: [0; MEMBERS],
            start: [0; MEMBERS + 1],
            count: self.params.len() as u64,
        };
        for (j, s) in self.start.iter().enumerate() {
            table.start[j] = *s as u64;
        }
        // the storages stay locked (read) and their pointers' guards alive until the launch
        let guards: Vec<_> = self
            .params
            .iter()
            .chain(&self.grads)
            .chain(&self.scale)
            .map(|t| t.storage_and_layout())
            .collect();
        let mut views = Vec::with_capacity(guards.len());
        for (st, l) in guards.iter() {
            let Storage::Cuda(c) = &**st else {
                candle_core::bail!("adamw members: a parameter or gradient is not on CUDA");
            };
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("adamw members: not contiguous");
            };
            views.push(c.as_cuda_slice::<f32>()?.slice(a..b));
        }
        let mut events = Vec::with_capacity(views.len());
        let mut scale = 0u64; // null: no scale
        for (j, view) in views.iter().enumerate() {
            let (ptr, event) = view.device_ptr(&stream);
            events.push(event);
            let n = self.params.len();
            if j < n {
                table.p[j] = ptr;
            } else if j < 2 * n {
                table.g[j - n] = ptr;
            } else {
                scale = ptr; // the clipping coefficient, after the gradients
            }
        }
        if total == 0 {
            return Ok(());
        }
        let mut mvv = mv.as_cuda_slice_mut::<f32>()?.slice_mut(o..o + 2 * len);
        let k = &self.k;
        let (decay, decay_on) = (k.decay.unwrap_or(1.0), k.decay.is_some() as i32);
        let func = crate::kernels::cuda::func(&dev, "tallow_adamw_members_f32")?;
        let mut bld = func.builder();
        bld.arg(&table);
        bld.arg(&mut mvv);
        bld.arg(&len);
        bld.arg(&self.base);
        bld.arg(&k.beta1);
        bld.arg(&k.one_minus_beta1);
        bld.arg(&k.beta2);
        bld.arg(&k.one_minus_beta2);
        bld.arg(&decay);
        bld.arg(&decay_on);
        bld.arg(&k.inv_bias_correction2_sqrt);
        bld.arg(&k.eps);
        bld.arg(&k.step_size);
        bld.arg(&scale);
        let cfg = super::cuda::Grid::Elems(total).config();
        // SAFETY: argument types and order match `tallow_adamw_members_f32`; `scale` is null
        // or one f32 on this device (checked by `adamw_members`); the table holds
        // `count` members whose parameter and gradient buffers hold start[j + 1] - start[j]
        // f32 elements each (checked by `adamw_members`), on this device and stream; the
        // moments hold (2, len) with base + total <= len (`dims`). The parameters are written
        // through their pointers while their storages are locked for reading: the kernel is the
        // only writer, queued on the one stream every op of theirs is queued on.
        unsafe { bld.launch(cfg) }.w()?;
        drop(events);
        Ok(())
    }
}
