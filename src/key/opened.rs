//! An opened hardware key: the backend behind it, and the counters every signature updates.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::backend::{KeyBackend, SessionStats};
use super::{
    attestation, backends, der, KeyAlgorithm, KeyError, KeyUri, Protection, Purpose, SignScheme,
    SigningPath,
};
use crate::key::CapabilityError;

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
    /// Signatures a signer refused, by purpose (see [`Purpose`]).
    refused: [AtomicU64; 3],
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

    /// A key served by `backend` (the signer's remote key, or a device backend).
    pub fn from_backend(uri: KeyUri, backend: Box<dyn KeyBackend>) -> Key {
        Key {
            uri,
            backend,
            signatures: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_error: std::sync::Mutex::new(None),
            failing: AtomicBool::new(false),
            refused: Default::default(),
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

    /// Signs inside the hardware. Blocking; safe to call from many threads at once. A key
    /// served by a signer process signs only through [`Key::sign_for`].
    pub fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        self.check_scheme(scheme)?;
        let result = self.backend.sign(scheme, message);
        self.count(result)
    }

    /// Signs `message` for `purpose` (see [`Purpose`]): what every signature the proxy and the
    /// lifecycle make goes through, so a signer can refuse anything else. Blocking.
    pub fn sign_for(
        &self,
        purpose: Purpose,
        scheme: SignScheme,
        message: &[u8],
    ) -> Result<Vec<u8>, KeyError> {
        self.check_scheme(scheme)?;
        let result = self.backend.sign_for(purpose, scheme, message);
        if matches!(result, Err(KeyError::SignerRefused { .. })) {
            use crate::metric_labels::LabelValue as _;
            if let Some(n) = self.refused.get(purpose.index()) {
                n.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count(result)
    }

    fn check_scheme(&self, scheme: SignScheme) -> Result<(), KeyError> {
        let algorithm = self.algorithm();
        if !algorithm.schemes().contains(&scheme) || !self.signing_path().offers(scheme) {
            return Err(KeyError::Capability(CapabilityError::UnsupportedScheme {
                key: self.describe(),
                algorithm: algorithm.to_string(),
                scheme: scheme.to_string(),
            }));
        }
        Ok(())
    }

    /// Counts a signature attempt and remembers its error.
    fn count(&self, result: Result<Vec<u8>, KeyError>) -> Result<Vec<u8>, KeyError> {
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

    /// Signatures a signer refused since the key was opened, by purpose.
    pub fn signer_refusals(&self) -> Vec<(Purpose, u64)> {
        use crate::metric_labels::LabelValue as _;
        Purpose::ALL
            .iter()
            .map(|p| {
                let n = self
                    .refused
                    .get(p.index())
                    .map_or(0, |n| n.load(Ordering::Relaxed));
                (*p, n)
            })
            .collect()
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

    /// The key's PIV attestation (slot certificate, device f9 certificate), when its device
    /// has one: what `hwkey csr` and renewals attach as hardware proof.
    pub fn piv_attestation(&self) -> Result<Option<super::PivAttestationCerts>, KeyError> {
        self.backend.piv_attestation()
    }

    /// The certificate chain stored with the key (DER, leaf first), if any.
    pub fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        self.backend.stored_chain()
    }

    /// Stores `chain` (DER, leaf first) with the key; says where.
    pub fn store_chain(&self, chain: &[Vec<u8>]) -> Result<String, KeyError> {
        self.backend.store_chain(&self.uri, chain)
    }

    /// Installs `chain` (DER, leaf first) in the identity's certificate file through the key's
    /// signer (keeping the file's previous content as `FILE.prev` when `keep_previous`); says
    /// where. Only a signer's key can: the signer checks the chain is for this key and its
    /// identity.
    pub fn install_certificate(
        &self,
        chain: &[Vec<u8>],
        keep_previous: bool,
    ) -> Result<String, KeyError> {
        self.backend.install_certificate(chain, keep_previous)
    }

    /// Deletes the key from its device (with its public key and certificates); says what was
    /// removed.
    pub fn destroy(&self) -> Result<Vec<String>, KeyError> {
        self.backend.destroy(&self.uri)
    }

    /// Marks this key as the one in use (after a rotation): a signer never deletes it.
    /// Blocking (a round trip to a signer).
    pub fn mark_in_use(&self) -> Result<(), KeyError> {
        self.backend.mark_in_use()
    }

    /// Creates and opens the next key of this key's rotation series (`--rotate-key`).
    pub fn create_next(&self) -> Result<Key, KeyError> {
        let (uri, backend) = self.backend.create_next(&self.uri)?;
        Ok(Key::from_backend(uri, backend))
    }

    /// TPM2_Certify evidence for this key (TPM keys only) for a request with the DER subject
    /// `subject_der` made at `made_at` (see [`KeyBackend::certify_request`]).
    pub fn certify_request(
        &self,
        ak_handle: u32,
        subject_der: &[u8],
        made_at: u64,
    ) -> Result<attestation::TpmEvidence, KeyError> {
        self.backend
            .certify_request(ak_handle, subject_der, made_at)
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
