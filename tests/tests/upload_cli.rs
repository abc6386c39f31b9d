//! Issue 21: `tallow upload REPO_ID PATH` and `train.push_to_hub`, against the write endpoints of
//! the loopback hub (`tallow_tests::hub_server`): repo creation, LFS through the batch API with
//! sha256, one commit, the model card, the errors (bad id, no token, 401, 403, missing PATH, bad
//! branch), and cut connections that a retry finishes without a half commit.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use tallow_tests::hub_server::{
    hex, HubServer, UploadCut, DATASET, MODEL, OTHER_TOKEN, READ_TOKEN, TOKEN,
};
use tallow_tests::*;

/// `HF_ENDPOINT` = the server, `HF_HOME` = `home`, and `HF_TOKEN` when given.
fn env(url: &str, home: &Path, token: Option<&str>) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("HF_ENDPOINT", url.to_string()),
        ("HF_HOME", home.display().to_string()),
    ];
    if let Some(t) = token {
        v.push(("HF_TOKEN", t.to_string()));
    }
    v
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

fn fails(r: &Run, what: &str, needles: &[&str]) {
    assert_eq!(r.code, 1, "{what} should fail:\n{}\n{}", r.stdout, r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{what}: no {n:?} in:\n{}", r.stderr);
    }
}

fn ok(r: &Run, what: &str) {
    assert_eq!(r.code, 0, "{what} failed:\n{}\n{}", r.stdout, r.stderr);
}

/// Bytes that are not all alike (an LCG), `n` long.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

/// An adapter-like dir: a safetensors over the hub's 10 MiB LFS threshold, two small JSON
/// files, a nested text file, and a hidden file that is not uploaded. Returns path -> bytes of
/// what should be uploaded.
fn adapter_dir(dir: &Path, seed: u64) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    files.insert(
        "adapter_model.safetensors".to_string(),
        noise((10 << 20) + 4321, seed),
    );
    files.insert(
        "adapter_config.json".to_string(),
        format!(
            "{{\"base_model_name_or_path\": \"{MODEL}\", \"peft_type\": \"LORA\", \"r\": 2, \
             \"lora_alpha\": 4, \"target_modules\": [\"v_proj\", \"q_proj\"]}}"
        )
        .into_bytes(),
    );
    files.insert(
        "tokenizer_config.json".to_string(),
        format!("{{\"seed\": {seed}}}").into_bytes(),
    );
    files.insert("notes/run.txt".to_string(), b"small text\n".to_vec());
    for (p, b) in &files {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b).unwrap();
    }
    std::fs::write(dir.join(".secret"), b"not uploaded").unwrap();
    files
}

/// Requests whose log line starts with `prefix`.
fn count(hub: &HubServer, prefix: &str) -> usize {
    hub.requests()
        .iter()
        .filter(|r| r.starts_with(prefix))
        .count()
}

/// Every file under `dir`, relative -> bytes.
fn read_tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out)
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `tallow download REPO --include * --local-dir DIR` with a token: the repo's files.
fn download_all(
    hub: &HubServer,
    home: &Path,
    repo: &str,
    dest: &Path,
) -> BTreeMap<String, Vec<u8>> {
    let r = tallow_env(
        [
            "download",
            repo,
            "--include",
            "*",
            "--local-dir",
            dest.to_str().unwrap(),
            "--quiet",
        ],
        &env(&hub.url, &home.join("dl-home"), Some(TOKEN)),
    );
    ok(&r, "download");
    read_tree(dest)
}

/// One commit with every file; the safetensors through LFS (its sha256 sent, its bytes PUT once),
/// the small files in the commit itself; a model card added; and `tallow download` of the new
/// repo gives back the same bytes. A second upload sends no LFS bytes the hub already holds.
#[test]
fn upload_then_download_back() {
    let hub = HubServer::start();
    let home = scratch("upload-roundtrip");
    let dir = home.join("adapter");
    let files = adapter_dir(&dir, 1);
    let repo = "tallow-test/my-adapter";
    let r = tallow_env(
        ["upload", repo, dir.to_str().unwrap()],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "upload");
    let commits = hub.commits_made(repo);
    assert_eq!(commits.len(), 1, "{commits:?}");
    assert_eq!(commits[0].0, "main");
    assert_eq!(
        r.stdout.trim(),
        format!("{}/{repo}/commit/{}", hub.url, commits[0].1)
    );
    assert_eq!(hub.repo_private(repo), Some(false));

    // LFS: exactly the safetensors, PUT once under its sha256; nothing else PUT.
    let st = &files["adapter_model.safetensors"];
    assert_eq!(hub.lfs_objects(), vec![sha256(st)]);
    assert_eq!(count(&hub, &format!("PUT /lfs-upload/{}", sha256(st))), 1);
    assert_eq!(count(&hub, "PUT "), 1);
    assert!(r.stderr.contains("1 through LFS, 1 sent"), "{}", r.stderr);

    // The server's commit: the files, the generated card, the repo's .gitattributes.
    let on_hub = hub.files_at(repo, "main");
    for (p, b) in &files {
        assert!(on_hub.get(p) == Some(b), "{p} differs on the hub");
    }
    let mut names: Vec<&str> = on_hub.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(
        names,
        [
            ".gitattributes",
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
            "notes/run.txt",
            "tokenizer_config.json"
        ]
    );
    let card = String::from_utf8(on_hub["README.md"].clone()).unwrap();
    for want in [
        "---\nbase_model: tallow-test/tiny-qwen2\n",
        "library_name: peft\n",
        "pipeline_tag: text-generation\n",
        "- base_model:adapter:tallow-test/tiny-qwen2\n",
        "- lora\n",
        "- tallow\n",
        "A LoRA adapter (rank 2, alpha 4, on q_proj, v_proj)",
        "AutoPeftModelForCausalLM.from_pretrained(\"tallow-test/my-adapter\")",
    ] {
        assert!(card.contains(want), "card lacks {want:?}:\n{card}");
    }

    // The download path reads back what was committed, byte for byte.
    let back = download_all(&hub, &home, repo, &home.join("back"));
    for (p, b) in &files {
        assert!(back.get(p) == Some(b), "{p} differs after download");
    }
    assert_eq!(back["README.md"], on_hub["README.md"]);

    // Again, with a README.md of our own and another small file: a second commit, the card kept
    // as written, and no LFS bytes sent (the hub has the object).
    std::fs::write(dir.join("README.md"), "# mine\n").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{\"seed\": 2}").unwrap();
    let r = tallow_env(
        ["upload", repo, dir.to_str().unwrap(), "-m", "second"],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "second upload");
    assert!(r.stderr.contains("1 through LFS, 0 sent"), "{}", r.stderr);
    assert!(!r.stderr.contains("adding a model card"), "{}", r.stderr);
    assert_eq!(count(&hub, "PUT "), 1);
    assert_eq!(hub.commits_made(repo).len(), 2);
    let on_hub = hub.files_at(repo, "main");
    assert_eq!(on_hub["README.md"], b"# mine\n");
    assert_eq!(on_hub["tokenizer_config.json"], b"{\"seed\": 2}");
    assert_eq!(on_hub["adapter_model.safetensors"], *st);
}

/// A cut connection in the middle of the LFS PUT or of the commit POST: the next attempt asks
/// the batch endpoint again, sends what is missing, and makes exactly one commit with every file.
#[test]
fn cut_uploads_are_retried() {
    for (cut, what) in [
        (UploadCut::LfsPut, "PUT "),
        (
            UploadCut::Commit,
            "POST /api/models/tallow-test/cut/commit/",
        ),
    ] {
        let hub = HubServer::start();
        let home = scratch(&format!("upload-cut-{cut:?}"));
        let dir = home.join("adapter");
        let files = adapter_dir(&dir, 3);
        hub.cut_upload_once(cut);
        let repo = "tallow-test/cut";
        let r = tallow_env(
            ["upload", repo, dir.to_str().unwrap()],
            &env(&hub.url, &home, Some(TOKEN)),
        );
        ok(&r, &format!("upload cut at {cut:?}"));
        assert!(r.stderr.contains("attempt 2 of 4"), "{cut:?}: {}", r.stderr);
        assert!(
            r.stderr.contains("after 2 attempts"),
            "{cut:?}: {}",
            r.stderr
        );
        // Two tries of the cut request, two batch calls, one commit.
        assert_eq!(count(&hub, what), 2, "{cut:?}: {:?}", hub.requests());
        assert_eq!(
            count(&hub, "POST /tallow-test/cut.git/info/lfs/objects/batch"),
            2
        );
        assert_eq!(hub.commits_made(repo).len(), 1, "{cut:?}");
        let on_hub = hub.files_at(repo, "main");
        for (p, b) in &files {
            assert!(on_hub.get(p) == Some(b), "{cut:?}: {p} differs on the hub");
        }
        // After a cut commit the object was already there: the retry sent no second PUT.
        let puts = if cut == UploadCut::LfsPut { 2 } else { 1 };
        assert_eq!(count(&hub, "PUT "), puts, "{cut:?}");
    }
}

/// One raw HTTP request to the loopback server: (status, body).
fn raw(
    url: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += "\r\n";
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// The server half of "nothing half-committed": a commit naming an LFS object that was never
/// uploaded is refused (422) and leaves the branch where it was.
#[test]
fn commit_without_its_lfs_object_is_refused() {
    let hub = HubServer::start();
    let auth = format!("Bearer {TOKEN}");
    let (status, _) = raw(
        &hub.url,
        "POST",
        "/api/repos/create",
        &[("Authorization", &auth)],
        br#"{"name": "half", "organization": "tallow-test", "private": false, "type": "model"}"#,
    );
    assert_eq!(status, 200);
    let before = hub.commit("tallow-test/half", "main");
    let oid = "ab".repeat(32);
    let payload = format!(
        "{{\"key\":\"header\",\"value\":{{\"summary\":\"s\",\"description\":\"\"}}}}\n\
         {{\"key\":\"file\",\"value\":{{\"content\":\"aGk=\",\"path\":\"a.txt\",\"encoding\":\"base64\"}}}}\n\
         {{\"key\":\"lfsFile\",\"value\":{{\"path\":\"w.safetensors\",\"algo\":\"sha256\",\"oid\":\"{oid}\",\"size\":5}}}}\n"
    );
    let (status, body) = raw(
        &hub.url,
        "POST",
        "/api/models/tallow-test/half/commit/main",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/x-ndjson"),
        ],
        payload.as_bytes(),
    );
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("never uploaded"), "{body}");
    assert_eq!(hub.commit("tallow-test/half", "main"), before);
    assert!(hub.commits_made("tallow-test/half").is_empty());
    assert!(!hub
        .files_at("tallow-test/half", "main")
        .contains_key("a.txt"));
}

/// Each bad input has its own message and exit 1, and the name checks make no request at all.
#[test]
fn upload_errors() {
    let hub = HubServer::start();
    let home = scratch("upload-errors");
    let dir = home.join("adapter");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), "{}").unwrap();
    let d = dir.to_str().unwrap();
    let e = |token| env(&hub.url, &home, token);

    // Names: checked before anything is read or sent.
    let r = tallow_env(["upload", "me/my model", d], &e(Some(TOKEN)));
    fails(
        &r,
        "bad id",
        &["repo id \"me/my model\" is not valid", "character ' '"],
    );
    let r = tallow_env(["upload", "just-a-name", d], &e(Some(TOKEN)));
    fails(&r, "no owner", &["write OWNER/NAME"]);
    let r = tallow_env(["upload", "me/a--b", d], &e(Some(TOKEN)));
    fails(&r, "double dash", &["`--` or `..`"]);
    let r = tallow_env(
        ["upload", "tallow-test/x", d, "--revision", "a..b"],
        &e(Some(TOKEN)),
    );
    fails(
        &r,
        "bad branch",
        &["--revision branch \"a..b\" is not valid"],
    );
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());

    // PATH missing.
    let missing = home.join("nope");
    let r = tallow_env(
        ["upload", "tallow-test/x", missing.to_str().unwrap()],
        &e(Some(TOKEN)),
    );
    fails(&r, "missing PATH", &["PATH", "nope does not exist"]);
    let empty = home.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let r = tallow_env(
        ["upload", "tallow-test/x", empty.to_str().unwrap()],
        &e(Some(TOKEN)),
    );
    fails(&r, "empty PATH", &["has no files to upload"]);

    // No token (neither HF_TOKEN nor a token file in HF_HOME).
    let r = tallow_env(["upload", "tallow-test/x", d], &e(None));
    fails(
        &r,
        "no token",
        &[
            "needs a token with write access",
            "HF_TOKEN",
            "huggingface-cli login",
        ],
    );
    assert!(hub.requests().is_empty(), "{:?}", hub.requests());

    // The token file is read when HF_TOKEN is not set; a wrong one is a 401.
    std::fs::write(home.join("token"), "hf_wrong\n").unwrap();
    let r = tallow_env(["upload", "tallow-test/x", d], &e(None));
    fails(
        &r,
        "401",
        &[
            "token rejected",
            "HTTP 401",
            &format!("in {}", home.join("token").display()),
        ],
    );
    let r = tallow_env(["upload", "tallow-test/x", d], &e(Some("hf_wrong")));
    fails(&r, "401 env", &["token rejected", "from HF_TOKEN"]);

    // 403: another user's namespace, a repo that exists there, and a read-only token.
    let r = tallow_env(["upload", "someone-else/new", d], &e(Some(TOKEN)));
    fails(
        &r,
        "403 namespace",
        &["not allowed to write to someone-else/new", "tallow-test"],
    );
    let theirs = "someone-else/their-model";
    ok(
        &tallow_env(["upload", theirs, d], &e(Some(OTHER_TOKEN))),
        "their upload",
    );
    let r = tallow_env(["upload", theirs, d], &e(Some(TOKEN)));
    fails(
        &r,
        "403 their repo",
        &[
            &format!("not allowed to write to {theirs}"),
            "does not have write access",
        ],
    );
    assert_eq!(hub.commits_made(theirs).len(), 1);
    let r = tallow_env(["upload", "tallow-test/ro", d], &e(Some(READ_TOKEN)));
    fails(
        &r,
        "read-only token",
        &["not allowed to write to tallow-test/ro"],
    );
    assert_eq!(hub.repo_private("tallow-test/ro"), None);
}

/// `--private` makes a private repo (downloads need the token); `--revision` to a branch that
/// does not exist creates it from main, and the commit lands there, not on main.
#[test]
fn private_repo_and_new_branch() {
    let hub = HubServer::start();
    let home = scratch("upload-private");
    let dir = home.join("adapter");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), "{\"a\": 1}").unwrap();
    let repo = "tallow-test/private-one";
    let r = tallow_env(
        ["upload", repo, dir.to_str().unwrap(), "--private"],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "private upload");
    assert_eq!(hub.repo_private(repo), Some(true));
    // A full model (no adapter_config.json): library_name transformers.
    let card = String::from_utf8(hub.files_at(repo, "main")["README.md"].clone()).unwrap();
    assert!(card.contains("library_name: transformers\n"), "{card}");
    assert!(!card.contains("base_model"), "{card}");
    let r = tallow_env(
        ["download", repo, "--include", "*", "--quiet"],
        &env(&hub.url, &home.join("anon"), None),
    );
    assert_eq!(r.code, 1, "a private repo without a token: {}", r.stderr);
    let back = download_all(&hub, &home, repo, &home.join("back"));
    assert_eq!(back["config.json"], b"{\"a\": 1}");

    let main_before = hub.commit(repo, "main");
    std::fs::write(dir.join("config.json"), "{\"a\": 2}").unwrap();
    let r = tallow_env(
        [
            "upload",
            repo,
            dir.to_str().unwrap(),
            "--revision",
            "exp/lr-1e-4",
        ],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "upload to a new branch");
    assert!(
        r.stderr
            .contains("created branch exp/lr-1e-4 of tallow-test/private-one from main"),
        "{}",
        r.stderr
    );
    assert_eq!(hub.commit(repo, "main"), main_before);
    assert_eq!(
        hub.files_at(repo, "exp/lr-1e-4")["config.json"],
        b"{\"a\": 2}"
    );
    let made = hub.commits_made(repo);
    assert_eq!(made.last().unwrap().0, "exp/lr-1e-4");
    // Uploading to it again: the branch exists, nothing is created.
    let r = tallow_env(
        [
            "upload",
            repo,
            dir.to_str().unwrap(),
            "--revision",
            "exp/lr-1e-4",
        ],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "upload to the branch again");
    assert!(!r.stderr.contains("created branch"), "{}", r.stderr);
}

fn train_config(home: &Path, extra: &str) -> PathBuf {
    let cfg = home.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = \"{MODEL}\"\ndtype = \"f32\"\n[lora]\nrank = 2\n[data]\ntrain = \"hf://datasets/{DATASET}/data/train.jsonl\"\nmax_seq_len = 32\n[train]\nmax_steps = 2\noutput_dir = \"{}\"\n{extra}\n",
            home.join("run").display()
        ),
    )
    .unwrap();
    cfg
}

/// `train.push_to_hub`: after the final save the adapter and a card with the run's data, config
/// and final loss are one commit; downloading the repo gives the local adapter back.
#[test]
fn train_pushes_to_hub() {
    let hub = HubServer::start();
    let home = scratch("upload-train");
    let repo = "tallow-test/tiny-run";
    let cfg = train_config(
        &home,
        &format!("push_to_hub = \"{repo}\"\nhub_private_repo = true"),
    );
    let r = tallow_env(
        ["train", "--config", cfg.to_str().unwrap(), "--quiet"],
        &env(&hub.url, &home, Some(TOKEN)),
    );
    ok(&r, "train with push_to_hub");
    assert!(
        r.stderr
            .contains("will upload to tallow-test/tiny-run as tallow-test"),
        "{}",
        r.stderr
    );
    let made = hub.commits_made(repo);
    assert_eq!(made.len(), 1);
    assert!(
        r.stdout.contains(&format!(
            "uploaded: {}/{repo}/commit/{}",
            hub.url, made[0].1
        )),
        "{}",
        r.stdout
    );
    assert_eq!(hub.repo_private(repo), Some(true));
    // The whoami check came before anything was downloaded for training.
    let reqs = hub.requests();
    assert!(reqs[0].starts_with("GET /api/whoami-v2"), "{reqs:?}");

    let adapter = read_tree(&home.join("run/adapter"));
    let back = download_all(&hub, &home, repo, &home.join("back"));
    for (p, b) in &adapter {
        assert!(back.get(p) == Some(b), "{p} differs after the round trip");
    }
    let card = String::from_utf8(back["README.md"].clone()).unwrap();
    let metrics = std::fs::read_to_string(home.join("run/metrics.jsonl")).unwrap();
    let last: serde_json::Value =
        serde_json::from_str(metrics.lines().rfind(|l| l.contains("\"loss\"")).unwrap()).unwrap();
    let config_toml = std::fs::read_to_string(home.join("run/config.toml")).unwrap();
    for want in [
        "base_model: tallow-test/tiny-qwen2\n".to_string(),
        "datasets:\n- tallow-test/chat\n".into(),
        "library_name: peft\n".into(),
        "- base_model:adapter:tallow-test/tiny-qwen2\n".into(),
        format!("- train: `hf://datasets/{DATASET}/data/train.jsonl`"),
        format!(
            "| last train loss | 2 | {:.4} |",
            last["loss"].as_f64().unwrap()
        ),
        format!("```toml\n{}\n```", config_toml.trim_end()),
    ] {
        assert!(card.contains(&want), "card lacks {want:?}:\n{card}");
    }
}

/// Before training: a bad `push_to_hub` id fails at config load, a missing or read-only token
/// fails before any step (no adapter written). At the end: a failed upload leaves the outputs,
/// prints the `tallow upload` command to retry with and exits 1.
#[test]
fn train_push_errors() {
    let hub = HubServer::start();
    let home = scratch("upload-train-errors");
    let run = |extra: &str, token: Option<&str>| {
        let cfg = train_config(&home, extra);
        tallow_env(
            ["train", "--config", cfg.to_str().unwrap(), "--quiet"],
            &env(&hub.url, &home, token),
        )
    };
    let r = run("push_to_hub = \"me/bad name\"", Some(TOKEN));
    fails(
        &r,
        "bad id",
        &["`train.push_to_hub` must be a hub repo id OWNER/NAME"],
    );
    let r = run("push_to_hub = \"tallow-test/x\"", None);
    fails(
        &r,
        "no token",
        &[
            "train.push_to_hub = \"tallow-test/x\": checked before training",
            "needs a token",
        ],
    );
    let r = run("push_to_hub = \"tallow-test/x\"", Some(READ_TOKEN));
    fails(&r, "read token", &["is read-only"]);
    let r = run("push_to_hub = \"tallow-test/x\"", Some("hf_wrong"));
    fails(&r, "bad token", &["token rejected"]);
    assert!(!home.join("run/adapter").exists(), "training ran");
    assert!(
        hub.requests()
            .iter()
            .all(|r| r.starts_with("GET /api/whoami-v2")),
        "{:?}",
        hub.requests()
    );

    // Allowed at the start (a valid write token), refused at the end (not the user's namespace).
    let r = run("push_to_hub = \"someone-else/x\"", Some(TOKEN));
    let adapter = home.join("run/adapter");
    fails(
        &r,
        "upload at the end",
        &[
            "training finished",
            &format!(
                "retry with: tallow upload someone-else/x {}",
                adapter.display()
            ),
            "not allowed to write to someone-else/x",
        ],
    );
    assert!(adapter.join("adapter_model.safetensors").exists());
    assert!(
        !adapter.join("README.md").exists(),
        "the card is not written into the run"
    );
}
