//! The model crate's rooms import only downward (docs/architecture.md): each `crate::` path in
//! a file's code (comments and `#[cfg(test)]` modules left out) must name a room below the
//! file's own, or the same room, and the files' import graph has no cycle.
//!
//! The rooms, bottom to top: the error type; file I/O; the checked model config (and its layout
//! and key rules); the families that build it; the kernels; the quantized-checkpoint formats;
//! the layers' building blocks (`nn`); the decoder; the adapters (`peft`); generation; the one
//! load of a model dir; the crate root's re-exports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOMS: &[&str] = &[
    "error", "io", "config", "families", "kernels", "quant", "nn", "decoder", "peft", "generate",
    "load", "lib",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every .rs file under src/, relative ("nn/linear.rs").
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p.strip_prefix(src()).unwrap().to_path_buf());
        }
    }
}

/// A file's room: its folder, or the file itself at the top ("error", "load", "lib").
fn room(file: &Path) -> String {
    let first = file
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The code of a file: line comments and `#[cfg(test)] mod ... { ... }` blocks removed.
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        // the item after the attribute: a module (skip its braces) or anything else (keep)
        let item = after["#[cfg(test)]".len()..].trim_start();
        // a test module shared with other test modules is `pub(crate)`: still test code
        let item = ["pub(crate) ", "pub "]
            .iter()
            .find_map(|v| item.strip_prefix(v))
            .unwrap_or(item);
        if !item.starts_with("mod ") {
            out.push_str("#[cfg(test)]");
            rest = &after["#[cfg(test)]".len()..];
            continue;
        }
        let open = after.find('{').unwrap();
        let mut depth = 0;
        let mut end = after.len();
        for (j, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module file a path of `crate::` segments names: the longest prefix that is a file.
fn resolve(segments: &[&str]) -> Option<PathBuf> {
    for n in (1..=segments.len()).rev() {
        let base: PathBuf = segments[..n].iter().collect();
        for cand in [base.with_extension("rs"), base.join("mod.rs")] {
            if src().join(&cand).is_file() {
                return Some(cand);
            }
        }
    }
    None
}

/// The module path of a file (["nn", "linear"] for nn/linear.rs; ["nn"] for nn/mod.rs).
fn module_of(file: &Path) -> Vec<String> {
    let mut parts: Vec<String> = file
        .components()
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string()
        })
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Every file a file's code names, through `crate::` and `super::` paths.
fn imports(file: &Path) -> BTreeSet<PathBuf> {
    let text = code(&std::fs::read_to_string(src().join(file)).unwrap());
    let mut out = BTreeSet::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    for (prefix, base) in [
        ("crate::", Vec::new()),
        ("super::", {
            let mut m = module_of(file);
            m.pop();
            m
        }),
    ] {
        let mut rest = text.as_str();
        while let Some(i) = rest.find(prefix) {
            let before = rest[..i].chars().last();
            rest = &rest[i + prefix.len()..];
            if before.is_some_and(|c| ident(c) || c == ':') {
                continue; // `self::super::`, `tallow_crate::` ...
            }
            let path: String = rest
                .chars()
                .take_while(|c| ident(*c) || *c == ':')
                .collect();
            let mut segs: Vec<&str> = base.iter().map(String::as_str).collect();
            segs.extend(path.split("::").filter(|s| !s.is_empty() && *s != "{"));
            if let Some(target) = resolve(&segs) {
                if target != file {
                    out.insert(target);
                }
            }
        }
    }
    out
}

#[test]
fn rooms_import_only_downward_and_files_have_no_cycle() {
    let mut all = Vec::new();
    files(&src(), &mut all);
    all.sort();
    let rank = |r: &str| {
        ROOMS
            .iter()
            .position(|x| *x == r)
            .unwrap_or_else(|| panic!("room `{r}` is not in ROOMS"))
    };
    let mut upward = Vec::new();
    let mut graph: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for f in &all {
        let deps = imports(f);
        for d in &deps {
            if room(f) != "lib" && rank(&room(d)) > rank(&room(f)) {
                upward.push(format!("{} -> {}", f.display(), d.display()));
            }
        }
        graph.insert(f.clone(), deps);
    }
    assert!(
        upward.is_empty(),
        "imports from a room above:\n{}",
        upward.join("\n")
    );
    // No cycle among the files (depth-first search, reporting the first cycle found).
    fn visit(
        f: &PathBuf,
        graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        state: &mut BTreeMap<PathBuf, u8>,
        stack: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        match state.get(f) {
            Some(2) => return None,
            Some(1) => {
                let i = stack.iter().position(|x| x == f).unwrap();
                let mut cycle = stack[i..].to_vec();
                cycle.push(f.clone());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(f.clone(), 1);
        stack.push(f.clone());
        for d in graph.get(f).into_iter().flatten() {
            if let Some(c) = visit(d, graph, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(f.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for f in graph.keys() {
        if room(f) == "lib" {
            continue; // the root names every room (mod lines, re-exports)
        }
        if let Some(c) = visit(f, &graph, &mut state, &mut Vec::new()) {
            let names: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
            panic!("import cycle: {}", names.join(" -> "));
        }
    }
}
