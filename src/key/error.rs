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

    #[error("{what} is malformed: {problem}")]
    Malformed {
        what: String,
        #[source]
        problem: Malformation,
    },

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("the certificate for {subject} holds a different public key than {key}: use the certificate issued for this key (check with `hwkey cert show`)")]
    CertificateMismatch { key: String, subject: String },

    #[error("the signer refused to sign: {reason} (the key signs only TLS handshakes, requests for its own identity and health checks)")]
    SignerRefused { reason: String },

    #[error("{message}")]
    Signer { message: String },

    #[error("{0}")]
    Pin(#[from] PinError),

    #[error("{0}")]
    Locate(#[from] LocateError),

    #[error("{0}")]
    Capability(#[from] CapabilityError),

    #[error("{0}")]
    Device(#[from] DeviceError),
}

impl KeyError {
    /// Whether this is a PIN or password refusal: the device refused it (a PKCS#11 PIN, a TPM
    /// key's authValue), hwkey refused to present one refused before, or the signer process
    /// reported such a refusal. Callers must not retry without a new PIN; hwkey exits
    /// [`crate::key::pin::EXIT_PIN_REFUSED`] on it, so a supervisor does not restart into the
    /// device's lockout.
    pub fn is_pin_refusal(&self) -> bool {
        matches!(self, KeyError::Pin(p) if p.is_refusal())
    }
}

/// A PIN or key password that is missing, unreadable, or refused (by the device, or by hwkey
/// because the device refused it before): [`PinError::is_refusal`] says which must not be
/// retried.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum PinError {
    #[error("token '{token}' needs a PIN: add pin-source=file:/path/to/pin or pin-source=env:VAR to the URI")]
    Required { token: String },

    #[error("cannot read the PIN from {source_desc}: {reason}")]
    Unreadable { source_desc: String, reason: String },

    #[error("the PIN from {source_desc} is {} and token '{token}' takes PINs of {min} to {max} bytes, so hwkey did not present it (a wrong PIN spends one of the token's few attempts): put the PIN into {source_desc}", if *.len == 0 { "empty".to_string() } else { format!("{} bytes long", .len) })]
    Length {
        token: String,
        source_desc: String,
        len: usize,
        min: usize,
        max: usize,
    },

    #[error("the PIN for token '{token}' was rejected (CKR_PIN_INCORRECT); hwkey made exactly one attempt and, because tokens lock after a few wrong PINs, will not present this PIN again (in any process) until its source changes: fix the PIN source and try again")]
    Incorrect { token: String },

    #[error("the PIN from {source_desc} was rejected by token '{token}' before (CKR_PIN_INCORRECT), so hwkey did not present it again: tokens lock after a few wrong PINs. Fix the PIN in {source_desc} (hwkey tries a changed PIN once), or, if the token's PIN was changed instead, delete {}", .record.display())]
    Remembered {
        token: String,
        source_desc: String,
        record: PathBuf,
    },

    #[error("cannot use the rejected-PIN memory in {} ({reason}): hwkey presents a PIN only where it can remember a rejection, because tokens lock after a few wrong PINs. Make that directory writable by this user, or point HWKEY_PIN_STATE_DIR at one that is", .dir.display())]
    Memory { dir: PathBuf, reason: String },

    #[error("token '{token}' has one user-PIN attempt left (CKF_USER_PIN_FINAL_TRY): hwkey will not spend it, because a wrong PIN now locks the token. Check the PIN, then allow this one attempt with HWKEY_ALLOW_FINAL_PIN_TRY=1")]
    FinalTry { token: String },

    #[error("token '{token}' has locked its user PIN (CKR_PIN_LOCKED): unlock it with the SO PIN (e.g. `softhsm2-util` / `pkcs11-tool --unlock-pin`)")]
    Locked { token: String },

    #[error("{key} has a password (authValue): add pin-source=file:/path/to/password or pin-source=env:VAR to the key URI")]
    TpmAuthRequired { key: String },

    #[error("the TPM refused the password of {key} (TPM_RC_AUTH_FAIL): every wrong password counts toward the TPM's dictionary-attack lockout, after which the TPM refuses all password use for a while, so hwkey presents this password no more until its source changes. Fix the password source; `tpm2_getcap properties-variable` shows the failure counter, `tpm2_dictionarylockout --clear-lockout` (with the lockout password) resets it")]
    TpmAuthRejected { key: String },

    #[error("the TPM refused the owner-hierarchy authorization for {operation}: if the owner hierarchy has a password (set with `tpm2_changeauth -c owner`), give it with owner-pin-source=file:/path/to/password or owner-pin-source=env:VAR on the tpm: URI; if one was given, it is not the owner password")]
    TpmOwnerAuthRefused { operation: &'static str },

    #[error("the password from {source_desc} was refused for {key} before, so hwkey did not present it again: the TPM's dictionary-attack lockout counts every wrong password. Fix the password in {source_desc} (a changed password is tried once), or, if the key's password was changed instead, delete {}", .record.display())]
    TpmAuthRemembered {
        key: String,
        source_desc: String,
        record: PathBuf,
    },

    #[error("{message}")]
    SignerRefused { message: String },
}

/// The module, token or key a URI names cannot be found (or is already there).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum LocateError {
    #[error("no PKCS#11 module given: add module-name=NAME (a module p11-kit registers, e.g. softhsm2) or module-path=/path/to/module.so to the URI's query, set HWKEY_PKCS11_MODULE, or install p11-kit's proxy module (p11-kit-modules)")]
    NoModule,

    #[error("no PKCS#11 module is registered as '{name}' (module-name=): registered: {}; p11-kit reads NAME.module files in {}{}", list_or_none(.known), .dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", "), if *.user_skipped { " (not ~/.config/pkcs11/modules: as p11-kit does, hwkey reads no user module files as root or with P11_NO_USER_CONFIG)" } else { "" })]
    UnknownModuleName {
        name: String,
        known: Vec<String>,
        dirs: Box<[PathBuf]>,
        user_skipped: bool,
    },

    #[error("{} registers module '{name}' but names no library for hwkey (no `module:` line, or `enable-in`/`disable-in` leave hwkey out)", .file.display())]
    ModuleNameUnusable { name: String, file: PathBuf },

    #[error("cannot load PKCS#11 module {path}: {reason}; check module-path (is the package installed? e.g. apt-get install softhsm2)")]
    ModuleLoad { path: PathBuf, reason: String },

    #[error("token '{token}' not found in module {module}; tokens present: {}", list_or_none(.present))]
    TokenNotFound {
        token: String,
        module: PathBuf,
        present: Vec<String>,
    },

    #[error("{} tokens in {module} fit '{token}' (serial numbers {}): add serial=SERIAL to the URI so one token is meant", .serials.len(), .serials.join(", "))]
    AmbiguousToken {
        token: String,
        module: PathBuf,
        serials: Vec<String>,
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

    #[error("{key} on {place} has no public-key object, no certificate with its CKA_ID, and no CKA_EC_POINT of its own, so its public key is unknown: write its public key or certificate to the token with the same CKA_ID (e.g. `pkcs11-tool --write-object cert.der --type cert --id ID`)")]
    NoPublicKey { key: String, place: String },

    #[error("{what} already exists on {place}: choose another object/id/path, or delete it first with `hwkey key delete --yes`")]
    KeyExists { what: String, place: String },

    #[error("the URI names no key: add object=LABEL or id=%XX (or path=/ handle= for a TPM)")]
    NoKeySelected,

    #[error("the TPM's persistent handle {parent:#010x} {problem}; hwkey never changes a persistent handle it did not make")]
    TpmParent {
        parent: u32,
        #[source]
        problem: ParentProblem,
    },
}

/// What this key, its device or this build cannot do.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum CapabilityError {
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

    #[error("{key} asks for the PIN at every signature (CKA_ALWAYS_AUTHENTICATE), and the token does not offer {missing}, which hwkey signs such keys with (it re-authenticates between C_SignInit and the data, so the token must hash); use a key without PIN-always, or a token that offers {missing}")]
    NoReauthMechanism { key: String, missing: &'static str },

    #[error("{key} has no place beside it to store a certificate chain: keep the chain in a PEM file and pass it with --cert FILE")]
    TpmNoChainStore { key: String },

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

/// The device or its library failed while doing what was asked.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum DeviceError {
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

    #[error("{token} has no session left for hwkey (CKR_SESSION_COUNT): other applications hold all the sessions it allows; close some of them (or their sessions) and try again")]
    SessionLimit { token: String },

    #[error("cannot open the TPM through TCTI '{tcti}': {reason}; check that the TPM (or swtpm) is running and the tcti= value (or TPM2TOOLS_TCTI) is right")]
    TpmConnect {
        tcti: String,
        reason: String,
        /// tss-esapi's error, when the TSS reported one.
        #[source]
        source: Option<Cause>,
    },

    /// `reason` explains the TPM response code in words (`rc::describe_error`); `source` is
    /// tss-esapi's error itself, when there is one.
    #[error("TPM {operation} failed: {reason}")]
    Tpm {
        operation: &'static str,
        reason: String,
        #[source]
        source: Option<Cause>,
    },

    #[error("TPM key file {path} is not a usable TSS2 PRIVATE KEY: {problem}")]
    Tss2Pem {
        path: PathBuf,
        #[source]
        problem: Tss2Problem,
    },

    #[error("{key} cannot be used by hwkey: {problem}")]
    TpmKeyUnusable {
        key: String,
        #[source]
        problem: Unusable,
    },

    #[error(
        "{key} made a {scheme} signature that does not verify against its own public key: {hint}"
    )]
    TpmBadSignature {
        key: String,
        scheme: String,
        hint: String,
    },
}

impl PinError {
    /// Whether the PIN was refused (by the device, by hwkey's memory of a refusal, by its
    /// length, or by the signer process reporting one): retrying with the same PIN spends the
    /// device's few attempts, so callers stop until the PIN source changes.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            PinError::Incorrect { .. }
                | PinError::Remembered { .. }
                | PinError::Length { .. }
                | PinError::FinalTry { .. }
                | PinError::Locked { .. }
                | PinError::TpmAuthRejected { .. }
                | PinError::TpmAuthRemembered { .. }
                | PinError::SignerRefused { .. }
        )
    }
}

/// What is wrong with a persistent storage key named as a parent, for [`KeyError::Locate(LocateError::TpmParent)`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ParentProblem {
    #[error("holds no object (persistent handles present: {present})")]
    Missing { present: String },
    #[error("holds a key that is not a storage key (not a restricted decryption key), so no key can be made or loaded under it: name a storage key, e.g. an SRK made with `tpm2_createprimary -C o -c srk.ctx` and `tpm2_evictcontrol -C o -c srk.ctx 0x81000001`")]
    NotAStorageKey,
    #[error("holds a storage key other than the one this key file was made under (it was replaced, or made with another template): put that storage key back at this handle, or make a new key")]
    NotTheParent,
}

/// Why a key cannot be used, for [`KeyError::Device(DeviceError::TpmKeyUnusable)`] (and a TSS2 key file's
/// [`Tss2Problem::Unusable`]).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum Unusable {
    #[error("it is a storage (parent) key, not a signing key")]
    Storage,
    #[error("it is not a signing key (the sign attribute is clear)")]
    NotSigning,
    #[error("it is a restricted signing key (an attestation key): it signs only data the TPM produced, never a TLS handshake")]
    Restricted,
    #[error("it can only be used through a policy session (userWithAuth is clear), which hwkey does not support")]
    PolicyOnly,
    #[error("its curve {0} is not supported (use NIST P-256 or P-384)")]
    Curve(String),
    #[error("its scheme {0} is not ECDSA")]
    EcScheme(String),
    #[error("its scheme {0} is not a signature scheme")]
    RsaScheme(String),
    #[error("it is not an RSA or EC key")]
    NotRsaOrEc,
    #[error("its public area holds no modulus")]
    NoModulus,
    #[error("a {len}-byte value where at most {max} bytes fit")]
    TooLong { len: usize, max: usize },
    #[error("{0}")]
    Spki(#[source] Box<KeyError>),
    #[error("it is not an attestation key (a restricted signing key); choose another --ak-handle")]
    NotAttestationKey,
    #[error("another key was stored at this handle since hwkey opened it; open the key again (and check its certificate)")]
    ReplacedAtHandle,
    #[error("the token now holds another key under this label/id (deleted and created again since hwkey opened it, or a token that came back with another key); hwkey signs with no key but the one it opened: open the key again (restart) and check its certificate")]
    ReplacedOnToken,
    #[error("{0}; hwkey deletes only signing keys (other keys may depend on this object: evict it with tpm2_evictcontrol if you really mean to)")]
    NotDeletable(#[source] Box<Unusable>),
}

/// What is malformed in a key's, signature's or certificate's encoding, for
/// [`KeyError::Malformed`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum Malformation {
    #[error("an RSA key has no EC point")]
    NoEcPoint,
    #[error("expected an uncompressed {alg} point of {expected} bytes, got {got} bytes")]
    PointLength {
        alg: String,
        expected: usize,
        got: usize,
    },
    #[error("not DER: {0}")]
    NotDer(#[source] x509_parser::error::X509Error),
    #[error("{0}")]
    Certificate(#[source] x509_parser::error::X509Error),
    #[error("{0}")]
    Asn1(#[source] yasna::ASN1Error),
    #[error("unsupported curve OID {0}")]
    UnsupportedCurve(String),
    #[error("unsupported key algorithm OID {0}")]
    UnsupportedAlgorithm(String),
    #[error("raw r||s of odd length {0}")]
    OddSignature(usize),
    #[error("neither a raw point nor a DER OCTET STRING: {0}")]
    NotAPoint(#[source] yasna::ASN1Error),
    #[error("not PEM: {0}")]
    NotPem(#[source] Box<pem::PemError>),
    #[error("it is empty")]
    Empty,
    #[error(
        "it holds no CERTIFICATE block: store the certificate chain again, or delete the file"
    )]
    NoCertificateBlock,
    #[error("too short")]
    TooShort,
    #[error("unsupported nameAlg {0:#06x}")]
    NameAlg(u16),
    #[error("the TPM returned no session")]
    NoSession,
    #[error("the token did not return its public attributes")]
    NoPublicAttributes,
    #[error("not an ECC key")]
    NotEcc,
    #[error(
        "neither an RSA-2048 EK's encrypted seed (256 bytes) nor an ECC P-256 EK's ephemeral point"
    )]
    NotAnEkSecret,
    #[error("{0}")]
    Unusable(#[source] Unusable),
    #[error("{0}")]
    Tpm(#[source] Cause),
}

/// What is wrong with a TSS2 PRIVATE KEY file, for [`KeyError::Device(DeviceError::Tss2Pem)`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum Tss2Problem {
    #[error("not PEM: {0}")]
    NotPem(#[source] Box<pem::PemError>),
    #[error("no -----BEGIN TSS2 PRIVATE KEY----- block in the file")]
    NoBlock,
    #[error("no -----BEGIN TSS2 PRIVATE KEY----- block; the file holds: {0}")]
    OtherBlocks(String),
    #[error("not the TSS2 key ASN.1 structure: {0}")]
    NotAsn1(#[source] yasna::ASN1Error),
    #[error("it is an importable key (2.23.133.10.1.4), which must be imported into the TPM before use; hwkey reads loadable keys (2.23.133.10.1.3)")]
    Importable,
    #[error("it holds sealed data (2.23.133.10.1.5), not a key")]
    SealedData,
    #[error("unknown key type {0}; hwkey reads loadable keys (2.23.133.10.1.3)")]
    UnknownType(String),
    #[error("emptyAuth is not a BOOLEAN: {0}")]
    EmptyAuthNotBool(#[source] yasna::ASN1Error),
    #[error("the key requires a policy session (policy/authPolicy fields); hwkey only uses keys with an empty password and no policy")]
    Policy,
    #[error("the key has an import secret (an importable key); import it first")]
    ImportSecret,
    #[error("the key has a password (emptyAuth is not TRUE); hwkey only uses keys with an empty password: create the key without one")]
    Password,
    #[error("parent {0:#x} is not a 32-bit TPM handle")]
    Parent(u64),
    #[error("pubkey is not a TPM2B_PUBLIC: {0}")]
    Pubkey(#[source] Cause),
    #[error("privkey is not a TPM2B_PRIVATE: {0}")]
    Privkey(#[source] Cause),
    #[error("{0} is shorter than a TPM2B size field")]
    ShortTpm2b(&'static str),
    #[error("{field} says it holds {size} bytes but {got} follow")]
    Tpm2bSize {
        field: &'static str,
        size: usize,
        got: usize,
    },
    #[error("a TPM2B body over 65535 bytes")]
    TooLarge,
    #[error("cannot marshal the public area: {0}")]
    Marshal(#[source] Cause),
    #[error("{0}")]
    Unusable(#[source] Unusable),
    #[error("it is not a TSS2 key file, so hwkey will not delete it")]
    NotTss2File,
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
