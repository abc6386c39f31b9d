//! 8-bit dynamic maps and blockwise 8-bit quantization (bitsandbytes `quantize_blockwise`).
//!
//! Used for 8-bit optimizer state (m with the signed map, v with the unsigned one, block 256;
//! Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
//! <https://arxiv.org/abs/2110.02861>) and for the nested absmax of NF4 double quantization.
//!
//! Format, as bitsandbytes (`bitsandbytes/functional.py`, `create_dynamic_map`,
//! `quantize_blockwise`): the tensor is flattened row-major and cut into blocks of `block`
//! elements (the last block may be shorter). Per block, `absmax = max |x|` (f32), every element
//! is normalized `x * (1 / absmax)`, clamped to [-1, 1], and stored as the index (u8) of the
//! nearest of the 256 sorted codes of the map; a value exactly halfway between two codes takes the
//! lower index. Dequantization is `map[code] * absmax`.
//!
//! Which bitsandbytes this matches (see `scripts/make_quant_fixtures.py` and
//! `tests/tests/quant_dynamic.rs`): codes equal, bit for bit, those of bitsandbytes' reference
//! ("default", pure torch) backend, `torch.bucketize(normed, (code[:-1] + code[1:]) / 2)` with
//! `absmax.clamp(min=1e-38)` before the reciprocal, so a block of zeros gives code(0.0) and
//! dequantizes to 0, never NaN. bitsandbytes' native CPU kernel (`csrc/cpu_ops.cpp`, a
//! `BinSearch::Direct2` lookup of limited resolution) is not exactly nearest: on random data it
//! picks a farther code for about 0.3% (signed) to 3% (unsigned) of the elements, up to 0.015 of
//! absmax away; the fixture test checks those bounds and that our code is never farther.
//!
//! Two implementations of the quantizer give identical codes: a CPU kernel (a [`CustomOp2`],
//! binary search over the 255 midpoints, blocks split across threads) and a device-generic one
//! built only from Candle tensor ops (an 8-step binary search with `index_select` gathers), used
//! on CUDA and other devices.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

use crate::error::ModelError;

/// Number of codes of an 8-bit map.
const CODES: usize = 256;

/// Smallest absmax used for the reciprocal (bitsandbytes' `absmax.clamp(min=1e-38)`; the python
/// float 1e-38 rounded to f32, as torch does). The stored absmax stays unclamped.
const MIN_ABSMAX: f32 = 1e-38f64 as f32;

/// Elements below which the CPU kernel runs on one thread (spawning costs more than it saves).
const PARALLEL_MIN: usize = 1 << 16;

/// bitsandbytes `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: 256 sorted
/// codes in [-1, 1] (signed) or [0, 1].
///
/// For exponent `i` in 0..7 the map holds the midpoints of `torch.linspace(0.1, 1, k)` scaled
/// by `10^(i-6)`, with `k = 2^i + 1` (signed, and the same values negated) or `2^(i+1) + 1`
/// (unsigned); then 0 and 1. The signed map's smallest code is -0.99296875, not -1. Bit-exact with
/// bitsandbytes' map as computed by torch 2.8 on x86 (checked by the fixture test), which needs
/// torch's linspace arithmetic: `start + step * i` for the first half and
/// `end - step * (k - 1 - i)` for the rest, each a fused multiply-add.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    // 10^(i-6) as torch gets it: a python float, rounded to f32 for the f32 multiply.
    const SCALES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
    let mut data: Vec<f32> = Vec::with_capacity(CODES);
    for (i, &scale) in SCALES.iter().enumerate() {
        let k = if signed {
            (1 << i) + 1
        } else {
            (1 << (i + 1)) + 1
        };
        let bounds = linspace(0.1, 1.0, k);
        let scale = scale as f32;
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0; // (boundaries[:-1] + boundaries[1:]) / 2.0
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    // With max_exponent_bits = 7 and total_bits = 8, bitsandbytes' "additional items" (fraction
    // codes of the all-zero exponent) number 2^(7-7) - 1 = 0: nothing to add.
    data.push(0.0);
    data.push(1.0);
    debug_assert_eq!(data.len(), CODES);
    data.sort_by(f32::total_cmp);
    let mut out = [0f32; CODES];
    out.copy_from_slice(&data);
    out
}

/// `torch.linspace(start, end, k, dtype=torch.float32)` on the CPU, value for value.
fn linspace(start: f32, end: f32, k: usize) -> Vec<f32> {
    let step = (end - start) / (k - 1) as f32;
    let halfway = k / 2;
    (0..k)
        .map(|i| {
            if i < halfway {
                step.mul_add(i as f32, start) // start + step * i
            } else {
                (-step).mul_add((k - 1 - i) as f32, end) // end - step * (k - 1 - i)
            }
        })
        .collect()
}

/// The 255 decision boundaries `(map[j] + map[j+1]) / 2` (f32, as bitsandbytes computes them):
/// the code of a normalized value `v` is the number of boundaries `< v`.
fn midpoints(signed: bool) -> [f32; CODES - 1] {
    let map = dynamic_map(signed);
    let mut mids = [0f32; CODES - 1];
    for (j, m) in mids.iter_mut().enumerate() {
        *m = (map[j] + map[j + 1]) / 2.0;
    }
    mids
}

/// Blockwise 8-bit quantized tensor (bitsandbytes `quantize_blockwise` with the dynamic map).
#[derive(Clone, Debug)]
pub struct Blockwise8 {
    /// u8, (n,): the tensor flattened row-major, one code per element.
    pub codes: Tensor,
    /// f32, (ceil(n / block),): max |x| of each block.
    pub absmax: Tensor,
    /// Elements per block (bitsandbytes: 256 for optimizer state and nested absmax).
    pub block: usize,
    /// Signed or unsigned [`dynamic_map`].
    pub signed: bool,
    /// Shape of the original tensor.
    pub shape: Shape,
}

impl Blockwise8 {
    /// Builds one from stored parts (e.g. a checkpoint), checking that they fit together.
    pub fn from_parts(
        codes: Tensor,
        absmax: Tensor,
        block: usize,
        signed: bool,
        shape: Shape,
    ) -> crate::Result<Self> {
        let q = Self {
            codes,
            absmax,
            block,
            signed,
            shape,
        };
        q.check()?;
        Ok(q)
    }

    /// Bytes held: one per code plus four per block scale.
    pub fn nbytes(&self) -> usize {
        self.codes.elem_count() + 4 * self.absmax.elem_count()
    }

    /// Errors unless codes are u8 of n elements and absmax f32 of ceil(n / block).
    fn check(&self) -> crate::Result<()> {
        let n = self.shape.elem_count();
        if self.block == 0 {
            return Err(invalid("block size must be at least 1"));
        }
        if self.codes.dtype() != DType::U8 || self.codes.dims() != [n] {
            return Err(invalid(format!(
                "codes must be u8 of shape ({n},) for a tensor of shape {:?}, got {:?} {:?}",
                self.shape,
                self.codes.dtype(),
                self.codes.dims()
            )));
        }
        let nb = n.div_ceil(self.block);
        if self.absmax.dtype() != DType::F32 || self.absmax.dims() != [nb] {
            return Err(invalid(format!(
                "absmax must be f32 of shape ({nb},) (one per block of {} of {n} elements), \
                 got {:?} {:?}",
                self.block,
                self.absmax.dtype(),
                self.absmax.dims()
            )));
        }
        Ok(())
    }
}

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(format!("blockwise 8-bit: {}", msg.into()))
}

/// Quantizes `x` (any float dtype, any shape) blockwise to 8 bits with the signed or unsigned
/// [`dynamic_map`], on `x`'s device. See the module docs for the exact rounding.
pub fn quantize_blockwise(x: &Tensor, signed: bool, block: usize) -> crate::Result<Blockwise8> {
    quantize_with(x, signed, block, !x.device().is_cpu())
}

/// [`quantize_blockwise`], with the device-generic tensor-op path forced when `generic`.
fn quantize_with(
    x: &Tensor,
    signed: bool,
    block: usize,
    generic: bool,
) -> crate::Result<Blockwise8> {
    if block == 0 {
        return Err(invalid("block size must be at least 1"));
    }
    if !x.dtype().is_float() {
        return Err(invalid(format!(
            "can only quantize float tensors, got {:?}",
            x.dtype()
        )));
    }
    let shape = x.shape().clone();
    let flat = x.flatten_all()?.to_dtype(DType::F32)?.contiguous()?; // (n,)
    let n = flat.elem_count();
    let nb = n.div_ceil(block);
    let blocks = pad_to(&flat, nb * block)?.reshape((nb, block))?; // (nb, block), zero-padded
    let absmax = blocks.abs()?.max(1)?; // (nb,)
                                        // 1 / max(absmax, 1e-38): a block of zeros normalizes to 0, not NaN.
    let recip = absmax.maximum(MIN_ABSMAX as f64)?.recip()?; // (nb,)
    let codes = if generic {
        codes_generic(&blocks, &recip, n, signed)?
    } else {
        flat.apply_op2_no_bwd(
            &recip,
            &CodesKernel {
                mids: midpoints(signed),
                block,
            },
        )?
    };
    Ok(Blockwise8 {
        codes,
        absmax,
        block,
        signed,
        shape,
    })
}

/// Dequantizes to f32 of `q.shape`, on `q`'s device: `map[code] * absmax` of the block.
pub fn dequantize_blockwise(q: &Blockwise8) -> crate::Result<Tensor> {
    q.check()?;
    let n = q.shape.elem_count();
    let nb = n.div_ceil(q.block);
    let dev = q.codes.device();
    let map = Tensor::new(&dynamic_map(q.signed), dev)?; // (256,)
    let values = map.index_select(&q.codes.to_dtype(DType::U32)?, 0)?; // (n,)
    let values = pad_to(&values, nb * q.block)?.reshape((nb, q.block))?; // (nb, block)
    let x = values.broadcast_mul(&q.absmax.unsqueeze(1)?)?; // (nb, block) * (nb, 1)
    Ok(x.flatten_all()?.narrow(0, 0, n)?.reshape(q.shape.clone())?) // (n,) -> shape
}

/// `x` (n,) followed by zeros up to `len` elements.
fn pad_to(x: &Tensor, len: usize) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    if len == n {
        return Ok(x.clone());
    }
    let zeros = Tensor::zeros(len - n, x.dtype(), x.device())?;
    Tensor::cat(&[x, &zeros], 0)
}

/// Device-generic codes: normalize with tensor ops, then the number of midpoints below each value
/// by an 8-step binary search whose probes are `index_select` gathers from the 255 midpoints.
/// `blocks` (nb, block) f32 zero-padded, `recip` (nb,) f32; returns u8 (n,).
fn codes_generic(
    blocks: &Tensor,
    recip: &Tensor,
    n: usize,
    signed: bool,
) -> candle_core::Result<Tensor> {
    let dev = blocks.device();
    let normed = blocks
        .broadcast_mul(&recip.unsqueeze(1)?)? // (nb, block) * (nb, 1)
        .clamp(-1f32, 1f32)?
        .flatten_all()? // (nb * block,)
        .narrow(0, 0, n)?; // (n,)
    let mids = Tensor::new(&midpoints(signed), dev)?; // (255,)
                                                      // Invariant: lo = number of midpoints < v among the first lo (all of them are), and after
                                                      // the probe of width `step` the answer lies in [lo, lo + step). 255 = 2^8 - 1 midpoints.
    let mut lo = Tensor::zeros(n, DType::U32, dev)?; // (n,)
    for step in [128u32, 64, 32, 16, 8, 4, 2, 1] {
        let cand = lo.affine(1.0, step as f64)?; // lo + step
        let probe = mids.index_select(&lo.affine(1.0, (step - 1) as f64)?, 0)?; // mids[cand - 1]
                                                                                // take the step unless mids[cand-1] >= v (so NaN takes every step, as in the kernel)
        lo = probe.ge(&normed)?.where_cond(&lo, &cand)?;
    }
    lo.to_dtype(DType::U8)
}

/// CPU kernel: `(x (n,) f32, recip (nb,) f32) -> codes (n,) u8`, blocks split across threads.
struct CodesKernel {
    mids: [f32; CODES - 1],
    block: usize,
}

impl CodesKernel {
    /// Codes of consecutive whole blocks: `x` and `out` start at a block boundary, `recip[b]` is
    /// the reciprocal absmax of their block `b`.
    fn run(&self, x: &[f32], recip: &[f32], out: &mut [u8]) {
        for ((xb, ob), &r) in x
            .chunks(self.block)
            .zip(out.chunks_mut(self.block))
            .zip(recip)
        {
            for (o, &v) in ob.iter_mut().zip(xb) {
                let v = (v * r).clamp(-1.0, 1.0);
                // number of midpoints < v: the nearest code, ties to the lower one. NaN counts
                // as above every midpoint (code 255), as torch.bucketize does.
                *o = self.mids.partition_point(|&m| m < v || v.is_nan()) as u8;
            }
        }
    }
}

impl CustomOp2 for CodesKernel {
    fn name(&self) -> &'static str {
        "quantize-blockwise-8bit"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let contiguous = |l: &Layout, what: &str| {
            l.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg(format!("{}: {what} must be contiguous", self.name()))
            })
        };
        let (a, b) = contiguous(l1, "x")?;
        let x = &s1.as_slice::<f32>()?[a..b];
        let (a, b) = contiguous(l2, "recip")?;
        let recip = &s2.as_slice::<f32>()?[a..b];
        let n = x.len();
        if recip.len() != n.div_ceil(self.block) {
            candle_core::bail!(
                "{}: {} block scales for {n} elements in blocks of {}",
                self.name(),
                recip.len(),
                self.block
            );
        }
        let mut out = vec![0u8; n];
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        if n < PARALLEL_MIN || threads == 1 {
            self.run(x, recip, &mut out);
        } else {
            // Whole blocks per thread, so each thread reads its own scales.
            let blocks_per = recip.len().div_ceil(threads);
            let chunk = blocks_per * self.block;
            std::thread::scope(|s| {
                for ((xc, oc), rc) in x
                    .chunks(chunk)
                    .zip(out.chunks_mut(chunk))
                    .zip(recip.chunks(blocks_per))
                {
                    s.spawn(move || self.run(xc, rc, oc));
                }
            });
        }
        Ok((CpuStorage::U8(out), Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};

    #[test]
    fn maps_are_sorted_and_span_the_range() {
        let s = dynamic_map(true);
        let u = dynamic_map(false);
        assert!(
            s.windows(2).all(|w| w[0] < w[1]),
            "signed map not strictly sorted"
        );
        assert!(
            u.windows(2).all(|w| w[0] < w[1]),
            "unsigned map not strictly sorted"
        );
        assert_eq!(s[255], 1.0);
        assert_eq!(s[127], 0.0);
        assert_eq!(s[0], -0.992_968_75);
        assert_eq!(u[0], 0.0);
        assert_eq!(u[255], 1.0);
        // the smallest nonzero magnitude: 1e-6 * mean(0.1, 1) (signed), 1e-6 * mean(0.1, 0.55)
        assert!((s[128] - 0.55e-6).abs() < 1e-12, "{}", s[128]);
        assert!((u[1] - 0.325e-6).abs() < 1e-12, "{}", u[1]);
    }

    /// Random values with the hard cases: zeros, subnormal-tiny and huge values, a whole block of
    /// zeros, a block of one sign, exact codes, and a last block shorter than `block`.
    fn nasty(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                let mag = 10f32.powf(rng.random_range(-8.0..2.0));
                match rng.random_range(0..20) {
                    0 => 0.0,
                    1 => 1e-30,
                    2 => -3e30,
                    _ => mag * if rng.random::<bool>() { 1.0 } else { -1.0 },
                }
            })
            .collect();
        v[256..512].fill(0.0); // a block of zeros
        for (j, x) in v[512..768].iter_mut().enumerate() {
            *x = (j as f32 - 128.0) / 128.0; // exact codes and midpoints ahead
        }
        v[768..1024].iter_mut().for_each(|x| *x = x.abs()); // one sign
        v
    }

    #[test]
    fn generic_path_equals_cpu_kernel_exactly() {
        let dev = Device::Cpu;
        // > PARALLEL_MIN so the threaded kernel runs; not a multiple of 256
        for (n, seed) in [(70_001usize, 1u64), (1_100, 2)] {
            let mut v = nasty(n, seed);
            v[7] = f32::NAN; // torch.bucketize puts NaN last: code 255 on both paths
            let x = Tensor::from_vec(v, (n,), &dev).unwrap();
            for signed in [true, false] {
                let x = if signed { x.clone() } else { x.abs().unwrap() };
                let k = quantize_with(&x, signed, 256, false).unwrap();
                let g = quantize_with(&x, signed, 256, true).unwrap();
                let (kc, gc) = (
                    k.codes.to_vec1::<u8>().unwrap(),
                    g.codes.to_vec1::<u8>().unwrap(),
                );
                assert_eq!(kc, gc, "codes differ (n {n}, signed {signed})");
                assert_eq!(kc[7], 255);
                assert_eq!(
                    k.absmax.to_vec1::<f32>().unwrap(),
                    g.absmax.to_vec1::<f32>().unwrap()
                );
                // not trivially equal: many distinct codes are used
                let mut seen = [false; 256];
                kc.iter().for_each(|&c| seen[c as usize] = true);
                assert!(seen.iter().filter(|&&s| s).count() > 100);
            }
        }
    }

    #[test]
    fn codes_are_the_nearest_and_round_trip_within_half_a_gap() {
        let dev = Device::Cpu;
        let n = 5_000;
        let x = Tensor::from_vec(nasty(n, 3), (n,), &dev).unwrap();
        let q = quantize_blockwise(&x, true, 256).unwrap();
        let map = dynamic_map(true);
        let xs = x.to_vec1::<f32>().unwrap();
        let codes = q.codes.to_vec1::<u8>().unwrap();
        let absmax = q.absmax.to_vec1::<f32>().unwrap();
        let back = dequantize_blockwise(&q).unwrap().to_vec1::<f32>().unwrap();
        for (i, (&v, &c)) in xs.iter().zip(&codes).enumerate() {
            let a = absmax[i / 256];
            let normed = if a == 0.0 {
                0.0
            } else {
                (v * (1.0 / a)) as f64
            };
            let best = map
                .iter()
                .map(|&m| (normed - m as f64).abs())
                .fold(f64::INFINITY, f64::min);
            let got = (normed - map[c as usize] as f64).abs();
            assert!(got <= best + 1e-7, "element {i}: code {c} not nearest");
            assert!(back[i].is_finite());
            assert_eq!(back[i], map[c as usize] * a);
        }
        // the block of zeros: absmax 0, every value back to exactly 0
        assert_eq!(absmax[1], 0.0);
        assert!(back[256..512].iter().all(|&v| v == 0.0));
        assert!(codes[256..512].iter().all(|&c| c == 127));
    }

    #[test]
    fn keeps_shape_dtype_and_device_and_accepts_bf16() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[0.5f32, -1.0, 0.25], [2.0, 0.0, -0.125]], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let q = quantize_blockwise(&x, true, 4).unwrap();
        assert_eq!(q.codes.dims(), [6]);
        assert_eq!(q.absmax.to_vec1::<f32>().unwrap(), vec![2.0, 0.125]);
        assert_eq!(q.nbytes(), 6 + 8);
        let back = dequantize_blockwise(&q).unwrap();
        assert_eq!(back.dims(), [2, 3]);
        assert_eq!(back.dtype(), DType::F32);
        // 1.0 and the absmax are exact codes
        let v = back.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!((v[1] + 1.0).abs() < 0.01, "{}", v[1]); // -0.5 normalized: a code near it
        assert_eq!(v[3], 2.0);
        assert_eq!(v[4], 0.0);
        assert_eq!(v[5], -0.125 * 0.992_968_75);
    }

    #[test]
    fn rejects_bad_parts_with_a_clear_message() {
        let dev = Device::Cpu;
        let x = Tensor::zeros(10, DType::F32, &dev).unwrap();
        assert!(quantize_blockwise(&x, true, 0).is_err());
        let q = quantize_blockwise(&x, true, 4).unwrap();
        let msg = Blockwise8::from_parts(
            q.codes.clone(),
            Tensor::zeros(2, DType::F32, &dev).unwrap(),
            4,
            true,
            q.shape.clone(),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("absmax must be f32 of shape (3,)"), "{msg}");
        let msg = Blockwise8::from_parts(
            q.codes.to_dtype(DType::F32).unwrap(),
            q.absmax.clone(),
            4,
            true,
            q.shape.clone(),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("codes must be u8"), "{msg}");
    }
}
