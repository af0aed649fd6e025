//! The TLS material every hwkey client and server shares: the crypto provider (named here and
//! nowhere else, so switching it — e.g. to aws-lc-rs for FIPS — is one line, measured in
//! docs/BENCHMARKS.md), the trust store, and the builder for client configs whose certificate
//! is signed by the hardware key.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, RootCertStore, SupportedProtocolVersion};

use super::PkiError;

/// What a client offers for the TLS 1.3 key exchange.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum KeyExchange {
    /// X25519MLKEM768 (the post-quantum hybrid Go ≥ 1.24 offers by default) first, X25519
    /// second: rustls sends both key shares, with one X25519 key, so a server without the
    /// hybrid (kube-apiserver built with Go < 1.24) picks X25519 without a HelloRetryRequest.
    #[default]
    Hybrid,
    /// X25519 first, no hybrid: for peers that mishandle large ClientHellos.
    Classical,
}

/// The rustls crypto provider of every hwkey client: ring for the cipher suites and
/// signatures, and the X25519MLKEM768 key exchange from aws-lc-rs first (ring has no ML-KEM).
/// aws-lc-rs was measured against ring for the rest (docs/BENCHMARKS.md, "Crypto provider");
/// the reasons for the choice are recorded there.
///
/// Cipher suites are offered in Go's order (crypto/tls on a CPU with AES instructions, which is
/// what kubectl and kube-apiserver use): AES-128-GCM first. ring's own order puts AES-256-GCM
/// with SHA-384 first, whose key schedule runs SHA-512 in software; the profile of new
/// connections through the proxy showed it as 9 % of the proxy's CPU (docs/BENCHMARKS.md).
/// Peers still choose: a server that prefers AES-256 gets it.
pub fn provider() -> Arc<CryptoProvider> {
    provider_for(KeyExchange::Hybrid)
}

/// The provider offering `kx`: [`provider`], or the same without the hybrid (what the loopback
/// listener serves: the hop between processes of one host needs no post-quantum protection,
/// and each local handshake would pay for ML-KEM).
pub fn provider_for(kx: KeyExchange) -> Arc<CryptoProvider> {
    static HYBRID: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    static CLASSICAL: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    let cell = match kx {
        KeyExchange::Hybrid => &HYBRID,
        KeyExchange::Classical => &CLASSICAL,
    };
    cell.get_or_init(|| {
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites.sort_by_key(suite_rank);
        if kx == KeyExchange::Hybrid {
            provider
                .kx_groups
                .insert(0, rustls::crypto::aws_lc_rs::kx_group::X25519MLKEM768);
        }
        Arc::new(provider)
    })
    .clone()
}

/// The name of a negotiated key-exchange group, for logs and `probe` (`X25519MLKEM768`).
pub fn group_name(conn: &rustls::CommonState) -> String {
    conn.negotiated_key_exchange_group()
        .map(|g| format!("{:?}", g.name()))
        .unwrap_or_else(|| "none".into())
}

/// Go's preference: TLS 1.3 before 1.2; within a version AES-128-GCM, AES-256-GCM, then
/// ChaCha20-Poly1305. The sort is stable, so ECDSA stays before RSA for each cipher.
fn suite_rank(suite: &rustls::SupportedCipherSuite) -> (bool, u8) {
    use rustls::CipherSuite as S;
    let bulk = match suite.suite() {
        S::TLS13_AES_128_GCM_SHA256
        | S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => 0,
        S::TLS13_AES_256_GCM_SHA384
        | S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => 1,
        _ => 2,
    };
    (suite.tls13().is_none(), bulk)
}

/// The trust of a CA bundle's bytes (`path` names it in errors): what a reload read through
/// the signer.
pub fn root_store_from(bytes: &[u8], path: &Path) -> Result<RootCertStore, PkiError> {
    let bad = |source: crate::key::Cause| PkiError::BadCaBundle {
        path: path.to_path_buf(),
        source,
    };
    let mut roots = RootCertStore::empty();
    for cert in super::cert::parse_chain(bytes, path).map_err(|e| bad(Box::new(e)))? {
        roots.add(cert).map_err(|e| bad(Box::new(e)))?;
    }
    Ok(roots)
}

/// The roots that authenticate a server: the PEM/DER bundle at `ca`, else the system's roots.
/// System roots that cannot be read or parsed are reported, not dropped: with none left every
/// handshake would fail with an unhelpful "unknown issuer".
pub fn root_store(ca: Option<&Path>) -> Result<RootCertStore, PkiError> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            let bytes = crate::small_file::read(path).map_err(|source| PkiError::BadCaBundle {
                path: path.to_path_buf(),
                source: Box::new(PkiError::ReadCert {
                    path: path.to_path_buf(),
                    source,
                }),
            });
            return bytes.and_then(|b| root_store_from(&b, path));
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let mut rejected = 0usize;
            for cert in native.certs {
                if roots.add(cert).is_err() {
                    rejected += 1;
                }
            }
            if roots.is_empty() {
                let mut reasons: Vec<String> =
                    native.errors.iter().map(|e| e.to_string()).collect();
                if rejected > 0 {
                    reasons.push(format!("{rejected} certificates could not be parsed"));
                }
                if reasons.is_empty() {
                    reasons.push("the system trust store is empty".into());
                }
                return Err(PkiError::NoSystemRoots {
                    reasons: reasons.join("; "),
                });
            }
            for e in &native.errors {
                tracing::warn!(error = %e, "some system root certificates could not be loaded");
            }
        }
    }
    Ok(roots)
}

/// A client config that authenticates the server with `roots` and presents the certificate
/// `resolver` chooses (signed in the hardware), for the given protocol versions.
pub fn client_config(
    versions: &[&'static SupportedProtocolVersion],
    roots: impl Into<Arc<RootCertStore>>,
    resolver: Arc<dyn ResolvesClientCert>,
    kx: KeyExchange,
) -> Result<ClientConfig, PkiError> {
    Ok(ClientConfig::builder_with_provider(provider_for(kx))
        .with_protocol_versions(versions)
        .map_err(PkiError::Tls)?
        .with_root_certificates(roots)
        .with_client_cert_resolver(resolver))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::CipherSuite as S;

    #[test]
    fn suites_are_offered_in_gos_order() {
        let order: Vec<S> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        assert_eq!(
            order,
            [
                S::TLS13_AES_128_GCM_SHA256,
                S::TLS13_AES_256_GCM_SHA384,
                S::TLS13_CHACHA20_POLY1305_SHA256,
                S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
                S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
                S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
                S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
                S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
                S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            ]
        );
    }
}
