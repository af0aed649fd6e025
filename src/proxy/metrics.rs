//! The proxy's metrics, registered once with a `prometheus-client` registry and served by the
//! admin listener in the OpenMetrics text format.
//!
//! Connection tasks update counters and histograms through handles taken when they were
//! registered (atomics inside `prometheus-client`; no family lookup and no lock on the data
//! path). The few values that belong to something swapped at run time (the key's
//! signature counters, the certificate's expiry) are read at scrape time by [`ScrapeTime`], a
//! collector. The metric names are the operator's contract: they are all named here, and the
//! integration tests parse `/metrics` with a real OpenMetrics parser.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Which listener a client connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    /// A UNIX socket (peer uid checked).
    Unix,
    /// Loopback TLS (loopback client certificate required).
    Tcp,
}

impl ListenerKind {
    const ALL: [ListenerKind; 2] = [ListenerKind::Unix, ListenerKind::Tcp];

    fn label(self) -> &'static str {
        match self {
            ListenerKind::Unix => "unix",
            ListenerKind::Tcp => "tcp",
        }
    }
}

/// Why a client was turned away before any upstream connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A UNIX-socket peer whose uid is not ours nor allowed.
    PeerUid,
    /// A loopback TLS client without a valid certificate from the loopback CA.
    ClientAuth,
    /// The local handshake (TLS or HTTP/2 preface sniffing) did not finish in time.
    HandshakeTimeout,
    /// Too many unauthenticated handshakes at once: closed at accept.
    Busy,
    /// A loopback client certificate outside its validity (e.g. a resumed session whose
    /// credential expired).
    Expired,
}

impl Refusal {
    const ALL: [Refusal; 5] = [
        Refusal::PeerUid,
        Refusal::ClientAuth,
        Refusal::HandshakeTimeout,
        Refusal::Busy,
        Refusal::Expired,
    ];

    fn label(self) -> &'static str {
        match self {
            Refusal::PeerUid => "peer_uid",
            Refusal::ClientAuth => "client_auth",
            Refusal::HandshakeTimeout => "handshake_timeout",
            Refusal::Busy => "busy",
            Refusal::Expired => "expired_credential",
        }
    }
}

/// At which step an upstream connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamStage {
    /// The TCP connect failed.
    Connect,
    /// The TLS handshake failed.
    Handshake,
    /// The upstream chose no protocol the client offered.
    Alpn,
    /// The handshake-timeout passed.
    Timeout,
}

impl UpstreamStage {
    const ALL: [UpstreamStage; 4] = [
        UpstreamStage::Connect,
        UpstreamStage::Handshake,
        UpstreamStage::Alpn,
        UpstreamStage::Timeout,
    ];

    fn label(self) -> &'static str {
        match self {
            UpstreamStage::Connect => "connect",
            UpstreamStage::Handshake => "handshake",
            UpstreamStage::Alpn => "alpn",
            UpstreamStage::Timeout => "timeout",
        }
    }
}

/// Upper bounds (seconds) of the handshake latency buckets: a resumed handshake is a few
/// milliseconds, a full one with a TPM signature tens to hundreds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The reasons `hwkey_renewal_failures_total` is labelled with (`renewal::reason_label`).
pub const RENEWAL_FAILURE_REASONS: [&str; 8] = [
    "denied",
    "failed",
    "timeout",
    "api",
    "bad_certificate",
    "install",
    "key",
    "other",
];

/// One label, e.g. `resumed="true"`. Every label value is a constant of this module.
type Label = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// All of the proxy's metrics. Arrays of handles are indexed like the `ALL` list of their
/// label's enum (or as commented).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    connections: [Counter; 2],
    connections_active: Gauge,
    refused: [Counter; 5],
    /// Index 0: resumed, 1: full.
    upstream_handshakes: [Counter; 2],
    upstream_errors: [Counter; 4],
    /// Index 0: resumed, 1: full.
    upstream_latency: [Histogram; 2],
    local_latency: Histogram,
    /// Index 0: up, 1: down.
    bytes: [Counter; 2],
    /// Index 0: ok, 1: refused.
    reloads: [Counter; 2],
    credentials_issued: Counter,
    /// Index 0: ok, 1: failed.
    renewals: [Counter; 2],
    /// Looked up by reason per failure, which is rare.
    renewal_failures: Family<Label, Counter>,
    renewal_last_success: Gauge,
    scrape_time: Arc<ScrapeTime>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers every metric once, with every label value it can take already present (at
    /// zero), so dashboards and alerts see a series before its first event.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let scrape_time = Arc::new(ScrapeTime::default());
        registry.register_collector(Box::new(ScrapeTimeCollector(scrape_time.clone())));

        let upstream_handshakes = labelled(
            &mut registry,
            "hwkey_upstream_handshakes",
            "Completed TLS handshakes with the upstream; resumed ones needed no signature",
            "resumed",
            ["true", "false"],
        );
        let upstream_errors = labelled(
            &mut registry,
            "hwkey_upstream_errors",
            "Upstream connections that failed, by step",
            "stage",
            UpstreamStage::ALL.map(UpstreamStage::label),
        );
        let latency_family =
            Family::<Label, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        let upstream_latency = ["true", "false"].map(|resumed| {
            latency_family
                .get_or_create(&[("resumed", resumed)])
                .clone()
        });
        registry.register(
            "hwkey_upstream_handshake_seconds",
            "Upstream TLS handshake latency (TCP connect excluded)",
            latency_family,
        );
        let local_latency = latency_histogram();
        registry.register(
            "hwkey_local_handshake_seconds",
            "Loopback TLS handshake latency with local clients",
            local_latency.clone(),
        );
        let connections = labelled(
            &mut registry,
            "hwkey_connections",
            "Client connections accepted, by listener (refused ones included)",
            "listener",
            ListenerKind::ALL.map(ListenerKind::label),
        );
        let connections_active = Gauge::default();
        registry.register(
            "hwkey_connections_active",
            "Client connections open now (handshaking or bridging)",
            connections_active.clone(),
        );
        let refused = labelled(
            &mut registry,
            "hwkey_connections_refused",
            "Local clients turned away before any upstream connection, by reason",
            "reason",
            Refusal::ALL.map(Refusal::label),
        );
        let bytes = labelled(
            &mut registry,
            "hwkey_bytes",
            "Bytes bridged, by direction (up: client to API server)",
            "direction",
            ["up", "down"],
        );
        let reloads = labelled(
            &mut registry,
            "hwkey_cert_reloads",
            "Certificate reloads, by result (refused: unreadable, expired or another key)",
            "result",
            ["ok", "refused"],
        );
        let credentials_issued = Counter::default();
        registry.register(
            "hwkey_loopback_credentials_issued",
            "Loopback client credentials handed out on the control socket",
            credentials_issued.clone(),
        );
        let renewals = labelled(
            &mut registry,
            "hwkey_renewals",
            "Certificate renewals through the CSR API (--renew), by result",
            "result",
            ["ok", "failed"],
        );
        let renewal_failures = Family::<Label, Counter>::default();
        for reason in RENEWAL_FAILURE_REASONS {
            let _ = renewal_failures.get_or_create(&[("reason", reason)]);
        }
        registry.register(
            "hwkey_renewal_failures",
            "Failed renewals, by reason (denied, failed, timeout, api, bad_certificate, install, key, other)",
            renewal_failures.clone(),
        );
        let renewal_last_success = Gauge::default();
        registry.register(
            "hwkey_renewal_last_success_timestamp_seconds",
            "When the last renewal succeeded (Unix time; 0: never)",
            renewal_last_success.clone(),
        );
        Metrics {
            registry,
            connections,
            connections_active,
            refused,
            upstream_handshakes,
            upstream_errors,
            upstream_latency,
            local_latency,
            bytes,
            reloads,
            credentials_issued,
            renewals,
            renewal_failures,
            renewal_last_success,
            scrape_time,
        }
    }

    /// Counts a client connection accepted on a listener (refused ones included).
    pub fn connection_accepted(&self, kind: ListenerKind) {
        self.connections[kind as usize].inc();
    }

    /// A client connection opened.
    pub fn active_inc(&self) {
        self.connections_active.inc();
    }

    /// A client connection closed.
    pub fn active_dec(&self) {
        self.connections_active.dec();
    }

    /// Counts a client turned away before any upstream connection.
    pub fn refused(&self, why: Refusal) {
        self.refused[why as usize].inc();
    }

    /// Counts an upstream handshake and observes its latency.
    pub fn upstream_handshake(&self, resumed: bool, took: Duration) {
        let i = usize::from(!resumed);
        self.upstream_handshakes[i].inc();
        self.upstream_latency[i].observe(took.as_secs_f64());
    }

    /// Counts a failed upstream connection by step.
    pub fn upstream_error(&self, stage: UpstreamStage) {
        self.upstream_errors[stage as usize].inc();
    }

    /// Observes a loopback TLS handshake's latency.
    pub fn local_handshake(&self, took: Duration) {
        self.local_latency.observe(took.as_secs_f64());
    }

    /// Adds the bytes a finished connection bridged each way.
    pub fn bytes(&self, up: u64, down: u64) {
        self.bytes[0].inc_by(up);
        self.bytes[1].inc_by(down);
    }

    /// Counts a certificate reload by result.
    pub fn reload(&self, ok: bool) {
        self.reloads[usize::from(!ok)].inc();
    }

    /// Records the NotAfter (Unix seconds) of the certificate now in use.
    pub fn certificate(&self, not_after_unix: Option<i64>) {
        self.scrape_time
            .not_after
            .store(not_after_unix.unwrap_or(i64::MIN), Ordering::Relaxed);
    }

    /// Counts a successful renewal and records when.
    pub fn renewal_succeeded(&self, at_unix: f64) {
        self.renewals[0].inc();
        self.renewal_last_success.set(at_unix as i64);
    }

    /// Counts a failed renewal by reason (one of [`RENEWAL_FAILURE_REASONS`]).
    pub fn renewal_failed(&self, reason: &'static str) {
        self.renewals[1].inc();
        self.renewal_failures
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// Counts a loopback credential handed out.
    pub fn credential_issued(&self) {
        self.credentials_issued.inc();
    }

    /// Connections open right now.
    pub fn active(&self) -> u64 {
        u64::try_from(self.connections_active.get()).unwrap_or(0)
    }

    /// The OpenMetrics text exposition, with the key's counters as of now (the key in use can
    /// change at run time, so they are passed in rather than registered).
    pub fn render(&self, signatures: u64, signature_failures: u64) -> String {
        self.scrape_time
            .signatures
            .store(signatures, Ordering::Relaxed);
        self.scrape_time
            .signature_failures
            .store(signature_failures, Ordering::Relaxed);
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Registers a counter family with one label whose values are all known, each present from the
/// start (at 0); returns the counters in the order of `values`.
fn labelled<const N: usize>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    label: &'static str,
    values: [&'static str; N],
) -> [Counter; N] {
    let family = Family::<Label, Counter>::default();
    let counters = values.map(|v| family.get_or_create(&[(label, v)]).clone());
    registry.register(name, help, family);
    counters
}

/// Values read at scrape time: the key's counters (passed to [`Metrics::render`]) and the
/// certificate's NotAfter, from which the remaining lifetime is computed at that moment.
#[derive(Debug)]
struct ScrapeTime {
    signatures: AtomicU64,
    signature_failures: AtomicU64,
    /// NotAfter of the certificate in use, Unix seconds (i64::MIN: unknown).
    not_after: AtomicI64,
}

impl Default for ScrapeTime {
    fn default() -> Self {
        ScrapeTime {
            signatures: AtomicU64::new(0),
            signature_failures: AtomicU64::new(0),
            not_after: AtomicI64::new(i64::MIN),
        }
    }
}

#[derive(Debug)]
struct ScrapeTimeCollector(Arc<ScrapeTime>);

impl Collector for ScrapeTimeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let counters = [
            (
                "hwkey_signatures",
                "Signatures made inside the hardware key (handshakes and health checks)",
                s.signatures.load(Ordering::Relaxed),
            ),
            (
                "hwkey_signature_failures",
                "Signature attempts the hardware key failed (device gone, session lost, PIN refused)",
                s.signature_failures.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        let buffers = ConstGauge::new(super::relay::buffers_in_use());
        buffers.encode(encoder.encode_descriptor(
            "hwkey_copy_buffers",
            "Copy and read-ahead buffers held by connections now (16-64 KiB each; an idle connection holds none)",
            None,
            buffers.metric_type(),
        )?)?;
        let not_after = s.not_after.load(Ordering::Relaxed);
        if not_after != i64::MIN {
            let now = time::OffsetDateTime::now_utc().unix_timestamp();
            let gauges = [
                (
                    "hwkey_certificate_not_after_timestamp_seconds",
                    "NotAfter of the client certificate in use (Unix time)",
                    not_after,
                ),
                (
                    "hwkey_certificate_remaining_seconds",
                    "Seconds until the client certificate in use expires (negative: expired)",
                    not_after - now,
                ),
            ];
            for (name, help, value) in gauges {
                let gauge = ConstGauge::new(value);
                gauge.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    gauge.metric_type(),
                )?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_contract_names() {
        let m = Metrics::default();
        m.upstream_handshake(false, Duration::from_millis(20));
        m.upstream_handshake(true, Duration::from_millis(2));
        m.upstream_handshake(true, Duration::from_millis(3));
        m.certificate(Some(4_000_000_000));
        let text = m.render(1, 0);
        assert!(text.contains("hwkey_signatures_total 1\n"), "{text}");
        assert!(
            text.contains("hwkey_signature_failures_total 0\n"),
            "{text}"
        );
        assert!(text.contains("hwkey_upstream_handshakes_total{resumed=\"true\"} 2\n"));
        assert!(text.contains("hwkey_upstream_handshakes_total{resumed=\"false\"} 1\n"));
        assert!(text.contains("hwkey_connections_active 0\n"));
        assert!(text.contains("hwkey_connections_refused_total{reason=\"busy\"} 0\n"));
        assert!(
            text.contains(
                "hwkey_upstream_handshake_seconds_bucket{le=\"+Inf\",resumed=\"true\"} 2\n"
            ) || text.contains(
                "hwkey_upstream_handshake_seconds_bucket{resumed=\"true\",le=\"+Inf\"} 2\n"
            )
        );
        assert!(text.contains("hwkey_upstream_handshake_seconds_count{resumed=\"false\"} 1\n"));
        assert!(text.contains("hwkey_certificate_not_after_timestamp_seconds 4000000000\n"));
        assert!(text.ends_with("# EOF\n"));
    }
}
