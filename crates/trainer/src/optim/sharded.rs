//! ZeRO stage 1 (`train.shard_optimizer`): each rank of a data-parallel run keeps and updates the
//! optimizer state of the trainable tensors it owns ([`tallow_data_parallel::owners`]: largest
//! first, each to the least loaded rank), then sends its updated tensors to the others. One
//! process, or a run without the key, owns every tensor and steps as usual.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use tallow_data_parallel::Dist;

use super::Optimizer;
use crate::error::TrainError;

/// Which of the trainable tensors (by index in the trainable list) this rank's optimizer owns.
#[derive(Debug, Clone)]
pub struct Shard {
    pub owned: Vec<usize>,
}

impl Shard {
    /// The tensors of elements `sizes` this rank owns: its share with `shard` on several ranks,
    /// else all of them.
    pub fn new(sizes: &[usize], dist: &Dist, shard: bool) -> Self {
        let owned = if shard && dist.world > 1 {
            let owner = tallow_data_parallel::owners(sizes, dist.world);
            (0..sizes.len())
                .filter(|&i| owner[i] == dist.rank)
                .collect()
        } else {
            (0..sizes.len()).collect()
        };
        Shard { owned }
    }

    /// Whether this rank owns every tensor (no sharding).
    pub fn owns_all(&self, n: usize) -> bool {
        self.owned.len() == n
    }

    /// The owned variables, in the optimizer's (local) order.
    pub fn owned_vars(&self, vars: &[Var]) -> Vec<Var> {
        self.owned.iter().map(|&i| vars[i].clone()).collect()
    }

    /// The optimizer update of the tensors this rank owns; with `train.shard_optimizer`, then
    /// each rank's updated tensors to every rank (an all-reduce where the others add zeros: a
    /// broadcast view, nothing allocated; x + 0 = x exactly, so every rank holds the same
    /// weights bit for bit).
    pub fn step(
        &self,
        opt: &mut dyn Optimizer,
        vars: &[Var],
        dist: &Dist,
        grads: &[Tensor],
        scale: Option<&Tensor>,
        lr: f64,
    ) -> Result<(), TrainError> {
        let owned = &self.owned;
        if owned.len() == vars.len() {
            return Ok(opt.step_scaled(vars, grads, lr, scale)?);
        }
        let owned_vars: Vec<Var> = owned.iter().map(|&i| vars[i].clone()).collect();
        let owned_grads: Vec<Tensor> = owned.iter().map(|&i| grads[i].clone()).collect();
        opt.step_scaled(&owned_vars, &owned_grads, lr, scale)?;
        drop(owned_grads);
        let mut mine = vec![false; vars.len()];
        for &i in owned {
            mine[i] = true;
        }
        let contributions: Vec<Tensor> = vars
            .iter()
            .zip(&mine)
            .map(|(v, &m)| match m {
                true => Ok(v.as_tensor().clone()),
                false => Tensor::zeros((), v.dtype(), v.device())?.broadcast_as(v.shape()),
            })
            .collect::<candle_core::Result<_>>()?;
        dist.all_reduce_sum_each(
            contributions,
            "sharing the updated weights (train.shard_optimizer)",
            |i, t| {
                if !mine[i] {
                    vars[i].set(&t)?;
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    /// Optimizer state named by the optimizer's own (local) parameter indices, renamed to the
    /// indices `owned[i]` of the whole trainable list (`"{i}.exp_avg"` -> `"{owned[i]}.exp_avg"`);
    /// names without an index ([`super::STEP_KEY`]) are kept.
    pub fn global_state_names(&self, state: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
        let owned = &self.owned;
        state
            .into_iter()
            .map(|(name, t)| match super::state_index(&name) {
                Some((i, what)) => (format!("{}.{what}", owned[i]), t),
                None => (name, t),
            })
            .collect()
    }

    /// The inverse of [`global_state_names`] for a checkpoint's whole state: the tensors of the
    /// owned indices, renamed to the optimizer's local indices; the others dropped.
    pub fn local_state_names(&self, state: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
        let owned = &self.owned;
        let local: HashMap<usize, usize> = owned.iter().enumerate().map(|(l, &g)| (g, l)).collect();
        state
            .iter()
            .filter_map(|(name, t)| match super::state_index(name) {
                Some((g, what)) => local.get(&g).map(|l| (format!("{l}.{what}"), t.clone())),
                None => Some((name.clone(), t.clone())),
            })
            .collect()
    }
}
