//! The one linear layer of the model: a base weight (dense, frozen or trainable, or NF4), an
//! optional bias, and an optional adapter ([`crate::peft`]: LoRA or DoRA).
//!
//! A frozen base goes through [`FrozenMatmul`], a custom op whose backward returns dX only:
//! Candle's own matmul backward computes (and stores) a full-size dW for both operands even when
//! the weight is not a variable (`backprop.rs`, `Op::Matmul`), which for LoRA costs a model-sized
//! gradient in time and memory. An NF4 base goes through [`Nf4Matmul`], which holds only the packed
//! 4-bit weight and dequantizes it inside forward and again inside backward.
//!
//! On the CPU a LoRA linear over a frozen base is one op ([`LoraLinearOp`]): f32 / f64, and a
//! bf16 model's (bf16 x, base and bias, f32 adapter), which widens its operands to f32 for the
//! products and rounds to bf16 exactly where the unfused graph of Candle ops rounds (tested bit
//! for bit), so a bf16 linear adds one node to the graph instead of about six.

use candle_core::backend::BackendStorage;
use std::sync::Arc;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Storage, Tensor, Var,
};
use half::bf16;
use rayon::prelude::*;

use crate::error::Result;
use crate::kernels::dropout::DropoutOp;
use crate::kernels::fused::{narrow_bf16, round_bf16, rows_per_task, uninit, widen_bf16};
pub use crate::kernels::nf4::{Nf4Matmul, Nf4Weight};
use crate::nn::no_grad;
pub use crate::peft::{lora_a_init, mix_seed, Adapter, Dora, Dropout, Lora};

/// A model weight: frozen (a plain tensor, never differentiated) or trainable (a `Var`).
#[derive(Clone)]
pub enum Param {
    Frozen(Tensor),
    Trainable(Var),
}

impl Param {
    pub fn tensor(&self) -> &Tensor {
        match self {
            Param::Frozen(t) => t,
            Param::Trainable(v) => v.as_tensor(),
        }
    }

    pub fn var(&self) -> Option<&Var> {
        match self {
            Param::Frozen(_) => None,
            Param::Trainable(v) => Some(v),
        }
    }

    pub fn new(t: Tensor, trainable: bool) -> Result<Self> {
        Ok(if trainable {
            Param::Trainable(Var::from_tensor(&t)?)
        } else {
            Param::Frozen(t)
        })
    }
}

/// The base weight of a linear layer: dense (in the model dtype) or NF4 (frozen, 4-bit packed).
#[derive(Clone)]
pub enum Base {
    Dense(Param),
    Nf4(Arc<Nf4Weight>),
}

impl Base {
    /// (out, in)
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Base::Dense(p) => p.tensor().dims2().unwrap_or((0, 0)),
            Base::Nf4(w) => w.shape,
        }
    }

    /// The dense parameter; None for an NF4 weight.
    pub fn param(&self) -> Option<&Param> {
        match self {
            Base::Dense(p) => Some(p),
            Base::Nf4(_) => None,
        }
    }

    /// The weight (out, in) in the compute dtype: the tensor itself, or NF4 dequantized (a new
    /// full-precision copy: for merging and saving, never for the forward pass).
    pub fn dense(&self) -> Result<Tensor> {
        match self {
            Base::Dense(p) => Ok(p.tensor().clone()),
            Base::Nf4(w) => w.dequantize(),
        }
    }
}

/// y = x W^T (+ b), changed by the adapter when there is one.
#[derive(Clone)]
pub struct Linear {
    /// (out, in), as stored in safetensors.
    pub weight: Base,
    /// (out)
    pub bias: Option<Param>,
    /// LoRA or DoRA; None for a plain linear.
    pub adapter: Option<Adapter>,
}

impl Linear {
    /// The adapter the forward applies: None without one, or inside
    /// [`crate::peft::adapters_off`].
    fn active_adapter(&self) -> Option<&Adapter> {
        self.adapter
            .as_ref()
            .filter(|_| crate::peft::adapters_active())
    }

    /// The adapter's LoRA matrices (DoRA has them too); None without an adapter.
    pub fn lora(&self) -> Option<&Lora> {
        self.adapter.as_ref().map(Adapter::lora)
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims().1
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims().0
    }

    /// x: (..., in) -> (..., out)
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, None)
    }

    /// [`Linear::forward`] with the adapter's input given: `lora_x` is x already cast to the
    /// adapter dtype (f32), made once by [`adapter_input`] for the linears that read the same x
    /// (q/k/v, gate/up), so a bf16 model keeps one f32 copy of x in the graph instead of three.
    /// x, lora_x: (..., in) -> (..., out)
    pub fn forward_with(&self, x: &Tensor, lora_x: Option<&Tensor>) -> Result<Tensor> {
        if let Some(y) = self.forward_fused(x)? {
            return Ok(y);
        }
        self.forward_unfused(x, lora_x)
    }

    /// Whether [`Linear::forward`] of x takes the one-op path ([`LoraLinearOp`]): a LoRA
    /// adapter on the CPU over a frozen dense or NF4 base and a frozen (or no) bias, all in x's
    /// dtype, with x and the adapter both f32 / f64, or x bf16 and the adapter f32 (a bf16
    /// model's adapter, PEFT's `autocast_adapter_dtype`).
    fn fuses(&self, x: &Tensor) -> bool {
        // DoRA rescales the output by a norm of the whole weight: tensor ops (forward_unfused).
        let Some(Adapter::Lora(lora)) = self.active_adapter() else {
            return false;
        };
        let dt = x.dtype();
        let base_ok = match &self.weight {
            Base::Dense(Param::Frozen(w)) => w.dtype() == dt,
            Base::Nf4(w) => w.dtype == dt,
            Base::Dense(Param::Trainable(_)) => false,
        };
        let bias_ok = match &self.bias {
            None => true,
            Some(Param::Frozen(b)) => b.dtype() == dt,
            Some(Param::Trainable(_)) => false,
        };
        let dtypes_ok = match (dt, lora.a.dtype()) {
            (DType::BF16, DType::F32) => x.device().is_cpu(),
            (x_dt, a_dt) => x_dt == a_dt && crate::kernels::fused::supports(x),
        };
        base_ok && bias_ok && dtypes_ok
    }

    /// The LoRA linear as one op ([`LoraLinearOp`]) where [`Linear::fuses`]; None elsewhere.
    fn forward_fused(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let (Some(Adapter::Lora(lora)), true) = (self.active_adapter(), self.fuses(x)) else {
            return Ok(None);
        };
        let bias = self.bias.as_ref().map(|b| b.tensor().clone());
        let (n, k) = self.weight.dims();
        if x.dim(candle_core::D::Minus1)? != k {
            return Err(candle_core::Error::Msg(format!(
                "linear: input has {} features, weight expects {k}",
                x.dim(candle_core::D::Minus1)?
            ))
            .into());
        }
        let m = x.elem_count() / k;
        let dropout = lora.active_dropout();
        let op = LoraLinearOp {
            base: self.weight.clone(),
            bias,
            scale: lora.scale,
            dropout,
            mkn: (m, k, n),
        };
        let (a, b) = (no_grad::enter(&lora.a), no_grad::enter(&lora.b));
        Ok(Some(x.contiguous()?.apply_op3(&a, &b, op)?))
    }

    /// The linear from Candle ops and tallow's matmul ops, on any device and dtype.
    pub fn forward_unfused(&self, x: &Tensor, lora_x: Option<&Tensor>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = *dims.last().expect("linear input has at least one dim");
        let m: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((m, k))?; // (M, in)
        let base = self.base_matmul(&x2)?; // (M, out)
        let bias = self.bias.as_ref().map(|b| no_grad::enter(b.tensor()));
        let xl = || match lora_x {
            Some(xl) => xl.reshape((m, k)), // (M, in), already f32
            None => Ok(x2.clone()),
        };
        let y = match self.active_adapter() {
            None => add_bias(base, bias.as_ref())?,
            Some(Adapter::Lora(lora)) => {
                let y = add_bias(base, bias.as_ref())?;
                (y.clone() + lora.forward(&xl()?)?.to_dtype(y.dtype())?)?
            }
            Some(Adapter::Dora(dora)) => dora.forward(self, base, bias.as_ref(), &xl()?)?,
        };
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features();
        Ok(y.reshape(out_dims)?)
    }

    /// x W^T without bias or adapter, through the op that fits the base (frozen, trainable,
    /// NF4). x: (M, in) -> (M, out)
    pub(crate) fn base_matmul(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(match &self.weight {
            Base::Dense(Param::Frozen(w)) => x.apply_op1(FrozenMatmul { w: w.clone() })?,
            Base::Dense(Param::Trainable(w)) => x.apply_op2(&no_grad::enter(w), TrainableMatmul)?,
            Base::Nf4(w) => x.apply_op1(Nf4Matmul { w: w.clone() })?,
        })
    }
}

/// y (M, out) + bias (out), when there is one.
fn add_bias(y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// A LoRA linear on the CPU as one graph op (x, A, B) -> W x + b + s · B A dropout(x), for f32 /
/// f64 with a frozen dense or NF4 base and a frozen (or no) bias: the adapter's output is added
/// into the base matmul's output buffer in place (no (M, out) add node), and the backward
/// returns dx = dY W + s · mask ⊙ (dY B) A in one buffer, dA and dB: Candle accumulates one
/// gradient per input instead of one per primitive (reshapes, the add, two matmuls, the scale),
/// each of which cost a zeroed (M, in) or (M, out) buffer and an add.
struct LoraLinearOp {
    base: Base,
    bias: Option<Tensor>,
    scale: f64,
    dropout: Option<DropoutOp>,
    /// (M, K, N): rows, in, out.
    mkn: (usize, usize, usize),
}

/// The dense base weight (N, K) in the compute dtype, on the CPU (NF4 dequantized, dropped by
/// the caller after use).
fn cpu_weight(base: &Base) -> candle_core::Result<Tensor> {
    match base {
        Base::Dense(p) => Ok(p.tensor().clone()),
        Base::Nf4(w) => w.dequantize_candle(),
    }
}

/// `dst (M, N) := [dst +] beta * lhs (M, K) * rhs`, row-major buffers, with `rhs` given as a
/// row-major (N, K) matrix used transposed (`rhs_t`) or a row-major (K, N) one. `read_dst`
/// false: dst's old contents are ignored (it may be uninitialized). Candle's own CPU matmul
/// kernel (`gemm`), on as many threads as Candle gives it.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: crate::kernels::fused::Real>(
    dst: &mut [T],
    read_dst: bool,
    lhs: &[T],
    rhs: &[T],
    rhs_t: bool,
    (m, n, k): (usize, usize, usize),
    beta: T,
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= n * k);
    let (rhs_cs, rhs_rs) = if rhs_t {
        (k as isize, 1)
    } else {
        (1, n as isize)
    };
    let threads = candle_core::utils::get_num_threads();
    let par = if threads > 1 && m * n * k >= 64 * 64 * 64 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths are checked above and the strides describe row-major (M, K), (M, N)
    // and (N, K) / (K, N) buffers inside them; T is f32 or f64 (gemm panics on other types).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            read_dst,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            T::one(),
            beta,
            false,
            false,
            false,
            par,
        )
    }
}

/// The contiguous elements of a tensor on the CPU, for `f` (the storage guard lives meanwhile).
fn with_cpu_slice<T: crate::kernels::fused::Real, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (st, l) = t.storage_and_layout();
    f(crate::kernels::fused::storage_data(
        &st,
        l,
        "lora linear weight",
    )?)
}

/// The base weight (N, K) of a bf16 model widened to f32, and the bias (N) when there is one.
fn cpu_weight_f32(
    base: &Base,
    bias: Option<&Tensor>,
) -> candle_core::Result<(Vec<f32>, Option<Vec<f32>>)> {
    let w = cpu_weight(base)?;
    let wide = |t: &Tensor| {
        let (st, l) = t.storage_and_layout();
        Ok::<_, candle_core::Error>(widen_bf16(crate::kernels::fused::storage_data(
            &st,
            l,
            "lora linear weight",
        )?))
    };
    Ok((wide(&w)?, bias.map(wide).transpose()?))
}

impl LoraLinearOp {
    /// y = x Wᵀ (+ bias) + s · dropout(x) Aᵀ Bᵀ, the adapter product accumulated by the gemm.
    fn run<T: crate::kernels::fused::Real + crate::kernels::dropout::num_like::Scale>(
        &self,
        x: &[T],
        a: &[T],
        b: &[T],
    ) -> candle_core::Result<Vec<T>> {
        let (m, k, n) = self.mkn;
        let r = a.len() / k;
        let mut y = crate::kernels::fused::uninit::<T>(m * n);
        // Start from the bias (then the base gemm accumulates onto it), or from nothing.
        let read = match &self.bias {
            Some(bias) => with_cpu_slice::<T, _>(bias, |bv| {
                y.chunks_mut(n).for_each(|row| row.copy_from_slice(bv));
                Ok(true)
            })?,
            None => false,
        };
        let w = cpu_weight(&self.base)?;
        with_cpu_slice::<T, _>(&w, |wv| {
            gemm_into(&mut y, read, x, wv, true, (m, n, k), T::one());
            Ok(())
        })?;
        drop(w);
        let dropped;
        let xd: &[T] = match &self.dropout {
            Some(op) => {
                dropped = op.run(x);
                &dropped
            }
            None => x,
        };
        let mut xa = crate::kernels::fused::uninit::<T>(m * r);
        gemm_into(
            &mut xa,
            false,
            xd,
            a,
            true,
            (m, r, k),
            T::from_f64(self.scale),
        ); // s xd Aᵀ
        gemm_into(&mut y, true, &xa, b, true, (m, n, r), T::one()); // += (s xd Aᵀ) Bᵀ
        Ok(y)
    }

    /// A bf16 model's LoRA linear: x, the base and the bias bf16, A and B f32 (PEFT keeps a bf16
    /// model's adapter in f32). Rounded to bf16 where the unfused graph rounds: t = bf16(x Wᵀ)
    /// (Candle's bf16 matmul: an f32 product of the widened operands), t = bf16(t + bias),
    /// y = bf16(t + bf16(s · dropout(x) Aᵀ Bᵀ)), the adapter's side in f32 on x widened.
    fn run_bf16(&self, x: &[bf16], a: &[f32], b: &[f32]) -> candle_core::Result<Vec<bf16>> {
        let (m, k, n) = self.mkn;
        let r = a.len() / k;
        let x32 = widen_bf16(x); // (M, K)
        let mut t = uninit::<f32>(m * n); // (M, N)
        let (w32, bias) = cpu_weight_f32(&self.base, self.bias.as_ref())?;
        gemm_into(&mut t, false, &x32, &w32, true, (m, n, k), 1.0);
        drop(w32);
        let dropped;
        let xd: &[f32] = match &self.dropout {
            Some(op) => {
                dropped = op.run(&x32);
                &dropped
            }
            None => &x32,
        };
        let mut xa = uninit::<f32>(m * r);
        gemm_into(&mut xa, false, xd, a, true, (m, r, k), self.scale as f32); // s xd Aᵀ
        let mut l = uninit::<f32>(m * n);
        gemm_into(&mut l, false, &xa, b, true, (m, n, r), 1.0); // (s xd Aᵀ) Bᵀ
        let rows = n * rows_per_task(n);
        t.par_chunks_mut(rows)
            .zip(l.par_chunks(rows))
            .for_each(|(t, l)| match &bias {
                None => t.iter_mut().zip(l).for_each(|(t, l)| {
                    *t = round_bf16(*t) + round_bf16(*l);
                }),
                Some(bias) => t.chunks_mut(n).zip(l.chunks(n)).for_each(|(t, l)| {
                    for ((t, l), c) in t.iter_mut().zip(l).zip(bias) {
                        *t = round_bf16(round_bf16(*t) + c) + round_bf16(*l);
                    }
                }),
            });
        Ok(narrow_bf16(&t))
    }
}

impl candle_core::CustomOp3 for LoraLinearOp {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    // x: (..., K), a: (r, K), b: (N, r) -> (..., N)
    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k, n) = self.mkn;
        let (Some((x0, x1)), Some((a0, a1)), Some((b0, b1))) = (
            xl.contiguous_offsets(),
            al.contiguous_offsets(),
            bl.contiguous_offsets(),
        ) else {
            candle_core::bail!("lora linear: inputs must be contiguous");
        };
        if x1 - x0 != m * k {
            candle_core::bail!(
                "lora linear: input has {} elements, expected {m} x {k}",
                x1 - x0
            );
        }
        let y = match (x, a, b) {
            (CpuStorage::F32(x), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::F32(self.run(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(a), CpuStorage::F64(b)) => {
                CpuStorage::F64(self.run(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            (CpuStorage::BF16(x), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                CpuStorage::BF16(self.run_bf16(&x[x0..x1], &a[a0..a1], &b[b0..b1])?)
            }
            _ => candle_core::bail!(
                "lora linear: x, A and B must all be f32 or all f64, or x bf16 with A, B f32"
            ),
        };
        let mut dims = xl.shape().dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = n;
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (m, k, n) = self.mkn;
        let (a, b) = (a.detach(), b.detach());
        // The adapter's side runs in its own dtype: a bf16 x and dY widened to f32 (exact).
        let x2 = x.detach().reshape((m, k))?.to_dtype(a.dtype())?;
        let dy2 = dy.detach().contiguous()?.reshape((m, n))?;
        let dy2a = dy2.to_dtype(a.dtype())?;
        let xd = match &self.dropout {
            Some(op) => x2.apply_op1_no_bwd(op)?,
            None => x2,
        };
        let dyb = (dy2a.matmul(&b)? * self.scale)?; // s (dY B): (M, r)
        let xa = (xd.matmul(&a.t()?)? * self.scale)?; // s (xd Aᵀ): (M, r)
        let db = dy2a.t()?.matmul(&xa)?; // (N, r)
        let da = dyb.t()?.matmul(&xd)?; // (r, K)
        let dx = if x.track_op() {
            let dx = dy2.apply_op2_no_bwd(
                &dyb,
                &LoraLinearDx {
                    base: self.base.clone(),
                    a: a.clone(),
                    dropout: self.dropout,
                    mkn: self.mkn,
                },
            )?;
            Some(dx.reshape(x.shape())?)
        } else {
            None
        };
        Ok((dx, Some(da), Some(db)))
    }
}

/// dx = dY W + mask ⊙ (s dY B) A in one buffer: (M, N), (M, r) -> (M, K).
struct LoraLinearDx {
    base: Base,
    a: Tensor,
    dropout: Option<DropoutOp>,
    mkn: (usize, usize, usize),
}

impl LoraLinearDx {
    fn run<T: crate::kernels::fused::Real + crate::kernels::dropout::num_like::Scale>(
        &self,
        dy: &[T],
        dyb: &[T],
    ) -> candle_core::Result<Vec<T>> {
        let (m, k, n) = self.mkn;
        let mut dx = crate::kernels::fused::uninit::<T>(m * k);
        let w = cpu_weight(&self.base)?;
        with_cpu_slice::<T, _>(&w, |wv| {
            gemm_into(&mut dx, false, dy, wv, false, (m, k, n), T::one()); // dY W
            Ok(())
        })?;
        drop(w);
        with_cpu_slice::<T, _>(&self.a, |av| {
            let r = av.len() / k;
            match &self.dropout {
                None => gemm_into(&mut dx, true, dyb, av, false, (m, k, r), T::one()),
                Some(op) => {
                    // The mask applies to the adapter's share only: its own buffer, masked, added.
                    let mut lora = crate::kernels::fused::uninit::<T>(m * k);
                    gemm_into(&mut lora, false, dyb, av, false, (m, k, r), T::one());
                    let lora = op.run(&lora);
                    dx.iter_mut().zip(&lora).for_each(|(d, &l)| *d += l);
                }
            }
            Ok(())
        })?;
        Ok(dx)
    }

    /// [`LoraLinearDx::run`] for a bf16 model: dY bf16, s (dY B) f32 -> dx = bf16(bf16(dY W) +
    /// bf16(mask ⊙ (s dY B) A)), the base's share rounded as Candle's bf16 matmul rounds it and
    /// the adapter's as its f32 -> bf16 cast does (PEFT: one cast per adapted linear).
    fn run_bf16(&self, dy: &[bf16], dyb: &[f32]) -> candle_core::Result<Vec<bf16>> {
        let (m, k, n) = self.mkn;
        let dy32 = widen_bf16(dy); // (M, N)
        let mut base = uninit::<f32>(m * k);
        let (w32, _) = cpu_weight_f32(&self.base, None)?;
        gemm_into(&mut base, false, &dy32, &w32, false, (m, k, n), 1.0); // dY W
        drop((dy32, w32));
        let mut lora = uninit::<f32>(m * k);
        with_cpu_slice::<f32, _>(&self.a, |av| {
            let r = av.len() / k;
            gemm_into(&mut lora, false, dyb, av, false, (m, k, r), 1.0); // (s dY B) A
            Ok(())
        })?;
        if let Some(op) = &self.dropout {
            lora = op.run(&lora);
        }
        let rows = k * rows_per_task(k);
        base.par_chunks_mut(rows)
            .zip(lora.par_chunks(rows))
            .for_each(|(d, l)| {
                d.iter_mut()
                    .zip(l)
                    .for_each(|(d, l)| *d = round_bf16(*d) + round_bf16(*l))
            });
        Ok(narrow_bf16(&base))
    }
}

impl CustomOp2 for LoraLinearDx {
    fn name(&self) -> &'static str {
        "lora-linear-dx"
    }

    fn cpu_fwd(
        &self,
        dy: &CpuStorage,
        dyl: &Layout,
        dyb: &CpuStorage,
        dybl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k, _) = self.mkn;
        let (Some((d0, d1)), Some((e0, e1))) =
            (dyl.contiguous_offsets(), dybl.contiguous_offsets())
        else {
            candle_core::bail!("lora linear dx: inputs must be contiguous");
        };
        let dx = match (dy, dyb) {
            (CpuStorage::F32(dy), CpuStorage::F32(dyb)) => {
                CpuStorage::F32(self.run(&dy[d0..d1], &dyb[e0..e1])?)
            }
            (CpuStorage::F64(dy), CpuStorage::F64(dyb)) => {
                CpuStorage::F64(self.run(&dy[d0..d1], &dyb[e0..e1])?)
            }
            (CpuStorage::BF16(dy), CpuStorage::F32(dyb)) => {
                CpuStorage::BF16(self.run_bf16(&dy[d0..d1], &dyb[e0..e1])?)
            }
            _ => candle_core::bail!("lora linear dx: f32 / f64, or dY bf16 with dY B f32"),
        };
        Ok((dx, Shape::from((m, k))))
    }
}

/// x cast once to the adapter dtype (f32) for the `linears` that all read x, when at least two
/// of them carry an adapter and x is not f32 already; None otherwise (each casts its own, or
/// the cast is a no-op).
pub fn adapter_input(linears: &[&Linear], x: &Tensor) -> Result<Option<Tensor>> {
    // The one-op path casts x inside the op (and again in its backward): no f32 copy of x.
    let with_lora: Vec<&Lora> = linears
        .iter()
        .filter(|l| !l.fuses(x))
        .filter_map(|l| l.lora())
        .collect();
    match with_lora.first() {
        Some(l) if with_lora.len() >= 2 && x.dtype() != l.a.dtype() => {
            Ok(Some(x.to_dtype(l.a.dtype())?))
        }
        _ => Ok(None),
    }
}

/// x W^T for a frozen W, whose backward gives dX = dY W and no dW.
/// The op keeps a reference to W (which lives in the model anyway) and nothing else.
pub struct FrozenMatmul {
    /// (N, K)
    pub w: Tensor,
}

/// A backend's storage as it sits in Candle's `Storage` enum: lets one generic forward serve
/// an op's `cpu_fwd` and `cuda_fwd`.
pub(crate) trait InStorage: BackendStorage {
    /// The device, in errors ("the CPU").
    const DEVICE: &'static str;
    /// The backend storage inside `s`, when `s` is on this backend.
    fn of(s: &Storage) -> Option<&Self>;
}

impl InStorage for CpuStorage {
    const DEVICE: &'static str = "the CPU";
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        }
    }
}

impl InStorage for CudaStorage {
    const DEVICE: &'static str = "the CUDA device";
    fn of(s: &Storage) -> Option<&Self> {
        match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        }
    }
}

/// x wᵀ: x (M, K) and w (N, K) storages on one backend -> (M, N), the forward of the matmul
/// ops (`op` names the op in errors).
pub(crate) fn matmul_t<S: BackendStorage>(
    x: &S,
    xl: &Layout,
    w: &S,
    wl: &Layout,
    op: &str,
) -> candle_core::Result<(S, Shape)> {
    let (m, k) = xl.shape().dims2()?;
    let (n, k2) = wl.shape().dims2()?;
    if k != k2 {
        candle_core::bail!("{op}: input has {k} features, weight expects {k2}");
    }
    let out = x.matmul(w, (1, m, n, k), xl, &wl.transpose(0, 1)?)?;
    Ok((out, Shape::from((m, n))))
}

/// [`matmul_t`] with the weight (N, K) a tensor, which must be on x's device.
pub(crate) fn matmul_wt<S: InStorage>(
    x: &S,
    xl: &Layout,
    w: &Tensor,
    op: &str,
) -> candle_core::Result<(S, Shape)> {
    let (ws, wl) = w.storage_and_layout();
    let Some(ws) = S::of(&ws) else {
        candle_core::bail!("{op}: weight is not on {}", S::DEVICE);
    };
    matmul_t(x, xl, ws, wl, op)
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    // x: (M, K) -> (M, N)
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        matmul_wt(s, l, &self.w, "frozen matmul")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        matmul_wt(s, l, &self.w, "frozen matmul")
    }

    // dX = dY W: (M, N) x (N, K) -> (M, K)
    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(dy.matmul(&self.w)?))
    }
}

/// x W^T for a trainable W (full fine-tuning), whose backward gives dX = dY W and
/// dW = dYᵀ X computed from detached tensors. Candle's own matmul backward builds dW as an op on
/// X and dY, so every weight gradient kept its layer's input and upstream gradient alive until
/// the gradients were dropped (measured: +111 MiB at the end of a 256-token backward of a
/// 105M-parameter model, and with checkpointing every recomputed layer stayed alive).
pub struct TrainableMatmul;

impl CustomOp2 for TrainableMatmul {
    fn name(&self) -> &'static str {
        "trainable-matmul"
    }

    // x: (M, K), w: (N, K) -> (M, N)
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        matmul_t(s, l, ws, wl, "trainable matmul")
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        matmul_t(s, l, ws, wl, "trainable matmul")
    }

    // dX = dY W: (M, N) x (N, K); dW = dYᵀ X: (N, M) x (M, K)
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.detach();
        let dx = x.track_op().then(|| dy.matmul(&w.detach())).transpose()?;
        let dw = dy.t()?.matmul(&x.detach())?;
        Ok((dx, Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn frozen_matmul_value_and_input_gradient_match_plain_matmul() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (5, 3), &dev)?;
        let x = Var::randn(0f32, 1., (4, 3), &dev)?;
        let frozen = Linear {
            weight: Base::Dense(Param::Frozen(w.clone())),
            bias: None,
            adapter: None,
        };
        let y = frozen.forward(x.as_tensor())?;
        let y_ref = x.matmul(&w.t()?)?;
        let diff = (&y - &y_ref)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "forward differs by {diff}");

        let g = y.sqr()?.sum_all()?.backward()?;
        let g_ref = y_ref.sqr()?.sum_all()?.backward()?;
        let dx = g.get(&x).expect("dx");
        let dx_ref = g_ref.get(&x).expect("dx ref");
        let diff = (dx - dx_ref)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "dx differs by {diff}");
        assert!(g.get(&w).is_none(), "a frozen weight must get no gradient");
        Ok(())
    }

    #[test]
    fn lora_with_zero_b_leaves_output_unchanged_and_gets_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1., (6, 4), &dev)?;
        let x = Tensor::randn(0f32, 1., (2, 3, 4), &dev)?;
        let lora = Lora {
            a: Var::from_tensor(&lora_a_init(2, 4, 7, &dev)?)?,
            b: Var::zeros((6, 2), DType::F32, &dev)?,
            scale: 2.0,
            dropout: None,
            id: 0,
        };
        let plain = Linear {
            weight: Base::Dense(Param::Frozen(w.clone())),
            bias: None,
            adapter: None,
        };
        let adapted = Linear {
            adapter: Some(Adapter::Lora(lora.clone())),
            ..plain.clone()
        };
        let y0 = plain.forward(&x)?;
        let y1 = adapted.forward(&x)?;
        assert_eq!(y1.dims(), &[2, 3, 6]);
        let diff = (&y0 - &y1)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        let g = y1.sum_all()?.backward()?;
        let gb = g.get(&lora.b).expect("B gets a gradient");
        assert!(gb.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
        Ok(())
    }

    /// The fused LoRA linear against the unfused graph of Candle ops, for each case: a dense
    /// base without and with a frozen bias, with dropout 0.3 (the same masks forward and
    /// backward), and an NF4 base with dropout. x, the base and the bias in `dtype`, A (r, k) and
    /// B (n, r) in `adapter`, x (rows.0, rows.1, k). Per case, the largest |a - b| / (1 + |b|)
    /// of y, dx, dA and dB (each pair checked to have one dtype); the fused path must be taken.
    fn fused_against_unfused(
        dtype: DType,
        adapter: DType,
        (n, k, r): (usize, usize, usize),
        rows: (usize, usize),
    ) -> Result<Vec<(String, [f64; 4])>> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.5, (n, k), &dev)?.to_dtype(dtype)?;
        let bias = Tensor::randn(0f32, 1., n, &dev)?.to_dtype(dtype)?;
        let nf4 = Arc::new({
            let mut q = Nf4Weight::quantize(&w.to_dtype(DType::F32)?, true)?;
            q.dtype = dtype;
            q
        });
        let mut errors = Vec::new();
        for (base, with_bias, p) in [
            (Base::Dense(Param::Frozen(w.clone())), false, 0.0),
            (Base::Dense(Param::Frozen(w.clone())), true, 0.0),
            (Base::Dense(Param::Frozen(w.clone())), true, 0.3),
            (Base::Nf4(nf4.clone()), false, 0.3),
        ] {
            let dropout = Arc::new(Dropout::new(p));
            dropout.set(Some(1234));
            let lora = Lora {
                a: Var::from_tensor(&lora_a_init(r, k, 7, &dev)?.to_dtype(adapter)?)?,
                b: Var::from_tensor(&Tensor::randn(0f32, 1., (n, r), &dev)?.to_dtype(adapter)?)?,
                scale: 1.5,
                dropout: Some(dropout),
                id: 4,
            };
            let lin = Linear {
                weight: base,
                bias: with_bias.then(|| Param::Frozen(bias.clone())),
                adapter: Some(Adapter::Lora(lora.clone())),
            };
            let x = Tensor::randn(0f32, 1., (rows.0, rows.1, k), &dev)?.to_dtype(dtype)?;
            let x = Var::from_tensor(&x)?;
            let probe = Tensor::randn(0f32, 1., (rows.0, rows.1, n), &dev)?.to_dtype(dtype)?;
            assert!(lin.fuses(x.as_tensor()));
            let run = |fused: bool| -> Result<Vec<Tensor>> {
                let y = if fused {
                    lin.forward_fused(x.as_tensor())?.expect("fused path taken")
                } else {
                    lin.forward_unfused(x.as_tensor(), None)?
                };
                let g = (&y * &probe)?.sum_all()?.backward()?;
                Ok(vec![
                    y,
                    g.get(&x).expect("dx").clone(),
                    g.get(&lora.a).expect("dA").clone(),
                    g.get(&lora.b).expect("dB").clone(),
                ])
            };
            let (f, u) = (run(true)?, run(false)?);
            let mut e = [0.0; 4];
            for (i, (a, b)) in f.iter().zip(&u).enumerate() {
                assert_eq!(a.dtype(), b.dtype(), "output {i}");
                let a = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                let b = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                e[i] = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
                    .fold(0.0, f64::max);
            }
            errors.push((format!("{dtype:?} bias={with_bias} p={p}"), e));
        }
        Ok(errors)
    }

    /// The fused LoRA linear (CPU, f32 / f64) against the unfused graph of Candle ops, value and
    /// gradients of x, A and B: with and without a frozen bias, with dropout (the same masks
    /// forward and backward), on a dense and an NF4 base. Tolerance 1e-5 relative in f32 (reordered
    /// sums; a missing scale, mask or term is O(1e-1)), 1e-12 in f64.
    #[test]
    fn fused_lora_linear_matches_the_unfused_graph() -> Result<()> {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            for (case, errors) in fused_against_unfused(dtype, dtype, (6, 8, 3), (2, 5))? {
                for (i, e) in errors.iter().enumerate() {
                    assert!(*e < tol, "{case} output {i}: {e}");
                }
            }
        }
        Ok(())
    }

    /// The fused LoRA linear of a bf16 model (x, base, bias bf16; A, B f32) against the unfused
    /// graph: y and dx bit for bit in bf16 (the op rounds where the graph rounds), dA and dB
    /// within 1e-5 relative (f32 sums in another order). A rounding step left out changes
    /// some elements by one bf16 ulp; a missing scale, mask or term changes O(1e-1) of them.
    #[test]
    fn fused_bf16_lora_linear_rounds_where_the_unfused_graph_rounds() -> Result<()> {
        let cases = fused_against_unfused(DType::BF16, DType::F32, (48, 64, 4), (3, 40))?;
        for (case, errors) in cases {
            for (i, e) in errors.iter().enumerate() {
                let tol = if i < 2 { 0.0 } else { 1e-5 };
                assert!(*e <= tol, "{case} output {i}: {e}");
            }
        }
        Ok(())
    }
}
