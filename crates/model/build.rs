//! With the `cuda` feature: compiles `kernels/tallow.cu` to PTX with nvcc, for compute
//! capability `CUDA_COMPUTE_CAP` (default 80: the driver JIT-compiles it for any newer GPU).
//! Without it: nothing (CPU builds need no CUDA toolkit).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels/tallow.cu");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap = cap
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_");
    let nvcc = match std::env::var_os("CUDA_ROOT").or_else(|| std::env::var_os("CUDA_PATH")) {
        Some(root) => PathBuf::from(root).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    // The toolkit's version, recorded in the binary: PTX from CUDA X.Y needs a driver that
    // supports at least X.Y to JIT it, which the CPU build checks before handing over.
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            let v = text
                .split("release ")
                .nth(1)?
                .split(',')
                .next()?
                .trim()
                .to_string();
            Some(v)
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo::rustc-env=TALLOW_CUDA_TOOLKIT={version}");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("tallow.ptx");
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("-arch=compute_{cap}"),
            "-o",
        ])
        .arg(&out)
        .arg("kernels/tallow.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): the `cuda` feature needs nvcc (set CUDA_ROOT, or use \
                 scripts/build_cuda.sh)",
                nvcc.display()
            )
        });
    assert!(
        status.success(),
        "nvcc failed on kernels/tallow.cu ({status})"
    );
}
