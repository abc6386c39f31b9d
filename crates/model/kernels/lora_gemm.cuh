// The one-op LoRA linear's adapter side for a bf16 x and an f32 adapter
// (`tallow_model::kernels::lora_linear`, `device::forward_kernels` / `backward_kernels`): the
// skinny products that cuBLAS could only take after x and dY were cast to f32 (its operands
// share one type), reading the bf16 rows directly, with the scale, the bias and the bf16
// rounding sum folded in. Three kernels, each taking up to two independent problems (blockIdx.z),
// so a linear's forward is the base's gemm and 2 launches, its backward dY W and 3.
//
// Every product accumulates in f32 in a fixed order (k, then j, then m ascending within a
// thread), so results are deterministic; they differ from cuBLAS's f32 gemm only in the order
// of the f32 sums. The arithmetic is what the CPU twin computes (`LoraLinearOp::run_bf16` and
// the twin's backward): `tallow doctor` compares the two.
//
// LoRA dropout is applied where the rows are read (x's mask from its element index, as
// `tallow_dropout_f32` draws it), so dropout costs no launch and no copy either.
//
// Written against emulable.cuh's device functions (`LG_*`), so that a test can compile this
// file as plain C++ and run each block's threads on CPU threads with a barrier for
// __syncthreads (tests/cuda_host/lora_gemm_host.cpp, run by tests/tests/cuda_ops.rs).

#ifndef TALLOW_LORA_GEMM_CUH
#define TALLOW_LORA_GEMM_CUH

#include "emulable.cuh"

// r(v): v rounded to bf16 and back (round to nearest even).
#define LG_RB(v) LG_TO_F32(LG_TO_BF16(v))

// LoRA dropout on x's element i (row-major index in the (M, K) input), as `tallow_dropout_f32`
// (`DropoutOp`): kept when the high 32 bits of mix(seed + (i + 1) golden) are >= threshold,
// then scaled by `scale` (one f32 product), else 0. A kernel applies it to the problem or the
// product `drop` names (0 or 1; any other value: none).
struct LgDrop {
    unsigned long long seed;
    unsigned threshold;
    float scale;
    unsigned which;
};

__device__ __forceinline__ float lg_drop(const LgDrop d, const unsigned long long i, const float v) {
    const unsigned long long h = tallow_mix(d.seed + (i + 1) * 0x9E3779B97F4A7C15ULL);
    return (unsigned)(h >> 32) >= d.threshold ? LG_MUL(v, d.scale) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Down: C (M, r) := alpha · L (M, K) · R, L bf16 row-major (row stride K), R (K, r) f32 read
// as R[k * rsk + j * rsj] (A (r, K) for x Aᵀ: rsk 1, rsj K; B (N, r) for dY B: rsk r, rsj 1),
// C f32 row-major (row stride r). Block: 64 rows x 32 columns of C, 128 threads, each 4 rows
// (ty, ty + 16, ..) x 4 columns (tx, tx + 8, ..); K in steps of 32 through shared memory.
// Grid: (ceil(M / 64), ceil(r / 32), problems).
struct LgDown {
    const LG_BF16 *l;
    const float *rm;
    float *c;
    unsigned long long k, rsk, rsj;
};

#define LG_DM 64
#define LG_DJ 32
#define LG_DK 32

__device__ __forceinline__ void lg_down_body(const LgDown p, const unsigned long long m,
                                             const unsigned long long r, const float alpha,
                                             const bool drop, const LgDrop d,
                                             float (*ls)[LG_DK + 1], float (*rs)[LG_DJ + 1]) {
    const unsigned tid = LG_TID, ty = tid / 8, tx = tid % 8;
    const unsigned long long m0 = (unsigned long long)LG_BX * LG_DM;
    const unsigned long long j0 = (unsigned long long)LG_BY * LG_DJ;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
    for (unsigned long long k0 = 0; k0 < p.k; k0 += LG_DK) {
        // L's tile: 64 x 32, consecutive threads along k (coalesced rows)
        for (unsigned e = tid; e < LG_DM * LG_DK; e += 128) {
            const unsigned row = e / LG_DK, kk = e % LG_DK;
            const unsigned long long gm = m0 + row, gk = k0 + kk;
            float v = 0.0f;
            if (gm < m && gk < p.k) {
                v = LG_TO_F32(p.l[gm * p.k + gk]);
                if (drop) v = lg_drop(d, gm * p.k + gk, v);
            }
            ls[row][kk] = v;
        }
        // R's tile: 32 (k) x 32 (j), consecutive threads along R's contiguous index
        for (unsigned e = tid; e < LG_DK * LG_DJ; e += 128) {
            unsigned kk, jj;
            if (p.rsk == 1) {
                kk = e % LG_DK;
                jj = e / LG_DK;
            } else {
                jj = e % LG_DJ;
                kk = e / LG_DJ;
            }
            const unsigned long long gk = k0 + kk, gj = j0 + jj;
            rs[kk][jj] = (gk < p.k && gj < r) ? p.rm[gk * p.rsk + gj * p.rsj] : 0.0f;
        }
        LG_SYNC();
        for (unsigned kk = 0; kk < LG_DK; ++kk) {
            float a[4], b[4];
            for (int i = 0; i < 4; ++i) a[i] = ls[ty + 16 * i][kk];
            for (int c = 0; c < 4; ++c) b[c] = rs[kk][tx + 8 * c];
            for (int i = 0; i < 4; ++i)
                for (int c = 0; c < 4; ++c) acc[i][c] = LG_FMA(a[i], b[c], acc[i][c]);
        }
        LG_SYNC();
    }
    for (int i = 0; i < 4; ++i) {
        const unsigned long long gm = m0 + ty + 16 * i;
        for (int c = 0; c < 4; ++c) {
            const unsigned long long gj = j0 + tx + 8 * c;
            if (gm < m && gj < r) p.c[gm * r + gj] = LG_MUL(alpha, acc[i][c]);
        }
    }
}

// Problem z's L, R, C, K and R's strides: l0 .. for blockIdx.z 0, l1 .. for 1; `drop` masks
// the rows of problem `drop.which` (x's).
LG_KERNEL tallow_lora_down_bf16(const LG_BF16 *l0, const float *r0, float *c0,
                                const unsigned long long k0, const unsigned long long rsk0,
                                const unsigned long long rsj0, const LG_BF16 *l1, const float *r1,
                                float *c1, const unsigned long long k1,
                                const unsigned long long rsk1, const unsigned long long rsj1,
                                const unsigned long long m, const unsigned long long r,
                                const float alpha, const LgDrop drop) {
    LG_SHARED float ls[LG_DM][LG_DK + 1];
    LG_SHARED float rs[LG_DK][LG_DJ + 1];
    const LgDown p = LG_BZ == 0 ? LgDown{l0, r0, c0, k0, rsk0, rsj0}
                                : LgDown{l1, r1, c1, k1, rsk1, rsj1};
    lg_down_body(p, m, r, alpha, drop.which == LG_BZ, drop, ls, rs);
}

// ---------------------------------------------------------------------------------------------
// Up and sum: O (M, N) bf16, in place, O[m, n] := r(r(O[m, n]) (+ c[n]) + r(l)) with
// l = Σ_j S[m, j] · R[n * rsn + j * rsj] in f32: S (M, r) f32 row-major, R (N, r) read as above
// (B (N, r) for the forward's xa Bᵀ: rsn r, rsj 1; A (r, K) for dx's (s dY B) A: rsn 1,
// rsj K). With a bias c (N) bf16: r(r(O) + c) first, as `sum_rows_bf16_body`; with `drop`
// (which 0) l is x's dropout mask at (m, n) times l first (dx's adapter share, its mask
// x's). Block: 64 x 64
// of O, 256 threads, each 4 rows (ty, ty + 16, ..) x 4 columns (tx, tx + 16, ..); j in steps of
// 32. Grid: (ceil(M / 64), ceil(N / 64)).
#define LG_UM 64
#define LG_UN 64
#define LG_UJ 32

LG_KERNEL tallow_lora_up_bf16(LG_BF16 *o, const float *s, const float *rm, const LG_BF16 *bias,
                              const unsigned long long m, const unsigned long long n,
                              const unsigned long long r, const unsigned long long rsn,
                              const unsigned long long rsj, const LgDrop drop) {
    LG_SHARED float ss[LG_UM][LG_UJ + 1];
    LG_SHARED float rs[LG_UN][LG_UJ + 1];
    const unsigned tid = LG_TID, ty = tid / 16, tx = tid % 16;
    const unsigned long long m0 = (unsigned long long)LG_BX * LG_UM;
    const unsigned long long n0 = (unsigned long long)LG_BY * LG_UN;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
    for (unsigned long long j0 = 0; j0 < r; j0 += LG_UJ) {
        for (unsigned e = tid; e < LG_UM * LG_UJ; e += 256) {
            const unsigned row = e / LG_UJ, jj = e % LG_UJ;
            const unsigned long long gm = m0 + row, gj = j0 + jj;
            ss[row][jj] = (gm < m && gj < r) ? s[gm * r + gj] : 0.0f;
        }
        for (unsigned e = tid; e < LG_UN * LG_UJ; e += 256) {
            unsigned nn, jj;
            if (rsj == 1) {
                jj = e % LG_UJ;
                nn = e / LG_UJ;
            } else {
                nn = e % LG_UN;
                jj = e / LG_UN;
            }
            const unsigned long long gn = n0 + nn, gj = j0 + jj;
            rs[nn][jj] = (gn < n && gj < r) ? rm[gn * rsn + gj * rsj] : 0.0f;
        }
        LG_SYNC();
        for (unsigned jj = 0; jj < LG_UJ; ++jj) {
            float a[4], b[4];
            for (int i = 0; i < 4; ++i) a[i] = ss[ty + 16 * i][jj];
            for (int c = 0; c < 4; ++c) b[c] = rs[tx + 16 * c][jj];
            for (int i = 0; i < 4; ++i)
                for (int c = 0; c < 4; ++c) acc[i][c] = LG_FMA(a[i], b[c], acc[i][c]);
        }
        LG_SYNC();
    }
    for (int i = 0; i < 4; ++i) {
        const unsigned long long gm = m0 + ty + 16 * i;
        for (int c = 0; c < 4; ++c) {
            const unsigned long long gn = n0 + tx + 16 * c;
            if (gm >= m || gn >= n) continue;
            LG_BF16 *at = o + gm * n + gn;
            float t = LG_TO_F32(*at);
            if (bias != nullptr) t = LG_RB(LG_ADD(t, LG_TO_F32(bias[gn])));
            const float l = drop.which == 0 ? lg_drop(drop, gm * n + gn, acc[i][c]) : acc[i][c];
            *at = LG_TO_BF16(LG_ADD(t, LG_RB(l)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients: G[p * osp + j * osj] := Σ_m L[m, p] · S[m, j] in f32, L (M, P) bf16 row-major,
// S (M, r) f32 row-major (dB (N, r) = dYᵀ (s x Aᵀ): L dY, osp r, osj 1; dA (r, K) =
// (s dY B)ᵀ x: L x, osp 1, osj K). Every element is written (zeros when M is 0). Block: 32 p
// x 32 j, 128 threads, each 2 p (ty, ty + 16) x 4 j (tx, tx + 8, ..); m in steps of 32.
// The sum over M (the tokens: long) is split over `splits` blocks of `chunk` rows each (a
// multiple of 32), so that short P still fills the GPU: each writes its partial sums to
// `ws` (problem, split, P, r), and the last of a tile's blocks to finish (a ticket from
// `tickets`, one per tile, zero before and reset to zero after) adds the partials in split
// order, so the result does not depend on which block finished last. One split: no
// workspace, no ticket. Grid: (ceil(max P / 32), ceil(r / 32), problems x splits); a problem's
// blocks past its P return.
struct LgGrad {
    const LG_BF16 *l;
    const float *s;
    float *g;
    unsigned long long p, osp, osj;
};

#define LG_GP 32
#define LG_GJ 32
#define LG_GM 32

__device__ __forceinline__ void lg_grad_body(const LgGrad q, const unsigned problem,
                                             const unsigned long long m,
                                             const unsigned long long r, const unsigned splits,
                                             const unsigned long long chunk, float *ws,
                                             const unsigned long long ws_p,
                                             unsigned *tickets, const bool drop,
                                             const LgDrop d, float (*ls)[LG_GP + 1],
                                             float (*ss)[LG_GJ + 1], unsigned *last) {
    const unsigned tid = LG_TID, ty = tid / 8, tx = tid % 8;
    const unsigned split = LG_BZ % splits;
    const unsigned long long p0 = (unsigned long long)LG_BX * LG_GP;
    const unsigned long long j0 = (unsigned long long)LG_BY * LG_GJ;
    if (p0 >= q.p) return; // the whole block: no thread reaches a barrier
    const unsigned long long m_lo = split * chunk;
    const unsigned long long m_hi = m_lo + chunk < m ? m_lo + chunk : m;
    float acc[2][4];
    for (int i = 0; i < 2; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
    for (unsigned long long mm0 = m_lo; mm0 < m_hi; mm0 += LG_GM) {
        for (unsigned e = tid; e < LG_GM * LG_GP; e += 128) {
            const unsigned mm = e / LG_GP, pp = e % LG_GP;
            const unsigned long long gm = mm0 + mm, gp = p0 + pp;
            float v = 0.0f;
            if (gm < m_hi && gp < q.p) {
                v = LG_TO_F32(q.l[gm * q.p + gp]);
                if (drop) v = lg_drop(d, gm * q.p + gp, v);
            }
            ls[mm][pp] = v;
        }
        for (unsigned e = tid; e < LG_GM * LG_GJ; e += 128) {
            const unsigned mm = e / LG_GJ, jj = e % LG_GJ;
            const unsigned long long gm = mm0 + mm, gj = j0 + jj;
            ss[mm][jj] = (gm < m_hi && gj < r) ? q.s[gm * r + gj] : 0.0f;
        }
        LG_SYNC();
        for (unsigned mm = 0; mm < LG_GM; ++mm) {
            float a[2], b[4];
            for (int i = 0; i < 2; ++i) a[i] = ls[mm][ty + 16 * i];
            for (int c = 0; c < 4; ++c) b[c] = ss[mm][tx + 8 * c];
            for (int i = 0; i < 2; ++i)
                for (int c = 0; c < 4; ++c) acc[i][c] = LG_FMA(a[i], b[c], acc[i][c]);
        }
        LG_SYNC();
    }
    if (splits == 1) {
        for (int i = 0; i < 2; ++i) {
            const unsigned long long gp = p0 + ty + 16 * i;
            for (int c = 0; c < 4; ++c) {
                const unsigned long long gj = j0 + tx + 8 * c;
                if (gp < q.p && gj < r) q.g[gp * q.osp + gj * q.osj] = acc[i][c];
            }
        }
        return;
    }
    // this split's partial sums, then a ticket: the tile's last block adds them all up
    float *part = ws + ((unsigned long long)problem * splits) * ws_p * r;
    for (int i = 0; i < 2; ++i) {
        const unsigned long long gp = p0 + ty + 16 * i;
        for (int c = 0; c < 4; ++c) {
            const unsigned long long gj = j0 + tx + 8 * c;
            if (gp < q.p && gj < r) part[(split * ws_p + gp) * r + gj] = acc[i][c];
        }
    }
    LG_FENCE();
    LG_SYNC();
    unsigned *ticket = tickets + ((unsigned long long)problem * LG_GX + LG_BX) * LG_GY + LG_BY;
    if (tid == 0) *last = LG_TICKET(ticket) == splits - 1;
    LG_SYNC();
    if (!*last) return;
    LG_FENCE();
    for (int i = 0; i < 2; ++i) {
        const unsigned long long gp = p0 + ty + 16 * i;
        for (int c = 0; c < 4; ++c) {
            const unsigned long long gj = j0 + tx + 8 * c;
            if (gp >= q.p || gj >= r) continue;
            float sum = 0.0f;
            for (unsigned t = 0; t < splits; ++t) sum = LG_ADD(sum, LG_LOAD(part + (t * ws_p + gp) * r + gj));
            q.g[gp * q.osp + gj * q.osj] = sum;
        }
    }
    if (tid == 0) *ticket = 0; // ready for the next launch
}

// Problem z / splits's L, S, G, P and G's strides: l0 .. for problem 0, l1 .. for 1. ws:
// problems x splits x ws_p x r floats (unused with one split); tickets: problems x gridDim.x
// x gridDim.y zeros (left zero); `drop` masks the rows of problem `drop.which` (x's).
LG_KERNEL tallow_lora_grad_bf16(const LG_BF16 *l0, const float *s0, float *g0,
                                const unsigned long long p0, const unsigned long long osp0,
                                const unsigned long long osj0, const LG_BF16 *l1, const float *s1,
                                float *g1, const unsigned long long p1,
                                const unsigned long long osp1, const unsigned long long osj1,
                                const unsigned long long m, const unsigned long long r,
                                const unsigned splits, const unsigned long long chunk, float *ws,
                                const unsigned long long ws_p, unsigned *tickets,
                                const LgDrop drop) {
    LG_SHARED float ls[LG_GM][LG_GP + 1];
    LG_SHARED float ss[LG_GM][LG_GJ + 1];
    LG_SHARED unsigned last;
    const unsigned problem = LG_BZ / splits;
    const LgGrad q = problem == 0 ? LgGrad{l0, s0, g0, p0, osp0, osj0}
                                  : LgGrad{l1, s1, g1, p1, osp1, osj1};
    lg_grad_body(q, problem, m, r, splits, chunk, ws, ws_p, tickets, drop.which == problem, drop,
                 ls, ss, &last);
}

#endif
