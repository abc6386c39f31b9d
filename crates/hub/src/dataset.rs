//! Whole hub datasets: `hf://datasets/OWNER/NAME[@REVISION]` -> the files of one split of one
//! config ([`crate::datafiles`] picks them from the revision's file list and README), each
//! downloaded only when [`DatasetSplit::shard`] asks for it.

use std::path::{Path, PathBuf};

use crate::datafiles::{resolve_split, SplitFiles};
use crate::error::io_err;
use crate::{Hub, HubError, HubId};

pub use crate::datafiles::{DataFilesError, ShardFormat};

/// One split of a hub dataset at a fixed commit: its files, fetched one by one.
#[derive(Debug, Clone)]
pub struct DatasetSplit {
    /// The dataset as asked for (`OWNER/NAME`, with the revision written).
    pub id: HubId,
    /// The commit the revision pointed to; every shard is fetched at it.
    pub commit: String,
    pub config: Option<String>,
    pub split: String,
    pub format: ShardFormat,
    /// Repo-relative shard paths, in reading order.
    pub files: Vec<String>,
    hub: Hub,
}

impl DatasetSplit {
    /// `hf://datasets/OWNER/NAME[@REV] (config "C", split "S")`, for messages.
    pub fn name(&self) -> String {
        let config = match &self.config {
            Some(c) => format!("config {c:?}, "),
            None => String::new(),
        };
        format!(
            "hf://{} ({config}split {:?})",
            self.id_at_revision(),
            self.split
        )
    }

    /// `hf://datasets/OWNER/NAME@REV/PATH` of shard `i`, for messages.
    pub fn shard_name(&self, i: usize) -> String {
        format!("hf://{}/{}", self.id_at_revision(), self.files[i])
    }

    fn id_at_revision(&self) -> String {
        let mut s = format!("datasets/{}", self.id.repo_id);
        if self.id.revision != "main" {
            s += &format!("@{}", self.id.revision);
        }
        s
    }

    /// The local path of shard `i`: from the cache, else downloaded now.
    pub fn shard(&self, i: usize) -> Result<PathBuf, HubError> {
        let at_commit = HubId {
            repo_id: self.id.repo_id.clone(),
            kind: self.id.kind,
            revision: self.commit.clone(),
        };
        self.hub.file(&at_commit, &self.files[i])
    }
}

impl Hub {
    /// The files of `split` of `config` (the default config when `None`) of dataset `id`: the
    /// revision's file list and README from the hub (or, offline, from the cached snapshot),
    /// then `datasets`' rules. Nothing but the README is downloaded here.
    pub fn dataset_split(
        &self,
        id: &HubId,
        config: Option<&str>,
        split: &str,
    ) -> Result<DatasetSplit, HubError> {
        let (commit, files, readme) = if self.offline {
            let snap = self
                .cached_snapshot(id)
                .ok_or_else(|| self.offline_error(id, format!("dataset {id}")))?;
            let commit = snap
                .file_name()
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut files = Vec::new();
            walk(&snap, &snap, &mut files).map_err(io_err(&snap))?;
            let readme = snap.join("README.md");
            let readme = match readme.exists() {
                true => Some(std::fs::read_to_string(&readme).map_err(io_err(&readme))?),
                false => None,
            };
            (commit, files, readme)
        } else {
            let info = self.info(id)?;
            let files: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
            let readme = if files.iter().any(|f| f == "README.md") {
                let got = self.fetch_file(id, &info.sha, "README.md", None)?;
                Some(std::fs::read_to_string(&got.path).map_err(io_err(&got.path))?)
            } else {
                None
            };
            if !id.is_commit() {
                self.write_ref(id, &info.sha)?;
            }
            (info.sha, files, readme)
        };
        let SplitFiles {
            config,
            split,
            format,
            files,
        } = resolve_split(&files, readme.as_deref(), config, split).map_err(|source| {
            HubError::DataFiles {
                dataset: id.repo_id.clone(),
                revision: id.revision.clone(),
                commit: commit.clone(),
                source: Box::new(source),
            }
        })?;
        Ok(DatasetSplit {
            id: id.clone(),
            commit,
            config,
            split,
            format,
            files,
            hub: self.clone(),
        })
    }
}

/// Every file under `dir`, relative to `root`, `/`-separated.
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
