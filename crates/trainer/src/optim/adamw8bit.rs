//! AdamW with 8-bit moments (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
//! <https://arxiv.org/abs/2110.02861>; bitsandbytes `AdamW8bit`): the maths of [`super::AdamW`]
//! (torch semantics, bias correction, decoupled weight decay, the update in f32), with the two
//! moments stored blockwise 8-bit between steps.
//!
//! Per parameter of at least [`MIN_8BIT_ELEMS`] elements, m is kept blockwise 8-bit with the
//! signed dynamic map and v with the unsigned one, blocks of [`BLOCK`] (f32 absmax per block):
//! about 2 bytes per parameter plus 8 per 256 instead of 8. Smaller tensors (norms, biases, small
//! LoRA factors) keep f32 moments, as bitsandbytes does.
//!
//! Each step dequantizes m and v to f32, applies the AdamW update with tensor ops, and
//! requantizes; everything stays on the parameter's device (quantization runs a CPU kernel on the
//! CPU and Candle tensor ops elsewhere, see `tallow_model::kernels::blockwise8`; both give the same
//! codes, so on the CPU the generic path gives the CPU path's bits, which a test checks).
//!
//! **Groups.** The 8-bit parameters are updated in groups (consecutive 8-bit parameters on one
//! device, up to [`GROUP_ELEMS`] elements): a group's moments live in one flat buffer, each
//! member starting on a block boundary (zero padding, code of 0.0, up to the next multiple of
//! 256), so its blocks are exactly the member's own blocks and the results are bit for bit those
//! of a per-parameter update. The update holds f32 copies of one group at a time (parameters,
//! gradients, both moments and the arithmetic's temporaries, about 40 bytes per element), so the
//! cap keeps that transient at one chunk's (or, for a larger parameter, one tensor's), as
//! bitsandbytes' kernels work block by block: with 4Mi-element groups, a LoRA r64 of a 77M
//! Llama (10M trainable) held ~140 MiB of transients and its optimizer phase peaked above
//! AdamW's, whose f32 state is 60 MiB larger (`benchmarks/estimate.md`, issue 41). One step of a
//! group of k parameters costs (kernel launches, f32 parameters and gradients):
//! - per group, 41: dequantize m and v (3 + 3: codes to u32, gather the cached map, multiply by
//!   the absmax), the AdamW arithmetic (13, [`super::adamw::adamw_math`]), quantize m and v
//!   (11 + 11: absmax 4, codes 7 by the bucket lookup of `kernels::blockwise8`);
//! - per member, 3: its parameter and its gradient copied into the flat f32 inputs, the new
//!   value copied back (none of the first two for a group of one), +1 per padded member and
//!   input (the zeros), +2 for a bf16/f16 parameter (casts), +1 for a bf16/f16 gradient.
//!
//! So 42 for a lone parameter and about 3 + 41/k each in a group of k (LoRA factors of one shape
//! across layers group well); no host-device copies once the constants are cached (the first
//! step uploads them), no host reads. Before (commit df98832): 119 launches and 10 host-to-device
//! copies per 8-bit parameter, the codes found by an 8-step binary search
//! (`benchmarks/cuda-ops.md`).
//!
//! Checkpoint names (see [`super`]): for an 8-bit parameter `i`, `"{i}.exp_avg.codes"` (u8, (n,)),
//! `"{i}.exp_avg.absmax"` (f32, (ceil(n/256),)), `"{i}.exp_avg_sq.codes"`,
//! `"{i}.exp_avg_sq.absmax"` (views of the group buffers, without the padding); for an f32 one
//! `"{i}.exp_avg"` and `"{i}.exp_avg_sq"` in the parameter's shape, as [`super::AdamW`]. The
//! codes are stored as they are, so a resumed run continues bit for bit.

use std::collections::HashMap;

use candle_core::{DType, Shape, Tensor, Var};
use tallow_model::kernels::blockwise8::{
    dequantize_blockwise, quantize_blockwise, quantize_blockwise_generic, Blockwise8,
};
use tallow_model::kernels::consts::{cached, ConstKey};
use tallow_model::ModelError;

use super::adamw::{adamw_math, adamw_update, AdamWParams, StepConstants};
use super::{check_grads, load_param_state, read_moment_step, step_tensor, Optimizer, STEP_KEY};

/// Parameters with fewer elements keep f32 moments (bitsandbytes' `min_8bit_size`).
pub const MIN_8BIT_ELEMS: usize = 4096;
/// Elements per quantization block (bitsandbytes' optimizer block size).
pub const BLOCK: usize = 256;
/// Most elements (padded) in one group of 8-bit parameters updated together. A step's transient
/// memory is about 40 bytes per element of the group being updated (f32 copies of parameter,
/// gradient, m, v and the update's temporaries): 10 MiB at this size, below the 6 bytes per
/// parameter that 8-bit moments save over f32 ones once 2M parameters train. A larger parameter
/// forms a group of its own. Smaller groups cost launches: 41 per group (module docs), so about
/// 170 groups (7k launches) for Llama-3.1-8B's 42M LoRA r16 parameters, against 11 at 4Mi.
pub const GROUP_ELEMS: usize = 1 << 18;

/// Code of 0.0 in the signed / unsigned dynamic map (the padding between group members).
const ZERO_CODE: [u8; 2] = [0, 127]; // [unsigned, signed]

/// The f32 moments of a small parameter, or where a quantized one lives.
#[derive(Debug, Clone)]
enum Slot {
    /// f32, the parameter's shape and device (small tensors).
    Full { exp_avg: Tensor, exp_avg_sq: Tensor },
    /// Member `member` of group `group`.
    Quantized { group: usize, member: usize },
}

/// The moments of a group of 8-bit parameters, flat, on their device.
#[derive(Debug, Clone)]
struct Group {
    /// Index (in the parameter list) of each member.
    params: Vec<usize>,
    /// Shape of each member.
    shapes: Vec<Shape>,
    /// Element offset of each member in the flat buffers: multiples of [`BLOCK`].
    offsets: Vec<usize>,
    /// m (signed map), (len,) with len the padded total.
    exp_avg: Blockwise8,
    /// v (unsigned map), (len,).
    exp_avg_sq: Blockwise8,
}

impl Group {
    /// Padded length of member `j`.
    fn padded(&self, j: usize) -> usize {
        self.shapes[j].elem_count().div_ceil(BLOCK) * BLOCK
    }

    /// Member `j`'s part of `q`: (codes (n,), absmax (ceil(n/256),)), views (no copy).
    fn part(&self, q: &Blockwise8, j: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let n = self.shapes[j].elem_count();
        let codes = q.codes.narrow(0, self.offsets[j], n)?;
        let absmax = q
            .absmax
            .narrow(0, self.offsets[j] / BLOCK, n.div_ceil(BLOCK))?;
        Ok((codes, absmax))
    }

    /// The members' tensors (`get(param index)`, any float dtype) in f32, flattened and
    /// concatenated with zero padding: (len,). One copy per member and per padding (none for a
    /// lone unpadded member).
    fn flat(&self, get: impl Fn(usize) -> Tensor) -> candle_core::Result<Tensor> {
        let mut pieces = Vec::with_capacity(2 * self.params.len());
        for (j, &i) in self.params.iter().enumerate() {
            let t = get(i).to_dtype(DType::F32)?.flatten_all()?; // (n,)
            let pad = self.padded(j) - t.elem_count();
            let dev = t.device().clone();
            pieces.push(t);
            if pad > 0 {
                let zeros = cached(&dev, ConstKey::with("adamw8bit.pad", [pad as u64]), |d| {
                    Tensor::zeros(pad, DType::F32, d)
                })?;
                pieces.push(zeros);
            }
        }
        Tensor::cat(&pieces, 0) // (len,)
    }
}

/// Where each parameter's moments live: groups of consecutive 8-bit parameters on one device,
/// each up to [`GROUP_ELEMS`] elements. Returns one `Option<(group, member)>` per parameter and
/// the groups' (parameter indices, shapes, offsets, padded length).
#[allow(clippy::type_complexity)]
fn plan(
    params: &[Var],
) -> (
    Vec<Option<(usize, usize)>>,
    Vec<(Vec<usize>, Vec<Shape>, Vec<usize>, usize)>,
) {
    let mut slots = Vec::with_capacity(params.len());
    let mut groups: Vec<(Vec<usize>, Vec<Shape>, Vec<usize>, usize)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let n = p.elem_count();
        if n < MIN_8BIT_ELEMS {
            slots.push(None);
            continue;
        }
        let padded = n.div_ceil(BLOCK) * BLOCK;
        let joins = groups.last().is_some_and(|(members, _, _, len)| {
            fits(*len, padded) && params[members[0]].device().same_device(p.device())
        });
        if !joins {
            groups.push((Vec::new(), Vec::new(), Vec::new(), 0));
        }
        let g = groups.len() - 1;
        let (members, shapes, offsets, len) = &mut groups[g];
        slots.push(Some((g, members.len())));
        members.push(i);
        shapes.push(p.shape().clone());
        offsets.push(*len);
        *len += padded;
    }
    (slots, groups)
}

/// Whether a parameter of `padded` elements joins a group of `len`.
fn fits(len: usize, padded: usize) -> bool {
    len + padded <= GROUP_ELEMS
}

/// The padded lengths of the groups [`plan`] makes for parameters of `counts` elements (in the
/// trainable order, one device). The update's f32 temporaries are group-sized, so the memory
/// estimate sizes them by the largest of these.
pub fn group_lengths(counts: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for n in counts.into_iter().filter(|&n| n >= MIN_8BIT_ELEMS) {
        let padded = n.div_ceil(BLOCK) * BLOCK;
        match out.last_mut() {
            Some(len) if fits(*len, padded) => *len += padded,
            _ => out.push(padded),
        }
    }
    out
}

/// AdamW with 8-bit moments. See the module docs.
#[derive(Debug, Clone)]
pub struct AdamW8bit {
    hp: AdamWParams,
    /// t: the number of steps taken.
    t: u32,
    /// One slot per parameter once the first step (or `load_state`) has run, and the groups.
    state: Option<(Vec<Slot>, Vec<Group>)>,
    /// Quantize with the device-generic tensor ops even on the CPU (tests only).
    generic: bool,
}

/// A model-crate error as a Candle one (the [`Optimizer`] trait speaks Candle errors).
fn candle_err(e: ModelError) -> candle_core::Error {
    match e {
        ModelError::Candle(e) => e,
        other => candle_core::Error::Msg(other.to_string()),
    }
}

/// Blockwise 8-bit with the CPU kernel on the CPU (unless `generic`) and tensor ops elsewhere.
fn quantize(x: &Tensor, signed: bool, generic: bool) -> candle_core::Result<Blockwise8> {
    if generic {
        quantize_blockwise_generic(x, signed, BLOCK).map_err(candle_err)
    } else {
        quantize_blockwise(x, signed, BLOCK).map_err(candle_err)
    }
}

fn dequantize(q: &Blockwise8) -> candle_core::Result<Tensor> {
    dequantize_blockwise(q).map_err(candle_err)
}

impl AdamW8bit {
    pub fn new(hp: AdamWParams) -> Self {
        Self {
            hp,
            t: 0,
            state: None,
            generic: false,
        }
    }

    /// Runs the device-generic path (the one CUDA runs) on the CPU too, for tests that compare
    /// it with the CPU kernel or count its device ops.
    #[doc(hidden)]
    pub fn with_generic_quantizer(mut self) -> Self {
        self.generic = true;
        self
    }

    /// Number of steps taken so far.
    pub fn steps_taken(&self) -> u32 {
        self.t
    }

    /// Number of groups of 8-bit parameters (see the module docs); 0 before the first step.
    pub fn groups(&self) -> usize {
        self.state.as_ref().map_or(0, |(_, g)| g.len())
    }

    /// Zero state for `params`.
    fn zeros(&self, params: &[Var]) -> candle_core::Result<(Vec<Slot>, Vec<Group>)> {
        let (where_, layout) = plan(params);
        let mut groups = Vec::with_capacity(layout.len());
        for (members, shapes, offsets, len) in layout {
            let z = Tensor::zeros(len, DType::F32, params[members[0]].device())?;
            groups.push(Group {
                exp_avg: quantize(&z, true, self.generic)?,
                exp_avg_sq: quantize(&z, false, self.generic)?,
                params: members,
                shapes,
                offsets,
            });
        }
        let slots = params
            .iter()
            .zip(where_)
            .map(|(p, w)| match w {
                Some((group, member)) => Ok(Slot::Quantized { group, member }),
                None => {
                    let z = Tensor::zeros(p.shape(), DType::F32, p.device())?;
                    Ok(Slot::Full {
                        exp_avg: z.clone(),
                        exp_avg_sq: z,
                    })
                }
            })
            .collect::<candle_core::Result<_>>()?;
        Ok((slots, groups))
    }
}

impl Optimizer for AdamW8bit {
    fn step(&mut self, params: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        check_grads(params, grads)?;
        if self.state.is_none() {
            self.state = Some(self.zeros(params)?);
        }
        let generic = self.generic;
        let Some((slots, groups)) = &mut self.state else {
            unreachable!("state set above")
        };
        if slots.len() != params.len() {
            candle_core::bail!(
                "adamw8bit: state holds {} parameters but step got {}: the trainable set must \
                 not change",
                slots.len(),
                params.len()
            );
        }
        let t = self.t + 1; // t = index of this step, from 1
        let k = StepConstants::new(&self.hp, t, lr);
        let wrong_shape = |i: usize, state: &Shape, p: &Var| {
            candle_core::Error::Msg(format!(
                "adamw8bit: state of parameter {i} has shape {state:?} but the parameter has \
                 shape {:?}",
                p.shape()
            ))
        };
        for (i, ((p, g), slot)) in params.iter().zip(grads).zip(slots.iter_mut()).enumerate() {
            if let Slot::Full {
                exp_avg,
                exp_avg_sq,
            } = slot
            {
                if exp_avg.shape() != p.shape() {
                    return Err(wrong_shape(i, exp_avg.shape(), p));
                }
                let (m, v) = adamw_update(p, g, exp_avg, exp_avg_sq, &k)?;
                *exp_avg = m;
                *exp_avg_sq = v;
            }
        }
        for group in groups.iter_mut() {
            for (j, &i) in group.params.iter().enumerate() {
                if &group.shapes[j] != params[i].shape() {
                    return Err(wrong_shape(i, &group.shapes[j], &params[i]));
                }
            }
            // flat f32 inputs (len,): parameters (decay and step apply to them) and gradients
            let p32 = group.flat(|i| params[i].as_detached_tensor())?;
            let g32 = group.flat(|i| grads[i].detach())?;
            // dequantize (len,) -> AdamW arithmetic -> requantize: 41 launches (module docs)
            let m = dequantize(&group.exp_avg)?;
            let v = dequantize(&group.exp_avg_sq)?;
            let (p32, m, v) = adamw_math(&p32, &g32, &m, &v, &k)?;
            for (j, &i) in group.params.iter().enumerate() {
                let p = &params[i];
                let n = group.shapes[j].elem_count();
                // (n,) view -> p's shape, rounded once to p's dtype, copied into p
                let new = p32.narrow(0, group.offsets[j], n)?.reshape(p.shape())?;
                p.set(&new.to_dtype(p.dtype())?)?;
            }
            group.exp_avg = quantize(&m, true, generic)?;
            group.exp_avg_sq = quantize(&v, false, generic)?;
        }
        self.t = t;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        if let Some((slots, groups)) = &self.state {
            for (i, slot) in slots.iter().enumerate() {
                match slot {
                    Slot::Full {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        out.push((format!("{i}.exp_avg"), exp_avg.clone()));
                        out.push((format!("{i}.exp_avg_sq"), exp_avg_sq.clone()));
                    }
                    Slot::Quantized { group, member } => {
                        let g = &groups[*group];
                        for (what, q) in [("exp_avg", &g.exp_avg), ("exp_avg_sq", &g.exp_avg_sq)] {
                            // narrow of a 1-d contiguous tensor: a view, no copy
                            let (codes, absmax) = g
                                .part(q, *member)
                                .expect("member offsets lie within the group buffers");
                            out.push((format!("{i}.{what}.codes"), codes));
                            out.push((format!("{i}.{what}.absmax"), absmax));
                        }
                    }
                }
            }
        }
        out.push((STEP_KEY.to_string(), step_tensor(self.t)));
        out
    }

    fn load_state(
        &mut self,
        params: &[Var],
        state: &HashMap<String, Tensor>,
    ) -> candle_core::Result<()> {
        const WHAT: [&str; 6] = [
            "exp_avg",
            "exp_avg_sq",
            "exp_avg.codes",
            "exp_avg.absmax",
            "exp_avg_sq.codes",
            "exp_avg_sq.absmax",
        ];
        let (t, has_moments) = read_moment_step("adamw8bit", state, params.len(), &WHAT)?;
        if !has_moments {
            self.t = t;
            self.state = None;
            return Ok(());
        }
        let (where_, layout) = plan(params);
        let mut groups = Vec::with_capacity(layout.len());
        for (members, shapes, offsets, len) in layout {
            let mut q = Vec::with_capacity(2);
            for (what, signed) in [("exp_avg", true), ("exp_avg_sq", false)] {
                let (mut codes, mut absmax) = (Vec::new(), Vec::new());
                for (j, &i) in members.iter().enumerate() {
                    let part = load_quantized(state, i, what, signed, &params[i])?;
                    let pad =
                        shapes[j].elem_count().div_ceil(BLOCK) * BLOCK - shapes[j].elem_count();
                    codes.push(part.codes);
                    if pad > 0 {
                        let fill = ZERO_CODE[signed as usize];
                        codes.push(Tensor::full(fill, pad, params[i].device())?);
                    }
                    absmax.push(part.absmax);
                }
                q.push(
                    Blockwise8::from_parts(
                        Tensor::cat(&codes, 0)?,
                        Tensor::cat(&absmax, 0)?,
                        BLOCK,
                        signed,
                        Shape::from(len),
                    )
                    .map_err(candle_err)?,
                );
            }
            let exp_avg_sq = q.pop().expect("two moments");
            let exp_avg = q.pop().expect("two moments");
            groups.push(Group {
                params: members,
                shapes,
                offsets,
                exp_avg,
                exp_avg_sq,
            });
        }
        let slots = params
            .iter()
            .zip(where_)
            .enumerate()
            .map(|(i, (p, w))| match w {
                Some((group, member)) => Ok(Slot::Quantized { group, member }),
                None => Ok(Slot::Full {
                    exp_avg: load_param_state("adamw8bit", state, i, "exp_avg", p)?,
                    exp_avg_sq: load_param_state("adamw8bit", state, i, "exp_avg_sq", p)?,
                }),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.t = t;
        self.state = Some((slots, groups));
        Ok(())
    }

    fn name(&self) -> &'static str {
        super::OptimizerKind::AdamW8bit.name()
    }
}

/// `"{i}.{what}.codes"` and `"{i}.{what}.absmax"` as a [`Blockwise8`] for `param`, on its device.
fn load_quantized(
    state: &HashMap<String, Tensor>,
    i: usize,
    what: &str,
    signed: bool,
    param: &Var,
) -> candle_core::Result<Blockwise8> {
    let get = |part: &str| {
        let key = format!("{i}.{what}.{part}");
        match state.get(&key) {
            Some(t) => t.to_device(param.device()),
            None => candle_core::bail!(
                "adamw8bit state has no `{key}` (parameter {i} of {:?}, 8-bit since it has at \
                 least {MIN_8BIT_ELEMS} elements): was the checkpoint written with another \
                 optimizer or another set of trainable parameters?",
                param.shape()
            ),
        }
    };
    Blockwise8::from_parts(
        get("codes")?,
        get("absmax")?,
        BLOCK,
        signed,
        param.shape().clone(),
    )
    .map_err(|e| {
        candle_core::Error::Msg(format!(
            "adamw8bit state `{i}.{what}.*` does not fit parameter {i} of shape {:?} ({e}): was \
             the checkpoint written for other trainable parameters?",
            param.shape()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, STEP_KEY};
    use candle_core::Device;

    const HP: AdamWParams = AdamWParams {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };

    /// A 1024 x 1024 parameter (8-bit state), a 64 x 32 one (f32 state), and gradients.
    fn setup(dev: &Device) -> (Vec<Var>, impl Fn(usize) -> Vec<Tensor> + '_) {
        let big = Tensor::randn(0f32, 1.0, (1024, 1024), dev).unwrap();
        let small = Tensor::randn(0f32, 1.0, (64, 32), dev).unwrap();
        let params = vec![
            Var::from_tensor(&big).unwrap(),
            Var::from_tensor(&small).unwrap(),
        ];
        let grads = move |step: usize| {
            let s = (step + 1) as f64;
            vec![
                ((Tensor::ones((1024, 1024), DType::F32, dev).unwrap() * 0.01).unwrap()
                    + Tensor::randn(0f32, 0.01, (1024, 1024), dev).unwrap() * s)
                    .unwrap(),
                Tensor::randn(0f32, 0.01, (64, 32), dev).unwrap(),
            ]
        };
        (params, grads)
    }

    /// Random gradients for `params` at `step` (std 0.01 (step + 1)), in each one's dtype.
    fn step_grads(params: &[Tensor], step: usize) -> Vec<Tensor> {
        params
            .iter()
            .map(|t| {
                let g = Tensor::randn(0f32, 0.01 * (step + 1) as f32, t.shape(), t.device());
                g.unwrap().to_dtype(t.dtype()).unwrap()
            })
            .collect()
    }

    fn copy(params: &[Var]) -> Vec<Var> {
        params
            .iter()
            .map(|p| Var::from_tensor(&p.as_tensor().copy().unwrap()).unwrap())
            .collect()
    }

    #[test]
    fn state_is_about_two_bytes_per_parameter_and_small_tensors_keep_f32() {
        let dev = Device::Cpu;
        let (params, grads) = setup(&dev);
        let mut opt = AdamW8bit::new(HP);
        opt.step(&params, &grads(0), 1e-3).unwrap();
        let mut adam = AdamW::new(HP);
        adam.step(&copy(&params), &grads(0), 1e-3).unwrap();
        let n_big = 1024 * 1024;
        let n_small = 64 * 32;
        let state: HashMap<String, Tensor> = opt.state().into_iter().collect();
        assert_eq!(state["0.exp_avg.codes"].dtype(), DType::U8);
        assert_eq!(state["0.exp_avg.codes"].dims(), [n_big]);
        assert_eq!(state["0.exp_avg_sq.absmax"].dims(), [n_big / 256]);
        assert_eq!(state["1.exp_avg"].dtype(), DType::F32);
        assert_eq!(state["1.exp_avg"].dims(), [64, 32]);
        assert!(!state.contains_key("0.exp_avg"));
        // 2 bytes per element plus 2 x 4 bytes per 256-block, + the small tensor at 8 B/elem
        let expected = 2 * n_big + 8 * (n_big / 256) + 8 * n_small + 4;
        assert_eq!(opt.state_bytes(), expected);
        let ratio = (opt.state_bytes() - 8 * n_small) as f64 / (8 * n_big) as f64;
        assert!(ratio < 0.30, "8-bit state is {ratio} of AdamW's");
        assert_eq!(adam.state_bytes(), 8 * (n_big + n_small) + 4);
    }

    #[test]
    fn three_steps_stay_close_to_f32_adamw() {
        let dev = Device::Cpu;
        let (pa, grads) = setup(&dev);
        let pb = copy(&pa);
        let p0 = copy(&pa);
        let mut a = AdamW::new(HP);
        let mut b = AdamW8bit::new(HP);
        for step in 0..3 {
            let g = grads(step);
            a.step(&pa, &g, 1e-3).unwrap();
            b.step(&pb, &g, 1e-3).unwrap();
        }
        for ((x, y), z) in pa.iter().zip(&pb).zip(&p0) {
            let moved = (x.as_tensor() - z.as_tensor()).unwrap().abs().unwrap();
            let diff = (x.as_tensor() - y.as_tensor()).unwrap().abs().unwrap();
            let moved = moved.mean_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = diff.mean_all().unwrap().to_scalar::<f32>().unwrap();
            // both moved about 3 * lr; they differ by a few percent of that on average
            assert!(moved > 1e-3, "{moved}");
            assert!(
                diff < 0.05 * moved,
                "mean |adamw - adamw8bit| {diff} vs moved {moved}"
            );
        }
        // the small parameter has f32 state: exactly AdamW
        assert_eq!(
            pa[1].as_tensor().to_vec2::<f32>().unwrap(),
            pb[1].as_tensor().to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn state_round_trip_gives_bit_identical_next_step() {
        let dev = Device::Cpu;
        let (pa, grads) = setup(&dev);
        let mut a = AdamW8bit::new(HP);
        for step in 0..2 {
            a.step(&pa, &grads(step), 1e-3).unwrap();
        }
        let pb = copy(&pa);
        let state: HashMap<String, Tensor> = a.state().into_iter().collect();
        assert_eq!(state.len(), 4 + 2 + 1);
        let mut b = AdamW8bit::new(HP);
        b.load_state(&pb, &state).unwrap();
        assert_eq!(b.steps_taken(), 2);
        let g = grads(2);
        a.step(&pa, &g, 1e-3).unwrap();
        b.step(&pb, &g, 1e-3).unwrap();
        for (x, y) in pa.iter().zip(&pb) {
            let d = (x.as_tensor() - y.as_tensor()).unwrap().abs().unwrap();
            assert_eq!(d.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        }
    }

    /// N(0, 1) tensors of `shapes`, the one at `bf16` in bf16, the rest f32.
    fn random_params(shapes: &[(usize, usize)], bf16: usize, dev: &Device) -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let t = Tensor::randn(0f32, 1.0, s, dev).unwrap();
                if i == bf16 {
                    t.to_dtype(DType::BF16).unwrap()
                } else {
                    t
                }
            })
            .collect()
    }

    /// The device-generic path (what CUDA runs: tensor-op quantizer) run on the CPU gives the
    /// same bits as the CPU path (kernel quantizer): parameters, codes and absmax after each of
    /// 3 steps, for a parameter whose length is a multiple of 256, one that is not (padding), a
    /// bf16 one, and an f32-state one.
    #[test]
    fn generic_path_equals_cpu_path_exactly() {
        let dev = Device::Cpu;
        let shapes: [(usize, usize); 4] = [(64, 128), (300, 71), (96, 64), (16, 16)];
        let init = random_params(&shapes, 2, &dev);
        let pa: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let pb = copy(&pa);
        let mut a = AdamW8bit::new(HP);
        let mut b = AdamW8bit::new(HP).with_generic_quantizer();
        for step in 0..3 {
            let grads = step_grads(&init, step);
            a.step(&pa, &grads, 1e-3).unwrap();
            b.step(&pb, &grads, 1e-3).unwrap();
            for (i, (x, y)) in pa.iter().zip(&pb).enumerate() {
                let bits = |v: &Var| {
                    let t = v.as_tensor().to_dtype(DType::F32).unwrap();
                    let t = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    t.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(bits(x), bits(y), "step {step}: parameter {i} differs");
            }
            let sa: HashMap<String, Tensor> = a.state().into_iter().collect();
            let sb: HashMap<String, Tensor> = b.state().into_iter().collect();
            assert_eq!(sa.len(), sb.len());
            assert!(
                sa.contains_key("1.exp_avg_sq.codes"),
                "(300, 71) must be 8-bit"
            );
            for (k, t) in &sa {
                let (u, w) = (t.flatten_all().unwrap(), sb[k].flatten_all().unwrap());
                assert_eq!(u.dtype(), w.dtype(), "{k}");
                let d = u.to_dtype(DType::F64).unwrap();
                let e = w.to_dtype(DType::F64).unwrap();
                assert_eq!(
                    d.to_vec1::<f64>().unwrap(),
                    e.to_vec1::<f64>().unwrap(),
                    "step {step}: state {k} differs"
                );
            }
        }
    }

    /// A group's update equals updating each member alone (a group of one each), bit for bit:
    /// parameters and every state tensor, over 3 steps and a save/load in between, with a
    /// padded member (300 x 71 is not a multiple of 256), a bf16 one, and an f32-state one
    /// between them. The group cap splits a long list into several groups.
    #[test]
    fn group_lengths_are_the_groups_plan_makes() {
        let dev = Device::Cpu;
        // small (kept f32), padded, a run that overflows the cap, one larger than the cap
        let sizes = [
            100,
            5000,
            GROUP_ELEMS / 2,
            GROUP_ELEMS / 2 + 7,
            4096,
            300,
            GROUP_ELEMS + 1,
            70_000,
        ];
        let params: Vec<Var> = sizes
            .iter()
            .map(|&n| Var::zeros(n, DType::F32, &dev).unwrap())
            .collect();
        let planned: Vec<usize> = plan(&params).1.iter().map(|g| g.3).collect();
        assert_eq!(group_lengths(sizes), planned);
        assert_eq!(planned.len(), 4, "{planned:?}");
    }

    #[test]
    fn groups_equal_per_parameter_updates_exactly() {
        let dev = Device::Cpu;
        let shapes: [(usize, usize); 4] = [(64, 128), (16, 16), (300, 71), (96, 64)];
        let init = random_params(&shapes, 3, &dev);
        let together: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let alone: Vec<Var> = copy(&together);
        let mut a = AdamW8bit::new(HP);
        let mut each: Vec<AdamW8bit> = (0..4).map(|_| AdamW8bit::new(HP)).collect();
        for step in 0..3 {
            let grads = step_grads(&init, step);
            if step == 2 {
                // save and load: the group is rebuilt from per-parameter tensors
                let saved: HashMap<String, Tensor> = a.state().into_iter().collect();
                a = AdamW8bit::new(HP);
                a.load_state(&together, &saved).unwrap();
            }
            a.step(&together, &grads, 1e-3).unwrap();
            for (i, opt) in each.iter_mut().enumerate() {
                opt.step(&alone[i..i + 1], &grads[i..i + 1], 1e-3).unwrap();
            }
            assert_eq!(a.groups(), 1);
            let sa: HashMap<String, Tensor> = a.state().into_iter().collect();
            // equal, or a panic naming the first differing element (not whole vectors)
            let same = |a: &Tensor, b: &Tensor, what: String| {
                let f = |t: &Tensor| {
                    let t = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                    t.to_vec1::<f64>().unwrap()
                };
                let (a, b) = (f(a), f(b));
                assert_eq!(a.len(), b.len(), "{what}: lengths");
                if let Some(j) = (0..a.len()).find(|&j| a[j].to_bits() != b[j].to_bits()) {
                    panic!("{what}: first difference at {j}: {} vs {}", a[j], b[j]);
                }
            };
            for (i, (x, opt)) in alone.iter().zip(&each).enumerate() {
                let what = format!("step {step}: parameter {i}");
                same(together[i].as_tensor(), x.as_tensor(), what);
                for (k, t) in opt.state() {
                    if k == STEP_KEY {
                        continue;
                    }
                    let (_, what) = k.split_once('.').unwrap();
                    let key = format!("{i}.{what}");
                    same(&sa[&key], &t, format!("step {step}: {key}"));
                }
            }
        }
        // more than GROUP_ELEMS elements of 8-bit parameters: several groups (two of 3/8 of
        // the cap fit in one, the third starts the next)
        let big: Vec<Var> = (0..3)
            .map(|_| Var::zeros((GROUP_ELEMS * 3 / 8 / 256, 256), DType::F32, &dev).unwrap())
            .collect();
        let grads: Vec<Tensor> = big.iter().map(|p| p.ones_like().unwrap()).collect();
        let mut b = AdamW8bit::new(HP);
        b.step(&big, &grads, 1e-3).unwrap();
        assert_eq!(
            b.groups(),
            2,
            "3 x 3/8 of GROUP_ELEMS elements in groups of at most GROUP_ELEMS"
        );
    }

    #[test]
    fn load_state_rejects_mismatches_with_a_clear_message() {
        let dev = Device::Cpu;
        let (params, grads) = setup(&dev);
        let mut a = AdamW8bit::new(HP);
        a.step(&params, &grads(0), 1e-3).unwrap();
        let good: HashMap<String, Tensor> = a.state().into_iter().collect();
        let err = |state: &HashMap<String, Tensor>| {
            AdamW8bit::new(HP)
                .load_state(&params, state)
                .unwrap_err()
                .to_string()
        };
        let mut bad = good.clone();
        bad.remove("0.exp_avg_sq.codes");
        let msg = err(&bad);
        assert!(msg.contains("no `0.exp_avg_sq.codes`"), "{msg}");

        let mut bad = good.clone();
        bad.insert(
            "0.exp_avg.absmax".into(),
            Tensor::zeros(7, DType::F32, &dev).unwrap(),
        );
        let msg = err(&bad);
        assert!(
            msg.contains("`0.exp_avg.*` does not fit parameter 0"),
            "{msg}"
        );

        // an f32 AdamW checkpoint is refused, naming the missing 8-bit tensor
        let mut adam = AdamW::new(HP);
        adam.step(&copy(&params), &grads(0), 1e-3).unwrap();
        let adam_state: HashMap<String, Tensor> = adam.state().into_iter().collect();
        let msg = err(&adam_state);
        assert!(msg.contains("no `0.exp_avg.codes`"), "{msg}");

        let mut bad = good.clone();
        bad.remove(STEP_KEY);
        assert!(err(&bad).contains("no `step`"));
    }
}
