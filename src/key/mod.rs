//! The hardware key layer: one abstraction over keys that live in a PKCS#11 token or a TPM 2.0.
//!
//! A [`Key`] knows its algorithm and public key and can sign; the private key never leaves the
//! device in any code path (keys are created sensitive and non-extractable, and no function here
//! reads private key material). Backends implement [`KeyBackend`]; the rustls and rcgen adapters
//! ([`tls`], [`rcgen_signer`]) sit on top and never the other way round.
//!
//! Concurrency: [`Key::sign`] is blocking and may be called from many threads at once. The
//! PKCS#11 backend runs concurrent signatures on a pool of sessions (one per signer at a time);
//! the TPM backend serialises them on the single thread that owns the TPM context. Async callers
//! must not call `sign` on a runtime worker without `block_in_place` (the rustls adapter does so).

pub mod algorithm;
pub mod attestation;
mod backends;
pub mod der;
mod error;
pub mod p11kit;
pub mod pin;
pub mod pin_memory;
#[cfg(feature = "pkcs11")]
pub mod pkcs11;
pub mod protection;
pub(crate) mod pss;
pub mod rcgen_signer;
pub mod signing_path;
pub mod tls;
#[cfg(feature = "tpm")]
pub mod tpm;
pub mod uri;
pub mod verify;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use algorithm::{HashAlg, KeyAlgorithm, SignScheme};
pub use error::{Cause, KeyError, Malformation, ParentProblem, Tss2Problem, Unusable};
pub use protection::{KeyPolicy, Protection};
pub use signing_path::SigningPath;
pub use uri::{KeyUri, KeyUriParser, Pkcs11Uri, TpmKeyLocation, TpmUri};

/// What a hardware backend provides. One job: sign inside the device.
pub trait KeyBackend: Send + Sync + fmt::Debug {
    /// The key pair's algorithm.
    fn algorithm(&self) -> KeyAlgorithm;

    /// The DER SubjectPublicKeyInfo of the key.
    fn spki_der(&self) -> &[u8];

    /// Signs `message` (the whole message; the backend hashes) with `scheme`, which the caller
    /// has checked is one of `algorithm().schemes()`. ECDSA results are DER.
    fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError>;

    /// A short human description ("PKCS#11 token 'kube', object 'alice'").
    fn describe(&self) -> String;

    /// The certificate chain stored with the key (DER, leaf first), if any.
    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError>;

    /// Session-level counters, for backends that have sessions.
    fn session_stats(&self) -> Option<SessionStats> {
        None
    }

    /// What the device says about whether the private key can leave it.
    fn protection(&self) -> Result<Protection, KeyError>;

    /// TPM2_Certify evidence for this key by the attestation key at persistent handle
    /// `ak_handle`, bound to `qualifying_data`. Only TPM keys can be certified.
    fn certify(
        &self,
        ak_handle: u32,
        qualifying_data: &[u8],
    ) -> Result<attestation::TpmEvidence, KeyError> {
        let _ = (ak_handle, qualifying_data);
        Err(KeyError::NotAttestable {
            key: self.describe(),
        })
    }

    /// How signatures are made (decided when the key was opened). Backends whose RSA keys can
    /// lack PSS say so here; the default is the device's own mechanisms.
    fn signing_path(&self) -> SigningPath {
        SigningPath::Native
    }
}

/// Counters of a backend's session pool: tests use them as a speed-independent proof of
/// parallelism (how many sessions were in use at the same moment).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Sessions opened since the key was opened (reopens after a token reset included).
    pub opened: u64,
    /// The largest number of sessions signing at the same moment.
    pub peak_in_use: u64,
    /// Sessions that the token invalidated and that were replaced.
    pub recovered: u64,
}

/// An opened hardware key, ready to sign from any thread.
#[derive(Debug)]
pub struct Key {
    uri: KeyUri,
    backend: Box<dyn KeyBackend>,
    signatures: AtomicU64,
    failures: AtomicU64,
    /// The error of the latest signature attempt, if it failed (None after a success): health
    /// checks must see a key that stopped working, not only one that once worked.
    last_error: std::sync::Mutex<Option<String>>,
    /// Whether `last_error` holds an error (read without the lock).
    failing: AtomicBool,
}

/// One entry of `hwkey key list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyListing {
    /// A URI that opens exactly this key.
    pub uri: KeyUri,
    /// Its algorithm.
    pub algorithm: KeyAlgorithm,
    /// Whether a certificate is stored with it.
    pub has_certificate: bool,
}

impl Key {
    /// Opens the key a URI names. The PIN (if any) is read and used once, here.
    pub fn open(uri: &KeyUri) -> Result<Key, KeyError> {
        Ok(Key::from_backend(uri.clone(), backends::open(uri)?))
    }

    /// Creates a new key on the device and opens it. Refuses if the name is taken.
    pub fn create(uri: &KeyUri, algorithm: KeyAlgorithm) -> Result<Key, KeyError> {
        Ok(Key::from_backend(
            uri.clone(),
            backends::create(uri, algorithm)?,
        ))
    }

    fn from_backend(uri: KeyUri, backend: Box<dyn KeyBackend>) -> Key {
        Key {
            uri,
            backend,
            signatures: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_error: std::sync::Mutex::new(None),
            failing: AtomicBool::new(false),
        }
    }

    /// The URI the key was opened with.
    pub fn uri(&self) -> &KeyUri {
        &self.uri
    }

    /// The key pair's algorithm.
    pub fn algorithm(&self) -> KeyAlgorithm {
        self.backend.algorithm()
    }

    /// The DER SubjectPublicKeyInfo.
    pub fn spki_der(&self) -> &[u8] {
        self.backend.spki_der()
    }

    /// The public key as a PEM `PUBLIC KEY` block.
    pub fn public_key_pem(&self) -> String {
        der::to_pem("PUBLIC KEY", self.spki_der())
    }

    /// A short description for logs and messages.
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// How this key's signatures are made (native, software PSS over raw RSA, PKCS#1 only).
    pub fn signing_path(&self) -> SigningPath {
        self.backend.signing_path()
    }

    /// The schemes this key can sign with, in order of preference: the algorithm's schemes
    /// that its signing path can make (a PKCS#1-only token offers no RSA-PSS).
    pub fn schemes(&self) -> Vec<SignScheme> {
        let path = self.signing_path();
        self.algorithm()
            .schemes()
            .iter()
            .copied()
            .filter(|s| path.offers(*s))
            .collect()
    }

    /// Signs inside the hardware. Blocking; safe to call from many threads at once.
    pub fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        let algorithm = self.algorithm();
        if !algorithm.schemes().contains(&scheme) || !self.signing_path().offers(scheme) {
            return Err(KeyError::UnsupportedScheme {
                key: self.describe(),
                algorithm: algorithm.to_string(),
                scheme: scheme.to_string(),
            });
        }
        let result = self.backend.sign(scheme, message);
        // The error slot is locked only when it changes: signing threads share this key, and a
        // lock taken on every signature made them queue behind each other.
        match &result {
            Ok(_) => {
                self.signatures.fetch_add(1, Ordering::Relaxed);
                if self.failing.load(Ordering::Relaxed) {
                    let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
                    *last = None;
                    self.failing.store(false, Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
                *last = Some(e.to_string());
                self.failing.store(true, Ordering::Relaxed);
            }
        }
        result
    }

    /// How many signature attempts failed since the key was opened.
    pub fn signature_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The error of the latest signature attempt when it failed; None when it succeeded (or
    /// none was made).
    pub fn last_signature_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many signatures this key has made since it was opened.
    pub fn signatures(&self) -> u64 {
        self.signatures.load(Ordering::Relaxed)
    }

    /// Session pool counters (PKCS#11 only).
    pub fn session_stats(&self) -> Option<SessionStats> {
        self.backend.session_stats()
    }

    /// The certificate chain stored with the key (DER, leaf first), if any.
    pub fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        self.backend.stored_chain()
    }

    /// TPM2_Certify evidence for this key (TPM keys only), bound to `qualifying_data`.
    pub fn certify(
        &self,
        ak_handle: u32,
        qualifying_data: &[u8],
    ) -> Result<attestation::TpmEvidence, KeyError> {
        self.backend.certify(ak_handle, qualifying_data)
    }

    /// What the device says about whether the private key can leave it.
    pub fn protection(&self) -> Result<Protection, KeyError> {
        self.backend.protection()
    }

    /// The `--require-non-extractable` policy: fails, naming the reasons, when the device says
    /// the private key could leave it (or may exist outside it). Does nothing when `required`
    /// is false.
    pub fn require_non_extractable(&self, required: bool) -> Result<(), KeyError> {
        if !required {
            return Ok(());
        }
        self.protection()?.require_non_extractable(&self.describe())
    }
}

pub use backends::{activate, delete, enroll, list, store_chain};
