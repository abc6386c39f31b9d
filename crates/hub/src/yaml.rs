//! Just enough YAML to read a dataset card's `configs:`: block mappings and sequences (a
//! sequence may sit at its key's indent, as the hub writes it), `- key: value` items, flow
//! lists `[a, "b"]`, plain / single- / double-quoted scalars, `true` / `false` / `null`, and
//! comments. Only the value of one top-level key is parsed, so anything else in the front
//! matter (block scalars, anchors, `dataset_info:`) is never looked at. Anything outside this
//! subset inside that value is an error that says so.

use serde_json::Value as Json;

/// A significant line: its indent and its text (comment removed, right-trimmed).
#[derive(Debug, Clone)]
struct Line {
    indent: usize,
    text: String,
}

/// `text` without a trailing ` # comment` (outside quotes).
fn strip_comment(text: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in text.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return &text[..i],
            _ => {}
        }
        prev = c;
    }
    text
}

fn lines(yaml: &str) -> Vec<Line> {
    yaml.lines()
        .filter_map(|l| {
            let stripped = strip_comment(l).trim_end();
            let text = stripped.trim_start();
            (!text.is_empty()).then(|| Line {
                indent: stripped.len() - text.len(),
                text: text.to_string(),
            })
        })
        .collect()
}

/// The value of `key` at the top level of `yaml`, `None` when there is no such key.
pub(crate) fn top_level_key(yaml: &str, key: &str) -> Result<Option<Json>, String> {
    let mut ls = lines(yaml);
    let prefix = format!("{key}:");
    let Some(start) = ls
        .iter()
        .position(|l| l.indent == 0 && l.text.starts_with(&prefix))
    else {
        return Ok(None);
    };
    // The key's block: up to the next top-level line that is not a sequence item.
    let end = ls[start + 1..]
        .iter()
        .position(|l| l.indent == 0 && !is_item(&l.text))
        .map_or(ls.len(), |p| start + 1 + p);
    let mut block: Vec<Line> = ls.drain(start..end).collect();
    let mut p = Parser { lines: &mut block };
    let (map, _) = p.mapping(0, 0)?;
    Ok(map.get(key).cloned())
}

fn is_item(text: &str) -> bool {
    text == "-" || text.starts_with("- ")
}

struct Parser<'a> {
    lines: &'a mut Vec<Line>,
}

impl Parser<'_> {
    /// The node starting at line `i` with indent `indent`; returns it and the next line.
    fn node(&mut self, i: usize, indent: usize) -> Result<(Json, usize), String> {
        if is_item(&self.lines[i].text) {
            self.sequence(i, indent)
        } else if split_key(&self.lines[i].text).is_some() {
            let (m, next) = self.mapping(i, indent)?;
            Ok((Json::Object(m), next))
        } else {
            Ok((scalar(&self.lines[i].text)?, i + 1))
        }
    }

    fn sequence(&mut self, mut i: usize, indent: usize) -> Result<(Json, usize), String> {
        let mut items = Vec::new();
        while i < self.lines.len() && self.lines[i].indent == indent && is_item(&self.lines[i].text)
        {
            let rest = self.lines[i].text[1..].trim_start().to_string();
            if rest.is_empty() {
                // "-" alone: the item is the indented block below.
                match self.lines.get(i + 1) {
                    Some(l) if l.indent > indent => {
                        let ind = l.indent;
                        let (v, next) = self.node(i + 1, ind)?;
                        items.push(v);
                        i = next;
                    }
                    _ => {
                        items.push(Json::Null);
                        i += 1;
                    }
                }
                continue;
            }
            // "- text": the text starts a node at the column it stands in.
            let col = indent + (self.lines[i].text.len() - rest.len());
            self.lines[i] = Line {
                indent: col,
                text: rest,
            };
            let (v, next) = self.node(i, col)?;
            items.push(v);
            i = next;
        }
        Ok((Json::Array(items), i))
    }

    fn mapping(
        &mut self,
        mut i: usize,
        indent: usize,
    ) -> Result<(serde_json::Map<String, Json>, usize), String> {
        let mut map = serde_json::Map::new();
        while i < self.lines.len() && self.lines[i].indent == indent {
            let text = self.lines[i].text.clone();
            if is_item(&text) {
                return Err(format!("unexpected list item `{text}` inside a mapping"));
            }
            let Some((k, v)) = split_key(&text) else {
                return Err(format!("expected `key: value`, found `{text}`"));
            };
            let key = match scalar(k)? {
                Json::String(s) => s,
                other => other.to_string(),
            };
            if !v.is_empty() {
                map.insert(key, scalar(v)?);
                i += 1;
                continue;
            }
            // "key:" then an indented block, or a sequence at the key's own indent.
            match self.lines.get(i + 1) {
                Some(l) if l.indent > indent || (l.indent == indent && is_item(&l.text)) => {
                    let ind = l.indent;
                    let (v, next) = self.node(i + 1, ind)?;
                    map.insert(key, v);
                    i = next;
                }
                _ => {
                    map.insert(key, Json::Null);
                    i += 1;
                }
            }
        }
        if let Some(l) = self.lines.get(i) {
            if l.indent > indent {
                return Err(format!("unexpected indentation at `{}`", l.text));
            }
        }
        Ok((map, i))
    }
}

/// `key: value` / `key:` (the key may be quoted); `None` when the text is not a mapping entry.
fn split_key(text: &str) -> Option<(&str, &str)> {
    let quoted_end = match text.chars().next() {
        Some(q @ ('"' | '\'')) => text[1..].find(q).map(|e| e + 2),
        _ => Some(0),
    }?;
    let colon = text[quoted_end..]
        .char_indices()
        .find(|&(j, c)| {
            c == ':'
                && text[quoted_end + j + 1..]
                    .chars()
                    .next()
                    .is_none_or(|n| n == ' ')
        })
        .map(|(j, _)| quoted_end + j)?;
    if text.starts_with('[') || text.starts_with('{') {
        return None;
    }
    Some((text[..colon].trim(), text[colon + 1..].trim()))
}

/// A scalar or a flow list.
fn scalar(text: &str) -> Result<Json, String> {
    let t = text.trim();
    if let Some(inner) = t.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| format!("unclosed flow list `{t}`"))?;
        return split_flow(inner)?
            .iter()
            .map(|s| scalar(s))
            .collect::<Result<Vec<_>, _>>()
            .map(Json::Array);
    }
    if t.starts_with('{') || t.starts_with('|') || t.starts_with('>') || t.starts_with('&') {
        return Err(format!(
            "`{t}`: flow mappings, block scalars and anchors are not read here"
        ));
    }
    if let Some(inner) = t.strip_prefix('"') {
        let inner = inner
            .strip_suffix('"')
            .ok_or_else(|| format!("unclosed quote in `{t}`"))?;
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c == '\\' {
                match chars.next() {
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some(c) => out.push(c),
                    None => {}
                }
            } else {
                out.push(c);
            }
        }
        return Ok(Json::String(out));
    }
    if let Some(inner) = t.strip_prefix('\'') {
        let inner = inner
            .strip_suffix('\'')
            .ok_or_else(|| format!("unclosed quote in `{t}`"))?;
        return Ok(Json::String(inner.replace("''", "'")));
    }
    Ok(match t {
        "true" | "True" | "TRUE" => Json::Bool(true),
        "false" | "False" | "FALSE" => Json::Bool(false),
        "null" | "Null" | "NULL" | "~" => Json::Null,
        _ => Json::String(t.to_string()),
    })
}

/// The items of a flow list body, split on commas outside quotes.
fn split_flow(body: &str) -> Result<Vec<String>, String> {
    let (mut out, mut cur) = (Vec::new(), String::new());
    let (mut single, mut double) = (false, false);
    for c in body.chars() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            ',' if !single && !double => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if single || double {
        return Err(format!("unclosed quote in `[{body}]`"));
    }
    out.push(cur);
    Ok(out
        .into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_shapes_cards_use() {
        let yaml = "license: mit\nconfigs:  # the configs\n- config_name: default\n  data_files:\n  \
                    - split: train\n    path: \"data/train-*\"\n  - split: test\n    path: [a.jsonl, \
                    'b c.jsonl']\n  default: true\n-   config_name: x\n    data_files:\n      - \
                    x/*.parquet\ndataset_info:\n  description: |\n    anything: [ here\n";
        let v = top_level_key(yaml, "configs").unwrap().unwrap();
        assert_eq!(
            v,
            json!([
                {"config_name": "default", "data_files": [
                    {"split": "train", "path": "data/train-*"},
                    {"split": "test", "path": ["a.jsonl", "b c.jsonl"]},
                ], "default": true},
                {"config_name": "x", "data_files": ["x/*.parquet"]},
            ])
        );
        assert_eq!(top_level_key(yaml, "tags").unwrap(), None);
        assert!(top_level_key("configs:\n- config_name: a\n   bad: 1\n", "configs").is_err());
    }
}
