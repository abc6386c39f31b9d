//! `tallow doctor`: what this build is, what the machine has, and whether every op of a
//! training step gives the CPU's answer on the chosen device; with the `nccl` feature and two
//! or more GPUs, also an NCCL all-reduce across all of them. The first thing to run on a new
//! GPU; exit 1 when any check fails.

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use tallow_dist::gpucheck::GpuCheck;
use tallow_trainer::doctor::{self_test, Report};
use tallow_trainer::memory::human_bytes;

use crate::args::DoctorArgs;
use crate::device::{parse_device, parse_dtype};
use crate::gpu;

/// What this binary was built with.
fn build() -> serde_json::Value {
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "cuda": cfg!(feature = "cuda"),
        "nccl": cfg!(feature = "nccl"),
        // The PTX target of the CUDA kernels (build-time CUDA_COMPUTE_CAP; 80 by default).
        "cuda_compute_cap": option_env!("CUDA_COMPUTE_CAP").unwrap_or(if cfg!(feature = "cuda") { "80" } else { "" }),
        "cuda_toolkit": toolkit(),
        "tf32_f32_matmuls": tf32(),
    })
}

#[cfg(feature = "cuda")]
fn toolkit() -> &'static str {
    // The marker, not just the version: printing it keeps it in the binary for the CPU build.
    tallow_model::kernels::cuda::TOOLKIT_MARKER
        .trim_start_matches("tallow-cuda-toolkit:")
        .trim_end_matches(';')
}

#[cfg(not(feature = "cuda"))]
fn toolkit() -> &'static str {
    ""
}

#[cfg(feature = "cuda")]
fn tf32() -> bool {
    candle_core::cuda::gemm_reduced_precision_f32()
}

#[cfg(not(feature = "cuda"))]
fn tf32() -> bool {
    false
}

/// The driver and its GPUs, as `libcuda.so.1` reports them (or why there is none).
fn driver() -> serde_json::Value {
    match gpu::probe_driver() {
        Ok(d) => serde_json::json!({
            "cuda_version": gpu::cuda_version_text(d.cuda_version),
            "devices": d.devices.iter().map(|g| serde_json::json!({
                "name": g.name,
                "compute_capability": format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
                "memory_bytes": g.total_bytes,
                "memory_pools": g.memory_pools,
            })).collect::<Vec<_>>(),
        }),
        Err(why) => serde_json::json!({ "missing": why }),
    }
}

/// f32 elements of the multi-GPU all-reduce: 4 MiB per GPU, past NCCL's small-message
/// protocols, and not a multiple of any chunk size.
#[cfg(feature = "nccl")]
const NCCL_CHECK_ELEMENTS: usize = (1 << 20) + 3;

/// How long the multi-GPU all-reduce may take: a broken link between GPUs makes NCCL hang,
/// not fail.
#[cfg(feature = "nccl")]
const NCCL_CHECK_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The multi-GPU check: an NCCL all-reduce of known values over every visible GPU, from this
/// process, compared with the exact sum ([`tallow_dist::gpucheck`]).
#[cfg(feature = "nccl")]
fn nccl_check() -> std::result::Result<GpuCheck, String> {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    // On its own thread, so a hang is reported rather than waited out; a hung thread ends with
    // the process.
    std::thread::spawn(move || {
        let _ = tx.send(
            tallow_dist::nccl::check_all_gpus(NCCL_CHECK_ELEMENTS).map_err(|e| e.to_string()),
        );
    });
    match rx.recv_timeout(NCCL_CHECK_WAIT) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => Err(format!(
            "no result within {} s: NCCL hangs between these GPUs (NCCL_DEBUG=INFO says where; \
             NCCL_P2P_DISABLE=1 tries without peer-to-peer copies)",
            NCCL_CHECK_WAIT.as_secs()
        )),
        Err(RecvTimeoutError::Disconnected) => Err("the check panicked".into()),
    }
}

#[cfg(not(feature = "nccl"))]
fn nccl_check() -> std::result::Result<GpuCheck, String> {
    Ok(GpuCheck::Skipped(tallow_dist::gpucheck::NOT_BUILT.into()))
}

pub fn run(a: DoctorArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtypes: Vec<DType> = if a.dtype.is_empty() {
        if device.is_cuda() {
            vec![DType::F32, DType::BF16]
        } else {
            vec![DType::F32]
        }
    } else {
        a.dtype
            .iter()
            .map(|d| parse_dtype(d, &device))
            .collect::<Result<_>>()?
    };
    let (build, driver) = (build(), driver());
    if !a.json {
        println!(
            "build     tallow {} ({})",
            build["version"].as_str().unwrap_or(""),
            if cfg!(feature = "cuda") {
                format!(
                    "CUDA, PTX for compute {}",
                    build["cuda_compute_cap"].as_str().unwrap_or("")
                )
            } else {
                "CPU build".into()
            }
        );
        match &driver["missing"] {
            serde_json::Value::String(why) => println!("driver    none: {why}"),
            _ => {
                println!(
                    "driver    CUDA {}",
                    driver["cuda_version"].as_str().unwrap_or("?")
                );
                for (i, g) in driver["devices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    println!(
                        "gpu {i}     {}, compute {}, {}, memory pools: {}",
                        g["name"].as_str().unwrap_or("?"),
                        g["compute_capability"].as_str().unwrap_or("?"),
                        human_bytes(g["memory_bytes"].as_u64().unwrap_or(0)),
                        g["memory_pools"]
                    );
                }
            }
        }
        if !cfg!(feature = "cuda") {
            match gpu::cuda_binary() {
                Some(p) if p.is_file() => {
                    println!("cuda      {} (CUDA build beside this one)", p.display())
                }
                _ => println!(
                    "cuda      no tallow-cuda beside this binary: --device cuda is unavailable"
                ),
            }
        }
        println!("device    {}", describe(&device));
        println!();
    }
    let report: Report = self_test(&device, &dtypes);
    let nccl = nccl_check();
    let (nccl_status, nccl_line) = GpuCheck::line(&nccl);
    let ok = report.ok && nccl_status != "FAIL";
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["ok"] = ok.into();
        v["build"] = build;
        v["driver"] = driver;
        v["device"] = describe(&device).into();
        v["nccl"] = serde_json::json!({ "status": nccl_status, "line": nccl_line });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for c in &report.checks {
            println!(
                "{}  {:<40} max |err| {:<10.3e} tol {:.1e}{}",
                if c.ok { "ok  " } else { "FAIL" },
                c.name,
                c.max_abs_err,
                c.tol,
                c.note
                    .as_ref()
                    .map(|n| format!("  ({n})"))
                    .unwrap_or_default()
            );
        }
        println!("{nccl_status:<4}  {nccl_line}");
        let ran = report.checks.len() + usize::from(nccl_status != "skip");
        let failed =
            report.checks.iter().filter(|c| !c.ok).count() + usize::from(nccl_status == "FAIL");
        println!();
        println!("{ran} checks, {failed} failed");
    }
    if !report.ok {
        bail!("tallow doctor: a check failed on {}", describe(&device));
    }
    if !ok {
        bail!("tallow doctor: {nccl_line}");
    }
    Ok(())
}

fn describe(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        _ => "other".into(),
    }
}
