//! AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
//! <https://arxiv.org/abs/1711.05101>), computed exactly as `torch.optim.AdamW` with
//! `foreach=False, fused=False, amsgrad=False, maximize=False` (torch/optim/adamw.py,
//! `_single_tensor_adam` with `decoupled_weight_decay=True`).
//!
//! One difference, on purpose: the moments `m` and `v` are kept in f32 whatever the parameter's
//! dtype (torch keeps them in the parameter's dtype), and a bf16/f16 parameter is updated in f32
//! (`p.to_dtype(f32)`), then rounded back once. For f32 parameters the two are the same maths.
//!
//! State is created lazily (zeros) on the first step, so an optimizer built before the model is
//! moved to its device costs nothing.
//!
//! **Groups.** On CUDA, consecutive parameters on one device are updated together, up to
//! [`GROUP_ELEMS`] elements (a larger parameter is a group of its own; on the CPU each
//! parameter is its own group, [`group_elems`]): a group's moments are
//! one flat f32 buffer each, its parameters and gradients are copied into flat f32 inputs, the
//! arithmetic runs once over them, and each new value is copied back. Each element sees the
//! same operations as in a per-parameter update, so the results are bit for bit those (a test
//! checks it against [`adamw_update`]'s tensor ops). The arithmetic is two ops
//! (`tallow_model::kernels::adamw`: the moments, one (2, len) buffer, updated in place, then the
//! new values; one CUDA kernel each, a CPU twin on the CPU) where Candle's tensor ops
//! ([`adamw_math`]) took 13 launches. Device cost of a step: 2 launches per group and 3 per
//! member (its parameter and gradient copied in, the new value copied back; a lone member
//! copies neither in), +2 casts for a bf16/f16 parameter, +1 for a bf16/f16 gradient. A group
//! of f32 parameters with f32 gradients (LoRA's factors, an f32 model) on CUDA takes neither
//! the flat inputs nor the copies: one launch per [`adamw::MEMBERS`] members
//! (`adamw::adamw_members`: each parameter and gradient read where it is, the parameter
//! written in place, the same operations per element, so the same bits). Updated
//! one parameter at a time with tensor ops it was 14 per parameter (13 without weight decay):
//! 182 launches per decoder layer and step for 14 LoRA factors, 42 in groups
//! (`benchmarks/op-counts.md`). The f32 temporaries are a group's flat parameters, gradients
//! and new values (12 bytes per element), which `tallow estimate` counts. Checkpoints keep one
//! `"{i}.exp_avg"` / `"{i}.exp_avg_sq"` per parameter in its shape, as before.

use std::collections::HashMap;

use candle_core::{DType, Shape, Tensor, Var};
use tallow_model::kernels::adamw;
use tallow_model::kernels::dispatch::Backend;

use super::{check_grads, load_param_state, read_moment_step, step_tensor, Optimizer, STEP_KEY};

/// AdamW hyperparameters. [`Default`] is torch's: betas (0.9, 0.999), eps 1e-8, weight decay 0.01.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// Decay of the first moment (mean of the gradient).
    pub beta1: f64,
    /// Decay of the second moment (uncentered variance of the gradient).
    pub beta2: f64,
    /// Added to the bias-corrected sqrt(v), outside the square root, as torch does.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by (1 - lr * weight_decay).
    pub weight_decay: f64,
}

impl Default for AdamWParams {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Most elements in one group of parameters updated together (module docs): 4 MiB per f32
/// buffer, about 24 MiB of temporaries while a group is updated.
pub const GROUP_ELEMS: usize = 1 << 20;

/// The group size on `backend`: [`GROUP_ELEMS`] where launches cost (CUDA), 0 on the CPU, where
/// an op costs no launch: there grouping would only add the copies into and out of the flat
/// buffers and a group's temporaries (a 77M Llama LoRA r64 in bf16 trained at the same speed
/// either way, within the order effect of a side-by-side run, 2026-11-27), so each parameter is
/// a group of its own, as before.
pub fn group_elems(backend: Backend) -> usize {
    match backend {
        Backend::Cpu => 0,
        Backend::Cuda => GROUP_ELEMS,
    }
}

/// The moments of a group of consecutive parameters on one device, flat f32.
#[derive(Debug, Clone)]
struct Group {
    /// Index (in the parameter list) of each member.
    params: Vec<usize>,
    /// Shape of each member.
    shapes: Vec<Shape>,
    /// Element offset of each member in the flat buffers.
    offsets: Vec<usize>,
    /// m and v ("exp_avg", "exp_avg_sq" in torch), one flat buffer: (2, len), updated in place.
    moments: Tensor,
}

impl Group {
    /// Member `j`'s part of the flat `t`, in its shape: a view (no copy).
    fn part(&self, t: &Tensor, j: usize) -> candle_core::Result<Tensor> {
        let shape = &self.shapes[j];
        t.narrow(0, self.offsets[j], shape.elem_count())?
            .reshape(shape)
    }

    /// The members' tensors (`get(param index)`, any float dtype) in f32, flattened and
    /// concatenated: (len,). One copy per member (none for a lone f32 member).
    fn flat(
        &self,
        get: impl Fn(usize) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let pieces = self
            .params
            .iter()
            .map(|&i| get(i)?.to_dtype(DType::F32)?.flatten_all()) // (n,)
            .collect::<candle_core::Result<Vec<_>>>()?;
        if pieces.len() == 1 {
            return Ok(pieces.into_iter().next().expect("one piece"));
        }
        Tensor::cat(&pieces, 0) // (len,)
    }
}

#[cfg(test)]
impl Group {
    /// m (len,)
    fn exp_avg(&self) -> Tensor {
        self.moments.get(0).expect("(2, len) moments")
    }

    /// v (len,)
    fn exp_avg_sq(&self) -> Tensor {
        self.moments.get(1).expect("(2, len) moments")
    }
}

/// The groups of `params` (module docs), each up to `cap` elements (0: one parameter each):
/// each group's member indices, shapes and offsets.
#[allow(clippy::type_complexity)]
fn plan(params: &[Var], cap: Option<usize>) -> Vec<(Vec<usize>, Vec<Shape>, Vec<usize>)> {
    let mut groups: Vec<(Vec<usize>, Vec<Shape>, Vec<usize>, usize)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let n = p.elem_count();
        let cap = cap.unwrap_or_else(|| group_elems(Backend::of(p.device())));
        let joins = groups.last().is_some_and(|(members, _, _, len)| {
            len + n <= cap && params[members[0]].device().same_device(p.device())
        });
        if !joins {
            groups.push((Vec::new(), Vec::new(), Vec::new(), 0));
        }
        let (members, shapes, offsets, len) = groups.last_mut().expect("a group");
        members.push(i);
        shapes.push(p.shape().clone());
        offsets.push(*len);
        *len += n;
    }
    groups.into_iter().map(|(m, s, o, _)| (m, s, o)).collect()
}

/// The groups [`plan`] makes for parameters of `counts` elements (in the trainable order, one
/// device) with groups of up to `cap` ([`group_elems`]), each as (elements, members): the
/// update's f32 temporaries are group-sized (a lone member's fewer), which the memory estimate
/// counts.
pub fn group_sizes(counts: impl IntoIterator<Item = usize>, cap: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for n in counts {
        match out.last_mut() {
            Some((len, members)) if *len + n <= cap => {
                *len += n;
                *members += 1;
            }
            _ => out.push((n, 1)),
        }
    }
    out
}

/// AdamW with f32 moments. See the module docs.
#[derive(Debug, Clone)]
pub struct AdamW {
    hp: AdamWParams,
    /// t: the number of steps taken (the step being taken is t + 1).
    t: u32,
    /// The groups once the first step (or `load_state`) has run.
    groups: Option<Vec<Group>>,
    /// Group size; None: by device ([`group_elems`]).
    cap: Option<usize>,
}

impl AdamW {
    pub fn new(hp: AdamWParams) -> Self {
        Self {
            hp,
            t: 0,
            groups: None,
            cap: None,
        }
    }

    /// Groups of up to `cap` elements whatever the device (tests: groups on the CPU).
    #[doc(hidden)]
    pub fn with_group_elems(mut self, cap: usize) -> Self {
        self.cap = Some(cap);
        self
    }

    pub fn params(&self) -> AdamWParams {
        self.hp
    }

    /// Number of steps taken so far.
    pub fn steps_taken(&self) -> u32 {
        self.t
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        self.step_scaled(params, grads, lr, None)
    }

    fn applies_grad_scale(&self) -> bool {
        true
    }

    /// The f32 members' kernel applies `scale` as it reads each gradient (no op of its own);
    /// other groups multiply their own gradients as they gather them (one group's copies
    /// alive at a time).
    fn step_scaled(
        &mut self,
        params: &[Var],
        grads: &[Tensor],
        lr: f64,
        scale: Option<&Tensor>,
    ) -> candle_core::Result<()> {
        check_grads(params, grads)?;
        let groups = match &mut self.groups {
            Some(groups) => {
                check_groups(groups, params)?;
                groups
            }
            None => {
                // Lazy init: m = v = 0, f32, one flat buffer per group on its device.
                let init = plan(params, self.cap)
                    .into_iter()
                    .map(|(members, shapes, offsets)| {
                        let len: usize = shapes.iter().map(Shape::elem_count).sum();
                        let dev = params[members[0]].device();
                        Ok(Group {
                            moments: Tensor::zeros((2, len), DType::F32, dev)?,
                            params: members,
                            shapes,
                            offsets,
                        })
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                self.groups.insert(init)
            }
        };

        let t = self.t + 1; // t = index of this step, from 1
        let k = StepConstants::new(&self.hp, t, lr).fused();
        for group in groups.iter_mut() {
            let members_f32 = group.params.iter().all(|&i| {
                params[i].dtype() == DType::F32
                    && grads[i].dtype() == DType::F32
                    && params[i].is_contiguous()
            });
            if members_f32 && Backend::of(params[group.params[0]].device()) == Backend::Cuda {
                // f32 members on CUDA: each slice of up to adamw::MEMBERS one op, reading the
                // parameters and gradients where they are and writing the parameters in place
                for (c, chunk) in group.params.chunks(adamw::MEMBERS).enumerate() {
                    let base = group.offsets[c * adamw::MEMBERS];
                    let ps: Vec<&Var> = chunk.iter().map(|&i| &params[i]).collect();
                    let gs = chunk
                        .iter()
                        .map(|&i| grads[i].detach().contiguous())
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    adamw::adamw_members(&group.moments, base, &ps, &gs, &k, scale)?;
                }
                continue;
            }
            // flat f32 inputs (len,): parameters (detached: the update records no graph) and
            // gradients (times the clipping coefficient, one op each)
            let p32 = group.flat(|i| Ok(params[i].as_detached_tensor()))?;
            let g32 = group.flat(|i| match scale {
                Some(s) => crate::grads::scaled_by(&grads[i].detach(), s),
                None => Ok(grads[i].detach()),
            })?;
            // two ops (kernels::adamw): m and v in place, then the new values
            adamw::adamw_moments(&group.moments, &g32, &k)?;
            let p32 = adamw::adamw_param(&p32, &group.moments, &k)?;
            for (j, &i) in group.params.iter().enumerate() {
                // (n,) view -> p's shape, rounded once to p's dtype, copied into p
                let p = &params[i];
                p.set(&group.part(&p32, j)?.to_dtype(p.dtype())?)?;
            }
        }
        self.t = t;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut per_param: Vec<(usize, Tensor, Tensor)> = Vec::new();
        for g in self.groups.iter().flatten() {
            for (j, &i) in g.params.iter().enumerate() {
                // views of the flat buffers in the parameter's shape
                let (m, v) = (g.moments.get(0), g.moments.get(1));
                let m = m
                    .and_then(|m| g.part(&m, j))
                    .expect("member within its group");
                let v = v
                    .and_then(|v| g.part(&v, j))
                    .expect("member within its group");
                per_param.push((i, m, v));
            }
        }
        per_param.sort_by_key(|(i, _, _)| *i);
        for (i, m, v) in per_param {
            out.push((format!("{i}.exp_avg"), m));
            out.push((format!("{i}.exp_avg_sq"), v));
        }
        out.push((STEP_KEY.to_string(), step_tensor(self.t)));
        out
    }

    fn load_state(
        &mut self,
        params: &[Var],
        state: &HashMap<String, Tensor>,
    ) -> candle_core::Result<()> {
        const WHAT: [&str; 2] = ["exp_avg", "exp_avg_sq"];
        let (t, has_moments) = read_moment_step("adamw", state, params.len(), &WHAT)?;
        if !has_moments {
            // Saved before the first step: nothing but the counter.
            self.t = t;
            self.groups = None;
            return Ok(());
        }
        let groups = plan(params, self.cap)
            .into_iter()
            .map(|(members, shapes, offsets)| {
                let flat = |what: &str| -> candle_core::Result<Tensor> {
                    let parts = members
                        .iter()
                        .map(|&i| {
                            load_param_state("adamw", state, i, what, &params[i])?
                                .to_dtype(DType::F32)?
                                .flatten_all()
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&parts, 0)
                };
                Ok(Group {
                    moments: Tensor::stack(&[flat(WHAT[0])?, flat(WHAT[1])?], 0)?, // (2, len)
                    params: members,
                    shapes,
                    offsets,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.t = t;
        self.groups = Some(groups);
        Ok(())
    }

    fn name(&self) -> &'static str {
        super::OptimizerKind::AdamW.name()
    }
}

/// The host-side scalars of AdamW step `t` (from 1), in f64 as Python computes them in torch's
/// single-tensor path. Shared by [`AdamW`] and [`super::adamw8bit::AdamW8bit`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConstants {
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
    /// lr / (1 - b1^t)
    step_size: f64,
    /// sqrt(1 - b2^t)
    bias_correction2_sqrt: f64,
    /// p - lr*wd*p = p * (1 - lr*wd)
    decay: f64,
}

impl StepConstants {
    /// The same scalars as the fused ops take them (f32, as Candle's affine rounds them).
    pub(crate) fn fused(&self) -> adamw::AdamWStep {
        adamw::AdamWStep {
            beta1: self.b1 as f32,
            one_minus_beta1: (1.0 - self.b1) as f32,
            beta2: self.b2 as f32,
            one_minus_beta2: (1.0 - self.b2) as f32,
            inv_bias_correction2_sqrt: (1.0 / self.bias_correction2_sqrt) as f32,
            eps: self.eps as f32,
            step_size: self.step_size as f32,
            decay: (self.wd != 0.0).then_some(self.decay as f32),
        }
    }

    pub(crate) fn new(hp: &AdamWParams, t: u32, lr: f64) -> Self {
        let AdamWParams {
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
        } = *hp;
        let bias_correction1 = 1.0 - b1.powi(t as i32); // 1 - b1^t
        let bias_correction2 = 1.0 - b2.powi(t as i32); // 1 - b2^t
        Self {
            b1,
            b2,
            eps,
            wd,
            step_size: lr / bias_correction1,
            bias_correction2_sqrt: bias_correction2.sqrt(),
            decay: 1.0 - lr * wd,
        }
    }
}

/// One AdamW update of `p` from its gradient `g` and its f32 moments `exp_avg` (m) and
/// `exp_avg_sq` (v); writes `p` and returns the new (m, v), f32 on p's device.
///
/// Device cost for an f32 parameter and gradient: 14 kernel launches over its elements
/// ([`adamw_math`] 13, the copy into `p` 1), +2 casts for a bf16/f16 parameter and +1 for a
/// bf16/f16 gradient; no host-device copies (the scalars travel as kernel arguments of `affine`).
pub(crate) fn adamw_update(
    p: &Var,
    g: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    k: &StepConstants,
) -> candle_core::Result<(Tensor, Tensor)> {
    // p32 = p in f32 (shares p's storage when p is already f32; never written in place)
    let p32 = p.as_detached_tensor().to_dtype(DType::F32)?;
    // g32 = g in f32, detached so the update records no graph
    let g32 = g.detach().to_dtype(DType::F32)?;
    let (p32, m, v) = adamw_math(&p32, &g32, exp_avg, exp_avg_sq, k)?;
    // write back, rounded once to the parameter's dtype (bf16/f16/f32)
    p.set(&p32.to_dtype(p.dtype())?)?;
    Ok((m, v))
}

/// The AdamW arithmetic on f32 tensors of one shape: returns (new p, m, v). 13 element-wise
/// kernel launches (12 without weight decay): weight decay 1, m 3, v 4, denominator 2, step 3.
pub(crate) fn adamw_math(
    p32: &Tensor,
    g32: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    k: &StepConstants,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let StepConstants {
        b1,
        b2,
        eps,
        wd,
        step_size,
        bias_correction2_sqrt,
        decay,
    } = *k;
    // p <- p * (1 - lr * wd)                     decoupled weight decay, before the Adam step
    let p32 = if wd != 0.0 {
        (p32 * decay)?
    } else {
        p32.clone()
    };
    // m <- b1 * m + (1 - b1) * g                 first moment
    let m = ((exp_avg * b1)? + (g32 * (1.0 - b1))?)?;
    // v <- b2 * v + (1 - b2) * g^2               second moment
    let v = ((exp_avg_sq * b2)? + (g32.sqr()? * (1.0 - b2))?)?;
    // denom = sqrt(v) / sqrt(1 - b2^t) + eps     eps outside the sqrt, after bias correction;
    // one affine, x * (1 / sqrt(1 - b2^t)) + eps: on the CPU the same two roundings as
    // `(x / c) + eps` in Candle (whose `/ c` is `* (1 / c)`); CUDA may fuse it into one fma.
    let denom = v.sqrt()?.affine(1.0 / bias_correction2_sqrt, eps)?;
    // p <- p - (lr / (1 - b1^t)) * m / denom     bias-corrected step
    let p32 = (p32 - ((&m / &denom)? * step_size)?)?;
    Ok((p32, m, v))
}

/// Errors unless the groups hold one member per parameter, of its shape.
fn check_groups(groups: &[Group], params: &[Var]) -> candle_core::Result<()> {
    let held: usize = groups.iter().map(|g| g.params.len()).sum();
    if held != params.len() {
        candle_core::bail!(
            "adamw: state holds {held} parameters but step got {}: the trainable set must not change",
            params.len()
        );
    }
    for g in groups {
        for (j, &i) in g.params.iter().enumerate() {
            if &g.shapes[j] != params[i].shape() {
                candle_core::bail!(
                    "adamw: state of parameter {i} has shape {:?} but the parameter has shape {:?}",
                    g.shapes[j],
                    params[i].shape()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::read_step;
    use candle_core::Device;

    /// Initial values, shape (2, 3): bf16-exact, so the same start serves f32 and bf16.
    const P0: [f32; 6] = [1.0, -0.5, 0.25, 2.0, -1.5, 0.0];
    /// Gradients of steps 1..=3. Element 5 has g = 0 on every step: only weight decay moves it
    /// (m = v = 0, the update is 0 / eps), and element 5 of P0 is 0 so it must stay 0.
    /// Element 2 has a small gradient, so eps = 1e-3 weighs in the denominator.
    const G: [[f32; 6]; 3] = [
        [0.1, -0.2, 0.001, 0.5, -0.05, 0.0],
        [-0.3, 0.1, 0.002, 0.4, 0.05, 0.0],
        [0.2, 0.0, -0.001, -0.1, 0.05, 0.0],
    ];
    const HP: AdamWParams = AdamWParams {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-3,
        weight_decay: 0.1,
    };
    const LR: [f64; 3] = [0.1, 0.05, 0.02];

    /// Reference AdamW in f64, element by element, straight from the torch formula.
    /// `round` is applied to the parameter after each step (models its storage dtype).
    fn reference(round: impl Fn(f64) -> f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut p: Vec<f64> = P0.iter().map(|&x| x as f64).collect();
        let mut m = vec![0f64; 6];
        let mut v = vec![0f64; 6];
        for (step, (g, lr)) in G.iter().zip(LR).enumerate() {
            let t = (step + 1) as i32;
            let bc1 = 1.0 - HP.beta1.powi(t);
            let bc2 = 1.0 - HP.beta2.powi(t);
            for j in 0..6 {
                let g = g[j] as f64;
                p[j] -= lr * HP.weight_decay * p[j];
                m[j] = HP.beta1 * m[j] + (1.0 - HP.beta1) * g;
                v[j] = HP.beta2 * v[j] + (1.0 - HP.beta2) * g * g;
                let denom = v[j].sqrt() / bc2.sqrt() + HP.eps;
                p[j] -= (lr / bc1) * m[j] / denom;
                p[j] = round(p[j]);
            }
        }
        (p, m, v)
    }

    /// Round to the nearest bf16 (ties to even), as Candle's f32 -> bf16 cast does.
    fn round_bf16(x: f64) -> f64 {
        let bits = (x as f32).to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
        f32::from_bits(rounded) as f64
    }

    fn run(dtype: DType) -> (Var, AdamW) {
        let dev = Device::Cpu;
        let p = Var::from_tensor(
            &Tensor::new(&P0, &dev)
                .unwrap()
                .reshape((2, 3))
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let mut opt = AdamW::new(HP);
        for (g, lr) in G.iter().zip(LR) {
            let g = Tensor::new(g, &dev).unwrap().reshape((2, 3)).unwrap();
            opt.step(std::slice::from_ref(&p), &[g], lr).unwrap();
        }
        (p, opt)
    }

    fn values(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn f32_matches_reference_for_three_steps() {
        let (p, opt) = run(DType::F32);
        let (p_ref, m_ref, v_ref) = reference(|x| x);
        assert_eq!(p.dtype(), DType::F32);
        assert_eq!(opt.steps_taken(), 3);
        // f32 arithmetic vs f64 reference on values of order 1: a few f32 ulps.
        let tol = 1e-6;
        for (a, b) in values(p.as_tensor()).iter().zip(&p_ref) {
            assert!((a - b).abs() <= tol * b.abs().max(1.0), "p {a} vs {b}");
        }
        let st = &opt.groups.as_ref().unwrap()[0];
        assert_eq!(st.exp_avg().dtype(), DType::F32);
        for (a, b) in values(&st.exp_avg()).iter().zip(&m_ref) {
            assert!((a - b).abs() <= 1e-7, "m {a} vs {b}");
        }
        for (a, b) in values(&st.exp_avg_sq()).iter().zip(&v_ref) {
            assert!((a - b).abs() <= 1e-8, "v {a} vs {b}");
        }
        // g = 0 and p = 0 throughout: still exactly 0.
        assert_eq!(values(p.as_tensor())[5], 0.0);
    }

    #[test]
    fn bf16_param_updates_in_f32_and_rounds_once_per_step() {
        let (p, opt) = run(DType::BF16);
        assert_eq!(p.dtype(), DType::BF16);
        let (p_ref, m_ref, _) = reference(round_bf16);
        // The reference rounds to bf16 after each step as the optimizer does; f32 vs f64
        // arithmetic may land on the other side of a rounding boundary: allow one bf16 ulp
        // (2^-7 relative: 8 significant bits).
        for (a, b) in values(p.as_tensor()).iter().zip(&p_ref) {
            assert!((a - b).abs() <= b.abs() * 2f64.powi(-7), "p {a} vs {b}");
        }
        // The moments stay f32 and do not depend on p: f32 accuracy.
        let st = &opt.groups.as_ref().unwrap()[0];
        assert_eq!(st.exp_avg().dtype(), DType::F32);
        assert_eq!(st.exp_avg_sq().dtype(), DType::F32);
        for (a, b) in values(&st.exp_avg()).iter().zip(&m_ref) {
            assert!((a - b).abs() <= 1e-7, "m {a} vs {b}");
        }
    }

    /// Two parameters of different shapes and dtypes, and fixed gradients per step.
    fn two_params(dev: &Device) -> Vec<Var> {
        let a = Tensor::new(&[[0.5f32, -1.0], [1.5, 2.0]], dev).unwrap();
        let b = Tensor::new(&[0.25f32, -0.75, 3.0], dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        vec![Var::from_tensor(&a).unwrap(), Var::from_tensor(&b).unwrap()]
    }

    fn two_grads(step: usize, dev: &Device) -> Vec<Tensor> {
        let s = step as f32 + 1.0;
        vec![
            Tensor::new(&[[0.1f32 * s, -0.2], [0.3, -0.4 / s]], dev).unwrap(),
            Tensor::new(&[0.05f32, -0.5 * s, 0.01], dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        ]
    }

    fn bits(p: &Var) -> Vec<u32> {
        values(p.as_tensor())
            .iter()
            .map(|&x| (x as f32).to_bits())
            .collect()
    }

    #[test]
    fn state_round_trip_gives_bit_identical_third_step() {
        let dev = Device::Cpu;
        let hp = AdamWParams::default();
        let pa = two_params(&dev);
        let mut a = AdamW::new(hp);
        for step in 0..2 {
            a.step(&pa, &two_grads(step, &dev), 1e-2).unwrap();
        }
        // B starts from A's parameter values and A's saved state.
        let pb: Vec<Var> = pa
            .iter()
            .map(|p| Var::from_tensor(&p.as_tensor().copy().unwrap()).unwrap())
            .collect();
        let state: HashMap<String, Tensor> = a.state().into_iter().collect();
        assert_eq!(state.len(), 5); // 2 params x (exp_avg, exp_avg_sq) + step
        assert_eq!(read_step(&state).unwrap(), Some(2));
        let mut b = AdamW::new(hp);
        b.load_state(&pb, &state).unwrap();
        assert_eq!(b.steps_taken(), 2);

        a.step(&pa, &two_grads(2, &dev), 1e-2).unwrap();
        b.step(&pb, &two_grads(2, &dev), 1e-2).unwrap();
        for (x, y) in pa.iter().zip(&pb) {
            assert_eq!(bits(x), bits(y));
        }
        // and the step actually moved the parameters
        assert_ne!(bits(&pa[0]), bits(&two_params(&dev)[0]));
    }

    /// Parameters of these shapes and dtypes with smooth values (a sine of the index, shifted
    /// per parameter).
    fn sine_params(sizes: &[(&[usize], DType)]) -> Vec<Var> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, (shape, dt))| {
                let n: usize = shape.iter().product();
                let t = Tensor::arange(0f32, n as f32, &Device::Cpu)
                    .unwrap()
                    .affine(0.01, i as f64 * 0.1 - 0.2)
                    .unwrap()
                    .sin()
                    .unwrap()
                    .reshape(*shape)
                    .unwrap()
                    .to_dtype(*dt)
                    .unwrap();
                Var::from_tensor(&t).unwrap()
            })
            .collect()
    }

    /// Step `step`'s gradients of `params`: cos(p) (step + 1), in p's dtype.
    fn cos_grads(step: usize, params: &[Var]) -> Vec<Tensor> {
        params
            .iter()
            .map(|p| {
                (p.as_tensor().to_dtype(DType::F32).unwrap().cos().unwrap() * (step as f64 + 1.0))
                    .unwrap()
                    .to_dtype(p.dtype())
                    .unwrap()
            })
            .collect()
    }

    /// Zero first and second moments (f32) for each of `params`, for [`adamw_update`].
    fn zero_moments(params: &[Var]) -> Vec<(Tensor, Tensor)> {
        params
            .iter()
            .map(|p| {
                let z = Tensor::zeros(p.shape(), DType::F32, p.device()).unwrap();
                (z.clone(), z)
            })
            .collect()
    }

    /// On the CUDA path (its CPU twin) a group of f32 parameters is updated in place by
    /// `adamw::adamw_members`, one launch per `adamw::MEMBERS` members and no copies, with a
    /// per-parameter update's bits: 70 small f32 parameters of mixed shapes in one group (3
    /// launches of 32, 32 and 6 members), then a large one alone, 3 steps with weight decay,
    /// the last two with a gradient clipping coefficient applied in the op. A slice's first
    /// element off by one member (its base), or the coefficient left out, fails it.
    #[test]
    fn f32_members_update_in_place_with_the_per_parameter_bits() {
        use tallow_model::kernels::dispatch::with_cuda_paths_on_cpu;
        let dev = Device::Cpu;
        let shapes: Vec<Vec<usize>> = (0..70)
            .map(|i| {
                if i % 3 == 0 {
                    vec![2, 3 + i % 5]
                } else {
                    vec![5 + i % 7]
                }
            })
            .chain(std::iter::once(vec![GROUP_ELEMS + 1]))
            .collect();
        let shapes: Vec<(&[usize], DType)> =
            shapes.iter().map(|s| (s.as_slice(), DType::F32)).collect();
        let make = || sine_params(&shapes);
        let hp = AdamWParams::default();
        let (grouped, alone) = (make(), make());
        let mut opt = AdamW::new(hp).with_group_elems(GROUP_ELEMS);
        let mut moments = zero_moments(&alone);
        // steps 2 and 3 with a clipping coefficient, which the members' op applies as it
        // reads each gradient and the per-parameter update gets multiplied in
        let coef = Tensor::new(0.37f32, &dev).unwrap();
        for step in 0..3 {
            let g = cos_grads(step, &grouped);
            let scale = (step > 0).then_some(&coef);
            let c0 = candle_core::launches::count_on_this_thread();
            with_cuda_paths_on_cpu(|| opt.step_scaled(&grouped, &g, 1e-2, scale)).unwrap();
            let launched = candle_core::launches::count_on_this_thread() - c0;
            // 70 members: 3 launches; the large parameter alone: 1; the moments' zeros (step 1)
            let zeros = if step == 0 { 2 } else { 0 };
            assert_eq!(launched, 4 + zeros, "step {step}");
            let k = StepConstants::new(&hp, step as u32 + 1, 1e-2);
            let mut g = cos_grads(step, &alone);
            if let Some(c) = scale {
                g = g.iter().map(|g| g.broadcast_mul(c).unwrap()).collect();
            }
            for ((p, g), (m, v)) in alone.iter().zip(&g).zip(moments.iter_mut()) {
                (*m, *v) = adamw_update(p, g, m, v, &k).unwrap();
            }
        }
        for (i, (a, b)) in grouped.iter().zip(&alone).enumerate() {
            assert_eq!(bits(a), bits(b), "parameter {i}");
        }
        let sizes: Vec<usize> = opt
            .groups
            .as_ref()
            .unwrap()
            .iter()
            .map(|g| g.params.len())
            .collect();
        assert_eq!(sizes, vec![70, 1]);
    }

    /// The grouped update (module docs) gives a per-parameter update's bits: mixed shapes,
    /// f32 and bf16 parameters, a group of several members, a parameter larger than
    /// [`GROUP_ELEMS`] (a group of its own) and one after it, 3 steps with weight decay, against
    /// [`adamw_update`] run on each parameter alone; the groups are the ones [`group_sizes`]
    /// (the estimate's) says. Shifting a member's offset by one element, or writing the wrong
    /// member back, fails it.
    #[test]
    fn grouped_update_gives_the_per_parameter_bits() {
        let sizes: [(&[usize], DType); 5] = [
            (&[3, 5], DType::F32),
            (&[7], DType::BF16),
            (&[4, 4], DType::F32),
            (&[GROUP_ELEMS + 3], DType::F32),
            (&[2, 6], DType::F32),
        ];
        let make = || sine_params(&sizes);
        let hp = AdamWParams::default();
        let (grouped, alone) = (make(), make());
        let mut opt = AdamW::new(hp).with_group_elems(GROUP_ELEMS);
        let mut moments = zero_moments(&alone);
        for step in 0..3 {
            opt.step(&grouped, &cos_grads(step, &grouped), 1e-2)
                .unwrap();
            let k = StepConstants::new(&hp, step as u32 + 1, 1e-2);
            let g = cos_grads(step, &alone);
            for ((p, g), (m, v)) in alone.iter().zip(&g).zip(moments.iter_mut()) {
                (*m, *v) = adamw_update(p, g, m, v, &k).unwrap();
            }
        }
        for (i, (a, b)) in grouped.iter().zip(&alone).enumerate() {
            assert_eq!(bits(a), bits(b), "parameter {i}");
        }
        let groups = opt.groups.as_ref().unwrap();
        let sizes: Vec<(usize, usize)> = groups
            .iter()
            .map(|g| (g.exp_avg().elem_count(), g.params.len()))
            .collect();
        let counts = grouped.iter().map(|p| p.elem_count());
        assert_eq!(sizes, group_sizes(counts, GROUP_ELEMS));
        assert_eq!(sizes, vec![(15 + 7 + 16, 3), (GROUP_ELEMS + 3, 1), (12, 1)]);
        let state: HashMap<String, Tensor> = opt.state().into_iter().collect();
        for (i, (m, _)) in moments.iter().enumerate() {
            assert_eq!(
                values(&state[&format!("{i}.exp_avg")]),
                values(m),
                "saved m of parameter {i}"
            );
        }
    }

    #[test]
    fn fresh_state_holds_only_the_counter_and_loads_back() {
        let dev = Device::Cpu;
        let params = two_params(&dev);
        let state: HashMap<String, Tensor> = AdamW::new(HP).state().into_iter().collect();
        assert_eq!(state.keys().collect::<Vec<_>>(), vec![STEP_KEY]);
        let mut b = AdamW::new(HP);
        b.load_state(&params, &state).unwrap();
        b.step(&params, &two_grads(0, &dev), 1e-2).unwrap();
        assert_eq!(b.steps_taken(), 1);
    }

    #[test]
    fn load_state_rejects_mismatches_with_a_clear_message() {
        let dev = Device::Cpu;
        let params = two_params(&dev);
        let mut a = AdamW::new(HP);
        a.step(&params, &two_grads(0, &dev), 1e-2).unwrap();
        let good: HashMap<String, Tensor> = a.state().into_iter().collect();
        let err = |state: &HashMap<String, Tensor>, ps: &[Var]| {
            AdamW::new(HP)
                .load_state(ps, state)
                .unwrap_err()
                .to_string()
        };

        // wrong shape
        let mut bad = good.clone();
        bad.insert(
            "1.exp_avg".into(),
            Tensor::zeros(4, DType::F32, &dev).unwrap(),
        );
        let msg = err(&bad, &params);
        assert!(msg.contains("`1.exp_avg` has shape"), "{msg}");

        // missing tensor
        let mut bad = good.clone();
        bad.remove("0.exp_avg_sq");
        let msg = err(&bad, &params);
        assert!(msg.contains("no `0.exp_avg_sq`"), "{msg}");

        // state for more parameters than given
        let msg = err(&good, &params[..1]);
        assert!(msg.contains("unexpected tensor `1."), "{msg}");

        // missing counter
        let mut bad = good.clone();
        bad.remove(STEP_KEY);
        let msg = err(&bad, &params);
        assert!(msg.contains("no `step`"), "{msg}");

        // a step with another trainable set than the state's
        let mut b = AdamW::new(HP);
        b.load_state(&params, &good).unwrap();
        let msg = b
            .step(&params[..1], &two_grads(0, &dev)[..1], 1e-2)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("must not change"), "{msg}");
    }

    #[test]
    fn step_rejects_grad_of_wrong_shape() {
        let dev = Device::Cpu;
        let params = two_params(&dev);
        let mut grads = two_grads(0, &dev);
        grads[1] = Tensor::zeros(2, DType::F32, &dev).unwrap();
        let msg = AdamW::new(HP)
            .step(&params, &grads, 1e-2)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("gradient 1 has shape"), "{msg}");
    }
}
