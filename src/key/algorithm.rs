//! Key algorithms and signature schemes, independent of any TLS or PKCS#11 crate.
//!
//! The key layer speaks only these types; the rustls and rcgen adapters translate them. Keeping
//! them here means a backend never needs to know which protocol asked for a signature.

use std::fmt;
use std::str::FromStr;

use super::KeyError;
use crate::key::CapabilityError;

/// The kind of key pair a hardware key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyAlgorithm {
    /// ECDSA on NIST P-256 (secp256r1).
    EcP256,
    /// ECDSA on NIST P-384 (secp384r1).
    EcP384,
    /// RSA with the given modulus size in bits. Keys found on a token may have any size; keys we
    /// create are 2048, 3072 or 4096 bits.
    Rsa {
        /// The modulus size in bits.
        bits: u32,
    },
}

impl KeyAlgorithm {
    /// The names accepted by `--algorithm`, in the order we recommend them.
    pub const CREATABLE: [&'static str; 5] =
        ["ec-p256", "ec-p384", "rsa-2048", "rsa-3072", "rsa-4096"];

    /// The signature schemes this key can make, most preferred first.
    ///
    /// RSA offers PSS before PKCS#1 v1.5 because TLS 1.3 only allows PSS; PKCS#1 remains for
    /// TLS 1.2 peers and for CSRs (rcgen signs those with PKCS#1 v1.5).
    pub fn schemes(self) -> &'static [SignScheme] {
        match self {
            KeyAlgorithm::EcP256 => &[SignScheme::EcdsaP256Sha256],
            KeyAlgorithm::EcP384 => &[SignScheme::EcdsaP384Sha384],
            KeyAlgorithm::Rsa { .. } => &[
                SignScheme::RsaPssSha256,
                SignScheme::RsaPssSha384,
                SignScheme::RsaPssSha512,
                SignScheme::RsaPkcs1Sha256,
                SignScheme::RsaPkcs1Sha384,
                SignScheme::RsaPkcs1Sha512,
            ],
        }
    }

    /// True for the elliptic-curve algorithms.
    pub fn is_ec(self) -> bool {
        matches!(self, KeyAlgorithm::EcP256 | KeyAlgorithm::EcP384)
    }

    /// The DER encoding of the named-curve OID (the PKCS#11 `CKA_EC_PARAMS` value), for EC keys.
    pub fn ec_params_der(self) -> Option<&'static [u8]> {
        match self {
            KeyAlgorithm::EcP256 => {
                Some(&[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07])
            }
            KeyAlgorithm::EcP384 => Some(&[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22]),
            KeyAlgorithm::Rsa { .. } => None,
        }
    }

    /// Recognises a curve from its `CKA_EC_PARAMS` / SPKI parameter encoding.
    pub fn from_ec_params_der(params: &[u8]) -> Option<Self> {
        [KeyAlgorithm::EcP256, KeyAlgorithm::EcP384]
            .into_iter()
            .find(|a| a.ec_params_der() == Some(params))
    }

    /// Length in bytes of one ECDSA scalar (r or s) for this curve.
    pub fn ec_scalar_len(self) -> Option<usize> {
        match self {
            KeyAlgorithm::EcP256 => Some(32),
            KeyAlgorithm::EcP384 => Some(48),
            KeyAlgorithm::Rsa { .. } => None,
        }
    }
}

impl fmt::Display for KeyAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyAlgorithm::EcP256 => f.write_str("ec-p256"),
            KeyAlgorithm::EcP384 => f.write_str("ec-p384"),
            KeyAlgorithm::Rsa { bits } => write!(f, "rsa-{bits}"),
        }
    }
}

impl FromStr for KeyAlgorithm {
    type Err = KeyError;

    /// Parses the names of [`KeyAlgorithm::CREATABLE`] (case-insensitive).
    fn from_str(s: &str) -> Result<Self, KeyError> {
        match s.to_ascii_lowercase().as_str() {
            "ec-p256" | "p256" | "p-256" | "ecdsa-p256" => Ok(KeyAlgorithm::EcP256),
            "ec-p384" | "p384" | "p-384" | "ecdsa-p384" => Ok(KeyAlgorithm::EcP384),
            "rsa-2048" | "rsa2048" => Ok(KeyAlgorithm::Rsa { bits: 2048 }),
            "rsa-3072" | "rsa3072" => Ok(KeyAlgorithm::Rsa { bits: 3072 }),
            "rsa-4096" | "rsa4096" => Ok(KeyAlgorithm::Rsa { bits: 4096 }),
            _ => Err(KeyError::Capability(CapabilityError::UnknownAlgorithm {
                given: s.to_string(),
            })),
        }
    }
}

/// A hash function used by a signature scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    /// SHA-256.
    Sha256,
    /// SHA-384.
    Sha384,
    /// SHA-512.
    Sha512,
}

impl HashAlg {
    /// Hashes `data` in software. Hashing is not a secret operation; doing it here lets every
    /// token use its most basic mechanism (`CKM_ECDSA`, `CKM_RSA_PKCS`), which all of them have.
    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        let alg = match self {
            HashAlg::Sha256 => &ring::digest::SHA256,
            HashAlg::Sha384 => &ring::digest::SHA384,
            HashAlg::Sha512 => &ring::digest::SHA512,
        };
        ring::digest::digest(alg, data).as_ref().to_vec()
    }

    /// Output length in bytes (also the PSS salt length TLS 1.3 requires).
    pub fn output_len(self) -> usize {
        match self {
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
            HashAlg::Sha512 => 64,
        }
    }

    /// The DER `DigestInfo` prefix that PKCS#1 v1.5 puts before the hash (RFC 8017 §9.2).
    pub fn pkcs1_digest_info_prefix(self) -> &'static [u8] {
        match self {
            HashAlg::Sha256 => &[
                0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x01, 0x05, 0x00, 0x04, 0x20,
            ],
            HashAlg::Sha384 => &[
                0x30, 0x41, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x02, 0x05, 0x00, 0x04, 0x30,
            ],
            HashAlg::Sha512 => &[
                0x30, 0x51, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02,
                0x03, 0x05, 0x00, 0x04, 0x40,
            ],
        }
    }
}

/// A signature scheme: which algorithm, which hash, which padding.
///
/// Every scheme signs the whole message (the backend hashes it). ECDSA signatures come back
/// DER-encoded (`Ecdsa-Sig-Value`), as TLS and X.509 want them; RSA signatures are the raw
/// big-endian integer of the modulus length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignScheme {
    /// ECDSA on P-256 with SHA-256.
    EcdsaP256Sha256,
    /// ECDSA on P-384 with SHA-384.
    EcdsaP384Sha384,
    /// RSASSA-PSS, MGF1 with the same hash, salt length = hash length (what TLS 1.3 requires).
    RsaPssSha256,
    /// RSA-PSS with SHA-384 (salt = hash length).
    RsaPssSha384,
    /// RSA-PSS with SHA-512 (salt = hash length).
    RsaPssSha512,
    /// RSASSA-PKCS1-v1_5.
    RsaPkcs1Sha256,
    /// RSA PKCS#1 v1.5 with SHA-384 (TLS 1.2 only).
    RsaPkcs1Sha384,
    /// RSA PKCS#1 v1.5 with SHA-512 (TLS 1.2 only).
    RsaPkcs1Sha512,
}

impl SignScheme {
    /// The hash this scheme applies to the message.
    pub fn hash(self) -> HashAlg {
        match self {
            SignScheme::EcdsaP256Sha256 | SignScheme::RsaPssSha256 | SignScheme::RsaPkcs1Sha256 => {
                HashAlg::Sha256
            }
            SignScheme::EcdsaP384Sha384 | SignScheme::RsaPssSha384 | SignScheme::RsaPkcs1Sha384 => {
                HashAlg::Sha384
            }
            SignScheme::RsaPssSha512 | SignScheme::RsaPkcs1Sha512 => HashAlg::Sha512,
        }
    }

    /// True for RSASSA-PSS schemes.
    pub fn is_pss(self) -> bool {
        matches!(
            self,
            SignScheme::RsaPssSha256 | SignScheme::RsaPssSha384 | SignScheme::RsaPssSha512
        )
    }

    /// True for ECDSA schemes.
    pub fn is_ecdsa(self) -> bool {
        matches!(
            self,
            SignScheme::EcdsaP256Sha256 | SignScheme::EcdsaP384Sha384
        )
    }
}

impl fmt::Display for SignScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The IANA TLS names, so they match what openssl and rustls print.
        f.write_str(match self {
            SignScheme::EcdsaP256Sha256 => "ecdsa_secp256r1_sha256",
            SignScheme::EcdsaP384Sha384 => "ecdsa_secp384r1_sha384",
            SignScheme::RsaPssSha256 => "rsa_pss_rsae_sha256",
            SignScheme::RsaPssSha384 => "rsa_pss_rsae_sha384",
            SignScheme::RsaPssSha512 => "rsa_pss_rsae_sha512",
            SignScheme::RsaPkcs1Sha256 => "rsa_pkcs1_sha256",
            SignScheme::RsaPkcs1Sha384 => "rsa_pkcs1_sha384",
            SignScheme::RsaPkcs1Sha512 => "rsa_pkcs1_sha512",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in KeyAlgorithm::CREATABLE {
            let alg: KeyAlgorithm = name.parse().expect("creatable name parses");
            assert_eq!(alg.to_string(), name);
        }
        assert!("dsa-1024".parse::<KeyAlgorithm>().is_err());
    }

    #[test]
    fn ec_params_are_recognised() {
        for alg in [KeyAlgorithm::EcP256, KeyAlgorithm::EcP384] {
            let params = alg.ec_params_der().expect("ec params");
            assert_eq!(KeyAlgorithm::from_ec_params_der(params), Some(alg));
        }
    }
}
