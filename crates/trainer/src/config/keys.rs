//! The key table: every section and its keys (`SECTIONS`, from the declarations in
//! `sections.rs`), the names other trainers use for them (`ALIASES`), and the check that
//! rejects an unknown section or key of a file with a message that lists the valid ones and
//! suggests the closest ([`super::suggest`]).

use toml::{Table, Value};

use super::section::{Key, Kind, Section};
use super::suggest::{normalize, suggest_anywhere, suggest_key, suggest_section};
use super::{ConfigError, DataSection, LoraSection, ModelSection, PreferenceSection, TrainSection};

/// Every section and its keys, in the order [`super::TrainConfig::to_toml_string`] writes them.
pub(super) const SECTIONS: [(&str, &[Key]); 5] = [
    (ModelSection::NAME, ModelSection::KEYS),
    (LoraSection::NAME, LoraSection::KEYS),
    (DataSection::NAME, DataSection::KEYS),
    (TrainSection::NAME, TrainSection::KEYS),
    (PreferenceSection::NAME, PreferenceSection::KEYS),
];

/// Names other trainers (HF TrainingArguments, PEFT, axolotl, torchtune, litgpt) use for our keys.
pub(super) const ALIASES: &[(&str, &str)] = &[
    ("learning_rate", "train.lr"),
    ("lora_r", "lora.rank"),
    ("r", "lora.rank"),
    ("lora_alpha", "lora.alpha"),
    ("lora_dropout", "lora.dropout"),
    ("target_modules", "lora.targets"),
    ("lora_target_modules", "lora.targets"),
    ("lora_targets", "lora.targets"),
    ("lora_target_parameters", "lora.target_parameters"),
    ("use_rslora", "lora.rslora"),
    ("use_dora", "lora.kind"),
    ("peft_use_dora", "lora.kind"),
    ("dora", "lora.kind"),
    ("adapter_type", "lora.kind"),
    ("peft_type", "lora.kind"),
    ("lora_model_dir", "lora.init"),
    ("adapter", "lora.init"),
    ("base_model", "model.path"),
    ("model_name_or_path", "model.path"),
    ("checkpoint_dir", "model.path"),
    ("torch_dtype", "model.dtype"),
    ("load_in_4bit", "model.quantize"),
    ("bnb_4bit_quant_type", "model.quantize"),
    ("quantization", "model.quantize"),
    ("bnb_4bit_use_double_quant", "model.double_quant"),
    ("gradient_checkpointing", "train.checkpointing"),
    ("activation_checkpointing", "train.checkpointing"),
    ("enable_activation_checkpointing", "train.checkpointing"),
    ("precision", "model.dtype"),
    ("dataset", "data.train"),
    ("datasets", "data.train"),
    ("train_file", "data.train"),
    ("eval_file", "data.eval"),
    ("validation_file", "data.eval"),
    ("val_file", "data.eval"),
    ("dataset_train_split", "data.train_split"),
    ("dataset_test_split", "data.eval_split"),
    ("dataset_config_name", "data.dataset_config"),
    ("max_train_samples", "data.max_rows"),
    ("max_samples", "data.max_rows"),
    ("sequence_len", "data.max_seq_len"),
    ("seq_len", "data.max_seq_len"),
    ("max_length", "data.max_seq_len"),
    ("max_seq_length", "data.max_seq_len"),
    ("block_size", "data.max_seq_len"),
    ("cutoff_len", "data.max_seq_len"),
    ("sample_packing", "data.pack"),
    ("packing", "data.pack"),
    ("batch_size", "train.micro_batch_size"),
    ("micro_batch", "train.micro_batch_size"),
    ("per_device_train_batch_size", "train.micro_batch_size"),
    ("gradient_accumulation_steps", "train.grad_accum"),
    ("gradient_accumulation_iters", "train.grad_accum"),
    ("num_epochs", "train.epochs"),
    ("num_train_epochs", "train.epochs"),
    ("max_iters", "train.max_steps"),
    ("num_steps", "train.max_steps"),
    ("optim", "train.optimizer"),
    ("lr_scheduler", "train.schedule"),
    ("lr_scheduler_type", "train.schedule"),
    ("scheduler", "train.schedule"),
    ("warmup", "train.warmup_steps"),
    ("num_warmup_steps", "train.warmup_steps"),
    ("lr_warmup_steps", "train.warmup_steps"),
    ("grad_clip", "train.max_grad_norm"),
    ("max_norm", "train.max_grad_norm"),
    ("gradient_clip_val", "train.max_grad_norm"),
    ("adam_beta1", "train.betas"),
    ("adam_beta2", "train.betas"),
    ("beta1", "train.betas"),
    ("beta2", "train.betas"),
    ("adam_epsilon", "train.eps"),
    ("epsilon", "train.eps"),
    ("out_dir", "train.output_dir"),
    ("save_dir", "train.output_dir"),
    ("logging_steps", "train.log_every"),
    ("log_interval", "train.log_every"),
    ("eval_steps", "train.eval_every"),
    ("eval_interval", "train.eval_every"),
    ("save_steps", "train.save_every"),
    ("save_interval", "train.save_every"),
    ("dpo_beta", "preference.beta"),
    ("rpo_alpha", "preference.beta"),
    ("loss_type", "preference.loss"),
    ("max_prompt_length", "preference.max_prompt_len"),
    ("orpo_alpha", "preference.lambda"),
    ("rl", "train.method"),
    ("rl_beta", "preference.beta"),
    ("load_best_model_at_end", "train.keep_best"),
    ("save_best", "train.keep_best"),
    ("patience", "train.early_stopping_patience"),
    ("hub_model_id", "train.push_to_hub"),
    ("hub_repo", "train.push_to_hub"),
    ("hub_private", "train.hub_private_repo"),
    ("private", "train.hub_private_repo"),
];

/// Names other trainers use for our sections.
pub(super) const SECTION_ALIASES: &[(&str, &str)] = &[
    ("training", "train"),
    ("trainer", "train"),
    ("optimizer", "train"),
    ("optim", "train"),
    ("dataset", "data"),
    ("datasets", "data"),
    ("peft", "lora"),
    ("adapter", "lora"),
];

/// The keys of `section`, or `None` for an unknown section.
pub(super) fn section_keys(section: &str) -> Option<&'static [Key]> {
    SECTIONS
        .iter()
        .find(|(name, _)| *name == section)
        .map(|(_, keys)| *keys)
}

/// The kind of `section.key`, or `None` for an unknown section or key.
pub(super) fn key_kind(section: &str, key: &str) -> Option<Kind> {
    section_keys(section)?
        .iter()
        .find(|k| k.name == key)
        .map(|k| k.kind)
}

/// `[model], [lora], [data], [train]`.
pub(super) fn section_list() -> String {
    let names: Vec<String> = SECTIONS.iter().map(|(s, _)| format!("[{s}]")).collect();
    names.join(", ")
}

/// The keys of `section`, comma-separated.
pub(super) fn valid_keys(section: &str) -> String {
    let keys: Vec<&str> = section_keys(section)
        .unwrap_or_default()
        .iter()
        .map(|k| k.name)
        .collect();
    keys.join(", ")
}

/// Rejects unknown sections and keys of the file, before any `--set`.
pub(super) fn check_keys(table: &Table, origin: &str) -> Result<(), ConfigError> {
    for (name, value) in table {
        let Value::Table(sec) = value else {
            if section_keys(name).is_some() {
                return Err(ConfigError::NotATable {
                    origin: origin.to_string(),
                    section: name.clone(),
                });
            }
            return Err(ConfigError::KeyOutsideSection {
                origin: origin.to_string(),
                key: name.clone(),
                suggestion: suggest_anywhere(&normalize(name)),
            });
        };
        if section_keys(name).is_none() {
            return Err(ConfigError::UnknownSection {
                origin: origin.to_string(),
                set: None,
                section: name.clone(),
                suggestion: suggest_section(name),
            });
        }
        for key in sec.keys() {
            if key_kind(name, key).is_none() {
                return Err(ConfigError::UnknownKey {
                    origin: origin.to_string(),
                    set: None,
                    section: name.clone(),
                    key: key.clone(),
                    suggestion: suggest_key(name, key),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{OptimizerKind, TrainConfig};
    use super::*;

    /// `SECTIONS` (used for error messages and --set) lists exactly the keys `to_toml_string`
    /// writes, in its order.
    #[test]
    fn key_table_matches_structs() {
        let text = TrainConfig::new("m", "t").to_toml_string();
        let table: Table = text.parse().unwrap();
        let mut sections_written = Vec::new();
        for line in text.lines() {
            if let Some(s) = line.strip_prefix('[') {
                sections_written.push(s.trim_end_matches(']').to_string());
            }
        }
        let expected: Vec<&str> = SECTIONS.iter().map(|(s, _)| *s).collect();
        assert_eq!(sections_written, expected);
        for (section, keys) in SECTIONS {
            // Key lines, skipping the continuation lines of multi-line strings
            // (`data.alpaca_prompt`).
            let mut in_string = false;
            let mut written: Vec<&str> = Vec::new();
            let body = text.split(&format!("[{section}]\n")).nth(1).unwrap();
            for l in body.lines() {
                if !in_string {
                    if l.is_empty() || l.starts_with('[') {
                        break;
                    }
                    written.push(l.split(" = ").next().unwrap());
                }
                in_string ^= l.matches("\"\"\"").count() % 2 == 1;
            }
            let listed: Vec<&str> = keys.iter().map(|k| k.name).collect();
            assert_eq!(written, listed, "[{section}]");
            assert_eq!(table[section].as_table().unwrap().len(), keys.len());
        }
    }

    #[test]
    fn every_alias_points_at_a_key() {
        for (alias, full) in ALIASES {
            let (s, k) = full.split_once('.').unwrap();
            assert!(key_kind(s, k).is_some(), "{alias} -> {full}");
            assert!(key_kind(s, alias).is_none(), "{alias} is a key of [{s}]");
        }
        for (alias, s) in SECTION_ALIASES {
            assert!(section_keys(s).is_some(), "{alias} -> {s}");
        }
    }

    #[test]
    fn choice_messages_list_the_names() {
        assert_eq!(
            Kind::Choice(OptimizerKind::NAMES).expected(),
            "one of \"adamw\", \"adamw8bit\", \"sgd\""
        );
        assert_eq!(
            key_kind("data", "format").unwrap().expected(),
            "one of \"auto\", \"text\", \"prompt_completion\", \"messages\", \"alpaca\", \
             \"sharegpt\", \"preference\""
        );
    }
}
