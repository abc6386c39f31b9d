//! Errors of the data pipeline (reading JSONL and parquet datasets; the tokenizer's and chat
//! template's own errors come from `tallow_text` and convert with `From`) and of a training run.
//!
//! Every message names the file (and line or key where there is one) and says what to change.

use std::path::PathBuf;

use tallow_text::{EncodeError, TextError};

/// An error while loading tokenizer files or a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The model dir's tokenizer files (tokenizer.json, tokenizer_config.json, the chat
    /// template) could not be loaded.
    #[error(transparent)]
    Text(#[from] TextError),

    /// `--format` / `format =` names no known format.
    #[error("unknown data format {0:?}: expected one of {names}", names = crate::data::Format::NAMES.join(", "))]
    UnknownFormat(String),

    /// The data file has no non-blank line.
    #[error("{} has no rows (every line is blank); give a JSONL file with one JSON object per line", path.display())]
    EmptyFile { path: PathBuf },

    /// The format needs something the model dir does not provide (a chat template, an EOS token).
    #[error("{} cannot be used with {}: {source}", data.display(), model_dir.display())]
    Unsupported {
        data: PathBuf,
        model_dir: PathBuf,
        #[source]
        source: RowError,
    },

    /// One line of a JSONL file is malformed or cannot be tokenized.
    #[error("{}:{line}: {source}", path.display())]
    Row {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        #[source]
        source: RowError,
    },

    /// One row of a parquet file is malformed or cannot be tokenized.
    #[error("{}: row group {group}, row {row}: {source}", path.display())]
    ParquetRow {
        path: PathBuf,
        /// 0-based row group, and 0-based row inside it.
        group: usize,
        row: usize,
        #[source]
        source: RowError,
    },

    /// A shard of a hub dataset could not be downloaded.
    #[error("{}: {source}", shard.display())]
    Shard {
        /// `hf://datasets/OWNER/NAME/PATH`.
        shard: PathBuf,
        #[source]
        source: Box<tallow_hub::HubError>,
    },

    /// A parquet file could not be read (not parquet, truncated, unsupported compression).
    #[error("cannot read parquet file {}: {message} (tallow reads uncompressed and snappy-compressed parquet)", path.display())]
    Parquet { path: PathBuf, message: String },
}

/// What is wrong with one row (one JSONL line); [`DataError::Row`] adds the file and line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RowError {
    /// The line is not valid JSON.
    #[error("not valid JSON: {0}")]
    Json(String),

    /// The line is JSON but not an object.
    #[error("expected a JSON object, found {0}")]
    NotObject(&'static str),

    /// `format = auto` could not tell the format from the row's keys.
    #[error(
        "cannot detect the data format from keys [{keys}]; each row must be one of \
         {{\"text\": str}}, {{\"prompt\": str, \"completion\": str}}, \
         {{\"messages\": [{{\"role\": str, \"content\": str}}, ...]}}, \
         {{\"instruction\": str, \"input\": str, \"output\": str}} (Alpaca) or \
         {{\"conversations\": [{{\"from\": str, \"value\": str}}, ...]}} (ShareGPT) (or set the \
         format explicitly)"
    )]
    UndetectedFormat {
        /// The row's keys, quoted and comma-separated.
        keys: String,
    },

    /// A key the format needs is absent.
    #[error("missing key `{key}` required by format {format}")]
    MissingKey {
        key: &'static str,
        format: &'static str,
    },

    /// A key has the wrong JSON type.
    #[error("key `{key}` must be {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },

    /// A ShareGPT turn whose `from` is not a role tallow reads.
    #[error(
        "{at} is `{found}`; tallow reads ShareGPT turns from \"human\" (or \"user\"), \"gpt\" \
         (or \"assistant\") and \"system\" (tool calls and observations are not supported)"
    )]
    ShareGptRole { at: String, found: String },

    /// A preference row whose chosen and rejected completions are the same.
    #[error(
        "`chosen` and `rejected` are identical, so the pair prefers nothing; fix or drop the row"
    )]
    IdenticalPair,

    /// A conversational preference prompt that does not end with a user turn.
    #[error(
        "the `prompt` messages end with a `{role}` turn; a preference prompt must end with a \
         user turn (the chosen and rejected lists hold the assistant's answer)"
    )]
    PromptLastRole { role: String },

    /// Preference pairs where single sequences are expected, or the other way round.
    #[error("{0}")]
    MethodMismatch(String),

    /// add_eos is on but the tokenizer knows no EOS token.
    #[error(
        "add_eos is set but the tokenizer has no EOS token; set add_eos = false, or add \
         \"eos_token\" to the model dir's tokenizer_config.json"
    )]
    NoEos,

    /// The messages format was asked for but the model has no chat template.
    #[error(
        "the model dir has no chat template (add `chat_template` to tokenizer_config.json or a \
         chat_template.jinja file), so the messages format cannot be rendered"
    )]
    NoChatTemplate,

    /// The chat template raised while rendering the row, or the tokenizer failed on it.
    #[error(transparent)]
    Text(#[from] EncodeError),
}

/// The JSON type name of a value, for error messages (one definition, in the text crate).
pub(crate) use tallow_text::error::json_type;

/// An error of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] tallow_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// `model.path` (hub id) or `data.train` / `data.eval` (`hf://datasets/...`) could not be
    /// resolved from the Hugging Face Hub.
    #[error("{key}: {source}")]
    Hub {
        key: &'static str,
        #[source]
        source: tallow_hub::HubError,
    },
    #[error("cannot resume: {0}")]
    Resume(String),
    /// The loss or the gradient norm became NaN or infinite.
    #[error(
        "step {step}: the {what} is {value} (not finite); training stopped. {kept} \
         Lower train.lr, set train.max_grad_norm (clipping), or use dtype = \"f32\"."
    )]
    NonFinite {
        step: usize,
        what: &'static str,
        value: f64,
        kept: String,
    },
    /// The device (or `--memory-limit`) ran out of memory. The CLI adds the estimate's
    /// breakdown and a plan that fits.
    #[error(
        "out of memory in the {phase} phase{at}: {detail}. {kept}",
        at = if *step > 0 { format!(" of step {step}") } else { String::new() }
    )]
    OutOfMemory {
        /// load | forward | backward | optimizer
        phase: &'static str,
        /// The optimizer step (1-based); 0 while loading.
        step: usize,
        /// Measured peak of the phase when known.
        peak_bytes: Option<u64>,
        /// The memory there was: `--memory-limit`, or the GPU's total.
        limit_bytes: Option<u64>,
        detail: String,
        kept: String,
    },
    #[error("{0}")]
    Invalid(String),
    /// A collective between the ranks of a data-parallel run failed.
    #[error("data-parallel run: {0}")]
    Dist(#[from] tallow_data_parallel::DistError),
    /// `train.output_dir` is held by another run ([`crate::lock`]).
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// The run lock `train.output_dir/.tallow-lock` could not be taken ([`crate::lock::RunLock`]).
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// A live run on this host holds the directory.
    #[error(
        "train.output_dir {} is in use by another run: process {pid} on {host} (started \
         {started}) holds {}. Wait for it to finish or set another train.output_dir; if that \
         process is gone, remove {}",
        dir.display(), lock.display(), lock.display()
    )]
    Held {
        dir: PathBuf,
        lock: PathBuf,
        pid: u32,
        host: String,
        /// "3 min ago"
        started: String,
    },
    /// A run on another host holds the directory (a shared file system): tallow cannot tell
    /// whether it is still alive.
    #[error(
        "train.output_dir {} is held by a run on another host, {host} (process {pid}, started \
         {started}; lock {}), whose processes cannot be checked from here. Wait for it or set \
         another train.output_dir; if that run is gone, delete {} to take over",
        dir.display(), lock.display(), lock.display()
    )]
    HeldElsewhere {
        dir: PathBuf,
        lock: PathBuf,
        pid: u32,
        host: String,
        started: String,
    },
    /// The lock file is there but does not say who holds it.
    #[error(
        "{} is not a tallow run lock ({detail}); if no run is using train.output_dir {}, \
         remove it",
        lock.display(), dir.display()
    )]
    Unreadable {
        dir: PathBuf,
        lock: PathBuf,
        detail: String,
    },
    #[error("cannot take the run lock {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The model dir's tokenizer files, as the data pipeline reports them.
impl From<TextError> for TrainError {
    fn from(e: TextError) -> Self {
        TrainError::Data(DataError::Text(e))
    }
}

/// A failed [`tallow_model::load()`] is the model error itself: a run's messages name the
/// config key and path already, and [`TrainError::is_device_oom`] reads the model error's text.
impl From<tallow_model::LoadError> for TrainError {
    fn from(e: tallow_model::LoadError) -> Self {
        TrainError::Model(e.into_model_error())
    }
}

impl TrainError {
    /// Is this error a device out-of-memory (CUDA's `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS' alloc
    /// failure)?
    pub fn is_device_oom(&self) -> bool {
        let text = self.to_string();
        text.contains("OUT_OF_MEMORY")
            || text.contains("out of memory")
            || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_out_of_memory_errors_are_recognized_and_others_are_not() {
        // How cudarc's driver error and cuBLAS' allocation failure read through Candle.
        for text in [
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "cublas error: CUBLAS_STATUS_ALLOC_FAILED",
        ] {
            let e = TrainError::Candle(candle_core::Error::Msg(text.into()));
            assert!(e.is_device_oom(), "{text}");
        }
        let e = TrainError::Candle(candle_core::Error::Msg("shape mismatch in matmul".into()));
        assert!(!e.is_device_oom());
        let oom = TrainError::OutOfMemory {
            phase: "backward",
            step: 12,
            peak_bytes: Some(1 << 30),
            limit_bytes: Some(1 << 30),
            detail: "x".into(),
            kept: "The last good checkpoint is c (continue with --resume).".into(),
        };
        let msg = oom.to_string();
        assert!(
            msg.starts_with("out of memory in the backward phase of step 12: x."),
            "{msg}"
        );
        assert!(msg.contains("--resume"));
    }
}
