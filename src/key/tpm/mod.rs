//! TPM 2.0 backend (placeholder until the backend lands).

use super::{KeyAlgorithm, KeyBackend, KeyError, KeyListing, SignScheme, TpmUri};

/// A key inside a TPM.
#[derive(Debug)]
pub struct TpmKey {
    _private: (),
}

fn unbuilt() -> KeyError {
    KeyError::Unsupported("the TPM backend is not built yet".into())
}

/// Opens a TPM key.
pub fn open(_uri: &TpmUri) -> Result<TpmKey, KeyError> {
    Err(unbuilt())
}
/// Creates a TPM key.
pub fn create(_uri: &TpmUri, _alg: KeyAlgorithm) -> Result<TpmKey, KeyError> {
    Err(unbuilt())
}
/// Lists TPM keys.
pub fn list(_uri: &TpmUri) -> Result<Vec<KeyListing>, KeyError> {
    Err(unbuilt())
}
/// Deletes a TPM key.
pub fn delete(_uri: &TpmUri) -> Result<Vec<String>, KeyError> {
    Err(unbuilt())
}
/// Stores a chain beside a TPM key.
pub fn store_chain(_uri: &TpmUri, _chain: &[Vec<u8>]) -> Result<String, KeyError> {
    Err(unbuilt())
}

impl KeyBackend for TpmKey {
    fn algorithm(&self) -> KeyAlgorithm {
        KeyAlgorithm::EcP256
    }
    fn spki_der(&self) -> &[u8] {
        &[]
    }
    fn sign(&self, _scheme: SignScheme, _message: &[u8]) -> Result<Vec<u8>, KeyError> {
        Err(unbuilt())
    }
    fn describe(&self) -> String {
        "TPM key".into()
    }
    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        Ok(None)
    }
}
