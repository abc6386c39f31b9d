//! The kernels: each op's CPU kernel and its CUDA twin side by side, the storage helpers they
//! share, and the rule that picks one ([`dispatch`]). Everything above (`crate::nn`) reaches a
//! kernel through that rule, so a new kernel is one file here, one row below, its branch in
//! `dispatch` and a `tallow doctor` check against its CPU twin.
//!
//! | op (forward + backward) | file | CPU | CUDA | `tallow doctor` check |
//! | --- | --- | --- | --- | --- |
//! | RMSNorm (and Gemma's `1 + w`) | [`fused`] | kernel, f32 / f64 / bf16 | kernel, f32 / bf16 (`kernels/tallow.cu`) | rmsnorm, gemma rmsnorm fwd+bwd |
//! | rotary embedding (with the head transpose) | [`fused`] | kernel, f32 / f64 / bf16 | kernel, f32 / bf16 | rope fwd+bwd |
//! | masked softmax | [`fused`] | kernel, f32 / f64 | tensor ops | softmax fwd+bwd |
//! | SwiGLU | [`fused`] | kernel, f32 / f64 / bf16 | kernel, f32 / bf16 | swiglu fwd+bwd |
//! | GeGLU (Gemma, gelu's tanh approximation) | [`fused`] | kernel, f32 / f64 / bf16 | kernel, f32 / bf16 | geglu fwd+bwd |
//! | eager attention's core (64-row blocks) | [`fused`] | kernel, f32 / f64 | tensor ops | checkpointed layer gradients |
//! | chunked attention (no T x T; packed rows, windows, soft-caps) | [`chunked`] | kernel, f32 / f64, bf16 uncapped | tensor ops per block | chunked attention (softcap) fwd+bwd |
//! | cross-entropy of a logits chunk (gradient in place) | [`cross_entropy`] | kernel, f32 / f64 (host-side) | kernel, f32 logits (device ops, twins in [`cross_entropy`]) | fused loss fwd+bwd |
//! | frozen / trainable base matmul | [`matmul`] | gemm | cuBLAS | frozen / trainable matmul fwd+bwd |
//! | the LoRA linear as one op | [`lora_linear`] | kernel, f32 / f64, bf16 x with f32 adapter | f32: cuBLAS; bf16 x: cuBLAS for the base and kernels for the adapter side (`kernels/lora_gemm.cuh`) | lora linear fwd+bwd, lora linear tiles+bias, lora linear nf4+bias+dropout |
//! | bf16 base matmuls of the LoRA linear and the LM head on AMX tiles | [`amx`] | kernel (AMX-BF16, else the widened f32 `gemm` twin) | - | amx bf16 matmul |
//! | NF4 quantize / dequantize, NF4 matmul | [`nf4`] | kernel | CUDA kernel (`kernels/tallow.cu`) + cuBLAS | nf4 dequantize (double quant), nf4 matmul fwd+bwd |
//! | GGML block weights (GGUF Q4_K, Q8_0, ...) dequantized for their matmul | [`ggml`] | kernel (Candle's block decoders over threads, straight into the compute dtype) | Candle's CUDA kernels + cuBLAS | gguf block dequantize |
//! | LoRA dropout mask (a hash of the seed and index) | [`dropout`] | kernel | CUDA kernel (`kernels/tallow.cu`) | lora dropout mask (bit for bit) |
//! | AdamW's update of a parameter group (moments in place, then the parameters; f32 members in place, 32 a launch) | [`adamw`] | kernel, f32 | kernel, f32 (`kernels/tallow.cu`) | adamw 3 steps |
//! | the sum of squares of many f32 tensors (the gradient norm) | [`sum_squares`] | twin (f64 sums) | kernel (`kernels/sum_squares.cuh`) | sum of squares |
//! | blockwise 8-bit (de)quantization (AdamW8bit's moments, NF4's double quant) | [`blockwise8`] | kernel | tensor ops | adamw8bit 3 steps |
//!
//! Storage helpers: [`fused`]'s `Real`, `data`, `uninit`, the bf16 widening and rounding;
//! [`matmul`]'s `InStorage` / `matmul_wt` (one generic body for an op's CPU and CUDA forward);
//! [`consts`]' small tables uploaded once per device; [`cuda`]'s PTX of tallow's own CUDA
//! kernels (feature `cuda`).

pub mod adamw;
pub mod amx;
pub mod attn_block;
pub mod blockwise8;
pub mod chunked;
pub mod consts;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dispatch;
pub mod dropout;
pub mod flash_attn;
pub mod fused;
pub mod ggml;
pub mod lora_linear;
pub mod matmul;
pub mod nf4;
pub mod sum_squares;
