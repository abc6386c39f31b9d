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

    /// [`GgmlWeight::dequantize`] with Candle's error type, for use inside custom ops.
    pub(crate) fn dequantize_candle(&self) -> candle_core::Result<Tensor> {
        let device = self.q.device();
        if self.dtype == DType::F16 && device.is_cuda() {
            return self.q.dequantize_f16(&device);
        }
        self.q.dequantize(&device)?.to_dtype(self.dtype)
    }
}

impl Dequantize for GgmlWeight {
    fn op_name(&self) -> &'static str {
        "ggml-matmul"
    }

    fn compute_dtype(&self) -> DType {
        self.dtype
    }

    fn dequantize_candle(&self) -> candle_core::Result<Tensor> {
        GgmlWeight::dequantize_candle(self)
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
