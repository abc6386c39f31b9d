//! A loopback Hugging Face Hub for the hub tests: std `TcpListener`, one thread per connection,
//! `Connection: close`. It speaks the part of the hub's API the client uses:
//!
//! - `GET /api/{models,datasets}/OWNER/NAME/revision/REV`: `{"sha", "siblings": [{"rfilename"}]}`
//! - `HEAD|GET /[datasets/]OWNER/NAME/resolve/REV/PATH`: `X-Repo-Commit`, `ETag`; LFS files
//!   (`*.safetensors`, `*.bin`) answer 302 to `/cdn/<sha256>` with `X-Linked-Etag` (the sha256)
//!   and `X-Linked-Size`, as the hub does; other files are served directly.
//! - `GET /cdn/<sha256>` with `Range: bytes=N-`: 206 + `Content-Range`.
//! - Errors with the hub's `X-Error-Code`: `RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
//!   `GatedRepo` (401 without a token, 403 with a wrong one).
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
    pub url: String,
    repos: Arc<Vec<RepoDef>>,
    switches: Arc<Mutex<Switches>>,
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
        let server = HubServer {
            url: url.clone(),
            repos: Arc::new(
                [vec![model, gated, dataset], dataset_repos()]
                    .into_iter()
                    .flatten()
                    .collect(),
            ),
            switches: Arc::new(Mutex::new(Switches::default())),
        };
        let (repos, switches) = (server.repos.clone(), server.switches.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (repos, switches, url) = (repos.clone(), switches.clone(), url.clone());
                std::thread::spawn(move || {
                    let _ = handle(stream, &repos, &switches, &url);
                });
            }
        });
        server
    }

    /// The commit a ref of a repo points to.
    pub fn commit(&self, repo: &str, rev: &str) -> String {
        let r = self.repos.iter().find(|r| r.id == repo).unwrap();
        r.refs[rev].clone()
    }

    /// The bytes of a file at a ref.
    pub fn file(&self, repo: &str, rev: &str, path: &str) -> Vec<u8> {
        let r = self.repos.iter().find(|r| r.id == repo).unwrap();
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

struct Request {
    method: String,
    path: String,
    headers: BTreeMap<String, String>,
}

fn read_request(stream: &TcpStream) -> std::io::Result<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
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
    // GET/HEAD only: no body to drain.
    Ok(Request {
        method,
        path,
        headers,
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

fn handle(
    stream: TcpStream,
    repos: &[RepoDef],
    switches: &Mutex<Switches>,
    base_url: &str,
) -> std::io::Result<()> {
    let req = read_request(&stream)?;
    let range = req.headers.get("range").cloned().unwrap_or_default();
    switches
        .lock()
        .unwrap()
        .log
        .push(format!("{} {} {range}", req.method, req.path));
    let head = req.method == "HEAD";
    let path = req.path.replace("%2F", "/");

    if let Some(sha) = path.strip_prefix("/cdn/") {
        let found = repos
            .iter()
            .flat_map(|r| r.commits.values())
            .flat_map(|files| files.iter())
            .find(|(_, f)| f.sha256 == sha);
        return match found {
            Some((name, f)) => serve_bytes(&stream, head, name, &f.bytes, &range, switches, &[]),
            None => error(&stream, head, "404 Not Found", "EntryNotFound"),
        };
    }

    // /api/{models,datasets}/OWNER/NAME/revision/REV
    if let Some(rest) = path.strip_prefix("/api/") {
        let parts: Vec<&str> = rest.splitn(5, '/').collect();
        if parts.len() != 5 || parts[3] != "revision" {
            return error(&stream, head, "404 Not Found", "RepoNotFound");
        }
        let (kind, id, rev) = (parts[0], format!("{}/{}", parts[1], parts[2]), parts[4]);
        let Some(repo) = repos.iter().find(|r| r.kind == kind && r.id == id) else {
            return error(&stream, head, "404 Not Found", "RepoNotFound");
        };
        if let Some(status) = auth(repo, &req) {
            return error(&stream, head, status, "GatedRepo");
        }
        let Some((commit, files)) = lookup(repo, rev) else {
            return error(&stream, head, "404 Not Found", "RevisionNotFound");
        };
        let siblings: Vec<_> = files
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({"id": repo.id, "sha": commit, "siblings": siblings});
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
            ("Location", format!("{base_url}/cdn/{}", f.sha256)),
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
