// Runs chunked attention's CUDA kernels (crates/model/kernels/flash_attn.cuh: the forward, dK /
// dV and dQ) on the CPU, as lora_gemm_host.cpp runs the LoRA kernels: each block's threads on
// CPU threads with a barrier for __syncthreads. Two checks per case:
//   - every output bit for bit against a sequential loop in the kernels' own order of f32
//     operations (tiles, online log-sum-exp, sums) -- the indexing, tiling and barriers;
//   - every output against attention computed plainly in f64 (softmax, the mask from segment
//     ids and the window, the soft-cap, the gradients from their formulas), within 2% of the
//     tensor's largest value -- what the kernels compute is attention.
// Cases cross tile edges, pack documents, slide windows, soft-cap, group query heads, take head
// dims 64, 80, 96, 128 and 256, and lay v, y and dY out heads-major or tokens-major.
//
//   g++ -std=c++20 -O2 -pthread tests/cuda_host/flash_attn_host.cpp -o /tmp/fa && /tmp/fa
// (tests/tests/cuda_ops.rs runs it; exit 0 and "ok" when every case agrees)
#include "emulate.h"
#include "../../crates/model/kernels/flash_attn.cuh"

TALLOW_FLASH_ATTN(bf16, Bf16)

static int failures = 0;

struct Case {
    size_t b, kv, n_rep, t, d, window;
    float cap;
    bool packed;
    // v, y and dY laid out tokens-major (B, T, N, D), as the decoder layer hands v over and
    // takes y back; else heads-major (B, N, T, D) like q, k and dv
    bool tokens;
};

static FaStrides heads_major(size_t n, size_t t, size_t d) { return FaStrides{n * t * d, t * d, d}; }
static FaStrides tokens_major(size_t n, size_t t, size_t d) { return FaStrides{t * n * d, d, n * d}; }

// Row (b, head, p) of x laid out as st.
static Bf16 *at(std::vector<Bf16> &x, FaStrides st, size_t b, size_t head, size_t p) {
    return &x[b * st.b + head * st.h + p * st.p];
}
static const Bf16 *at(const std::vector<Bf16> &x, FaStrides st, size_t b, size_t head, size_t p) {
    return &x[b * st.b + head * st.h + p * st.p];
}

static float rbf(float v) { return bf2f(f2bf(v)); }

// first[b][p]: the first key position p sees (its document's start, the window's).
static std::vector<unsigned> firsts(const Case &c) {
    std::vector<unsigned> f(c.b * c.t);
    for (size_t b = 0; b < c.b; ++b) {
        size_t start = 0;
        for (size_t p = 0; p < c.t; ++p) {
            // row 0 packs documents of 11, 19, then the rest; other rows are one document
            if (c.packed && b == 0 && (p == 11 || p == 30)) start = p;
            size_t lo = start;
            if (c.window && p + 1 > c.window) lo = std::max(lo, p + 1 - c.window);
            f[b * c.t + p] = (unsigned)lo;
        }
    }
    return f;
}

struct Inputs {
    std::vector<Bf16> q, k, v, dy;
    std::vector<unsigned> first;
    FaShape s;
};

static float dot(const Bf16 *a, const Bf16 *b, size_t d) {
    float acc = 0.0f;
    for (size_t i = 0; i < d; ++i) acc = std::fma(bf2f(a[i]), bf2f(b[i]), acc);
    return acc;
}

static float score(const Inputs &in, const Bf16 *qr, const Bf16 *kr) {
    float v = rbf(dot(qr, kr, in.s.d));
    if (in.s.cap > 0.0f) {
        v = rbf(rbf(v * rbf(in.s.inv_cap)) + 0.0f);
        v = rbf(std::tanh(v));
        v = rbf(rbf(v * rbf(in.s.cap)) + 0.0f);
    }
    return v;
}

static float ds_of(const Inputs &in, float x, float p, float dp, float drow) {
    float g = p * (dp - drow);
    if (in.s.cap > 0.0f) {
        const float th = x * in.s.inv_cap + 0.0f;
        g = g * ((th * th) * -1.0f + 1.0f);
    }
    return rbf(g);
}

// The kernels' order, sequentially.
static void reference(const Case &c, const Inputs &in, const std::vector<float> &lse, const std::vector<float> &drow,
                      std::vector<Bf16> &y, std::vector<float> &lse_out, std::vector<Bf16> &dq,
                      std::vector<Bf16> &dk, std::vector<Bf16> &dv) {
    const size_t t = c.t, d = c.d, heads = c.kv * c.n_rep;
    const FaShape &s = in.s;
    auto visible = [&](size_t b, size_t p, size_t j) { return j >= in.first[b * t + p] && j <= p; };
    auto sc = [&](size_t b, size_t h, size_t p, size_t j) {
        return score(in, at(in.q, s.q, b, h, p), at(in.k, s.k, b, h / c.n_rep, j));
    };
    for (size_t bh = 0; bh < c.b * heads; ++bh) {
        const size_t b = bh / heads, h = bh % heads, g = h / c.n_rep;
        for (size_t p0 = 0; p0 < t; p0 += FA_M) {
            const size_t rows = std::min<size_t>(FA_M, t - p0), lo = in.first[b * t + p0],
                         hi = p0 + rows;
            for (size_t r = 0; r < rows; ++r) {
                const size_t p = p0 + r;
                float m = -INFINITY, l = 0.0f;
                for (size_t j0 = lo; j0 < hi; j0 += FA_N) {
                    float x[FA_N];
                    float mt = m;
                    for (size_t jj = 0; jj < FA_N; ++jj) {
                        const size_t j = j0 + jj;
                        x[jj] = j < hi && visible(b, p, j) ? sc(b, h, p, j) : -INFINITY;
                        mt = std::fmax(mt, x[jj]);
                    }
                    if (mt == -INFINITY) continue;
                    l = m == -INFINITY ? 0.0f : l * std::exp(m - mt);
                    for (size_t jj = 0; jj < FA_N; ++jj) l = l + std::exp(x[jj] - mt);
                    m = mt;
                }
                const float ls = m + std::log(l);
                lse_out[bh * t + p] = ls;
                std::vector<float> acc(d, 0.0f);
                for (size_t j = lo; j < hi; ++j) {
                    const float pj = visible(b, p, j) ? rbf(std::exp(sc(b, h, p, j) - ls)) : 0.0f;
                    for (size_t col = 0; col < d; ++col)
                        acc[col] = std::fma(pj, bf2f(at(in.v, s.v, b, g, j)[col]), acc[col]);
                }
                for (size_t col = 0; col < d; ++col) at(y, s.y, b, h, p)[col] = f2bf(acc[col]);
            }
        }
    }
    // dS and P of a pair, from the given lse and D
    auto pair = [&](size_t b, size_t h, size_t p, size_t j, float *pp, float *gr) {
        const size_t bh = b * heads + h;
        const float x = sc(b, h, p, j);
        *pp = std::exp(x - lse[bh * t + p]);
        const float dp = rbf(dot(at(in.dy, s.y, b, h, p), at(in.v, s.v, b, h / c.n_rep, j), d));
        *gr = ds_of(in, x, *pp, dp, drow[bh * t + p]);
    };
    for (size_t b = 0; b < c.b; ++b)
        for (size_t g = 0; g < c.kv; ++g)
            for (size_t j0 = 0; j0 < t; j0 += FA_N)
                for (size_t j = j0; j < std::min(t, j0 + FA_N); ++j) {
                    std::vector<float> gk(d, 0.0f), gv(d, 0.0f);
                    for (size_t rep = 0; rep < c.n_rep; ++rep) {
                        const size_t h = g * c.n_rep + rep;
                        for (size_t p0 = j0; p0 < t; p0 += FA_M) {
                            if (in.first[b * t + p0] >= std::min(t, j0 + FA_N)) break;
                            for (size_t p = p0; p < std::min(t, p0 + FA_M); ++p) {
                                float pp = 0.0f, gr = 0.0f;
                                if (visible(b, p, j)) {
                                    pair(b, h, p, j, &pp, &gr);
                                    pp = rbf(pp);
                                }
                                for (size_t col = 0; col < d; ++col) {
                                    gv[col] = std::fma(pp, bf2f(at(in.dy, s.y, b, h, p)[col]), gv[col]);
                                    gk[col] = std::fma(gr, bf2f(at(in.q, s.q, b, h, p)[col]), gk[col]);
                                }
                            }
                        }
                    }
                    for (size_t col = 0; col < d; ++col) {
                        at(dk, s.k, b, g, j)[col] = f2bf(gk[col]);
                        at(dv, s.dv, b, g, j)[col] = f2bf(gv[col]);
                    }
                }
    for (size_t bh = 0; bh < c.b * heads; ++bh) {
        const size_t b = bh / heads, h = bh % heads, g = h / c.n_rep;
        for (size_t p0 = 0; p0 < t; p0 += FA_M) {
            const size_t rows = std::min<size_t>(FA_M, t - p0), lo = in.first[b * t + p0];
            for (size_t p = p0; p < p0 + rows; ++p) {
                std::vector<float> acc(d, 0.0f);
                for (size_t j = lo; j < p0 + rows; ++j) {
                    float pp = 0.0f, gr = 0.0f;
                    if (visible(b, p, j)) pair(b, h, p, j, &pp, &gr);
                    for (size_t col = 0; col < d; ++col)
                        acc[col] = std::fma(gr, bf2f(at(in.k, s.k, b, g, j)[col]), acc[col]);
                }
                for (size_t col = 0; col < d; ++col) at(dq, s.q, b, h, p)[col] = f2bf(acc[col]);
            }
        }
    }
}

// Attention in f64 from its formulas: y, and dq, dk, dv for the upstream dy, each laid out as
// the kernels' outputs.
static void plain(const Case &c, const Inputs &in, std::vector<double> &y, std::vector<double> &dq,
                  std::vector<double> &dk, std::vector<double> &dv) {
    const size_t t = c.t, d = c.d, heads = c.kv * c.n_rep;
    const FaShape &s = in.s;
    auto el = [&](const std::vector<Bf16> &x, FaStrides st, size_t b, size_t head, size_t p,
                  size_t col) { return (double)bf2f(at(x, st, b, head, p)[col]); };
    auto ix = [&](FaStrides st, size_t b, size_t head, size_t p) {
        return b * st.b + head * st.h + p * st.p;
    };
    for (size_t b = 0; b < c.b; ++b)
        for (size_t h = 0; h < heads; ++h) {
            const size_t g = h / c.n_rep;
            for (size_t p = 0; p < t; ++p) {
                std::vector<double> sc(t, -INFINITY), raw(t, 0.0), pr(t, 0.0);
                double mx = -INFINITY;
                for (size_t j = in.first[b * t + p]; j <= p; ++j) {
                    double v = 0.0;
                    for (size_t col = 0; col < d; ++col)
                        v += el(in.q, s.q, b, h, p, col) * el(in.k, s.k, b, g, j, col);
                    raw[j] = v;
                    sc[j] = c.cap > 0 ? c.cap * std::tanh(v / c.cap) : v;
                    mx = std::max(mx, sc[j]);
                }
                double sum = 0.0;
                for (size_t j = 0; j < t; ++j) sum += sc[j] == -INFINITY ? 0.0 : std::exp(sc[j] - mx);
                for (size_t j = 0; j < t; ++j)
                    pr[j] = sc[j] == -INFINITY ? 0.0 : std::exp(sc[j] - mx) / sum;
                std::vector<double> yr(d, 0.0);
                for (size_t j = 0; j < t; ++j)
                    for (size_t col = 0; col < d; ++col) yr[col] += pr[j] * el(in.v, s.v, b, g, j, col);
                double drow = 0.0;
                for (size_t col = 0; col < d; ++col) {
                    y[ix(s.y, b, h, p) + col] = yr[col];
                    drow += yr[col] * el(in.dy, s.y, b, h, p, col);
                }
                for (size_t j = 0; j < t; ++j) {
                    if (pr[j] == 0.0) continue;
                    double dp = 0.0;
                    for (size_t col = 0; col < d; ++col)
                        dp += el(in.dy, s.y, b, h, p, col) * el(in.v, s.v, b, g, j, col);
                    double gr = pr[j] * (dp - drow);
                    if (c.cap > 0) {
                        const double th = std::tanh(raw[j] / c.cap);
                        gr *= 1.0 - th * th;
                    }
                    for (size_t col = 0; col < d; ++col) {
                        dq[ix(s.q, b, h, p) + col] += gr * el(in.k, s.k, b, g, j, col);
                        dk[ix(s.k, b, g, j) + col] += gr * el(in.q, s.q, b, h, p, col);
                        dv[ix(s.dv, b, g, j) + col] += pr[j] * el(in.dy, s.y, b, h, p, col);
                    }
                }
            }
        }
}

static bool same(const std::vector<Bf16> &a, const std::vector<Bf16> &b) {
    for (size_t i = 0; i < a.size(); ++i)
        if (a[i].bits != b[i].bits) return false;
    return true;
}

// max |a - want| / max |want|
static double rel(const std::vector<Bf16> &a, const std::vector<double> &want) {
    double err = 0.0, big = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        err = std::max(err, std::fabs(bf2f(a[i]) - want[i]));
        big = std::max(big, std::fabs(want[i]));
    }
    return err / std::max(big, 1e-30);
}

int main() {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const std::vector<Case> cases = {
        {1, 1, 1, 16, 64, 0, 0.0f, false, false},  // one tile
        {2, 2, 3, 37, 80, 0, 0.0f, true, true},    // grouped heads, packed row, partial tiles
        {1, 1, 2, 50, 96, 7, 4.0f, false, false},  // sliding window, soft-cap
        {1, 2, 1, 33, 256, 0, 0.0f, false, true},  // the largest head dim
        {2, 1, 2, 70, 128, 20, 0.0f, true, false}, // window and packing together
        {2, 2, 2, 45, 64, 9, 0.0f, true, true},    // all of it, tokens-major
    };
    for (const Case &c : cases) {
        const size_t heads = c.kv * c.n_rep, nq = c.b * heads * c.t * c.d, nk = c.b * c.kv * c.t * c.d;
        Inputs in;
        const float qs = 1.0f / std::sqrt((float)c.d) * (c.cap > 0 ? 3.0f : 1.0f);
        auto fill = [&](std::vector<Bf16> &x, size_t n, float scale) {
            x.resize(n);
            for (auto &e : x) e = f2bf(nd(rng) * scale);
        };
        fill(in.q, nq, qs);
        fill(in.k, nk, 1.0f);
        fill(in.v, nk, 1.0f);
        fill(in.dy, nq, 1.0f);
        in.first = firsts(c);
        in.s = FaShape{c.t,
                       c.d,
                       heads,
                       c.n_rep,
                       c.cap,
                       c.cap > 0 ? 1.0f / c.cap : 0.0f,
                       heads_major(heads, c.t, c.d),
                       heads_major(c.kv, c.t, c.d),
                       c.tokens ? tokens_major(c.kv, c.t, c.d) : heads_major(c.kv, c.t, c.d),
                       c.tokens ? tokens_major(heads, c.t, c.d) : heads_major(heads, c.t, c.d),
                       heads_major(c.kv, c.t, c.d)};
        std::vector<Bf16> y(nq), dq(nq), dk(nk), dv(nk);
        std::vector<float> lse(c.b * heads * c.t, NAN), drow(c.b * heads * c.t);
        const unsigned qtiles = (unsigned)((c.t + FA_M - 1) / FA_M);
        const unsigned ktiles = (unsigned)((c.t + FA_N - 1) / FA_N);
        launch(Dim{qtiles, (unsigned)(c.b * heads), 1}, FA_THREADS, [&] {
            tallow_fa_fwd_bf16(in.q.data(), in.k.data(), in.v.data(), in.first.data(), y.data(),
                               lse.data(), in.s);
        });
        // D = rowsum(dY y) in the kernels' order, for the reference (rows b H T + h T + p)
        for (size_t b = 0; b < c.b; ++b)
            for (size_t h = 0; h < heads; ++h)
                for (size_t p = 0; p < c.t; ++p) {
                    float acc = 0.0f;
                    const Bf16 *dyr = at(in.dy, in.s.y, b, h, p), *yr = at(y, in.s.y, b, h, p);
                    for (size_t col = 0; col < c.d; ++col) acc = acc + bf2f(dyr[col]) * bf2f(yr[col]);
                    drow[(b * heads + h) * c.t + p] = acc;
                }
        launch(Dim{ktiles, (unsigned)(c.b * c.kv), 1}, FA_THREADS, [&] {
            tallow_fa_dkdv_bf16(in.q.data(), in.k.data(), in.v.data(), in.dy.data(), y.data(),
                                in.first.data(), lse.data(), dk.data(), dv.data(), in.s);
        });
        launch(Dim{qtiles, (unsigned)(c.b * heads), 1}, FA_THREADS, [&] {
            tallow_fa_dq_bf16(in.q.data(), in.k.data(), in.v.data(), in.dy.data(), y.data(),
                              in.first.data(), lse.data(), dq.data(), in.s);
        });
        std::vector<Bf16> ry(nq), rdq(nq), rdk(nk), rdv(nk);
        std::vector<float> rlse(lse.size());
        reference(c, in, lse, drow, ry, rlse, rdq, rdk, rdv);
        const bool bits = same(y, ry) && same(dq, rdq) && same(dk, rdk) && same(dv, rdv) &&
                          std::memcmp(lse.data(), rlse.data(), lse.size() * 4) == 0;
        std::vector<double> py(nq), pdq(nq, 0.0), pdk(nk, 0.0), pdv(nk, 0.0);
        plain(c, in, py, pdq, pdk, pdv);
        const double ey = rel(y, py), eq = rel(dq, pdq), ek = rel(dk, pdk), ev = rel(dv, pdv);
        const bool close = ey < 0.02 && eq < 0.02 && ek < 0.02 && ev < 0.02;
        if (!bits || !close) ++failures;
        std::printf("B %zu KV %zu n_rep %zu T %zu D %zu window %zu cap %g packed %d tokens %d: "
                    "bits %s, f64 rel y %.2e dq %.2e dk %.2e dv %.2e: %s\n",
                    c.b, c.kv, c.n_rep, c.t, c.d, c.window, c.cap, (int)c.packed, (int)c.tokens,
                    bits ? "same" : "DIFFER", ey, eq, ek, ev, bits && close ? "ok" : "FAILED");
    }
    if (failures) {
        std::printf("%d failures\n", failures);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}
