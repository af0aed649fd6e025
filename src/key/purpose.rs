//! What a signature is for. Keys opened in this process sign whatever trusted code gives them;
//! a key served by a signer process ([`crate::signer`]) is told the purpose of each signature
//! and signs only a message of that purpose's shape, so a compromised network side can make
//! TLS handshakes with it and nothing else (no CSR for another name, no JWT, no arbitrary data).

use serde::{Deserialize, Serialize};

crate::label_values! {
    /// What a signature is for (the `purpose` label of the signer's metrics).
    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Purpose {
        /// A TLS client `CertificateVerify`: for TLS 1.3 the content RFC 8446 §4.4.3 defines,
        /// for TLS 1.2 the handshake messages so far.
        Handshake => "handshake",
        /// A PKCS#10 `CertificationRequestInfo` for the key's own identity and public key.
        CertificateRequest => "certificate_request",
        /// [`HEALTH_CHECK_MESSAGE`], and nothing else.
        HealthCheck => "health_check",
    }
}

/// The one message a health check signs: proof that the key signs now.
pub const HEALTH_CHECK_MESSAGE: &[u8] = b"hwkey proxy health check";
