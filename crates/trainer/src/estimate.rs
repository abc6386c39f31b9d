//! Peak memory of a training job, predicted from `config.json` and the training config alone
//! (no weights read), and the plan that makes a job fit a memory budget.
//!
//! The estimate walks the same code the trainer runs and counts what each part keeps alive:
//!
//! - **weights**: frozen base per dtype, NF4 codes + block scales (double quant: 8-bit scales plus
//!   one f32 per 256 blocks), trainable parameters (LoRA factors in f32; every weight in full FT);
//! - **optimizer state**: adamw 8 bytes per trainable parameter, adamw8bit 2 (+ 8 per 256, f32
//!   moments under 4096 elements), sgd none;
//! - **gradients**: Candle's gradient store (the parameter dtype) next to the trainer's f32
//!   accumulator, both alive when a backward ends;
//! - **activations**: per decoder layer, every tensor the forward graph keeps for the backward
//!   (listed op by op in [`layer_activation_bytes`]), linear in tokens plus the attention's
//!   heads x T x T scores and probabilities; with checkpointing only each layer's input, plus one
//!   layer rebuilt at a time;
//! - **logits + loss**: the chunked LM head (at most 16M logits at a time, f32; on the CPU a
//!   bf16 matmul also makes an f32 copy of the V x C head weight first; on AMX the logits read
//!   the head as it is and dh packs it in bf16);
//! - **backward workspace**: gradients in flight at the backward's high point (the attention
//!   backward of one layer);
//! - **overhead**: tokenizer, data, rotary tables and mask; on CUDA the context and cuBLAS
//!   workspace, which the memory pool does not see.
//!
//! Per phase (the trainer measures the same phases): load, forward (weights + state + saved
//! activations + the loss's logits), backward (+ gradients + workspace), optimizer (+ f32
//! gradients + update temporaries). The peak is the largest phase, in the steady state after the
//! first step (optimizer state allocated). `benchmarks/estimate.md` compares it with measured
//! peaks; `tests/tests/estimate_cli.rs` asserts 10% on a grid of configs.
//!
//! A data-parallel run ([`estimate_per_rank`]) is estimated per rank: one process's numbers,
//! plus the gradient all-reduce's buckets in the optimizer phase and, with
//! `train.shard_optimizer`, the optimizer state of the tensors the rank owns.

use candle_core::DType;
use serde::Serialize;
use tallow_model::config::Activation;
use tallow_model::kernels::dispatch::{Backend, Paths};
use tallow_model::DecoderConfig;

use crate::config::{Attention, ModelDtype, Quantize, TrainConfig};
use crate::optim::OptimizerKind;

/// NF4 block size, and double quantization's groups of 8-bit block scales with one f32 each.
use tallow_model::kernels::nf4::{BLOCK as NF4_BLOCK, NESTED_BLOCK as NF4_NESTED_BLOCK};
/// Elements of one logits chunk of the LM head.
use tallow_model::nn::loss::CHUNK_ELEMS as LOSS_CHUNK_ELEMS;
/// adamw8bit: block size and smallest 8-bit tensor (see `optim::adamw8bit`).
const ADAM8_BLOCK: usize = crate::optim::adamw8bit::BLOCK;
const ADAM8_MIN: usize = crate::optim::adamw8bit::MIN_8BIT_ELEMS;
/// What a CUDA process holds outside the memory pool: context, kernels, cuBLAS workspace.
const CUDA_CONTEXT_BYTES: u64 = 600 << 20;

/// One line of the breakdown.
#[derive(Debug, Clone, Serialize)]
pub struct Component {
    pub name: &'static str,
    pub bytes: u64,
    /// How the number was made, for the table.
    pub detail: String,
}

/// Predicted peak bytes of each phase of a step.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct PhaseBytes {
    pub load: u64,
    pub forward: u64,
    pub backward: u64,
    pub optimizer: u64,
}

/// The prediction for one config.
#[derive(Debug, Clone, Serialize)]
pub struct Estimate {
    /// The largest phase.
    pub total_bytes: u64,
    pub peak_phase: &'static str,
    /// The breakdown of the peak phase; sums to `total_bytes`.
    pub components: Vec<Component>,
    pub phases: PhaseBytes,
    pub trainable_params: u64,
    /// Tokens in one forward: micro_batch_size x max_seq_len (rows assumed full).
    pub tokens_per_micro_batch: usize,
    /// Bytes one decoder layer keeps for the backward for one micro-batch, without checkpointing.
    pub activation_bytes_per_layer: u64,
    /// "cpu" or "cuda": what the numbers are comparable with.
    pub device: &'static str,
    /// Part of the total that the measured peaks do not see (the CUDA context is outside the
    /// memory pool); 0 on the CPU.
    pub outside_pool_bytes: u64,
    /// Host memory outside the total: the offloaded checkpoint inputs (`train.offload_checkpoints`
    /// on CUDA), pinned; 0 otherwise.
    pub host_bytes: u64,
    /// With more than one rank: whose numbers these are, and what the ranks add
    /// ([`estimate_per_rank`]). Absent for one process.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Ranks>,
}

/// A data-parallel job's side of a per-rank estimate.
#[derive(Debug, Clone, Serialize)]
pub struct Ranks {
    /// Ranks of the job (`tallow train --nproc N`).
    pub world: usize,
    /// `train.shard_optimizer`: each rank keeps the optimizer state of the tensors
    /// `tallow_data_parallel::owners` gives it.
    pub shard_optimizer: bool,
    /// The rank whose optimizer share the estimate counts (the largest peak, the lowest rank on
    /// a tie); 0 without sharding.
    pub rank: usize,
    /// Trainable tensors and parameters whose optimizer state that rank keeps (every one
    /// without sharding).
    pub owned_tensors: usize,
    pub owned_params: u64,
    /// That rank's optimizer state.
    pub state_bytes: u64,
    /// The optimizer state of every trainable tensor: one rank's without sharding.
    pub unsharded_state_bytes: u64,
    /// The gradient all-reduce's buckets at most (`tallow_data_parallel::transient_bytes`), in the
    /// optimizer phase.
    pub all_reduce_bytes: u64,
}

/// What varies between phases, computed once.
#[derive(Clone)]
struct Parts {
    trainable_params: u64,
    /// One decoder layer's saved activations for the micro-batch, without checkpointing.
    per_layer: u64,
    frozen: (u64, String),
    trainable: (u64, String),
    state: (u64, String),
    grads_backward: u64,
    grads_optimizer: u64,
    accumulator_live: u64,
    activations: (u64, String),
    loss_forward: u64,
    workspace_forward: u64,
    workspace_backward: u64,
    /// The part of `workspace_backward` that is the LM head's logits (when they are the larger).
    logits_backward: u64,
    workspace_optimizer: u64,
    load_transient: u64,
    overhead: (u64, String),
}

fn dtype_bytes(d: ModelDtype) -> usize {
    match d {
        ModelDtype::F32 => 4,
        ModelDtype::Bf16 | ModelDtype::F16 => 2,
    }
}

/// A decoder linear layer's shape (from the model crate's one description of the layers,
/// `DecoderConfig::layer_linears`).
type Lin = tallow_model::LinearSpec;
use tallow_model::config::layout::LoraPlan;

/// NF4 bytes of an (out, in) weight: 4-bit codes, plus per block of 64 an f32 absmax, or with
/// double quantization an 8-bit absmax and one f32 per 256 blocks (+ the f32 offset).
pub fn nf4_bytes(n: usize, double_quant: bool) -> u64 {
    let blocks = n.div_ceil(NF4_BLOCK);
    let scales = if double_quant {
        blocks + 4 * blocks.div_ceil(NF4_NESTED_BLOCK) + 4
    } else {
        4 * blocks
    };
    (n.div_ceil(2) + scales) as u64
}

/// Optimizer state bytes of a parameter of `n` elements.
fn state_bytes(kind: OptimizerKind, n: usize) -> u64 {
    match kind {
        OptimizerKind::AdamW => 8 * n as u64,
        OptimizerKind::AdamW8bit if n >= ADAM8_MIN => (2 * n + 8 * n.div_ceil(ADAM8_BLOCK)) as u64,
        OptimizerKind::AdamW8bit => 8 * n as u64,
        OptimizerKind::Sgd => 0,
    }
}

/// The dispatch rule's backend for the estimate's device.
fn backend(cpu: bool) -> Backend {
    if cpu {
        Backend::Cpu
    } else {
        Backend::Cuda
    }
}

/// The config's compute dtype.
fn dtype(cfg: &TrainConfig) -> DType {
    match cfg.model.dtype {
        ModelDtype::F32 => DType::F32,
        ModelDtype::Bf16 => DType::BF16,
        ModelDtype::F16 => DType::F16,
    }
}

/// Chunked attention takes CUDA's kernels (`tallow_model::kernels::flash_attn`): the dispatch
/// rule's answer for the config's device, dtype and head dim.
fn flash_attention(m: &DecoderConfig, cfg: &TrainConfig, cpu: bool) -> bool {
    cfg.model.attention == Attention::Chunked
        && tallow_model::kernels::dispatch::flash_attention(backend(cpu), dtype(cfg), m.head_dim)
}

/// The paths the model crate's dispatch rule gives a config's step
/// (`tallow_model::kernels::dispatch`): one-op CPU kernels keep one output where the tensor-op
/// path keeps several.
fn paths(m: &DecoderConfig, cfg: &TrainConfig, cpu: bool) -> Paths {
    // adapters are f32 whatever the base dtype (PEFT's `autocast_adapter_dtype`)
    Paths::of(
        backend(cpu),
        dtype(cfg),
        DType::F32,
        m.variant.attn_logit_softcapping.is_some(),
    )
}

/// Bytes one decoder layer keeps alive for the backward, per micro-batch of `b` rows of `t`
/// tokens, op by op as `tallow_model::decoder` runs them (s = model dtype bytes; LoRA runs in f32).
/// `cpu`: the CPU's one-op paths where the dtype has them ([`paths`]), which keep one output
/// per linear, norm, rotary and SwiGLU and no adapter intermediates.
pub fn layer_activation_bytes(
    m: &DecoderConfig,
    cfg: &TrainConfig,
    b: usize,
    t: usize,
    cpu: bool,
) -> u64 {
    let halves = layer_halves(m, cfg, cpu);
    halves.attention_bytes(b, t) + (b * t * halves.mlp_per_token) as u64
}

/// A decoder layer's graph in its two residual halves (`DecoderLayer::attention_half` and
/// `mlp_half`), which activation checkpointing rebuilds separately (the MLP half in token
/// tiles).
struct LayerHalves {
    /// Bytes per token of x + attn(norm(x)).
    attention_per_token: usize,
    /// Bytes per score (B x H x T x T) eager attention keeps; 0 for chunked.
    per_score: usize,
    heads: usize,
    /// Bytes per token of x + mlp(norm(x)).
    mlp_per_token: usize,
}

impl LayerHalves {
    /// The attention half's graph for (b, t) tokens.
    fn attention_bytes(&self, b: usize, t: usize) -> u64 {
        (b * t * self.attention_per_token + b * self.heads * t * t * self.per_score) as u64
    }
}

fn layer_halves(m: &DecoderConfig, cfg: &TrainConfig, cpu: bool) -> LayerHalves {
    let ops = paths(m, cfg, cpu);
    let s = dtype_bytes(cfg.model.dtype);
    let cast = |n: usize| if s == 4 { 0 } else { n }; // to_dtype is free when it is a no-op
    let (c, d) = (m.hidden_size, m.head_dim);
    let (h, kv) = (m.num_attention_heads, m.num_key_value_heads);
    let (q, kvd) = (h * d, kv * d);
    let lora = !cfg.trains_full();
    let plan = lora_plan(m, cfg);
    let r = cfg.lora.rank;
    let dropout = lora && cfg.lora.dropout > 0.0;
    // One linear: its output (base matmul, + bias), and with LoRA: x cast to f32 (unless
    // `shared`: one cast for the group, counted by `group_cast`), the dropped-out x (the
    // dropout op keeps no mask), x·Aᵀ and its scaled copy (r), B·(..) in f32, cast back, sum.
    // A routed expert's linear (`routed`) is adapted by `lora.target_parameters` when set.
    let adapted = |l: &Lin, routed: bool| {
        lora && match routed {
            true => plan.wraps(&format!("mlp.experts.0.{}", l.path)),
            false => plan.wraps(l.path),
        }
    };
    let kind = cfg.lora.kind.spec();
    let one_op = |l: &Lin, routed: bool| ops.lora_one_op && kind.additive() && adapted(l, routed);
    let linear_in = |l: &Lin, shared: bool, routed: bool| -> usize {
        if one_op(l, routed) {
            return s * l.out; // one op; its input is the previous output, A and B are params
        }
        if adapted(l, routed) {
            return kind.activation_bytes(l, s, r, dropout, shared);
        }
        s * l.out + if l.bias { s * l.out } else { 0 }
    };
    let linear = |l: &Lin, shared: bool| linear_in(l, shared, false);
    // Linears reading one input (q/k/v, gate/up) share its f32 cast when >= 2 adapted ones
    // take the unfused path (the one-op linear casts inside).
    let group_in = |ls: &[&Lin], routed: bool| -> usize {
        let shared = ls
            .iter()
            .filter(|l| adapted(l, routed) && !one_op(l, routed))
            .count()
            >= 2;
        let cast_once = if shared { cast(4 * ls[0].inp) } else { 0 };
        cast_once
            + ls.iter()
                .map(|l| linear_in(l, shared, routed))
                .sum::<usize>()
    };
    let group = |ls: &[&Lin]| group_in(ls, false);
    let ls = m.layer_linears();
    // (q, k, v), o, (gate, up), down: Phi-3's fused linears are one-element groups.
    let (lqkv, lo, lgu, ld) = if m.fused_projections {
        (vec![&ls[0]], &ls[1], vec![&ls[2]], &ls[3])
    } else {
        (
            vec![&ls[0], &ls[1], &ls[2]],
            &ls[3],
            vec![&ls[4], &ls[5]],
            &ls[6],
        )
    };
    let mut attn = 0;
    attn += s * c; // input_layernorm output
    attn += group(&lqkv);
    if m.fused_projections {
        // q, k, v copied out of the fused output (a reshape of a narrow), each kept by the op
        // that reads it
        attn += s * (q + 2 * kvd);
    }
    if m.rotary_dim != d {
        // partial rotary: the rotated dims of q and k copied out, and q's scaled pass-through
        attn += s * (h + kv) * m.rotary_dim + s * h * (d - m.rotary_dim);
    }
    if m.qk_norm {
        attn += s * (q + kvd); // q_norm, k_norm outputs (Qwen3's, Gemma 3's (1 + w) ones)
    }
    // CUDA's attention kernels read v where its projection wrote it and write y as o_proj
    // reads it (`tallow_model::kernels::flash_attn`): no transposed copies of either
    let flash = flash_attention(m, cfg, cpu);
    attn += s * (q + kvd); // transposed q, k (fused: the rotary op's outputs)
    if !flash {
        attn += s * kvd; // transposed v
    }
    if !ops.fused_with_bf16 {
        attn += s * (q + kvd); // rotary embedding of q (scaled by 1/sqrt(D)), k
    }
    // (grouped-query heads share their kv head in the matmuls: no repeat_kv copies)
    attn += s * q; // probs · v
    if !flash {
        attn += s * q; // transpose back, contiguous
    }
    attn += linear(lo, false);
    let sandwich = m.variant.sandwich_norms;
    if sandwich {
        attn += s * c; // Gemma 2: post_attention_layernorm of the attention output
    }
    attn += s * c; // residual add
    let mut mlp = 0;
    mlp += s * c; // post_attention_layernorm (Gemma 2: pre_feedforward_layernorm) output
    if m.fused_projections {
        mlp += 2 * s * m.intermediate_size; // gate, up copied out of gate_up_proj's output
    }
    // The gated activation's outputs per token, for an MLP `width` wide.
    let act = |width: usize| match m.variant.act {
        // silu and silu(gate) * up (fused: one SwiGLU output)
        Activation::Silu => (if ops.fused_with_bf16 { 1 } else { 2 }) * s * width,
        // Gemma's GeGLU: one op on every device (`ops::geglu`), its output only
        Activation::GeluTanh => s * width,
    };
    mlp += group(&lgu);
    mlp += act(m.intermediate_size);
    mlp += linear(ld, false);
    if sandwich {
        mlp += s * c; // post_feedforward_layernorm output
    }
    mlp += s * c; // residual add
    if let Some(moe) = &m.moe {
        // A sparse layer's half (`tallow_model::decoder::moe`), per token: the norm, the router
        // (its logits, their f32 copy, softmax's exp and probabilities), the K gathered rows of
        // x, each chosen expert's gate / up / act / down on its row (K of them), the outputs
        // concatenated and weighted, the index_add's sum and the residual add. A model with
        // dense layers too (`mlp_only_layers`) is counted at the larger of the two per layer.
        let (k, e) = (moe.top_k, moe.num_experts);
        let spec = |path, out, inp| Lin {
            path,
            out,
            inp,
            bias: false,
        };
        // One gated MLP `width` wide on a token: gate and up (one group), act, down; a routed
        // expert's (`routed`) or the shared expert's.
        let gated = |width: usize, routed: bool| {
            let [g, u, d] = moe.names.linears(width, c).map(|(n, o, i)| spec(n, o, i));
            group_in(&[&g, &u], routed) + act(width) + linear_in(&d, false, routed)
        };
        let mut sparse = s * c; // post_attention_layernorm output
        sparse += linear(&spec("gate", e, c), false) + cast(4 * e) + 2 * 4 * e; // router
        sparse += 3 * 4 * k; // chosen probabilities, renormalized, cast
        sparse += k * (s * c + gated(moe.expert_size, true) + 2 * s * c);
        sparse += 2 * s * c; // index_add's sum, residual add
        if let Some(size) = moe.shared_expert_size {
            // Qwen2-MoE's shared expert on every token, the sigmoid of its gate (4 element-wise
            // steps of one value), the product and the sum
            sparse += gated(size, false);
            sparse += linear(&spec("shared_expert_gate", 1, c), false) + 4 * s + 2 * s * c;
        }
        mlp = match (0..m.num_hidden_layers).all(|l| m.is_sparse(l)) {
            true => sparse,
            false => mlp.max(sparse),
        };
    }
    let per_score = if cfg.model.attention == Attention::Chunked {
        // Chunked attention (`tallow_model::kernels::chunked`) keeps its output (counted above as
        // probs · v) and one f32 log-sum-exp per head and token: nothing T x T.
        attn += 4 * h;
        0
    } else {
        // Eager attention scores (B, H, T, T): q·kᵀ (q carries the 1/sqrt(D) scale), softmax
        // probabilities in f32, cast back (fused: the causal attention op keeps only the f32
        // probabilities). Gemma 2's soft-capped scores take the tensor-op path on every device
        // (`ops::causal_attention_capped`): the scores, their capped copy, the f32
        // probabilities and their cast.
        match (m.variant.attn_logit_softcapping, ops.fused) {
            (Some(_), _) => 2 * s + 4 + cast(s),
            (None, true) => 4,
            (None, false) => s + 4 + cast(s),
        }
    };
    LayerHalves {
        attention_per_token: attn,
        per_score,
        heads: h,
        mlp_per_token: mlp,
    }
}

/// The one-op LoRA linear's buffers on CUDA (`tallow_model::kernels::lora_linear`), for
/// `tokens` rows, forward and backward: the largest over the adapted linears (input K, output
/// N; `s` bytes an element of the model dtype), beside dx in the backward (every row's). A bf16
/// model takes tallow's kernels (`lora_linear::bf16_kernels`), which read the bf16 rows
/// themselves and apply dropout's mask as they read: nothing more. An f32 model takes cuBLAS,
/// whose dropout needs x's dropped-out copy (forward), then x's again and dx's adapter share
/// apart with its masked copy (backward): f32 buffers per chunk of rows
/// (`lora_linear::chunk_rows`). Zero on the CPU, whose twin's buffers are in the measured
/// per-element figures, and where the linear is not one op. r-sized buffers (x Aᵀ, dY B) are
/// left out.
fn one_op_transients(m: &DecoderConfig, cfg: &TrainConfig, cpu: bool, tokens: u64) -> (u64, u64) {
    let ops = paths(m, cfg, cpu);
    let kind = cfg.lora.kind.spec();
    if cpu || !ops.lora_one_op || cfg.trains_full() || !kind.additive() {
        return (0, 0);
    }
    let s = dtype_bytes(cfg.model.dtype) as u64;
    let drop = (cfg.lora.dropout > 0.0) as u64;
    let kernels = tallow_model::kernels::lora_linear::bf16_kernels(s == 2);
    let plan = lora_plan(m, cfg);
    let (mut fwd, mut bwd) = (0, 0);
    for l in m.layer_linears().iter().filter(|l| plan.wraps(l.path)) {
        let k = l.inp as u64;
        let dx = tokens * s * k;
        if kernels {
            bwd = bwd.max(dx);
            continue;
        }
        let rows = tokens.min(tallow_model::kernels::lora_linear::chunk_rows(l.inp, l.out) as u64);
        fwd = fwd.max(rows * 4 * k * drop);
        bwd = bwd.max(dx + rows * 8 * k * drop); // dx, every row, and one chunk's buffers
    }
    (fwd, bwd)
}

/// One layer's attention transients beyond what the graph keeps, forward and backward.
/// Eager: the backward's score-sized gradients, f32 (the forward's scores are kept, counted in
/// [`layer_activation_bytes`]); the CPU's fused op needs none of them. Chunked
/// (`tallow_model::kernels::chunked`): on the CPU each (batch, kv head) task holds two 64-row blocks of
/// scores; on CUDA a block's f32 scores are at most `BLOCK_SCORE_BYTES`; its block kernels
/// (f32, bf16) keep 2 score-sized tensors in the model dtype forward and 4 backward, plus f32
/// dK / dV sums; f16 and f64, on tensor ops, about 3 f32 ones in the forward (scores, exp,
/// probabilities) and 4 in the backward plus P and dS cast to the model dtype. bf16 and f16
/// on CUDA take tallow's attention kernels, which keep none.
fn attention_transients(m: &DecoderConfig, cfg: &TrainConfig, cpu: bool) -> (u64, u64) {
    let ops = paths(m, cfg, cpu);
    let (b, t) = (rows_per_micro_batch(cfg), cfg.data.max_seq_len);
    let (h, kv, d) = (m.num_attention_heads, m.num_key_value_heads, m.head_dim);
    let scores = (b * h * t * t * 4) as u64;
    // Gemma 2's soft-cap: the cap's derivative (1 - tanh²), one more score-sized buffer per
    // block on the chunked paths, and in the eager backward.
    let capped = m.variant.attn_logit_softcapping.is_some();
    let fused = match cfg.model.attention {
        Attention::Eager => ops.fused && !capped,
        Attention::Chunked => ops.chunked_kernel,
    };
    match (cfg.model.attention, fused) {
        // The fused CPU op's backward reads its kept probabilities and holds one 64-row dS
        // block per task (measured at 1-4k tokens: the kept probabilities are the whole
        // difference from chunked attention).
        (Attention::Eager, true) => return (0, (64 * t * 4 * b * kv) as u64),
        (Attention::Eager, false) => return (0, (3 + capped as u64) * scores),
        (Attention::Chunked, true) => {
            let block = (tallow_model::kernels::chunked::CPU_BLOCK * t * 4) as u64;
            let tasks = (b * kv) as u64;
            // bf16: q, k, v (and y, dY) widened to f32, and the f32 outputs before rounding
            let (q, kvd) = ((b * t * h * d) as u64, (b * t * kv * d) as u64);
            let (wide_fwd, wide_bwd) = if dtype_bytes(cfg.model.dtype) == 2 {
                (4 * (2 * q + 2 * kvd), 4 * (4 * q + 4 * kvd))
            } else {
                (0, 0)
            };
            return (
                2 * block * tasks + wide_fwd,
                (2 + capped as u64) * block * tasks + wide_bwd,
            );
        }
        (Attention::Chunked, false) => {}
    }
    if flash_attention(m, cfg, cpu) {
        // CUDA's kernels (`tallow_model::kernels::flash_attn`): the tiles live in shared
        // memory; nothing beyond the outputs and their gradients, which the graph counts.
        return (0, 0);
    }
    let rows = tallow_model::kernels::chunked::block_rows(b, h, t);
    let block = (b * h * rows * t * 4) as u64;
    let s = dtype_bytes(cfg.model.dtype) as u64;
    let sums = (2 * b * t * kv * d * 4) as u64; // dK, dV summed in f32
    if !cpu && matches!(cfg.model.dtype, ModelDtype::F32 | ModelDtype::Bf16) {
        // CUDA's block kernels (`tallow_model::kernels::attn_block`): no f32 copy of a block's
        // scores, mask or exponentials; the forward holds the scores and P in the model dtype,
        // the backward the recomputed scores, P, dP and dS (the cap's derivative inside).
        let scores = block / 4 * s;
        return (2 * scores, 4 * scores + sums);
    }
    let extra = capped as u64 * block;
    // The backward's block at its peak (traced with `TALLOW_TRACE_PEAK` on the CUDA path,
    // 2026-11-27): the recomputed scores, P, dP and dS in f32, and P and dS cast to the model
    // dtype for the matmuls (no copy in f32). f16 and f64 on CUDA. Before the blocks, D =
    // rowsum(dY Y) from dY and Y in f32 (f64) and their product, each the size of the output.
    let casts = if s == 4 { 0 } else { 2 * block * s / 4 };
    let out = (b * t * h * d) as u64;
    let rowsum = if s == 8 { 8 * out } else { 12 * out };
    (
        3 * block + extra,
        (4 * block + casts + extra + sums).max(rowsum),
    )
}

fn mib(b: u64) -> String {
    crate::memory::human_bytes(b)
}

/// Predicts the peak memory of `cfg` on `device` ("cpu" or "cuda") for the model described by
/// `model` (its config.json).
pub fn estimate(model: &DecoderConfig, cfg: &TrainConfig, device: &'static str) -> Estimate {
    estimate_per_rank(model, cfg, device, 1)
}

/// The peak of each phase for `parts`; the optimizer phase's high point is the gradients'
/// all-reduce (`all_reduce` bytes of buckets) or the update after it, whichever holds more.
fn phase_bytes(parts: &Parts, all_reduce: u64) -> PhaseBytes {
    let common = parts.frozen.0 + parts.trainable.0 + parts.overhead.0;
    PhaseBytes {
        load: common + parts.load_transient,
        forward: common
            + parts.state.0
            + parts.accumulator_live
            + parts.activations.0
            + parts.loss_forward.max(parts.workspace_forward),
        backward: common
            + parts.state.0
            + parts.grads_backward
            + parts.activations.0
            + parts.workspace_backward,
        optimizer: common
            + parts.state.0
            + parts.grads_optimizer
            + parts.workspace_optimizer.max(all_reduce),
    }
}

fn peak(p: &PhaseBytes) -> (&'static str, u64) {
    let all = [
        ("load", p.load),
        ("forward", p.forward),
        ("backward", p.backward),
        ("optimizer", p.optimizer),
    ];
    all.into_iter()
        .fold(("load", 0), |a, p| if p.1 > a.1 { p } else { a })
}

/// One rank of a data-parallel job of `world` ranks (`tallow train --nproc N`): every rank holds
/// the whole model, the full trainable set and its gradients, and runs `micro_batch_size` rows
/// per micro-batch (the global batch is `world` times that), so weights, activations and
/// gradients are one process's. After the backward the gradients are summed over the ranks by
/// `tallow_data_parallel::Dist::all_reduce_sum`, whose buckets add `tallow_data_parallel::transient_bytes` in the
/// optimizer phase (freed before the update; with `train.shard_optimizer` the updated weights
/// go round in another all-reduce of the same buckets, after the update). With
/// `train.shard_optimizer` (ZeRO stage 1) a rank keeps the optimizer state of, and updates,
/// only the tensors `tallow_data_parallel::owners` gives it: the estimate is the rank whose peak is the
/// largest. `world = 1` is [`estimate`].
pub fn estimate_per_rank(
    model: &DecoderConfig,
    cfg: &TrainConfig,
    device: &'static str,
    world: usize,
) -> Estimate {
    let mut parts = parts(model, cfg, device);
    let mut ranks = None;
    let mut all_reduce = 0;
    if world > 1 {
        let sizes = trainable_tensor_sizes(model, cfg);
        all_reduce = tallow_data_parallel::transient_bytes(&sizes) as u64;
        let mut r = Ranks {
            world,
            shard_optimizer: cfg.train.shard_optimizer,
            rank: 0,
            owned_tensors: sizes.len(),
            owned_params: sizes.iter().sum::<usize>() as u64,
            state_bytes: parts.state.0,
            unsharded_state_bytes: parts.state.0,
            all_reduce_bytes: all_reduce,
        };
        if cfg.train.shard_optimizer {
            // trainable parameters' dtype: LoRA f32, full fine-tuning the model dtype
            let var_bytes = if cfg.trains_full() {
                dtype_bytes(cfg.model.dtype) as u64
            } else {
                4
            };
            let owner = tallow_data_parallel::owners(&sizes, world);
            // Each rank's state and update temporaries over the tensors it owns (in the
            // trainable order, as its optimizer gets them); the estimate is the largest peak.
            let mut worst: Option<(u64, usize, Vec<usize>)> = None;
            for rank in 0..world {
                let mine: Vec<usize> = (0..sizes.len())
                    .filter(|&i| owner[i] == rank)
                    .map(|i| sizes[i])
                    .collect();
                let mut p = parts.clone();
                (p.state.0, p.workspace_optimizer) =
                    optimizer_bytes(cfg.train.optimizer, &mine, device, var_bytes);
                let total = peak(&phase_bytes(&p, all_reduce)).1;
                if worst.as_ref().is_none_or(|w| total > w.0) {
                    worst = Some((total, rank, mine));
                }
            }
            let (_, rank, mine) = worst.expect("world > 1");
            (parts.state.0, parts.workspace_optimizer) =
                optimizer_bytes(cfg.train.optimizer, &mine, device, var_bytes);
            parts.state.1 += &format!(
                "; rank {rank}'s share (train.shard_optimizer, the largest of {world}): {} of \
                 {} tensors, {} of {} parameters",
                mine.len(),
                sizes.len(),
                mine.iter().sum::<usize>(),
                r.owned_params
            );
            r.rank = rank;
            r.state_bytes = parts.state.0;
            r.owned_tensors = mine.len();
            r.owned_params = mine.iter().sum::<usize>() as u64;
        } else {
            parts.state.1 += &format!("; every rank keeps all of it ({world} ranks)");
        }
        ranks = Some(r);
    }
    let phases = phase_bytes(&parts, all_reduce);
    let (peak_phase, total_bytes) = peak(&phases);
    let c = |name, bytes, detail: String| Component {
        name,
        bytes,
        detail,
    };
    let mut components = vec![
        c("frozen_weights", parts.frozen.0, parts.frozen.1.clone()),
        c(
            "trainable_params",
            parts.trainable.0,
            parts.trainable.1.clone(),
        ),
    ];
    let text = |d: &str| d.to_string();
    match peak_phase {
        "load" => {
            components.push(c(
                "workspace",
                parts.load_transient,
                text("load: one tensor converted at a time"),
            ));
        }
        _ => {
            let (grads, act, logits, ws, why) = match peak_phase {
                "forward" => (
                    parts.accumulator_live,
                    parts.activations.0,
                    parts.loss_forward,
                    parts.workspace_forward.saturating_sub(parts.loss_forward),
                    "one checkpointed layer rebuilt in the forward",
                ),
                "backward" => (
                    parts.grads_backward,
                    parts.activations.0,
                    parts.logits_backward,
                    parts.workspace_backward - parts.logits_backward,
                    if parts.logits_backward > 0 {
                        "the LM head's backward: dh for every row"
                    } else {
                        "gradients in flight in one layer's backward"
                    },
                ),
                // (with ranks, the all-reduce before the update may be the phase's high point)
                _ if all_reduce > parts.workspace_optimizer => (
                    parts.grads_optimizer,
                    0,
                    0,
                    0,
                    "f32 temporaries of the update: fewer bytes than the all-reduce's buckets, \
                     freed before it",
                ),
                _ => (
                    parts.grads_optimizer,
                    0,
                    0,
                    parts.workspace_optimizer,
                    "f32 temporaries of the update of the largest group of tensors",
                ),
            };
            let at = match peak_phase {
                "backward" if parts.logits_backward > 0 => "backward-head",
                p => p,
            };
            components.push(c("gradients", grads, grad_detail(cfg, at)));
            components.push(c("optimizer_state", parts.state.0, parts.state.1.clone()));
            components.push(c("activations", act, parts.activations.1.clone()));
            components.push(c(
                "logits_loss",
                logits,
                text("LM head logits (and their gradient in the backward), a chunk of at most 16M in f32"),
            ));
            components.push(c("workspace", ws, why.into()));
        }
    }
    if world > 1 {
        let at_peak = peak_phase == "optimizer" && all_reduce > parts.workspace_optimizer;
        let what = format!(
            "gradients summed over {world} ranks: two f32 buckets of up to 25 MiB (a larger \
             tensor is a bucket of its own), {} in the optimizer phase{}",
            mib(all_reduce),
            match (peak_phase, at_peak) {
                (_, true) => "",
                ("optimizer", false) => ", fewer bytes than the update's temporaries after it",
                _ => ", not the peak phase",
            }
        );
        components.push(c("all_reduce", if at_peak { all_reduce } else { 0 }, what));
    }
    components.push(c("overhead", parts.overhead.0, parts.overhead.1.clone()));
    let b = rows_per_micro_batch(cfg);
    let t = cfg.data.max_seq_len;
    Estimate {
        total_bytes,
        peak_phase,
        components,
        phases,
        trainable_params: parts.trainable_params,
        tokens_per_micro_batch: b * t,
        activation_bytes_per_layer: parts.per_layer,
        device,
        outside_pool_bytes: if device == "cuda" {
            CUDA_CONTEXT_BYTES
        } else {
            0
        },
        host_bytes: host_bytes(model, cfg, device),
        ranks,
    }
}

fn grad_detail(cfg: &TrainConfig, phase: &str) -> String {
    let acc = if cfg.train.grad_accum > 1 {
        format!("f32 sums over {} micro-batches", cfg.train.grad_accum)
    } else {
        "f32 sums (f32 gradients are their own sums: no copy)".into()
    };
    match phase {
        "forward" if cfg.train.grad_accum > 1 => acc,
        "forward" => "none yet".into(),
        "backward" => format!("this backward's gradients + {acc}"),
        // the LM head's backward runs before any layer's
        "backward-head" => {
            let head = if cfg.trains_full() {
                "the LM head's weight gradient"
            } else {
                "none yet"
            };
            match cfg.train.grad_accum {
                1 => head.into(),
                _ => format!("{head} + {acc}"),
            }
        }
        _ => acc,
    }
}

/// The linears `lora.targets` and `lora.target_parameters` wrap on this model
/// (`DecoderConfig::lora_plan`: on Phi-3 the seven Llama names are its four fused ones);
/// names the model lacks (refused when training starts) wrap nothing.
fn lora_plan(m: &DecoderConfig, cfg: &TrainConfig) -> LoraPlan {
    let names = cfg.lora.targets();
    let params = &cfg.lora.target_parameters;
    m.lora_plan(&names, params).unwrap_or_else(|_| LoraPlan {
        modules: m
            .lora_modules()
            .into_iter()
            .filter(|x| names.contains(x))
            .collect(),
        experts: None,
    })
}

/// Sequences in one forward: `micro_batch_size`, twice that for the preference methods (a
/// pair's chosen and rejected sequences run in one batch, as TRL's concatenated forward).
pub fn rows_per_micro_batch(cfg: &TrainConfig) -> usize {
    let pairs = if cfg.train.method.preference() { 2 } else { 1 };
    cfg.train.micro_batch_size * pairs
}

/// Trainable parameters: LoRA factors, or every weight.
pub fn trainable_params(m: &DecoderConfig, cfg: &TrainConfig) -> u64 {
    trainable_tensor_sizes(m, cfg)
        .iter()
        .map(|&n| n as u64)
        .sum()
}

/// Every trainable tensor's element count, in the trainer's trainable order (what the
/// optimizer gets, and what a data-parallel run's gradient all-reduce buckets and
/// `train.shard_optimizer` partitions): a full fine-tune's `CausalLM::named_params` (the HF
/// file order of `DecoderConfig::hf_tensor_shapes`: embedding, each layer's linears with their
/// biases and its norms, final norm, untied LM head); LoRA's `peft::lora_vars` (per layer, per
/// adapted linear: A, B, and DoRA's magnitude; an expert's up projection under a fused
/// `gate_up_proj` target shares its gate's A, listed once).
pub fn trainable_tensor_sizes(m: &DecoderConfig, cfg: &TrainConfig) -> Vec<usize> {
    if cfg.trains_full() {
        return m
            .hf_tensor_shapes()
            .iter()
            .map(|(_, shape)| shape.iter().product())
            .collect();
    }
    let mut v = Vec::new();
    let plan = lora_plan(m, cfg);
    for layer in 0..m.num_hidden_layers {
        for (path, l) in m.linears_at(layer) {
            if plan.wraps(&path) {
                let sizes = cfg
                    .lora
                    .kind
                    .spec()
                    .tensor_sizes(l.out, l.inp, cfg.lora.rank);
                let skip = usize::from(plan.shares_a(&path)); // A comes first
                v.extend(sizes.into_iter().skip(skip));
            }
        }
    }
    v
}

/// What one optimizer holds for the trainable tensors of `sizes` (elements, in the trainable
/// order): its state, and the f32 temporaries of its update of the largest group of tensors
/// (sgd: of the largest tensor).
/// The optimizer's state and its update's temporaries, for trainable tensors of `sizes`
/// elements of `var_bytes` each (LoRA: 4; full fine-tuning: the model dtype's).
fn optimizer_bytes(
    kind: OptimizerKind,
    sizes: &[usize],
    device: &str,
    var_bytes: u64,
) -> (u64, u64) {
    let state = sizes.iter().map(|&n| state_bytes(kind, n)).sum();
    let largest = sizes.iter().copied().max().unwrap_or(0) as u64;
    if kind == OptimizerKind::AdamW {
        // AdamW's two ops (`tallow_model::kernels::adamw`) update the moments in place; what
        // the update allocates is the group's flat f32 parameters, gradients (always f32, the
        // accumulator's) and new values (12 bytes per element) and, for half-precision
        // parameters, the new values rounded (2 more). A lone parameter (every parameter on
        // the CPU, or one larger than a CUDA group) has its gradient as its flat buffer, and
        // an f32 one its own value: 4 bytes (f32), 10 (half precision: its f32 copy, the new
        // values, rounded). Measured on the CPU, full fine-tuning of a tiny Llama with a 2M
        // embedding (`tallow bench`, 2026-11-28): the optimizer phase +0.95% (f32), +0.89% (bf16).
        // On CUDA f32 parameters (LoRA's factors, an f32 model) are updated in place by the
        // members' kernel (`adamw::adamw_members`): no temporaries.
        if Backend::named(device) == Backend::Cuda && var_bytes == 4 {
            return (state, 0);
        }
        let cap = crate::optim::adamw::group_elems(Backend::named(device));
        let groups = crate::optim::adamw::group_sizes(sizes.iter().copied(), cap);
        let per_elem = |members: usize| match (members, var_bytes) {
            (1, 4) => 4,
            (1, _) => 10,
            (_, 4) => 12,
            _ => 14,
        };
        let bytes = groups
            .iter()
            .map(|&(len, members)| per_elem(members) * len as u64)
            .max()
            .unwrap_or(0);
        return (state, bytes);
    }
    // f32 copies of the largest group's parameters, gradients and moments while updating
    // (adamw8bit also dequantizes both moments to f32 and requantizes them).
    let temporaries = match kind {
        OptimizerKind::AdamW8bit => 8,
        _ => 6,
    };
    // adamw8bit updates its parameters in groups (flat buffers of consecutive parameters,
    // `optim::adamw8bit::GROUP_ELEMS`): the temporaries are the size of the largest group, not
    // of the largest tensor.
    let groups = match kind {
        OptimizerKind::AdamW8bit => crate::optim::adamw8bit::group_lengths(sizes.iter().copied()),
        _ => Vec::new(),
    };
    let update_elems = groups.into_iter().max().unwrap_or(0).max(largest as usize) as u64;
    (state, temporaries * 4 * update_elems)
}

fn state_detail(kind: OptimizerKind) -> &'static str {
    match kind {
        OptimizerKind::AdamW => "adamw: two f32 moments per trainable parameter",
        OptimizerKind::AdamW8bit => {
            "adamw8bit: two 8-bit moments + f32 scale per 256 (f32 under 4096 elements)"
        }
        OptimizerKind::Sgd => "sgd: no state",
    }
}

fn parts(m: &DecoderConfig, cfg: &TrainConfig, device: &'static str) -> Parts {
    let s = dtype_bytes(cfg.model.dtype) as u64;
    let full = cfg.trains_full();
    // Preference methods run a pair's chosen and rejected sequences in one batch.
    let (b, t) = (rows_per_micro_batch(cfg), cfg.data.max_seq_len);
    let (c, v, layers) = (m.hidden_size, m.vocab_size, m.num_hidden_layers);
    // A bitsandbytes 4-bit checkpoint loads its decoder linears as NF4 whatever
    // `model.quantize` says (`tallow_model::kernels::nf4::Nf4Weight::from_bnb`), with its own
    // double quantization, and the modules it skipped dense.
    let pre = m.prequantized.as_ref();
    let nf4 = cfg.model.quantize == Quantize::Nf4 || pre.is_some();
    let double_quant = pre.map_or(cfg.model.double_quant, |p| p.double_quant);
    // `model.quantize = "keep"` on a GGUF file: its block-format linears as the file stores
    // them (`tallow_model::kernels::ggml`), the rest dequantized into the model dtype.
    let keep = match cfg.model.quantize {
        Quantize::Keep => m.stored_blocks.as_ref(),
        _ => None,
    };
    let quantized = nf4 || keep.is_some();

    // Weights: decoder linears (dense, NF4 or GGML blocks), and the rest (embeddings, lm_head
    // when untied, norms, biases) in the model dtype.
    let mut linear_stored = 0u64;
    let mut largest_linear = 0usize;
    let mut formats = std::collections::BTreeSet::new();
    for layer in 0..layers {
        for (path, l) in m.linears_at(layer) {
            let n = l.inp * l.out;
            let name = format!("model.layers.{layer}.{path}");
            linear_stored += match (keep, pre) {
                (Some(k), _) => match k.get(&format!("{name}.weight")) {
                    Some(&bytes) => {
                        formats.insert(format!("{:.2} bits", 8.0 * bytes as f64 / n as f64));
                        bytes
                    }
                    None => s * n as u64,
                },
                (None, Some(p)) if !p.quantizes(&name) => s * n as u64,
                _ => nf4_bytes(n, double_quant),
            };
            largest_linear = largest_linear.max(n);
        }
    }
    let linear_elems = m.linear_weight_elems();
    let other = m.num_params() - linear_elems;
    let dt = cfg.model.dtype.name();
    // What the adapter kind keeps beside its trainable tensors (DoRA: ||W_i||² per output row
    // of each adapted linear, f32, computed once).
    let kind = (!full).then(|| cfg.lora.kind.spec());
    let adapter_kept = match kind {
        Some(kind) => {
            let plan = lora_plan(m, cfg);
            (0..layers)
                .flat_map(|layer| m.linears_at(layer))
                .filter(|(path, _)| plan.wraps(path))
                .map(|(_, l)| kind.kept_bytes(l.out) as u64)
                .sum()
        }
        None => 0,
    };
    let base_bytes = adapter_kept
        + if quantized {
            linear_stored + s * other as u64
        } else {
            s * (linear_elems + other) as u64
        };
    let tp = trainable_params(m, cfg);
    let (frozen, trainable) = if full {
        (
            (0, "none (every weight is trained)".to_string()),
            (
                s * tp,
                format!("{tp} parameters in {dt} (full fine-tuning)"),
            ),
        )
    } else {
        let what = if keep.is_some() {
            format!(
                "decoder linears as the GGUF file stores them ({} per value; {}), the rest {dt}",
                formats.into_iter().collect::<Vec<_>>().join(", "),
                mib(linear_stored)
            )
        } else if nf4 {
            format!(
                "decoder linears NF4{}{} ({}), the rest {dt}",
                if pre.is_some() {
                    " as the bitsandbytes checkpoint stores them"
                } else {
                    ""
                },
                if double_quant { " + double quant" } else { "" },
                mib(linear_stored)
            )
        } else {
            format!("{} parameters in {dt}", linear_elems + other)
        };
        (
            (base_bytes, what),
            (
                4 * tp,
                format!(
                    "{} r{} on {}, {tp} parameters in f32",
                    cfg.lora.kind.spec().label(),
                    cfg.lora.rank,
                    lora_plan(m, cfg).describe()
                ),
            ),
        )
    };
    // Trainable parameters' dtype: LoRA f32, full FT the model dtype.
    let var_bytes = if full { s } else { 4 };

    let tensors = trainable_tensor_sizes(m, cfg);
    let (state_total, workspace_optimizer) =
        optimizer_bytes(cfg.train.optimizer, &tensors, device, var_bytes);
    let state = (state_total, state_detail(cfg.train.optimizer).to_string());
    let acc = 4 * tp;
    let acc_before = if cfg.train.grad_accum > 1 { acc } else { 0 };

    // Activations for the backward.
    // The CPU's kernels, unless `TALLOW_CUDA_PATHS_ON_CPU` has the CPU take CUDA's paths.
    let cpu = Backend::named(device) == Backend::Cpu;
    let per_layer = layer_activation_bytes(m, cfg, b, t, cpu);
    let tokens = (b * t) as u64;
    let every = cfg.train.checkpoint_every.max(1);
    let checkpointed = if cfg.train.checkpointing {
        layers.div_ceil(every)
    } else {
        0
    };
    let kept_layers = (layers - checkpointed) as u64;
    // Outside the layers: embedding output (Gemma: and its scaled copy), final norm, the
    // target rows for the LM head.
    let outside = (3 + m.variant.embed_scale as u64) * s * tokens * c as u64;
    // One (tokens, C) tensor: what a checkpointed layer keeps.
    let hidden = s * tokens * c as u64;
    // Offloaded checkpoint inputs live in host memory (on the CPU the host copy is the
    // tensor: no saving there).
    let offloaded = checkpointed > 0 && cfg.train.offload_checkpoints && device != "cpu";
    let kept_inputs = if offloaded {
        0
    } else {
        checkpointed as u64 * hidden
    };
    let activations = (
        kept_layers * per_layer + kept_inputs + outside,
        if offloaded {
            format!(
                "{checkpointed} checkpointed layers keep their input in host memory ({} in \
                 all), {kept_layers} keep {} each; {b} x {t} tokens",
                mib(host_bytes(m, cfg, device)),
                mib(per_layer)
            )
        } else if checkpointed > 0 {
            format!(
                "{checkpointed} checkpointed layers keep their input ({} each), {kept_layers} \
                 keep {} each; {b} x {t} tokens",
                mib(hidden),
                mib(per_layer)
            )
        } else {
            format!("{layers} layers x {} ({b} x {t} tokens)", mib(per_layer))
        },
    );

    // The LM head: logits of a chunk of rows, in the model dtype then f32, log-softmax.
    let rows = b * t.saturating_sub(1);
    let chunk = rows.min((LOSS_CHUNK_ELEMS / v.max(1)).max(1)) as u64;
    // On the CPU a bf16/f16 matmul converts its operands to f32 in full and computes into an
    // f32 output (the gemm crate's half-precision path, measured): with the LM head, a V x C f32
    // copy of the head weight per chunk, forward and backward (on AMX a packed bf16 copy).
    // CUDA's cuBLAS reads bf16 as is.
    let cpu_half = cpu && s == 2;
    // bf16 base matmuls of the LoRA linear on AMX tiles: where the estimate runs (the CPU
    // that trains on the CPU).
    let amx = cpu_half
        && matches!(cfg.model.dtype, ModelDtype::Bf16)
        && tallow_model::kernels::amx::enabled();
    let f32_copy = |n: usize| if cpu_half { 4 * n as u64 } else { 0 };
    // The LM head on AMX too (`tallow_model::nn::loss`): the logits as (W hᵀ)ᵀ, the weight read
    // as it is stored and only the chunk's rows packed (2 bytes per element), for C a multiple
    // of 32; dh = dlogits W with W packed (2 bytes per element) in place of the f32 copy, for V
    // a multiple of 32 too.
    let amx_logits = amx && c % 32 == 0 && v >= 32;
    let amx_head = amx_logits && v % 32 == 0;
    let ops = paths(m, cfg, cpu);
    let logits = chunk * v as u64;
    // On the CPU the cross-entropy runs in the f32 logits' own buffer (`tallow_model::kernels::fused`,
    // `kernels::cross_entropy`): one f32 logits chunk (with bf16 / f16, also the
    // matmul's f32 head copy and half-precision output); on CUDA too (one kernel each way).
    // On AMX the logits come out in f32 (no half-precision copy, no copy of the head), and W
    // is packed for dh only once the f32 logits are gone: the backward holds the larger of
    // (f32 logits + their narrowed gradient) and (that gradient + W packed for dh).
    let rows_packed = 2 * chunk * c as u64;
    let (ce, ce_bwd) = match (cpu, cpu_half) {
        (true, true) if amx_head => {
            let packed = 2 * (v * c) as u64;
            (
                rows_packed + logits * 4,
                (logits * (4 + s)).max(packed + logits * s),
            )
        }
        (true, true) if amx_logits => {
            (rows_packed + logits * 4, f32_copy(v * c) + logits * (4 + s))
        }
        (true, true) => {
            let both = f32_copy(v * c) + logits * (4 + s);
            (both, both)
        }
        (true, false) => (logits * 4, logits * 4),
        // CUDA with f32 logits: the cross-entropy's two kernels in the f32 logits' own buffer
        // (`kernels::cross_entropy::ce_rows` / `ce_grad_rows`), next to the matmul's
        // half-precision logits while they are upcast, and to the gradient's half-precision
        // copy for dh in the backward.
        (false, _) if s <= 4 => {
            let half = if s < 4 { s } else { 0 };
            (logits * (4 + half), logits * (4 + half))
        }
        // f64 on CUDA: tensor ops, up to three logits-sized buffers at once
        (false, _) => (logits * 3 * s, logits * 3 * s),
    };
    // Gemma 2's final-logit soft-cap (`tallow_model::nn::loss`): the chunk's logits divided, tanh,
    // multiplied (in the model dtype, two alive at once) before the cross-entropy; in the
    // backward the cap's derivative, f32, next to the logits' gradient, and their product.
    let (cap_fwd, cap_bwd) = match m.variant.final_logit_softcapping {
        Some(_) => (2 * s * logits, 8 * logits),
        None => (0, 0),
    };
    let ce_bwd = ce_bwd + cap_bwd;
    let ce = ce + cap_fwd;
    let loss_forward = ce;
    // Backward high point: the LM head's backward (a chunk's logits turned into their gradient,
    // and dh for every row in f32), or one layer's attention backward (score-sized
    // gradients in f32) plus a few token-sized gradients.
    // One layer's backward: score-sized gradients in f32, a few hidden-sized ones, and the
    // feed-forward's (tokens x intermediate): the gradients of the SwiGLU output, of gate and of
    // up, each accumulated by Candle as zeros + add, about six such tensors at once. Measured on
    // the CPU (2026-11-24, random shapes, intermediate 1024-4096): 24-27 bytes per element in
    // f32 and in bf16 (whose CPU matmuls work in f32). The vendored candle-core now stores a
    // first contiguous gradient as it is instead of zeros + add; measured again (2026-11-27,
    // `tallow bench` on the bench shapes, f32 and bf16) the phase peaks moved by at most 1.2%
    // (f32 base: 467.7 -> 462.2 MiB), so the figure stands. On CUDA the gradients stay in the
    // model dtype: six of them, 6 x s (not measured yet).
    let ffn_grad = if cpu { 24 } else { 6 * s };
    let (scores_fwd, scores_bwd) = attention_transients(m, cfg, cpu);
    let (lin_fwd, lin_bwd) = one_op_transients(m, cfg, cpu, tokens);
    // The down projection's backward is where the feed-forward's gradients are in flight: on
    // CUDA the one-op linear's own buffers there, or the figure above, whichever is larger.
    let ffn_bwd = (tokens * ffn_grad * m.intermediate_size as u64).max(lin_bwd);
    // On the CPU the attention core's backward runs after the MLP's, whose gradients are gone
    // by then (Candle frees a node's gradient once it has passed it on): the larger of the two
    // is in flight, not both (measured: a bnb-4bit Llama, hidden 512, intermediate 1408, 256
    // tokens, bf16 without AMX: the sum overshot its backward peak by 12%, the larger is within
    // 3%). CUDA keeps the sum until a GPU measures it.
    let attn_bwd = tokens * 4 * 4 * c as u64
        + if cpu {
            scores_bwd.max(ffn_bwd)
        } else {
            scores_bwd + ffn_bwd
        };
    let lm_bwd = ce_bwd + 8 * tokens * c as u64;
    // A checkpointed layer (`tallow_model::decoder::checkpointing`) is rebuilt in two halves: the
    // attention half with its graph, then the MLP half tile by tile (tiles of C tokens), each
    // tile's graph and gradients gone before the next, then the attention half's backward.
    // Alive throughout: the attention half's graph, dy and d(mid) (plus, offloaded, the input
    // back from the host and its copy as a variable).
    let halves = layer_halves(m, cfg, cpu);
    let back_from_host = if offloaded { hidden } else { 0 };
    // On the CPU a bf16 / f16 matmul of the rebuilt MLP also holds its (rows, I) operand
    // widened to f32, its f32 output and that output rounded back: 4 + 4 + 2 bytes per element
    // next to the rows' graph (measured on a random bf16 Qwen3 shape, C 320, I 2624, 2 x 256
    // tokens: -16% without it, tiled and in one piece).
    let widen = if cpu_half { 10 } else { 0 };
    // With the bf16 kernels of SwiGLU, rotary and RMSNorm (`kernels::dispatch::fused_with_bf16`)
    // the rebuilt MLP's bf16 gradients are no longer a chain of Candle's bf16 ops: measured on
    // that shape (tiles of one 256-token row) at I 1312 / 2624 / 3936, the peak grows by ~19
    // bytes per (tile token, intermediate) element with the base matmuls on AMX (no widened dY),
    // ~21 without (against 34 before the kernels).
    let rebuilt_ffn = match (cpu_half, ops.fused_with_bf16, amx) {
        (true, true, true) => 19,
        (true, true, false) => 21,
        _ => ffn_grad + widen,
    };
    let tile = match cfg.train.checkpoint_tile_tokens {
        0 => c as u64,
        n => n as u64,
    };
    let (rebuilt_forward, rebuilt_backward) = if tokens > tile {
        let rebuild = TiledRebuild {
            halves: &halves,
            m,
            b,
            t,
            s,
            // tiles stay within one batch row: a row shorter than a tile is one
            tile: tile.min(t as u64),
            ffn_grad: rebuilt_ffn,
            chunked: cfg.model.attention == Attention::Chunked,
        };
        (
            rebuild.forward(),
            back_from_host + rebuild.backward(scores_bwd),
        )
    } else {
        // One tile: the attention half rebuilt whole with its graph, then the MLP half.
        let attention_graph = halves.attention_bytes(b, t);
        let mlp = tokens * (halves.mlp_per_token as u64 + rebuilt_ffn * m.intermediate_size as u64);
        (
            attention_graph.max(2 * hidden + tokens * halves.mlp_per_token as u64),
            attention_graph
                + back_from_host
                + (2 * hidden + mlp).max(hidden + scores_bwd + tokens * 4 * 4 * c as u64),
        )
    };
    // NF4: a weight is dequantized for its matmul, forward and backward, by one op that
    // allocates only its output in the compute dtype (`kernels::nf4`); a bf16 / f16 matmul on
    // the CPU then reads it as an f32 copy.
    // On AMX (`tallow_model::kernels::amx`) the LoRA linear packs the weight instead: 2 bytes
    // per element.
    let base_copy = if amx && ops.lora_one_op {
        2 * largest_linear as u64
    } else {
        f32_copy(largest_linear)
    };
    // GGML blocks (`kernels::ggml`): on the CPU decoded straight into the compute dtype; on
    // CUDA Candle's kernel writes f32, cast to bf16 (the f32 alive during the cast, freed before
    // the matmul reads the result; f16 has its own kernel).
    let dequantized = match (nf4, keep.is_some()) {
        (true, _) => s * largest_linear as u64 + base_copy,
        (false, true) => {
            let via_f32 = device == "cuda" && cfg.model.dtype == ModelDtype::Bf16;
            let f32_out = if via_f32 {
                4 * largest_linear as u64
            } else {
                0
            };
            s * largest_linear as u64 + f32_out.max(base_copy)
        }
        (false, false) => base_copy,
    };
    // An adapter that reads the weight (DoRA's norm of a bf16 / f16 or NF4-dequantized weight in
    // f32, one linear at a time): a transient the size of the largest weight.
    let adapter_read = kind.map_or(0, |k| {
        k.weight_transient_bytes(largest_linear, s as usize, quantized)
    }) as u64;
    let dequantized = dequantized.max(adapter_read);
    // Three high points: the LM head's backward, which comes first, before any layer has a
    // gradient (only the sums of earlier micro-batches, and in full fine-tuning the head's own
    // weight gradient); the end of the backward (every gradient in Candle's store, or in the
    // checkpointed layers' side stores, plus one layer's backward in flight); and adding them
    // to the f32 accumulator (without checkpointing the whole store is alive next to the sums;
    // with it, each layer's store is freed once added). Counting every gradient next to the LM
    // head's logits overshot by the trainable parameters' gradients where the head's backward
    // is the largest (a 32k vocabulary on a 77M Llama, LoRA r64 with NF4, checkpointing and
    // adamw8bit: +12%, issue 41).
    let end_of_backward = var_bytes * tp + acc_before;
    // A layer kept whole goes back through its own graph (counted in the activations) with
    // `attn_bwd` in flight; a checkpointed one is rebuilt (`rebuilt_backward`).
    let layer_bwd = match (checkpointed > 0, kept_layers > 0) {
        (true, true) => rebuilt_backward.max(attn_bwd),
        (true, false) => rebuilt_backward,
        (false, _) => attn_bwd,
    };
    let head_grad = if full { s * (v * c) as u64 } else { 0 };
    let at_head = (acc_before + head_grad, lm_bwd);
    let at_layer = (end_of_backward, layer_bwd + dequantized);
    let layer_grads = if checkpointed > 0 {
        var_bytes * tp / layers.max(1) as u64
    } else {
        var_bytes * tp
    };
    // One micro-batch of f32 gradients: `GradAccumulator::add` keeps each as the step's sum
    // (to_dtype to f32 is no copy), so adding allocates nothing: the sums are the gradients.
    let at_add = if cfg.train.grad_accum == 1 && var_bytes == 4 {
        acc
    } else {
        acc + layer_grads
    };
    let sum = |(g, w): (u64, u64)| g + w;
    let ((grads_backward, workspace_backward), logits_backward) =
        if at_add >= sum(at_head).max(sum(at_layer)) {
            ((at_add, 0), 0)
        } else if sum(at_head) > sum(at_layer) {
            (at_head, ce_bwd)
        } else {
            (at_layer, 0)
        };
    let rebuilt_forward = if checkpointed > 0 { rebuilt_forward } else { 0 };
    let workspace_forward =
        (rebuilt_forward + dequantized + scores_fwd.max(lin_fwd)).max(loss_forward);
    // Load: bf16/f32 tensors are converted one at a time; NF4 quantizes from an f32 copy; a
    // bitsandbytes checkpoint's packed codes are read and reordered (two copies of n / 2).
    // GGML blocks are read and their rows reordered as bytes (a few copies of under a byte per
    // value).
    let load_transient = if pre.is_some() || keep.is_some() {
        largest_linear as u64
    } else if nf4 {
        4 * largest_linear as u64
    } else {
        s * largest_linear as u64
    };
    let mut overhead = 1 << 20;
    overhead += 200 * v as u64; // tokenizer
    overhead += s * tokens * (2 * m.head_dim as u64); // rope tables
    let mut what = "tokenizer, data, rotary tables".to_string();
    if m.variant.rope_local_base_freq.is_some() {
        overhead += s * tokens * (2 * m.head_dim as u64); // Gemma 3's sliding layers' own
        what += " (two sets: Gemma 3's sliding and global layers)";
    }
    if cfg.model.attention == Attention::Eager {
        overhead += s * (b * t * t) as u64; // the (B, T, T) mask
        what += ", attention mask";
    }
    if device == "cuda" {
        overhead += CUDA_CONTEXT_BYTES;
        what += "; CUDA context + cuBLAS workspace (outside the memory pool)";
        if cfg.train.optimizer == OptimizerKind::AdamW8bit {
            // The tensor-op quantizer's bucket tables, uploaded once (CPU runs its kernel).
            overhead += tallow_model::kernels::blockwise8::generic_table_bytes() as u64;
            what += "; 8-bit quantizer tables";
        }
    }
    Parts {
        trainable_params: tp,
        per_layer,
        frozen,
        trainable,
        state,
        grads_backward,
        grads_optimizer: acc,
        accumulator_live: if cfg.train.grad_accum > 1 { acc } else { 0 },
        activations,
        loss_forward,
        workspace_forward,
        workspace_backward,
        logits_backward,
        workspace_optimizer,
        load_transient,
        overhead: (overhead, what),
    }
}

/// A checkpointed layer longer than one tile, rebuilt as `tallow_model::decoder::checkpointing`
/// does: every token-wise part tile by tile, the attention core over the whole sequence.
struct TiledRebuild<'a> {
    halves: &'a LayerHalves,
    m: &'a DecoderConfig,
    b: usize,
    t: usize,
    /// Model dtype bytes.
    s: u64,
    tile: u64,
    /// Bytes per (token, intermediate) element of the MLP's gradients in flight.
    ffn_grad: u64,
    chunked: bool,
}

impl TiledRebuild<'_> {
    fn tokens(&self) -> u64 {
        (self.b * self.t) as u64
    }

    /// One (tokens, C) tensor.
    fn hidden(&self) -> u64 {
        self.s * self.tokens() * self.m.hidden_size as u64
    }

    /// q, k and v of every token.
    fn qkv(&self) -> u64 {
        let m = self.m;
        let width = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim;
        self.s * self.tokens() * width as u64
    }

    /// The core's output, (tokens, H*D).
    fn y(&self) -> u64 {
        self.s * self.tokens() * (self.m.num_attention_heads * self.m.head_dim) as u64
    }

    /// What the core's graph keeps: q, k, v, its output twice (the attention op's, heads
    /// first, and its transposed contiguous copy), and the log-sum-exp per head and token
    /// (chunked) or the scores (eager).
    fn core_graph(&self) -> u64 {
        let h = self.m.num_attention_heads as u64;
        let kept = if self.chunked {
            4 * h * self.tokens()
        } else {
            self.halves.attention_bytes(self.b, self.t)
                - (self.tokens() * self.halves.attention_per_token as u64)
        };
        self.qkv() + 2 * self.y() + kept
    }

    /// One tile's graph and gradients: of the MLP half, or of the attention half's projections
    /// (bounded by the whole half's bytes per token, plus four f32 gradients of the width C).
    fn mlp_tile(&self) -> u64 {
        let i = self.m.intermediate_size as u64;
        self.tile * (self.halves.mlp_per_token as u64 + self.ffn_grad * i)
    }

    fn attention_tile(&self) -> u64 {
        self.tile * (self.halves.attention_per_token as u64 + 16 * self.m.hidden_size as u64)
    }

    /// The checkpointed forward (no graph), at its largest step: q, k, v tiles and their
    /// concatenation; the core; x + o_proj(y) (tiles, concatenation, sum); the MLP tiles.
    fn forward(&self) -> u64 {
        let (qkv, y, hidden) = (self.qkv(), self.y(), self.hidden());
        let tile_out = self.tile * self.halves.mlp_per_token as u64;
        (2 * qkv + self.attention_tile())
            .max(qkv + y)
            .max(y + 3 * hidden)
            .max(3 * hidden + tile_out)
    }

    /// The rebuild's backward at its largest step, besides x (counted as a kept input or
    /// brought back from the host) and `scores_bwd`, the core's backward transients. Alive
    /// throughout: dy. Steps: (2) the MLP half's backward, mid and d(mid) (its tiles and their
    /// concatenation) next to the core's graph; (3) o_proj's, d(y) likewise; (4) the core's,
    /// d(mid) and d(y) next to its graph: through the reshapes, a gradient, Candle's zeros and
    /// their sum (three of the output's size), then in the attention op's backward d(output),
    /// dq, dk, dv and the zeros each is summed into (the size of q at most); (5) the
    /// projections', d(mid), dq, dk, dv, dx (tiles, concatenation, sum with d(mid)).
    fn backward(&self, scores_bwd: u64) -> u64 {
        let (qkv, y, hidden, core) = (self.qkv(), self.y(), self.hidden(), self.core_graph());
        let q = y; // (tokens, H*D), as the core's output
        let dy = hidden;
        let mlp = core + 3 * hidden + self.mlp_tile();
        let o_proj = core + hidden + 2 * y + self.attention_tile();
        let attention = core + hidden + y + (3 * y).max(y + qkv + q + scores_bwd);
        let projections = 4 * hidden + qkv + self.attention_tile();
        dy + mlp.max(o_proj).max(attention).max(projections)
    }
}

/// One change of a plan, with the predicted peak once it (and the ones before it) are applied.
#[derive(Debug, Clone, Serialize)]
pub struct PlanStep {
    /// The `--set` overrides of this change (`train.checkpointing=true`).
    pub sets: Vec<String>,
    pub what: String,
    pub peak_bytes: u64,
}

/// What to change to fit a budget.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub budget_bytes: u64,
    /// The config's own predicted peak.
    pub peak_bytes: u64,
    /// True when the config already fits (then `steps` is empty).
    pub fits: bool,
    /// The smallest set of changes that fits, in the usual order; empty when none does.
    pub steps: Vec<PlanStep>,
    /// False when no combination of the levers fits the budget.
    pub possible: bool,
    /// When it fits: the largest micro-batch that still fits, with the grad_accum that keeps the
    /// rows per optimizer step (when it divides).
    pub largest_micro_batch: Option<usize>,
    pub grad_accum_for_largest: Option<usize>,
    /// Every override of the plan, for `--set` (`tallow train --config F --set ...`).
    pub sets: Vec<String>,
    /// The longest `data.max_seq_len` (a multiple of 64, at most [`LONGEST_SEARCHED`]) that
    /// fits the budget with the config's own levers; None when not even 64 tokens do. It may
    /// exceed `max_position_embeddings`.
    pub longest_max_seq_len: Option<usize>,
    /// The model's `max_position_embeddings`: the positions it was trained on.
    pub max_position_embeddings: usize,
    /// When the config does not fit: the longest `data.max_seq_len` with the plan's levers
    /// (all but shorter sequences).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longest_with_plan: Option<usize>,
    /// When the config fits: the longest `data.max_seq_len` once the long-context levers it
    /// does not use yet are on (checkpointing of every layer; on CUDA, offloading its inputs),
    /// when that is longer than `longest_max_seq_len`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub longer_with: Option<LongerWith>,
    /// Ranks of the job the plan is for: its peaks are per rank ([`estimate_per_rank`]).
    #[serde(skip_serializing_if = "is_one")]
    pub world: usize,
}

/// The longest sequences the long-context levers reach.
#[derive(Debug, Clone, Serialize)]
pub struct LongerWith {
    /// The `--set` overrides (`train.checkpointing=true`, ...).
    pub sets: Vec<String>,
    pub longest_max_seq_len: usize,
    /// Host memory the offloaded checkpoint inputs take at that length (0: none offloaded).
    pub host_bytes: u64,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The longest `data.max_seq_len` the budget searches reach (16M tokens).
pub const LONGEST_SEARCHED: usize = 1 << 24;

/// The longest multiple of 64 tokens, up to [`LONGEST_SEARCHED`], whose predicted peak fits
/// `budget`, the rest of `cfg` as it is (the peak grows with the length). Not capped at the
/// model's `max_position_embeddings`: training past it is the user's choice (rotary positions
/// extrapolate, as in transformers), and the CLI says when the length is past it.
pub fn longest_seq_len(
    model: &DecoderConfig,
    cfg: &TrainConfig,
    device: &'static str,
    budget: u64,
) -> Option<usize> {
    longest_seq_len_per_rank(model, cfg, device, budget, 1)
}

/// [`longest_seq_len`] for one rank of `world`.
fn longest_seq_len_per_rank(
    model: &DecoderConfig,
    cfg: &TrainConfig,
    device: &'static str,
    budget: u64,
    world: usize,
) -> Option<usize> {
    let fits = |blocks: usize| {
        let mut c = cfg.clone();
        c.data.max_seq_len = 64 * blocks;
        estimate_per_rank(model, &c, device, world).total_bytes <= budget
    };
    if !fits(1) {
        return None;
    }
    // fits(lo), and hi is past the searched limit or does not fit
    let (mut lo, mut hi) = (1, LONGEST_SEARCHED / 64 + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(64 * lo)
}

/// The levers, in the order users reach for them. Sharding the optimizer state over the ranks
/// costs one more all-reduce of the trainable weights per step (over one node's links, little
/// next to the step) and changes no number of the run: after the free levers, before those
/// that cost speed (checkpointing recomputes every layer). Only with more than one rank.
const LEVERS: [&str; 8] = [
    "micro-batch 1 + more accumulation",
    "bf16 weights and activations",
    "optimizer state sharded over the ranks",
    "activation checkpointing",
    "checkpointed inputs offloaded to host memory",
    "8-bit optimizer state (adamw8bit)",
    "NF4 base weights (QLoRA)",
    "shorter sequences",
];

/// The index of the optimizer-state sharding in [`LEVERS`].
const SHARD_LEVER: usize = 2;

/// The index of activation checkpointing in [`LEVERS`].
const CHECKPOINT_LEVER: usize = 3;

/// The index of offloading checkpointed inputs in [`LEVERS`].
const OFFLOAD_LEVER: usize = 4;

/// The index of NF4 base weights in [`LEVERS`].
const NF4_LEVER: usize = 6;

/// The index of "shorter sequences" in [`LEVERS`]: the last resort.
const SEQ_LEVER: usize = LEVERS.len() - 1;

/// Applies lever `i` to `cfg` (a job of `world` ranks, on `model`) when it changes something;
/// the seq lever is applied by the caller.
fn apply_lever(
    i: usize,
    cfg: &TrainConfig,
    model: &DecoderConfig,
    world: usize,
) -> Option<(TrainConfig, Vec<String>)> {
    let mut c = cfg.clone();
    let t = &mut c.train;
    let sets = match i {
        0 if t.micro_batch_size > 1 => {
            t.grad_accum *= t.micro_batch_size;
            t.micro_batch_size = 1;
            vec![
                "train.micro_batch_size=1".to_string(),
                format!("train.grad_accum={}", t.grad_accum),
            ]
        }
        1 if c.model.dtype == ModelDtype::F32 => {
            c.model.dtype = ModelDtype::Bf16;
            vec!["model.dtype=bf16".into()]
        }
        2 if world > 1 && !t.shard_optimizer && t.optimizer != OptimizerKind::Sgd => {
            t.shard_optimizer = true;
            vec!["train.shard_optimizer=true".into()]
        }
        3 if !t.checkpointing || t.checkpoint_every > 1 => {
            t.checkpointing = true;
            t.checkpoint_every = 1;
            vec![
                "train.checkpointing=true".into(),
                "train.checkpoint_every=1".into(),
            ]
        }
        // (after checkpointing, which a plan applies first when it takes both; it changes no
        // number of the run, only adds host copies, so it comes before the 8-bit state and
        // NF4; it saves nothing on the CPU, so a CPU plan never needs it)
        4 if t.checkpointing && !t.offload_checkpoints => {
            t.offload_checkpoints = true;
            vec!["train.offload_checkpoints=true".into()]
        }
        5 if t.optimizer == OptimizerKind::AdamW => {
            t.optimizer = OptimizerKind::AdamW8bit;
            vec!["train.optimizer=adamw8bit".into()]
        }
        // A GGUF whose linears are in block formats keeps them (`keep`) rather than being
        // dequantized and quantized again to NF4.
        6 if !c.trains_full() && c.model.quantize == Quantize::None => {
            c.model.quantize = match model.stored_blocks.as_ref().is_some_and(|b| !b.is_empty()) {
                true => Quantize::Keep,
                false => Quantize::Nf4,
            };
            vec![format!("model.quantize={}", c.model.quantize)]
        }
        _ => return None,
    };
    Some((c, sets))
}

/// The longest `data.max_seq_len` of `cfg` with the long-context levers on (checkpointing of
/// every layer, then on CUDA its inputs offloaded); None when `cfg` has them all already.
fn longer_with(
    model: &DecoderConfig,
    cfg: &TrainConfig,
    device: &'static str,
    budget: u64,
    world: usize,
) -> Option<LongerWith> {
    let mut c = cfg.clone();
    let mut sets = vec![];
    let levers: &[usize] = if device == "cpu" {
        &[CHECKPOINT_LEVER]
    } else {
        &[CHECKPOINT_LEVER, OFFLOAD_LEVER]
    };
    for &i in levers {
        if let Some((next, s)) = apply_lever(i, &c, model, world) {
            c = next;
            sets.extend(s);
        }
    }
    if sets.is_empty() {
        return None;
    }
    let n = longest_seq_len_per_rank(model, &c, device, budget, world)?;
    c.data.max_seq_len = n;
    Some(LongerWith {
        sets,
        longest_max_seq_len: n,
        host_bytes: host_bytes(model, &c, device),
    })
}

/// Host memory `cfg` needs for offloaded checkpoint inputs: one (tokens, C) tensor per
/// checkpointed layer, in pinned memory, on CUDA; 0 otherwise (on the CPU the host copy is the
/// tensor itself).
pub fn host_bytes(model: &DecoderConfig, cfg: &TrainConfig, device: &str) -> u64 {
    let t = &cfg.train;
    if device == "cpu" || !t.checkpointing || !t.offload_checkpoints {
        return 0;
    }
    let layers = model.num_hidden_layers.div_ceil(t.checkpoint_every.max(1)) as u64;
    let tokens = (rows_per_micro_batch(cfg) * cfg.data.max_seq_len) as u64;
    layers * tokens * (dtype_bytes(cfg.model.dtype) * model.hidden_size) as u64
}

/// The smallest set of changes (fewest levers, earlier levers first; shorter sequences only when
/// nothing else fits) after which the predicted peak of `cfg` fits `budget`; when it already
/// fits, the largest micro-batch that does.
pub fn plan(model: &DecoderConfig, cfg: &TrainConfig, device: &'static str, budget: u64) -> Plan {
    plan_per_rank(model, cfg, device, budget, 1)
}

/// [`plan`] for each rank of a job of `world` ranks: per-rank peaks ([`estimate_per_rank`]),
/// and with more than one rank `train.shard_optimizer` is one of the levers.
pub fn plan_per_rank(
    model: &DecoderConfig,
    cfg: &TrainConfig,
    device: &'static str,
    budget: u64,
    world: usize,
) -> Plan {
    let peak = |c: &TrainConfig| estimate_per_rank(model, c, device, world).total_bytes;
    let own = peak(cfg);
    let mut out = Plan {
        budget_bytes: budget,
        peak_bytes: own,
        fits: own <= budget,
        steps: vec![],
        possible: true,
        largest_micro_batch: None,
        grad_accum_for_largest: None,
        sets: vec![],
        longest_max_seq_len: longest_seq_len_per_rank(model, cfg, device, budget, world),
        max_position_embeddings: model.max_position_embeddings,
        longest_with_plan: None,
        longer_with: None,
        world,
    };
    if out.fits {
        out.longer_with = longer_with(model, cfg, device, budget, world)
            .filter(|l| Some(l.longest_max_seq_len) > out.longest_max_seq_len);
        let fits_mb = |mb: usize| {
            let mut c = cfg.clone();
            c.train.micro_batch_size = mb;
            peak(&c) <= budget
        };
        let mut lo = cfg.train.micro_batch_size; // fits
        let mut hi = lo * 2;
        while hi <= 4096 && fits_mb(hi) {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits_mb(mid) {
                lo = mid
            } else {
                hi = mid
            }
        }
        let rows = cfg.train.micro_batch_size * cfg.train.grad_accum;
        out.largest_micro_batch = Some(lo);
        out.grad_accum_for_largest = rows.is_multiple_of(lo).then(|| rows / lo);
        return out;
    }
    let n = LEVERS.len();
    let mut subsets: Vec<u32> = (1..(1u32 << n)).collect();
    // Shorter sequences change what is trained: only when no mix of the others fits. Then the
    // fewest levers; among equals, the ones that come earliest in the usual order.
    subsets.sort_by_key(|m| {
        let idx: Vec<u32> = (0..n as u32).filter(|i| m & (1 << i) != 0).collect();
        (m & (1 << SEQ_LEVER) != 0, m.count_ones(), idx)
    });
    for m in subsets {
        let mut c = cfg.clone();
        let mut steps = vec![];
        let mut ok = true;
        for (i, lever) in LEVERS.iter().enumerate() {
            if m & (1 << i) == 0 {
                continue;
            }
            if i == SEQ_LEVER {
                // Halve max_seq_len until it fits (not below 64).
                let mut len = c.data.max_seq_len / 2;
                let mut found = None;
                while len >= 64 {
                    let mut s = c.clone();
                    s.data.max_seq_len = len;
                    if peak(&s) <= budget {
                        found = Some(s);
                        break;
                    }
                    len /= 2;
                }
                match found {
                    Some(s) => {
                        steps.push(PlanStep {
                            sets: vec![format!("data.max_seq_len={}", s.data.max_seq_len)],
                            what: format!("{lever} ({} tokens)", s.data.max_seq_len),
                            peak_bytes: peak(&s),
                        });
                        c = s;
                    }
                    None => ok = false,
                }
                continue;
            }
            // a bitsandbytes 4-bit checkpoint is NF4 already
            if i == NF4_LEVER && model.prequantized.is_some() {
                continue;
            }
            match apply_lever(i, &c, model, world) {
                Some((next, sets)) => {
                    let what = if i == SHARD_LEVER {
                        let r = estimate_per_rank(model, &next, device, world).ranks;
                        let saved = r.map_or(0, |r| r.unsharded_state_bytes - r.state_bytes);
                        format!(
                            "optimizer state sharded: -{} per rank",
                            crate::memory::human_bytes(saved)
                        )
                    } else if i == OFFLOAD_LEVER {
                        format!(
                            "{lever} ({} pinned)",
                            crate::memory::human_bytes(host_bytes(model, &next, device))
                        )
                    } else if i == NF4_LEVER && next.model.quantize == Quantize::Keep {
                        "the GGUF file's own quantized blocks (keep)".to_string()
                    } else {
                        lever.to_string()
                    };
                    steps.push(PlanStep {
                        sets,
                        what,
                        peak_bytes: peak(&next),
                    });
                    c = next;
                }
                None => ok = false, // not applicable: another subset covers it
            }
            if !ok {
                break;
            }
        }
        if ok && peak(&c) <= budget {
            out.longest_with_plan = longest_seq_len_per_rank(model, &c, device, budget, world);
            out.sets = steps.iter().flat_map(|s| s.sets.clone()).collect();
            out.steps = steps;
            return out;
        }
    }
    out.possible = false;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn model() -> DecoderConfig {
        let text = include_str!("../../../benchmarks/models/llama-105m.json");
        DecoderConfig::from_json_str(text, Path::new("llama-105m.json")).unwrap()
    }

    fn cfg(sets: &[&str]) -> TrainConfig {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_toml_str(
            "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\nmax_seq_len = 512\n",
            "test",
            &sets,
        )
        .unwrap()
    }

    #[test]
    fn components_sum_to_the_peak_phase() {
        for sets in [
            vec![],
            vec!["train.method=full"],
            vec!["train.checkpointing=true"],
            vec!["model.quantize=nf4", "train.micro_batch_size=4"],
            vec!["train.grad_accum=4", "train.optimizer=adamw8bit"],
        ] {
            let e = estimate(&model(), &cfg(&sets), "cpu");
            let sum: u64 = e.components.iter().map(|c| c.bytes).sum();
            assert_eq!(sum, e.total_bytes, "{sets:?}");
            let p = e.phases;
            assert_eq!(
                e.total_bytes,
                p.load.max(p.forward).max(p.backward).max(p.optimizer)
            );
        }
        // Per rank of a data-parallel job, sharded or not, on either device (the all-reduce
        // line is the optimizer phase's high point when its buckets outgrow the update).
        for world in [2, 4] {
            for sets in [
                vec![],
                vec!["train.shard_optimizer=true"],
                vec!["train.method=full", "train.shard_optimizer=true"],
                vec!["train.optimizer=adamw8bit", "train.shard_optimizer=true"],
            ] {
                for dev in ["cpu", "cuda"] {
                    let e = estimate_per_rank(&model(), &cfg(&sets), dev, world);
                    let sum: u64 = e.components.iter().map(|c| c.bytes).sum();
                    assert_eq!(sum, e.total_bytes, "{world} {sets:?} {dev}");
                    assert_eq!(e.total_bytes, peak(&e.phases).1);
                }
            }
        }
        // In f32 (no CPU-only half-precision operand copies) CUDA adds the context and the
        // activations its unfused ops keep beyond the CPU's fused kernels (every layer kept:
        // no checkpointing). (Eager attention: its transients are the same on both devices.)
        let f32 = cfg(&["model.dtype=f32", "model.attention=eager"]);
        let cuda = estimate(&model(), &f32, "cuda");
        let cpu = estimate(&model(), &f32, "cpu");
        let (b, t) = (f32.train.micro_batch_size, f32.data.max_seq_len);
        let unfused = layer_activation_bytes(&model(), &f32, b, t, false);
        let fused = layer_activation_bytes(&model(), &f32, b, t, true);
        assert!(
            fused < unfused,
            "the fused CPU path keeps less: {fused} vs {unfused}"
        );
        let layers = model().num_hidden_layers as u64;
        // ... and the unfused attention backward's score-sized gradients, at most.
        let m = model();
        let scores = (b * m.num_attention_heads * t * t * 4) as u64;
        let base = CUDA_CONTEXT_BYTES + layers * (unfused - fused);
        let diff = cuda.total_bytes - cpu.total_bytes;
        assert!(
            (base..=base + 3 * scores).contains(&diff),
            "{diff} vs {base}"
        );
        assert_eq!(cuda.outside_pool_bytes, CUDA_CONTEXT_BYTES);
        assert_eq!(cpu.outside_pool_bytes, 0);
        // In bf16 the one-op LoRA linears keep one output each on both devices (CUDA's
        // kernels as the CPU's), and CUDA's hold dx while they run: tallow's kernels read the
        // bf16 rows, dropout's mask included, so nothing f32 beyond the r-sized products. CUDA's
        // attention kernels read v and write y where the projections have them: the CPU's
        // transposed copies of both (bf16, per token) are all that differs.
        let bf16 = cfg(&[]);
        let (b, t) = (bf16.train.micro_batch_size, bf16.data.max_seq_len);
        let on_cuda = layer_activation_bytes(&model(), &bf16, b, t, false);
        let on_cpu = layer_activation_bytes(&model(), &bf16, b, t, true);
        let tokens = (b * t) as u64;
        let (h, kv, d) = (m.num_attention_heads, m.num_key_value_heads, m.head_dim);
        let transposed = tokens * 2 * ((h + kv) * d) as u64;
        assert_eq!(
            on_cpu - on_cuda,
            transposed,
            "bf16: {on_cpu} (CPU) vs {on_cuda} (CUDA)"
        );
        let i = model().intermediate_size as u64;
        assert!(bf16.lora.dropout > 0.0);
        // the largest: down_proj's dx (K = I, 2 bytes)
        assert_eq!(
            one_op_transients(&model(), &bf16, false, tokens),
            (0, tokens * 2 * i)
        );
        assert_eq!(one_op_transients(&model(), &bf16, true, tokens), (0, 0));
        // an f32 model keeps cuBLAS's chunked body: with the default dropout x's dropped-out
        // copy (4 I) forward; dx (4 I), its f32 share apart and its masked copy (2 x 4 I)
        let f32_drop = cfg(&["model.dtype=f32"]);
        let (b, t) = (f32_drop.train.micro_batch_size, f32_drop.data.max_seq_len);
        let tokens = (b * t) as u64;
        assert_eq!(
            one_op_transients(&model(), &f32_drop, false, tokens),
            (tokens * 4 * i, tokens * 12 * i)
        );
    }

    /// AdamW's update temporaries: none on CUDA for f32 parameters (updated in place by the
    /// members' kernel); a group's flat buffers for half-precision ones (14 bytes an element);
    /// on the CPU each parameter alone (an f32 one: its gradient, 4 bytes an element).
    #[test]
    fn adamw_temporaries_follow_the_update_path() {
        let sizes = [100, 200, 300];
        let (state, tmp) = optimizer_bytes(OptimizerKind::AdamW, &sizes, "cuda", 4);
        assert!(state > 0);
        assert_eq!(tmp, 0);
        assert_eq!(
            optimizer_bytes(OptimizerKind::AdamW, &sizes, "cuda", 2).1,
            14 * 600
        );
        assert_eq!(
            optimizer_bytes(OptimizerKind::AdamW, &sizes, "cpu", 4).1,
            4 * 300
        );
    }

    /// Chunked attention's saved activations are linear in the sequence length, eager's are not;
    /// at 4096 tokens the chunked peak is below half the eager one for this model.
    #[test]
    fn chunked_attention_activations_are_linear_in_t() {
        let m = model();
        for dev in ["cpu", "cuda"] {
            let c = cfg(&["data.max_seq_len=1024", "model.dtype=f32"]);
            let e = cfg(&[
                "data.max_seq_len=1024",
                "model.dtype=f32",
                "model.attention=eager",
            ]);
            let fused = dev == "cpu";
            let at = |cfg: &TrainConfig, t: usize| layer_activation_bytes(&m, cfg, 1, t, fused);
            assert_eq!(at(&c, 2048), 2 * at(&c, 1024), "{dev}");
            assert!(at(&e, 2048) > 2 * at(&e, 1024), "{dev}");
            let peak = |sets: &[&str]| estimate(&m, &cfg(sets), dev).total_bytes;
            let chunked = peak(&["data.max_seq_len=4096", "train.checkpointing=true"]);
            let eager = peak(&[
                "data.max_seq_len=4096",
                "train.checkpointing=true",
                "model.attention=eager",
            ]);
            assert!(
                2 * chunked < eager,
                "{dev}: chunked {chunked} vs eager {eager}"
            );
        }
    }

    /// The longest length fits and 64 more tokens do not (or it is the model's limit).
    /// Offloaded checkpoint inputs leave the device's activations on CUDA (all but the one
    /// brought back for its layer's backward) and change nothing on the CPU; the MLP tiles
    /// make a checkpointed run's rebuilt layer grow slower than the whole layer's graph.
    #[test]
    fn offload_frees_the_checkpointed_inputs_on_cuda_only() {
        let m = model();
        let base = [
            "data.max_seq_len=4096",
            "train.checkpointing=true",
            "model.dtype=bf16",
        ];
        let with = [&base[..], &["train.offload_checkpoints=true"]].concat();
        let hidden = 2 * 4096 * m.hidden_size as u64; // bf16 (B x T x C)
        let layers = m.num_hidden_layers as u64;
        let act = |e: &Estimate| {
            e.components
                .iter()
                .find(|c| c.name == "activations")
                .unwrap()
                .bytes
        };
        let (off, on) = (
            estimate(&m, &cfg(&base), "cuda"),
            estimate(&m, &cfg(&with), "cuda"),
        );
        assert_eq!(act(&off) - act(&on), layers * hidden);
        assert!(on.total_bytes < off.total_bytes);
        assert!(off.total_bytes - on.total_bytes <= layers * hidden);
        let (off, on) = (
            estimate(&m, &cfg(&base), "cpu"),
            estimate(&m, &cfg(&with), "cpu"),
        );
        assert_eq!(off.total_bytes, on.total_bytes);
    }

    /// On CUDA, a budget between the checkpointed peak and the offloaded one is met by
    /// checkpointing + offload (the fewest levers); the CPU plan never offloads.
    /// Issue 38's bar, Unsloth's long-context figures (78,475 tokens in 24 GB, 342,733 in
    /// 80 GB): Llama-3.1-8B QLoRA r32, micro-batch 1, checkpointing with its inputs offloaded,
    /// on CUDA, fits >= 100,000 tokens in 24 GiB and >= 350,000 in 80 GiB with the token tiles,
    /// and not with each layer rebuilt in one piece (the tiles are what gets there).
    #[test]
    fn llama_8b_qlora_fits_past_unsloths_long_context() {
        let text = include_str!("../../../benchmarks/models/llama-3.1-8b-instruct.json");
        let m =
            DecoderConfig::from_json_str(text, Path::new("llama-3.1-8b-instruct.json")).unwrap();
        let job = [
            "model.dtype=bf16",
            "model.quantize=nf4",
            "model.double_quant=true",
            "lora.rank=32",
            "train.micro_batch_size=1",
            "train.checkpointing=true",
            "train.offload_checkpoints=true",
        ];
        let tiled = cfg(&job);
        let longest = |c: &TrainConfig, gib: u64| {
            longest_seq_len(&m, c, "cuda", gib << 30).expect("some length fits")
        };
        let (at24, at80) = (longest(&tiled, 24), longest(&tiled, 80));
        assert!(at24 >= 100_000, "24 GiB: {at24} tokens");
        assert!(at80 >= 350_000, "80 GiB: {at80} tokens");
        // One piece per layer: a length that is long enough to need the tiles.
        let untiled = cfg(&[&job[..], &["train.checkpoint_tile_tokens=16777216"]].concat());
        assert!(longest(&untiled, 24) < 100_000, "{}", longest(&untiled, 24));
        // The offloaded inputs are stated: one bf16 (tokens, 4096) tensor per layer.
        let mut c = tiled.clone();
        c.data.max_seq_len = at24;
        let e = estimate(&m, &c, "cuda");
        assert_eq!(e.host_bytes, 32 * at24 as u64 * 4096 * 2);
        let p = plan(&m, &cfg(&job[..5]), "cuda", 24 << 30);
        let longer = p
            .longer_with
            .expect("checkpointing and offload reach further");
        assert_eq!(
            longer.sets,
            [
                "train.checkpointing=true",
                "train.checkpoint_every=1",
                "train.offload_checkpoints=true"
            ]
        );
        assert_eq!(longer.longest_max_seq_len, at24);
        // `--set data.max_seq_len=100000 --budget 24GiB`: the plan that reaches it, with the
        // host memory of its offload step.
        let far = cfg(&[&job[..5], &["data.max_seq_len=100000"]].concat());
        let p = plan(&m, &far, "cuda", 24 << 30);
        assert!(!p.fits && p.possible, "{p:?}");
        assert!(p
            .sets
            .contains(&"train.offload_checkpoints=true".to_string()));
        assert!(!p.sets.iter().any(|s| s.starts_with("data.max_seq_len")));
        assert!(p.longest_with_plan >= Some(100_000), "{p:?}");
        let step = p
            .steps
            .iter()
            .find(|s| s.what.contains("offloaded"))
            .unwrap();
        assert!(step.what.contains("GiB pinned"), "{}", step.what);
    }

    #[test]
    fn plan_offloads_checkpointed_inputs_on_cuda() {
        let m = model();
        let base = cfg(&["data.max_seq_len=8192", "model.dtype=bf16"]);
        let at = |sets: &[&str]| {
            estimate(
                &m,
                &cfg(&[&["data.max_seq_len=8192", "model.dtype=bf16"], sets].concat()),
                "cuda",
            )
            .total_bytes
        };
        let ckpt = at(&["train.checkpointing=true"]);
        let off = at(&["train.checkpointing=true", "train.offload_checkpoints=true"]);
        assert!(off < ckpt, "{off} vs {ckpt}");
        let p = plan(&m, &base, "cuda", (off + ckpt) / 2);
        assert!(
            p.sets
                .contains(&"train.offload_checkpoints=true".to_string()),
            "{p:?}"
        );
        let p = plan(&m, &base, "cpu", 1 << 40);
        assert!(p.fits);
        for budget in [2u64 << 30, 1 << 30] {
            let p = plan(&m, &base, "cpu", budget);
            assert!(!p.sets.iter().any(|s| s.contains("offload")), "{p:?}");
        }
    }

    #[test]
    fn longest_seq_len_is_the_edge_of_the_budget() {
        let m = model();
        let base = cfg(&["train.checkpointing=true"]);
        let budget = 3u64 << 30;
        let n = longest_seq_len(&m, &base, "cpu", budget).expect("some length fits 3 GiB");
        let peak = |t: usize| {
            let mut c = base.clone();
            c.data.max_seq_len = t;
            estimate(&m, &c, "cpu").total_bytes
        };
        assert!(peak(n) <= budget);
        assert!(peak(n + 64) > budget, "{n}");
        assert_eq!(longest_seq_len(&m, &base, "cpu", 1 << 20), None);
        let plan = plan(&m, &base, "cpu", budget);
        assert_eq!(plan.longest_max_seq_len, Some(n));
    }

    /// With ranks, sharding the optimizer state is a lever, taken before checkpointing and
    /// adamw8bit: a full fine-tune at 64 tokens (weights, gradients and state dwarf the
    /// activations, so checkpointing does not reach it) on a budget of its sharded per-rank peak gets
    /// `train.shard_optimizer=true` alone, with the state it saves per rank; one process on the
    /// same budget never gets it (adamw8bit instead).
    #[test]
    fn plan_shards_the_optimizer_state_only_with_ranks() {
        let m = model();
        let base = cfg(&[
            "train.method=full",
            "model.dtype=bf16",
            "data.max_seq_len=64",
            "train.micro_batch_size=1",
        ]);
        for world in [2usize, 4] {
            let at = |sets: &[&str]| {
                let mut c = base.clone();
                for s in sets {
                    match *s {
                        "shard" => c.train.shard_optimizer = true,
                        "ckpt" => c.train.checkpointing = true,
                        _ => unreachable!(),
                    }
                }
                estimate_per_rank(&m, &c, "cpu", world)
            };
            let (own, sharded) = (at(&[]), at(&["shard"]));
            assert!(sharded.total_bytes < own.total_bytes);
            assert!(at(&["ckpt"]).total_bytes > sharded.total_bytes);
            let budget = sharded.total_bytes;
            let p = plan_per_rank(&m, &base, "cpu", budget, world);
            assert_eq!(p.sets, ["train.shard_optimizer=true"], "{world}: {p:?}");
            let r = sharded.ranks.unwrap();
            let saved = crate::memory::human_bytes(r.unsharded_state_bytes - r.state_bytes);
            assert!(p.steps[0].what.contains(&saved), "{p:?}");
            assert_eq!(p.steps[0].peak_bytes, budget);
            for one in [plan(&m, &base, "cpu", budget), {
                plan_per_rank(&m, &base, "cpu", budget, 1)
            }] {
                assert!(one.possible && !one.fits);
                assert!(!one.sets.iter().any(|s| s.contains("shard")), "{one:?}");
            }
        }
    }

    #[test]
    fn nf4_storage_is_codes_plus_scales() {
        // 4096 x 4096: 8 MiB of codes, 262144 blocks -> 256 KiB of 8-bit scales + 1024 f32.
        assert_eq!(
            nf4_bytes(4096 * 4096, true),
            8 * 1048576 + 262144 + 4096 + 4
        );
        assert_eq!(nf4_bytes(4096 * 4096, false), 8 * 1048576 + 4 * 262144);
    }

    #[test]
    fn plan_takes_the_fewest_levers_in_the_usual_order() {
        let m = model();
        let base = cfg(&["train.micro_batch_size=4"]);
        let own = estimate(&m, &base, "cpu").total_bytes;
        // Just above micro-batch 1: the first lever alone.
        let mb1 = estimate(&m, &cfg(&["train.grad_accum=32"]), "cpu").total_bytes;
        let p = plan(&m, &base, "cpu", mb1 + 1);
        assert!(!p.fits && p.possible);
        assert_eq!(
            p.sets,
            ["train.micro_batch_size=1", "train.grad_accum=32"],
            "{p:?}"
        );
        assert!(p.steps[0].peak_bytes <= mb1 + 1 && mb1 < own);
        // Under what micro-batch 1 alone reaches: more levers, each step's peak lower.
        let p = plan(&m, &base, "cpu", mb1 / 2);
        assert!(p.possible && p.steps.len() >= 2, "{p:?}");
        assert_eq!(p.steps[0].what, LEVERS[0]);
        assert!(p.steps.last().unwrap().peak_bytes <= mb1 / 2);
        assert!(p
            .steps
            .windows(2)
            .all(|w| w[1].peak_bytes < w[0].peak_bytes));
        // Nothing fits 1 MiB.
        let p = plan(&m, &base, "cpu", 1 << 20);
        assert!(!p.possible && p.steps.is_empty());
        // Already fits: no steps, the largest micro-batch.
        let p = plan(&m, &base, "cpu", own * 2);
        assert!(p.fits && p.steps.is_empty());
        let largest = p.largest_micro_batch.unwrap();
        assert!(largest > 4);
        let at = |mb: usize| {
            estimate(&m, &cfg(&[&format!("train.micro_batch_size={mb}")]), "cpu").total_bytes
        };
        assert!(at(largest) <= own * 2 && at(largest + 1) > own * 2);
    }
}
