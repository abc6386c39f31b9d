//! Which `config.json` keys tallow reads, which it ignores because they cannot change the
//! model's output, and the refusal of every other key.
//!
//! A family reads the keys that are fields of the shared serde struct
//! (`families::common::CommonKeys`) and of its own (`families/llama.rs`, ...; the field names
//! are taken from the structs themselves, so the list cannot drift) and ignores the keys of
//! [`GENERIC_IGNORED`] and its own `IGNORED` list. A key in
//! [`GENERIC_FIXED`] is accepted only with the value that leaves a decoder-only model as it is.
//! Anything else (a key of another family such as `attn_logit_softcapping`, a newer
//! transformers feature) is refused by name: tallow would otherwise compute something other
//! than what transformers computes, with no message.
//!
//! `tests/fixtures/reference/config-keys.json` holds the full key set of each family's
//! transformers config class, for transformers 4.57 and 5.x; a test checks that each one is
//! read or listed here.

use std::path::Path;

use serde::de::{self, DeserializeOwned, Visitor};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// `PretrainedConfig` keys (and a few that checkpoint tools add) that never change a decoder's
/// output: names, bookkeeping, storage dtype, generation defaults (`tallow generate` takes those
/// from `generation_config.json`), settings of heads tallow does not build (classification,
/// TensorFlow, TorchScript).
pub const GENERIC_IGNORED: &[&str] = &[
    // read elsewhere: `architectures` / `model_type` pick the family, `quantization_config` is
    // checked by `config::check_quantization_config`
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
    // runtime switches of the Python classes, no effect on the values computed
    "use_cache",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "output_router_logits",
    "torchscript",
    "tf_legacy_loss",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "attn_implementation",
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
    // generation defaults (transformers < 5 kept them in config.json)
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
    "repetition_penalty",
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
];

/// `PretrainedConfig` keys that would turn the model into something else (an encoder-decoder,
/// cross-attention, pruned heads): accepted only with the value of a plain decoder.
pub const GENERIC_FIXED: &[(&str, &str)] = &[
    ("is_encoder_decoder", "false"),
    ("add_cross_attention", "false"),
    ("tie_encoder_decoder", "false"),
    ("cross_attention_hidden_size", "null"),
    ("pruned_heads", "{}"),
];

/// What one family does with `config.json` keys (`families::key_policy`).
#[derive(Debug, Clone)]
pub struct KeyPolicy {
    /// The family's name in messages ("Llama").
    pub family: &'static str,
    /// The keys it reads: the serde fields of the shared and the family's structs.
    pub read: Vec<&'static str>,
    /// Keys of the family's transformers config class that tallow ignores, each because it
    /// cannot change the output.
    pub ignored: &'static [&'static str],
}

/// How tallow treats one `config.json` key of family `T`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUse {
    /// A field of the family struct: its value is read and checked.
    Read,
    /// Known not to change the output.
    Ignored,
    /// Accepted with this one value (JSON text).
    Fixed(&'static str),
    /// Not implemented: refused.
    Unknown,
}

/// How the family of `policy` treats `key`.
pub fn key_use(policy: &KeyPolicy, key: &str) -> KeyUse {
    if policy.read.contains(&key) {
        KeyUse::Read
    } else if policy.ignored.contains(&key) || GENERIC_IGNORED.contains(&key) {
        KeyUse::Ignored
    } else if let Some((_, v)) = GENERIC_FIXED.iter().find(|(k, _)| *k == key) {
        KeyUse::Fixed(v)
    } else {
        KeyUse::Unknown
    }
}

/// Refuses every key of `raw` that the family of `policy` neither reads nor knows to be
/// harmless, and every fixed key with another value; `path` names the file in the message.
pub fn check_keys(policy: &KeyPolicy, raw: &Value, path: &Path) -> Result<()> {
    let Some(obj) = raw.as_object() else {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            key: "(config.json)".into(),
            msg: "expected a JSON object".into(),
        });
    };
    for (key, value) in obj {
        match key_use(policy, key) {
            KeyUse::Read | KeyUse::Ignored => {}
            KeyUse::Fixed(want) => {
                let want_value: Value = serde_json::from_str(want).expect("fixed values are JSON");
                if *value != want_value && !(want == "null" && value.is_null()) {
                    return Err(ModelError::Config {
                        path: path.to_path_buf(),
                        key: key.clone(),
                        msg: format!(
                            "{value} is not supported: tallow builds a plain decoder-only model \
                             ({key} = {want}); a model that needs this is not one of the \
                             families tallow implements"
                        ),
                    });
                }
            }
            KeyUse::Unknown => {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    key: key.clone(),
                    msg: format!(
                        "not implemented by tallow's {family}, and it may change what the model \
                         computes (value {value}); tallow reads these keys of a {family} \
                         config: {read}, and ignores the ones that cannot change the output \
                         (use_cache, initializer_range, ...). If this key really has no effect \
                         on this model, remove it from config.json",
                        family = policy.family,
                        value = short(value),
                        read = policy.read.join(", "),
                    ),
                });
            }
        }
    }
    Ok(())
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
            read: field_names::<Two>().to_vec(),
            ignored: &["c"],
        }
    }

    #[test]
    fn field_names_come_from_the_struct() {
        assert_eq!(field_names::<Two>(), &["a", "b"]);
        assert_eq!(key_use(&two(), "a"), KeyUse::Read);
        assert_eq!(key_use(&two(), "c"), KeyUse::Ignored);
        assert_eq!(key_use(&two(), "use_cache"), KeyUse::Ignored);
        assert_eq!(key_use(&two(), "pruned_heads"), KeyUse::Fixed("{}"));
        assert_eq!(key_use(&two(), "attn_logit_softcapping"), KeyUse::Unknown);
    }

    #[test]
    fn unknown_and_fixed_keys_are_refused_by_name() {
        let p = Path::new("m/config.json");
        let ok = serde_json::json!({"a": 1, "c": 2, "use_cache": true, "pruned_heads": {},
            "cross_attention_hidden_size": null});
        check_keys(&two(), &ok, p).unwrap();
        let e = check_keys(
            &two(),
            &serde_json::json!({"a": 1, "final_logit_softcapping": 30.0}),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("m/config.json") && e.contains("`final_logit_softcapping`"),
            "{e}"
        );
        assert!(
            e.contains("30.0") && e.contains("reads these keys") && e.contains("a, b"),
            "{e}"
        );
        let e = check_keys(&two(), &serde_json::json!({"is_encoder_decoder": true}), p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`is_encoder_decoder`") && e.contains("decoder-only"),
            "{e}"
        );
    }
}
