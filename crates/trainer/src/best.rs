//! The best evaluation of a run, for `train.keep_best` and `train.early_stopping_patience`.
//!
//! The rules are HF Trainer's, with `metric_for_best_model = "eval_loss"`:
//! - the best is the lowest eval loss so far (any decrease counts), as `Trainer`'s
//!   `_determine_best_metric`;
//! - an evaluation resets the patience counter when it beats the best *before it* by more than
//!   `early_stopping_threshold`, and adds one otherwise, as `EarlyStoppingCallback`; the run
//!   stops when the counter reaches the patience.
//!
//! Only evaluations after a training step count: the step-0 evaluation of the untouched
//! weights is logged, but neither the best nor the counter (HF Trainer does not evaluate before
//! training either). The state travels in every checkpoint's `state.json`, so a resumed run
//! stops, or keeps, exactly as an uninterrupted one.

use serde::{Deserialize, Serialize};

/// The best evaluation so far and the evaluations since the last improvement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BestEval {
    /// Step and eval loss of the lowest eval loss so far (None before the first evaluation).
    pub best: Option<(usize, f64)>,
    /// Evaluations in a row without an improvement of more than the threshold.
    pub evals_without_improvement: usize,
}

/// What one evaluation changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// It is the new best (its weights are the ones `keep_best` keeps).
    pub new_best: bool,
}

impl BestEval {
    /// Records the evaluation of step `step` (>= 1) with eval loss `loss`.
    pub fn observe(&mut self, step: usize, loss: f64, threshold: f64) -> Observed {
        let (improved_by_threshold, new_best) = match self.best {
            None => (true, true),
            Some((_, best)) => (loss < best && best - loss > threshold, loss < best),
        };
        if improved_by_threshold {
            self.evals_without_improvement = 0;
        } else {
            self.evals_without_improvement += 1;
        }
        if new_best {
            self.best = Some((step, loss));
        }
        Observed { new_best }
    }

    /// Whether `patience` evaluations in a row went without improvement (never with 0).
    pub fn exhausted(&self, patience: usize) -> bool {
        patience > 0 && self.evals_without_improvement >= patience
    }

    /// The step of the best evaluation.
    pub fn best_step(&self) -> Option<usize> {
        self.best.map(|(s, _)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HF's rules on a sequence of eval losses: the counter after each, and the best.
    #[test]
    fn follows_hf_rules() {
        // threshold 0: any decrease resets; equal losses do not count as better.
        let mut b = BestEval::default();
        let counters: Vec<usize> = [(1, 2.0), (2, 1.5), (3, 1.5), (4, 1.6), (5, 1.4)]
            .iter()
            .map(|&(s, l)| {
                b.observe(s, l, 0.0);
                b.evals_without_improvement
            })
            .collect();
        assert_eq!(counters, [0, 0, 1, 2, 0]);
        assert_eq!(b.best, Some((5, 1.4)));
        assert!(!b.exhausted(1));
        assert!(!b.exhausted(0));

        // threshold 0.1: a decrease of 0.05 is a new best (keep_best keeps it) but does not
        // reset the counter; the next compares against the new best.
        let mut b = BestEval::default();
        assert!(b.observe(1, 2.0, 0.1).new_best);
        let o = b.observe(2, 1.95, 0.1);
        assert!(o.new_best);
        assert_eq!(b.evals_without_improvement, 1);
        assert!(b.exhausted(1) && !b.exhausted(2));
        b.observe(3, 1.80, 0.1); // 1.95 - 1.80 = 0.15 > 0.1
        assert_eq!(b.evals_without_improvement, 0);
        assert_eq!(b.best_step(), Some(3));
        // A worse loss: no new best.
        assert!(!b.observe(4, 1.9, 0.1).new_best);
        assert_eq!(b.best, Some((3, 1.80)));
    }
}
