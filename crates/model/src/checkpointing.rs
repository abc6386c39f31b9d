//! Activation checkpointing: recompute a decoder layer in the backward instead of keeping its
//! intermediates from the forward.
//!
//! ```text
//!  forward:   x ──► layer(x.detach()) ──► y.detach()     (graph of the layer dropped at once)
//!             x ─┬─► attach2 op ──────► y               (graph keeps x only, plus y itself)
//!  anchor var ───┘
//!  backward:  dy ──► recompute layer(x as a fresh var), backward of sum(y * dy)
//!                    ──► dx (to the outer graph) and the layer's parameter grads (to a side store)
//! ```
//!
//! Candle's `CustomOp::bwd` returns gradients for the op's inputs only, so the gradients of the
//! variables inside the layer (LoRA A/B, or every weight in full fine-tuning) go to a shared
//! list that the trainer drains after each backward ([`crate::CausalLM::take_checkpoint_grads`]).
//! The op's second input is one variable of the layer, so that the op is recorded even when
//! `x` itself does not track gradients (the first layer reads frozen embeddings).
//!
//! The recomputation sees the same LoRA dropout masks as the forward: masks are a pure
//! function of the dropout seed the trainer sets per micro-batch, which is still set when that
//! micro-batch's backward runs.

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::error::Result;
use crate::model::{DecoderLayer, RopeMask};

/// Checkpointing settings of a model plus the side store of parameter gradients.
pub struct Checkpointing {
    /// Checkpoint layers whose index is a multiple of this.
    pub(crate) every: usize,
    grads: Arc<Mutex<Vec<GradStore>>>,
}

impl Checkpointing {
    pub(crate) fn new(every: usize) -> Self {
        Self {
            every,
            grads: Arc::default(),
        }
    }

    pub(crate) fn take_grads(&self) -> Vec<GradStore> {
        std::mem::take(&mut *self.grads.lock().expect("checkpoint grads lock"))
    }

    /// `layer.forward(x)` that keeps only `x` (and the output) alive for the backward.
    /// x: (B, T, C) -> (B, T, C)
    pub(crate) fn forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        rope: &RopeMask,
    ) -> Result<Tensor> {
        // The layer's graph lives only inside this expression.
        let y = layer.forward(&x.detach(), rope)?.contiguous()?.detach();
        let anchor = first_var(layer).filter(|_| !crate::no_grad::is_on());
        let Some(anchor) = anchor.or_else(|| x.track_op().then(|| x.clone())) else {
            return Ok(y); // nothing to differentiate: no graph at all
        };
        let (layer, rope, grads) = (layer.clone(), rope.clone(), self.grads.clone());
        crate::ops::attach2(
            "layer-checkpoint",
            x,
            &anchor,
            y,
            move |x, _anchor, _y, dy| recompute_backward(&layer, &rope, &grads, x, dy),
        )
    }
}

/// The backward of a checkpointed layer: recompute it from its input `x`, backpropagate `dy`,
/// return dx (when `x` tracks) and push the layer's variable gradients to `grads`.
fn recompute_backward(
    layer: &DecoderLayer,
    rope: &RopeMask,
    grads: &Mutex<Vec<GradStore>>,
    x: &Tensor,
    dy: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
    let map = |e: crate::error::ModelError| candle_core::Error::Msg(e.to_string());
    let x_var = if x.track_op() {
        Some(Var::from_tensor(&x.detach())?)
    } else {
        None
    };
    let x_in = x_var
        .as_ref()
        .map_or_else(|| x.detach(), |v| v.as_tensor().clone());
    // Recompute, then backpropagate dy: d/dy' of sum(y' * dy) is exactly dy.
    let y = layer.forward(&x_in, rope).map_err(map)?;
    let mut store = (y * dy.detach())?.sum_all()?.backward()?;
    let dx = x_var.and_then(|v| store.remove(v.as_tensor()));
    // Keep only the layer's variables: Candle's store also holds gradients of untracked
    // operands (masks, rotary tables), which must not stay alive for the whole backward.
    let mut kept = GradStore::default();
    for v in layer_vars(layer) {
        if let Some(g) = store.remove(&v) {
            // Detached: Candle's weight gradients keep the ops that made them (x^T dY), and with
            // them this layer's recomputed activations, for as long as they live.
            kept.insert(&v, g.detach());
        }
    }
    drop(store);
    grads.lock().expect("checkpoint grads lock").push(kept);
    Ok((dx, None))
}

/// Every variable of the layer: LoRA A/B, and in full fine-tuning every weight.
fn layer_vars(layer: &DecoderLayer) -> Vec<Tensor> {
    let mut out: Vec<Tensor> = layer
        .norms()
        .into_iter()
        .filter_map(|(_, p)| p.var().map(|v| v.as_tensor().clone()))
        .collect();
    for (_, l) in layer.linears() {
        out.extend(
            l.weight
                .param()
                .and_then(|p| p.var())
                .map(|v| v.as_tensor().clone()),
        );
        out.extend(
            l.bias
                .iter()
                .filter_map(|b| b.var().map(|v| v.as_tensor().clone())),
        );
        if let Some(a) = &l.adapter {
            out.extend(a.vars().into_iter().map(|(_, v)| v.as_tensor().clone()));
        }
    }
    out
}

/// One variable of the layer, to anchor the op in the graph.
fn first_var(layer: &DecoderLayer) -> Option<Tensor> {
    layer_vars(layer).into_iter().next()
}
