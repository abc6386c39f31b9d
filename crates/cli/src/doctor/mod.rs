//! `tallow doctor`: what this build is, what the machine has, and whether every op of a
//! training step gives the CPU's answer on the chosen device; with the `nccl` feature and two
//! or more GPUs, also an NCCL all-reduce across all of them. The first thing to run on a new
//! GPU; exit 1 when any check fails.
//!
//! - this file: the command, the build and driver lines, the report and its JSON;
//! - [`ops`]: every op of a training step on the device against the CPU reference;
//! - [`nccl`]: the all-reduce over every GPU.
//!
//! The driver probe it lists the GPUs with is [`crate::gpu`]'s, which `--device cuda` uses to
//! hand a command to `tallow-cuda`.

mod nccl;
mod ops;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use tallow_trainer::memory::human_bytes;

use crate::args::DoctorArgs;
use crate::device::{parse_device, parse_dtype};
use crate::gpu;
use nccl::GpuCheck;
use ops::{self_test, Report};

/// What this binary was built with.
fn build() -> serde_json::Value {
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "cuda": cfg!(feature = "cuda"),
        "nccl": cfg!(feature = "nccl"),
        // The PTX target of the CUDA kernels (build-time CUDA_COMPUTE_CAP; 80 by default).
        "cuda_compute_cap": option_env!("CUDA_COMPUTE_CAP").unwrap_or(if cfg!(feature = "cuda") { "80" } else { "" }),
        "cuda_toolkit": toolkit(),
        // What tallow's own kernels are compiled to (SASS targets, PTX for the rest).
        "cuda_kernels": kernel_targets(),
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
fn kernel_targets() -> &'static str {
    tallow_model::kernels::cuda::TARGETS
}

#[cfg(not(feature = "cuda"))]
fn kernel_targets() -> &'static str {
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
    let all_reduce = nccl::check();
    let (nccl_status, nccl_line) = GpuCheck::line(&all_reduce);
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
                "{}  {:<40} max |err| {:<10.3e} tol {:<8.1e} (output {}{})",
                if c.ok { "ok  " } else { "FAIL" },
                c.name,
                c.max_abs_err,
                c.tol,
                c.output,
                c.note
                    .as_ref()
                    .map(|n| format!("; {n}"))
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
