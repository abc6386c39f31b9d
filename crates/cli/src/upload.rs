//! `tallow upload REPO_ID PATH`: a dir into a hub model repo as one commit (see
//! `tallow_hub::Hub::upload`), with a model card ([`crate::card`]) when the dir has no README.md.
//! `tallow train` calls [`push`] after the final save when `train.push_to_hub` is set.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tallow_hub::{CommitInfo, Hub, Source, UploadFile, UploadRequest};

use crate::args::UploadArgs;

pub fn run(a: UploadArgs) -> Result<()> {
    // Names first: no file is read and no request made for an id the hub would refuse.
    tallow_hub::check_repo_id(&a.repo_id)?;
    tallow_hub::check_branch(&a.revision)?;
    let info = push(
        &a.repo_id,
        &a.path,
        a.private,
        &a.revision,
        a.message.as_deref(),
    )?;
    println!("{}", info.commit_url);
    Ok(())
}

/// Every file under `dir` (relative, `/`-separated, sorted), hidden files and dirs left out.
fn list_files(dir: &Path) -> Result<Vec<String>> {
    fn walk(root: &Path, d: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
        for e in std::fs::read_dir(d)? {
            let e = e?;
            if e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out)?;
            } else if let Ok(rel) = p.strip_prefix(root) {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out).with_context(|| format!("reading {}", dir.display()))?;
    out.sort();
    Ok(out)
}

/// Uploads `path` (a dir, or one file) to `repo_id` at `revision`, adding a model card when
/// there is no README.md; prints progress on stderr. The local files are only read.
pub fn push(
    repo_id: &str,
    path: &Path,
    private: bool,
    revision: &str,
    message: Option<&str>,
) -> Result<CommitInfo> {
    if !path.exists() {
        bail!(
            "PATH {} does not exist: give the dir to upload (a run's adapter/ or model/, or a \
             `tallow merge` output)",
            path.display()
        );
    }
    let mut files: Vec<UploadFile> = if path.is_dir() {
        list_files(path)?
            .into_iter()
            .map(|rel| UploadFile {
                source: Source::File(path.join(&rel)),
                path_in_repo: rel,
            })
            .collect()
    } else {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        vec![UploadFile {
            path_in_repo: name,
            source: Source::File(path.to_path_buf()),
        }]
    };
    if files.is_empty() {
        bail!(
            "PATH {} has no files to upload (hidden files are left out)",
            path.display()
        );
    }
    if path.is_dir() && !files.iter().any(|f| f.path_in_repo == "README.md") {
        files.push(UploadFile {
            path_in_repo: "README.md".into(),
            source: Source::Bytes(crate::card::model_card(path, repo_id).into_bytes()),
        });
        eprintln!("adding a model card (README.md) to the commit");
    }
    let hub = Hub::from_env();
    if hub.offline {
        bail!("HF_HUB_OFFLINE is set: uploading needs the hub; unset HF_HUB_OFFLINE");
    }
    let dir_name = path
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| path.display().to_string());
    let req = UploadRequest {
        repo_id: repo_id.to_string(),
        revision: revision.to_string(),
        private,
        message: message
            .map(str::to_string)
            .unwrap_or_else(|| format!("Upload {dir_name} with tallow")),
        description: String::new(),
    };
    let n = files.len();
    let info = hub.upload(&req, files, &mut |note| eprintln!("{note}"))?;
    eprintln!(
        "{} {repo_id}: {n} files ({} through LFS, {} sent) in commit {} on {revision}{}",
        if info.created_repo {
            "created"
        } else {
            "updated"
        },
        info.lfs_files.len(),
        info.lfs_uploaded,
        info.commit_oid,
        if info.attempts > 1 {
            format!(" after {} attempts", info.attempts)
        } else {
            String::new()
        }
    );
    Ok(info)
}
