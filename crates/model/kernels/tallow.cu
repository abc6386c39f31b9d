// tallow's own CUDA kernels, compiled to PTX by crates/model/build.rs (feature `cuda`) for
// compute capability $CUDA_COMPUTE_CAP (default 80), and checked against their CPU twins by
// `tallow doctor`. Each kernel names the Rust function it must match bit for bit.
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
