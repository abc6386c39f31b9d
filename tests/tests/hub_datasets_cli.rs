//! Whole hub datasets as training data: `data.train = "hf://datasets/OWNER/NAME[@REV]"`, the
//! split and config keys, `data.max_rows`, against the loopback hub of
//! `tallow_tests::hub_server` (datasets from tests/fixtures/hub_datasets/). A hub run is
//! checked against a run on the same rows from a local JSONL file: same adapter bytes.

use std::path::{Path, PathBuf};

use tallow_tests::hub_server::{
    hub_dataset_dir, HubServer, DS_BAD_PARQUET, DS_BAD_ROW, DS_CONFIGS, DS_JSONL, DS_SHARDED,
};
use tallow_tests::*;

/// A LoRA run of one epoch (3 steps of 4 rows on 12 rows) on tiny-qwen2 with `data` as the
/// `[data]` section's extra lines, in `dir/run`; `HF_ENDPOINT` = the server, `HF_HOME` = `dir`.
fn train(hub: &HubServer, dir: &Path, data: &str) -> Run {
    let cfg = dir.join("config.toml");
    let model = model_dir("tiny-qwen2");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = \"{}\"\ndtype = \"f32\"\n[lora]\nrank = 2\n[data]\n{data}\n\
             max_seq_len = 48\n[train]\nmicro_batch_size = 4\ngrad_accum = 1\nepochs = 1\n\
             lr = 0.01\noutput_dir = \"{}\"\n",
            model.display(),
            dir.join("run").display()
        ),
    )
    .unwrap();
    tallow_env(
        ["train", "--config", cfg.to_str().unwrap(), "--quiet"],
        &[
            ("HF_ENDPOINT", hub.url.clone()),
            ("HF_HOME", dir.display().to_string()),
        ],
    )
}

fn ok(r: &Run, what: &str) {
    assert_eq!(r.code, 0, "{what} failed:\n{}\n{}", r.stdout, r.stderr);
}

fn fails(r: &Run, what: &str, needles: &[&str]) {
    assert_eq!(r.code, 1, "{what} should fail:\n{}\n{}", r.stdout, r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{what}: no {n:?} in:\n{}", r.stderr);
    }
}

fn adapter(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("run/adapter/adapter_model.safetensors")).unwrap()
}

/// The eval losses the run wrote (start and end).
fn eval_losses(dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["eval_loss"].as_f64())
        .collect()
}

/// `tests/fixtures/hub_datasets/<name>.<split>.jsonl`: the dataset's rows, as a local file.
fn local_rows(name: &str) -> String {
    let p: PathBuf = hub_dataset_dir(&format!("{name}.jsonl"));
    assert!(p.exists(), "{}", p.display());
    p.display().to_string()
}

/// Trains on `hub_data` and on `local_data` (`[data]` lines) and checks that the adapters are
/// the same bytes; returns the hub run (for its stderr) and the two dirs.
fn same_as_local(
    hub: &HubServer,
    name: &str,
    hub_data: &str,
    local_data: &str,
) -> (Run, PathBuf, PathBuf) {
    let a = scratch(&format!("hubds-{name}-hub"));
    let b = scratch(&format!("hubds-{name}-local"));
    let ra = train(hub, &a, hub_data);
    ok(&ra, &format!("{name}: hub run"));
    ok(&train(hub, &b, local_data), &format!("{name}: local run"));
    assert!(
        adapter(&a) == adapter(&b),
        "{name}: the adapter trained on {hub_data:?} differs from the one trained on \
         {local_data:?}"
    );
    (ra, a, b)
}

/// The whole parquet dataset (3 train shards, messages as lists of structs, extra int / float /
/// bool / null columns) trains as its rows from a local JSONL file do, and `data.eval` reads
/// its "test" split (the default) as the local test rows.
#[test]
fn whole_dataset_equals_local_rows() {
    let hub = HubServer::start();
    let (run, dir, local) = same_as_local(
        &hub,
        "sharded",
        &format!("train = \"hf://datasets/{DS_SHARDED}\"\neval = \"hf://datasets/{DS_SHARDED}\""),
        &format!(
            "train = \"{}\"\neval = \"{}\"",
            local_rows("sharded.train"),
            local_rows("sharded.test")
        ),
    );
    // The eval split was read: the same losses as the local test rows.
    let (h, l) = (eval_losses(&dir), eval_losses(&local));
    assert!(h.len() >= 2 && h == l, "eval losses {h:?} vs {l:?}");
    assert!(
        run.stderr.contains(&format!(
            "data.train: hf://datasets/{DS_SHARDED} (split \"train\"): 3 of 3 shards, 12 rows"
        )),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("data.eval: hf://datasets/tallow-test/sharded (split \"test\"): 1 of 1"),
        "{}",
        run.stderr
    );
    // The shards are in the cache as huggingface_hub lays them out.
    let snap = dir
        .join("hub/datasets--tallow-test--sharded/snapshots")
        .join(hub.commit(DS_SHARDED, "main"));
    for k in 0..3 {
        assert!(snap
            .join(format!("data/train-0000{k}-of-00003.parquet"))
            .exists());
    }
}

/// `data.max_rows = 6` reads shard 0 (4 rows) and 2 rows of shard 1; shard 2 is never
/// requested. Same adapter as the local file's first 6 rows (`max_rows` there too).
#[test]
fn max_rows_stops_before_the_last_shard() {
    let hub = HubServer::start();
    let (run, dir, local) = same_as_local(
        &hub,
        "maxrows",
        &format!("train = \"hf://datasets/{DS_SHARDED}\"\nmax_rows = 6"),
        &format!("train = \"{}\"\nmax_rows = 6", local_rows("sharded.train")),
    );
    let log = hub.requests();
    let asked = |name: &str| log.iter().any(|r| r.contains(name));
    assert!(asked("train-00000-of-00003"), "{log:#?}");
    assert!(asked("train-00001-of-00003"), "{log:#?}");
    assert!(
        !asked("train-00002-of-00003"),
        "shard 2 was fetched: {log:#?}"
    );
    assert!(
        !asked("test-00000"),
        "no eval split was asked for: {log:#?}"
    );
    assert!(
        run.stderr.contains("2 of 3 shards, 6 rows"),
        "{}",
        run.stderr
    );
    // Offline, the cached snapshot (README, shards 0 and 1) answers: the same rows.
    let cfg = dir.join("config.toml");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    std::fs::remove_dir_all(dir.join("run")).unwrap();
    let r = tallow_env(
        ["train", "--config", cfg.to_str().unwrap(), "--quiet"],
        &[
            ("HF_ENDPOINT", dead_url),
            ("HF_HOME", dir.display().to_string()),
            ("HF_HUB_OFFLINE", "1".into()),
        ],
    );
    ok(&r, "offline rerun");
    assert!(
        adapter(&dir) == adapter(&local),
        "offline rerun: another adapter"
    );
}

/// Splits named by directories (`train/`, `test/`), JSON lines with a gzip shard.
#[test]
fn jsonl_shards_in_split_dirs() {
    let hub = HubServer::start();
    same_as_local(
        &hub,
        "jsonl",
        &format!("train = \"hf://datasets/{DS_JSONL}\"\neval = \"hf://datasets/{DS_JSONL}\""),
        &format!(
            "train = \"{}\"\neval = \"{}\"",
            local_rows("jsonl.train"),
            local_rows("jsonl.test")
        ),
    );
}

/// README `configs:`: the default config (`default: true`), another by `data.dataset_config`
/// with `data.train_split`, and `@REV`.
#[test]
fn readme_configs_and_revisions() {
    let hub = HubServer::start();
    same_as_local(
        &hub,
        "cfg-default",
        &format!("train = \"hf://datasets/{DS_CONFIGS}\""),
        &format!("train = \"{}\"", local_rows("configs.chat.train")),
    );
    let (run, ..) = same_as_local(
        &hub,
        "cfg-text",
        &format!(
            "train = \"hf://datasets/{DS_CONFIGS}\"\ndataset_config = \"text\"\n\
             train_split = \"train\""
        ),
        &format!("train = \"{}\"", local_rows("configs.text.train")),
    );
    assert!(
        run.stderr.contains("(config \"text\", split \"train\")"),
        "{}",
        run.stderr
    );
    // v1 has only the first train shard: its 4 rows.
    same_as_local(
        &hub,
        "rev",
        &format!("train = \"hf://datasets/{DS_SHARDED}@v1\""),
        &format!("train = \"{}\"\nmax_rows = 4", local_rows("sharded.train")),
    );
}

/// Each bad input: its own message, exit code 1.
#[test]
fn bad_inputs_are_named() {
    let hub = HubServer::start();
    let dir = scratch("hubds-bad");
    let run = |data: &str| train(&hub, &dir, data);
    let sharded = format!("train = \"hf://datasets/{DS_SHARDED}\"");

    fails(
        &run(&format!("{sharded}\ntrain_split = \"validation\"")),
        "no such split",
        &[
            "data.train: dataset hf://datasets/tallow-test/sharded at revision \"main\"",
            "the default config has no files for split \"validation\"",
            "its splits: \"train\", \"test\"",
        ],
    );
    // The chat config (the default) has no test split: data.eval's default split.
    fails(
        &run(&format!(
            "train = \"hf://datasets/{DS_CONFIGS}\"\neval = \"hf://datasets/{DS_CONFIGS}\""
        )),
        "no eval split",
        &[
            "data.eval: dataset hf://datasets/tallow-test/configs",
            "config \"chat\" has no files for split \"test\"",
            "its splits: \"train\"",
        ],
    );
    fails(
        &run(&format!(
            "train = \"hf://datasets/{DS_CONFIGS}\"\ndataset_config = \"nope\""
        )),
        "no such config",
        &["no config \"nope\"", "configs: \"chat\", \"text\""],
    );
    fails(
        &run(&format!("train = \"hf://datasets/{DS_SHARDED}@v9\"")),
        "no such revision",
        &["tallow-test/sharded has no revision \"v9\""],
    );
    fails(
        &run("train = \"hf://datasets/tallow-test/nope\""),
        "no such dataset",
        &["repo tallow-test/nope not found", "dataset repo"],
    );
    fails(
        &run(&format!("train = \"hf://datasets/{DS_BAD_PARQUET}\"")),
        "truncated parquet shard",
        &["cannot read parquet file hf://datasets/tallow-test/bad-parquet/data/train-00001-of-00003.parquet"],
    );
    fails(
        &run(&format!("train = \"hf://datasets/{DS_BAD_ROW}\"")),
        "malformed JSON line",
        &["hf://datasets/tallow-test/bad-row/train/part-0.jsonl:2: not valid JSON"],
    );
    // The split / config keys with a source that is not a whole dataset.
    let local = local_rows("sharded.train");
    fails(
        &run(&format!("train = \"{local}\"\ntrain_split = \"train\"")),
        "train_split on a file",
        &["data.train_split", "not a whole hub dataset"],
    );
    fails(
        &run(&format!(
            "{sharded}\neval = \"{local}\"\neval_split = \"test\""
        )),
        "eval_split on a file",
        &["data.eval_split", "data.eval is not a whole hub dataset"],
    );
    fails(
        &run(&format!(
            "train = \"hf://datasets/{DS_SHARDED}/data/train-00000-of-00003.parquet\"\n\
             dataset_config = \"x\""
        )),
        "dataset_config on one file",
        &["data.dataset_config", "neither data.train nor data.eval"],
    );
}
