//! `pkcs11:` URIs (RFC 7512): the token, the object and where the PIN comes from.

use std::fmt;
use std::path::PathBuf;

use percent_encoding::{percent_decode_str, utf8_percent_encode};

use super::query::{decode, invalid, pairs, parse_pin_source, pin_query, PinSource, ESCAPE};
use crate::key::{CapabilityError, LocateError};
use zeroize::Zeroizing;

use crate::key::KeyError;

/// A PKCS#11 URI (RFC 7512), reduced to the attributes hwkey uses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pkcs11Uri {
    /// `token=`: the token label.
    pub token: Option<String>,
    /// `serial=`: the token serial number.
    pub serial: Option<String>,
    /// `slot-id=`: the slot number (discouraged: SoftHSM renumbers slots).
    pub slot_id: Option<u64>,
    /// `manufacturer=`: the token's manufacturer (`CK_TOKEN_INFO.manufacturerID`).
    pub manufacturer: Option<String>,
    /// `model=`: the token's model.
    pub model: Option<String>,
    /// `object=`: the key's `CKA_LABEL`.
    pub object: Option<String>,
    /// `id=`: the key's `CKA_ID` bytes.
    pub id: Option<Vec<u8>>,
    /// `module-path=`: the PKCS#11 library.
    pub module_path: Option<PathBuf>,
    /// `module-name=`: a module registered with p11-kit (see [`crate::key::p11kit`]).
    pub module_name: Option<String>,
    /// `pin-source=` / `pin-value=`.
    pub pin: Option<PinSource>,
}

pub(super) fn parse(uri: &str, rest: &str) -> Result<Pkcs11Uri, KeyError> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut out = Pkcs11Uri::default();
    for (k, v) in pairs(uri, path, ';')? {
        match k {
            "token" => out.token = Some(decode(uri, k, v)?),
            "object" => out.object = Some(decode(uri, k, v)?),
            "serial" => out.serial = Some(decode(uri, k, v)?),
            "id" => out.id = Some(percent_decode_str(v).collect()),
            "slot-id" => {
                out.slot_id = Some(
                    decode(uri, k, v)?
                        .parse()
                        .map_err(|_| invalid(uri, "slot-id must be a decimal number"))?,
                )
            }
            "manufacturer" => out.manufacturer = Some(decode(uri, k, v)?),
            "model" => out.model = Some(decode(uri, k, v)?),
            // Accepted and ignored: they narrow a search we already narrow by token and key.
            "type" | "library-manufacturer" | "library-description" | "library-version"
            | "slot-description" | "slot-manufacturer" => {}
            other => {
                return Err(invalid(
                    uri,
                    format!(
                        "unknown path attribute '{other}' (known: token, object, id, serial, slot-id, manufacturer, model, type)"
                    ),
                ))
            }
        }
    }
    for (k, v) in pairs(uri, query, '&')? {
        match k {
            "module-path" => out.module_path = Some(PathBuf::from(decode(uri, k, v)?)),
            "pin-source" => {
                if out.pin.is_some() {
                    return Err(invalid(
                        uri,
                        "give either pin-source or pin-value, not both",
                    ));
                }
                out.pin = Some(parse_pin_source(uri, k, &decode(uri, k, v)?)?)
            }
            "pin-value" => {
                if out.pin.is_some() {
                    return Err(invalid(
                        uri,
                        "give either pin-source or pin-value, not both",
                    ));
                }
                tracing::warn!(
                    "pin-value in a key URI is visible in process lists, shell history and kubeconfigs; prefer pin-source=file:/path or pin-source=env:VAR"
                );
                out.pin = Some(PinSource::Value(Zeroizing::new(decode(uri, k, v)?)))
            }
            "module-name" => {
                let name = decode(uri, k, v)?;
                if name.is_empty() || name.contains('/') {
                    return Err(invalid(
                        uri,
                        "module-name is a name p11-kit registers (e.g. softhsm2), not a path: use module-path for a path",
                    ));
                }
                out.module_name = Some(name)
            }
            other => {
                return Err(invalid(
                    uri,
                    format!(
                    "unknown query attribute '{other}' (known: module-path, module-name, pin-source, pin-value)"
                ),
                ))
            }
        }
    }
    Ok(out)
}

impl Pkcs11Uri {
    /// The module to load: `module-path`; else the library p11-kit registers as `module-name`;
    /// else `HWKEY_PKCS11_MODULE`; else p11-kit's proxy module (every registered module) when
    /// it is installed.
    pub fn module(&self) -> Result<PathBuf, KeyError> {
        if let Some(p) = &self.module_path {
            return Ok(p.clone());
        }
        if let Some(name) = &self.module_name {
            return crate::key::p11kit::resolve(name);
        }
        match std::env::var_os("HWKEY_PKCS11_MODULE") {
            Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
            _ => crate::key::p11kit::proxy_module().ok_or(KeyError::Locate(LocateError::NoModule)),
        }
    }

    /// A human description of the token this URI selects, for messages.
    pub fn token_desc(&self) -> String {
        match (&self.token, &self.serial, self.slot_id) {
            (Some(t), _, _) => t.clone(),
            (None, Some(s), _) => format!("serial {s}"),
            (None, None, Some(id)) => format!("slot {id}"),
            _ => "(any)".into(),
        }
    }

    /// A human description of the key this URI selects, for messages.
    pub fn key_desc(&self) -> String {
        match (&self.object, &self.id) {
            (Some(o), Some(id)) => format!("key object='{o}' id={}", hex::encode(id)),
            (Some(o), None) => format!("key object='{o}'"),
            (None, Some(id)) => format!("key id={}", hex::encode(id)),
            (None, None) => "key".into(),
        }
    }

    /// The same URI naming another object on the same token (used by `key list`).
    pub fn with_key(&self, object: Option<String>, id: Option<Vec<u8>>) -> Pkcs11Uri {
        Pkcs11Uri {
            object,
            id,
            ..self.clone()
        }
    }
}

impl fmt::Display for Pkcs11Uri {
    /// Prints the URI in canonical order. A `pin-value` is never printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut path = Vec::new();
        if let Some(t) = &self.token {
            path.push(format!("token={}", utf8_percent_encode(t, ESCAPE)));
        }
        if let Some(s) = &self.serial {
            path.push(format!("serial={}", utf8_percent_encode(s, ESCAPE)));
        }
        if let Some(s) = self.slot_id {
            path.push(format!("slot-id={s}"));
        }
        if let Some(m) = &self.manufacturer {
            path.push(format!("manufacturer={}", utf8_percent_encode(m, ESCAPE)));
        }
        if let Some(m) = &self.model {
            path.push(format!("model={}", utf8_percent_encode(m, ESCAPE)));
        }
        if let Some(o) = &self.object {
            path.push(format!("object={}", utf8_percent_encode(o, ESCAPE)));
        }
        if let Some(id) = &self.id {
            path.push(format!(
                "id={}",
                id.iter().map(|b| format!("%{b:02x}")).collect::<String>()
            ));
        }
        let mut query = Vec::new();
        if let Some(m) = &self.module_path {
            query.push(format!(
                "module-path={}",
                utf8_percent_encode(&m.to_string_lossy(), ESCAPE)
            ));
        }
        if let Some(m) = &self.module_name {
            query.push(format!("module-name={}", utf8_percent_encode(m, ESCAPE)));
        }
        query.extend(pin_query(self.pin.as_ref()));
        write!(f, "pkcs11:{}", path.join(";"))?;
        if !query.is_empty() {
            write!(f, "?{}", query.join("&"))?;
        }
        Ok(())
    }
}

/// Its place in a rotation series (`--rotate-key`): the key named by its label (`object=`),
/// on the same token of the same module.
impl Pkcs11Uri {
    /// The next key of the series after this one.
    pub(crate) fn next_in_series(&self, stamp: u64) -> Result<Pkcs11Uri, KeyError> {
        let label = self.object.as_deref().ok_or_else(|| {
            CapabilityError::Unsupported(
                "--rotate-key needs a key named by object= (its label)".into(),
            )
        })?;
        Ok(self.with_key(Some(super::series::next_name(label, stamp)), None))
    }

    /// Whether this key belongs to `configured`'s series: the same token and module, and the
    /// configured label with or without a `-r<digits>` suffix.
    pub(crate) fn in_series_of(&self, configured: &Pkcs11Uri) -> bool {
        let device = |u: &Pkcs11Uri| {
            let device_only = Pkcs11Uri {
                pin: None,
                ..u.with_key(None, None)
            };
            device_only.to_string()
        };
        match (configured.object.as_deref(), self.object.as_deref()) {
            (Some(c), Some(k)) => {
                device(configured) == device(self)
                    && self.id.is_none()
                    && super::series::named_in(c, k)
            }
            _ => false,
        }
    }

    /// The key this URI names, with everything but which key (the module, the token, the PIN
    /// source) taken from `configured`.
    pub(crate) fn key_of(self, configured: &Pkcs11Uri) -> Pkcs11Uri {
        Pkcs11Uri {
            object: self.object,
            id: self.id,
            ..configured.clone()
        }
    }
}
