//! Where a PIN comes from, and reading it without leaving copies behind.
//!
//! PINs never come from argv (visible in `ps`). They are read when needed, held in a
//! [`zeroize::Zeroizing`] buffer for the duration of one login, and never logged.

use std::fmt;
use std::path::PathBuf;

use zeroize::Zeroizing;

use super::KeyError;

/// The `pin-source` (or `pin-value`) of a key URI.
#[derive(Clone, PartialEq, Eq)]
pub enum PinSource {
    /// A file holding the PIN; one trailing newline is ignored.
    File(PathBuf),
    /// An environment variable holding the PIN.
    Env(String),
    /// A PIN written in the URI itself (`pin-value`); accepted with a warning.
    Value(Zeroizing<String>),
}

impl PinSource {
    /// Reads the PIN. The result is wiped from memory when dropped.
    pub fn read(&self) -> Result<Zeroizing<String>, KeyError> {
        match self {
            PinSource::File(path) => {
                let bytes =
                    Zeroizing::new(std::fs::read(path).map_err(|e| KeyError::PinUnreadable {
                        source_desc: format!("file {}", path.display()),
                        reason: e.to_string(),
                    })?);
                let text = std::str::from_utf8(&bytes).map_err(|_| KeyError::PinUnreadable {
                    source_desc: format!("file {}", path.display()),
                    reason: "it is not UTF-8 text".into(),
                })?;
                let pin = text.strip_suffix('\n').unwrap_or(text);
                let pin = pin.strip_suffix('\r').unwrap_or(pin);
                Ok(Zeroizing::new(pin.to_string()))
            }
            PinSource::Env(var) => match std::env::var(var) {
                Ok(v) => Ok(Zeroizing::new(v)),
                Err(e) => Err(KeyError::PinUnreadable {
                    source_desc: format!("environment variable {var}"),
                    reason: e.to_string(),
                }),
            },
            PinSource::Value(v) => Ok(v.clone()),
        }
    }
}

impl fmt::Debug for PinSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinSource::File(p) => write!(f, "File({})", p.display()),
            PinSource::Env(v) => write!(f, "Env({v})"),
            PinSource::Value(_) => f.write_str("Value(<redacted>)"),
        }
    }
}
