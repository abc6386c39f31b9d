// Runs the LoRA linear's CUDA kernels (crates/model/kernels/lora_gemm.cuh) on the CPU: the
// kernel source compiled as C++, each block's threads as CPU threads with a barrier for
// __syncthreads and the block's __shared__ arrays as statics (one block at a time), and checks
// every output against a sequential loop in the kernels' own order of f32 operations, bit for
// bit. Tile edges, two problems per launch (blockIdx.z), r past one tile of 32, M = 0.
//
//   g++ -std=c++20 -O2 -pthread tests/cuda_host/lora_gemm_host.cpp -o /tmp/lg && /tmp/lg
// (tests/tests/cuda_ops.rs runs it; exit 0 and "ok" when every output agrees)
#include "emulate.h"
#include "../../crates/model/kernels/lora_gemm.cuh"

static std::mt19937 rng(7);
static std::vector<Bf16> bf_rand(size_t n) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<Bf16> v(n);
    for (auto &x : v) x = f2bf(d(rng));
    return v;
}
static std::vector<float> f_rand(size_t n) {
    std::normal_distribution<float> d(0.0f, 0.5f);
    std::vector<float> v(n);
    for (auto &x : v) x = d(rng);
    return v;
}
static unsigned cdiv(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }
static int failures = 0;
static void expect(bool ok, const char *what, size_t i, float got, float want) {
    if (!ok && failures++ < 10)
        std::printf("MISMATCH %s at %zu: %.9g vs %.9g\n", what, i, got, want);
}

// x (M, K), A (r, K), B (N, r), dY (M, N): the forward and the backward of one linear, as
// lora_linear.rs's `forward_kernels` / `backward_kernels` launch them; with `p` > 0 LoRA dropout
// on x (its mask from x's element index).
static void linear(size_t m, size_t k, size_t n, size_t r, bool bias, float p) {
    const float s = 0.75f;
    auto x = bf_rand(m * k), dy = bf_rand(m * n), base = bf_rand(m * n), dxb = bf_rand(m * k);
    auto c = bf_rand(n);
    auto a = f_rand(r * k), b = f_rand(n * r);
    const LgDrop none{0, 0, 1.0f, 2};
    const LgDrop drop{0x5eedULL, (unsigned)std::llround(p * 4294967296.0), 1.0f / (1.0f - p),
                      p > 0 ? 0u : 2u};
    auto drop_on = [&](unsigned which) { return LgDrop{drop.seed, drop.threshold, drop.scale,
                                                       p > 0 ? which : 2u}; };
    // x's rows as the kernels read them (dropped out)
    auto xd = [&](size_t i) {
        const float v = bf2f(x[i]);
        if (p <= 0) return v;
        const uint64_t h = tallow_mix(drop.seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
        return (unsigned)(h >> 32) >= drop.threshold ? v * drop.scale : 0.0f;
    };
    auto mask = [&](size_t i, float l) { // dx's adapter share, masked by x's element i
        if (p <= 0) return l;
        const uint64_t h = tallow_mix(drop.seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
        return (unsigned)(h >> 32) >= drop.threshold ? l * drop.scale : 0.0f;
    };
    // forward: xa = s x Aᵀ, then O = r(r(O) (+ c) + r(xa Bᵀ))
    std::vector<float> xa(m * r, NAN);
    launch(Dim{cdiv(m, 64), cdiv(r, 32), 1}, 128, [&] {
        tallow_lora_down_bf16(x.data(), a.data(), xa.data(), k, 1, k, nullptr, nullptr, nullptr,
                              0, 0, 0, m, r, s, drop_on(0));
    });
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < r; ++j) {
            float acc = 0.0f;
            for (size_t q = 0; q < k; ++q) acc = std::fma(xd(i * k + q), a[j * k + q], acc);
            expect(xa[i * r + j] == s * acc, "x A^T", i * r + j, xa[i * r + j], s * acc);
        }
    auto o = base;
    launch(Dim{cdiv(m, 64), cdiv(n, 64), 1}, 256, [&] {
        tallow_lora_up_bf16(o.data(), xa.data(), b.data(), bias ? c.data() : nullptr, m, n, r, r,
                            1, none);
    });
    for (size_t i = 0; i < m; ++i)
        for (size_t q = 0; q < n; ++q) {
            float l = 0.0f;
            for (size_t j = 0; j < r; ++j) l = std::fma(xa[i * r + j], b[q * r + j], l);
            float t = bf2f(base[i * n + q]);
            if (bias) t = bf2f(f2bf(t + bf2f(c[q])));
            const float want = bf2f(f2bf(t + bf2f(f2bf(l))));
            expect(bf2f(o[i * n + q]) == want, "forward sum", i * n + q, bf2f(o[i * n + q]), want);
        }
    // backward: g = s dY B and xa = s x Aᵀ (one launch), dB = dYᵀ xa and dA = gᵀ x (one),
    // dx = r(r(dx) + r(g A))
    std::vector<float> g(m * r, NAN), xa2(m * r, NAN), db(n * r, NAN), da(r * k, NAN);
    launch(Dim{cdiv(m, 64), cdiv(r, 32), 2}, 128, [&] {
        tallow_lora_down_bf16(dy.data(), b.data(), g.data(), n, r, 1, x.data(), a.data(),
                              xa2.data(), k, 1, k, m, r, s, drop_on(1));
    });
    for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < r; ++j) {
            float acc = 0.0f;
            for (size_t q = 0; q < n; ++q) acc = std::fma(bf2f(dy[i * n + q]), b[q * r + j], acc);
            expect(g[i * r + j] == s * acc, "dY B", i * r + j, g[i * r + j], s * acc);
            expect(xa2[i * r + j] == xa[i * r + j], "x A^T (backward)", i * r + j,
                   xa2[i * r + j], xa[i * r + j]);
        }
    // dB and dA: the sum over M in one block per tile, and split over blocks of 32 rows (the
    // partials added in split order by the tile's last block)
    for (const unsigned long long chunk : {(unsigned long long)(m ? m : 1), 32ull}) {
        const unsigned splits = m ? (unsigned)((m + chunk - 1) / chunk) : 1;
        const unsigned gx = cdiv(n > k ? n : k, 32), gy = cdiv(r, 32);
        const size_t ws_p = n > k ? n : k;
        std::vector<float> ws(2 * splits * ws_p * r, NAN);
        std::vector<unsigned> tickets(2 * gx * gy, 0);
        std::fill(db.begin(), db.end(), NAN);
        std::fill(da.begin(), da.end(), NAN);
        launch(Dim{gx, gy, 2 * splits}, 128, [&] {
            tallow_lora_grad_bf16(dy.data(), xa2.data(), db.data(), n, r, 1, x.data(), g.data(),
                                  da.data(), k, 1, k, m, r, splits, chunk, ws.data(), ws_p,
                                  tickets.data(), drop_on(1));
        });
        for (size_t i = 0; i < tickets.size(); ++i)
            expect(tickets[i] == 0, "tickets reset", i, tickets[i], 0);
        // the kernels' order: each split's sum from 0 in m order; one split as it is, more
        // added in split order from 0
        auto sum = [&](auto term) {
            if (splits == 1) {
                float acc = 0.0f;
                for (size_t i = 0; i < m; ++i) acc = std::fma(term(i).first, term(i).second, acc);
                return acc;
            }
            float total = 0.0f;
            for (size_t t = 0; t < splits; ++t) {
                float acc = 0.0f;
                for (size_t i = t * chunk; i < m && i < (t + 1) * chunk; ++i)
                    acc = std::fma(term(i).first, term(i).second, acc);
                total = total + acc;
            }
            return total;
        };
        for (size_t q = 0; q < n; ++q)
            for (size_t j = 0; j < r; ++j) {
                const float want = sum([&](size_t i) {
                    return std::pair<float, float>(bf2f(dy[i * n + q]), xa[i * r + j]);
                });
                expect(db[q * r + j] == want, "dB", q * r + j, db[q * r + j], want);
            }
        for (size_t j = 0; j < r; ++j)
            for (size_t q = 0; q < k; ++q) {
                const float want = sum([&](size_t i) {
                    return std::pair<float, float>(g[i * r + j], xd(i * k + q));
                });
                expect(da[j * k + q] == want, "dA", j * k + q, da[j * k + q], want);
            }
    }
    auto dx = dxb;
    launch(Dim{cdiv(m, 64), cdiv(k, 64), 1}, 256, [&] {
        tallow_lora_up_bf16(dx.data(), g.data(), a.data(), nullptr, m, k, r, 1, k, drop_on(0));
    });
    for (size_t i = 0; i < m; ++i)
        for (size_t q = 0; q < k; ++q) {
            float l = 0.0f;
            for (size_t j = 0; j < r; ++j) l = std::fma(g[i * r + j], a[j * k + q], l);
            const float want = bf2f(f2bf(bf2f(dxb[i * k + q]) + bf2f(f2bf(mask(i * k + q, l)))));
            expect(bf2f(dx[i * k + q]) == want, "dx", i * k + q, bf2f(dx[i * k + q]), want);
        }
}

int main() {
    // (M, K, N, r, bias, dropout): tile edges in every dimension, r of 1, one tile and past
    // one tile, no rows, and LoRA dropout
    struct Case {
        size_t m, k, n, r;
        bool bias;
        float p;
    };
    const Case cases[] = {{70, 45, 77, 5, true, 0.0f},  {64, 64, 64, 32, false, 0.0f},
                          {130, 33, 20, 40, true, 0.0f}, {1, 100, 3, 1, false, 0.0f},
                          {0, 40, 50, 8, true, 0.0f},    {70, 45, 77, 40, true, 0.25f}};
    for (const Case &cs : cases) {
        const int before = failures;
        linear(cs.m, cs.k, cs.n, cs.r, cs.bias, cs.p);
        std::printf("M %zu K %zu N %zu r %zu bias %d dropout %.2f: %s\n", cs.m, cs.k, cs.n, cs.r,
                    (int)cs.bias, cs.p, failures == before ? "ok" : "FAILED");
    }
    if (failures) {
        std::printf("%d mismatches\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
