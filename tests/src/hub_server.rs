//! A loopback Hugging Face Hub for the hub tests: std `TcpListener`, one thread per connection,
//! `Connection: close`. It speaks the part of the hub's API the client uses:
//!
//! - `GET /api/{models,datasets}/OWNER/NAME[/revision/REV]`: `{"id", "sha", "private",
//!   "siblings": [{"rfilename"}]}` (no revision: `main`).
//! - `GET /api/{models,datasets}/OWNER/NAME/tree/REV[/PATH][?recursive=true]`: the entries under
//!   PATH, `{"type": "file", "oid", "size", "path"[, "lfs": {"oid", "size", "pointerSize"}]}` or
//!   `{"type": "directory", "oid", "path"}`, in one page (huggingface_hub's `list_repo_tree`,
//!   which its `snapshot_download` lists a snapshot with).
//! - `HEAD|GET /[datasets/]OWNER/NAME/resolve/REV/PATH`: `X-Repo-Commit`, `ETag`; LFS files
//!   (`*.safetensors`, `*.bin`, `*.parquet`) answer 302 to `CDN/cdn/<sha256>` with
//!   `X-Linked-Etag` (the sha256) and `X-Linked-Size`, as the hub does; other files are served
//!   directly.
//! - `GET CDN/cdn/<sha256>` with `Range: bytes=N-`: 206 + `Content-Range`. CDN
//!   ([`HubServer::cdn_url`]) is a second listener, another origin than the hub's, as the hub's
//!   CDN is another host: huggingface_hub follows a redirect that stays on the hub's origin and
//!   reads the file's metadata from the answer at its end, so a CDN on the hub's own origin
//!   loses `X-Repo-Commit` (found by scripts/check_hub_server.py).
//! - Errors with the hub's `X-Error-Code`: `RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
//!   `GatedRepo` (401 without a token, 403 with a wrong one).
//!
//! The write endpoints (uploads: repo creation, branches, preupload, LFS, commits) are in their
//! own section at the end of the file, with their own doc.
//!
//! Checked from the other side: `scripts/make_hub_client_fixtures.py` runs the real Python
//! huggingface_hub (2.4.0) against this server (`src/bin/hub-server.rs`) and records the
//! exchange; `hub_cli::real_client_exchange_replays` replays it here.
//!
//! Switches: [`HubServer::cut_once`] sends half of a file's bytes then drops the connection
//! (once); [`HubServer::corrupt`] serves a file with its bytes flipped (hash mismatch).
//!
//! Repos, built from `tests/fixtures/`:
//! - `tallow-test/tiny-qwen2`: the tiny-qwen2 fixture plus `extra.json`, `README.md`,
//!   `pytorch_model.bin` and `original/params.json`; tag `v1` (older commit, `extra.json` =
//!   `{"rev":"v1"}`) and `main` (`{"rev":"main"}`).
//! - `tallow-test/gated`: the same files as main, needing `Authorization: Bearer `[`TOKEN`].
//! - dataset `tallow-test/chat`: `data/train.jsonl` (messages fixture), `data/text.jsonl`,
//!   `data/train.parquet` (the messages fixture as parquet).
//! - whole datasets from `tests/fixtures/hub_datasets/` ([`dataset_repos`]): `sharded`,
//!   `jsonl`, `configs`, and the broken `bad-parquet` and `bad-row`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// The token the gated repo accepts.
pub const TOKEN: &str = "hf_tallow_test_token";
pub const MODEL: &str = "tallow-test/tiny-qwen2";
pub const GATED: &str = "tallow-test/gated";
pub const DATASET: &str = "tallow-test/chat";

#[derive(Clone)]
struct File {
    bytes: Vec<u8>,
    sha256: String,
    /// git's blob id: sha1 of `blob {len}\0{bytes}` (the ETag of a non-LFS file).
    git_sha1: String,
}

impl File {
    fn new(bytes: Vec<u8>) -> File {
        let sha256 = hex(&Sha256::digest(&bytes));
        let mut h = sha1::Sha1::new();
        h.update(format!("blob {}\0", bytes.len()).as_bytes());
        h.update(&bytes);
        let git_sha1 = hex(&h.finalize());
        File {
            bytes,
            sha256,
            git_sha1,
        }
    }
}

struct RepoDef {
    /// "models" or "datasets"
    kind: &'static str,
    id: String,
    /// branch / tag -> commit
    refs: BTreeMap<String, String>,
    /// commit -> path -> file
    commits: BTreeMap<String, BTreeMap<String, File>>,
    token: Option<String>,
}

#[derive(Default)]
struct Switches {
    cut_once: Option<String>,
    corrupt: Option<String>,
    /// "METHOD PATH RANGE" of every request, in order.
    log: Vec<String>,
}

pub struct HubServer {
    /// The hub's endpoint (`HF_ENDPOINT`), `http://127.0.0.1:PORT`.
    pub url: String,
    /// Where LFS files are redirected to: another port, so another origin.
    pub cdn_url: String,
    /// Behind a lock: uploads add repos, branches and commits.
    repos: Arc<Mutex<Vec<RepoDef>>>,
    switches: Arc<Mutex<Switches>>,
    writes: Arc<Mutex<Writes>>,
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fake 40-hex commit id.
fn commit_id(seed: &str) -> String {
    hex(&Sha256::digest(seed.as_bytes()))[..40].to_string()
}

fn is_lfs(path: &str) -> bool {
    path.ends_with(".safetensors") || path.ends_with(".bin") || path.ends_with(".parquet")
}

impl HubServer {
    /// Starts the server on a free loopback port; it lives until the test process ends.
    pub fn start() -> HubServer {
        let mut base = BTreeMap::new();
        for e in std::fs::read_dir(crate::model_dir("tiny-qwen2")).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            base.insert(name, File::new(std::fs::read(e.path()).unwrap()));
        }
        base.insert("README.md".into(), File::new(b"# tiny-qwen2\n".to_vec()));
        base.insert(
            "pytorch_model.bin".into(),
            File::new(b"not used: a .bin duplicate".to_vec()),
        );
        base.insert(
            "original/params.json".into(),
            File::new(b"{\"dim\": 64}".to_vec()),
        );
        let with_extra = |rev: &str| {
            let mut files = base.clone();
            files.insert(
                "extra.json".into(),
                File::new(format!("{{\"rev\":\"{rev}\"}}").into_bytes()),
            );
            files
        };
        let (v1, main) = (commit_id("tiny-qwen2 v1"), commit_id("tiny-qwen2 main"));
        let model = RepoDef {
            kind: "models",
            id: MODEL.into(),
            refs: [("main".into(), main.clone()), ("v1".into(), v1.clone())].into(),
            commits: [(v1, with_extra("v1")), (main, with_extra("main"))].into(),
            token: None,
        };
        let gated_commit = commit_id("gated main");
        let gated = RepoDef {
            kind: "models",
            id: GATED.into(),
            refs: [("main".into(), gated_commit.clone())].into(),
            commits: [(gated_commit, with_extra("main"))].into(),
            token: Some(TOKEN.into()),
        };
        let data_commit = commit_id("chat main");
        let mut data_files = BTreeMap::new();
        for (name, fixture) in [("train", "messages"), ("text", "text")] {
            data_files.insert(
                format!("data/{name}.jsonl"),
                File::new(std::fs::read(crate::data_file(fixture)).unwrap()),
            );
        }
        data_files.insert(
            "data/train.parquet".into(),
            File::new(
                std::fs::read(crate::data_file("messages").with_extension("parquet")).unwrap(),
            ),
        );
        let dataset = RepoDef {
            kind: "datasets",
            id: DATASET.into(),
            refs: [("main".into(), data_commit.clone())].into(),
            commits: [(data_commit, data_files)].into(),
            token: None,
        };

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cdn_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn_url = format!("http://{}", cdn_listener.local_addr().unwrap());
        let server = HubServer {
            url: url.clone(),
            cdn_url: cdn_url.clone(),
            repos: Arc::new(Mutex::new(
                [vec![model, gated, dataset], dataset_repos()]
                    .into_iter()
                    .flatten()
                    .collect(),
            )),
            switches: Arc::new(Mutex::new(Switches::default())),
            writes: Arc::new(Mutex::new(Writes::default())),
        };
        let (repos, switches) = (server.repos.clone(), server.switches.clone());
        let writes = server.writes.clone();
        let urls = Urls {
            hub: url,
            cdn: cdn_url,
        };
        for (listener, cdn) in [(listener, false), (cdn_listener, true)] {
            let (repos, switches, writes, urls) = (
                repos.clone(),
                switches.clone(),
                writes.clone(),
                urls.clone(),
            );
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let (repos, switches) = (repos.clone(), switches.clone());
                    let (writes, urls) = (writes.clone(), urls.clone());
                    std::thread::spawn(move || {
                        let _ = match cdn {
                            true => handle_cdn(stream, &repos, &switches),
                            false => handle(stream, &repos, &switches, &writes, &urls),
                        };
                    });
                }
            });
        }
        server
    }

    /// The commit a ref of a repo points to.
    pub fn commit(&self, repo: &str, rev: &str) -> String {
        let repos = self.repos.lock().unwrap();
        let r = repos.iter().find(|r| r.id == repo).unwrap();
        r.refs[rev].clone()
    }

    /// The bytes of a file at a ref.
    pub fn file(&self, repo: &str, rev: &str, path: &str) -> Vec<u8> {
        let repos = self.repos.lock().unwrap();
        let r = repos.iter().find(|r| r.id == repo).unwrap();
        r.commits[&r.refs[rev]][path].bytes.clone()
    }

    /// The next transfer of a file with this name stops after half its bytes.
    pub fn cut_once(&self, path: &str) {
        self.switches.lock().unwrap().cut_once = Some(path.into());
    }

    /// Every transfer of a file with this name has its bytes flipped.
    pub fn corrupt(&self, path: &str) {
        self.switches.lock().unwrap().corrupt = Some(path.into());
    }

    /// "METHOD PATH RANGE" of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.switches.lock().unwrap().log.clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Whole datasets (`hf://datasets/OWNER/NAME`): repos made from the directories of
// tests/fixtures/hub_datasets/ (scripts/make_hub_dataset_fixtures.py).

/// 3 parquet train shards (`data/train-0000{0,1,2}-of-00003.parquet`, 4 messages rows each)
/// and `data/test-00000-of-00001.parquet` (3 rows); tag `v1`: only the first train shard and
/// the test shard.
pub const DS_SHARDED: &str = "tallow-test/sharded";
/// `train/part-0.jsonl`, `train/part-1.jsonl.gz`, `test/part-0.jsonl` (text rows).
pub const DS_JSONL: &str = "tallow-test/jsonl";
/// README `configs:`: `chat` (default; parquet under `chat/`, split train only) and `text`
/// (`text/train.parquet`, `text/test.parquet`).
pub const DS_CONFIGS: &str = "tallow-test/configs";
/// `sharded` with `data/train-00001-of-00003.parquet` cut to half its bytes.
pub const DS_BAD_PARQUET: &str = "tallow-test/bad-parquet";
/// `jsonl` with line 2 of `train/part-0.jsonl` not valid JSON.
pub const DS_BAD_ROW: &str = "tallow-test/bad-row";

/// `tests/fixtures/hub_datasets/<name>` (the repo's files) or `<name>.<split>.jsonl` (its rows).
pub fn hub_dataset_dir(name: &str) -> std::path::PathBuf {
    crate::fixtures().join("hub_datasets").join(name)
}

/// Every file under a fixture dataset dir, by repo path.
fn dataset_files(name: &str) -> BTreeMap<String, File> {
    fn walk(root: &std::path::Path, dir: &std::path::Path, out: &mut BTreeMap<String, File>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                out.insert(rel, File::new(std::fs::read(&p).unwrap()));
            }
        }
    }
    let root = hub_dataset_dir(name);
    let mut out = BTreeMap::new();
    walk(&root, &root, &mut out);
    out
}

fn dataset_repo(id: &str, files: BTreeMap<String, File>) -> RepoDef {
    let commit = commit_id(&format!("{id} main"));
    RepoDef {
        kind: "datasets",
        id: id.into(),
        refs: [("main".into(), commit.clone())].into(),
        commits: [(commit, files)].into(),
        token: None,
    }
}

fn dataset_repos() -> Vec<RepoDef> {
    let sharded = dataset_files("sharded");
    let mut sharded_repo = dataset_repo(DS_SHARDED, sharded.clone());
    let v1: BTreeMap<String, File> = sharded
        .iter()
        .filter(|(p, _)| !p.starts_with("data/train-0000") || p.starts_with("data/train-00000"))
        .map(|(p, f)| (p.clone(), f.clone()))
        .collect();
    let v1_commit = commit_id("sharded v1");
    sharded_repo.refs.insert("v1".into(), v1_commit.clone());
    sharded_repo.commits.insert(v1_commit, v1);

    let mut bad_parquet = sharded;
    let cut = "data/train-00001-of-00003.parquet";
    let bytes = &bad_parquet[cut].bytes;
    let half = bytes[..bytes.len() / 2].to_vec();
    bad_parquet.insert(cut.into(), File::new(half));

    let mut bad_row = dataset_files("jsonl");
    let part = "train/part-0.jsonl";
    let text = String::from_utf8(bad_row[part].bytes.clone()).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[1] = "{\"text\": \"cut off";
    bad_row.insert(
        part.into(),
        File::new((lines.join("\n") + "\n").into_bytes()),
    );

    vec![
        sharded_repo,
        dataset_repo(DS_JSONL, dataset_files("jsonl")),
        dataset_repo(DS_CONFIGS, dataset_files("configs")),
        dataset_repo(DS_BAD_PARQUET, bad_parquet),
        dataset_repo(DS_BAD_ROW, bad_row),
    ]
}

/// The hub's and the CDN's base URLs.
#[derive(Clone)]
struct Urls {
    hub: String,
    cdn: String,
}

struct Request {
    method: String,
    /// The request target's path, without its query.
    path: String,
    /// The query (after `?`), empty without one.
    query: String,
    headers: BTreeMap<String, String>,
    /// Body bytes read along with the headers (the rest is still on the stream).
    body_start: Vec<u8>,
}

fn read_request(stream: &TcpStream) -> std::io::Result<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let (path, query) = (path.to_string(), query.to_string());
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    // A body (uploads) is read by `read_body`, starting with what the reader buffered.
    let body_start = reader.buffer().to_vec();
    Ok(Request {
        method,
        path,
        query,
        headers,
        body_start,
    })
}

/// Status line + headers (+ body unless HEAD), then close.
fn respond(
    mut stream: &TcpStream,
    head_only: bool,
    status: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut out = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        out += &format!("{k}: {v}\r\n");
    }
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        out += &format!("Content-Length: {}\r\n", body.len());
    }
    out += "\r\n";
    stream.write_all(out.as_bytes())?;
    if !head_only {
        stream.write_all(body)?;
    }
    stream.flush()
}

fn error(stream: &TcpStream, head: bool, status: &str, code: &str) -> std::io::Result<()> {
    let body = format!("{{\"error\": \"{code}\"}}");
    respond(
        stream,
        head,
        status,
        &[
            ("X-Error-Code", code.into()),
            ("Content-Type", "application/json".into()),
        ],
        body.as_bytes(),
    )
}

/// Reads the request and logs it ("METHOD PATH[?QUERY] RANGE").
fn read_logged(stream: &TcpStream, switches: &Mutex<Switches>) -> std::io::Result<Request> {
    let req = read_request(stream)?;
    let range = req.headers.get("range").cloned().unwrap_or_default();
    let query = match req.query.as_str() {
        "" => String::new(),
        q => format!("?{q}"),
    };
    switches
        .lock()
        .unwrap()
        .log
        .push(format!("{} {}{query} {range}", req.method, req.path));
    Ok(req)
}

/// The CDN's one route, `GET|HEAD /cdn/<sha256>`: any file a repo holds, by its sha256.
fn handle_cdn(
    stream: TcpStream,
    repos: &Mutex<Vec<RepoDef>>,
    switches: &Mutex<Switches>,
) -> std::io::Result<()> {
    let req = read_logged(&stream, switches)?;
    serve_cdn(&stream, &req, repos, switches)
}

fn serve_cdn(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    switches: &Mutex<Switches>,
) -> std::io::Result<()> {
    let range = req.headers.get("range").cloned().unwrap_or_default();
    let head = req.method == "HEAD";
    // The hub's token must not leave the hub: the CDN's URLs carry their own signature (S3
    // answers a request with a second auth mechanism 400), and huggingface_hub sends none here.
    if req.headers.contains_key("authorization") {
        return error(stream, head, "400 Bad Request", "InvalidArgument");
    }
    let repos = repos.lock().unwrap();
    let found = req.path.strip_prefix("/cdn/").and_then(|sha| {
        repos
            .iter()
            .flat_map(|r| r.commits.values())
            .flat_map(|files| files.iter())
            .find(|(_, f)| f.sha256 == sha)
    });
    match found {
        Some((name, f)) => serve_bytes(stream, head, name, &f.bytes, &range, switches, &[]),
        None => error(stream, head, "404 Not Found", "EntryNotFound"),
    }
}

fn handle(
    stream: TcpStream,
    repos: &Mutex<Vec<RepoDef>>,
    switches: &Mutex<Switches>,
    writes: &Mutex<Writes>,
    urls: &Urls,
) -> std::io::Result<()> {
    let req = read_logged(&stream, switches)?;
    let range = req.headers.get("range").cloned().unwrap_or_default();
    if let Some(done) = handle_write(&stream, &req, repos, writes, &urls.hub) {
        return done;
    }
    let repos = repos.lock().unwrap();
    let repos: &[RepoDef] = &repos;
    let head = req.method == "HEAD";
    let path = req.path.replace("%2F", "/");

    // /api/{models,datasets}/OWNER/NAME/{revision,tree}/REV[/PATH]
    if let Some(rest) = path.strip_prefix("/api/") {
        let parts: Vec<&str> = rest.splitn(5, '/').collect();
        if parts.len() != 5 || !matches!(parts[3], "revision" | "tree") {
            return error(&stream, head, "404 Not Found", "RepoNotFound");
        }
        let (kind, id) = (parts[0], format!("{}/{}", parts[1], parts[2]));
        // A revision is one path component (a `/` in it travels as %2F); a tree's PATH follows.
        let (rev, under) = match parts[3] {
            "tree" => parts[4].split_once('/').unwrap_or((parts[4], "")),
            _ => (parts[4], ""),
        };
        let rev = &rev.replace("%2F", "/");
        let Some(repo) = repos.iter().find(|r| r.kind == kind && r.id == id) else {
            return error(&stream, head, "404 Not Found", "RepoNotFound");
        };
        if let Some(status) = auth(repo, &req) {
            return error(&stream, head, status, "GatedRepo");
        }
        let Some((commit, files)) = lookup(repo, rev) else {
            return error(&stream, head, "404 Not Found", "RevisionNotFound");
        };
        if parts[3] == "tree" {
            let recursive = req
                .query
                .split('&')
                .any(|kv| kv.eq_ignore_ascii_case("recursive=true"));
            return match tree(files, under, recursive) {
                Some(entries) => respond(
                    &stream,
                    head,
                    "200 OK",
                    &[("Content-Type", "application/json".into())],
                    serde_json::Value::Array(entries).to_string().as_bytes(),
                ),
                None => error(&stream, head, "404 Not Found", "EntryNotFound"),
            };
        }
        let body = serde_json::json!({"id": repo.id, "sha": commit,
            "private": repo.token.is_some(), "siblings": siblings(files)});
        return respond(
            &stream,
            head,
            "200 OK",
            &[("Content-Type", "application/json".into())],
            body.to_string().as_bytes(),
        );
    }

    // /[datasets/]OWNER/NAME/resolve/REV/PATH
    let (kind, rest) = match path.strip_prefix("/datasets/") {
        Some(r) => ("datasets", r),
        None => ("models", path.trim_start_matches('/')),
    };
    let parts: Vec<&str> = rest.splitn(5, '/').collect();
    if parts.len() != 5 || parts[2] != "resolve" {
        return error(&stream, head, "404 Not Found", "RepoNotFound");
    }
    let (id, rev, file) = (format!("{}/{}", parts[0], parts[1]), parts[3], parts[4]);
    let Some(repo) = repos.iter().find(|r| r.kind == kind && r.id == id) else {
        return error(&stream, head, "404 Not Found", "RepoNotFound");
    };
    if let Some(status) = auth(repo, &req) {
        return error(&stream, head, status, "GatedRepo");
    }
    let Some((commit, files)) = lookup(repo, rev) else {
        return error(&stream, head, "404 Not Found", "RevisionNotFound");
    };
    let Some(f) = files.get(file) else {
        return error(&stream, head, "404 Not Found", "EntryNotFound");
    };
    let git_etag = format!("\"{}\"", f.git_sha1);
    if is_lfs(file) {
        let headers = [
            ("Location", format!("{}/cdn/{}", urls.cdn, f.sha256)),
            ("X-Repo-Commit", commit),
            ("ETag", git_etag),
            ("X-Linked-Etag", format!("\"{}\"", f.sha256)),
            ("X-Linked-Size", f.bytes.len().to_string()),
        ];
        return respond(&stream, head, "302 Found", &headers, b"");
    }
    let headers = [("X-Repo-Commit", commit), ("ETag", git_etag)];
    serve_bytes(&stream, head, file, &f.bytes, &range, switches, &headers)
}

/// `[{"rfilename"}]` of every file.
fn siblings(files: &BTreeMap<String, File>) -> Vec<serde_json::Value> {
    files
        .keys()
        .map(|f| serde_json::json!({ "rfilename": f }))
        .collect()
}

/// The git LFS pointer file of an LFS file (what git stores in its place).
fn lfs_pointer(f: &File) -> String {
    format!(
        "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {}\n",
        f.sha256,
        f.bytes.len()
    )
}

/// The `/tree/` entries under `under` ("" for the root): files and directories, directly
/// under it or (`recursive`) at any depth, sorted by path; `None` when nothing is there.
fn tree(
    files: &BTreeMap<String, File>,
    under: &str,
    recursive: bool,
) -> Option<Vec<serde_json::Value>> {
    let prefix = match under.trim_end_matches('/') {
        "" => String::new(),
        u => format!("{u}/"),
    };
    let mut dirs = std::collections::BTreeSet::new();
    let mut out = BTreeMap::new();
    for (path, f) in files {
        let Some(rest) = path.strip_prefix(&prefix) else {
            continue;
        };
        let comps: Vec<&str> = rest.split('/').collect();
        // Every directory between `under` and the file (only the first without `recursive`).
        let depth = if recursive { comps.len() - 1 } else { 1 };
        for i in 1..=depth.min(comps.len() - 1) {
            dirs.insert(format!("{prefix}{}", comps[..i].join("/")));
        }
        if !recursive && comps.len() > 1 {
            continue;
        }
        let mut entry = serde_json::json!({"type": "file", "oid": f.git_sha1,
            "size": f.bytes.len(), "path": path});
        if is_lfs(path) {
            entry["lfs"] = serde_json::json!({"oid": f.sha256, "size": f.bytes.len(),
                "pointerSize": lfs_pointer(f).len()});
        }
        out.insert(path.clone(), entry);
    }
    for d in dirs {
        let oid = commit_id(&format!("tree {d}"));
        out.insert(
            d.clone(),
            serde_json::json!({"type": "directory", "oid": oid, "path": d}),
        );
    }
    (!out.is_empty() || prefix.is_empty()).then(|| out.into_values().collect())
}

/// `Some(status)` when the repo needs a token the request does not carry.
fn auth(repo: &RepoDef, req: &Request) -> Option<&'static str> {
    let want = repo.token.as_ref()?;
    match req.headers.get("authorization") {
        None => Some("401 Unauthorized"),
        Some(h) if h == &format!("Bearer {want}") => None,
        Some(_) => Some("403 Forbidden"),
    }
}

fn lookup<'a>(repo: &'a RepoDef, rev: &str) -> Option<(String, &'a BTreeMap<String, File>)> {
    let commit = repo
        .refs
        .get(rev)
        .cloned()
        .unwrap_or_else(|| rev.to_string());
    repo.commits.get(&commit).map(|files| (commit, files))
}

/// The file's bytes from the requested offset (`Range: bytes=N-`), honouring the switches.
fn serve_bytes(
    stream: &TcpStream,
    head: bool,
    name: &str,
    bytes: &[u8],
    range: &str,
    switches: &Mutex<Switches>,
    extra: &[(&str, String)],
) -> std::io::Result<()> {
    let total = bytes.len();
    let start = range
        .strip_prefix("bytes=")
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse::<usize>().ok());
    let end = range
        .strip_prefix("bytes=")
        .and_then(|r| r.split('-').nth(1))
        .and_then(|s| s.parse::<usize>().ok())
        .map(|e| (e + 1).min(total))
        .unwrap_or(total);
    let mut headers: Vec<(&str, String)> = extra.to_vec();
    let (status, from) = match start {
        Some(s) if s >= total && total > 0 => {
            return respond(stream, head, "416 Range Not Satisfiable", &headers, b"")
        }
        Some(s) => {
            headers.push((
                "Content-Range",
                format!("bytes {s}-{}/{total}", end.saturating_sub(1)),
            ));
            ("206 Partial Content", s)
        }
        None => ("200 OK", 0),
    };
    let base = name.rsplit('/').next().unwrap_or(name);
    let (cut, corrupt) = {
        let mut sw = switches.lock().unwrap();
        let cut = !head && sw.cut_once.as_deref() == Some(base);
        if cut {
            sw.cut_once = None;
        }
        (cut, sw.corrupt.as_deref() == Some(base))
    };
    let mut body = bytes[from..end].to_vec();
    if corrupt {
        body.iter_mut().for_each(|b| *b = !*b);
    }
    headers.push(("Content-Length", body.len().to_string()));
    if cut {
        // Announce the whole length, send half, drop the connection.
        let half = body.len() / 2;
        let mut s = stream;
        let mut out = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in &headers {
            out += &format!("{k}: {v}\r\n");
        }
        out += "\r\n";
        s.write_all(out.as_bytes())?;
        s.write_all(&body[..half])?;
        s.flush()?;
        return stream.shutdown(std::net::Shutdown::Both);
    }
    respond(stream, head, status, &headers, &body)
}

// ---------------------------------------------------------------------------------------------
// Uploads: the write half of the hub's API, as Python huggingface_hub 0.36 and 2.4 call it
// (`hf_api.py` create_repo / create_branch / create_commit, `_commit_api.py`, `lfs.py`; 2.4
// checked by scripts/make_hub_client_fixtures.py).
//
// - `GET /api/whoami-v2`: `{"type": "user", "name", "orgs": [], "auth": {"accessToken": {"role"}}}`
// - `POST /api/repos/create {"name", "organization", "private", "type"}`: 200 `{"url"}` with an
//   initial commit holding `.gitattributes`, as the hub makes; 409 `{"error", "url"}` when it
//   exists; 403 when the namespace is not the token's user; 401 for an unknown token.
// - `GET /api/models/OWNER/NAME`: repo info with `main`'s siblings (the fallback of
//   create_repo on 403).
// - `POST /api/validate-yaml {"content", "repoType"}`: `{"errors": [], "warnings": []}` (the
//   Python client's create_commit checks a README.md's front matter here first).
// - `POST /api/models/OWNER/NAME/branch/BRANCH`: a branch from `main` (409 when it exists).
// - `POST /api/models/OWNER/NAME/preupload/REV {"files": [{"path", "size", "sample"}]}`:
//   `uploadMode` "lfs" for `*.safetensors` / `*.bin`, files of 10 MiB or more, and binary
//   samples (a NUL byte), else "regular".
// - `POST /OWNER/NAME.git/info/lfs/objects/batch`: per object, `actions.upload` (PUT to
//   `/lfs-upload/OID`) and `actions.verify` for objects the server does not hold, no actions
//   for those it does.
// - `PUT /lfs-upload/OID`: stored only when the bytes' sha256 and length match.
// - `POST /OWNER/NAME.git/info/lfs/objects/verify {"oid", "size"}`: 200 if held, else 404.
// - `POST /api/models/OWNER/NAME/commit/REV` (NDJSON: header, `file`, `lfsFile`): one new commit
//   on the branch, `{"commitOid", "commitUrl"}`; 422 and no commit when an `lfsFile` names an
//   object never uploaded.
//
// Tokens: [`TOKEN`] is user `tallow-test` (write), [`OTHER_TOKEN`] user `someone-else`
// (write), [`READ_TOKEN`] user `tallow-test` with the read role. A repo is writable by the user
// named by its namespace. [`HubServer::cut_upload_once`] reads half of the next LFS PUT or commit
// body, then drops the connection, storing nothing.
// ---------------------------------------------------------------------------------------------

/// A write token of user `someone-else`.
pub const OTHER_TOKEN: &str = "hf_someone_else_token";
/// A read-only token of user `tallow-test`.
pub const READ_TOKEN: &str = "hf_tallow_test_read_token";

/// (token, user, role)
const USERS: [(&str, &str, &str); 3] = [
    (TOKEN, "tallow-test", "write"),
    (OTHER_TOKEN, "someone-else", "write"),
    (READ_TOKEN, "tallow-test", "read"),
];

/// Which upload request [`HubServer::cut_upload_once`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadCut {
    /// The PUT of an LFS object's bytes.
    LfsPut,
    /// The commit POST.
    Commit,
}

#[derive(Default)]
struct Writes {
    /// LFS objects by sha256.
    lfs: BTreeMap<String, File>,
    cut: Option<UploadCut>,
    /// (repo, branch, commit) of every commit made through the API, in order.
    commits: Vec<(String, String, String)>,
}

impl HubServer {
    /// The next LFS PUT or commit POST is read half-way, then its connection dropped.
    pub fn cut_upload_once(&self, what: UploadCut) {
        self.writes.lock().unwrap().cut = Some(what);
    }

    /// The commits made through the commit API on `repo`, oldest first: (branch, commit).
    pub fn commits_made(&self, repo: &str) -> Vec<(String, String)> {
        let w = self.writes.lock().unwrap();
        w.commits
            .iter()
            .filter(|(r, _, _)| r == repo)
            .map(|(_, b, c)| (b.clone(), c.clone()))
            .collect()
    }

    /// Every file of `repo` at `rev` (a branch or commit): path -> bytes.
    pub fn files_at(&self, repo: &str, rev: &str) -> BTreeMap<String, Vec<u8>> {
        let repos = self.repos.lock().unwrap();
        let r = repos.iter().find(|r| r.id == repo).expect("no such repo");
        let (_, files) = lookup(r, rev).expect("no such revision");
        files
            .iter()
            .map(|(p, f)| (p.clone(), f.bytes.clone()))
            .collect()
    }

    /// Whether `repo` exists, and whether it is private.
    pub fn repo_private(&self, repo: &str) -> Option<bool> {
        let repos = self.repos.lock().unwrap();
        repos
            .iter()
            .find(|r| r.id == repo)
            .map(|r| r.token.is_some())
    }

    /// The sha256 of every LFS object the server holds.
    pub fn lfs_objects(&self) -> Vec<String> {
        self.writes.lock().unwrap().lfs.keys().cloned().collect()
    }
}

/// The (user, role) of the request's bearer token; `None` without one or for an unknown one.
fn user_of(req: &Request) -> Option<(&'static str, &'static str)> {
    let h = req.headers.get("authorization")?;
    let t = h.strip_prefix("Bearer ")?;
    USERS
        .iter()
        .find(|(tok, _, _)| *tok == t)
        .map(|(_, u, r)| (*u, *r))
}

/// The body: `Content-Length` bytes. With `cut`, only half of them are read, the connection is
/// dropped and `None` returned.
fn read_body(mut stream: &TcpStream, req: &Request, cut: bool) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let len: usize = req
        .headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let want = if cut { len / 2 } else { len };
    let mut body = req.body_start.clone();
    body.truncate(want);
    while body.len() < want {
        let mut buf = vec![0u8; (want - body.len()).min(1 << 16)];
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&buf[..n]);
    }
    if cut {
        stream.shutdown(std::net::Shutdown::Both)?;
        return Ok(None);
    }
    Ok(Some(body))
}

fn json_ok(stream: &TcpStream, v: serde_json::Value) -> std::io::Result<()> {
    respond(
        stream,
        false,
        "200 OK",
        &[("Content-Type", "application/json".into())],
        v.to_string().as_bytes(),
    )
}

/// An error answer with the hub's `X-Error-Code` (may be empty) and `{"error": message}`.
fn write_error(stream: &TcpStream, status: &str, code: &str, message: &str) -> std::io::Result<()> {
    let mut headers = vec![("Content-Type", "application/json".to_string())];
    if !code.is_empty() {
        headers.push(("X-Error-Code", code.to_string()));
    }
    let body = serde_json::json!({ "error": message }).to_string();
    respond(stream, false, status, &headers, body.as_bytes())
}

/// The `.gitattributes` of a new repo (the start of the hub's default one).
const GITATTRIBUTES: &str = "*.bin filter=lfs diff=lfs merge=lfs -text\n\
    *.safetensors filter=lfs diff=lfs merge=lfs -text\n\
    *.pt filter=lfs diff=lfs merge=lfs -text\n";

/// The write endpoints; `None` for a request they do not handle (served by the read side).
fn handle_write(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    writes: &Mutex<Writes>,
    base_url: &str,
) -> Option<std::io::Result<()>> {
    let path = req.path.replace("%2F", "/");
    let m = req.method.as_str();
    if m == "GET" && path == "/api/whoami-v2" {
        return Some(match user_of(req) {
            None => write_error(
                stream,
                "401 Unauthorized",
                "",
                "Invalid credentials in Authorization header",
            ),
            Some((name, role)) => json_ok(
                stream,
                serde_json::json!({"type": "user", "name": name, "orgs": [],
                    "auth": {"type": "access_token", "accessToken": {"role": role}}}),
            ),
        });
    }
    if m == "POST" && path == "/api/repos/create" {
        return Some(create_repo(stream, req, repos, base_url));
    }
    if m == "POST" && path == "/api/validate-yaml" {
        // huggingface_hub's create_commit sends a README.md here before uploading anything;
        // this hub accepts every card.
        return Some(match read_body(stream, req, false) {
            Ok(_) => json_ok(stream, serde_json::json!({"errors": [], "warnings": []})),
            Err(e) => Err(e),
        });
    }
    if m == "PUT" {
        if let Some(oid) = path.strip_prefix("/lfs-upload/") {
            return Some(lfs_put(stream, req, writes, oid));
        }
    }
    // /OWNER/NAME.git/info/lfs/objects/{batch,verify}
    if m == "POST" && path.contains(".git/info/lfs/objects/") {
        let (repo, action) = path
            .trim_start_matches('/')
            .split_once(".git/info/lfs/objects/")?;
        return Some(lfs_endpoint(
            stream, req, repos, writes, repo, action, base_url,
        ));
    }
    // /api/models/OWNER/NAME[/ACTION/REV]
    let rest = path.strip_prefix("/api/models/")?;
    let parts: Vec<&str> = rest.splitn(4, '/').collect();
    let repo = format!("{}/{}", parts[0], parts.get(1)?);
    match (m, parts.len(), parts.get(2).copied()) {
        ("GET", 2, _) => Some(repo_info(stream, req, repos, &repo)),
        ("POST", 4, Some(action @ ("branch" | "preupload" | "commit"))) => Some(repo_write(
            stream, req, repos, writes, &repo, action, parts[3], base_url,
        )),
        _ => None,
    }
}

fn create_repo(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    base_url: &str,
) -> std::io::Result<()> {
    let Some(body) = read_body(stream, req, false)? else {
        return Ok(());
    };
    let Some((user, role)) = user_of(req) else {
        return write_error(
            stream,
            "401 Unauthorized",
            "",
            "Invalid credentials in Authorization header",
        );
    };
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(name), Some(org)) = (v["name"].as_str(), v["organization"].as_str()) else {
        return write_error(
            stream,
            "400 Bad Request",
            "",
            "name and organization are required",
        );
    };
    if org != user || role != "write" {
        return write_error(
            stream,
            "403 Forbidden",
            "",
            &format!("You don't have the rights to create a model under the namespace \"{org}\""),
        );
    }
    let id = format!("{org}/{name}");
    let mut repos = repos.lock().unwrap();
    if repos.iter().any(|r| r.id == id) {
        // With the repo's url, as the hub answers: huggingface_hub's `create_repo(exist_ok=True)`
        // reads it from this 409 (found by scripts/make_hub_client_fixtures.py).
        let body = serde_json::json!({"error": "You already created this model repo",
            "url": format!("{base_url}/{id}")});
        return respond(
            stream,
            false,
            "409 Conflict",
            &[("Content-Type", "application/json".into())],
            body.to_string().as_bytes(),
        );
    }
    let first = commit_id(&format!("{id} initial commit"));
    let files: BTreeMap<String, File> = [(
        ".gitattributes".to_string(),
        File::new(GITATTRIBUTES.as_bytes().to_vec()),
    )]
    .into();
    let owner_token = USERS
        .iter()
        .find(|(_, u, r)| *u == user && *r == "write")
        .unwrap()
        .0;
    repos.push(RepoDef {
        kind: "models",
        id: id.clone(),
        refs: [("main".to_string(), first.clone())].into(),
        commits: [(first, files)].into(),
        token: v["private"]
            .as_bool()
            .unwrap_or(false)
            .then(|| owner_token.to_string()),
    });
    json_ok(
        stream,
        serde_json::json!({"url": format!("{base_url}/{id}"), "name": id}),
    )
}

/// Whether the request's user may read `repo` (public, or private and theirs).
fn can_read(repo: &RepoDef, req: &Request) -> bool {
    auth(repo, req).is_none()
        || user_of(req).is_some_and(|(u, _)| repo.id.split('/').next() == Some(u))
}

fn repo_info(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    repo: &str,
) -> std::io::Result<()> {
    let repos = repos.lock().unwrap();
    match repos.iter().find(|r| r.kind == "models" && r.id == repo) {
        Some(r) if can_read(r, req) => {
            let sha = r.refs["main"].clone();
            json_ok(
                stream,
                serde_json::json!({"id": r.id, "sha": sha, "private": r.token.is_some(),
                    "siblings": siblings(&r.commits[&sha])}),
            )
        }
        _ => write_error(
            stream,
            "404 Not Found",
            "RepoNotFound",
            "Repository not found",
        ),
    }
}

/// `None` when the request may write to `repo`, else the error to answer.
fn write_denied(repo: &RepoDef, req: &Request) -> Option<(&'static str, String)> {
    match user_of(req) {
        None => Some((
            "401 Unauthorized",
            "Invalid credentials in Authorization header".into(),
        )),
        Some((user, role)) if role == "write" && repo.id.split('/').next() == Some(user) => None,
        Some((user, _)) => Some((
            "403 Forbidden",
            format!("{user} does not have write access to {}", repo.id),
        )),
    }
}

#[allow(clippy::too_many_arguments)]
fn repo_write(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    writes: &Mutex<Writes>,
    repo_id: &str,
    action: &str,
    rev: &str,
    base_url: &str,
) -> std::io::Result<()> {
    let cut = action == "commit" && {
        let mut w = writes.lock().unwrap();
        let cut = w.cut == Some(UploadCut::Commit);
        if cut {
            w.cut = None;
        }
        cut
    };
    let Some(body) = read_body(stream, req, cut)? else {
        return Ok(()); // cut: nothing happens
    };
    let mut repos = repos.lock().unwrap();
    let Some(repo) = repos
        .iter_mut()
        .find(|r| r.kind == "models" && r.id == repo_id)
    else {
        return write_error(
            stream,
            "404 Not Found",
            "RepoNotFound",
            "Repository not found",
        );
    };
    if !can_read(repo, req) {
        return write_error(
            stream,
            "404 Not Found",
            "RepoNotFound",
            "Repository not found",
        );
    }
    if let Some((status, msg)) = write_denied(repo, req) {
        return write_error(stream, status, "", &msg);
    }
    if action == "branch" {
        if repo.refs.contains_key(rev) {
            return write_error(stream, "409 Conflict", "", "Reference already exists");
        }
        let main = repo.refs["main"].clone();
        repo.refs.insert(rev.to_string(), main);
        return json_ok(stream, serde_json::json!({}));
    }
    let Some(parent) = repo.refs.get(rev).cloned() else {
        return write_error(
            stream,
            "404 Not Found",
            "RevisionNotFound",
            &format!("Invalid rev id: {rev}"),
        );
    };
    if action == "preupload" {
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let b64 = base64::engine::general_purpose::STANDARD;
        let files: Vec<_> = v["files"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                use base64::Engine;
                let path = f["path"].as_str().unwrap_or_default();
                let size = f["size"].as_u64().unwrap_or(0);
                let sample = b64
                    .decode(f["sample"].as_str().unwrap_or_default())
                    .unwrap_or_default();
                let lfs = is_lfs(path) || size >= 10 << 20 || sample.contains(&0);
                serde_json::json!({"path": path, "uploadMode": if lfs { "lfs" } else { "regular" },
                    "shouldIgnore": false})
            })
            .collect();
        return json_ok(stream, serde_json::json!({ "files": files }));
    }
    // The commit: every operation is checked before anything changes.
    let text = String::from_utf8_lossy(&body);
    let mut files = repo.commits[&parent].clone();
    let mut summary = String::new();
    let lfs_store = writes.lock().unwrap();
    let held = &lfs_store.lfs;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(op) = serde_json::from_str::<serde_json::Value>(line) else {
            return write_error(
                stream,
                "400 Bad Request",
                "",
                "a line of the payload is not JSON",
            );
        };
        let v = &op["value"];
        let path = v["path"].as_str().unwrap_or_default().to_string();
        let bad_path = path.is_empty()
            || path.starts_with('/')
            || path.split('/').any(|c| c == ".." || c.is_empty());
        match op["key"].as_str() {
            Some("header") => summary = v["summary"].as_str().unwrap_or_default().to_string(),
            Some(_) if bad_path => {
                return write_error(
                    stream,
                    "400 Bad Request",
                    "",
                    &format!("invalid path {path:?}"),
                )
            }
            Some("file") => {
                use base64::Engine;
                let Ok(bytes) = base64::engine::general_purpose::STANDARD
                    .decode(v["content"].as_str().unwrap_or_default())
                else {
                    return write_error(stream, "400 Bad Request", "", "content is not base64");
                };
                files.insert(path, File::new(bytes));
            }
            Some("lfsFile") => {
                let oid = v["oid"].as_str().unwrap_or_default();
                match held.get(oid) {
                    Some(f) if Some(f.bytes.len() as u64) == v["size"].as_u64() => {
                        files.insert(path, f.clone());
                    }
                    _ => {
                        return write_error(
                            stream,
                            "422 Unprocessable Entity",
                            "",
                            &format!("LFS object {oid} of {path} was never uploaded"),
                        )
                    }
                }
            }
            _ => return write_error(stream, "400 Bad Request", "", "unknown operation key"),
        }
    }
    if summary.is_empty() {
        return write_error(stream, "400 Bad Request", "", "the commit has no summary");
    }
    let digest: Vec<String> = files
        .iter()
        .map(|(p, f)| format!("{p}:{}", f.sha256))
        .collect();
    let commit = commit_id(&format!("{parent} {summary} {}", digest.join(",")));
    repo.commits.insert(commit.clone(), files);
    repo.refs.insert(rev.to_string(), commit.clone());
    let repo_id = repo.id.clone();
    drop(repos);
    drop(lfs_store);
    let mut w = writes.lock().unwrap();
    w.commits
        .push((repo_id.clone(), rev.to_string(), commit.clone()));
    drop(w);
    json_ok(
        stream,
        serde_json::json!({"commitOid": commit, "commitUrl": format!("{base_url}/{repo_id}/commit/{commit}"),
            "pullRequestUrl": null}),
    )
}

#[allow(clippy::too_many_arguments)]
fn lfs_endpoint(
    stream: &TcpStream,
    req: &Request,
    repos: &Mutex<Vec<RepoDef>>,
    writes: &Mutex<Writes>,
    repo_id: &str,
    action: &str,
    base_url: &str,
) -> std::io::Result<()> {
    let Some(body) = read_body(stream, req, false)? else {
        return Ok(());
    };
    {
        let repos = repos.lock().unwrap();
        let Some(repo) = repos.iter().find(|r| r.kind == "models" && r.id == repo_id) else {
            return write_error(
                stream,
                "404 Not Found",
                "RepoNotFound",
                "Repository not found",
            );
        };
        if let Some((status, msg)) = write_denied(repo, req) {
            return write_error(stream, status, "", &msg);
        }
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let lfs_store = writes.lock().unwrap();
    let held = &lfs_store.lfs;
    let lfs_json = [("Content-Type", "application/vnd.git-lfs+json".to_string())];
    if action == "verify" {
        let oid = v["oid"].as_str().unwrap_or_default();
        return match held.get(oid) {
            Some(f) if Some(f.bytes.len() as u64) == v["size"].as_u64() => {
                respond(stream, false, "200 OK", &lfs_json, b"{}")
            }
            _ => write_error(
                stream,
                "404 Not Found",
                "",
                &format!("object {oid} not found"),
            ),
        };
    }
    if action != "batch" || v["operation"] != "upload" {
        return write_error(
            stream,
            "400 Bad Request",
            "",
            "only upload batches are served",
        );
    }
    let objects: Vec<_> = v["objects"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            let oid = o["oid"].as_str().unwrap_or_default();
            let mut out = serde_json::json!({"oid": oid, "size": o["size"], "authenticated": true});
            if !held.contains_key(oid) {
                out["actions"] = serde_json::json!({
                    "upload": {"href": format!("{base_url}/lfs-upload/{oid}")},
                    "verify": {"href": format!("{base_url}/{repo_id}.git/info/lfs/objects/verify")},
                });
            }
            out
        })
        .collect();
    let answer = serde_json::json!({"transfer": "basic", "objects": objects});
    respond(
        stream,
        false,
        "200 OK",
        &lfs_json,
        answer.to_string().as_bytes(),
    )
}

fn lfs_put(
    stream: &TcpStream,
    req: &Request,
    writes: &Mutex<Writes>,
    oid: &str,
) -> std::io::Result<()> {
    let cut = {
        let mut w = writes.lock().unwrap();
        let cut = w.cut == Some(UploadCut::LfsPut);
        if cut {
            w.cut = None;
        }
        cut
    };
    let Some(body) = read_body(stream, req, cut)? else {
        return Ok(()); // cut: nothing stored
    };
    let f = File::new(body);
    if f.sha256 != oid {
        return write_error(
            stream,
            "400 Bad Request",
            "",
            "the bytes do not hash to the oid",
        );
    }
    writes.lock().unwrap().lfs.insert(oid.to_string(), f);
    respond(stream, false, "200 OK", &[], b"")
}
