//! `hwkey probe`: one HTTPS GET with mTLS signed by the hardware key, reporting what the
//! handshake used. Operators run it to check a freshly provisioned key against an API server.

use std::path::PathBuf;
use std::sync::Arc;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::{Key, KeyError, SignScheme};
use crate::pki::PkiError;

/// Errors of a probe, each naming the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("invalid URL '{url}': {reason} (example: https://127.0.0.1:6443/version)")]
    InvalidUrl { url: String, reason: String },

    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("TLS handshake with {addr} failed: {reason}")]
    Handshake { addr: String, reason: String },

    #[error("HTTP request to {url} failed: {reason}{hint}")]
    Http {
        url: String,
        reason: String,
        hint: &'static str,
    },

    #[error("{url} answered HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },

    #[error(transparent)]
    Key(#[from] KeyError),

    #[error(transparent)]
    Pki(#[from] PkiError),
}

/// What to probe and how.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub url: String,
    pub ca: Option<PathBuf>,
    pub server_name: Option<String>,
    /// Allow TLS 1.2 for a PKCS#1-only RSA key ([`crate::key::tls::protocol_versions`]).
    pub allow_tls12_fallback: bool,
}

/// What the probe saw.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    pub tls_version: String,
    pub cipher_suite: String,
    pub alpn: Option<String>,
    /// The scheme the hardware signed the CertificateVerify with (None: the server asked for no
    /// client certificate, or the handshake was resumed).
    pub client_scheme: Option<SignScheme>,
    pub peer_subject: String,
    pub status: u16,
    pub body: Bytes,
}

/// Runs the probe.
pub async fn probe(
    key: Arc<Key>,
    chain: Vec<CertificateDer<'static>>,
    options: &ProbeOptions,
) -> Result<ProbeReport, ProbeError> {
    let url = &options.url;
    let invalid = |reason: &str| ProbeError::InvalidUrl {
        url: url.clone(),
        reason: reason.into(),
    };
    let uri: hyper::Uri = url.parse().map_err(|_| invalid("not a URL"))?;
    if uri.scheme_str() != Some("https") {
        return Err(invalid("only https:// URLs can be probed"));
    }
    let host = uri.host().ok_or_else(|| invalid("no host"))?.to_string();
    let port = uri.port_u16().unwrap_or(443);
    let host_bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let addr = format!("{host}:{port}");

    let versions = crate::key::tls::protocol_versions(&key, options.allow_tls12_fallback)?;
    let signer = HardwareSigningKey::new(key);
    let resolver = Arc::new(HardwareCertResolver::new(signer.clone(), chain)?);
    let roots = crate::pki::tls::root_store(options.ca.as_deref())?;
    let mut config = crate::pki::tls::client_config(versions, roots, resolver)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let server_name = options.server_name.clone().unwrap_or(host_bare.clone());
    let server_name = ServerName::try_from(server_name.clone())
        .map_err(|_| invalid("the TLS server name is not a valid DNS name or IP address"))?;

    let tcp = TcpStream::connect((host_bare.as_str(), port))
        .await
        .map_err(|source| ProbeError::Connect {
            addr: addr.clone(),
            source,
        })?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(server_name, tcp)
        .await
        .map_err(|e| ProbeError::Handshake {
            addr: addr.clone(),
            reason: e.to_string(),
        })?;
    let (_, conn) = tls.get_ref();
    let tls_version = conn
        .protocol_version()
        .map(|v| match v {
            rustls::ProtocolVersion::TLSv1_3 => "TLSv1.3".to_string(),
            rustls::ProtocolVersion::TLSv1_2 => "TLSv1.2".to_string(),
            other => format!("{other:?}"),
        })
        .unwrap_or_default();
    let cipher_suite = conn
        .negotiated_cipher_suite()
        .map(|s| format!("{:?}", s.suite()))
        .unwrap_or_default();
    let alpn = conn
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let peer_subject = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| crate::key::tls::subject_of(c))
        .unwrap_or_default();

    let http_err = |e: hyper::Error| ProbeError::Http {
        url: url.clone(),
        reason: error_chain(&e),
        hint: if error_chain(&e).contains("CertificateRequired")
            || error_chain(&e).contains("certificate")
        {
            " (the server rejected the client certificate: check it is issued by a CA the server trusts)"
        } else {
            ""
        },
    };
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(http_err)?;
    let driver = tokio::spawn(connection);
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let request = hyper::Request::get(path)
        .header(
            hyper::header::HOST,
            uri.authority().map(|a| a.as_str()).unwrap_or(&host),
        )
        .header(
            hyper::header::USER_AGENT,
            concat!("hwkey/", env!("CARGO_PKG_VERSION")),
        )
        .body(Empty::<Bytes>::new())
        .map_err(|e| invalid(&e.to_string()))?;
    let response = sender.send_request(request).await.map_err(http_err)?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(http_err)?
        .to_bytes();
    driver.abort();
    if !(200..300).contains(&status) {
        return Err(ProbeError::Status {
            url: url.clone(),
            status,
            body: String::from_utf8_lossy(&body)
                .trim()
                .chars()
                .take(500)
                .collect(),
        });
    }
    Ok(ProbeReport {
        tls_version,
        cipher_suite,
        alpn,
        client_scheme: signer.last_scheme(),
        peer_subject,
        status,
        body,
    })
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}
