// What tests/cuda_host/*.cpp share: the CPU side of crates/model/kernels/emulable.cuh. Defines
// its device functions for the CPU (bf16 as a struct of bits rounded to nearest even, std::fma,
// a std::barrier for __syncthreads, __shared__ arrays as statics), the grid's indices as
// globals, and `launch`, which runs a grid one block at a time, each block's threads on CPU
// threads. Include it before a kernel header.
#ifndef TALLOW_CUDA_HOST_EMULATE_H
#define TALLOW_CUDA_HOST_EMULATE_H

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <functional>
#include <random>
#include <thread>
#include <vector>

struct Bf16 {
    uint16_t bits;
};
static float bf2f(Bf16 v) {
    uint32_t u = (uint32_t)v.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static Bf16 f2bf(float f) { // round to nearest even, as __float2bfloat16_rn (NaN kept quiet)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return Bf16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7FFF + ((u >> 16) & 1);
    return Bf16{(uint16_t)(u >> 16)};
}

struct Dim {
    unsigned x, y, z;
};
static thread_local unsigned g_tid;
static Dim g_block, g_grid;
static std::barrier<> *g_barrier;

static uint64_t tallow_mix(uint64_t z) { // as kernels/tallow.cu's
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#define LG_HOST_EMULATION 1
#define LG_BF16 Bf16
#define LG_TO_F32(v) bf2f(v)
#define LG_TO_BF16(v) f2bf(v)
#define LG_ADD(a, b) ((float)(a) + (float)(b))
#define LG_FMA(a, b, c) std::fma((float)(a), (float)(b), (float)(c))
#define LG_MUL(a, b) ((float)(a) * (float)(b))
#define LG_SYNC() g_barrier->arrive_and_wait()
#define LG_SHARED static
#define LG_TID g_tid
#define LG_BX g_block.x
#define LG_BY g_block.y
#define LG_BZ g_block.z
#define LG_KERNEL void
#define LG_GX g_grid.x
#define LG_GY g_grid.y
#define LG_FENCE() std::atomic_thread_fence(std::memory_order_seq_cst)
#define LG_TICKET(p) ((*(p))++)
#define LG_LOAD(p) (*(p))
#define LG_SUB(a, b) ((float)(a) - (float)(b))
#define LG_MAX(a, b) std::fmax((float)(a), (float)(b))
#define LG_EXP(v) std::exp((float)(v))
#define LG_LOG(v) std::log((float)(v))
#define LG_TANH(v) std::tanh((float)(v))
#define __device__
#define __forceinline__
// Runs `kernel` over the grid, `threads` CPU threads per block.
static void launch(Dim grid, unsigned threads, const std::function<void()> &kernel) {
    g_grid = grid;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                g_block = Dim{x, y, z};
                std::barrier<> bar(threads);
                g_barrier = &bar;
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < threads; ++t)
                    ts.emplace_back([&, t] {
                        g_tid = t;
                        kernel();
                    });
                for (auto &t : ts) t.join();
            }
}

#endif
