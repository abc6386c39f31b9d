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
//! built only from Candle tensor ops, used on CUDA and other devices: a bucket lookup (see
//! [`Buckets`]) that finds the code in 5 element-wise ops, with no search loop.
//!
//! Device cost (kernel launches; "full" = one pass over the n elements, "small" = over the n/256
//! block scales), constants cached per device ([`crate::kernels::consts`]), no host-device copies:
//! - [`dequantize_blockwise`]: 3 full (codes to u32, gather `map[code]`, multiply by the block
//!   absmax).
//! - [`quantize_blockwise`] on a non-CPU device: 2 full for the absmax (`abs`, row `max`), 2 small
//!   (clamp to 1e-38, reciprocal), 7 full for the codes (normalize, bucket index, cast, 2 gathers,
//!   compare, add).
//! - Either: +1 (a concatenation with cached zeros) when n is not a multiple of the block.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};

use crate::error::ModelError;
use crate::kernels::consts::{cached, ConstKey};
use crate::kernels::dispatch::Backend;

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

/// The map as a (256,) f32 tensor on `dev`, uploaded once per device.
pub fn map_tensor(signed: bool, dev: &Device) -> candle_core::Result<Tensor> {
    cached(dev, ConstKey::with("dynamic.map", [signed as u64]), |d| {
        Tensor::new(&dynamic_map(signed), d)
    })
}

/// Bytes of the device-generic quantizer's lookup tables (both maps), which the generic path
/// (CUDA) uploads once per device on the first 8-bit optimizer step: for memory estimates.
pub fn generic_table_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        [true, false]
            .into_iter()
            .map(|signed| {
                let b = Buckets::build(signed);
                b.base.len() + 4 * b.mid.len()
            })
            .sum()
    })
}

/// Lookup tables that turn a normalized value `v` into its code (the number of midpoints `< v`)
/// with element-wise ops only, exactly.
///
/// The bucket of `v` is `r(v) = u32(S - v * S)` for a power of two `S`, computed in f32 as the
/// device does (`affine(-S, S)`: `v * -S` is exact, one rounding in the add, so a fused
/// multiply-add gives the same bits; then a truncating, saturating cast: NaN and anything above
/// 1 go to bucket 0). `r` never increases as `v` grows, so every midpoint in a bucket above
/// `r(v)` (a larger index) is `< v`, every one in a bucket below is `> v`, and only midpoints in
/// `v`'s own bucket need comparing. `S` is the smallest power of two that puts at most one
/// midpoint in each bucket, so
///
/// `code(v) = base[r(v)] + (v > mid[r(v)])`
///
/// with `base[r]` the number of midpoints in buckets above `r` and `mid[r]` the bucket's own
/// midpoint (+inf if none). NaN lands in bucket 0, whose base is 255: code 255, as the kernel
/// (`torch.bucketize`) gives. Normalized values lie in [-1 - 2^-22, 1 + 2^-22], buckets 0..=2S.
struct Buckets {
    /// S
    scale: f32,
    /// (2S + 2,) u8
    base: Vec<u8>,
    /// (2S + 2,) f32
    mid: Vec<f32>,
}

impl Buckets {
    /// `r(v)`, bit for bit as the device computes it (see the type's docs).
    fn bucket(v: f32, scale: f32) -> u32 {
        (v * -scale + scale) as u32
    }

    fn build(signed: bool) -> Self {
        let mids = midpoints(signed);
        for k in 9..=26 {
            let scale = (1u32 << k) as f32;
            let r: Vec<u32> = mids.iter().map(|&m| Self::bucket(m, scale)).collect();
            // at most one midpoint per bucket <=> strictly decreasing; the top one above bucket 0
            if !r.windows(2).all(|w| w[0] > w[1]) || r[CODES - 2] == 0 {
                continue;
            }
            let len = 2 * (1usize << k) + 2;
            let mut base = vec![0u8; len];
            let mut mid = vec![f32::INFINITY; len];
            for (j, &rj) in r.iter().enumerate() {
                mid[rj as usize] = mids[j];
            }
            // base[b] = #{j : r_j > b} = 255 - #{j : r_j <= b}; walk the buckets upwards with
            // the bucket indices in ascending order (r reversed).
            let ascending: Vec<u32> = r.iter().rev().copied().collect();
            let mut at_or_below = 0;
            for (b, slot) in base.iter_mut().enumerate() {
                while at_or_below < ascending.len() && ascending[at_or_below] as usize <= b {
                    at_or_below += 1;
                }
                *slot = (CODES - 1 - at_or_below) as u8;
            }
            debug_assert_eq!(base[0] as usize, CODES - 1);
            return Self { scale, base, mid };
        }
        unreachable!("the dynamic map's midpoints are more than 2^-26 apart")
    }

    fn get(signed: bool) -> &'static Buckets {
        static TABLES: [OnceLock<Buckets>; 2] = [OnceLock::new(), OnceLock::new()];
        TABLES[signed as usize].get_or_init(|| Self::build(signed))
    }

    /// (S, base (2S+2,) u8, mid (2S+2,) f32) on `dev`, uploaded once per device.
    fn tensors(signed: bool, dev: &Device) -> candle_core::Result<(f32, Tensor, Tensor)> {
        let b = Self::get(signed);
        let base = cached(
            dev,
            ConstKey::with("dynamic.buckets.base", [signed as u64]),
            |d| Tensor::from_slice(&b.base, b.base.len(), d),
        )?;
        let mid = cached(
            dev,
            ConstKey::with("dynamic.buckets.mid", [signed as u64]),
            |d| Tensor::from_slice(&b.mid, b.mid.len(), d),
        )?;
        Ok((b.scale, base, mid))
    }
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
    quantize_with(x, signed, block, Backend::of(x.device()) == Backend::Cuda)
}

/// [`quantize_blockwise`] through the device-generic tensor-op path (the one CUDA runs) on any
/// device, the CPU included: for tests that compare it with the CPU kernel.
pub fn quantize_blockwise_generic(
    x: &Tensor,
    signed: bool,
    block: usize,
) -> crate::Result<Blockwise8> {
    quantize_with(x, signed, block, true)
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
                                        // 1 / max(absmax, 1e-38): a block of zeros normalizes to 0, not NaN. The bound is a cached
                                        // (1,) tensor: a scalar `maximum` would upload it on every call.
    let floor = cached(x.device(), ConstKey::new("dynamic.min_absmax"), |d| {
        Tensor::new(&[MIN_ABSMAX], d)
    })?;
    let recip = absmax.broadcast_maximum(&floor)?.recip()?; // (nb,)
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
/// Three element-wise ops (cast the codes to u32, gather, multiply), a fourth (the padding) when
/// n is not a multiple of the block; the map is cached per device.
///
/// The cast is needed: Candle's `index_select` returns zeros for the largest index of its index
/// type (255 for u8; `max_value` in `cpu_backend/mod.rs` and `indexing.cu`, candle 0.11), and
/// 255 is a real code here (1.0).
pub fn dequantize_blockwise(q: &Blockwise8) -> crate::Result<Tensor> {
    q.check()?;
    let n = q.shape.elem_count();
    let nb = n.div_ceil(q.block);
    let map = map_tensor(q.signed, q.codes.device())?; // (256,)
    let codes = pad_to(&q.codes.to_dtype(DType::U32)?, nb * q.block)?; // (nb * block,) u32
    let values = map.index_select(&codes, 0)?.reshape((nb, q.block))?; // (nb, block)
    let x = values.broadcast_mul(&q.absmax.unsqueeze(1)?)?; // (nb, block) * (nb, 1)
    Ok(x.flatten_all()?.narrow(0, 0, n)?.reshape(q.shape.clone())?) // (n,) -> shape
}

/// `x` (n,) followed by zeros up to `len` elements: one concatenation with a cached zero tensor.
pub(crate) fn pad_to(x: &Tensor, len: usize) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    if len == n {
        return Ok(x.clone());
    }
    let key = ConstKey::with("zeros", [(len - n) as u64, x.dtype() as u64]);
    let zeros = cached(x.device(), key, |d| Tensor::zeros(len - n, x.dtype(), d))?;
    Tensor::cat(&[x, &zeros], 0)
}

/// Device-generic codes by the bucket lookup of [`Buckets`]: 7 element-wise ops over the
/// padded elements, no loop, the tables cached per device.
/// `blocks` (nb, block) f32 zero-padded, `recip` (nb,) f32; returns u8 (n,).
///
/// No clamp to [-1, 1] (the kernel clamps): above 1 the bucket saturates to 0 and the code is
/// 255, below -1 the code is 0 (no midpoint is smaller), as for the clamped value.
fn codes_generic(
    blocks: &Tensor,
    recip: &Tensor,
    n: usize,
    signed: bool,
) -> candle_core::Result<Tensor> {
    let (scale, base, mid) = Buckets::tensors(signed, blocks.device())?;
    let normed = blocks
        .broadcast_mul(&recip.unsqueeze(1)?)? // (nb, block) * (nb, 1)
        .flatten_all()?; // (nb * block,)
    let s = scale as f64;
    let bucket = normed.affine(-s, s)?.to_dtype(DType::U32)?; // r(v) = u32(S - v S), (nb * block,)
    let below = base.index_select(&bucket, 0)?; // u8: midpoints in buckets above r(v)
    let own = mid.index_select(&bucket, 0)?; // f32: the midpoint in v's bucket, or +inf
    let codes = (below + normed.gt(&own)?)?; // u8 (nb * block,)
    codes.narrow(0, 0, n) // (n,)
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

    /// The bucket tables: their size, and the lookup against a direct count of the midpoints
    /// below, on every f32 near each midpoint (the hard cases) and on a grid over [-1.01, 1.01].
    #[test]
    fn bucket_lookup_equals_counting_midpoints() {
        for signed in [true, false] {
            let b = Buckets::get(signed);
            let mids = midpoints(signed);
            eprintln!(
                "signed {signed}: S = 2^{}, {} buckets, {} KiB",
                b.scale.log2(),
                b.base.len(),
                b.base.len() * 5 / 1024
            );
            let lookup = |v: f32| {
                let r = Buckets::bucket(v, b.scale) as usize;
                b.base[r] + u8::from(v > b.mid[r])
            };
            let count = |v: f32| {
                if v.is_nan() {
                    255
                } else {
                    mids.iter().filter(|&&m| m < v).count() as u8
                }
            };
            let mut probes = vec![f32::NAN, 0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001];
            for &m in &mids {
                let mut x = m;
                for _ in 0..3 {
                    x = f32::from_bits(x.to_bits() - 1);
                }
                for _ in 0..7 {
                    probes.push(x);
                    x = f32::from_bits(x.to_bits() + 1);
                }
            }
            // normalized values lie in [-1 - 2^-22, 1 + 2^-22]; above 1 saturates
            probes.extend((0..=200_000).map(|i| -1.0 + 2.02 * i as f32 / 200_000.0));
            for v in probes {
                assert_eq!(lookup(v), count(v), "signed {signed}: v = {v:e}");
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
