//! Certificates and certificate requests around a hardware key: building PKCS#10 requests,
//! reading certificate chains, and checking that a certificate belongs to a key.

pub mod attestation;
pub mod cert;
pub mod certificate;
pub mod csr;
pub mod ek_crl;
pub mod ek_join;
#[cfg(feature = "tpm")]
pub mod ek_trust;
pub mod error;
pub mod loopback_ca;
pub mod name;
pub mod piv;
pub mod piv_policy;
pub mod registration;
pub mod request;
pub mod request_pem;
pub mod same_key;
pub mod san;
pub mod tls;

pub use error::PkiError;
