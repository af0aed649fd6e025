//! What both kinds of key URI share: `name=value` pairs, percent-decoding, where a PIN comes
//! from, and keeping a PIN written into a URI out of every message.

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};

pub use crate::key::pin::PinSource;
use crate::key::KeyError;

/// Characters escaped when printing a URI value (RFC 7512 `pchar`/`qchar` are stricter, but
/// these are the ones that would change the parse).
pub(super) const ESCAPE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b';')
    .add(b'?')
    .add(b'&')
    .add(b'%')
    .add(b'=')
    .add(b'"')
    .add(b'#');

pub(super) fn invalid(uri: &str, reason: impl Into<String>) -> KeyError {
    // The reason may quote a piece of the URI that a pin-value ran into: hide those too.
    let mut reason = reason.into();
    for secret in secrets(uri) {
        reason = reason.replace(&secret, "<redacted>");
    }
    KeyError::InvalidUri {
        uri: redact(uri),
        reason,
    }
}

/// The values of every `pin-value` attribute in `uri`, and of every `pin-source` that is not a
/// source (the secret itself, typed in the wrong place), as written (see [`redact`]).
fn secrets(uri: &str) -> Vec<String> {
    let mut found: Vec<String> = uri
        .split(['?', '&', ';', ':'])
        .filter_map(|part| part.split_once('='))
        .filter(|(name, value)| is_pin_value(name) && !value.is_empty())
        .map(|(_, value)| value.to_string())
        .collect();
    for part in uri.split(['?', '&', ';']) {
        let Some((name, value)) = part.split_once('=') else {
            continue;
        };
        let name = name.rsplit(':').next().unwrap_or(name);
        if is_source_name(name) && !value.is_empty() && !is_valid_source(value) {
            found.push(value.to_string());
            found.push(percent_decode_str(value).decode_utf8_lossy().into_owned());
        }
    }
    found
}

/// Hides every `pin-value`, and every `pin-source` or `owner-pin-source` that is not a source
/// (whatever their case or percent-encoding), so a URI can appear in an error message.
pub fn redact(uri: &str) -> String {
    let mut out = String::with_capacity(uri.len());
    let mut rest = uri;
    loop {
        let end = rest.find(['?', '&', ';', ':']).unwrap_or(rest.len());
        let (part, mut tail) = rest.split_at(end);
        match part.split_once('=') {
            Some((name, _)) if is_pin_value(name) => {
                out.push_str(name);
                out.push_str("=<redacted>");
            }
            Some((name, value)) if is_source_name(name) => {
                // A source's value runs to the next attribute (`file:/p` holds a ':').
                let more = tail.find(['?', '&', ';']).unwrap_or(tail.len());
                let whole = format!("{value}{}", &tail[..more]);
                tail = &tail[more..];
                out.push_str(name);
                out.push('=');
                if is_valid_source(&whole) {
                    out.push_str(&whole);
                } else {
                    out.push_str("<redacted>");
                }
            }
            _ => out.push_str(part),
        }
        let Some(sep) = tail.chars().next() else {
            return out;
        };
        out.push(sep);
        rest = &tail[sep.len_utf8()..];
    }
}

/// True for an attribute name that names where a secret comes from.
fn is_source_name(name: &str) -> bool {
    let name = percent_decode_str(name).decode_utf8_lossy();
    let name = name.trim();
    name.eq_ignore_ascii_case("pin-source") || name.eq_ignore_ascii_case("owner-pin-source")
}

/// True when `value` (as written, percent-encoded or not) is a source, not a secret.
fn is_valid_source(value: &str) -> bool {
    PinSource::parse(&percent_decode_str(value).decode_utf8_lossy()).is_some()
}

/// True for an attribute name that means `pin-value`.
fn is_pin_value(name: &str) -> bool {
    percent_decode_str(name)
        .decode_utf8_lossy()
        .trim()
        .eq_ignore_ascii_case("pin-value")
}

pub(super) fn decode(uri: &str, name: &str, value: &str) -> Result<String, KeyError> {
    percent_decode_str(value)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| {
            invalid(
                uri,
                format!("the value of '{name}' is not UTF-8 after percent-decoding"),
            )
        })
}

/// Splits `a=b;c=d` (or with `&`) into decoded pairs, refusing repeats.
pub(super) fn pairs<'a>(
    uri: &str,
    part: &'a str,
    sep: char,
) -> Result<Vec<(&'a str, &'a str)>, KeyError> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for item in part.split(sep).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| invalid(uri, format!("'{item}' is not of the form name=value")))?;
        if out.iter().any(|(seen, _)| *seen == k) {
            return Err(invalid(uri, format!("'{k}' is given twice")));
        }
        out.push((k, v));
    }
    Ok(out)
}

pub(super) fn parse_pin_source(uri: &str, name: &str, value: &str) -> Result<PinSource, KeyError> {
    PinSource::parse(value)
        .ok_or_else(|| invalid(uri, format!("{name}: {}", PinSource::why_not(value))))
}

/// The `pin-source=` a URI prints; a `pin-value` is never printed.
pub(super) fn pin_query(pin: Option<&PinSource>) -> Option<String> {
    source_query("pin-source", pin)
}

/// `NAME=file:…` or `NAME=env:…`; a PIN value is never printed.
pub(super) fn source_query(name: &str, pin: Option<&PinSource>) -> Option<String> {
    match pin? {
        PinSource::File(p) => Some(format!(
            "{name}=file:{}",
            utf8_percent_encode(&p.to_string_lossy(), ESCAPE)
        )),
        PinSource::Env(v) => Some(format!("{name}=env:{v}")),
        PinSource::Value(_) => None,
    }
}
