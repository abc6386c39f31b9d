//! tallow-hub: models and datasets straight from the Hugging Face Hub.
//!
//! - [`resolve_model`]: what every command calls on its model path. An existing local path wins;
//!   otherwise `OWNER/NAME[@REVISION]` is a hub id, served from the cache or downloaded.
//! - [`resolve_data`]: `hf://datasets/OWNER/NAME[@REVISION]/path/in/repo` -> a local file.
//! - [`Hub::dataset_split`]: `hf://datasets/OWNER/NAME[@REVISION]` (a whole dataset) -> the
//!   files of one split, found as the `datasets` library finds them, fetched one at a time.
//! - [`Hub::download`]: `tallow download`.
//!
//! The cache is Python huggingface_hub's, so files downloaded by either are shared:
//!
//! ```text
//! $HF_HUB_CACHE (default $HF_HOME/hub, default ~/.cache/huggingface/hub)
//! └── models--OWNER--NAME/               (datasets--OWNER--NAME/ for datasets)
//!     ├── blobs/<etag>                   file contents; etag = sha256 for LFS files
//!     ├── blobs/<etag>.incomplete        a download in progress (resumed, never used)
//!     ├── refs/<revision>                the commit a branch or tag pointed to
//!     └── snapshots/<commit>/<path>      symlink -> ../../blobs/<etag>
//! ```
//!
//! hf-hub (the sync, ureq flavour) supplies the cache and repo naming and the revision listing
//! (`/api/{models,datasets}/OWNER/NAME/revision/REV`). The file transfer is done here, on the
//! same ureq, because hf-hub 0.4 neither checks hashes nor tells a missing file from a gated
//! repo: a `HEAD /OWNER/NAME/resolve/COMMIT/PATH` gives ETag / X-Repo-Commit / size (following
//! relative redirects only, as huggingface_hub does), then a ranged GET fills
//! `blobs/<etag>.incomplete`, which is checked (size, and sha256 for LFS files) before it is
//! renamed into place.

mod datafiles;
mod dataset;
mod download;
mod error;
mod filter;
mod upload;
mod yaml;

use std::path::{Path, PathBuf};

pub use datafiles::glob_match;
pub use dataset::{DataFilesError, DatasetSplit, ShardFormat};
pub use error::HubError;
pub use filter::Filter;
pub use upload::{
    check_branch, check_repo_id, CommitInfo, Source, UploadFile, UploadRequest, WhoAmI,
};

use error::io_err;
use hf_hub::{Cache, Repo, RepoType};

/// The default endpoint; `HF_ENDPOINT` overrides it.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Model or dataset repo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

impl RepoKind {
    fn hf(self) -> RepoType {
        match self {
            RepoKind::Model => RepoType::Model,
            RepoKind::Dataset => RepoType::Dataset,
        }
    }
}

/// A repo on the hub at one revision: `OWNER/NAME[@REVISION]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo_id: String,
    pub kind: RepoKind,
    /// Branch, tag or commit; `main` when not given.
    pub revision: String,
}

impl HubId {
    /// Parses `OWNER/NAME` or `OWNER/NAME@REVISION`; `None` when `spec` does not have that shape
    /// (a relative path like `./m`, `models/a/b`, or a name with characters a hub id cannot have).
    pub fn parse(spec: &str, kind: RepoKind) -> Option<HubId> {
        let (repo, revision) = match spec.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev.to_string()),
            Some(_) => return None,
            None => (spec, "main".to_string()),
        };
        let (owner, name) = repo.split_once('/')?;
        let ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && !s.starts_with('-')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        (ok(owner) && ok(name)).then(|| HubId {
            repo_id: repo.to_string(),
            kind,
            revision,
        })
    }

    fn repo(&self) -> Repo {
        Repo::with_revision(self.repo_id.clone(), self.kind.hf(), self.revision.clone())
    }

    /// `models--OWNER--NAME` / `datasets--OWNER--NAME`.
    pub fn folder_name(&self) -> String {
        self.repo().folder_name()
    }

    /// The URL path prefix: `OWNER/NAME` or `datasets/OWNER/NAME`.
    fn url_path(&self) -> String {
        self.repo().url()
    }

    fn is_commit(&self) -> bool {
        self.revision.len() == 40 && self.revision.chars().all(|c| c.is_ascii_hexdigit())
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kind == RepoKind::Dataset {
            f.write_str("datasets/")?;
        }
        f.write_str(&self.repo_id)?;
        if self.revision != "main" {
            write!(f, "@{}", self.revision)?;
        }
        Ok(())
    }
}

/// Where and how to talk to the hub: read from the environment variables users know from
/// huggingface_hub.
#[derive(Debug, Clone)]
pub struct Hub {
    /// `HF_ENDPOINT`, no trailing slash.
    pub endpoint: String,
    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub cache_dir: PathBuf,
    /// `HF_TOKEN`, else the token file `huggingface-cli login` writes (`$HF_HOME/token`).
    pub token: Option<String>,
    /// Where `token` came from, for messages: "from HF_TOKEN", "in <HF_HOME>/token".
    pub token_origin: String,
    /// `HF_HUB_OFFLINE=1`: the cache only.
    pub offline: bool,
    /// A progress bar per file on stderr.
    pub progress: bool,
}

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

impl Hub {
    pub fn from_env() -> Hub {
        let hf_home = env_nonempty("HF_HOME").map(PathBuf::from).or_else(|| {
            env_nonempty("XDG_CACHE_HOME")
                .map(|x| PathBuf::from(x).join("huggingface"))
                .or_else(|| {
                    env_nonempty("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface"))
                })
        });
        let hf_home = hf_home.unwrap_or_else(|| PathBuf::from(".cache/huggingface"));
        let cache_dir = env_nonempty("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        // hf-hub reads the token file next to `<HF_HOME>/hub`.
        let (token, token_origin) = match (
            env_nonempty("HF_TOKEN"),
            env_nonempty("HUGGING_FACE_HUB_TOKEN"),
        ) {
            (Some(t), _) => (Some(t.trim().to_string()), "from HF_TOKEN".to_string()),
            (None, Some(t)) => (
                Some(t.trim().to_string()),
                "from HUGGING_FACE_HUB_TOKEN".to_string(),
            ),
            (None, None) => (
                Cache::new(hf_home.join("hub")).token(),
                format!("in {}", hf_home.join("token").display()),
            ),
        };
        let offline = env_nonempty("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE")
        });
        let endpoint = env_nonempty("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
            .trim_end_matches('/')
            .to_string();
        Hub {
            endpoint,
            cache_dir,
            token,
            token_origin,
            offline,
            progress: true,
        }
    }

    /// `<cache>/models--OWNER--NAME`.
    pub fn repo_dir(&self, id: &HubId) -> PathBuf {
        self.cache_dir.join(id.folder_name())
    }

    /// The commit `id.revision` points to in the cache (the revision itself for a commit).
    pub fn cached_commit(&self, id: &HubId) -> Option<String> {
        let dir = self.repo_dir(id);
        if id.is_commit() && dir.join("snapshots").join(&id.revision).is_dir() {
            return Some(id.revision.clone());
        }
        let commit = std::fs::read_to_string(dir.join("refs").join(&id.revision)).ok()?;
        let commit = commit.trim().to_string();
        dir.join("snapshots")
            .join(&commit)
            .is_dir()
            .then_some(commit)
    }

    /// The cached snapshot of `id`, if its revision is in the cache.
    pub fn cached_snapshot(&self, id: &HubId) -> Option<PathBuf> {
        let commit = self.cached_commit(id)?;
        Some(self.repo_dir(id).join("snapshots").join(commit))
    }

    /// The error for `what` of the repo being needed while offline, with what the cache holds.
    fn offline_error(&self, id: &HubId, what: String) -> HubError {
        HubError::Offline {
            what,
            cache: self.cache_dir.clone(),
            cached: self.describe_cache(id),
        }
    }

    /// What the cache holds for the repo, in words, for error messages.
    pub fn describe_cache(&self, id: &HubId) -> String {
        let dir = self.repo_dir(id);
        let mut refs = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir.join("refs")) {
            for e in rd.flatten() {
                if let Ok(c) = std::fs::read_to_string(e.path()) {
                    refs.push(format!(
                        "{} -> {}",
                        e.file_name().to_string_lossy(),
                        c.trim()
                    ));
                }
            }
        }
        let mut snaps = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir.join("snapshots")) {
            for e in rd.flatten() {
                snaps.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        refs.sort();
        snaps.sort();
        if snaps.is_empty() {
            format!(
                "nothing of {} is cached in {}",
                id.repo_id,
                self.cache_dir.display()
            )
        } else {
            format!(
                "cached in {}: snapshots {} (refs: {})",
                dir.display(),
                snaps.join(", "),
                if refs.is_empty() {
                    "none".into()
                } else {
                    refs.join(", ")
                }
            )
        }
    }

    /// A model snapshot dir for `id`: the cached one when it holds a loadable model
    /// (config.json and every safetensors file), else downloaded with the default file set.
    pub fn model_snapshot(&self, id: &HubId) -> Result<PathBuf, HubError> {
        if let Some(dir) = self.cached_snapshot(id) {
            if model_complete(&dir) {
                return Ok(dir);
            }
        }
        if self.offline {
            return Err(self.offline_error(id, format!("model {id}")));
        }
        self.download(id, &Filter::default(), None)
    }

    /// One file of a repo: from the cache, else downloaded. Returns its snapshot path.
    pub fn file(&self, id: &HubId, path: &str) -> Result<PathBuf, HubError> {
        if let Some(dir) = self.cached_snapshot(id) {
            let p = dir.join(path);
            if p.exists() {
                return Ok(p);
            }
        }
        if self.offline {
            return Err(self.offline_error(id, format!("{path} of {id}")));
        }
        let got = self.fetch_file(id, &id.revision, path, None)?;
        if !id.is_commit() {
            self.write_ref(id, &got.commit)?;
        }
        Ok(got.path)
    }

    /// Downloads the files of `id` that `filter` selects into the cache, or into `local_dir`
    /// (real files, not symlinks). Returns the snapshot dir (or `local_dir`).
    ///
    /// With `HF_HUB_OFFLINE=1` it returns the cached snapshot, or an error when there is none.
    pub fn download(
        &self,
        id: &HubId,
        filter: &Filter,
        local_dir: Option<&Path>,
    ) -> Result<PathBuf, HubError> {
        if self.offline {
            let snap = self
                .cached_snapshot(id)
                .ok_or_else(|| self.offline_error(id, id.to_string()))?;
            if let Some(dir) = local_dir {
                copy_tree(&snap, dir, filter)?;
                return Ok(dir.to_path_buf());
            }
            return Ok(snap);
        }
        let info = self.info(id)?;
        let files: Vec<&str> = info
            .siblings
            .iter()
            .map(|s| s.rfilename.as_str())
            .filter(|f| filter.matches(f))
            .collect();
        if files.is_empty() {
            let mut available: Vec<&str> =
                info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
            available.sort();
            return Err(HubError::NoMatchingFiles {
                repo: id.repo_id.clone(),
                revision: id.revision.clone(),
                filter: filter.to_string(),
                available: available.join(", "),
            });
        }
        for f in &files {
            self.fetch_file(id, &info.sha, f, local_dir)?;
        }
        let snap = self.repo_dir(id).join("snapshots").join(&info.sha);
        if !id.is_commit() {
            self.write_ref(id, &info.sha)?;
        }
        Ok(local_dir.map(Path::to_path_buf).unwrap_or(snap))
    }

    fn write_ref(&self, id: &HubId, commit: &str) -> Result<(), HubError> {
        // hf-hub's create_ref writes `refs/<revision>` (revision may contain '/').
        let cache = Cache::new(self.cache_dir.clone());
        cache
            .repo(id.repo())
            .create_ref(commit)
            .map_err(io_err(self.repo_dir(id).join("refs").join(&id.revision)))
    }

    /// The revision's commit and file list, through hf-hub's `info()`
    /// (`GET /api/{models,datasets}/OWNER/NAME/revision/REV`).
    fn info(&self, id: &HubId) -> Result<hf_hub::api::RepoInfo, HubError> {
        let api = hf_hub::api::sync::ApiBuilder::from_cache(Cache::new(self.cache_dir.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(false)
            .build()
            .map_err(|e| self.network_error(id, e.to_string()))?;
        match api.repo(id.repo()).info() {
            Ok(info) => Ok(info),
            Err(hf_hub::api::sync::ApiError::RequestError(e)) => Err(match *e {
                ureq::Error::Status(status, resp) => {
                    let url = resp.get_url().to_string();
                    self.status_error(id, None, status, &resp, &url)
                }
                ureq::Error::Transport(t) => self.network_error(id, t.to_string()),
            }),
            Err(e) => Err(self.network_error(id, e.to_string())),
        }
    }

    fn network_error(&self, id: &HubId, message: String) -> HubError {
        HubError::Network {
            repo: id.to_string(),
            endpoint: self.endpoint.clone(),
            message,
            cached: self.describe_cache(id),
        }
    }

    /// An HTTP error status, told apart by the hub's `X-Error-Code` header as huggingface_hub
    /// does (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`).
    fn status_error(
        &self,
        id: &HubId,
        file: Option<&str>,
        status: u16,
        resp: &ureq::Response,
        url: &str,
    ) -> HubError {
        let code = resp.header("x-error-code").unwrap_or("").to_string();
        let repo_not_found = || HubError::RepoNotFound {
            repo: id.repo_id.clone(),
            endpoint: self.endpoint.clone(),
            dataset: id.kind == RepoKind::Dataset,
        };
        match (code.as_str(), status) {
            ("RepoNotFound", _) => repo_not_found(),
            ("RevisionNotFound", _) => HubError::RevisionNotFound {
                repo: id.repo_id.clone(),
                revision: id.revision.clone(),
            },
            ("EntryNotFound", _) => HubError::FileNotFound {
                repo: id.repo_id.clone(),
                revision: id.revision.clone(),
                file: file.unwrap_or("").to_string(),
            },
            ("GatedRepo", _) | (_, 401 | 403) => HubError::NeedsToken {
                repo: id.repo_id.clone(),
                endpoint: self.endpoint.clone(),
                had_token: self.token.is_some(),
            },
            (_, 404) => match file {
                Some(f) => HubError::FileNotFound {
                    repo: id.repo_id.clone(),
                    revision: id.revision.clone(),
                    file: f.to_string(),
                },
                None => repo_not_found(),
            },
            _ => HubError::Http {
                url: url.to_string(),
                status,
                message: resp.header("x-error-message").unwrap_or("").to_string(),
            },
        }
    }
}

/// config.json plus every weight file the snapshot names (model.safetensors, or the shards of
/// model.safetensors.index.json). A snapshot missing one was downloaded with a narrower filter.
fn model_complete(dir: &Path) -> bool {
    if !dir.join("config.json").exists() {
        return false;
    }
    if dir.join("model.safetensors").exists() {
        return true;
    }
    let Ok(text) = std::fs::read_to_string(dir.join("model.safetensors.index.json")) else {
        return false;
    };
    let Ok(index) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        return false;
    };
    map.values()
        .filter_map(|v| v.as_str())
        .all(|f| dir.join(f).exists())
}

/// Copies the files of a cached snapshot that `filter` selects into `dest` (offline --local-dir).
fn copy_tree(src: &Path, dest: &Path, filter: &Filter) -> Result<(), HubError> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let p = e?.path();
            if p.is_dir() {
                walk(root, &p, out)?;
            } else if let Ok(rel) = p.strip_prefix(root) {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    walk(src, src, &mut files).map_err(io_err(src))?;
    for f in files.iter().filter(|f| filter.matches(f)) {
        let to = dest.join(f);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        std::fs::copy(src.join(f), &to).map_err(io_err(&to))?;
    }
    Ok(())
}

/// What every command calls on its model path: an existing local path is returned as is; an
/// `OWNER/NAME[@REVISION]` hub id is resolved from the cache or downloaded (config, tokenizer
/// files, safetensors, generation config, chat template); anything else is returned as is, for
/// the caller's "no such directory" error.
pub fn resolve_model(spec: &Path) -> Result<PathBuf, HubError> {
    if spec.exists() {
        return Ok(spec.to_path_buf());
    }
    let Some(id) = spec.to_str().and_then(|s| HubId::parse(s, RepoKind::Model)) else {
        return Ok(spec.to_path_buf());
    };
    Hub::from_env().model_snapshot(&id)
}

/// The `config.json` of a model path or hub id, without the weights: a local dir's file (or the
/// path itself when it is a file), or the one file fetched from the hub (cached). For `tallow estimate`, which reads nothing else.
pub fn resolve_model_config(spec: &Path) -> Result<PathBuf, HubError> {
    if spec.is_file() {
        return Ok(spec.to_path_buf()); // a config.json itself
    }
    if spec.exists() {
        return Ok(spec.join("config.json"));
    }
    let Some(id) = spec.to_str().and_then(|s| HubId::parse(s, RepoKind::Model)) else {
        return Ok(spec.join("config.json"));
    };
    Hub::from_env().file(&id, "config.json")
}

/// The scheme of dataset files on the hub, as in huggingface_hub's HfFileSystem.
pub const HF_DATASETS_PREFIX: &str = "hf://datasets/";

/// What an `hf://datasets/...` path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfData {
    /// `hf://datasets/OWNER/NAME[@REVISION]/path/in/repo`: one file.
    File { id: HubId, path: String },
    /// `hf://datasets/OWNER/NAME[@REVISION]`: the whole dataset (a split is picked from it).
    Dataset(HubId),
}

/// Parses `hf://datasets/OWNER/NAME[@REVISION][/path/in/repo]`.
pub fn parse_hf_data(spec: &str) -> Result<HfData, HubError> {
    let bad = || HubError::BadSpec {
        spec: spec.to_string(),
        what: "hub dataset path: write hf://datasets/OWNER/NAME (the whole dataset) or \
               hf://datasets/OWNER/NAME/path/to/file.jsonl (one file), optionally NAME@REVISION",
    };
    let rest = spec.strip_prefix(HF_DATASETS_PREFIX).ok_or_else(bad)?;
    let mut parts = rest.splitn(3, '/');
    let (owner, name, path) = (parts.next(), parts.next(), parts.next());
    let (Some(owner), Some(name)) = (owner, name) else {
        return Err(bad());
    };
    let id = HubId::parse(&format!("{owner}/{name}"), RepoKind::Dataset).ok_or_else(bad)?;
    match path {
        None => Ok(HfData::Dataset(id)),
        Some(path) if path.is_empty() || path.split('/').any(|c| c.is_empty() || c == "..") => {
            Err(bad())
        }
        Some(path) => Ok(HfData::File {
            id,
            path: path.to_string(),
        }),
    }
}

/// Splits `hf://datasets/OWNER/NAME[@REVISION]/path/in/repo` into the repo and the file path;
/// a whole dataset (no path) is an error here.
pub fn parse_hf_path(spec: &str) -> Result<(HubId, String), HubError> {
    match parse_hf_data(spec)? {
        HfData::File { id, path } => Ok((id, path)),
        HfData::Dataset(_) => Err(HubError::BadSpec {
            spec: spec.to_string(),
            what: "path to one file here: add the file's path in the repo, e.g. \
                   hf://datasets/OWNER/NAME/data/train.jsonl (a whole dataset is read by \
                   `tallow train` as data.train / data.eval)",
        }),
    }
}

/// The dataset of `spec` when it is a whole-dataset `hf://datasets/OWNER/NAME[@REV]` path.
pub fn whole_dataset(spec: &Path) -> Option<HubId> {
    match parse_hf_data(spec.to_str()?) {
        Ok(HfData::Dataset(id)) => Some(id),
        _ => None,
    }
}

/// A data path: `hf://datasets/...` is downloaded (or taken from the cache) and its local path
/// returned; any other path is returned as is.
pub fn resolve_data(spec: &Path) -> Result<PathBuf, HubError> {
    match spec.to_str() {
        Some(s) if s.starts_with("hf://") => {
            let (id, path) = parse_hf_path(s)?;
            Hub::from_env().file(&id, &path)
        }
        _ => Ok(spec.to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids() {
        let id = HubId::parse("Qwen/Qwen2.5-0.5B", RepoKind::Model).unwrap();
        assert_eq!(
            (id.repo_id.as_str(), id.revision.as_str()),
            ("Qwen/Qwen2.5-0.5B", "main")
        );
        assert_eq!(id.folder_name(), "models--Qwen--Qwen2.5-0.5B");
        let id = HubId::parse("a/b@v1.0", RepoKind::Dataset).unwrap();
        assert_eq!(id.revision, "v1.0");
        assert_eq!(id.folder_name(), "datasets--a--b");
        for bad in [
            "./m",
            "../a",
            "models/a/b",
            "/abs/x",
            "m",
            "a/b@",
            "a/b c",
            "a/.x",
        ] {
            assert_eq!(HubId::parse(bad, RepoKind::Model), None, "{bad}");
        }
    }

    #[test]
    fn hf_paths() {
        let (id, p) = parse_hf_path("hf://datasets/o/n/data/train.jsonl").unwrap();
        assert_eq!(
            (id.repo_id.as_str(), p.as_str()),
            ("o/n", "data/train.jsonl")
        );
        let (id, _) = parse_hf_path("hf://datasets/o/n@refs%2Fconvert/x.parquet").unwrap();
        assert_eq!(id.revision, "refs%2Fconvert");
        // The whole dataset: not one file.
        let err = parse_hf_path("hf://datasets/o/n").unwrap_err().to_string();
        assert!(err.contains("data.train / data.eval"), "{err}");
        let HfData::Dataset(id) = parse_hf_data("hf://datasets/o/n@v1").unwrap() else {
            panic!("a whole dataset")
        };
        assert_eq!((id.repo_id.as_str(), id.revision.as_str()), ("o/n", "v1"));
        assert_eq!(whole_dataset(Path::new("hf://datasets/o/n/x.jsonl")), None);
        for bad in [
            "hf://datasets/o",
            "hf://datasets/o/n/",
            "hf://models/o/n/x",
            "hf://datasets/o/n/../x",
        ] {
            assert!(parse_hf_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn local_paths_win() {
        let dir = std::env::temp_dir();
        assert_eq!(resolve_model(&dir).unwrap(), dir);
        // Not a hub id and not a dir: returned for the caller's own error.
        let p = Path::new("./no/such/dir");
        assert_eq!(resolve_model(p).unwrap(), p);
        assert_eq!(
            resolve_data(Path::new("d.jsonl")).unwrap(),
            Path::new("d.jsonl")
        );
    }
}
