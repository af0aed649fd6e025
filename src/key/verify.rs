//! Verifying a signature against a public key, in software (ring).
//!
//! Backends use it to check what a device returned before it leaves the key layer (the TPM
//! backend checks every RSA signature: a TPM with the wrong PSS salt length must not hand a
//! TLS peer a signature it will reject); tests and benchmarks use it to prove signatures right.

use ring::signature as rs;

use super::{der, KeyError, SignScheme};

/// The ring algorithm that verifies `scheme` (RSA moduli of 2048 to 8192 bits).
pub fn ring_algorithm(scheme: SignScheme) -> &'static dyn rs::VerificationAlgorithm {
    match scheme {
        SignScheme::EcdsaP256Sha256 => &rs::ECDSA_P256_SHA256_ASN1,
        SignScheme::EcdsaP384Sha384 => &rs::ECDSA_P384_SHA384_ASN1,
        SignScheme::RsaPssSha256 => &rs::RSA_PSS_2048_8192_SHA256,
        SignScheme::RsaPssSha384 => &rs::RSA_PSS_2048_8192_SHA384,
        SignScheme::RsaPssSha512 => &rs::RSA_PSS_2048_8192_SHA512,
        SignScheme::RsaPkcs1Sha256 => &rs::RSA_PKCS1_2048_8192_SHA256,
        SignScheme::RsaPkcs1Sha384 => &rs::RSA_PKCS1_2048_8192_SHA384,
        SignScheme::RsaPkcs1Sha512 => &rs::RSA_PKCS1_2048_8192_SHA512,
    }
}

/// Checks `signature` over `message` with the key bits of an SPKI's BIT STRING (the EC point or
/// the PKCS#1 RSA key). True when it verifies.
pub fn verify_key_bits(
    key_bits: &[u8],
    scheme: SignScheme,
    message: &[u8],
    signature: &[u8],
) -> bool {
    rs::UnparsedPublicKey::new(ring_algorithm(scheme), key_bits)
        .verify(message, signature)
        .is_ok()
}

/// Checks `signature` over `message` against a DER SubjectPublicKeyInfo.
pub fn verify_signature(
    spki: &[u8],
    scheme: SignScheme,
    message: &[u8],
    signature: &[u8],
) -> Result<bool, KeyError> {
    let info = der::parse_spki(spki)?;
    Ok(verify_key_bits(&info.key_bits, scheme, message, signature))
}
