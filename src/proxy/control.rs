//! The control socket: where a local process of the proxy's user gets a loopback credential.
//!
//! A UNIX socket in `--state-dir` (`control.sock`, mode 0600, peer uid checked like the client
//! socket) speaking HTTP/1.1, so that `curl --unix-socket` and the exec front end use it alike:
//!
//! - `GET /v1/credential[?validity=10m]`: a fresh software key and a short-lived loopback
//!   client certificate (default `--credential-validity`, at most [`MAX_VALIDITY`], never past the
//!   hardware certificate's NotAfter), the loopback CA, and the proxy's loopback URL.
//! - `GET /v1/info`: the same without a credential (URLs, upstream, key description).
//!
//! The response holds a private key (a throw-away software key for the local hop only): it is
//! never logged and never written to disk by the proxy.
//!
//! Tasks: one accept loop task, one task per control connection (hyper HTTP/1.1).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::net::UnixListener;
use tokio::sync::watch;

use super::lifetime::Activity;
use super::listener::{check_peer, own_uid};
use super::metrics::Metrics;
use super::parts::Parts;
use super::settings::ClientSettings;
use super::upstream::Upstream;
use crate::control_api::{ControlError, LoopbackCredential, ProxyInfo, API_VERSION};
use crate::endpoint::ListenAddr;
use crate::pki::loopback_ca::{rfc3339, LoopbackCa};
use crate::stop::stopped;

/// What the control socket needs.
pub struct Control {
    /// Mints the loopback credentials.
    pub ca: LoopbackCa,
    /// Their default lifetime.
    pub credential_validity: Duration,
    /// `https://127.0.0.1:PORT` of the first loopback TLS listener, if any.
    pub loopback_url: Option<String>,
    /// The client UNIX sockets.
    pub unix_sockets: Vec<std::path::PathBuf>,
    /// Peers allowed besides the proxy's own uid.
    pub allowed_uids: Vec<u32>,
    /// A control request counts as activity for `--idle-exit`.
    pub activity: Arc<Activity>,
    /// Credentials issued.
    pub metrics: Arc<Metrics>,
    /// The key and certificate the credentials are capped by and the info names.
    pub upstream: Arc<Upstream>,
}

impl Control {
    /// The control socket's component: the loopback CA it mints with, and what it announces
    /// (the first loopback TLS listener's URL and the UNIX sockets among `bound`).
    pub fn build(settings: &ClientSettings, parts: Parts, bound: &[ListenAddr]) -> Control {
        let loopback_url = bound.iter().find_map(|a| match a {
            ListenAddr::Tcp(s) => Some(format!("https://{s}")),
            ListenAddr::Unix(_) => None,
        });
        let unix_sockets = bound
            .iter()
            .filter_map(|a| match a {
                ListenAddr::Unix(p) => Some(p.clone()),
                ListenAddr::Tcp(_) => None,
            })
            .collect();
        Control {
            ca: parts.ca,
            credential_validity: settings.credential_validity,
            loopback_url,
            unix_sockets,
            allowed_uids: settings.allow_uids.clone(),
            activity: parts.activity,
            metrics: parts.metrics,
            upstream: parts.upstream,
        }
    }
}
/// The longest loopback credential handed out.
pub const MAX_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// The shortest (a credential that expires before it is used helps nobody).
pub const MIN_VALIDITY: Duration = Duration::from_secs(60);

/// The control socket's limits: an exec plugin makes one request and closes; a client that
/// sends nothing is closed after 5 s, and at most 64 are open at once.
pub const CONTROL_LIMITS: crate::http_serve::Limits = crate::http_serve::Limits {
    max_connections: 64,
    header_timeout: Duration::from_secs(5),
    connection_timeout: Duration::from_secs(30),
};

/// Serves the control socket until `stop` (the owner's uid and `--allow-uid` only), within
/// [`CONTROL_LIMITS`].
pub async fn serve(shared: Arc<Control>, listener: UnixListener, mut stop: watch::Receiver<bool>) {
    let endpoint = crate::http_serve::Endpoint::new(CONTROL_LIMITS);
    loop {
        let stream = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(_) => { tokio::time::sleep(Duration::from_millis(100)).await; continue }
            },
        };
        if let Err(uid) = check_peer(&stream, &shared.allowed_uids) {
            tracing::warn!(peer_uid = ?uid, proxy_uid = own_uid(), "refused a control-socket client of another user");
            continue;
        }
        let Some(slot) = endpoint.admit() else {
            tracing::debug!(
                "{} control connections are open; closed a new one",
                CONTROL_LIMITS.max_connections
            );
            continue;
        };
        shared.activity.touch();
        let shared = shared.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            endpoint
                .serve(stream, move |req| {
                    let response = route(&shared, &req);
                    async move { response }
                })
                .await;
            drop(slot);
        });
    }
}

fn route(shared: &Control, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/v1/credential") => credential(shared, req.uri().query()),
        ("GET", "/v1/info") => json(StatusCode::OK, &info(shared, "ProxyInfo")),
        _ => error(
            StatusCode::NOT_FOUND,
            "not found: GET /v1/credential or /v1/info".into(),
        ),
    }
}

fn info(shared: &Control, kind: &str) -> ProxyInfo {
    ProxyInfo {
        kind: kind.into(),
        api_version: API_VERSION.into(),
        server: shared.loopback_url.clone(),
        unix_sockets: shared
            .unix_sockets
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        upstream: shared.upstream.describe(),
        key: shared.upstream.key().describe(),
        key_uri: Some(shared.upstream.key().uri().without_pin().to_string()),
        egress: Some(shared.upstream.egress().routes(shared.upstream.targets())),
        pid: std::process::id(),
        certificate_authority_pem: shared.ca.cert_pem().to_string(),
        certificate_chain_pem: crate::pki::cert::chain_to_pem(&shared.upstream.chain()),
    }
}

fn credential(shared: &Control, query: Option<&str>) -> Response<Full<Bytes>> {
    let mut validity = shared.credential_validity;
    for pair in query.unwrap_or("").split('&') {
        if let Some(v) = pair.strip_prefix("validity=") {
            match crate::duration::parse_duration(v) {
                Ok(d) => validity = d,
                Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
            }
        }
    }
    let validity = validity.clamp(MIN_VALIDITY, MAX_VALIDITY);
    let cap = hardware_not_after(shared);
    // A credential capped at a NotAfter already past would be expired when issued (NotAfter
    // before NotBefore): client-go would run the plugin again for every request, each failing
    // with an unclear TLS error. Say what is wrong instead.
    if let Some(expired) = cap.filter(|c| *c <= time::OffsetDateTime::now_utc()) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the proxy's client certificate expired at {}: no loopback credential can outlast it; renew the certificate (hwkey renew, or run the proxy with --renew) and the proxy picks the new one up",
                rfc3339(expired)
            ),
        );
    }
    let cred = match shared.ca.mint_client(validity, cap) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot mint a loopback credential");
            return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    };
    shared.metrics.credential_issued();
    let body = LoopbackCredential {
        info: info(shared, "LoopbackCredential"),
        client_certificate_pem: cred.cert_pem.clone(),
        client_key_pem: cred.key_pem.clone(),
        expiration_timestamp: rfc3339(cred.not_after),
        expiration_unix: cred.not_after.unix_timestamp(),
    };
    // The throw-away key lives in this response only: `cred.key_pem` and `body` are wiped on
    // drop; the encoded copy goes to the socket and is freed (not wiped) with the response.
    // Never logged.
    json(StatusCode::OK, &body)
}

fn hardware_not_after(shared: &Control) -> Option<time::OffsetDateTime> {
    let chain = shared.upstream.chain();
    let leaf = chain.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
    time::OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp()).ok()
}

fn error(status: StatusCode, error: String) -> Response<Full<Bytes>> {
    json(status, &ControlError { error })
}

fn json(status: StatusCode, body: &impl serde::Serialize) -> Response<Full<Bytes>> {
    let body = match serde_json::to_vec(body) {
        Ok(b) => b,
        // Our own types with string fields: encoding cannot fail; answer something parseable.
        Err(e) => format!("{{\"error\":\"cannot encode the answer: {e}\"}}").into_bytes(),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}
