//! tallow-model: decoder-only causal LMs (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3)
//! in Candle, written for training.
//!
//! - `config` + one file per family (`llama`, `qwen2`, `qwen3`): config.json -> [`DecoderConfig`].
//! - `model`: the decoder, written once; `linear`: the one linear layer (frozen / trainable base,
//!   optional adapter); `peft`: the adapters (LoRA, DoRA) and PEFT's file format; `ops`: differentiable norms, softmax, rotary embedding, masks; `no_grad`:
//!   forward passes that record no graph (evaluation); `dropout`: LoRA dropout as a hash op.
//! - `consts`: small constant tensors (codebooks, tables) uploaded once per device; `cuda`
//!   (feature `cuda`): tallow's own kernels (`kernels/tallow.cu`).
//! - `loss`: chunked cross-entropy fused with the LM head; `weights`: safetensors loading.
//! - `load`: [`load()`], the one load of a model dir plus an optional adapter that every command
//!   (train, eval, generate, chat, merge) calls. The tokenizer and chat template are not here:
//!   they are the `tallow-text` crate's.
//! - `generate`: inference only: KV cache, cached forward, decoding loop; `sampling`: next-token
//!   choice (greedy, temperature, top-k, top-p, repetition penalty).

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
