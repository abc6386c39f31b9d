//! Errors of reading a model dir's tokenizer files and of turning text into tokens.
//!
//! Every message names the file (and key where there is one) and says what to change.

use std::path::PathBuf;

/// An error while loading a model dir's tokenizer files or compiling its chat template.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The model dir lacks the fast-tokenizer file.
    #[error(
        "{} has no tokenizer.json: the model dir needs a tokenizer.json (the file HF \
         `tokenizer.save_pretrained` writes; convert slow tokenizers with transformers first)",
        dir.display()
    )]
    MissingTokenizer { dir: PathBuf },

    /// tokenizer.json exists but the `tokenizers` crate rejected it.
    #[error("cannot load tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },

    /// A JSON config file (tokenizer_config.json, config.json, ...) is not valid JSON.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// A key of a JSON config file has a value of the wrong shape.
    #[error("{}: key `{key}` {message}", path.display())]
    ConfigKey {
        path: PathBuf,
        key: String,
        message: String,
    },

    /// A special token named in tokenizer_config.json is not in tokenizer.json's vocabulary.
    #[error(
        "{}: `{key}` is {token:?}, which is not a token of tokenizer.json; fix the key or add the \
         token to tokenizer.json's added_tokens",
        path.display()
    )]
    UnknownToken {
        path: PathBuf,
        key: String,
        token: String,
    },

    /// The chat template does not parse.
    #[error("chat template from {origin} does not compile: {message}")]
    TemplateSyntax { origin: String, message: String },
}

/// One text (or one conversation) that cannot be rendered or tokenized. It names no file or
/// row: the caller knows where the text came from and adds it (the trainer's `RowError`, a
/// CLI flag).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EncodeError {
    /// The chat template raised (`raise_exception`) or failed while rendering.
    #[error("chat template from {origin} failed to render: {message}")]
    Template { origin: String, message: String },

    /// The tokenizer failed on the text (encoding) or on the ids (decoding).
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
}

/// The JSON type name of a value, for error messages ("a string", "an object", ...).
pub fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
