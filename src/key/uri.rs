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

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};
use zeroize::Zeroizing;

use super::pin::PinSource;
use super::KeyError;

/// A parsed key URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyUri {
    /// A key in a PKCS#11 token (RFC 7512).
    Pkcs11(Pkcs11Uri),
    /// A key in a TPM 2.0 (TSS2 key file or persistent handle).
    Tpm(TpmUri),
}

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

/// Characters escaped when printing a URI value (RFC 7512 `pchar`/`qchar` are stricter, but
/// these are the ones that would change the parse).
const ESCAPE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b';')
    .add(b'?')
    .add(b'&')
    .add(b'%')
    .add(b'=')
    .add(b'"')
    .add(b'#');

impl FromStr for KeyUri {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, KeyError> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("pkcs11:") {
            parse_pkcs11(s, rest).map(KeyUri::Pkcs11)
        } else if let Some(rest) = s.strip_prefix("tpm:") {
            parse_tpm(s, rest).map(KeyUri::Tpm)
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

fn invalid(uri: &str, reason: impl Into<String>) -> KeyError {
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

fn decode(uri: &str, name: &str, value: &str) -> Result<String, KeyError> {
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
fn pairs<'a>(uri: &str, part: &'a str, sep: char) -> Result<Vec<(&'a str, &'a str)>, KeyError> {
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

fn parse_pkcs11(uri: &str, rest: &str) -> Result<Pkcs11Uri, KeyError> {
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

fn parse_pin_source(uri: &str, name: &str, value: &str) -> Result<PinSource, KeyError> {
    PinSource::parse(value)
        .ok_or_else(|| invalid(uri, format!("{name}: {}", PinSource::why_not(value))))
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

fn parse_tpm(uri: &str, rest: &str) -> Result<TpmUri, KeyError> {
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

impl Pkcs11Uri {
    /// The module to load: `module-path`; else the library p11-kit registers as `module-name`;
    /// else `HWKEY_PKCS11_MODULE`; else p11-kit's proxy module (every registered module) when
    /// it is installed.
    pub fn module(&self) -> Result<PathBuf, KeyError> {
        if let Some(p) = &self.module_path {
            return Ok(p.clone());
        }
        if let Some(name) = &self.module_name {
            return super::p11kit::resolve(name);
        }
        match std::env::var_os("HWKEY_PKCS11_MODULE") {
            Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
            _ => super::p11kit::proxy_module().ok_or(KeyError::NoModule),
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

/// The `pin-source=` a URI prints; a `pin-value` is never printed.
fn pin_query(pin: Option<&PinSource>) -> Option<String> {
    source_query("pin-source", pin)
}

/// `NAME=file:…` or `NAME=env:…`; a PIN value is never printed.
fn source_query(name: &str, pin: Option<&PinSource>) -> Option<String> {
    match pin? {
        PinSource::File(p) => Some(format!(
            "{name}=file:{}",
            utf8_percent_encode(&p.to_string_lossy(), ESCAPE)
        )),
        PinSource::Env(v) => Some(format!("{name}=env:{v}")),
        PinSource::Value(_) => None,
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
