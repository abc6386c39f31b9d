//! `model.attention = "chunked"` (the default) gives eager attention's loss and gradients on
//! every fixture family: full fine-tuning (every weight's gradient), a batch with two documents
//! packed in one row and a shorter row padded (pad segment `u32::MAX`, as `batch.rs` pads), with
//! and without a sliding window shorter than the rows, checkpointing off and on. f32; tolerance
//! 1e-5 relative (loss) and 1e-5 of the largest gradient entry (gradients): the two compute the
//! same sums in another order. Breaking the chunked kernel's window on purpose (ignoring it)
//! fails the first windowed case: loss 319.83 vs 318.92 on tiny-llama (2.9e-3 relative).

use candle_core::{DType, Device, Tensor, Var};
use tallow_model::{lm_head_nll, AttentionImpl, CausalLM, Targets};
use tallow_tests::*;

const TOL: f64 = 1e-5;

/// Token ids, targets and segment ids of each row of a batch.
type Batch = (Vec<Vec<u32>>, Vec<Vec<bool>>, Vec<Vec<u32>>);

/// Loss and gradients of every weight for one packed + padded batch.
fn loss_and_grads(
    model: &CausalLM,
    vars: &[(String, Var)],
    (ids, targets, segments): &Batch,
) -> (f64, Vec<Tensor>) {
    let t = ids[0].len();
    let flat: Vec<u32> = ids.iter().flatten().copied().collect();
    let input = Tensor::from_vec(flat, (ids.len(), t), &Device::Cpu).unwrap();
    let h = model.forward_hidden(&input, Some(segments)).unwrap();
    let tg = Targets::new(ids, targets, &Device::Cpu).unwrap();
    let nll = lm_head_nll(
        &h,
        model.lm_head_weight(),
        &tg,
        model.config.variant.final_logit_softcapping,
    )
    .unwrap();
    let loss = nll
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let mut stores = vec![nll.backward().unwrap()];
    stores.extend(model.take_checkpoint_grads());
    let grads = vars
        .iter()
        .map(|(n, v)| {
            let gs: Vec<&Tensor> = stores.iter().filter_map(|s| s.get(v)).collect();
            assert!(!gs.is_empty(), "no gradient for {n}");
            gs.iter()
                .skip(1)
                .fold(gs[0].clone(), |a, g| (a + *g).unwrap())
        })
        .collect();
    (loss, grads)
}

/// Rows 0 and 1 of the fixture's text rows packed into one row, row 2 (cut to leave at least 3
/// pad tokens) padded to its length.
fn packed_batch(model_name: &str) -> Batch {
    let rows = reference_rows(&reference_json(model_name), "text");
    let mut ids = rows[0].0.clone();
    ids.extend(&rows[1].0);
    let mut tg = rows[0].1.clone();
    tg.extend(&rows[1].1);
    let mut seg = vec![0u32; rows[0].0.len()];
    seg.extend(vec![1u32; rows[1].0.len()]);
    let t = ids.len();
    let (mut ids2, mut tg2) = rows[2].clone();
    ids2.truncate(t - 3); // at least 3 pad tokens
    tg2.truncate(t - 3);
    let mut seg2 = vec![0u32; ids2.len()];
    ids2.resize(t, 0);
    tg2.resize(t, false);
    seg2.resize(t, u32::MAX);
    (vec![ids, ids2], vec![tg, tg2], vec![seg, seg2])
}

#[test]
fn chunked_attention_gives_eager_loss_and_gradients() {
    for model_name in MODELS {
        let batch = packed_batch(model_name);
        for window in [None, Some(5)] {
            let (mut model, vars) = trainable_model(model_name, DType::F32);
            model.config.sliding_window = window;
            model.attention = AttentionImpl::Eager;
            let (l0, g0) = loss_and_grads(&model, &vars, &batch);
            for checkpointing in [None, Some(1)] {
                model.attention = AttentionImpl::Chunked;
                model.set_checkpointing(checkpointing);
                let (l1, g1) = loss_and_grads(&model, &vars, &batch);
                let what =
                    format!("{model_name} window {window:?} checkpointing {checkpointing:?}");
                assert!(
                    (l1 - l0).abs() <= TOL * l0.abs(),
                    "{what}: loss {l1} vs {l0}"
                );
                let scale = g0.iter().map(max_abs).fold(0.0, f64::max);
                for ((n, _), (a, b)) in vars.iter().zip(g1.iter().zip(&g0)) {
                    let d = max_abs_diff(a, b);
                    assert!(d <= TOL * scale, "{what}: gradient of {n} differs by {d}");
                }
            }
        }
    }
}
