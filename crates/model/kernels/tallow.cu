// tallow's own CUDA kernels, compiled to PTX by crates/model/build.rs (feature `cuda`) for
// compute capability $CUDA_COMPUTE_CAP (default 80), and checked against their CPU twins by
// `tallow doctor`. Each kernel names the Rust function it must match bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// SplitMix64's output function (Steele, Lea, Flood 2014), as `tallow_model::dropout::mix`.
__device__ __forceinline__ uint64_t tallow_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Inverted dropout with a counter-based mask, as `tallow_model::dropout::DropoutOp::cpu_fwd`:
// element i is kept when the high 32 bits of mix(seed + (i + 1) * golden) are >= threshold
// (= round(p * 2^32)), and then scaled by `scale` (= 1 / (1 - p) in f32). No generator state:
// forward, backward and a checkpointed recompute draw the same mask from (seed, i).
extern "C" __global__ void tallow_dropout_f32(
    const float *x, float *y, const size_t n, const uint64_t seed, const uint32_t threshold,
    const float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const uint64_t h = tallow_mix(seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
        y[i] = ((uint32_t)(h >> 32) >= threshold) ? x[i] * scale : 0.0f;
    }
}

// NF4 dequantization, as `tallow_model::quant::nf4::Dequant::cpu_fwd`: one thread per packed
// byte writes its two elements, out[e] = conv(lut[2 byte + k] * absmax[e / block]), the product
// in f32 rounded once to the output type (round to nearest even, as `half`'s from_f32). The
// absmax is an f32 per block, or with double quantization (DQ) decoded in place as bitsandbytes
// does, with its two roundings: map[codes[b]] * nested[b / nested_block], then + offset. The
// explicit _rn intrinsics keep nvcc from contracting them into one fused multiply-add.
// `lut` is the (256, 2) byte -> values table and `map` the signed dynamic map, both uploaded
// once per device from the Rust constants, so both sides read the same f32 values.
template <typename T> __device__ __forceinline__ T tallow_from_f32(float v);
template <> __device__ __forceinline__ float tallow_from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 tallow_from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half tallow_from_f32<__half>(float v) {
    return __float2half_rn(v);
}

template <typename T, bool DQ>
__device__ __forceinline__ void tallow_nf4_dequant(
    const uint8_t *packed, const float *lut, const float *absmax, const uint8_t *codes,
    const float *nested, const float *map, const float offset, const size_t nested_block,
    const size_t block, const size_t n, T *out) {
    const size_t bytes = (n + 1) / 2;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < bytes;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t e = 2 * i;
        const size_t b = e / block;  // block is even: e and e + 1 share it
        float a;
        if (DQ) {
            a = __fadd_rn(__fmul_rn(map[codes[b]], nested[b / nested_block]), offset);
        } else {
            a = absmax[b];
        }
        const unsigned byte = packed[i];
        out[e] = tallow_from_f32<T>(__fmul_rn(lut[2 * byte], a));
        if (e + 1 < n) {
            out[e + 1] = tallow_from_f32<T>(__fmul_rn(lut[2 * byte + 1], a));
        }
    }
}

#define TALLOW_NF4_DEQUANT(SUFFIX, T)                                                            \
    extern "C" __global__ void tallow_nf4_dequant_##SUFFIX(                                      \
        const uint8_t *packed, const float *lut, const float *absmax, const size_t block,        \
        const size_t n, T *out) {                                                                \
        tallow_nf4_dequant<T, false>(packed, lut, absmax, nullptr, nullptr, nullptr, 0.0f, 1,    \
                                     block, n, out);                                             \
    }                                                                                            \
    extern "C" __global__ void tallow_nf4_dequant_dq_##SUFFIX(                                   \
        const uint8_t *packed, const float *lut, const uint8_t *codes, const float *nested,      \
        const float *map, const float offset, const size_t nested_block, const size_t block,     \
        const size_t n, T *out) {                                                                \
        tallow_nf4_dequant<T, true>(packed, lut, nullptr, codes, nested, map, offset,            \
                                    nested_block, block, n, out);                                \
    }

TALLOW_NF4_DEQUANT(f32, float)
TALLOW_NF4_DEQUANT(bf16, __nv_bfloat16)
TALLOW_NF4_DEQUANT(f16, __half)
