//! Errors of the model crate. Each message names the file or tensor involved and, where there is
//! one, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "{path}: unsupported architecture `{found}`; tallow supports {supported} \
         (set by `architectures` / `model_type` in config.json)"
    )]
    UnsupportedArchitecture {
        path: PathBuf,
        found: String,
        supported: String,
    },

    #[error("{path}: key `{key}`: {msg}")]
    Config {
        path: PathBuf,
        key: String,
        msg: String,
    },

    /// Every key of a `config.json` that tallow refuses, at once (`crate::config::hf_keys::Refusals`).
    #[error(
        "{path}: tallow cannot compute what transformers' {class} computes with {}:\n{}\n\
         If a key really has no effect on this model, list it in `model.ignore_config_keys` \
         (train, estimate) or pass `--ignore-config-key KEY` (eval, generate, chat, merge): \
         tallow then reads the file as if the key were absent, and config.json (in the Hub \
         cache a shared file) stays as it is",
        if refusals.len() == 1 { "this key".to_string() } else { format!("these {} keys", refusals.len()) },
        refusals.iter().map(|r| format!("  - {r}")).collect::<Vec<_>>().join("\n")
    )]
    Refused {
        path: PathBuf,
        class: String,
        refusals: Vec<Refusal>,
    },

    #[error(
        "{path}: not a readable GGUF file ({msg}); the file may be truncated or corrupt: \
         download or convert it again"
    )]
    BadGguf { path: PathBuf, msg: String },

    /// Every metadata key or tensor of a GGUF file that tallow cannot read exactly, at once.
    #[error(
        "{path}: tallow cannot read this GGUF file exactly ({}):\n{}\nConvert the original \
         model's safetensors instead, or see docs/gguf.md for what is read",
        if refusals.len() == 1 { "this key".to_string() } else { format!("these {} keys", refusals.len()) },
        refusals.iter().map(|r| format!("  - {r}")).collect::<Vec<_>>().join("\n")
    )]
    GgufRefused {
        path: PathBuf,
        refusals: Vec<Refusal>,
    },

    #[error(
        "{dir}: no weights found: expected `model.safetensors` or `model.safetensors.index.json`"
    )]
    NoWeights { dir: PathBuf },

    #[error(
        "{path}: not a readable safetensors file ({msg}); the file may be truncated or corrupt: \
         download it again"
    )]
    BadSafetensors { path: PathBuf, msg: String },

    #[error("{dir}: tensor `{name}` is missing from the checkpoint{hint}")]
    MissingTensor {
        dir: PathBuf,
        name: String,
        hint: String,
    },

    #[error(
        "{path}: tensor `{name}` has shape {found:?} but config.json implies {expected:?}; \
         the config and the weights do not belong together"
    )]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("{0}")]
    Invalid(String),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// One refused key: its name (dotted for a nested one, `rope_parameters.full_attention`), its
/// value as the file has it (short), and what transformers does with it / what tallow lacks.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub key: String,
    pub value: Option<String>,
    pub msg: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Some(v) => write!(f, "`{}` = {v}: {}", self.key, self.msg),
            None => write!(f, "`{}`: {}", self.key, self.msg),
        }
    }
}

/// A [`ModelError`] of [`crate::load()`], with the step that failed and its directory.
///
/// The message is the step alone ("loading the adapter from DIR"); the model error is its
/// source, so a printed chain reads `loading the adapter from DIR` / `caused by: ...`. Callers
/// that want the model error alone (the trainer: its out-of-memory check reads the text) take
/// [`LoadError::into_model_error`].
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// config.json or the weights of the base model.
    #[error("loading the model from {}", dir.display())]
    Model {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },

    /// The adapter (adapter_config.json, adapter_model.safetensors) or attaching it.
    #[error("loading the adapter from {}", dir.display())]
    Adapter {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },
}

impl LoadError {
    /// The model error, without the step and directory.
    pub fn into_model_error(self) -> ModelError {
        match self {
            LoadError::Model { source, .. } | LoadError::Adapter { source, .. } => source,
        }
    }
}
