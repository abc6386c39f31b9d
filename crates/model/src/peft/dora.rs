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

use super::kind::KindSpec;
use crate::config::layout::LinearSpec;
use crate::error::Result;
use crate::nn::linear::{Adapter, Linear};
use crate::nn::lora::Lora;

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
    /// W for a fresh adapter). The weight is read once (dequantized once for NF4) for both
    /// ||W||² and W Aᵀ.
    pub fn new(lin: &Linear, lora: Lora) -> Result<Self> {
        let w = lin.weight.dense()?.detach().to_dtype(DType::F32)?; // (out, in)
        let base_norm_sq = w.sqr()?.sum(1)?;
        let wa = lora.a.as_tensor().detach().matmul(&w.t()?)?.t()?; // (out, r) = W Aᵀ
        drop(w);
        let dora = Self {
            magnitude: Var::zeros(lin.out_features(), DType::F32, base_norm_sq.device())?,
            base_norm_sq,
            lora,
        };
        dora.magnitude.set(&dora.norm_with(&wa)?)?;
        Ok(dora)
    }

    /// n = ||W + s B A|| per output row, (out) f32, from detached tensors (no graph).
    pub fn weight_norm(&self, lin: &Linear) -> Result<Tensor> {
        let a = self.lora.a.as_tensor().detach(); // (r, in)
        let wa = crate::nn::no_grad::no_grad(|| base_times(lin, &a))?.t()?; // (out, r) = W Aᵀ
        self.norm_with(&wa)
    }

    /// n from W Aᵀ (out, r): ||W_i||² + 2 s (W Aᵀ)_i · B_i + s² B_i (A Aᵀ) B_iᵀ, square-rooted.
    fn norm_with(&self, wa: &Tensor) -> Result<Tensor> {
        let s = self.lora.scale;
        let a = self.lora.a.as_tensor().detach(); // (r, in)
        let b = self.lora.b.as_tensor().detach(); // (out, r)
        let cross = (wa * &b)?.sum(1)?; // (out): W_i · (B A)_i
        let aat = a.matmul(&a.t()?)?; // (r, r)
        let quad = (b.matmul(&aat)? * &b)?.sum(1)?; // (out): ||(B A)_i||²
        let sq = ((&self.base_norm_sq + (cross * (2.0 * s))?)? + (quad * (s * s))?)?;
        // Rounding can only push a zero row's square below zero by a few ulps.
        Ok(sq.relu()?.sqrt()?)
    }
}

impl Adapter for Dora {
    fn kind(&self) -> &'static str {
        DoraKind.name()
    }

    fn lora(&self) -> &Lora {
        &self.lora
    }

    fn lora_mut(&mut self) -> &mut Lora {
        &mut self.lora
    }

    /// The DoRA linear's output from the base output `base` = x Wᵀ (M, out), the bias and the
    /// adapter input `x` (M, in) in f32. Returns (M, out) in the base output's dtype.
    fn forward(
        &self,
        lin: &Linear,
        base: Tensor,
        bias: Option<&Tensor>,
        x: &Tensor,
    ) -> Result<Tensor> {
        let dt = base.dtype();
        let n = self.weight_norm(lin)?; // (out), constant
        let m = crate::nn::no_grad::enter(self.magnitude.as_tensor());
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

    fn vars(&self) -> Vec<(&'static str, &Var)> {
        vec![
            ("lora_A.weight", &self.lora.a),
            ("lora_B.weight", &self.lora.b),
            ("lora_magnitude_vector", &self.magnitude),
        ]
    }

    /// The merged weight m ⊙ (W + s B A) / ||W + s B A|| (out, in) in the base's dtype, computed
    /// in f32 as PEFT's `merge_and_unload` does (the norm of the summed weight itself).
    fn merged_weight(&self, lin: &Linear) -> Result<Tensor> {
        let w = lin.weight.dense()?; // (out, in)
        let delta = (self.lora.b.matmul(self.lora.a.as_tensor())? * self.lora.scale)?;
        let full = (w.to_dtype(DType::F32)? + delta)?; // (out, in)
        let n = full.sqr()?.sum_keepdim(1)?.sqrt()?; // (out, 1)
        let factor = self.magnitude.as_tensor().unsqueeze(1)?.broadcast_div(&n)?; // (out, 1)
        Ok(full.broadcast_mul(&factor)?.to_dtype(w.dtype())?)
    }

    fn clone_box(&self) -> Box<dyn Adapter> {
        Box::new(self.clone())
    }
}

/// The DoRA kind (`lora.kind = "dora"`, PEFT's `use_dora`).
pub struct DoraKind;

impl KindSpec for DoraKind {
    fn name(&self) -> &'static str {
        "dora"
    }

    fn label(&self) -> &'static str {
        "DoRA"
    }

    fn use_dora(&self) -> bool {
        true
    }

    /// m starts as the row norms of W (B = 0), so the model is unchanged.
    fn attach(&self, lin: &Linear, lora: Lora) -> Result<Box<dyn Adapter>> {
        Ok(Box::new(Dora::new(lin, lora)?))
    }

    /// A (r, in), B (out, r), m (out).
    fn tensor_sizes(&self, out: usize, inp: usize, rank: usize) -> Vec<usize> {
        vec![rank * inp, rank * out, out]
    }

    /// ||W_i||² per output row, f32, computed once.
    fn kept_bytes(&self, out: usize) -> usize {
        4 * out
    }

    fn additive(&self) -> bool {
        false
    }

    /// Per token (tensor ops on every device): the base output, its f32 copy (bf16 / f16), the
    /// adapter input cast and dropped out, x·Aᵀ and its scaled copy, the adapter output,
    /// (W x + s B A x), the rescaled sum, the cast back and the bias add; with dropout also the
    /// dropped input in the model dtype, the second base matmul on it and its f32 copy, and
    /// PEFT's two extra (M, out) sums.
    fn activation_bytes(
        &self,
        l: &LinearSpec,
        s: usize,
        r: usize,
        dropout: bool,
        shared: bool,
    ) -> usize {
        let cast = |n: usize| if s == 4 { 0 } else { n };
        let mut n = s * l.out + cast(4 * l.out); // base output, in f32
        n += if shared { 0 } else { cast(4 * l.inp) }; // adapter input in f32
        n += 8 * r + 4 * l.out; // x·Aᵀ, scaled, ·Bᵀ
        n += 4 * l.out + 4 * l.out + cast(s * l.out); // sum, rescaled, cast back
        if l.bias {
            n += s * l.out;
        }
        if dropout {
            n += 4 * l.inp + cast(s * l.inp); // dropped input, in the model dtype
            n += s * l.out + cast(4 * l.out) + 2 * 4 * l.out; // W xd, in f32, two more sums
        }
        n
    }

    /// The weight norm reads a bf16 / f16 (or NF4-dequantized) weight in f32, one linear at a
    /// time: a transient the size of the weight in f32 (plus the dequantized copy for NF4).
    fn weight_transient_bytes(&self, elems: usize, s: usize, nf4: bool) -> usize {
        if s == 4 {
            0
        } else {
            (4 + if nf4 { s } else { 0 }) * elems
        }
    }
}

/// A (r, in) times the base weight transposed: (r, out) = A Wᵀ, in f32, through the base's
/// matmul op (frozen / quantized: no weight gradient, nothing kept).
fn base_times(lin: &Linear, a: &Tensor) -> Result<Tensor> {
    if lin.weight.dtype() == DType::F32 {
        return lin.base_matmul(a);
    }
    // bf16 / f16: the weight in f32 (one transient copy), so the cross term keeps A's precision.
    let w = lin.weight.dense()?.to_dtype(DType::F32)?.detach(); // (out, in)
    Ok(a.matmul(&w.t()?)?)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::Device;

    use super::*;
    use crate::kernels::dropout::Dropout;
    use crate::kernels::nf4::Nf4Weight;
    use crate::nn::linear::{Base, Param};
    use crate::peft::lora::lora_a_init;

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let s = b.abs().unwrap().max_all().unwrap();
        (d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()) as f64
    }

    /// A DoRA linear (out 6, in 8, r 3) with B and m away from their initial values.
    fn dora_linear(base: Base, dropout: Option<Arc<Dropout>>) -> (Linear, Dora) {
        let dev = Device::Cpu;
        let mut lin = Linear {
            weight: base,
            bias: Some(Param::Frozen(Tensor::randn(0f32, 1., 6, &dev).unwrap())),
            adapter: None,
        };
        let lora = Lora {
            a: Var::from_tensor(&lora_a_init(3, 8, 5, &dev).unwrap()).unwrap(),
            b: Var::from_tensor(&Tensor::randn(0f32, 0.5, (6, 3), &dev).unwrap()).unwrap(),
            scale: 2.0,
            dropout,
            id: 3,
        };
        let dora = Dora::new(&lin, lora).unwrap();
        let m = (dora.magnitude.as_tensor() * 1.3).unwrap();
        dora.magnitude.set(&m).unwrap();
        lin.adapter = Some(Box::new(dora.clone()));
        (lin, dora)
    }

    /// The reference: the norm of the summed weight itself, y from the formulas of PEFT's
    /// `DoraLinearLayer.forward` (no dropout: (m / n) (W x + s B A x) + b; with dropout xd:
    /// W x + b + (m / n - 1) W xd + (m / n) s B A xd).
    fn reference(lin: &Linear, d: &Dora, x: &Tensor, xd: &Tensor) -> Tensor {
        let w = lin.weight.dense().unwrap();
        let ba = (d.lora.b.matmul(d.lora.a.as_tensor()).unwrap() * d.lora.scale).unwrap();
        let full = (&w + &ba).unwrap();
        let n = full.sqr().unwrap().sum(1).unwrap().sqrt().unwrap();
        let ms = d.magnitude.as_tensor().div(&n).unwrap();
        let b = lin.bias.as_ref().unwrap().tensor();
        let base = x.matmul(&w.t().unwrap()).unwrap();
        let base_d = xd.matmul(&w.t().unwrap()).unwrap();
        let lora_d = xd.matmul(&ba.t().unwrap()).unwrap();
        let rescaled = (base_d.broadcast_mul(&(&ms - 1.0).unwrap()).unwrap()
            + lora_d.broadcast_mul(&ms).unwrap())
        .unwrap();
        ((base + rescaled).unwrap().broadcast_add(b)).unwrap()
    }

    /// Forward against PEFT's formulas with the directly computed norm (tallow expands it):
    /// 1e-5 relative in f32; gradients of m and B against the formula with the norm constant.
    /// Breaking the norm's expansion (the cross term's factor 2 dropped) fails it.
    #[test]
    fn dora_forward_and_gradients_follow_peft() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (6, 8), &dev)?;
        let x = Tensor::randn(0f32, 1., (5, 8), &dev)?;
        let (lin, d) = dora_linear(Base::Dense(Param::Frozen(w.clone())), None);
        let y = lin.forward(&x)?;
        let want = reference(&lin, &d, &x, &x);
        assert!(max_rel(&y, &want) < 1e-5, "{}", max_rel(&y, &want));
        // Gradients: dm_i = sum_rows dy_i (W x + s B A x)_i / n_i; the norm is a constant.
        let probe = Tensor::randn(0f32, 1., (5, 6), &dev)?;
        let g = (&y * &probe)?.sum_all()?.backward()?;
        let n = d.weight_norm(&lin)?;
        let ba = (d.lora.b.matmul(d.lora.a.as_tensor())? * 2.0)?;
        let z = x.matmul(&(&w + &ba)?.t()?)?; // (5, 6)
        let dm = (z * &probe)?.sum(0)?.div(&n)?;
        let got = g.get(d.magnitude.as_tensor()).expect("magnitude gradient");
        assert!(max_rel(got, &dm) < 1e-5, "dm {}", max_rel(got, &dm));
        // dB = s (dy ⊙ m / n)ᵀ (x Aᵀ)
        let ms = d.magnitude.as_tensor().div(&n)?;
        let dy = probe.broadcast_mul(&ms)?;
        let db = (dy.t()?.matmul(&x.matmul(&d.lora.a.as_tensor().t()?)?)? * 2.0)?;
        let got = g.get(d.lora.b.as_tensor()).expect("B gradient");
        assert!(max_rel(got, &db) < 1e-5, "dB {}", max_rel(got, &db));

        // With dropout: PEFT's form on the dropped input (mask from the adapter's own op).
        let drop = Arc::new(Dropout::new(0.3));
        let (lin, d) = dora_linear(Base::Dense(Param::Frozen(w)), Some(drop.clone()));
        drop.set(Some(11));
        let y = lin.forward(&x)?;
        let mask = d.lora.dropout_mask(11, &[5, 8], &dev)?.expect("dropout on");
        let want = reference(&lin, &d, &x, &(&x * mask)?);
        assert!(max_rel(&y, &want) < 1e-5, "dropout {}", max_rel(&y, &want));
        Ok(())
    }

    /// QDoRA: on an NF4 base the output equals DoRA on the dequantized weight as a dense f32
    /// base (1e-5 relative: the same weights, a different matmul path).
    #[test]
    fn dora_on_nf4_equals_dora_on_the_dequantized_weight() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (6, 64), &dev)?;
        let q = Arc::new(Nf4Weight::quantize(&w, true)?);
        let dense = q.dequantize()?;
        let x = Tensor::randn(0f32, 1., (5, 64), &dev)?;
        let mk = |base: Base| {
            let mut lin = Linear {
                weight: base,
                bias: None,
                adapter: None,
            };
            let b = (Tensor::ones((6, 2), DType::F32, &dev).unwrap() * 0.3).unwrap();
            let lora = Lora {
                a: Var::from_tensor(&lora_a_init(2, 64, 5, &dev).unwrap()).unwrap(),
                b: Var::from_tensor(&b).unwrap(),
                scale: 2.0,
                dropout: None,
                id: 0,
            };
            lin.adapter = Some(Box::new(Dora::new(&lin, lora).unwrap()));
            lin
        };
        let y4 = mk(Base::Nf4(q)).forward(&x)?;
        let yd = mk(Base::Dense(Param::Frozen(dense))).forward(&x)?;
        assert!(max_rel(&y4, &yd) < 1e-5, "{}", max_rel(&y4, &yd));
        Ok(())
    }
}
