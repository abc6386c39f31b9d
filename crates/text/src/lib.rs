//! tallow-text: the text side of a model dir, shared by training and inference.
//!
//! - `tokenizer`: [`TextTokenizer::from_model_dir`] reads `tokenizer.json` with the special tokens
//!   and chat template transformers keeps beside it.
//! - `chat`: [`ChatTemplate`] renders a list of [`Message`]s with the model's Jinja template, in
//!   an environment that copies transformers' (`chat/compat.rs`: its globals and filters).
//! - `error`: [`TextError`] for loading those files, [`EncodeError`] for one text that cannot be
//!   rendered or tokenized (the caller adds which row or flag it came from).
//!
//! `tallow generate` / `tallow chat` use this crate directly; the trainer's data pipeline builds
//! its rows with it.

pub mod chat;
pub mod error;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message};
pub use error::{EncodeError, TextError};
pub use tokenizer::TextTokenizer;
