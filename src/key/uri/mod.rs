//! Key URIs: the one way every command, config file and kubeconfig names a hardware key.
//!
//! * `pkcs11:token=T;object=O;id=%01?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/p`
//!   (RFC 7512). `pin-source` may be a `file:` URI, an absolute path, or `env:VAR`; `pin-value` is
//!   accepted with a warning. Without `module-path`: the module p11-kit registers as
//!   `module-name=`, else `HWKEY_PKCS11_MODULE`, else p11-kit's proxy module when installed.
//!   `token`, `serial`, `slot-id`, `manufacturer` and `model` select the token.
//! * `tpm:path=/path/key.pem?tcti=swtpm:host=127.0.0.1,port=2321` (a TSS2 PRIVATE KEY PEM file) or
//!   `tpm:handle=0x81000101` (a persistent key). The TCTI defaults to `TPM2TOOLS_TCTI`, then
//!   `device:/dev/tpmrm0`. `tpm:?tcti=…` names the TPM itself (for `key list`).
//!
//! Parsing happens once, at the edge; the rest of the code passes [`KeyUri`] values.

mod pkcs11;
mod query;
mod series;
mod tpm;

use std::fmt;
use std::str::FromStr;

use zeroize::Zeroizing;

use super::pin::PinSource;
use super::KeyError;

pub use self::pkcs11::Pkcs11Uri;
pub use self::query::redact;
pub use self::tpm::{TpmKeyLocation, TpmUri};

/// A parsed key URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyUri {
    /// A key in a PKCS#11 token (RFC 7512).
    Pkcs11(Pkcs11Uri),
    /// A key in a TPM 2.0 (TSS2 key file or persistent handle).
    Tpm(TpmUri),
}

impl FromStr for KeyUri {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, KeyError> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("pkcs11:") {
            pkcs11::parse(s, rest).map(KeyUri::Pkcs11)
        } else if let Some(rest) = s.strip_prefix("tpm:") {
            tpm::parse(s, rest).map(KeyUri::Tpm)
        } else {
            Err(KeyError::InvalidUri {
                uri: redact(s),
                reason: "it must start with 'pkcs11:' (RFC 7512) or 'tpm:', e.g. \
                         pkcs11:token=kube;object=alice?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/hwkey/pin"
                    .into(),
            })
        }
    }
}

impl KeyUri {
    /// The same key without its PIN source: what identifies the key (two URIs naming one key
    /// with different PIN sources compare equal this way).
    pub fn without_pin(&self) -> KeyUri {
        match self {
            KeyUri::Pkcs11(u) => KeyUri::Pkcs11(Pkcs11Uri {
                pin: None,
                ..u.clone()
            }),
            KeyUri::Tpm(u) => KeyUri::Tpm(TpmUri {
                pin: None,
                ..u.clone()
            }),
        }
    }

    /// The same key without a PIN held in memory (`pin-value`, or one read from a pipe); a
    /// `pin-source` stays: for a process that must know where the PIN is, never what it is.
    pub fn without_pin_value(&self) -> KeyUri {
        let keep = |p: &Option<PinSource>| p.clone().filter(|p| !matches!(p, PinSource::Value(_)));
        match self {
            KeyUri::Pkcs11(u) => KeyUri::Pkcs11(Pkcs11Uri {
                pin: keep(&u.pin),
                ..u.clone()
            }),
            KeyUri::Tpm(u) => KeyUri::Tpm(TpmUri {
                pin: keep(&u.pin),
                owner_pin: keep(&u.owner_pin),
                ..u.clone()
            }),
        }
    }

    /// The same key with the PIN held in memory (read from a pipe): never printed, never put in
    /// argv or the environment.
    pub fn with_pin_value(&self, pin: Zeroizing<String>) -> KeyUri {
        match self {
            KeyUri::Pkcs11(u) => KeyUri::Pkcs11(Pkcs11Uri {
                pin: Some(PinSource::Value(pin)),
                ..u.clone()
            }),
            other => other.clone(),
        }
    }

    /// The environment variables the URI's PIN sources read (`pin-source=env:VAR`, and a TPM
    /// URI's `owner-pin-source=env:VAR`): a process that must not see the PIN starts without them.
    pub fn pin_env_vars(&self) -> Vec<String> {
        let sources = match self {
            KeyUri::Pkcs11(u) => vec![u.pin.as_ref()],
            KeyUri::Tpm(u) => vec![u.pin.as_ref(), u.owner_pin.as_ref()],
        };
        sources
            .into_iter()
            .flatten()
            .filter_map(|s| match s {
                PinSource::Env(var) => Some(var.clone()),
                _ => None,
            })
            .collect()
    }

    /// The files only a signer may read: the PIN file (`pin-source=file:`, and a TPM URI's
    /// owner PIN file) and the PKCS#11 module (`module-path=`). The network side checks it
    /// cannot read them once confined.
    pub fn secret_files(&self) -> Vec<std::path::PathBuf> {
        let mut files = self.pin_files();
        if let KeyUri::Pkcs11(u) = self {
            files.extend(u.module_path.clone());
        }
        files
    }

    /// Whether opening the key presents a PIN or password, so a refusal is remembered
    /// ([`crate::key::pin_memory`]): always for PKCS#11 (a PIN is prompted when no source is
    /// named), for a TPM key only when it names a password source.
    pub fn presents_pin(&self) -> bool {
        match self {
            KeyUri::Pkcs11(_) => true,
            KeyUri::Tpm(u) => u.pin.is_some() || u.owner_pin.is_some(),
        }
    }

    /// The files the URI's PIN sources read (`pin-source=file:…`, a TPM's `owner-pin-source`).
    pub fn pin_files(&self) -> Vec<std::path::PathBuf> {
        let mut files = Vec::new();
        let mut source = |pin: Option<&PinSource>| {
            if let Some(PinSource::File(p)) = pin {
                files.push(p.clone());
            }
        };
        match self {
            KeyUri::Pkcs11(u) => source(u.pin.as_ref()),
            KeyUri::Tpm(u) => {
                source(u.pin.as_ref());
                source(u.owner_pin.as_ref());
            }
        }
        files
    }

    /// The files that hold the key itself (a TPM key file): what the network side must neither
    /// read nor be able to delete.
    pub fn key_files(&self) -> Vec<std::path::PathBuf> {
        match self {
            KeyUri::Tpm(TpmUri {
                key: Some(TpmKeyLocation::Path(p)),
                ..
            }) => vec![p.clone()],
            _ => Vec::new(),
        }
    }

    /// The PIN itself when the URI carries it in memory (`pin-value`, or a PIN read from a
    /// pipe): the one PIN source the URI's text never shows, which a signer is handed apart.
    pub fn pin_value(&self) -> Option<Zeroizing<String>> {
        let pin = match self {
            KeyUri::Pkcs11(u) => u.pin.as_ref(),
            KeyUri::Tpm(u) => u.pin.as_ref(),
        };
        match pin {
            Some(PinSource::Value(v)) => Some(v.clone()),
            _ => None,
        }
    }
}

impl fmt::Display for KeyUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyUri::Pkcs11(u) => u.fmt(f),
            KeyUri::Tpm(u) => u.fmt(f),
        }
    }
}

/// Parses `--key` values into typed URIs at the edge. A plain value parser would let clap echo
/// the raw value in its error, `pin-value` included; this one reports only the parser's
/// message, in which every `pin-value` is redacted.
#[derive(Debug, Clone, Copy)]
pub struct KeyUriParser;

impl clap::builder::TypedValueParser for KeyUriParser {
    type Value = KeyUri;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        use clap::error::ErrorKind;
        let flag = arg
            .and_then(|a| a.get_long())
            .map(|l| format!("--{l}"))
            .unwrap_or_else(|| "the key URI".into());
        let text = value.to_str().ok_or_else(|| {
            clap::Error::raw(ErrorKind::InvalidUtf8, format!("{flag} is not UTF-8\n")).with_cmd(cmd)
        })?;
        text.parse().map_err(|e: super::KeyError| {
            clap::Error::raw(ErrorKind::ValueValidation, format!("invalid {flag}: {e}\n"))
                .with_cmd(cmd)
        })
    }
}

/// Rotation series (`--rotate-key`), dispatched to each backend's URI: which key comes next,
/// which keys belong to a series, and which spellings name one key.
impl KeyUri {
    /// The next key of the series after this one, stamped `stamp` (unix seconds).
    pub fn next_in_series(&self, stamp: u64) -> Result<KeyUri, KeyError> {
        match self {
            KeyUri::Pkcs11(u) => u.next_in_series(stamp).map(KeyUri::Pkcs11),
            KeyUri::Tpm(u) => u.next_in_series(stamp).map(KeyUri::Tpm),
        }
    }

    /// Whether this key belongs to `configured`'s series (the configured key included).
    pub fn in_series_of(&self, configured: &KeyUri) -> bool {
        match (configured, self) {
            (KeyUri::Pkcs11(c), KeyUri::Pkcs11(k)) => k.in_series_of(c),
            (KeyUri::Tpm(c), KeyUri::Tpm(k)) => k.in_series_of(c),
            _ => false,
        }
    }

    /// Whether this and `other` name the same key, whatever their spelling.
    pub fn same_key_as(&self, other: &KeyUri) -> bool {
        if self.without_pin().to_string() == other.without_pin().to_string() {
            return true;
        }
        match (self, other) {
            (KeyUri::Tpm(a), KeyUri::Tpm(b)) => a.same_key_as(b),
            _ => false,
        }
    }

    /// The key this URI names, with everything but which key taken from `configured` (a
    /// URI of another backend: `configured` itself).
    pub fn key_of(self, configured: &KeyUri) -> KeyUri {
        match (self, configured) {
            (KeyUri::Pkcs11(u), KeyUri::Pkcs11(c)) => KeyUri::Pkcs11(u.key_of(c)),
            (KeyUri::Tpm(u), KeyUri::Tpm(c)) => KeyUri::Tpm(u.key_of(c)),
            (_, configured) => configured.clone(),
        }
    }

    /// As a rotation pointer records it: which key, without any password source.
    pub fn for_pointer(&self) -> KeyUri {
        match self.without_pin() {
            KeyUri::Tpm(u) => KeyUri::Tpm(u.for_pointer()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn every_pin_value_is_redacted_whatever_its_spelling() {
        // Found by tests/fuzz_props.rs: a pin-value right after the scheme.
        assert!(!redact("pkcs11:pin-value=9876;").contains("9876"));
        let text = redact("pkcs11:token=a;pin-value=1?PIN-VALUE=2&pin%2Dvalue=3&x=4&Pin-Value=5");
        for secret in ["=1", "=2", "=3", "=5"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert!(text.contains("x=4"), "{text}");
        assert_eq!(
            redact("pkcs11:token=a?module-path=/m"),
            "pkcs11:token=a?module-path=/m"
        );
    }

    use super::*;

    fn p11(s: &str) -> Pkcs11Uri {
        match s.parse::<KeyUri>().expect("parses") {
            KeyUri::Pkcs11(u) => u,
            other => panic!("not pkcs11: {other:?}"),
        }
    }

    #[test]
    fn pkcs11_full() {
        let u = p11("pkcs11:token=kube%20ops;object=alice;id=%01%ff?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/pin");
        assert_eq!(u.token.as_deref(), Some("kube ops"));
        assert_eq!(u.object.as_deref(), Some("alice"));
        assert_eq!(u.id.as_deref(), Some(&[0x01, 0xff][..]));
        assert_eq!(
            u.module_path.as_deref(),
            Some(std::path::Path::new("/usr/lib/softhsm/libsofthsm2.so"))
        );
        assert_eq!(u.pin, Some(PinSource::File("/run/pin".into())));
        // Printing and parsing again gives the same value.
        assert_eq!(p11(&u.to_string()), u);
    }

    #[test]
    fn pin_sources() {
        assert_eq!(
            p11("pkcs11:token=a?pin-source=/p").pin,
            Some(PinSource::File("/p".into()))
        );
        assert_eq!(
            p11("pkcs11:token=a?pin-source=file:///p").pin,
            Some(PinSource::File("/p".into()))
        );
        assert_eq!(
            p11("pkcs11:token=a?pin-source=env:PIN").pin,
            Some(PinSource::Env("PIN".into()))
        );
        let u = p11("pkcs11:token=a?pin-value=1234");
        assert!(matches!(u.pin, Some(PinSource::Value(_))));
        assert!(
            !u.to_string().contains("1234"),
            "pin-value is never printed"
        );
    }

    #[test]
    fn pkcs11_errors_name_the_problem() {
        for (uri, needle) in [
            ("pkcs11:token=a;bogus=1", "unknown path attribute 'bogus'"),
            ("pkcs11:token=a;token=b", "'token' is given twice"),
            ("pkcs11:token=a?pin-source=relative/p", "absolute"),
            ("pkcs11:token", "name=value"),
            ("pkcs12:token=a", "must start with"),
        ] {
            let err = uri.parse::<KeyUri>().expect_err(uri).to_string();
            assert!(err.contains(needle), "{uri}: {err}");
        }
        let err = "pkcs11:token=a?pin-value=9999&x=1"
            .parse::<KeyUri>()
            .expect_err("bad")
            .to_string();
        assert!(
            !err.contains("9999"),
            "pin-value is redacted in errors: {err}"
        );
    }

    #[test]
    fn tpm_uris() {
        let u: KeyUri = "tpm:path=/k/a.pem?tcti=swtpm:host=127.0.0.1,port=2321"
            .parse()
            .expect("tpm path");
        let KeyUri::Tpm(t) = &u else { panic!("tpm") };
        assert_eq!(t.key, Some(TpmKeyLocation::Path("/k/a.pem".into())));
        assert_eq!(t.tcti(), "swtpm:host=127.0.0.1,port=2321");
        assert_eq!(u.to_string().parse::<KeyUri>().expect("again"), u);

        let u: KeyUri = "tpm:handle=0x81000101".parse().expect("handle");
        assert_eq!(
            u,
            KeyUri::Tpm(TpmUri {
                key: Some(TpmKeyLocation::Handle(0x8100_0101)),
                tcti: None,
                pin: None,
                owner_pin: None,
                parent: None,
            })
        );
        assert!("tpm:handle=0x40000001".parse::<KeyUri>().is_err());
        // The owner password's source and a persistent parent survive printing.
        let u: KeyUri = "tpm:path=/k/a.pem?owner-pin-source=env:OWNER&parent=0x81000001"
            .parse()
            .expect("owner and parent");
        let KeyUri::Tpm(t) = &u else { panic!("tpm") };
        assert_eq!(t.owner_pin, Some(PinSource::Env("OWNER".into())));
        assert_eq!(t.parent, Some(0x8100_0001));
        assert_eq!(u.to_string().parse::<KeyUri>().expect("again"), u);
        assert!("tpm:path=/k?parent=0x40000001".parse::<KeyUri>().is_err());
        assert!("tpm:path=/k?parent=0x81000001&parent=0x81000002"
            .parse::<KeyUri>()
            .is_err());
        assert!("tpm:?tcti=device:/dev/tpmrm0".parse::<KeyUri>().is_ok());
    }
}
