//! The key layer's error type. Hardware errors are mapped here, once, at the backend edge, into
//! variants that say what was wrong and how to fix it.

use std::path::PathBuf;

/// The device library's own error under a [`KeyError`] (cryptoki's or tss-esapi's, depending on
/// the backend; boxed so the error type does not depend on which backends are built).
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong while finding, creating or using a hardware key.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum KeyError {
    #[error("invalid key URI '{uri}': {reason}")]
    InvalidUri { uri: String, reason: String },

    #[error(
        "unknown algorithm '{given}': use one of ec-p256, ec-p384, rsa-2048, rsa-3072, rsa-4096"
    )]
    UnknownAlgorithm { given: String },

    #[error("{backend} keys cannot use algorithm {algorithm}: {hint}")]
    UnsupportedAlgorithm {
        backend: &'static str,
        algorithm: String,
        hint: String,
    },

    #[error("key {key} ({algorithm}) cannot sign with {scheme}")]
    UnsupportedScheme {
        key: String,
        algorithm: String,
        scheme: String,
    },

    #[error("no PKCS#11 module given: add module-path=/path/to/module.so to the URI's query or set HWKEY_PKCS11_MODULE")]
    NoModule,

    #[error("cannot load PKCS#11 module {path}: {reason}; check module-path (is the package installed? e.g. apt-get install softhsm2)")]
    ModuleLoad { path: PathBuf, reason: String },

    #[error("token '{token}' not found in module {module}; tokens present: {}", list_or_none(.present))]
    TokenNotFound {
        token: String,
        module: PathBuf,
        present: Vec<String>,
    },

    #[error("the URI names no token: add token=LABEL (tokens present in {module}: {})", list_or_none(.present))]
    NoTokenSelected {
        module: PathBuf,
        present: Vec<String>,
    },

    #[error("{what} not found on {place}; keys present: {}", list_or_none(.present))]
    KeyNotFound {
        what: String,
        place: String,
        present: Vec<String>,
    },

    #[error("{what} already exists on {place}: choose another object/id/path, or delete it first with `hwkey key delete --yes`")]
    KeyExists { what: String, place: String },

    #[error("the URI names no key: add object=LABEL or id=%XX (or path=/ handle= for a TPM)")]
    NoKeySelected,

    #[error("token '{token}' needs a PIN: add pin-source=file:/path/to/pin or pin-source=env:VAR to the URI")]
    PinRequired { token: String },

    #[error("cannot read the PIN from {source_desc}: {reason}")]
    PinUnreadable { source_desc: String, reason: String },

    #[error("the PIN for token '{token}' was rejected (CKR_PIN_INCORRECT); hwkey made exactly one attempt and, because tokens lock after a few wrong PINs, will not present this PIN again (in any process) until its source changes: fix the PIN source and try again")]
    PinIncorrect { token: String },

    #[error("the PIN from {source_desc} was rejected by token '{token}' before (CKR_PIN_INCORRECT), so hwkey did not present it again: tokens lock after a few wrong PINs. Fix the PIN in {source_desc} (hwkey tries a changed PIN once), or, if the token's PIN was changed instead, delete {}", .record.display())]
    PinRemembered {
        token: String,
        source_desc: String,
        record: PathBuf,
    },

    #[error("cannot use the rejected-PIN memory in {} ({reason}): hwkey presents a PIN only where it can remember a rejection, because tokens lock after a few wrong PINs. Make that directory writable by this user, or point HWKEY_PIN_STATE_DIR at one that is", .dir.display())]
    PinMemory { dir: PathBuf, reason: String },

    #[error("token '{token}' has one user-PIN attempt left (CKF_USER_PIN_FINAL_TRY): hwkey will not spend it, because a wrong PIN now locks the token. Check the PIN, then allow this one attempt with HWKEY_ALLOW_FINAL_PIN_TRY=1")]
    PinFinalTry { token: String },

    #[error("token '{token}' has locked its user PIN (CKR_PIN_LOCKED): unlock it with the SO PIN (e.g. `softhsm2-util` / `pkcs11-tool --unlock-pin`)")]
    PinLocked { token: String },

    /// `reason` names the return value the way PKCS#11 documents it (`CKR_PIN_INCORRECT from
    /// C_Login`); `source` is cryptoki's error itself, for `{:#}` chains and for callers that
    /// match on it (`source.downcast_ref::<cryptoki::error::Error>()`).
    #[error("PKCS#11 {operation} failed on token '{token}': {reason}")]
    Pkcs11 {
        operation: &'static str,
        token: String,
        reason: String,
        #[source]
        source: Option<Cause>,
    },

    #[error("cannot open the TPM through TCTI '{tcti}': {reason}; check that the TPM (or swtpm) is running and the tcti= value (or TPM2TOOLS_TCTI) is right")]
    TpmConnect {
        tcti: String,
        reason: String,
        /// tss-esapi's error, when the TSS reported one.
        #[source]
        source: Option<Cause>,
    },

    /// `reason` explains the TPM response code in words (`rc::describe`); `source` is
    /// tss-esapi's error itself, when there is one.
    #[error("TPM {operation} failed: {reason}")]
    Tpm {
        operation: &'static str,
        reason: String,
        #[source]
        source: Option<Cause>,
    },

    #[error("TPM key file {path} is not a usable TSS2 PRIVATE KEY: {reason}")]
    Tss2Pem { path: PathBuf, reason: String },

    #[error("{key} cannot be used by hwkey: {reason}")]
    TpmKeyUnusable { key: String, reason: String },

    #[error(
        "{key} made a {scheme} signature that does not verify against its own public key: {hint}"
    )]
    TpmBadSignature {
        key: String,
        scheme: String,
        hint: String,
    },

    #[error("{key} has no place beside it to store a certificate chain: keep the chain in a PEM file and pass it with --cert FILE")]
    TpmNoChainStore { key: String },

    #[error("{what} is malformed: {reason}")]
    Malformed { what: String, reason: String },

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("the certificate for {subject} holds a different public key than {key}: use the certificate issued for this key (check with `hwkey cert show`)")]
    CertificateMismatch { key: String, subject: String },

    #[error("{0}")]
    Unsupported(String),

    #[error("{key} could leave its device: {reasons}. A hardware identity needs a key that cannot (create one with `hwkey key create`); to use this key anyway, pass --require-non-extractable=false")]
    Extractable { key: String, reasons: String },

    #[error("{key} cannot be attested: only TPM keys can prove where they live (TPM2_Certify); use a TPM key (tpm:…) or leave out --attest")]
    NotAttestable { key: String },

    #[error("this hwkey was built without the {backend} backend: rebuild it with `cargo build --features {feature}` (both backends are in the default build)")]
    BackendNotBuilt {
        backend: &'static str,
        feature: &'static str,
    },

    #[error("cannot encode an RSA-PSS signature: {reason}")]
    PssEncoding { reason: String },

    #[error("{key} cannot sign a TLS 1.3 handshake: the token offers RSA PKCS#1 v1.5 only (it lacks {missing}), and TLS 1.3 allows RSA keys only RSA-PSS. Ways out: use an EC key (`hwkey key create --algorithm ec-p256`), or allow TLS 1.2 with PKCS#1 v1.5 signatures (--allow-tls12-fallback, config `allow-tls12-fallback = true`)")]
    NoTls13Signature { key: String, missing: &'static str },

    #[error("{key} cannot sign at all: the token lacks {missing}; use a key of another algorithm (e.g. `hwkey key create --algorithm ec-p256`)")]
    NoSignatureMechanism { key: String, missing: &'static str },
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "(none)".to_string()
    } else {
        items
            .iter()
            .map(|s| {
                if s.starts_with('\'') {
                    s.clone()
                } else {
                    format!("'{s}'")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl KeyError {
    /// An I/O error with the action and path that failed.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        KeyError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
