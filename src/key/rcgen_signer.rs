//! rcgen adapter: lets rcgen build CSRs (and test certificates) signed inside the hardware.
//!
//! rcgen's `PublicKeyData::der_bytes` is the SPKI's BIT STRING contents (the EC point or the
//! PKCS#1 RSA key), not the SPKI itself, and rcgen 0.14 knows no RSA-PSS: RSA keys sign CSRs
//! with PKCS#1 v1.5 SHA-256, which every CA accepts.

use std::sync::Arc;

use super::{der, Key, KeyAlgorithm, KeyError, SignScheme};

/// A hardware key as an rcgen `SigningKey`.
#[derive(Debug)]
pub struct RcgenSigner {
    key: Arc<Key>,
    key_bits: Vec<u8>,
    algorithm: &'static rcgen::SignatureAlgorithm,
    scheme: SignScheme,
}

impl RcgenSigner {
    /// Wraps a key; fails only if its SPKI cannot be read.
    pub fn new(key: Arc<Key>) -> Result<RcgenSigner, KeyError> {
        let info = der::parse_spki(key.spki_der())?;
        let (algorithm, scheme) = match key.algorithm() {
            KeyAlgorithm::EcP256 => (&rcgen::PKCS_ECDSA_P256_SHA256, SignScheme::EcdsaP256Sha256),
            KeyAlgorithm::EcP384 => (&rcgen::PKCS_ECDSA_P384_SHA384, SignScheme::EcdsaP384Sha384),
            KeyAlgorithm::Rsa { .. } => (&rcgen::PKCS_RSA_SHA256, SignScheme::RsaPkcs1Sha256),
        };
        Ok(RcgenSigner {
            key,
            key_bits: info.key_bits,
            algorithm,
            scheme,
        })
    }
}

impl rcgen::PublicKeyData for RcgenSigner {
    fn der_bytes(&self) -> &[u8] {
        &self.key_bits
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        self.algorithm
    }
}

impl rcgen::SigningKey for RcgenSigner {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.key
            .sign_for(super::Purpose::CertificateRequest, self.scheme, msg)
            .map_err(|e| {
                tracing::error!("signing with {} failed: {e}", self.key.describe());
                rcgen::Error::RemoteKeyError
            })
    }
}
