//! 4-bit NormalFloat (NF4) weights, bitsandbytes layout (QLoRA, arXiv:2305.14314).
//!
//! A weight W (out, in) is flattened row-major and cut into blocks of 64 values. Each block keeps
//! its absmax (fp32) and each value the index (0..15) of the NF4 code nearest to value / absmax;
//! two indices per byte, the first element in the high nibble. Double quantization replaces the
//! fp32 absmax by 8-bit codes: absmax minus its mean (the offset), blockwise-quantized (block 256)
//! with the signed dynamic map ([`super::dynamic`]). This is what `bitsandbytes.functional.
//! quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=...)` computes (its CPU /
//! default backend, `backends/default/ops.py`, in bitsandbytes 0.50.2), bit for bit: the parity
//! tests compare against fixtures from `scripts/make_nf4_fixtures.py`.
//!
//! Storage: n/2 bytes of codes + n/64 absmax (4 bytes, or 1 byte + 4 bytes per 256 blocks with
//! double quantization): 0.5625 or about 0.516 bytes per parameter (4.5 or 4.127 bits; double
//! quantization saves 0.373 bits per parameter, about 7% of a 4-bit model).
//!
//! In memory each byte is bitsandbytes' byte XOR 0x88 (each nibble's top bit flipped, so code c
//! is stored as c ^ 8; [`Nf4Weight::bnb_packed`] gives bitsandbytes' bytes back). Why: Candle's
//! `index_select` returns zeros for the largest index of its index type (255 for u8; candle 0.11
//! `cpu_backend/mod.rs` and `indexing.cu`). With the flip, stored 0xFF is the pair of codes
//! (7, 7) = (0.0, 0.0), for which zeros are right, so the packed bytes can index a table directly
//! without a u8 -> u32 cast (one op and 2 bytes per parameter of temporaries saved per call).
//!
//! Two implementations of each direction: a kernel (a byte -> (hi, lo) lookup table) behind a
//! [`CustomOp1`], and a device-generic one made of Candle tensor ops only. Quantization (once per
//! weight, at load) uses the kernel on the CPU and the tensor ops elsewhere. Dequantization (run
//! by [`Nf4Matmul`] in forward, backward and a checkpointed recompute) uses the kernel on the CPU
//! (rayon over blocks) and on CUDA (`tallow_nf4_dequant*` in `kernels/tallow.cu`): **one launch
//! per call**, double quantization included (the 8-bit absmax is decoded in place, per block,
//! with bitsandbytes' two roundings), 0.5 B read and 2 B written per parameter for bf16, no
//! temporaries. A unit test checks that the CPU kernel and the tensor ops give identical bits;
//! `tallow doctor` checks the CUDA kernel against the CPU kernel (tolerance 0).
//!
//! The tensor-op path ([`Nf4Weight::dequantize_generic`]; other devices, f64 on CUDA), launches
//! per call:
//! - on the weight-sized data, 3: `index_select` of a cached (256, 2) f32 table by the packed
//!   bytes (the two values of each byte), `broadcast_mul` by the block absmax, cast to the
//!   compute dtype (none for f32). Traffic per parameter: 0.5 B read + 4 B written (gather),
//!   4 + 4 (multiply), 4 + 2 (bf16 cast): 18.5 B, 8 B of f32 temporaries; no host copies.
//! - on the absmax (1/64 of the elements): none for an f32 absmax; with double quantization 4
//!   (codes to u32, gather of the dynamic map, multiply by the nested absmax, + offset: the two
//!   roundings bitsandbytes does, `dequantize_blockwise(...)` then `absmax += offset`).
//! - +1 (a concatenation with cached zeros) on the packed bytes when n is not a multiple of the
//!   block, +1 on the absmax codes when the block count is not a multiple of 256.

use std::sync::OnceLock;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::blockwise8::{
    dequantize_blockwise, dynamic_map, pad_to, quantize_blockwise, Blockwise8,
};
use crate::error::{ModelError, Result};
use crate::io::weights::Weights;
use crate::kernels::consts::{cached, ConstKey};
use crate::kernels::dispatch::Backend;
use crate::kernels::matmul::{DequantMatmul, Dequantize};

/// The NF4 codebook (`bitsandbytes.functional.get_4bit_type("nf4")`), sorted, index 0..15.
/// Written with bitsandbytes' printed digits (they round to the same f32 values).
#[allow(clippy::excessive_precision)]
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Values per absmax block (bitsandbytes' default `blocksize` for 4-bit).
pub const BLOCK: usize = 64;
/// Values per block of the nested (double) quantization of the absmax.
pub const NESTED_BLOCK: usize = 256;
/// The blocksizes bitsandbytes accepts for 4-bit quantization.
pub const BNB_BLOCKSIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// How to quantize base weights at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nf4Options {
    /// Quantize the per-block absmax too (8-bit, block 256): about 0.37 bits per parameter less.
    pub double_quant: bool,
}

/// Midpoints between consecutive codes, as bitsandbytes computes them in fp32:
/// `(code[:-1] + code[1:]) / 2`. A value's code is the number of midpoints below it
/// (`torch.bucketize(x, bounds, right=False)`).
fn midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (NF4_CODE[i] + NF4_CODE[i + 1]) / 2.0)
}

/// The flip between bitsandbytes' bytes and the stored ones (see the module docs).
const FLIP: u8 = 0x88;

/// stored byte -> (code[hi nibble ^ 8], code[lo nibble ^ 8]): the values of its two elements.
fn lut() -> &'static [[f32; 2]; 256] {
    static LUT: OnceLock<[[f32; 2]; 256]> = OnceLock::new();
    LUT.get_or_init(|| std::array::from_fn(|b| [NF4_CODE[(b >> 4) ^ 8], NF4_CODE[(b & 15) ^ 8]]))
}

/// [`lut`] as a (256, 2) f32 tensor on `dev`, uploaded once per device.
fn lut_tensor(dev: &Device) -> candle_core::Result<Tensor> {
    cached(dev, ConstKey::new("nf4.lut"), |d| {
        let flat: Vec<f32> = lut().iter().flatten().copied().collect();
        Tensor::from_vec(flat, (256, 2), d)
    })
}

/// The per-block scales of a weight.
#[derive(Clone)]
pub enum Absmax {
    /// (blocks,) f32
    F32(Tensor),
    /// Double quantization: absmax = dequantize_blockwise(nested) + offset.
    Double { nested: Blockwise8, offset: f32 },
}

impl Absmax {
    /// (blocks,) f32, contiguous.
    pub fn to_f32(&self) -> candle_core::Result<Tensor> {
        match self {
            Absmax::F32(t) => t.contiguous(),
            Absmax::Double { nested, offset } => {
                // bitsandbytes: `absmax = dequantize_blockwise(...); absmax += offset` (fp32).
                let a = dequantize_blockwise(nested).map_err(candle_core::Error::wrap)?;
                (a.flatten_all()? + *offset as f64)?.contiguous()
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Absmax::F32(t) => t.elem_count() * 4,
            Absmax::Double { nested, .. } => {
                nested.codes.elem_count() + nested.absmax.elem_count() * 4 + 4
            }
        }
    }
}

/// A frozen linear weight (out, in) in NF4.
#[derive(Clone)]
pub struct Nf4Weight {
    /// (ceil(n/2),) u8: two codes per byte, the first element in the high nibble, each byte
    /// XOR 0x88 (code c stored as c ^ 8; see the module docs and [`Nf4Weight::bnb_packed`]).
    pub packed: Tensor,
    pub absmax: Absmax,
    /// Values per absmax block (64 unless a checkpoint says otherwise).
    pub block: usize,
    /// (out, in)
    pub shape: (usize, usize),
    /// Compute dtype: what [`Nf4Weight::dequantize`] returns.
    pub dtype: DType,
}

impl Nf4Weight {
    /// Quantizes `w` (out, in), any float dtype, on its device; the compute dtype is `w`'s.
    pub fn quantize(w: &Tensor, double_quant: bool) -> Result<Self> {
        let shape = w.dims2()?;
        let dtype = w.dtype();
        let (packed, absmax) = if Backend::of(w.device()) == Backend::Cpu {
            quantize_cpu(w, BLOCK)?
        } else {
            quantize_generic(w, BLOCK)?
        };
        let absmax = if double_quant {
            double_quantize(&absmax)?
        } else {
            Absmax::F32(absmax)
        };
        Ok(Self {
            packed,
            absmax,
            block: BLOCK,
            shape,
            dtype,
        })
    }

    /// Loads a bitsandbytes 4-bit weight as `transformers` saves it (`QuantState.as_dict(packed=True)`):
    /// `{name}` packed u8 (n/2, 1), `{name}.absmax`, `{name}.quant_map`, with double quantization
    /// `{name}.nested_absmax`, `{name}.nested_quant_map`, and `{name}.quant_state.bitsandbytes__nf4`
    /// (JSON in a u8 tensor: quant_type, blocksize, dtype, shape, nested_blocksize, nested_offset).
    /// `name` is the weight's key (`model.layers.0.mlp.up_proj.weight`).
    pub fn from_bnb(
        w: &Weights,
        name: &str,
        shape: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let file = w.file_name(name);
        let bad = |msg: String| ModelError::Invalid(format!("{file}: tensor `{name}`: {msg}"));
        let state_key = format!("{name}.quant_state.bitsandbytes__nf4");
        if !w.contains(&state_key) {
            if w.contains(&format!("{name}.quant_state.bitsandbytes__fp4")) {
                return Err(bad(
                    "quantized as bitsandbytes fp4; tallow reads nf4 only: \
                     quantize the original model with bnb_4bit_quant_type=\"nf4\", or give tallow \
                     the unquantized checkpoint with --quantize nf4"
                        .into(),
                ));
            }
            return Err(bad(format!(
                "u8 weight without `{state_key}`: not a bitsandbytes 4-bit checkpoint tallow can read"
            )));
        }
        let raw = w.load_raw(&state_key, &Device::Cpu)?.to_vec1::<u8>()?;
        let state: serde_json::Value = serde_json::from_slice(&raw)
            .map_err(|e| bad(format!("`{state_key}` is not JSON: {e}")))?;
        let quant_type = state["quant_type"].as_str().unwrap_or("");
        if quant_type != "nf4" {
            return Err(bad(format!(
                "quant_type `{quant_type}` in `{state_key}`; tallow reads nf4 only"
            )));
        }
        let block = state["blocksize"].as_u64().unwrap_or(0) as usize;
        if !BNB_BLOCKSIZES.contains(&block) {
            return Err(bad(format!(
                "blocksize {block} in `{state_key}` is not supported; bitsandbytes uses one of \
                 {BNB_BLOCKSIZES:?} (64 by default): re-quantize the model"
            )));
        }
        let saved_shape: Vec<usize> = state["shape"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64())
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default();
        if saved_shape != [shape.0, shape.1] {
            return Err(ModelError::ShapeMismatch {
                path: file.into(),
                name: name.to_string(),
                expected: vec![shape.0, shape.1],
                found: saved_shape,
            });
        }
        let n = shape.0 * shape.1;
        let blocks = n.div_ceil(block);
        let packed = w.load_raw(name, &Device::Cpu)?.flatten_all()?; // (n/2, 1) -> (n/2,)
        if packed.dtype() != DType::U8 || packed.elem_count() != n.div_ceil(2) {
            return Err(bad(format!(
                "expected {} packed u8 values, found {} {:?}",
                n.div_ceil(2),
                packed.elem_count(),
                packed.dtype()
            )));
        }
        let packed = flip(&packed)?.to_device(device)?; // stored form, on the host before upload
        let quant_map = w
            .load_raw(&format!("{name}.quant_map"), &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        if quant_map != NF4_CODE {
            return Err(bad(format!(
                "`{name}.quant_map` is not the NF4 codebook: {quant_map:?}"
            )));
        }
        let absmax_t = w
            .load_raw(&format!("{name}.absmax"), device)?
            .flatten_all()?;
        if absmax_t.elem_count() != blocks {
            return Err(bad(format!(
                "`{name}.absmax` has {} values, {n} weights in blocks of {block} need {blocks}",
                absmax_t.elem_count()
            )));
        }
        let absmax = if w.contains(&format!("{name}.nested_absmax")) {
            let nested_block = state["nested_blocksize"].as_u64().unwrap_or(0) as usize;
            let offset = state["nested_offset"].as_f64().ok_or_else(|| {
                bad(format!(
                    "`{state_key}` has nested tensors but no nested_offset"
                ))
            })? as f32;
            let map = w
                .load_raw(&format!("{name}.nested_quant_map"), &Device::Cpu)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            if map != dynamic_map(true) {
                return Err(bad(format!(
                    "`{name}.nested_quant_map` is not bitsandbytes' signed dynamic map"
                )));
            }
            let nested_absmax = w
                .load_raw(&format!("{name}.nested_absmax"), device)?
                .flatten_all()?
                .to_dtype(DType::F32)?;
            if nested_block == 0 || nested_absmax.elem_count() != blocks.div_ceil(nested_block) {
                return Err(bad(format!(
                    "`{name}.nested_absmax` has {} values, nested_blocksize {nested_block} \
                     needs {}",
                    nested_absmax.elem_count(),
                    blocks.div_ceil(nested_block.max(1))
                )));
            }
            Absmax::Double {
                nested: Blockwise8::from_parts(
                    absmax_t.to_dtype(DType::U8)?,
                    nested_absmax,
                    nested_block,
                    true,
                    Shape::from(blocks),
                )?,
                offset,
            }
        } else {
            Absmax::F32(absmax_t.to_dtype(DType::F32)?)
        };
        Ok(Self {
            packed,
            absmax,
            block,
            shape,
            dtype,
        })
    }

    pub fn device(&self) -> &Device {
        self.packed.device()
    }

    /// The codes in bitsandbytes' layout (`quantize_4bit`'s packed bytes), (ceil(n/2),) u8 on the
    /// CPU: the stored bytes XOR 0x88.
    pub fn bnb_packed(&self) -> Result<Tensor> {
        Ok(flip(&self.packed.to_device(&Device::Cpu)?)?)
    }

    pub fn elem_count(&self) -> usize {
        self.shape.0 * self.shape.1
    }

    /// Bytes held on the device: packed codes and scales.
    pub fn storage_bytes(&self) -> usize {
        self.packed.elem_count() + self.absmax.bytes()
    }

    /// The same weight on `device` (a 4-bit copy; nothing is dequantized).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let absmax = match &self.absmax {
            Absmax::F32(t) => Absmax::F32(t.to_device(device)?),
            Absmax::Double { nested, offset } => Absmax::Double {
                nested: Blockwise8 {
                    codes: nested.codes.to_device(device)?,
                    absmax: nested.absmax.to_device(device)?,
                    ..nested.clone()
                },
                offset: *offset,
            },
        };
        Ok(Self {
            packed: self.packed.to_device(device)?,
            absmax,
            ..self.clone()
        })
    }

    /// (out, in) in the compute dtype: the CPU kernel on the CPU, tensor ops elsewhere.
    pub fn dequantize(&self) -> Result<Tensor> {
        Ok(self.dequantize_candle()?)
    }

    /// [`Self::dequantize`] with Candle's error type, for use inside custom ops: one kernel on
    /// the CPU and on CUDA ([`Dequant`]); the tensor-op path on other devices and for f64 on CUDA.
    pub(crate) fn dequantize_candle(&self) -> candle_core::Result<Tensor> {
        let kernel = match self.packed.device() {
            Device::Cpu => true,
            Device::Cuda(_) => matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16),
            _ => false,
        };
        if kernel {
            self.packed.apply_op1_no_bwd(&Dequant::of(self))
        } else {
            let absmax = self.absmax.to_f32()?;
            dequantize_generic(&self.packed, &absmax, self.block, self.shape, self.dtype)
        }
    }

    /// The tensor-op path on any device (the CUDA path; on the CPU only for tests).
    pub fn dequantize_generic(&self) -> Result<Tensor> {
        let absmax = self.absmax.to_f32()?;
        Ok(dequantize_generic(
            &self.packed,
            &absmax,
            self.block,
            self.shape,
            self.dtype,
        )?)
    }
}

/// Double quantization of an absmax vector (blocks,) f32: offset = mean, then 8-bit blockwise
/// quantization of (absmax - offset) with the signed dynamic map, block 256
/// (`quantize_4bit(..., compress_statistics=True)`).
fn double_quantize(absmax: &Tensor) -> Result<Absmax> {
    // bitsandbytes takes torch's fp32 `absmax.mean()`, whose summation order depends on the
    // CPU's vector width; tallow takes the correctly rounded mean (sum in f64, one rounding),
    // which is the same on every machine and within one ulp of torch's. The offset is stored
    // with the weight, so loading a bitsandbytes checkpoint is exact either way; see the parity
    // test for what this changes in the nested codes (nothing, on the fixtures).
    let n = absmax.elem_count() as f64;
    let offset = (absmax.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()? / n) as f32;
    let centered = (absmax - offset as f64)?;
    let nested = quantize_blockwise(&centered, true, NESTED_BLOCK)?;
    Ok(Absmax::Double { nested, offset })
}

/// Bytes XOR 0x88 (bitsandbytes' layout <-> the stored one), on the CPU. (n,) u8 -> (n,) u8
fn flip(bytes: &Tensor) -> candle_core::Result<Tensor> {
    let v: Vec<u8> = cpu_slice::<u8>(bytes)?
        .into_iter()
        .map(|b| b ^ FLIP)
        .collect();
    let n = v.len();
    Tensor::from_vec(v, n, &Device::Cpu)
}

/// Byte layout helpers: the contiguous slice of a CPU tensor.
fn cpu_slice<T: candle_core::WithDType>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

/// CPU quantization kernel. w: (out, in) any float dtype -> (packed (ceil(n/2),) u8, absmax
/// (blocks,) f32), both on the CPU.
fn quantize_cpu(w: &Tensor, block: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let x: Vec<f32> = cpu_slice(&w.to_dtype(DType::F32)?)?;
    let n = x.len();
    let blocks = n.div_ceil(block);
    let mids = midpoints();
    let code_of = |v: f32| mids.iter().filter(|&&m| m < v).count() as u8;
    // Per block: absmax and the block's codes (block is even, so a block starts on a byte).
    // Outputs are allocated at their exact size: they become the model's storage.
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut absmax = vec![0f32; blocks];
    packed
        .par_chunks_mut(block / 2)
        .zip(absmax.par_iter_mut())
        .zip(x.par_chunks(block))
        .for_each(|((out, amax_out), chunk)| {
            let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
            *amax_out = amax;
            // bitsandbytes: `A * (1.0 / absmax.clamp(min=1e-38))`, clamped to [-1, 1].
            let inv = 1.0f32 / amax.max(1e-38);
            let code = |v: f32| code_of((v * inv).clamp(-1.0, 1.0));
            for (o, p) in out.iter_mut().zip(chunk.chunks(2)) {
                // An odd last element pairs with a padded 0 (code 7), as bitsandbytes pads.
                let byte = (code(p[0]) << 4) | p.get(1).map_or(code_of(0.0), |&v| code(v));
                *o = byte ^ FLIP; // stored form
            }
        });
    Ok((
        Tensor::from_vec(packed, n.div_ceil(2), &Device::Cpu)?,
        Tensor::from_vec(absmax, blocks, &Device::Cpu)?,
    ))
}

/// Device-generic quantization from tensor ops: the nearest code is the number of the 15
/// midpoints below the scaled value (15 comparisons summed). Same outputs as [`quantize_cpu`].
/// Runs once per weight at load; the constants are cached per device.
fn quantize_generic(w: &Tensor, block: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = w.device();
    let x = w.to_dtype(DType::F32)?.flatten_all()?; // (n,)
    let n = x.elem_count();
    let blocks = n.div_ceil(block);
    // Zero padding changes no absmax (|x| >= 0) and its codes are cut off below.
    let xb = x
        .pad_with_zeros(0, 0, blocks * block - n)?
        .reshape((blocks, block))?; // (blocks, block)
    let absmax = xb.abs()?.max_keepdim(1)?; // (blocks, 1)
    let k = |name: &'static str, v: &[f32]| {
        let v = v.to_vec();
        cached(dev, ConstKey::new(name), move |d| {
            Tensor::new(v.as_slice(), d)
        })
    };
    let bounds = k("nf4.quantize.bounds", &[1e-38, -1.0, 1.0])?; // (3,)
    let mids = k("nf4.midpoints", &midpoints())?; // (15,)
    let one = |t: &Tensor, i: usize| t.narrow(0, i, 1); // (1,) view of a cached tensor
    let inv = absmax.broadcast_maximum(&one(&bounds, 0)?)?.recip()?;
    let scaled = xb
        .broadcast_mul(&inv)?
        .broadcast_maximum(&one(&bounds, 1)?)?
        .broadcast_minimum(&one(&bounds, 2)?)?
        .flatten_all()?; // (blocks*block,)
    let n2 = n.div_ceil(2) * 2;
    let scaled = if n2 <= scaled.elem_count() {
        scaled.narrow(0, 0, n2)?
    } else {
        scaled.pad_with_zeros(0, 0, n2 - scaled.elem_count())?
    }; // (n2,)
    let mut codes = Tensor::zeros(n2, DType::U8, dev)?;
    for j in 0..15 {
        codes = (codes + scaled.broadcast_gt(&one(&mids, j)?)?)?; // u8 0/1 per comparison
    }
    // stored form: c ^ 8 = c + 8 - 16 * (c >= 8), in u8 without overflow
    let high = codes.broadcast_ge(&cached(dev, ConstKey::new("nf4.eight"), |d| {
        Tensor::new(&[8u8], d)
    })?)?;
    let codes = (codes.affine(1.0, 8.0)? - high.affine(16.0, 0.0)?)?;
    let pairs = codes.reshape((n2 / 2, 2))?; // (n/2, 2): (first, second) element
    let packed =
        (pairs.narrow(1, 0, 1)?.affine(16.0, 0.0)? + pairs.narrow(1, 1, 1)?)?.flatten_all()?; // (n/2,)
    Ok((packed, absmax.flatten_all()?))
}

/// Device-generic dequantization: 3 ops on the weight (see the module docs), same bits as the
/// CPU kernel (the same f32 product `code * absmax`, rounded once to `dtype`).
/// packed: (ceil(n/2),) u8 stored form, absmax: (blocks,) f32 -> (out, in) in `dtype`.
fn dequantize_generic(
    packed: &Tensor,
    absmax: &Tensor,
    block: usize,
    shape: (usize, usize),
    dtype: DType,
) -> candle_core::Result<Tensor> {
    if !block.is_multiple_of(2) {
        candle_core::bail!("nf4: block size {block} is odd; bitsandbytes' are even");
    }
    let n = shape.0 * shape.1;
    let blocks = n.div_ceil(block);
    // Bytes of whole blocks; the padding (a partial last block only) is cut off below.
    let packed = pad_to(packed, blocks * block / 2)?; // (blocks * block / 2,) u8
    let table = lut_tensor(packed.device())?; // (256, 2) f32
    let vals = table
        .index_select(&packed, 0)? // op 1: (blocks * block / 2, 2) f32, element order
        .reshape((blocks, block))?; // (blocks, block)
    let out = vals
        .broadcast_mul(&absmax.reshape((blocks, 1))?)? // op 2: (blocks, block) f32
        .flatten_all()?
        .narrow(0, 0, n)?
        .reshape(shape)?; // (out, in), still contiguous: no copy
    out.to_dtype(dtype) // op 3 (a no-op for f32)
}

/// The dequantization kernel as a custom op on the packed codes (no backward: the packed weight is
/// never differentiated): a rayon loop on the CPU, one launch of `tallow_nf4_dequant*`
/// (`kernels/tallow.cu`) on CUDA. Both decode a double-quantized absmax in place (no (blocks,)
/// f32 temporary) and do the same IEEE operations, so their outputs are equal bit for bit, and
/// equal to [`dequantize_generic`]'s (tested below; `tallow doctor` checks the CUDA kernel).
struct Dequant {
    absmax: Absmax,
    block: usize,
    shape: (usize, usize),
    dtype: DType,
}

/// The absmax of block b, read or decoded: bitsandbytes' `dequantize_blockwise(...)`, then
/// `absmax += offset`, each rounded in f32 (as [`Absmax::to_f32`]).
enum Scales<'a> {
    F32(&'a [f32]),
    Double {
        codes: &'a [u8],
        nested: &'a [f32],
        map: Box<[f32; 256]>,
        nested_block: usize,
        offset: f32,
    },
}

impl Scales<'_> {
    #[inline]
    fn get(&self, b: usize) -> f32 {
        match self {
            Scales::F32(a) => a[b],
            Scales::Double {
                codes,
                nested,
                map,
                nested_block,
                offset,
            } => map[codes[b] as usize] * nested[b / nested_block] + offset,
        }
    }

    fn len(&self) -> usize {
        match self {
            Scales::F32(a) => a.len(),
            Scales::Double { codes, .. } => codes.len(),
        }
    }
}

impl Dequant {
    fn of(w: &Nf4Weight) -> Self {
        Self {
            absmax: w.absmax.clone(),
            block: w.block,
            shape: w.shape,
            dtype: w.dtype,
        }
    }

    /// out[i] = conv(code[nibble i] * absmax[i / block]), in f32 then converted (as bitsandbytes).
    fn run<T: Copy + Send + Sync + Default>(
        &self,
        packed: &[u8],
        scales: &Scales,
        conv: impl Fn(f32) -> T + Sync,
    ) -> Vec<T> {
        let n = self.shape.0 * self.shape.1;
        let block = self.block;
        let lut = lut();
        let mut out = vec![T::default(); n];
        // Chunks of whole blocks per rayon task (a 64-value block is too small a task).
        let per_task = block * 64;
        out.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(t, chunk)| {
                for (j, blk) in chunk.chunks_mut(block).enumerate() {
                    let b = t * 64 + j;
                    let a = scales.get(b);
                    let bytes = &packed[b * block / 2..];
                    for (pair, byte) in blk.chunks_mut(2).zip(bytes) {
                        let [h, l] = lut[*byte as usize];
                        pair[0] = conv(h * a);
                        if let Some(p) = pair.get_mut(1) {
                            *p = conv(l * a);
                        }
                    }
                }
            });
        out
    }

    fn check_len(&self, packed: usize, scales: usize) -> candle_core::Result<()> {
        let n = self.shape.0 * self.shape.1;
        if packed != n.div_ceil(2) || scales != n.div_ceil(self.block) {
            candle_core::bail!(
                "nf4: {packed} packed bytes / {scales} scales do not fit a {:?} weight in blocks of {}",
                self.shape,
                self.block
            );
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_run<T>(
        &self,
        packed: &candle_core::cuda_backend::cudarc::driver::CudaView<u8>,
        dev: &candle_core::cuda_backend::CudaDevice,
        kernel: &str,
    ) -> candle_core::Result<CudaStorage>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        use candle_core::cuda_backend::cudarc::driver::CudaView;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::WrapErr;
        use candle_core::Storage;
        /// The contiguous elements of a CUDA tensor.
        fn view<'a, U: candle_core::cuda_backend::CudaDType>(
            st: &'a Storage,
            l: &Layout,
            what: &str,
        ) -> candle_core::Result<CudaView<'a, U>> {
            match (st, l.contiguous_offsets()) {
                (Storage::Cuda(c), Some((a, b))) => Ok(c.as_cuda_slice::<U>()?.slice(a..b)),
                _ => {
                    candle_core::bail!("nf4: {what} must be a contiguous tensor on the CUDA device")
                }
            }
        }
        let device = Device::Cuda(dev.clone());
        let n = self.shape.0 * self.shape.1;
        let lut_t = lut_tensor(&device)?;
        let (lut_st, lut_l) = lut_t.storage_and_layout();
        let lut_v = view::<f32>(&lut_st, lut_l, "the NF4 table")?;
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(n)? };
        let cfg = LaunchConfig::for_num_elems(n.div_ceil(2) as u32);
        let (n, block) = (n, self.block);
        match &self.absmax {
            Absmax::F32(a) => {
                let (st, l) = a.storage_and_layout();
                let a = view::<f32>(&st, l, "absmax")?;
                self.check_len(packed.len(), a.len())?;
                let func =
                    crate::kernels::cuda::func(dev, &format!("tallow_nf4_dequant_{kernel}"))?;
                let mut b = func.builder();
                b.arg(packed);
                b.arg(&lut_v);
                b.arg(&a);
                b.arg(&block);
                b.arg(&n);
                b.arg(&out);
                // SAFETY: argument types and order match `tallow_nf4_dequant_*` in kernels/tallow.cu.
                unsafe { b.launch(cfg) }.w()?;
            }
            Absmax::Double { nested, offset } => {
                let map_t = super::blockwise8::map_tensor(nested.signed, &device)?;
                let (map_st, map_l) = map_t.storage_and_layout();
                let map_v = view::<f32>(&map_st, map_l, "the dynamic map")?;
                let (c_st, c_l) = nested.codes.storage_and_layout();
                let codes = view::<u8>(&c_st, c_l, "absmax codes")?;
                let (a_st, a_l) = nested.absmax.storage_and_layout();
                let nested_absmax = view::<f32>(&a_st, a_l, "nested absmax")?;
                self.check_len(packed.len(), codes.len())?;
                let func =
                    crate::kernels::cuda::func(dev, &format!("tallow_nf4_dequant_dq_{kernel}"))?;
                let nested_block = nested.block;
                let mut b = func.builder();
                b.arg(packed);
                b.arg(&lut_v);
                b.arg(&codes);
                b.arg(&nested_absmax);
                b.arg(&map_v);
                b.arg(offset);
                b.arg(&nested_block);
                b.arg(&block);
                b.arg(&n);
                b.arg(&out);
                // SAFETY: argument types and order match `tallow_nf4_dequant_dq_*`.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}

impl CustomOp1 for Dequant {
    fn name(&self) -> &'static str {
        "nf4-dequantize"
    }

    // packed: (ceil(n/2),) u8 -> (out, in) in `dtype`
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let packed = match (s, l.contiguous_offsets()) {
            (CpuStorage::U8(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("nf4: packed weight must be contiguous u8"),
        };
        // The storage guards live until the kernel has run.
        let (absmax_t, codes_t, nested_t) = match &self.absmax {
            Absmax::F32(a) => (Some(a.storage_and_layout()), None, None),
            Absmax::Double { nested, .. } => (
                None,
                Some(nested.codes.storage_and_layout()),
                Some(nested.absmax.storage_and_layout()),
            ),
        };
        let scales = match (&self.absmax, &absmax_t, &codes_t, &nested_t) {
            (Absmax::F32(_), Some((st, l)), _, _) => {
                Scales::F32(crate::kernels::fused::storage_data(st, l, "nf4 absmax")?)
            }
            (Absmax::Double { nested, offset }, _, Some((cs, cl)), Some((ns, nl))) => {
                Scales::Double {
                    codes: crate::kernels::fused::storage_data(cs, cl, "nf4 absmax codes")?,
                    nested: crate::kernels::fused::storage_data(ns, nl, "nf4 nested absmax")?,
                    map: Box::new(super::blockwise8::dynamic_map(nested.signed)),
                    nested_block: nested.block,
                    offset: *offset,
                }
            }
            _ => unreachable!("guards taken for the absmax's own variant"),
        };
        self.check_len(packed.len(), scales.len())?;
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(self.run(packed, &scales, |v| v)),
            DType::F64 => CpuStorage::F64(self.run(packed, &scales, |v| v as f64)),
            DType::BF16 => CpuStorage::BF16(self.run(packed, &scales, half::bf16::from_f32)),
            DType::F16 => CpuStorage::F16(self.run(packed, &scales, half::f16::from_f32)),
            d => candle_core::bail!("nf4: compute dtype {d:?} is not a float type"),
        };
        Ok((out, Shape::from(self.shape)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("nf4: packed weight must be contiguous u8");
        };
        let packed = s.as_cuda_slice::<u8>()?.slice(a..b);
        let dev = s.device();
        let out = match self.dtype {
            DType::F32 => self.cuda_run::<f32>(&packed, dev, "f32")?,
            DType::BF16 => self.cuda_run::<half::bf16>(&packed, dev, "bf16")?,
            DType::F16 => self.cuda_run::<half::f16>(&packed, dev, "f16")?,
            d => candle_core::bail!("nf4: the CUDA kernel computes in f32, bf16 or f16, not {d:?}"),
        };
        Ok((out, Shape::from(self.shape)))
    }
}

/// x W^T for an NF4 W ([`DequantMatmul`]: forward and backward each dequantize the weight).
pub type Nf4Matmul = DequantMatmul<Nf4Weight>;

impl Dequantize for Nf4Weight {
    fn op_name(&self) -> &'static str {
        "nf4-matmul"
    }

    fn compute_dtype(&self) -> DType {
        self.dtype
    }

    fn dequantize_candle(&self) -> candle_core::Result<Tensor> {
        Nf4Weight::dequantize_candle(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use std::collections::HashMap;
    use std::sync::Arc;

    fn fixtures() -> HashMap<String, Tensor> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/nf4/blocks.safetensors");
        candle_core::safetensors::load(p, &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Equal vectors, or a panic naming the first differing index (not the whole vectors).
    fn same<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            panic!("{what}: first difference at {i}: {:?} vs {:?}", a[i], b[i]);
        }
    }

    fn bytes(t: &Tensor) -> Vec<u8> {
        t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
    }

    const CASES: [&str; 4] = ["rows5", "tall", "bf16", "spiky"];

    /// Codes, absmax, nested codes / absmax / offset and dequantized values equal bitsandbytes'
    /// (`quantize_4bit` / `dequantize_4bit`, CPU backend) bit for bit: same fp32 operations in
    /// the same order (reciprocal of the absmax, clamp, midpoint comparisons, code * absmax).
    #[test]
    fn quantize_and_dequantize_match_bitsandbytes_exactly() -> Result<()> {
        let fx = fixtures();
        for case in CASES {
            let x = &fx[&format!("{case}.input")];
            // Quantized from its own dtype (bf16 for two cases); computes in that dtype, as
            // bitsandbytes' dequantize_4bit returns the input's dtype.
            let q = Nf4Weight::quantize(x, false)?;
            let want_codes = bytes(&fx[&format!("{case}.packed")]);
            same(
                &bytes(&q.bnb_packed()?),
                &want_codes,
                &format!("{case} codes"),
            );
            let Absmax::F32(a) = &q.absmax else { panic!() };
            same(
                &bits(a),
                &bits(&fx[&format!("{case}.absmax")]),
                &format!("{case} absmax"),
            );
            if let Some(want) = fx.get(&format!("{case}.dequant")) {
                let got = bits(&q.dequantize()?);
                same(&got, &bits(want), &format!("{case} dequant"));
            }

            let q = Nf4Weight::quantize(x, true)?;
            same(
                &bytes(&q.bnb_packed()?),
                &want_codes,
                &format!("{case} dq codes"),
            );
            let Absmax::Double { nested, offset } = &q.absmax else {
                panic!()
            };
            // The offset (the mean absmax) may differ from torch's fp32 mean in the last bit
            // (summation order, see `double_quantize`): allowed 1 ulp.
            let want_offset = bits(&fx[&format!("{case}.dq.offset")])[0];
            assert!(
                offset.to_bits().abs_diff(want_offset) <= 1,
                "{case} offset {offset} vs {}",
                f32::from_bits(want_offset)
            );
            same(
                &bytes(&nested.codes),
                &bytes(&fx[&format!("{case}.dq.absmax")]),
                &format!("{case} nested codes"),
            );
            same(
                &bits(&nested.absmax),
                &bits(&fx[&format!("{case}.dq.nested_absmax")]),
                &format!("{case} nested absmax"),
            );
            assert_eq!(nested.block, NESTED_BLOCK);
            if let Some(want) = fx.get(&format!("{case}.dq.dequant")) {
                // With bitsandbytes' offset: bit for bit.
                let with_bnb_offset = Nf4Weight {
                    absmax: Absmax::Double {
                        nested: nested.clone(),
                        offset: f32::from_bits(want_offset),
                    },
                    ..q.clone()
                };
                let got = bits(&with_bnb_offset.dequantize()?);
                same(&got, &bits(want), &format!("{case} double-quant dequant"));
                // With tallow's own offset: within the offset's last bit.
                let d = (q.dequantize()?.to_dtype(DType::F32)? - want)?
                    .abs()?
                    .max_all()?;
                let rel = d.to_scalar::<f32>()? / want.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(rel < 1e-6, "{case}: {rel}");
            }
        }
        // The nested blocks of "tall" are 256 + a partial 64.
        assert_eq!(fx["tall.dq.nested_absmax"].elem_count(), 2);
        Ok(())
    }

    /// The tensor-op path gives the dequantization kernel's bits (whose CUDA twin `tallow doctor`
    /// checks against it), for quantization and for dequantization in every float dtype, with an
    /// f32 and a double-quantized absmax (decoded in place by the kernel), including a partial
    /// last block, more than one nested block, an odd length, and the bytes Candle's `index_select` treats
    /// specially (stored 0xFF, see the module docs) next to bitsandbytes' 0xFF (codes 15, 15).
    #[test]
    fn generic_path_equals_cpu_kernel() -> Result<()> {
        // (67, 250): 262 blocks, two nested blocks of the absmax (the second partial).
        let shapes = [
            ((8, 320), 64),
            ((3, 70), 64),
            ((5, 13), 64),
            ((7, 96), 32),
            ((67, 250), 64),
        ];
        for (shape, block) in shapes {
            let mut x = (Tensor::randn(0f32, 1., shape, &Device::Cpu)? * 0.1)?;
            if shape.0 == 8 {
                // a zero block (stored 0xFF), an exact-midpoint value, two values at code 15 in
                // one byte (bitsandbytes' 0xFF)
                let mut v = x.flatten_all()?.to_vec1::<f32>()?;
                v[..64].iter_mut().for_each(|e| *e = 0.0);
                v[64] = 1.0;
                v[65] = midpoints()[9];
                v[66] = 0.95;
                v[67] = 0.97;
                x = Tensor::from_vec(v, shape, &Device::Cpu)?;
            }
            let (pk, ak) = quantize_cpu(&x, block)?;
            let (pg, ag) = quantize_generic(&x, block)?;
            same(&bytes(&pk), &bytes(&pg), &format!("{shape:?} codes"));
            same(&bits(&ak), &bits(&ag), &format!("{shape:?} absmax"));
            if shape.0 == 8 {
                let b = bytes(&pk);
                assert_eq!(b[0], 0xFF, "zero pair not stored as 0xFF");
                assert_eq!(b[33] ^ FLIP, 0xFF, "codes (15, 15) missing");
            }
            let double = double_quantize(&ak)?;
            for absmax in [Absmax::F32(ak.clone()), double] {
                for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                    let w = Nf4Weight {
                        packed: pk.clone(),
                        absmax: absmax.clone(),
                        block,
                        shape,
                        dtype,
                    };
                    let k = w.dequantize()?;
                    let g = w.dequantize_generic()?;
                    assert_eq!(k.dtype(), dtype);
                    assert_eq!(g.dtype(), dtype);
                    assert_eq!(k.dims(), &[shape.0, shape.1]);
                    let kv = k.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    let gv = g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    let dq = matches!(absmax, Absmax::Double { .. });
                    same(&kv, &gv, &format!("{shape:?} {dtype:?} dq={dq} dequant"));
                    if shape.0 == 8 {
                        assert!(kv[..64].iter().all(|&v| v == 0.0));
                        assert!(kv[66] > 0.0 && kv[66] == kv[67], "{} {}", kv[66], kv[67]);
                    }
                }
            }
        }
        Ok(())
    }

    /// Round trip error is bounded by half the widest code gap times the block absmax.
    #[test]
    fn round_trip_error_is_bounded() -> Result<()> {
        let x = Tensor::randn(0f32, 1., (32, 128), &Device::Cpu)?;
        for dq in [false, true] {
            let d = Nf4Weight::quantize(&x, dq)?.dequantize()?;
            let err = (&d - &x)?.abs()?.reshape((64, 64))?.max(1)?; // per block
            let amax = x.abs()?.reshape((64, 64))?.max(1)?;
            // widest gap: -1.0 .. -0.6962 = 0.304; half of it, plus slack for the 8-bit absmax.
            let ratio = (err / amax)?.max_all()?.to_scalar::<f32>()?;
            assert!(ratio < 0.16, "double_quant={dq}: {ratio}");
        }
        Ok(())
    }

    /// Forward equals x W^T with W dequantized; backward gives dX = dY W and nothing for W.
    #[test]
    fn nf4_matmul_value_and_input_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (24, 64), &dev)?;
        let q = Arc::new(Nf4Weight::quantize(&w, true)?);
        let wd = q.dequantize()?;
        let x = Var::randn(0f32, 1., (5, 64), &dev)?;
        let y = x.as_tensor().apply_op1(Nf4Matmul { w: q.clone() })?;
        let y_ref = x.matmul(&wd.t()?)?;
        let diff = (&y - &y_ref)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "forward differs by {diff}");
        let g = y.sqr()?.sum_all()?.backward()?;
        let g_ref = y_ref.sqr()?.sum_all()?.backward()?;
        let diff = (g.get(&x).unwrap() - g_ref.get(&x).unwrap())?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-4, "dx differs by {diff}");
        // Only x (and the graph's own nodes) have gradients: the packed weight is no variable.
        assert!(g.get(&q.packed).is_none());
        Ok(())
    }

    #[test]
    fn storage_is_about_half_a_byte_per_parameter() -> Result<()> {
        // A Qwen2.5-0.5B-sized MLP projection: 896 x 4864.
        let w = Tensor::randn(0f32, 1., (896, 4864), &Device::Cpu)?;
        let n = w.elem_count() as f64;
        let plain = Nf4Weight::quantize(&w, false)?.storage_bytes() as f64 / n;
        let dq = Nf4Weight::quantize(&w, true)?.storage_bytes() as f64 / n;
        assert!((plain - 0.5625).abs() < 1e-6, "{plain}");
        assert!(dq < 0.5161 && dq > 0.5156, "{dq}");
        Ok(())
    }
}
