//! Preference tuning (issue 20): `train.method = "dpo" | "orpo"` end to end. One SGD step of
//! each objective equals TRL 0.23's own `DPOTrainer` / `ORPOTrainer` running that step, and
//! tallow's pairs are TRL's token ids (`scripts/make_preference_fixtures.py`,
//! `tests/fixtures/reference/preference.*`, issue 41); the precomputed reference equals the live
//! one; accumulation equals a big batch; resume is exact; bad rows get their own messages.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tallow_tests::*;
use tallow_text::TextTokenizer;
use tallow_trainer::{load_jsonl, DataOptions, Format, PairRule};

/// A DPO / ORPO config on `model` from its non-zero PEFT adapter: SGD, no clipping, constant
/// lr, unshuffled; `train` and `preference` lines appended to their sections.
fn config(dir: &Path, model: &str, data: &str, train: &str, preference: &str) -> PathBuf {
    let f = fixtures();
    let text = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\ninit = \"{}\"\ndropout = 0.0\n\
         [data]\ntrain = \"{}\"\nmax_seq_len = 64\nshuffle = false\n\
         [train]\noptimizer = \"sgd\"\nlr = 0.5\nschedule = \"constant\"\nmax_grad_norm = 0.0\n\
         output_dir = \"{}\"\n{train}\n[preference]\n{preference}\n",
        f.join("models").join(model).display(),
        f.join("adapters").join(format!("{model}-peft")).display(),
        f.join("data").join(data).display(),
        dir.join("run").display(),
    );
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn train_ok(config: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["train", "--config", config.to_str().unwrap(), "--quiet"];
    args.extend_from_slice(extra);
    let r = tallow(&args);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    r
}

fn adapter(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        dir.join("run/adapter/adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

/// The metrics lines of a run with a `loss` (its steps), in order.
fn steps(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .collect()
}

fn max_rel(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(k, t)| max_abs_diff(t, &b[k]) / max_abs(&b[k]).max(1e-12))
        .fold(0.0, f64::max)
}

/// The data file of a fixture case's data name.
fn data_file(data: &str) -> &'static str {
    match data {
        "string" => "preference.jsonl",
        "messages" => "preference_messages.jsonl",
        "rules" => "preference_rules.jsonl",
        other => panic!("unknown data {other}"),
    }
}

/// Every case of the reference, made by TRL 0.23's `DPOTrainer` / `ORPOTrainer` running one
/// step (3 models; DPO sigmoid with and without label smoothing, IPO, ORPO; string,
/// conversational and `rules` data): one SGD step (lr 0.5) on the 4 pairs in one micro-batch from
/// the model's non-zero PEFT adapter; and full-weight DPO (reference precomputed) and ORPO on
/// tiny-llama (`preference.full`), five weights of the saved model compared.
/// - the loss within 1e-5 relative, TRL's metrics (rewards, accuracies, margins, log-probs,
///   ORPO's NLL and odds) within 1e-4 absolute + 1e-5 relative;
/// - the update of every adapter tensor within 1e-3 relative (max |ours - ref| / max |ref|
///   over after - before), the issue's bar.
///
/// Measured: loss <= 1.0e-6 relative, metrics <= 7.6e-6 absolute, updates <= 8.8e-6 relative
/// (printed). The effects guarded, smallest over the cases (the loss, relative, measured with
/// the fixture script's re-implementation on TRL's ids): the last completion token (EOS)
/// dropped 2.9e-4 (ORPO, tiny-llama); beta 10% off 2.0e-3 (sigmoid), 0.16 (IPO); lambda 10%
/// off 1.1e-3; IPO's log-probs not divided by the completion length 0.46; ORPO without TRL's
/// BOS (tiny-llama) 1.4e-2.
/// Breaks seen: DPO's EOS never appended: `tiny-llama/dpo-ipo/string: loss 21.145 vs 21.669`;
/// IPO without its length normalization: `tiny-llama/dpo-ipo/string: loss 11.758 vs 21.669`;
/// ORPO runs tokenized by DPO's rule (the config's pair rule ignored, as before issue 41):
/// `tiny-llama/orpo-full/string: loss 6.1460 vs 6.1287`; the reference computed with the adapters
/// on (margin 0): the llama IPO loss 25
/// (= (1 / 2 beta)^2) vs 21.67; ORPO's NLL share halved: the llama messages loss 3.16 vs 6.25;
/// log sigmoid built from Candle's min and abs (slope 1 instead of 1/2 at margin 0, the first
/// step from a policy equal to its reference): the full-weight DPO update twice PyTorch's
/// (relative error 1.0). TRL's tokenization itself is [`pairs_are_trls_token_ids`]'s.
#[test]
fn one_sgd_step_matches_trl_losses_for_every_case() {
    check_trl_cases("preference", 26, "");
}

/// The mixtures of experts (tiny Qwen3-MoE and Mixtral with `output_router_logits`, router
/// coefficient 0.05, from their PEFT adapters on attention and experts; `preference-moe.*`):
/// TRL's `DPOTrainer` and `ORPOTrainer` add coef * the concatenated forward's load-balancing
/// loss (chosen and rejected rows, padding not counted) to the loss, and so does tallow, which
/// logs it apart (`aux_loss`; `loss` without it, as in the plain loop): `loss + coef *
/// aux_loss` equals TRL's loss within 1e-5 relative, DPO's `aux_loss` metric within 1e-4, every
/// update within 1e-3 relative, as above; again with activation checkpointing on every layer
/// (the recompute injects the aux gradient). The reference runs TRL without its default
/// gradient checkpointing, under which transformers 4.57 drops the aux loss's gradient
/// (`make_preference_fixtures.py`). The aux term is 0.10-0.16 of the loss; measured: updates
/// within 3.2e-5. Break seen: the aux term added without its gradient (what TRL's default
/// does): `tiny-mixtral/dpo-sigmoid/string ...experts.0.w2.lora_A.weight: update differs by
/// 0.0021`.
#[test]
fn preference_steps_on_a_mixture_of_experts_add_the_aux_loss_as_trl() {
    check_trl_cases("preference-moe", 4, "");
    check_trl_cases(
        "preference-moe",
        4,
        "checkpointing = true\ncheckpoint_every = 1",
    );
}

/// Each case of `reference/<file>.json` (see the two tests above), `count` of them, with
/// `train` lines added to each run's `[train]`.
fn check_trl_cases(file: &str, count: usize, train: &str) {
    let root = fixtures();
    let reference = json_at(&root, &format!("{file}.json"));
    let refs = candle_core::safetensors::load(
        root.join(format!("reference/{file}.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let cases = reference["cases"].as_object().unwrap();
    assert_eq!(cases.len(), count);
    let (mut worst_loss, mut worst_metric, mut worst_update) = (0f64, 0f64, 0f64);
    for (key, want) in cases {
        let parts: Vec<&str> = key.split('/').collect();
        let (model, data) = (parts[0], parts[2]);
        let case = &want["case"];
        let full = want["full"].as_bool().unwrap_or(false);
        let (method, mut pref) = match case["kind"].as_str().unwrap() {
            "dpo" => (
                "dpo",
                format!(
                    "beta = {}\nloss = \"{}\"\nlabel_smoothing = {}",
                    case["beta"],
                    case["loss"].as_str().unwrap(),
                    case["ls"]
                ),
            ),
            _ => ("orpo", format!("lambda = {}", case["lam"])),
        };
        if full {
            // Every weight; DPO's reference precomputed from the base before the step.
            pref += "\nfull = true";
            if method == "dpo" {
                pref += "\nprecompute_ref = true";
            }
        }
        let file = data_file(data);
        let dir = scratch(&format!("pref-{}", key.replace('/', "-")));
        let c = config(
            &dir,
            model,
            file,
            &format!(
                "method = \"{method}\"\nmax_steps = 1\nmicro_batch_size = 4\ngrad_accum = 1\n{train}"
            ),
            &pref,
        );
        train_ok(&c, &[]);
        let step = &steps(&dir)[0];
        // TRL's loss includes coef * aux; tallow logs the two apart
        let aux = match want["aux_coef"].as_f64() {
            Some(coef) => {
                let aux = step["aux_loss"]
                    .as_f64()
                    .expect("aux_loss in the step's line");
                assert!(aux > 0.0, "{key}: aux loss {aux}");
                coef * aux
            }
            None => 0.0,
        };
        let (ours, theirs) = (
            step["loss"].as_f64().unwrap() + aux,
            want["loss"].as_f64().unwrap(),
        );
        assert!(
            (ours - theirs).abs() <= 1e-5 * theirs.abs(),
            "{key}: loss {ours} vs {theirs}"
        );
        worst_loss = worst_loss.max((ours - theirs).abs() / theirs.abs());
        for (name, v) in want["metrics"].as_object().unwrap() {
            let (a, b) = (step[name].as_f64().unwrap_or(f64::NAN), v.as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-4 + 1e-5 * b.abs(),
                "{key}: {name} {a} vs {b}"
            );
            worst_metric = worst_metric.max((a - b).abs());
        }
        let (before, after) = if full {
            (
                model_weights(&root.join("models").join(model)),
                model_weights(&dir.join("run/model")),
            )
        } else {
            let init = root.join(format!("adapters/{model}-peft/adapter_model.safetensors"));
            (
                candle_core::safetensors::load(init, &Device::Cpu).unwrap(),
                adapter(&dir),
            )
        };
        let prefix = format!("{key}.after.");
        let names: Vec<&String> = if full {
            refs.keys()
                .filter_map(|k| k.strip_prefix(&prefix).and(Some(k)))
                .collect()
        } else {
            before.keys().collect()
        };
        for name in names {
            let name = name.strip_prefix(&prefix).unwrap_or(name);
            let b = &before[name];
            let du = (&after[name] - b).unwrap();
            let dr = (&refs[&format!("{key}.after.{name}")] - b).unwrap();
            let rel = max_abs_diff(&du, &dr) / max_abs(&dr).max(1e-12);
            assert!(
                rel < 1e-3,
                "{key} {name}: update differs by {rel} (relative)"
            );
            worst_update = worst_update.max(rel);
        }
    }
    eprintln!(
        "worst: loss {worst_loss:.1e} relative, metric {worst_metric:.1e} absolute, update \
         {worst_update:.1e} relative"
    );
}

/// tallow's pairs are the token ids TRL 0.23's trainers fed the model in every case of the
/// reference (`rows`: per pair, the chosen and rejected ids and their prompt length), exactly,
/// targets included. The `rules` data is where the two trainers differ: a completion that
/// already ends with the tokenizer's EOS (Qwen's `<|im_end|>`, Llama's `<|end_of_text|>`) gets
/// a second one from `DPOTrainer.tokenize_row` and none from ORPO's; ORPO prepends BOS when the
/// tokenizer has one (tiny-llama) and tokenizes prompt + completion together, so a prompt ending
/// with a space gives its last token to the completion (`"Cats like "` + `"fish"`).
///
/// Breaks seen: DPO's EOS never appended: `tiny-llama/dpo-ipo/string pair 0 chosen: ids differ`
/// (ours end `.., 88, 13`, TRL's `.., 88, 13, 321`); ORPO appending EOS after an EOS (DPO's
/// rule): `tiny-llama/orpo/rules pair 1 chosen` (ours end `13, 321, 321`, TRL's `13, 321`).
#[test]
fn pairs_are_trls_token_ids() {
    let root = fixtures();
    let reference = json_at(&root, "preference.json");
    let mut doubled_eos = 0;
    for (key, want) in reference["cases"].as_object().unwrap() {
        let parts: Vec<&str> = key.split('/').collect();
        let (model, data) = (parts[0], parts[2]);
        let orpo = want["case"]["kind"] == "orpo";
        let tok = TextTokenizer::from_model_dir(&root.join("models").join(model)).unwrap();
        let opts = DataOptions {
            format: Format::Preference,
            max_seq_len: 64,
            add_eos: true,
            pair_rule: if orpo { PairRule::Orpo } else { PairRule::Dpo },
            ..Default::default()
        };
        let set = load_jsonl(&root.join("data").join(data_file(data)), &tok, &opts).unwrap();
        let rows = want["rows"].as_array().unwrap();
        assert_eq!(set.examples.len(), 2 * rows.len(), "{key}");
        for (i, pair) in rows.iter().enumerate() {
            for (j, side) in ["chosen", "rejected"].into_iter().enumerate() {
                let ids: Vec<u32> = pair[side]["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect();
                let n = pair[side]["prompt_len"].as_u64().unwrap() as usize;
                let targets: Vec<bool> = (0..ids.len()).map(|k| k >= n && k >= 1).collect();
                let ex = &set.examples[2 * i + j];
                assert_eq!(ex.ids, ids, "{key} pair {i} {side}: ids differ (left ours)");
                assert_eq!(ex.targets, targets, "{key} pair {i} {side}: targets differ");
                let eos = tok.eos_id().unwrap();
                doubled_eos += usize::from(ids.ends_with(&[eos, eos]));
            }
        }
    }
    // DPO's second EOS: the rules data's completions that end with EOS, on the model that reads
    // it as EOS (two each on the Qwens, one on tiny-llama; DPO cases only).
    assert_eq!(
        doubled_eos, 5,
        "the rules data no longer exercises DPO's EOS rule"
    );
}

/// DPO with `preference.precompute_ref = true` (the reference log-probs computed once before
/// training and cached) gives the adapter of the live reference (computed in each step with the
/// adapters off) after 4 steps with LoRA dropout on and shuffled pairs: within 1e-6 relative
/// (the cache is computed in data order, the steps batch shuffled pairs: the same f32 values up
/// to the batch composition; measured 0). A run killed after step 2 and resumed reads the cache
/// back (its note says so) and ends bit for bit on the uninterrupted adapter. One micro-batch of
/// 4 pairs equals 4 accumulated micro-batches of 1 (1e-5 relative: each micro-batch's share is
/// normalized by the step's pairs).
///
/// Break seen: the cached values handed out by position in the step instead of by pair id: the
/// adapters differ by 2.17 (relative). (A cache ignored on resume would still give the same
/// bits, being a cache, so the test checks the resumed run's note that it was read back.)
#[test]
fn precomputed_reference_accumulation_and_resume_are_exact() {
    let model = "tiny-qwen2";
    let train_lines = |extra: &str| {
        format!("method = \"dpo\"\nmax_steps = 4\nmicro_batch_size = 2\ngrad_accum = 1\n{extra}")
    };
    let run = |name: &str, train: &str, pref: &str, sets: &[&str]| -> (PathBuf, Run) {
        let dir = scratch(name);
        let c = config(&dir, model, "preference.jsonl", train, pref);
        let mut extra = vec!["--set", "lora.dropout=0.1", "--set", "data.shuffle=true"];
        extra.extend_from_slice(sets);
        let r = train_ok(&c, &extra);
        (dir, r)
    };
    let (live, _) = run("pref-live", &train_lines(""), "beta = 0.1", &[]);
    let (pre, r) = run("pref-pre", &train_lines(""), "precompute_ref = true", &[]);
    assert!(
        r.stderr.contains("reference log-probs of 4 pairs computed"),
        "{}",
        r.stderr
    );
    assert!(pre.join("run/reference-logps.safetensors").exists());
    let d = max_rel(&adapter(&pre), &adapter(&live));
    assert!(d <= 1e-6, "precomputed vs live reference: {d}");

    // Killed after step 2, resumed: the cache is read back, the result is the same bits.
    let dir = scratch("pref-resumed");
    let c = config(
        &dir,
        model,
        "preference.jsonl",
        &train_lines(""),
        "precompute_ref = true",
    );
    let sets = ["--set", "lora.dropout=0.1", "--set", "data.shuffle=true"];
    let mut first = sets.to_vec();
    first.extend_from_slice(&["--set", "train.save_every=2", "--set", "train.max_steps=2"]);
    train_ok(&c, &first);
    let mut again = sets.to_vec();
    again.push("--resume");
    let r = train_ok(&c, &again);
    assert!(
        r.stderr
            .contains("reference log-probs of 4 pairs read from"),
        "{}",
        r.stderr
    );
    let (a, b) = (adapter(&dir), adapter(&pre));
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{k} differs after resume");
    }

    // Accumulation: 1 x 4 pairs = 4 x 1 pair (dropout off: masks are per micro-batch).
    let big = run(
        "pref-big",
        "method = \"dpo\"\nmax_steps = 1\nmicro_batch_size = 4\ngrad_accum = 1",
        "beta = 0.1",
        &["--set", "lora.dropout=0.0"],
    )
    .0;
    let small = run(
        "pref-small",
        "method = \"dpo\"\nmax_steps = 1\nmicro_batch_size = 1\ngrad_accum = 4",
        "beta = 0.1",
        &["--set", "lora.dropout=0.0"],
    )
    .0;
    let d = max_rel(&adapter(&small), &adapter(&big));
    assert!(d <= 1e-5, "4 x 1 vs 1 x 4 pairs: {d}");
    let (ls, lb) = (
        steps(&small)[0]["loss"].as_f64().unwrap(),
        steps(&big)[0]["loss"].as_f64().unwrap(),
    );
    assert!((ls - lb).abs() < 1e-6, "loss {ls} vs {lb}");
}

/// Bad preference input, each with its own message and a non-zero exit, naming the file and
/// line: a row without `rejected`, identical chosen and rejected, a conversational prompt
/// ending with an assistant turn; DPO on supervised rows and preference rows under
/// `method = "lora"` are refused naming the method; a prompt longer than `max_seq_len` is
/// skipped and counted.
#[test]
fn bad_preference_input_gets_its_own_message() {
    let dir = scratch("pref-bad");
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let ok = r#"{"prompt": "Hi", "chosen": " yes.", "rejected": " no."}"#;
    let cases = [
        (
            format!("{ok}\n{{\"prompt\": \"Hi\", \"chosen\": \" a\"}}\n"),
            "method = \"dpo\"",
            ":2: missing key `rejected` required by format preference",
        ),
        (
            format!("{ok}\n{{\"prompt\": \"Hi\", \"chosen\": \" a\", \"rejected\": \" a\"}}\n"),
            "method = \"dpo\"",
            ":2: `chosen` and `rejected` are identical",
        ),
        (
            r#"{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], "chosen": [{"role": "assistant", "content": "A"}], "rejected": [{"role": "assistant", "content": "B"}]}"#.to_string() + "\n",
            "method = \"orpo\"",
            ":1: the `prompt` messages end with a `assistant` turn",
        ),
        (
            "{\"text\": \"plain text\"}\n".to_string(),
            "method = \"dpo\"",
            "train.method = \"dpo\" trains on preference pairs, but data.train has text rows",
        ),
        (
            format!("{ok}\n"),
            "method = \"lora\"",
            "data.train holds preference pairs (prompt / chosen / rejected): set train.method",
        ),
    ];
    for (i, (data, method, want)) in cases.iter().enumerate() {
        let file = write(&format!("bad{i}.jsonl"), data);
        let c = config(
            &dir,
            "tiny-qwen2",
            "x",
            &format!("{method}\nmax_steps = 1"),
            "",
        );
        let r = tallow([
            "train",
            "--config",
            c.to_str().unwrap(),
            "--set",
            &format!("data.train={}", file.display()),
        ]);
        assert_ne!(r.code, 0, "case {i} should fail");
        assert!(
            r.stderr.contains(want),
            "case {i}: want `{want}` in:\n{}",
            r.stderr
        );
    }
    // A prompt that fills max_seq_len: skipped and counted, the other pair trains.
    let long = format!(
        "{{\"prompt\": \"{}\", \"chosen\": \" a\", \"rejected\": \" b\"}}",
        "word ".repeat(80)
    );
    let file = write("long.jsonl", &format!("{ok}\n{long}\n"));
    let c = config(
        &dir,
        "tiny-qwen2",
        "x",
        "method = \"dpo\"\nmax_steps = 1",
        "",
    );
    let r = train_ok(&c, &["--set", &format!("data.train={}", file.display())]);
    assert!(
        r.stderr.contains("data.train: 1 pairs skipped"),
        "{}",
        r.stderr
    );
}

/// The preference quickstart (`configs/quickstart-dpo.toml`, the README's): DPO from a fresh
/// adapter on the embedded tiny model moves the reward accuracy on the 50 held-out pairs from
/// 0 (policy = reference, every reward 0) to above 0.9 (1.0 measured, after 50 steps in ~10 s),
/// and the eval loss from ln 2 down (0.127 measured). `tallow eval --format preference` on the
/// trained adapter (the base as reference) reports the run's last evaluation (1e-6).
#[test]
fn preference_quickstart_learns_to_prefer() {
    let root = fixtures().parent().unwrap().parent().unwrap().to_path_buf();
    let out = scratch("quickstart-dpo");
    let r = std::process::Command::new(tallow_bin())
        .current_dir(&root)
        .args([
            "train",
            "--config",
            "configs/quickstart-dpo.toml",
            "--quiet",
            "--set",
        ])
        .arg(format!("train.output_dir={}", out.join("run").display()))
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let evals: Vec<(u64, f64, f64)> = std::fs::read_to_string(out.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((
                v["step"].as_u64()?,
                v["eval_loss"].as_f64()?,
                v["eval_rewards/accuracies"].as_f64()?,
            ))
        })
        .collect();
    let (first, last) = (evals.first().unwrap(), evals.last().unwrap());
    assert_eq!(first.0, 0);
    assert!((first.1 - std::f64::consts::LN_2).abs() < 1e-6, "{first:?}");
    assert!(first.2 < 0.5, "{first:?}");
    assert!(
        last.2 > 0.9,
        "reward accuracy only {} at the end: {evals:?}",
        last.2
    );
    assert!(last.1 < 0.5 * first.1, "{evals:?}");

    // `tallow eval --format preference` on the adapter reports the run's last evaluation.
    let adapter = out.join("run/adapter");
    let r = std::process::Command::new(tallow_bin())
        .current_dir(&root)
        .args(["eval", "--model", "examples/quickstart/model", "--data"])
        .args([
            "examples/quickstart/eval_pairs.jsonl",
            "--max-seq-len",
            "64",
            "--json",
        ])
        .arg("--adapter")
        .arg(&adapter)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(v["format"], "preference");
    assert!(
        (v["dpo_loss"].as_f64().unwrap() - last.1).abs() < 1e-6,
        "{v}"
    );
    assert_eq!(v["rewards/accuracies"].as_f64().unwrap(), last.2, "{v}");
}

/// Every tensor of the safetensors files in a model dir, by name.
fn model_weights(dir: &Path) -> HashMap<String, Tensor> {
    let mut all = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            all.extend(candle_core::safetensors::load(&p, &Device::Cpu).unwrap());
        }
    }
    all
}

/// DPO and ORPO on an NF4 base with DoRA adapters (QDoRA), fresh adapters, AdamW: each runs,
/// writes a PEFT DoRA adapter, and its loss on the 4 training pairs falls over 8 steps
/// (DPO from ln 2), with the reward accuracy ending at 1 (measured: DPO eval loss 0.693 ->
/// 0.006, ORPO 6.25 -> 2.63, accuracy 0 -> 1 for both; the 4 pairs are easily separated, so
/// this shows the combination trains, not how well).
#[test]
fn dpo_and_orpo_train_qdora_adapters() {
    for method in ["dpo", "orpo"] {
        let dir = scratch(&format!("pref-qdora-{method}"));
        let c = config(
            &dir,
            "tiny-qwen2",
            "preference.jsonl",
            &format!(
                "method = \"{method}\"\nmax_steps = 8\nmicro_batch_size = 4\ngrad_accum = 1\n\
                 eval_every = 8"
            ),
            "",
        );
        let f = fixtures();
        let data = f.join("data/preference.jsonl");
        train_ok(
            &c,
            &[
                "--set",
                "train.optimizer=\"adamw\"",
                "--set",
                "train.lr=0.02",
                "--set",
                "lora.init=",
                "--set",
                "lora.kind=dora",
                "--set",
                "lora.rank=4",
                "--set",
                "model.quantize=\"nf4\"",
                "--set",
                &format!("data.eval={}", data.display()),
            ],
        );
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("run/adapter/adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["use_dora"], true, "{method}");
        let evals: Vec<(f64, f64)> = std::fs::read_to_string(dir.join("run/metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                Some((
                    v["eval_loss"].as_f64()?,
                    v["eval_rewards/accuracies"].as_f64()?,
                ))
            })
            .collect();
        let (first, last) = (evals[0], *evals.last().unwrap());
        assert!(
            last.0 < first.0,
            "{method}: eval loss {first:?} -> {last:?}"
        );
        assert_eq!(last.1, 1.0, "{method}: {evals:?}");
        eprintln!("{method}: {first:?} -> {last:?}");
    }
}
