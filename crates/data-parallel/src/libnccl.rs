//! NCCL's C API, loaded at run time from `libnccl.so.2` (dlopen) the first time a collective
//! over GPUs is asked for, rather than linked: a CUDA build then starts, trains and runs the
//! doctor on one GPU without NCCL installed, and only `--nproc N` on GPUs (or a launcher's CUDA
//! ranks) and the doctor's multi-GPU line need it. A missing library is an error that says where
//! to get it.
//!
//! Only functions every NCCL 2.x exports are bound, with the ABI of NCCL's `nccl.h`:
//! `ncclUniqueId` is 128 bytes passed by value, `ncclComm_t` an opaque pointer, `cudaStream_t`
//! the driver's `CUstream`, the data-type and reduction enums C `int`s.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::bootstrap::ID_BYTES;

/// `ncclUniqueId`: rank 0's bootstrap address, which every rank passes to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; ID_BYTES],
}

/// `ncclComm_t`.
pub type Comm = *mut c_void;
/// `cudaStream_t` (the same handle as the driver's `CUstream`).
pub type Stream = *mut c_void;

/// `ncclDataType_t` values used here.
pub const UINT8: c_int = 1;
pub const FLOAT32: c_int = 7;
/// `ncclRedOp_t::ncclSum`.
pub const SUM: c_int = 0;

/// The names tried, in order: the runtime soname, then the development link.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Where a user gets NCCL: the end of the error when it does not load.
pub const HOW_TO_GET_IT: &str = "NCCL is needed only for more than one GPU: `pip install \
     nvidia-nccl-cu13` (nvidia-nccl-cu12 for CUDA 12) and add its site-packages/nvidia/nccl/lib \
     to LD_LIBRARY_PATH, or install Debian/Ubuntu's libnccl2 (NVIDIA's CUDA repository)";

type Ret = c_int;

/// The loaded library and the functions tallow calls.
pub struct Lib {
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Ret,
    pub comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Ret,
    pub comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Ret,
    pub comm_abort: unsafe extern "C" fn(Comm) -> Ret,
    pub all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Ret,
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Ret,
    pub group_start: unsafe extern "C" fn() -> Ret,
    pub group_end: unsafe extern "C" fn() -> Ret,
    get_error_string: unsafe extern "C" fn(Ret) -> *const c_char,
    get_version: unsafe extern "C" fn(*mut c_int) -> Ret,
    /// Kept loaded for the life of the process (the function pointers above point into it).
    _lib: libloading::Library,
}

/// The process's NCCL, loaded on first use; the error says which names were tried and why
/// each failed, and where to get NCCL.
pub fn get() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Lib, String> {
    let mut tried = Vec::new();
    for name in NAMES {
        // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib, name),
            Err(e) => {
                // libloading's own text is "dlopen failed"; dlerror's is in its source.
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                tried.push(why);
            }
        }
    }
    Err(format!(
        "NCCL did not load ({}). {HOW_TO_GET_IT}",
        tried.join("; ")
    ))
}

fn bind(lib: libloading::Library, name: &str) -> Result<Lib, String> {
    // SAFETY: each symbol is given the signature NCCL 2.x's nccl.h declares for it.
    unsafe {
        macro_rules! sym {
            ($s:literal) => {
                *lib.get(concat!($s, "\0").as_bytes())
                    .map_err(|e| format!("{name} has no {} ({e}): is it NCCL 2.x?", $s))?
            };
        }
        Ok(Lib {
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_init_all: sym!("ncclCommInitAll"),
            comm_abort: sym!("ncclCommAbort"),
            all_reduce: sym!("ncclAllReduce"),
            all_gather: sym!("ncclAllGather"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            get_error_string: sym!("ncclGetErrorString"),
            get_version: sym!("ncclGetVersion"),
            _lib: lib,
        })
    }
}

impl Lib {
    /// `Ok` for `ncclSuccess`, else the result's name and NCCL's own text for it.
    pub fn check(&self, call: &str, result: Ret) -> Result<(), String> {
        if result == 0 {
            return Ok(());
        }
        let name = match result {
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            _ => "ncclResult",
        };
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any value.
        let text = unsafe {
            let p = (self.get_error_string)(result);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(format!(
            "{call} failed: {name} ({result}): {text} (run with NCCL_DEBUG=WARN, or INFO, for \
             NCCL's own account)"
        ))
    }

    /// NCCL's version as `major.minor.patch` (`ncclGetVersion`'s code is
    /// major * 10000 + minor * 100 + patch from 2.9 on).
    pub fn version(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        if unsafe { (self.get_version)(&mut v) } != 0 {
            return "unknown".into();
        }
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    }

    /// A new unique id (rank 0, or the `--nproc` parent): this process then hosts NCCL's
    /// bootstrap root until the ranks have joined.
    pub fn unique_id(&self) -> Result<[u8; ID_BYTES], String> {
        let mut id = UniqueId {
            internal: [0; ID_BYTES],
        };
        // SAFETY: writes the 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        // c_char is i8 on x86-64 and u8 on aarch64: the bytes either way.
        Ok(id.internal.map(|c| c as u8))
    }
}

/// The id as NCCL takes it.
pub fn id_of(bytes: [u8; ID_BYTES]) -> UniqueId {
    UniqueId {
        internal: bytes.map(|b| b as c_char),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the library is (the CUDA build's NCCL wheel on LD_LIBRARY_PATH), it loads, says
    /// its version, and makes an id without a GPU; where it is not, the error names the
    /// library and how to get it. Either way the answer is checked.
    #[test]
    fn loads_or_says_how_to_get_it() {
        match get() {
            Ok(lib) => {
                let v = lib.version();
                assert!(v.starts_with("2."), "NCCL version {v}");
                let id = lib.unique_id().expect("ncclGetUniqueId");
                assert!(id.iter().any(|&b| b != 0), "an all-zero id");
                let err = lib.check("ncclAllReduce", 4).unwrap_err();
                assert!(err.contains("ncclInvalidArgument (4)"), "{err}");
            }
            Err(e) => {
                assert!(e.contains("libnccl.so.2"), "{e}");
                assert!(e.contains("nvidia-nccl-cu13"), "{e}");
            }
        }
    }
}
