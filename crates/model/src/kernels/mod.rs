//! The kernels: each op's CPU kernel and its CUDA twin side by side, and the storage helpers
//! they share. Everything above (`crate::nn`) reaches a kernel through the dispatch rule
//! (`crate::nn::dispatch`).

pub mod blockwise8;
pub mod chunked;
pub mod consts;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dispatch;
pub mod dropout;
pub mod fused;
pub mod lora_linear;
pub mod matmul;
pub mod nf4;
