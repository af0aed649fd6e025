//! The approver's metrics (OpenMetrics, `prometheus-client`), its `/metrics` listener and its
//! liveness listener. Names are the operator's contract:
//!
//! - `hwkey_approver_decisions_total{decision, reason}`: decisions written, by reason
//!   (`approved`/`AttestedTPMKey`, `denied`/every other [`Reason`]).
//! - `hwkey_approver_conflicts_total`: decisions not written because the request changed
//!   meanwhile (another replica or approver decided it).
//! - `hwkey_approver_verify_seconds`: time to judge one request from its content.
//! - `hwkey_approver_leader`: 1 while this replica holds the Lease (or runs without election).
//! - `hwkey_approver_registered_nodes`: usable registrations in the trust source as last read.
//! - `hwkey_approver_trust_available`: 0 while the trust source cannot be read.
//! - `hwkey_approver_trust_invalid_entries`, `hwkey_approver_trust_duplicate_aks`.
//! - `hwkey_approver_retries_total`: writes retried after a transient error.
//! - `hwkey_approver_queued`: decisions waiting to be written.
//! - `hwkey_approver_deferred_total`: requests not queued because their requester's lane was
//!   full (they come back at the next resync).
//! - `hwkey_approver_evidence_index`: pieces of evidence remembered (bounded by the window).
//! - `hwkey_approver_watch_errors_total`: list/watch failures (kube's watcher retries).
//!
//! Liveness is served apart from metrics ([`serve_health`]), with its own small cap: whoever can
//! reach the metrics port cannot hold the probe's slots and get the approver restarted.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::reason::Reason;
use crate::label_values;
use crate::metric_labels::LabelValue;

label_values! {
    /// A decision's outcome.
    pub enum Verdict {
        /// Approved.
        Approved => "approved",
        /// Denied.
        Denied => "denied",
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: Verdict,
    reason: Reason,
}

/// When the decision loop last ran: the liveness probe fails when it stops.
#[derive(Debug, Clone)]
pub struct Heartbeat(Arc<Mutex<Instant>>);

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat(Arc::new(Mutex::new(Instant::now())))
    }
}

impl Heartbeat {
    /// The loop is alive now.
    pub fn beat(&self) {
        if let Ok(mut at) = self.0.lock() {
            *at = Instant::now();
        }
    }

    /// How long ago the loop last ran.
    pub fn age(&self) -> Duration {
        self.0
            .lock()
            .map(|at| at.elapsed())
            .unwrap_or(Duration::MAX)
    }
}

/// How long the decision loop may be silent before the liveness probe fails.
pub const STALLED_AFTER: Duration = Duration::from_secs(30);

/// The approver's metrics, registered once.
pub struct ApproverMetrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    /// Decisions not written: the request changed meanwhile.
    pub conflicts: Counter,
    /// Seconds per request judged.
    pub verify_seconds: Histogram,
    /// 1 while leading.
    pub leader: Gauge,
    /// Usable registrations.
    pub registered_nodes: Gauge,
    /// 1 while the trust source can be read.
    pub trust_available: Gauge,
    /// Trust entries skipped as malformed.
    pub trust_invalid_entries: Gauge,
    /// AKs registered for more than one node.
    pub trust_duplicate_aks: Gauge,
    /// Writes retried after a transient error.
    pub retries: Counter,
    /// Decisions waiting to be written.
    pub queued: Gauge,
    /// Requests not queued: their requester's lane was full.
    pub deferred: Counter,
    /// Pieces of evidence remembered.
    pub evidence_index: Gauge,
    /// List/watch failures.
    pub watch_errors: Counter,
    /// The decision loop's heartbeat.
    pub heartbeat: Heartbeat,
}

fn register<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Default for ApproverMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        for reason in Reason::ALL {
            decisions
                .get_or_create(&DecisionLabels {
                    decision: verdict(*reason),
                    reason: *reason,
                })
                .inc_by(0);
        }
        let r = &mut registry;
        let decisions = register(
            r,
            "hwkey_approver_decisions",
            "CertificateSigningRequests decided, by decision and reason",
            decisions,
        );
        // 50 µs .. ~100 ms: one ECDSA verification plus parsing is well under a millisecond.
        let verify_seconds = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.00005, 2.0, 12),
        );
        ApproverMetrics {
            decisions,
            conflicts: register(r, "hwkey_approver_conflicts", "Decisions not written because the request changed meanwhile", Counter::default()),
            verify_seconds: register(r, "hwkey_approver_verify_seconds", "Time to judge one request from its content: parsing, its signature and TPM evidence", verify_seconds),
            leader: register(r, "hwkey_approver_leader", "1 while this replica decides (holds the Lease, or runs without leader election)", Gauge::default()),
            registered_nodes: register(r, "hwkey_approver_registered_nodes", "Usable registrations in the trust source as last read", Gauge::default()),
            trust_available: register(r, "hwkey_approver_trust_available", "1 while the trust source can be read; 0 while requests that need it wait", Gauge::default()),
            trust_invalid_entries: register(r, "hwkey_approver_trust_invalid_entries", "Trust entries skipped because they are not a usable registration", Gauge::default()),
            trust_duplicate_aks: register(r, "hwkey_approver_trust_duplicate_aks", "Attestation keys registered for more than one node", Gauge::default()),
            retries: register(r, "hwkey_approver_retries", "Writes retried after a transient error (trust source, API server)", Counter::default()),
            queued: register(r, "hwkey_approver_queued", "Decisions waiting to be written", Gauge::default()),
            deferred: register(r, "hwkey_approver_deferred", "Requests not queued because their requester has too many queued; listed again at the next resync", Counter::default()),
            evidence_index: register(r, "hwkey_approver_evidence_index", "Pieces of TPM evidence remembered to refuse reuse (forgotten past the freshness window)", Gauge::default()),
            watch_errors: register(r, "hwkey_approver_watch_errors", "Failures listing or watching requests (retried with backoff)", Counter::default()),
            heartbeat: Heartbeat::default(),
            registry,
        }
    }
}

fn verdict(reason: Reason) -> Verdict {
    if reason.approves() {
        Verdict::Approved
    } else {
        Verdict::Denied
    }
}

impl ApproverMetrics {
    /// Counts a written decision.
    pub fn decided(&self, reason: Reason) {
        self.decisions
            .get_or_create(&DecisionLabels {
                decision: verdict(reason),
                reason,
            })
            .inc();
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The liveness answer: 200 while the decision loop runs, 503 once it has been silent for
    /// [`STALLED_AFTER`].
    fn health(&self) -> (StatusCode, String) {
        let age = self.heartbeat.age();
        if age > STALLED_AFTER {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "stalled: the decision loop has not run for {} s\n",
                    age.as_secs()
                ),
            );
        }
        let role = if self.leader.get() == 1 {
            "leading"
        } else {
            "standing by"
        };
        (StatusCode::OK, format!("ok: {role}\n"))
    }
}

/// Which paths a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Serves {
    /// `/metrics` and `/healthz`.
    Metrics,
    /// `/healthz` only.
    Health,
}

/// Serves `/metrics` (and `/healthz`) on `listener` until `stop`: 32 connections at most.
/// Metrics hold no secrets; the listener may be a pod's address for Prometheus.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<ApproverMetrics>,
    stop: watch::Receiver<bool>,
) {
    serve(listener, metrics, stop, Serves::Metrics, 32).await
}

/// Serves `/healthz` alone on `listener` until `stop`, with its own 4 connections and short
/// deadlines: the liveness probe's port, which the manifest's NetworkPolicy closes to pods.
/// At the cap the oldest connection gives way to the new one, so a client holding every slot
/// (8 idle connections once answered 0 of 5 probes) cannot get the approver restarted.
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    metrics: Arc<ApproverMetrics>,
    stop: watch::Receiver<bool>,
) {
    serve(listener, metrics, stop, Serves::Health, 4).await
}

async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<ApproverMetrics>,
    mut stop: watch::Receiver<bool>,
    serves: Serves,
    max_connections: usize,
) {
    let endpoint = crate::http_serve::Endpoint::new(crate::http_serve::Limits {
        max_connections,
        header_timeout: Duration::from_secs(if serves == Serves::Health { 2 } else { 5 }),
        connection_timeout: Duration::from_secs(if serves == Serves::Health { 5 } else { 10 }),
    });
    // The connections being served, oldest first: on the health port, the one that gives way
    // at the cap. Every request is answered at once, so a connection still here is one that
    // has not sent it.
    let mut live: std::collections::VecDeque<tokio::task::JoinHandle<()>> =
        std::collections::VecDeque::new();
    loop {
        let conn = tokio::select! {
            _ = crate::stop::stopped(&mut stop) => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        live.retain(|task| !task.is_finished());
        // Only the probe's port evicts: the metrics port, which pods may reach, refuses at its
        // cap, so holding it achieves nothing beyond it.
        let slot = match serves {
            Serves::Health => admit_evicting_oldest(&endpoint, &mut live).await,
            Serves::Metrics => endpoint.admit(),
        };
        let Some(slot) = slot else {
            continue;
        };
        let _ = conn.set_nodelay(true);
        let metrics = metrics.clone();
        let endpoint = endpoint.clone();
        live.push_back(tokio::spawn(async move {
            endpoint
                .serve(conn, move |req: Request<hyper::body::Incoming>| {
                    let response = route(&metrics, serves, req.method(), req.uri().path());
                    async move { response }
                })
                .await;
            drop(slot);
        }));
    }
    for task in live {
        task.abort();
    }
}

/// A slot for a new connection: a free one, or the oldest connection's, which is closed (its
/// task ends, giving the slot back, before this returns).
async fn admit_evicting_oldest(
    endpoint: &crate::http_serve::Endpoint,
    live: &mut std::collections::VecDeque<tokio::task::JoinHandle<()>>,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Some(slot) = endpoint.admit() {
        return Some(slot);
    }
    let oldest = live.pop_front()?;
    oldest.abort();
    // Resolves once the task is gone, its slot with it.
    let _ = oldest.await;
    endpoint.admit()
}

fn route(
    metrics: &ApproverMetrics,
    serves: Serves,
    method: &hyper::Method,
    path: &str,
) -> Response<Full<Bytes>> {
    let (status, kind, body) = match (method.as_str(), path, serves) {
        ("GET", "/metrics", Serves::Metrics) => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        ("GET", "/healthz", _) => {
            let (status, text) = metrics.health();
            (status, "text/plain", text)
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /healthz or /metrics\n".into(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(kind) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_present_from_the_start() {
        let m = ApproverMetrics::default();
        m.decided(Reason::AttestedTpmKey);
        let text = m.render();
        assert!(
            text.contains(
                "hwkey_approver_decisions_total{decision=\"approved\",reason=\"AttestedTPMKey\"} 1"
            ),
            "{text}"
        );
        for reason in [
            "NoEvidence",
            "EvidenceInvalid",
            "UnknownAttestationKey",
            "SubjectMismatch",
            "MalformedRequest",
            "EvidenceReused",
        ] {
            assert!(
                text.contains(&format!(
                    "hwkey_approver_decisions_total{{decision=\"denied\",reason=\"{reason}\"}} 0"
                )),
                "{reason}: {text}"
            );
        }
        assert!(
            text.contains("hwkey_approver_verify_seconds_bucket"),
            "{text}"
        );
    }

    /// One probe on `addr`: the status line of the answer, or what went wrong.
    async fn probe(addr: std::net::SocketAddr) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = match tokio::net::TcpStream::connect(addr).await {
            Ok(c) => c,
            Err(e) => return format!("connect: {e}"),
        };
        if let Err(e) = conn
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: probe\r\n\r\n")
            .await
        {
            return format!("write: {e}");
        }
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer));
        match read.await {
            Ok(Ok(_)) => String::from_utf8_lossy(&answer)
                .lines()
                .next()
                .unwrap_or("no answer")
                .to_string(),
            Ok(Err(e)) => format!("read: {e}"),
            Err(_) => "no answer within 5 s".into(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_is_answered_while_a_client_holds_every_slot() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let (_stop_tx, stop) = watch::channel(false);
        let server = tokio::spawn(serve_health(
            listener,
            Arc::new(ApproverMetrics::default()),
            stop,
        ));
        // One client holds 8 connections that never send a request (twice the slots).
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        // The listener accepts in arrival order: every held connection before each probe.
        let mut answers = Vec::new();
        for _ in 0..5 {
            answers.push(probe(addr).await);
        }
        server.abort();
        let ok = answers.iter().filter(|a| a.contains(" 200 ")).count();
        assert_eq!(ok, 5, "probes answered: {answers:?}");
    }

    #[test]
    fn liveness_fails_once_the_loop_is_silent() {
        let m = ApproverMetrics::default();
        assert_eq!(m.health().0, StatusCode::OK);
        if let Ok(mut at) = m.heartbeat.0.lock() {
            *at = Instant::now()
                .checked_sub(STALLED_AFTER + Duration::from_secs(1))
                .expect("the machine has been up for a minute");
        }
        let (status, text) = m.health();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.contains("stalled"), "{text}");
    }
}
