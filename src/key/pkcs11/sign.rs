//! Turning a [`SignScheme`] into a PKCS#11 mechanism and the token's output into the encoding
//! TLS expects.
//!
//! The message is hashed in software and the token gets the most basic mechanism (`CKM_ECDSA`,
//! `CKM_RSA_PKCS`, `CKM_RSA_PKCS_PSS`): every token implements those, while combined
//! hash-and-sign mechanisms are patchy across smart cards. A token without `CKM_RSA_PKCS_PSS`
//! but with `CKM_RSA_X_509` gets the PSS padding from hwkey ([`crate::key::pss`]) and does the
//! raw RSA operation; the caller verifies that result before it is released.

use cryptoki::mechanism::rsa::{PkcsMgfType, PkcsPssParams};
use cryptoki::mechanism::{Mechanism, MechanismType};
use cryptoki::object::ObjectHandle;
use cryptoki::session::Session;

use crate::key::{der, HashAlg, KeyAlgorithm, SignScheme, SigningPath};

/// Signs `message` with `scheme` on `session`. Returns the token's error untouched so the caller
/// can tell an invalidated session from a real failure.
pub(crate) fn sign(
    session: &Session,
    key: ObjectHandle,
    (algorithm, path): (KeyAlgorithm, &SigningPath),
    scheme: SignScheme,
    message: &[u8],
) -> Result<Vec<u8>, SignError> {
    let hash = scheme.hash();
    let digest = hash.digest(message);
    if scheme.is_ecdsa() {
        let raw = session
            .sign(&Mechanism::Ecdsa, key, &digest)
            .map_err(SignError::Token)?;
        return der::ecdsa_raw_to_der(&raw).map_err(SignError::Encoding);
    }
    if let (true, SigningPath::SoftwarePss { .. }, KeyAlgorithm::Rsa { bits }) =
        (scheme.is_pss(), path, algorithm)
    {
        let encoded =
            crate::key::pss::encode(&digest, hash, bits as usize).map_err(SignError::Encoding)?;
        return session
            .sign(&Mechanism::RsaX509, key, &encoded)
            .map_err(SignError::Token);
    }
    if scheme.is_pss() {
        let params = PkcsPssParams {
            hash_alg: hash_mechanism(hash),
            mgf: mgf(hash),
            s_len: (hash.output_len() as u64).into(),
        };
        return session
            .sign(&Mechanism::RsaPkcsPss(params), key, &digest)
            .map_err(SignError::Token);
    }
    let mut info = hash.pkcs1_digest_info_prefix().to_vec();
    info.extend_from_slice(&digest);
    session
        .sign(&Mechanism::RsaPkcs, key, &info)
        .map_err(SignError::Token)
}

/// Why a signature failed.
#[derive(Debug)]
pub(crate) enum SignError {
    /// The token refused or failed.
    Token(cryptoki::error::Error),
    /// The token's output could not be encoded.
    Encoding(crate::key::KeyError),
}

fn hash_mechanism(hash: HashAlg) -> MechanismType {
    match hash {
        HashAlg::Sha256 => MechanismType::SHA256,
        HashAlg::Sha384 => MechanismType::SHA384,
        HashAlg::Sha512 => MechanismType::SHA512,
    }
}

fn mgf(hash: HashAlg) -> PkcsMgfType {
    match hash {
        HashAlg::Sha256 => PkcsMgfType::MGF1_SHA256,
        HashAlg::Sha384 => PkcsMgfType::MGF1_SHA384,
        HashAlg::Sha512 => PkcsMgfType::MGF1_SHA512,
    }
}
