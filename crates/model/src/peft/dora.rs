//! DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353) as
//! PEFT's `use_dora` (`peft/tuners/lora/dora.py`, `DoraLinearLayer`): the adapted weight is
//! split into a trainable magnitude per output feature and a direction.
//!
//! ```text
//!   W' = m ⊙ (W + s B A) / n          n = ||W + s B A|| per output row (out), treated as a
//!                                       constant in backward, as PEFT does (section 4.3)
//!   y  = (m / n) ⊙ (W x + s B A x) + b
//! ```
//!
//! With LoRA dropout active (training, p > 0) PEFT applies the rescaled part to the dropped
//! input xd and keeps the plain base output on x, which costs a second base matmul:
//!
//! ```text
//!   y  = W x + b + (m / n - 1) ⊙ W xd + (m / n) ⊙ s B A xd
//! ```
//!
//! m starts as n at attach time (B = 0: the row norms of W), so a fresh adapter leaves the
//! model unchanged. m is f32 like A and B; PEFT saves it as `<module>.lora_magnitude_vector`.
//!
//! The norm never builds W + s B A: per output row i,
//! n_i² = ||W_i||² + 2 s (W Aᵀ)_i · B_i + s² B_i (A Aᵀ) B_iᵀ, with ||W_i||² computed once at
//! attach. What the forward adds to LoRA's is the (out, r) product W Aᵀ, made by the base's own
//! matmul op (A as an r-row input), so a dense f32 base needs no weight-sized temporary; a bf16 /
//! f16 base is read in f32 (one transient f32 copy of the weight, counted by the estimate), an
//! NF4 base is dequantized inside its op as for the forward. All of it is computed from detached
//! tensors: no graph, nothing kept for backward.

use candle_core::{DType, Tensor, Var};

use crate::error::Result;
use crate::linear::{Base, Linear};
use crate::peft::Lora;

/// A DoRA adapter: LoRA's A and B plus the magnitude vector.
#[derive(Clone)]
pub struct Dora {
    pub lora: Lora,
    /// m: (out), f32, trainable.
    pub magnitude: Var,
    /// ||W_i||² per output row, (out) f32: the base weight is frozen, so computed once.
    pub base_norm_sq: Tensor,
}

impl Dora {
    /// DoRA on `lin`'s base weight with `lora`'s matrices: m = ||W + s B A|| (the row norms of
    /// W for a fresh adapter).
    pub fn new(lin: &Linear, lora: Lora) -> Result<Self> {
        let base_norm_sq = base_norm_sq(&lin.weight)?;
        let dora = Self {
            magnitude: Var::zeros(lin.out_features(), DType::F32, base_norm_sq.device())?,
            base_norm_sq,
            lora,
        };
        dora.magnitude.set(&dora.weight_norm(lin)?)?;
        Ok(dora)
    }

    /// n = ||W + s B A|| per output row, (out) f32, from detached tensors (no graph).
    pub fn weight_norm(&self, lin: &Linear) -> Result<Tensor> {
        let s = self.lora.scale;
        let a = self.lora.a.as_tensor().detach(); // (r, in)
        let b = self.lora.b.as_tensor().detach(); // (out, r)
        let wa = crate::no_grad(|| base_times(lin, &a))?.t()?; // (out, r) = W Aᵀ
        let cross = (wa * &b)?.sum(1)?; // (out): W_i · (B A)_i
        let aat = a.matmul(&a.t()?)?; // (r, r)
        let quad = (b.matmul(&aat)? * &b)?.sum(1)?; // (out): ||(B A)_i||²
        let sq = ((&self.base_norm_sq + (cross * (2.0 * s))?)? + (quad * (s * s))?)?;
        // Rounding can only push a zero row's square below zero by a few ulps.
        Ok(sq.relu()?.sqrt()?)
    }

    /// The DoRA linear's output from the base output `base` = x Wᵀ (M, out), the bias and the
    /// adapter input `x` (M, in) in f32. Returns (M, out) in the base output's dtype.
    pub(crate) fn forward(
        &self,
        lin: &Linear,
        base: Tensor,
        bias: Option<&Tensor>,
        x: &Tensor,
    ) -> Result<Tensor> {
        let dt = base.dtype();
        let n = self.weight_norm(lin)?; // (out), constant
        let m = crate::no_grad::enter(self.magnitude.as_tensor());
        let scale = m.broadcast_div(&n)?; // (out): m / n, gradient to m only
        let y = match self.lora.active_dropout() {
            None => {
                // (m / n) ⊙ (W x + s B A x): one (M, out) sum kept for m's gradient.
                let z = (base.to_dtype(DType::F32)? + self.lora.forward(x)?)?;
                z.broadcast_mul(&scale)?
            }
            Some(op) => {
                // PEFT's order: W x + (m / n - 1) ⊙ W xd + (m / n) ⊙ s B A xd.
                let xd = op.apply(x)?;
                let base_d = lin.base_matmul(&xd.to_dtype(dt)?)?.to_dtype(DType::F32)?;
                let lora_d = self.lora.forward_dropped(&xd)?;
                let scaled = (base_d.clone() + lora_d)?.broadcast_mul(&scale)?;
                ((base.to_dtype(DType::F32)? + scaled)? - base_d)?
            }
        };
        let y = y.to_dtype(dt)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// The merged weight m ⊙ (W + s B A) / ||W + s B A|| (out, in) in the base's dtype, computed
    /// in f32 as PEFT's `merge_and_unload` does (the norm of the summed weight itself).
    pub fn merged_weight(&self, lin: &Linear) -> Result<Tensor> {
        let w = lin.weight.dense()?; // (out, in)
        let delta = (self.lora.b.matmul(self.lora.a.as_tensor())? * self.lora.scale)?;
        let full = (w.to_dtype(DType::F32)? + delta)?; // (out, in)
        let n = full.sqr()?.sum_keepdim(1)?.sqrt()?; // (out, 1)
        let factor = self
            .magnitude
            .as_tensor()
            .unsqueeze(1)?
            .broadcast_div(&n)?; // (out, 1)
        Ok(full.broadcast_mul(&factor)?.to_dtype(w.dtype())?)
    }
}

/// A (r, in) times the base weight transposed: (r, out) = A Wᵀ, in f32, through the base's
/// matmul op (frozen / NF4: no weight gradient, nothing kept).
fn base_times(lin: &Linear, a: &Tensor) -> Result<Tensor> {
    let dt = match &lin.weight {
        Base::Dense(p) => p.tensor().dtype(),
        Base::Nf4(w) => w.dtype,
    };
    if dt == DType::F32 {
        return lin.base_matmul(a);
    }
    // bf16 / f16: the weight in f32 (one transient copy), so the cross term keeps A's precision.
    let w = lin.weight.dense()?.to_dtype(DType::F32)?.detach(); // (out, in)
    Ok(a.matmul(&w.t()?)?)
}

/// ||W_i||² per output row (out), f32.
fn base_norm_sq(base: &Base) -> Result<Tensor> {
    Ok(base
        .dense()?
        .detach().to_dtype(DType::F32)?.sqr()?.sum(1)?)
}
