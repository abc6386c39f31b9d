//! Mixture-of-experts parity (issue 40): tiny random Qwen3-MoE (8 experts, top 3,
//! `norm_topk_prob`, a dense layer from `mlp_only_layers`), Qwen2-MoE (6 experts, top 2, a
//! shared expert with its sigmoid gate, q/k/v bias) and Mixtral (4 experts, top 2, sliding
//! window 8) against transformers 4.57 and 5.23, from `scripts/make_moe_fixtures.py`.
//! The 4.57 checkpoints store each expert's linears; the 5 ones the fused 3-D expert tensors
//! (`save_original_format=False`), so both weight layouts and both config layouts load.
//!
//! Tolerances (f32): logits 1e-4 absolute; a row's NLL 1e-4 relative; the aux loss 1e-5
//! absolute (it is about 2-3, and times the fixtures' coefficient 0.05 it moves the loss by
//! 0.1-0.16); gradients per tensor max |diff| <= 1e-4 max |reference|.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use tallow_model::{lm_head_nll, CausalLM, LoadOptions, Targets};
use tallow_tests::*;

const MOE_MODELS: [&str; 3] = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"];

fn rows(reference: &serde_json::Value) -> Vec<(Vec<u32>, Vec<bool>)> {
    rows_of(&reference["rows"])
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// The right-padded batch of every row, as the fixture script builds it, and its total loss:
/// CE (mean over the targets) + coef * aux (over the real tokens), the CE and the aux loss.
fn batch_loss(model: &CausalLM, rows: &[(Vec<u32>, Vec<bool>)], pad: u32) -> (Tensor, f64, f64) {
    let t = rows.iter().map(|(ids, _)| ids.len()).max().unwrap();
    let mut ids = Vec::new();
    let mut targets = Vec::new();
    let mut valid = Vec::new();
    for (i, tg) in rows {
        let n = i.len();
        ids.push(
            i.iter()
                .copied()
                .chain(std::iter::repeat_n(pad, t - n))
                .collect::<Vec<_>>(),
        );
        targets.push(
            tg.iter()
                .copied()
                .chain(std::iter::repeat_n(false, t - n))
                .collect::<Vec<_>>(),
        );
        valid.push((0..t).map(|k| k < n).collect::<Vec<_>>());
    }
    let flat: Vec<u32> = ids.concat();
    let input = Tensor::from_vec(flat, (rows.len(), t), &Device::Cpu).unwrap();
    let coef = model.config.moe.as_ref().unwrap().router_aux_loss_coef;
    let (h, aux) = model
        .forward_hidden_aux(&input, None, Some(&valid), coef)
        .unwrap();
    let tg = Targets::new(&ids, &targets, &Device::Cpu).unwrap();
    let nll = lm_head_nll(&h, model.lm_head_weight(), &tg, None).unwrap();
    let ce = (nll / tg.count as f64).unwrap();
    let aux = aux.expect("output_router_logits is set in the fixtures");
    let loss = (&ce + (&aux * coef).unwrap()).unwrap();
    let (ce_v, aux_v) = (scalar(&ce), scalar(&aux));
    (loss, ce_v, aux_v)
}

/// Logits, each row's NLL and aux loss, and the padded batch's CE, aux and total loss equal
/// transformers' in both layouts. The batch's aux term (0.1-0.16) is far above the loss
/// tolerance, so a model without it fails.
#[test]
fn moe_logits_and_losses_match_transformers_in_both_layouts() {
    for (layout, root) in layouts() {
        for name in MOE_MODELS {
            let reference = json_at(&root, &format!("moe-{name}.json"));
            let logits = candle_core::safetensors::load(
                fixtures().join(format!("reference/moe-{name}.safetensors")),
                &Device::Cpu,
            )
            .unwrap();
            let model = CausalLM::load(
                &root.join("models").join(name),
                &LoadOptions::frozen(DType::F32, &Device::Cpu),
            )
            .unwrap();
            let rs = rows(&reference);
            for (k, (ids, tg)) in rs.iter().enumerate() {
                let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let got = model.logits(&input).unwrap().squeeze(0).unwrap();
                let d = max_abs_diff(&got, &logits[&format!("row.{k}.logits")]);
                assert!(d < 1e-4, "{layout} {name} row {k}: logits differ by {d}");
                let (h, aux) = model.forward_hidden_aux(&input, None, None, 1.0).unwrap();
                let t = Targets::new(
                    std::slice::from_ref(ids),
                    std::slice::from_ref(tg),
                    &Device::Cpu,
                )
                .unwrap();
                let nll = scalar(&lm_head_nll(&h, model.lm_head_weight(), &t, None).unwrap());
                let r = &reference["rows"][k];
                let want = r["nll_sum"].as_f64().unwrap();
                assert_eq!(t.count as u64, r["n_targets"].as_u64().unwrap());
                assert!(
                    (nll - want).abs() <= 1e-4 * want.abs(),
                    "{layout} {name} row {k}: nll {nll} vs {want}"
                );
                let aux = scalar(&aux.unwrap());
                let want = r["aux"].as_f64().unwrap();
                assert!(
                    (aux - want).abs() < 1e-5,
                    "{layout} {name} row {k}: aux {aux} vs {want}"
                );
            }
            let b = &reference["batch"];
            let pad = b["pad"].as_u64().unwrap() as u32;
            let (loss, ce, aux) = batch_loss(&model, &rs, pad);
            for (what, got, key) in [
                ("ce", ce, "ce"),
                ("aux", aux, "aux"),
                ("loss", scalar(&loss), "loss"),
            ] {
                let want = b[key].as_f64().unwrap();
                assert!(
                    (got - want).abs() < 1e-5,
                    "{layout} {name} batch {what}: {got} vs {want}"
                );
            }
            let moved = b["loss"].as_f64().unwrap() - b["ce"].as_f64().unwrap();
            assert!(
                moved > 1e-2,
                "{name}: the aux term moves the loss by {moved}"
            );
        }
    }
}

/// Every parameter's gradient of the padded batch's total loss (CE + coef * aux) equals torch
/// autograd's, the routers' included (their gradient comes from the routing weights and the
/// aux loss), with the experts loaded from either layout; and the same with activation
/// checkpointing on every layer and on every 2nd, in tiles of 5 tokens, where a checkpointed
/// layer's recompute adds the aux loss's gradient itself (`RouterTape`).
#[test]
fn moe_gradients_match_torch_autograd_in_both_layouts() {
    for (layout, root) in layouts() {
        for name in MOE_MODELS {
            let reference = json_at(&fixtures(), &format!("moe-{name}.json"));
            let want = candle_core::safetensors::load(
                fixtures().join(format!("reference/moe-{name}.safetensors")),
                &Device::Cpu,
            )
            .unwrap();
            let opts = LoadOptions {
                train_base: true,
                ..LoadOptions::frozen(DType::F32, &Device::Cpu)
            };
            let mut model = CausalLM::load(&root.join("models").join(name), &opts).unwrap();
            let pad = reference["batch"]["pad"].as_u64().unwrap() as u32;
            for every in [None, Some(1), Some(2)] {
                if every.is_some() && layout != "transformers 4.57" {
                    continue; // the layouts load the same weights: one layout suffices
                }
                model.set_checkpointing(every);
                model.set_checkpoint_tile_rows(Some(5));
                let what = format!("{layout} {name} checkpointing {every:?}");
                let (loss, _, _) = batch_loss(&model, &rows(&reference), pad);
                let mut stores = vec![loss.backward().unwrap()];
                stores.extend(model.take_checkpoint_grads());
                let params = model.named_params();
                let expected: HashMap<&str, &Tensor> = want
                    .iter()
                    .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
                    .collect();
                assert_eq!(params.len(), expected.len(), "{what}: parameter count");
                for (n, p) in &params {
                    let w = expected
                        .get(n.as_str())
                        .unwrap_or_else(|| panic!("{name}: no reference gradient for {n}"));
                    let v = p.var().unwrap().as_tensor();
                    let mut g: Option<Tensor> = None;
                    for s in &stores {
                        if let Some(x) = s.get(v) {
                            g = Some(match g {
                                None => x.clone(),
                                Some(a) => (a + x).unwrap(),
                            });
                        }
                    }
                    let g = g.unwrap_or_else(|| panic!("{what}: no gradient for {n}"));
                    let d = max_abs_diff(&g, w);
                    let tol = 1e-4 * max_abs(w);
                    assert!(d <= tol, "{what} {n}: gradient differs by {d} (tol {tol})");
                }
            }
        }
    }
}

/// One plain-SGD step of `tallow train` from PEFT's adapter (LoRA r=4 on q/k/v/o and every
/// expert's linears; Qwen3-MoE's names also hit its dense layer) on the 4 text rows, one
/// right-padded micro-batch, equals PEFT's step on transformers 4.57: the step's CE and aux
/// loss within 1e-5, every adapter tensor's update within 1e-3 relative. The adapter loads
/// (PEFT's per-expert keys) and the trainer adds coef * aux to the loss.
#[test]
fn lora_step_on_attention_and_experts_matches_peft() {
    for name in MOE_MODELS {
        let init = fixtures().join(format!("adapters/{name}-peft"));
        let (dir, ce) = one_sgd_step(
            &format!("moe-sgd-{name}"),
            &model_dir(name),
            &init,
            0.0,
            None,
        );
        let reference = json_at(&fixtures(), &format!("peft-moe-{name}.json"));
        let sgd = &reference["sgd"];
        let want = sgd["ce"].as_f64().unwrap();
        assert!((ce - want).abs() < 1e-5, "{name}: step loss {ce} vs {want}");
        let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
        let step: serde_json::Value =
            serde_json::from_str(metrics.lines().find(|l| l.contains("\"loss\"")).unwrap())
                .unwrap();
        let aux = step["aux_loss"]
            .as_f64()
            .expect("aux_loss in the step's line");
        let want = sgd["aux"].as_f64().unwrap();
        assert!(
            (aux - want).abs() < 1e-5,
            "{name}: aux loss {aux} vs {want}"
        );
        assert_updates_match(
            name,
            &load_tensors(&init.join("adapter_model.safetensors")),
            &load_tensors(&dir.join("run/adapter/adapter_model.safetensors")),
            &load_tensors(&fixtures().join(format!("reference/peft-moe-{name}-sgd.safetensors"))),
            1e-3,
        );
    }
}

/// Greedy generation with the KV cache gives transformers' 8 tokens, in both layouts.
#[test]
fn greedy_generation_matches_transformers() {
    for (layout, root) in layouts() {
        for name in MOE_MODELS {
            let reference = json_at(&root, &format!("moe-{name}.json"));
            let g = &reference["generate"];
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            let model = CausalLM::load(
                &root.join("models").join(name),
                &LoadOptions::frozen(DType::F32, &Device::Cpu),
            )
            .unwrap();
            let opts = tallow_model::GenerateOptions {
                max_new_tokens: 8,
                stop_ids: vec![],
                sampling: Default::default(),
                use_cache: true,
            };
            let out =
                tallow_model::generate(&model, &ids(&g["prompt"]), &opts, |_| Ok(())).unwrap();
            assert_eq!(out.ids, ids(&g["ids"]), "{layout} {name}");
        }
    }
}

/// QLoRA on a mixture of experts end to end: `tallow train` with the experts and routers in
/// NF4, LoRA on the attention and every expert (the default targets), the load-balancing
/// loss on (Mixtral's run with activation checkpointing): the eval loss falls, every step
/// logs its aux loss, and the adapter holds each
/// expert's A and B under PEFT's per-expert keys. Then `tallow merge` writes a model that
/// loads and evaluates.
#[test]
fn qlora_on_experts_trains() {
    // Mixtral with activation checkpointing: its recompute adds the aux loss's gradient.
    for (name, expert, checkpointing) in [
        ("tiny-qwen3-moe", "gate_proj", false),
        ("tiny-mixtral", "w1", true),
    ] {
        let dir = scratch(&format!("moe-qlora-{name}"));
        let lines = train_on_text(
            name,
            &dir,
            "quantize = \"nf4\"\n",
            "rank = 8\nalpha = 16\n",
            &format!(
                "lr = 1e-2\nschedule = \"constant\"\nmax_steps = 8\nmicro_batch_size = 2\n\
                 grad_accum = 2\neval_every = 8\ncheckpointing = {checkpointing}\n"
            ),
        );
        let evals: Vec<f64> = lines
            .iter()
            .filter_map(|v| v["eval_loss"].as_f64())
            .collect();
        assert!(evals.len() >= 2, "{name}: eval losses {evals:?}");
        let (first, last) = (evals[0], evals[evals.len() - 1]);
        assert!(last < first - 0.1, "{name}: eval loss {first} -> {last}");
        let steps: Vec<&serde_json::Value> =
            lines.iter().filter(|v| v["loss"].is_number()).collect();
        assert!(!steps.is_empty());
        assert!(
            steps
                .iter()
                .all(|v| v["aux_loss"].as_f64().is_some_and(|a| a > 0.0)),
            "{name}: a step without aux_loss"
        );
        let adapter = load_tensors(&dir.join("run/adapter/adapter_model.safetensors"));
        let experts = adapter
            .keys()
            .filter(|k| k.contains(".experts.") && k.contains(&format!(".{expert}.lora_A")))
            .count();
        // two sparse layers each (tiny-qwen3-moe's layer 1 is dense), of 8 and 4 experts
        let want = if name == "tiny-qwen3-moe" {
            2 * 8
        } else {
            2 * 4
        };
        assert_eq!(experts, want, "{name}: adapted experts");

        let loss = eval_fixture(&merge_run(name, &dir), None, "text");
        assert!(
            loss < first - 0.1,
            "{name}: merged model's loss {loss} vs base {first}"
        );
    }
}

/// PEFT's LoRA on transformers 5's fused expert tensors (`target_parameters`, PEFT 0.21's
/// `ParamWrapper`: per expert one adapter on gate and up together, one on down, all experts
/// stacked in one A and one B). One plain-SGD step of `tallow train` from PEFT's adapter on the
/// text batch equals PEFT's step on transformers 5, in both weight layouts (the fused model PEFT
/// ran on, and the same weights per expert): the step's CE and aux loss within 1e-5, every
/// adapter tensor's update within 1e-3 relative (the tests' tolerance for one step of the
/// dense families; a gate/up pair trained with two As instead of the shared one moves the
/// stacked A by the other half's gradient, far past it). The adapter written back carries
/// PEFT's stacked keys (Qwen3-MoE: both tensors, PEFT's nested `experts.base_layer.` for
/// gate_up; Qwen2-MoE: gate_up alone, beside its shared expert's per-module adapters;
/// Mixtral: `down_proj` by PEFT's suffix match), and the run's trainable parameters, the
/// estimate's and the PEFT file's elements are one number.
#[test]
fn lora_step_on_fused_expert_tensors_matches_peft() {
    let v5 = fixtures().join("v5");
    for name in MOE_MODELS {
        let init = v5.join(format!("adapters/{name}-peft-params"));
        let before = load_tensors(&init.join("adapter_model.safetensors"));
        let reference = json_at(&v5, &format!("peft-moe-{name}.json"));
        let refs = load_tensors(&v5.join(format!("reference/peft-moe-{name}-sgd.safetensors")));
        let sgd = &reference["sgd"];
        for (layout, root) in layouts() {
            let what = format!("{name} ({layout} weights)");
            let (dir, ce) = one_sgd_step(
                &format!("moe-params-sgd-{name}-{}", layout.replace(' ', "-")),
                &root.join("models").join(name),
                &init,
                0.0,
                None,
            );
            let want = sgd["ce"].as_f64().unwrap();
            assert!((ce - want).abs() < 1e-5, "{what}: step loss {ce} vs {want}");
            let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
            let lines: Vec<serde_json::Value> = metrics
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            let step = lines.iter().find(|v| v["loss"].is_number()).unwrap();
            let (aux, want) = (
                step["aux_loss"].as_f64().unwrap(),
                sgd["aux"].as_f64().unwrap(),
            );
            assert!(
                (aux - want).abs() < 1e-5,
                "{what}: aux loss {aux} vs {want}"
            );
            let out = dir.join("run/adapter");
            assert_updates_match(
                &what,
                &before,
                &load_tensors(&out.join("adapter_model.safetensors")),
                &refs,
                1e-3,
            );
            let elems: usize = before.values().map(|t| t.elem_count()).sum();
            let logged = lines
                .iter()
                .find_map(|v| v["trainable_params"].as_u64())
                .unwrap();
            assert_eq!(logged as usize, elems, "{what}: trainable parameters");
            let cfg: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
            )
            .unwrap();
            let theirs: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(init.join("adapter_config.json")).unwrap(),
            )
            .unwrap();
            let canonical = |v: &serde_json::Value| -> Vec<String> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|p| {
                        let p = p.as_str().unwrap();
                        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                            .into_iter()
                            .find(|f| f.ends_with(p))
                            .unwrap()
                            .to_string()
                    })
                    .collect()
            };
            let mut want = canonical(&theirs["target_parameters"]);
            want.sort();
            let mut got = canonical(&cfg["target_parameters"]);
            got.sort();
            assert_eq!(got, want, "{what}: target_parameters");
        }

        // The estimate counts the same trainable parameters from the config alone.
        let theirs: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(init.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let list = |v: &serde_json::Value| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| format!("{s}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let dir = scratch(&format!("moe-params-estimate-{name}"));
        let toml = dir.join("c.toml");
        std::fs::write(
            &toml,
            format!(
                "[model]\npath = \"{}\"\n[lora]\nrank = 4\nalpha = 8\ndropout = 0.0\n\
                 targets = [{}]\ntarget_parameters = [{}]\n[data]\ntrain = \"x.jsonl\"\n",
                model_dir(name).display(),
                list(&theirs["target_modules"]),
                list(&theirs["target_parameters"]),
            ),
        )
        .unwrap();
        let cfg = tallow_trainer::TrainConfig::load(&toml, &[]).unwrap();
        let model = CausalLM::load(
            &model_dir(name),
            &LoadOptions::frozen(DType::F32, &Device::Cpu),
        )
        .unwrap();
        let elems: u64 = before.values().map(|t| t.elem_count() as u64).sum();
        assert_eq!(
            tallow_trainer::estimate::trainable_params(&model.config, &cfg),
            elems,
            "{name}: the estimate's trainable parameters"
        );
    }
}

/// A fresh LoRA on the fused expert tensors (`lora.target_parameters`) trains from a config:
/// the eval loss falls, the adapter is written in PEFT's stacked layout, and `tallow merge`
/// folds each expert's shared-A adapter into its gate and up: the merged model's eval loss
/// equals the base + adapter's within 1e-5 (a merge that leaves each expert's up projection
/// out moves it by 0.11).
#[test]
fn lora_on_fused_expert_tensors_trains_and_merges() {
    let name = "tiny-qwen3-moe";
    let dir = scratch("moe-params-train");
    let lines = train_on_text(
        name,
        &dir,
        "",
        "rank = 4\nalpha = 8\ndropout = 0.0\ntargets = [\"q_proj\", \"v_proj\"]\n\
         target_parameters = [\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n",
        "lr = 2e-2\nschedule = \"constant\"\nmax_steps = 6\nmicro_batch_size = 2\n\
         eval_every = 6\n",
    );
    let evals: Vec<f64> = lines
        .iter()
        .filter_map(|v| v["eval_loss"].as_f64())
        .collect();
    let (first, last) = (evals[0], evals[evals.len() - 1]);
    assert!(last < first - 0.05, "eval loss {first} -> {last}");
    let adapter = load_tensors(&dir.join("run/adapter/adapter_model.safetensors"));
    // two sparse layers, each: gate_up (nested) and down, A (4 x 8, in) and B (out, 4 x 8)
    for l in [0, 2] {
        let p = format!("base_model.model.model.layers.{l}.mlp.experts");
        assert_eq!(
            adapter[&format!("{p}.base_layer.lora_A.weight")].dims(),
            [32, 32]
        );
        assert_eq!(
            adapter[&format!("{p}.base_layer.lora_B.weight")].dims(),
            [48, 32]
        );
        assert_eq!(adapter[&format!("{p}.lora_A.weight")].dims(), [32, 24]);
        assert_eq!(adapter[&format!("{p}.lora_B.weight")].dims(), [32, 32]);
    }
    assert!(!adapter.keys().any(|k| k.contains(".experts.0.")));
    let with_adapter = eval_fixture(&model_dir(name), Some(&dir.join("run/adapter")), "text");
    assert!(
        (with_adapter - last).abs() < 1e-5,
        "{with_adapter} vs the run's {last}"
    );
    let loss = eval_fixture(&merge_run(name, &dir), None, "text");
    assert!(
        (loss - with_adapter).abs() < 1e-5,
        "merged {loss} vs base + adapter {with_adapter}"
    );
}

/// `tallow train` of a LoRA on the fixture model `name` (f32, the text fixture as training and
/// eval data, rows of 32 tokens, no shuffling) into `dir/run`, with these lines added to the
/// config's [model], [lora] and [train] sections: its metrics.jsonl's records.
fn train_on_text(
    name: &str,
    dir: &std::path::Path,
    model: &str,
    lora: &str,
    train: &str,
) -> Vec<serde_json::Value> {
    let cfg = dir.join("train.toml");
    let text = data_file("text");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\n{model}[lora]\n{lora}\
             [data]\ntrain = \"{}\"\neval = \"{}\"\nmax_seq_len = 32\nshuffle = false\n\
             [train]\n{train}output_dir = \"{}\"\n",
            model_dir(name).display(),
            text.display(),
            text.display(),
            dir.join("run").display()
        ),
    )
    .unwrap();
    let r = tallow(["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_eq!(r.code, 0, "{name}: {}", r.stderr);
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `tallow merge` of the fixture model `name` and `dir/run/adapter` into `dir/merged`, in f32.
fn merge_run(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let merged = dir.join("merged");
    let r = tallow([
        "merge",
        "--model",
        model_dir(name).to_str().unwrap(),
        "--adapter",
        dir.join("run/adapter").to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    assert_eq!(r.code, 0, "{name}: merge: {}", r.stderr);
    merged
}
