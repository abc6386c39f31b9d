//! LoRA's low-rank factors (Hu et al. 2021, arXiv:2106.09685): A, B, the scale and the shared
//! dropout, and their product s · B A dropout(x). Every adapter kind of `crate::peft` is built
//! on them (LoRA adds the product to the base output; DoRA rescales the sum), and the CPU's
//! one-op LoRA linear (`crate::kernels::lora_linear`) takes them as they are.
//!
//! ```text
//!   x ──► W (frozen) ────────────────┐
//!   │                                 (+) ──► y = W x + b + s · B A x          (LoRA)
//!   └──► A (r × in) ──► B (out × r) ─┘      s = alpha / r   (rsLoRA: alpha / sqrt(r))
//! ```

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use crate::error::Result;
use crate::kernels::dropout::{Dropout, DropoutOp};
use crate::nn::no_grad;

/// LoRA's low-rank factors on one linear layer (Hu et al. 2021, arXiv:2106.09685; PEFT's
/// `LoraLayer`). A and B are f32 whatever the base dtype (as PEFT keeps them), so small updates
/// are not lost to bf16 rounding.
#[derive(Clone)]
pub struct Lora {
    /// (r, in), Kaiming-uniform at init.
    pub a: Var,
    /// (out, r), zeros at init, so a fresh adapter leaves the model unchanged.
    pub b: Var,
    pub scale: f64,
    /// Dropout on the adapter's input (PEFT's `lora_dropout`), shared by all adapters of a model.
    pub dropout: Option<Arc<Dropout>>,
    /// Index of this adapter in the model, mixed into the dropout seed.
    pub id: u64,
}

/// SplitMix64 finalizer: mixes an adapter id into a seed.
pub fn mix_seed(seed: u64, id: u64) -> u64 {
    let mut z = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Lora {
    pub fn rank(&self) -> usize {
        self.a.dim(0).unwrap_or(0)
    }

    /// The dropout mask this adapter multiplies its input by in the micro-batch whose seed is
    /// `micro_seed` (what the trainer passes to `set_dropout`), for an input of `dims` ((M, in)):
    /// 0 with probability p, else 1/(1-p); None without dropout. A pure function of
    /// (micro_seed, adapter id, element index): [`DropoutOp`] applied to ones.
    pub fn dropout_mask(
        &self,
        micro_seed: u64,
        dims: &[usize],
        device: &Device,
    ) -> Result<Option<Tensor>> {
        match self.dropout_op(micro_seed) {
            Some(op) => Ok(Some(op.apply(&Tensor::ones(dims, DType::F32, device)?)?)),
            None => Ok(None),
        }
    }

    /// The dropout op of the current micro-batch while training with p > 0; None otherwise.
    /// Inside a token tile ([`crate::kernels::dropout::at_row`]) it draws that tile's rows of the
    /// batch's masks.
    pub fn active_dropout(&self) -> Option<DropoutOp> {
        let skip = crate::kernels::dropout::first_row() * self.a.dim(1).unwrap_or(0);
        self.dropout
            .as_ref()
            .and_then(|d| d.seed())
            .and_then(|s| self.dropout_op(s))
            .map(|op| op.skip(skip))
    }

    fn dropout_op(&self, micro_seed: u64) -> Option<DropoutOp> {
        match &self.dropout {
            Some(d) if d.p > 0.0 => Some(DropoutOp {
                seed: mix_seed(micro_seed, self.id),
                p: d.p,
            }),
            _ => None,
        }
    }

    /// s · B A dropout(x) for x: (M, in) in any float dtype -> (M, out) in f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.to_dtype(self.a.dtype())?;
        if let Some(op) = self.active_dropout() {
            // One element-wise op whose backward is itself on dy: no mask is stored.
            x = op.apply(&x)?;
        }
        self.forward_dropped(&x)
    }

    /// s · B A x for an input already dropped out (or without dropout): (M, in) -> (M, out) f32.
    pub fn forward_dropped(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.to_dtype(self.a.dtype())?;
        // The scale is applied to the rank-r intermediate rather than to the (M, out) output
        // (PEFT's order): same value up to rounding, and the graph keeps an (M, r) tensor less
        // instead of an (M, out) one.
        let (a, b) = (no_grad::enter(&self.a), no_grad::enter(&self.b));
        let xa = (x.matmul(&a.t()?)? * self.scale)?; // (M, r)
        Ok(xa.matmul(&b.t()?)?) // (M, out)
    }
}
