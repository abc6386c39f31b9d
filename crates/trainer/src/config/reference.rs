//! docs/config.md's key tables, written from the declarations in `sections.rs`: one table per
//! section (key, TOML type, default, the key's doc comment), between the lines
//! `<!-- keys of [SECTION] ... -->` and `<!-- end of keys -->`; the prose around them is the
//! doc's own. `config_reference_matches_the_declarations` fails when the committed doc differs
//! and prints the diff; `TALLOW_UPDATE_DOCS=1 cargo test -p tallow-trainer --lib
//! config_reference` writes the tables.

use toml::Value;

use super::keys::SECTIONS;
use super::section::{Key, Kind};
use super::TrainConfig;

const UPDATE: &str = "TALLOW_UPDATE_DOCS=1 cargo test -p tallow-trainer --lib config_reference";
const END: &str = "<!-- end of keys -->";

/// The line that starts the table of `section`.
fn start_marker(section: &str) -> String {
    format!(
        "<!-- keys of [{section}], written from crates/trainer/src/config/sections.rs: edit \
         there, then run {UPDATE} -->"
    )
}

/// The TOML type of a key, for the type column.
fn type_name(kind: Kind) -> String {
    match kind {
        Kind::Str => "string".into(),
        Kind::Uint => "integer".into(),
        Kind::Float => "number".into(),
        Kind::Bool => "bool".into(),
        Kind::Pair => "[number, number]".into(),
        Kind::Targets => "`\"all-linear\"` or list of strings".into(),
        Kind::Choice(names) => names.join(" \\| "),
        Kind::Choices(names) => format!("list of {}", names.join(" \\| ")),
        Kind::Strs => "list of strings".into(),
    }
}

/// A default as TOML, in backticks; a long string is cut, a small number written `2e-4`.
fn default_cell(value: &Value) -> String {
    const LONG: usize = 24;
    let text = match value {
        Value::String(s) if s.chars().count() > LONG => {
            let head: String = s.chars().take(LONG).collect();
            format!("\"{head}…\"")
        }
        Value::Float(x) if *x != 0.0 && x.abs() < 1e-3 => format!("{x:e}"),
        v => v.to_string(),
    };
    format!("`{text}`")
}

/// The table of one section.
fn table(keys: &[Key], defaults: &toml::Table) -> String {
    let mut out = String::from("| key | type | default | meaning |\n| --- | --- | --- | --- |\n");
    for key in keys {
        let default = match key.required {
            Some(_) => "required".to_string(),
            None => default_cell(defaults.get(key.name).expect("every key is written")),
        };
        let doc: Vec<&str> = key.doc.iter().map(|line| line.trim()).collect();
        out += &format!(
            "| `{}` | {} | {default} | {} |\n",
            key.full,
            type_name(key.kind),
            doc.join(" ").replace('|', "\\|")
        );
    }
    out
}

/// `doc` with each section's table written from the declarations; `Err` names a missing
/// marker.
fn with_tables(doc: &str) -> Result<String, String> {
    let resolved = Value::try_from(TrainConfig::new("m", "t")).expect("defaults are TOML");
    let mut out = String::new();
    let mut rest = doc;
    for (section, keys) in SECTIONS {
        let start = start_marker(section);
        let Some(at) = rest.find(&format!("{start}\n")) else {
            return Err(format!(
                "docs/config.md lacks the line that starts the table of [{section}] (in the \
                 order of the sections):\n{start}\nAdd it and a line {END} where the table goes, \
                 then run {UPDATE}"
            ));
        };
        let body = at + start.len() + 1;
        let Some(len) = rest[body..].find(&format!("{END}\n")) else {
            return Err(format!(
                "docs/config.md: no {END} after the [{section}] marker"
            ));
        };
        let defaults = resolved[section].as_table().expect("a section is a table");
        out += &rest[..body];
        out += &table(keys, defaults);
        rest = &rest[body + len..];
    }
    out += rest;
    Ok(out)
}

/// The lines only in `a` (`-`) and only in `b` (`+`), in order, by longest common subsequence.
fn diff(a: &str, b: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            (i, j) = (i + 1, j + 1);
        } else if j == b.len() || (i < a.len() && lcs[i + 1][j] >= lcs[i][j + 1]) {
            out += &format!("-{}\n", a[i]);
            i += 1;
        } else {
            out += &format!("+{}\n", b[j]);
            j += 1;
        }
    }
    out
}

/// docs/config.md's key tables are the declarations': a key added, changed or dropped in
/// `sections.rs` without its row fails here.
#[test]
fn config_reference_matches_the_declarations() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/config.md");
    let committed = std::fs::read_to_string(path).unwrap();
    let written = with_tables(&committed).unwrap_or_else(|e| panic!("{e}"));
    if written == committed {
        return;
    }
    if std::env::var_os("TALLOW_UPDATE_DOCS").is_some() {
        std::fs::write(path, &written).unwrap();
        return;
    }
    panic!(
        "docs/config.md's key tables are not those of the declarations in \
         crates/trainer/src/config/sections.rs (- the doc, + the declarations):\n{}\nWrite \
         them: {UPDATE}",
        diff(&committed, &written)
    );
}

#[test]
fn diffs() {
    assert_eq!(diff("a\nb\nc\n", "a\nc\nd\n"), "-b\n+d\n");
    assert_eq!(diff("", "x\n"), "+x\n");
    assert_eq!(diff("x\n", "x\n"), "");
}

#[test]
fn cells() {
    assert_eq!(type_name(Kind::Choice(&["a", "b"])), "a \\| b");
    assert_eq!(default_cell(&Value::Integer(16)), "`16`");
    assert_eq!(default_cell(&Value::Float(2e-4)), "`2e-4`");
    assert_eq!(default_cell(&Value::Float(0.05)), "`0.05`");
    assert_eq!(default_cell(&Value::String("auto".into())), "`\"auto\"`");
    assert_eq!(
        default_cell(&Value::String("x".repeat(30))),
        format!("`\"{}…\"`", "x".repeat(24))
    );
}
