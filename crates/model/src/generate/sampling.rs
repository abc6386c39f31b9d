//! Choosing the next token from the last position's logits, with transformers' logits processors
//! in transformers' order: repetition penalty, then (when sampling) temperature, top-k, top-p,
//! and a draw from the softmax. Temperature 0 is greedy (argmax, the first index on a tie, as
//! `torch.argmax`); the repetition penalty applies in both modes, as in transformers.
//!
//! The draw uses a seeded `StdRng`: the same seed gives the same tokens on any machine, but not
//! the tokens torch's `multinomial` would draw.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};

/// Decoding knobs with transformers' meanings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy. Otherwise logits are divided by it before sampling.
    pub temperature: f64,
    /// Keep the k most likely tokens (ties with the k-th kept too); 0: off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p; 1.0: off.
    pub top_p: f64,
    /// Above 1 discourages ids already in the prompt or output: their logit is divided by it
    /// when positive, multiplied when negative (CTRL, arXiv:1909.05858; HF
    /// `RepetitionPenaltyLogitsProcessor`). 1.0: off.
    pub repetition_penalty: f64,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy, no penalty.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges; messages name the command-line flag.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Invalid(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "--temperature {}: must be 0 (greedy) or positive",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("--top-p {}: must be in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "--repetition-penalty {}: must be positive (1.0 = off)",
                self.repetition_penalty
            ));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Picks tokens, keeping the random state between calls.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Self { params, rng })
    }

    /// The next id from the last position's logits (V values); `history` holds every id so far,
    /// prompt included (the repetition penalty's "seen" set).
    pub fn next(&mut self, mut logits: Vec<f32>, history: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            // Once per distinct id, however often it occurred (HF gathers and scatters).
            let mut seen = vec![false; logits.len()];
            let r = p.repetition_penalty as f32;
            for &id in history {
                let i = id as usize;
                if i < logits.len() && !seen[i] {
                    seen[i] = true;
                    let l = logits[i];
                    logits[i] = if l < 0.0 { l * r } else { l / r };
                }
            }
        }
        if p.is_greedy() {
            return argmax(&logits);
        }
        let t = p.temperature as f32;
        logits.iter_mut().for_each(|l| *l /= t);
        if p.top_k > 0 && p.top_k < logits.len() {
            // HF TopKLogitsWarper: drop every logit below the k-th largest.
            let mut sorted = logits.clone();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            let kth = sorted[p.top_k - 1];
            logits
                .iter_mut()
                .filter(|l| **l < kth)
                .for_each(|l| *l = f32::NEG_INFINITY);
        }
        let mut probs = softmax(&logits);
        if p.top_p < 1.0 {
            // HF TopPLogitsWarper: in ascending order, drop tokens while the cumulative
            // probability stays <= 1 - top_p; the most likely token always stays.
            let mut order: Vec<usize> = (0..probs.len()).collect();
            order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
            let mut cum = 0.0f64;
            let last = order.len() - 1;
            for (n, &i) in order.iter().enumerate() {
                cum += probs[i] as f64;
                if cum <= 1.0 - p.top_p && n < last {
                    logits[i] = f32::NEG_INFINITY;
                }
            }
            probs = softmax(&logits);
        }
        // Inverse-CDF draw.
        let u: f64 = self.rng.random();
        let mut cum = 0.0f64;
        let mut pick = argmax(&probs);
        for (i, &q) in probs.iter().enumerate() {
            cum += q as f64;
            if q > 0.0 && u < cum {
                pick = i as u32;
                break;
            }
        }
        pick
    }
}

/// Index of the largest value; the first one on a tie.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| ((l - max) as f64).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|&x| (x / z) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f64, top_k: usize, top_p: f64, rp: f64, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: rp,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_the_penalty_applies() {
        let mut s = sampler(0.0, 0, 1.0, 1.0, 0);
        assert_eq!(s.next(vec![1.0, 3.0, 3.0, -1.0], &[]), 1);
        // Penalty 2 on id 1 (seen twice, penalized once): 3 -> 1.5 < 2.
        let mut s = sampler(0.0, 0, 1.0, 2.0, 0);
        assert_eq!(s.next(vec![2.0, 3.0, -1.0], &[1, 1]), 0);
        // A negative logit is multiplied: -1 -> -2, so id 2 stays below id 0's -1.5.
        assert_eq!(s.next(vec![-1.5, -3.0, -1.0], &[2]), 0);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_draw() {
        let logits = vec![0.0, 5.0, 4.9, 1.0, 0.5];
        let mut s = sampler(1.0, 2, 1.0, 1.0, 1);
        for _ in 0..200 {
            let id = s.next(logits.clone(), &[]);
            assert!(id == 1 || id == 2, "top-k 2 drew {id}");
        }
        // p(1) ~ 0.51: top-p 0.3 keeps only the most likely token.
        let mut s = sampler(1.0, 0, 0.3, 1.0, 1);
        for _ in 0..50 {
            assert_eq!(s.next(logits.clone(), &[]), 1);
        }
    }

    #[test]
    fn draws_follow_the_seed_and_the_distribution() {
        let logits = vec![0.0f32; 8];
        let draw = |seed| {
            let mut s = sampler(1.0, 0, 1.0, 1.0, seed);
            (0..400)
                .map(|_| s.next(logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        let d = draw(5);
        for id in 0..8 {
            let n = d.iter().filter(|&&x| x == id).count();
            assert!(
                (25..=75).contains(&n),
                "uniform logits: id {id} drawn {n}/400"
            );
        }
    }

    #[test]
    fn bad_values_name_the_flag() {
        let d = SamplingParams::default();
        let bad_top_p = SamplingParams {
            top_p: 0.0,
            ..d.clone()
        };
        let bad_temperature = SamplingParams {
            temperature: -1.0,
            ..d
        };
        for (p, flag) in [(bad_top_p, "--top-p"), (bad_temperature, "--temperature")] {
            let err = Sampler::new(p).err().unwrap().to_string();
            assert!(err.contains(flag), "{err}");
        }
    }
}
