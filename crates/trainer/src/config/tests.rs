//! Tests of the config as a whole, through [`TrainConfig::from_toml_str`], and the helpers the
//! per-file tests share.

use std::path::PathBuf;

use candle_core::DType;

use super::keys::SECTIONS;
use super::section::Kind;
use super::*;
use crate::data::Format;

pub(super) const MINIMAL: &str = "[model]\npath = \"models/m\"\n[data]\ntrain = \"d.jsonl\"\n";

pub(super) fn parse(text: &str, sets: &[&str]) -> Result<TrainConfig, ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    TrainConfig::from_toml_str(text, "configs/x.toml", &sets)
}

pub(super) fn err(text: &str, sets: &[&str]) -> String {
    match parse(text, sets) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

/// `MINIMAL` with `--set key=value`, expected to fail validation; returns the message.
pub(super) fn invalid(set: &str) -> String {
    let e = err(MINIMAL, &[set]);
    assert!(e.starts_with("configs/x.toml: --set `"), "{e}");
    e
}

pub(super) fn contains_all(haystack: &str, needles: &[&str]) {
    for n in needles {
        assert!(haystack.contains(n), "{haystack:?} lacks {n:?}");
    }
}

/// No line of `message` has two spaces in a row after its indentation.
pub(super) fn assert_single_spaced(message: &str) {
    for line in message.lines() {
        assert!(
            !line.trim_start().contains("  "),
            "a run of spaces in {line:?} of {message:?}"
        );
    }
}

#[test]
fn defaults() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!(c, TrainConfig::new("models/m", "d.jsonl"));
    assert_eq!(c.model.path, PathBuf::from("models/m"));
    assert_eq!(c.model.dtype, ModelDtype::Bf16);
    let l = &c.lora;
    assert_eq!(
        (l.rank, l.alpha, l.dropout, l.rslora),
        (16, 32.0, 0.05, false)
    );
    assert_eq!(l.targets(), LORA_TARGETS.to_vec());
    assert_eq!(l.init, None);
    assert_eq!(l.spec().scale(), 2.0);
    let d = &c.data;
    assert_eq!(d.train, PathBuf::from("d.jsonl"));
    assert_eq!(d.eval, None);
    assert_eq!(d.format, Format::Auto);
    assert_eq!(d.max_seq_len, 1024);
    assert!(d.add_eos && d.shuffle && !d.pack);
    let t = &c.train;
    assert_eq!(t.method, Method::Lora);
    assert_eq!((t.micro_batch_size, t.grad_accum), (1, 8));
    assert_eq!((t.max_steps, t.epochs), (0, 1));
    assert_eq!(t.optimizer, OptimizerKind::AdamW);
    assert_eq!(
        (t.lr, t.weight_decay, t.betas, t.eps),
        (2e-4, 0.0, (0.9, 0.999), 1e-8)
    );
    assert_eq!(t.schedule, Schedule::Cosine);
    assert_eq!((t.warmup_steps, t.max_grad_norm, t.seed), (0, 1.0, 42));
    assert_eq!(t.device, "auto");
    assert_eq!(t.output_dir, PathBuf::from("runs/example"));
    assert_eq!((t.log_every, t.eval_every, t.save_every), (1, 0, 0));
    assert!(
        t.tf32,
        "TF32 is on by default (it only acts on CUDA f32 matmuls)"
    );
    assert_eq!(LoraSection::default(), c.lora);
    assert_eq!(TrainSection::default(), c.train);
    assert_eq!(
        d.options(),
        DataOptions {
            format: Format::Auto,
            max_seq_len: 1024,
            add_eos: true,
            alpaca: crate::data::AlpacaPrompt::default(),
            max_prompt_len: 0,
            pair_rule: crate::data::PairRule::Dpo,
        }
    );
    assert_eq!(PreferenceSection::default(), c.preference);
    assert_eq!(DEFAULT_MAX_SEQ_LEN, 1024, "the default `[data]` documents");
}

#[test]
fn enums_parse() {
    let one = |set: &str| parse(MINIMAL, &[set]).unwrap();
    for (name, dtype, dt) in [
        ("f32", ModelDtype::F32, DType::F32),
        ("f16", ModelDtype::F16, DType::F16),
        ("bf16", ModelDtype::Bf16, DType::BF16),
    ] {
        let c = one(&format!("model.dtype={name}"));
        assert_eq!(c.model.dtype, dtype);
        assert_eq!(dtype.to_dtype(), dt);
        assert_eq!(dtype.name(), name);
    }
    for (name, f) in [
        ("auto", Format::Auto),
        ("text", Format::Text),
        ("prompt_completion", Format::PromptCompletion),
        ("messages", Format::Messages),
    ] {
        assert_eq!(one(&format!("data.format={name}")).data.format, f);
    }
    assert_eq!(one("train.method=full").train.method, Method::Full);
    assert_eq!(one("train.method=\"lora\"").train.method, Method::Lora);
    assert_eq!(
        one("train.optimizer=sgd").train.optimizer,
        OptimizerKind::Sgd
    );
    assert_eq!(
        one("train.optimizer=adamw").train.optimizer,
        OptimizerKind::AdamW
    );
    for (name, s) in [
        ("constant", Schedule::Constant),
        ("linear", Schedule::Linear),
        ("cosine", Schedule::Cosine),
    ] {
        assert_eq!(one(&format!("train.schedule={name}")).train.schedule, s);
    }
    let all = one("lora.targets=all-linear");
    assert_eq!(all.lora.targets, LoraTargets::AllLinear);
    assert_eq!(all.lora.targets(), LORA_TARGETS.to_vec());
    let text = format!("{MINIMAL}[lora]\ntargets = \"all-linear\"\n");
    assert_eq!(
        parse(&text, &[]).unwrap().lora.targets,
        LoraTargets::AllLinear
    );
}

/// Every `Choice` name in `SECTIONS` is accepted by serde, so the two lists agree.
#[test]
fn choice_names_deserialize() {
    for (section, keys) in SECTIONS {
        for key in keys {
            if let Kind::Choice(names) = key.kind {
                for name in names {
                    let set = format!("{section}.{}={name}", key.name);
                    parse(MINIMAL, &[&set]).unwrap_or_else(|e| panic!("{set}: {e}"));
                }
            }
        }
    }
}

#[test]
fn set_overrides() {
    let c = parse(
        MINIMAL,
        &[
            "train.lr=1e-3",
            "model.path=/x/y",
            "lora.targets=[\"q_proj\", \"v_proj\"]",
            "train.betas=[0.9,0.95]",
            "data.pack=true",
            "lora.rank=8",
            "lora.alpha=16",
            "train.device=cuda:1",
            "data.eval=data/eval.jsonl",
            "data.train=\"quoted.jsonl\"",
            "train.output_dir=2024",
            "train.seed = 7",
        ],
    )
    .unwrap();
    assert_eq!(c.train.lr, 1e-3);
    assert_eq!(c.model.path, PathBuf::from("/x/y"));
    assert_eq!(c.lora.targets(), vec!["q_proj", "v_proj"]);
    assert_eq!(c.train.betas, (0.9, 0.95));
    assert!(c.data.pack);
    assert_eq!((c.lora.rank, c.lora.alpha), (8, 16.0));
    assert_eq!(c.train.device, "cuda:1");
    assert_eq!(c.data.eval, Some(PathBuf::from("data/eval.jsonl")));
    assert_eq!(c.data.train, PathBuf::from("quoted.jsonl"));
    assert_eq!(c.train.output_dir, PathBuf::from("2024"));
    assert_eq!(c.train.seed, 7);
    // A later --set wins; --set fills a section and a required key the file lacks.
    let c = parse(
        "[model]\npath = \"m\"\n",
        &["train.lr=1", "train.lr=0.5", "data.train=t.jsonl"],
    )
    .unwrap();
    assert_eq!(c.train.lr, 0.5);
    assert_eq!(c.data.train, PathBuf::from("t.jsonl"));
}

#[test]
fn set_errors() {
    let e = err(MINIMAL, &["train.lr"]);
    contains_all(
        &e,
        &["configs/x.toml", "--set `train.lr`", "section.key=value"],
    );
    let e = err(MINIMAL, &["lr=1e-3"]);
    contains_all(&e, &["--set `lr=1e-3`", "needs its section", "`train.lr`"]);
    let e = err(MINIMAL, &["lora=8"]);
    contains_all(
        &e,
        &["`lora` is a section: write lora.KEY=value", "rank, alpha"],
    );
    let e = err(MINIMAL, &["train.learning_rate=1e-3"]);
    contains_all(
        &e,
        &[
            "--set `train.learning_rate=1e-3`",
            "unknown key `train.learning_rate`",
            "did you mean `train.lr`?",
        ],
    );
    let e = err(MINIMAL, &["optim.lr=1e-3"]);
    contains_all(
        &e,
        &[
            "--set `optim.lr=1e-3`",
            "unknown section `[optim]`",
            "`[train]`",
        ],
    );
    let e = err(MINIMAL, &["train.lr=fast"]);
    contains_all(
        &e,
        &[
            "--set `train.lr=fast`",
            "`train.lr` must be a number",
            "the string \"fast\"",
        ],
    );
}

#[test]
fn unknown_key_names_file_key_and_suggestion() {
    let text = format!("{MINIMAL}[train]\nlearning_rate = 1e-3\n");
    let e = err(&text, &[]);
    assert_eq!(
        e,
        "configs/x.toml: unknown key `train.learning_rate`; did you mean `train.lr`? valid keys \
         in [train]: method, micro_batch_size, grad_accum, max_steps, epochs, optimizer, lr, \
         weight_decay, betas, eps, schedule, warmup_steps, max_grad_norm, seed, device, \
         output_dir, log_every, log, eval_every, save_every, save_total_limit, \
         early_stopping_patience, early_stopping_threshold, keep_best, checkpointing, \
         checkpoint_every, offload_checkpoints, checkpoint_tile_tokens, shard_optimizer, dist_timeout_s, tf32, threads, push_to_hub, hub_private_repo"
    );
    // A typo, by edit distance.
    let e = err(&format!("{MINIMAL}[lora]\nrnak = 8\n"), &[]);
    contains_all(
        &e,
        &["unknown key `lora.rnak`", "did you mean `lora.rank`?"],
    );
    // HF Trainer's name for the hub repo id.
    let e = err(&format!("{MINIMAL}[train]\nhub_model_id = \"me/x\"\n"), &[]);
    contains_all(&e, &["did you mean `train.push_to_hub`?"]);
    // A key of another section.
    let e = err(&format!("{MINIMAL}[lora]\nlr = 1e-3\n"), &[]);
    contains_all(&e, &["unknown key `lora.lr`", "did you mean `train.lr`?"]);
    // Dashes for underscores.
    let e = err(
        "[model]\npath = \"m\"\n[data]\ntrain = \"t\"\nmax-seq-len = 8\n",
        &[],
    );
    contains_all(
        &e,
        &["did you mean `data.max_seq_len`?", "valid keys in [data]"],
    );
    // Nothing close: no suggestion, still the list.
    let e = err(&format!("{MINIMAL}[train]\nzzzzzzzz = 1\n"), &[]);
    assert!(!e.contains("did you mean"), "{e}");
    contains_all(
        &e,
        &[
            "unknown key `train.zzzzzzzz`",
            "valid keys in [train]: method",
        ],
    );
}

#[test]
fn unknown_section() {
    let e = err(&format!("{MINIMAL}[training]\nlr = 1e-3\n"), &[]);
    assert_eq!(
        e,
        "configs/x.toml: unknown section `[training]`; did you mean `[train]`? valid \
         sections: [model], [lora], [data], [train], [preference]"
    );
    let e = err(&format!("{MINIMAL}[mdoel]\n"), &[]);
    contains_all(&e, &["`[mdoel]`", "did you mean `[model]`?"]);
    let e = err(&format!("seed = 1\n{MINIMAL}"), &[]);
    contains_all(
        &e,
        &[
            "key `seed` is outside any section",
            "did you mean `train.seed`?",
        ],
    );
    let e = err("model = \"m\"\n", &[]);
    contains_all(&e, &["`model` must be a table", "[model]"]);
}

#[test]
fn wrong_type() {
    let e = err(&format!("{MINIMAL}[train]\nlr = \"fast\"\n"), &[]);
    assert_eq!(
        e,
        "configs/x.toml: `train.lr` must be a number, found the string \"fast\""
    );
    let e = err(&format!("{MINIMAL}[lora]\nrank = 16.0\n"), &[]);
    contains_all(
        &e,
        &["`lora.rank` must be a whole number >= 0", "the number 16.0"],
    );
    let e = err(&format!("{MINIMAL}[lora]\nrank = -1\n"), &[]);
    contains_all(&e, &["`lora.rank`", "the integer -1"]);
    let e = err(&format!("{MINIMAL}[train]\noptimizer = \"adam\"\n"), &[]);
    contains_all(
        &e,
        &[
            "`train.optimizer` must be one of \"adamw\", \"adamw8bit\", \"sgd\"",
            "found the string \"adam\"; did you mean `adamw`?",
        ],
    );
    let e = err(
        &format!("{MINIMAL}[train]\nbetas = [0.9, 0.95, 0.1]\n"),
        &[],
    );
    contains_all(&e, &["`train.betas` must be a list of two numbers"]);
    let e = err(&format!("{MINIMAL}[lora]\ntargets = \"q_proj\"\n"), &[]);
    contains_all(&e, &["`lora.targets` must be \"all-linear\" or a list"]);
    let e = err("[model]\npath = 3\n[data]\ntrain = \"t\"\n", &[]);
    contains_all(&e, &["`model.path` must be a string, found the integer 3"]);
    let e = err(
        "[model]\npath = \"m\"\n[data]\ntrain = \"t\"\npack = \"yes\"\n",
        &[],
    );
    contains_all(&e, &["`data.pack` must be true or false"]);
}

#[test]
fn missing_required_keys() {
    let e = err("[data]\ntrain = \"t\"\n", &[]);
    contains_all(&e, &["configs/x.toml: missing key `model.path`", "[model]"]);
    let e = err("[model]\npath = \"m\"\n", &[]);
    contains_all(&e, &["configs/x.toml: missing key `data.train`", "[data]"]);
    let e = err("[model]\npath = \"m\"\n[data\n", &[]);
    contains_all(&e, &["configs/x.toml: TOML parse error at line 3"]);
}

#[test]
fn spec_scale_and_targets() {
    let mut l = LoraSection {
        rank: 16,
        alpha: 32.0,
        ..LoraSection::default()
    };
    assert_eq!(l.spec().scale(), 2.0);
    l.rslora = true;
    assert_eq!(l.spec().scale(), 8.0);
    l.targets = LoraTargets::List(vec!["v_proj".into()]);
    assert_eq!(l.targets(), vec!["v_proj"]);
    l.dropout = 0.1;
    l.kind = tallow_model::AdapterKind::Dora;
    assert_eq!(
        l.spec(),
        tallow_model::LoraSpec {
            rank: 16,
            alpha: 32.0,
            dropout: 0.1,
            targets: vec!["v_proj".into()],
            rslora: true,
            kind: tallow_model::AdapterKind::Dora,
            target_parameters: vec![],
        }
    );
}

/// The messages of reading a config (unknown names, wrong types, missing keys, bad `--set`s),
/// rendered: none has a run of spaces inside a line. Validation's are checked in `validate.rs`.
#[test]
fn error_messages_have_no_runs_of_spaces() {
    let cases: [(String, &[&str]); 12] = [
        (format!("{MINIMAL}[train]\nlearning_rate = 1e-3\n"), &[]),
        (format!("{MINIMAL}[train]\nzzzzzzzz = 1\n"), &[]),
        (format!("{MINIMAL}[training]\nlr = 1e-3\n"), &[]),
        (format!("seed = 1\n{MINIMAL}"), &[]),
        ("model = \"m\"\n".into(), &[]),
        (format!("{MINIMAL}[train]\noptimizer = \"adam\"\n"), &[]),
        (format!("{MINIMAL}[lora]\ntargets = \"q_proj\"\n"), &[]),
        ("[data]\ntrain = \"t\"\n".into(), &[]),
        ("[model]\npath = \"m\"\n".into(), &[]),
        (MINIMAL.into(), &["train.lr"]),
        (MINIMAL.into(), &["lr=1e-3"]),
        (MINIMAL.into(), &["lora=8"]),
    ];
    for (text, sets) in cases {
        assert_single_spaced(&err(&text, sets));
    }
}

#[test]
fn to_toml_round_trip() {
    let default = TrainConfig::new("models/m", "d.jsonl");
    let c = parse(
        MINIMAL,
        &[
            "model.dtype=f16",
            "lora.targets=all-linear",
            "lora.rslora=true",
            "lora.init=adapters/a",
            "lora.dropout=0",
            "data.eval=e.jsonl",
            "data.format=messages",
            "train.method=full",
            "train.lr=3e-5",
            "train.eps=1e-10",
            "train.betas=[0.9,0.95]",
            "train.max_steps=100",
            "train.warmup_steps=7",
            "train.seed=9223372036854775807",
            "train.device=cuda:1",
        ],
    )
    .unwrap();
    // A whole hub dataset with its split / config keys and max_rows.
    let hub = parse(
        MINIMAL,
        &[
            "data.train=hf://datasets/o/n@v1",
            "data.eval=hf://datasets/o/n",
            "data.train_split=training",
            "data.eval_split=validation",
            "data.dataset_config=chat",
            "data.max_rows=100",
        ],
    )
    .unwrap();
    assert_eq!(
        (hub.data.train_split(), hub.data.eval_split()),
        ("training", "validation")
    );
    assert_eq!(hub.data.dataset_config.as_deref(), Some("chat"));
    assert_eq!(hub.data.max_rows, 100);
    let plain = parse(MINIMAL, &["data.train=hf://datasets/o/n"]).unwrap();
    assert_eq!(
        (plain.data.train_split(), plain.data.eval_split()),
        ("train", "test")
    );
    assert_eq!(
        (plain.data.dataset_config.clone(), plain.data.max_rows),
        (None, 0)
    );
    // dataset_config with only data.eval a whole dataset is fine.
    parse(
        MINIMAL,
        &["data.eval=hf://datasets/o/n", "data.dataset_config=chat"],
    )
    .unwrap();
    for config in [default, c, hub] {
        let text = config.to_toml_string();
        let back = TrainConfig::from_toml_str(&text, "resolved.toml", &[])
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back, config, "{text}");
        assert_eq!(back.to_toml_string(), text);
    }
}

#[test]
fn target_parameters_are_peft_names_without_dropout_or_dora() {
    let e = invalid("lora.target_parameters=[\"mlp.experts.gate_proj\"]");
    contains_all(
        &e,
        &[
            "`mlp.experts.gate_proj`",
            "mlp.experts.gate_up_proj and mlp.experts.down_proj",
        ],
    );
    let e = invalid("lora.target_parameters=[\"down_proj\", \"mlp.experts.down_proj\"]");
    assert!(e.contains("twice"), "{e}");
    // the default dropout (0.05) is refused by name, as PEFT refuses it
    let e = err(MINIMAL, &["lora.target_parameters=[\"gate_up_proj\"]"]);
    contains_all(&e, &["lora.dropout", "set lora.dropout = 0"]);
    let e = err(
        MINIMAL,
        &[
            "lora.target_parameters=[\"gate_up_proj\"]",
            "lora.dropout=0.0",
            "lora.kind=\"dora\"",
        ],
    );
    contains_all(&e, &["lora.kind", "plain LoRA only"]);
    let c = parse(
        MINIMAL,
        &[
            "lora.target_parameters=[\"experts.down_proj\"]",
            "lora.dropout=0.0",
        ],
    )
    .unwrap();
    assert_eq!(c.lora.spec().target_parameters, ["experts.down_proj"]);
    // PEFT's name for the key is pointed to ours
    let e = err(
        "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n[lora]\nlora_target_parameters = []\n",
        &[],
    );
    assert!(e.contains("lora.target_parameters"), "{e}");
}
