//! Plain stochastic gradient descent, as `torch.optim.SGD` with `momentum=0`, `dampening=0`,
//! `nesterov=False` (torch/optim/sgd.py, `_single_tensor_sgd`): weight decay is coupled, i.e.
//! added to the gradient (L2 regularization), unlike AdamW's decoupled decay.
//!
//! No state beyond a step counter. A bf16/f16 parameter is updated in f32 and rounded back once.

use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::{check_grads, check_state_keys, read_step, step_tensor, Optimizer, STEP_KEY};

/// SGD without momentum. See the module docs.
#[derive(Debug, Clone)]
pub struct Sgd {
    weight_decay: f64,
    /// Steps taken (kept only so that checkpoints record it).
    t: u32,
}

impl Sgd {
    pub fn new(weight_decay: f64) -> Self {
        Self { weight_decay, t: 0 }
    }

    /// Number of steps taken so far.
    pub fn steps_taken(&self) -> u32 {
        self.t
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Var], grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        check_grads(params, grads)?;
        let wd = self.weight_decay;
        for (p, g) in params.iter().zip(grads) {
            // p32, g32: f32 copies (detached, so the update records no graph)
            let p32 = p.as_detached_tensor().to_dtype(DType::F32)?;
            let g32 = g.detach().to_dtype(DType::F32)?;
            // g <- g + wd * p          coupled weight decay (L2), torch.optim.SGD
            let g32 = if wd != 0.0 {
                (g32 + (&p32 * wd)?)?
            } else {
                g32
            };
            // p <- p - lr * g
            let p32 = (p32 - (g32 * lr)?)?;
            // write back, rounded once to the parameter's dtype
            p.set(&p32.to_dtype(p.dtype())?)?;
        }
        self.t += 1;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        vec![(STEP_KEY.to_string(), step_tensor(self.t))]
    }

    fn load_state(
        &mut self,
        params: &[Var],
        state: &HashMap<String, Tensor>,
    ) -> candle_core::Result<()> {
        check_state_keys("sgd", state, params.len(), &[])?;
        self.t = read_step(state)?.unwrap_or(0);
        Ok(())
    }

    fn name(&self) -> &'static str {
        super::OptimizerKind::Sgd.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(p: &Var) -> Vec<f32> {
        p.as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    // Powers of two throughout, so f32 (and bf16) arithmetic is exact and the test compares with ==.
    const P: [f32; 3] = [1.0, -2.0, 0.5];
    const G: [f32; 3] = [0.5, 0.25, -1.0];

    #[test]
    fn one_step_is_exact() {
        let dev = Device::Cpu;
        let p = Var::new(&P, &dev).unwrap();
        let g = Tensor::new(&G, &dev).unwrap();
        let mut opt = Sgd::new(0.0);
        opt.step(std::slice::from_ref(&p), &[g], 0.5).unwrap();
        // p - 0.5 * g
        assert_eq!(values(&p), vec![0.75, -2.125, 1.0]);
        assert_eq!(opt.steps_taken(), 1);
    }

    #[test]
    fn weight_decay_is_coupled_like_torch() {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::BF16] {
            let p =
                Var::from_tensor(&Tensor::new(&P, &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let g = Tensor::new(&G, &dev).unwrap().to_dtype(dtype).unwrap();
            Sgd::new(0.25)
                .step(std::slice::from_ref(&p), &[g], 0.5)
                .unwrap();
            // d = g + 0.25 p = [0.75, -0.25, -0.875]; p - 0.5 d
            assert_eq!(values(&p), vec![0.625, -1.875, 0.9375], "{dtype:?}");
            assert_eq!(p.dtype(), dtype);
        }
    }

    #[test]
    fn state_is_the_counter_only() {
        let dev = Device::Cpu;
        let p = Var::new(&P, &dev).unwrap();
        let mut a = Sgd::new(0.0);
        a.step(
            std::slice::from_ref(&p),
            &[Tensor::new(&G, &dev).unwrap()],
            0.1,
        )
        .unwrap();
        let state: HashMap<String, Tensor> = a.state().into_iter().collect();
        let mut b = Sgd::new(0.0);
        b.load_state(std::slice::from_ref(&p), &state).unwrap();
        assert_eq!(b.steps_taken(), 1);

        let mut adam_state = state.clone();
        adam_state.insert("0.exp_avg".into(), Tensor::new(&P, &dev).unwrap());
        let msg = b
            .load_state(std::slice::from_ref(&p), &adam_state)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("unexpected tensor `0.exp_avg`"), "{msg}");
    }
}
