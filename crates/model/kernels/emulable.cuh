// The device functions tallow's host-emulable kernels (lora_gemm.cuh, sum_squares.cuh,
// flash_attn.cuh) are written against. On the GPU they are CUDA's; tests/cuda_host/*.cpp define
// them for the CPU (LG_HOST_EMULATION: each block's threads on CPU threads, a barrier for
// __syncthreads, the block's __shared__ arrays as statics, one block at a time) and run the
// kernels' own source against sequential loops.

#ifndef TALLOW_EMULABLE_CUH
#define TALLOW_EMULABLE_CUH

#ifndef LG_HOST_EMULATION
#define LG_BF16 __nv_bfloat16
#define LG_TO_F32(v) __bfloat162float(v)
#define LG_TO_BF16(v) __float2bfloat16_rn(v)
#define LG_ADD(a, b) __fadd_rn(a, b)
#define LG_FMA(a, b, c) __fmaf_rn(a, b, c)
#define LG_MUL(a, b) __fmul_rn(a, b)
#define LG_SYNC() __syncthreads()
#define LG_SHARED __shared__
#define LG_TID threadIdx.x
#define LG_BX blockIdx.x
#define LG_BY blockIdx.y
#define LG_BZ blockIdx.z
#define LG_KERNEL extern "C" __global__ void
#define LG_GX gridDim.x
#define LG_GY gridDim.y
#define LG_FENCE() __threadfence()
#define LG_TICKET(p) atomicAdd(p, 1u)
#define LG_LOAD(p) __ldcg(p)
#define LG_SUB(a, b) __fsub_rn(a, b)
#define LG_MAX(a, b) fmaxf(a, b)
#define LG_EXP(v) expf(v)
#define LG_LOG(v) logf(v)
#define LG_TANH(v) tanhf(v)
#endif

#endif
