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
