//! A GGUF file's tokenizer (`tokenizer.ggml.*`) as the `tokenizer.json` and
//! `tokenizer_config.json` transformers builds from it (`integrations/gguf/
//! gguf_tokenizer_mapping.py` in transformers 5: `byte_level_tokenizer`, `add_gguf_special_tokens`,
//! `set_split_regex`), so that tallow's tokenizer gives the ids transformers' does.
//!
//! Read: byte-level BPE vocabularies (`tokenizer.ggml.model` = `gpt2`: GPT-2, Llama 3, Qwen 2 /
//! 2.5 / 3, most recent models). SentencePiece vocabularies (`llama`: Llama 2, Mistral, Gemma,
//! Phi-3) are refused by name for now.

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
    if model != "gpt2" {
        return Err(ModelError::GgufRefused {
            path: file.path.clone(),
            refusals: vec![Refusal {
                key: "tokenizer.ggml.model".into(),
                value: Some(format!("{model:?}")),
                msg: "only byte-level BPE (`gpt2`) vocabularies are read from GGUF yet".into(),
            }],
        });
    }
    let missing = |key: &str| ModelError::Config {
        path: file.path.clone(),
        key: key.to_string(),
        msg: "missing from the file's metadata".into(),
    };
    let tokens = file
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
    let merges = file.strings("tokenizer.ggml.merges")?.unwrap_or_default();
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
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| json!(m.split(' ').collect::<Vec<_>>()))
        .collect();

    // Control tokens are added as special (those outside the byte alphabet are llama.cpp
    // mislabels and skipped); user-defined ones as plain added tokens.
    let mut added = Vec::new();
    for (id, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        let special = match *ty {
            CONTROL if in_alphabet(t) => true,
            USER_DEFINED if vocab.contains_key(*t) => false,
            _ => continue,
        };
        added.push(
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special}),
        );
    }
    // user-defined tokens come after the control ones, as transformers adds them
    added.sort_by_key(|a| !a["special"].as_bool().unwrap_or(false));

    let pre = file.string("tokenizer.ggml.pre")?.unwrap_or("");
    let pre_tokenizer = match split_regex(pre) {
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}),
        None => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
    };

    // (id, token as the vocabulary spells it) of a special token the metadata names by id (a
    // control token outside the byte alphabet, such as DeepSeek's `<｜end▁of▁sentence｜>`, is
    // not an added token and is known by its byte-level spelling)
    let special = |key: &str| -> Result<Option<(i64, String)>> {
        Ok(file
            .int(key)?
            .and_then(|id| tokens.get(id as usize).map(|t| (id, spelled(t)))))
    };
    let bos = special("tokenizer.ggml.bos_token_id")?;
    let eos = special("tokenizer.ggml.eos_token_id")?;
    let add_bos = file.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = file.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    // The post-processor: BOS / EOS around each sequence when the file says to add them.
    let mut special_tokens = Map::new();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut piece = |t: &Option<(i64, String)>, on: bool, type_id: u32, out: &mut Vec<Value>| {
        if let (Some((id, t)), true) = (t, on) {
            out.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
            special_tokens.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
        }
    };
    piece(&bos, add_bos, 0, &mut single);
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    piece(&eos, add_eos, 0, &mut single);
    piece(&bos, add_bos, 0, &mut pair);
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    piece(&eos, add_eos, 0, &mut pair);
    piece(&bos, add_bos, 1, &mut pair);
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    piece(&eos, add_eos, 1, &mut pair);

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
            "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let mut config = Map::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        config.insert(
            name.into(),
            special(key)?.map_or(Value::Null, |(_, t)| Value::from(t)),
        );
    }
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    if let Some(t) = file.string("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(t));
    }
    Ok((tokenizer, Value::Object(config)))
}
