//! The dispatch rule: which path an op of the training step takes on a device and dtype, a
//! kernel of tallow's own or the device-generic tensor-op path. The forward asks it at each op
//! (`crate::nn::ops`, `crate::nn::linear`, chunked attention) and `tallow estimate` asks it for
//! the whole step ([`Paths::of`]), so the estimate counts the tensors the forward keeps.
//!
//! | path | taken when |
//! | --- | --- |
//! | fused element-wise kernels (norms, rotary, softmax, SwiGLU, eager attention's core; `super::fused`) | CPU, f32 / f64 |
//! | fused SwiGLU, GeGLU, rotary and RMSNorm (`super::fused::swiglu`, `geglu`, `rope_heads`, `rms_norm`) | CPU, f32 / f64, and bf16 (in f32, rounded where PyTorch's bf16 ops round); CUDA, f32 and bf16 (one kernel of `kernels/tallow.cu` each way, the same arithmetic) |
//! | the one-op LoRA linear (`super::lora_linear`) | CPU: x f32 / f64 with an adapter of x's dtype, or x bf16 with an f32 adapter; CUDA: the same but f64 (the base's cuBLAS gemm; for a bf16 x the adapter side as three kernels of `kernels/lora_gemm.cuh` on the bf16 rows, dropout's mask included, `super::lora_linear::bf16_kernels`; for an f32 x cuBLAS gemms with the scale and the accumulation in their alpha / beta); an additive adapter (LoRA) over a frozen base (the linear checks that) |
//! | chunked attention's kernel (`super::chunked`) | CPU: f32 / f64, or bf16 without soft-capping |
//! | chunked attention as kernels of tallow's own, forward one launch and backward two (`super::flash_attn`) | CUDA: bf16 and f16, head dims up to 256 ([`flash_attention`]) |
//! | chunked attention's block kernels around cuBLAS's matmuls (`super::attn_block`) | CUDA: f32, and bf16 past 256 head dims (the tensor-op path's softmax, mask and dS) |
//! | the LM head's cross-entropy as device ops (`super::cross_entropy::ce_rows`, `ce_grad_rows`) | CUDA, f32 logits (the CPU has its host-side kernel for f32 / f64) |
//!
//! Everything else (the rest of CUDA, f16, the other bf16 element-wise ops on the CPU) is Candle's tensor ops, which
//! every kernel's tests and `tallow doctor` compare the kernel with.

use candle_core::{DType, Device, Tensor};

/// The device an op runs on, as the rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    /// The rule's backend for `device`: [`Backend::Cuda`] for the CPU too under
    /// [`cuda_paths_on_cpu`].
    pub fn of(device: &Device) -> Self {
        if device.is_cpu() && !cuda_paths_on_cpu() {
            Backend::Cpu
        } else {
            Backend::Cuda
        }
    }

    /// `tallow estimate`'s device names ("cpu", "cuda"), under the same switch.
    pub fn named(device: &str) -> Self {
        if device == "cpu" && !cuda_paths_on_cpu() {
            Backend::Cpu
        } else {
            Backend::Cuda
        }
    }
}

/// `TALLOW_CUDA_PATHS_ON_CPU=1`, a development switch: tensors on the CPU take the paths CUDA
/// takes (Candle's tensor ops and the tensor-op twins of tallow's CUDA kernels, no CPU kernel,
/// no AMX), computed by the CPU. The values are the CUDA path's, within rounding (what `tallow
/// doctor` checks); what it is for is measuring, on a machine without a GPU, what that path
/// allocates and how many ops it issues (`tallow bench` with `train.device = "cpu"` then
/// measures the CUDA step's tensors; `tallow estimate` for the CPU counts them the same way,
/// without a CUDA context). Read once per process.
pub fn cuda_paths_on_cpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCED.with(|f| f.get()).unwrap_or_else(|| {
        *ON.get_or_init(|| std::env::var("TALLOW_CUDA_PATHS_ON_CPU").is_ok_and(|v| v.trim() == "1"))
    })
}

thread_local! {
    static FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`cuda_paths_on_cpu`] on for this thread, whatever the environment says: for
/// tests of a CUDA path's twin inside a test process.
pub fn with_cuda_paths_on_cpu<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|f| f.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|f| f.replace(Some(true))));
    f()
}

/// The fused element-wise kernels take tensors of `dtype` on `backend`.
pub fn fused(backend: Backend, dtype: DType) -> bool {
    backend == Backend::Cpu && matches!(dtype, DType::F32 | DType::F64)
}

/// [`fused`] for a tensor.
pub fn fused_for(t: &Tensor) -> bool {
    fused(Backend::of(t.device()), t.dtype())
}

/// The fused kernels that also have a bf16 body (SwiGLU, GeGLU, rotary with the head transpose,
/// Llama's RMSNorm: computing in f32 and rounding where PyTorch's bf16 ops round) take tensors
/// of `dtype` on `backend`: on the CPU f32, f64 and bf16; on CUDA f32 and bf16, where each is
/// one kernel of `kernels/tallow.cu` forward and one backward (f16 and f64 keep Candle's ops).
pub fn fused_with_bf16(backend: Backend, dtype: DType) -> bool {
    match backend {
        Backend::Cpu => matches!(dtype, DType::F32 | DType::F64 | DType::BF16),
        Backend::Cuda => matches!(dtype, DType::F32 | DType::BF16),
    }
}

/// [`fused_with_bf16`] for a tensor.
pub fn fused_with_bf16_for(t: &Tensor) -> bool {
    fused_with_bf16(Backend::of(t.device()), t.dtype())
}

/// The LM head's cross-entropy over logits of `dtype` runs as the device ops of
/// `super::cross_entropy` (`ce_rows`, `ce_grad_rows`: one CUDA kernel each way, labels and row
/// statistics on the device): on CUDA, f32 logits (what bf16, f16 and f32 models upcast to). The
/// CPU's f32 / f64 logits take its host path (`ce_nll_sum`), CUDA's f64 Candle's tensor ops.
pub fn device_cross_entropy(backend: Backend, dtype: DType) -> bool {
    backend == Backend::Cuda && dtype == DType::F32
}

/// A LoRA linear with input `x` and adapter factors of `adapter` dtype may run as one op: on
/// the CPU f32 / f64 (x and adapter alike) and a bf16 x with an f32 adapter; on CUDA f32 and
/// a bf16 x with an f32 adapter (cuBLAS gemms, and for a bf16 x tallow's kernels,
/// `super::lora_linear`).
pub fn lora_one_op(backend: Backend, x: DType, adapter: DType) -> bool {
    match (backend, x, adapter) {
        (_, DType::BF16, DType::F32) => true,
        (Backend::Cpu, x, a) => x == a && matches!(x, DType::F32 | DType::F64),
        (Backend::Cuda, x, a) => x == a && x == DType::F32,
    }
}

/// The largest head dim chunked attention's CUDA kernels take (their shared-memory tiles,
/// `FA_DMAX` in `kernels/flash_attn.cuh`); a larger one keeps the tensor-op path.
pub const FLASH_MAX_HEAD_DIM: usize = 256;

/// Chunked attention runs as the CUDA kernels of `super::flash_attn` (forward one launch,
/// backward two, whatever the length): on CUDA, bf16 and f16 q, k, v with heads of at most
/// [`FLASH_MAX_HEAD_DIM`]. f32 keeps the tensor-op path (cuBLAS's matmuls in f32 around the
/// block kernels of `super::attn_block`).
pub fn flash_attention(backend: Backend, dtype: DType, head_dim: usize) -> bool {
    backend == Backend::Cuda
        && matches!(dtype, DType::BF16 | DType::F16)
        && head_dim <= FLASH_MAX_HEAD_DIM
}

/// Chunked attention runs its CPU kernel on q, k, v of `dtype` (soft-capped or not).
pub fn chunked_kernel(backend: Backend, dtype: DType, softcapped: bool) -> bool {
    fused(backend, dtype) || (backend == Backend::Cpu && dtype == DType::BF16 && !softcapped)
}

/// The paths of a whole step: activations in `dtype` on `backend`, adapters in `adapter`
/// dtype, attention scores soft-capped or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paths {
    pub fused: bool,
    pub fused_with_bf16: bool,
    pub lora_one_op: bool,
    pub chunked_kernel: bool,
}

impl Paths {
    pub fn of(backend: Backend, dtype: DType, adapter: DType, softcapped: bool) -> Self {
        Paths {
            fused: fused(backend, dtype),
            fused_with_bf16: fused_with_bf16(backend, dtype),
            lora_one_op: lora_one_op(backend, dtype, adapter),
            chunked_kernel: chunked_kernel(backend, dtype, softcapped),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA's attention kernels: bf16 and f16 with heads up to their tiles' 256; f32, larger
    /// heads and the CPU keep their paths.
    #[test]
    fn flash_attention_per_device_dtype_and_head_dim() {
        use Backend::{Cpu, Cuda};
        assert!(flash_attention(Cuda, DType::BF16, 64));
        assert!(flash_attention(Cuda, DType::F16, 256));
        assert!(!flash_attention(Cuda, DType::BF16, 257));
        assert!(!flash_attention(Cuda, DType::F32, 64));
        assert!(!flash_attention(Cpu, DType::BF16, 64));
    }

    #[test]
    fn the_rule_per_device_and_dtype() {
        let p = |b, d, capped| Paths::of(b, d, DType::F32, capped);
        use Backend::{Cpu, Cuda};
        assert_eq!(
            p(Cpu, DType::F32, true),
            Paths {
                fused: true,
                fused_with_bf16: true,
                lora_one_op: true,
                chunked_kernel: true
            }
        );
        assert_eq!(
            p(Cpu, DType::BF16, false),
            Paths {
                fused: false,
                fused_with_bf16: true,
                lora_one_op: true,
                chunked_kernel: true
            }
        );
        assert_eq!(
            p(Cpu, DType::BF16, true),
            Paths {
                fused: false,
                fused_with_bf16: true,
                lora_one_op: true,
                chunked_kernel: false
            }
        );
        assert_eq!(
            p(Cpu, DType::F16, false),
            Paths {
                fused: false,
                fused_with_bf16: false,
                lora_one_op: false,
                chunked_kernel: false
            }
        );
        // CUDA: the kernels of kernels/tallow.cu (SwiGLU, GeGLU, rotary, RMSNorm) in f32 and
        // bf16, the one-op LoRA linear (cuBLAS) for f32 and for bf16 with its f32 adapter
        for d in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            assert_eq!(
                p(Cuda, d, false),
                Paths {
                    fused: false,
                    fused_with_bf16: matches!(d, DType::F32 | DType::BF16),
                    lora_one_op: matches!(d, DType::F32 | DType::BF16),
                    chunked_kernel: false
                }
            );
        }
        assert!(!lora_one_op(Cpu, DType::F32, DType::BF16));
        assert!(!lora_one_op(Cuda, DType::F64, DType::F64));
        assert!(!lora_one_op(Cuda, DType::F16, DType::F32));
        assert!(lora_one_op(Cpu, DType::F64, DType::F64));
        assert!(device_cross_entropy(Cuda, DType::F32));
        assert!(!device_cross_entropy(Cuda, DType::F64));
        assert!(!device_cross_entropy(Cpu, DType::F32));
    }
}
