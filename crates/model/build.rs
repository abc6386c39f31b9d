//! With the `cuda` feature: compiles `kernels/tallow.cu` with nvcc into one fatbin holding
//! machine code (SASS) for the GPUs tallow is run on, sm_80 (A100, and by binary compatibility
//! the sm_8x cards) and sm_90 (H100 / H200), so they load the kernels with no JIT compile, and
//! PTX for compute capability `CUDA_COMPUTE_CAP` (default 80), which the driver JIT-compiles for
//! any other GPU (Blackwell, or older cards with `CUDA_COMPUTE_CAP=75`). `TALLOW_CUDA_SASS`
//! ("80,90" by default, "" for none) lists the SASS targets. Without the feature: nothing (CPU
//! builds need no CUDA toolkit).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels/tallow.cu");
    println!("cargo::rerun-if-changed=kernels/lora_gemm.cuh");
    println!("cargo::rerun-if-changed=kernels/sum_squares.cuh");
    println!("cargo::rerun-if-changed=kernels/emulable.cuh");
    println!("cargo::rerun-if-changed=kernels/flash_attn.cuh");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=TALLOW_CUDA_SASS");
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
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("tallow.fatbin");
    let sass = std::env::var("TALLOW_CUDA_SASS").unwrap_or_else(|_| "80,90".into());
    let sms: Vec<&str> = sass
        .split(',')
        .map(|s| s.trim().trim_start_matches("sm_"))
        .filter(|s| !s.is_empty())
        .collect();
    let mut targets: Vec<String> = sms
        .iter()
        .map(|s| format!("arch=compute_{s},code=sm_{s}"))
        .collect();
    targets.push(format!("arch=compute_{cap},code=compute_{cap}"));
    let listed: Vec<String> = sms.iter().map(|s| format!("sm_{s}")).collect();
    let sass_part = if sms.is_empty() {
        String::new()
    } else {
        format!("SASS {} + ", listed.join(", "))
    };
    println!("cargo::rustc-env=TALLOW_CUDA_TARGETS={sass_part}PTX compute_{cap}");
    let mut nvcc_cmd = Command::new(&nvcc);
    nvcc_cmd.args(["--fatbin", "-O3", "-std=c++17"]);
    for t in &targets {
        nvcc_cmd.args(["-gencode", t]);
    }
    let status = nvcc_cmd
        .arg("-o")
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
