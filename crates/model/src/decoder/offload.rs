//! Host copies of offloaded checkpoint inputs (`train.offload_checkpoints`, see
//! [`crate::decoder::checkpointing`]): [`HostCopy::of`] after a layer's forward, [`HostCopy::back`]
//! before its backward.
//!
//! - **CPU:** the copy is the tensor itself (same storage): the same code path, no saving.
//! - **CUDA** (f32, bf16, f16): the bytes go to page-locked (pinned) host memory by an
//!   asynchronous copy queued on the device's stream, and come back into a fresh device buffer
//!   by another queued copy. Neither waits on the host: stream order alone puts the copy back
//!   after the copy out, and the device buffer the forward made is freed in stream order after
//!   the copy out has read it. Candle's own `to_device` would wait twice per layer (a
//!   device-to-host copy into pageable memory returns only when done, and a host-to-device one
//!   from pageable memory stages through a driver buffer).
//! - **Not overlapped with compute:** the copies share the compute stream. A second stream would
//!   let them overlap, but it switches cudarc into multi-stream mode, which records an event on
//!   every buffer of every kernel launch for the rest of the run.
//!
//! Pinned buffers come from a per-process pool and are reused across layers and steps: pinning
//! memory costs far more than copying it (PyTorch keeps a caching host allocator for the same
//! reason). A buffer goes back to the pool when its copy is dropped, which is after the
//! layer's backward has queued the copy back; the next copy out into it is queued behind that
//! on the same stream, so it cannot overwrite bytes not yet read. The pool keeps the largest
//! set of buffers a step has needed (one per offloaded layer, each rounded up to 2 MiB) until
//! the process ends.

use candle_core::{Device, Tensor};

use crate::error::Result;

/// A checkpointed layer's input, kept off the device between its forward and its backward.
pub(crate) struct HostCopy {
    inner: Inner,
}

enum Inner {
    /// The CPU's tensor itself, or (another device's dtype not handled below) a host tensor.
    Host { tensor: Tensor, device: Device },
    #[cfg(feature = "cuda")]
    Pinned(cuda::Pinned),
}

impl HostCopy {
    /// Queue `x`'s copy to host memory (CUDA: without waiting for it).
    pub(crate) fn of(x: &Tensor) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(device) = x.device() {
            if let Some(p) = cuda::Pinned::of(x, device)? {
                return Ok(Self {
                    inner: Inner::Pinned(p),
                });
            }
        }
        Ok(Self {
            inner: Inner::Host {
                tensor: x.to_device(&Device::Cpu)?,
                device: x.device().clone(),
            },
        })
    }

    /// The tensor again, on the device it came from (CUDA: its copy back queued, not waited for).
    pub(crate) fn back(&self) -> Result<Tensor> {
        match &self.inner {
            Inner::Host { tensor, device } => Ok(tensor.to_device(device)?),
            #[cfg(feature = "cuda")]
            Inner::Pinned(p) => p.back(),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Mutex;

    use candle_core::cuda_backend::cudarc::driver::{
        result, DevicePtr, DevicePtrMut, DeviceRepr, HostSlice, PinnedHostSlice,
    };
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};
    use half::{bf16, f16};

    use crate::error::Result;

    /// Pool buffers are rounded up to this many bytes, so that slightly different sequence
    /// lengths reuse them.
    const ROUND: usize = 2 << 20;

    /// Free pinned buffers, each with the ordinal of the GPU whose context pinned it.
    static POOL: Mutex<Vec<(usize, PinnedHostSlice<u8>)>> = Mutex::new(Vec::new());

    /// A tensor's bytes in a pinned buffer of the pool (returned to it on drop).
    pub(super) struct Pinned {
        buf: Option<PinnedHostSlice<u8>>,
        ordinal: usize,
        bytes: usize,
        shape: Shape,
        dtype: DType,
        device: CudaDevice,
    }

    impl Drop for Pinned {
        fn drop(&mut self) {
            if let Some(buf) = self.buf.take() {
                POOL.lock().expect("pinned pool").push((self.ordinal, buf));
            }
        }
    }

    /// The smallest free buffer of GPU `ordinal`'s context that holds `bytes`, else a new one.
    fn take(device: &CudaDevice, ordinal: usize, bytes: usize) -> Result<PinnedHostSlice<u8>> {
        let mut pool = POOL.lock().expect("pinned pool");
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, (o, b))| *o == ordinal && b.len() >= bytes)
            .min_by_key(|(_, (_, b))| b.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return Ok(pool.swap_remove(i).1);
        }
        drop(pool);
        let len = bytes.div_ceil(ROUND) * ROUND;
        let ctx = device.cuda_stream().context().clone();
        // SAFETY: the buffer is only written by a device copy before anything reads it.
        // Flags 0: ordinary page-locked memory (cudarc's default, write-combined, is slow for
        // the device to write into).
        Ok(unsafe { ctx.alloc_pinned_with_flags::<u8>(len, 0) }
            .map_err(candle_core::Error::wrap)?)
    }

    impl Pinned {
        /// Queues the copy out; None for a dtype not handled here (the caller copies it the
        /// slow way).
        pub(super) fn of(x: &Tensor, device: &CudaDevice) -> Result<Option<Self>> {
            let dtype = x.dtype();
            if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Ok(None);
            }
            let x = x.contiguous()?;
            let bytes = x.elem_count() * dtype.size_in_bytes();
            let ordinal = device.cuda_stream().context().ordinal();
            let mut buf = take(device, ordinal, bytes)?;
            let (storage, layout) = x.storage_and_layout();
            let Storage::Cuda(cuda) = &*storage else {
                unreachable!("a CUDA device's tensor has CUDA storage")
            };
            let (start, end) = layout.contiguous_offsets().expect("made contiguous above");
            match dtype {
                DType::F32 => copy_out::<f32>(cuda, start, end, &mut buf, bytes, device)?,
                DType::BF16 => copy_out::<bf16>(cuda, start, end, &mut buf, bytes, device)?,
                DType::F16 => copy_out::<f16>(cuda, start, end, &mut buf, bytes, device)?,
                _ => unreachable!("checked above"),
            }
            drop(storage);
            Ok(Some(Self {
                buf: Some(buf),
                ordinal,
                bytes,
                shape: x.shape().clone(),
                dtype,
                device: device.clone(),
            }))
        }

        /// Queues the copy back into a new device buffer.
        pub(super) fn back(&self) -> Result<Tensor> {
            let buf = self.buf.as_ref().expect("taken only on drop");
            let n = self.shape.elem_count();
            let storage = match self.dtype {
                DType::F32 => copy_back::<f32>(buf, self.bytes, n, &self.device)?,
                DType::BF16 => copy_back::<bf16>(buf, self.bytes, n, &self.device)?,
                DType::F16 => copy_back::<f16>(buf, self.bytes, n, &self.device)?,
                _ => unreachable!("only these are made"),
            };
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                self.shape.clone(),
                BackpropOp::none(),
                false,
            ))
        }
    }

    /// Elements `start..end` of `cuda` into the first `bytes` of `buf`, queued on the stream.
    fn copy_out<T: CudaDType + DeviceRepr>(
        cuda: &CudaStorage,
        start: usize,
        end: usize,
        buf: &mut PinnedHostSlice<u8>,
        bytes: usize,
        device: &CudaDevice,
    ) -> Result<()> {
        let stream = device.cuda_stream();
        let src = cuda.as_cuda_slice::<T>()?.slice(start..end);
        let (src_ptr, _read) = src.device_ptr(&stream);
        // SAFETY: the buffer holds at least `bytes` = (end - start) elements of T; the stream
        // waits for the buffer's last use (its event) before the copy, and records it after.
        unsafe {
            let (dst, _written) = buf.stream_synced_mut_slice(&stream);
            result::memcpy_dtoh_async(&mut dst[..bytes], src_ptr, stream.cu_stream())
        }
        .map_err(candle_core::Error::wrap)?;
        Ok(())
    }

    /// The first `bytes` of `buf` (n elements of T) into a new device buffer, queued.
    fn copy_back<T: CudaDType + DeviceRepr>(
        buf: &PinnedHostSlice<u8>,
        bytes: usize,
        n: usize,
        device: &CudaDevice,
    ) -> Result<CudaStorage> {
        let stream = device.cuda_stream();
        // SAFETY: every element is written by the copy below before any kernel reads it (both
        // are queued on this stream).
        let mut dst = unsafe { device.alloc::<T>(n) }?;
        {
            let (dst_ptr, _written) = dst.device_ptr_mut(&stream);
            // SAFETY: dst holds n elements = `bytes` bytes; the stream waits for the copy out.
            unsafe {
                let (src, _read) = buf.stream_synced_slice(&stream);
                result::memcpy_htod_async(dst_ptr, &src[..bytes], stream.cu_stream())
            }
            .map_err(candle_core::Error::wrap)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, device.clone()))
    }
}
