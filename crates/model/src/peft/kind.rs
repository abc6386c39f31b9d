//! The description of an adapter kind that each kind's file gives (`super::lora`,
//! `super::dora`), and everything outside the forward pass reads.

use crate::config::layout::LinearSpec;
use crate::error::Result;
use crate::nn::linear::{Adapter, Linear};
use crate::nn::lora::Lora;

/// What one adapter kind is, beyond the forward pass its `Adapter` impl runs: everything the
/// rest of tallow asks of a kind (attaching, PEFT's flags, the memory estimate).
pub trait KindSpec: Sync {
    /// `lora.kind` in a training config ("lora", "dora").
    fn name(&self) -> &'static str;
    /// Its name in tables and model cards ("LoRA", "DoRA").
    fn label(&self) -> &'static str;
    /// PEFT's `use_dora` in adapter_config.json.
    fn use_dora(&self) -> bool;
    /// A fresh adapter on `lin` from fresh factors (B = 0: the model's output unchanged).
    fn attach(&self, lin: &Linear, lora: Lora) -> Result<Box<dyn Adapter>>;
    /// Elements of each trainable tensor of one adapted linear (out, in) at `rank`, in PEFT's
    /// order (what `lora_vars` lists).
    fn tensor_sizes(&self, out: usize, inp: usize, rank: usize) -> Vec<usize>;
    /// Bytes the adapter keeps beside its trainable tensors, per adapted linear of `out` rows.
    fn kept_bytes(&self, _out: usize) -> usize {
        0
    }
    /// Whether it only adds s · B A dropout(x) to the base output (the CPU's one-op LoRA
    /// linear may run it; `crate::nn::dispatch`).
    fn additive(&self) -> bool;
    /// Bytes per token one adapted linear `l` keeps for the backward on the tensor-op path, in
    /// a model of `s`-byte activations at rank `r` (`shared`: its f32 input is one cast shared
    /// by the linears reading the same x).
    fn activation_bytes(
        &self,
        l: &LinearSpec,
        s: usize,
        r: usize,
        dropout: bool,
        shared: bool,
    ) -> usize;
    /// A transient while the adapter reads a weight of `elems` (DoRA's norm), bytes.
    fn weight_transient_bytes(&self, _elems: usize, _s: usize, _nf4: bool) -> usize {
        0
    }
}
