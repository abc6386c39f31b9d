//! [`TrainConfig::validate`]: each key's own check (declared with the key in `sections.rs`,
//! from the helpers here), then the checks that read several keys. Each failure names the key,
//! the value found and what it must be.

use std::ops::Range;
use std::path::Path;

use super::section::Section;
use super::suggest::closest;
use super::{
    AdapterKind, DataSection, InvalidValue, LoraSection, Method, ModelSection, OptimizerKind,
    PreferenceLoss, Quantize, TrainConfig, TrainSection, ALL_LINEAR,
};
use tallow_model::peft::KNOWN_MODULES;

type Checked = Result<(), InvalidValue>;

/// The failure of `key`, with `message` after it.
fn bad(key: &'static str, message: impl Into<String>) -> Checked {
    Err(InvalidValue {
        key,
        message: message.into(),
    })
}

impl TrainConfig {
    /// Checks every value; the error names the key, the value found and what it must be.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        self.model.check()?;
        self.lora.check()?;
        self.data.check()?;
        self.train.check()?;
        self.preference.check()?;
        validate_hub_dataset_keys(&self.data)?;
        validate_train_length(&self.train)?;
        validate_quantize_with_method(&self.model, &self.train)?;
        validate_best_with_eval(&self.data, &self.train)?;
        validate_target_parameters(&self.lora)?;
        validate_preference(self)
    }
}

// The helpers of the keys' own checks: each gives the message after the key, or `Ok`.

/// `Err(message)` unless `ok`.
pub(super) fn ensure(ok: bool, message: impl Into<String>) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(message.into())
    }
}

/// A finite number > 0; `usual` says what is usual.
pub(super) fn positive(x: f64, usual: &str) -> Result<(), String> {
    ensure(
        x > 0.0 && x.is_finite(),
        format!("must be > 0, found {x} ({usual})"),
    )
}

/// A finite number >= 0; `note` (with its leading space) follows "must be >= 0".
pub(super) fn non_negative(x: f64, note: &str) -> Result<(), String> {
    ensure(
        x >= 0.0 && x.is_finite(),
        format!("must be >= 0{note}, found {x}"),
    )
}

/// A number in `range`, written `[start, end)`; `note` says what it means.
pub(super) fn in_range(x: f64, range: Range<f64>, note: &str) -> Result<(), String> {
    ensure(
        range.contains(&x),
        format!(
            "must be in [{}, {}), found {x} ({note})",
            range.start, range.end
        ),
    )
}

/// A path that is not `""`.
pub(super) fn not_empty(path: &Path, message: &str) -> Result<(), String> {
    ensure(!path.as_os_str().is_empty(), message)
}

/// A template that contains each of `needed`.
pub(super) fn placeholders(template: &str, needed: &[&str]) -> Result<(), String> {
    match needed.iter().find(|p| !template.contains(*p)) {
        None => Ok(()),
        Some(missing) => Err(format!(
            "has no {missing}: the template must contain {} (where the row's value goes)",
            needed.join(" and ")
        )),
    }
}

/// `lora.targets`: not empty, each a linear layer of some family ([`KNOWN_MODULES`]: the
/// Llama layout's seven, Phi-3's fused `qkv_proj` and `gate_up_proj`), none twice. Whether the
/// model has them is checked when it is read (`DecoderConfig::resolve_lora_targets`).
pub(super) fn validate_targets(names: &[&str]) -> Result<(), String> {
    let valid = KNOWN_MODULES.join(", ");
    if names.is_empty() {
        return Err(format!(
            "is empty; list some of {valid} or write \"{ALL_LINEAR}\""
        ));
    }
    for (i, name) in names.iter().enumerate() {
        if !KNOWN_MODULES.contains(name) {
            let hint = closest(name, KNOWN_MODULES.iter().copied())
                .map(|c| format!("did you mean `{c}`? "))
                .unwrap_or_default();
            return Err(format!(
                "has `{name}`, which is not a linear layer of a decoder layer; {hint}valid: \
                 {valid}, or the string \"{ALL_LINEAR}\""
            ));
        }
        if names[..i].contains(name) {
            return Err(format!("lists `{name}` twice"));
        }
    }
    Ok(())
}

/// `train.device`: `auto`, `cpu`, `cuda` or `cuda:N`.
pub(super) fn valid_device(spec: &str) -> bool {
    match spec {
        "auto" | "cpu" | "cuda" => true,
        s => s
            .strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())),
    }
}

// The checks that read several keys.

/// `[preference]` and what a preference method needs of the other sections.
fn validate_preference(c: &TrainConfig) -> Checked {
    let p = &c.preference;
    let method = c.train.method;
    if p.label_smoothing > 0.0 && p.loss != PreferenceLoss::Sigmoid {
        return bad(
            "preference.label_smoothing",
            "applies to the sigmoid loss only: set preference.loss = \"sigmoid\" or drop it",
        );
    }
    if p.precompute_ref && method != Method::Dpo {
        return bad(
            "preference.precompute_ref",
            "caches DPO's reference log-probs: it needs train.method = \"dpo\" (ORPO has no \
             reference)",
        );
    }
    if p.full && !method.preference() {
        return bad(
            "preference.full",
            "applies to train.method = \"dpo\" or \"orpo\" (for supervised full fine-tuning \
             set train.method = \"full\")",
        );
    }
    if p.full && method == Method::Dpo && !p.precompute_ref {
        return bad(
            "preference.full",
            "full-weight DPO takes its reference log-probs from the base before training: set \
             preference.precompute_ref = true too (no second copy of the model is kept)",
        );
    }
    if p.full && c.model.quantize.freezes_base() {
        return bad(
            "preference.full",
            format!(
                "trains every weight, but model.quantize = \"{}\" freezes the base: drop one",
                c.model.quantize
            ),
        );
    }
    if method.preference() && c.data.pack {
        return bad(
            "data.pack",
            "cannot pack preference pairs: each chosen and rejected sequence is scored on its \
             own; drop data.pack",
        );
    }
    if p.max_prompt_len > 0 && p.max_prompt_len >= c.data.max_seq_len {
        return bad(
            "preference.max_prompt_len",
            format!(
                "is {} but data.max_seq_len is {}: leave room for the completion",
                p.max_prompt_len, c.data.max_seq_len
            ),
        );
    }
    Ok(())
}

/// The split and config keys only mean something for a whole hub dataset.
fn validate_hub_dataset_keys(d: &DataSection) -> Checked {
    let whole = |p: Option<&Path>| p.and_then(tallow_hub::whole_dataset).is_some();
    let (train_whole, eval_whole) = (whole(Some(&d.train)), whole(d.eval.as_deref()));
    let not_whole = |key: &'static str, source: &str| {
        bad(
            key,
            format!(
                "is set but {source} is not a whole hub dataset (hf://datasets/OWNER/NAME, \
                 optionally @REVISION, with no file path); remove {key}, or point {source} at \
                 a whole dataset"
            ),
        )
    };
    if d.train_split.is_some() && !train_whole {
        return not_whole("data.train_split", "data.train");
    }
    if d.eval_split.is_some() && !eval_whole {
        return not_whole("data.eval_split", "data.eval");
    }
    if d.dataset_config.is_some() && !train_whole && !eval_whole {
        return bad(
            "data.dataset_config",
            "is set but neither data.train nor data.eval is a whole hub dataset \
             (hf://datasets/OWNER/NAME, optionally @REVISION, with no file path); remove \
             data.dataset_config, or point data.train at a whole dataset",
        );
    }
    Ok(())
}

/// `train.early_stopping_patience` and `train.keep_best` compare evaluations made during the
/// run: they need an eval set and `train.eval_every`.
fn validate_best_with_eval(d: &DataSection, t: &TrainSection) -> Checked {
    if t.early_stopping_threshold > 0.0 && t.early_stopping_patience == 0 {
        return bad(
            "train.early_stopping_threshold",
            "has no effect without train.early_stopping_patience: set the patience (e.g. 3 \
             evaluations) or drop the threshold",
        );
    }
    let users = [
        (
            "train.early_stopping_patience",
            t.early_stopping_patience > 0,
        ),
        ("train.keep_best", t.keep_best),
    ];
    for (key, on) in users {
        if !on {
            continue;
        }
        if d.eval.is_none() {
            return bad(
                key,
                "compares eval losses, but there is no eval data: set data.eval to a held-out \
                 JSONL file, or drop the key",
            );
        }
        if t.eval_every == 0 {
            return bad(
                key,
                "compares the evaluations made during the run, but train.eval_every is 0 (one \
                 evaluation, at the end): set train.eval_every, e.g. 50",
            );
        }
    }
    Ok(())
}

/// Checkpointing and the length of the run.
fn validate_train_length(t: &TrainSection) -> Checked {
    if t.offload_checkpoints && !t.checkpointing {
        return bad(
            "train.offload_checkpoints",
            "offloads the inputs activation checkpointing keeps: set train.checkpointing = true \
             too, or drop it",
        );
    }
    if t.checkpoint_tile_tokens > 0 && !t.checkpointing {
        return bad(
            "train.checkpoint_tile_tokens",
            "sizes the token tiles of the layers activation checkpointing recomputes: set \
             train.checkpointing = true too, or drop it",
        );
    }
    if t.max_steps == 0 && t.epochs < 1 {
        return bad(
            "train.epochs",
            "is 0 and `train.max_steps` is 0, so nothing would run; set epochs >= 1, or \
             max_steps > 0 to count optimizer steps instead",
        );
    }
    if t.max_steps > 0 && t.warmup_steps > t.max_steps {
        return bad(
            "train.warmup_steps",
            format!(
                "is {} but `train.max_steps` is {}; warmup must fit in the run",
                t.warmup_steps, t.max_steps
            ),
        );
    }
    Ok(())
}

/// `model.quantize = "nf4"` (or `"keep"`) freezes the base, so it needs `train.method = "lora"`.
/// `lora.target_parameters` takes plain LoRA without dropout, as PEFT's fused-expert
/// adapter (`ParamWrapper`) does.
fn validate_target_parameters(l: &LoraSection) -> Checked {
    if l.target_parameters.is_empty() {
        return Ok(());
    }
    if l.dropout > 0.0 {
        return bad(
            "lora.dropout",
            format!(
                "is {}, but lora.target_parameters (the fused expert tensors) takes no dropout, \
                 as PEFT's fused-expert LoRA refuses lora_dropout != 0: set lora.dropout = 0",
                l.dropout
            ),
        );
    }
    if l.kind != AdapterKind::Lora {
        return bad(
            "lora.kind",
            format!(
                "is \"{}\", but lora.target_parameters (the fused expert tensors) takes plain \
                 LoRA only, as PEFT: set lora.kind = \"{}\", or adapt the experts per module \
                 (lora.targets) without target_parameters",
                l.kind.name(),
                AdapterKind::Lora.name()
            ),
        );
    }
    Ok(())
}

fn validate_quantize_with_method(m: &ModelSection, t: &TrainSection) -> Checked {
    if m.quantize == Quantize::Nf4 && t.method == Method::Full {
        return bad(
            "model.quantize",
            format!(
                "is \"{nf4}\", which needs train.method = \"{lora}\" (QLoRA: NF4 base weights are \
                 frozen); set model.quantize = \"{none}\" for a full fine-tune (add \
                 train.optimizer = \"{adamw8bit}\" to save optimizer memory)",
                nf4 = Quantize::Nf4,
                lora = Method::Lora,
                none = Quantize::None,
                adamw8bit = OptimizerKind::AdamW8bit,
            ),
        );
    }
    if m.quantize == Quantize::Keep && t.method == Method::Full {
        return bad(
            "model.quantize",
            format!(
                "is \"{keep}\", which needs train.method = \"{lora}\" (weights kept in their \
                 GGUF block format are frozen); set model.quantize = \"{none}\" for a full \
                 fine-tune of the GGUF dequantized",
                keep = Quantize::Keep,
                lora = Method::Lora,
                none = Quantize::None,
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{assert_single_spaced, contains_all, err, invalid, parse, MINIMAL};
    use super::*;

    #[test]
    fn nf4_with_full_fine_tuning_is_invalid() {
        let e = err(MINIMAL, &["model.quantize=nf4", "train.method=full"]);
        assert_eq!(
            e,
            "configs/x.toml: --set `model.quantize=nf4`: `model.quantize` is \"nf4\", which needs \
             train.method = \"lora\" (QLoRA: NF4 base weights are frozen); set model.quantize = \
             \"none\" for a full fine-tune (add train.optimizer = \"adamw8bit\" to save optimizer \
             memory)"
        );
        assert!(parse(MINIMAL, &["model.quantize=nf4", "train.method=lora"]).is_ok());
        let e = err(MINIMAL, &["model.quantize=keep", "train.method=full"]);
        assert!(
            e.contains("is \"keep\", which needs train.method = \"lora\""),
            "{e}"
        );
        assert!(parse(MINIMAL, &["model.quantize=keep", "train.method=lora"]).is_ok());
    }

    /// Every message `validate` can give, rendered: none has a run of spaces inside a line (a
    /// multi-line literal without its `\` once leaked 18 spaces of indentation into the nf4 one).
    #[test]
    fn messages_have_no_runs_of_spaces() {
        let mut in_code = Vec::new();
        let mut c = TrainConfig::new("m", "t");
        c.model.quantize = Quantize::Nf4;
        c.train.method = Method::Full;
        in_code.push(c);
        let mut c = TrainConfig::new("m", "t");
        c.model.quantize = Quantize::Keep;
        c.train.method = Method::Full;
        in_code.push(c);
        let mut c = TrainConfig::new("m", "t");
        c.lora.init = Some(std::path::PathBuf::new());
        in_code.push(c);
        let mut c = TrainConfig::new("m", "t");
        c.train.seed = u64::MAX;
        in_code.push(c);
        let mut messages: Vec<String> = in_code
            .iter()
            .map(|c| c.validate().unwrap_err().to_string())
            .collect();
        for (set, _) in CASES {
            messages.push(invalid(set));
        }
        for sets in [
            &["train.max_steps=10", "train.warmup_steps=11"][..],
            &["train.checkpoint_every=0"][..],
        ] {
            messages.push(err(MINIMAL, sets));
        }
        for m in &messages {
            assert_single_spaced(m);
        }
    }

    /// `--set` values that fail validation, and a part of the message each gives.
    const CASES: [(&str, &str); 45] = [
        (
            "data.train_split=validation",
            "`data.train_split` is set but data.train is not a whole hub dataset",
        ),
        (
            "data.eval_split=test",
            "`data.eval_split` is set but data.eval is not a whole hub dataset",
        ),
        (
            "data.dataset_config=x",
            "`data.dataset_config` is set but neither data.train nor data.eval",
        ),
        ("lora.rank=0", "`lora.rank` must be at least 1"),
        ("lora.alpha=0", "`lora.alpha` must be > 0"),
        ("lora.dropout=1.0", "`lora.dropout` must be in [0, 1)"),
        ("lora.dropout=-0.1", "`lora.dropout` must be in [0, 1)"),
        ("lora.targets=[]", "`lora.targets` is empty"),
        ("lora.targets=[\"qproj\"]", "did you mean `q_proj`?"),
        ("lora.targets=[\"lm_head\"]", "valid: q_proj, k_proj"),
        (
            "lora.targets=[\"q_proj\",\"q_proj\"]",
            "lists `q_proj` twice",
        ),
        (
            "train.micro_batch_size=0",
            "`train.micro_batch_size` must be at least 1",
        ),
        (
            "train.grad_accum=0",
            "`train.grad_accum` must be at least 1",
        ),
        (
            "train.log=[\"tensorboard\"]",
            "`train.log` must include \"jsonl\"",
        ),
        (
            "train.offload_checkpoints=true",
            "set train.checkpointing = true",
        ),
        (
            "train.early_stopping_patience=3",
            "`train.early_stopping_patience` compares eval losses, but there is no eval data",
        ),
        (
            "train.keep_best=true",
            "`train.keep_best` compares eval losses, but there is no eval data",
        ),
        (
            "train.early_stopping_threshold=0.01",
            "`train.early_stopping_threshold` has no effect without",
        ),
        (
            "train.early_stopping_threshold=-1",
            "`train.early_stopping_threshold` must be >= 0",
        ),
        ("preference.beta=0", "`preference.beta` must be > 0"),
        ("preference.lambda=-1", "`preference.lambda` must be > 0"),
        (
            "preference.label_smoothing=0.5",
            "`preference.label_smoothing` must be in [0, 0.5)",
        ),
        (
            "preference.precompute_ref=true",
            "`preference.precompute_ref` caches DPO's reference log-probs",
        ),
        (
            "preference.full=true",
            "`preference.full` applies to train.method = \"dpo\" or \"orpo\"",
        ),
        (
            "preference.max_prompt_len=2000",
            "`preference.max_prompt_len` is 2000 but data.max_seq_len is 1024",
        ),
        (
            "data.alpaca_prompt=\"Q: {instruction}\"",
            "`data.alpaca_prompt` has no {input}",
        ),
        (
            "data.alpaca_prompt_no_input=\"Q:\"",
            "`data.alpaca_prompt_no_input` has no {instruction}",
        ),
        (
            "data.max_seq_len=1",
            "`data.max_seq_len` must be at least 2",
        ),
        ("train.lr=0", "`train.lr` must be > 0"),
        ("train.lr=nan", "`train.lr` must be > 0"),
        (
            "train.betas=[0.9,1.0]",
            "`train.betas` must both be in [0, 1)",
        ),
        (
            "train.betas=[-0.1,0.9]",
            "`train.betas` must both be in [0, 1)",
        ),
        ("train.eps=0", "`train.eps` must be > 0"),
        (
            "train.epochs=0",
            "`train.epochs` is 0 and `train.max_steps` is 0",
        ),
        ("train.weight_decay=-1", "`train.weight_decay` must be >= 0"),
        (
            "train.max_grad_norm=-1",
            "`train.max_grad_norm` must be >= 0",
        ),
        (
            "train.device=gpu",
            "`train.device` must be auto, cpu, cuda or cuda:N",
        ),
        ("train.device=cuda:", "`train.device` must be auto"),
        ("train.device=cuda:x", "`train.device` must be auto"),
        ("train.log_every=0", "`train.log_every` must be at least 1"),
        ("model.path=", "`model.path` is empty"),
        ("data.train=", "`data.train` is empty"),
        ("train.output_dir=", "`train.output_dir` is empty"),
        (
            "train.push_to_hub=me/my model",
            "`train.push_to_hub` must be a hub repo id OWNER/NAME: repo id \"me/my model\" is not valid: the name has the character ' '",
        ),
        (
            "train.push_to_hub=just-a-name",
            "`train.push_to_hub` must be a hub repo id OWNER/NAME",
        ),
    ];

    #[test]
    fn validate_rules() {
        for (set, want) in CASES {
            let e = invalid(set);
            contains_all(&e, &[want, &format!("--set `{set}`")]);
        }
        // Two keys together: warmup must fit in max_steps; epochs may be 0 with max_steps.
        let e = err(MINIMAL, &["train.max_steps=10", "train.warmup_steps=11"]);
        contains_all(
            &e,
            &["`train.warmup_steps` is 11 but `train.max_steps` is 10"],
        );
        parse(
            MINIMAL,
            &[
                "train.max_steps=10",
                "train.warmup_steps=10",
                "train.epochs=0",
            ],
        )
        .unwrap();
        parse(MINIMAL, &["train.warmup_steps=100"]).unwrap(); // epochs decide the length
        for device in ["auto", "cpu", "cuda", "cuda:0", "cuda:12"] {
            parse(MINIMAL, &[&format!("train.device={device}")]).unwrap();
        }
        // Preference pairs are not packed; IPO takes no label smoothing.
        let e = err(MINIMAL, &["train.method=\"dpo\"", "data.pack=true"]);
        contains_all(&e, &["`data.pack` cannot pack preference pairs"]);
        let e = err(
            MINIMAL,
            &["preference.loss=\"ipo\"", "preference.label_smoothing=0.1"],
        );
        contains_all(&e, &["applies to the sigmoid loss only"]);
        let e = err(MINIMAL, &["train.method=\"dpo\"", "preference.full=true"]);
        contains_all(&e, &["set preference.precompute_ref = true too"]);
        parse(
            MINIMAL,
            &[
                "train.method=\"dpo\"",
                "preference.full=true",
                "preference.precompute_ref=true",
            ],
        )
        .unwrap();
        parse(MINIMAL, &["train.method=\"orpo\"", "preference.full=true"]).unwrap();
        // Early stopping and keep_best need evaluations during the run, and then are valid.
        let with_eval = ["data.eval=e.jsonl", "train.keep_best=true"];
        let e = err(MINIMAL, &with_eval);
        contains_all(&e, &["`train.keep_best`", "train.eval_every is 0"]);
        let e = err(
            MINIMAL,
            &["data.eval=e.jsonl", "train.early_stopping_patience=2"],
        );
        contains_all(
            &e,
            &["`train.early_stopping_patience`", "train.eval_every is 0"],
        );
        parse(
            MINIMAL,
            &[
                "data.eval=e.jsonl",
                "train.eval_every=5",
                "train.keep_best=true",
                "train.early_stopping_patience=2",
                "train.early_stopping_threshold=0.01",
                "train.save_total_limit=1",
            ],
        )
        .unwrap();
        // Errors from the file itself carry no --set.
        let e = err(&format!("{MINIMAL}[lora]\nrank = 0\n"), &[]);
        assert_eq!(
            e,
            "configs/x.toml: `lora.rank` must be at least 1, found 0 (8 to 64 is usual)"
        );
        // validate() on a config built in code.
        let mut c = TrainConfig::new("m", "t");
        c.train.lr = -1.0;
        assert_eq!(c.validate().unwrap_err().key, "train.lr");
    }
}
