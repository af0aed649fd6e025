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
    /// Re-authenticating for the signature failed (a refused PIN, no PIN source).
    Login(crate::key::KeyError),
}

/// The mechanism that hashes on the token, for keys that need `C_Login(CKU_CONTEXT_SPECIFIC)`
/// between `C_SignInit` and the data: cryptoki offers `C_Sign` only together with its own
/// `C_SignInit`, so such keys sign in parts (`C_SignUpdate`, `C_SignFinal`), which only the
/// hashing mechanisms allow.
pub(crate) fn reauthenticated_mechanism(scheme: SignScheme) -> Mechanism<'static> {
    let hash = scheme.hash();
    if scheme.is_ecdsa() {
        return match hash {
            HashAlg::Sha256 => Mechanism::EcdsaSha256,
            HashAlg::Sha384 => Mechanism::EcdsaSha384,
            HashAlg::Sha512 => Mechanism::EcdsaSha512,
        };
    }
    if scheme.is_pss() {
        let params = PkcsPssParams {
            hash_alg: hash_mechanism(hash),
            mgf: mgf(hash),
            s_len: (hash.output_len() as u64).into(),
        };
        return match hash {
            HashAlg::Sha256 => Mechanism::Sha256RsaPkcsPss(params),
            HashAlg::Sha384 => Mechanism::Sha384RsaPkcsPss(params),
            HashAlg::Sha512 => Mechanism::Sha512RsaPkcsPss(params),
        };
    }
    match hash {
        HashAlg::Sha256 => Mechanism::Sha256RsaPkcs,
        HashAlg::Sha384 => Mechanism::Sha384RsaPkcs,
        HashAlg::Sha512 => Mechanism::Sha512RsaPkcs,
    }
}

/// Signs `message` with a key that asks for the PIN every time (`CKA_ALWAYS_AUTHENTICATE`, a
/// PIV card's slot 9c): `C_SignInit`, then `login` (`C_Login(CKU_CONTEXT_SPECIFIC)`), then the
/// message in parts.
pub(crate) fn sign_reauthenticated(
    session: &Session,
    key: ObjectHandle,
    scheme: SignScheme,
    message: &[u8],
    login: impl FnOnce() -> Result<(), crate::key::KeyError>,
) -> Result<Vec<u8>, SignError> {
    session
        .sign_init(&reauthenticated_mechanism(scheme), key)
        .map_err(SignError::Token)?;
    login().map_err(SignError::Login)?;
    session.sign_update(message).map_err(SignError::Token)?;
    let signature = session.sign_final().map_err(SignError::Token)?;
    if scheme.is_ecdsa() {
        return der::ecdsa_raw_to_der(&signature).map_err(SignError::Encoding);
    }
    Ok(signature)
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
