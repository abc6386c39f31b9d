//! The base matmuls of the linear layer, with the backward each base needs: [`FrozenMatmul`]
//! (dX only: no model-sized dW for a frozen weight) and [`TrainableMatmul`] (dW from detached
//! tensors); and the storage helpers that let one generic forward serve an op's CPU and CUDA
//! bodies ([`InStorage`], [`matmul_t`], [`matmul_wt`]), which the other kernels use too. CPU and
//! CUDA both run Candle's matmul (gemm / cuBLAS) inside. [`DequantMatmul`] is the frozen
//! matmul of a weight kept quantized (NF4, GGML blocks): it dequantizes for each call.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor,
};

/// x W^T for a frozen W, whose backward gives dX = dY W and no dW.
/// The op keeps a reference to W (which lives in the model anyway) and nothing else.
pub struct FrozenMatmul {
    /// (N, K)
    pub w: Tensor,
}

/// A backend's storage as it sits in Candle's `Storage` enum: lets one generic forward serve
/// an op's `cpu_fwd` and `cuda_fwd`.
pub trait InStorage: BackendStorage {
    /// The device, in errors ("the CPU").
    const DEVICE: &'static str;
    /// The backend storage inside `s`, when `s` is on this backend.
    fn of(s: &Storage) -> Option<&Self>;
}

impl InStorage for CpuStorage {
    const DEVICE: &'static str = "the CPU";
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        }
    }
}

impl InStorage for CudaStorage {
    const DEVICE: &'static str = "the CUDA device";
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        }
    }
}

/// x wᵀ: x (M, K) and w (N, K) storages on one backend -> (M, N), the forward of the matmul
/// ops (`op` names the op in errors).
pub fn matmul_t<S: BackendStorage>(
    x: &S,
    xl: &Layout,
    w: &S,
    wl: &Layout,
    op: &str,
) -> candle_core::Result<(S, Shape)> {
    let (m, k) = xl.shape().dims2()?;
    let (n, k2) = wl.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("{op}: input has {k} features, weight expects {k2}");
    }
    let out = x.matmul(w, (1, m, n, k), xl, &wl.transpose(0, 1)?)?;
    Ok((out, Shape::from((m, n))))
}

/// [`matmul_t`] with the weight (N, K) a tensor, which must be on x's device.
pub fn matmul_wt<S: InStorage>(
    x: &S,
    xl: &Layout,
    w: &Tensor,
    op: &str,
) -> candle_core::Result<(S, Shape)> {
    let (ws, wl) = w.storage_and_layout();
    let Some(ws) = S::of(&ws) else {
        candle_core::bail!("{op}: weight is not on {}", S::DEVICE);
    };
    matmul_t(x, xl, ws, wl, op)
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    // x: (M, K) -> (M, N)
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        matmul_wt(s, l, &self.w, "frozen matmul")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        matmul_wt(s, l, &self.w, "frozen matmul")
    }

    // dX = dY W: (M, N) x (N, K) -> (M, K)
    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(dy.matmul(&self.w)?))
    }
}

/// x W^T for a trainable W (full fine-tuning), whose backward gives dX = dY W and
/// dW = dYᵀ X computed from detached tensors. Candle's own matmul backward builds dW as an op on
/// X and dY, so every weight gradient kept its layer's input and upstream gradient alive until
/// the gradients were dropped (measured: +111 MiB at the end of a 256-token backward of a
/// 105M-parameter model, and with checkpointing every recomputed layer stayed alive).
pub struct TrainableMatmul;

impl CustomOp2 for TrainableMatmul {
    fn name(&self) -> &'static str {
        "trainable-matmul"
    }

    // x: (M, K), w: (N, K) -> (M, N)
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        matmul_t(s, l, ws, wl, "trainable matmul")
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        matmul_t(s, l, ws, wl, "trainable matmul")
    }

    // dX = dY W: (M, N) x (N, K); dW = dYᵀ X: (N, M) x (M, K)
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.detach();
        let dx = x.track_op().then(|| dy.matmul(&w.detach())).transpose()?;
        let dw = dy.t()?.matmul(&x.detach())?;
        Ok((dx, Some(dw)))
    }
}

/// A frozen base weight kept quantized (`crate::kernels::nf4`'s NF4, `crate::kernels::ggml`'s
/// GGML blocks): what [`DequantMatmul`] and the one-op LoRA linear need of it.
pub trait Dequantize: Send + Sync {
    /// The matmul op's name (launch counts, `TALLOW_OP_TIMES`, errors).
    fn op_name(&self) -> &'static str;
    /// What [`Dequantize::dequantize_candle`] returns, and the dtype the input must have.
    fn compute_dtype(&self) -> DType;
    /// The weight (N, K) in the compute dtype on the weight's device: a new full-precision copy,
    /// which the caller drops after its matmul.
    fn dequantize_candle(&self) -> candle_core::Result<Tensor>;
}

/// x W^T for a quantized W: the custom op holds only the quantized weight; forward and backward
/// each dequantize it (one layer at a time) and drop the full-precision copy before returning,
/// so the graph never keeps a dequantized weight alive. Backward gives dX only.
pub struct DequantMatmul<W: ?Sized> {
    pub w: Arc<W>,
}

impl<W: Dequantize + ?Sized> DequantMatmul<W> {
    /// x (M, K) -> x Wᵀ (M, N) on x's backend, W dequantized for the call and dropped on return.
    fn fwd<S: InStorage>(&self, s: &S, l: &Layout) -> candle_core::Result<(S, Shape)> {
        if s.dtype() != self.w.compute_dtype() {
            candle_core::bail!(
                "{}: input is {:?}, the weight computes in {:?}",
                self.w.op_name(),
                s.dtype(),
                self.w.compute_dtype()
            );
        }
        let w = self.w.dequantize_candle()?; // (N, K)
        matmul_wt(s, l, &w, self.w.op_name())
    }
}

impl<W: Dequantize + ?Sized> CustomOp1 for DequantMatmul<W> {
    fn name(&self) -> &'static str {
        self.w.op_name()
    }

    // x: (M, K) -> (M, N)
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.fwd(s, l)
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.fwd(s, l)
    }

    // dX = dY W: (M, N) x (N, K) -> (M, K), W dequantized again.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let w = self.w.dequantize_candle()?;
        Ok(Some(dy.matmul(&w)?))
    }
}
