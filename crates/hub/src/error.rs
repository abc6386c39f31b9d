//! Errors of hub downloads. Every message names the repo (and revision or file where there is
//! one) and says what to do.

use std::path::PathBuf;

/// An error while resolving or downloading from the Hugging Face Hub.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// 401/403 on a gated or private repo.
    #[error(
        "the repo {repo} needs a token: run `huggingface-cli login` or set HF_TOKEN{}",
        if *had_token {
            format!(
                " (a token was sent and refused: check that it has read access and, for a gated \
                 repo, that access was granted at {endpoint}/{repo})"
            )
        } else {
            format!(" (for a gated repo, also request access at {endpoint}/{repo})")
        }
    )]
    NeedsToken {
        repo: String,
        endpoint: String,
        had_token: bool,
    },

    /// The repo does not exist (or is private and no token was sent).
    #[error(
        "repo {repo} not found on {endpoint}: check the id (OWNER/NAME{}); a private repo also \
         needs HF_TOKEN",
        if *dataset { ", and that it is a dataset repo" } else { "" }
    )]
    RepoNotFound {
        repo: String,
        endpoint: String,
        dataset: bool,
    },

    /// The repo exists but the revision (branch, tag or commit) does not.
    #[error("repo {repo} has no revision {revision:?}: give an existing branch, tag or commit")]
    RevisionNotFound { repo: String, revision: String },

    /// The repo and revision exist but the file does not.
    #[error("repo {repo} has no file {file:?} at revision {revision:?}")]
    FileNotFound {
        repo: String,
        revision: String,
        file: String,
    },

    /// Any other HTTP error status.
    #[error("{url}: the hub answered HTTP {status}{}", if message.is_empty() { String::new() } else { format!(" ({message})") })]
    Http {
        url: String,
        status: u16,
        message: String,
    },

    /// The hub could not be reached (DNS, refused, reset, timeout) or a transfer was cut off.
    #[error("network error reaching {endpoint} for {repo}: {message}; {cached}")]
    Network {
        repo: String,
        endpoint: String,
        message: String,
        /// What the cache holds for the repo, in words.
        cached: String,
    },

    /// `HF_HUB_OFFLINE=1` and what was asked for is not in the cache.
    #[error(
        "HF_HUB_OFFLINE is set and {what} is not in the cache {}: {cached}; unset HF_HUB_OFFLINE \
         to download it",
        cache.display()
    )]
    Offline {
        what: String,
        cache: PathBuf,
        cached: String,
    },

    /// A downloaded file's hash (sha256 for LFS files, git's blob sha1 for others) is not the
    /// one the hub announced: the file was deleted.
    #[error(
        "{repo}: {file} was downloaded corrupt: its {} is {actual}, not the {expected} the hub \
         announced; the file was deleted, run the command again",
        if expected.len() == 64 { "sha256" } else { "git blob sha1" }
    )]
    HashMismatch {
        repo: String,
        file: String,
        expected: String,
        actual: String,
    },

    /// The disk filled up while writing a download; the partial file was removed.
    #[error(
        "no space left on the device while downloading {repo}/{file} into {}: the partial file \
         was removed; free space or point HF_HOME / HF_HUB_CACHE (or --local-dir) elsewhere",
        dir.display()
    )]
    DiskFull {
        repo: String,
        file: String,
        dir: PathBuf,
    },

    /// The revision has no file matching the include/exclude patterns.
    #[error("{repo}@{revision}: no file matches {filter} (the repo has: {available})")]
    NoMatchingFiles {
        repo: String,
        revision: String,
        filter: String,
        available: String,
    },

    /// A response lacks a header the download needs.
    #[error("{url}: the response has no {header} header (is HF_ENDPOINT a Hugging Face hub?)")]
    Protocol { url: String, header: &'static str },

    /// Not a hub id / hf:// path the caller can use.
    #[error("{spec:?} is not a {what}")]
    BadSpec { spec: String, what: &'static str },

    /// An upload without a token (neither `HF_TOKEN` nor the token file).
    #[error(
        "uploading to {repo} needs a token with write access: set HF_TOKEN=hf_... or run \
         `huggingface-cli login` (it writes $HF_HOME/token, default ~/.cache/huggingface/token); \
         create one at {endpoint}/settings/tokens"
    )]
    NoToken { repo: String, endpoint: String },

    /// 401 on an upload or `whoami`: the hub does not know the token.
    #[error(
        "token rejected by {endpoint} (HTTP 401): the token {source_name} is invalid or expired; \
         create a new one at {endpoint}/settings/tokens"
    )]
    TokenRejected {
        endpoint: String,
        /// Where the token came from, in words ("from HF_TOKEN", "in $HF_HOME/token").
        source_name: String,
    },

    /// 403 on an upload: the token's user may not write to the repo.
    #[error(
        "not allowed to write to {repo} (HTTP 403{}): the token belongs to {user}; use a repo \
         under your own name or an organization where you have write access, and a token with \
         the write role",
        if message.is_empty() { String::new() } else { format!(": {message}") }
    )]
    NotAllowed {
        repo: String,
        user: String,
        message: String,
    },

    /// The token is accepted but has the read role only.
    #[error(
        "the token of {user} is read-only: uploading to {repo} needs a token with the write \
         role ({endpoint}/settings/tokens)"
    )]
    ReadOnlyToken {
        repo: String,
        user: String,
        endpoint: String,
    },

    /// A repo id or branch name the hub would refuse, caught before any request.
    #[error("{what} {value:?} is not valid: {reason}")]
    BadName {
        what: &'static str,
        value: String,
        reason: String,
    },

    /// A whole dataset (`hf://datasets/OWNER/NAME`) has no usable files for the split asked
    /// for (or the config does not exist, or the README's `configs:` cannot be read).
    #[error(
        "dataset hf://datasets/{dataset} at revision {revision:?} (commit {commit}): {source}"
    )]
    DataFiles {
        /// `OWNER/NAME`.
        dataset: String,
        revision: String,
        commit: String,
        source: Box<crate::datafiles::DataFilesError>,
    },

    /// A local file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `io_err(path)(e)`: wraps an I/O error with the path it concerns.
pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.into();
    move |source| HubError::Io { path, source }
}
