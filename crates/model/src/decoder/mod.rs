//! The decoder-only causal LM shared by every family (`crate::families`): written once, with
//! the family differences (biases, qk-norm, head_dim, rope scaling, tying, Phi-3's fused
//! projections and partial rotary, Gemma's norms and soft-caps) taken from [`DecoderConfig`]. Tensor names follow the HF safetensors keys (`model.layers.0.self_attn.q_proj.weight`).
//!
//! This is training code: the forward is cache-free, returns every position, and every op has a
//! backward. Inference with a key/value cache reuses these layers from [`crate::generate`]. Shape legend: B = batch, T = time, C = hidden size, H = heads, KV = key/value heads,
//! D = head dim, I = intermediate size, V = vocab.

pub mod checkpointing;
pub mod layer;
pub mod moe;
mod offload;
pub mod save;

use layer::{norm, Rotary};
pub use layer::{
    Attention, AttentionImpl, DecoderLayer, FeedForward, GateUpProj, Mask, Mlp, QkvProj, RopeMask,
};
pub use moe::{Expert, RouterTape, SharedExpert, SparseMoe};

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::layout::LinearSpec;
use crate::config::{DecoderConfig, Moe};
use crate::decoder::checkpointing::Checkpointing;
use crate::error::{ModelError, Result};
use crate::io::weights::Weights;
use crate::kernels::ggml::GgmlWeight;
use crate::kernels::nf4::{Nf4Options, Nf4Weight};
use crate::nn::linear::{Base, Linear, Param};
use crate::nn::no_grad::enter;
use crate::nn::ops;

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
    /// A GGUF checkpoint's decoder linears stored in a block format (Q4_K, Q8_0, ...) stay in it,
    /// dequantized for each matmul (`crate::kernels::ggml`; `model.quantize = "keep"`); false:
    /// dequantized into `dtype` at load. Plain-float tensors load into `dtype` either way.
    pub keep_blocks: bool,
    /// `config.json` keys to read as if absent (`model.ignore_config_keys`): for a key tallow
    /// refuses that the user knows has no effect (`crate::config::hf_keys`).
    pub ignore_config_keys: Vec<String>,
}

impl LoadOptions {
    pub fn frozen(dtype: DType, device: &Device) -> Self {
        Self {
            dtype,
            device: device.clone(),
            train_base: false,
            quantize: None,
            keep_blocks: false,
            ignore_config_keys: Vec::new(),
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
    pub(crate) rotary: Rotary,
    dtype: DType,
    device: Device,
    /// Activation checkpointing, when on (see [`crate::decoder::checkpointing`]).
    checkpointing: Option<Checkpointing>,
    /// How the training / eval forward computes attention (`model.attention`).
    pub attention: AttentionImpl,
}

impl CausalLM {
    /// Loads an HF-layout model directory (config.json + safetensors).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        if opts.keep_blocks && !dir.join(crate::io::gguf::LINK).exists() {
            return Err(ModelError::Invalid(format!(
                "{}: quantize \"keep\" keeps a GGUF file's quantized blocks, and this model is \
                 not a GGUF file: use \"nf4\" to quantize it at load, or \"none\"",
                dir.display()
            )));
        }
        let config = DecoderConfig::from_dir_ignoring(dir, &opts.ignore_config_keys)?;
        let mut weights = Weights::from_dir(dir)?;
        if config.text_tower {
            weights = weights.text_tower();
        }
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
        if opts.keep_blocks && tr {
            return Err(ModelError::Invalid(
                "weights kept in their GGUF block format are frozen: keeping them works with \
                 LoRA only; for full fine-tuning load the GGUF dequantized (model.quantize = \
                 \"none\")"
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
            if opts.keep_blocks {
                if let Some(g) = GgmlWeight::from_gguf(w, name, (out, inp), dt, dev)? {
                    return Ok(Base::Ggml(Arc::new(g)));
                }
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
        // A weight already read (a slice of transformers 5's fused experts), on the CPU in f32
        // or `dt`: dense or NF4 as `base` makes it.
        let base_of = |full: Tensor| -> Result<Base> {
            match opts.quantize {
                None => Ok(Base::Dense(Param::new(
                    full.to_dtype(dt)?.to_device(dev)?,
                    tr,
                )?)),
                Some(q) => {
                    let mut nf4 = Nf4Weight::quantize(&full.to_dtype(DType::F32)?, q.double_quant)?;
                    nf4.dtype = dt;
                    Ok(Base::Nf4(Arc::new(nf4.to_device(dev)?)))
                }
            }
        };
        let plain = |weight: Base| Linear {
            weight,
            bias: None,
            adapter: None,
        };
        // A gated MLP stored as its three linears under `q` (an expert of the per-expert layout,
        // the shared expert), `width` wide.
        let named_expert = |moe: &Moe, q: &str, width: usize| -> Result<Expert> {
            let [g, u, d] = moe.names.linears(width, hs);
            let load = |(n, o, i): (&str, usize, usize)| -> Result<Linear> {
                Ok(plain(base(&format!("{q}.{n}.weight"), o, i)?))
            };
            Ok(Expert {
                gate_proj: load(g)?,
                up_proj: load(u)?,
                down_proj: load(d)?,
            })
        };
        // A sparse block at `p` (`model.layers.3`): its router, and its experts in either
        // layout, per-expert linears (transformers 4.57, and 5's default save) or fused 3-D
        // tensors (5.x's `save_original_format=False`): `mlp.experts.gate_up_proj` (E, 2 I, C),
        // gate rows then up rows, and `mlp.experts.down_proj` (E, C, I).
        let sparse_block = |moe: &Moe, p: &str, layer: usize| -> Result<SparseMoe> {
            let (e, i) = (moe.num_experts, moe.expert_size);
            let b = moe.names.block;
            let router = [
                format!("{p}.{b}.gate.weight"),
                format!("{p}.mlp.gate.weight"),
            ]
            .into_iter()
            .find(|n| w.contains(n))
            .unwrap_or_else(|| format!("{p}.{b}.gate.weight"));
            let gate = plain(base(&router, e, hs)?);
            let fused = format!("{p}.mlp.experts.gate_up_proj");
            let experts = if w.contains(&fused) {
                let load_dt = if opts.quantize.is_some() {
                    DType::F32
                } else {
                    dt
                };
                let gu = w.load(&fused, &[e, 2 * i, hs], load_dt, &Device::Cpu)?; // (E, 2I, C)
                let down_name = format!("{p}.mlp.experts.down_proj");
                let down = w.load(&down_name, &[e, hs, i], load_dt, &Device::Cpu)?; // (E, C, I)
                (0..e)
                    .map(|x| {
                        let g = gu.get(x)?; // (2I, C)
                        Ok(Expert {
                            gate_proj: plain(base_of(g.narrow(0, 0, i)?.contiguous()?)?),
                            up_proj: plain(base_of(g.narrow(0, i, i)?.contiguous()?)?),
                            down_proj: plain(base_of(down.get(x)?.contiguous()?)?),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?
            } else {
                (0..e)
                    .map(|x| named_expert(moe, &format!("{p}.{b}.experts.{x}"), i))
                    .collect::<Result<Vec<_>>>()?
            };
            // Qwen2-MoE's shared expert: the same names in both layouts.
            let shared = match moe.shared_expert_size {
                None => None,
                Some(s) => Some(SharedExpert {
                    expert: named_expert(moe, &format!("{p}.{b}.shared_expert"), s)?,
                    gate: plain(base(&format!("{p}.{b}.shared_expert_gate.weight"), 1, hs)?),
                }),
            };
            Ok(SparseMoe {
                gate,
                experts,
                shared,
                top_k: moe.top_k,
                norm_topk_prob: moe.norm_topk_prob,
                act: c.variant.act,
                names: moe.names,
                layer,
            })
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            // The linears in `layer_linears` order (crate::config::layout): seven, or Phi-3's four.
            let sparse = c.is_sparse(i);
            let mut lins = c
                .plain_linears_at(i)
                .iter()
                .map(|s| linear(&format!("{p}.{}", s.path), s))
                .collect::<Result<Vec<_>>>()?
                .into_iter();
            let mut next = || lins.next().expect("the layout's linears");
            let norm = |n: &str| param(&format!("{p}.{n}"), &[d]);
            let qkv = if c.fused_projections {
                QkvProj::Fused { qkv_proj: next() }
            } else {
                QkvProj::Separate {
                    q_proj: next(),
                    k_proj: next(),
                    v_proj: next(),
                }
            };
            let self_attn = Attention {
                qkv,
                o_proj: next(),
                q_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.q_norm.weight"))
                    .transpose()?,
                k_norm: c
                    .qk_norm
                    .then(|| norm("self_attn.k_norm.weight"))
                    .transpose()?,
                norm_plus_one: c.variant.norm_plus_one,
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: d,
                rotary_dim: c.rotary_dim,
                eps: c.rms_norm_eps,
                scale: c.attention_scale(),
                softcap: c.variant.attn_logit_softcapping,
            };
            let mlp = match c.moe.as_ref().filter(|_| sparse) {
                Some(moe) => FeedForward::Sparse(sparse_block(moe, &p, i)?),
                None => {
                    let gate_up = if c.fused_projections {
                        GateUpProj::Fused {
                            gate_up_proj: next(),
                        }
                    } else {
                        GateUpProj::Separate {
                            gate_proj: next(),
                            up_proj: next(),
                        }
                    };
                    FeedForward::Dense(Mlp {
                        gate_up,
                        down_proj: next(),
                        act: c.variant.act,
                    })
                }
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
                mlp_path: c.mlp_path(i),
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
            rotary: Rotary::new(c),
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

    /// With checkpointing on: keep the checkpointed layers' inputs in host memory between the
    /// forward and the backward (`train.offload_checkpoints`; no saving on the CPU, where the
    /// host copy is the tensor itself). See [`crate::decoder::checkpointing`].
    pub fn set_offload_checkpoints(&mut self, on: bool) {
        if let Some(c) = &mut self.checkpointing {
            c.offload = on;
        }
    }

    /// With checkpointing on: tokens per tile of the checkpointed layers' MLP half (None: the
    /// hidden size). Tests set small tiles to run several on tiny models.
    pub fn set_checkpoint_tile_rows(&mut self, rows: Option<usize>) {
        if let Some(c) = &mut self.checkpointing {
            c.tile_rows = rows.map(|r| r.max(1));
        }
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
        let (cos, sin) = self
            .rotary
            .tables_for_segments(&positions, segments, self.dtype)?; // (B, 1, T, Dr)
        let make = |window: Option<usize>| -> Result<Mask> {
            Ok(match self.attention {
                AttentionImpl::Eager => Mask::Dense(ops::attention_mask(
                    segments,
                    window,
                    self.dtype,
                    &self.device,
                )?),
                AttentionImpl::Chunked => Mask::Chunked(
                    crate::kernels::chunked::AttentionMask::new(segments, window, &self.device)?,
                ),
            })
        };
        let mask = make(self.config.sliding_window)?;
        // Gemma 2's global layers: a second mask without the window.
        let full = if self.layers.iter().any(|l| l.full_attention) {
            Some(make(None)?)
        } else {
            None
        };
        let local = self.rotary.local_tables(&positions, self.dtype)?;
        Ok(RopeMask {
            cos,
            sin,
            mask,
            full,
            local,
            router: None,
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
        // `torch.tensor(hidden_size**0.5, dtype=hidden.dtype)` (Gemma 2). Gemma 3 rounds it to
        // f32 first (a float32 buffer cast to the weights' dtype): for every C < 70000 the two
        // give the same bf16 and f16 number (checked with torch), so one path serves both.
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
        self.layers_forward(input_ids, rope)
    }

    /// [`CausalLM::forward_hidden`] and, for a mixture of experts whose config sets
    /// `output_router_logits`, the router's load-balancing loss over the batch (transformers'
    /// `aux_loss`, which it adds to the loss times `router_aux_loss_coef`; a () f32 tensor;
    /// None for other models). `valid` (B rows of T) marks the tokens the loss counts, transformers'
    /// `attention_mask` (padding is not; None: every token).
    /// input_ids: (B, T) u32 -> (B, T, C), ()
    /// `aux_weight` is the factor the caller puts on the aux loss in the loss it
    /// backpropagates: with activation checkpointing, a checkpointed layer's forward keeps no
    /// graph, and its recompute in the backward adds the gradient of `aux_weight` x aux itself
    /// ([`RouterTape`]).
    pub fn forward_hidden_aux(
        &self,
        input_ids: &Tensor,
        segments: Option<&[Vec<u32>]>,
        valid: Option<&[Vec<bool>]>,
        aux_weight: f64,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let Some(moe) = self.config.moe.as_ref().filter(|m| m.output_router_logits) else {
            return Ok((self.forward_hidden(input_ids, segments)?, None));
        };
        let (b, t) = input_ids.dims2()?;
        let mut rope = self.rope_mask(b, t, segments)?;
        let valid = valid.map(|v| v.concat());
        let tape = Arc::new(RouterTape::new(b * t, valid, aux_weight, &self.device)?);
        rope.router = Some(tape.clone());
        let hidden = self.layers_forward(input_ids, rope)?;
        let aux = tape.aux_loss(moe.num_experts)?;
        tape.finish();
        Ok((hidden, aux))
    }

    /// Embeddings, the decoder layers and the final norm. input_ids: (B, T) -> (B, T, C)
    fn layers_forward(&self, input_ids: &Tensor, rope: RopeMask) -> Result<Tensor> {
        let mut x = self.embed(input_ids)?;
        match &self.checkpointing {
            Some(c) => x = c.forward_layers(&self.layers, x, &rope)?,
            None => {
                for layer in &self.layers {
                    x = layer.forward(&x, &rope)?;
                }
            }
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
    /// training and eval use the chunked loss in [`crate::nn::loss`].
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

    /// Every linear weight kept in a GGUF block format (`LoadOptions::keep_blocks`), with its HF
    /// name.
    pub fn ggml_weights(&self) -> Vec<(String, &Arc<GgmlWeight>)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (n, lin) in l.linears() {
                if let Base::Ggml(w) = &lin.weight {
                    out.push((format!("model.layers.{i}.{n}.weight"), w));
                }
            }
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
