//! The decoder-only causal LM shared by the Llama, Qwen2 and Qwen3 families: written once, with
//! the family differences (biases, qk-norm, head_dim, rope scaling, tying) taken from
//! [`DecoderConfig`]. Tensor names follow the HF safetensors keys (`model.layers.0.self_attn.q_proj.weight`).
//!
//! This is training code: the forward is cache-free, returns every position, and every op has a
//! backward. Inference with a key/value cache reuses these layers from [`crate::generate`]. Shape legend: B = batch, T = time, C = hidden size, H = heads, KV = key/value heads,
//! D = head dim, I = intermediate size, V = vocab.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::checkpointing::Checkpointing;
use crate::config::{Activation, DecoderConfig};
use crate::error::{ModelError, Result};
use crate::layout::{LinearSpec, LINEAR_PATHS};
use crate::linear::{adapter_input, Base, Linear, Param};
use crate::no_grad::enter;
use crate::ops;
use crate::quant::nf4::{Nf4Options, Nf4Weight};
use crate::weights::Weights;

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Storage and compute dtype of the base weights.
    pub dtype: DType,
    pub device: Device,
    /// Make every base weight a trainable variable (full fine-tuning). False: all frozen.
    pub train_base: bool,
    /// Some: store the linear weights of the decoder layers in NF4 (QLoRA), quantized at load one
    /// tensor at a time; embeddings, norms and lm_head stay in `dtype`. A bitsandbytes 4-bit
    /// checkpoint loads as NF4 whatever this says.
    pub quantize: Option<Nf4Options>,
}

impl LoadOptions {
    pub fn frozen(dtype: DType, device: &Device) -> Self {
        Self {
            dtype,
            device: device.clone(),
            train_base: false,
            quantize: None,
        }
    }

    /// [`LoadOptions::frozen`] with the decoder's linear weights in NF4.
    pub fn nf4(dtype: DType, device: &Device, double_quant: bool) -> Self {
        Self {
            quantize: Some(Nf4Options { double_quant }),
            ..Self::frozen(dtype, device)
        }
    }
}

/// Multi-head self-attention with grouped-query heads and rotary embedding.
#[derive(Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen3: RMSNorm over D on each q / k head.
    pub q_norm: Option<Param>,
    pub k_norm: Option<Param>,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
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
    /// x: (B, T, C), cos/sin: (B, 1, T, D) -> q (B, H, T, D), k and v (B, KV, T, D)
    pub(crate) fn qkv(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // x in f32 once for the three adapters (bf16 models), not once per projection.
        let xa = adapter_input(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?;
        let xa = xa.as_ref();
        let q = self.q_proj.forward_with(x, xa)?.reshape((b, t, h, d))?; // (B, T, H, D)
        let k = self.k_proj.forward_with(x, xa)?.reshape((b, t, kv, d))?; // (B, T, KV, D)
        let v = self.v_proj.forward_with(x, xa)?.reshape((b, t, kv, d))?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (
                ops::rms_norm(&q, &enter(qn.tensor()), self.eps)?,
                ops::rms_norm(&k, &enter(kn.tensor()), self.eps)?,
            ),
            _ => (q, k),
        };
        // Heads moved in front of time by the rotary op itself (one pass on the CPU). The
        // attention scale (1/sqrt(D), or Gemma 2's) is folded into q's rotary embedding (no
        // extra tensor), so the graph keeps no unscaled (B, H, T, T) scores.
        let q = ops::rope_heads(&q, cos, sin, self.scale)?; // (B, H, T, D)
        let k = ops::rope_heads(&k, cos, sin, 1.0)?; // (B, KV, T, D)
        let v = v.transpose(1, 2)?.contiguous()?; // (B, KV, T, D)
        Ok((q, k, v))
    }

    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: &Mask) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = self.qkv(x, cos, sin)?;
        // Grouped-query attention without copying k and v per query head (HF's repeat_kv):
        // the n_rep = H / KV query heads that share a kv head are adjacent, so q viewed as
        // (B, KV, n_rep * T, D) multiplies each kv head once, in a larger matmul.
        let n_rep = h / kv;
        let q = q.reshape((b, kv, n_rep * t, d))?; // (B, H, T, D) -> (B, KV, n_rep*T, D), a view

        // Scores in the compute dtype (q carries the 1/sqrt(D) scale, see `qkv`), softmax in
        // f32, cast back, as HF's eager attention; kept grouped (a reshape to (B, H, T, T) would
        // be a graph node whose backward zeroes and adds a score-sized buffer). Chunked (the
        // default) keeps no (T, T) scores; eager reads the causal mask of ops::attention_mask.
        let y = match mask {
            Mask::Dense(m) => match self.softcap {
                None => ops::causal_attention(&q, &k, &v, m)?,
                Some(cap) => ops::causal_attention_capped(&q, &k, &v, m, cap)?,
            },
            Mask::Chunked(m) => {
                crate::chunked::chunked_attention_capped(&q, &k, &v, m, self.softcap)?
            }
        }; // (B, KV, n_rep*T, D)
        let y = y.reshape((b, h, t, d))?; // (B, H, T, D)
        let y = y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))?; // (B, T, H*D)
        self.o_proj.forward(&y)
    }
}

/// Gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU (silu) or Gemma's GeGLU (gelu tanh).
#[derive(Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub(crate) act: Activation,
}

impl Mlp {
    /// x: (B, T, C) -> (B, T, C), through (B, T, I)
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let xa = adapter_input(&[&self.gate_proj, &self.up_proj], x)?; // one f32 copy of x
        let g = self.gate_proj.forward_with(x, xa.as_ref())?;
        let u = self.up_proj.forward_with(x, xa.as_ref())?;
        let a = match self.act {
            Activation::Silu => ops::swiglu(&g, &u)?,
            Activation::GeluTanh => ops::geglu(&g, &u)?,
        };
        self.down_proj.forward(&a)
    }
}

/// One pre-norm decoder layer. Cloning is cheap (tensors are shared), which activation
/// checkpointing uses to keep a handle on the layer in the graph.
#[derive(Clone)]
pub struct DecoderLayer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Param,
    pub post_attention_layernorm: Param,
    /// Gemma 2's norms around the MLP (`post_attention_layernorm` then normalizes the
    /// attention output).
    pub pre_feedforward_layernorm: Option<Param>,
    pub post_feedforward_layernorm: Option<Param>,
    pub(crate) eps: f64,
    /// Gemma's RMSNorm, `x_normed * (1 + w)`.
    pub(crate) norm_plus_one: bool,
    /// A full-attention layer of a model whose other layers slide (Gemma 2's global layers):
    /// it reads [`RopeMask::full`].
    pub(crate) full_attention: bool,
}

impl DecoderLayer {
    /// x: (B, T, C) -> (B, T, C)
    pub fn forward(&self, x: &Tensor, rope: &RopeMask) -> Result<Tensor> {
        let mask = match (&rope.full, self.full_attention) {
            (Some(full), true) => full,
            _ => &rope.mask,
        };
        self.block(x, |h| self.self_attn.forward(h, &rope.cos, &rope.sin, mask))
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
        let h = self.norm(x, &self.input_layernorm)?;
        if let (Some(pre), Some(post)) = (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            // Gemma 2: x + norm(attn(norm(x))), then + norm(mlp(norm(.)))
            let a = self.norm(&attn(&h)?, &self.post_attention_layernorm)?;
            let x = (x + a)?;
            let h = self.norm(&x, pre)?;
            let m = self.norm(&self.mlp.forward(&h)?, post)?;
            return Ok((&x + m)?);
        }
        let x = (x + attn(&h)?)?;
        let h = self.norm(&x, &self.post_attention_layernorm)?;
        Ok((&x + self.mlp.forward(&h)?)?)
    }

    /// Every linear layer of this block with its path relative to the layer
    /// ([`LINEAR_PATHS`], HF's names: `self_attn.q_proj`, ...).
    pub fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let (a, m) = (&self.self_attn, &self.mlp);
        let l = [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ];
        LINEAR_PATHS.into_iter().zip(l).collect()
    }

    /// [`DecoderLayer::linears`], mutable (for attaching adapters).
    pub fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        let l = [
            &mut a.q_proj,
            &mut a.k_proj,
            &mut a.v_proj,
            &mut a.o_proj,
            &mut m.gate_proj,
            &mut m.up_proj,
            &mut m.down_proj,
        ];
        LINEAR_PATHS.into_iter().zip(l).collect()
    }
}

/// The per-batch inputs every layer shares: rotary tables and the additive attention mask.
#[derive(Clone)]
pub struct RopeMask {
    /// (B, 1, T, D)
    pub cos: Tensor,
    pub sin: Tensor,
    /// The mask with the config's sliding window (if any).
    pub mask: Mask,
    /// Without the window, for the full-attention layers of a model whose other layers slide
    /// (Gemma 2); None when every layer reads `mask`.
    pub full: Option<Mask>,
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

/// `*ForCausalLM`: embeddings, decoder layers, final norm, LM head (tied or not).
pub struct CausalLM {
    pub config: DecoderConfig,
    /// (V, C)
    pub embed_tokens: Param,
    pub layers: Vec<DecoderLayer>,
    /// (C)
    pub norm: Param,
    /// (V, C); None when tied to `embed_tokens`.
    pub lm_head: Option<Param>,
    pub(crate) inv_freq: Vec<f32>,
    dtype: DType,
    device: Device,
    /// Activation checkpointing, when on (see [`crate::checkpointing`]).
    checkpointing: Option<Checkpointing>,
    /// How the training / eval forward computes attention (`model.attention`).
    pub attention: AttentionImpl,
}

/// `model.attention`: how the full-sequence forward computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionImpl {
    /// Blocks of queries, nothing T x T kept ([`crate::chunked`]); the default.
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
    /// Per-token segment ids and the window ([`crate::chunked::AttentionMask`]).
    Chunked(crate::chunked::AttentionMask),
}

impl CausalLM {
    /// Loads an HF-layout model directory (config.json + safetensors).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let config = DecoderConfig::from_dir(dir)?;
        let weights = Weights::from_dir(dir)?;
        Self::from_weights(config, &weights, opts)
    }

    pub fn from_weights(config: DecoderConfig, w: &Weights, opts: &LoadOptions) -> Result<Self> {
        let c = &config;
        let (dt, dev, tr) = (opts.dtype, &opts.device, opts.train_base);
        let param = |name: &str, shape: &[usize]| -> Result<Param> {
            Param::new(w.load(name, shape, dt, dev)?, tr)
        };
        if opts.quantize.is_some() && tr {
            return Err(ModelError::Invalid(
                "NF4 base weights are frozen: quantization works with LoRA (QLoRA) only; \
                 for full fine-tuning load the model unquantized"
                    .into(),
            ));
        }
        // A decoder linear weight: dense, quantized to NF4 right after loading (the
        // full-precision tensor is dropped before the next one is read), or a bitsandbytes 4-bit
        // tensor read as it is.
        let base = |name: &str, out: usize, inp: usize| -> Result<Base> {
            if w.dtype(name)? == DType::U8 {
                if tr {
                    return Err(ModelError::Invalid(format!(
                        "{}: `{name}` is 4-bit (a bitsandbytes checkpoint): its weights cannot \
                         be trained; use LoRA, or the unquantized model for full fine-tuning",
                        w.dir().display()
                    )));
                }
                return Ok(Base::Nf4(Arc::new(Nf4Weight::from_bnb(
                    w,
                    name,
                    (out, inp),
                    dt,
                    dev,
                )?)));
            }
            match opts.quantize {
                None => Ok(Base::Dense(param(name, &[out, inp])?)),
                Some(q) => {
                    // Quantized on the CPU from f32 (the kernel path), then moved: the device
                    // only ever receives the 4-bit weight.
                    let full = w.load(name, &[out, inp], DType::F32, &Device::Cpu)?;
                    let mut nf4 = Nf4Weight::quantize(&full, q.double_quant)?;
                    drop(full);
                    nf4.dtype = dt;
                    Ok(Base::Nf4(Arc::new(nf4.to_device(dev)?)))
                }
            }
        };
        let linear = |name: &str, s: &LinearSpec| -> Result<Linear> {
            Ok(Linear {
                weight: base(&format!("{name}.weight"), s.out, s.inp)?,
                bias: if s.bias {
                    Some(param(&format!("{name}.bias"), &[s.out])?)
                } else {
                    None
                },
                adapter: None,
            })
        };
        let (hs, d) = (c.hidden_size, c.head_dim);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            // The seven linears in LINEAR_PATHS order (crate::layout).
            let mut lins = c
                .layer_linears()
                .iter()
                .map(|s| linear(&format!("{p}.{}", s.path), s))
                .collect::<Result<Vec<_>>>()?
                .into_iter();
            let mut next = || lins.next().expect("seven linears");
            let norm = |n: &str| param(&format!("{p}.{n}"), &[d]);
            let self_attn = Attention {
                q_proj: next(),
                k_proj: next(),
                v_proj: next(),
                o_proj: next(),
                q_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.q_norm.weight"))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.k_norm.weight"))
                    .transpose()?,
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: d,
                eps: c.rms_norm_eps,
                scale: c.attention_scale(),
                softcap: c.variant.attn_logit_softcapping,
            };
            let mlp = Mlp {
                gate_proj: next(),
                up_proj: next(),
                down_proj: next(),
                act: c.variant.act,
            };
            let sandwich = |n: &str| -> Result<Option<Param>> {
                c.variant
                    .sandwich_norms
                    .then(|| param(&format!("{p}.{n}.weight"), &[hs]))
                    .transpose()
            };
            layers.push(DecoderLayer {
                self_attn,
                mlp,
                input_layernorm: param(&format!("{p}.input_layernorm.weight"), &[hs])?,
                post_attention_layernorm: param(
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[hs],
                )?,
                pre_feedforward_layernorm: sandwich("pre_feedforward_layernorm")?,
                post_feedforward_layernorm: sandwich("post_feedforward_layernorm")?,
                eps: c.rms_norm_eps,
                norm_plus_one: c.variant.norm_plus_one,
                full_attention: c.sliding_window.is_some() && c.layer_window(i).is_none(),
            });
        }
        let embed_tokens = param("model.embed_tokens.weight", &[c.vocab_size, hs])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(param("lm_head.weight", &[c.vocab_size, hs])?)
        };
        Ok(Self {
            inv_freq: ops::rope_inv_freq(d, c.rope_theta, c.rope_scaling.as_ref()),
            embed_tokens,
            layers,
            norm: param("model.norm.weight", &[hs])?,
            lm_head,
            dtype: dt,
            device: dev.clone(),
            config,
            checkpointing: None,
            attention: AttentionImpl::default(),
        })
    }

    /// Activation checkpointing of every `every`-th decoder layer (`None`: off). With it on,
    /// the gradients of the checkpointed layers' variables do not come out of `backward()`:
    /// collect them with [`CausalLM::take_checkpoint_grads`] after each backward.
    pub fn set_checkpointing(&mut self, every: Option<usize>) {
        self.checkpointing = every.map(|e| Checkpointing::new(e.max(1)));
    }

    /// The gradients of variables inside checkpointed layers from the backward passes since the
    /// last call (one store per layer and backward). Empty when checkpointing is off.
    pub fn take_checkpoint_grads(&self) -> Vec<candle_core::backprop::GradStore> {
        self.checkpointing
            .as_ref()
            .map(Checkpointing::take_grads)
            .unwrap_or_default()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The output projection (V, C): `lm_head.weight`, or the embeddings when tied.
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens).tensor()
    }

    /// Rotary tables and mask for a batch. `segments` (B rows of T ids) marks rows packed
    /// together; None = one sequence per row.
    pub fn rope_mask(&self, b: usize, t: usize, segments: Option<&[Vec<u32>]>) -> Result<RopeMask> {
        let plain;
        let segments = match segments {
            Some(s) => s,
            None => {
                plain = vec![vec![0u32; t]; b];
                &plain
            }
        };
        if segments.len() != b || segments.iter().any(|s| s.len() != t) {
            return Err(ModelError::Invalid(format!(
                "segments must be {b} rows of {t} ids"
            )));
        }
        let positions = ops::positions_from_segments(segments, &self.device)?; // (B, T)
        let (cos, sin) = ops::rope_tables(&positions, &self.inv_freq, self.dtype)?;
        let make = |window: Option<usize>| -> Result<Mask> {
            Ok(match self.attention {
                AttentionImpl::Eager => Mask::Dense(ops::attention_mask(
                    segments,
                    window,
                    self.dtype,
                    &self.device,
                )?),
                AttentionImpl::Chunked => Mask::Chunked(crate::chunked::AttentionMask::new(
                    segments,
                    window,
                    &self.device,
                )?),
            })
        };
        let mask = make(self.config.sliding_window)?;
        // Gemma 2's global layers: a second mask without the window.
        let full = if self.layers.iter().any(|l| l.full_attention) {
            Some(make(None)?)
        } else {
            None
        };
        Ok(RopeMask {
            cos,
            sin,
            mask,
            full,
        })
    }

    /// Embeds token ids. input_ids: (B, T) u32 -> (B, T, C)
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let w = enter(self.embed_tokens.tensor());
        let flat = input_ids.flatten_all()?; // (B*T)
        let x = w
            .index_select(&flat, 0)?
            .reshape((b, t, self.config.hidden_size))?;
        if !self.config.variant.embed_scale {
            return Ok(x);
        }
        // Gemma: x * sqrt(C), the factor first rounded to the compute dtype as transformers'
        // `torch.tensor(hidden_size**0.5, dtype=hidden.dtype)`.
        let normalizer = Tensor::new(self.config.hidden_size as f64, &Device::Cpu)?
            .sqrt()?
            .to_dtype(self.dtype)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        Ok((x * normalizer)?)
    }

    /// Final hidden states after the last norm, for every position.
    /// input_ids: (B, T) u32 -> (B, T, C)
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        segments: Option<&[Vec<u32>]>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        let rope = self.rope_mask(b, t, segments)?;
        let mut x = self.embed(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = match &self.checkpointing {
                Some(c) if i % c.every == 0 => c.forward(layer, &x, &rope)?,
                _ => layer.forward(&x, &rope)?,
            };
        }
        self.final_norm(&x)
    }

    /// The final norm. x: (B, T, C) -> (B, T, C)
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        norm(x, &self.norm, c.rms_norm_eps, c.variant.norm_plus_one)
    }

    /// `final_logit_softcapping` (Gemma 2) on logits in any shape; the identity otherwise.
    pub fn cap_logits(&self, logits: Tensor) -> Result<Tensor> {
        match self.config.variant.final_logit_softcapping {
            Some(cap) => ops::softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// Full logits, upcast to f32 (f64 for an f64 model). Only for small inputs (tests, debugging):
    /// training and eval use the chunked loss in [`crate::loss`].
    /// input_ids: (B, T) -> (B, T, V)
    pub fn logits(&self, input_ids: &Tensor) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, None)?;
        let logits = self.cap_logits(h.broadcast_matmul(&self.lm_head_weight().t()?)?)?;
        Ok(logits.to_dtype(ops::upcast(self.dtype))?)
    }

    /// Every dense weight with its HF safetensors name (tied lm_head listed once, as the
    /// embeddings). NF4 linear weights are not listed: see [`CausalLM::nf4_weights`].
    pub fn named_params(&self) -> Vec<(String, &Param)> {
        let mut out: Vec<(String, &Param)> =
            vec![("model.embed_tokens.weight".into(), &self.embed_tokens)];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            for (n, lin) in l.linears() {
                if let Some(w) = lin.weight.param() {
                    out.push((format!("{p}.{n}.weight"), w));
                }
                if let Some(b) = &lin.bias {
                    out.push((format!("{p}.{n}.bias"), b));
                }
            }
            for (n, w) in l.norms() {
                out.push((format!("{p}.{n}"), w));
            }
        }
        out.push(("model.norm.weight".into(), &self.norm));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".into(), h));
        }
        out
    }

    /// Every NF4 linear weight with its HF safetensors name.
    pub fn nf4_weights(&self) -> Vec<(String, &Arc<Nf4Weight>)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (n, lin) in l.linears() {
                if let Base::Nf4(w) = &lin.weight {
                    out.push((format!("model.layers.{i}.{n}.weight"), w));
                }
            }
        }
        out
    }
}
