//! `tpm:` URIs: a TSS2 key file or a persistent handle, and the TCTI of the TPM.

use std::fmt;
use std::path::PathBuf;

use percent_encoding::utf8_percent_encode;

use super::query::{
    decode, invalid, pairs, parse_pin_source, pin_query, source_query, PinSource, ESCAPE,
};
use crate::key::{CapabilityError, KeyError};

/// Where a TPM key lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TpmKeyLocation {
    /// A TSS2 PRIVATE KEY PEM file.
    Path(PathBuf),
    /// A persistent handle (0x81xxxxxx).
    Handle(u32),
}

/// A TPM key URI.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TpmUri {
    /// The key; `None` when the URI names only the TPM (`tpm:?tcti=…`).
    pub key: Option<TpmKeyLocation>,
    /// The TCTI configuration string as written in the URI, if any.
    pub tcti: Option<String>,
    /// `pin-source=`: the key's authValue (its password), for keys that have one.
    pub pin: Option<PinSource>,
    /// `owner-pin-source=`: the owner hierarchy's password (`tpm2_changeauth -c owner`), which
    /// creating the storage key that key files hang under needs, and making keys persistent.
    pub owner_pin: Option<PinSource>,
    /// `parent=0x81…`: for `key create`, the persistent storage key (made by another tool, e.g.
    /// an SRK at 0x81000001) to make the key file's key under, instead of the owner's
    /// standard storage key.
    pub parent: Option<u32>,
}

/// A persistent handle written in hex (`0x81000101`).
fn persistent_handle(uri: &str, name: &str, v: &str) -> Result<u32, KeyError> {
    let digits = v.trim_start_matches("0x").trim_start_matches("0X");
    let handle = u32::from_str_radix(digits, 16).map_err(|_| {
        invalid(
            uri,
            format!("{name} '{v}' is not a hex number like 0x81000101"),
        )
    })?;
    if handle >> 24 != 0x81 {
        return Err(invalid(
            uri,
            format!("{name} {v} is not a persistent handle (0x81000000-0x81FFFFFF)"),
        ));
    }
    Ok(handle)
}

pub(super) fn parse(uri: &str, rest: &str) -> Result<TpmUri, KeyError> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut out = TpmUri::default();
    for (k, v) in pairs(uri, path, ';')? {
        let v = decode(uri, k, v)?;
        let loc = match k {
            "path" => {
                if v.is_empty() {
                    return Err(invalid(uri, "path= is empty"));
                }
                TpmKeyLocation::Path(PathBuf::from(v))
            }
            "handle" => TpmKeyLocation::Handle(persistent_handle(uri, "handle", &v)?),
            other => {
                return Err(invalid(
                    uri,
                    format!("unknown attribute '{other}' (known: path, handle)"),
                ))
            }
        };
        if out.key.is_some() {
            return Err(invalid(uri, "give either path= or handle=, not both"));
        }
        out.key = Some(loc);
    }
    for (k, v) in pairs(uri, query, '&')? {
        match k {
            "tcti" => out.tcti = Some(decode(uri, k, v)?),
            "pin-source" => {
                if out.pin.is_some() {
                    return Err(invalid(uri, "'pin-source' is given twice"));
                }
                out.pin = Some(parse_pin_source(uri, k, &decode(uri, k, v)?)?)
            }
            "parent" => {
                if out.parent.is_some() {
                    return Err(invalid(uri, "'parent' is given twice"));
                }
                out.parent = Some(persistent_handle(uri, "parent", &decode(uri, k, v)?)?)
            }
            "owner-pin-source" => {
                if out.owner_pin.is_some() {
                    return Err(invalid(uri, "'owner-pin-source' is given twice"));
                }
                out.owner_pin = Some(parse_pin_source(uri, k, &decode(uri, k, v)?)?)
            }
            other => {
                return Err(invalid(
                    uri,
                    format!(
                        "unknown query attribute '{other}' (known: tcti, pin-source, owner-pin-source, parent)"
                    ),
                ))
            }
        }
    }
    Ok(out)
}

impl TpmUri {
    /// The TCTI to use: the URI's, else `TPM2TOOLS_TCTI`, else the kernel resource manager.
    pub fn tcti(&self) -> String {
        self.tcti
            .clone()
            .or_else(|| {
                std::env::var("TPM2TOOLS_TCTI")
                    .ok()
                    .filter(|v| !v.is_empty())
            })
            .unwrap_or_else(|| "device:/dev/tpmrm0".to_string())
    }
}

impl fmt::Display for TpmUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tpm:")?;
        match &self.key {
            Some(TpmKeyLocation::Path(p)) => write!(
                f,
                "path={}",
                utf8_percent_encode(&p.to_string_lossy(), ESCAPE)
            )?,
            Some(TpmKeyLocation::Handle(h)) => write!(f, "handle=0x{h:08x}")?,
            None => {}
        }
        let mut query = Vec::new();
        if let Some(t) = &self.tcti {
            // TCTI strings hold ':' ',' '=' which are fine in a query value except '&'.
            query.push(format!("tcti={}", t.replace('&', "%26")));
        }
        query.extend(pin_query(self.pin.as_ref()));
        query.extend(source_query("owner-pin-source", self.owner_pin.as_ref()));
        query.extend(self.parent.map(|p| format!("parent=0x{p:08x}")));
        if !query.is_empty() {
            write!(f, "?{}", query.join("&"))?;
        }
        Ok(())
    }
}

/// Its place in a rotation series (`--rotate-key`): key files in one directory, of one TPM.
impl TpmUri {
    /// The next key of the series after this one: its file name with a fresh suffix.
    pub(crate) fn next_in_series(&self, stamp: u64) -> Result<TpmUri, KeyError> {
        match &self.key {
            Some(TpmKeyLocation::Path(p)) => {
                let name = super::series::next_name(super::series::stem(p), stamp);
                let mut next = self.clone();
                next.key = Some(TpmKeyLocation::Path(
                    p.with_file_name(format!("{name}.tpm.pem")),
                ));
                Ok(next)
            }
            _ => Err(CapabilityError::Unsupported(
                "--rotate-key needs a TPM key file (tpm:path=…), not a persistent handle".into(),
            )
            .into()),
        }
    }

    /// Whether this key belongs to `configured`'s series: the same TPM and directory, and the
    /// configured file or its name with a `-r<digits>` suffix.
    pub(crate) fn in_series_of(&self, configured: &TpmUri) -> bool {
        match (&configured.key, &self.key) {
            (Some(TpmKeyLocation::Path(cp)), Some(TpmKeyLocation::Path(kp))) => {
                configured.tcti == self.tcti
                    && cp.parent() == kp.parent()
                    && (kp == cp
                        || super::series::named_in(
                            super::series::stem(cp),
                            super::series::stem(kp),
                        ))
            }
            _ => false,
        }
    }

    /// Whether this and `other` name one key whatever their spelling: key files that are one
    /// file (the same path, or the same file once links are followed), or one persistent handle
    /// of one TPM.
    pub(crate) fn same_key_as(&self, other: &TpmUri) -> bool {
        match (&self.key, &other.key) {
            (Some(TpmKeyLocation::Path(ap)), Some(TpmKeyLocation::Path(bp))) => {
                ap == bp
                    || matches!(
                        (std::fs::canonicalize(ap), std::fs::canonicalize(bp)),
                        (Ok(x), Ok(y)) if x == y
                    )
            }
            (Some(TpmKeyLocation::Handle(x)), Some(TpmKeyLocation::Handle(y))) => {
                x == y && self.tcti == other.tcti
            }
            _ => false,
        }
    }

    /// The key this URI names, with everything but which key (the TPM, the parent, the
    /// passwords) taken from `configured`.
    pub(crate) fn key_of(self, configured: &TpmUri) -> TpmUri {
        TpmUri {
            key: self.key,
            ..configured.clone()
        }
    }

    /// As the rotation pointer records it: no password source at all.
    pub(crate) fn for_pointer(self) -> TpmUri {
        TpmUri {
            pin: None,
            owner_pin: None,
            ..self
        }
    }
}
