//! `tallow download`: a hub repo into the HF cache (or a local dir); prints where it is.

use anyhow::{Context, Result};
use tallow_hub::{Filter, Hub, HubId, RepoKind};

use crate::args::DownloadArgs;

pub fn run(a: DownloadArgs) -> Result<()> {
    let kind = match a.repo_type.as_str() {
        "dataset" => RepoKind::Dataset,
        _ => RepoKind::Model,
    };
    let mut id = HubId::parse(&a.repo_id, kind).with_context(|| {
        format!(
            "{:?} is not a hub repo id: write OWNER/NAME or OWNER/NAME@REVISION",
            a.repo_id
        )
    })?;
    if let Some(rev) = a.revision {
        id.revision = rev;
    }
    // A dataset repo has no "what training needs": without --include, take every file.
    let include = if a.include.is_empty() && kind == RepoKind::Dataset {
        vec!["*".to_string()]
    } else {
        a.include
    };
    let filter = Filter::new(include, a.exclude);
    let mut hub = Hub::from_env();
    hub.progress = !a.quiet;
    let path = hub.download(&id, &filter, a.local_dir.as_deref())?;
    println!("{}", path.display());
    Ok(())
}
