//! Frozen weights kept in llama.cpp's block formats (a GGUF file's Q4_K, Q8_0, ...), for LoRA
//! over a quantized GGUF base in its quantized footprint (`model.quantize = "keep"`,
//! docs/gguf.md).
//!
//! A weight is Candle's [`QTensor`]: the file's blocks as they are, on the device. Its matmul
//! ([`GgmlMatmul`], a [`DequantMatmul`]) dequantizes it for each call, forward and backward, as
//! NF4's does, and drops the dequantized copy before returning. Dequantization is Candle's own
//! (`QTensor::dequantize`: the block decoders of `quantized::k_quants` on the CPU, one kernel per
//! format on CUDA, both ported from ggml); the values are those of gguf-py's `dequantize`, which
//! transformers' GGUF loader uses (the parity tests of tests/tests/gguf.rs compare them). A
//! dequantized weight is f32, cast to the compute dtype when that is another (f16 on CUDA takes
//! Candle's direct f16 kernel).

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};
use crate::io::gguf::format_bytes;
use crate::io::weights::Weights;
use crate::kernels::matmul::{DequantMatmul, Dequantize};

/// x W^T for a weight in GGML blocks.
pub type GgmlMatmul = DequantMatmul<GgmlWeight>;

/// A frozen (out, in) weight in one of llama.cpp's block formats.
pub struct GgmlWeight {
    /// The blocks, rows in HF's order (out, in).
    pub q: QTensor,
    /// (out, in)
    pub shape: (usize, usize),
    /// Compute dtype: what the dequantized weight is cast to.
    pub dtype: DType,
}

impl GgmlWeight {
    /// The weight from its stored bytes (row-major blocks of an (out, in) tensor), on `device`.
    pub fn from_bytes(
        bytes: &[u8],
        format: GgmlDType,
        shape: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let want = format_bytes(format, shape.0 * shape.1);
        if bytes.len() as u64 != want || !shape.1.is_multiple_of(format.block_size()) {
            return Err(ModelError::Invalid(format!(
                "a {format:?} weight of shape {shape:?} needs rows of whole {}-value blocks \
                 ({want} bytes); it has {} bytes",
                format.block_size(),
                bytes.len()
            )));
        }
        let storage = QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, format)?;
        Ok(Self {
            q: QTensor::new(storage, shape)?,
            shape,
            dtype,
        })
    }

    /// Weight `name` (out, in) of a GGUF checkpoint as its file stores it, computing in `dtype`
    /// on `device`; None when the file stores it as plain floats (or `w` is not a GGUF file).
    pub fn from_gguf(
        w: &Weights,
        name: &str,
        shape: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Self>> {
        let Some((bytes, format, found)) = w.block_rows(name)? else {
            return Ok(None);
        };
        if found != [shape.0, shape.1] {
            return Err(ModelError::ShapeMismatch {
                path: w.path_of(name),
                name: name.to_string(),
                expected: vec![shape.0, shape.1],
                found,
            });
        }
        Self::from_bytes(&bytes, format, shape, dtype, device).map(Some)
    }

    pub fn format(&self) -> GgmlDType {
        self.q.dtype()
    }

    /// Bytes held on the device: the blocks.
    pub fn storage_bytes(&self) -> usize {
        self.q.storage_size_in_bytes()
    }

    /// (out, in) in the compute dtype (a new full-precision copy).
    pub fn dequantize(&self) -> Result<Tensor> {
        Ok(self.dequantize_candle()?)
    }

    /// The CPU kernel: the blocks decoded by Candle's block decoder (`GgmlType::to_float`,
    /// what `QTensor::dequantize` runs on one thread) in chunks of [`CHUNK_BLOCKS`] blocks over
    /// rayon's threads, each written straight into the compute dtype from a chunk-sized f32
    /// buffer: one pass and no weight-sized f32 copy for bf16 / f16. The same values as Candle's
    /// path (the same decoder, the same rounding to bf16 / f16; a unit test compares the bits).
    /// None for a format or dtype it does not take (Candle's path then runs).
    fn dequantize_cpu(&self) -> Option<candle_core::Result<Tensor>> {
        use candle_core::quantized::k_quants::*;
        let data = match self.q.data() {
            Ok(std::borrow::Cow::Borrowed(d)) => d,
            _ => return None,
        };
        Some(match self.format() {
            GgmlDType::Q4_0 => self.decode::<BlockQ4_0>(data)?,
            GgmlDType::Q4_1 => self.decode::<BlockQ4_1>(data)?,
            GgmlDType::Q5_0 => self.decode::<BlockQ5_0>(data)?,
            GgmlDType::Q5_1 => self.decode::<BlockQ5_1>(data)?,
            GgmlDType::Q8_0 => self.decode::<BlockQ8_0>(data)?,
            GgmlDType::Q2K => self.decode::<BlockQ2K>(data)?,
            GgmlDType::Q3K => self.decode::<BlockQ3K>(data)?,
            GgmlDType::Q4K => self.decode::<BlockQ4K>(data)?,
            GgmlDType::Q5K => self.decode::<BlockQ5K>(data)?,
            GgmlDType::Q6K => self.decode::<BlockQ6K>(data)?,
            _ => return None,
        })
    }

    /// [`GgmlWeight::dequantize_cpu`] for block type `T`; None when the bytes are not whole,
    /// aligned `T` blocks or the dtype is not f32 / bf16 / f16.
    fn decode<T: candle_core::quantized::k_quants::GgmlType>(
        &self,
        bytes: &[u8],
    ) -> Option<candle_core::Result<Tensor>> {
        use rayon::prelude::*;
        let size = std::mem::size_of::<T>();
        let n = self.shape.0 * self.shape.1;
        if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
            || !bytes.len().is_multiple_of(size)
            || bytes.len() / size * T::BLCK_SIZE != n
        {
            return None;
        }
        // SAFETY: `bytes` is the QTensor's own `Vec<T>` (what `QStorage::data` borrows on the
        // CPU), checked above to be aligned for T and whole blocks; T is plain old data.
        let blocks: &[T] =
            unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) };
        let per_task = CHUNK_BLOCKS * T::BLCK_SIZE;
        fn narrow<O: Send + Copy, B: Sync + Send + candle_core::quantized::k_quants::GgmlType>(
            out: &mut [O],
            blocks: &[B],
            per_task: usize,
            cast: impl Fn(f32) -> O + Sync,
        ) {
            use rayon::prelude::*;
            out.par_chunks_mut(per_task)
                .zip(blocks.par_chunks(CHUNK_BLOCKS))
                .for_each_init(
                    || vec![0f32; per_task],
                    |tmp, (ys, xs)| {
                        let tmp = &mut tmp[..ys.len()];
                        B::to_float(xs, tmp);
                        for (y, &x) in ys.iter_mut().zip(tmp.iter()) {
                            *y = cast(x);
                        }
                    },
                );
        }
        let dev = &Device::Cpu;
        Some(match self.dtype {
            DType::F32 => {
                let mut out = vec![0f32; n];
                out.par_chunks_mut(per_task)
                    .zip(blocks.par_chunks(CHUNK_BLOCKS))
                    .for_each(|(ys, xs)| T::to_float(xs, ys));
                Tensor::from_vec(out, self.shape, dev)
            }
            DType::BF16 => {
                let mut out = vec![half::bf16::ZERO; n];
                narrow(&mut out, blocks, per_task, half::bf16::from_f32);
                Tensor::from_vec(out, self.shape, dev)
            }
            DType::F16 => {
                let mut out = vec![half::f16::ZERO; n];
                narrow(&mut out, blocks, per_task, half::f16::from_f32);
                Tensor::from_vec(out, self.shape, dev)
            }
            _ => return None,
        })
    }
}

/// Blocks per task of the CPU kernel (16k values of a 256-value format: a 64 KiB f32 buffer).
const CHUNK_BLOCKS: usize = 64;

impl Dequantize for GgmlWeight {
    fn op_name(&self) -> &'static str {
        "ggml-matmul"
    }

    fn compute_dtype(&self) -> DType {
        self.dtype
    }

    /// [`GgmlWeight::dequantize`] with Candle's error type, for use inside custom ops: on the
    /// CPU [`GgmlWeight::dequantize_cpu`]; on CUDA Candle's kernel (f32, then a cast; f16
    /// direct).
    fn dequantize_candle(&self) -> candle_core::Result<Tensor> {
        let device = self.q.device();
        if device.is_cpu() {
            if let Some(t) = self.dequantize_cpu() {
                return t;
            }
        }
        if self.dtype == DType::F16 && device.is_cuda() {
            return self.q.dequantize_f16(&device);
        }
        self.q.dequantize(&device)?.to_dtype(self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Module, Var};
    use std::sync::Arc;

    /// A (96, 512) weight in Q4_K (two blocks per row) and its dequantized values.
    fn q4k() -> Result<(GgmlWeight, Tensor)> {
        let w = Tensor::randn(0f32, 0.05, (96, 512), &Device::Cpu)?;
        let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
        let bytes = q.data()?.to_vec();
        let g =
            GgmlWeight::from_bytes(&bytes, GgmlDType::Q4K, (96, 512), DType::F32, &Device::Cpu)?;
        let dense = q.dequantize(&Device::Cpu)?;
        Ok((g, dense))
    }

    /// The kept weight's matmul and its input gradient equal a dense linear's over the same
    /// dequantized values (the same matmul, so to the bit), and it holds 4.5 bits per value.
    #[test]
    fn ggml_matmul_is_the_dense_matmul_of_the_dequantized_weight() -> Result<()> {
        let (g, dense) = q4k()?;
        assert_eq!(g.storage_bytes(), 96 * 512 * 9 / 16);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (7, 512), &Device::Cpu)?)?;
        let g = Arc::new(g);
        let y = x.as_tensor().apply_op1(GgmlMatmul { w: g.clone() })?;
        let want = candle_nn::Linear::new(dense.clone(), None).forward(x.as_tensor())?;
        let d = (&y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "forward");
        let dy = Tensor::randn(0f32, 1., (7, 96), &Device::Cpu)?;
        let grads = (&y * &dy)?.sum_all()?.backward()?;
        let dx = grads.get(x.as_tensor()).unwrap();
        let want_dx = dy.matmul(&dense)?;
        let d = (dx - &want_dx)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "dx");
        // bf16 compute: the dequantized values rounded to bf16.
        let bf = GgmlWeight {
            dtype: DType::BF16,
            ..GgmlWeight::from_bytes(
                &g.q.data()?,
                GgmlDType::Q4K,
                (96, 512),
                DType::F32,
                &Device::Cpu,
            )?
        };
        let got = bf.dequantize()?;
        assert_eq!(got.dtype(), DType::BF16);
        let d = (got.to_dtype(DType::F32)? - dense.to_dtype(DType::BF16)?.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "bf16");
        Ok(())
    }

    /// The CPU kernel gives Candle's values bit for bit (its decoder, then its cast), in each
    /// compute dtype, for 256- and 32-value formats, with a row count that leaves a partial
    /// last task.
    #[test]
    fn the_cpu_kernel_gives_candles_bits() -> Result<()> {
        let (rows, cols) = (37, 512);
        let w = Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu)?;
        for format in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
        ] {
            let q = QTensor::quantize(&w, format)?;
            let bytes = q.data()?.to_vec();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let g = GgmlWeight::from_bytes(&bytes, format, (rows, cols), dtype, &Device::Cpu)?;
                let ours = g.dequantize_cpu().expect("a CPU kernel format")?;
                let candle = g.q.dequantize(&Device::Cpu)?.to_dtype(dtype)?;
                assert_eq!(ours.dtype(), dtype);
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    Ok(t.to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect())
                };
                assert_eq!(bits(&ours)?, bits(&candle)?, "{format:?} {dtype:?}");
            }
        }
        Ok(())
    }

    /// A byte count that is not whole blocks of the shape is refused, naming both.
    #[test]
    fn wrong_byte_counts_are_refused() {
        let e = GgmlWeight::from_bytes(
            &[0u8; 100],
            GgmlDType::Q4K,
            (2, 256),
            DType::F32,
            &Device::Cpu,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("288 bytes") && e.contains("100 bytes"), "{e}");
    }
}
