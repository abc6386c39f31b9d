//! The tokenizer of an HF model dir: `tokenizer.json` plus the special tokens and chat template
//! that transformers keeps beside it.
//!
//! Files read from the model dir:
//! - `tokenizer.json` (required): the fast tokenizer, loaded with the `tokenizers` crate.
//! - `tokenizer_config.json` (optional): `bos_token`, `eos_token`, `pad_token` (each a string,
//!   `null`, or an AddedToken dict `{"content": "...", ...}`) and `chat_template` (a string, or a
//!   list of `{"name", "template"}`: "default" wins, else the first).
//! - `chat_template.jinja` (optional): the chat template; takes precedence over tokenizer_config's,
//!   as in transformers >= 4.51.
//! - `generation_config.json`, then `config.json`: `eos_token_id` (an id or a list of ids; the first
//!   is used), read only when tokenizer_config.json names no `eos_token`.

use crate::chat::ChatTemplate;
use crate::error::{json_type, EncodeError, TextError};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// A model dir's tokenizer with its special tokens and chat template.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    dir: PathBuf,
    /// Special-token strings as tokenizer_config.json names them (None when absent or null).
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
}

impl TextTokenizer {
    /// Loads the tokenizer files of the HF model dir `dir` (see the module doc for which files).
    pub fn from_model_dir(dir: &Path) -> Result<Self, TextError> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(TextError::MissingTokenizer {
                dir: dir.to_path_buf(),
            });
        }
        let mut inner =
            Tokenizer::from_file(&tokenizer_path).map_err(|e| TextError::Tokenizer {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            })?;
        // transformers' fast tokenizers ignore the truncation/padding saved in tokenizer.json
        // unless asked (`set_truncation_and_padding` with defaults); so do we: a saved
        // `max_length` truncation would silently cut training rows.
        inner
            .with_truncation(None)
            .map_err(|e| TextError::Tokenizer {
                path: tokenizer_path.clone(),
                message: e.to_string(),
            })?;
        inner.with_padding(None);

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or(Json::Null);
        let bos_token = special_token(&config, "bos_token", &config_path)?;
        let eos_token = special_token(&config, "eos_token", &config_path)?;
        let pad_token = special_token(&config, "pad_token", &config_path)?;

        let eos_id = match &eos_token {
            Some(tok) => Some(
                inner
                    .token_to_id(tok)
                    .ok_or_else(|| TextError::UnknownToken {
                        path: config_path.clone(),
                        key: "eos_token".into(),
                        token: tok.clone(),
                    })?,
            ),
            None => fallback_eos_id(dir)?,
        };
        let pad_id = pad_token.as_deref().and_then(|t| inner.token_to_id(t));

        let jinja_path = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja_path) {
            Ok(src) => Some((src, jinja_path.display().to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                config_chat_template(&config, &config_path)?
                    .map(|src| (src, config_path.display().to_string()))
            }
            Err(source) => {
                return Err(TextError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        let chat_template = template
            .map(|(src, origin)| {
                ChatTemplate::new(src, origin, bos_token.as_deref(), eos_token.as_deref())
            })
            .transpose()?;

        Ok(Self {
            inner,
            dir: dir.to_path_buf(),
            bos_token,
            eos_token,
            eos_id,
            pad_id,
            chat_template,
        })
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (e.g. prepends BOS),
    /// like `tokenizer(text, add_special_tokens=...)` in transformers.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EncodeError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| EncodeError::Tokenizer(e.to_string()))
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EncodeError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| EncodeError::Tokenizer(e.to_string()))
    }

    /// The EOS id: tokenizer_config.json's `eos_token`, else `eos_token_id` from
    /// generation_config.json / config.json.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The BOS token string as tokenizer_config.json names it.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string as tokenizer_config.json names it (None when only a fallback
    /// `eos_token_id` is known: transformers passes no eos_token to templates then either).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The id of tokenizer_config.json's `pad_token`, when it names one that is in the vocab.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The id to right-pad batches with: the pad token, else EOS, else 0. Padding is never
    /// attended to by real tokens nor trained on, so any valid id works; a real one keeps
    /// dumps readable.
    pub fn batch_pad_id(&self) -> u32 {
        self.pad_id().or(self.eos_id()).unwrap_or(0)
    }

    /// Vocabulary size including added tokens (the largest id + 1 for HF-saved tokenizers; the
    /// model's embedding may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The chat template, if the model dir has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The model dir this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

/// Parses the JSON file at `path`; `Ok(None)` when it does not exist.
fn read_json(path: &Path) -> Result<Option<Json>, TextError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// A special token of tokenizer_config.json: a string, `null`, or an AddedToken dict
/// (`{"__type": "AddedToken", "content": "</s>", ...}`, written by older transformers).
fn special_token(config: &Json, key: &str, path: &Path) -> Result<Option<String>, TextError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TextError::ConfigKey {
                path: path.to_path_buf(),
                key: key.into(),
                message: "is a dict without a string \"content\"; write the token as a string \
                          or {\"content\": \"<token>\"}"
                    .into(),
            }),
        },
        Some(other) => Err(TextError::ConfigKey {
            path: path.to_path_buf(),
            key: key.into(),
            message: format!(
                "must be a string, null or {{\"content\": \"<token>\"}}, found {}",
                json_type(other)
            ),
        }),
    }
}

/// tokenizer_config.json's `chat_template`: a string, or a list of named templates from which
/// "default" (else the first) is taken, as transformers does.
fn config_chat_template(config: &Json, path: &Path) -> Result<Option<String>, TextError> {
    let bad = |message: &str| TextError::ConfigKey {
        path: path.to_path_buf(),
        key: "chat_template".into(),
        message: message.into(),
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            };
            match named("default").or(list.first()) {
                None => Ok(None),
                Some(t) => match t.get("template") {
                    Some(Json::String(s)) => Ok(Some(s.clone())),
                    _ => Err(bad(
                        "is a list whose entries must be {\"name\": str, \"template\": str}",
                    )),
                },
            }
        }
        Some(_) => Err(bad(
            "must be a string or a list of {\"name\": str, \"template\": str}",
        )),
    }
}

/// `eos_token_id` from generation_config.json, else config.json (an id or a list; the first id).
fn fallback_eos_id(dir: &Path) -> Result<Option<u32>, TextError> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        let Some(config) = read_json(&path)? else {
            continue;
        };
        let id = match config.get("eos_token_id") {
            None | Some(Json::Null) => continue,
            Some(Json::Array(ids)) => ids.first(),
            Some(v) => Some(v),
        };
        match id.and_then(Json::as_u64).map(u32::try_from) {
            Some(Ok(id)) => return Ok(Some(id)),
            None if id.is_none() => continue, // empty list
            _ => {
                return Err(TextError::ConfigKey {
                    path,
                    key: "eos_token_id".into(),
                    message: "must be a token id or a list of token ids".into(),
                })
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::Message;
    use crate::test_util::*;

    #[test]
    fn loads_specials_and_encodes_without_saved_truncation() {
        let dir = model_dir(
            "tok-basic",
            Some(r#"{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}"#),
        );
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        assert_eq!(tok.eos_id(), Some(2));
        assert_eq!(tok.pad_id(), Some(0));
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("</s>"));
        assert_eq!(tok.vocab_size(), WORDS.len());
        assert!(tok.chat_template().is_none());
        // tokenizer.json saves truncation max_length 3; it must not apply.
        assert_eq!(
            tok.encode("hello world a b", true).unwrap(),
            vec![1, 3, 4, 5, 6]
        );
        assert_eq!(
            tok.encode("hello world a b", false).unwrap(),
            vec![3, 4, 5, 6]
        );
        assert_eq!(tok.decode(&[1, 3, 2]).unwrap(), "<s> hello </s>");
    }

    #[test]
    fn added_token_dict_eos() {
        let dir = model_dir(
            "tok-addedtoken",
            Some(
                r#"{"eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false},
                    "bos_token": null, "pad_token": null}"#,
            ),
        );
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        assert_eq!(tok.eos_token(), Some("</s>"));
        assert_eq!(tok.eos_id(), Some(2));
        assert_eq!(tok.bos_token(), None);
        assert_eq!(tok.pad_id(), None);
    }

    #[test]
    fn eos_id_falls_back_to_generation_config_then_config() {
        let dir = model_dir("tok-fallback", None);
        write(&dir, "config.json", r#"{"eos_token_id": 9}"#);
        assert_eq!(
            TextTokenizer::from_model_dir(&dir).unwrap().eos_id(),
            Some(9)
        );
        write(
            &dir,
            "generation_config.json",
            r#"{"eos_token_id": [11, 2]}"#,
        );
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        assert_eq!(tok.eos_id(), Some(11));
        assert_eq!(tok.eos_token(), None);
        // tokenizer_config's eos_token wins over both.
        write(&dir, "tokenizer_config.json", r#"{"eos_token": "</s>"}"#);
        assert_eq!(
            TextTokenizer::from_model_dir(&dir).unwrap().eos_id(),
            Some(2)
        );
    }

    #[test]
    fn no_eos_anywhere_is_none() {
        let dir = model_dir("tok-noeos", Some("{}"));
        assert_eq!(TextTokenizer::from_model_dir(&dir).unwrap().eos_id(), None);
    }

    #[test]
    fn missing_tokenizer_json_names_dir() {
        let dir = temp_dir("tok-missing");
        let err = TextTokenizer::from_model_dir(&dir).unwrap_err().to_string();
        assert!(err.contains(&dir.display().to_string()), "{err}");
        assert!(err.contains("needs a tokenizer.json"), "{err}");
    }

    #[test]
    fn eos_not_in_vocab_is_an_error_naming_key() {
        let dir = model_dir("tok-badeos", Some(r#"{"eos_token": "<|end|>"}"#));
        let err = TextTokenizer::from_model_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer_config.json"), "{err}");
        assert!(
            err.contains("eos_token") && err.contains("<|end|>"),
            "{err}"
        );
    }

    #[test]
    fn bad_special_token_type_names_key() {
        let dir = model_dir("tok-badtype", Some(r#"{"bos_token": 5}"#));
        let err = TextTokenizer::from_model_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("`bos_token`") && err.contains("a number"),
            "{err}"
        );
    }

    #[test]
    fn chat_template_list_prefers_default() {
        let cfg = r#"{"eos_token": "</s>", "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default {{ eos_token }}"}]}"#;
        // The template a tokenizer_config.json picks, rendered with no messages.
        let rendered = |name: &str, cfg: &str| {
            let tok = TextTokenizer::from_model_dir(&model_dir(name, Some(cfg))).unwrap();
            tok.chat_template().unwrap().render(&[], false).unwrap()
        };
        assert_eq!(rendered("tok-tpl-list", cfg), "default </s>");

        let cfg = r#"{"chat_template": [{"name": "a", "template": "first"},
                                        {"name": "b", "template": "second"}]}"#;
        assert_eq!(rendered("tok-tpl-list-first", cfg), "first");
    }

    #[test]
    fn chat_template_jinja_takes_precedence() {
        let dir = model_dir("tok-tpl-jinja", Some(&chat_config()));
        let msgs = [Message::new("user", "hello")];
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        assert_eq!(
            tok.chat_template().unwrap().render(&msgs, true).unwrap(),
            "<|user|> hello <|bot|> "
        );
        write(
            &dir,
            "chat_template.jinja",
            "jinja file {{ messages | length }}\n",
        );
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let tpl = tok.chat_template().unwrap();
        assert_eq!(tpl.render(&msgs, true).unwrap(), "jinja file 1");
        assert!(
            tpl.origin().ends_with("chat_template.jinja"),
            "{}",
            tpl.origin()
        );
    }
}
