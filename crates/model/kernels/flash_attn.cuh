// Chunked attention on CUDA for bf16 / f16 q, k, v as three kernels of tallow's own, in the
// manner of FlashAttention-2 (Dao, arXiv:2307.08691): nothing (T, T) is ever stored, each block
// of query rows walks the key tiles it may see in shared memory, and the backward recomputes
// the probabilities from the saved log-sum-exp (`tallow_model::kernels::flash_attn`).
//
//   forward:  y = softmax(cap(q kᵀ) + mask) v, lse            one launch (fa_fwd)
//   backward: dK = Σ dSᵀ q, dV = Σ Pᵀ dY per key tile          one launch (fa_dkdv)
//             dQ = Σ dS k per query tile                       one launch (fa_dq)
//
// with dS = P (dP - D), D = rowsum(dY y) computed by each kernel for the query rows it loads
// (a d-element dot product per row and tile, against the tile's 16 d per row).
//
// dK / dV and dQ are two kernels (FlashAttention-2's deterministic variant): each output element
// is summed by one thread in a fixed order, no atomics, so a run gives the same bits each time.
// Grouped-query heads read their kv head directly (no repeat); the mask is each position's first
// visible key (`AttentionMask::first`, which packing's segments and a sliding window decide):
// key j is visible to the query at position p iff first[p] <= j <= p. `first` is nondecreasing
// along a row, so a query tile reads keys first[p0] .. p0 + rows, and a key tile is read by the
// query tiles from its first key up to the first one whose first key lies past it.
//
// The arithmetic is that of the tensor-op path with its block kernels (`attn_block`), which the
// CPU kernel twins: a score is the f32 dot product of q's and k's rows rounded to the model
// dtype (the matmul's output), soft-capped in that dtype (Gemma 2), P = exp(s - lse) in f32,
// rounded to the model dtype for P v and Pᵀ dY, dP = dY vᵀ rounded, dS = P (dP - D) (times the
// cap's 1 - tanh²) rounded, and each output (y, dQ, dK, dV) summed in f32 and rounded once. The
// log-sum-exp is computed online over the key tiles (a running max and a rescaled sum), and the
// forward then takes a second pass over the same tiles for P v, so that P is normalized before
// it is rounded, as eager attention rounds it.
//
// The products run on f32 FMA lanes (SIMT), not tensor cores; which tile sizes and which mma
// path a GPU wants is for the first GPU run to measure (issue 24).
//
// Written against emulable.cuh's device functions, so that tests/cuda_host/flash_attn_host.cpp
// compiles this file as plain C++ and runs each block's threads on CPU threads, comparing every
// output bit for bit with a sequential loop in the kernels' own order.

#ifndef TALLOW_FLASH_ATTN_CUH
#define TALLOW_FLASH_ATTN_CUH

#include "emulable.cuh"

// Query rows per tile, keys per tile, the largest head dim, threads per block. Each thread owns
// one row of a tile (tid / 8) and the columns tid % 8 + 8 c of it.
#define FA_M 16
#define FA_N 16
#define FA_DMAX 256
#define FA_THREADS 128
#define FA_COLS (FA_DMAX / 8)

typedef unsigned long long fa_u64;

// Where a tensor's rows are: row (b, head, p) at b * b_ + head * h + p * p_, its d elements
// contiguous; so heads-major (B, N, T, D) and tokens-major (B, T, N, D) layouts alike.
struct FaStrides {
    fa_u64 b, h, p;
};

// The problem: H = KV n_rep query heads (the n_rep of a kv head adjacent), T positions, head
// dim d; q and dq laid out as `q`, k and dk as `k`, v as `v`, y and dY as `y`, dv as `dv`;
// first (B, T); lse (B H T) f32, row b H T + h T + p. cap 0: no soft-capping.
struct FaShape {
    fa_u64 t, d, heads, n_rep;
    float cap, inv_cap;
    FaStrides q, k, v, y, dv;
};

// Row (b, head, p)'s first element.
template <typename T>
__device__ __forceinline__ T *fa_row(T *x, const FaStrides st, const fa_u64 b, const fa_u64 head,
                                     const fa_u64 p) {
    return x + b * st.b + head * st.h + p * st.p;
}

// The 16-bit element types: their bits in shared memory, widened to f32, rounded from f32.
#ifdef LG_HOST_EMULATION
__device__ __forceinline__ unsigned short fa_bits(const Bf16 v) { return v.bits; }
__device__ __forceinline__ float fa_f32(const unsigned short u, const Bf16 *) {
    return bf2f(Bf16{u});
}
__device__ __forceinline__ Bf16 fa_from(const float v, const Bf16 *) { return f2bf(v); }
#else
__device__ __forceinline__ unsigned short fa_bits(const __nv_bfloat16 v) {
    return __bfloat16_as_ushort(v);
}
__device__ __forceinline__ float fa_f32(const unsigned short u, const __nv_bfloat16 *) {
    return __bfloat162float(__ushort_as_bfloat16(u));
}
__device__ __forceinline__ __nv_bfloat16 fa_from(const float v, const __nv_bfloat16 *) {
    return __float2bfloat16_rn(v);
}
__device__ __forceinline__ unsigned short fa_bits(const __half v) { return __half_as_ushort(v); }
__device__ __forceinline__ float fa_f32(const unsigned short u, const __half *) {
    return __half2float(__ushort_as_half(u));
}
__device__ __forceinline__ __half fa_from(const float v, const __half *) {
    return __float2half_rn(v);
}
#endif

// v rounded to T and back.
template <typename T> __device__ __forceinline__ float fa_rb(const float v) {
    const T *tag = nullptr;
    return fa_f32(fa_bits(fa_from(v, tag)), tag);
}

// Candle's affine x * mul + add, the product and the sum rounded apart (`tallow_affine`).
__device__ __forceinline__ float fa_affine(const float x, const float mul, const float add) {
    return LG_ADD(LG_MUL(x, mul), add);
}

// The dot product of two d-element rows of shared memory, f32 FMAs in ascending order.
template <typename T>
__device__ __forceinline__ float fa_dot(const unsigned short *a, const unsigned short *b,
                                        const fa_u64 d) {
    const T *tag = nullptr;
    float acc = 0.0f;
    for (fa_u64 i = 0; i < d; ++i) acc = LG_FMA(fa_f32(a[i], tag), fa_f32(b[i], tag), acc);
    return acc;
}

// A score as the tensor-op path has it: the dot product rounded to T, soft-capped in T
// (cap tanh(s / cap), each step rounded, its multipliers rounded to T as Candle's affine in T
// takes them), as `tallow_attn_score`.
template <typename T> __device__ __forceinline__ float fa_score(const float dot, const FaShape s) {
    float v = fa_rb<T>(dot);
    if (s.cap > 0.0f) {
        v = fa_rb<T>(fa_affine(v, fa_rb<T>(s.inv_cap), 0.0f));
        v = fa_rb<T>(LG_TANH(v));
        v = fa_rb<T>(fa_affine(v, fa_rb<T>(s.cap), 0.0f));
    }
    return v;
}

// dS of one visible (query, key) pair, as `tallow_attn_ds`: P (dP - D) in f32, through the cap's
// derivative 1 - (x / cap)², rounded to T; `p` is P = exp(x - lse) in f32, x the score.
template <typename T>
__device__ __forceinline__ float fa_ds(const float x, const float p, const float dp,
                                       const float drow, const FaShape s) {
    float g = LG_MUL(p, LG_SUB(dp, drow));
    if (s.cap > 0.0f) {
        const float th = fa_affine(x, s.inv_cap, 0.0f);
        g = LG_MUL(g, fa_affine(LG_MUL(th, th), -1.0f, 1.0f));
    }
    return fa_rb<T>(g);
}

// D = rowsum(dY y) of one row: f32 products added in ascending order, as `attn_rowdot`'s
// threads add theirs.
template <typename T>
__device__ __forceinline__ float fa_rowdot(const T *dy, const T *y, const fa_u64 d) {
    const T *tag = nullptr;
    float acc = 0.0f;
    for (fa_u64 i = 0; i < d; ++i)
        acc = LG_ADD(acc, LG_MUL(fa_f32(fa_bits(dy[i]), tag), fa_f32(fa_bits(y[i]), tag)));
    return acc;
}

// Rows [r0, r0 + n) of one head (rows `sp` apart from `src`) into a tile of shared memory,
// zeros past n.
template <typename T>
__device__ __forceinline__ void fa_load(unsigned short (*dst)[FA_DMAX], const T *src,
                                        const fa_u64 sp, const fa_u64 r0, const fa_u64 n,
                                        const fa_u64 d, const unsigned rows) {
    for (fa_u64 e = LG_TID; e < (fa_u64)rows * d; e += FA_THREADS) {
        const fa_u64 r = e / d, c = e % d;
        dst[r][c] = r < n ? fa_bits(src[(r0 + r) * sp + c]) : (unsigned short)0;
    }
}

// ---------------------------------------------------------------------------------------------
// Forward: y (B H, T, D) and lse (B H T). Grid (ceil(T / FA_M), B H), FA_THREADS threads.
template <typename T>
__device__ __forceinline__ void fa_fwd(const T *q, const T *k, const T *v,
                                       const unsigned *first, T *y, float *lse, const FaShape s) {
    LG_SHARED unsigned short qs[FA_M][FA_DMAX];
    LG_SHARED unsigned short kv[FA_N][FA_DMAX];
    LG_SHARED float ss[FA_M][FA_N + 1];
    LG_SHARED float mx[FA_M], sum[FA_M];
    LG_SHARED fa_u64 fs[FA_M];
    const T *tag = nullptr;
    const unsigned tid = LG_TID, sr = tid / 8, sc = tid % 8;
    const fa_u64 bh = LG_BY, b = bh / s.heads, h = bh % s.heads, g = h / s.n_rep, d = s.d;
    const fa_u64 p0 = (fa_u64)LG_BX * FA_M;
    const fa_u64 rows = s.t - p0 < FA_M ? s.t - p0 : FA_M;
    const T *kb = fa_row(k, s.k, b, g, 0), *vb = fa_row(v, s.v, b, g, 0);
    fa_load(qs, fa_row(q, s.q, b, h, 0), s.q.p, p0, rows, d, FA_M);
    if (tid < FA_M) {
        fs[tid] = tid < rows ? first[b * s.t + p0 + tid] : s.t;
        mx[tid] = -INFINITY;
        sum[tid] = 0.0f;
    }
    LG_SYNC();
    const fa_u64 lo = fs[0], hi = p0 + rows;
    float acc[FA_COLS];
    for (int c = 0; c < FA_COLS; ++c) acc[c] = 0.0f;
    for (int pass = 0; pass < 2; ++pass) {
        for (fa_u64 j0 = lo; j0 < hi; j0 += FA_N) {
            const fa_u64 nk = hi - j0 < FA_N ? hi - j0 : FA_N;
            fa_load(kv, kb, s.k.p, j0, nk, d, FA_N);
            LG_SYNC();
            for (unsigned c = 0; c < 2; ++c) {
                const unsigned jj = sc + 8 * c;
                const fa_u64 gj = j0 + jj, gp = p0 + sr;
                float x = -INFINITY;
                if (sr < rows && jj < nk && gj >= fs[sr] && gj <= gp)
                    x = fa_score<T>(fa_dot<T>(qs[sr], kv[jj], d), s);
                ss[sr][jj] = x;
            }
            LG_SYNC();
            if (pass == 0) {
                // the running max and the sum of exp(x - max), rescaled when the max grows
                if (tid < FA_M) {
                    float m = mx[tid];
                    for (unsigned jj = 0; jj < FA_N; ++jj) m = LG_MAX(m, ss[tid][jj]);
                    if (m != -INFINITY) {
                        float l = mx[tid] == -INFINITY
                                      ? 0.0f
                                      : LG_MUL(sum[tid], LG_EXP(LG_SUB(mx[tid], m)));
                        for (unsigned jj = 0; jj < FA_N; ++jj)
                            l = LG_ADD(l, LG_EXP(LG_SUB(ss[tid][jj], m)));
                        mx[tid] = m;
                        sum[tid] = l;
                    }
                }
                LG_SYNC();
                continue;
            }
            // P = exp(x - lse) rounded to T, then V's tile where K's was
            for (unsigned c = 0; c < 2; ++c) {
                const unsigned jj = sc + 8 * c;
                const float x = ss[sr][jj];
                ss[sr][jj] = x == -INFINITY ? 0.0f : fa_rb<T>(LG_EXP(LG_SUB(x, mx[sr])));
            }
            fa_load(kv, vb, s.v.p, j0, nk, d, FA_N);
            LG_SYNC();
            for (unsigned jj = 0; jj < nk; ++jj) {
                const float pj = ss[sr][jj];
                for (int c = 0; c < FA_COLS; ++c) {
                    const fa_u64 col = sc + 8 * c;
                    if (col < d) acc[c] = LG_FMA(pj, fa_f32(kv[jj][col], tag), acc[c]);
                }
            }
            LG_SYNC();
        }
        if (pass == 0) {
            // mx becomes the log-sum-exp (every row sees its own position's key)
            if (tid < FA_M && tid < rows) mx[tid] = LG_ADD(mx[tid], LG_LOG(sum[tid]));
            LG_SYNC();
        }
    }
    if (sr < rows) {
        T *yr = fa_row(y, s.y, b, h, p0 + sr);
        for (int c = 0; c < FA_COLS; ++c) {
            const fa_u64 col = sc + 8 * c;
            if (col < d) yr[col] = fa_from(acc[c], tag);
        }
    }
    if (tid < rows) lse[bh * s.t + p0 + tid] = mx[tid];
}

// One (query row, key) pair of the backward from the tiles in shared memory: P = exp(x - lse)
// in f32 (0 where masked) and dS; x the score.
template <typename T>
__device__ __forceinline__ void fa_pair(const unsigned short *qr, const unsigned short *dyr,
                                        const unsigned short *kr, const unsigned short *vr,
                                        const float l, const float drow, const FaShape s,
                                        float *p, float *ds) {
    const float x = fa_score<T>(fa_dot<T>(qr, kr, s.d), s);
    *p = LG_EXP(LG_SUB(x, l));
    *ds = fa_ds<T>(x, *p, fa_rb<T>(fa_dot<T>(dyr, vr, s.d)), drow, s);
}

// The backward's query tile: rows [p0, p0 + rows) of head h of batch entry b, q's and dY's into
// shared memory, and per row its first visible key, its log-sum-exp and D = rowsum(dY y) (past
// `rows`: a first key of T, zeros). fa_dkdv and fa_dq load it alike, so both compute the same dS.
template <typename T>
__device__ __forceinline__ void fa_load_queries(
    unsigned short (*qs)[FA_DMAX], unsigned short (*dys)[FA_DMAX], fa_u64 *fs, float *ls,
    float *drow, const T *q, const T *dy, const T *y, const unsigned *first, const float *lse,
    const FaShape s, const fa_u64 b, const fa_u64 h, const fa_u64 p0, const fa_u64 rows) {
    const unsigned tid = LG_TID;
    const fa_u64 bh = b * s.heads + h;
    fa_load(qs, fa_row(q, s.q, b, h, 0), s.q.p, p0, rows, s.d, FA_M);
    fa_load(dys, fa_row(dy, s.y, b, h, 0), s.y.p, p0, rows, s.d, FA_M);
    if (tid < FA_M) {
        fs[tid] = tid < rows ? first[b * s.t + p0 + tid] : s.t;
        ls[tid] = tid < rows ? lse[bh * s.t + p0 + tid] : 0.0f;
        drow[tid] = tid < rows ? fa_rowdot(fa_row(dy, s.y, b, h, p0 + tid),
                                           fa_row(y, s.y, b, h, p0 + tid), s.d)
                               : 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// dK and dV (B KV, T, D): grid (ceil(T / FA_N), B KV). A block owns FA_N keys of one kv head
// and walks, for each of its n_rep query heads, the query tiles from its first key on until
// one cannot see it; dK[j] = Σ_i dS[i, j] q[i] and dV[j] = Σ_i r(P[i, j]) dY[i] in f32, summed
// over the heads, then the tiles, then their rows, in ascending order, rounded once.
template <typename T>
__device__ __forceinline__ void fa_dkdv(const T *q, const T *k, const T *v, const T *dy,
                                        const T *y, const unsigned *first, const float *lse,
                                        T *dk, T *dv, const FaShape s) {
    LG_SHARED unsigned short ks[FA_N][FA_DMAX], vs[FA_N][FA_DMAX];
    LG_SHARED unsigned short qs[FA_M][FA_DMAX], dys[FA_M][FA_DMAX];
    LG_SHARED float ps[FA_M][FA_N + 1], dss[FA_M][FA_N + 1];
    LG_SHARED float ls[FA_M], ds_[FA_M];
    LG_SHARED fa_u64 fs[FA_M];
    const T *tag = nullptr;
    const unsigned tid = LG_TID, sr = tid / 8, sc = tid % 8;
    const fa_u64 kvh = LG_BY, kv_heads = s.heads / s.n_rep, b = kvh / kv_heads,
                 g = kvh % kv_heads, d = s.d;
    const fa_u64 j0 = (fa_u64)LG_BX * FA_N;
    const fa_u64 nk = s.t - j0 < FA_N ? s.t - j0 : FA_N;
    fa_load(ks, fa_row(k, s.k, b, g, 0), s.k.p, j0, nk, d, FA_N);
    fa_load(vs, fa_row(v, s.v, b, g, 0), s.v.p, j0, nk, d, FA_N);
    float gk[FA_COLS], gv[FA_COLS];
    for (int c = 0; c < FA_COLS; ++c) gk[c] = gv[c] = 0.0f;
    for (fa_u64 rep = 0; rep < s.n_rep; ++rep) {
        const fa_u64 h = g * s.n_rep + rep;
        for (fa_u64 p0 = j0; p0 < s.t; p0 += FA_M) {
            // the tile's rows see none of these keys, nor do later tiles' (first only grows)
            if (first[b * s.t + p0] >= j0 + nk) break;
            const fa_u64 rows = s.t - p0 < FA_M ? s.t - p0 : FA_M;
            fa_load_queries(qs, dys, fs, ls, ds_, q, dy, y, first, lse, s, b, h, p0, rows);
            LG_SYNC();
            for (unsigned c = 0; c < 2; ++c) {
                const unsigned jj = sc + 8 * c;
                const fa_u64 gj = j0 + jj, gp = p0 + sr;
                float p = 0.0f, g = 0.0f;
                if (sr < rows && jj < nk && gj >= fs[sr] && gj <= gp) {
                    fa_pair<T>(qs[sr], dys[sr], ks[jj], vs[jj], ls[sr], ds_[sr], s, &p, &g);
                    p = fa_rb<T>(p);
                }
                ps[sr][jj] = p;
                dss[sr][jj] = g;
            }
            LG_SYNC();
            // this thread: key sr, columns sc + 8 c
            for (unsigned i = 0; i < rows; ++i) {
                const float pi = ps[i][sr], gi = dss[i][sr];
                for (int c = 0; c < FA_COLS; ++c) {
                    const fa_u64 col = sc + 8 * c;
                    if (col >= d) continue;
                    gv[c] = LG_FMA(pi, fa_f32(dys[i][col], tag), gv[c]);
                    gk[c] = LG_FMA(gi, fa_f32(qs[i][col], tag), gk[c]);
                }
            }
            LG_SYNC();
        }
    }
    if (sr < nk) {
        T *kr = fa_row(dk, s.k, b, g, j0 + sr), *vr = fa_row(dv, s.dv, b, g, j0 + sr);
        for (int c = 0; c < FA_COLS; ++c) {
            const fa_u64 col = sc + 8 * c;
            if (col >= d) continue;
            kr[col] = fa_from(gk[c], tag);
            vr[col] = fa_from(gv[c], tag);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dQ (B H, T, D): grid (ceil(T / FA_M), B H). A block owns FA_M query rows of one head and
// walks the key tiles they see as the forward does; dQ[i] = Σ_j dS[i, j] k[j] in f32, tiles
// then keys ascending, rounded once. dS is fa_dkdv's, bit for bit (the same products).
template <typename T>
__device__ __forceinline__ void fa_dq(const T *q, const T *k, const T *v, const T *dy,
                                      const T *y, const unsigned *first, const float *lse, T *dq,
                                      const FaShape s) {
    LG_SHARED unsigned short ks[FA_N][FA_DMAX], vs[FA_N][FA_DMAX];
    LG_SHARED unsigned short qs[FA_M][FA_DMAX], dys[FA_M][FA_DMAX];
    LG_SHARED float dss[FA_M][FA_N + 1];
    LG_SHARED float ls[FA_M], ds_[FA_M];
    LG_SHARED fa_u64 fs[FA_M];
    const T *tag = nullptr;
    const unsigned tid = LG_TID, sr = tid / 8, sc = tid % 8;
    const fa_u64 bh = LG_BY, b = bh / s.heads, h = bh % s.heads, g = h / s.n_rep, d = s.d;
    const fa_u64 p0 = (fa_u64)LG_BX * FA_M;
    const fa_u64 rows = s.t - p0 < FA_M ? s.t - p0 : FA_M;
    fa_load_queries(qs, dys, fs, ls, ds_, q, dy, y, first, lse, s, b, h, p0, rows);
    LG_SYNC();
    const fa_u64 lo = fs[0], hi = p0 + rows;
    float acc[FA_COLS];
    for (int c = 0; c < FA_COLS; ++c) acc[c] = 0.0f;
    for (fa_u64 j0 = lo; j0 < hi; j0 += FA_N) {
        const fa_u64 nk = hi - j0 < FA_N ? hi - j0 : FA_N;
        fa_load(ks, fa_row(k, s.k, b, g, 0), s.k.p, j0, nk, d, FA_N);
        fa_load(vs, fa_row(v, s.v, b, g, 0), s.v.p, j0, nk, d, FA_N);
        LG_SYNC();
        for (unsigned c = 0; c < 2; ++c) {
            const unsigned jj = sc + 8 * c;
            const fa_u64 gj = j0 + jj, gp = p0 + sr;
            float p = 0.0f, g = 0.0f;
            if (sr < rows && jj < nk && gj >= fs[sr] && gj <= gp)
                fa_pair<T>(qs[sr], dys[sr], ks[jj], vs[jj], ls[sr], ds_[sr], s, &p, &g);
            dss[sr][jj] = g;
        }
        LG_SYNC();
        for (unsigned jj = 0; jj < nk; ++jj) {
            const float g = dss[sr][jj];
            for (int c = 0; c < FA_COLS; ++c) {
                const fa_u64 col = sc + 8 * c;
                if (col < d) acc[c] = LG_FMA(g, fa_f32(ks[jj][col], tag), acc[c]);
            }
        }
        LG_SYNC();
    }
    if (sr < rows) {
        T *qr = fa_row(dq, s.q, b, h, p0 + sr);
        for (int c = 0; c < FA_COLS; ++c) {
            const fa_u64 col = sc + 8 * c;
            if (col < d) qr[col] = fa_from(acc[c], tag);
        }
    }
}

// The kernels for element type T, named tallow_fa_{fwd,dkdv,dq}_SUFFIX.
#define TALLOW_FLASH_ATTN(SUFFIX, T)                                                           \
    LG_KERNEL tallow_fa_fwd_##SUFFIX(const T *q, const T *k, const T *v,                      \
                                     const unsigned *first, T *y, float *lse,                 \
                                     const FaShape s) {                                        \
        fa_fwd<T>(q, k, v, first, y, lse, s);                                                  \
    }                                                                                          \
    LG_KERNEL tallow_fa_dkdv_##SUFFIX(const T *q, const T *k, const T *v, const T *dy,        \
                                      const T *y, const unsigned *first, const float *lse,    \
                                      T *dk, T *dv, const FaShape s) {                         \
        fa_dkdv<T>(q, k, v, dy, y, first, lse, dk, dv, s);                                     \
    }                                                                                          \
    LG_KERNEL tallow_fa_dq_##SUFFIX(const T *q, const T *k, const T *v, const T *dy,          \
                                    const T *y, const unsigned *first, const float *lse,      \
                                    T *dq, const FaShape s) {                                  \
        fa_dq<T>(q, k, v, dy, y, first, lse, dq, s);                                           \
    }

#endif
