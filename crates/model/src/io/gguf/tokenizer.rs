//! A GGUF file's tokenizer (`tokenizer.ggml.*`) as the `tokenizer.json` and
//! `tokenizer_config.json` transformers builds from it (`integrations/gguf/
//! gguf_tokenizer_mapping.py` in transformers 5: `byte_level_tokenizer`, `add_gguf_special_tokens`,
//! `set_split_regex`), so that tallow's tokenizer gives the ids transformers' does.
//!
//! Read: byte-level BPE vocabularies (`tokenizer.ggml.model` = `gpt2`: GPT-2, Llama 3, Qwen 2 /
//! 2.5 / 3, most recent models) and SentencePiece ones (`llama`: Llama 2, Mistral, and the two
//! variants transformers builds by architecture, `GGUF_SENTENCEPIECE_BUILDERS`: Gemma 1 / 2 / 3's
//! and Phi-3's). Others (BERT, T5) are refused by name.

use serde_json::{json, Map, Value};

use super::GgufFile;
use crate::error::{ModelError, Refusal, Result};

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizer split of each `tokenizer.ggml.pre` that transformers knows
/// (`GGUF_PRE_TOKENIZER_SPLITS`); any other keeps GPT-2's byte-level regex.
pub(crate) fn split_regex(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "tekken" => TEKKEN,
        "qwen35" => QWEN35,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}

/// GPT-2's byte -> printable character map (`bytes_to_unicode`).
fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u32 {
        let printable = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        map[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    map
}

/// (`tokenizer.json`, `tokenizer_config.json`) of `file`.
pub fn hf_tokenizer(file: &GgufFile) -> Result<(Value, Value)> {
    let model = file.string("tokenizer.ggml.model")?.unwrap_or("");
    let arch = file.string("general.architecture")?.unwrap_or("");
    if model == "llama" {
        let variant = match arch {
            "gemma" | "gemma2" | "gemma3" => Spm::Gemma,
            "phi3" => Spm::Phi3,
            _ => Spm::Llama,
        };
        return sentencepiece(file, variant);
    }
    if model != "gpt2" {
        return Err(ModelError::GgufRefused {
            path: file.path.clone(),
            refusals: vec![Refusal {
                key: "tokenizer.ggml.model".into(),
                value: Some(format!("{model:?}")),
                msg: "byte-level BPE (`gpt2`) and SentencePiece (`llama`) vocabularies are read \
                      from GGUF so far"
                    .into(),
            }],
        });
    }
    let tokens = file
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing(file, "tokenizer.ggml.tokens"))?;
    let types = file.ints("tokenizer.ggml.token_type")?.unwrap_or_default();
    let spelling = bytes_to_unicode();
    let alphabet: std::collections::HashSet<char> = spelling.iter().copied().collect();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));

    // The vocabulary, each token spelled in the byte alphabet (a token the file writes in plain
    // UTF-8 is re-spelled byte by byte, as transformers does).
    let spelled = |t: &str| -> String {
        if in_alphabet(t) {
            t.to_string()
        } else {
            t.bytes().map(|b| spelling[b as usize]).collect()
        }
    };
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(spelled(t), json!(id));
    }
    let merges = file_merges(file)?.unwrap_or_default();

    // Control tokens outside the byte alphabet are llama.cpp mislabels, skipped.
    let added = added_tokens(&tokens, &types, &in_alphabet, &vocab);

    let pre = file.string("tokenizer.ggml.pre")?.unwrap_or("");
    let pre_tokenizer = match split_regex(pre) {
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}),
        None => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
    };

    let specials = Specials::read(file, &tokens, &spelled, false)?;
    let post_processor = specials.post_processor();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
            "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let config = specials.tokenizer_config(file)?;
    Ok((tokenizer, config))
}

/// The file's merges (`tokenizer.ggml.merges`, "left right" each) as tokenizer.json pairs.
fn file_merges(file: &GgufFile) -> Result<Option<Vec<Value>>> {
    Ok(file.strings("tokenizer.ggml.merges")?.map(|m| {
        m.iter()
            .map(|m| json!(m.split(' ').collect::<Vec<_>>()))
            .collect()
    }))
}

/// A metadata key the tokenizer cannot do without, absent.
fn missing(file: &GgufFile, key: &str) -> ModelError {
    ModelError::Config {
        path: file.path.clone(),
        key: key.to_string(),
        msg: "missing from the file's metadata".into(),
    }
}

/// The special tokens a file names by id (as the vocabulary spells them: a control token outside
/// the byte alphabet, such as DeepSeek's `<｜end▁of▁sentence｜>`, is not an added token and is
/// known by its byte-level spelling) and whether BOS / EOS are added.
struct Specials {
    bos: Option<(i64, String)>,
    eos: Option<(i64, String)>,
    unk: Option<(i64, String)>,
    pad: Option<(i64, String)>,
    add_bos: bool,
    add_eos: bool,
}

impl Specials {
    /// `add_bos_default`: a SentencePiece file without the flag adds BOS (transformers and
    /// llama.cpp alike); a byte-level one does not.
    fn read(
        file: &GgufFile,
        tokens: &[&str],
        spelled: &dyn Fn(&str) -> String,
        add_bos_default: bool,
    ) -> Result<Self> {
        let special = |key: &str| -> Result<Option<(i64, String)>> {
            Ok(file
                .int(key)?
                .and_then(|id| tokens.get(id as usize).map(|t| (id, spelled(t)))))
        };
        Ok(Self {
            bos: special("tokenizer.ggml.bos_token_id")?,
            eos: special("tokenizer.ggml.eos_token_id")?,
            unk: special("tokenizer.ggml.unknown_token_id")?,
            pad: special("tokenizer.ggml.padding_token_id")?,
            add_bos: file
                .bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(add_bos_default),
            add_eos: file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        })
    }

    /// BOS / EOS around each sequence when the file says to add them.
    fn post_processor(&self) -> Value {
        let mut special_tokens = Map::new();
        let (mut single, mut pair) = (Vec::new(), Vec::new());
        let mut piece =
            |t: &Option<(i64, String)>, on: bool, type_id: u32, out: &mut Vec<Value>| {
                if let (Some((id, t)), true) = (t, on) {
                    out.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
                    special_tokens.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
                }
            };
        piece(&self.bos, self.add_bos, 0, &mut single);
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        piece(&self.eos, self.add_eos, 0, &mut single);
        piece(&self.bos, self.add_bos, 0, &mut pair);
        pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        piece(&self.eos, self.add_eos, 0, &mut pair);
        piece(&self.bos, self.add_bos, 1, &mut pair);
        pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
        piece(&self.eos, self.add_eos, 1, &mut pair);
        json!({"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special_tokens})
    }

    fn tokenizer_config(&self, file: &GgufFile) -> Result<Value> {
        let name = |t: &Option<(i64, String)>| t.as_ref().map_or(Value::Null, |(_, t)| json!(t));
        let mut config = Map::new();
        config.insert("bos_token".into(), name(&self.bos));
        config.insert("eos_token".into(), name(&self.eos));
        config.insert("unk_token".into(), name(&self.unk));
        config.insert("pad_token".into(), name(&self.pad));
        config.insert("add_bos_token".into(), json!(self.add_bos));
        config.insert("add_eos_token".into(), json!(self.add_eos));
        if let Some(t) = file.string("tokenizer.chat_template")? {
            config.insert("chat_template".into(), json!(t));
        }
        Ok(Value::Object(config))
    }
}

/// Added tokens as transformers' `add_gguf_special_tokens` adds them: control tokens as special
/// (`keep(token)` false: skipped), then (after them) user-defined ones in the vocabulary as plain
/// added tokens.
fn added_tokens(
    tokens: &[&str],
    types: &[i64],
    keep: &dyn Fn(&str) -> bool,
    vocab: &Map<String, Value>,
) -> Vec<Value> {
    let mut added = Vec::new();
    for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
        let special = match *ty {
            CONTROL if keep(t) => true,
            USER_DEFINED if vocab.contains_key(*t) => false,
            _ => continue,
        };
        added.push(
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special}),
        );
    }
    added.sort_by_key(|a| !a["special"].as_bool().unwrap_or(false));
    added
}

/// The SentencePiece builds transformers 5 picks by architecture.
#[derive(Clone, Copy, PartialEq)]
enum Spm {
    /// `LlamaTokenizer`: Llama 2, Mistral and every architecture without a build of its own.
    Llama,
    /// `gemma_tokenizer` -> `GemmaTokenizer`: Gemma 1 / 2 / 3.
    Gemma,
    /// `phi3_tokenizer`: `LlamaTokenizer` with the prefix space from a normalizer.
    Phi3,
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model` = "llama") as transformers 5 builds it
/// (`sentencepiece_tokenizer` -> `LlamaTokenizer(vocab, merges)`, or the Gemma / Phi-3 builds):
/// BPE with byte fallback over the tokens as the file spells them, the file's merges or, when it
/// has none (llama.cpp writes none for these), merges recovered from the scores
/// ([`generate_merges`]); the `▁` before the first word and between words, and the decoder that
/// undoes them.
///
/// - Llama: Metaspace pre-tokenization (a `▁` before the first word only).
/// - Phi-3: a `Prepend("▁")` + `Replace(" ", "▁")` normalizer and no pre-tokenizer, so a text
///   that starts with spaces gets one `▁` more than Metaspace gives it.
/// - Gemma: no prefix `▁` (Gemma's SentencePiece adds no dummy prefix), spaces replaced by `▁`;
///   a token of spaces alone (stored with real spaces) respelled as `▁`s, and the merges ordered
///   by the tokens' positions in the file, not their scores (Gemma's scores do not follow its
///   merge order); `<unk>` as the model's unknown token; no strip of a leading space in the
///   decoder.
fn sentencepiece(file: &GgufFile, variant: Spm) -> Result<(Value, Value)> {
    let stored = file
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing(file, "tokenizer.ggml.tokens"))?;
    let respelled: Vec<String> = stored
        .iter()
        .map(|t| match variant {
            Spm::Gemma if t.contains(' ') && t.trim().is_empty() => {
                "\u{2581}".repeat(t.chars().count())
            }
            _ => t.to_string(),
        })
        .collect();
    let tokens: Vec<&str> = respelled.iter().map(String::as_str).collect();
    let types = file.ints("tokenizer.ggml.token_type")?.unwrap_or_default();
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(id));
    }
    let merges = match file_merges(file)? {
        Some(m) => m,
        None => {
            let scores = match variant {
                // -position: the earlier a token, the earlier its merge
                Spm::Gemma => (0..tokens.len()).map(|i| -(i as f64)).collect(),
                _ => file
                    .floats("tokenizer.ggml.scores")?
                    .ok_or_else(|| missing(file, "tokenizer.ggml.scores"))?,
            };
            generate_merges(&tokens, &scores)
                .into_iter()
                .map(|(l, r)| json!([l, r]))
                .collect()
        }
    };
    let added = added_tokens(&tokens, &types, &|_| true, &vocab);
    let specials = Specials::read(file, &tokens, &|t| t.to_string(), true)?;
    let space = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let (normalizer, pre_tokenizer) = match variant {
        Spm::Llama => (
            Value::Null,
            json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first",
                "split": false}),
        ),
        Spm::Phi3 => (
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"}, space]}),
            Value::Null,
        ),
        Spm::Gemma => (
            space,
            json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                "invert": false}),
        ),
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if variant != Spm::Gemma {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let unk = match variant {
        Spm::Gemma => json!("<unk>"),
        _ => Value::Null,
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": specials.post_processor(),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    Ok((tokenizer, specials.tokenizer_config(file)?))
}

/// transformers' `generate_merges(vocab, vocab_scores)`: every split of every token into two
/// tokens of the vocabulary, ordered by the token's score (highest first), then by the lengths
/// of the two parts (longest first), ties in vocabulary order.
fn generate_merges(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    // dict(zip(tokens, scores)) and {token: index}: a repeated token keeps its first position
    // in the order, its last score and its last index
    let mut index: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut score: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if !score.contains_key(t) {
            order.push(t);
        }
        score.insert(t, scores.get(i).copied().unwrap_or(0.0));
        index.insert(t, i);
    }
    let mut merges: Vec<(String, String, f64)> = Vec::new();
    for t in &order {
        let chars: Vec<(usize, char)> = t.char_indices().collect();
        let mut local: Vec<(&str, &str)> = Vec::new();
        for &(at, _) in chars.iter().skip(1) {
            let (l, r) = t.split_at(at);
            if index.contains_key(l) && index.contains_key(r) {
                local.push((l, r));
            }
        }
        local.sort_by_key(|(l, r)| (index[l], index[r]));
        merges.extend(
            local
                .into_iter()
                .map(|(l, r)| (l.to_string(), r.to_string(), score[t])),
        );
    }
    // sorted(key=(score, len(l), len(r)), reverse=True), stable
    merges.sort_by(|a, b| {
        let ka = (a.0.chars().count(), a.1.chars().count());
        let kb = (b.0.chars().count(), b.1.chars().count());
        b.2.total_cmp(&a.2).then(kb.cmp(&ka))
    });
    merges.into_iter().map(|(l, r, _)| (l, r)).collect()
}
