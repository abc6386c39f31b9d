//! AdamW with 8-bit moments (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
//! <https://arxiv.org/abs/2110.02861>; bitsandbytes `AdamW8bit`): the maths of [`super::AdamW`]
//! (torch semantics, bias correction, decoupled weight decay, the update in f32), with the two
//! moments stored blockwise 8-bit between steps.
//!
//! Per parameter of at least [`MIN_8BIT_ELEMS`] elements, m is kept as a
//! [`Blockwise8`] with the signed dynamic map and v with the unsigned one, blocks of
//! [`BLOCK`] (f32 absmax per block): about 2 bytes per parameter plus 8 per 256 instead of 8.
//! Smaller tensors (norms, biases, small LoRA factors) keep f32 moments, as bitsandbytes does.
//! Each step dequantizes m and v to f32, applies the AdamW update with tensor ops, and
//! requantizes; everything stays on the parameter's device (quantization runs a CPU kernel on the
//! CPU and Candle tensor ops elsewhere, see `tallow_model::quant::dynamic`; both give the same
//! codes, so the CPU and the generic path give the same bits on the CPU, which a test checks).
//!
//! Device cost per 8-bit parameter per step (f32 parameter and gradient, n a multiple of 256;
//! kernel launches, counted in `benchmarks/cuda-ops.md` and by `tests/tests/cuda_ops.rs`):
//! 42 = dequantize m and v (3 + 3: codes to u32, gather the cached map, multiply by the absmax)
//! + the AdamW update (14, [`super::adamw`]) + quantize m and v (11 + 11: absmax 4, codes 7 by
//! the bucket lookup); no host-device copies once the constants are cached, no host reads.
//! Before (commit df98832): 119 launches and 10 host-to-device copies (the map twice, and per
//! quantization the midpoints and three scalars), the codes found by an 8-step binary search.
//!
//! Checkpoint names (see [`super`]): for an 8-bit parameter `i`, `"{i}.exp_avg.codes"` (u8, (n,)),
//! `"{i}.exp_avg.absmax"` (f32, (ceil(n/256),)), `"{i}.exp_avg_sq.codes"`,
//! `"{i}.exp_avg_sq.absmax"`; for an f32 one `"{i}.exp_avg"` and `"{i}.exp_avg_sq"` in the
//! parameter's shape, as [`super::AdamW`]. The codes are stored as they are, so a resumed run
//! continues bit for bit.

use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};
use tallow_model::quant::dynamic::{
    dequantize_blockwise, quantize_blockwise, quantize_blockwise_generic, Blockwise8,
};
use tallow_model::ModelError;

use super::adamw::{adamw_update, AdamWParams, StepConstants};
use super::{
    check_grads, check_state_keys, load_param_state, read_moment_step, step_tensor, Optimizer,
    STEP_KEY,
};

/// Parameters with fewer elements keep f32 moments (bitsandbytes' `min_8bit_size`).
pub const MIN_8BIT_ELEMS: usize = 4096;
/// Elements per quantization block (bitsandbytes' optimizer block size).
pub const BLOCK: usize = 256;

/// The moments of one parameter.
#[derive(Debug, Clone)]
enum Moments {
    /// f32, the parameter's shape and device (small tensors).
    Full { exp_avg: Tensor, exp_avg_sq: Tensor },
    /// m signed, v unsigned dynamic 8-bit, on the parameter's device.
    Quantized {
        exp_avg: Blockwise8,
        exp_avg_sq: Blockwise8,
    },
}

/// AdamW with 8-bit moments. See the module docs.
#[derive(Debug, Clone)]
pub struct AdamW8bit {
    hp: AdamWParams,
    /// t: the number of steps taken.
    t: u32,
    /// One entry per parameter once the first step (or `load_state`) has run.
    moments: Option<Vec<Moments>>,
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
            moments: None,
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

    /// Zero moments for `p`: 8-bit when it has at least [`MIN_8BIT_ELEMS`] elements.
    fn zeros(p: &Var, generic: bool) -> candle_core::Result<Moments> {
        let z = Tensor::zeros(p.shape(), DType::F32, p.device())?;
        Ok(if p.elem_count() >= MIN_8BIT_ELEMS {
            Moments::Quantized {
                exp_avg: quantize(&z, true, generic)?,
                exp_avg_sq: quantize(&z, false, generic)?,
            }
        } else {
            Moments::Full {
                exp_avg: z.clone(),
                exp_avg_sq: z,
            }
        })
    }
}

impl Optimizer for AdamW8bit {
    fn step(&mut self, params: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        check_grads(params, grads)?;
        let moments = match &mut self.moments {
            Some(moments) => {
                if moments.len() != params.len() {
                    candle_core::bail!(
                        "adamw8bit: state holds {} parameters but step got {}: the trainable set \
                         must not change",
                        moments.len(),
                        params.len()
                    );
                }
                moments
            }
            None => self.moments.insert(
                params
                    .iter()
                    .map(|p| Self::zeros(p, self.generic))
                    .collect::<candle_core::Result<_>>()?,
            ),
        };
        let t = self.t + 1; // t = index of this step, from 1
        let k = StepConstants::new(&self.hp, t, lr);
        for (i, ((p, g), st)) in params.iter().zip(grads).zip(moments.iter_mut()).enumerate() {
            match st {
                Moments::Full {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    if exp_avg.shape() != p.shape() {
                        candle_core::bail!(
                            "adamw8bit: state of parameter {i} has shape {:?} but the parameter \
                             has shape {:?}",
                            exp_avg.shape(),
                            p.shape()
                        );
                    }
                    let (m, v) = adamw_update(p, g, exp_avg, exp_avg_sq, &k)?;
                    *exp_avg = m;
                    *exp_avg_sq = v;
                }
                Moments::Quantized {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    if &exp_avg.shape != p.shape() {
                        candle_core::bail!(
                            "adamw8bit: state of parameter {i} has shape {:?} but the parameter \
                             has shape {:?}",
                            exp_avg.shape,
                            p.shape()
                        );
                    }
                    // dequantize (f32, p's shape) -> AdamW update -> requantize: 42 launches
                    // (module docs), all on p's device
                    let m = dequantize(exp_avg)?;
                    let v = dequantize(exp_avg_sq)?;
                    let (m, v) = adamw_update(p, g, &m, &v, &k)?;
                    *exp_avg = quantize(&m, true, self.generic)?;
                    *exp_avg_sq = quantize(&v, false, self.generic)?;
                }
            }
        }
        self.t = t;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, st) in self.moments.iter().flatten().enumerate() {
            match st {
                Moments::Full {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    out.push((format!("{i}.exp_avg"), exp_avg.clone()));
                    out.push((format!("{i}.exp_avg_sq"), exp_avg_sq.clone()));
                }
                Moments::Quantized {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    for (what, q) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
                        out.push((format!("{i}.{what}.codes"), q.codes.clone()));
                        out.push((format!("{i}.{what}.absmax"), q.absmax.clone()));
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
        check_state_keys("adamw8bit", state, params.len(), &WHAT)?;
        let (t, has_moments) = read_moment_step("adamw8bit", state, params.len())?;
        if !has_moments {
            self.t = t;
            self.moments = None;
            return Ok(());
        }
        let moments = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if p.elem_count() < MIN_8BIT_ELEMS {
                    return Ok(Moments::Full {
                        exp_avg: load_param_state("adamw8bit", state, i, "exp_avg", p)?,
                        exp_avg_sq: load_param_state("adamw8bit", state, i, "exp_avg_sq", p)?,
                    });
                }
                Ok(Moments::Quantized {
                    exp_avg: load_quantized(state, i, "exp_avg", true, p)?,
                    exp_avg_sq: load_quantized(state, i, "exp_avg_sq", false, p)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.t = t;
        self.moments = Some(moments);
        Ok(())
    }

    fn name(&self) -> &'static str {
        "adamw8bit"
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

    /// The device-generic path (what CUDA runs: tensor-op quantizer) run on the CPU gives the
    /// same bits as the CPU path (kernel quantizer): parameters, codes and absmax after each of
    /// 3 steps, for a parameter whose length is a multiple of 256, one that is not (padding), a
    /// bf16 one, and an f32-state one.
    #[test]
    fn generic_path_equals_cpu_path_exactly() {
        let dev = Device::Cpu;
        let shapes: [(usize, usize); 4] = [(64, 128), (300, 71), (96, 64), (16, 16)];
        let init: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let t = Tensor::randn(0f32, 1.0, s, &dev).unwrap();
                if i == 2 {
                    t.to_dtype(DType::BF16).unwrap()
                } else {
                    t
                }
            })
            .collect();
        let pa: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let pb: Vec<Var> = init
            .iter()
            .map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap())
            .collect();
        let mut a = AdamW8bit::new(HP);
        let mut b = AdamW8bit::new(HP).with_generic_quantizer();
        for step in 0..3 {
            let grads: Vec<Tensor> = init
                .iter()
                .map(|t| {
                    let g = Tensor::randn(0f32, 0.01 * (step + 1) as f32, t.shape(), &dev);
                    g.unwrap().to_dtype(t.dtype()).unwrap()
                })
                .collect();
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
            assert!(sa.contains_key("1.exp_avg_sq.codes"), "(300, 71) must be 8-bit");
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
