//! `hwkey probe`: one HTTPS GET with mTLS signed by the hardware key, reporting what the
//! handshake used. Operators run it to check a freshly provisioned key against an API server.

use std::path::PathBuf;
use std::sync::Arc;

use crate::egress::Tunnel;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use rustls::pki_types::{CertificateDer, ServerName};

use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::{Key, KeyError, SignScheme};
use crate::pki::PkiError;

/// Errors of a probe, each naming the step that failed.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum ProbeError {
    #[error("invalid URL '{url}': {problem} (example: https://127.0.0.1:6443/version)")]
    InvalidUrl { url: String, problem: &'static str },

    #[error("cannot reach {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: crate::egress::EgressError,
    },

    #[error("TLS handshake with {addr} failed: {source}")]
    Handshake {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("HTTP request to {url} failed: {}{hint}", crate::error_chain::error_chain(.source))]
    Http {
        url: String,
        #[source]
        source: hyper::Error,
        hint: &'static str,
    },

    #[error("invalid request for {url}: {source}")]
    Request {
        url: String,
        #[source]
        source: hyper::http::Error,
    },

    #[error("{url} answered HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },

    #[error("{0}")]
    Key(#[from] KeyError),

    #[error("{0}")]
    Pki(#[from] PkiError),
}

/// What to probe and how.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// The `https://` URL to GET.
    pub url: String,
    /// The CA bundle that signs the server's certificate (default: the system roots).
    pub ca: Option<PathBuf>,
    /// The name the server's certificate is checked against (default: the URL's host).
    pub server_name: Option<String>,
    /// Allow TLS 1.2 for a PKCS#1-only RSA key ([`crate::key::tls::protocol_versions`]).
    pub allow_tls12_fallback: bool,
    /// How the server is reached: directly or through a forward proxy.
    pub egress: crate::egress::Egress,
    /// The TLS 1.3 key exchange offered.
    pub key_exchange: crate::pki::tls::KeyExchange,
}

/// What the probe saw.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    /// `TLSv1.3` or `TLSv1.2`.
    pub tls_version: String,
    /// The negotiated cipher suite.
    pub cipher_suite: String,
    /// The negotiated key-exchange group (`X25519MLKEM768`, `X25519`, …).
    pub key_exchange: String,
    /// Whether the server asked for another key share (a HelloRetryRequest: one more round
    /// trip).
    pub hello_retry: bool,
    /// The negotiated ALPN protocol, if any.
    pub alpn: Option<String>,
    /// The scheme the hardware signed the CertificateVerify with (None: the server asked for no
    /// client certificate, or the handshake was resumed).
    pub client_scheme: Option<SignScheme>,
    /// The server certificate's subject.
    pub peer_subject: String,
    /// The HTTP status.
    pub status: u16,
    /// The response body.
    pub body: Bytes,
}

/// Runs the probe.
pub async fn probe(
    key: Arc<Key>,
    chain: Vec<CertificateDer<'static>>,
    options: &ProbeOptions,
) -> Result<ProbeReport, ProbeError> {
    let target = Target::parse(&options.url)?;
    let versions = crate::key::tls::protocol_versions(&key, options.allow_tls12_fallback)?;
    let signer = HardwareSigningKey::new(key);
    let resolver = Arc::new(HardwareCertResolver::new(signer.clone(), chain)?);
    let roots = crate::pki::tls::root_store(options.ca.as_deref())?;
    let mut config =
        crate::pki::tls::client_config(versions, roots, resolver, options.key_exchange)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];

    let tls = target
        .handshake(config, options.server_name.as_deref(), &options.egress)
        .await?;
    let facts = SessionFacts::of(tls.get_ref().1);
    let (status, body) = target.get(tls).await?;
    if !(200..300).contains(&status) {
        return Err(ProbeError::Status {
            url: target.url.clone(),
            status,
            body: String::from_utf8_lossy(&body)
                .trim()
                .chars()
                .take(500)
                .collect(),
        });
    }
    Ok(ProbeReport {
        tls_version: facts.tls_version,
        cipher_suite: facts.cipher_suite,
        key_exchange: facts.key_exchange,
        hello_retry: facts.hello_retry,
        alpn: facts.alpn,
        client_scheme: signer.last_scheme(),
        peer_subject: facts.peer_subject,
        status,
        body,
    })
}

/// The probed URL, split into what the connection needs.
struct Target {
    url: String,
    uri: hyper::Uri,
    /// Host as written (IPv6 in brackets), for `Host:` and messages.
    host: String,
    /// Host without brackets, for connecting and as the default TLS server name.
    host_bare: String,
    port: u16,
}

impl Target {
    fn parse(url: &str) -> Result<Target, ProbeError> {
        let invalid = |problem| ProbeError::InvalidUrl {
            url: url.to_string(),
            problem,
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
        Ok(Target {
            url: url.to_string(),
            uri,
            host,
            host_bare,
            port,
        })
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// TCP connect and the TLS handshake (signed in the hardware when the server asks for a
    /// client certificate).
    async fn handshake(
        &self,
        config: rustls::ClientConfig,
        server_name: Option<&str>,
        egress: &crate::egress::Egress,
    ) -> Result<tokio_rustls::client::TlsStream<Tunnel>, ProbeError> {
        let name = server_name.unwrap_or(&self.host_bare).to_string();
        let name = ServerName::try_from(name).map_err(|_| ProbeError::InvalidUrl {
            url: self.url.clone(),
            problem: "the TLS server name is not a valid DNS name or IP address",
        })?;
        let tcp = egress
            .dial(&self.host_bare, self.port)
            .await
            .map_err(|source| ProbeError::Connect {
                addr: self.addr(),
                source,
            })?;
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|source| ProbeError::Handshake {
                addr: self.addr(),
                source,
            })
    }

    /// One HTTP/1.1 GET of the URL's path over the connection: (status, body).
    async fn get(
        &self,
        tls: tokio_rustls::client::TlsStream<Tunnel>,
    ) -> Result<(u16, Bytes), ProbeError> {
        let http_err = |source: hyper::Error| ProbeError::Http {
            url: self.url.clone(),
            hint: if crate::error_chain::error_chain(&source).contains("certificate") {
                " (the server rejected the client certificate: check it is issued by a CA the server trusts)"
            } else {
                ""
            },
            source,
        };
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(http_err)?;
        let driver = tokio::spawn(connection);
        let path = self.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let request = hyper::Request::get(path)
            .header(
                hyper::header::HOST,
                self.uri
                    .authority()
                    .map(|a| a.as_str())
                    .unwrap_or(&self.host),
            )
            .header(
                hyper::header::USER_AGENT,
                concat!("hwkey/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::<Bytes>::new())
            .map_err(|source| ProbeError::Request {
                url: self.url.clone(),
                source,
            })?;
        let response = sender.send_request(request).await.map_err(http_err)?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(http_err)?
            .to_bytes();
        driver.abort();
        Ok((status, body))
    }
}

/// What the handshake settled, for the report.
struct SessionFacts {
    tls_version: String,
    cipher_suite: String,
    key_exchange: String,
    hello_retry: bool,
    alpn: Option<String>,
    peer_subject: String,
}

impl SessionFacts {
    fn of(conn: &rustls::ClientConnection) -> SessionFacts {
        SessionFacts {
            tls_version: conn
                .protocol_version()
                .map(|v| match v {
                    rustls::ProtocolVersion::TLSv1_3 => "TLSv1.3".to_string(),
                    rustls::ProtocolVersion::TLSv1_2 => "TLSv1.2".to_string(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default(),
            cipher_suite: conn
                .negotiated_cipher_suite()
                .map(|s| format!("{:?}", s.suite()))
                .unwrap_or_default(),
            key_exchange: crate::pki::tls::group_name(conn),
            hello_retry: conn.handshake_kind()
                == Some(rustls::HandshakeKind::FullWithHelloRetryRequest),
            alpn: conn
                .alpn_protocol()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
            peer_subject: conn
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| crate::key::tls::subject_of(c))
                .unwrap_or_default(),
        }
    }
}
