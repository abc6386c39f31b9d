//! Finite-difference checks of every gradient path, block by block, in f64: for a decoder layer
//! (attention with GQA / bias / qk-norm, rotary embedding, SwiGLU MLP, RMSNorms) of each family,
//! and for the head block (final RMSNorm + fused chunked LM-head cross-entropy, Gemma 2 with its
//! (1 + w) norm and soft-capped logits).
//!
//! Central differences with step 1e-6 in f64; analytic and numeric derivatives must agree to
//! 1e-6 relative (|a - n| <= 1e-6 * max(1, |n|)). A silently cut gradient (a `*_no_bwd` op)
//! shows up here as a zero or missing analytic gradient.

use candle_core::{DType, Device, Tensor, Var};
use tallow_model::{lm_head_nll, CausalLM, Targets};
use tallow_tests::*;

const STEP: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn load_f64(model: &str) -> CausalLM {
    trainable_model(model, DType::F64).0
}

fn scalar(t: &Tensor) -> f64 {
    t.to_scalar::<f64>().unwrap()
}

/// A few deterministic coordinates of a tensor with `n` elements.
fn coords(n: usize, seed: usize) -> Vec<usize> {
    let mut s = seed as u64 * 2654435761 + 12345;
    (0..4)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as usize) % n
        })
        .collect()
}

fn set_elem(var: &Var, idx: usize, value: f64) {
    let shape = var.shape().clone();
    let mut data = var.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    data[idx] = value;
    var.set(&Tensor::from_vec(data, shape, &Device::Cpu).unwrap())
        .unwrap();
}

/// Checks d loss / d var at a few coordinates against central differences.
fn check_var(what: &str, var: &Var, analytic: &Tensor, loss: &dyn Fn() -> f64, seed: usize) {
    let flat = analytic.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let orig = var.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let nonzero = flat.iter().any(|g| *g != 0.0);
    assert!(
        nonzero,
        "{what}: analytic gradient is all zeros (a cut graph?)"
    );
    for i in coords(flat.len(), seed) {
        set_elem(var, i, orig[i] + STEP);
        let up = loss();
        set_elem(var, i, orig[i] - STEP);
        let down = loss();
        set_elem(var, i, orig[i]);
        let numeric = (up - down) / (2.0 * STEP);
        let err = (flat[i] - numeric).abs();
        assert!(
            err <= TOL * numeric.abs().max(1.0),
            "{what}[{i}]: analytic {} vs numeric {numeric}",
            flat[i]
        );
    }
}

/// Every decoder layer of each family (the fixtures have 2), each on its own.
#[test]
fn decoder_layer_gradients_match_finite_differences() {
    for (m, model_name) in MODELS.iter().enumerate() {
        let model = load_f64(model_name);
        let c = model.config.hidden_size;
        let (b, t) = (2, 5);
        let rope = model.rope_mask(b, t, None).unwrap();
        assert!(model.layers.len() >= 2);
        for (l, layer) in model.layers.iter().enumerate() {
            let x = Var::randn(0f64, 1., (b, t, c), &Device::Cpu).unwrap();
            let r = Tensor::randn(0f64, 1., (b, t, c), &Device::Cpu).unwrap();
            let loss = || {
                let y = layer.forward(x.as_tensor(), &rope).unwrap();
                (y * &r).unwrap().sum_all().unwrap()
            };
            let grads = loss().backward().unwrap();
            let value = || scalar(&loss());
            let seed = 1000 * l + m;
            check_var(
                &format!("{model_name} layer {l} input"),
                &x,
                grads.get(&x).unwrap(),
                &value,
                seed,
            );
            let prefix = format!("model.layers.{l}.");
            let params: Vec<_> = model
                .named_params()
                .into_iter()
                .filter(|(n, _)| n.starts_with(&prefix))
                .collect();
            // the layout's linears (seven, or Phi-3's four fused) and two norms
            let expected = model.config.layer_linears().len()
                + 2
                + if model.config.qkv_bias { 3 } else { 0 }
                + if model.config.qk_norm { 2 } else { 0 }
                + if model.config.variant.sandwich_norms {
                    2
                } else {
                    0
                };
            assert_eq!(
                params.len(),
                expected,
                "{model_name}: layer {l} parameter count"
            );
            for (k, (name, p)) in params.iter().enumerate() {
                let var = p.var().unwrap();
                let g = grads
                    .get(var)
                    .unwrap_or_else(|| panic!("{model_name}: no gradient for {name}"));
                check_var(
                    &format!("{model_name} {name}"),
                    var,
                    g,
                    &value,
                    seed + 100 * k,
                );
            }
        }
    }
}

#[test]
fn head_block_gradients_match_finite_differences() {
    for (m, model_name) in MODELS.iter().enumerate() {
        let model = load_f64(model_name);
        let c = model.config.hidden_size;
        let v = model.config.vocab_size as u32;
        let x = Var::randn(0f64, 1., (2, 4, c), &Device::Cpu).unwrap();
        let ids = vec![vec![1, 7 % v, 100 % v, 3], vec![5, 9, 2, 0]];
        let tg = vec![
            vec![false, true, true, true],
            vec![false, true, false, false],
        ];
        let targets = Targets::new(&ids, &tg, &Device::Cpu).unwrap();
        let loss = || {
            // the model's final norm (Gemma 2: (1 + w)), then the (soft-capped) loss
            let h = model.final_norm(x.as_tensor()).unwrap();
            lm_head_nll(
                &h,
                model.lm_head_weight(),
                &targets,
                model.config.variant.final_logit_softcapping,
            )
            .unwrap()
        };
        let grads = loss().backward().unwrap();
        let value = || scalar(&loss());
        check_var(
            &format!("{model_name} hidden"),
            &x,
            grads.get(&x).unwrap(),
            &value,
            m,
        );
        let norm = model.norm.var().unwrap();
        check_var(
            &format!("{model_name} norm"),
            norm,
            grads.get(norm).unwrap(),
            &value,
            m + 7,
        );
        let head = model
            .lm_head
            .as_ref()
            .unwrap_or(&model.embed_tokens)
            .var()
            .unwrap();
        // Only rows of target tokens and of tokens in the softmax get gradient: all rows here.
        check_var(
            &format!("{model_name} head"),
            head,
            grads.get(head).unwrap(),
            &value,
            m + 11,
        );
    }
}
