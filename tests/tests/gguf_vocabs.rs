//! GGUF tokenizers on real vocabularies: llama.cpp's own tokenizer test files
//! (`models/ggml-vocab-*.gguf`, the vocabularies of GPT-2, Llama 3, Qwen 2 / 3.5, Falcon,
//! StarCoder, ... without weights; `.inp` texts and the `.out` ids llama.cpp gives them).
//!
//! Ignored by default: the files (6-16 MB each) come from llama-cpp-python's source archive on
//! PyPI (76 MB), which `python3 scripts/make_gguf_fixtures.py vocabs` downloads, checks and
//! unpacks, printing the dir:
//!
//!     TALLOW_LLAMA_CPP_VOCABS=$(python3 scripts/make_gguf_fixtures.py vocabs) \
//!       cargo test -p tallow-tests --test gguf_vocabs -- --ignored
//!
//! tallow builds the tokenizer transformers 5 builds from a GGUF (tests/tests/gguf.rs checks
//! that on the fixtures; on these files it gave transformers 5's ids for every text of every
//! vocabulary transformers loads, 2026-11-28, docs/gguf.md). Where transformers and llama.cpp
//! differ (Llama 3's `ignore_merges`, a pre-tokenizer transformers does not know, SentencePiece's
//! spaces), so does tallow: the counts below are today's agreements with llama.cpp, which the
//! test holds.

use std::path::PathBuf;

use tallow_model::io::gguf::{tokenizer::hf_tokenizer, GgufFile};
use tallow_tests::scratch;
use tallow_text::TextTokenizer;

/// (vocabulary, texts whose ids equal llama.cpp's, texts)
const AGREEMENT: [(&str, usize, usize); 13] = [
    ("command-r", 45, 46),
    ("deepseek-coder", 45, 46),
    ("deepseek-llm", 45, 46),
    ("falcon", 37, 46),
    ("gpt-2", 46, 46),
    ("llama-bpe", 45, 46),
    ("llama-spm", 31, 46),
    ("mpt", 41, 46),
    ("phi-3", 46, 46),
    ("qwen2", 46, 46),
    ("qwen35", 50, 50),
    ("refact", 45, 46),
    ("starcoder", 45, 46),
];

/// Refused by name (Gemma 4's SentencePiece variant, `tokenizer.ggml.model` = "gemma4"; BERT
/// vocabularies). Phi-3's real vocabulary agrees with llama.cpp on all 46 texts (and transformers 5
/// gives the same 46, checked once with `AutoTokenizer.from_pretrained(..., gguf_file=...)`).
const REFUSED: [&str; 3] = ["bert-bge", "gemma-4", "nomic-bert-moe"];

#[test]
#[ignore = "needs llama.cpp's vocabulary files: see the module doc"]
fn byte_level_vocabularies_tokenize_as_recorded() {
    let root =
        PathBuf::from(std::env::var("TALLOW_LLAMA_CPP_VOCABS").expect(
            "TALLOW_LLAMA_CPP_VOCABS: the dir `scripts/make_gguf_fixtures.py vocabs` prints",
        ));
    let tmp = scratch("gguf-vocabs");
    for (name, agree, texts) in AGREEMENT {
        let path = root.join(format!("ggml-vocab-{name}.gguf"));
        let (tok, config) = hf_tokenizer(&GgufFile::open(&path).unwrap()).unwrap();
        let dir = tmp.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = TextTokenizer::from_model_dir(&dir).unwrap();
        let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
        let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
        let (mut n, mut same) = (0, 0);
        for (text, ids) in inp
            .split("\n__ggml_vocab_test__\n")
            .zip(out.trim_end().lines())
        {
            let want: Vec<u32> = ids.split_whitespace().map(|x| x.parse().unwrap()).collect();
            n += 1;
            same += (tok.encode(text, false).unwrap() == want) as usize;
        }
        assert_eq!(
            (same, n),
            (agree, texts),
            "{name}: agreements with llama.cpp"
        );
    }
    for name in REFUSED {
        let path = root.join(format!("ggml-vocab-{name}.gguf"));
        let e = hf_tokenizer(&GgufFile::open(&path).unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("tokenizer.ggml.model"),
            "{name}: {e}"
        );
    }
}
