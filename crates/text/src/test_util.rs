//! Throwaway model dirs with a tiny word-level tokenizer, for unit tests here and in the
//! trainer's data pipeline (`features = ["test-util"]` in a dev-dependency).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Vocabulary of the test tokenizer: words split on whitespace, `<s>` = 1, `</s>` = 2.
pub const WORDS: [&str; 12] = [
    "<unk>", "<s>", "</s>", "hello", "world", "a", "b", "c", "d", "e", "<|user|>", "<|bot|>",
];

/// A WordLevel tokenizer.json over [`WORDS`] whose post-processor prepends `<s>` (like Llama).
pub fn tokenizer_json() -> String {
    let vocab: Vec<String> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{w:?}: {i}"))
        .collect();
    let added: Vec<String> = [0, 1, 2, 10, 11]
        .iter()
        .map(|&i| {
            format!(
                r#"{{"id": {i}, "content": {:?}, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}}"#,
                WORDS[i]
            )
        })
        .collect();
    format!(
        r##"{{
          "version": "1.0",
          "truncation": {{"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}},
          "padding": null,
          "added_tokens": [{added}],
          "normalizer": null,
          "pre_tokenizer": {{"type": "WhitespaceSplit"}},
          "post_processor": {{
            "type": "TemplateProcessing",
            "single": [{{"SpecialToken": {{"id": "<s>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}}],
            "pair": [{{"SpecialToken": {{"id": "<s>", "type_id": 0}}}}, {{"Sequence": {{"id": "A", "type_id": 0}}}},
                     {{"Sequence": {{"id": "B", "type_id": 1}}}}],
            "special_tokens": {{"<s>": {{"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}}
          }},
          "decoder": null,
          "model": {{"type": "WordLevel", "vocab": {{{vocab}}}, "unk_token": "<unk>"}}
        }}"##,
        added = added.join(", "),
        vocab = vocab.join(", ")
    )
}

/// A ChatML-like template over the test vocabulary: `<|user|> hi <|bot|> answer </s> `.
pub const TEMPLATE: &str = "{% for m in messages %}\n\
    {% if m.role == 'user' %}{{ '<|user|> ' + m.content + ' ' }}\
    {% else %}{{ '<|bot|> ' + m.content + ' ' + eos_token + ' ' }}{% endif %}\n\
    {% endfor %}\n\
    {% if add_generation_prompt %}{{ '<|bot|> ' }}{% endif %}";

/// Creates a fresh empty dir under the system temp dir, unique per call.
pub fn temp_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tallow-text-{}-{name}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A model dir with tokenizer.json and, if given, tokenizer_config.json.
pub fn model_dir(name: &str, tokenizer_config: Option<&str>) -> PathBuf {
    let dir = temp_dir(name);
    write(&dir, "tokenizer.json", &tokenizer_json());
    if let Some(cfg) = tokenizer_config {
        write(&dir, "tokenizer_config.json", cfg);
    }
    dir
}

/// Writes `text` to `dir/name`.
pub fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// tokenizer_config.json with `eos_token` `</s>` and [`TEMPLATE`].
pub fn chat_config() -> String {
    serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
        .to_string()
}
