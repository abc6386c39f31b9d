//! Enums written as names in configs and on the command line (`model.dtype = "bf16"`,
//! `--format messages`), declared with [`choices!`]: each enum lists `Variant = "name"` once, and
//! serde, `name()` / `Display`, `from_name` (which each enum's `FromStr` calls), the key table's
//! `Kind::Choice` and every message that lists the valid values are derived from that list, so
//! they cannot disagree.

/// Declares a fieldless enum whose values are written as names:
///
/// ```ignore
/// choices! {
///     /// `train.method`: which weights are trained.
///     #[derive(Default)]
///     pub enum Method {
///         #[default]
///         Lora = "lora",
///         Full = "full",
///     }
/// }
/// ```
///
/// The enum derives `Debug, Clone, Copy, PartialEq, Eq` (add others, such as `Default`, above
/// it) and gets `ALL`, `NAMES`, `name()`, `from_name()`, `Display`, a serde `Serialize` /
/// `Deserialize` that write and read the name (an unknown one is serde's `unknown variant`
/// error listing `NAMES`) and the `KeyType` that lets a config key have it (`Kind::Choice`).
/// `FromStr` is left to each enum (their error types differ); [`any_case_from_str!`] writes the
/// usual one.
macro_rules! choices {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $text:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order; [`Self::NAMES`] holds their names.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The names written in configs and on the command line, in the order of
            /// [`Self::ALL`].
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name written in configs and on the command line.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The value spelled exactly `name`, if any.
            pub fn from_name(name: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|v| v.name() == name)
            }

            /// The value named `name` in any case (`AdamW`), for a `FromStr`; an unknown name
            /// is the message "unknown {what} `name`: expected" [`Self::NAMES`].
            pub fn from_name_any_case(name: &str, what: &str) -> Result<Self, String> {
                Self::from_name(&name.to_ascii_lowercase()).ok_or_else(|| {
                    format!(
                        "unknown {what} `{name}`: expected {}",
                        $crate::config::choice::or_list(Self::NAMES)
                    )
                })
            }
        }

        /// A key of this type takes one of [`Self::NAMES`].
        impl $crate::config::section::KeyType for $name {
            const KIND: $crate::config::section::Kind =
                $crate::config::section::Kind::Choice(Self::NAMES);

            fn read(value: &::toml::Value) -> Option<Self> {
                value.as_str().and_then(Self::from_name)
            }

            fn write(&self) -> ::toml::Value {
                ::toml::Value::String(self.name().to_string())
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct NameVisitor;

                impl<'de> ::serde::de::Visitor<'de> for NameVisitor {
                    type Value = $name;

                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "one of {}", $crate::config::choice::quoted($name::NAMES))
                    }

                    fn visit_str<E: ::serde::de::Error>(self, s: &str) -> Result<$name, E> {
                        $name::from_name(s).ok_or_else(|| E::unknown_variant(s, $name::NAMES))
                    }
                }

                d.deserialize_str(NameVisitor)
            }
        }
    };
}

pub(crate) use choices;

/// `FromStr` (error type `String`) for a [`choices!`] enum by its `from_name_any_case`:
/// `any_case_from_str!(Schedule, "learning-rate schedule");` parses `Cosine` and answers
/// `nope` with "unknown learning-rate schedule `nope`: expected `constant`, ...".
macro_rules! any_case_from_str {
    ($name:ident, $what:literal) => {
        impl ::std::str::FromStr for $name {
            type Err = String;

            /// The name in any case; an unknown one lists [`Self::NAMES`].
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::from_name_any_case(s, $what)
            }
        }
    };
}

pub(crate) use any_case_from_str;

/// `"a", "b", "c"`: names as TOML strings, for "must be one of ..." messages.
pub fn quoted(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    quoted.join(", ")
}

/// `` `a`, `b` or `c` ``: names in backticks, for "expected ..." messages.
pub fn or_list(names: &[&str]) -> String {
    let ticked: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match ticked.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    choices! {
        /// A test enum.
        #[derive(Default)]
        enum Fruit {
            /// The default.
            #[default]
            Apple = "apple",
            BloodOrange = "blood_orange",
        }
    }

    #[test]
    fn one_list_feeds_every_spelling() {
        assert_eq!(Fruit::NAMES, ["apple", "blood_orange"]);
        assert_eq!(Fruit::ALL, [Fruit::Apple, Fruit::BloodOrange]);
        assert_eq!(Fruit::default(), Fruit::Apple);
        for (v, n) in Fruit::ALL.iter().zip(Fruit::NAMES) {
            assert_eq!(v.name(), *n);
            assert_eq!(v.to_string(), *n);
            assert_eq!(Fruit::from_name(n), Some(*v));
            assert_eq!(serde_json::to_string(v).unwrap(), format!("\"{n}\""));
            assert_eq!(
                serde_json::from_str::<Fruit>(&format!("\"{n}\"")).unwrap(),
                *v
            );
        }
        assert_eq!(Fruit::from_name("Apple"), None);
        assert_eq!(
            Fruit::from_name_any_case("Apple", "fruit"),
            Ok(Fruit::Apple)
        );
        assert_eq!(
            Fruit::from_name_any_case("pear", "fruit"),
            Err("unknown fruit `pear`: expected `apple` or `blood_orange`".to_string())
        );
        let e = serde_json::from_str::<Fruit>("\"pear\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown variant `pear`, expected `apple` or `blood_orange`"),
            "{e}"
        );
        let e = serde_json::from_str::<Fruit>("3").unwrap_err().to_string();
        assert!(e.contains("one of \"apple\", \"blood_orange\""), "{e}");
    }

    #[test]
    fn lists() {
        assert_eq!(quoted(&["a", "b"]), "\"a\", \"b\"");
        assert_eq!(or_list(&[]), "");
        assert_eq!(or_list(&["a"]), "`a`");
        assert_eq!(or_list(&["a", "b", "c"]), "`a`, `b` or `c`");
    }
}
