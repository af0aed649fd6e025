//! What a TPM public area says about a key: its algorithm, its SubjectPublicKeyInfo, and
//! whether (and how) hwkey can sign with it.
//!
//! Every key, whether hwkey, tpm2-openssl or tpm2-tools made it, goes through [`KeyInfo::from_public`]
//! before it is used, so an unusable key (a storage key, a restricted attestation key, an
//! unsupported curve) is refused with its reason when it is opened, not at the first handshake.

use tss_esapi::attributes::ObjectAttributes;
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::structures::{
    EccPoint, EccScheme, Public, PublicKeyRsa, PublicRsaParameters, RsaScheme,
};

use crate::key::{der, KeyAlgorithm, Unusable};

/// How RSA-PSS signatures are made with this key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PssMethod {
    /// Not an RSA key.
    NotRsa,
    /// The key may decrypt with scheme NULL: hwkey encodes EMSA-PSS itself (salt = hash
    /// length, as TLS 1.3 requires) and the TPM applies the raw private-key operation
    /// (TPM2_RSA_Decrypt). Works on every TPM.
    SoftwareEncoded,
    /// A sign-only key: TPM2_Sign with RSAPSS. The TPM picks the salt length; hwkey checks the
    /// result (some TPMs use the maximum salt length, which TLS 1.3 peers reject).
    Tpm,
}

/// The facts about a key that signing needs.
#[derive(Debug, Clone)]
pub(crate) struct KeyInfo {
    pub algorithm: KeyAlgorithm,
    pub spki: Vec<u8>,
    /// The PKCS#1 `RSAPublicKey` (for checking RSA signatures); empty for EC keys.
    pub rsa_public_key: Vec<u8>,
    /// RSA modulus length in bytes; 0 for EC keys.
    pub modulus_len: usize,
    pub pss: PssMethod,
    /// The object attributes that say whether the key can leave this TPM.
    pub fixed: Fixedness,
}

/// The object attributes that keep a key in its TPM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fixedness {
    /// The key cannot be duplicated (to any TPM).
    pub fixed_tpm: bool,
    /// The key cannot be duplicated to another parent.
    pub fixed_parent: bool,
    /// The TPM generated the private key (it was not imported).
    pub sensitive_data_origin: bool,
}

impl KeyInfo {
    /// Reads a public area; the error is the reason the key cannot be used.
    pub(crate) fn from_public(public: &Public) -> Result<KeyInfo, Unusable> {
        let attributes = public.object_attributes();
        let fixed = Fixedness {
            fixed_tpm: attributes.fixed_tpm(),
            fixed_parent: attributes.fixed_parent(),
            sensitive_data_origin: attributes.sensitive_data_origin(),
        };
        check_signing_attributes(attributes)?;
        match public {
            Public::Ecc {
                parameters, unique, ..
            } => {
                let algorithm = match parameters.ecc_curve() {
                    EccCurve::NistP256 => KeyAlgorithm::EcP256,
                    EccCurve::NistP384 => KeyAlgorithm::EcP384,
                    other => return Err(Unusable::Curve(format!("{other:?}"))),
                };
                if !matches!(
                    parameters.ecc_scheme(),
                    EccScheme::Null | EccScheme::EcDsa(_)
                ) {
                    return Err(Unusable::EcScheme(format!("{:?}", parameters.ecc_scheme())));
                }
                Ok(KeyInfo {
                    algorithm,
                    spki: ec_spki(algorithm, unique)?,
                    rsa_public_key: Vec::new(),
                    modulus_len: 0,
                    pss: PssMethod::NotRsa,
                    fixed,
                })
            }
            Public::Rsa {
                parameters, unique, ..
            } => {
                let (modulus, exponent) = rsa_parts(parameters, unique)?;
                let exponent = exponent.to_be_bytes();
                let pss = match parameters.rsa_scheme() {
                    RsaScheme::Null if attributes.decrypt() => PssMethod::SoftwareEncoded,
                    RsaScheme::Null | RsaScheme::RsaPss(_) | RsaScheme::RsaSsa(_) => PssMethod::Tpm,
                    other => return Err(Unusable::RsaScheme(format!("{other:?}"))),
                };
                Ok(KeyInfo {
                    algorithm: KeyAlgorithm::Rsa {
                        bits: (modulus.len() * 8) as u32,
                    },
                    spki: der::rsa_spki(modulus, &exponent),
                    rsa_public_key: der::rsa_public_key(modulus, &exponent),
                    modulus_len: modulus.len(),
                    pss,
                    fixed,
                })
            }
            _ => Err(Unusable::NotRsaOrEc),
        }
    }
}

/// A key hwkey signs with: a signing key, unrestricted, usable with its authValue.
fn check_signing_attributes(attributes: ObjectAttributes) -> Result<(), Unusable> {
    if !attributes.sign_encrypt() {
        return Err(if attributes.restricted() && attributes.decrypt() {
            Unusable::Storage
        } else {
            Unusable::NotSigning
        });
    }
    if attributes.restricted() {
        return Err(Unusable::Restricted);
    }
    if !attributes.user_with_auth() {
        return Err(Unusable::PolicyOnly);
    }
    Ok(())
}

/// An RSA public area's modulus (leading zeros stripped) and public exponent (the TPM's 0 means
/// 65537): what a SubjectPublicKeyInfo or an encryption to the key needs.
pub(crate) fn rsa_parts<'a>(
    parameters: &PublicRsaParameters,
    unique: &'a PublicKeyRsa,
) -> Result<(&'a [u8], u32), Unusable> {
    let modulus = unique.value();
    let first = modulus
        .iter()
        .position(|&b| b != 0)
        .unwrap_or(modulus.len());
    let modulus = &modulus[first..];
    if modulus.is_empty() {
        return Err(Unusable::NoModulus);
    }
    let exponent = match parameters.exponent().value() {
        0 => 65537,
        e => e,
    };
    Ok((modulus, exponent))
}

/// The SubjectPublicKeyInfo of an EC public area's point (x and y left-padded to the curve).
pub(crate) fn ec_spki(algorithm: KeyAlgorithm, unique: &EccPoint) -> Result<Vec<u8>, Unusable> {
    let len = algorithm.ec_scalar_len().unwrap_or(0);
    let mut point = Vec::with_capacity(1 + 2 * len);
    point.push(0x04);
    point.extend(left_pad(unique.x().value(), len)?);
    point.extend(left_pad(unique.y().value(), len)?);
    der::ec_spki(algorithm, &point).map_err(|e| Unusable::Spki(Box::new(e)))
}

/// Left-pads a big-endian scalar to `len` bytes.
pub(crate) fn left_pad(value: &[u8], len: usize) -> Result<Vec<u8>, Unusable> {
    let first = value.iter().position(|&b| b != 0).unwrap_or(value.len());
    let value = &value[first..];
    if value.len() > len {
        return Err(Unusable::TooLong {
            len: value.len(),
            max: len,
        });
    }
    let mut out = vec![0u8; len - value.len()];
    out.extend_from_slice(value);
    Ok(out)
}
