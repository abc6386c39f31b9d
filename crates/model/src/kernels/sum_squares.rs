//! The sum of the squares of many f32 tensors as one op: the gradient norm of
//! `tallow_trainer::grads::clip_grad_norm` on the CUDA path, where Candle's ops took a square,
//! a sum and an add per gradient (42 launches per decoder layer for 14 LoRA factors). On CUDA
//! one kernel per [`TENSORS`] tensors (`kernels/sum_squares.cuh`: f32 sums per thread, a fixed
//! tree per block, the blocks' sums added in order by the last block, so the same bits from run
//! to run); the CPU body is its twin, summing in f64 (the two agree to f32's rounding of a sum,
//! what `tallow doctor`'s "sum of squares" check bounds).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

type R<T> = candle_core::Result<T>;

/// Tensors per launch (`TALLOW_SQ_TENSORS` in kernels/sum_squares.cuh).
pub const TENSORS: usize = 32;

/// Σ over `ts` of Σ x², a 0-d f32 tensor on their device: one op per [`TENSORS`] tensors,
/// added. `ts`: f32, contiguous, on one device, at least one.
pub fn sum_squares(ts: &[Tensor]) -> R<Tensor> {
    let mut total: Option<Tensor> = None;
    for chunk in ts.chunks(TENSORS) {
        for t in chunk {
            if t.dtype() != DType::F32 || !t.is_contiguous() {
                candle_core::bail!(
                    "sum of squares: f32 contiguous tensors only ({:?})",
                    t.dtype()
                );
            }
        }
        let op = SumSquares {
            rest: chunk[1..].to_vec(),
        };
        // the first tensor carries the op (Candle hands its storage to the body), the rest
        // are read from the op
        let s = chunk[0].apply_op1_no_bwd(&op)?;
        total = Some(match total {
            None => s,
            Some(t) => (t + s)?,
        });
    }
    total.ok_or_else(|| candle_core::Error::Msg("sum of squares of no tensors".into()))
}

struct SumSquares {
    rest: Vec<Tensor>,
}

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> R<(CpuStorage, Shape)> {
        let first = super::fused::data::<f32>(s, l, "sum of squares")?;
        let mut sum: f64 = first.iter().map(|&v| (v as f64) * (v as f64)).sum();
        for t in &self.rest {
            let (st, tl) = t.storage_and_layout();
            let candle_core::Storage::Cpu(c) = &*st else {
                candle_core::bail!("sum of squares: the tensors are not all on the CPU");
            };
            let v = super::fused::data::<f32>(c, tl, "sum of squares")?;
            sum += v.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
        }
        Ok((CpuStorage::F32(vec![sum as f32]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> R<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;

        /// `TallowSqTable` of kernels/sum_squares.cuh.
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Table {
            t: [u64; TENSORS],
            start: [u64; TENSORS + 1],
            count: u64,
        }
        // SAFETY: a #[repr(C)] struct of u64 arrays, laid out as the kernel's C struct (device
        // pointers as 64-bit integers).
        unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for Table {}

        const THREADS: usize = 256;
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let guards: Vec<_> = self.rest.iter().map(|t| t.storage_and_layout()).collect();
        let mut views = vec![super::cuda::view::<f32>(s, l, "sum of squares")?];
        for (st, tl) in &guards {
            let candle_core::Storage::Cuda(c) = &**st else {
                candle_core::bail!("sum of squares: the tensors are not all on CUDA");
            };
            views.push(super::cuda::view::<f32>(c, tl, "sum of squares")?);
        }
        let mut table = Table {
            t: [0; TENSORS],
            start: [0; TENSORS + 1],
            count: views.len() as u64,
        };
        let mut events = Vec::with_capacity(views.len());
        let mut total = 0usize;
        for (j, v) in views.iter().enumerate() {
            let (ptr, event) = v.device_ptr(&stream);
            events.push(event);
            table.t[j] = ptr;
            table.start[j] = total as u64;
            total += v.len();
        }
        table.start[views.len()] = total as u64;
        if total == 0 {
            let zero = dev.alloc_zeros::<f32>(1)?;
            return Ok((
                candle_core::CudaStorage::wrap_cuda_slice(zero, dev),
                Shape::from(()),
            ));
        }
        // SAFETY: the kernel's last block writes it.
        let mut out = unsafe { dev.alloc::<f32>(1)? };
        {
            let blocks = total.div_ceil(THREADS).min(1024);
            // SAFETY: every one of the `blocks` partial sums is written before it is read.
            let mut partials = unsafe { dev.alloc::<f32>(blocks)? };
            let mut held = super::cuda::tickets(&dev, 1)?;
            let func = super::cuda::func(&dev, "tallow_sum_squares_f32")?;
            let mut b = func.builder();
            b.arg(&table);
            b.arg(&mut partials);
            b.arg(held.slice_mut());
            b.arg(&mut out);
            let cfg = super::cuda::Grid::Rows {
                rows: blocks,
                threads: THREADS as u32,
            }
            .config();
            // SAFETY: argument types and order match `tallow_sum_squares_f32`; the table's
            // `count` pointers each hold start[j + 1] - start[j] f32 elements on this device
            // (their storages stay locked until after the launch); partials holds `blocks`
            // floats; the ticket is zero (and left zero, the kernel resets it).
            unsafe { b.launch(cfg) }.w()?;
        }
        drop(events);
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from(()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The twin against a plain f64 sum of squares over 70 tensors (3 ops: 32, 32, 6),
    /// within f32's rounding; a tensor left out or squared twice is off by far more.
    #[test]
    fn sum_of_squares_over_chunks_of_tensors() -> R<()> {
        let dev = candle_core::Device::Cpu;
        let ts: Vec<Tensor> = (0..70)
            .map(|i| {
                let n = 1 + (i * 37) % 200;
                Tensor::arange(0f32, n as f32, &dev)?
                    .affine(0.01, i as f64 * 0.1)?
                    .sin()
            })
            .collect::<R<_>>()?;
        let got = sum_squares(&ts)?.to_scalar::<f32>()? as f64;
        let want: f64 = ts
            .iter()
            .map(|t| {
                t.to_vec1::<f32>()
                    .map(|v| v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())
            })
            .sum::<R<f64>>()?;
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        let c0 = candle_core::launches::count_on_this_thread();
        let _ = sum_squares(&ts)?;
        // 3 ops and the 2 adds of their sums
        assert_eq!(candle_core::launches::count_on_this_thread() - c0, 5);
        Ok(())
    }
}
