//! The sparse mixture-of-experts feed-forward of Qwen3-MoE, Qwen2-MoE and Mixtral
//! (`Qwen3MoeSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`, `MixtralSparseMoeBlock` in
//! transformers 4.57; the router and fused experts of 5.x compute the same), and the router's load-balancing loss
//! (`load_balancing_loss_func`, Switch Transformer eq. 4-6, arXiv:2101.03961).
//!
//! Shape legend: N = tokens (B * T), C = hidden size, E = experts, K = experts per token,
//! I = an expert's intermediate size.
//!
//! The experts run grouped, not per token: the router's top-K choices are sorted by expert on
//! the host, x is gathered once into that order (N K, C), each expert runs its three linears on
//! its contiguous slice (one matmul per projection per expert, with the expert's adapters), and
//! the weighted rows are added back into place by one `index_add`. Every step is a Candle op
//! with a backward, so the CPU and CUDA paths share it; only the choice of experts (top-K, a
//! host decision that has no gradient in transformers either) leaves the device.

use std::sync::Mutex;

use candle_core::{DType, Tensor};

use crate::config::{Activation, MoeNames};
use crate::error::Result;
use crate::nn::linear::{adapter_input, Linear};
use crate::nn::ops;

/// One expert: a gated MLP, down(act(gate(x)) * up(x)).
#[derive(Clone)]
pub struct Expert {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// Qwen2-MoE's shared expert: every token's output gains sigmoid(gate(x)) * expert(x).
#[derive(Clone)]
pub struct SharedExpert {
    pub expert: Expert,
    /// `shared_expert_gate`, (1, C), no bias.
    pub gate: Linear,
}

/// The sparse block: a router (`gate`, E x C, no bias) and E experts (and Qwen2-MoE's shared
/// expert).
#[derive(Clone)]
pub struct SparseMoe {
    pub gate: Linear,
    pub experts: Vec<Expert>,
    pub shared: Option<SharedExpert>,
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
    pub(crate) act: Activation,
    /// The experts' linears' names (`gate_proj`, ..., Mixtral's `w1`, ...).
    pub(crate) names: MoeNames,
    /// The decoder layer it sits in: a layer run in token tiles records once per tile, into
    /// its one entry of the tape.
    pub(crate) layer: usize,
}

/// What the sparse blocks of one forward record for the load-balancing loss: per layer, the
/// router's probabilities summed over the counted tokens and how often each expert was each
/// token's k-th choice. Shared by every layer of a forward through [`super::RopeMask`].
///
/// Activation checkpointing runs a layer's forward without a graph, so its record carries no
/// gradient; the layer's recompute in the backward (after [`RouterTape::finish`]) adds the
/// loss's gradient itself. Given every layer's choices (constants: top-K has no gradient),
/// the loss is linear in each layer's probability sums, d aux / d prob_sum_l[e] =
/// E / (L n)^2 * chosen[e], so a recomputed block hands `weight` times that to its
/// probabilities ([`RouterTape::inject`]), tile by tile.
pub struct RouterTape {
    /// Which of the N = B * T tokens count (transformers' `attention_mask`: padding does not);
    /// None: all.
    valid: Option<Vec<bool>>,
    /// (N, 1) f32 of `valid`, for the probability sums.
    valid_col: Option<Tensor>,
    /// The tokens counted in each layer.
    counted: usize,
    /// What the caller multiplies the loss by in the loss it backpropagates.
    weight: f64,
    /// The forward is over: a block run now is a checkpointed layer's recompute.
    finished: std::sync::atomic::AtomicBool,
    /// By decoder layer.
    records: Mutex<std::collections::BTreeMap<usize, RouterRecord>>,
}

struct RouterRecord {
    /// (E) f32: sum over the counted tokens of softmax(router logits).
    prob_sum: Tensor,
    /// E: over the counted tokens and their K choices, how many chose each expert.
    chosen: Vec<f64>,
}

impl RouterTape {
    /// A tape for a batch of `tokens` tokens (N), `valid` marking those that count (None: all).
    /// `weight`: the factor the caller puts on the loss (a checkpointed layer's recompute
    /// injects the gradient of `weight` x the loss).
    pub fn new(
        tokens: usize,
        valid: Option<Vec<bool>>,
        weight: f64,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let counted = valid
            .as_ref()
            .map_or(tokens, |v| v.iter().filter(|&&b| b).count());
        let valid_col = match &valid {
            Some(v) => {
                let f: Vec<f32> = v.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect();
                Some(Tensor::from_vec(f, (v.len(), 1), device)?)
            }
            None => None,
        };
        Ok(Self {
            valid,
            valid_col,
            counted,
            weight,
            finished: std::sync::atomic::AtomicBool::new(false),
            records: Mutex::new(Default::default()),
        })
    }

    /// Marks the forward done: sparse blocks run from now on (checkpointed layers' recompute)
    /// inject the loss's gradient instead of recording.
    pub fn finish(&self) {
        self.finished
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The load-balancing loss of the recorded layers, a () f32 tensor (None when no sparse
    /// layer ran). transformers concatenates every sparse layer's router logits and takes
    /// E * sum_{k,e} f[k,e] * P[e], f[k,e] the share of (layer, token) pairs whose k-th choice
    /// is e, P[e] the mean probability of e; summed over k that is
    /// E / (L n)^2 * sum_e chosen[e] * prob_sum[e] over L layers of n counted tokens.
    pub fn aux_loss(&self, num_experts: usize) -> Result<Option<Tensor>> {
        let records = self.records.lock().expect("router tape");
        let Some(first) = records.values().next() else {
            return Ok(None);
        };
        let device = first.prob_sum.device().clone();
        let chosen = chosen_total(&records, num_experts);
        let mut prob_sum: Option<Tensor> = None;
        for r in records.values() {
            prob_sum = Some(match prob_sum {
                None => r.prob_sum.clone(),
                Some(p) => (p + &r.prob_sum)?,
            });
        }
        let prob_sum = prob_sum.expect("one record at least"); // (E)
        let n = (records.len() * self.counted) as f64; // L n
        let chosen: Vec<f32> = chosen.into_iter().map(|c| c as f32).collect();
        let chosen = Tensor::from_vec(chosen, num_experts, &device)?; // (E)
        let dot = (prob_sum * chosen)?.sum_all()?; // ()
        Ok(Some((dot * (num_experts as f64 / (n * n)))?))
    }
}

/// E: over every recorded layer, how often each expert was chosen.
fn chosen_total(records: &std::collections::BTreeMap<usize, RouterRecord>, e: usize) -> Vec<f64> {
    let mut chosen = vec![0f64; e];
    for r in records.values() {
        for (c, x) in chosen.iter_mut().zip(&r.chosen) {
            *c += x;
        }
    }
    chosen
}

impl SparseMoe {
    /// x: (B, T, C) -> (B, T, C). With a tape, records the router's statistics for the
    /// load-balancing loss.
    pub(crate) fn forward(&self, x: &Tensor, tape: Option<&RouterTape>) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let n = b * t;
        let k = self.top_k;
        let e = self.experts.len();
        let x = x.reshape((n, c))?; // (N, C)
        let logits = self.gate.forward(&x)?; // (N, E)
        let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?; // (N, E) f32

        // The top-K experts of each token, on the host: the ids only, which carry no gradient.
        let host: Vec<Vec<f32>> = probs.detach().to_vec2()?;
        let mut choice = vec![0u32; n * k]; // (N, K) row-major
        for (row, p) in host.iter().enumerate() {
            for (slot, id) in top_k(p, k).into_iter().enumerate() {
                choice[row * k + slot] = id as u32;
            }
        }
        let choice_t = Tensor::from_vec(choice.clone(), (n, k), x.device())?; // (N, K)
        let mut weights = probs.gather(&choice_t, 1)?; // (N, K) f32
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?; // as transformers casts them back

        let recompute = tape.filter(|t| t.finished.load(std::sync::atomic::Ordering::SeqCst));
        if let Some(tape) = tape.filter(|_| recompute.is_none()) {
            tape.record(self.layer, &probs, &choice, k, e)?;
        }

        // The (token, slot) pairs sorted by expert: a stable sort keeps tokens ascending within
        // an expert, as transformers' `torch.where` over its expert mask.
        let mut order: Vec<u32> = (0..(n * k) as u32).collect();
        order.sort_by_key(|&i| choice[i as usize]);
        let mut counts = vec![0usize; e];
        for &ch in &choice {
            counts[ch as usize] += 1;
        }
        let tokens: Vec<u32> = order.iter().map(|&i| i / k as u32).collect();
        let tokens = Tensor::from_vec(tokens, n * k, x.device())?; // (N K)
        let order = Tensor::from_vec(order, n * k, x.device())?; // (N K)
        let xs = x.index_select(&tokens, 0)?; // (N K, C), grouped by expert
        let ws = weights
            .flatten_all()?
            .index_select(&order, 0)?
            .unsqueeze(1)?; // (N K, 1)

        let mut outs = Vec::with_capacity(e);
        let mut start = 0;
        for (expert, &m) in self.experts.iter().zip(&counts) {
            if m == 0 {
                continue;
            }
            let xe = xs.narrow(0, start, m)?; // (m, C)
            outs.push(expert.forward(&xe, self.act)?); // (m, C)
            start += m;
        }
        let ys = Tensor::cat(&outs, 0)?.broadcast_mul(&ws)?; // (N K, C)
        let mut y = Tensor::zeros((n, c), ys.dtype(), x.device())?.index_add(&tokens, &ys, 0)?;
        if let Some(s) = &self.shared {
            let g = s.gate.forward(&x)?; // (N, 1)
            let g = (g.neg()?.exp()? + 1.0)?.recip()?; // sigmoid
            y = (y + s.expert.forward(&x, self.act)?.broadcast_mul(&g)?)?;
        }
        if let Some(tape) = recompute {
            y = tape.inject(y, &probs)?;
        }
        Ok(y.reshape((b, t, c))?)
    }
}

impl RouterTape {
    /// The probabilities summed over the counted tokens of this run, which may be a tile of
    /// the batch's tokens from [`crate::kernels::dropout::first_row`] on.
    /// probs: (N, E) f32 -> (E)
    fn prob_sum(&self, probs: &Tensor) -> Result<Tensor> {
        let first = crate::kernels::dropout::first_row();
        Ok(match &self.valid_col {
            Some(v) => probs
                .broadcast_mul(&v.narrow(0, first, probs.dim(0)?)?)?
                .sum(0)?,
            None => probs.sum(0)?,
        })
    }

    /// Adds one layer's statistics. probs: (N, E) f32; choice: (N, K) row-major.
    fn record(
        &self,
        layer: usize,
        probs: &Tensor,
        choice: &[u32],
        k: usize,
        e: usize,
    ) -> Result<()> {
        let prob_sum = self.prob_sum(probs)?;
        let first = crate::kernels::dropout::first_row();
        let mut chosen = vec![0f64; e];
        for (i, &ch) in choice.iter().enumerate() {
            if self.valid.as_ref().is_none_or(|v| v[first + i / k]) {
                chosen[ch as usize] += 1.0;
            }
        }
        let mut records = self.records.lock().expect("router tape");
        match records.get_mut(&layer) {
            // another tile of the layer's tokens
            Some(r) => {
                r.prob_sum = (&r.prob_sum + prob_sum)?;
                for (c, x) in r.chosen.iter_mut().zip(chosen) {
                    *c += x;
                }
            }
            None => {
                records.insert(layer, RouterRecord { prob_sum, chosen });
            }
        }
        Ok(())
    }
}

impl RouterTape {
    /// A checkpointed layer's recompute: `y` passed on unchanged, and in the backward the
    /// gradient of weight x aux sent to this run's probability sums (see [`RouterTape`]).
    /// y: (N, C), probs: (N, E) f32 -> (N, C)
    fn inject(&self, y: Tensor, probs: &Tensor) -> Result<Tensor> {
        let (chosen, layers) = {
            let records = self.records.lock().expect("router tape");
            (chosen_total(&records, probs.dim(1)?), records.len())
        };
        let e = chosen.len();
        let ln = (layers * self.counted) as f64;
        let scale = self.weight * e as f64 / (ln * ln);
        let w: Vec<f32> = chosen.iter().map(|c| (c * scale) as f32).collect();
        let w = Tensor::from_vec(w, e, probs.device())?; // (E): d(weight x aux) / d prob_sum
        let prob_sum = self.prob_sum(probs)?; // (E)
        crate::nn::ops::attach2(
            "router-aux",
            &y,
            &prob_sum,
            y.clone(),
            move |_, _, _, dy| Ok((Some(dy.clone()), Some(w.clone()))),
        )
    }
}

impl Expert {
    /// The three linears by their names, in the layout's order (gate, up, down).
    pub(crate) fn named(&self, n: &MoeNames) -> [(&'static str, &Linear); 3] {
        [
            (n.gate, &self.gate_proj),
            (n.up, &self.up_proj),
            (n.down, &self.down_proj),
        ]
    }

    pub(crate) fn named_mut(&mut self, n: &MoeNames) -> [(&'static str, &mut Linear); 3] {
        [
            (n.gate, &mut self.gate_proj),
            (n.up, &mut self.up_proj),
            (n.down, &mut self.down_proj),
        ]
    }

    /// x: (m, C) -> (m, C), through (m, I)
    fn forward(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let xa = adapter_input(&[&self.gate_proj, &self.up_proj], x)?; // one f32 copy of x
        let g = self.gate_proj.forward_with(x, xa.as_ref())?;
        let u = self.up_proj.forward_with(x, xa.as_ref())?;
        let a = match act {
            Activation::Silu => ops::swiglu(&g, &u)?,
            Activation::GeluTanh => ops::geglu(&g, &u)?,
        };
        self.down_proj.forward(&a)
    }
}

/// The indices of the `k` largest values of `p`, largest first; ties to the lower index, as
/// `torch.topk` on the CPU.
fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::top_k;

    #[test]
    fn top_k_is_largest_first() {
        assert_eq!(top_k(&[0.1, 0.5, 0.2, 0.2], 3), vec![1, 2, 3]);
        assert_eq!(top_k(&[0.3, 0.1], 1), vec![0]);
    }
}
