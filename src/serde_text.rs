//! serde for values that travel as text: a config file's and a kubeconfig extension's key URIs,
//! upstream URLs, listen addresses and durations arrive as the same types the flags parse into,
//! through the same `FromStr` (one parser, one set of accepted forms, one error message).
//!
//! Use with `#[serde(default, with = "crate::serde_text::option")]` (or `deserialize_with`).

/// An optional value in its text form (`Display` / `FromStr`).
pub mod option {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the value's text.
    pub fn serialize<S: Serializer, T: Display>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(v),
            None => s.serialize_none(),
        }
    }

    /// Parses the text with `FromStr`; its error becomes serde's.
    pub fn deserialize<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        Option::<String>::deserialize(d)?
            .map(|t| t.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A list of values in their text forms.
pub mod list {
    use std::fmt::Display;
    use std::str::FromStr;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes each value's text.
    pub fn serialize<S: Serializer, T: Display>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(ToString::to_string))
    }

    /// Parses each text with `FromStr`.
    pub fn deserialize<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .collect()
    }

    /// Like [`deserialize`], also taking a single text for a list of one.
    pub fn one_or_many<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: Display,
    {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Texts {
            One(String),
            Many(Vec<String>),
        }
        let texts = match Texts::deserialize(d)? {
            Texts::One(s) => vec![s],
            Texts::Many(v) => v,
        };
        texts
            .iter()
            .map(|s| s.parse().map_err(serde::de::Error::custom))
            .collect()
    }
}

/// An optional duration: written as humantime text (`1h 30m`), read in
/// [`crate::duration::parse_duration`]'s syntax or as a number of seconds.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `1h 30m`.
    pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(d) => s.collect_str(&humantime::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    /// Reads `90s`, `1h30m`, or a number of seconds.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Text {
            Seconds(u64),
            Text(String),
        }
        Option::<Text>::deserialize(d)?
            .map(|t| match t {
                Text::Seconds(n) => Ok(Duration::from_secs(n)),
                Text::Text(s) => {
                    crate::duration::parse_duration(&s).map_err(serde::de::Error::custom)
                }
            })
            .transpose()
    }
}
