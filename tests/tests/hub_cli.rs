//! Issue 5: `tallow download`, hub ids as model paths, `hf://datasets/...` data files. The real
//! client runs against the loopback hub of `tallow_tests::hub_server`, with a fresh `HF_HOME`
//! per test.

use std::path::{Path, PathBuf};

use tallow_tests::hub_server::{hex, HubServer, DATASET, GATED, MODEL, TOKEN};
use tallow_tests::*;

/// `HF_ENDPOINT` = the server, `HF_HOME` = `home`, plus `extra`.
fn env(server_url: &str, home: &Path, extra: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = vec![
        ("HF_ENDPOINT", server_url.to_string()),
        ("HF_HOME", home.display().to_string()),
    ];
    for (k, val) in extra {
        let k: &'static str = match *k {
            "HF_TOKEN" => "HF_TOKEN",
            "HF_HUB_OFFLINE" => "HF_HUB_OFFLINE",
            other => panic!("unexpected env {other}"),
        };
        v.push((k, val.to_string()));
    }
    v
}

/// An endpoint nobody listens on (connection refused).
fn dead_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn ok(r: &Run, what: &str) -> PathBuf {
    assert_eq!(r.code, 0, "{what} failed:\n{}\n{}", r.stdout, r.stderr);
    PathBuf::from(r.stdout.trim().lines().last().expect("a path on stdout"))
}

fn fails(r: &Run, what: &str, needles: &[&str]) {
    assert_eq!(r.code, 1, "{what} should fail:\n{}\n{}", r.stdout, r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{what}: no {n:?} in:\n{}", r.stderr);
    }
}

/// Every file under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out)
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string())
            }
        }
    }
    let mut out = vec![];
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

fn repo_dir(home: &Path, folder: &str) -> PathBuf {
    home.join("hub").join(folder)
}

/// Download lays out the cache as huggingface_hub does (blobs by etag, refs/main, snapshot
/// symlinks), takes only what training needs, and then works offline.
#[test]
fn download_then_offline() {
    let hub = HubServer::start();
    let home = scratch("hub-offline");
    let r = tallow_env(["download", MODEL, "--quiet"], &env(&hub.url, &home, &[]));
    let snap = ok(&r, "download");
    let main = hub.commit(MODEL, "main");
    let repo = repo_dir(&home, "models--tallow-test--tiny-qwen2");
    assert_eq!(snap, repo.join("snapshots").join(&main));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        main
    );
    // The default set: no README, no .bin, nothing under original/.
    assert_eq!(
        files(&snap),
        [
            "config.json",
            "extra.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    // LFS file: a relative symlink to the blob named by its sha256.
    let weights = hub.file(MODEL, "main", "model.safetensors");
    let link = std::fs::read_link(snap.join("model.safetensors")).unwrap();
    assert_eq!(
        link,
        Path::new("../../blobs").join(sha256(&weights)),
        "snapshot link"
    );
    assert_eq!(
        std::fs::read(snap.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(!files(&repo.join("blobs"))
        .iter()
        .any(|f| f.ends_with(".incomplete")));

    // Offline, with an endpoint that would refuse: the cache answers.
    let dead = dead_endpoint();
    let offline = env(&dead, &home, &[("HF_HUB_OFFLINE", "1")]);
    let r = tallow_env(["download", MODEL, "--quiet"], &offline);
    assert_eq!(ok(&r, "offline download"), snap);
    let data = data_file("text");
    let args = [
        "eval",
        "--model",
        MODEL,
        "--data",
        data.to_str().unwrap(),
        "--json",
    ];
    let r = tallow_env(args, &offline);
    assert_eq!(r.code, 0, "offline eval: {}", r.stderr);
    // Offline and not cached: a clear error.
    let r = tallow_env(
        ["eval", "--model", GATED, "--data", data.to_str().unwrap()],
        &offline,
    );
    fails(
        &r,
        "offline uncached",
        &["HF_HUB_OFFLINE", "not in the cache", GATED],
    );
    // Online but the network is down: say so, and what is cached.
    let r = tallow_env(["download", MODEL, "--quiet"], &env(&dead, &home, &[]));
    fails(
        &r,
        "network down",
        &["network error", &format!("snapshots {main}")],
    );
    // ... while a model already cached needs no network at all.
    let r = tallow_env(args, &env(&dead, &home, &[]));
    assert_eq!(r.code, 0, "cached eval with the network down: {}", r.stderr);
}

/// `@REV`, `--revision`, a commit id; an unknown revision names itself.
#[test]
fn revision_pinning() {
    let hub = HubServer::start();
    let home = scratch("hub-revision");
    let e = env(&hub.url, &home, &[]);
    let v1 = hub.commit(MODEL, "v1");
    let snap = ok(
        &tallow_env(["download", &format!("{MODEL}@v1"), "--quiet"], &e),
        "@v1",
    );
    assert!(snap.ends_with(&v1));
    assert_eq!(
        std::fs::read_to_string(snap.join("extra.json")).unwrap(),
        "{\"rev\":\"v1\"}"
    );
    let repo = repo_dir(&home, "models--tallow-test--tiny-qwen2");
    assert_eq!(std::fs::read_to_string(repo.join("refs/v1")).unwrap(), v1);
    assert!(!repo.join("refs/main").exists(), "main was not asked for");

    let main = hub.commit(MODEL, "main");
    let snap = ok(
        &tallow_env(["download", MODEL, "--revision", &main, "--quiet"], &e),
        "--revision COMMIT",
    );
    assert!(snap.ends_with(&main));
    assert_eq!(
        std::fs::read_to_string(snap.join("extra.json")).unwrap(),
        "{\"rev\":\"main\"}"
    );
    // Blobs shared by both commits are stored once.
    let blobs = files(&repo.join("blobs"));
    assert_eq!(
        blobs.len(),
        7,
        "6 files per commit, extra.json differs: {blobs:?}"
    );

    let r = tallow_env(["download", &format!("{MODEL}@v9")], &e);
    fails(&r, "unknown revision", &[MODEL, "has no revision \"v9\""]);
}

#[test]
fn include_exclude() {
    let hub = HubServer::start();
    let home = scratch("hub-filter");
    let e = env(&hub.url, &home, &[]);
    let args = [
        "download",
        MODEL,
        "--include",
        "*.json",
        "--exclude",
        "tokenizer*",
        "--quiet",
    ];
    let snap = ok(&tallow_env(args, &e), "include/exclude");
    assert_eq!(
        files(&snap),
        [
            "config.json",
            "extra.json",
            "generation_config.json",
            "original/params.json"
        ]
    );
    // A narrower download is not mistaken for a complete model: eval fetches the rest.
    let data = data_file("text");
    let r = tallow_env(
        ["eval", "--model", MODEL, "--data", data.to_str().unwrap()],
        &e,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(snap.join("model.safetensors").exists() && snap.join("tokenizer.json").exists());

    let r = tallow_env(["download", MODEL, "--include", "*.gguf"], &e);
    fails(&r, "no match", &["no file matches", "model.safetensors"]);

    // --local-dir: real files, no cache symlinks.
    let local = home.join("local");
    let args = [
        "download",
        MODEL,
        "--include",
        "README.md",
        "--local-dir",
        local.to_str().unwrap(),
    ];
    assert_eq!(ok(&tallow_env(args, &e), "local dir"), local);
    assert_eq!(files(&local), ["README.md"]);
    assert!(!std::fs::symlink_metadata(local.join("README.md"))
        .unwrap()
        .is_symlink());
}

#[test]
fn gated_repo_needs_a_token() {
    let hub = HubServer::start();
    let home = scratch("hub-gated");
    let r = tallow_env(["download", GATED], &env(&hub.url, &home, &[]));
    fails(
        &r,
        "no token",
        &[
            &format!("the repo {GATED} needs a token"),
            "huggingface-cli login",
            "HF_TOKEN",
        ],
    );
    let r = tallow_env(
        ["download", GATED],
        &env(&hub.url, &home, &[("HF_TOKEN", "hf_wrong")]),
    );
    fails(&r, "wrong token", &["needs a token", "refused"]);
    assert!(!repo_dir(&home, "models--tallow-test--gated")
        .join("snapshots")
        .exists());

    let r = tallow_env(
        ["download", GATED, "--quiet"],
        &env(&hub.url, &home, &[("HF_TOKEN", TOKEN)]),
    );
    assert!(ok(&r, "HF_TOKEN").join("model.safetensors").exists());
    // The token file `huggingface-cli login` writes: $HF_HOME/token.
    let home2 = scratch("hub-gated-file");
    std::fs::write(home2.join("token"), format!("{TOKEN}\n")).unwrap();
    let r = tallow_env(["download", GATED, "--quiet"], &env(&hub.url, &home2, &[]));
    assert!(ok(&r, "token file").join("config.json").exists());
}

#[test]
fn missing_repo_and_file() {
    let hub = HubServer::start();
    let home = scratch("hub-missing");
    let e = env(&hub.url, &home, &[]);
    let r = tallow_env(["download", "tallow-test/nope"], &e);
    fails(&r, "missing repo", &["repo tallow-test/nope not found"]);
    let data = data_file("text");
    let r = tallow_env(
        [
            "eval",
            "--model",
            "tallow-test/nope",
            "--data",
            data.to_str().unwrap(),
        ],
        &e,
    );
    fails(
        &r,
        "missing repo (eval)",
        &["--model tallow-test/nope", "not found"],
    );
    let model = model_dir("tiny-qwen2");
    let bad = format!("hf://datasets/{DATASET}/data/nope.jsonl");
    let r = tallow_env(
        ["eval", "--model", model.to_str().unwrap(), "--data", &bad],
        &e,
    );
    fails(
        &r,
        "missing file",
        &[&format!("repo {DATASET} has no file \"data/nope.jsonl\"")],
    );
    let r = tallow_env(["download", "not a repo id"], &e);
    fails(&r, "bad id", &["not a hub repo id"]);
}

/// The first transfer of the weights stops halfway: the client resumes with a Range request
/// and the result is byte-identical.
#[test]
fn connection_cut_mid_file_resumes() {
    let hub = HubServer::start();
    let home = scratch("hub-cut");
    hub.cut_once("model.safetensors");
    let r = tallow_env(["download", MODEL, "--quiet"], &env(&hub.url, &home, &[]));
    let snap = ok(&r, "download with a cut");
    let weights = hub.file(MODEL, "main", "model.safetensors");
    assert_eq!(
        std::fs::read(snap.join("model.safetensors")).unwrap(),
        weights
    );
    let cdn: Vec<String> = hub
        .requests()
        .into_iter()
        .filter(|l| l.starts_with("GET /cdn/"))
        .collect();
    assert_eq!(cdn.len(), 2, "{cdn:?}");
    assert!(cdn[0].ends_with("bytes=0-"), "{cdn:?}");
    let resumed_at: usize = cdn[1]
        .rsplit("bytes=")
        .next()
        .unwrap()
        .trim_end_matches('-')
        .parse()
        .unwrap();
    assert!(resumed_at > 0 && resumed_at < weights.len(), "{cdn:?}");
}

/// Bytes that do not hash to the announced sha256 never reach blobs/ or the snapshot.
#[test]
fn hash_mismatch_is_never_used() {
    let hub = HubServer::start();
    let home = scratch("hub-corrupt");
    hub.corrupt("model.safetensors");
    let r = tallow_env(["download", MODEL], &env(&hub.url, &home, &[]));
    fails(&r, "corrupt", &["model.safetensors", "sha256", "deleted"]);
    let repo = repo_dir(&home, "models--tallow-test--tiny-qwen2");
    let sha = sha256(&hub.file(MODEL, "main", "model.safetensors"));
    assert!(!repo.join("blobs").join(&sha).exists());
    assert!(!repo
        .join("blobs")
        .join(format!("{sha}.incomplete"))
        .exists());
    let snap = repo.join("snapshots").join(hub.commit(MODEL, "main"));
    assert!(!snap.join("model.safetensors").exists());
    assert!(!repo.join("refs/main").exists());

    // A small (non-LFS) file is checked against its git blob id.
    let hub = HubServer::start();
    let home = scratch("hub-corrupt-config");
    hub.corrupt("config.json");
    let r = tallow_env(["download", MODEL], &env(&hub.url, &home, &[]));
    fails(
        &r,
        "corrupt config.json",
        &["config.json", "git blob sha1", "deleted"],
    );
    let snap = repo_dir(&home, "models--tallow-test--tiny-qwen2")
        .join("snapshots")
        .join(hub.commit(MODEL, "main"));
    assert!(!snap.join("config.json").exists());
}

/// `eval --model OWNER/NAME` equals eval of the local folder; `hf://datasets/...` equals the
/// local file.
#[test]
fn eval_from_hub_equals_local() {
    let hub = HubServer::start();
    let home = scratch("hub-eval");
    let e = env(&hub.url, &home, &[]);
    let local = model_dir("tiny-qwen2");
    let loss = |model: &str, data: &str| {
        let r = tallow_env(["eval", "--model", model, "--data", data, "--json"], &e);
        assert_eq!(r.code, 0, "eval {model} {data}: {}", r.stderr);
        let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let text = data_file("text");
    let messages = data_file("messages");
    let want = loss(local.to_str().unwrap(), text.to_str().unwrap());
    assert_eq!(loss(MODEL, text.to_str().unwrap()), want);
    let want = loss(local.to_str().unwrap(), messages.to_str().unwrap());
    let hf = format!("hf://datasets/{DATASET}/data/train.jsonl");
    assert_eq!(loss(MODEL, &hf), want);
    let hf = format!("hf://datasets/{DATASET}/data/train.parquet");
    assert_eq!(
        loss(MODEL, &hf),
        want,
        "the parquet file of the hub dataset"
    );
    assert!(repo_dir(&home, "datasets--tallow-test--chat")
        .join("refs/main")
        .exists());
}

/// `train` with `model.path` a hub id and `data.train` an `hf://` file; the adapter names the
/// hub id as its base model.
#[test]
fn train_from_hub() {
    let hub = HubServer::start();
    let home = scratch("hub-train");
    let cfg = home.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = \"{MODEL}\"\ndtype = \"f32\"\n[lora]\nrank = 2\n[data]\ntrain = \"hf://datasets/{DATASET}/data/train.jsonl\"\nmax_seq_len = 32\n[train]\nmax_steps = 1\noutput_dir = \"{}\"\n",
            home.join("run").display()
        ),
    )
    .unwrap();
    let r = tallow_env(
        ["train", "--config", cfg.to_str().unwrap(), "--quiet"],
        &env(&hub.url, &home, &[]),
    );
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let ac = std::fs::read_to_string(home.join("run/adapter/adapter_config.json")).unwrap();
    let ac: serde_json::Value = serde_json::from_str(&ac).unwrap();
    assert_eq!(ac["base_model_name_or_path"], MODEL);
}
