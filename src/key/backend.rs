//! What a hardware backend provides: the one trait PKCS#11 and the TPM implement, and what
//! they report.

use std::fmt;

use super::{
    attestation, KeyAlgorithm, KeyError, KeyUri, Protection, Purpose, SignScheme, SigningPath,
};
use crate::key::CapabilityError;

/// What a hardware backend provides. One job: sign inside the device.
pub trait KeyBackend: Send + Sync + fmt::Debug {
    /// The key pair's algorithm.
    fn algorithm(&self) -> KeyAlgorithm;

    /// The DER SubjectPublicKeyInfo of the key.
    fn spki_der(&self) -> &[u8];

    /// Signs `message` (the whole message; the backend hashes) with `scheme`, which the caller
    /// has checked is one of `algorithm().schemes()`. ECDSA results are DER.
    fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError>;

    /// Signs `message` for `purpose`. A backend in this process signs any message (its caller
    /// is this process's own code); the signer's remote key passes the purpose on, and the
    /// signer refuses a message that does not have that purpose's shape.
    fn sign_for(
        &self,
        purpose: Purpose,
        scheme: SignScheme,
        message: &[u8],
    ) -> Result<Vec<u8>, KeyError> {
        let _ = purpose;
        self.sign(scheme, message)
    }

    /// TPM2_Certify evidence for a request with the DER subject `subject_der` made at `made_at`
    /// (Unix seconds): the qualifying data binds both and this key's public key
    /// ([`attestation::qualifying_data`]). Computed here in this process; a signer computes it
    /// itself after checking that the subject is its identity's and the time is now.
    fn certify_request(
        &self,
        ak_handle: u32,
        subject_der: &[u8],
        made_at: u64,
    ) -> Result<attestation::TpmEvidence, KeyError> {
        let binding = attestation::qualifying_data(subject_der, self.spki_der(), made_at);
        self.certify(ak_handle, &binding)
    }

    /// Stores `chain` (DER, leaf first) with this key, `uri`: PKCS#11 certificate objects, or
    /// `NAME.crt.pem` beside a TPM key file. Says where.
    fn store_chain(&self, uri: &KeyUri, chain: &[Vec<u8>]) -> Result<String, KeyError> {
        super::backends::store_chain(uri, chain)
    }

    /// Installs `chain` in the certificate file of this key's signer (see
    /// [`super::Key::install_certificate`]): only a key held by a signer has one.
    fn install_certificate(
        &self,
        chain: &[Vec<u8>],
        keep_previous: bool,
    ) -> Result<String, KeyError> {
        let _ = (chain, keep_previous);
        Err(KeyError::Capability(CapabilityError::Unsupported(
            "only a key held by a signer installs its identity's certificate file".into(),
        )))
    }

    /// Deletes this key, `uri`, from its device (with its public key and certificates); says
    /// what was removed.
    fn destroy(&self, uri: &KeyUri) -> Result<Vec<String>, KeyError> {
        super::backends::delete(uri)
    }

    /// Creates the next key of the rotation series of this key, `uri`, on the same device
    /// ([`super::rotation`]), with the same algorithm.
    fn create_next(&self, uri: &KeyUri) -> Result<(KeyUri, Box<dyn KeyBackend>), KeyError> {
        let next = super::rotation::next_key_uri(uri)?;
        let backend = super::backends::create(&next, self.algorithm())?;
        Ok((next, backend))
    }

    /// This key is the one in use from now on (after a rotation): a signer then never deletes
    /// it. Nothing to do in this process.
    fn mark_in_use(&self) -> Result<(), KeyError> {
        Ok(())
    }

    /// A short human description ("PKCS#11 token 'kube', object 'alice'").
    fn describe(&self) -> String;

    /// The certificate chain stored with the key (DER, leaf first), if any.
    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError>;

    /// The key's PIV attestation, when its device exposes one (a YubiKey through its PKCS#11
    /// module): (the slot's attestation certificate, the device's f9 certificate), DER. Public
    /// data; an approver checks it ([`crate::pki::piv`]). None for other devices.
    fn piv_attestation(&self) -> Result<Option<PivAttestationCerts>, KeyError> {
        Ok(None)
    }

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
        Err(KeyError::Capability(CapabilityError::NotAttestable {
            key: self.describe(),
        }))
    }

    /// How signatures are made (decided when the key was opened). Backends whose RSA keys can
    /// lack PSS say so here; the default is the device's own mechanisms.
    fn signing_path(&self) -> SigningPath {
        SigningPath::Native
    }
}

/// A key's PIV attestation as its device gives it (DER each): public data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PivAttestationCerts {
    /// The slot's attestation certificate (its subject key is the key's).
    pub attestation: Vec<u8>,
    /// The device's attestation certificate (slot f9), which signed it.
    pub device: Vec<u8>,
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
