//! Gradient accumulation over the micro-batches of one optimizer step, and global-norm clipping.
//!
//! Candle's `backward()` returns a fresh `GradStore` (tensor id -> gradient) each time, so the sum
//! over micro-batches is ours to keep: [`GradAccumulator`] holds one f32 buffer per trainable
//! parameter. At the step boundary the trainer takes the sums, scales them (1 / target tokens),
//! computes their norm and clipping coefficient ([`norm_and_clip_coefficient`]) and hands both
//! to the optimizer (`Optimizer::step_scaled`), which multiplies the gradients by it, in its
//! kernel where it has one ([`clip_grad_norm`] does the multiply itself).
//!
//! Everything is Candle tensor ops on the parameters' device, clipping included: the norm stays
//! a device tensor, read by the trainer together with the step's loss (`crate::host`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, TensorId, Var};
use tallow_model::kernels::dispatch::Backend;

/// Sums gradients of the trainable vars over the micro-batches of one optimizer step (Candle's
/// backward returns a fresh GradStore each time).
#[derive(Debug)]
pub struct GradAccumulator {
    /// Id, shape and device of each trainable parameter, in the optimizer's order.
    params: Vec<(TensorId, Shape, Device)>,
    /// Running f32 sum per parameter; `None` until a store holds a gradient for it.
    sums: Vec<Option<Tensor>>,
    /// Stores added since the last `take`.
    added: usize,
}

impl GradAccumulator {
    /// An empty accumulator for `params` (the trainable set, in the optimizer's order).
    pub fn new(params: &[Var]) -> Self {
        Self {
            params: params
                .iter()
                .map(|p| (p.id(), p.shape().clone(), p.device().clone()))
                .collect(),
            sums: vec![None; params.len()],
            added: 0,
        }
    }

    /// Adds the gradients in `store` for each param (a param absent from the store contributes
    /// zero). Accumulates in f32.
    pub fn add(&mut self, store: &GradStore) -> candle_core::Result<()> {
        for ((id, shape, _), sum) in self.params.iter().zip(self.sums.iter_mut()) {
            let Some(g) = store.get_id(*id) else {
                continue;
            };
            if g.shape() != shape {
                candle_core::bail!(
                    "gradient of shape {:?} for a parameter of shape {shape:?}",
                    g.shape()
                );
            }
            // detach: the sum must not keep any graph alive between micro-batches
            let g = g.detach().to_dtype(DType::F32)?;
            *sum = Some(match sum.take() {
                None => g,
                Some(s) => (s + g)?,
            });
        }
        self.added += 1;
        Ok(())
    }

    /// Number of stores added since the last [`GradAccumulator::take`] (one per micro-batch, plus
    /// one per checkpointed layer and micro-batch with activation checkpointing).
    pub fn stores_added(&self) -> usize {
        self.added
    }

    /// Takes the summed gradients (f32; zeros for params that never got one), leaving the
    /// accumulator empty.
    pub fn take(&mut self) -> candle_core::Result<Vec<Tensor>> {
        let out = self
            .params
            .iter()
            .zip(self.sums.iter_mut())
            .map(|((_, shape, device), sum)| match sum.take() {
                Some(s) => Ok(s),
                None => Tensor::zeros(shape, DType::F32, device),
            })
            .collect();
        self.added = 0;
        out
    }
}

/// Global L2 norm over all grads, computed in f32 on the device and returned there as a 0-d
/// tensor (no host sync: the trainer reads it with the step's loss); if `max_norm > 0`, every
/// grad is multiplied by `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`
/// does (a multiply by 1 when under the norm). Returns the norm before clipping.
///
/// With a non-finite norm (inf/NaN gradients) the grads become non-finite too: the caller stops
/// before the update. All grads are expected on one device (the first one's; others are moved
/// there for the sum).
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> candle_core::Result<Tensor> {
    let (norm, coef) = norm_and_clip_coefficient(grads, max_norm)?;
    if let Some(coef) = coef {
        scale_in_place(grads, &coef)?;
    }
    Ok(norm)
}

/// Every gradient multiplied by `coef` (a 0-d f32), each new one replacing the old in `grads`
/// (so one extra gradient at a time is alive).
pub fn scale_in_place(grads: &mut [Tensor], coef: &Tensor) -> candle_core::Result<()> {
    for g in grads.iter_mut() {
        *g = scaled_by(g, coef)?;
    }
    Ok(())
}

/// `g` times `coef` (a 0-d f32), in g's dtype on g's device: the clipping's multiply, wherever
/// it runs (here, or in an optimizer's `step_scaled`).
pub fn scaled_by(g: &Tensor, coef: &Tensor) -> candle_core::Result<Tensor> {
    g.broadcast_mul(&coef.to_dtype(g.dtype())?.to_device(g.device())?)
}

/// [`clip_grad_norm`]'s norm, and (with `max_norm > 0`) its clipping coefficient
/// `min(1, max_norm / (norm + 1e-6))` as a 0-d f32 on the norm's device, without multiplying
/// the gradients: the trainer hands it to the optimizer (`Optimizer::step_scaled`), whose
/// kernel applies it as it reads each gradient, one launch fewer per gradient.
pub fn norm_and_clip_coefficient(
    grads: &[Tensor],
    max_norm: f64,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let Some(first) = grads.first() else {
        return Ok((Tensor::zeros((), DType::F32, &Device::Cpu)?, None));
    };
    let device = first.device().clone();
    // sum over all grads of sum(g^2): a 0-d f32 tensor on the device, no sync. On the CUDA
    // path f32 gradients on one device are summed by tallow's kernel, one launch per 32
    // (`kernels::sum_squares`), where each took a square, a sum and an add.
    let one_pass = Backend::of(&device) == Backend::Cuda
        && grads
            .iter()
            .all(|g| g.dtype() == DType::F32 && g.device().same_device(&device));
    let sum_sq = if one_pass {
        let flat = grads
            .iter()
            .map(|g| g.detach().contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        tallow_model::kernels::sum_squares::sum_squares(&flat)?
    } else {
        let mut sum_sq: Option<Tensor> = None;
        for g in grads.iter() {
            let s = g
                .detach()
                .to_dtype(DType::F32)?
                .sqr()?
                .sum_all()?
                .to_device(&device)?;
            sum_sq = Some(match sum_sq {
                None => s,
                Some(acc) => (acc + s)?,
            });
        }
        sum_sq.expect("grads is not empty")
    };
    let norm = sum_sq.sqrt()?;
    if max_norm <= 0.0 {
        return Ok((norm, None));
    }
    // torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to at most 1, and every
    // gradient multiplied by it (a no-op multiply by 1 when under the norm), on the device
    let coef = ((&norm + 1e-6)?.recip()? * max_norm)?.clamp(0f32, 1f32)?;
    Ok((norm, Some(coef)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Backward of sum(c * p) gives grad c for p: a GradStore built by Candle itself.
    fn store_for(params: &[&Var], coefs: &[f64]) -> GradStore {
        let mut loss: Option<Tensor> = None;
        for (p, &c) in params.iter().zip(coefs) {
            let term = (p.as_tensor() * c).unwrap().sum_all().unwrap();
            loss = Some(match loss {
                None => term,
                Some(l) => (l + term).unwrap(),
            });
        }
        loss.unwrap().backward().unwrap()
    }

    #[test]
    fn accumulator_sums_stores_fills_missing_with_zeros_and_empties_on_take() {
        let dev = Device::Cpu;
        let a = Var::new(&[1f32, 2.0, 3.0], &dev).unwrap();
        let b = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let c = Var::new(&[5f32], &dev).unwrap(); // never in any store
        let mut acc = GradAccumulator::new(&[a.clone(), b.clone(), c.clone()]);

        // micro-batch 1: d/da = 2, d/db = 0.5;  micro-batch 2: d/da = -0.25 only (b absent)
        acc.add(&store_for(&[&a, &b], &[2.0, 0.5])).unwrap();
        let s2 = store_for(&[&a], &[-0.25]);
        assert!(s2.get(&b).is_none());
        acc.add(&s2).unwrap();
        assert_eq!(acc.stores_added(), 2);

        let g = acc.take().unwrap();
        assert_eq!(vals(&g[0]), vec![1.75; 3]);
        assert_eq!(vals(&g[1]), vec![0.5; 4]);
        assert_eq!(g[1].dims(), &[2, 2]);
        assert_eq!(vals(&g[2]), vec![0.0]);
        assert!(g.iter().all(|t| t.dtype() == DType::F32));

        // take() emptied it: zeros again until the next add
        assert_eq!(acc.stores_added(), 0);
        let g = acc.take().unwrap();
        assert_eq!(vals(&g[0]), vec![0.0; 3]);
        acc.add(&store_for(&[&a], &[3.0])).unwrap();
        assert_eq!(vals(&acc.take().unwrap()[0]), vec![3.0; 3]);
    }

    #[test]
    fn accumulator_sums_bf16_grads_in_f32() {
        let dev = Device::Cpu;
        let a = Var::from_tensor(
            &Tensor::new(&[1f32, 2.0], &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        let mut acc = GradAccumulator::new(std::slice::from_ref(&a));
        // 256 + 1 is not representable in bf16 (8 significant bits) but is in f32
        acc.add(&store_for(&[&a], &[256.0])).unwrap();
        acc.add(&store_for(&[&a], &[1.0])).unwrap();
        let g = acc.take().unwrap();
        assert_eq!(g[0].dtype(), DType::F32);
        assert_eq!(vals(&g[0]), vec![257.0; 2]);
    }

    fn scalar(t: &Tensor) -> f64 {
        t.to_scalar::<f32>().unwrap() as f64
    }

    fn grads() -> Vec<Tensor> {
        let dev = Device::Cpu;
        vec![
            Tensor::new(&[3f32, -4.0], &dev).unwrap(),
            Tensor::new(&[[1f32, 2.0], [-2.0, 0.5]], &dev).unwrap(),
        ]
    }

    #[test]
    fn clip_grad_norm_matches_hand_computation_and_scales_to_max_norm() {
        // sqrt(9 + 16 + 1 + 4 + 4 + 0.25) = sqrt(34.25)
        let expected = 34.25f64.sqrt();
        let mut g = grads();
        let norm = scalar(&clip_grad_norm(&mut g, 1.0).unwrap());
        assert!((norm - expected).abs() < 1e-6, "{norm} vs {expected}");
        let coef = 1.0 / (expected + 1e-6);
        for (clipped, orig) in g.iter().zip(grads()) {
            for (a, b) in vals(clipped).iter().zip(vals(&orig)) {
                assert!(
                    (*a as f64 - b as f64 * coef).abs() < 1e-6,
                    "{a} vs {b} * {coef}"
                );
            }
        }
        // the clipped grads have norm max_norm (up to the 1e-6 in the denominator)
        let after = scalar(&clip_grad_norm(&mut g, 0.0).unwrap());
        assert!((after - 1.0).abs() < 1e-6, "{after}");
    }

    #[test]
    fn clip_grad_norm_leaves_grads_under_max_norm_or_with_max_norm_zero() {
        for max_norm in [10.0, 0.0] {
            let mut g = grads();
            let norm = scalar(&clip_grad_norm(&mut g, max_norm).unwrap());
            assert!((norm - 34.25f64.sqrt()).abs() < 1e-6);
            for (a, b) in g.iter().zip(grads()) {
                assert_eq!(vals(a), vals(&b), "max_norm {max_norm}");
            }
        }
        assert_eq!(scalar(&clip_grad_norm(&mut [], 1.0).unwrap()), 0.0);
    }

    /// On the CUDA path (its CPU twin) the norm is one op per 32 f32 gradients
    /// (`kernels::sum_squares`) and gives the CPU path's norm and clipped gradients within f32
    /// rounding (the twin sums in f64, Candle's ops in f32): 40 gradients, 2 ops and an add
    /// and a sqrt where the per-gradient ops were 3 x 40 + 1; a gradient left out changes the
    /// norm by far more than 1e-6.
    #[test]
    fn clip_grad_norm_on_the_cuda_path_sums_in_one_op_per_32_gradients() {
        use tallow_model::kernels::dispatch::with_cuda_paths_on_cpu;
        let dev = Device::Cpu;
        let grads = || -> Vec<Tensor> {
            (0..40)
                .map(|i| {
                    Tensor::arange(0f32, (3 + i % 11) as f32, &dev)
                        .unwrap()
                        .affine(0.3, i as f64 * 0.05 - 1.0)
                        .unwrap()
                })
                .collect()
        };
        let (mut cpu, mut cuda) = (grads(), grads());
        let want = scalar(&clip_grad_norm(&mut cpu, 1.0).unwrap());
        let c0 = candle_core::launches::count_on_this_thread();
        let norm = with_cuda_paths_on_cpu(|| clip_grad_norm(&mut cuda, 0.0)).unwrap();
        let launched = candle_core::launches::count_on_this_thread() - c0;
        assert_eq!(launched, 2 + 1 + 1, "2 ops, their add, the sqrt");
        let got = scalar(&norm);
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        let got = scalar(&with_cuda_paths_on_cpu(|| clip_grad_norm(&mut cuda, 1.0)).unwrap());
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        for (a, b) in cuda.iter().zip(&cpu) {
            for (x, y) in vals(a).iter().zip(vals(b)) {
                assert!((x - y).abs() <= 1e-6 * y.abs().max(1e-3), "{x} vs {y}");
            }
        }
    }
}
