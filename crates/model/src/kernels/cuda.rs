//! tallow's own CUDA kernels (`kernels/tallow.cu`), compiled to PTX by build.rs and loaded once
//! per device by Candle (`CudaDevice::get_or_load_custom_func`, module name "tallow").

/// PTX of `kernels/tallow.cu` for `CUDA_COMPUTE_CAP` (default 80).
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/tallow.ptx"));

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
