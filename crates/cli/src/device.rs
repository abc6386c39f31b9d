//! `--device` and `--dtype` values.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};

/// auto | cpu | cuda | cuda:N. `auto` picks CUDA device 0 when this binary has CUDA support and a
/// GPU answers, else the CPU.
pub fn parse_device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(if cfg!(feature = "cuda") {
            Device::new_cuda(0).unwrap_or(Device::Cpu)
        } else {
            Device::Cpu
        }),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal: usize = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .with_context(|| format!("--device {s}: `{n}` is not a GPU number"))?,
                None => 0,
            };
            if !cfg!(feature = "cuda") {
                bail!(
                    "--device {s}: this tallow was built without CUDA support; rebuild with \
                     `cargo build --release --features cuda` (see README, \"CUDA\")"
                );
            }
            let dev = Device::new_cuda(ordinal)
                .with_context(|| format!("--device {s}: cannot open the GPU"))?;
            Ok(dev)
        }
        other => bail!("--device {other}: expected auto, cpu, cuda or cuda:N"),
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
