//! Differentiable building blocks, written from Candle primitives that all have a backward.
//!
//! Candle's fused `rms_norm`, `rope*` and `softmax_last_dim` are `*_no_bwd`: their output is right
//! but no gradient flows through them (candle issues #2168, #3568, #3591). The one used here,
//! the fused softmax in [`masked_softmax`], gets its backward from this module.
//!
//! Shape legend: B = batch, T = time (sequence), H = attention heads, KV = key/value heads,
//! D = head dim, C = hidden size.

use candle_core::{CpuStorage, CudaStorage, DType, Device, Layout, Shape, Storage, Tensor, D};

use crate::config::RopeScaling;
use crate::error::Result;

/// The dtype that numerically sensitive reductions run in: f32, or f64 when the input is f64
/// (the finite-difference tests run the whole model in f64).
pub fn upcast(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// RMSNorm as HF computes it: `w * (x / sqrt(mean(x^2) + eps))`, the normalization in f32 and the
/// result cast back to the input dtype before the weight multiply.
/// x: (..., C), w: (C) -> (..., C)
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_with_bf16_for(x) && w.dtype() == x.dtype() {
        return Ok(crate::kernels::fused::rms_norm(x, w, eps)?); // one pass forward, one backward
    }
    rms_norm_generic(x, w, eps)
}

/// [`rms_norm`] from Candle tensor ops, on any device (the CUDA path).
pub fn rms_norm_generic(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let value = rms_norm_value(&x.detach(), &w.detach(), eps)?;
    // y = cast(xn) * w, xn = xf * r, r = 1 / sqrt(mean(xf^2) + eps):
    //   dw = sum over rows of dy * cast(xn);  g = cast_up(dy * w);  dx = r * (g - xn * mean(g * xn))
    attach2("rms-norm", x, w, value, move |x, w, _y, dy| {
        let dtype = x.dtype();
        let up = upcast(dtype);
        let xf = x.to_dtype(up)?;
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
            .sqrt()?
            .recip()?; // (..., 1)
        let xn = xf.broadcast_mul(&r)?;
        let dw = if w.track_op() {
            let rows = dy.elem_count() / dy.dim(D::Minus1)?;
            let prod = (dy.to_dtype(up)? * xn.to_dtype(dtype)?.to_dtype(up)?)?;
            Some(prod.reshape((rows, ()))?.sum(0)?.to_dtype(w.dtype())?) // (C)
        } else {
            None
        };
        let g = dy.broadcast_mul(w)?.to_dtype(up)?;
        let dot = (&g * &xn)?.mean_keepdim(D::Minus1)?; // (..., 1)
        let dx = (g - xn.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
        Ok((Some(dx.to_dtype(dtype)?), dw))
    })
}

/// Gemma's RMSNorm (`Gemma2RMSNorm`): `x_normed * (1 + w)` with the product in f32 and the
/// result cast back to x's dtype (Llama's casts before the weight multiply).
/// x: (..., C), w: (C) -> (..., C)
pub fn rms_norm_plus_one(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_with_bf16_for(x)
        && matches!(x.dtype(), DType::F32 | DType::F64)
        && w.dtype() == x.dtype()
    {
        // f32 / f64: no cast between the two products, so this is [`rms_norm`] with weight
        // 1 + w (computed in x's dtype, as `1.0 + weight.float()`); the offset's backward is
        // the identity.
        return rms_norm(x, &w.affine(1.0, 1.0)?, eps);
    }
    if crate::kernels::dispatch::fused_with_bf16_for(x)
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
    {
        // one pass forward, one backward (the CPU's kernel, CUDA's `tallow_rms_norm_p1_*`)
        return Ok(crate::kernels::fused::rms_norm_plus_one_bf16(x, w, eps)?);
    }
    rms_norm_plus_one_generic(x, w, eps)
}

/// [`rms_norm_plus_one`] from Candle tensor ops, on any device (f16; f64 on CUDA), and the
/// reference the bf16 kernel is tested against.
pub fn rms_norm_plus_one_generic(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let up = upcast(dtype);
    let value = {
        let xf = x.detach().to_dtype(up)?;
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
            .sqrt()?
            .recip()?; // (..., 1)
        let w1 = (w.detach().to_dtype(up)? + 1.0)?;
        xf.broadcast_mul(&r)?
            .broadcast_mul(&w1)?
            .to_dtype(dtype)?
            .contiguous()?
    };
    // y = cast(xn * (1 + w)), xn = xf * r:
    //   dw = sum over rows of dy * xn;  g = dy * (1 + w);  dx = r * (g - xn * mean(g * xn))
    attach2("rms-norm-plus-one", x, w, value, move |x, w, _y, dy| {
        let xf = x.to_dtype(up)?;
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
            .sqrt()?
            .recip()?;
        let xn = xf.broadcast_mul(&r)?;
        let dyf = dy.to_dtype(up)?;
        let dw = if w.track_op() {
            let rows = dy.elem_count() / dy.dim(D::Minus1)?;
            let prod = (&dyf * &xn)?;
            Some(prod.reshape((rows, ()))?.sum(0)?.to_dtype(w.dtype())?) // (C)
        } else {
            None
        };
        let g = dyf.broadcast_mul(&(w.to_dtype(up)? + 1.0)?)?;
        let dot = (&g * &xn)?.mean_keepdim(D::Minus1)?; // (..., 1)
        let dx = (g - xn.broadcast_mul(&dot)?)?.broadcast_mul(&r)?;
        Ok((Some(dx.to_dtype(dtype)?), dw))
    })
}

/// Soft-capping (Gemma 2's attention scores and logits): `cap * tanh(x / cap)`, in x's dtype as
/// transformers computes it; the backward is `dx = dy * (1 - tanh^2)`, with tanh recovered
/// from the output (y / cap), so nothing but the output is kept.
/// x: any shape -> the same shape
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    let value = ((x.detach() / cap)?.tanh()? * cap)?;
    attach1("softcap", x, value, move |x, y, dy| {
        let up = upcast(x.dtype());
        let t = (y.to_dtype(up)? / cap)?;
        let d = (1.0 - t.sqr()?)?; // 1 - tanh^2 in [0, 1]
        Ok(Some((dy.to_dtype(up)? * d)?.to_dtype(x.dtype())?))
    })
}

/// The value of [`rms_norm`], HF's order of operations (normalize in f32, cast, scale).
fn rms_norm_value(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(upcast(dtype))?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?; // (..., 1)
    let xn = xf.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(xn.to_dtype(dtype)?.broadcast_mul(w)?.contiguous()?)
}

/// Softmax over the last dim. The max is detached: it is a constant shift that leaves the value
/// and the gradient unchanged, so it needs no backward of its own.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// Attention probabilities: softmax(scores + mask) over the last dim, computed in
/// [`upcast`]`(scores.dtype())` by Candle's fused softmax kernel, with the backward
/// `dS = P * (dP - sum(dP * P))` written here. The graph keeps `scores` and `P` only: the
/// primitive version kept five score-sized f32 intermediates per layer (upcast, masked, shifted,
/// exp, normalized).
/// scores: (B, H, T, T), mask: (B, 1, T, T) additive (0 / -inf) -> (B, H, T, T) in the upcast dtype
/// Grouped query heads may come as (B, KV, n_rep * T, T): row y takes mask row y mod T.
pub fn masked_softmax(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_for(scores) && mask.dtype() == scores.dtype() {
        return Ok(crate::kernels::fused::masked_softmax(scores, mask)?);
    }
    let (b, x, y, s) = scores.dims4()?;
    let t = mask.dim(2)?;
    if y == t {
        return masked_softmax_generic(scores, mask);
    }
    // (B, KV, n_rep*T, S) -> (B, KV*n_rep, T, S) and back: views of the same buffer.
    let p = masked_softmax_generic(&scores.reshape((b, x * y / t, t, s))?, mask)?;
    Ok(p.reshape((b, x, y, s))?)
}

/// [`masked_softmax`] from Candle tensor ops, on any device (the CUDA path).
pub fn masked_softmax_generic(scores: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let up = upcast(scores.dtype());
    let masked = scores
        .detach()
        .to_dtype(up)?
        .broadcast_add(&mask.to_dtype(up)?)?;
    let probs = candle_nn::ops::softmax_last_dim(&masked)?;
    drop(masked);
    // dS = P * (dP - sum(dP * P, -1)), in P's dtype, cast back to the scores' dtype.
    attach1("masked-softmax", scores, probs, |s, p, dp| {
        let dp = dp.to_dtype(p.dtype())?;
        let dot = (&dp * p)?.sum_keepdim(D::Minus1)?; // (B, H, T, 1)
        let ds = (p * dp.broadcast_sub(&dot)?)?;
        Ok(Some(ds.to_dtype(s.dtype())?))
    })
}

// ---------------------------------------------------------------------------------------------
// Attaching a value computed outside the graph, with a backward written by hand.
//
// Each differentiable primitive keeps its inputs alive until the backward: a norm or a rotary
// embedding built from five primitives keeps five activation-sized tensors. Instead, the value is
// computed on detached inputs (its intermediates freed at once) and put into the graph by an op
// whose only inputs are the real inputs and whose backward is the closed form.

/// Candle's result, what the ops' callbacks return.
type R<T> = candle_core::Result<T>;

/// The backward of [`attach1`]: (x, value, d value) -> dx.
type Bwd1 = dyn Fn(&Tensor, &Tensor, &Tensor) -> R<Option<Tensor>> + Send + Sync;
/// The backward of [`attach2`]: (x, w, value, d value) -> (dx, dw).
type Bwd2 =
    dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> R<(Option<Tensor>, Option<Tensor>)> + Send + Sync;

/// `value` as a function of `x`: bwd(x, value, d_value) -> dx.
pub(crate) fn attach1(
    name: &'static str,
    x: &Tensor,
    value: Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor) -> R<Option<Tensor>> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(value);
    }
    Ok(x.apply_op1(Attach::<Bwd1>::new(name, value, Box::new(bwd)))?)
}

/// `value` as a function of `(x, w)`: bwd(x, w, value, d_value) -> (dx, dw).
pub(crate) fn attach2(
    name: &'static str,
    x: &Tensor,
    w: &Tensor,
    value: Tensor,
    bwd: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> R<(Option<Tensor>, Option<Tensor>)>
        + Send
        + Sync
        + 'static,
) -> Result<Tensor> {
    if !x.track_op() && !w.track_op() {
        return Ok(value);
    }
    Ok(x.apply_op2(w, Attach::<Bwd2>::new(name, value, Box::new(bwd)))?)
}

/// The op of [`attach1`] / [`attach2`]: its output is `value`, its backward `bwd` ([`Bwd1`] /
/// [`Bwd2`]).
struct Attach<B: ?Sized> {
    name: &'static str,
    value: std::sync::Mutex<Option<Tensor>>,
    bwd: Box<B>,
}

impl<B: ?Sized> Attach<B> {
    fn new(name: &'static str, value: Tensor, bwd: Box<B>) -> Self {
        let value = std::sync::Mutex::new(Some(value));
        Self { name, value, bwd }
    }

    /// Hands the precomputed value over as the op's output storage (a copy: Candle ops return
    /// owned storage); the op keeps no reference to it afterwards.
    fn take_value(&self) -> R<(Storage, Shape)> {
        use candle_core::backend::BackendStorage;
        let name = self.name;
        let v = self
            .value
            .lock()
            .expect("attach lock")
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{name}: op applied twice")))?;
        let (s, l) = v.storage_and_layout();
        if !l.is_contiguous() || l.start_offset() != 0 {
            candle_core::bail!("{name}: value must be contiguous");
        }
        let storage = match &*s {
            Storage::Cpu(c) => Storage::Cpu(c.try_clone(l)?),
            Storage::Cuda(c) => Storage::Cuda(c.try_clone(l)?),
            Storage::Metal(_) => candle_core::bail!("{name}: Metal is not supported"),
        };
        Ok((storage, v.shape().clone()))
    }
}

/// Candle's `CustomOp1` / `CustomOp2` for an [`Attach`] of 1 / 2 inputs (named by the
/// forward's unused storage and layout arguments): the output is the value on the CPU or
/// the CUDA device, the backward is given (it detaches the gradients: a gradient that kept
/// the ops it was computed with would keep their inputs, activations, alive for as long as
/// the gradient lives).
macro_rules! attach_op {
    ($op:ident for $bwd:ty, $(($s:ident, $l:ident)),+; $($backward:tt)*) => {
        impl candle_core::$op for Attach<$bwd> {
            fn name(&self) -> &'static str {
                self.name
            }

            fn cpu_fwd(&self, $($s: &CpuStorage, $l: &Layout),+) -> R<(CpuStorage, Shape)> {
                match self.take_value()? {
                    (Storage::Cpu(c), shape) => Ok((c, shape)),
                    _ => candle_core::bail!("{}: value is not on the CPU", self.name),
                }
            }

            fn cuda_fwd(&self, $($s: &CudaStorage, $l: &Layout),+) -> R<(CudaStorage, Shape)> {
                match self.take_value()? {
                    (Storage::Cuda(c), shape) => Ok((c, shape)),
                    _ => candle_core::bail!("{}: value is not on the CUDA device", self.name),
                }
            }

            $($backward)*
        }
    };
}

attach_op!(CustomOp1 for Bwd1, (_x, _xl);
    fn bwd(&self, x: &Tensor, v: &Tensor, dv: &Tensor) -> R<Option<Tensor>> {
        Ok((self.bwd)(x, v, dv)?.map(|g| g.detach()))
    }
);

attach_op!(CustomOp2 for Bwd2, (_x, _xl), (_w, _wl);
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        v: &Tensor,
        dv: &Tensor,
    ) -> R<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = (self.bwd)(x, w, v, dv)?;
        Ok((dx.map(|g| g.detach()), dw.map(|g| g.detach())))
    }
);

/// Log-softmax over the last dim, with the same detached max.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Rotary-embedding inverse frequencies (D/2), with HF's `rope_scaling` rules.
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let inv: Vec<f64> = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0 / theta.powf(i as f64 / head_dim as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        None => inv,
        Some(RopeScaling::Linear { factor }) => inv.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_ctx,
        }) => {
            // transformers `_compute_llama3_parameters`: long wavelengths are divided by
            // `factor`, short ones kept, the band between interpolated smoothly.
            let low_wavelen = old_ctx / low_freq_factor;
            let high_wavelen = old_ctx / high_freq_factor;
            inv.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        // The short factors: transformers' table for sequences within the original context
        // (the long one is [`longrope_inv_freq`] with `long_factor`).
        Some(RopeScaling::LongRope { short_factor, .. }) => {
            return longrope_inv_freq(head_dim, theta, short_factor)
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

/// cos and sin tables for the given positions, computed in f32 and cast to `dtype` (as HF does).
/// positions: (B, T) u32 -> cos, sin: (B, 1, T, D)
/// LongRoPE frequencies (transformers' `_compute_longrope_parameters`): the default ones of a
/// `dim`-wide rotary table, each divided by its factor (`factors`: dim / 2 entries).
pub fn longrope_inv_freq(dim: usize, theta: f64, factors: &[f64]) -> Vec<f32> {
    (0..dim)
        .step_by(2)
        .zip(factors)
        .map(|(i, f)| (1.0 / (f * theta.powf(i as f64 / dim as f64))) as f32)
        .collect()
}

/// [`rope_tables_scaled`] with no scale on cos / sin.
pub fn rope_tables(positions: &Tensor, inv_freq: &[f32], dtype: DType) -> Result<(Tensor, Tensor)> {
    rope_tables_scaled(positions, inv_freq, 1.0, dtype)
}

/// Rotary tables with cos and sin multiplied by `mscale` in f32 before the cast (LongRoPE's
/// attention factor, as transformers' `Phi3RotaryEmbedding.forward`).
/// positions: (B, T) -> cos, sin: (B, 1, T, 2 * inv_freq.len())
pub fn rope_tables_scaled(
    positions: &Tensor,
    inv_freq: &[f32],
    mscale: f64,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let device = positions.device();
    let (b, t) = positions.dims2()?;
    let half = inv_freq.len();
    // (1, 1, D/2), uploaded once per device and set of frequencies (crate::kernels::consts): the key
    // holds their bits, so two models with different rotary settings never share an entry.
    let key = crate::kernels::consts::ConstKey::with(
        "rope.inv_freq",
        inv_freq.iter().map(|f| f.to_bits() as u64),
    );
    let inv = crate::kernels::consts::cached(device, key, |d| {
        Tensor::from_slice(inv_freq, (1, 1, half), d)
    })?;
    let pos = positions.to_dtype(DType::F32)?.reshape((b, t, 1))?;
    let freqs = pos.broadcast_mul(&inv)?; // (B, T, D/2)
    let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?; // (B, T, D)
    let (mut cos, mut sin) = (emb.cos()?, emb.sin()?);
    if mscale != 1.0 {
        cos = (cos * mscale)?;
        sin = (sin * mscale)?;
    }
    let cos = cos.to_dtype(dtype)?.unsqueeze(1)?; // (B, 1, T, D)
    let sin = sin.to_dtype(dtype)?.unsqueeze(1)?;
    Ok((cos, sin))
}

/// Applies rotary embedding the HF way: `x * cos + rotate_half(x) * sin`, where
/// `rotate_half([x1, x2]) = [-x2, x1]` over the two halves of the head dim.
/// x: (B, H, T, D), cos/sin: (B, 1, T, D) -> (B, H, T, D)
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    apply_rope_scaled(x, cos, sin, 1.0)
}

/// [`apply_rope`] times `scale` in one graph op (the attention's 1/sqrt(D) folded into q):
/// y = scale · (x * cos + R(x) * sin), dx = scale · (dy * cos + Rᵀ(dy * sin)).
pub fn apply_rope_scaled(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    let mut value = rope_value(&x.detach(), cos, sin)?;
    if scale != 1.0 {
        value = (value * scale)?;
    }
    // y = x * cos + R(x) * sin with R([x1, x2]) = [-x2, x1], so dx = dy * cos + R^T(dy * sin),
    // R^T([z1, z2]) = [z2, -z1]. cos / sin are constants (not in the graph).
    let (cos, sin) = (cos.detach(), sin.detach());
    attach1("rope", x, value, move |_x, _y, dy| {
        let dy = if scale != 1.0 {
            (dy * scale)?
        } else {
            dy.clone()
        };
        let d = dy.dim(D::Minus1)?;
        let z = dy.broadcast_mul(&sin)?;
        let z1 = z.narrow(D::Minus1, 0, d / 2)?;
        let z2 = z.narrow(D::Minus1, d / 2, d / 2)?;
        let rt = Tensor::cat(&[&z2, &z1.neg()?], D::Minus1)?;
        Ok(Some((dy.broadcast_mul(&cos)? + rt)?))
    })
}

/// Rotary embedding (times `scale`) of per-head vectors laid out (B, T, H, D) as the
/// projections give them, returned as (B, H, T, D): on the CPU one fused pass for the transpose,
/// the rotation and the scale (and one back); elsewhere a transposed copy then
/// [`apply_rope_scaled`].
/// x: (B, T, H, D), cos/sin: (B, 1, T, D) -> (B, H, T, D)
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_with_bf16_for(x) && cos.dtype() == x.dtype() {
        return Ok(crate::kernels::fused::rope_heads(x, cos, sin, scale)?);
    }
    apply_rope_scaled(&x.transpose(1, 2)?.contiguous()?, cos, sin, scale)
}

/// Causal attention softmax(q kᵀ + mask) v over grouped heads: q (B, KV, n_rep * T, D) (scaled),
/// k, v (B, KV, T, D), a causal additive mask (B, 1, T, T) -> (B, KV, n_rep * T, D). On the CPU
/// in f32 / f64 one fused op that skips the keys after each block of queries
/// ([`crate::kernels::fused::causal_attention`]); elsewhere the eager matmul / softmax / matmul, the
/// softmax in f32, as HF's eager attention.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_for(q) && k.dtype() == q.dtype() && mask.dtype() == q.dtype()
    {
        return Ok(crate::kernels::fused::causal_attention(q, k, v, mask)?);
    }
    let scores = q.matmul(&k.t()?)?; // (B, KV, n_rep*T, T)
    let probs = masked_softmax(&scores, mask)?.to_dtype(v.dtype())?; // f32, cast back
    Ok(probs.matmul(v)?) // (B, KV, n_rep*T, D)
}

/// [`causal_attention`] with the scores soft-capped before the mask (Gemma 2's eager
/// attention): softmax(cap * tanh(q kᵀ / cap) + mask) v, the cap in q's dtype, the softmax in
/// f32. Tensor ops on every device (the CPU's fused eager kernel has no cap).
pub fn causal_attention_capped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    cap: f64,
) -> Result<Tensor> {
    let scores = softcap(&q.matmul(&k.t()?)?, cap)?; // (B, KV, n_rep*T, T)
    let mask = mask.to_dtype(scores.dtype())?;
    let probs = masked_softmax(&scores, &mask)?.to_dtype(v.dtype())?; // f32, cast back
    Ok(probs.matmul(v)?) // (B, KV, n_rep*T, D)
}

/// SwiGLU's gate: silu(g) * u, one fused pass on the CPU (and one back; bf16: silu in f32
/// rounded once, then the product, as PyTorch's bf16 ops), Candle ops elsewhere.
/// g, u: (..., I) -> (..., I)
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_with_bf16_for(g) && u.dtype() == g.dtype() {
        return Ok(crate::kernels::fused::swiglu(g, u)?);
    }
    Ok((g.silu()? * u)?) // Candle's silu has a backward
}

/// GeGLU's gate (Gemma): gelu_tanh(g) * u, with gelu's tanh approximation
/// (`gelu_pytorch_tanh`): gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x³))), k = sqrt(2/pi). The gelu
/// in f32 for bf16 / f16 inputs and rounded once, as torch computes it, then the product in the
/// input dtype. The backward is written here: Candle's gelu backward uses 6-digit constants
/// (1e-6 relative error, seen by the f64 finite-difference test).
/// g, u: (..., I) -> (..., I)
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if crate::kernels::dispatch::fused_with_bf16_for(g) && u.dtype() == g.dtype() {
        return Ok(crate::kernels::fused::geglu(g, u)?); // one pass forward, one backward
    }
    geglu_generic(g, u)
}

/// [`geglu`] from Candle tensor ops, on any device (f16; f64 on CUDA), and the reference the
/// fused kernel is tested against.
pub fn geglu_generic(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    let dt = g.dtype();
    let up = upcast(dt);
    let value = {
        let (act, _) = gelu_tanh(&g.detach().to_dtype(up)?, false)?;
        (act.to_dtype(dt)? * u.detach())?.contiguous()?
    };
    // y = gelu(g) * u:  dg = dy * u * gelu'(g),  du = dy * gelu(g)
    attach2("geglu", g, u, value, move |g, u, _y, dy| {
        let (act, dact) = gelu_tanh(&g.to_dtype(up)?, true)?;
        let dyf = dy.to_dtype(up)?;
        let dg = match (g.track_op(), dact) {
            (true, Some(da)) => Some((&dyf * u.to_dtype(up)?)?.mul(&da)?.to_dtype(dt)?),
            _ => None,
        };
        let du = if u.track_op() {
            Some((dyf * act.to_dtype(dt)?.to_dtype(up)?)?.to_dtype(dt)?)
        } else {
            None
        };
        Ok((dg, du))
    })
}

/// gelu's tanh approximation of x, and (when `grad`) its derivative
/// 0.5 (1 + t) + 0.5 x (1 - t²) k (1 + 3 · 0.044715 x²), t = tanh(k (x + 0.044715 x³)).
fn gelu_tanh(x: &Tensor, grad: bool) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    const C: f64 = 0.044715;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let x2 = x.sqr()?;
    let inner = ((x * (&x2 * C)?)? + x)?.affine(k, 0.0)?; // k (x + C x³)
    let t = inner.tanh()?;
    let act = ((&t + 1.0)? * x)?.affine(0.5, 0.0)?;
    if !grad {
        return Ok((act, None));
    }
    let dinner = (x2.affine(3.0 * C, 1.0)?).affine(k, 0.0)?; // k (1 + 3 C x²)
    let one_minus_t2 = (1.0 - t.sqr()?)?;
    let d = ((t + 1.0)?.affine(0.5, 0.0)? + (x * one_minus_t2)?.mul(&dinner)?.affine(0.5, 0.0)?)?;
    Ok((act, Some(d)))
}

/// The value of [`apply_rope`].
fn rope_value(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Repeats each key/value head `n_rep` times for grouped-query attention.
/// x: (B, KV, T, D) -> (B, KV * n_rep, T, D)
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, t, d) = x.dims4()?;
    // (B, KV, 1, T, D) -> (B, KV, n_rep, T, D) -> (B, KV * n_rep, T, D)
    Ok(x.unsqueeze(2)?
        .broadcast_as((b, kv, n_rep, t, d))?
        .contiguous()?
        .reshape((b, kv * n_rep, t, d))?)
}

/// Additive attention mask (0 where attention is allowed, -inf elsewhere), in `dtype`.
///
/// `segments` gives each token's sequence id within its row (all zeros for an ordinary batch;
/// distinct ids for rows packed together): token i may attend to token j iff j <= i, both are in
/// the same segment, and (with a sliding window w) i - j < w.
/// segments: B rows of T ids -> (B, 1, T, T)
pub fn attention_mask(
    segments: &[Vec<u32>],
    sliding_window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let b = segments.len();
    let t = segments.first().map_or(0, |s| s.len());
    let flat: Vec<u32> = segments.iter().flatten().copied().collect();
    let seg = Tensor::from_vec(flat, (b, t), device)?;
    let same = seg.unsqueeze(2)?.broadcast_eq(&seg.unsqueeze(1)?)?; // (B, T, T)
    let pos = Tensor::arange(0u32, t as u32, device)?;
    let (i, j) = (pos.unsqueeze(1)?, pos.unsqueeze(0)?); // (T, 1), (1, T)
    let mut allowed = i.broadcast_ge(&j)?; // (T, T): j <= i
    if let Some(w) = sliding_window {
        allowed = (allowed * i.broadcast_lt(&(j + w as f64)?)?)?; // i - j < w
    }
    let allowed = same.broadcast_mul(&allowed.unsqueeze(0)?)?; // (B, T, T)
    let zeros = Tensor::zeros((b, t, t), DType::F32, device)?;
    let neg = Tensor::full(f32::NEG_INFINITY, (b, t, t), device)?;
    Ok(allowed
        .where_cond(&zeros, &neg)?
        .unsqueeze(1)?
        .to_dtype(dtype)?) // (B, 1, T, T)
}

/// Position ids that restart at 0 at every segment boundary (HF's packed-sequence positions).
pub fn positions_from_segments(segments: &[Vec<u32>], device: &Device) -> Result<Tensor> {
    let b = segments.len();
    let t = segments.first().map_or(0, |s| s.len());
    let mut pos = Vec::with_capacity(b * t);
    for seg in segments {
        let mut p = 0u32;
        for i in 0..t {
            if i > 0 && seg[i] != seg[i - 1] {
                p = 0;
            }
            pos.push(p);
            p += 1;
        }
    }
    Ok(Tensor::from_vec(pos, (b, t), device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_definition_and_rows_sum_to_one() -> Result<()> {
        let x = Tensor::new(&[[1f32, 2., 3.], [-1., 0., 1000.]], &Device::Cpu)?;
        let s = softmax_last_dim(&x)?.to_vec2::<f32>()?;
        let e: Vec<f32> = [1f32, 2., 3.].iter().map(|v| v.exp()).collect();
        let z: f32 = e.iter().sum();
        for j in 0..3 {
            assert!((s[0][j] - e[j] / z).abs() < 1e-6);
        }
        assert!(
            (s[1][2] - 1.0).abs() < 1e-6,
            "large logits must not overflow"
        );
        let ls = log_softmax_last_dim(&x)?.exp()?.to_vec2::<f32>()?;
        assert!((ls[0][0] - s[0][0]).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = rope_inv_freq(16, 500000.0, None);
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        };
        let scaled = rope_inv_freq(16, 500000.0, Some(&s));
        assert_eq!(plain[0], scaled[0], "highest frequency is unchanged");
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn mask_is_causal_within_segments_and_window() -> Result<()> {
        let m = attention_mask(&[vec![0, 0, 1, 1]], None, DType::F32, &Device::Cpu)?;
        let m = m.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?;
        assert_eq!(m[1][0], 0.0);
        assert_eq!(m[0][1], f32::NEG_INFINITY, "no look-ahead");
        assert_eq!(
            m[2][1],
            f32::NEG_INFINITY,
            "no attention across packed rows"
        );
        assert_eq!(m[3][2], 0.0);
        let w = attention_mask(&[vec![0; 4]], Some(2), DType::F32, &Device::Cpu)?;
        let w = w.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?;
        assert_eq!(w[3][2], 0.0);
        assert_eq!(w[3][1], f32::NEG_INFINITY, "outside the sliding window");
        let p = positions_from_segments(&[vec![0, 0, 1, 1, 1]], &Device::Cpu)?;
        assert_eq!(p.to_vec2::<u32>()?, vec![vec![0, 1, 0, 1, 2]]);
        Ok(())
    }
}
