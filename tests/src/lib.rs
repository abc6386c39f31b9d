//! Helpers shared by the end-to-end and parity tests under `tests/tests/`.
//! Fixtures (tiny HF models, data, reference numbers from transformers) live in
//! `tests/fixtures/` and are made by `scripts/make_fixtures.py`.

pub mod hub_server;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub const MODELS: [&str; 7] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-gemma2",
    "tiny-phi3",
    "tiny-gemma3",
];
pub const FORMATS: [&str; 3] = ["text", "prompt_completion", "messages"];

/// The formats of [`FORMATS`] that `model`'s reference (`reference/<model>.json`) has: all of
/// them, except `messages` for a chat template that refuses the fixture's conversations
/// (tiny-gemma2: Gemma 2's template has no system role; the reference keeps transformers' error
/// under `template_errors`, checked by the data-parity tests).
pub fn model_formats(model: &str) -> Vec<&'static str> {
    let r = reference_json(model);
    let formats: Vec<&'static str> = FORMATS
        .into_iter()
        .filter(|f| r["formats"].get(f).is_some())
        .collect();
    for f in FORMATS {
        assert!(
            formats.contains(&f) || r["template_errors"].get(f).is_some(),
            "{model}: no `{f}` in its reference and no template error saying why"
        );
    }
    formats
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

pub fn model_dir(model: &str) -> PathBuf {
    fixtures().join("models").join(model)
}

/// Fixture `model` on the CPU in `dtype` with every weight a trainable variable (full
/// fine-tuning), and those variables by name.
pub fn trainable_model(
    model: &str,
    dtype: candle_core::DType,
) -> (tallow_model::CausalLM, Vec<(String, candle_core::Var)>) {
    let opts = tallow_model::LoadOptions {
        train_base: true,
        ..tallow_model::LoadOptions::frozen(dtype, &Device::Cpu)
    };
    let model = tallow_model::CausalLM::load(&model_dir(model), &opts).unwrap();
    let vars = model
        .named_params()
        .into_iter()
        .map(|(n, p)| (n, p.var().expect("a trainable weight").clone()))
        .collect();
    (model, vars)
}

/// The two `config.json` layouts real checkpoints come in, each with its fixture root:
/// `tests/fixtures/` was written by transformers 4.57 (`rope_theta`, `rope_scaling`),
/// `tests/fixtures/v5/` by transformers 5.x (`rope_parameters`; same weights, tiny-qwen3 there
/// with linear rope scaling), made by `scripts/make_v5_fixtures.py`. Each root has
/// `models/<M>/`, `reference/<M>.json`, `reference/peft-<M>.json` (+ `-sgd.safetensors`) and
/// `reference/generate.json`; the PEFT adapters are the ones under `tests/fixtures/adapters/`.
pub fn layouts() -> [(&'static str, PathBuf); 2] {
    [
        ("transformers 4.57", fixtures()),
        ("transformers 5", fixtures().join("v5")),
    ]
}

/// `<root>/reference/<name>`, parsed.
pub fn json_at(root: &std::path::Path, name: &str) -> serde_json::Value {
    let p = root.join("reference").join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

pub fn data_file(format: &str) -> PathBuf {
    fixtures().join("data").join(format!("{format}.jsonl"))
}

/// `tests/fixtures/reference/<model>.json`
pub fn reference_json(model: &str) -> serde_json::Value {
    let p = fixtures().join("reference").join(format!("{model}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// `tests/fixtures/reference/<model>.safetensors` (logits and gradients)
pub fn reference_tensors(model: &str) -> HashMap<String, Tensor> {
    let p = fixtures()
        .join("reference")
        .join(format!("{model}.safetensors"));
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

/// Rows (ids, targets) of one format in a reference JSON.
pub fn reference_rows(reference: &serde_json::Value, format: &str) -> Vec<(Vec<u32>, Vec<bool>)> {
    rows_of(&reference["formats"][format]["rows"])
}

/// Rows (ids, targets) of a JSON array of `{"ids": [...], "targets": [...]}` objects.
pub fn rows_of(rows: &serde_json::Value) -> Vec<(Vec<u32>, Vec<bool>)> {
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let ids = r["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let tg = r["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_bool().unwrap())
                .collect();
            (ids, tg)
        })
        .collect()
}

/// max |a - b| over all elements, computed in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(candle_core::DType::F64).unwrap();
    let b = b.to_dtype(candle_core::DType::F64).unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Every element of `t`, flattened row-major, as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// max |a| over all elements, in f64.
pub fn max_abs(a: &Tensor) -> f64 {
    a.to_dtype(candle_core::DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// The largest per-tensor relative difference between two sets of named tensors (max |a - b|
/// over max |b| of each tensor); the sets must hold the same names.
pub fn max_rel_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(k, t)| max_abs_diff(t, &b[k]) / max_abs(&b[k]).max(1e-12))
        .fold(0.0, f64::max)
}

/// Path of the `tallow` binary of this workspace, built on first use (same profile as the tests).
/// The tests crate is a separate package, so cargo does not hand it `CARGO_BIN_EXE_tallow`.
pub fn tallow_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        // target/<profile>/deps/<test-exe> -> target/<profile>/tallow
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", "tallow", "--bin", "tallow"]);
        if cfg!(feature = "mpi") {
            cmd.args(["--features", "tallow/mpi"]);
        }
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd
            .status()
            .expect("running cargo build for the tallow binary");
        assert!(status.success(), "cargo build -p tallow failed");
        let bin = profile_dir.join(format!("tallow{}", std::env::consts::EXE_SUFFIX));
        assert!(bin.exists(), "{} was not built", bin.display());
        bin
    })
    .clone()
}

/// Output of one `tallow` run.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tallow ARGS` and captures its output.
pub fn tallow<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = std::process::Command::new(tallow_bin())
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `tallow ARGS` with these environment variables set and the Hugging Face ones
/// (`HF_TOKEN`, `HF_HOME`, `HF_ENDPOINT`, ...) of the calling environment removed.
pub fn tallow_env<I, S>(args: I, env: &[(&str, String)]) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = std::process::Command::new(tallow_bin());
    cmd.args(args);
    for k in [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_ENDPOINT",
        "HF_HUB_OFFLINE",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `tallow ARGS` (an `eval ... --json`), requires success, and parses its JSON line.
pub fn eval_json(args: &[&str]) -> serde_json::Value {
    let r = tallow(args);
    assert_eq!(r.code, 0, "tallow {args:?} failed: {}", r.stderr);
    serde_json::from_str(r.stdout.trim()).unwrap_or_else(|e| panic!("bad JSON {e}: {}", r.stdout))
}

/// The `loss` of [`eval_json`].
pub fn eval_loss(args: &[&str]) -> f64 {
    eval_json(args)["loss"]
        .as_f64()
        .expect("eval --json prints a loss")
}

/// `tallow eval --json` of `model` (+ `adapter`) on the fixture data file of `format`, in f32 with
/// the fixtures' max_seq_len (32): the loss.
pub fn eval_fixture(
    model: &std::path::Path,
    adapter: Option<&std::path::Path>,
    format: &str,
) -> f64 {
    let data = data_file(format);
    let mut args = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--max-seq-len",
        "32",
        "--dtype",
        "f32",
        "--json",
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", a.to_str().unwrap()]);
    }
    eval_loss(&args)
}

/// A fresh, empty scratch directory under the system temp dir, named by this process. The
/// first call in a process removes the scratch directories of test processes that have ended
/// (a test binary leaves its own behind: up to 2 GB, and a CI machine once ran out of disk).
pub fn scratch(name: &str) -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| remove_dead_scratch(&std::env::temp_dir(), "tallow-test-"));
    let dir = std::env::temp_dir().join(format!("tallow-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Removes the entries of `tmp` named `{prefix}{pid}-...` whose process is gone (Linux: no
/// `/proc/{pid}`; elsewhere nothing is removed).
pub fn remove_dead_scratch(tmp: &std::path::Path, prefix: &str) {
    if !std::path::Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Copies a fixture model dir into `dest` (to damage a copy, never the fixture).
pub fn copy_model(model: &str, dest: &std::path::Path) {
    std::fs::create_dir_all(dest).unwrap();
    for entry in std::fs::read_dir(model_dir(model)).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), dest.join(e.file_name())).unwrap();
    }
}

/// Runs the `make-random-model` dev tool (`exe`: an integration test passes
/// `env!("CARGO_BIN_EXE_make-random-model")`): random weights for the architecture in
/// `config_json`, written with a tokenizer and `bench.jsonl` into `out`.
pub fn make_random_model(
    exe: &str,
    config_json: &std::path::Path,
    out: &std::path::Path,
    rows: usize,
) {
    make_random_model_with(exe, config_json, out, rows, &[])
}

/// [`make_random_model`] with more of the tool's flags (`["--bnb-4bit", "true"]`).
pub fn make_random_model_with(
    exe: &str,
    config_json: &std::path::Path,
    out: &std::path::Path,
    rows: usize,
    flags: &[&str],
) {
    let output = std::process::Command::new(exe)
        .arg(config_json)
        .arg(out)
        .args(["--rows", &rows.to_string()])
        .args(flags)
        .output()
        .unwrap_or_else(|e| panic!("{exe}: {e}"));
    assert!(
        output.status.success(),
        "make-random-model {}: {}",
        config_json.display(),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// LoRA dropout used by `tests/dropout.rs` and its fixture (`dropout-masks` dev tool): rate,
/// run seed and the text rows' micro-batch (all 4 rows, right-padded to the longest).
pub const DROPOUT_P: f64 = 0.3;
pub const DROPOUT_SEED: u64 = 7;

/// The keep flags (1 = kept) of every LoRA dropout mask tallow draws in micro-batch 0 of step 0
/// of a run seeded `seed` with dropout `p`, for `model` + the PEFT adapter in `adapter`, on a
/// micro-batch of `rows` rows padded to `t` tokens: u8 tensors (rows, t, in) keyed by PEFT module
/// name (`base_model.model.model.layers.0.self_attn.q_proj`). Also checks that every kept value
/// is exactly 1/(1-p).
pub fn dropout_keep_masks(
    model: &std::path::Path,
    adapter: &std::path::Path,
    p: f64,
    seed: u64,
    rows: usize,
    t: usize,
) -> HashMap<String, Tensor> {
    use tallow_model::peft::names::peft_prefix;
    use tallow_model::{load_peft, set_dropout_rate, CausalLM, LoadOptions};
    let dev = Device::Cpu;
    let mut m = CausalLM::load(model, &LoadOptions::frozen(candle_core::DType::F32, &dev)).unwrap();
    load_peft(&mut m, adapter).unwrap();
    set_dropout_rate(&mut m, p);
    let micro_seed = tallow_trainer::train::dropout_seed(seed, 0, 0);
    let mut out = HashMap::new();
    for (i, layer) in m.layers.iter().enumerate() {
        for (path, lin) in layer.linears() {
            let Some(lora) = lin.lora() else { continue };
            let k = lin.in_features();
            let mask = lora
                .dropout_mask(micro_seed, &[rows * t, k], &dev)
                .unwrap()
                .expect("dropout is on");
            let values = mask.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let scale = (1.0 / (1.0 - p)) as f32;
            assert!(values.iter().all(|&v| v == 0.0 || v == scale));
            let keep: Vec<u8> = values.iter().map(|&v| u8::from(v > 0.0)).collect();
            out.insert(
                peft_prefix(i, &path),
                Tensor::from_vec(keep, (rows, t, k), &dev).unwrap(),
            );
        }
    }
    out
}

/// The tensors of a safetensors file, on the CPU.
pub fn load_tensors(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// One plain-SGD step of `tallow train` from the adapter `init` on `model` (f32, lr 0.5, no
/// clipping, the 4 "text" rows in one micro-batch), with `lora.dropout = dropout` and, when
/// given, `train.seed = seed`, in the scratch dir `name`. Returns that dir (the run is in
/// `run/`) and the step's loss.
pub fn one_sgd_step(
    name: &str,
    model: &std::path::Path,
    init: &std::path::Path,
    dropout: f64,
    seed: Option<u64>,
) -> (PathBuf, f64) {
    let dir = scratch(name);
    let seed = seed.map_or(String::new(), |s| format!("seed = {s}\n"));
    let cfg = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\ninit = \"{}\"\ndropout = {dropout:?}\n[data]\ntrain = \"{}\"\nmax_seq_len = 32\nshuffle = false\n\
         [train]\n{seed}optimizer = \"sgd\"\nlr = 0.5\nschedule = \"constant\"\nmax_grad_norm = 0.0\nmax_steps = 1\nmicro_batch_size = 4\ngrad_accum = 1\noutput_dir = \"{}\"\n",
        model.display(),
        init.display(),
        data_file("text").display(),
        dir.join("run").display()
    );
    std::fs::write(dir.join("sgd.toml"), cfg).unwrap();
    let r = tallow([
        "train",
        "--config",
        dir.join("sgd.toml").to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(r.code, 0, "{name}: {}", r.stderr);
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let step: serde_json::Value =
        serde_json::from_str(metrics.lines().find(|l| l.contains("\"loss\"")).unwrap()).unwrap();
    (dir, step["loss"].as_f64().unwrap())
}

/// Every adapter tensor of `before` (and no other) in `after`, moved as the reference moved it
/// (`refs`' `after.<name>`): max |ours - ref| / max |ref| over the updates below `tol`.
pub fn assert_updates_match(
    what: &str,
    before: &HashMap<String, Tensor>,
    after: &HashMap<String, Tensor>,
    refs: &HashMap<String, Tensor>,
    tol: f64,
) {
    assert_eq!(after.len(), before.len(), "{what}: adapter tensors");
    for (name, b) in before {
        let du = (&after[name] - b).unwrap();
        let dr = (&refs[&format!("after.{name}")] - b).unwrap();
        let rel = max_abs_diff(&du, &dr) / max_abs(&dr).max(1e-12);
        assert!(
            rel < tol,
            "{what} {name}: update differs by {rel} (relative, tolerance {tol})"
        );
    }
}

/// One plain-SGD step (lr 0.5, no clipping, the 4 "text" rows in one micro-batch, dropout 0)
/// of `tallow train` from the adapter `init` on `<root>/models/<model>`, against the reference
/// `<root>/reference/<reference>.json` (its `sgd.sgd_loss_before`) and
/// `<root>/reference/<reference>-sgd.safetensors` (`after.<key>`): the step's loss within
/// 1e-5, the update of every adapter tensor within 1e-3 relative (max |ours - ref| / max |ref|
/// over after - before). Returns the run's adapter dir.
pub fn sgd_step_matches_reference(
    what: &str,
    root: &std::path::Path,
    model: &str,
    init: &std::path::Path,
    reference: &str,
) -> PathBuf {
    let (dir, loss) = one_sgd_step(
        &format!("sgd-{}", what.replace(' ', "-")),
        &root.join("models").join(model),
        init,
        0.0,
        None,
    );
    let reference_json = json_at(root, &format!("{reference}.json"));
    let want = reference_json["sgd"]["sgd_loss_before"].as_f64().unwrap();
    assert!((loss - want).abs() < 1e-5, "{what}: loss {loss} vs {want}");
    assert_updates_match(
        what,
        &load_tensors(&init.join("adapter_model.safetensors")),
        &load_tensors(&dir.join("run/adapter/adapter_model.safetensors")),
        &load_tensors(&root.join(format!("reference/{reference}-sgd.safetensors"))),
        1e-3,
    );
    dir.join("run/adapter")
}

/// Alpaca rows `(instruction, input, output)` as two JSONL texts: the Alpaca rows, and the
/// prompt_completion rows with the prompt `prompt(instruction, input)` wrote out for each.
pub fn alpaca_and_prompt_completion(
    rows: &[(&str, &str, &str)],
    prompt: impl Fn(&str, &str) -> String,
) -> (String, String) {
    let (mut alpaca, mut pc) = (String::new(), String::new());
    for &(instruction, input, output) in rows {
        alpaca += &format!(
            "{}\n",
            serde_json::json!({"instruction": instruction, "input": input, "output": output})
        );
        pc += &format!(
            "{}\n",
            serde_json::json!({"prompt": prompt(instruction, input), "completion": output})
        );
    }
    (alpaca, pc)
}

/// `dir/train.toml`: the estimate and bench tests' job on `model` (bf16, micro-batch 1,
/// sequence 128, constant lr, CPU, output in `dir/run`, the model's `bench.jsonl` as data), with
/// `extra` appended after the `[train]` keys (more of them, or further sections).
pub fn write_config(dir: &std::path::Path, model: &std::path::Path, extra: &str) -> PathBuf {
    let path = dir.join("train.toml");
    std::fs::write(
        &path,
        format!(
            "[model]\npath = {:?}\ndtype = \"bf16\"\n[data]\ntrain = {:?}\nmax_seq_len = 128\n\
             shuffle = false\n[train]\nmicro_batch_size = 1\ngrad_accum = 1\nlr = 1e-4\n\
             schedule = \"constant\"\ndevice = \"cpu\"\noutput_dir = {:?}\n{extra}",
            model.display().to_string(),
            model.join("bench.jsonl").display().to_string(),
            dir.join("run").display().to_string()
        ),
    )
    .unwrap();
    path
}

/// Summed next-token NLL of each row on its own (its target flags as the data pipeline makes
/// them: `targets[t]`, token t is predicted), with the model's final-logit soft-cap, and the
/// number of targets.
pub fn nll_and_count(
    model: &tallow_model::CausalLM,
    rows: &[(Vec<u32>, Vec<bool>)],
) -> (f64, usize) {
    let mut total = 0.0;
    let mut count = 0;
    for (ids, tg) in rows {
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let h = model.forward_hidden(&input, None).unwrap();
        let t = tallow_model::Targets::new(
            std::slice::from_ref(ids),
            std::slice::from_ref(tg),
            &Device::Cpu,
        )
        .unwrap();
        let nll = tallow_model::lm_head_nll(
            &h,
            model.lm_head_weight(),
            &t,
            model.config.variant.final_logit_softcapping,
        )
        .unwrap();
        total += nll
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        count += t.count;
    }
    (total, count)
}

/// A JSON array of token-id rows (`[[1, 2], [3]]`) as ids.
pub fn id_rows(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// GGUF file `path` written to `to` with its decoder linears in Q4_K where a row is whole
/// 256-value blocks and Q8_0 elsewhere (llama.cpp's fallback for such rows), by Candle's
/// quantizer: the footprint of a Q4_K GGUF for memory and speed measurements (the blocks' sizes
/// are the format's; their values are Candle's quantizer's, not llama-quantize's, which
/// differ: docs/gguf.md). The `requantize-gguf` dev tool.
pub fn requantize_linears(path: &std::path::Path, to: &std::path::Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let content = gguf_file::Content::read(&mut f).unwrap();
    let linears = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| {
            let t = content.tensor(&mut f, n, &Device::Cpu).unwrap();
            let linear = n.starts_with("blk.")
                && linears.iter().any(|l| n.ends_with(&format!("{l}.weight")));
            if !linear {
                return (n.clone(), t);
            }
            let format = match t.shape().dims()[1] % 256 {
                0 => GgmlDType::Q4K,
                _ => GgmlDType::Q8_0,
            };
            let w = t.dequantize(&Device::Cpu).unwrap();
            (n.clone(), QTensor::quantize(&w, format).unwrap())
        })
        .collect();
    let meta: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(to).unwrap_or_else(|e| panic!("{}: {e}", to.display()));
    gguf_file::write(&mut out, &meta, &tensors).unwrap();
}
