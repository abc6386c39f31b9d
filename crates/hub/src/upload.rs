//! Uploads: files into a model repo as ONE commit, through the hub's HTTP API as Python
//! huggingface_hub 0.36 speaks it (`hf_api.py` `create_repo` / `create_branch` /
//! `create_commit`, `_commit_api.py`, `lfs.py`):
//!
//! 1. `POST /api/repos/create {"name", "organization", "private", "type"}`: 200 creates the repo,
//!    409 means it exists (fine). On 403 (no right to create in that namespace) the repo may still
//!    exist and be writable by this token, so, as `create_repo(exist_ok=True)` does, a
//!    `GET /api/models/OWNER/NAME` decides: found -> go on, else "not allowed".
//! 2. A branch other than `main` that does not exist is created from `main`
//!    (`POST /api/models/OWNER/NAME/branch/BRANCH`), as `huggingface-cli upload --revision` does.
//! 3. `POST /api/models/OWNER/NAME/preupload/REV {"files": [{"path", "size", "sample"}]}`: the hub
//!    says per file whether it goes into git (`"regular"`) or LFS (`"lfs"`).
//! 4. LFS files: `POST {endpoint}/OWNER/NAME.git/info/lfs/objects/batch` with each file's sha256
//!    and size; the answer has an `upload` action (PUT the bytes to `href`, then POST `{oid, size}`
//!    to the `verify` action) only for objects the hub does not have yet.
//! 5. `POST /api/models/OWNER/NAME/commit/REV` (NDJSON): a header line, one `file` line per regular
//!    file (base64 content), one `lfsFile` line per LFS file (its sha256 and size). The hub refuses
//!    a commit naming an LFS object it does not hold, so a cut upload never makes half a commit.
//!
//! Steps 3-5 are one attempt; a connection error or a 5xx restarts the attempt (4 in all, with
//! backoff), and the batch call of the next attempt asks only for what is still missing.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use sha2::{Digest, Sha256};

use crate::download::{agent, sha256_file};
use crate::error::io_err;
use crate::{Hub, HubError};

/// Attempts of each step: a cut connection or a 5xx restarts it.
const ATTEMPTS: u32 = 4;
/// Wait before the second attempt; doubled before each later one.
const BACKOFF: Duration = Duration::from_millis(500);
/// What the LFS batch endpoint is asked to use: one PUT per object (huggingface_hub also offers
/// "multipart", for files over 5 GB, which tallow does not send).
const LFS_TRANSFER: &str = "basic";

/// Where a file's bytes come from.
#[derive(Debug, Clone)]
pub enum Source {
    File(PathBuf),
    /// Made in memory (a generated model card).
    Bytes(Vec<u8>),
}

/// One file of the commit: its path in the repo and its bytes.
#[derive(Debug, Clone)]
pub struct UploadFile {
    pub path_in_repo: String,
    pub source: Source,
}

/// The commit to make.
#[derive(Debug, Clone)]
pub struct UploadRequest {
    /// `OWNER/NAME` (check it with [`check_repo_id`]).
    pub repo_id: String,
    /// The branch to commit to (`main`); created from `main` when missing.
    pub revision: String,
    /// A repo created by this upload is private.
    pub private: bool,
    /// The commit's summary line.
    pub message: String,
    pub description: String,
}

/// What the upload did.
#[derive(Debug, Clone)]
pub struct CommitInfo {
    pub commit_oid: String,
    pub commit_url: String,
    pub created_repo: bool,
    pub created_branch: bool,
    /// The files the hub took through LFS.
    pub lfs_files: Vec<String>,
    /// LFS objects whose bytes were sent (those the hub already had are not).
    pub lfs_uploaded: usize,
    /// Attempts the commit took (1 without a transient failure).
    pub attempts: u32,
}

/// `GET /api/whoami-v2`: the token's user, its organizations and the token's role.
#[derive(Debug, Clone)]
pub struct WhoAmI {
    pub name: String,
    pub orgs: Vec<String>,
    /// "read", "write" or "fineGrained"; `None` when the hub does not say.
    pub role: Option<String>,
}

/// A file ready to send: hashed and sampled.
struct Prepared {
    path: String,
    source: Source,
    size: u64,
    sha256: String,
    /// The first 512 bytes, which the hub's preupload looks at.
    sample: Vec<u8>,
}

impl Prepared {
    fn new(f: UploadFile) -> Result<Prepared, HubError> {
        let (size, sha256, sample) = match &f.source {
            Source::Bytes(b) => (
                b.len() as u64,
                hex(&Sha256::digest(b)),
                b[..b.len().min(512)].to_vec(),
            ),
            Source::File(p) => {
                let size = std::fs::metadata(p).map_err(io_err(p))?.len();
                let mut sample = Vec::with_capacity(512);
                std::fs::File::open(p)
                    .map_err(io_err(p))?
                    .take(512)
                    .read_to_end(&mut sample)
                    .map_err(io_err(p))?;
                (size, sha256_file(p)?, sample)
            }
        };
        Ok(Prepared {
            path: f.path_in_repo,
            source: f.source,
            size,
            sha256,
            sample,
        })
    }

    fn bytes(&self) -> Result<Vec<u8>, HubError> {
        match &self.source {
            Source::Bytes(b) => Ok(b.clone()),
            Source::File(p) => std::fs::read(p).map_err(io_err(p)),
        }
    }

    /// PUTs the bytes to `req` with their length; a file is streamed, not read into memory.
    /// No Content-Type, as huggingface_hub sends none (the URL may be a pre-signed one).
    fn put(&self, req: ureq::Request) -> Result<Result<ureq::Response, Failure>, HubError> {
        let req = req.set("Content-Length", &self.size.to_string());
        let res = match &self.source {
            Source::Bytes(b) => req.send_bytes(b),
            Source::File(p) => req.send(std::fs::File::open(p).map_err(io_err(p))?),
        };
        Ok(failure(res))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The checks of huggingface_hub's `validate_repo_id` for a repo to write to, plus the shape
/// `OWNER/NAME`: letters, digits, `-`, `_`, `.`; no `--` or `..`; a part neither starts nor ends
/// with `-` or `.`; the name at most 96 characters and not ending in `.git`.
pub fn check_repo_id(id: &str) -> Result<(), HubError> {
    let bad = |reason: String| HubError::BadName {
        what: "repo id",
        value: id.to_string(),
        reason,
    };
    let Some((owner, name)) = id.split_once('/') else {
        return Err(bad(
            "write OWNER/NAME (your user or organization name, a slash, the repo name)".into(),
        ));
    };
    if name.contains('/') {
        return Err(bad("it has more than one `/`: write OWNER/NAME".into()));
    }
    for (what, part) in [("owner", owner), ("name", name)] {
        if part.is_empty() {
            return Err(bad(format!("the {what} is empty: write OWNER/NAME")));
        }
        if let Some(c) = part
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(bad(format!(
                "the {what} has the character {c:?}; only letters, digits, `-`, `_` and `.` \
                 are allowed"
            )));
        }
        if part.contains("--") || part.contains("..") {
            return Err(bad(format!("the {what} contains `--` or `..`")));
        }
        if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
            return Err(bad(format!("the {what} starts or ends with `-` or `.`")));
        }
    }
    if name.len() > 96 {
        return Err(bad(format!(
            "the name has {} characters, at most 96 are allowed",
            name.len()
        )));
    }
    if name.ends_with(".git") {
        return Err(bad("the name ends with `.git`".into()));
    }
    Ok(())
}

/// A branch name git accepts (`git check-ref-format --branch`, the common rules): not empty, no
/// space or control character, none of `~^:?*[\`, no `..`, `@{` or `//`, not starting with `-`
/// or `/`, not ending with `/`, `.` or `.lock`; and not a 40-hex commit id (a commit cannot be
/// committed to).
pub fn check_branch(branch: &str) -> Result<(), HubError> {
    let bad = |reason: &str| HubError::BadName {
        what: "--revision branch",
        value: branch.to_string(),
        reason: reason.to_string(),
    };
    if branch.is_empty() {
        return Err(bad("it is empty"));
    }
    if branch
        .chars()
        .any(|c| c.is_control() || c == ' ' || "~^:?*[\\".contains(c))
    {
        return Err(bad(
            "git branch names have no spaces, control characters or any of ~^:?*[\\",
        ));
    }
    if branch.contains("..") || branch.contains("@{") || branch.contains("//") {
        return Err(bad("git branch names contain no `..`, `@{` or `//`"));
    }
    if branch.starts_with(['-', '/']) || branch.ends_with(['/', '.']) || branch.ends_with(".lock") {
        return Err(bad(
            "git branch names do not start with `-` or `/` nor end with `/`, `.` or `.lock`",
        ));
    }
    if branch.len() == 40 && branch.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad("it is a commit id; uploads go to a branch"));
    }
    Ok(())
}

/// A failed request: the status and the response, or the transport error.
enum Failure {
    Status(u16, Box<ureq::Response>),
    Transport(String),
}

fn failure(res: Result<ureq::Response, ureq::Error>) -> Result<ureq::Response, Failure> {
    match res {
        Ok(r) => Ok(r),
        Err(ureq::Error::Status(s, r)) => Err(Failure::Status(s, Box::new(r))),
        Err(ureq::Error::Transport(t)) => Err(Failure::Transport(t.to_string())),
    }
}

/// 5xx and 429 are worth another attempt, as are cut connections.
fn transient(e: &HubError) -> bool {
    match e {
        HubError::Network { .. } => true,
        HubError::Http { status, .. } => *status >= 500 || *status == 429,
        _ => false,
    }
}

/// The hub's message of an error response: `X-Error-Message`, else the JSON body's `error`.
fn error_message(resp: ureq::Response) -> String {
    if let Some(m) = resp.header("x-error-message") {
        return m.to_string();
    }
    let text = resp.into_string().unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| text.chars().take(300).collect())
}

/// Percent-encodes a branch for a URL path segment (`refs/pr/1` -> `refs%2Fpr%2F1`).
fn quote(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One step with retries: `f` again after a transient failure, with backoff.
fn retry<T>(
    what: &str,
    notes: &mut dyn FnMut(String),
    mut f: impl FnMut() -> Result<T, HubError>,
) -> Result<(T, u32), HubError> {
    let mut wait = BACKOFF;
    for attempt in 1..=ATTEMPTS {
        match f() {
            Ok(v) => return Ok((v, attempt)),
            Err(e) if attempt < ATTEMPTS && transient(&e) => {
                notes(format!(
                    "{what}: {e}; attempt {} of {ATTEMPTS} in {:.1}s",
                    attempt + 1,
                    wait.as_secs_f64()
                ));
                std::thread::sleep(wait);
                wait *= 2;
            }
            Err(e) => return Err(e),
        }
    }
    unreachable!("the last attempt returns")
}

impl Hub {
    fn token_or_err(&self, repo: &str) -> Result<&str, HubError> {
        self.token.as_deref().ok_or_else(|| HubError::NoToken {
            repo: repo.to_string(),
            endpoint: self.endpoint.clone(),
        })
    }

    /// Sends `req` with the token and an optional JSON body; the response or the failure.
    fn send(
        &self,
        req: ureq::Request,
        token: Option<&str>,
        body: Option<(&str, &[u8])>,
    ) -> Result<ureq::Response, Failure> {
        let req = match token {
            Some(t) => req.set("Authorization", &format!("Bearer {t}")),
            None => req,
        };
        failure(match body {
            Some((content_type, bytes)) => req.set("Content-Type", content_type).send_bytes(bytes),
            None => req.call(),
        })
    }

    /// The error of a failed write request to `repo`: 401 -> token rejected, 403 -> not allowed,
    /// 404 -> the repo or revision is missing, anything else with the hub's message.
    fn write_error(&self, repo: &str, revision: &str, url: &str, f: Failure) -> HubError {
        match f {
            Failure::Transport(message) => HubError::Network {
                repo: repo.to_string(),
                endpoint: self.endpoint.clone(),
                message,
                cached: format!("nothing was committed to {repo}"),
            },
            Failure::Status(status, resp) => {
                let code = resp.header("x-error-code").unwrap_or("").to_string();
                match (status, code.as_str()) {
                    (401, _) => HubError::TokenRejected {
                        endpoint: self.endpoint.clone(),
                        source_name: self.token_origin.clone(),
                    },
                    (403, _) => HubError::NotAllowed {
                        repo: repo.to_string(),
                        user: self
                            .whoami()
                            .map(|w| w.name)
                            .unwrap_or_else(|_| "this token's user".into()),
                        message: error_message(*resp),
                    },
                    (_, "RevisionNotFound") => HubError::RevisionNotFound {
                        repo: repo.to_string(),
                        revision: revision.to_string(),
                    },
                    (404, _) | (_, "RepoNotFound") => HubError::RepoNotFound {
                        repo: repo.to_string(),
                        endpoint: self.endpoint.clone(),
                        dataset: false,
                    },
                    _ => HubError::Http {
                        url: url.to_string(),
                        status,
                        message: error_message(*resp),
                    },
                }
            }
        }
    }

    /// POSTs JSON to `url` with the token; the parsed JSON answer.
    fn post_json(
        &self,
        repo: &str,
        revision: &str,
        url: &str,
        content_type: &str,
        body: &[u8],
        accept: Option<&str>,
    ) -> Result<serde_json::Value, HubError> {
        let token = self.token_or_err(repo)?;
        let mut req = agent(0).post(url);
        if let Some(a) = accept {
            req = req.set("Accept", a);
        }
        let resp = self
            .send(req, Some(token), Some((content_type, body)))
            .map_err(|f| self.write_error(repo, revision, url, f))?;
        let text = resp.into_string().map_err(|e| HubError::Network {
            repo: repo.to_string(),
            endpoint: self.endpoint.clone(),
            message: e.to_string(),
            cached: format!("nothing was committed to {repo}"),
        })?;
        Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
    }

    /// `GET /api/whoami-v2`: who the token belongs to. Fails without a token or when the hub
    /// rejects it; `tallow train` calls it before training when `train.push_to_hub` is set.
    pub fn whoami(&self) -> Result<WhoAmI, HubError> {
        let token = self.token_or_err("the hub")?;
        let url = format!("{}/api/whoami-v2", self.endpoint);
        let resp = self
            .send(agent(0).get(&url), Some(token), None)
            .map_err(|f| match f {
                Failure::Status(401, _) => HubError::TokenRejected {
                    endpoint: self.endpoint.clone(),
                    source_name: self.token_origin.clone(),
                },
                Failure::Status(status, r) => HubError::Http {
                    url: url.clone(),
                    status,
                    message: error_message(*r),
                },
                Failure::Transport(message) => HubError::Network {
                    repo: "whoami".into(),
                    endpoint: self.endpoint.clone(),
                    message,
                    cached: String::new(),
                },
            })?;
        let v: serde_json::Value = resp.into_json().map_err(|e| HubError::Http {
            url: url.clone(),
            status: 200,
            message: format!("not JSON: {e}"),
        })?;
        let name = v["name"].as_str().unwrap_or_default().to_string();
        let orgs = v["orgs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|o| o["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let role = v["auth"]["accessToken"]["role"]
            .as_str()
            .map(str::to_string);
        Ok(WhoAmI { name, orgs, role })
    }

    /// Before a long run that ends in an upload: a token is there, the hub accepts it and it is
    /// not read-only. Returns the user.
    pub fn check_write_token(&self, repo: &str) -> Result<WhoAmI, HubError> {
        self.token_or_err(repo)?;
        let who = self.whoami()?;
        if who.role.as_deref() == Some("read") {
            return Err(HubError::ReadOnlyToken {
                repo: repo.to_string(),
                user: who.name,
                endpoint: self.endpoint.clone(),
            });
        }
        Ok(who)
    }

    /// Creates the repo; `Ok(false)` when it exists already and this token may use it.
    fn ensure_repo(&self, up: &UploadRequest) -> Result<bool, HubError> {
        let (owner, name) = up.repo_id.split_once('/').expect("checked OWNER/NAME");
        let url = format!("{}/api/repos/create", self.endpoint);
        let body = serde_json::json!({
            "name": name, "organization": owner, "private": up.private, "type": "model"
        });
        let token = self.token_or_err(&up.repo_id)?;
        let res = self.send(
            agent(0).post(&url),
            Some(token),
            Some(("application/json", body.to_string().as_bytes())),
        );
        match res {
            Ok(_) => Ok(true),
            Err(Failure::Status(409, _)) => Ok(false),
            Err(Failure::Status(403, resp)) => {
                // No right to create under OWNER; the repo may exist and be writable anyway.
                let info = format!("{}/api/models/{}", self.endpoint, up.repo_id);
                match self.send(agent(0).get(&info), Some(token), None) {
                    Ok(_) => Ok(false),
                    Err(_) => Err(self.write_error(
                        &up.repo_id,
                        &up.revision,
                        &url,
                        Failure::Status(403, resp),
                    )),
                }
            }
            Err(f) => Err(self.write_error(&up.repo_id, &up.revision, &url, f)),
        }
    }

    /// Creates `up.revision` from `main` when it is missing; `Ok(true)` when it did.
    fn ensure_branch(&self, up: &UploadRequest) -> Result<bool, HubError> {
        if up.revision == "main" {
            return Ok(false);
        }
        let token = self.token_or_err(&up.repo_id)?;
        let rev = quote(&up.revision);
        let url = format!("{}/api/models/{}/revision/{rev}", self.endpoint, up.repo_id);
        match self.send(agent(0).get(&url), Some(token), None) {
            Ok(_) => return Ok(false),
            Err(Failure::Status(404, r))
                if r.header("x-error-code") == Some("RevisionNotFound") => {}
            Err(f) => return Err(self.write_error(&up.repo_id, &up.revision, &url, f)),
        }
        let url = format!("{}/api/models/{}/branch/{rev}", self.endpoint, up.repo_id);
        match self.send(
            agent(0).post(&url),
            Some(token),
            Some(("application/json", b"{}")),
        ) {
            Ok(_) => Ok(true),
            Err(Failure::Status(409, _)) => Ok(false),
            Err(f) => Err(self.write_error(&up.repo_id, &up.revision, &url, f)),
        }
    }

    /// Uploads `files` to `up.repo_id` at `up.revision` as one commit; see the module doc.
    /// `notes` gets a line per retry and per LFS file sent.
    pub fn upload(
        &self,
        up: &UploadRequest,
        files: Vec<UploadFile>,
        notes: &mut dyn FnMut(String),
    ) -> Result<CommitInfo, HubError> {
        check_repo_id(&up.repo_id)?;
        check_branch(&up.revision)?;
        self.token_or_err(&up.repo_id)?;
        let files = files
            .into_iter()
            .map(Prepared::new)
            .collect::<Result<Vec<_>, _>>()?;
        // Both the retry loop and the attempt report through `notes`.
        let notes = std::cell::RefCell::new(notes);
        let say = |s: String| (*notes.borrow_mut())(s);
        let (created_repo, _) = retry("creating the repo", &mut |s| say(s), || {
            self.ensure_repo(up)
        })?;
        let (created_branch, _) = retry("creating the branch", &mut |s| say(s), || {
            self.ensure_branch(up)
        })?;
        if created_branch {
            say(format!(
                "created branch {} of {} from main",
                up.revision, up.repo_id
            ));
        }
        let mut lfs_uploaded = 0;
        let ((commit, lfs_files), attempts) = retry("uploading", &mut |s| say(s), || {
            self.push_once(up, &files, &mut lfs_uploaded, &mut |s| say(s))
        })?;
        Ok(CommitInfo {
            commit_oid: commit["commitOid"].as_str().unwrap_or_default().to_string(),
            commit_url: commit["commitUrl"].as_str().unwrap_or_default().to_string(),
            created_repo,
            created_branch,
            lfs_files,
            lfs_uploaded,
            attempts,
        })
    }

    /// One attempt: preupload, the missing LFS objects, the commit.
    fn push_once(
        &self,
        up: &UploadRequest,
        files: &[Prepared],
        lfs_uploaded: &mut usize,
        notes: &mut dyn FnMut(String),
    ) -> Result<(serde_json::Value, Vec<String>), HubError> {
        let (repo, rev) = (up.repo_id.as_str(), up.revision.as_str());
        let api = format!("{}/api/models/{repo}", self.endpoint);
        let b64 = base64::engine::general_purpose::STANDARD;

        // 1. Which files go through LFS (in chunks of 256, as huggingface_hub asks).
        let mut modes = std::collections::HashMap::new();
        for chunk in files.chunks(256) {
            let payload = serde_json::json!({"files": chunk.iter().map(|f| serde_json::json!({
                "path": f.path, "sample": b64.encode(&f.sample), "size": f.size,
            })).collect::<Vec<_>>()});
            let url = format!("{api}/preupload/{}", quote(rev));
            let v = self.post_json(
                repo,
                rev,
                &url,
                "application/json",
                payload.to_string().as_bytes(),
                None,
            )?;
            for f in v["files"].as_array().into_iter().flatten() {
                let path = f["path"].as_str().unwrap_or_default().to_string();
                let lfs = f["uploadMode"].as_str() == Some("lfs");
                let ignore = f["shouldIgnore"].as_bool().unwrap_or(false);
                modes.insert(path, (lfs, ignore));
            }
        }
        let mode = |f: &Prepared| -> Result<(bool, bool), HubError> {
            let (lfs, ignore) = *modes.get(&f.path).ok_or_else(|| HubError::Http {
                url: format!("{api}/preupload/{rev}"),
                status: 200,
                message: format!("the answer has no upload mode for {}", f.path),
            })?;
            // Empty files cannot go through LFS (huggingface_hub makes them regular).
            Ok((lfs && f.size > 0, ignore))
        };
        let mut lfs = Vec::new();
        for f in files {
            if mode(f)? == (true, false) {
                lfs.push(f);
            }
        }

        // 2. LFS objects the hub does not have yet: PUT, then verify.
        if !lfs.is_empty() {
            let url = format!("{}/{repo}.git/info/lfs/objects/batch", self.endpoint);
            let payload = serde_json::json!({
                "operation": "upload",
                "transfers": [LFS_TRANSFER],
                "objects": lfs.iter().map(|f| serde_json::json!({"oid": f.sha256, "size": f.size})).collect::<Vec<_>>(),
                "hash_algo": "sha256",
                "ref": {"name": rev},
            });
            let lfs_json = "application/vnd.git-lfs+json";
            let v = self.post_json(
                repo,
                rev,
                &url,
                lfs_json,
                payload.to_string().as_bytes(),
                Some(lfs_json),
            )?;
            for obj in v["objects"].as_array().into_iter().flatten() {
                let oid = obj["oid"].as_str().unwrap_or_default();
                let f = lfs
                    .iter()
                    .find(|f| f.sha256 == oid)
                    .ok_or_else(|| HubError::Http {
                        url: url.clone(),
                        status: 200,
                        message: format!("the batch answer names an object {oid} not asked for"),
                    })?;
                if let Some(err) = obj.get("error") {
                    return Err(HubError::Http {
                        url: url.clone(),
                        status: err["code"].as_u64().unwrap_or(0) as u16,
                        message: format!("LFS refused {}: {}", f.path, err["message"]),
                    });
                }
                let Some(upload) = obj["actions"].get("upload") else {
                    continue; // the hub has these bytes already
                };
                if upload["header"].get("chunk_size").is_some() {
                    return Err(HubError::Http {
                        url: url.clone(),
                        status: 200,
                        message: format!(
                            "the hub asks for a multipart upload of {}, which tallow does not \
                             send; upload it with huggingface-cli",
                            f.path
                        ),
                    });
                }
                let href = upload["href"].as_str().unwrap_or_default();
                notes(format!(
                    "uploading {} ({} bytes, sha256 {})",
                    f.path, f.size, f.sha256
                ));
                // The href is pre-signed: its own headers, no token.
                let mut put = agent(0).put(href);
                if let Some(h) = upload["header"].as_object() {
                    for (k, val) in h {
                        if let Some(s) = val.as_str() {
                            put = put.set(k, s);
                        }
                    }
                }
                f.put(put)?
                    .map_err(|e| self.write_error(repo, rev, href, e))?;
                if let Some(verify) = obj["actions"].get("verify") {
                    let vurl = verify["href"].as_str().unwrap_or_default();
                    let body = serde_json::json!({"oid": f.sha256, "size": f.size});
                    self.post_json(
                        repo,
                        rev,
                        vurl,
                        lfs_json,
                        body.to_string().as_bytes(),
                        Some(lfs_json),
                    )?;
                }
                *lfs_uploaded += 1;
            }
        }

        // 3. The commit: header, then one line per file.
        let mut ndjson = serde_json::json!({"key": "header", "value": {
            "summary": up.message, "description": up.description,
        }})
        .to_string();
        for f in files {
            let (is_lfs, ignore) = mode(f)?;
            if ignore {
                continue;
            }
            let line = if is_lfs {
                serde_json::json!({"key": "lfsFile", "value": {
                    "path": f.path, "algo": "sha256", "oid": f.sha256, "size": f.size,
                }})
            } else {
                serde_json::json!({"key": "file", "value": {
                    "content": b64.encode(f.bytes()?), "path": f.path, "encoding": "base64",
                }})
            };
            ndjson.push('\n');
            ndjson += &line.to_string();
        }
        let url = format!("{api}/commit/{}", quote(rev));
        let commit = self.post_json(
            repo,
            rev,
            &url,
            "application/x-ndjson",
            ndjson.as_bytes(),
            None,
        )?;
        Ok((commit, lfs.iter().map(|f| f.path.clone()).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        for good in ["me/my-model", "Org_1/a.b-c_d", "a/b"] {
            check_repo_id(good).unwrap();
        }
        let long = format!("me/{}", "x".repeat(97));
        for (bad, why) in [
            ("noslash", "write OWNER/NAME"),
            ("a/b/c", "more than one `/`"),
            ("me/my model", "character ' '"),
            ("me/é", "character 'é'"),
            ("/name", "owner is empty"),
            ("me/", "name is empty"),
            ("me/a--b", "`--`"),
            ("me/a..b", "`..`"),
            ("me/-a", "starts or ends"),
            ("me/a.", "starts or ends"),
            ("me/x.git", "`.git`"),
            (long.as_str(), "at most 96"),
        ] {
            let e = check_repo_id(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.starts_with(&format!("repo id {bad:?}")), "{e}");
        }
    }

    #[test]
    fn branches() {
        for good in ["main", "dev", "exp/lr-1e-4", "v1.0"] {
            check_branch(good).unwrap();
        }
        for bad in [
            "",
            "a b",
            "a..b",
            "-x",
            "x/",
            "x.lock",
            "a:b",
            "0123456789abcdef0123456789abcdef01234567",
        ] {
            let e = check_branch(bad).unwrap_err().to_string();
            assert!(e.contains("--revision branch"), "{bad}: {e}");
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(quote("main"), "main");
    }

    #[test]
    fn retries_only_transient_errors() {
        let mut notes = Vec::new();
        let mut calls = 0;
        let r: Result<(u32, u32), _> = retry("x", &mut |n| notes.push(n), || {
            calls += 1;
            Err(HubError::BadName {
                what: "repo id",
                value: "a".into(),
                reason: "r".into(),
            })
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
        let mut calls = 0;
        let (v, attempts) = retry("x", &mut |n| notes.push(n), || {
            calls += 1;
            if calls < 2 {
                Err(HubError::Http {
                    url: "u".into(),
                    status: 503,
                    message: String::new(),
                })
            } else {
                Ok(7)
            }
        })
        .unwrap();
        assert_eq!((v, attempts), (7, 2));
        assert_eq!(notes.len(), 1);
    }
}
