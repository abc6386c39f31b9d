//! SentencePiece vocabularies for GGUF export: the pieces of a `tokenizer.model` (SentencePiece's
//! protobuf), and the token list, scores and types llama.cpp's converter builds from them
//! (`TextModel._create_vocab_sentencepiece` in conversion/base.py for Llama 2 / Mistral / Gemma,
//! `Phi3MiniModel.set_vocab` in conversion/phi.py for Phi-3).

use serde_json::Value;

/// llama.cpp's token types (gguf-py's `SentencePieceTokenTypes`).
pub const NORMAL: i32 = 1;
pub const UNKNOWN: i32 = 2;
pub const CONTROL: i32 = 3;
pub const USER_DEFINED: i32 = 4;
pub const UNUSED: i32 = 5;
pub const BYTE: i32 = 6;

/// One piece of a `tokenizer.model`: its text, score and SentencePiece type (1 normal, 2
/// unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: i32,
}

/// A varint at `*at` of `b`, moving `*at` past it.
fn varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// The fields of one protobuf message: (field number, wire type, payload: the varint's or
/// fixed value's bytes, or the length-delimited bytes).
fn fields(b: &[u8]) -> Option<Vec<(u64, u8, &[u8])>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let start = at;
        let end = match wire {
            0 => {
                varint(b, &mut at)?;
                at
            }
            1 => at + 8,
            2 => {
                let n = varint(b, &mut at)? as usize;
                let s = at;
                at = s.checked_add(n)?;
                out.push((field, wire, b.get(s..at)?));
                continue;
            }
            5 => at + 4,
            _ => return None,
        };
        at = end;
        out.push((field, wire, b.get(start..end)?));
    }
    Some(out)
}

/// The pieces of a `tokenizer.model` (`ModelProto.pieces`, field 1; each `SentencePiece` with
/// `piece` 1, `score` 2, `type` 3, absent type meaning normal), or None when the bytes are not
/// such a protobuf.
pub fn pieces(model: &[u8]) -> Option<Vec<Piece>> {
    let mut out = Vec::new();
    for (field, wire, payload) in fields(model)? {
        if field != 1 || wire != 2 {
            continue;
        }
        let mut p = Piece {
            text: String::new(),
            score: 0.0,
            kind: NORMAL,
        };
        for (f, w, v) in fields(payload)? {
            match (f, w) {
                (1, 2) => p.text = String::from_utf8(v.to_vec()).ok()?,
                (2, 5) => p.score = f32::from_le_bytes(v.try_into().ok()?),
                (3, 0) => p.kind = varint(v, &mut 0)? as i32,
                _ => {}
            }
        }
        out.push(p);
    }
    Some(out)
}

/// Which of the converter's two SentencePiece vocabulary builds.
#[derive(Clone, Copy, PartialEq)]
pub enum Build {
    /// `_create_vocab_sentencepiece` (Llama 2, Mistral, Gemma): added tokens from
    /// `added_tokens.json`, then `tokenizer_config.json`'s `added_tokens_decoder` (control when
    /// special or when they look special, user-defined otherwise, their `▁` written as spaces).
    Base,
    /// Phi-3's own: `added_tokens.json`, then `added_tokens_decoder`, then `tokenizer.json`'s
    /// `added_tokens`, each user-defined, or control when special.
    Phi3,
}

/// (tokens, scores, types) as the converter writes them for a model of `vocab_size` tokens:
/// `[PAD{i}]` (-10000, unused) where nothing else is, the pieces (types normal, unknown,
/// control, unused or byte; a user-defined piece counts as normal), then the added tokens at
/// -1000 (`build`).
pub fn vocabulary(
    pieces: &[Piece],
    vocab_size: usize,
    added_tokens_json: &Value,
    tokenizer_config: &Value,
    tokenizer_json: &Value,
    build: Build,
    looks_special: &dyn Fn(&str) -> bool,
) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000.0f32; vocab_size];
    let mut types = vec![UNUSED; vocab_size];
    for (i, p) in pieces.iter().enumerate().take(vocab_size) {
        tokens[i] = p.text.clone();
        scores[i] = p.score;
        types[i] = match p.kind {
            UNKNOWN | CONTROL | UNUSED | BYTE => p.kind,
            _ => NORMAL,
        };
    }
    let mut set = |id: usize, token: String, ty: i32| {
        if id < vocab_size {
            tokens[id] = token;
            scores[id] = -1000.0;
            types[id] = ty;
        }
    };
    if let Some(added) = added_tokens_json.as_object() {
        for (token, id) in added {
            if let Some(id) = id.as_u64() {
                set(id as usize, token.clone(), USER_DEFINED);
            }
        }
    }
    let mut decoder: Vec<(usize, &Value)> = tokenizer_config["added_tokens_decoder"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
                .collect()
        })
        .unwrap_or_default();
    // the JSON object's order is the file's; tokenizer_config.json writes ids ascending
    decoder.sort_by_key(|(id, _)| *id);
    let special = |v: &Value| v["special"].as_bool() == Some(true);
    let content = |v: &Value| v["content"].as_str().unwrap_or("").to_string();
    for (id, v) in decoder {
        let token = content(v);
        match build {
            Build::Base if special(v) || looks_special(&token) => set(id, token, CONTROL),
            Build::Base => set(id, token.replace('\u{2581}', " "), USER_DEFINED),
            Build::Phi3 => set(id, token, if special(v) { CONTROL } else { USER_DEFINED }),
        }
    }
    if build == Build::Phi3 {
        for v in tokenizer_json["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(id) = v["id"].as_u64() {
                let ty = if special(v) { CONTROL } else { USER_DEFINED };
                set(id as usize, content(v), ty);
            }
        }
    }
    (tokens, scores, types)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made `ModelProto`: two pieces (one with every field, one with the text alone) and
    /// a field 2 (trainer spec) to skip.
    #[test]
    fn pieces_are_read_from_the_protobuf() {
        let piece = |text: &str, score: Option<f32>, kind: Option<u8>| {
            let mut m = vec![0x0a, text.len() as u8];
            m.extend(text.as_bytes());
            if let Some(s) = score {
                m.push(0x15);
                m.extend(s.to_le_bytes());
            }
            if let Some(k) = kind {
                m.extend([0x18, k]);
            }
            let mut out = vec![0x0a, m.len() as u8];
            out.extend(m);
            out
        };
        let mut model = piece("<unk>", Some(0.0), Some(2));
        model.extend([0x12, 0x02, 0x08, 0x01]); // field 2: a message holding varint 1
        model.extend(piece("\u{2581}the", Some(-3.5), None));
        let got = pieces(&model).unwrap();
        assert_eq!(
            got,
            vec![
                Piece {
                    text: "<unk>".into(),
                    score: 0.0,
                    kind: UNKNOWN
                },
                Piece {
                    text: "\u{2581}the".into(),
                    score: -3.5,
                    kind: NORMAL
                },
            ]
        );
        // truncated: not a protobuf
        assert!(pieces(&model[..model.len() - 2]).is_none());
    }
}
