//! PEFT's names for a model's modules: the key prefix of each adapted linear, and the
//! `target_modules` regex of an image-text model's language model.

use crate::decoder::CausalLM;

/// The PEFT module name (key prefix) of layer `i`'s linear `path` (`self_attn.q_proj`).
pub fn peft_prefix(i: usize, path: &str) -> String {
    format!("base_model.model.model.layers.{i}.{path}")
}

/// [`peft_prefix`] for `model`: under `model.language_model` for an image-text Gemma 3's text
/// tower.
pub fn model_peft_prefix(model: &CausalLM, i: usize, path: &str) -> String {
    if model.config.text_tower {
        format!("base_model.model.model.language_model.layers.{i}.{path}")
    } else {
        peft_prefix(i, path)
    }
}

/// `target_modules` for the text tower of an image-text model: PEFT full-matches a string
/// against each module's name, so this regex takes the language model's modules `names` and
/// none of the vision tower's.
pub fn text_tower_targets(names: &[&str]) -> String {
    format!(r".*\.language_model\..*\.({})", names.join("|"))
}

/// The module names of a [`text_tower_targets`] regex, None for any other string.
pub fn parse_text_tower_targets(s: &str) -> Option<Vec<String>> {
    let inner = s
        .strip_prefix(r".*\.language_model\..*\.(")?
        .strip_suffix(')')?;
    let names: Vec<String> = inner.split('|').map(str::to_string).collect();
    names
        .iter()
        .all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(names)
}
