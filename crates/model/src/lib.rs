//! tallow-model: decoder-only causal LMs (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3)
//! in Candle, written for training.
//!
//! Rooms, bottom to top, each using only those below it (`tests/layers.rs` checks it; the map
//! with a line per room is docs/architecture.md): [`error`], [`io`] (files, safetensors),
//! [`config`] (the checked model config, the layers' layout, which `config.json` keys are
//! read), [`families`] (one file per family, building the config), [`kernels`] (each op's CPU
//! kernel and CUDA twin, and the rule that picks one), [`nn`] (the linear layer and its
//! `Adapter` trait, the differentiable ops, the LM head's loss), [`decoder`] (the layer, the
//! causal LM, checkpointing, saving), [`peft`] (adapter kinds, PEFT's files), [`generate`]
//! (inference), [`load()`] (a model dir plus an optional adapter, as every command loads it).
//! The tokenizer and chat template are the `tallow-text` crate's.

pub mod config;
pub mod decoder;
pub mod error;
pub mod families;
pub mod generate;
pub mod io;
pub mod kernels;
pub mod load;
pub mod nn;
pub mod peft;

pub use config::layout::{LinearSpec, LINEAR_PATHS};
pub use config::{Arch, DecoderConfig, RopeScaling};
pub use decoder::save::save_hf_model;
pub use decoder::{AttentionImpl, CausalLM, LoadOptions};
pub use error::{LoadError, ModelError, Result};
pub use generate::sampling::{Sampler, SamplingParams};
pub use generate::{generate, GenerateOptions, Generation, GenerationConfig, KvCache};
pub use io::weights::Weights;
pub use kernels::nf4::{Nf4Options, Nf4Weight};
pub use load::load;
pub use nn::linear::Adapter;
pub use nn::linear::{Base, Linear, Param};
pub use nn::lora::Lora;
pub use nn::loss::{lm_head_nll, Targets};
pub use nn::no_grad::no_grad;
pub use peft::attach::{attach_lora, lora_vars, merge_lora, set_dropout, set_dropout_rate};
pub use peft::dora::Dora;
pub use peft::format::{load_peft, save_peft};
pub use peft::{AdapterKind, LoraSpec};
