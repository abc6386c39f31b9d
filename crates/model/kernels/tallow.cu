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

// ---------------------------------------------------------------------------------------------
// The fused element-wise ops of a training step (`tallow_model::kernels::fused`), f32 and bf16:
// each does what its CPU twin does, in f32, and rounds to bf16 exactly where the twin's bf16
// body rounds (`ROUND`, a constant of the bf16 instances; the f32 instances never round). The
// _rn intrinsics keep nvcc from contracting a product and a sum into one fused multiply-add
// where the twin rounds both. A row reduction (RMSNorm) sums in another order than the twin's
// loop: its f32 results agree within a few ulp, which `tallow doctor` allows.

__device__ __forceinline__ float tallow_to_f32(float v) { return v; }
__device__ __forceinline__ float tallow_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// v rounded to bf16 and back when ROUND (the twin's `round_bf16`), else v.
template <bool ROUND> __device__ __forceinline__ float tallow_rb(float v) {
    return ROUND ? __bfloat162float(__float2bfloat16_rn(v)) : v;
}

// Candle's affine x * mul + add, the product and the sum rounded apart (its scalar products,
// `t * c`, are affine(c, 0): the + 0 only turns -0 into +0, kept so the bits agree).
__device__ __forceinline__ float tallow_affine(const float x, const float mul, const float add) {
    return __fadd_rn(__fmul_rn(x, mul), add);
}

// The sum of `v` over the block's threads, returned to every thread. `scratch` holds one float
// per warp (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float tallow_block_sum(float v, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();  // scratch may still be read by a previous call's last loop
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// RMSNorm, as `fused::rms_fwd` (f32) and `RmsNorm::kernel_bf16`: one block per row of c,
// s = sqrt(sum(x^2) inv_n + eps), y = x / s * w (bf16: r(r(x / s) w)); Gemma's (PLUS_ONE):
// y = (x (1 / s)) (w + 1), rounded once.
template <typename T, bool ROUND, bool PLUS_ONE>
__device__ __forceinline__ void tallow_rms_norm(
    const T *x, const T *w, T *y, const size_t c, const float eps, const float inv_n) {
    __shared__ float scratch[32];
    const T *xr = x + (size_t)blockIdx.x * c;
    T *yr = y + (size_t)blockIdx.x * c;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
        const float v = tallow_to_f32(xr[i]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    ss = tallow_block_sum(ss, scratch);
    const float s = __fsqrt_rn(__fadd_rn(__fmul_rn(ss, inv_n), eps));
    if (PLUS_ONE) {
        const float r = __frcp_rn(s);
        for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
            const float n = __fmul_rn(tallow_to_f32(xr[i]), r);
            yr[i] = tallow_from_f32<T>(__fmul_rn(n, __fadd_rn(tallow_to_f32(w[i]), 1.0f)));
        }
    } else {
        for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
            const float n = tallow_rb<ROUND>(__fdiv_rn(tallow_to_f32(xr[i]), s));
            yr[i] = tallow_from_f32<T>(__fmul_rn(n, tallow_to_f32(w[i])));
        }
    }
}

// RMSNorm's backward's g: dy w rounded (ROUND), or Gemma's dy (w + 1).
template <bool ROUND, bool PLUS_ONE, typename T>
__device__ __forceinline__ float tallow_rms_g(const T dy, const T w) {
    if (PLUS_ONE) return __fmul_rn(tallow_to_f32(dy), __fadd_rn(tallow_to_f32(w), 1.0f));
    return tallow_rb<ROUND>(__fmul_rn(tallow_to_f32(dy), tallow_to_f32(w)));
}

// RMSNorm's dx, as `fused::rms_bwd` (f32) and `RmsNormBwd::kernel_bf16`: r = 1 / s,
// g = dy w (bf16: rounded; PLUS_ONE: dy (w + 1), not rounded), xn = x r,
// dx = (g - xn mean(g xn)) r.
template <typename T, bool ROUND, bool PLUS_ONE>
__device__ __forceinline__ void tallow_rms_norm_bwd(
    const T *x, const T *w, const T *dy, T *dx, const size_t c, const float eps,
    const float inv_n) {
    __shared__ float scratch[32];
    const size_t row = (size_t)blockIdx.x * c;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
        const float v = tallow_to_f32(x[row + i]);
        ss = __fadd_rn(ss, __fmul_rn(v, v));
    }
    ss = tallow_block_sum(ss, scratch);
    const float r = __frcp_rn(__fsqrt_rn(__fadd_rn(__fmul_rn(ss, inv_n), eps)));
    float dot = 0.0f;
    for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
        const float g = tallow_rms_g<ROUND, PLUS_ONE>(dy[row + i], w[i]);
        dot = __fadd_rn(dot, __fmul_rn(g, __fmul_rn(tallow_to_f32(x[row + i]), r)));
    }
    const float mean = __fmul_rn(tallow_block_sum(dot, scratch), inv_n);
    for (size_t i = threadIdx.x; i < c; i += blockDim.x) {
        const float g = tallow_rms_g<ROUND, PLUS_ONE>(dy[row + i], w[i]);
        const float xn = __fmul_rn(tallow_to_f32(x[row + i]), r);
        dx[row + i] = tallow_from_f32<T>(__fmul_rn(__fsub_rn(g, __fmul_rn(xn, mean)), r));
    }
}

// Rotary embedding with the head transpose, as `fused::rope_rows_as`: one thread per (output
// row, k < d / 2), writing elements k and k + d / 2 of the row. Forward: x (B, T, H, D) ->
// (B, H, T, D), y = x cos + rotate_half(x) sin, then times `scale` unless it is 1. Backward:
// dy (B, H, T, D) -> dx (B, T, H, D), its transpose. cs is (2, B, 1, T, D): cos, then sin.
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_rope(
    const T *x, const T *cs, T *y, const size_t b, const size_t t, const size_t h,
    const size_t d, const float scale, const int backward) {
    const size_t half = d / 2, pairs = b * t * h * half;
    const T *cos = cs, *sin = cs + b * t * d;
    const bool one = scale == 1.0f;
    for (size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs;
         p += (size_t)blockDim.x * gridDim.x) {
        const size_t row = p / half, k = p % half;
        size_t bi, ti, src;
        if (backward) {  // out (B, T, H, D), in (B, H, T, D)
            const size_t bt = row / h, hi = row % h;
            bi = bt / t;
            ti = bt % t;
            src = ((bi * h + hi) * t + ti) * d;
        } else {  // out (B, H, T, D), in (B, T, H, D)
            const size_t bh = row / t;
            ti = row % t;
            bi = bh / h;
            const size_t hi = bh % h;
            src = ((bi * t + ti) * h + hi) * d;
        }
        const size_t tab = (bi * t + ti) * d;
        const float c_lo = tallow_to_f32(cos[tab + k]), c_hi = tallow_to_f32(cos[tab + half + k]);
        const float s_lo = tallow_to_f32(sin[tab + k]), s_hi = tallow_to_f32(sin[tab + half + k]);
        float x_lo = tallow_to_f32(x[src + k]), x_hi = tallow_to_f32(x[src + half + k]);
        float lo, hi;
        if (backward) {
            if (!one) {
                x_lo = tallow_rb<ROUND>(__fmul_rn(x_lo, scale));
                x_hi = tallow_rb<ROUND>(__fmul_rn(x_hi, scale));
            }
            lo = tallow_rb<ROUND>(__fadd_rn(tallow_rb<ROUND>(__fmul_rn(x_lo, c_lo)),
                                            tallow_rb<ROUND>(__fmul_rn(x_hi, s_hi))));
            hi = tallow_rb<ROUND>(__fsub_rn(tallow_rb<ROUND>(__fmul_rn(x_hi, c_hi)),
                                            tallow_rb<ROUND>(__fmul_rn(x_lo, s_lo))));
        } else {
            lo = tallow_rb<ROUND>(__fadd_rn(tallow_rb<ROUND>(__fmul_rn(x_lo, c_lo)),
                                            tallow_rb<ROUND>(__fmul_rn(-x_hi, s_lo))));
            hi = tallow_rb<ROUND>(__fadd_rn(tallow_rb<ROUND>(__fmul_rn(x_hi, c_hi)),
                                            tallow_rb<ROUND>(__fmul_rn(x_lo, s_hi))));
            if (!one) {
                lo = tallow_rb<ROUND>(__fmul_rn(lo, scale));
                hi = tallow_rb<ROUND>(__fmul_rn(hi, scale));
            }
        }
        const size_t dst = row * d;
        y[dst + k] = tallow_from_f32<T>(lo);
        y[dst + half + k] = tallow_from_f32<T>(hi);
    }
}

// sigmoid(v) and silu(v) as `fused::sigmoid_silu`: from one exp of -|v|.
__device__ __forceinline__ void tallow_sigmoid_silu(const float v, float *s, float *y) {
    const bool neg = v < 0.0f;
    const float e = expf(neg ? v : -v);
    const float den = __fadd_rn(1.0f, e);
    const float num = neg ? e : 1.0f;
    *s = __fdiv_rn(num, den);
    *y = __fdiv_rn(__fmul_rn(v, num), den);
}

// gelu's tanh approximation (Gemma's GeGLU), as `fused::gelu_tanh` / `gelu_tanh_grad`: in
// Candle's order of operations (`ops::gelu_tanh`), tanhf for the CPU twin's tanh (the two within
// a few ulp).
// (act, t): inner = (x (x^2 C) + x) k, t = tanh(inner), act = ((t + 1) x) / 2.
__device__ __forceinline__ void tallow_gelu_tanh(const float x, float *act, float *t) {
    const float c = 0.044715f, k = 0.7978845608028654f;  // k = sqrt(2 / pi)
    const float x2 = __fmul_rn(x, x);
    const float inner =
        tallow_affine(__fadd_rn(__fmul_rn(x, tallow_affine(x2, c, 0.0f)), x), k, 0.0f);
    *t = tanhf(inner);
    *act = tallow_affine(__fmul_rn(__fadd_rn(*t, 1.0f), x), 0.5f, 0.0f);
}

// gelu_tanh'(x) from t: (t + 1) / 2 + ((x (1 - t^2)) (k (3 C x^2 + 1))) / 2.
__device__ __forceinline__ float tallow_gelu_tanh_grad(const float x, const float t) {
    const float c3 = 0.134145f, k = 0.7978845608028654f;  // 3 C
    const float dinner = tallow_affine(tallow_affine(__fmul_rn(x, x), c3, 1.0f), k, 0.0f);
    const float omt2 = tallow_affine(__fmul_rn(t, t), -1.0f, 1.0f);
    return __fadd_rn(tallow_affine(tallow_affine(t, 1.0f, 1.0f), 0.5f, 0.0f),
                     tallow_affine(__fmul_rn(__fmul_rn(x, omt2), dinner), 0.5f, 0.0f));
}

// The activations of the gated MLPs, for tallow_gate.
struct TallowSilu {
    static __device__ __forceinline__ float act(const float v) {
        float s, y;
        tallow_sigmoid_silu(v, &s, &y);
        return y;
    }
};
struct TallowGelu {
    static __device__ __forceinline__ float act(const float v) {
        float a, t;
        tallow_gelu_tanh(v, &a, &t);
        return a;
    }
};

// A gated MLP's gate, act(g) u: SwiGLU as `fused::swiglu_chunk_body` (f32) and
// `swiglu_chunk_bf16_body` (r(r(silu(g)) u)), GeGLU as `fused::GeGlu` (r(r(gelu(g)) u)).
template <typename T, bool ROUND, typename Act>
__device__ __forceinline__ void tallow_gate(const T *g, const T *u, T *y, const size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float a = Act::act(tallow_to_f32(g[i]));
        y[i] = tallow_from_f32<T>(__fmul_rn(tallow_rb<ROUND>(a), tallow_to_f32(u[i])));
    }
}

// SwiGLU's backward into out = (dg, du) (2 n), as `swiglu_bwd_chunk_body` (f32, Candle's silu
// derivative: dg = dh u (s (1 - y) + y), du = dh y) and `swiglu_bwd_chunk_bf16_body`
// (PyTorch's: a = r(y), da = r(dh u), dg = r(da s (1 + g (1 - s))), du = r(dh a)).
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_swiglu_bwd(
    const T *g, const T *u, const T *dh, T *out, const size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float gv = tallow_to_f32(g[i]), uv = tallow_to_f32(u[i]), d = tallow_to_f32(dh[i]);
        float s, y;
        tallow_sigmoid_silu(gv, &s, &y);
        float dg, du;
        if (ROUND) {
            const float a = tallow_rb<true>(y);
            const float da = tallow_rb<true>(__fmul_rn(d, uv));
            dg = __fmul_rn(da, __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(gv, __fsub_rn(1.0f, s)))));
            du = __fmul_rn(d, a);
        } else {
            dg = __fmul_rn(__fmul_rn(d, uv), __fadd_rn(__fmul_rn(s, __fsub_rn(1.0f, y)), y));
            du = __fmul_rn(d, y);
        }
        out[i] = tallow_from_f32<T>(dg);
        out[n + i] = tallow_from_f32<T>(du);
    }
}

// GeGLU's backward into out = (dg, du) (2 n): dg = (dh u) gelu'(g), du = dh r(gelu(g)).
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_geglu_bwd(
    const T *g, const T *u, const T *dh, T *out, const size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float gv = tallow_to_f32(g[i]), d = tallow_to_f32(dh[i]);
        float act, t;
        tallow_gelu_tanh(gv, &act, &t);
        const float dg =
            __fmul_rn(__fmul_rn(d, tallow_to_f32(u[i])), tallow_gelu_tanh_grad(gv, t));
        out[i] = tallow_from_f32<T>(dg);
        out[n + i] = tallow_from_f32<T>(__fmul_rn(d, tallow_rb<ROUND>(act)));
    }
}

#define TALLOW_FUSED(SUFFIX, T, ROUND)                                                           \
    extern "C" __global__ void tallow_rms_norm_##SUFFIX(                                         \
        const T *x, const T *w, T *y, const size_t c, const float eps, const float inv_n) {      \
        tallow_rms_norm<T, ROUND, false>(x, w, y, c, eps, inv_n);                                \
    }                                                                                            \
    extern "C" __global__ void tallow_rms_norm_bwd_##SUFFIX(                                     \
        const T *x, const T *w, const T *dy, T *dx, const size_t c, const float eps,             \
        const float inv_n) {                                                                     \
        tallow_rms_norm_bwd<T, ROUND, false>(x, w, dy, dx, c, eps, inv_n);                       \
    }                                                                                            \
    extern "C" __global__ void tallow_rms_norm_p1_##SUFFIX(                                      \
        const T *x, const T *w, T *y, const size_t c, const float eps, const float inv_n) {      \
        tallow_rms_norm<T, ROUND, true>(x, w, y, c, eps, inv_n);                                 \
    }                                                                                            \
    extern "C" __global__ void tallow_rms_norm_p1_bwd_##SUFFIX(                                  \
        const T *x, const T *w, const T *dy, T *dx, const size_t c, const float eps,             \
        const float inv_n) {                                                                     \
        tallow_rms_norm_bwd<T, ROUND, true>(x, w, dy, dx, c, eps, inv_n);                        \
    }                                                                                            \
    extern "C" __global__ void tallow_rope_##SUFFIX(                                             \
        const T *x, const T *cs, T *y, const size_t b, const size_t t, const size_t h,           \
        const size_t d, const float scale, const int backward) {                                 \
        tallow_rope<T, ROUND>(x, cs, y, b, t, h, d, scale, backward);                            \
    }                                                                                            \
    extern "C" __global__ void tallow_swiglu_##SUFFIX(                                           \
        const T *g, const T *u, T *y, const size_t n) {                                          \
        tallow_gate<T, ROUND, TallowSilu>(g, u, y, n);                                           \
    }                                                                                            \
    extern "C" __global__ void tallow_swiglu_bwd_##SUFFIX(                                       \
        const T *g, const T *u, const T *dh, T *out, const size_t n) {                           \
        tallow_swiglu_bwd<T, ROUND>(g, u, dh, out, n);                                           \
    }                                                                                            \
    extern "C" __global__ void tallow_geglu_##SUFFIX(                                            \
        const T *g, const T *u, T *y, const size_t n) {                                          \
        tallow_gate<T, ROUND, TallowGelu>(g, u, y, n);                                           \
    }                                                                                            \
    extern "C" __global__ void tallow_geglu_bwd_##SUFFIX(                                        \
        const T *g, const T *u, const T *dh, T *out, const size_t n) {                           \
        tallow_geglu_bwd<T, ROUND>(g, u, dh, out, n);                                            \
    }

TALLOW_FUSED(f32, float, false)
TALLOW_FUSED(bf16, __nv_bfloat16, true)

// ---------------------------------------------------------------------------------------------
// Cross-entropy over a chunk of f32 logits (n, V) (`tallow_model::kernels::cross_entropy`'s
// device ops, whose CPU twins are `CeRows::cpu_fwd` and `CeGradRows::cpu_fwd`): one block per
// row. The row's max and sum of exp(x - max) are block reductions in f32 (the twin sums in
// f64: rows of up to ~256k terms agree within a few f32 ulp of the log-sum-exp).

// The max of `v` over the block's threads, returned to every thread (as tallow_block_sum).
__device__ __forceinline__ float tallow_block_max(float v, float *scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The log-sum-exp of row x (v elements), to every thread of the block.
__device__ __forceinline__ float tallow_row_lse(const float *x, const size_t v, float *scratch) {
    float m = -INFINITY;
    for (size_t j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, x[j]);
    m = tallow_block_max(m, scratch);
    float s = 0.0f;
    for (size_t j = threadIdx.x; j < v; j += blockDim.x) s += expf(x[j] - m);
    s = tallow_block_sum(s, scratch);
    return m + logf(s);
}

// out[row] = lse(row) - x[row, label] (the row's NLL), out[n + row] = lse(row).
extern "C" __global__ void tallow_ce_rows_f32(
    const float *x, const uint32_t *labels, float *out, const size_t v, const size_t n) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float *xr = x + row * v;
    const float lse = tallow_row_lse(xr, v, scratch);
    if (threadIdx.x == 0) {
        out[row] = lse - xr[labels[row]];
        out[n + row] = lse;
    }
}

// In place: x[row, j] := g (exp(x[row, j] - lse[row]) - [j == label]), the gradient of
// g * sum of the rows' NLL; lse_g holds the n rows' log-sum-exp, then g.
extern "C" __global__ void tallow_ce_grad_f32(
    float *x, const uint32_t *labels, const float *lse_g, const size_t v, const size_t n) {
    const size_t row = blockIdx.x;
    float *xr = x + row * v;
    const float lse = lse_g[row], g = lse_g[n];
    const uint32_t y = labels[row];
    for (size_t j = threadIdx.x; j < v; j += blockDim.x) {
        const float p = __fmul_rn(expf(xr[j] - lse), g);
        xr[j] = j == y ? __fsub_rn(p, g) : p;
    }
}

// ---------------------------------------------------------------------------------------------
// AdamW over one parameter group's flat f32 buffers (`tallow_model::kernels::adamw`, whose CPU
// twins do the same IEEE operations in the same order: results bit for bit, as torch's
// single-tensor AdamW on f32): the moments (2, n) updated in place, then the new parameters.

// mv[i] = m, mv[n + i] = v: m = m b1 + g c1, v = v b2 + (g g) c2 (c1 = 1 - b1, c2 = 1 - b2).
extern "C" __global__ void tallow_adamw_moments_f32(
    float *mv, const float *g, const size_t n, const float b1, const float c1, const float b2,
    const float c2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float gi = g[i];
        mv[i] = __fadd_rn(tallow_affine(mv[i], b1, 0.0f), tallow_affine(gi, c1, 0.0f));
        mv[n + i] = __fadd_rn(tallow_affine(mv[n + i], b2, 0.0f),
                              tallow_affine(__fmul_rn(gi, gi), c2, 0.0f));
    }
}

// out = p' - (m / (sqrt(v) inv_bc2 + eps)) step, p' = p decay when `decay_on` (weight decay).
extern "C" __global__ void tallow_adamw_param_f32(
    const float *p, const float *mv, float *out, const size_t n, const float decay,
    const int decay_on, const float inv_bc2, const float eps, const float step) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)blockDim.x * gridDim.x) {
        const float pi = decay_on ? tallow_affine(p[i], decay, 0.0f) : p[i];
        const float denom = tallow_affine(__fsqrt_rn(mv[n + i]), inv_bc2, eps);
        out[i] = __fsub_rn(pi, tallow_affine(__fdiv_rn(mv[i], denom), step, 0.0f));
    }
}

// AdamW's update of up to TALLOW_ADAM_MEMBERS parameters of one group in one launch
// (`tallow_model::kernels::adamw::adamw_members`): each member's f32 parameter and gradient read
// where they are (no copies into flat buffers) and the parameter written in place; the moments
// are the group's flat (2, len) buffer, the slice's elements from `base` on. Element e of the
// slice belongs to the member j with start[j] <= e < start[j + 1]; each element sees
// `tallow_adamw_moments_f32`'s then `tallow_adamw_param_f32`'s operations, so the bits are theirs.
// `scale` (nullable, one float on the device): the gradient clipping's coefficient, each
// gradient element multiplied by it first (one rounding, as the clipping's multiply did).
#define TALLOW_ADAM_MEMBERS 32
struct TallowAdamMembers {
    float *p[TALLOW_ADAM_MEMBERS];
    const float *g[TALLOW_ADAM_MEMBERS];
    unsigned long long start[TALLOW_ADAM_MEMBERS + 1];
    unsigned long long count;
};

extern "C" __global__ void tallow_adamw_members_f32(
    const TallowAdamMembers ms, float *mv, const size_t len, const size_t base, const float b1,
    const float c1, const float b2, const float c2, const float decay, const int decay_on,
    const float inv_bc2, const float eps, const float step, const float *scale) {
    const float sc = scale != nullptr ? *scale : 1.0f;
    const size_t total = ms.start[ms.count];
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)blockDim.x * gridDim.x) {
        unsigned lo = 0, hi = (unsigned)ms.count; // the last start <= e
        while (hi - lo > 1) {
            const unsigned mid = (lo + hi) / 2;
            if (ms.start[mid] <= e) lo = mid; else hi = mid;
        }
        const size_t i = e - ms.start[lo], f = base + e;
        const float gi = scale != nullptr ? __fmul_rn(ms.g[lo][i], sc) : ms.g[lo][i];
        const float m = __fadd_rn(tallow_affine(mv[f], b1, 0.0f), tallow_affine(gi, c1, 0.0f));
        const float v = __fadd_rn(tallow_affine(mv[len + f], b2, 0.0f),
                                  tallow_affine(__fmul_rn(gi, gi), c2, 0.0f));
        mv[f] = m;
        mv[len + f] = v;
        const float p = ms.p[lo][i];
        const float pi = decay_on ? tallow_affine(p, decay, 0.0f) : p;
        const float denom = tallow_affine(__fsqrt_rn(v), inv_bc2, eps);
        ms.p[lo][i] = __fsub_rn(pi, tallow_affine(__fdiv_rn(m, denom), step, 0.0f));
    }
}

// The one-op LoRA linear's sum for an f32 x (`tallow_model::kernels::lora_linear`) with dropout,
// as the twin's masked-adapter sum of dx (`LoraLinearDx::run` with dropout): o += l.
extern "C" __global__ void tallow_lora_sum_f32(float *o, const float *l, const size_t total) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        o[i] = __fadd_rn(o[i], l[i]);
    }
}

// The same linear's adapter side as skinny products on the bf16 rows (no f32 copies of x or dY).
#include "lora_gemm.cuh"

// The gradient norm's sum of squares over many tensors in one launch.
#include "sum_squares.cuh"

// Chunked attention's path on CUDA (`tallow_model::kernels::attn_block`): the element-wise
// work of one block of query rows, around its two cuBLAS matmuls. s: the block's scores q kᵀ
// (rows, nk) in the model dtype, rows = (B, KV, n_rep, m) for query positions p0 .. p0 + m
// and keys lo .. lo + nk; seg: (B, T) segment ids. Key j is visible to query i as
// `AttentionMask` says (j <= i, the same segment, i - j < window; window 0: none); a masked
// score is -inf. With a soft-cap (cap > 0) a score is cap tanh(s / cap) first, each step in
// the model dtype as the tensor ops round it (inv_cap = 1 / cap, from f64 as Candle's
// affine takes it). Every row sees its own position's key.
template <typename T, bool ROUND>
__device__ __forceinline__ float tallow_attn_score(
    const T *s, const uint32_t *seg, const size_t row, const size_t j, const size_t m,
    const size_t nk, const size_t heads, const size_t t, const size_t p0, const size_t lo,
    const size_t window, const float cap, const float inv_cap) {
    const size_t b = row / (heads * m), qi = p0 + row % m, kj = lo + j;
    const uint32_t *sb = seg + b * t;
    if (kj > qi || sb[kj] != sb[qi] || (window != 0 && qi - kj >= window)) return -INFINITY;
    float v = tallow_to_f32(s[row * nk + j]);
    if (cap > 0.0f) {
        // Candle's affine in the scores' dtype: its multipliers rounded to that dtype too
        v = tallow_rb<ROUND>(tallow_affine(v, tallow_rb<ROUND>(inv_cap), 0.0f));
        v = tallow_rb<ROUND>(tanhf(v));
        v = tallow_rb<ROUND>(tallow_affine(v, tallow_rb<ROUND>(cap), 0.0f));
    }
    return v;
}

#define TALLOW_ATTN_ARGS                                                                       \
    const size_t m, const size_t nk, const size_t heads, const size_t t, const size_t p0,     \
        const size_t lo, const size_t window, const float cap, const float inv_cap
#define TALLOW_ATTN_PASS m, nk, heads, t, p0, lo, window, cap, inv_cap

// lse[row] = max + log(sum exp(score - max)) over the row's keys: one block per row.
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_attn_lse(
    const T *s, const uint32_t *seg, float *lse, TALLOW_ATTN_ARGS) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    float mx = -INFINITY;
    for (size_t j = threadIdx.x; j < nk; j += blockDim.x)
        mx = fmaxf(mx, tallow_attn_score<T, ROUND>(s, seg, row, j, TALLOW_ATTN_PASS));
    mx = tallow_block_max(mx, scratch);
    float sum = 0.0f;
    for (size_t j = threadIdx.x; j < nk; j += blockDim.x)
        sum += expf(__fsub_rn(tallow_attn_score<T, ROUND>(s, seg, row, j, TALLOW_ATTN_PASS), mx));
    sum = tallow_block_sum(sum, scratch);
    if (threadIdx.x == 0) lse[row] = __fadd_rn(mx, logf(sum));
}

// p = exp(score - lse) in the model dtype; lse of row (g, i) at lse[g lt + lp0 + i] (g: the
// row's (B, KV, n_rep) index, i its query position in the block).
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_attn_probs(
    const T *s, const uint32_t *seg, const float *lse, T *p, const size_t rows,
    const size_t lt, const size_t lp0, TALLOW_ATTN_ARGS) {
    const size_t total = rows * nk;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)blockDim.x * gridDim.x) {
        const size_t row = e / nk, j = e % nk;
        const float l = lse[(row / m) * lt + lp0 + row % m];
        const float x = tallow_attn_score<T, ROUND>(s, seg, row, j, TALLOW_ATTN_PASS);
        p[e] = tallow_from_f32<T>(expf(__fsub_rn(x, l)));
    }
}

// dS = P (dP - D) in the model dtype, P = exp(score - lse) in f32, through the cap's
// derivative 1 - (c tanh(s / c) / c)^2 when capped; stats = [lse; D] over every query row
// (2, rows_all), the block's rows at g lt + p0 + i (D = rowsum(dY Y)).
template <typename T, bool ROUND>
__device__ __forceinline__ void tallow_attn_ds(
    const T *s, const uint32_t *seg, const T *dp, const float *stats, T *ds, const size_t rows,
    const size_t rows_all, TALLOW_ATTN_ARGS) {
    const size_t total = rows * nk;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)blockDim.x * gridDim.x) {
        const size_t row = e / nk, j = e % nk;
        const size_t at = (row / m) * t + p0 + row % m;
        const float x = tallow_attn_score<T, ROUND>(s, seg, row, j, TALLOW_ATTN_PASS);
        const float pj = expf(__fsub_rn(x, stats[at]));
        float d = __fmul_rn(pj, __fsub_rn(tallow_to_f32(dp[e]), stats[rows_all + at]));
        if (cap > 0.0f && x != -INFINITY) {
            const float th = tallow_affine(x, inv_cap, 0.0f);
            d = __fmul_rn(d, tallow_affine(__fmul_rn(th, th), -1.0f, 1.0f));
        }
        ds[e] = tallow_from_f32<T>(d);
    }
}

// D = rowsum(dY Y) of chunked attention's backward (`attn_block::RowDot`): out[row] = sum over
// the row's d elements of f32(dy) f32(y), one block per row, no f32 copy of dY or Y.
template <typename T>
__device__ __forceinline__ void tallow_attn_rowdot(
    const T *dy, const T *y, float *out, const size_t d) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    float acc = 0.0f;
    for (size_t j = threadIdx.x; j < d; j += blockDim.x)
        acc = __fadd_rn(acc, __fmul_rn(tallow_to_f32(dy[row * d + j]), tallow_to_f32(y[row * d + j])));
    acc = tallow_block_sum(acc, scratch);
    if (threadIdx.x == 0) out[row] = acc;
}

#define TALLOW_ATTN(SUFFIX, T, ROUND)                                                          \
    extern "C" __global__ void tallow_attn_lse_##SUFFIX(                                      \
        const T *s, const uint32_t *seg, float *lse, TALLOW_ATTN_ARGS) {                      \
        tallow_attn_lse<T, ROUND>(s, seg, lse, TALLOW_ATTN_PASS);                             \
    }                                                                                          \
    extern "C" __global__ void tallow_attn_probs_##SUFFIX(                                    \
        const T *s, const uint32_t *seg, const float *lse, T *p, const size_t rows,           \
        const size_t lt, const size_t lp0, TALLOW_ATTN_ARGS) {                                \
        tallow_attn_probs<T, ROUND>(s, seg, lse, p, rows, lt, lp0, TALLOW_ATTN_PASS);         \
    }                                                                                          \
    extern "C" __global__ void tallow_attn_ds_##SUFFIX(                                       \
        const T *s, const uint32_t *seg, const T *dp, const float *stats, T *ds,              \
        const size_t rows, const size_t rows_all, TALLOW_ATTN_ARGS) {                         \
        tallow_attn_ds<T, ROUND>(s, seg, dp, stats, ds, rows, rows_all, TALLOW_ATTN_PASS);    \
    }                                                                                          \
    extern "C" __global__ void tallow_attn_rowdot_##SUFFIX(                                   \
        const T *dy, const T *y, float *out, const size_t d) {                                \
        tallow_attn_rowdot<T>(dy, y, out, d);                                                  \
    }

TALLOW_ATTN(f32, float, false)
TALLOW_ATTN(bf16, __nv_bfloat16, true)

// Chunked attention for bf16 / f16 q, k, v (`tallow_model::kernels::flash_attn`): the forward,
// dK / dV and dQ, each one launch whatever the length.
#include "flash_attn.cuh"
TALLOW_FLASH_ATTN(bf16, __nv_bfloat16)
TALLOW_FLASH_ATTN(f16, __half)
