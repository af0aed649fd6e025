//! How a key's signatures are made, decided once when the key is opened.
//!
//! TLS 1.3 lets an RSA client key sign only with RSA-PSS. Many smart cards and older HSMs offer
//! `CKM_RSA_PKCS` (and often `CKM_RSA_X_509`) but no PSS mechanism, and TPMs pick a PSS salt
//! length TLS 1.3 peers reject. So for RSA keys hwkey reads what the device can do and picks
//! one path; `hwkey key info`, `doctor` and `probe` show it, and the TLS layer offers only the
//! protocol versions the path can serve (see [`super::tls::protocol_versions`]).

use std::fmt;

use super::SignScheme;

/// The way a key signs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SigningPath {
    /// The device's own mechanisms for every scheme (EC keys; RSA with the token's PSS).
    Native,
    /// RSA-PSS padding computed by hwkey ([`super::pss`]), the raw RSA private-key operation in
    /// the device (`mechanism`: `CKM_RSA_X_509`, or the TPM's RSA_Decrypt). The private key
    /// still never leaves the device.
    SoftwarePss {
        /// The raw-RSA mechanism the padded block is signed with.
        mechanism: &'static str,
    },
    /// PKCS#1 v1.5 only: no PSS and no raw RSA, so no TLS 1.3; TLS 1.2 only when the user
    /// allows the fallback.
    Pkcs1Only {
        /// The mechanisms the device lacks.
        missing: &'static str,
    },
    /// No RSA signature mechanism at all.
    Unusable {
        /// The mechanisms the device lacks.
        missing: &'static str,
    },
}

impl SigningPath {
    /// Whether this path can make signatures with `scheme`.
    pub fn offers(&self, scheme: SignScheme) -> bool {
        match self {
            SigningPath::Native | SigningPath::SoftwarePss { .. } => true,
            SigningPath::Pkcs1Only { .. } => !scheme.is_pss(),
            SigningPath::Unusable { .. } => false,
        }
    }

    /// Whether TLS 1.3 (which needs RSA-PSS or ECDSA) is possible on this path.
    pub fn supports_tls13(&self) -> bool {
        matches!(self, SigningPath::Native | SigningPath::SoftwarePss { .. })
    }
}

impl fmt::Display for SigningPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SigningPath::Native => write!(f, "native (the device's own signature mechanisms)"),
            SigningPath::SoftwarePss { mechanism } => write!(
                f,
                "software PSS over raw RSA (hwkey pads, the device signs with {mechanism}); TLS 1.3 and 1.2"
            ),
            SigningPath::Pkcs1Only { missing } => write!(
                f,
                "TLS 1.2 fallback only (PKCS#1 v1.5 signatures): the token lacks {missing}; \
                 needs --allow-tls12-fallback"
            ),
            SigningPath::Unusable { missing } => {
                write!(f, "unusable: the token lacks {missing}")
            }
        }
    }
}
