//! tallow's own CUDA kernels (`kernels/tallow.cu`), compiled by build.rs into one fatbin (SASS
//! for sm_80 and sm_90, PTX for `CUDA_COMPUTE_CAP`) and loaded once per device by Candle
//! (`CudaDevice::get_or_load_custom_image`, module name "tallow"; the driver picks the SASS
//! for its GPU, or JIT-compiles the PTX).

/// The fatbin of `kernels/tallow.cu`.
pub const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tallow.fatbin"));

/// What [`FATBIN`] holds ("SASS sm_80, sm_90 + PTX compute_80"), for `tallow doctor`.
pub const TARGETS: &str = env!("TALLOW_CUDA_TARGETS");

/// The kernel `name` of [`FATBIN`] on `dev` (the module is loaded on first use).
pub(crate) fn func(
    dev: &candle_core::cuda_backend::CudaDevice,
    name: &str,
) -> Result<candle_core::cuda_backend::CudaFunc> {
    dev.get_or_load_custom_image(name, "tallow", FATBIN)
}

/// The CUDA toolkit that compiled [`PTX`] ("13.0"): the driver must support at least this CUDA
/// version to JIT-compile it.
pub const TOOLKIT: &str = env!("TALLOW_CUDA_TOOLKIT");

/// [`TOOLKIT`] in a form the CPU build finds by scanning this binary's bytes before handing a
/// command over (`tallow-cuda-toolkit:13.0;`). `tallow doctor` prints it, which keeps it linked.
pub const TOOLKIT_MARKER: &str = concat!("tallow-cuda-toolkit:", env!("TALLOW_CUDA_TOOLKIT"), ";");

use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, Layout, Result};

/// The contiguous elements of a kernel's input; `op` names it in the error.
pub(crate) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op}: inputs must be contiguous");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// The CUDA storage inside `st`; `op` names the op in the error.
pub(crate) fn storage<'a>(st: &'a candle_core::Storage, op: &str) -> Result<&'a CudaStorage> {
    match st {
        candle_core::Storage::Cuda(c) => Ok(c),
        _ => candle_core::bail!("{op}: a tensor is not on the CUDA device"),
    }
}

/// A CUDA tensor of `shape` over `slice`, outside the graph (a gradient, a saved statistic).
pub(crate) fn tensor<T: CudaDType>(
    slice: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    dev: &candle_core::cuda_backend::CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> candle_core::Tensor {
    candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}

/// How a kernel's threads are laid out.
#[derive(Clone, Copy)]
pub(crate) enum Grid {
    /// One block of `threads` per row, `rows` blocks.
    Rows { rows: usize, threads: u32 },
    /// A grid-stride loop over `n` work items.
    Elems(usize),
}

impl Grid {
    /// The launch configuration.
    pub(crate) fn config(self) -> LaunchConfig {
        match self {
            Grid::Rows { rows, threads } => LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
            // a grid-stride loop: past 2^30 items each thread takes several
            Grid::Elems(n) => LaunchConfig::for_num_elems(n.min(1 << 30) as u32),
        }
    }

    /// No work: nothing to launch (CUDA refuses an empty grid).
    pub(crate) fn is_empty(self) -> bool {
        match self {
            Grid::Rows { rows, .. } => rows == 0,
            Grid::Elems(n) => n == 0,
        }
    }
}

/// The element types of [`gemm`]: cuBLAS's type tag for each, and the compute type Candle's
/// own matmul of that type uses (f32 accumulation; TF32 / reduced-precision bf16 only where
/// Candle's process-wide switches allow it, `train.tf32`), so a product here rounds as
/// `Tensor::matmul` would.
pub(crate) trait GemmType:
    CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr
{
    const DATA: candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t;
    fn compute() -> candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t;
}

impl GemmType for f32 {
    const DATA: candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t =
        candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
    fn compute() -> candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t {
        use candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t as C;
        if candle_core::cuda_backend::gemm_reduced_precision_f32() {
            C::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            C::CUBLAS_COMPUTE_32F
        }
    }
}

impl GemmType for half::bf16 {
    const DATA: candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t =
        candle_core::cuda_backend::cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
    fn compute() -> candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t {
        use candle_core::cuda_backend::cudarc::cublas::sys::cublasComputeType_t as C;
        if candle_core::cuda_backend::gemm_reduced_precision_bf16() {
            C::CUBLAS_COMPUTE_32F_FAST_16BF
        } else {
            C::CUBLAS_COMPUTE_32F
        }
    }
}

/// One operand of [`gemm`]: a row-major matrix, used as stored or transposed.
pub(crate) struct Operand<'a, T> {
    pub view: &'a CudaView<'a, T>,
    /// Used transposed: the left operand (M, K) stored as a row-major (K, M), the right one
    /// (K, N) stored as a row-major (N, K) (a linear's weight in x Wᵀ).
    pub t: bool,
}

/// `dst (M, N) := alpha · lhs (M, K) · rhs (K, N) + beta · dst`, row-major, in one cuBLAS
/// call (`cublasGemmEx`), the twin of the CPU's `gemm_into` (`super::lora_linear`). cuBLAS is
/// column-major: a row-major (M, N) is its (N, M), so it computes dstᵀ = rhsᵀ · lhsᵀ, rhs's
/// buffer as its A and lhs's as its B. `beta` 0: dst's old contents are not read.
pub(crate) fn gemm<T: GemmType>(
    dev: &candle_core::cuda_backend::CudaDevice,
    dst: &mut impl candle_core::cuda_backend::cudarc::driver::DevicePtrMut<T>,
    lhs: Operand<'_, T>,
    rhs: Operand<'_, T>,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::cublas::{result, sys::cublasOperation_t as Op};
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::WrapErr;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if lhs.view.len() < m * k || rhs.view.len() < k * n || dst.len() < m * n {
        candle_core::bail!("gemm: ({m}, {k}) x ({k}, {n}) on buffers too short");
    }
    let int = |v: usize| -> Result<i32> {
        i32::try_from(v)
            .map_err(|_| candle_core::Error::Msg(format!("gemm: {v} is past cuBLAS's int")))
    };
    let (transa, lda) = if rhs.t {
        (Op::CUBLAS_OP_T, k)
    } else {
        (Op::CUBLAS_OP_N, n)
    };
    let (transb, ldb) = if lhs.t {
        (Op::CUBLAS_OP_T, m)
    } else {
        (Op::CUBLAS_OP_N, k)
    };
    let blas = dev.cublas_handle();
    let stream = dev.cuda_stream();
    let (a, _ga) = rhs.view.device_ptr(&stream);
    let (b, _gb) = lhs.view.device_ptr(&stream);
    let (c, _gc) = dst.device_ptr_mut(&stream);
    // SAFETY: the buffers hold the (K, N), (M, K) and (M, N) matrices (checked above), the leading
    // dimensions are their row lengths, alpha and beta are f32 as the compute types take them,
    // and all three are on the handle's stream.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            transa,
            transb,
            int(n)?,
            int(m)?,
            int(k)?,
            (&alpha) as *const f32 as *const _,
            a as *const _,
            T::DATA,
            int(lda)?,
            b as *const _,
            T::DATA,
            int(ldb)?,
            (&beta) as *const f32 as *const _,
            c as *mut _,
            T::DATA,
            int(n)?,
            T::compute(),
            candle_core::cuda_backend::cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .w()
}

/// Each device's tickets for kernels whose last block to finish completes the work
/// (`tallow_lora_grad_bf16`, `tallow_sum_squares_f32`): zeros between launches (each such
/// kernel resets the ones it took), grown as needed. Held for a launch by [`tickets`].
static TICKETS: std::sync::Mutex<
    Vec<(
        candle_core::cuda_backend::DeviceId,
        candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
    )>,
> = std::sync::Mutex::new(Vec::new());

/// At least `need` zeroed tickets on `dev`, locked while the caller queues its launch (the
/// device's launches run in order on its one stream, so the next kernel finds them zero).
pub(crate) fn tickets(dev: &candle_core::cuda_backend::CudaDevice, need: usize) -> Result<Tickets> {
    let mut held = TICKETS.lock().expect("tickets lock");
    let id = dev.id();
    let at = match held.iter().position(|(d, t)| *d == id && t.len() >= need) {
        Some(i) => i,
        None => {
            held.retain(|(d, _)| *d != id);
            held.push((id, dev.alloc_zeros::<u32>(need.max(1))?));
            held.len() - 1
        }
    };
    Ok(Tickets { held, at })
}

/// [`tickets`]' lock on one device's tickets.
pub(crate) struct Tickets {
    held: std::sync::MutexGuard<
        'static,
        Vec<(
            candle_core::cuda_backend::DeviceId,
            candle_core::cuda_backend::cudarc::driver::CudaSlice<u32>,
        )>,
    >,
    at: usize,
}

impl Tickets {
    pub(crate) fn slice_mut(
        &mut self,
    ) -> &mut candle_core::cuda_backend::cudarc::driver::CudaSlice<u32> {
        &mut self.held[self.at].1
    }
}
