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

/// The rustls crypto provider of every hwkey connection: ring. aws-lc-rs was measured against it
/// (docs/BENCHMARKS.md, "Crypto provider"); the reasons for the choice are recorded there.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// The roots that authenticate a server: the PEM/DER bundle at `ca`, else the system's roots.
/// System roots that cannot be read or parsed are reported, not dropped: with none left every
/// handshake would fail with an unhelpful "unknown issuer".
pub fn root_store(ca: Option<&Path>) -> Result<RootCertStore, PkiError> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            let bad = |reason: String| PkiError::BadCaBundle {
                path: path.to_path_buf(),
                reason,
            };
            for cert in super::cert::load_chain(path).map_err(|e| bad(e.to_string()))? {
                roots.add(cert).map_err(|e| bad(e.to_string()))?;
            }
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
) -> Result<ClientConfig, PkiError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .map_err(|e| PkiError::Tls {
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_client_cert_resolver(resolver))
}
