//! Atomic output: every file tallow writes goes to a temporary name in the same directory and is
//! renamed into place, so a killed run never leaves a half-written checkpoint, adapter or model.
//! And the reading of small text / JSON files with errors that name the file.

pub mod gguf;
pub mod weights;

use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::error::{ModelError, Result};

fn io_err(path: &Path, source: std::io::Error) -> ModelError {
    if source.kind() == std::io::ErrorKind::StorageFull {
        return ModelError::Invalid(format!(
            "{}: disk full while writing; free some space and run again (a training run continues \
             from its last checkpoint with --resume)",
            path.display()
        ));
    }
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The text of `path`; an error names the file.
pub fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `text` (read from `path`) parsed as JSON; an error names the file.
pub fn parse_json<T: serde::de::DeserializeOwned>(text: &str, path: &Path) -> Result<T> {
    serde_json::from_str(text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes `bytes` to `path` atomically (temp file + fsync + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

/// Saves named tensors as one safetensors file, atomically. Names are sorted in the file.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<()> {
    let mut sorted: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    // safetensors wants contiguous CPU data.
    let cpu: Vec<(&str, Tensor)> = sorted
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(&candle_core::Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(cpu.iter().map(|(n, t)| (*n, t)), metadata)
        .map_err(|e| ModelError::Invalid(format!("{}: cannot serialize: {e}", path.display())))?;
    write_atomic(path, &bytes)
}

/// Replaces directory `dest` with the fully written directory `staged` (same parent): the old
/// content is moved aside first and removed only after the rename succeeded.
pub fn replace_dir(staged: &Path, dest: &Path) -> Result<()> {
    let old: Option<PathBuf> = if dest.exists() {
        let aside = dest.with_extension(format!("old-{}", std::process::id()));
        std::fs::rename(dest, &aside).map_err(|e| io_err(dest, e))?;
        Some(aside)
    } else {
        None
    };
    std::fs::rename(staged, dest).map_err(|e| io_err(dest, e))?;
    if let Some(old) = old {
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(())
}

/// A fresh staging directory next to `dest` (`.NAME.tmp-PID`), for writing a directory output
/// before [`replace_dir`] puts it in place.
pub fn staging_dir(dest: &Path) -> Result<PathBuf> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let staged = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staged);
    std::fs::create_dir_all(&staged).map_err(|e| io_err(&staged, e))?;
    Ok(staged)
}
