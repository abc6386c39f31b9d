//! Every config under `configs/` parses and validates, starts with the command that runs it, and
//! is listed in `configs/README.md`: configs are code (torchtune's rule), so a broken one fails CI.

use std::path::{Path, PathBuf};
use tallow_trainer::TrainConfig;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Every `*.toml` under `dir`, recursively, sorted.
fn toml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            toml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "toml") {
            out.push(path);
        }
    }
    out.sort();
}

/// `configs/a/b.toml`, with `/` on every platform.
fn repo_relative(path: &Path) -> String {
    let rel = path.strip_prefix(repo_root()).unwrap();
    let parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    parts.join("/")
}

/// The path after `tallow train --config` on the first line, if that line is such a comment.
fn command_path(first_line: &str) -> Option<&str> {
    let comment = first_line.strip_prefix('#')?;
    let (_, rest) = comment.split_once("tallow train --config ")?;
    rest.split_whitespace().next()
}

#[test]
fn every_config_parses_validates_and_starts_with_its_command() {
    let mut files = Vec::new();
    toml_files(&repo_root().join("configs"), &mut files);
    assert!(
        files.len() >= 6,
        "expected the shipped configs under configs/, found {files:?}"
    );

    let readme = std::fs::read_to_string(repo_root().join("configs/README.md")).unwrap();
    let mut failures = Vec::new();
    for path in &files {
        let rel = repo_relative(path);
        match TrainConfig::load(path, &[]) {
            Ok(config) => {
                // What a run records must load back to the same config.
                let resolved = config.to_toml_string();
                match TrainConfig::from_toml_str(&resolved, &rel, &[]) {
                    Ok(back) if back == config => {}
                    Ok(_) => failures.push(format!("{rel}: to_toml_string does not round-trip")),
                    Err(e) => failures.push(format!("{rel}: resolved config: {e}")),
                }
            }
            Err(e) => failures.push(e.to_string()),
        }

        let text = std::fs::read_to_string(path).unwrap();
        let first = text.lines().next().unwrap_or_default();
        if command_path(first) != Some(rel.as_str()) {
            failures.push(format!(
                "{rel}: the first line must be `# tallow train --config {rel}`, found {first:?}"
            ));
        }
        if !readme.contains(&format!("`{rel}`")) {
            failures.push(format!("{rel}: not listed in configs/README.md"));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn command_path_reads_the_first_line() {
    assert_eq!(
        command_path("# tallow train --config configs/a/b.toml"),
        Some("configs/a/b.toml")
    );
    assert_eq!(
        command_path("#   tallow train --config configs/a.toml --set train.lr=1"),
        Some("configs/a.toml")
    );
    assert_eq!(command_path("tallow train --config configs/a.toml"), None);
    assert_eq!(command_path("# tallow eval --model m"), None);
}

/// An override on top of a shipped config, as `tallow train --config ... --set ...` does it.
#[test]
fn set_applies_on_top_of_a_shipped_config() {
    let path = repo_root().join("configs/qwen2.5-0.5b/lora.toml");
    let sets = [
        "train.lr=1e-3".to_string(),
        "train.max_steps=50".to_string(),
        "train.tf32=false".to_string(),
    ];
    let config = TrainConfig::load(&path, &sets).unwrap();
    assert_eq!((config.train.lr, config.train.max_steps), (1e-3, 50));
    assert!(!config.train.tf32);
    assert!(
        TrainConfig::load(&path, &[]).unwrap().train.tf32,
        "on by default"
    );

    let bad = ["train.learning_rate=1e-3".to_string()];
    let err = TrainConfig::load(&path, &bad).unwrap_err().to_string();
    assert!(err.contains("lora.toml"), "{err}");
    assert!(err.contains("--set `train.learning_rate=1e-3`"), "{err}");
    assert!(err.contains("did you mean `train.lr`?"), "{err}");
}

#[test]
fn a_missing_file_is_an_error_naming_it() {
    let err = TrainConfig::load(Path::new("configs/no-such.toml"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("configs/no-such.toml"), "{err}");
}

/// The memory column of `configs/README.md` is what `tallow estimate` says (on CUDA, from the
/// real models' config.json kept in `benchmarks/models/`), so the docs cannot drift from it.
#[test]
fn readme_memory_column_matches_the_estimate() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("configs/README.md")).unwrap();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for line in readme.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with("`configs/") || !cells[3].ends_with("GiB") {
            continue;
        }
        let file = cells[1].trim_matches('`');
        let cfg = TrainConfig::load(&root.join(file), &[]).unwrap();
        let repo = cfg.model.path.to_string_lossy().to_string();
        let name = repo.rsplit('/').next().unwrap().to_lowercase();
        let json = root.join(format!("benchmarks/models/{name}.json"));
        let text =
            std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}", json.display()));
        let model = tallow_model::DecoderConfig::from_json_str(&text, &json).unwrap();
        let est = tallow_trainer::estimate::estimate(&model, &cfg, "cuda");
        let gib = format!("{:.1} GiB", est.total_bytes as f64 / (1u64 << 30) as f64);
        if cells[3] != gib {
            wrong.push(format!("{file}: README says {}, estimate {gib}", cells[3]));
        }
        checked += 1;
    }
    // All rows at once, so one run says everything to update in configs/README.md.
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(checked >= 9, "only {checked} rows with a memory figure");
}
