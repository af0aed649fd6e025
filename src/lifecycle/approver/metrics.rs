//! The approver's metrics (OpenMetrics, `prometheus-client`) and its `/metrics` + `/healthz`
//! listener. Names are the operator's contract:
//!
//! - `hwkey_approver_decisions_total{decision, reason}`: decisions written, by reason
//!   (`approved`/`AttestedTPMKey`, `denied`/every other [`Reason`]).
//! - `hwkey_approver_conflicts_total`: decisions not written because the request changed
//!   meanwhile (another replica or approver decided it).
//! - `hwkey_approver_verify_seconds`: time to check one request (signature, evidence, trust).
//! - `hwkey_approver_leader`: 1 while this replica holds the Lease (or runs without election).
//! - `hwkey_approver_registered_nodes`: nodes in the trust source as last read.
//! - `hwkey_approver_trust_invalid_entries`: trust entries skipped as malformed.
//! - `hwkey_approver_trust_duplicate_aks`: AKs registered for more than one node.
//! - `hwkey_approver_retries_total`: decisions retried after a transient error.

use std::sync::Arc;
use std::time::Duration;

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

use super::policy::Reason;

#[derive(
    Debug, Clone, Copy, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelValue,
)]
#[allow(
    non_camel_case_types,
    reason = "the label values operators match on are lowercase"
)]
enum Verdict {
    approved,
    denied,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    decision: Verdict,
    reason: Reason,
}

/// The approver's metrics, registered once.
pub struct ApproverMetrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    /// Decisions not written: the request changed meanwhile.
    pub conflicts: Counter,
    /// Seconds per request check.
    pub verify_seconds: Histogram,
    /// 1 while leading.
    pub leader: Gauge,
    /// Nodes in the trust source.
    pub registered_nodes: Gauge,
    /// Trust entries skipped as malformed.
    pub trust_invalid_entries: Gauge,
    /// AKs registered for more than one node.
    pub trust_duplicate_aks: Gauge,
    /// Decisions retried after a transient error.
    pub retries: Counter,
}

impl Default for ApproverMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        for reason in Reason::ALL {
            let decision = if reason == Reason::AttestedTPMKey {
                Verdict::approved
            } else {
                Verdict::denied
            };
            decisions
                .get_or_create(&DecisionLabels { decision, reason })
                .inc_by(0);
        }
        registry.register(
            "hwkey_approver_decisions",
            "CertificateSigningRequests decided, by decision and reason",
            decisions.clone(),
        );
        let conflicts = Counter::default();
        registry.register(
            "hwkey_approver_conflicts",
            "Decisions not written because the request changed meanwhile",
            conflicts.clone(),
        );
        // 50 µs .. ~100 ms: one ECDSA verification plus parsing is well under a millisecond.
        let verify_seconds = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.00005, 2.0, 12),
        );
        registry.register(
            "hwkey_approver_verify_seconds",
            "Time to check one request: its signature, TPM evidence and trust",
            verify_seconds.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "hwkey_approver_leader",
            "1 while this replica decides (holds the Lease, or runs without leader election)",
            leader.clone(),
        );
        let registered_nodes = Gauge::default();
        registry.register(
            "hwkey_approver_registered_nodes",
            "Registered nodes in the trust source as last read",
            registered_nodes.clone(),
        );
        let trust_invalid_entries = Gauge::default();
        registry.register(
            "hwkey_approver_trust_invalid_entries",
            "Trust entries skipped because they are not a usable registration",
            trust_invalid_entries.clone(),
        );
        let trust_duplicate_aks = Gauge::default();
        registry.register(
            "hwkey_approver_trust_duplicate_aks",
            "Attestation keys registered for more than one node",
            trust_duplicate_aks.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "hwkey_approver_retries",
            "Decisions retried after a transient error (trust source, API server)",
            retries.clone(),
        );
        ApproverMetrics {
            registry,
            trust_invalid_entries,
            trust_duplicate_aks,
            retries,
            decisions,
            conflicts,
            verify_seconds,
            leader,
            registered_nodes,
        }
    }
}

impl ApproverMetrics {
    /// Counts a written decision.
    pub fn decided(&self, reason: Reason) {
        let decision = if reason == Reason::AttestedTPMKey {
            Verdict::approved
        } else {
            Verdict::denied
        };
        self.decisions
            .get_or_create(&DecisionLabels { decision, reason })
            .inc();
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `/metrics` and `/healthz` (200 `ok: leading` / `ok: standing by`) on `listener` until
/// `stop`. Metrics hold no secrets; the listener may be a pod's address for Prometheus.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<ApproverMetrics>,
    leading: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let endpoint = crate::http_serve::Endpoint::new(crate::http_serve::Limits {
        max_connections: 32,
        header_timeout: Duration::from_secs(5),
        connection_timeout: Duration::from_secs(10),
    });
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
        let Some(slot) = endpoint.admit() else {
            continue;
        };
        let metrics = metrics.clone();
        let leading = leading.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            endpoint
                .serve(conn, move |req: Request<hyper::body::Incoming>| {
                    let response =
                        route(&metrics, *leading.borrow(), req.method(), req.uri().path());
                    async move { response }
                })
                .await;
            drop(slot);
        });
    }
}

fn route(
    metrics: &ApproverMetrics,
    leading: bool,
    method: &hyper::Method,
    path: &str,
) -> Response<Full<Bytes>> {
    let (status, kind, body) = match (method.as_str(), path) {
        ("GET", "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        ),
        ("GET", "/healthz") => (
            StatusCode::OK,
            "text/plain",
            if leading {
                "ok: leading\n".into()
            } else {
                "ok: standing by\n".into()
            },
        ),
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
        m.decided(Reason::AttestedTPMKey);
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
}
