//! What a hardware backend provides: the one trait PKCS#11 and the TPM implement, and what
//! they report.

use std::fmt;

use super::{attestation, KeyAlgorithm, KeyError, KeyUri, Protection, SignScheme, SigningPath};

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
