//! Activation checkpointing gives the gradients of the plain forward: LoRA and DoRA (with dropout on, so
//! the recomputation must redraw the same masks) and full fine-tuning, every layer or every
//! second layer checkpointed, the token-wise parts (MLP half, q/k/v and o projections) in token
//! tiles, one row per batch or several rows in one, inputs offloaded. f32; tolerance 1e-5 relative to the largest gradient entry
//! (the recomputed forward is the same sequence of ops, so differences are float-order only).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use tallow_model::{
    attach_lora, lm_head_nll, lora_vars, set_dropout, CausalLM, LoadOptions, LoraSpec, Targets,
};
use tallow_tests::*;

const TOL: f64 = 1e-5;

/// (every, MLP tile rows, offload): every layer or every second one; the MLP half in one
/// tile (the hidden size exceeds the fixture rows) or in tiles of 5 / 7 tokens (the last one
/// partial; LoRA dropout must draw the untiled masks); inputs offloaded (on the CPU the same
/// code path, links between consecutive checkpointed layers) or not.
const SETTINGS: [(usize, Option<usize>, bool); 5] = [
    (1, None, false),
    (2, None, false),
    (1, Some(5), false),
    (1, Some(7), true),
    (2, Some(5), true),
];

type Row = (Vec<u32>, Vec<bool>);

/// The text rows as batches: one row each, or (`together`) every row cut to the shortest one's
/// length in one batch, so that token tiles also start inside later rows of a batch (their
/// rotary tables and dropout masks are that row's).
fn batches(rows: &[Row], together: bool) -> Vec<Vec<Row>> {
    if !together {
        return rows.iter().map(|r| vec![r.clone()]).collect();
    }
    let t = rows.iter().map(|(ids, _)| ids.len()).min().unwrap();
    assert!(
        rows.len() >= 2 && t > 7,
        "the fixture's rows: several, longer than a tile"
    );
    vec![rows
        .iter()
        .map(|(ids, tg)| (ids[..t].to_vec(), tg[..t].to_vec()))
        .collect()]
}

/// Loss of each batch of rows; returns the summed grads of `vars` (main store plus the
/// checkpointed layers' side stores).
fn grads(model: &CausalLM, vars: &[(String, Var)], batches: &[Vec<Row>]) -> Vec<Tensor> {
    let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
    for batch in batches {
        let ids: Vec<Vec<u32>> = batch.iter().map(|(i, _)| i.clone()).collect();
        let tg: Vec<Vec<bool>> = batch.iter().map(|(_, t)| t.clone()).collect();
        let input = Tensor::new(ids.clone(), &Device::Cpu).unwrap(); // (B, T)
        let h = model.forward_hidden(&input, None).unwrap();
        let t = Targets::new(&ids, &tg, &Device::Cpu).unwrap();
        let nll = lm_head_nll(
            &h,
            model.lm_head_weight(),
            &t,
            model.config.variant.final_logit_softcapping,
        )
        .unwrap();
        let mut stores: Vec<GradStore> = vec![nll.backward().unwrap()];
        stores.extend(model.take_checkpoint_grads());
        for (sum, (_, v)) in sums.iter_mut().zip(vars) {
            for s in &stores {
                if let Some(g) = s.get(v) {
                    *sum = Some(match sum.take() {
                        None => g.clone(),
                        Some(a) => (a + g).unwrap(),
                    });
                }
            }
        }
    }
    sums.into_iter()
        .zip(vars)
        .map(|(s, (n, _))| s.unwrap_or_else(|| panic!("no gradient for {n}")))
        .collect()
}

fn compare(what: &str, vars: &[(String, Var)], a: &[Tensor], b: &[Tensor]) {
    let scale = a.iter().map(max_abs).fold(0.0, f64::max).max(1e-12);
    for ((name, _), (x, y)) in vars.iter().zip(a.iter().zip(b)) {
        let d = max_abs_diff(x, y);
        assert!(
            d <= TOL * scale,
            "{what}: gradient of {name} differs by {d} (tolerance {})",
            TOL * scale
        );
    }
}

/// For each batching of `rows` (one row per batch, all in one), the gradients of `vars` under
/// every checkpointing setting of [`SETTINGS`] against those without checkpointing.
fn every_setting_equals_plain(
    model: &mut CausalLM,
    vars: &[(String, Var)],
    rows: &[Row],
    what: &str,
) {
    for together in [false, true] {
        let batches = batches(rows, together);
        model.set_checkpointing(None);
        let plain = grads(model, vars, &batches);
        for (every, tile, offload) in SETTINGS {
            model.set_checkpointing(Some(every));
            model.set_checkpoint_tile_rows(tile);
            model.set_offload_checkpoints(offload);
            let ck = grads(model, vars, &batches);
            compare(
                &format!(
                    "{what} every={every} tile={tile:?} offload={offload} one batch={together}"
                ),
                vars,
                &plain,
                &ck,
            );
        }
    }
}

/// LoRA and DoRA (whose magnitude gradient and weight norm are recomputed with the layer).
#[test]
fn lora_gradients_with_checkpointing_equal_plain_gradients() {
    for dora in [false, true] {
        for model_name in MODELS {
            adapter_gradients_with_checkpointing(model_name, dora);
        }
    }
}

fn adapter_gradients_with_checkpointing(model_name: &str, dora: bool) {
    let kind = if dora { "dora" } else { "lora" };
    let reference = reference_json(model_name);
    let rows = reference_rows(&reference, "text");
    let opts = LoadOptions::frozen(DType::F32, &Device::Cpu);
    let mut model = CausalLM::load(&model_dir(model_name), &opts).unwrap();
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.1,
        targets: tallow_model::peft::LINEAR_MODULES
            .iter()
            .map(|s| s.to_string())
            .collect(),
        rslora: false,
        kind: if dora {
            tallow_model::AdapterKind::Dora
        } else {
            tallow_model::AdapterKind::Lora
        },
        target_parameters: vec![],
    };
    attach_lora(&mut model, &spec, 1).unwrap();
    let vars = lora_vars(&model);
    if dora {
        assert!(vars
            .iter()
            .any(|(n, _)| n.ends_with("lora_magnitude_vector")));
    }
    // B starts at zero; give it values so every path carries gradient.
    for (n, v) in &vars {
        if n.contains("lora_B") {
            v.set(&Tensor::randn(0f32, 0.05, v.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    set_dropout(&model, Some(1234));
    every_setting_equals_plain(&mut model, &vars, &rows, &format!("{model_name} {kind}"));
    model.set_checkpointing(None);
    assert!(model.take_checkpoint_grads().is_empty());
}

#[test]
fn full_fine_tuning_gradients_with_checkpointing_equal_plain_gradients() {
    for model_name in MODELS {
        let reference = reference_json(model_name);
        let rows = reference_rows(&reference, "text");
        let (mut model, vars) = trainable_model(model_name, DType::F32);
        every_setting_equals_plain(&mut model, &vars, &rows, &format!("{model_name} full"));
    }
}
