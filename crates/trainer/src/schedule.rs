//! Learning-rate schedules with linear warmup, exactly as Hugging Face transformers'
//! `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup` and
//! `get_cosine_schedule_with_warmup` (`num_cycles = 0.5`), transformers/optimization.py.
//!
//! Step convention (the same as HF's `LambdaLR`): `step` is the 0-based index of the optimizer
//! step about to be taken. HF builds the scheduler with `lr = base_lr * lambda(0)`, the first
//! `optimizer.step()` uses that, and each `scheduler.step()` after it moves to `lambda(1)`,
//! `lambda(2)`, ... So the first step uses `lr_at(.., step = 0, ..)`, which is **0** whenever
//! `warmup_steps > 0`: the first update of a warmed-up run does nothing (and AdamW's decoupled
//! weight decay is `lr * wd * p = 0` too), only the moments move. With `warmup_steps = 0` the
//! first step uses the full `base_lr`.
//!
//! Warmup: `step / max(1, warmup_steps)` for `step < warmup_steps`. After it, with
//! `progress = (step - warmup) / max(1, total - warmup)`:
//! - constant: 1
//! - linear: `max(0, (total - step) / max(1, total - warmup))` = `max(0, 1 - progress)`
//! - cosine: `max(0, 0.5 * (1 + cos(pi * progress)))`
//!
//! The last step a run of `total_steps` takes is `total_steps - 1`, so linear and cosine never
//! quite reach 0 inside a run. As in HF, cosine's progress is not clamped past `total_steps`.

crate::config::choice::choices! {
    /// The shape of the learning rate after warmup.
    pub enum Schedule {
        /// `get_constant_schedule_with_warmup`: base_lr after warmup.
        Constant = "constant",
        /// `get_linear_schedule_with_warmup`: linear decay to 0 at `total_steps`.
        Linear = "linear",
        /// `get_cosine_schedule_with_warmup`, half a cosine period: decay to 0 at `total_steps`.
        Cosine = "cosine",
    }
}

crate::config::choice::any_case_from_str!(Schedule, "learning-rate schedule");

/// The learning rate of optimizer step `step` (0-based: the step about to be taken) of a run of
/// `total_steps` steps, the first `warmup_steps` of which warm up linearly from 0.
/// See the module docs for the formulas and the step convention.
pub fn lr_at(
    kind: Schedule,
    base_lr: f64,
    step: usize,
    warmup_steps: usize,
    total_steps: usize,
) -> f64 {
    base_lr * lr_lambda(kind, step, warmup_steps, total_steps)
}

/// The multiplier HF's `lr_lambda` returns (integer arithmetic in i64 as Python's ints, so that
/// `total - step` may go negative).
fn lr_lambda(kind: Schedule, step: usize, warmup_steps: usize, total_steps: usize) -> f64 {
    let (step, warmup, total) = (step as i64, warmup_steps as i64, total_steps as i64);
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    let decay_steps = (total - warmup).max(1) as f64;
    match kind {
        Schedule::Constant => 1.0,
        Schedule::Linear => ((total - step) as f64 / decay_steps).max(0.0),
        Schedule::Cosine => {
            let num_cycles = 0.5;
            let progress = (step - warmup) as f64 / decay_steps;
            (0.5 * (1.0 + (std::f64::consts::PI * num_cycles * 2.0 * progress).cos())).max(0.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::f64::consts::PI;

    const LR: f64 = 3e-4;
    const WARMUP: usize = 10;
    const TOTAL: usize = 110;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-15, "{a} vs {b}");
    }

    #[test]
    fn warmup_is_the_same_for_every_kind_and_starts_at_zero() {
        for kind in [Schedule::Constant, Schedule::Linear, Schedule::Cosine] {
            assert_eq!(lr_at(kind, LR, 0, WARMUP, TOTAL), 0.0, "{kind}");
            close(lr_at(kind, LR, 5, WARMUP, TOTAL), LR * 5.0 / 10.0);
            close(lr_at(kind, LR, 9, WARMUP, TOTAL), LR * 9.0 / 10.0);
            // end of warmup: the full rate (progress 0)
            close(lr_at(kind, LR, WARMUP, WARMUP, TOTAL), LR);
            // no warmup: the first step already uses base_lr
            close(lr_at(kind, LR, 0, 0, TOTAL), LR);
        }
    }

    #[test]
    fn constant_stays_at_base_lr() {
        for step in [10, 60, 109, 110, 500] {
            close(lr_at(Schedule::Constant, LR, step, WARMUP, TOTAL), LR);
        }
    }

    #[test]
    fn linear_decays_to_zero_at_total_steps() {
        let f = |step| lr_at(Schedule::Linear, LR, step, WARMUP, TOTAL);
        // (total - step) / (total - warmup)
        close(f(60), LR * 50.0 / 100.0);
        close(f(109), LR * 1.0 / 100.0); // the last step of the run
        assert_eq!(f(110), 0.0);
        assert_eq!(f(200), 0.0); // clamped at 0, not negative
    }

    #[test]
    fn cosine_follows_half_a_period() {
        let f = |step| lr_at(Schedule::Cosine, LR, step, WARMUP, TOTAL);
        let hf = |step: usize| {
            let progress = (step - WARMUP) as f64 / (TOTAL - WARMUP) as f64;
            LR * 0.5 * (1.0 + (PI * 0.5 * 2.0 * progress).cos())
        };
        close(f(35), hf(35)); // progress 0.25: (1 + cos(pi/4)) / 2 = 0.8536
        close(f(35), LR * 0.5 * (1.0 + 0.5f64.sqrt()));
        close(f(60), LR * 0.5); // halfway
        close(f(109), hf(109)); // the last step of the run
        assert!(f(109) > 0.0 && f(109) < LR * 1e-3);
        assert!(f(110).abs() < 1e-18); // cos(pi) = -1
    }

    #[test]
    fn degenerate_runs_do_not_divide_by_zero() {
        // warmup longer than the run: HF uses max(1, total - warmup)
        close(lr_at(Schedule::Linear, LR, 3, 4, 2), LR * 3.0 / 4.0);
        assert_eq!(lr_at(Schedule::Linear, LR, 4, 4, 2), 0.0);
        close(lr_at(Schedule::Cosine, LR, 4, 4, 2), LR);
        // a one-step run without warmup
        close(lr_at(Schedule::Cosine, LR, 0, 0, 1), LR);
        close(lr_at(Schedule::Linear, LR, 0, 0, 1), LR);
    }

    #[test]
    fn parses_and_serializes_snake_case() {
        assert_eq!("cosine".parse::<Schedule>(), Ok(Schedule::Cosine));
        assert_eq!("Linear".parse::<Schedule>(), Ok(Schedule::Linear));
        assert!("step".parse::<Schedule>().unwrap_err().contains("constant"));
        let s: Schedule = serde_json::from_str("\"constant\"").unwrap();
        assert_eq!(s, Schedule::Constant);
        assert_eq!(
            serde_json::to_string(&Schedule::Linear).unwrap(),
            "\"linear\""
        );
        assert_eq!(Schedule::Cosine.to_string(), "cosine");
    }
}
