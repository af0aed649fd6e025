//! Counters and histograms the admin listener exposes in the Prometheus text format.
//!
//! Everything is a plain atomic updated by connection tasks and read by the admin task; no
//! locks on the data path. The text format is small enough to write by hand, which keeps the
//! metric names (the operator's contract) visible in one place.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Which listener a client connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerKind {
    Unix,
    Tcp,
}

impl ListenerKind {
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

const REFUSALS: [Refusal; 5] = [
    Refusal::PeerUid,
    Refusal::ClientAuth,
    Refusal::HandshakeTimeout,
    Refusal::Busy,
    Refusal::Expired,
];

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::PeerUid => "peer_uid",
            Refusal::ClientAuth => "client_auth",
            Refusal::HandshakeTimeout => "handshake_timeout",
            Refusal::Busy => "busy",
            Refusal::Expired => "expired_credential",
        }
    }
    fn index(self) -> usize {
        match self {
            Refusal::PeerUid => 0,
            Refusal::ClientAuth => 1,
            Refusal::HandshakeTimeout => 2,
            Refusal::Busy => 3,
            Refusal::Expired => 4,
        }
    }
}

/// At which step an upstream connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamStage {
    Connect,
    Handshake,
    Alpn,
    Timeout,
}

const STAGES: [UpstreamStage; 4] = [
    UpstreamStage::Connect,
    UpstreamStage::Handshake,
    UpstreamStage::Alpn,
    UpstreamStage::Timeout,
];

impl UpstreamStage {
    fn label(self) -> &'static str {
        match self {
            UpstreamStage::Connect => "connect",
            UpstreamStage::Handshake => "handshake",
            UpstreamStage::Alpn => "alpn",
            UpstreamStage::Timeout => "timeout",
        }
    }
    fn index(self) -> usize {
        match self {
            UpstreamStage::Connect => 0,
            UpstreamStage::Handshake => 1,
            UpstreamStage::Alpn => 2,
            UpstreamStage::Timeout => 3,
        }
    }
}

/// Upper bounds (seconds) of the handshake latency buckets: a resumed handshake is a few
/// milliseconds, a full one with a TPM signature tens to hundreds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, bound) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                self.buckets[i].load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        if labels.is_empty() {
            let _ = writeln!(out, "{name}_sum {sum}");
            let _ = writeln!(out, "{name}_count {count}");
        } else {
            let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
            let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
        }
    }
}

/// All of the proxy's metrics. `hwkey_signatures_total` is read from the key itself at render
/// time, so it also counts signatures made outside handshakes (health checks).
#[derive(Debug, Default)]
pub struct Metrics {
    connections_total: [AtomicU64; 2],
    connections_active: AtomicU64,
    refused: [AtomicU64; 5],
    upstream_full: AtomicU64,
    upstream_resumed: AtomicU64,
    upstream_errors: [AtomicU64; 4],
    upstream_latency_full: Histogram,
    upstream_latency_resumed: Histogram,
    local_latency: Histogram,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    reloads_ok: AtomicU64,
    reloads_refused: AtomicU64,
    credentials_issued: AtomicU64,
    renewal: RenewalMetrics,
}

/// The certificate in use and the renewals (`--renew`).
#[derive(Debug, Default)]
struct RenewalMetrics {
    /// NotAfter of the certificate in use, Unix seconds (i64::MIN: unknown).
    not_after: std::sync::atomic::AtomicI64,
    attempts: AtomicU64,
    succeeded: AtomicU64,
    last_success_unix: AtomicU64,
    failures: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl Metrics {
    pub fn connection_accepted(&self, kind: ListenerKind) {
        let i = match kind {
            ListenerKind::Unix => 0,
            ListenerKind::Tcp => 1,
        };
        self.connections_total[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn active_inc(&self) {
        self.connections_active.fetch_add(1, Ordering::Relaxed);
    }

    pub fn active_dec(&self) {
        self.connections_active.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn refused(&self, why: Refusal) {
        self.refused[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn upstream_handshake(&self, resumed: bool, took: Duration) {
        if resumed {
            self.upstream_resumed.fetch_add(1, Ordering::Relaxed);
            self.upstream_latency_resumed.observe(took);
        } else {
            self.upstream_full.fetch_add(1, Ordering::Relaxed);
            self.upstream_latency_full.observe(took);
        }
    }

    pub fn upstream_error(&self, stage: UpstreamStage) {
        self.upstream_errors[stage.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn local_handshake(&self, took: Duration) {
        self.local_latency.observe(took);
    }

    pub fn bytes(&self, up: u64, down: u64) {
        self.bytes_up.fetch_add(up, Ordering::Relaxed);
        self.bytes_down.fetch_add(down, Ordering::Relaxed);
    }

    pub fn reload(&self, ok: bool) {
        if ok {
            self.reloads_ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.reloads_refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the NotAfter (Unix seconds) of the certificate now in use.
    pub fn certificate(&self, not_after_unix: Option<i64>) {
        self.renewal
            .not_after
            .store(not_after_unix.unwrap_or(i64::MIN), Ordering::Relaxed);
    }

    pub fn renewal_attempt(&self) {
        self.renewal.attempts.fetch_add(1, Ordering::Relaxed);
    }

    pub fn renewal_succeeded(&self, at_unix: f64) {
        self.renewal.succeeded.fetch_add(1, Ordering::Relaxed);
        self.renewal
            .last_success_unix
            .store(at_unix as u64, Ordering::Relaxed);
    }

    pub fn renewal_failed(&self, reason: &'static str) {
        *self
            .renewal
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(reason)
            .or_default() += 1;
    }

    pub fn credential_issued(&self) {
        self.credentials_issued.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections open right now.
    pub fn active(&self) -> u64 {
        self.connections_active.load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self, signatures: u64, signature_failures: u64) -> String {
        let mut o = String::with_capacity(4096);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        header(
            &mut o,
            "hwkey_signatures_total",
            "counter",
            "Signatures made inside the hardware key (handshakes and health checks).",
        );
        let _ = writeln!(o, "hwkey_signatures_total {signatures}");
        header(
            &mut o,
            "hwkey_signature_failures_total",
            "counter",
            "Signature attempts the hardware key failed (device gone, session lost, PIN refused).",
        );
        let _ = writeln!(o, "hwkey_signature_failures_total {signature_failures}");

        header(
            &mut o,
            "hwkey_upstream_handshakes_total",
            "counter",
            "Completed TLS handshakes with the upstream; resumed ones needed no signature.",
        );
        let _ = writeln!(
            o,
            "hwkey_upstream_handshakes_total{{resumed=\"true\"}} {}",
            load(&self.upstream_resumed)
        );
        let _ = writeln!(
            o,
            "hwkey_upstream_handshakes_total{{resumed=\"false\"}} {}",
            load(&self.upstream_full)
        );

        header(
            &mut o,
            "hwkey_upstream_errors_total",
            "counter",
            "Upstream connections that failed, by step.",
        );
        for s in STAGES {
            let _ = writeln!(
                o,
                "hwkey_upstream_errors_total{{stage=\"{}\"}} {}",
                s.label(),
                load(&self.upstream_errors[s.index()])
            );
        }

        header(
            &mut o,
            "hwkey_upstream_handshake_seconds",
            "histogram",
            "Upstream TLS handshake latency (TCP connect excluded).",
        );
        self.upstream_latency_resumed.render(
            &mut o,
            "hwkey_upstream_handshake_seconds",
            "resumed=\"true\"",
        );
        self.upstream_latency_full.render(
            &mut o,
            "hwkey_upstream_handshake_seconds",
            "resumed=\"false\"",
        );

        header(
            &mut o,
            "hwkey_local_handshake_seconds",
            "histogram",
            "Loopback TLS handshake latency with local clients.",
        );
        self.local_latency
            .render(&mut o, "hwkey_local_handshake_seconds", "");

        header(
            &mut o,
            "hwkey_connections_total",
            "counter",
            "Client connections accepted, by listener (refused ones included).",
        );
        for k in [ListenerKind::Unix, ListenerKind::Tcp] {
            let i = match k {
                ListenerKind::Unix => 0,
                ListenerKind::Tcp => 1,
            };
            let _ = writeln!(
                o,
                "hwkey_connections_total{{listener=\"{}\"}} {}",
                k.label(),
                load(&self.connections_total[i])
            );
        }

        header(
            &mut o,
            "hwkey_connections_active",
            "gauge",
            "Client connections open now (handshaking or bridging).",
        );
        let _ = writeln!(o, "hwkey_connections_active {}", self.active());

        header(
            &mut o,
            "hwkey_connections_refused_total",
            "counter",
            "Local clients turned away before any upstream connection, by reason.",
        );
        for r in REFUSALS {
            let _ = writeln!(
                o,
                "hwkey_connections_refused_total{{reason=\"{}\"}} {}",
                r.label(),
                load(&self.refused[r.index()])
            );
        }

        header(
            &mut o,
            "hwkey_bytes_total",
            "counter",
            "Bytes bridged, by direction (up: client to API server).",
        );
        let _ = writeln!(
            o,
            "hwkey_bytes_total{{direction=\"up\"}} {}",
            load(&self.bytes_up)
        );
        let _ = writeln!(
            o,
            "hwkey_bytes_total{{direction=\"down\"}} {}",
            load(&self.bytes_down)
        );

        header(
            &mut o,
            "hwkey_cert_reloads_total",
            "counter",
            "Certificate reloads, by result (refused: unreadable, expired or another key).",
        );
        let _ = writeln!(
            o,
            "hwkey_cert_reloads_total{{result=\"ok\"}} {}",
            load(&self.reloads_ok)
        );
        let _ = writeln!(
            o,
            "hwkey_cert_reloads_total{{result=\"refused\"}} {}",
            load(&self.reloads_refused)
        );

        header(
            &mut o,
            "hwkey_loopback_credentials_issued_total",
            "counter",
            "Loopback client credentials handed out on the control socket.",
        );
        let _ = writeln!(
            o,
            "hwkey_loopback_credentials_issued_total {}",
            load(&self.credentials_issued)
        );
        self.render_certificate(&mut o);
        o
    }

    fn render_certificate(&self, o: &mut String) {
        let r = &self.renewal;
        let not_after = r.not_after.load(Ordering::Relaxed);
        if not_after != i64::MIN {
            header(
                o,
                "hwkey_certificate_not_after_timestamp_seconds",
                "gauge",
                "NotAfter of the client certificate in use (Unix time).",
            );
            let _ = writeln!(
                o,
                "hwkey_certificate_not_after_timestamp_seconds {not_after}"
            );
            let now = time::OffsetDateTime::now_utc().unix_timestamp();
            header(
                o,
                "hwkey_certificate_remaining_seconds",
                "gauge",
                "Seconds until the client certificate in use expires (negative: expired).",
            );
            let _ = writeln!(o, "hwkey_certificate_remaining_seconds {}", not_after - now);
        }
        header(
            o,
            "hwkey_renewals_total",
            "counter",
            "Certificate renewals through the CSR API (--renew), by result.",
        );
        let ok = r.succeeded.load(Ordering::Relaxed);
        let failed: u64 = r
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum();
        let _ = writeln!(o, "hwkey_renewals_total{{result=\"ok\"}} {ok}");
        let _ = writeln!(o, "hwkey_renewals_total{{result=\"failed\"}} {failed}");
        header(
            o,
            "hwkey_renewal_failures_total",
            "counter",
            "Failed renewals, by reason (denied, failed, timeout, api, bad_certificate, install, key).",
        );
        for (reason, n) in r.failures.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(o, "hwkey_renewal_failures_total{{reason=\"{reason}\"}} {n}");
        }
        header(
            o,
            "hwkey_renewal_last_success_timestamp_seconds",
            "gauge",
            "When the last renewal succeeded (Unix time; 0: never).",
        );
        let _ = writeln!(
            o,
            "hwkey_renewal_last_success_timestamp_seconds {}",
            r.last_success_unix.load(Ordering::Relaxed)
        );
    }
}

fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
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
        let text = m.render(1, 0);
        assert!(text.contains("hwkey_signatures_total 1\n"));
        assert!(text.contains("hwkey_upstream_handshakes_total{resumed=\"true\"} 2\n"));
        assert!(text.contains("hwkey_upstream_handshakes_total{resumed=\"false\"} 1\n"));
        assert!(text.contains("hwkey_connections_active 0\n"));
        assert!(text
            .contains("hwkey_upstream_handshake_seconds_bucket{resumed=\"true\",le=\"+Inf\"} 2\n"));
        assert!(text.contains("hwkey_upstream_handshake_seconds_count{resumed=\"false\"} 1\n"));
    }
}
