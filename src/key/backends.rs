//! Which backend serves a URI. The only place that names both backends, so that each can be
//! compiled out (Cargo features `pkcs11` and `tpm`): a build without one still parses its URIs and
//! answers them with an error that says how to get a build that has it.

#[cfg(feature = "pkcs11")]
use super::pkcs11;
#[cfg(feature = "tpm")]
use super::tpm;
use super::{CapabilityError, KeyAlgorithm, KeyBackend, KeyError, KeyListing, KeyUri};

/// The error for a URI whose backend this build does not contain.
#[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
fn not_built(uri: &KeyUri) -> KeyError {
    let (backend, feature) = match uri {
        KeyUri::Pkcs11(_) => ("PKCS#11", "pkcs11"),
        KeyUri::Tpm(_) => ("TPM 2.0", "tpm"),
    };
    KeyError::Capability(CapabilityError::BackendNotBuilt { backend, feature })
}

/// Opens the key a URI names on its backend.
pub(super) fn open(uri: &KeyUri) -> Result<Box<dyn KeyBackend>, KeyError> {
    match uri {
        #[cfg(feature = "pkcs11")]
        KeyUri::Pkcs11(u) => Ok(Box::new(pkcs11::open(u)?)),
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => Ok(Box::new(tpm::open(u)?)),
        #[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
        _ => Err(not_built(uri)),
    }
}

/// Creates a key on the device a URI names.
pub(super) fn create(
    uri: &KeyUri,
    algorithm: KeyAlgorithm,
) -> Result<Box<dyn KeyBackend>, KeyError> {
    match uri {
        #[cfg(feature = "pkcs11")]
        KeyUri::Pkcs11(u) => Ok(Box::new(pkcs11::create(u, algorithm)?)),
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => Ok(Box::new(tpm::create(u, algorithm)?)),
        #[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
        _ => Err(not_built(uri)),
    }
}

/// Lists the keys on the token or TPM a URI names.
pub fn list(uri: &KeyUri) -> Result<Vec<KeyListing>, KeyError> {
    match uri {
        #[cfg(feature = "pkcs11")]
        KeyUri::Pkcs11(u) => pkcs11::list(u),
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => tpm::list(u),
        #[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
        _ => Err(not_built(uri)),
    }
}

/// Deletes a key and the objects tied to it (public key, certificates). Returns what it removed.
/// Callers must have an explicit confirmation from the user (`--yes`).
pub fn delete(uri: &KeyUri) -> Result<Vec<String>, KeyError> {
    match uri {
        #[cfg(feature = "pkcs11")]
        KeyUri::Pkcs11(u) => pkcs11::delete(u),
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => tpm::delete(u),
        #[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
        _ => Err(not_built(uri)),
    }
}

/// Makes sure the TPM a URI names has an attestation key at `ak_handle` and returns what an
/// operator registers for it. PKCS#11 tokens offer no attestation hwkey can check.
pub fn enroll(
    uri: &KeyUri,
    ak_handle: u32,
    ek: Option<super::attestation::EkKind>,
) -> Result<super::attestation::Enrollment, KeyError> {
    match uri {
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => tpm::enroll(u, ak_handle, ek),
        KeyUri::Pkcs11(_) => {
            let _ = (ak_handle, ek);
            Err(KeyError::Capability(CapabilityError::NotAttestable {
                key: format!("the PKCS#11 key {uri}"),
            }))
        }
        #[cfg(not(feature = "tpm"))]
        KeyUri::Tpm(_) => Err(not_built(uri)),
    }
}

/// Credential activation on the TPM `uri` names (see `key::tpm::credential`): the secret a verifier
/// encrypted to its EK for the AK at `ak_handle`.
pub fn activate(
    uri: &KeyUri,
    ak_handle: u32,
    credential_blob: &[u8],
    encrypted_secret: &[u8],
) -> Result<zeroize::Zeroizing<Vec<u8>>, KeyError> {
    match uri {
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => tpm::activate(u, ak_handle, credential_blob, encrypted_secret),
        KeyUri::Pkcs11(_) => {
            let _ = (ak_handle, credential_blob, encrypted_secret);
            Err(KeyError::Capability(CapabilityError::NotAttestable {
                key: format!("the PKCS#11 key {uri}"),
            }))
        }
        #[cfg(not(feature = "tpm"))]
        KeyUri::Tpm(_) => Err(not_built(uri)),
    }
}

/// Stores a certificate chain (DER, leaf first) with the key; the caller has checked that the
/// leaf matches the key. Replaces a chain stored before. Returns where it was stored.
pub fn store_chain(uri: &KeyUri, chain: &[Vec<u8>]) -> Result<String, KeyError> {
    match uri {
        #[cfg(feature = "pkcs11")]
        KeyUri::Pkcs11(u) => pkcs11::store_chain(u, chain),
        #[cfg(feature = "tpm")]
        KeyUri::Tpm(u) => tpm::store_chain(u, chain),
        #[cfg(not(all(feature = "pkcs11", feature = "tpm")))]
        _ => Err(not_built(uri)),
    }
}
