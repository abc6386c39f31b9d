//! tallow-trainer: data pipeline, loss, evaluation and training loop for tallow.
//!
//! Data flow: [`TextTokenizer::from_model_dir`] (the `tallow-text` crate, shared with inference)
//! reads a model dir's tokenizer files and chat template, [`load_jsonl`] turns a JSONL or parquet
//! file into [`Example`]s (token ids plus which positions are trained), [`train::train`] runs the
//! loop on them.

pub mod batch;
pub mod best;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod estimate;
pub mod eval;
pub mod grads;
pub mod host;
pub mod lock;
pub mod memory;
pub mod opcount;
pub mod optim;
pub mod preference;
pub mod schedule;
pub mod tensorboard;
pub mod threads;
pub mod train;

pub use config::TrainConfig;
pub use data::{
    load_file, load_hub_split, load_jsonl, tokenize_row, DataOptions, Dataset, Example, Format,
    PairRule, DEFAULT_MAX_SEQ_LEN,
};
pub use error::{DataError, RowError};
