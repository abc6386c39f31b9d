//! Finding a usable GPU without linking CUDA, and handing the command to `tallow-cuda`.
//!
//! tallow ships as two binaries installed side by side: `tallow`, the CPU build, which links no
//! CUDA library and so starts anywhere, and `tallow-cuda`, the same program built with
//! `--features cuda` (`scripts/build_cuda.sh`), which links libcublas, libcurand, libnvrtc and the
//! driver and cannot even start where one of them is missing. `tallow --device cuda` (or `auto`
//! with a GPU present) checks here, by loading them at run time, that the driver answers, has a
//! device, is new enough for the CUDA version `tallow-cuda` was built with, and that every library
//! `tallow-cuda` needs (read from its ELF header) loads; then it replaces itself with `tallow-cuda`
//! and the same arguments. Anything missing is named in one message. docs/cuda.md says why this
//! design rather than a patched Candle with cudarc's `dynamic-loading`.

// The CUDA build runs CUDA itself: the hand-off half of this module is the CPU build's.
#![cfg_attr(feature = "cuda", allow(dead_code))]

use std::ffi::{c_char, c_int, c_uint, CStr, OsString};
use std::path::{Path, PathBuf};

/// The CUDA binary's file name, looked up beside the running `tallow`.
pub const CUDA_BINARY: &str = "tallow-cuda";

/// Set in `tallow-cuda`'s environment by the hand-off.
pub const HANDED_OFF: &str = "TALLOW_HANDED_OFF";

/// What the driver reports about one device.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub name: String,
    /// (major, minor)
    pub compute_capability: (i32, i32),
    pub total_bytes: usize,
    /// Whether the device supports stream-ordered memory pools (`cuMemAllocAsync`, which
    /// Candle's allocations and tallow's peak-memory readings rely on).
    pub memory_pools: bool,
}

/// What the driver reports: its CUDA version and the devices it sees.
#[derive(Debug, Clone)]
pub struct DriverInfo {
    /// `cuDriverGetVersion`: 1000 * major + 10 * minor (13000 = CUDA 13.0).
    pub cuda_version: i32,
    pub devices: Vec<GpuInfo>,
}

/// CUDA version number `v` (13000) as text ("13.0").
pub fn cuda_version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

type CuResult = c_int;

/// Asks the driver (`libcuda.so.1`, loaded at run time) for its version and devices.
/// Err: what is missing, as a sentence.
pub fn probe_driver() -> Result<DriverInfo, String> {
    // SAFETY: loading the NVIDIA driver library runs its initializers, which is what every CUDA
    // program does at start-up.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| {
        format!(
            "no NVIDIA driver: libcuda.so.1 cannot be loaded ({e}); install the NVIDIA driver \
             (`nvidia-smi` must work)"
        )
    })?;
    // SAFETY: the signatures are the CUDA driver API's (cuda.h), unchanged since CUDA 4.
    unsafe {
        let sym = |name: &str| format!("the driver's libcuda.so.1 lacks `{name}`");
        let cu_init: libloading::Symbol<unsafe extern "C" fn(c_uint) -> CuResult> =
            lib.get(b"cuInit\0").map_err(|_| sym("cuInit"))?;
        let version: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> CuResult> = lib
            .get(b"cuDriverGetVersion\0")
            .map_err(|_| sym("cuDriverGetVersion"))?;
        let count: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> CuResult> = lib
            .get(b"cuDeviceGetCount\0")
            .map_err(|_| sym("cuDeviceGetCount"))?;
        let get: libloading::Symbol<unsafe extern "C" fn(*mut c_int, c_int) -> CuResult> =
            lib.get(b"cuDeviceGet\0").map_err(|_| sym("cuDeviceGet"))?;
        let name: libloading::Symbol<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult> =
            lib.get(b"cuDeviceGetName\0")
                .map_err(|_| sym("cuDeviceGetName"))?;
        let attr: libloading::Symbol<unsafe extern "C" fn(*mut c_int, c_int, c_int) -> CuResult> =
            lib.get(b"cuDeviceGetAttribute\0")
                .map_err(|_| sym("cuDeviceGetAttribute"))?;
        let mem: libloading::Symbol<unsafe extern "C" fn(*mut usize, c_int) -> CuResult> = lib
            .get(b"cuDeviceTotalMem_v2\0")
            .map_err(|_| sym("cuDeviceTotalMem_v2"))?;

        let mut v: c_int = 0;
        if version(&mut v) != 0 {
            return Err(
                "the NVIDIA driver does not report its version (cuDriverGetVersion failed)".into(),
            );
        }
        let rc = cu_init(0);
        if rc != 0 {
            return Err(format!(
                "the NVIDIA driver (CUDA {}) failed to initialize (cuInit error {rc}{}); check \
                 `nvidia-smi` and that /dev/nvidia* are visible (containers: --gpus)",
                cuda_version_text(v),
                if rc == 100 {
                    ": no CUDA-capable device"
                } else {
                    ""
                }
            ));
        }
        let mut n: c_int = 0;
        if count(&mut n) != 0 {
            return Err(
                "the NVIDIA driver cannot count its devices (cuDeviceGetCount failed)".into(),
            );
        }
        let mut devices = Vec::new();
        for ordinal in 0..n {
            let mut dev: c_int = 0;
            if get(&mut dev, ordinal) != 0 {
                continue;
            }
            let mut buf = [0 as c_char; 256];
            name(buf.as_mut_ptr(), buf.len() as c_int, dev);
            let (mut major, mut minor) = (0, 0);
            // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
            attr(&mut major, 75, dev);
            attr(&mut minor, 76, dev);
            let mut pools = 0;
            // CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
            attr(&mut pools, 115, dev);
            let mut total = 0usize;
            mem(&mut total, dev);
            devices.push(GpuInfo {
                name: CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned(),
                compute_capability: (major, minor),
                total_bytes: total,
                memory_pools: pools != 0,
            });
        }
        Ok(DriverInfo {
            cuda_version: v,
            devices,
        })
    }
}

/// The CUDA binary beside the running one (`$TALLOW_CUDA` overrides, for tests and odd installs).
pub fn cuda_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TALLOW_CUDA") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.join(CUDA_BINARY))
}

/// The shared libraries an ELF64 executable names (`DT_NEEDED`), in order. None when the file is
/// not a little-endian ELF64 with a dynamic section.
pub fn needed_libraries(bytes: &[u8]) -> Option<Vec<String>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    // e_ident: magic, class 2 (64-bit), data 1 (little-endian)
    if bytes.get(..4)? != b"\x7fELF" || bytes.get(4)? != &2 || bytes.get(5)? != &1 {
        return None;
    }
    let (phoff, phentsize, phnum) = (
        u64_at(0x20)? as usize,
        u16_at(0x36)? as usize,
        u16_at(0x38)?,
    );
    // Program headers: (p_type, p_offset, p_vaddr, p_filesz)
    let headers: Vec<(u32, u64, u64, u64)> = (0..phnum as usize)
        .map(|i| {
            let h = phoff + i * phentsize;
            Some((u32_at(h)?, u64_at(h + 8)?, u64_at(h + 16)?, u64_at(h + 32)?))
        })
        .collect::<Option<_>>()?;
    const PT_LOAD: u32 = 1;
    const PT_DYNAMIC: u32 = 2;
    let &(_, dyn_off, _, dyn_size) = headers.iter().find(|h| h.0 == PT_DYNAMIC)?;
    // Dynamic entries: (d_tag, d_val) pairs of u64 up to DT_NULL.
    let mut needed = Vec::new();
    let mut strtab_vaddr = None;
    for e in (dyn_off..dyn_off + dyn_size).step_by(16) {
        let (tag, val) = (u64_at(e as usize)?, u64_at(e as usize + 8)?);
        match tag {
            0 => break,                    // DT_NULL
            1 => needed.push(val),         // DT_NEEDED: offset into the string table
            5 => strtab_vaddr = Some(val), // DT_STRTAB: its virtual address
            _ => {}
        }
    }
    let strtab_vaddr = strtab_vaddr?;
    let &(_, off, vaddr, _) = headers
        .iter()
        .find(|h| h.0 == PT_LOAD && h.2 <= strtab_vaddr && strtab_vaddr < h.2 + h.3)?;
    let strtab = (strtab_vaddr - vaddr + off) as usize;
    needed
        .iter()
        .map(|&o| {
            let start = strtab + o as usize;
            let len = bytes.get(start..)?.iter().position(|&b| b == 0)?;
            Some(String::from_utf8_lossy(&bytes[start..start + len]).into_owned())
        })
        .collect()
}

/// The libraries of `needed` that cannot be loaded here.
pub fn missing_libraries(needed: &[String]) -> Vec<String> {
    needed
        .iter()
        // SAFETY: loads (and drops) a shared library, as the dynamic loader would at start-up.
        .filter(|lib| unsafe { libloading::Library::new(lib.as_str()) }.is_err())
        .cloned()
        .collect()
}

/// The CUDA major version a list of needed libraries implies (libcublas.so.13 -> 13).
pub fn cuda_major_of(libs: &[String]) -> Option<i32> {
    libs.iter()
        .find_map(|l| l.strip_prefix("libcublas.so.").and_then(|v| v.parse().ok()))
}

/// The CUDA toolkit version a `tallow-cuda` binary records (`tallow-cuda-toolkit:13.0;`), as
/// 1000 * major + 10 * minor (the driver's numbering).
pub fn toolkit_of(bytes: &[u8]) -> Option<i32> {
    const MARK: &[u8] = b"tallow-cuda-toolkit:";
    let at = bytes.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let end = at + bytes[at..].iter().take(16).position(|&b| b == b';')?;
    let text = std::str::from_utf8(&bytes[at..end]).ok()?;
    let (major, minor) = text.split_once('.')?;
    Some(major.parse::<i32>().ok()? * 1000 + minor.parse::<i32>().ok()? * 10)
}

/// Lowest driver branch per CUDA major (NVIDIA's CUDA toolkit release notes, table 3).
fn min_driver(version: i32) -> &'static str {
    match version {
        13000.. => "580",
        12080.. => "570",
        12060.. => "560",
        12040.. => "550",
        12000.. => "525",
        _ => "a matching one",
    }
}

/// Everything `--device cuda:N` needs, checked in order; the first thing missing as one sentence.
/// Ok: the CUDA binary to run and what the driver said.
pub fn check_cuda(ordinal: usize) -> Result<(PathBuf, DriverInfo), String> {
    let driver = probe_driver()?;
    if driver.devices.is_empty() {
        return Err(format!(
            "the NVIDIA driver (CUDA {}) sees no GPU; check `nvidia-smi` and CUDA_VISIBLE_DEVICES",
            cuda_version_text(driver.cuda_version)
        ));
    }
    if ordinal >= driver.devices.len() {
        return Err(format!(
            "there is no GPU {ordinal}: the driver sees {} (cuda:0 to cuda:{})",
            driver.devices.len(),
            driver.devices.len() - 1
        ));
    }
    let binary = cuda_binary().ok_or("cannot locate the running tallow binary")?;
    if !binary.is_file() {
        return Err(format!(
            "this tallow is the CPU build, and its CUDA build `{CUDA_BINARY}` is not installed \
             beside it ({} is missing); build it with `scripts/build_cuda.sh` and copy \
             target/release/{CUDA_BINARY} there",
            binary.display()
        ));
    }
    let bytes =
        std::fs::read(&binary).map_err(|e| format!("cannot read {}: {e}", binary.display()))?;
    let needed = needed_libraries(&bytes);
    // PTX from toolkit X.Y is JIT-compiled only by a driver for CUDA >= X.Y; without the marker
    // (a build by other means), the major version of its cuBLAS.
    let required = toolkit_of(&bytes)
        .or_else(|| cuda_major_of(needed.as_deref().unwrap_or_default()).map(|m| m * 1000));
    if let Some(required) = required {
        if driver.cuda_version < required {
            let driver_major = driver.cuda_version / 1000;
            // scripts/build_cuda.sh fetches CUDA 12.4 itself; older drivers need a toolkit.
            let recipe = if driver.cuda_version >= 12040 && driver_major == 12 {
                "`CUDA_MAJOR=12 scripts/build_cuda.sh`".to_string()
            } else {
                format!(
                    "`CUDA_ROOT=/usr/local/cuda-{driver_major}.x scripts/build_cuda.sh` with a \
                     toolkit no newer than the driver"
                )
            };
            return Err(format!(
                "the NVIDIA driver supports CUDA {} but {} was built with CUDA {}, which needs \
                 driver >= {}; update the driver, or build with a CUDA {driver_major} toolkit: \
                 {recipe} (docs/cuda.md)",
                cuda_version_text(driver.cuda_version),
                binary.display(),
                cuda_version_text(required),
                min_driver(required),
            ));
        }
    }
    let needed = needed.ok_or_else(|| {
        format!(
            "{} is not a Linux x86-64/aarch64 executable",
            binary.display()
        )
    })?;
    let missing = missing_libraries(&needed);
    if !missing.is_empty() {
        let major = cuda_major_of(&needed).unwrap_or(13);
        return Err(format!(
            "{} needs CUDA libraries that cannot be loaded: {}; add the folder that holds them to \
             LD_LIBRARY_PATH (a CUDA toolkit's lib64, or a Python environment's \
             site-packages/nvidia/cu{major}/lib)",
            binary.display(),
            missing.join(", "),
        ));
    }
    Ok((binary, driver))
}

/// Replaces this process with `binary` and this process's own arguments. Returns only on failure.
pub fn hand_off(binary: &Path) -> String {
    use std::os::unix::process::CommandExt;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    // The CPU build has said which device `auto` chose; the CUDA build need not say it again.
    let err = std::process::Command::new(binary)
        .args(args)
        .env(HANDED_OFF, "1")
        .exec();
    format!("cannot start {}: {err}", binary.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_libraries_this_test_binary_needs() {
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let libs = needed_libraries(&exe).expect("an ELF64 with a dynamic section");
        assert!(
            libs.iter().any(|l| l.starts_with("libc.so")),
            "libc.so.6 among {libs:?}"
        );
        assert!(missing_libraries(&libs).is_empty());
    }

    #[test]
    fn not_an_elf_is_none() {
        assert!(needed_libraries(b"#!/bin/sh\necho hi\n").is_none());
        assert!(needed_libraries(b"\x7fELF").is_none());
    }

    #[test]
    fn toolkit_marker_is_found_in_the_bytes() {
        let bin = b"\x7fELF....tallow-cuda-toolkit:12.4;....";
        assert_eq!(toolkit_of(bin), Some(12040));
        assert_eq!(toolkit_of(b"tallow-cuda-toolkit:13.0;"), Some(13000));
        assert_eq!(toolkit_of(b"no marker"), None);
        assert_eq!(toolkit_of(b"tallow-cuda-toolkit:garbage"), None);
    }

    #[test]
    fn cuda_major_comes_from_cublas() {
        let libs = vec!["libcurand.so.10".to_string(), "libcublas.so.13".to_string()];
        assert_eq!(cuda_major_of(&libs), Some(13));
        assert_eq!(cuda_major_of(&["libc.so.6".to_string()]), None);
        assert_eq!(cuda_version_text(12040), "12.4");
    }
}
