//! tallow-model: Llama, Qwen2 and Qwen3 causal LMs in Candle, written for training.
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

pub mod checkpointing;
pub mod chunked;
pub mod config;
pub mod consts;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dropout;
pub mod error;
pub mod families;
pub mod fused;
pub mod generate;
pub mod hf_keys;
pub mod io;
pub mod layout;
pub mod linear;
pub mod load;
pub mod loss;
pub mod model;
pub mod no_grad;
mod offload;
pub mod ops;
pub mod peft;
pub mod quant;
pub mod sampling;
pub mod weights;

pub use config::{Arch, DecoderConfig, RopeScaling};
pub use error::{LoadError, ModelError, Result};
pub use generate::{generate, GenerateOptions, Generation, GenerationConfig, KvCache};
pub use layout::{LinearSpec, LINEAR_PATHS};
pub use linear::{Base, Linear, Param};
pub use load::load;
pub use loss::{lm_head_nll, Targets};
pub use model::{AttentionImpl, CausalLM, LoadOptions};
pub use no_grad::no_grad;
pub use peft::Lora;
pub use peft::{
    attach_lora, load_peft, lora_vars, merge_lora, save_hf_model, save_peft, set_dropout,
    set_dropout_rate, Adapter, Dora, LoraSpec,
};
pub use quant::nf4::{Nf4Options, Nf4Weight};
pub use sampling::{Sampler, SamplingParams};
pub use weights::Weights;
