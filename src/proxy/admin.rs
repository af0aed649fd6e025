//! The admin listener: `GET /healthz` and `GET /metrics` (Prometheus text), on loopback TCP
//! or a UNIX socket, separate from the client listeners so that monitoring never competes with
//! (or is mistaken for) API traffic. It serves no secrets.
//!
//! `/healthz` is 200 when the key can sign and the upstream accepts TCP connections, else 503
//! with the reasons. "Can sign" is proved by handshake signatures made since the last check;
//! only when there were none does the check make one test signature (on a blocking thread),
//! and its result is reused for [`KEY_CHECK_TTL`], so probes do not wear a slow TPM. A whole
//! answer stands for `--health-cache` (5 s), unless a signature or an upstream connection
//! failed since: probes within it cost nothing, and when it gives way, probes arriving
//! together share one check. So no number of probes makes the key sign or the proxy dial the
//! API server more than once per period, and a cached "ok" never hides a failure.
//!
//! Who gets what: the proxy's own uid, root, `--allow-uid` and `--admin-allow-uid` (a
//! monitoring agent) get `/healthz` with its reasons and `/metrics`. Any other local user
//! (who can reach a loopback port) gets only the last health status in one word, never causes
//! a check (so never a signature), and no metrics.
//!
//! Tasks: one accept loop task, one task per admin connection (hyper HTTP/1.1). Another local
//! user can reach a loopback TCP admin listener, so connections are capped, idle ones reaped
//! (header and connection timeouts) and refusals logged at a bounded rate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use tokio::sync::watch;

use super::admission::Admission;
use super::error::UpstreamError;
use super::limits::ADMIN_MAX_CONNECTIONS;
use super::listener::{accept_error, admit_connection, check_peer, Bound};
use super::metrics::Metrics;
use super::parts::Parts;
use super::ratelimit::RateLimited;
use super::renewal::RenewalStatus;
use super::settings::AdminSettings;
use super::upstream::Upstream;
use crate::endpoint::UpstreamTarget;
use crate::stop::stopped;

/// What the admin listener needs.
pub struct Admin {
    /// The key checked and the API servers dialled by `/healthz`.
    pub upstream: Arc<Upstream>,
    /// What `/metrics` renders.
    pub metrics: Arc<Metrics>,
    /// The last key check.
    pub health: HealthState,
    /// Loopback TCP admin connections, admitted by uid ([`ADMIN_MAX_CONNECTIONS`]).
    pub admission: Arc<Admission>,
    /// Its section of the settings: the listen address, the uids admitted like the proxy's
    /// own, and what `/healthz` may cost.
    pub settings: AdminSettings,
    /// The last renewal failure (`--renew`): `/healthz` says "degraded" with it.
    pub renewal: Arc<RenewalStatus>,
}

impl Admin {
    /// The admin listener's component, reporting `renewal`'s state.
    pub fn build(section: &AdminSettings, parts: &Parts, renewal: Arc<RenewalStatus>) -> Admin {
        Admin {
            upstream: parts.upstream.clone(),
            metrics: parts.metrics.clone(),
            health: HealthState::default(),
            admission: Admission::new(
                ADMIN_MAX_CONNECTIONS,
                ADMIN_RESERVED,
                owner_uids(),
                allowed_uids(section),
            ),
            settings: section.clone(),
            renewal,
        }
    }
}

/// How long a test signature's result stands for.
pub const KEY_CHECK_TTL: Duration = Duration::from_secs(30);
/// How long `/healthz` waits for the upstream's TCP accept.
const UPSTREAM_CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// Remembers what the last key check found, and the last `/healthz` answer.
#[derive(Debug, Default)]
pub struct HealthState {
    /// Shared with the test signature's blocking task, which records its own result: a probe
    /// that gives up (its client's timeout, the connection limit) does not lose it.
    last: Arc<Mutex<Option<KeyCheck>>>,
    /// The test signature running now, if any: a probe that finds one waits for it instead of
    /// starting another. Cleared by the signature's task when it ends, however it ends.
    test: Arc<Mutex<Option<watch::Receiver<bool>>>>,
    answer: Mutex<Option<Answer>>,
    /// Held while a check runs: probes arriving meanwhile wait for its answer.
    checking: tokio::sync::Mutex<()>,
}

/// One `/healthz` answer, when it was made, and the failures counted by then.
#[derive(Debug, Clone)]
struct Answer {
    at: Instant,
    failures: Failures,
    status: StatusCode,
    body: String,
}

/// Failed signatures and failed upstream connections since start. A failure after an answer
/// is news: that answer no longer stands, so a cached "ok" never hides a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Failures {
    signatures: u64,
    upstream: u64,
}

impl Failures {
    fn now(shared: &Admin) -> Failures {
        Failures {
            signatures: shared.upstream.key().signature_failures(),
            upstream: shared.metrics.upstream_errors(),
        }
    }
}

impl HealthState {
    /// The last answer's status in one word, whatever its age ("unknown", 503, before the
    /// first check): what other local users see, at no cost.
    fn last_word(&self) -> (StatusCode, &'static str) {
        let last = self
            .answer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match last {
            None => (StatusCode::SERVICE_UNAVAILABLE, "unknown"),
            Some(a) if a.status != StatusCode::OK => (a.status, "unhealthy"),
            Some(a) if a.body.starts_with("degraded") => (a.status, "degraded"),
            Some(a) => (a.status, "ok"),
        }
    }

    /// The last answer, if it is younger than `stands` and no failure came since.
    fn fresh(&self, stands: Duration, failures: Failures) -> Option<Answer> {
        self.answer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .filter(|a| a.at.elapsed() < stands && a.failures == failures)
    }
}

#[derive(Debug, Clone)]
struct KeyCheck {
    at: Instant,
    signatures: u64,
    result: Result<(), Unhealthy>,
}

/// How long `/healthz` waits for a test signature before it answers 503 (the signature goes on
/// and its result serves the next probe).
const TEST_SIGNATURE_WAIT: Duration = Duration::from_millis(900);

/// Why `/healthz` answers 503: the text after `key:`, `upstream:` or `certificate:`.
#[derive(Debug, Clone, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
enum Unhealthy {
    #[error("no certificate loaded")]
    NoCertificate,
    #[error("the certificate does not parse: {0}")]
    Unparsable(#[source] x509_parser::error::X509Error),
    #[error("expired at {0} (renew it: `hwkey renew`, or run the proxy with --renew)")]
    Expired(String),
    #[error("not valid before {0} (check the clocks)")]
    NotYetValid(String),
    #[error("the key offers no signature scheme")]
    NoScheme,
    #[error("{0}")]
    Sign(#[source] Arc<crate::key::KeyError>),
    #[error("{0}")]
    LastSignature(String),
    #[error("the check panicked: {0}")]
    Panicked(String),
    #[error("the signer has not answered a test signature within {TEST_SIGNATURE_WAIT:?} (stopped, or waiting on its device: a touch, a stalled TPM)")]
    SignerSlow,
    #[error("{source}")]
    Connect {
        addr: String,
        #[source]
        source: Arc<UpstreamError>,
    },
    #[error("{addr} did not accept within {UPSTREAM_CHECK_TIMEOUT:?}")]
    Timeout { addr: String },
}

/// Admin places other uids can never take.
pub const ADMIN_RESERVED: usize = 8;
/// How long an admin client may take to send its request headers.
const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest an admin connection lives (one request: `/healthz` may wait for the upstream and
/// a test signature).
const ADMIN_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

static BUSY_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));
static REFUSED_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));

/// Serves the admin endpoints until `stop`: one request per connection, at most
/// [`ADMIN_MAX_CONNECTIONS`] at once, each bounded by header and connection timeouts.
pub async fn serve(shared: Arc<Admin>, bound: Bound, mut stop: watch::Receiver<bool>) {
    let endpoint = crate::http_serve::Endpoint::new(crate::http_serve::Limits {
        max_connections: ADMIN_MAX_CONNECTIONS,
        header_timeout: ADMIN_HEADER_TIMEOUT,
        connection_timeout: ADMIN_CONNECTION_TIMEOUT,
    });
    let name = bound.addr().to_string();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            r = accept(&bound) => r,
        };
        let admitted = match accepted {
            Ok(a) => shared.admit(a, &endpoint),
            Err(e) => {
                accept_error(&name, e).await;
                continue;
            }
        };
        if let Some((conn, admitted, reached)) = admitted {
            tokio::spawn(serve_one(
                shared.clone(),
                endpoint.clone(),
                conn,
                admitted,
                reached,
            ));
        }
    }
}

/// The uids that get the admin port's details and an admin place first, whom no other uid
/// sheds: the proxy's own and root.
pub fn owner_uids() -> Vec<u32> {
    vec![super::listener::own_uid(), 0]
}

/// The other uids that get the details and a place before unknown ones (never at the owners'
/// expense): `--allow-uid` and `--admin-allow-uid`.
pub fn allowed_uids(section: &AdminSettings) -> Vec<u32> {
    let mut uids = section.allow_uids.clone();
    uids.extend_from_slice(&section.monitor_uids);
    uids
}

/// A connection accepted on the admin listener.
enum Accepted {
    Tcp(tokio::net::TcpStream, std::net::SocketAddr),
    Unix(tokio::net::UnixStream),
}

async fn accept(bound: &Bound) -> std::io::Result<Accepted> {
    match bound {
        Bound::Tcp { listener, .. } => listener
            .accept()
            .await
            .map(|(s, peer)| Accepted::Tcp(s, peer)),
        Bound::Unix { listener, .. } => listener.accept().await.map(|(s, _)| Accepted::Unix(s)),
    }
}

impl Admin {
    /// Admits a connection: loopback TCP by its peer's uid, a UNIX-socket peer if its uid is
    /// allowed and a place is free. None: closed.
    fn admit(
        &self,
        accepted: Accepted,
        endpoint: &crate::http_serve::Endpoint,
    ) -> Option<(Box<dyn super::bridge::ClientIo>, Admitted, Reached)> {
        match accepted {
            Accepted::Tcp(s, peer) => {
                let ticket = admit_connection(&self.admission, &self.metrics, &s, peer)?;
                let reached = if s.local_addr().is_ok_and(|a| a.ip().is_loopback()) {
                    Reached::Loopback
                } else {
                    Reached::Network
                };
                Some((Box::new(s), Admitted::ByUid(ticket), reached))
            }
            Accepted::Unix(s) => {
                if check_peer(&s, &self.settings.allow_uids).is_err() {
                    if let Some(suppressed) = REFUSED_LOG.allow() {
                        tracing::warn!(suppressed, "refused an admin client of another user");
                    }
                    return None;
                }
                // Only allowed uids reach this socket: a plain cap.
                let Some(permit) = endpoint.admit() else {
                    if let Some(suppressed) = BUSY_LOG.allow() {
                        tracing::warn!(
                            suppressed,
                            "{ADMIN_MAX_CONNECTIONS} admin connections are open; closed a new one"
                        );
                    }
                    return None;
                };
                Some((Box::new(s), Admitted::Permit(permit), Reached::Unix))
            }
        }
    }
}

/// Where an admin connection came in, which decides the `Host` a request may name.
#[derive(Debug, Clone, Copy)]
enum Reached {
    /// A loopback TCP address: [`loopback_host`].
    Loopback,
    /// A network address (`--unsafe-listen`): [`literal_host`], an IP address or `localhost`.
    Network,
    /// The admin UNIX socket: no browser reaches it, any `Host`.
    Unix,
}

/// Serves one admin connection; a loopback one ends early when it is shed for the proxy's own
/// uid. `reached`: where it came in, which decides the `Host` its requests may name.
async fn serve_one(
    shared: Arc<Admin>,
    endpoint: crate::http_serve::Endpoint,
    conn: Box<dyn super::bridge::ClientIo>,
    admitted: Admitted,
    reached: Reached,
) {
    // UNIX-socket peers passed the uid check; loopback ones are privileged or not.
    let privileged = match &admitted {
        Admitted::ByUid(ticket) => ticket.privileged,
        Admitted::Permit(_) => true,
    };
    let handler = move |req: Request<Incoming>| {
        let shared = shared.clone();
        async move {
            let host_ok = match reached {
                Reached::Loopback => loopback_host(&req),
                Reached::Network => literal_host(&req),
                Reached::Unix => true,
            };
            if !host_ok {
                return misdirected();
            }
            route(&shared, req, privileged).await
        }
    };
    match &admitted {
        Admitted::ByUid(ticket) => {
            tokio::select! {
                _ = endpoint.serve(conn, handler) => {}
                _ = ticket.shed() => {}
            }
        }
        Admitted::Permit(_) => endpoint.serve(conn, handler).await,
    }
    drop(admitted);
}

/// What holds an admin connection's place.
enum Admitted {
    /// A loopback TCP connection, admitted by its peer's uid (it may be shed for the proxy's
    /// own uid): that admission is its only cap, so a connection admitted in place of a shed
    /// one never waits for the shed one's slot.
    ByUid(super::admission::Ticket),
    /// A UNIX-socket connection of an allowed uid.
    Permit(
        #[allow(dead_code, reason = "held for the connection's life, released on drop")]
        tokio::sync::OwnedSemaphorePermit,
    ),
}

/// Whether a request to the loopback TCP admin port names a loopback host (`localhost`, an
/// address of 127.0.0.0/8 or `::1`, with or without a port), or none (HTTP/1.0). The port's
/// uid check admits a browser, which runs as the user: a web page whose name was rebound to
/// 127.0.0.1 (DNS rebinding) would otherwise read `/metrics` and `/healthz`'s reasons, and
/// trigger test signatures, with the name of its own site in `Host`.
fn loopback_host(req: &Request<Incoming>) -> bool {
    let Some(host) = req.headers().get(hyper::header::HOST) else {
        return true;
    };
    host.to_str().is_ok_and(is_loopback_name)
}

/// Whether a request to the admin port on a network address (`--unsafe-listen`) names no host
/// (HTTP/1.0), `localhost` or an IP address: never a DNS name, which a rebinding web page would
/// send with its own site's name while the port's uid check admits the browser's user.
fn literal_host(req: &Request<Incoming>) -> bool {
    let Some(host) = req.headers().get(hyper::header::HOST) else {
        return true;
    };
    host.to_str().is_ok_and(|h| literal(h).is_some())
}

/// A `Host` value that names no DNS name: `localhost` (or `localhost.`), or an IP address (a
/// zone id allowed), with or without a port.
#[derive(Debug, PartialEq, Eq)]
enum Literal {
    Localhost,
    Ip(std::net::IpAddr),
}

fn literal(host: &str) -> Option<Literal> {
    // `[::1]:9000`, `[::1%lo]`, `127.0.0.1:9000`, `localhost.`
    let name = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((inside, port)) if port.is_empty() || port.starts_with(':') => {
                inside.split_once('%').map_or(inside, |(ip, _zone)| ip)
            }
            _ => return None,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.eq_ignore_ascii_case("localhost") {
        return Some(Literal::Localhost);
    }
    name.parse::<std::net::IpAddr>().ok().map(Literal::Ip)
}

/// Whether a `Host` value names this machine's loopback: `localhost` (or `localhost.`), an
/// address of 127.0.0.0/8, `::1` (a zone id allowed) or `::ffff:127.x.y.z`, with or without a
/// port.
fn is_loopback_name(host: &str) -> bool {
    match literal(host) {
        Some(Literal::Localhost) => true,
        Some(Literal::Ip(ip)) => ip.to_canonical().is_loopback(),
        None => false,
    }
}

/// The answer to a request for another host (see [`loopback_host`]).
fn misdirected() -> Response<Full<Bytes>> {
    text(
        StatusCode::MISDIRECTED_REQUEST,
        "text/plain",
        "misdirected: the admin port answers requests for localhost or an IP address (on a loopback address: localhost, 127.0.0.1 or [::1]) only\n"
            .into(),
    )
}

async fn route(shared: &Admin, req: Request<Incoming>, privileged: bool) -> Response<Full<Bytes>> {
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/healthz") if !privileged => {
            let (status, word) = shared.health.last_word();
            text(status, "text/plain", format!("{word}\n"))
        }
        ("GET", "/metrics") if !privileged => text(
            StatusCode::FORBIDDEN,
            "text/plain",
            "forbidden: /metrics is for the proxy's user, root and --admin-allow-uid\n".into(),
        ),
        ("GET", "/metrics") => {
            let key = shared.upstream.key();
            let body = shared.metrics.render(
                key.signatures(),
                key.signature_failures(),
                &key.signer_refusals(),
            );
            text(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            )
        }
        ("GET", "/healthz") => {
            let answer = healthz(shared).await;
            text(answer.status, "text/plain", answer.body)
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /healthz or /metrics\n".into(),
        ),
    }
}

/// The `/healthz` answer: the last one while it stands, else one new check shared by every
/// probe waiting for it.
async fn healthz(shared: &Admin) -> Answer {
    let stands = shared.settings.health_cache;
    if let Some(a) = shared.health.fresh(stands, Failures::now(shared)) {
        return a;
    }
    let _one_check = shared.health.checking.lock().await;
    if let Some(a) = shared.health.fresh(stands, Failures::now(shared)) {
        return a;
    }
    let (status, body) = check(shared).await;
    // Counted after the check, so the check's own failed test signature is not news.
    let failures = Failures::now(shared);
    let answer = Answer {
        at: Instant::now(),
        failures,
        status,
        body,
    };
    *shared
        .health
        .answer
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Some(answer.clone());
    answer
}

/// Checks the key, the upstream and the certificate: 200 with "ok" or "degraded: …", or 503
/// with every problem found.
async fn check(shared: &Admin) -> (StatusCode, String) {
    let mut problems = Vec::new();
    if let Err(e) = key_check(shared).await {
        problems.push(format!("key: {e}"));
    }
    if let Err(e) = upstream_check(shared).await {
        problems.push(format!("upstream: {e}"));
    }
    if let Err(e) = certificate_check(shared) {
        problems.push(format!("certificate: {e}"));
    }
    if !problems.is_empty() {
        let body = format!("unhealthy: {}\n", problems.join("; "));
        return (StatusCode::SERVICE_UNAVAILABLE, body);
    }
    if let Some(why) = renewal_degraded(shared) {
        return (StatusCode::OK, format!("degraded: {why}\n"));
    }
    if let Some(why) = shared.upstream.cert_problem() {
        return (
            StatusCode::OK,
            format!(
                "degraded: the certificate was not reloaded ({why}); the previous one is in use\n"
            ),
        );
    }
    match shared.upstream.trust_problem() {
        Some(why) => (
            StatusCode::OK,
            format!("degraded: the upstream CA bundle was not reloaded ({why}); the previous trust is in use\n"),
        ),
        None => (StatusCode::OK, "ok\n".into()),
    }
}

/// The client certificate in use must be valid now: outside its window the API server refuses
/// every request, so the proxy is not healthy, whatever the key and the upstream say.
fn certificate_check(shared: &Admin) -> Result<(), Unhealthy> {
    let chain = shared.upstream.chain();
    let leaf = chain.first().ok_or(Unhealthy::NoCertificate)?;
    let (_, leaf) =
        x509_parser::parse_x509_certificate(leaf).map_err(|e| Unhealthy::Unparsable(e.into()))?;
    let v = leaf.validity();
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    if now > v.not_after.timestamp() {
        return Err(Unhealthy::Expired(v.not_after.to_string()));
    }
    if now < v.not_before.timestamp() {
        return Err(Unhealthy::NotYetValid(v.not_before.to_string()));
    }
    Ok(())
}

/// With `--renew`: the certificate is past 90 % of its lifetime and the last renewal attempt
/// failed. Still serving (200), but the operator must look before it expires.
fn renewal_degraded(shared: &Admin) -> Option<String> {
    let error = shared.renewal.last_error()?;
    let chain = shared.upstream.chain();
    let (_, leaf) = x509_parser::parse_x509_certificate(chain.first()?).ok()?;
    let v = leaf.validity();
    let (from, to) = (v.not_before.timestamp(), v.not_after.timestamp());
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let lifetime = (to - from).max(1);
    if (now - from) * 10 < lifetime * 9 {
        return None;
    }
    Some(format!(
        "the certificate is past 90% of its lifetime (expires {}) and renewal keeps failing: {error}",
        v.not_after
    ))
}

fn text(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

async fn key_check(shared: &Admin) -> Result<(), Unhealthy> {
    let now_sigs = shared.upstream.key().signatures();
    let cached = shared
        .health
        .last
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let last_error = shared.upstream.key().last_signature_error();
    if let Some(c) = &cached {
        // Signatures since the last check and the latest attempt succeeded: the key works now,
        // no test signature needed.
        if now_sigs > c.signatures && last_error.is_none() {
            return Ok(());
        }
        if c.at.elapsed() < KEY_CHECK_TTL {
            // A signature that failed after a good check is the news.
            if let (Some(e), Ok(())) = (last_error, &c.result) {
                return Err(Unhealthy::LastSignature(e));
            }
            return c.result.clone();
        }
    }
    let mut done = test_signature(shared);
    // Waits for the test signature, which runs (and records its result) even when this probe
    // gives up: the next probe reads it instead of signing again. A probe's own timeout is
    // short (kubelet's: 1 s), so an unanswered signature is an answer too.
    match tokio::time::timeout(TEST_SIGNATURE_WAIT, done.wait_for(|finished| *finished)).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => {
            return Err(Unhealthy::Panicked(
                "the test signature ended without a result".into(),
            ))
        }
        Err(_) => return Err(Unhealthy::SignerSlow),
    }
    let recorded = shared
        .health
        .last
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|c| c.result.clone());
    recorded.unwrap_or_else(|| {
        Err(Unhealthy::Panicked(
            "the test signature recorded no result".into(),
        ))
    })
}

/// The test signature running now, or a new one: at most one at a time, whatever the number of
/// probes and however many of them give up. The blocking task records its result in
/// `health.last` and clears `health.test` itself (on unwinding too), then says it is done.
fn test_signature(shared: &Admin) -> watch::Receiver<bool> {
    let mut running = shared.health.test.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(done) = running.as_ref() {
        return done.clone();
    }
    let (tx, done) = watch::channel(false);
    *running = Some(done.clone());
    let key = shared.upstream.key();
    let last = shared.health.last.clone();
    let clear = ClearTest(shared.health.test.clone());
    tokio::task::spawn_blocking(move || {
        let _clear = clear;
        let result = key
            .schemes()
            .first()
            .copied()
            .ok_or(Unhealthy::NoScheme)
            .and_then(|scheme| {
                key.sign_for(
                    crate::key::Purpose::HealthCheck,
                    scheme,
                    crate::key::HEALTH_CHECK_MESSAGE,
                )
                .map(|_| ())
                .map_err(|e| Unhealthy::Sign(Arc::new(e)))
            });
        *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(KeyCheck {
            at: Instant::now(),
            signatures: key.signatures(),
            result,
        });
        let _ = tx.send(true);
    });
    done
}

/// Clears the running test signature when its task ends (returning or unwinding): a panic
/// must not leave every later probe waiting on a signature that is gone.
struct ClearTest(Arc<Mutex<Option<watch::Receiver<bool>>>>);

impl Drop for ClearTest {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Healthy when any API server accepts a connection (through the forward proxy when there is
/// one: what matters is that requests get through); otherwise the first one's error.
async fn upstream_check(shared: &Admin) -> Result<(), Unhealthy> {
    let mut first_error = None;
    for t in shared.upstream.targets() {
        match dial_check(shared, t).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

async fn dial_check(shared: &Admin, t: &UpstreamTarget) -> Result<(), Unhealthy> {
    match tokio::time::timeout(UPSTREAM_CHECK_TIMEOUT, shared.upstream.dial(t)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Unhealthy::Connect {
            addr: t.authority(),
            source: Arc::new(e),
        }),
        Err(_) => Err(Unhealthy::Timeout {
            addr: t.authority(),
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_names_of_the_loopback_and_others() {
        for ok in [
            "localhost",
            "LOCALHOST:1",
            "localhost.",
            "localhost.:9000",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:9000",
            "[::1%lo]:9000",
            "[::ffff:127.0.0.1]",
        ] {
            assert!(super::is_loopback_name(ok), "{ok}");
        }
        for no in [
            "evil.example",
            "evil.example:80",
            "localhost.evil.example",
            "127.0.0.1.evil",
            "[::2]",
            "[::1]x",
            "10.0.0.1:9000",
            "",
            "[::ffff:10.0.0.1]",
        ] {
            assert!(!super::is_loopback_name(no), "{no}");
        }
        // On a network address: any IP address or localhost, never a DNS name.
        for ok in ["10.0.0.1:9000", "[fd00::2]:9", "192.0.2.2", "localhost:1"] {
            assert!(super::literal(ok).is_some(), "{ok}");
        }
        for no in [
            "evil.example",
            "evil.example:9000",
            "10.0.0.1.evil",
            "[::2]x",
            "",
        ] {
            assert!(super::literal(no).is_none(), "{no}");
        }
    }
}
