//! A `kube` client for the CSR API whose TLS is hwkey's: the client certificate is signed in the
//! hardware through [`HardwareCertResolver`] (kube's own TLS stack wants a software key), or no
//! client certificate and a bearer token (a bootstrap kubeconfig). kube's `Client::new` takes any
//! tower service, so the seam is a hyper client over hyper-rustls built from our `ClientConfig`,
//! with kube's base-URI and auth layers on top.

use std::sync::Arc;

use hyper_util::rt::TokioExecutor;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::RootCertStore;
use tower::{BoxError, ServiceBuilder};

use super::LifecycleError;
use crate::egress::{Egress, EgressConnector, ForwardProxy};
use crate::key::tls::HardwareCertResolver;

/// How the client proves who it is.
pub enum Identity {
    /// mTLS with the hardware key and its current certificate chain.
    Hardware {
        /// Presents the hardware certificate; signs the handshake in the device.
        resolver: Arc<HardwareCertResolver>,
        /// The TLS versions the key can sign for.
        versions: &'static [&'static rustls::SupportedProtocolVersion],
    },
    /// Whatever the kube `Config` carries (a bootstrap token); no client certificate.
    Config,
}

/// How long a TCP connection to the API server may take.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long the API server may take to answer a call (its response headers).
pub const RESPONSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// An idle HTTP/2 connection to the API server is PINGed this often, and closed when a PING
/// goes unanswered for [`PING_TIMEOUT`] (client-go does the same with 30 s and 15 s): a connection a
/// network path dropped silently — a NAT or a relay forgetting an idle flow — ends within
/// seconds, and the watches on it start again on a new one, instead of waiting out their
/// timeout while events are lost. The PINGs also keep such a path from forgetting the flow.
pub const PING_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// How long a PING may go unanswered (a loaded API server answers in well under a second).
pub const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How the client reaches the API server: the kubeconfig's `proxy-url`, else `HTTPS_PROXY`
/// unless `NO_PROXY` excludes it (client-go's order).
fn connector(config: &kube::Config) -> Result<EgressConnector, ClientProblem> {
    let proxy = match &config.proxy_url {
        Some(url) => Some(ForwardProxy::parse(&url.to_string()).map_err(ClientProblem::Proxy)?),
        None => None,
    };
    let egress = Egress::explicit_or_env(proxy).map_err(ClientProblem::Proxy)?;
    Ok(EgressConnector::new(egress, CONNECT_TIMEOUT))
}

/// Why a client for the API server could not be set up, for [`LifecycleError::Client`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ClientProblem {
    #[error("{0}")]
    Tls(#[source] rustls::Error),
    #[error("the CA bundle holds an unusable certificate: {0}")]
    UnusableCa(#[source] rustls::Error),
    #[error("no CA certificate to verify the API server with: pass --ca FILE")]
    NoCa,
    #[error("tls-server-name '{0}' is not a DNS name or IP")]
    ServerName(String),
    #[error("{0}")]
    Auth(#[source] kube::Error),
    #[error("{0}")]
    Proxy(#[source] crate::egress::EgressError),
    #[error("{what}-data is not base64: {source}")]
    NotBase64 {
        what: &'static str,
        #[source]
        source: base64::DecodeError,
    },
    #[error("cannot read {what} {}: {source}", .path.display())]
    Unreadable {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    NotPem {
        what: &'static str,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
}

/// Builds a client for `config` (server URL, CA bundle, TLS server name, and for
/// [`Identity::Config`] its credentials).
pub fn build_client(
    config: &kube::Config,
    identity: Identity,
) -> Result<kube::Client, LifecycleError> {
    build_via(config, identity, None)
}

/// Like [`build_client`], reaching the API server through `egress` (the proxy's own way out) instead
/// of the one the config and the environment name.
pub fn build_via(
    config: &kube::Config,
    identity: Identity,
    egress: Option<Egress>,
) -> Result<kube::Client, LifecycleError> {
    use kube::client::ConfigExt;
    let server = config.cluster_url.to_string();
    let fail = |problem: ClientProblem| LifecycleError::Client {
        server: server.clone(),
        problem,
    };
    let roots = roots(config).map_err(&fail)?;
    let versions: &[&rustls::SupportedProtocolVersion] = match &identity {
        Identity::Hardware { versions, .. } => versions,
        Identity::Config => &[&rustls::version::TLS13, &rustls::version::TLS12],
    };
    let builder = rustls::ClientConfig::builder_with_provider(crate::pki::tls::provider())
        .with_protocol_versions(versions)
        .map_err(|e| fail(ClientProblem::Tls(e)))?
        .with_root_certificates(roots);
    let tls = match identity {
        Identity::Hardware { resolver, .. } => builder.with_client_cert_resolver(resolver),
        Identity::Config => match software_identity(config).map_err(&fail)? {
            Some((chain, key)) => builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| fail(ClientProblem::Tls(e)))?,
            None => builder.with_no_client_auth(),
        },
    };
    let https = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
    let https = match &config.tls_server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone())
                .map_err(|_| fail(ClientProblem::ServerName(name.clone())))?;
            https
                .https_only()
                .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => https.https_only(),
    }
    .enable_http1()
    .enable_http2()
    .wrap_connector(match egress {
        Some(e) => EgressConnector::new(e, CONNECT_TIMEOUT),
        None => connector(config).map_err(&fail)?,
    });
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .http2_keep_alive_interval(PING_EVERY)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(https);
    let auth = config
        .auth_layer()
        .map_err(|e| fail(ClientProblem::Auth(e)))?;
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(auth)
        .map_err(BoxError::from)
        // Every call gets its response headers within RESPONSE_TIMEOUT (a watch's headers come
        // at once; its events then stream): a hung API server fails a call, never stalls it.
        .timeout(RESPONSE_TIMEOUT)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
}

/// The config's CA bundle, else the system roots.
fn roots(config: &kube::Config) -> Result<RootCertStore, ClientProblem> {
    let mut roots = RootCertStore::empty();
    match &config.root_cert {
        Some(certs) => {
            for der in certs {
                roots
                    .add(CertificateDer::from(der.clone()))
                    .map_err(ClientProblem::UnusableCa)?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    if roots.is_empty() {
        return Err(ClientProblem::NoCa);
    }
    Ok(roots)
}

/// A config for `server`, verified with the PEM CA bundle `ca` (None: system roots).
pub fn config_for(
    server: &str,
    ca: Option<&std::path::Path>,
    tls_server_name: Option<String>,
) -> Result<kube::Config, LifecycleError> {
    let invalid = |problem| LifecycleError::InvalidServer {
        url: server.to_string(),
        problem,
    };
    let uri: hyper::Uri = server.parse().map_err(|_| invalid("not a URL"))?;
    if uri.scheme_str() != Some("https") {
        return Err(invalid("only https:// API servers are supported"));
    }
    let roots = match ca {
        Some(path) => Some(
            crate::pki::cert::load_chain(path)?
                .into_iter()
                .map(|c| c.to_vec())
                .collect(),
        ),
        None => None,
    };
    let mut config = kube::Config::new(uri);
    config.root_cert = roots;
    config.tls_server_name = tls_server_name;
    Ok(config)
}

/// [`config_for`] with the CA's certificates given (DER; a confined proxy's renewal has them
/// read by its signer side) instead of read from a file.
pub fn config_with_roots(
    server: &str,
    roots: Option<Vec<Vec<u8>>>,
    tls_server_name: Option<String>,
) -> Result<kube::Config, LifecycleError> {
    let mut config = config_for(server, None, tls_server_name)?;
    config.root_cert = roots;
    Ok(config)
}

/// A kubeconfig's own client certificate and key (`client-certificate[-data]`,
/// `client-key[-data]`), for clients that are not a hardware identity (the approver, run with
/// an operator's kubeconfig). None when the kubeconfig has none (a token, in-cluster).
fn software_identity(
    config: &kube::Config,
) -> Result<
    Option<(
        Vec<rustls::pki_types::CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    )>,
    ClientProblem,
> {
    use base64::Engine as _;
    use rustls::pki_types::pem::PemObject;
    use secrecy::ExposeSecret;
    let auth = &config.auth_info;
    let read = |data: Option<String>,
                path: Option<&String>,
                what: &'static str|
     -> Result<Option<Vec<u8>>, ClientProblem> {
        if let Some(d) = data {
            return base64::engine::general_purpose::STANDARD
                .decode(d.trim())
                .map(Some)
                .map_err(|source| ClientProblem::NotBase64 { what, source });
        }
        match path {
            Some(p) => std::fs::read(p)
                .map(Some)
                .map_err(|source| ClientProblem::Unreadable {
                    what,
                    path: p.into(),
                    source,
                }),
            None => Ok(None),
        }
    };
    let cert = read(
        auth.client_certificate_data.clone(),
        auth.client_certificate.as_ref(),
        "client-certificate",
    )?;
    let key = read(
        auth.client_key_data
            .as_ref()
            .map(|k| k.expose_secret().to_string()),
        auth.client_key.as_ref(),
        "client-key",
    )?;
    let (Some(cert), Some(key)) = (cert, key) else {
        return Ok(None);
    };
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| ClientProblem::NotPem {
            what: "client-certificate is not PEM",
            source,
        })?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&key).map_err(|source| {
        ClientProblem::NotPem {
            what: "client-key is not a PEM private key",
            source,
        }
    })?;
    Ok(Some((chain, key)))
}

/// A multi-thread runtime for the API calls (block_in_place needs one).
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, LifecycleError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(LifecycleError::Runtime)
}
