//! One file from the hub into the cache: HEAD for ETag / X-Repo-Commit / size, a ranged GET
//! into `blobs/<etag>.incomplete` (resumed after a cut), size and sha256 checked, renamed to
//! `blobs/<etag>`, linked from `snapshots/<commit>/<path>`.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::error::io_err;
use crate::{Hub, HubError, HubId};

/// Attempts per file: a cut transfer resumes from the bytes already on disk.
const ATTEMPTS: usize = 4;

/// A file in the cache (or local dir) and the commit it came from.
pub(crate) struct Fetched {
    pub path: PathBuf,
    pub commit: String,
}

/// What HEAD on `/resolve/` says about a file.
struct Meta {
    commit: String,
    /// `X-Linked-Etag` (LFS: the sha256) else `ETag`, quotes and `W/` removed.
    etag: String,
    size: u64,
    /// Where the bytes are: the resolve URL, or the CDN location it redirects to.
    url: String,
}

pub(crate) fn agent(redirects: u32) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .try_proxy_from_env(true)
        .redirects(redirects)
        .timeout_connect(Duration::from_secs(15))
        .timeout_read(Duration::from_secs(60))
        .build()
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.chars().all(|c| c.is_ascii_hexdigit())
}

fn is_sha1(s: &str) -> bool {
    s.len() == 40 && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// True for "no space left on device" (ENOSPC on Unix, ERROR_DISK_FULL on Windows).
fn is_disk_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || matches!(e.raw_os_error(), Some(28 | 112))
}

impl Hub {
    fn resolve_url(&self, id: &HubId, revision: &str, path: &str) -> String {
        // Revisions like `refs/pr/1` travel URL-encoded, as in hf-hub's `url_revision`.
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            id.url_path(),
            revision.replace('/', "%2F"),
            path
        )
    }

    fn authed(&self, req: ureq::Request) -> ureq::Request {
        match &self.token {
            Some(t) => req.set("Authorization", &format!("Bearer {t}")),
            None => req,
        }
    }

    /// HEAD the resolve URL without following redirects, except relative ones (renamed repos),
    /// as huggingface_hub's `get_hf_file_metadata` does: an absolute redirect goes to the CDN,
    /// and the ETag that names the blob is on the hub's own answer.
    fn head(&self, id: &HubId, revision: &str, path: &str) -> Result<Meta, HubError> {
        let mut url = self.resolve_url(id, revision, path);
        let agent = agent(0);
        for _ in 0..5 {
            let resp = match self.authed(agent.head(&url)).call() {
                Ok(r) => r,
                Err(ureq::Error::Status(status, resp)) => {
                    return Err(self.status_error(id, Some(path), status, &resp, &url))
                }
                Err(ureq::Error::Transport(t)) => return Err(self.network_error(id, t.to_string())),
            };
            let location = resp.header("location").map(str::to_string);
            if (300..400).contains(&resp.status()) {
                let loc = location.clone().ok_or(HubError::Protocol {
                    url: url.clone(),
                    header: "Location",
                })?;
                if loc.starts_with('/') {
                    url = format!("{}{loc}", origin(&url));
                    continue;
                }
            }
            let commit = resp
                .header("x-repo-commit")
                .ok_or(HubError::Protocol {
                    url: url.clone(),
                    header: "X-Repo-Commit",
                })?
                .to_string();
            let etag = resp
                .header("x-linked-etag")
                .or_else(|| resp.header("etag"))
                .ok_or(HubError::Protocol {
                    url: url.clone(),
                    header: "ETag",
                })?
                .trim_start_matches("W/")
                .replace('"', "");
            let size = resp
                .header("x-linked-size")
                .or_else(|| resp.header("content-length"))
                .and_then(|s| s.parse().ok())
                .ok_or(HubError::Protocol {
                    url: url.clone(),
                    header: "Content-Length",
                })?;
            let url = match location {
                Some(loc) if (300..400).contains(&resp.status()) => loc,
                _ => url,
            };
            return Ok(Meta {
                commit,
                etag,
                size,
                url,
            });
        }
        Err(HubError::Http {
            url,
            status: 310,
            message: "too many redirects".into(),
        })
    }

    /// Downloads `path` of `id` at `revision` (unless its blob is cached) and links it into the
    /// snapshot of its commit; with `local_dir`, also copies it there.
    pub(crate) fn fetch_file(
        &self,
        id: &HubId,
        revision: &str,
        path: &str,
        local_dir: Option<&Path>,
    ) -> Result<Fetched, HubError> {
        let repo_dir = self.repo_dir(id);
        let snap_file = |commit: &str| repo_dir.join("snapshots").join(commit).join(path);
        // A commit-pinned file already linked needs no request at all.
        let linked = snap_file(revision);
        let (commit, pointer) = if revision.len() == 40 && linked.exists() {
            (revision.to_string(), linked)
        } else {
            let meta = self.head(id, revision, path)?;
            let pointer = snap_file(&meta.commit);
            if !pointer.exists() {
                let blobs = repo_dir.join("blobs");
                let blob = blobs.join(&meta.etag);
                if !blob.exists() {
                    self.download_blob(id, path, &meta, &blob)?;
                }
                link(&blob, &pointer, path)?;
            }
            (meta.commit, pointer)
        };
        let path_out = match local_dir {
            None => pointer,
            Some(dir) => {
                let to = dir.join(path);
                if let Some(parent) = to.parent() {
                    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
                }
                let _ = std::fs::remove_file(&to);
                // Same disk: a hard link costs nothing; else a copy.
                let blob = std::fs::canonicalize(&pointer).map_err(io_err(&pointer))?;
                if std::fs::hard_link(&blob, &to).is_err() {
                    std::fs::copy(&blob, &to).map_err(|e| {
                        let _ = std::fs::remove_file(&to);
                        if is_disk_full(&e) {
                            HubError::DiskFull {
                                repo: id.repo_id.clone(),
                                file: path.to_string(),
                                dir: dir.to_path_buf(),
                            }
                        } else {
                            HubError::Io {
                                path: to.clone(),
                                source: e,
                            }
                        }
                    })?;
                }
                to
            }
        };
        Ok(Fetched {
            path: path_out,
            commit,
        })
    }

    /// Fills `<blob>.incomplete` (resuming what an earlier, cut attempt left), checks its size
    /// and, for an LFS file (the ETag is its sha256), its hash, then renames it to `blob`.
    fn download_blob(
        &self,
        id: &HubId,
        path: &str,
        meta: &Meta,
        blob: &Path,
    ) -> Result<(), HubError> {
        let dir = blob.parent().expect("blobs dir");
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let part = dir.join(format!("{}.incomplete", meta.etag));
        let disk_full = |part: &Path| {
            let _ = std::fs::remove_file(part);
            HubError::DiskFull {
                repo: id.repo_id.clone(),
                file: path.to_string(),
                dir: dir.to_path_buf(),
            }
        };
        let bar = if self.progress {
            ProgressBar::with_draw_target(Some(meta.size), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:30!} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} (eta {eta})",
            )
            .expect("static template"),
        );
        bar.set_message(path.to_string());

        let agent = agent(5);
        let mut last_error = String::new();
        for attempt in 0..ATTEMPTS {
            let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
            if have == meta.size {
                break;
            }
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200 * attempt as u64));
            }
            let have = if have > meta.size { 0 } else { have };
            // The token goes to the hub only, never to the CDN origin a redirect names (as
            // huggingface_hub: tests/fixtures/hub/hf_client_exchange.json).
            let get = agent.get(&meta.url);
            let get = match origin(&meta.url) == origin(&self.endpoint) {
                true => self.authed(get),
                false => get,
            };
            let req = get.set("Range", &format!("bytes={have}-"));
            let resp = match req.call() {
                Ok(r) => r,
                Err(ureq::Error::Status(416, _)) => {
                    // The partial file is not a prefix of this blob: start over.
                    let _ = std::fs::remove_file(&part);
                    last_error = "HTTP 416 on resume".into();
                    continue;
                }
                Err(ureq::Error::Status(status, resp)) => {
                    return Err(self.status_error(id, Some(path), status, &resp, &meta.url))
                }
                Err(ureq::Error::Transport(t)) => {
                    last_error = t.to_string();
                    continue;
                }
            };
            // 206: the server honoured the range, append; 200: whole file, start over.
            let resumed = resp.status() == 206 && have > 0;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(resumed)
                .truncate(!resumed)
                .open(&part)
                .map_err(|e| {
                    if is_disk_full(&e) {
                        disk_full(&part)
                    } else {
                        HubError::Io {
                            path: part.clone(),
                            source: e,
                        }
                    }
                })?;
            bar.set_position(if resumed { have } else { 0 });
            let mut reader = resp.into_reader();
            let mut buf = vec![0u8; 1 << 16];
            loop {
                let n = match reader.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        last_error = format!("transfer of {path} cut off: {e}");
                        break;
                    }
                };
                if let Err(e) = file.write_all(&buf[..n]) {
                    return Err(if is_disk_full(&e) {
                        disk_full(&part)
                    } else {
                        HubError::Io {
                            path: part.clone(),
                            source: e,
                        }
                    });
                }
                bar.inc(n as u64);
            }
            if let Err(e) = file.sync_all() {
                if is_disk_full(&e) {
                    return Err(disk_full(&part));
                }
            }
        }
        let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if have != meta.size {
            bar.abandon();
            // Keep the partial file: the next run resumes it.
            return Err(self.network_error(
                id,
                format!(
                    "{path}: {have} of {} bytes after {ATTEMPTS} attempts ({last_error}); run \
                     the command again to resume",
                    meta.size
                ),
            ));
        }
        // LFS files: the ETag is the sha256 of the content; other files: git's blob id,
        // sha1("blob {len}\0" + content).
        let checked = if is_sha256(&meta.etag) {
            Some(sha256_file(&part)?)
        } else if is_sha1(&meta.etag) {
            Some(git_blob_sha1_file(&part)?)
        } else {
            None
        };
        if let Some(actual) = checked {
            if !actual.eq_ignore_ascii_case(&meta.etag) {
                let _ = std::fs::remove_file(&part);
                bar.abandon();
                return Err(HubError::HashMismatch {
                    repo: id.repo_id.clone(),
                    file: path.to_string(),
                    expected: meta.etag.clone(),
                    actual,
                });
            }
        }
        std::fs::rename(&part, blob).map_err(io_err(blob))?;
        bar.finish();
        Ok(())
    }
}

/// git's blob id of a file: sha1 of `blob {len}\0` followed by the content.
fn git_blob_sha1_file(path: &Path) -> Result<String, HubError> {
    let len = std::fs::metadata(path).map_err(io_err(path))?.len();
    hash_file(sha1::Sha1::new(), format!("blob {len}\0").as_bytes(), path)
}

pub(crate) fn sha256_file(path: &Path) -> Result<String, HubError> {
    hash_file(Sha256::new(), b"", path)
}

/// Lower-case hex digest of `prefix` followed by the file's content, read in 64 KiB blocks.
fn hash_file<D: Digest>(mut h: D, prefix: &[u8], path: &Path) -> Result<String, HubError> {
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    h.update(prefix);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

/// `snapshots/<commit>/<path>` -> `../../blobs/<etag>` (one more `..` per directory in `path`),
/// as huggingface_hub writes it; a copy where symlinks are not available.
fn link(blob: &Path, pointer: &Path, path: &str) -> Result<(), HubError> {
    let parent = pointer.parent().expect("snapshot dir");
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let _ = std::fs::remove_file(pointer);
    #[cfg(unix)]
    {
        let mut rel = PathBuf::from("../..");
        for _ in 0..path.matches('/').count() {
            rel.push("..");
        }
        rel.push("blobs");
        rel.push(blob.file_name().expect("blob name"));
        std::os::unix::fs::symlink(&rel, pointer).map_err(io_err(pointer))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        std::fs::copy(blob, pointer)
            .map(|_| ())
            .map_err(io_err(pointer))
    }
}
