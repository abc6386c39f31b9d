//! "Did you mean ...?": the nearest valid name to an unknown section, key or value, by edit
//! distance, after trying spelling variants (`max-seq-len`, `LR`) and other trainers' names
//! (`learning_rate`, see `keys::ALIASES`).

use super::keys::{section_keys, ALIASES, SECTIONS, SECTION_ALIASES};

/// Edit distance counting insertions, deletions, substitutions and swaps of two neighbours
/// (`rnak` -> `rank` is 1): the optimal-string-alignment variant of Damerau-Levenshtein.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j] = distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, x) in d[0].iter_mut().enumerate() {
        *x = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The candidate nearest to `word`, if it is near enough to be a typo (at most a third of the
/// word's length away, and at least 1).
pub(super) fn closest<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// A name as our keys spell it: trimmed, lower case, `_` for `-`.
pub(super) fn normalize(word: &str) -> String {
    word.trim().to_ascii_lowercase().replace('-', "_")
}

/// A suggestion for the unknown key `section.key` (section known), as `section.key`.
pub(super) fn suggest_key(section: &str, key: &str) -> Option<String> {
    let norm = normalize(key);
    let own = section_keys(section).unwrap_or_default();
    // Spelling variants of one of our keys (`max-seq-len`, `LR`).
    if own.iter().any(|k| k.name == norm) {
        return Some(format!("{section}.{norm}"));
    }
    // Another trainer's name for it (`learning_rate`).
    if let Some((_, full)) = ALIASES.iter().find(|(alias, _)| *alias == norm) {
        return Some(full.to_string());
    }
    // A typo of a key of this section.
    if let Some(k) = closest(&norm, own.iter().map(|k| k.name)) {
        return Some(format!("{section}.{k}"));
    }
    // A key of another section (`lora.lr`), or a typo of one.
    suggest_anywhere(&norm)
}

/// The section-qualified key nearest to `key` (already normalized), over every section.
pub(super) fn suggest_anywhere(key: &str) -> Option<String> {
    let all = SECTIONS
        .iter()
        .flat_map(|(s, keys)| keys.iter().map(move |k| (*s, k.name)));
    if let Some((s, k)) = all.clone().find(|(_, k)| *k == key) {
        return Some(format!("{s}.{k}"));
    }
    if let Some((_, full)) = ALIASES.iter().find(|(alias, _)| *alias == key) {
        return Some(full.to_string());
    }
    let limit = (key.chars().count() / 3).max(1);
    all.map(|(s, k)| (edit_distance(key, k), s, k))
        .filter(|&(d, _, _)| d <= limit)
        .min_by_key(|&(d, _, _)| d)
        .map(|(_, s, k)| format!("{s}.{k}"))
}

/// A suggestion for an unknown section name, as `[section]`.
pub(super) fn suggest_section(name: &str) -> Option<String> {
    let norm = normalize(name);
    if let Some((s, _)) = SECTIONS.iter().find(|(s, _)| *s == norm) {
        return Some(format!("[{s}]"));
    }
    if let Some((_, s)) = SECTION_ALIASES.iter().find(|(alias, _)| *alias == norm) {
        return Some(format!("[{s}]"));
    }
    closest(&norm, SECTIONS.iter().map(|(s, _)| *s)).map(|s| format!("[{s}]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distances() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("rnak", "rank"), 1);
        assert_eq!(edit_distance("epoch", "epochs"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(closest("epoch", ["epochs", "eps"]), Some("epochs"));
        assert_eq!(closest("zzzz", ["epochs", "eps"]), None);
    }

    #[test]
    fn suggestions() {
        assert_eq!(
            suggest_key("train", "Learning-Rate").as_deref(),
            Some("train.lr")
        );
        assert_eq!(
            suggest_key("data", "max-seq-len").as_deref(),
            Some("data.max_seq_len")
        );
        assert_eq!(suggest_key("lora", "lr").as_deref(), Some("train.lr"));
        assert_eq!(suggest_anywhere("seed").as_deref(), Some("train.seed"));
        assert_eq!(suggest_section("Training").as_deref(), Some("[train]"));
        assert_eq!(suggest_section("mdoel").as_deref(), Some("[model]"));
        assert_eq!(suggest_section("zzzzzz"), None);
    }
}
