//! Training checkpoints: `output_dir/checkpoints/step-N/` holds the trainable weights, the
//! optimizer state and `state.json` (step, what was trained, data position). A checkpoint is
//! written into a staging directory and renamed into place, so a killed run leaves either the
//! whole checkpoint or none, and `--resume` always finds a complete one.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use tallow_model::io::{replace_dir, save_safetensors, staging_dir, write_atomic};

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
    pub tallow_version: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LoraState {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<String>,
    pub rslora: bool,
    /// Absent in checkpoints written before DoRA existed: false.
    #[serde(default)]
    pub dora: bool,
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

/// The newest complete checkpoint (`step-N` with the largest N that has a state.json).
pub fn latest(output_dir: &Path) -> Option<(usize, PathBuf)> {
    let entries = std::fs::read_dir(checkpoints_dir(output_dir)).ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n: usize = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join("state.json").exists().then(|| (n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
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
