//! The errors of reading a config. Each names the file (`origin`), the `--set` it came from if
//! any, the key, and what to write instead.

use std::path::PathBuf;

use super::keys::{section_list, valid_keys};

/// A value that [`super::TrainConfig::validate`] rejects: `key` names it (`train.lr`), `message`
/// says what was found and what it must be.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{key}` {message}")]
pub struct InvalidValue {
    /// The section-qualified key, `train.lr`.
    pub key: &'static str,
    /// What was found and what it must be, after the key: "must be > 0, found 0 (...)".
    pub message: String,
}

/// A value of the wrong TOML type, or a name that is not one of the choices.
#[derive(Debug, thiserror::Error)]
#[error(
    "{origin}: {}`{key}` must be {expected}, found {found}{}",
    from_set(.set), did_you_mean(.suggestion)
)]
pub struct WrongType {
    pub origin: String,
    pub set: Option<String>,
    pub key: String,
    pub expected: String,
    pub found: String,
    pub suggestion: Option<String>,
}

/// An error while reading a training config. `origin` is the file (or the name given to
/// [`super::TrainConfig::from_toml_str`]); `set` is the `--set` argument the problem came from,
/// if any.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read config {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// Not TOML.
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },

    /// A `[section]` that is not one of ours.
    #[error(
        "{origin}: {}unknown section `[{section}]`{}valid sections: {}",
        from_set(.set), hint_then(.suggestion), section_list()
    )]
    UnknownSection {
        origin: String,
        set: Option<String>,
        section: String,
        suggestion: Option<String>,
    },

    /// A key that its section does not have.
    #[error(
        "{origin}: {}unknown key `{section}.{key}`{}valid keys in [{section}]: {}",
        from_set(.set), hint_then(.suggestion), valid_keys(.section)
    )]
    UnknownKey {
        origin: String,
        set: Option<String>,
        section: String,
        key: String,
        suggestion: Option<String>,
    },

    /// A plain key at the top of the file, before any `[section]` header.
    #[error(
        "{origin}: key `{key}` is outside any section{}every key goes under one of {}",
        hint_then(.suggestion), section_list()
    )]
    KeyOutsideSection {
        origin: String,
        key: String,
        suggestion: Option<String>,
    },

    /// A section name used as a plain key (`model = "m"`).
    #[error(
        "{origin}: `{section}` must be a table: write `[{section}]` on its own line with its keys \
         below it"
    )]
    NotATable { origin: String, section: String },

    /// A value of the wrong TOML type, or a name that is not one of the choices (boxed: the
    /// largest variant, kept off every `Result` of the config code).
    #[error(transparent)]
    WrongType(Box<WrongType>),

    /// A required key (`model.path`, `data.train`) that neither the file nor a `--set` gives.
    #[error("{origin}: missing key `{key}`: {hint}")]
    Missing {
        origin: String,
        key: &'static str,
        hint: &'static str,
    },

    /// A `--set` argument that is not `section.key=value`.
    #[error("{origin}: --set `{set}`: {message}")]
    BadSet {
        origin: String,
        set: String,
        message: String,
    },

    /// A value that [`super::TrainConfig::validate`] rejects.
    #[error("{origin}: {}{invalid}", from_set(.set))]
    Invalid {
        origin: String,
        set: Option<String>,
        invalid: InvalidValue,
    },
}

fn from_set(set: &Option<String>) -> String {
    set.as_ref()
        .map(|s| format!("--set `{s}`: "))
        .unwrap_or_default()
}

/// `; did you mean `x`? ` or `; `, before more text.
fn hint_then(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean `{s}`? "))
        .unwrap_or_else(|| "; ".into())
}

fn did_you_mean(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean `{s}`?"))
        .unwrap_or_default()
}
