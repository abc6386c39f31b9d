//! Training checkpoints: `output_dir/checkpoints/step-N/` holds the trainable weights, the
//! optimizer state and `state.json` (step, what was trained, data position). A checkpoint is
//! written into a staging directory and renamed into place, so a killed run leaves either the
//! whole checkpoint or none, and `--resume` always finds a complete one.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use tallow_model::io::{replace_dir, save_safetensors, staging_dir, write_atomic};

use crate::best::BestEval;
use crate::error::TrainError;

/// `state.json` of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointState {
    /// Optimizer steps done.
    pub step: usize,
    /// `lora` or `full`.
    pub method: String,
    /// HF class of the model trained (e.g. `Qwen2ForCausalLM`).
    pub architecture: String,
    /// `model.path` of the run.
    pub model_path: String,
    /// LoRA rank / alpha / targets, when method = lora.
    pub lora: Option<LoraState>,
    /// Name -> shape of every trainable tensor.
    pub trainable: BTreeMap<String, Vec<usize>>,
    pub optimizer: String,
    /// How the base's decoder linears are stored: `none`, `nf4`, `nf4+double_quant`
    /// (checkpoints written before this field read as `none`).
    #[serde(default = "no_quantize")]
    pub quantize: String,
    /// Target tokens trained on so far.
    pub tokens_seen: u64,
    /// Seconds of training so far (for tokens/s across resumes).
    pub elapsed_s: f64,
    /// The best evaluation so far and the patience counter (`train.keep_best`, early stopping);
    /// absent in checkpoints written before them: no evaluation seen.
    #[serde(default)]
    pub best_eval: BestEval,
    /// Ranks of the data-parallel run that wrote it (1 before data parallelism existed): a
    /// run resumes only with the same number, since the rows each step saw depend on it.
    #[serde(default = "one")]
    pub world_size: usize,
    pub tallow_version: String,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LoraState {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<String>,
    pub rslora: bool,
    /// The adapter kind ("lora", "dora"). Checkpoints written before kinds had `dora: bool`
    /// (absent: false), read by [`LoraState::kind`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<tallow_model::AdapterKind>,
    #[serde(default, skip_serializing)]
    pub dora: bool,
}

impl LoraState {
    /// The adapter kind, from `kind` or an older checkpoint's `dora`.
    pub fn kind(&self) -> tallow_model::AdapterKind {
        self.kind.unwrap_or(if self.dora {
            tallow_model::AdapterKind::Dora
        } else {
            tallow_model::AdapterKind::Lora
        })
    }
}

fn no_quantize() -> String {
    "none".into()
}

pub fn checkpoints_dir(output_dir: &Path) -> PathBuf {
    output_dir.join("checkpoints")
}

/// Writes `checkpoints/step-{state.step}/` atomically.
pub fn save(
    output_dir: &Path,
    state: &CheckpointState,
    trainable: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
) -> Result<PathBuf, TrainError> {
    let dest = checkpoints_dir(output_dir).join(format!("step-{}", state.step));
    let staged = staging_dir(&dest)?;
    save_safetensors(&staged.join("trainable.safetensors"), trainable, None)?;
    save_safetensors(&staged.join("optimizer.safetensors"), optimizer, None)?;
    let json = serde_json::to_string_pretty(state).expect("serializable");
    write_atomic(&staged.join("state.json"), json.as_bytes())?;
    replace_dir(&staged, &dest)?;
    Ok(dest)
}

/// The complete checkpoints (`step-N` with a state.json), oldest first.
pub fn all(output_dir: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(checkpoints_dir(output_dir)) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: usize = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join("state.json").exists().then(|| (n, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The newest complete checkpoint (`step-N` with the largest N that has a state.json).
pub fn latest(output_dir: &Path) -> Option<(usize, PathBuf)> {
    all(output_dir).pop()
}

/// `train.save_total_limit`: removes the oldest checkpoints until `limit` remain, never the one
/// of step `keep` (the best, with `keep_best`), which is kept besides. Each is renamed out of the
/// `step-N` namespace before it is deleted, so a run killed mid-removal never leaves a partial
/// `step-N` for `--resume` to find. Returns the removed dirs.
pub fn rotate(
    output_dir: &Path,
    limit: usize,
    keep: Option<usize>,
) -> Result<Vec<PathBuf>, TrainError> {
    let candidates: Vec<(usize, PathBuf)> = all(output_dir)
        .into_iter()
        .filter(|(n, _)| Some(*n) != keep)
        .collect();
    let excess = candidates.len().saturating_sub(limit);
    let mut removed = Vec::new();
    for (n, dir) in candidates.into_iter().take(excess) {
        let aside = checkpoints_dir(output_dir).join(format!(".removing-step-{n}"));
        let _ = std::fs::remove_dir_all(&aside);
        std::fs::rename(&dir, &aside)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", dir.display())))?;
        std::fs::remove_dir_all(&aside)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", aside.display())))?;
        removed.push(dir);
    }
    Ok(removed)
}

/// A loaded checkpoint.
pub struct Loaded {
    pub state: CheckpointState,
    pub trainable: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
}

pub fn load(dir: &Path, device: &Device) -> Result<Loaded, TrainError> {
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path)
        .map_err(|e| TrainError::Resume(format!("{}: {e}", state_path.display())))?;
    let state: CheckpointState = serde_json::from_str(&text)
        .map_err(|e| TrainError::Resume(format!("{}: {e}", state_path.display())))?;
    let read = |name: &str| {
        let p = dir.join(name);
        candle_core::safetensors::load(&p, device)
            .map_err(|e| TrainError::Resume(format!("{}: {e}", p.display())))
    };
    Ok(Loaded {
        trainable: read("trainable.safetensors")?,
        optimizer: read("optimizer.safetensors")?,
        state,
    })
}

/// Refuses to resume from a checkpoint of another model, method, rank or target set, naming
/// what differs.
pub fn check_compatible(
    saved: &CheckpointState,
    now: &CheckpointState,
    dir: &Path,
) -> Result<(), TrainError> {
    if saved.world_size != now.world_size {
        return Err(TrainError::Resume(format!(
            "{} was written by a run of {} rank(s) and this run has {}: resume with the same \
             number of ranks (`tallow train --nproc {}`, or that many under mpirun / torchrun / \
             srun), or point train.output_dir elsewhere",
            dir.display(),
            saved.world_size,
            now.world_size,
            saved.world_size
        )));
    }
    let mut diffs = Vec::new();
    // "{what} {saved} vs {now}" for a field that differs, each value shown with `$fmt`.
    macro_rules! differs {
        ($what:literal, $field:ident, $fmt:literal) => {
            if saved.$field != now.$field {
                let (a, b) = (&saved.$field, &now.$field);
                diffs.push(format!(concat!($what, " ", $fmt, " vs ", $fmt), a, b));
            }
        };
    }
    differs!("method", method, "{}");
    differs!("architecture", architecture, "{}");
    differs!("lora", lora, "{:?}");
    differs!("optimizer", optimizer, "{}");
    differs!("base quantization", quantize, "{}");
    if diffs.is_empty() && saved.trainable != now.trainable {
        let bad = now
            .trainable
            .iter()
            .find(|(k, v)| saved.trainable.get(*k) != Some(v))
            .map(|(k, v)| format!("{k}: {:?} vs {v:?}", saved.trainable.get(k)))
            .unwrap_or_else(|| "different tensor names".into());
        diffs.push(format!(
            "trainable shapes differ ({bad}): a different model"
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(TrainError::Resume(format!(
            "{} was written by a different run ({}); point train.output_dir elsewhere or drop --resume",
            dir.display(),
            diffs.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rotate` keeps the newest `limit` complete checkpoints and the protected one; a dir
    /// without state.json is not a checkpoint and is neither counted nor removed.
    #[test]
    fn rotate_keeps_newest_and_best() {
        let out = std::env::temp_dir().join(format!("tallow-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        for n in [1, 2, 3, 10, 20] {
            let d = checkpoints_dir(&out).join(format!("step-{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("state.json"), "{}").unwrap();
        }
        std::fs::create_dir_all(checkpoints_dir(&out).join("step-30")).unwrap(); // incomplete
        let removed = rotate(&out, 2, Some(2)).unwrap();
        let steps = |v: Vec<(usize, PathBuf)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(steps(all(&out)), [2, 10, 20]);
        assert_eq!(removed.len(), 2);
        assert!(checkpoints_dir(&out).join("step-30").exists());
        // Numeric order, not by name: step-10 is newer than step-2.
        rotate(&out, 1, None).unwrap();
        assert_eq!(steps(all(&out)), [20]);
        std::fs::remove_dir_all(&out).unwrap();
    }
}
