// The sum of the squares of up to TALLOW_SQ_TENSORS f32 tensors in one launch
// (`tallow_model::kernels::sum_squares`: the gradient norm before clipping), where Candle's ops
// took a square, a sum and an add per tensor. Each thread sums the squares of its elements
// (grid-stride over the tensors' elements laid end to end) in f32, each block adds its threads'
// sums in a fixed tree, and the last block to finish (a ticket, zero before and reset to zero
// after) adds the blocks' sums in block order: the result depends only on the grid, which
// depends only on the element count, so it is the same from run to run.
#ifndef TALLOW_SUM_SQUARES_CUH
#define TALLOW_SUM_SQUARES_CUH

#include "emulable.cuh"

#define TALLOW_SQ_TENSORS 32
#define TALLOW_SQ_THREADS 256

struct TallowSqTable {
    const float *t[TALLOW_SQ_TENSORS];
    unsigned long long start[TALLOW_SQ_TENSORS + 1]; // element e is tensor j's e - start[j]
    unsigned long long count;
};

// out[0] := Σ_j Σ_i t_j[i]²; partials: gridDim.x floats; ticket: one zero (left zero).
LG_KERNEL tallow_sum_squares_f32(const TallowSqTable tab, float *partials, unsigned *ticket,
                                 float *out) {
    LG_SHARED float red[TALLOW_SQ_THREADS];
    LG_SHARED unsigned last;
    const unsigned tid = LG_TID;
    const unsigned long long total = tab.start[tab.count];
    const unsigned long long stride = (unsigned long long)LG_GX * TALLOW_SQ_THREADS;
    float acc = 0.0f;
    unsigned j = 0;
    for (unsigned long long e = (unsigned long long)LG_BX * TALLOW_SQ_THREADS + tid; e < total;
         e += stride) {
        while (tab.start[j + 1] <= e) ++j; // e only grows; empty tensors are stepped over
        const float v = tab.t[j][e - tab.start[j]];
        acc = LG_FMA(v, v, acc);
    }
    red[tid] = acc;
    LG_SYNC();
    for (unsigned s = TALLOW_SQ_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = LG_ADD(red[tid], red[tid + s]);
        LG_SYNC();
    }
    if (tid == 0) partials[LG_BX] = red[0];
    LG_FENCE();
    LG_SYNC();
    if (tid == 0) last = LG_TICKET(ticket) == LG_GX - 1;
    LG_SYNC();
    if (!last) return;
    LG_FENCE();
    if (tid == 0) {
        float sum = 0.0f;
        for (unsigned b = 0; b < LG_GX; ++b) sum = LG_ADD(sum, LG_LOAD(partials + b));
        out[0] = sum;
        *ticket = 0; // ready for the next launch
    }
}

#endif
