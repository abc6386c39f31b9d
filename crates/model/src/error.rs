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
