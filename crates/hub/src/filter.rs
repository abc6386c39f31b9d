//! Which files of a repo to download: include / exclude globs, as huggingface_hub's
//! `allow_patterns` / `ignore_patterns` (fnmatch: `*` also matches `/`).

use std::fmt;

/// What training needs from a model repo: config, tokenizer files, safetensors (+ index),
/// generation config, chat template. Top-level files only, so `original/` and `onnx/` copies
/// are left out.
const DEFAULT_INCLUDE: [&str; 6] = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "merges.txt",
    "vocab.txt",
];
/// Weight duplicates in other formats.
const DEFAULT_EXCLUDE: [&str; 6] = ["*.bin", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.h5"];

/// Include / exclude globs. A file is selected when it matches an include and no exclude.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    /// Only files at the repo's top level (the default set).
    pub top_level_only: bool,
}

impl Default for Filter {
    fn default() -> Self {
        Filter {
            include: DEFAULT_INCLUDE.iter().map(|s| s.to_string()).collect(),
            exclude: DEFAULT_EXCLUDE.iter().map(|s| s.to_string()).collect(),
            top_level_only: true,
        }
    }
}

impl Filter {
    /// `--include` replaces the default set (`--include '*'` takes every file); `--exclude`
    /// removes from whichever set is used.
    pub fn new(include: Vec<String>, exclude: Vec<String>) -> Filter {
        let mut f = if include.is_empty() {
            Filter::default()
        } else {
            Filter {
                include,
                exclude: vec![],
                top_level_only: false,
            }
        };
        f.exclude.extend(exclude);
        f
    }

    pub fn matches(&self, path: &str) -> bool {
        if self.top_level_only && path.contains('/') {
            return false;
        }
        self.include.iter().any(|g| glob(g, path)) && !self.exclude.iter().any(|g| glob(g, path))
    }
}

impl fmt::Display for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "include [{}]", self.include.join(", "))?;
        if self.top_level_only {
            f.write_str(" (top level)")?;
        }
        if !self.exclude.is_empty() {
            write!(f, " exclude [{}]", self.exclude.join(", "))?;
        }
        Ok(())
    }
}

/// fnmatch-style match of the whole `text`: `*` any run of characters (`/` included), `?` one
/// character; everything else literal.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with backtracking to the last `*`.
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("*.json", "config.json"));
        assert!(glob("*.json", "onnx/config.json"));
        assert!(glob("original/*", "original/params.json"));
        assert!(glob(
            "model-?????-of-*.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(!glob("*.json", "config.json.bak"));
        assert!(glob("*", ""));
        assert!(!glob("a*b", "ac"));
    }

    #[test]
    fn default_set() {
        let f = Filter::default();
        for yes in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "model.safetensors",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "chat_template.jinja",
        ] {
            assert!(f.matches(yes), "{yes}");
        }
        for no in [
            "pytorch_model.bin",
            "original/consolidated.00.pth",
            "original/params.json",
            "README.md",
            "onnx/model.onnx",
        ] {
            assert!(!f.matches(no), "{no}");
        }
        let f = Filter::new(vec!["*".into()], vec!["*.bin".into()]);
        assert!(f.matches("original/params.json") && !f.matches("pytorch_model.bin"));
    }
}
