//! One decoder layer: attention (grouped-query heads, rotary embedding, q/k norms, the
//! chunked or eager core), the MLP (SwiGLU / GeGLU), their norms and residual adds, and the
//! per-batch inputs every layer shares (rotary tables, the mask). Written once for every family;
//! the differences come from `DecoderConfig`. Shape legend: B = batch, T = time, C = hidden
//! size, H = heads, KV = key/value heads, D = head dim, I = intermediate size.

use candle_core::{DType, Tensor};

use super::moe::{RouterTape, SparseMoe};
use crate::config::{Activation, DecoderConfig, RopeScaling};
use crate::error::Result;
use crate::nn::linear::{adapter_input, Linear, Param};
use crate::nn::no_grad::enter;
use crate::nn::ops;

/// The query, key and value projections: three linears (Llama, Qwen, Mistral), or one fused
/// `qkv_proj` whose output is q, then k, then v (Phi-3).
#[derive(Clone)]
pub enum QkvProj {
    Separate {
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
    },
    Fused {
        qkv_proj: Linear,
    },
}

/// Multi-head self-attention with grouped-query heads and rotary embedding.
#[derive(Clone)]
pub struct Attention {
    pub qkv: QkvProj,
    pub o_proj: Linear,
    /// Qwen3, Gemma 3: RMSNorm over D on each q / k head (Gemma 3: `(1 + w)`,
    /// `norm_plus_one`).
    pub q_norm: Option<Param>,
    pub k_norm: Option<Param>,
    pub(crate) norm_plus_one: bool,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    /// The leading dims of each head that rotate (`DecoderConfig::rotary_dim`).
    pub(crate) rotary_dim: usize,
    pub(crate) eps: f64,
    /// The scale on q kᵀ: 1/sqrt(D), or Gemma 2's `query_pre_attn_scalar ** -0.5`.
    pub(crate) scale: f64,
    /// Gemma 2: scores soft-capped to (-cap, cap) before the mask.
    pub(crate) softcap: Option<f64>,
}

impl Attention {
    /// x: (B, T, C), cos/sin: (B, 1, T, D), mask: (B, 1, T, T) -> (B, T, C)
    /// Projections, qk-norm (Qwen3) and rotary embedding of the queries and keys: what the
    /// training forward and the cached (generation) forward share.
    /// x: (B, T, C), cos/sin: (B, 1, T, Dr) (Dr = rotary dim) -> q (B, H, T, D), k and v
    /// (B, KV, T, D)
    pub(crate) fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = match &self.qkv {
            QkvProj::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => {
                // x in f32 once for the three adapters (bf16 models), not once per projection.
                let xa = adapter_input(&[q_proj, k_proj, v_proj], x)?;
                let xa = xa.as_ref();
                (
                    q_proj.forward_with(x, xa)?,
                    k_proj.forward_with(x, xa)?,
                    v_proj.forward_with(x, xa)?,
                )
            }
            QkvProj::Fused { qkv_proj } => {
                // One matmul (and one adapter) for the three; split as Phi3Attention slices it.
                let qkv = qkv_proj.forward(x)?; // (B, T, (H + 2 KV) D)
                (
                    qkv.narrow(2, 0, h * d)?,             // (B, T, H D)
                    qkv.narrow(2, h * d, kv * d)?,        // (B, T, KV D)
                    qkv.narrow(2, (h + kv) * d, kv * d)?, // (B, T, KV D)
                )
            }
        };
        let q = q.reshape((b, t, h, d))?; // (B, T, H, D)
        let k = k.reshape((b, t, kv, d))?; // (B, T, KV, D)
        let v = v.reshape((b, t, kv, d))?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (
                norm(&q, qn, self.eps, self.norm_plus_one)?,
                norm(&k, kn, self.eps, self.norm_plus_one)?,
            ),
            _ => (q, k),
        };
        // Heads moved in front of time by the rotary op itself (one pass on the CPU). The
        // attention scale (1/sqrt(D), or Gemma 2's) is folded into q's rotary embedding (no
        // extra tensor), so the graph keeps no unscaled (B, H, T, T) scores.
        let q = self.rope(&q, cos, sin, self.scale)?; // (B, H, T, D)
        let k = self.rope(&k, cos, sin, 1.0)?; // (B, KV, T, D)
                                               // A view: CUDA's attention kernels read v's rows where the projection wrote them, the
                                               // other paths make it contiguous (`core`).
        let v = v.transpose(1, 2)?; // (B, KV, T, D)
        Ok((q, k, v))
    }

    /// Rotary embedding of the first `rotary_dim` dims of each head, the rest passed through
    /// (transformers' `apply_rotary_pos_emb` with a partial table), heads moved in front of
    /// time, all of it times `scale`.
    /// x: (B, T, N, D), cos/sin: (B, 1, T, Dr) -> (B, N, T, D)
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
        let (d, r) = (self.head_dim, self.rotary_dim);
        if r == d {
            return ops::rope_heads(x, cos, sin, scale);
        }
        let rot = ops::rope_heads(&x.narrow(3, 0, r)?.contiguous()?, cos, sin, scale)?; // (B, N, T, Dr)
        let mut pass = x.narrow(3, r, d - r)?.transpose(1, 2)?; // (B, N, T, D - Dr)
        if scale != 1.0 {
            pass = (pass * scale)?;
        }
        Ok(Tensor::cat(&[&rot, &pass], 3)?) // (B, N, T, D)
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: &Mask) -> Result<Tensor> {
        let (q, k, v) = self.qkv(x, cos, sin)?;
        let y = self.core(&q, &k, &v, mask)?;
        self.o_proj.forward(&y)
    }

    /// The attention over the whole sequence, between the token-wise projections: the only
    /// part of a layer where a token reads other tokens.
    /// q: (B, H, T, D), k, v: (B, KV, T, D) (v may be a view of (B, T, KV, D)) -> (B, T, H*D)
    pub(crate) fn core(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> Result<Tensor> {
        let (b, _, t, _) = q.dims4()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // Grouped-query attention without copying k and v per query head (HF's repeat_kv):
        // the n_rep = H / KV query heads that share a kv head are adjacent, so q viewed as
        // (B, KV, n_rep * T, D) multiplies each kv head once, in a larger matmul.
        let n_rep = h / kv;
        let q = q.reshape((b, kv, n_rep * t, d))?; // (B, H, T, D) -> (B, KV, n_rep*T, D), a view
        if let Mask::Chunked(m) = mask {
            if crate::kernels::flash_attn::takes(&q, k, v) {
                // CUDA's kernels: v read tokens-major, y written tokens-major, no transposes
                let y = crate::kernels::flash_attn::attention_tokens(&q, k, v, m, self.softcap)?;
                return Ok(y.reshape((b, t, h * d))?); // (B, T, H, D) -> (B, T, H*D)
            }
        }
        let v = &v.contiguous()?;

        // Scores in the compute dtype (q carries the 1/sqrt(D) scale, see `qkv`), softmax in
        // f32, cast back, as HF's eager attention; kept grouped (a reshape to (B, H, T, T) would
        // be a graph node whose backward zeroes and adds a score-sized buffer). Chunked (the
        // default) keeps no (T, T) scores; eager reads the causal mask of ops::attention_mask.
        let y = match mask {
            Mask::Dense(m) => match self.softcap {
                None => ops::causal_attention(&q, k, v, m)?,
                Some(cap) => ops::causal_attention_capped(&q, k, v, m, cap)?,
            },
            Mask::Chunked(m) => {
                crate::kernels::chunked::chunked_attention_capped(&q, k, v, m, self.softcap)?
            }
        }; // (B, KV, n_rep*T, D)
        let y = y.reshape((b, h, t, d))?; // (B, H, T, D)
        Ok(y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))?) // (B, T, H*D)
    }
}

/// The gate and up projections: two linears, or one fused `gate_up_proj` whose output is
/// gate, then up (Phi-3, as `Phi3MLP` chunks it).
#[derive(Clone)]
pub enum GateUpProj {
    Separate { gate_proj: Linear, up_proj: Linear },
    Fused { gate_up_proj: Linear },
}

/// Gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU (silu) or Gemma's GeGLU (gelu tanh).
#[derive(Clone)]
pub struct Mlp {
    pub gate_up: GateUpProj,
    pub down_proj: Linear,
    pub(crate) act: Activation,
}

impl Mlp {
    /// x: (B, T, C) -> (B, T, C), through (B, T, I)
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (g, u) = match &self.gate_up {
            GateUpProj::Separate { gate_proj, up_proj } => {
                let xa = adapter_input(&[gate_proj, up_proj], x)?; // one f32 copy of x
                (
                    gate_proj.forward_with(x, xa.as_ref())?,
                    up_proj.forward_with(x, xa.as_ref())?,
                )
            }
            GateUpProj::Fused { gate_up_proj } => {
                let gu = gate_up_proj.forward(x)?; // (B, T, 2 I)
                let i = gu.dim(2)? / 2;
                (
                    gu.narrow(2, 0, i)?.contiguous()?, // (B, T, I), gate
                    gu.narrow(2, i, i)?.contiguous()?, // (B, T, I), up
                )
            }
        };
        let a = match self.act {
            Activation::Silu => ops::swiglu(&g, &u)?,
            Activation::GeluTanh => ops::geglu(&g, &u)?,
        };
        self.down_proj.forward(&a)
    }
}

/// A layer's feed-forward: a dense gated MLP, or a mixture of experts (Qwen3-MoE, Mixtral).
#[derive(Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// x: (B, T, C) -> (B, T, C); a sparse block records its router on `tape`.
    pub(crate) fn forward(&self, x: &Tensor, tape: Option<&RouterTape>) -> Result<Tensor> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x, tape),
        }
    }
}

/// One pre-norm decoder layer. Cloning is cheap (tensors are shared), which activation
/// checkpointing uses to keep a handle on the layer in the graph.
#[derive(Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: FeedForward,
    /// Where the feed-forward's tensors live inside the layer (`mlp`, Mixtral's
    /// `block_sparse_moe`).
    pub(crate) mlp_path: &'static str,
    pub input_layernorm: Param,
    pub post_attention_layernorm: Param,
    /// Gemma 2's norms around the MLP (`post_attention_layernorm` then normalizes the
    /// attention output).
    pub pre_feedforward_layernorm: Option<Param>,
    pub post_feedforward_layernorm: Option<Param>,
    pub(crate) eps: f64,
    /// Gemma's RMSNorm, `x_normed * (1 + w)`.
    pub(crate) norm_plus_one: bool,
    /// A full-attention layer of a model whose other layers slide (Gemma 2's and 3's global
    /// layers): it reads [`RopeMask::full`]; the others read Gemma 3's [`RopeMask::local`].
    pub(crate) full_attention: bool,
}

impl DecoderLayer {
    /// x: (B, T, C) -> (B, T, C)
    pub fn forward(&self, x: &Tensor, rope: &RopeMask) -> Result<Tensor> {
        self.mlp_half(&self.attention_residual(x, rope)?, rope.router.as_deref())
    }

    /// The training forward's first half, [`DecoderLayer::attention_half`] with the batch's
    /// rotary tables and this layer's mask (Gemma 2's global layers: the full one).
    /// x: (B, T, C) -> (B, T, C)
    pub(crate) fn attention_residual(&self, x: &Tensor, rope: &RopeMask) -> Result<Tensor> {
        let (mask, cos, sin) = self.inputs(rope);
        self.attention_half(x, |h| self.self_attn.forward(h, cos, sin, mask))
    }

    /// This layer's mask (Gemma 2's global layers: the full one) and rotary tables (Gemma 3's
    /// sliding layers: their own).
    pub(crate) fn inputs<'a>(&self, rope: &'a RopeMask) -> (&'a Mask, &'a Tensor, &'a Tensor) {
        let mask = match (&rope.full, self.full_attention) {
            (Some(full), true) => full,
            _ => &rope.mask,
        };
        let (cos, sin) = match (&rope.local, self.full_attention) {
            (Some((cos, sin)), false) => (cos, sin),
            _ => (&rope.cos, &rope.sin),
        };
        (mask, cos, sin)
    }

    /// The attention half before its core, token-wise: input norm, q/k/v projections (with
    /// their adapters), q/k norms and rotary embedding. Activation checkpointing runs it in
    /// token tiles. x: (B, T, C), cos/sin: (B, 1, T, Dr) -> q (B, H, T, D), k, v (B, KV, T, D)
    pub(crate) fn attention_in(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let h = self.norm(x, &self.input_layernorm)?;
        self.self_attn.qkv(&h, cos, sin)
    }

    /// The attention half after its core, token-wise: o_proj (Gemma 2: and the attention
    /// output's norm), what the residual adds to x. y: (B, T, H*D) -> (B, T, C)
    pub(crate) fn attention_out(&self, y: &Tensor) -> Result<Tensor> {
        let a = self.self_attn.o_proj.forward(y)?;
        if self.post_feedforward_layernorm.is_some() {
            return self.norm(&a, &self.post_attention_layernorm);
        }
        Ok(a)
    }

    /// RMSNorm with this layer's weight convention. x: (..., C) -> (..., C)
    fn norm(&self, x: &Tensor, w: &Param) -> Result<Tensor> {
        norm(x, w, self.eps, self.norm_plus_one)
    }

    /// The layer's norm weights with their paths inside the layer (HF's names).
    pub fn norms(&self) -> Vec<(&'static str, &Param)> {
        let a = &self.self_attn;
        let mut v = Vec::with_capacity(6);
        v.extend(a.q_norm.iter().map(|p| ("self_attn.q_norm.weight", p)));
        v.extend(a.k_norm.iter().map(|p| ("self_attn.k_norm.weight", p)));
        v.push(("input_layernorm.weight", &self.input_layernorm));
        v.push((
            "post_attention_layernorm.weight",
            &self.post_attention_layernorm,
        ));
        if let Some(p) = &self.pre_feedforward_layernorm {
            v.push(("pre_feedforward_layernorm.weight", p));
        }
        if let Some(p) = &self.post_feedforward_layernorm {
            v.push(("post_feedforward_layernorm.weight", p));
        }
        v
    }

    /// The pre-norm block around an attention: x + attn(norm(x)), then + mlp(norm(.)). The
    /// training forward and the cached forward differ only in `attn`.
    /// x: (B, T, C) -> (B, T, C)
    pub(crate) fn block(
        &self,
        x: &Tensor,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.mlp_half(&self.attention_half(x, attn)?, None)
    }

    /// The block's first residual half: x + attn(norm(x)). x: (B, T, C) -> (B, T, C)
    pub(crate) fn attention_half(
        &self,
        x: &Tensor,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = self.norm(x, &self.input_layernorm)?;
        let a = attn(&h)?;
        if self.post_feedforward_layernorm.is_some() {
            // Gemma 2: x + norm(attn(norm(x)))
            return Ok((x + self.norm(&a, &self.post_attention_layernorm)?)?);
        }
        Ok((x + a)?)
    }

    /// The block's second residual half: x + mlp(norm(x)) (Gemma 2: x + norm(mlp(norm(x)))
    /// with its pre- and post-feed-forward norms). Token-wise (each row of the output reads
    /// only its own row), which activation checkpointing uses to run it in tiles of tokens.
    /// A sparse feed-forward records its router on `tape` (the load-balancing loss).
    /// x: (B, T, C) -> (B, T, C)
    pub(crate) fn mlp_half(&self, x: &Tensor, tape: Option<&RouterTape>) -> Result<Tensor> {
        if let (Some(pre), Some(post)) = (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            let h = self.norm(x, pre)?;
            let m = self.norm(&self.mlp.forward(&h, tape)?, post)?;
            return Ok((x + m)?);
        }
        let h = self.norm(x, &self.post_attention_layernorm)?;
        Ok((x + self.mlp.forward(&h, tape)?)?)
    }

    /// Every linear layer of this block with its path relative to the layer, in the order of
    /// `DecoderConfig::layer_linears` (HF's names: `self_attn.q_proj`, ..., or Phi-3's
    /// `self_attn.qkv_proj`, ...); a sparse block's router and experts in transformers 4.57's
    /// per-expert names (`mlp.gate`, `mlp.experts.0.gate_proj`, ...).
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let a = &self.self_attn;
        let mut v: Vec<(String, &Linear)> = match &a.qkv {
            QkvProj::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => vec![
                ("self_attn.q_proj".into(), q_proj),
                ("self_attn.k_proj".into(), k_proj),
                ("self_attn.v_proj".into(), v_proj),
            ],
            QkvProj::Fused { qkv_proj } => vec![("self_attn.qkv_proj".into(), qkv_proj)],
        };
        v.push(("self_attn.o_proj".into(), &a.o_proj));
        let p = self.mlp_path;
        match &self.mlp {
            FeedForward::Dense(m) => {
                match &m.gate_up {
                    GateUpProj::Separate { gate_proj, up_proj } => {
                        v.push((format!("{p}.gate_proj"), gate_proj));
                        v.push((format!("{p}.up_proj"), up_proj));
                    }
                    GateUpProj::Fused { gate_up_proj } => {
                        v.push((format!("{p}.gate_up_proj"), gate_up_proj))
                    }
                }
                v.push((format!("{p}.down_proj"), &m.down_proj));
            }
            FeedForward::Sparse(m) => {
                v.push((format!("{p}.gate"), &m.gate));
                for (e, x) in m.experts.iter().enumerate() {
                    for (n, lin) in x.named(&m.names) {
                        v.push((format!("{p}.experts.{e}.{n}"), lin));
                    }
                }
                if let Some(s) = &m.shared {
                    for (n, lin) in s.expert.named(&m.names) {
                        v.push((format!("{p}.shared_expert.{n}"), lin));
                    }
                    v.push((format!("{p}.shared_expert_gate"), &s.gate));
                }
            }
        }
        v
    }

    /// [`DecoderLayer::linears`], mutable (for attaching adapters).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let a = &mut self.self_attn;
        let mut v: Vec<(String, &mut Linear)> = match &mut a.qkv {
            QkvProj::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => vec![
                ("self_attn.q_proj".into(), q_proj),
                ("self_attn.k_proj".into(), k_proj),
                ("self_attn.v_proj".into(), v_proj),
            ],
            QkvProj::Fused { qkv_proj } => vec![("self_attn.qkv_proj".into(), qkv_proj)],
        };
        v.push(("self_attn.o_proj".into(), &mut a.o_proj));
        let p = self.mlp_path;
        match &mut self.mlp {
            FeedForward::Dense(m) => {
                match &mut m.gate_up {
                    GateUpProj::Separate { gate_proj, up_proj } => {
                        v.push((format!("{p}.gate_proj"), gate_proj));
                        v.push((format!("{p}.up_proj"), up_proj));
                    }
                    GateUpProj::Fused { gate_up_proj } => {
                        v.push((format!("{p}.gate_up_proj"), gate_up_proj))
                    }
                }
                v.push((format!("{p}.down_proj"), &mut m.down_proj));
            }
            FeedForward::Sparse(m) => {
                v.push((format!("{p}.gate"), &mut m.gate));
                let names = m.names;
                for (e, x) in m.experts.iter_mut().enumerate() {
                    for (n, lin) in x.named_mut(&names) {
                        v.push((format!("{p}.experts.{e}.{n}"), lin));
                    }
                }
                if let Some(s) = &mut m.shared {
                    for (n, lin) in s.expert.named_mut(&names) {
                        v.push((format!("{p}.shared_expert.{n}"), lin));
                    }
                    v.push((format!("{p}.shared_expert_gate"), &mut s.gate));
                }
            }
        }
        v
    }
}

/// The per-batch inputs every layer shares: rotary tables and the additive attention mask.
#[derive(Clone)]
pub struct RopeMask {
    /// (B, 1, T, Dr), Dr = rotary dim
    pub cos: Tensor,
    pub sin: Tensor,
    /// The mask with the config's sliding window (if any).
    pub mask: Mask,
    /// Without the window, for the full-attention layers of a model whose other layers slide
    /// (Gemma 2); None when every layer reads `mask`.
    pub full: Option<Mask>,
    /// Gemma 3: the sliding layers' rotary tables (cos, sin), (B, 1, T, Dr); None when every
    /// layer reads `cos` / `sin`.
    pub local: Option<(Tensor, Tensor)>,
    /// A mixture of experts' forward that adds the load-balancing loss: where its sparse
    /// blocks record their routers.
    pub router: Option<std::sync::Arc<RouterTape>>,
}

/// RMSNorm of x with weight `w`: Llama's, or Gemma's `(1 + w)` when `plus_one`.
/// x: (..., C) -> (..., C)
pub(crate) fn norm(x: &Tensor, w: &Param, eps: f64, plus_one: bool) -> Result<Tensor> {
    let w = enter(w.tensor());
    if plus_one {
        ops::rms_norm_plus_one(x, &w, eps)
    } else {
        ops::rms_norm(x, &w, eps)
    }
}

/// The rotary frequencies of a model, and with LongRoPE the long ones and the scale of cos / sin.
#[derive(Clone, Debug)]
pub(crate) struct Rotary {
    /// Dr / 2 frequencies (with LongRoPE: the short factors').
    inv_freq: Vec<f32>,
    /// LongRoPE: (original context, the long factors' frequencies).
    long: Option<(usize, Vec<f32>)>,
    /// LongRoPE's attention factor on cos / sin; 1 otherwise.
    mscale: f64,
    /// Gemma 3: the sliding layers' Dr / 2 frequencies (`rope_local_base_freq`, unscaled).
    local: Option<Vec<f32>>,
}

impl Rotary {
    pub(crate) fn new(c: &DecoderConfig) -> Self {
        let long = match &c.rope_scaling {
            Some(RopeScaling::LongRope {
                long_factor,
                original_max_position_embeddings,
                attention_factor,
                ..
            }) => Some((
                (*original_max_position_embeddings, *attention_factor),
                ops::longrope_inv_freq(c.rotary_dim, c.rope_theta, long_factor),
            )),
            _ => None,
        };
        Self {
            inv_freq: ops::rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling.as_ref()),
            mscale: long.as_ref().map_or(1.0, |((_, a), _)| *a),
            long: long.map(|((n, _), f)| (n, f)),
            local: c
                .variant
                .rope_local_base_freq
                .map(|theta| ops::rope_inv_freq(c.rotary_dim, theta, None)),
        }
    }

    /// Gemma 3's sliding-layer tables at `positions`, None for the other families.
    /// positions: (B, T) -> cos, sin: (B, 1, T, Dr)
    pub(crate) fn local_tables(
        &self,
        positions: &Tensor,
        dtype: DType,
    ) -> Result<Option<(Tensor, Tensor)>> {
        self.local
            .as_ref()
            .map(|inv| ops::rope_tables_scaled(positions, inv, 1.0, dtype))
            .transpose()
    }

    /// The tables for the positions of one sequence of `seq_len` positions (its largest
    /// position + 1). With LongRoPE the long factors when seq_len > the original context, else
    /// the short ones: transformers' `dynamic_rope_update` (4.57 and 5.x alike) decides from
    /// max(position_ids) + 1 of the forward call.
    /// positions: (B, T) -> cos, sin: (B, 1, T, Dr)
    pub(crate) fn tables(
        &self,
        positions: &Tensor,
        seq_len: usize,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let inv = match &self.long {
            Some((original, long)) if seq_len > *original => long,
            _ => &self.inv_freq,
        };
        ops::rope_tables_scaled(positions, inv, self.mscale, dtype)
    }

    /// The tables of a batch whose rows hold the sequences `segments` marks. With LongRoPE each
    /// sequence (a run of one segment id) takes the short or long factors by its own length, so
    /// a row gives what transformers gives it run alone (the parity fixtures' rows), whatever
    /// it is padded or packed with. (transformers decides once per call from the whole batch's
    /// max(position_ids) + 1, so its padded or packed batches mix lengths; the trainer marks
    /// padding as a segment of its own, `tallow_trainer::batch`.)
    /// positions: (B, T) -> cos, sin: (B, 1, T, Dr)
    pub(crate) fn tables_for_segments(
        &self,
        positions: &Tensor,
        segments: &[Vec<u32>],
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let Some((original, _)) = &self.long else {
            return self.tables(positions, 0, dtype);
        };
        // 1 where a token's sequence is longer than the original context, by row.
        let long: Vec<Vec<f32>> = segments
            .iter()
            .map(|row| {
                row.chunk_by(|a, b| a == b)
                    .flat_map(|run| {
                        let flag = if run.len() > *original { 1f32 } else { 0f32 };
                        std::iter::repeat_n(flag, run.len())
                    })
                    .collect()
            })
            .collect();
        let all = |v: f32| long.iter().flatten().all(|&x| x == v);
        let t = segments.first().map_or(0, Vec::len);
        if all(0.0) {
            return self.tables(positions, 0, dtype);
        }
        if all(1.0) {
            return self.tables(positions, original + 1, dtype);
        }
        let (cs, ss) = self.tables(positions, 0, dtype)?; // (B, 1, T, Dr)
        let (cl, sl) = self.tables(positions, original + 1, dtype)?;
        let flat: Vec<f32> = long.into_iter().flatten().collect();
        let m = Tensor::from_vec(flat, (segments.len(), 1, t, 1), positions.device())?
            .to_dtype(dtype)?; // (B, 1, T, 1)
        let pick = |short: &Tensor, long: &Tensor| -> Result<Tensor> {
            Ok((short.broadcast_mul(&(1.0 - &m)?)? + long.broadcast_mul(&m)?)?)
        };
        Ok((pick(&cs, &cl)?, pick(&ss, &sl)?))
    }

    /// LongRoPE's original context: a cached generation that grows past it is recomputed with
    /// the long factors (`crate::generate`).
    pub(crate) fn long_after(&self) -> Option<usize> {
        self.long.as_ref().map(|(n, _)| *n)
    }
}

/// `model.attention`: how the full-sequence forward computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// Blocks of queries, nothing T x T kept ([`crate::kernels::chunked`]); the default.
    #[default]
    Chunked,
    /// HF's eager attention: the (T, T) mask, scores and probabilities of every layer.
    Eager,
}

/// The attention mask of a batch, in the form its [`AttentionImpl`] reads.
#[derive(Clone)]
pub enum Mask {
    /// (B, 1, T, T), 0 or -inf
    Dense(Tensor),
    /// Per-token segment ids and the window ([`crate::kernels::chunked::AttentionMask`]).
    Chunked(crate::kernels::chunked::AttentionMask),
}
