//! How a section of the config is declared: [`section!`] takes each key once (its doc line,
//! name, Rust type, default and, where it has one, its check) and writes from it the section
//! struct, its defaults, its rows of the key table ([`Key`]), how a TOML value is read into the
//! key and written back, and the check. What a key's Rust type is in TOML (its [`Kind`], `""`
//! for "not set") is that type's [`KeyType`]. The declarations themselves are in `sections.rs`.

use std::path::PathBuf;

use toml::Value;

use super::choice::quoted;
use super::{AdapterKind, InvalidValue, LogSink, LoraTargets, ALL_LINEAR};

/// The TOML type a key takes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Str,
    Uint,
    Float,
    Bool,
    /// Two floats.
    Pair,
    /// `"all-linear"` or a list of strings.
    Targets,
    /// One of these strings: an enum's `NAMES`.
    Choice(&'static [&'static str]),
    /// A list of these strings.
    Choices(&'static [&'static str]),
    /// A list of strings.
    Strs,
}

impl Kind {
    /// What a value of this kind must be, after "must be".
    pub(super) fn expected(self) -> String {
        match self {
            Kind::Str => "a string".into(),
            Kind::Uint => "a whole number >= 0".into(),
            Kind::Float => "a number".into(),
            Kind::Bool => "true or false".into(),
            Kind::Pair => "a list of two numbers, e.g. [0.9, 0.999]".into(),
            Kind::Targets => {
                format!("\"{ALL_LINEAR}\" or a list of module names, e.g. [\"q_proj\", \"v_proj\"]")
            }
            Kind::Choice(names) => format!("one of {}", quoted(names)),
            Kind::Choices(names) => format!("a list of {}", quoted(names)),
            Kind::Strs => "a list of strings, e.g. [\"is_llama_config\"]".into(),
        }
    }
}

/// One key of a section: a row of the key table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Key {
    /// `rank`.
    pub name: &'static str,
    /// `lora.rank`.
    pub full: &'static str,
    pub kind: Kind,
    /// The key's doc comment, line by line: its row in docs/config.md (`reference.rs`, a test,
    /// writes the rows).
    #[cfg_attr(not(test), allow(dead_code))]
    pub doc: &'static [&'static str],
    /// For a required key, what the message about its absence tells the user to write.
    pub required: Option<&'static str>,
}

/// A section of the config, as [`section!`] writes it.
pub(super) trait Section: Sized + serde::Serialize {
    /// `lora`.
    const NAME: &'static str;
    /// The keys, in the order they are declared and written.
    const KEYS: &'static [Key];

    /// Every key at its default (a required key at a placeholder: it must be set).
    fn defaults() -> Self;

    /// Sets `key`, one of [`Self::KEYS`], to `value`; false when the value is not of the key's
    /// type.
    fn set(&mut self, key: &str, value: &Value) -> bool;

    /// The checks declared on the keys, in the order of the keys.
    fn check(&self) -> Result<(), InvalidValue>;
}

/// A Rust type a key can have: its TOML [`Kind`], and how a TOML value becomes one and back.
pub(crate) trait KeyType: Sized {
    const KIND: Kind;

    /// `None`: the value is not of this type.
    fn read(value: &Value) -> Option<Self>;

    /// The value as the resolved config writes it.
    fn write(&self) -> Value;
}

/// [`KeyType`] for types that serde reads and writes as they are.
macro_rules! serde_key_types {
    ($($ty:ty => $kind:expr),+ $(,)?) => {$(
        impl KeyType for $ty {
            const KIND: Kind = $kind;

            fn read(value: &Value) -> Option<Self> {
                value.clone().try_into().ok()
            }

            /// Panics on a `u64` above `i64::MAX` (TOML integers are signed), which the
            /// checks of `train.seed` reject.
            fn write(&self) -> Value {
                Value::try_from(self).expect("a checked value is a TOML value")
            }
        }
    )+};
}

serde_key_types! {
    usize => Kind::Uint,
    u64 => Kind::Uint,
    f64 => Kind::Float,
    bool => Kind::Bool,
    String => Kind::Str,
    (f64, f64) => Kind::Pair,
    Vec<String> => Kind::Strs,
    LoraTargets => Kind::Targets,
    Vec<LogSink> => Kind::Choices(LogSink::NAMES),
    // The enums of this crate get theirs from `choices!`; this one is the model crate's.
    AdapterKind => Kind::Choice(&AdapterKind::NAMES),
}

/// A path is written as a string (lossily, if it is not UTF-8).
impl KeyType for PathBuf {
    const KIND: Kind = Kind::Str;

    fn read(value: &Value) -> Option<Self> {
        value.as_str().map(PathBuf::from)
    }

    fn write(&self) -> Value {
        Value::String(self.to_string_lossy().into_owned())
    }
}

/// An optional path or string is `""` when not set (TOML has no null).
impl KeyType for Option<PathBuf> {
    const KIND: Kind = Kind::Str;

    fn read(value: &Value) -> Option<Self> {
        let s = value.as_str()?;
        Some((!s.is_empty()).then(|| PathBuf::from(s)))
    }

    fn write(&self) -> Value {
        self.as_ref()
            .map_or(Value::String(String::new()), KeyType::write)
    }
}

impl KeyType for Option<String> {
    const KIND: Kind = Kind::Str;

    fn read(value: &Value) -> Option<Self> {
        let s = value.as_str()?;
        Some((!s.is_empty()).then(|| s.to_string()))
    }

    fn write(&self) -> Value {
        Value::String(self.clone().unwrap_or_default())
    }
}

/// Declares a section of the config, each key once:
///
/// ```ignore
/// section! {
///     /// `[lora]`: the adapters.
///     pub struct LoraSection("lora") {
///         /// r, the inner dimension of B·A.
///         rank: usize = 16,
///             check |r| ensure(*r >= 1, "must be at least 1, found 0 (8 to 64 is usual)");
///         /// Dropout on the adapter's input.
///         dropout: f64 = 0.05;
///     }
/// }
/// ```
///
/// A key is `DOC name: Type = default`, then optionally, in this order:
/// - `, in field.path`: the key is stored at `field.path` rather than in a field of its own
///   name (`data.alpaca_prompt` in `alpaca.with_input`); `field` is declared after the keys,
///   in `fields { DOC field: Type }`, and starts at its `Default`;
/// - `, required "hint"`: the file must set it (the default is a placeholder); a config
///   without it is an error that says what to write, the hint;
/// - `, check |v| expr`: `expr` (with `v: &Type`) is `Ok(())` or `Err(message)`, the text
///   after the key in the error (`lora.rank` "must be at least 1, found 0"). A check that
///   reads other keys belongs in `validate.rs`.
///
/// It writes the struct (the doc comment of each field is the key's, docs/config.md's row
/// too) and its [`Section`] impl (defaults, the [`Key`] rows, reading a TOML value into a key,
/// the checks) and a `Serialize` that writes every key in order.
macro_rules! section {
    (
        $(#[$meta:meta])*
        pub struct $name:ident($section:literal) {
            $(
                $(#[doc = $doc:literal])+
                $key:ident: $ty:ty = $default:expr
                $(, in $($place:ident).+)?
                $(, required $hint:literal)?
                $(, check |$v:ident| $check:expr)?;
            )+
        }
        $(fields {
            $(
                $(#[doc = $fdoc:literal])+
                $field:ident: $fty:ty
            ),+ $(,)?
        })?
    ) => {
        $crate::config::section::section!(@struct
            [
                $(#[$meta])*
                #[derive(Debug, Clone, PartialEq)]
            ]
            $name [] []
            $({
                [
                    $(#[doc = $doc])+
                    #[doc = ""]
                    #[doc = $crate::config::section::section!(@default_doc $default $(, $hint)?)]
                ]
                $key: $ty = ($default) $(in $($place).+)?
            })+
            ; [$($($(#[doc = $fdoc])+ $field: $fty,)+)?]
        );

        impl $crate::config::section::Section for $name {
            const NAME: &'static str = $section;
            const KEYS: &'static [$crate::config::section::Key] = &[$(
                $crate::config::section::Key {
                    name: stringify!($key),
                    full: concat!($section, ".", stringify!($key)),
                    kind: <$ty as $crate::config::section::KeyType>::KIND,
                    doc: &[$($doc),+],
                    required: $crate::config::section::section!(@option $($hint)?),
                },
            )+];

            fn defaults() -> Self {
                #[allow(unused_mut)]
                let mut section = Self::literal_defaults();
                $($(section.$($place).+ = $default;)?)+
                section
            }

            fn set(&mut self, key: &str, value: &::toml::Value) -> bool {
                $(
                    if key == stringify!($key) {
                        return match <$ty as $crate::config::section::KeyType>::read(value) {
                            Some(v) => {
                                $crate::config::section::section!(
                                    @place self $key $(in $($place).+)?
                                ) = v;
                                true
                            }
                            None => false,
                        };
                    }
                )+
                unreachable!("`{}.{key}` is not a key; check_keys rejects it", $section)
            }

            fn check(&self) -> Result<(), $crate::config::InvalidValue> {
                $(
                    $crate::config::section::section!(
                        @check self $section $key: $ty [$(in $($place).+)?] $(|$v| $check)?
                    );
                )+
                Ok(())
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use ::serde::ser::SerializeStruct;
                use $crate::config::section::{KeyType, Section};
                let mut out = s.serialize_struct(stringify!($name), Self::KEYS.len())?;
                $(
                    out.serialize_field(
                        stringify!($key),
                        &KeyType::write(
                            &$crate::config::section::section!(@place self $key $(in $($place).+)?),
                        ),
                    )?;
                )+
                out.end()
            }
        }
    };

    // The struct: a field for each key not stored elsewhere (`in`), then the `fields`.
    (@struct [$($meta:tt)*] $name:ident [$($fields:tt)*] [$($inits:tt)*]
        { [$($doc:tt)*] $key:ident: $ty:ty = ($default:expr) in $($place:ident).+ }
        $($rest:tt)*
    ) => {
        $crate::config::section::section!(@struct
            [$($meta)*] $name [$($fields)*] [$($inits)*] $($rest)*
        );
    };
    (@struct [$($meta:tt)*] $name:ident [$($fields:tt)*] [$($inits:tt)*]
        { [$($doc:tt)*] $key:ident: $ty:ty = ($default:expr) }
        $($rest:tt)*
    ) => {
        $crate::config::section::section!(@struct
            [$($meta)*] $name [$($fields)* $($doc)* pub $key: $ty,] [$($inits)* $key: $default,]
            $($rest)*
        );
    };
    (@struct [$($meta:tt)*] $name:ident [$($fields:tt)*] [$($inits:tt)*]
        ; [$($(#[doc = $fdoc:literal])+ $field:ident: $fty:ty,)*]
    ) => {
        $($meta)*
        pub struct $name {
            $($fields)*
            $($(#[doc = $fdoc])+ pub $field: $fty,)*
        }

        impl $name {
            /// The fields of the keys at their defaults, the other fields at theirs.
            fn literal_defaults() -> Self {
                Self {
                    $($inits)*
                    $($field: Default::default(),)*
                }
            }
        }
    };

    // A key's check, if it has one: return its failure.
    (@check $self:ident $section:literal $key:ident: $ty:ty [$($place:tt)*]) => {};
    (@check $self:ident $section:literal $key:ident: $ty:ty [$($place:tt)*]
        |$v:ident| $check:expr
    ) => {
        let $v: &$ty = &$crate::config::section::section!(@place $self $key $($place)*);
        let checked: Result<(), String> = $check;
        if let Err(message) = checked {
            return Err($crate::config::InvalidValue {
                key: concat!($section, ".", stringify!($key)),
                message,
            });
        }
    };

    // Where a key is stored.
    (@place $self:ident $key:ident) => { $self.$key };
    (@place $self:ident $key:ident in $($place:ident).+) => { $self.$($place).+ };

    (@option) => { None };
    (@option $hint:literal) => { Some($hint) };

    (@default_doc $default:expr) => { concat!("Default: `", stringify!($default), "`.") };
    (@default_doc $default:expr, $hint:literal) => { "Required." };
}

pub(crate) use section;
