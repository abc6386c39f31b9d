//! `--device` and `--dtype` values.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};

use crate::gpu;

/// auto | cpu | cuda | cuda:N.
///
/// The CPU build (no `cuda` feature) opens no GPU itself: for `cuda` it checks driver, device and
/// libraries ([`gpu::check_cuda`]) and replaces itself with `tallow-cuda`, or fails naming what
/// is missing. `auto` does the same when a GPU is usable and otherwise picks the CPU; either way it
/// says on stderr which device it chose and why.
pub fn parse_device(spec: &str) -> Result<Device> {
    parse_device_at(spec, 0)
}

/// [`parse_device`] for the rank of local rank `local_rank` of a data-parallel run: `cuda`
/// and `auto` mean that rank's GPU, `cuda:{local_rank}`, or `cuda:0` when the launcher shows
/// each rank one GPU (`srun --gpus-per-task=1` sets CUDA_VISIBLE_DEVICES per task).
pub fn parse_device_at(spec: &str, local_rank: usize) -> Result<Device> {
    let local_rank = match gpu::probe_driver() {
        Ok(d) if d.devices.len() == 1 => 0,
        _ => local_rank,
    };
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(auto(local_rank)),
        "cuda" if local_rank > 0 => {
            open_cuda(local_rank).map_err(|why| anyhow!("--device cuda (rank {local_rank}): {why}"))
        }
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal: usize = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .with_context(|| format!("--device {s}: `{n}` is not a GPU number"))?,
                None => 0,
            };
            open_cuda(ordinal).map_err(|why| anyhow!("--device {s}: {why}"))
        }
        other => bail!("--device {other}: expected auto, cpu, cuda or cuda:N"),
    }
}

/// One line naming a GPU: "NVIDIA H100 80GB HBM3, compute 9.0, 79.1 GiB".
fn describe(g: &gpu::GpuInfo) -> String {
    format!(
        "{}, compute {}.{}, {}",
        g.name,
        g.compute_capability.0,
        g.compute_capability.1,
        tallow_trainer::memory::human_bytes(g.total_bytes as u64)
    )
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> std::result::Result<Device, String> {
    let (binary, _) = gpu::check_cuda(ordinal)?;
    Err(gpu::hand_off(&binary))
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> std::result::Result<Device, String> {
    Device::new_cuda(ordinal).map_err(|e| match gpu::probe_driver() {
        // The driver's own account first (no driver, no device, too old); Candle's error else.
        Err(why) => why,
        Ok(d) if ordinal >= d.devices.len() => format!(
            "there is no GPU {ordinal}: the driver sees {}",
            d.devices.len()
        ),
        Ok(_) => format!("cannot open GPU {ordinal}: {e}"),
    })
}

#[cfg(not(feature = "cuda"))]
fn auto(ordinal: usize) -> Device {
    match gpu::check_cuda(ordinal) {
        Ok((binary, driver)) => {
            eprintln!(
                "tallow: device auto -> cuda:{ordinal} ({}): running {}",
                describe(&driver.devices[ordinal]),
                binary.display()
            );
            let why = gpu::hand_off(&binary);
            eprintln!("tallow: device auto -> cpu: {why}");
            Device::Cpu
        }
        Err(why) => {
            eprintln!("tallow: device auto -> cpu: {why}");
            Device::Cpu
        }
    }
}

#[cfg(feature = "cuda")]
fn auto(ordinal: usize) -> Device {
    match open_cuda(ordinal) {
        Ok(dev) => {
            let name = gpu::probe_driver()
                .ok()
                .and_then(|d| d.devices.get(ordinal).map(describe))
                .unwrap_or_else(|| format!("GPU {ordinal}"));
            if std::env::var_os(gpu::HANDED_OFF).is_none() {
                eprintln!("tallow: device auto -> cuda:{ordinal} ({name})");
            }
            dev
        }
        Err(why) => {
            eprintln!("tallow: device auto -> cpu: {why}");
            Device::Cpu
        }
    }
}

/// auto | f32 | f16 | bf16. `auto` is bf16 on CUDA and f32 on the CPU (where bf16 matmuls are
/// slower than f32 ones).
pub fn parse_dtype(spec: &str, device: &Device) -> Result<DType> {
    Ok(match spec {
        "auto" => {
            if device.is_cuda() {
                DType::BF16
            } else {
                DType::F32
            }
        }
        "f32" | "float32" => DType::F32,
        "f16" | "float16" => DType::F16,
        "bf16" | "bfloat16" => DType::BF16,
        other => bail!("--dtype {other}: expected auto, f32, f16 or bf16"),
    })
}

pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
        _ => "other",
    }
}
