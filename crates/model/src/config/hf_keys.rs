//! Which `config.json` keys tallow reads, which it ignores, and which it refuses.
//!
//! The rule: tallow computes what transformers computes.
//! - A key that the family's transformers classes read (its config class, its modeling code,
//!   the shared rotary, mask and cache code; in transformers 4.57 or 5.x) is either read by
//!   tallow (a field of the shared serde struct `families::common::CommonKeys` or of the
//!   family's own, so the list cannot drift), known not to change the output
//!   ([`GENERIC_IGNORED`] and the family's `IGNORED`), accepted only with the values that leave
//!   the model as tallow builds it ([`GENERIC_FIXED`] and the family's `FIXED`), or refused.
//! - A key that transformers never reads cannot change what it computes: it is ignored, as
//!   transformers ignores it, and named in one note at load ([`KeyCheck::unread`]). Real
//!   checkpoints carry such keys: nanotron's `is_llama_config`, `transformers.js_config`,
//!   `auto_map` for remote code, another family's keys left by a conversion script.
//!
//! Every refusal of a file is reported at once ([`Refusals`]), each with its value and what the
//! key does in transformers. `model.ignore_config_keys` (the training config) or
//! `--ignore-config-key` (eval, generate, chat, merge) removes keys before these checks, for a
//! user who knows better than this table; the note names them.
//!
//! `tests/fixtures/reference/config-keys.json` holds, for each family's class in transformers
//! 4.57 and 5.x, every key its config class carries and every name transformers reads from
//! the config object while it builds, trains and runs the model (`"reads"`, traced by
//! `scripts/make_config_key_fixtures.py`); `tests/tests/config_json.rs` checks that each of
//! them is read, listed or refused here, so a key transformers reads is never ignored unseen.

use std::path::{Path, PathBuf};

use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::Value;

use crate::error::{ModelError, Refusal, Result};

/// Keys that transformers reads but that never change a decoder's output: names, bookkeeping,
/// storage dtype, runtime switches of the Python objects, generation defaults (`tallow
/// generate` takes those from `generation_config.json`; transformers 5 drops them from the
/// model config), settings of heads tallow does not build (classification, TensorFlow,
/// TorchScript).
pub const GENERIC_IGNORED: &[&str] = &[
    // read elsewhere: `architectures` / `model_type` pick the family, `quantization_config` is
    // checked by `families::check_quantization_config`
    "architectures",
    "model_type",
    "quantization_config",
    // bookkeeping
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "_commit_hash",
    "unsloth_version",
    "unsloth_fixed",
    // storage dtype of the checkpoint (tallow's compute dtype is `model.dtype`); `merge` and
    // full fine-tuning write it back
    "dtype",
    "torch_dtype",
    "use_bfloat16",
    // runtime switches and state of the Python objects, no effect on the values computed
    "use_cache",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "_output_attentions",
    "output_router_logits",
    "torchscript",
    "tf_legacy_loss",
    "_attn_implementation",
    "_attn_implementation_internal",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "_experts_implementation_internal",
    "attn_implementation",
    "experts_implementation",
    "_post_init_done",
    // activation checkpointing in the Python model (memory, not values); 4.57 drops the key
    "gradient_checkpointing",
    // how transformers shards the model over devices (tensor, pipeline, expert, FSDP plans)
    "base_model_tp_plan",
    "base_model_pp_plan",
    "base_model_ep_plan",
    "base_model_fsdp_plan",
    // validation only: keys the rotary validation skips; `num_heads` is checked against an
    // `embed_dim` these families do not have
    "ignore_keys_at_rope_validation",
    "num_heads",
    // default arguments of image-text models' forward (`merge_with_config_defaults`); a text
    // decoder's forward takes no such argument
    "vision_feature_layer",
    "vision_feature_select_strategy",
    "vision_aspect_ratio",
    // splits the feed-forward into chunks of the sequence: the same values
    "chunk_size_feed_forward",
    // initialization of new weights (tallow loads every weight)
    "initializer_range",
    // token ids: bos / eos are read by the family structs; the rest name tokens only
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    // sequence-classification and task heads
    "finetuning_task",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "task_specific_params",
    "prefix",
    "tokenizer_class",
    "is_decoder",
    // generation defaults (transformers < 5 kept them in config.json; 5.x drops them)
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
];

/// A key transformers reads that tallow accepts only with the values that leave the model as
/// tallow builds it (JSON texts; none: refused whatever its value), and what it does in
/// transformers, for the refusal.
#[derive(Debug, Clone, Copy)]
pub struct Fixed {
    pub key: &'static str,
    pub accepted: &'static [&'static str],
    pub what: &'static str,
}

const fn fixed(key: &'static str, accepted: &'static [&'static str], what: &'static str) -> Fixed {
    Fixed {
        key,
        accepted,
        what,
    }
}

/// `PretrainedConfig` keys (and names the shared transformers code reads from every config)
/// that would turn the model into something else: accepted only with the value of a plain
/// decoder.
pub const GENERIC_FIXED: &[Fixed] = &[
    fixed(
        "is_encoder_decoder",
        &["false"],
        "makes the model an encoder-decoder",
    ),
    fixed(
        "add_cross_attention",
        &["false"],
        "adds cross-attention to an encoder",
    ),
    fixed(
        "tie_encoder_decoder",
        &["false"],
        "ties an encoder's weights to its decoder's",
    ),
    fixed(
        "cross_attention_hidden_size",
        &["null"],
        "sizes cross-attention to an encoder",
    ),
    fixed(
        "pruned_heads",
        &["{}"],
        "removes attention heads from layers",
    ),
    fixed(
        "is_causal",
        &["true"],
        "false lets every token attend to later ones (transformers 5's masks)",
    ),
    fixed(
        "partial_rotary_factor",
        &["1.0"],
        "rotates only this fraction of each head's dims (transformers' rotary init)",
    ),
    fixed(
        "attention_chunk_size",
        &["null"],
        "chunked attention (Llama 4's) in the masks and the KV cache",
    ),
    fixed(
        "is_heterogeneous",
        &["false"],
        "gives each layer its own config (`per_layer_config`, transformers 5)",
    ),
    fixed(
        "per_layer_config",
        &["null"],
        "gives each layer its own config (transformers 5)",
    ),
    fixed(
        "_heterogeneity_spec",
        &["null"],
        "gives each layer its own config (transformers 5)",
    ),
    fixed(
        "mlp_layer_types",
        &["null"],
        "sets each layer's MLP kind (dense / sparse, transformers 5)",
    ),
    fixed(
        "mtp_layer_types",
        &["null"],
        "adds multi-token-prediction layers (transformers 5)",
    ),
    fixed(
        "num_kv_shared_layers",
        &["null"],
        "shares the KV cache between layers (generation)",
    ),
    fixed(
        "kv_sharing_modes",
        &["null"],
        "shares the KV cache between layers (generation)",
    ),
    fixed(
        "_rope_type_labels",
        &["null"],
        "names which rotary parameters each layer takes (transformers 5)",
    ),
    fixed(
        "text_config",
        &["null"],
        "a nested text-model config that transformers' generation runs in place of this one",
    ),
    fixed(
        "decoder",
        &["null"],
        "a nested decoder config that generation runs in place of this one",
    ),
    fixed(
        "generator",
        &["null"],
        "a nested generator config that generation runs in place of this one",
    ),
    fixed(
        "text_encoder",
        &["null"],
        "a nested text-encoder config that transformers' generation runs in place of this one \
         (`get_text_config`, read in 4.57's Qwen2-MoE generate)",
    ),
    fixed(
        "default_theta",
        &[],
        "replaces the class's default rotary theta (transformers 5's rotary conversion)",
    ),
    fixed(
        "default_rope_type",
        &[],
        "replaces the class's default rotary type (transformers 5's rotary conversion)",
    ),
    fixed("sub_configs", &[], "declares nested model configs"),
    fixed("sub_configs_defaults", &[], "declares nested model configs"),
];

/// What one family does with `config.json` keys (`families::key_policy`).
#[derive(Debug, Clone)]
pub struct KeyPolicy {
    /// The family's name in messages ("Llama").
    pub family: &'static str,
    /// Its transformers class ("LlamaForCausalLM").
    pub class: &'static str,
    /// The keys it reads: the serde fields of the shared and the family's structs.
    pub read: Vec<&'static str>,
    /// Keys of the family's transformers classes that tallow ignores, each because it cannot
    /// change the output.
    pub ignored: &'static [&'static str],
    /// Keys its transformers classes read that tallow accepts with some values only.
    pub fixed: &'static [Fixed],
}

/// How tallow treats one `config.json` key of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// A field of the family struct: its value is read and checked.
    Read,
    /// Read by transformers, known not to change the output.
    Ignored,
    /// Read by transformers; accepted with these values only (JSON texts; none: refused).
    Fixed(&'static [&'static str]),
    /// Not read by transformers' class of this family: ignored, and named in a note.
    Unread,
}

/// How the family of `policy` treats `key`.
pub fn key_use(policy: &KeyPolicy, key: &str) -> KeyUse {
    if policy.read.contains(&key) {
        KeyUse::Read
    } else if policy.ignored.contains(&key) || GENERIC_IGNORED.contains(&key) {
        KeyUse::Ignored
    } else if let Some(f) = fixed_entry(policy, key) {
        KeyUse::Fixed(f.accepted)
    } else {
        KeyUse::Unread
    }
}

fn fixed_entry(policy: &KeyPolicy, key: &str) -> Option<&'static Fixed> {
    policy
        .fixed
        .iter()
        .chain(GENERIC_FIXED)
        .find(|f| f.key == key)
}

/// JSON equality with numbers compared as numbers (`1` and `1.0` are the same value).
pub fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, a)| y.get(k).is_some_and(|b| same_value(a, b)))
        }
        _ => a == b,
    }
}

/// The refusals of one `config.json`, gathered so that one message names every offending key
/// (each with its value and why), instead of one key per attempt.
#[derive(Debug)]
pub struct Refusals {
    path: PathBuf,
    class: String,
    /// The file's keys, for the values the message quotes.
    raw: Value,
    list: Vec<Refusal>,
}

impl Refusals {
    pub fn new(path: &Path, class: &str, raw: &Value) -> Self {
        Self {
            path: path.to_path_buf(),
            class: class.to_string(),
            raw: raw.clone(),
            list: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Refuses `key` (its value looked up in the file; a dotted key in nested objects).
    pub fn push(&mut self, key: &str, msg: impl Into<String>) {
        let mut v = Some(&self.raw);
        for part in key.split('.') {
            v = v.and_then(|v| v.get(part));
        }
        let refusal = Refusal {
            key: key.to_string(),
            value: v.map(short),
            msg: msg.into(),
        };
        if !self.list.contains(&refusal) {
            self.list.push(refusal);
        }
    }

    /// Adds a refusal made elsewhere (a nested config's).
    pub fn push_refusal(&mut self, r: Refusal) {
        if !self.list.contains(&r) {
            self.list.push(r);
        }
    }

    /// The value of `r`, or None with its error recorded: a check that failed refuses its key
    /// and the parse goes on to find the others. Errors other than a key's are returned later
    /// by [`Refusals::finish`] as they are.
    pub fn take<T>(&mut self, r: Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(ModelError::Config { key, msg, .. }) => {
                self.push(&key, msg);
                None
            }
            Err(ModelError::Refused { refusals, .. }) => {
                for r in refusals {
                    if !self.list.contains(&r) {
                        self.list.push(r);
                    }
                }
                None
            }
            Err(other) => {
                self.push("(config.json)", other.to_string());
                None
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Ok when nothing was refused, else the one error that lists every refusal.
    pub fn finish(self) -> Result<()> {
        if self.list.is_empty() {
            return Ok(());
        }
        Err(ModelError::Refused {
            path: self.path,
            class: self.class,
            refusals: self.list,
        })
    }
}

/// What [`check_keys`] found beside the refusals: the keys transformers never reads, which are
/// ignored and named in the load note.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KeyCheck {
    pub unread: Vec<String>,
}

/// Checks every key of `raw` against the family of `policy`: a fixed key with another value is
/// refused (into `refusals`), a key transformers never reads is returned as unread.
pub fn check_keys(policy: &KeyPolicy, raw: &Value, refusals: &mut Refusals) -> KeyCheck {
    let mut check = KeyCheck::default();
    let Some(obj) = raw.as_object() else {
        refusals.push("(config.json)", "expected a JSON object");
        return check;
    };
    for (key, value) in obj {
        match key_use(policy, key) {
            KeyUse::Read | KeyUse::Ignored => {}
            KeyUse::Fixed(accepted) => {
                let ok = accepted.iter().any(|a| {
                    let a: Value = serde_json::from_str(a).expect("fixed values are JSON");
                    same_value(value, &a)
                });
                if !ok {
                    let f = fixed_entry(policy, key).expect("a fixed key has its entry");
                    let allowed = if accepted.is_empty() {
                        "tallow implements no value of it".to_string()
                    } else {
                        format!("tallow implements {} only", accepted.join(" or "))
                    };
                    refusals.push(key, format!("in transformers it {}; {allowed}", f.what));
                }
            }
            KeyUse::Unread => check.unread.push(key.clone()),
        }
    }
    check
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

/// The field names of a serde struct, as its derived `Deserialize` announces them to the
/// deserializer (`deserialize_struct`'s `fields`).
pub fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Probe(Option<&'static [&'static str]>);
    impl<'de> de::Deserializer<'de> for &mut Probe {
        type Error = de::value::Error;
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            self.0 = Some(fields);
            Err(de::Error::custom("probe"))
        }
        fn deserialize_any<V: Visitor<'de>>(
            self,
            _visitor: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut probe = Probe(None);
    let _ = T::deserialize(&mut probe);
    probe
        .0
        .expect("a family config is a plain serde struct (no flatten)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Two {
        a: u32,
        #[serde(default)]
        b: Option<String>,
    }
    fn two() -> KeyPolicy {
        KeyPolicy {
            family: "Two",
            class: "TwoForCausalLM",
            read: field_names::<Two>().to_vec(),
            ignored: &["c"],
            fixed: &[],
        }
    }

    #[test]
    fn field_names_come_from_the_struct() {
        assert_eq!(field_names::<Two>(), &["a", "b"]);
        assert_eq!(key_use(&two(), "a"), KeyUse::Read);
        assert_eq!(key_use(&two(), "c"), KeyUse::Ignored);
        assert_eq!(key_use(&two(), "use_cache"), KeyUse::Ignored);
        assert_eq!(key_use(&two(), "pruned_heads"), KeyUse::Fixed(&["{}"]));
        assert_eq!(key_use(&two(), "is_llama_config"), KeyUse::Unread);
    }

    #[test]
    fn fixed_keys_are_refused_all_at_once_and_unread_ones_returned() {
        let p = Path::new("m/config.json");
        let ok = serde_json::json!({"a": 1, "c": 2, "use_cache": true, "pruned_heads": {},
            "cross_attention_hidden_size": null, "partial_rotary_factor": 1,
            "is_llama_config": true, "auto_map": {"AutoModel": "x.Y"}});
        let mut r = Refusals::new(p, "TwoForCausalLM", &ok);
        let check = check_keys(&two(), &ok, &mut r);
        assert!(r.is_empty(), "{r:?}");
        assert_eq!(check.unread, ["auto_map", "is_llama_config"]);

        let bad = serde_json::json!({"a": 1, "is_encoder_decoder": true,
            "partial_rotary_factor": 0.5, "default_theta": 10000.0, "is_causal": true});
        let mut r = Refusals::new(p, "TwoForCausalLM", &bad);
        check_keys(&two(), &bad, &mut r);
        let e = r.finish().unwrap_err().to_string();
        for needle in [
            "m/config.json",
            "TwoForCausalLM",
            "`is_encoder_decoder` = true",
            "encoder-decoder",
            "`partial_rotary_factor` = 0.5",
            "1.0 only",
            "`default_theta` = 10000.0",
            "no value",
            "model.ignore_config_keys",
        ] {
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        }
        assert!(!e.contains("is_causal"), "{e}");
    }

    #[test]
    fn numbers_compare_as_numbers() {
        use serde_json::json;
        assert!(same_value(&json!(1), &json!(1.0)));
        assert!(same_value(&json!({"a": [1, 2.0]}), &json!({"a": [1.0, 2]})));
        assert!(!same_value(&json!(1), &json!(true)));
        assert!(!same_value(&json!({"a": 1}), &json!({"a": 1, "b": 2})));
    }
}
