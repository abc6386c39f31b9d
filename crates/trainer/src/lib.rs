//! tallow-trainer: data pipeline, loss, evaluation and training loop for tallow.
//!
//! Data flow: [`TextTokenizer::from_model_dir`] reads a model dir's tokenizer files,
//! [`load_jsonl`] turns a JSONL file into [`Example`]s (token ids plus which positions are trained).

pub mod batch;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod doctor;
pub mod error;
pub mod estimate;
pub mod eval;
pub mod grads;
pub mod host;
pub mod memory;
pub mod opcount;
pub mod optim;
pub mod schedule;
pub mod threads;
pub mod tokenizer;
pub mod train;

pub use chat::{ChatTemplate, Message};
pub use config::TrainConfig;
pub use data::{
    load_jsonl, tokenize_row, DataOptions, Dataset, Example, Format, DEFAULT_MAX_SEQ_LEN,
};
pub use error::{DataError, RowError};
pub use tokenizer::TextTokenizer;
