//! The one load every command does: a model dir (config.json + safetensors) and, optionally, a
//! PEFT adapter on top. `tallow train` (`lora.init`), `eval`, `generate`, `chat` and `merge` all
//! call [`load`]; the tokenizer beside the weights is the text crate's
//! (`tallow_text::TextTokenizer::from_model_dir`), which this crate does not depend on.

use std::path::Path;

use crate::decoder::{CausalLM, LoadOptions};
use crate::error::LoadError;
use crate::peft::format::load_peft;
use crate::peft::LoraSpec;

/// Loads the model in `dir` with `opts`, then the adapter in `adapter` (ours or PEFT's) onto it;
/// returns the adapter's spec when there is one.
///
/// The error says which of the two failed and in which directory ([`LoadError`]).
pub fn load(
    dir: &Path,
    opts: &LoadOptions,
    adapter: Option<&Path>,
) -> Result<(CausalLM, Option<LoraSpec>), LoadError> {
    let mut model = CausalLM::load(dir, opts).map_err(|source| LoadError::Model {
        dir: dir.to_path_buf(),
        source,
    })?;
    let spec = adapter
        .map(|a| {
            load_peft(&mut model, a).map_err(|source| LoadError::Adapter {
                dir: a.to_path_buf(),
                source,
            })
        })
        .transpose()?;
    Ok((model, spec))
}
