//! tallow's `adamw8bit` update against bitsandbytes 0.50.2's `AdamW8bit` (its CPU backend:
//! dequantize, AdamW in f32, requantize), step by step
//! (`tests/fixtures/reference/adamw8bit.safetensors`, made by
//! `scripts/make_adamw8bit_fixtures.py`).
//!
//! Each of the 5 steps starts from bitsandbytes' own state after the step before (its codes and
//! absmax loaded as a tallow checkpoint would be), so every comparison is one update, not an
//! accumulation of rounding: a 64 x 128 parameter (8-bit moments, 32 blocks) and a 16 x 16 one
//! (f32 moments, under bitsandbytes' `min_8bit_size`).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use tallow_model::kernels::blockwise8::dynamic_map;
use tallow_tests::*;
use tallow_trainer::optim::{AdamW8bit, AdamWParams, Optimizer, STEP_KEY};

fn codes(t: &Tensor) -> Vec<u8> {
    t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
}

/// Tolerances, each against the size of what it must catch:
/// - parameter after the step: 1e-6 absolute, a few f32 ulps of parameters up to ~4 (one ulp
///   there is 2.4e-7 .. 4.8e-7). The update here is ~1e-2 per element; the decoupled weight
///   decay alone moves a parameter of size 1 by lr * wd = 1e-4, bias correction by 10x.
/// - f32 moments and 8-bit absmax: 1e-6 relative (the same f32 operations in another order).
/// - codes: the fixture also holds the f32 moments bitsandbytes quantized. Its CPU quantizer
///   does not always pick the nearest code (near zero it can land several codes away, within
///   0.0071 x absmax); tallow rounds to the nearest, so each of tallow's codes must decode at
///   least as close to that moment as bitsandbytes' does (up to 1e-6 x absmax for the moments'
///   own f32 differences). A wrong beta, map, block or absmax puts codes farther away.
#[test]
fn each_step_matches_bitsandbytes_adamw8bit() {
    let doc = json_at(&fixtures(), "adamw8bit.json");
    let t = candle_core::safetensors::load(
        fixtures().join("reference/adamw8bit.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let lr = doc["lr"].as_f64().unwrap();
    let hp = AdamWParams {
        beta1: doc["betas"][0].as_f64().unwrap(),
        beta2: doc["betas"][1].as_f64().unwrap(),
        eps: doc["eps"].as_f64().unwrap(),
        weight_decay: doc["weight_decay"].as_f64().unwrap(),
    };
    let steps = doc["steps"].as_u64().unwrap() as usize;
    assert!(steps >= 3);
    let mut worst = (0.0f64, 0.0f64, 0usize);
    for k in 1..=steps {
        let before = |i: usize| {
            if k == 1 {
                t[&format!("init.{i}")].clone()
            } else {
                t[&format!("after.{}.{i}.param", k - 1)].clone()
            }
        };
        let vars: Vec<Var> = (0..2)
            .map(|i| Var::from_tensor(&before(i)).unwrap())
            .collect();
        let mut opt = AdamW8bit::new(hp);
        if k > 1 {
            let mut state: HashMap<String, Tensor> = HashMap::new();
            for part in [
                "0.exp_avg.codes",
                "0.exp_avg.absmax",
                "0.exp_avg_sq.codes",
                "0.exp_avg_sq.absmax",
                "1.exp_avg",
                "1.exp_avg_sq",
            ] {
                state.insert(part.into(), t[&format!("after.{}.{part}", k - 1)].clone());
            }
            state.insert(
                STEP_KEY.into(),
                Tensor::new((k - 1) as u32, &Device::Cpu).unwrap(),
            );
            opt.load_state(&vars, &state).unwrap();
        }
        let grads: Vec<Tensor> = (0..2)
            .map(|i| t[&format!("grad.{k}.{i}")].clone())
            .collect();
        opt.step(&vars, &grads, lr).unwrap();

        for (i, v) in vars.iter().enumerate() {
            let want = &t[&format!("after.{k}.{i}.param")];
            let d = max_abs_diff(v.as_tensor(), want);
            let update = max_abs_diff(&before(i), want);
            assert!(update > 1e-3, "step {k}: the reference update is {update}");
            assert!(
                d < 1e-6,
                "step {k} parameter {i}: differs by {d} (update {update})"
            );
            worst.0 = worst.0.max(d);
        }
        let ours: HashMap<String, Tensor> = opt.state().into_iter().collect();
        for part in [
            "1.exp_avg",
            "1.exp_avg_sq",
            "0.exp_avg.absmax",
            "0.exp_avg_sq.absmax",
        ] {
            let want = &t[&format!("after.{k}.{part}")];
            let rel = max_abs_diff(&ours[part], want) / max_abs(want).max(1e-30);
            assert!(rel < 1e-6, "step {k} {part}: differs by {rel} (relative)");
            worst.1 = worst.1.max(rel);
        }
        for (what, signed) in [("exp_avg", true), ("exp_avg_sq", false)] {
            let map = dynamic_map(signed);
            let ours_c = codes(&ours[&format!("0.{what}.codes")]);
            let ours_a = values(&ours[&format!("0.{what}.absmax")]);
            let bnb_c = codes(&t[&format!("after.{k}.0.{what}.codes")]);
            let bnb_a = values(&t[&format!("after.{k}.0.{what}.absmax")]);
            let x = values(&t[&format!("after.{k}.0.{what}.fp32")]);
            let mut differ = 0;
            for (j, &xj) in x.iter().enumerate() {
                let (b, a) = (j / 256, bnb_a[j / 256]);
                let e_ours = (map[ours_c[j] as usize] as f64 * ours_a[b] - xj).abs();
                let e_bnb = (map[bnb_c[j] as usize] as f64 * a - xj).abs();
                assert!(
                    e_bnb <= 0.0071 * a,
                    "step {k} {what}[{j}]: the fixture's code is not a rounding of its moment"
                );
                assert!(
                    e_ours <= e_bnb + 1e-6 * a,
                    "step {k} {what}[{j}]: tallow's code {} is farther from {xj} than \
                     bitsandbytes' {} ({e_ours} vs {e_bnb}; absmax {a})",
                    ours_c[j],
                    bnb_c[j]
                );
                differ += usize::from(ours_c[j] != bnb_c[j]);
            }
            worst.2 = worst.2.max(differ);
        }
        assert_eq!(vars[0].dtype(), DType::F32);
    }
    eprintln!(
        "worst: parameter {:.2e} absolute, moments/absmax {:.2e} relative, {} codes (of 8192) differ, each nearer",
        worst.0, worst.1, worst.2
    );
}
