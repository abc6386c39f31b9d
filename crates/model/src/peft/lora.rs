//! LoRA (Hu et al. 2021, arXiv:2106.09685) as PEFT's `LoraLayer`: a rank-r update added to a
//! linear layer's output, y = W x + b + s · B A dropout(x). The factors and their product are
//! [`crate::nn::lora::Lora`]; this file is the adapter kind: the trait the linear calls, a
//! fresh adapter's init, and what one costs (for the estimate).
//!
//! On the CPU (f32 / f64, and a bf16 model's f32 adapter) the whole LoRA linear runs as one op
//! (`crate::kernels::lora_linear`, chosen by `crate::nn::dispatch`); elsewhere
//! [`Adapter::forward`] adds the adapter's output from tensor ops.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::kind::KindSpec;
use crate::config::layout::LinearSpec;
use crate::error::Result;
use crate::nn::linear::{add_bias, Adapter, Linear};
use crate::nn::lora::Lora;

impl Adapter for Lora {
    fn kind(&self) -> &'static str {
        LoraKind.name()
    }

    fn lora(&self) -> &Lora {
        self
    }

    fn lora_mut(&mut self) -> &mut Lora {
        self
    }

    fn additive(&self) -> bool {
        true
    }

    fn forward(
        &self,
        _: &Linear,
        base: Tensor,
        bias: Option<&Tensor>,
        x: &Tensor,
    ) -> Result<Tensor> {
        let y = add_bias(base, bias)?;
        Ok((y.clone() + Lora::forward(self, x)?.to_dtype(y.dtype())?)?)
    }

    fn vars(&self) -> Vec<(&'static str, &Var)> {
        vec![("lora_A.weight", &self.a), ("lora_B.weight", &self.b)]
    }

    /// W + s B A.
    fn merged_weight(&self, lin: &Linear) -> Result<Tensor> {
        let w = lin.weight.dense()?; // (out, in)
        let delta = (self.b.matmul(self.a.as_tensor())? * self.scale)?; // (out, in)
        Ok((w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?)
    }

    fn clone_box(&self) -> Box<dyn Adapter> {
        Box::new(self.clone())
    }
}

/// The LoRA kind (`lora.kind = "lora"`, PEFT's default).
pub struct LoraKind;

impl KindSpec for LoraKind {
    fn name(&self) -> &'static str {
        "lora"
    }

    fn label(&self) -> &'static str {
        "LoRA"
    }

    fn use_dora(&self) -> bool {
        false
    }

    fn attach(&self, _: &Linear, lora: Lora) -> Result<Box<dyn Adapter>> {
        Ok(Box::new(lora))
    }

    /// A (r, in), B (out, r).
    fn tensor_sizes(&self, out: usize, inp: usize, rank: usize) -> Vec<usize> {
        vec![rank * inp, rank * out]
    }

    fn additive(&self) -> bool {
        true
    }

    /// Per token, on the tensor-op path: the base output (and the bias add), x cast to f32
    /// (unless `shared`: one cast for the group), the dropped-out x (the dropout op keeps no
    /// mask), x·Aᵀ and its scaled copy (r), B·(..) in f32, cast back, the sum.
    fn activation_bytes(
        &self,
        l: &LinearSpec,
        s: usize,
        r: usize,
        dropout: bool,
        shared: bool,
    ) -> usize {
        let cast = |n: usize| if s == 4 { 0 } else { n };
        let mut n = s * l.out + if l.bias { s * l.out } else { 0 };
        n += if shared { 0 } else { cast(4 * l.inp) } + if dropout { 4 * l.inp } else { 0 };
        n + 8 * r + 4 * l.out + cast(s * l.out) + s * l.out
    }
}

/// Kaiming-uniform init of a LoRA A matrix as PEFT does it (`nn.init.kaiming_uniform_(a=sqrt(5))`
/// on a (r, in) weight): U(-1/sqrt(in), 1/sqrt(in)). Seeded (one-time host work at setup).
pub fn lora_a_init(rank: usize, in_features: usize, seed: u64, device: &Device) -> Result<Tensor> {
    let bound = 1.0 / (in_features as f32).sqrt();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..rank * in_features)
        .map(|_| rng.random_range(-bound..bound))
        .collect();
    Ok(Tensor::from_vec(v, (rank, in_features), device)?)
}
