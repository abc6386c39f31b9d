//! Reading a config: TOML text -> `toml::Table` (keys checked) -> each `--set` applied -> each
//! section's keys read into it over its defaults (a value of the wrong type is an error naming
//! the key and the type it must have) -> the required keys present -> [`TrainConfig`] ->
//! [`TrainConfig::validate`].

use toml::{Table, Value};

use super::error::WrongType;
use super::keys::{check_keys, key_kind, section_keys, section_list, valid_keys, SECTIONS};
use super::section::{Kind, Section};
use super::suggest::{closest, normalize, suggest_anywhere, suggest_key, suggest_section};
use super::{ConfigError, TrainConfig};

/// [`TrainConfig::from_toml_str`]: parse, check keys, apply `sets`, read, validate.
pub(super) fn from_toml_str(
    text: &str,
    origin: &str,
    sets: &[String],
) -> Result<TrainConfig, ConfigError> {
    let mut table: Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
    check_keys(&table, origin)?;

    // Which `--set` wrote each key, for error messages about values.
    let mut set_by: Vec<(String, String)> = Vec::new();
    for set in sets {
        let key = apply_set(&mut table, origin, set)?;
        set_by.retain(|(k, _)| *k != key);
        set_by.push((key, set.clone()));
    }
    let set_of = |key: &str| {
        set_by
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, s)| s.clone())
    };

    let config = TrainConfig {
        model: section(&table, origin, &set_of)?,
        lora: section(&table, origin, &set_of)?,
        data: section(&table, origin, &set_of)?,
        train: section(&table, origin, &set_of)?,
        preference: section(&table, origin, &set_of)?,
    };
    check_required(&table, origin)?;
    config.validate().map_err(|invalid| ConfigError::Invalid {
        origin: origin.to_string(),
        set: set_of(invalid.key),
        invalid,
    })?;
    Ok(config)
}

/// Applies one `--set section.key=value` to `table`; returns `section.key`.
fn apply_set(table: &mut Table, origin: &str, set: &str) -> Result<String, ConfigError> {
    let bad = |message: String| ConfigError::BadSet {
        origin: origin.to_string(),
        set: set.to_string(),
        message,
    };
    let Some((path, text)) = set.split_once('=') else {
        return Err(bad(
            "expected section.key=value, e.g. --set train.lr=1e-3".into()
        ));
    };
    let (path, text) = (path.trim(), text.trim());
    let Some((section, key)) = path.split_once('.') else {
        if section_keys(path).is_some() {
            return Err(bad(format!(
                "`{path}` is a section: write {path}.KEY=value with KEY one of {}",
                valid_keys(path)
            )));
        }
        let hint = suggest_anywhere(&normalize(path))
            .map(|s| format!(", e.g. `{s}`"))
            .unwrap_or_default();
        return Err(bad(format!(
            "`{path}` needs its section: write section.key=value{hint}; sections: {}",
            section_list()
        )));
    };
    if section_keys(section).is_none() {
        return Err(ConfigError::UnknownSection {
            origin: origin.to_string(),
            set: Some(set.to_string()),
            section: section.to_string(),
            suggestion: suggest_section(section),
        });
    }
    let Some(kind) = key_kind(section, key) else {
        return Err(ConfigError::UnknownKey {
            origin: origin.to_string(),
            set: Some(set.to_string()),
            section: section.to_string(),
            key: key.to_string(),
            suggestion: suggest_key(section, key),
        });
    };
    let value = set_value(text, kind);
    let sec = table
        .entry(section.to_string())
        .or_insert_with(|| Value::Table(Table::new()));
    match sec {
        Value::Table(sec) => {
            sec.insert(key.to_string(), value);
        }
        // `check_keys` already rejected a known section that is not a table.
        _ => unreachable!("section `{section}` is a table"),
    }
    Ok(format!("{section}.{key}"))
}

/// The TOML value of a `--set` value: parsed as TOML where it parses, else the text as a string.
/// String keys take the text as written unless it is a quoted TOML string, so
/// `model.path=2024` or `train.device=cuda:1` mean what they say.
fn set_value(text: &str, kind: Kind) -> Value {
    let parsed = text.parse::<Value>().ok();
    match (kind, parsed) {
        (Kind::Str | Kind::Choice(_), Some(Value::String(s))) => Value::String(s),
        (Kind::Str | Kind::Choice(_), _) => Value::String(text.to_string()),
        (_, Some(v)) => v,
        (_, None) => Value::String(text.to_string()),
    }
}

/// Reads one section: its defaults, then each key the table gives (absent: all defaults). A
/// value that is not of its key's type is an error naming the key.
fn section<T: Section>(
    table: &Table,
    origin: &str,
    set_of: &dyn Fn(&str) -> Option<String>,
) -> Result<T, ConfigError> {
    let mut section = T::defaults();
    let Some(Value::Table(sec)) = table.get(T::NAME) else {
        return Ok(section);
    };
    for (key, value) in sec {
        if section.set(key, value) {
            continue;
        }
        let kind = key_kind(T::NAME, key).expect("check_keys passed");
        let suggestion = match (kind, value) {
            (Kind::Choice(names), Value::String(s)) => {
                closest(&normalize(s), names.iter().copied()).map(str::to_string)
            }
            (Kind::Choices(names), Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .find(|s| !names.contains(s))
                .and_then(|s| closest(&normalize(s), names.iter().copied()))
                .map(str::to_string),
            _ => None,
        };
        let full = format!("{}.{key}", T::NAME);
        return Err(ConfigError::WrongType(Box::new(WrongType {
            origin: origin.to_string(),
            set: set_of(&full),
            key: full,
            expected: kind.expected(),
            found: describe(value),
            suggestion,
        })));
    }
    Ok(section)
}

/// The required keys (`model.path`, `data.train`): each must be in the file or a `--set`.
fn check_required(table: &Table, origin: &str) -> Result<(), ConfigError> {
    for (section, keys) in SECTIONS {
        for key in keys {
            let Some(hint) = key.required else { continue };
            let given = table
                .get(section)
                .and_then(Value::as_table)
                .is_some_and(|sec| sec.contains_key(key.name));
            if !given {
                return Err(ConfigError::Missing {
                    origin: origin.to_string(),
                    key: key.full,
                    hint,
                });
            }
        }
    }
    Ok(())
}

/// A TOML value as the error messages name it: `the string "x"`, `the integer 3`.
fn describe(value: &Value) -> String {
    match value {
        Value::String(_) => format!("the string {value}"),
        Value::Integer(_) => format!("the integer {value}"),
        Value::Float(_) => format!("the number {value}"),
        Value::Boolean(_) => format!("{value}"),
        Value::Datetime(_) => format!("the date {value}"),
        Value::Array(_) => format!("the list {value}"),
        Value::Table(_) => "a table".into(),
    }
}
