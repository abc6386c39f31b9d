//! Activation checkpointing: recompute a decoder layer in the backward instead of keeping its
//! intermediates from the forward.
//!
//! ```text
//!  forward:   x ──► layer(x.detach()) without a graph ──► y    (no intermediate kept)
//!             x ─┬─► attach2 op ──────► y                      (graph keeps x only, plus y)
//!  anchor var ───┘
//!  backward:  dy ──► rebuild the layer from x: q, k, v tile by tile, the attention core with
//!                    its graph, mid = x + o_proj(core) tile by tile; then backpropagate the
//!                    MLP half, o_proj, the core and the q/k/v projections in turn, each
//!                    token-wise part tile by tile
//!                    ──► dx (to the outer graph) and the layer's parameter grads (to a side store)
//! ```
//!
//! Candle's `CustomOp::bwd` returns gradients for the op's inputs only, so the gradients of the
//! variables inside the layer (LoRA A/B, or every weight in full fine-tuning) go to a shared
//! list that the trainer drains after each backward ([`crate::CausalLM::take_checkpoint_grads`]).
//! The op's second input is one variable of the layer, so that the op is recorded even when
//! `x` itself does not track gradients (the first layer reads frozen embeddings).
//!
//! **Token tiles.** Everything in a layer but the attention core is token-wise (each output
//! row reads only its own input row): the MLP half (x + mlp(norm(x))), the norm and q/k/v
//! projections with their adapters, q/k norms and rotary embedding before the core, o_proj
//! (Gemma 2: and its norm) after it. Rebuilt whole, these parts' graphs are most of a layer's
//! memory at long context: (tokens, I) tensors in the MLP, I about 3x the hidden size, and
//! each adapter's f32 copies of its input. The checkpointed forward and the recompute run them
//! in tiles of [`Checkpointing::tile_rows`] tokens (`train.checkpoint_tile_tokens`; the
//! hidden size by default: a tile's (rows, I) tensors are the size of one MLP weight, the rule
//! of Arctic Long Sequence Training's TiledMLP), each tile's graph built, backpropagated and
//! dropped before the next; only the core keeps a whole-sequence graph (q, k, v and its
//! output). So a layer's transients are a few (tokens, C)-sized tensors plus one tile's. Each
//! tile's parameter gradients are summed into the layer's: the same sum over tokens as one
//! pass, in another order (float rounding only). The price: the q/k/v projections run three
//! times instead of two (the forward, the rebuild of q, k, v for the core, each tile's
//! graph). A layer of at most one tile is rebuilt in one piece, as before tiles.
//!
//! **Offload** ([`Checkpointing::offload`], `train.offload_checkpoints`): the input each
//! checkpointed layer keeps goes to host memory after its forward and comes back to the device
//! for its backward. The graph cannot hold a device tensor for it, so consecutive offloaded
//! layers are chained in the graph by one-element link tensors: layer i's op outputs a link
//! (its real output goes on to layer i + 1 outside the graph), layer i + 1's op takes that link
//! as its input, and its backward hands dx to layer i through a shared slot instead of as the
//! link's gradient (a zero). Candle's backward runs layer i + 1's op before layer i's (the link
//! orders them), so the slot is always filled first. On the CPU the host copy is the tensor
//! itself: the same code path, no saving. On CUDA the copies go to pinned host memory, queued on
//! the device's stream without waiting ([`crate::decoder::offload`]); they share that stream with the
//! compute, so they are not overlapped with it.
//!
//! The recomputation sees the same LoRA dropout masks as the forward: masks are a pure
//! function of the dropout seed the trainer sets per micro-batch, which is still set when that
//! micro-batch's backward runs, and of the element's position in the batch, which a tile keeps
//! through [`crate::kernels::dropout::at_row`].

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::decoder::layer::{DecoderLayer, RopeMask};
use crate::decoder::offload::HostCopy;
use crate::error::Result;

/// Checkpointing settings of a model plus the side store of parameter gradients.
pub struct Checkpointing {
    /// Checkpoint layers whose index is a multiple of this.
    pub(crate) every: usize,
    /// Tokens per tile of the MLP half; None: the hidden size.
    pub(crate) tile_rows: Option<usize>,
    /// Keep checkpointed inputs in host memory between the forward and the backward.
    pub(crate) offload: bool,
    grads: Arc<Mutex<Vec<GradStore>>>,
}

/// Where a layer's gradient w.r.t. its output goes when the graph carries a link for it.
type Slot = Arc<Mutex<Option<Tensor>>>;

/// The graph's handle on the previous layer's output when that layer was offloaded: a
/// one-element tensor and the slot its dx goes to.
#[derive(Clone)]
struct Link {
    token: Tensor,
    slot: Slot,
}

impl Checkpointing {
    pub(crate) fn new(every: usize) -> Self {
        Self {
            every,
            tile_rows: None,
            offload: false,
            grads: Arc::default(),
        }
    }

    pub(crate) fn take_grads(&self) -> Vec<GradStore> {
        std::mem::take(&mut *self.grads.lock().expect("checkpoint grads lock"))
    }

    fn checkpointed(&self, i: usize) -> bool {
        i.is_multiple_of(self.every)
    }

    /// The decoder layers over `x`, every `every`-th checkpointed. x: (B, T, C) -> (B, T, C)
    pub(crate) fn forward_layers(
        &self,
        layers: &[DecoderLayer],
        mut x: Tensor,
        rope: &RopeMask,
    ) -> Result<Tensor> {
        let mut link: Option<Link> = None;
        for (i, layer) in layers.iter().enumerate() {
            if !self.checkpointed(i) {
                debug_assert!(link.is_none(), "a link only leads to a checkpointed layer");
                x = layer.forward(&x, rope)?;
                continue;
            }
            let next_offloaded = self.offload && i + 1 < layers.len() && self.checkpointed(i + 1);
            (x, link) = self.forward_one(layer, &x, link.take(), rope, next_offloaded)?;
        }
        Ok(x)
    }

    /// One checkpointed layer: its output, and the link the next layer's op takes instead of
    /// it when `emit_link` (that layer is checkpointed and offloaded; the output is then
    /// detached). `link_in`: this layer's input is the previous offloaded layer's output.
    fn forward_one(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        link_in: Option<Link>,
        rope: &RopeMask,
        emit_link: bool,
    ) -> Result<(Tensor, Option<Link>)> {
        let tile = self.tile_rows.unwrap_or(x.dim(2)?);
        // Nothing of the layer's graph is built: the backward recomputes it.
        let y = crate::nn::no_grad::no_grad(|| forward_tiled(layer, &x.detach(), rope, tile))?;
        let anchor = first_var(layer).filter(|_| !crate::nn::no_grad::is_on());
        let device = x.device().clone();
        // x goes to the host unless the graph must hold it to hand it its gradient (the first
        // layer's input in full fine-tuning).
        let offload_x = self.offload && (link_in.is_some() || !x.track_op());
        // The op's graph input: the link of an offloaded previous layer, a placeholder for an
        // offloaded x that takes no gradient, else x itself.
        let graph_in = match &link_in {
            Some(l) => l.token.clone(),
            None if offload_x => Tensor::zeros(1, DType::F32, &device)?,
            None => x.clone(),
        };
        let Some(anchor) = anchor.or_else(|| graph_in.track_op().then(|| graph_in.clone())) else {
            return Ok((y, None)); // nothing to differentiate: no graph at all
        };
        // What the backward rebuilds the layer from: a host copy when offloading (the
        // tensor itself on the CPU), else the graph input x.
        let host = if offload_x {
            Some(HostCopy::of(x)?)
        } else {
            None
        };
        let need_dx = link_in.is_some() || x.track_op();
        let out_slot: Option<Slot> = emit_link.then(Slot::default);
        let (value, next) = match &out_slot {
            Some(_) => (Tensor::zeros(1, DType::F32, &device)?, Some(y.detach())),
            None => (y, None),
        };
        let (layer, rope, grads) = (layer.clone(), rope.clone(), self.grads.clone());
        let slot = out_slot.clone();
        let out = crate::nn::ops::attach2(
            "layer-checkpoint",
            &graph_in,
            &anchor,
            value,
            move |graph_in, _anchor, _out, dout| {
                let map = |e: crate::error::ModelError| candle_core::Error::Msg(e.to_string());
                let dy = match &slot {
                    Some(s) => s.lock().expect("checkpoint slot").take().ok_or_else(|| {
                        candle_core::Error::Msg(
                            "layer-checkpoint: the next layer's backward has not run".into(),
                        )
                    })?,
                    None => dout.clone(),
                };
                let x = match &host {
                    Some(h) => h.back().map_err(map)?,
                    None => graph_in.clone(),
                };
                let (dx, kept) =
                    recompute_backward(&layer, &rope, tile, &x, need_dx, &dy).map_err(map)?;
                grads.lock().expect("checkpoint grads lock").push(kept);
                match &link_in {
                    Some(l) => {
                        *l.slot.lock().expect("checkpoint slot") = dx;
                        Ok((Some(graph_in.zeros_like()?), None))
                    }
                    None => Ok((dx, None)),
                }
            },
        )?;
        Ok(match (next, out_slot) {
            (Some(y), Some(slot)) => (y, Some(Link { token: out, slot })),
            _ => (out, None),
        })
    }
}

/// The layer's forward with its token-wise parts in tiles of `tile` tokens: the attention
/// half's projections before and after its core, and the MLP half; only the core (and the
/// q, k, v it reads, its output) spans the whole sequence. x: (B, T, C) -> (B, T, C)
fn forward_tiled(layer: &DecoderLayer, x: &Tensor, rope: &RopeMask, tile: usize) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    if b * t <= tile {
        return layer.forward(x, rope);
    }
    let (mask, cos, sin) = layer.inputs(rope);
    let (q, k, v) = attention_in_tiled(layer, x, cos, sin, tile)?;
    let y = layer.self_attn.core(&q, &k, &v, mask)?; // (B, T, H*D)
    drop((q, k, v));
    let mid = attention_out_tiled(layer, x, &y, tile)?;
    drop(y);
    map_tiles(&mid, tile, |xt| layer.mlp_half(xt, rope.router.as_deref()))
}

/// `f` over tiles of at most `tile` rows of the flattened (B*T, N) input, each tile run as a
/// (1, rows, N) batch at its first row ([`crate::kernels::dropout::at_row`]: LoRA dropout draws
/// the untiled masks); the outputs put back together. x: (B, T, N) -> (B, T, M)
fn map_tiles(x: &Tensor, tile: usize, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let n = b * t;
    let flat = x.reshape((n, c))?; // (B*T, N), a view
    let mut parts = Vec::with_capacity(n.div_ceil(tile));
    for start in (0..n).step_by(tile) {
        let rows = tile.min(n - start);
        let xt = flat.narrow(0, start, rows)?.unsqueeze(0)?; // (1, rows, N)
        parts.push(crate::kernels::dropout::at_row(start, || f(&xt))?);
    }
    let out = Tensor::cat(&parts, 1)?; // (1, B*T, M)
    let m = out.dim(2)?;
    Ok(out.reshape((b, t, m))?)
}

/// The tiles of [`DecoderLayer::attention_in`]: (batch row, first token, tokens), each within
/// one row, since the rotary tables are per row; `tile` tokens at most.
fn row_tiles(b: usize, t: usize, tile: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..b).flat_map(move |r| (0..t).step_by(tile).map(move |s| (r, s, tile.min(t - s))))
}

/// A tile's rows of a per-row table that may be shared by every row (batch dim 1).
/// table: (B or 1, 1, T, Dr) -> (1, 1, rows, Dr)
fn table_tile(table: &Tensor, row: usize, start: usize, rows: usize) -> Result<Tensor> {
    let r = if table.dim(0)? == 1 { 0 } else { row };
    Ok(table.narrow(0, r, 1)?.narrow(2, start, rows)?)
}

/// q, k, v of every token from [`DecoderLayer::attention_in`] run tile by tile.
/// x: (B, T, C) -> q (B, H, T, D), k, v (B, KV, T, D)
fn attention_in_tiled(
    layer: &DecoderLayer,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    tile: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = x.dims3()?;
    let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
    for (row, start, rows) in row_tiles(b, t, tile) {
        let xt = x.narrow(0, row, 1)?.narrow(1, start, rows)?; // (1, rows, C)
        let (q, k, v) = attention_in_tile(layer, &xt, cos, sin, (row, start, t))?;
        qs.push(q);
        ks.push(k);
        vs.push(v);
    }
    // (1, N, rows, D) tiles -> (B, N, T, D)
    Ok((
        join_row_tiles(qs, b, 2)?,
        join_row_tiles(ks, b, 2)?,
        join_row_tiles(vs, b, 2)?,
    ))
}

/// [`DecoderLayer::attention_in`] of one tile `xt` (1, rows, C) of batch row `row` starting at
/// token `start` of rows of `t` tokens: that row's rotary tables, and the LoRA dropout masks the
/// untiled forward draws for those tokens. -> q (1, H, rows, D), k, v (1, KV, rows, D)
fn attention_in_tile(
    layer: &DecoderLayer,
    xt: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (row, start, t): (usize, usize, usize),
) -> Result<(Tensor, Tensor, Tensor)> {
    let rows = xt.dim(1)?;
    let (ct, st) = (
        table_tile(cos, row, start, rows)?,
        table_tile(sin, row, start, rows)?,
    );
    crate::kernels::dropout::at_row(row * t + start, || layer.attention_in(xt, &ct, &st))
}

/// The tiles of [`row_tiles`] (in its order, `b` rows with as many tiles each) put back
/// together: along `dim` (time) within a row, then the rows along the batch dim.
fn join_row_tiles(parts: Vec<Tensor>, b: usize, dim: usize) -> Result<Tensor> {
    let per_row = parts.len() / b;
    let rows = parts
        .chunks(per_row)
        .map(|p| Tensor::cat(p, dim))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

/// mid = x + [`DecoderLayer::attention_out`] of the core's output y, tile by tile.
/// x: (B, T, C), y: (B, T, H*D) -> (B, T, C)
fn attention_out_tiled(
    layer: &DecoderLayer,
    x: &Tensor,
    y: &Tensor,
    tile: usize,
) -> Result<Tensor> {
    let a = map_tiles(y, tile, |yt| layer.attention_out(yt))?;
    Ok((x + a)?)
}

/// The backward of a checkpointed layer: recompute it from its input `x`, backpropagate `dy`;
/// dx (when `need_dx`) and the layer's variable gradients.
fn recompute_backward(
    layer: &DecoderLayer,
    rope: &RopeMask,
    tile: usize,
    x: &Tensor,
    need_dx: bool,
    dy: &Tensor,
) -> Result<(Option<Tensor>, GradStore)> {
    let (b, t, _) = x.dims3()?;
    if b * t > tile {
        return recompute_backward_tiled(layer, rope, tile, x, need_dx, dy);
    }
    let vars = layer_vars(layer);
    let mut kept = GradStore::default();
    let x_var = if need_dx {
        Some(Var::from_tensor(&x.detach())?)
    } else {
        None
    };
    let x_in = x_var
        .as_ref()
        .map_or_else(|| x.detach(), |v| v.as_tensor().clone());
    // The attention half with its graph; the MLP half's backward gives d(mid).
    let mid = layer.attention_residual(&x_in, rope)?;
    let dmid = tiles_backward(
        &mid.detach(),
        dy,
        tile,
        |m| layer.mlp_half(m, rope.router.as_deref()),
        &vars,
        &mut kept,
    )?;
    // Backpropagate d(mid) through the attention half's graph.
    let mut store = backward_from(&mid, dmid)?;
    let dx = x_var.and_then(|v| store.remove(v.as_tensor()));
    keep_grads(&mut kept, &mut store, &vars)?;
    Ok((dx, kept))
}

/// [`recompute_backward`] of a layer longer than one tile: every token-wise part (the MLP
/// half, o_proj, the q/k/v projections) rebuilt and backpropagated tile by tile, each tile's
/// graph gone before the next; only the attention core keeps a whole-sequence graph (q, k,
/// v, its output). Alive at the high point: x, dy, q, k, v, the core's output and d(output),
/// d(mid), and one tile's graph.
fn recompute_backward_tiled(
    layer: &DecoderLayer,
    rope: &RopeMask,
    tile: usize,
    x: &Tensor,
    need_dx: bool,
    dy: &Tensor,
) -> Result<(Option<Tensor>, GradStore)> {
    let vars = layer_vars(layer);
    let mut kept = GradStore::default();
    let x = x.detach();
    let (b, t, _) = x.dims3()?;
    let (mask, cos, sin) = layer.inputs(rope);
    // 1. q, k, v without a graph, then the core with its graph from them as variables.
    let (q, k, v) = crate::nn::no_grad::no_grad(|| attention_in_tiled(layer, &x, cos, sin, tile))?;
    let (q, k, v) = (into_var(q)?, into_var(k)?, into_var(v)?);
    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
    // y: (B, T, H*D)
    let y = layer.self_attn.core(qt, kt, vt, mask)?;

    // 2. The MLP half's backward from mid = x + attention_out(y), rebuilt without a graph.
    let mid = crate::nn::no_grad::no_grad(|| attention_out_tiled(layer, &x, &y.detach(), tile))?;
    let dmid = tiles_backward(
        &mid,
        dy,
        tile,
        |m| layer.mlp_half(m, rope.router.as_deref()),
        &vars,
        &mut kept,
    )?;
    drop(mid);
    // 3. o_proj (Gemma 2: and its norm) tile by tile: d(y).
    let dy_core = tiles_backward(
        &y.detach(),
        &dmid,
        tile,
        |yt| layer.attention_out(yt),
        &vars,
        &mut kept,
    )?;
    // 4. The core's backward: dq, dk, dv.
    let mut store = backward_from(&y, dy_core)?;
    drop(y);
    let (dq, dk, dv) = (
        take_grad(&mut store, &q, "q")?,
        take_grad(&mut store, &k, "k")?,
        take_grad(&mut store, &v, "v")?,
    );
    drop((store, q, k, v));
    // 5. The projections into q, k, v tile by tile: their parameter gradients and dx; the
    // residual adds d(mid).
    let mut dxs = Vec::new();
    for (row, start, rows) in row_tiles(b, t, tile) {
        let xt = x.narrow(0, row, 1)?.narrow(1, start, rows)?; // (1, rows, C)
        let xt = need_dx
            .then(|| Var::from_tensor(&xt.contiguous()?))
            .transpose()?;
        let xin = xt.as_ref().map_or_else(
            || x.narrow(0, row, 1)?.narrow(1, start, rows),
            |v| Ok::<_, candle_core::Error>(v.as_tensor().clone()),
        )?;
        let (qt, kt, vt) = attention_in_tile(layer, &xin, cos, sin, (row, start, t))?;
        let cut =
            |g: &Tensor| -> Result<Tensor> { Ok(g.narrow(0, row, 1)?.narrow(2, start, rows)?) };
        let loss = ((qt * cut(&dq)?)?.sum_all()?
            + (kt * cut(&dk)?)?.sum_all()?
            + (vt * cut(&dv)?)?.sum_all()?)?;
        if !loss.track_op() {
            continue; // nothing of the tile trains and no dx is wanted
        }
        let mut store = loss.backward()?;
        if let Some(xt) = &xt {
            dxs.push(take_grad(&mut store, xt, "a q/k/v tile")?);
        }
        keep_grads(&mut kept, &mut store, &vars)?;
    }
    // (1, rows, C) tiles -> (B, T, C)
    let dx = if need_dx {
        Some((join_row_tiles(dxs, b, 1)? + dmid)?)
    } else {
        None
    };
    Ok((dx, kept))
}

/// d(input) of a token-wise `f` (out = f(input)) given d(out), one tile of tokens at a time
/// (each tile's graph built, backpropagated and dropped before the next); the parameter
/// gradients summed into `kept`. input: (B, T, N), dout: (B, T, M) -> (B, T, N)
fn tiles_backward(
    input: &Tensor,
    dout: &Tensor,
    tile: usize,
    f: impl Fn(&Tensor) -> Result<Tensor>,
    vars: &[Tensor],
    kept: &mut GradStore,
) -> Result<Tensor> {
    let (b, t, c) = input.dims3()?;
    let m = dout.dim(2)?;
    let n = b * t;
    let flat = input.reshape((n, c))?; // (B*T, N)
    let dflat = dout.reshape((n, m))?; // (B*T, M)
    let mut parts = Vec::with_capacity(n.div_ceil(tile));
    for start in (0..n).step_by(tile) {
        let rows = tile.min(n - start);
        let xt = Var::from_tensor(&flat.narrow(0, start, rows)?.unsqueeze(0)?)?; // (1, rows, N)
        let yt = crate::kernels::dropout::at_row(start, || f(xt.as_tensor()))?;
        let dyt = dflat.narrow(0, start, rows)?.unsqueeze(0)?;
        let mut store = backward_from(&yt, dyt)?;
        parts.push(take_grad(&mut store, &xt, "a tile")?);
        keep_grads(kept, &mut store, vars)?;
    }
    Ok(Tensor::cat(&parts, 1)?.reshape((b, t, c))?)
}

/// The gradient of `v` out of `store`, detached (Candle's gradients keep the ops that made
/// them); an error naming `what` when none reached it.
fn take_grad(store: &mut GradStore, v: &Var, what: &str) -> Result<Tensor> {
    let g = store.remove(v.as_tensor()).ok_or_else(|| {
        crate::error::ModelError::Invalid(format!("checkpoint: no gradient reached {what}"))
    })?;
    Ok(g.detach())
}

/// A variable holding `t`'s values: Candle's `Var::from_tensor` copies a tensor that is not a
/// variable, so `t` is taken and dropped here rather than kept alive beside its copy.
fn into_var(t: Tensor) -> Result<Var> {
    Ok(Var::from_tensor(&t)?)
}

/// The backward of `out`'s graph with `dout` as the gradient reaching `out`. The usual seed,
/// `sum(out * dout)`, would also hold the product and its gradient (each the size of `out`),
/// and multiply once more; this scalar op hands `dout` over as is.
fn backward_from(out: &Tensor, dout: Tensor) -> Result<GradStore> {
    let root = Tensor::zeros((), out.dtype(), out.device())?;
    let seed = crate::nn::ops::attach1("checkpoint-seed", out, root, move |_, _, _| {
        Ok(Some(dout.clone()))
    })?;
    Ok(seed.backward()?)
}

/// Moves the gradients of `vars` from `store` into `kept` (summed with what is there), and
/// drops the rest: Candle's store also holds gradients of untracked operands (masks, rotary
/// tables), which must not stay alive for the whole backward.
fn keep_grads(kept: &mut GradStore, store: &mut GradStore, vars: &[Tensor]) -> Result<()> {
    for v in vars {
        if let Some(g) = store.remove(v) {
            // Detached: Candle's weight gradients keep the ops that made them (x^T dY), and with
            // them this layer's recomputed activations, for as long as they live.
            let g = match kept.remove(v) {
                Some(sum) => (sum + g)?.detach(),
                None => g.detach(),
            };
            kept.insert(v, g);
        }
    }
    Ok(())
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
