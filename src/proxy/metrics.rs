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
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;

use crate::label_values;
pub use crate::metric_labels::LabelValue;

label_values! {
    /// Which listener a client connection came in on.
    pub enum ListenerKind {
        /// A UNIX socket (peer uid checked).
        Unix => "unix",
        /// Loopback TLS (loopback client certificate required).
        Tcp => "tcp",
    }
}

label_values! {
    /// Why a client was turned away before any upstream connection.
    pub enum Refusal {
        /// A UNIX-socket peer whose uid is not ours nor allowed.
        PeerUid => "peer_uid",
        /// A loopback TLS client without a valid certificate from the loopback CA.
        ClientAuth => "client_auth",
        /// The local handshake (TLS or HTTP/2 preface sniffing) did not finish in time.
        HandshakeTimeout => "handshake_timeout",
        /// Too many unauthenticated handshakes at once: closed at accept.
        Busy => "busy",
        /// A loopback client certificate outside its validity (e.g. a resumed session whose
        /// credential expired).
        Expired => "expired_credential",
    }
}

label_values! {
    /// At which step an upstream connection failed.
    pub enum UpstreamStage {
        /// The TCP connect failed.
        Connect => "connect",
        /// The TLS handshake failed.
        Handshake => "handshake",
        /// The upstream chose no protocol the client offered.
        Alpn => "alpn",
        /// The handshake-timeout passed.
        Timeout => "timeout",
    }
}

label_values! {
    /// Whether an upstream handshake resumed a session (no signature) or was full.
    pub enum Resumed {
        /// Resumed: no signature.
        Yes => "true",
        /// Full: one signature by the hardware key.
        No => "false",
    }
}

label_values! {
    /// A spare upstream connection's events (`proxy::spare`): made, then used, expired or
    /// dropped; made minus the others is how many are held now.
    pub enum SpareOutcome {
        /// Made ahead for the next local client.
        Made => "made",
        /// A client's request went up on it.
        Used => "used",
        /// Nobody came for it in time: closed.
        Expired => "expired",
        /// Found closed by the API server or too old, or retired (a certificate or CA bundle
        /// installed, the session store emptied) before a client came.
        Dropped => "dropped",
    }
}

label_values! {
    /// Where a UNIX-socket client's connection was opened (`proxy::unix_open`).
    pub enum OpenedOn {
        /// On the relay loop that accepted it: its first bytes, its upstream connection (a
        /// spare or a resumed handshake) and its relay, on one thread.
        Loop => "relay_loop",
        /// Handed to a connection thread: no ticket to resume with, an API server named by
        /// a host name or behind a forward proxy, a failed attempt, no free slot.
        Thread => "connection_thread",
    }
}

label_values! {
    /// Which way bytes went.
    pub enum Direction {
        /// Client to API server.
        Up => "up",
        /// API server to client.
        Down => "down",
    }
}

label_values! {
    /// How a certificate reload ended.
    pub enum ReloadResult {
        /// Installed.
        Ok => "ok",
        /// Unreadable, expired or for another key: the current certificate stays.
        Refused => "refused",
    }
}

label_values! {
    /// How a renewal ended.
    pub enum RenewalResult {
        /// A new certificate is in use.
        Ok => "ok",
        /// The current certificate stays (see [`RenewalFailure`]).
        Failed => "failed",
    }
}

label_values! {
    /// Why a renewal failed (`hwkey_renewal_failures_total{reason}`).
    pub enum RenewalFailure {
        /// An approver denied the request.
        Denied => "denied",
        /// The signer failed it.
        Failed => "failed",
        /// It was not issued in time.
        Timeout => "timeout",
        /// The API server could not be reached or refused a call.
        Api => "api",
        /// What was issued is not usable (another key, not valid now, not a client certificate).
        BadCertificate => "bad_certificate",
        /// The signer caps lifetimes: the new certificate expires no later than the current one.
        Capped => "capped",
        /// The API server refused the renewed certificate in a handshake; it was rolled back.
        RefusedUpstream => "refused_upstream",
        /// It could not be installed.
        Install => "install",
        /// The hardware key failed.
        Key => "key",
        /// Anything else.
        Other => "other",
    }
}

/// Upper bounds (seconds) of the handshake latency buckets: a resumed handshake is a few
/// milliseconds, a full one with a TPM signature tens to hundreds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// A family with one label of known values, registered once, and the handle of each value
/// taken once (as linkerd2-proxy keeps its handles): the data path indexes, never looks up.
#[derive(Debug)]
struct ByLabel<L, M> {
    handles: Vec<M>,
    label: std::marker::PhantomData<L>,
}

impl<L: LabelValue, M> ByLabel<L, M>
where
    M: EncodeMetric + TypedMetric + Clone + std::fmt::Debug + Send + Sync + 'static,
{
    fn register(
        registry: &mut Registry,
        name: &str,
        help: &str,
        key: &'static str,
        make: fn() -> M,
    ) -> Self {
        let family = Family::<[(&'static str, L); 1], M, fn() -> M>::new_with_constructor(make);
        let handles = L::ALL
            .iter()
            .map(|v| family.get_or_create(&[(key, *v)]).clone())
            .collect();
        registry.register(name, help, family);
        ByLabel {
            handles,
            label: std::marker::PhantomData,
        }
    }

    fn get(&self, value: L) -> &M {
        &self.handles[value.index()]
    }
}

label_values! {
    /// A layer of the network side's confinement.
    pub enum SandboxLayer {
        /// Landlock: files, TCP ports, signals.
        Landlock => "landlock",
        /// The seccomp filter.
        Seccomp => "seccomp",
        /// `no_new_privs`.
        NoNewPrivs => "no_new_privs",
    }
}

/// All of the proxy's metrics, each label value's handle taken when it was registered.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    connections: ByLabel<ListenerKind, Counter>,
    connections_active: Gauge,
    refused: ByLabel<Refusal, Counter>,
    upstream_handshakes: ByLabel<Resumed, Counter>,
    upstream_errors: ByLabel<UpstreamStage, Counter>,
    spares: ByLabel<SpareOutcome, Counter>,
    unix_opened: ByLabel<OpenedOn, Counter>,
    upstream_latency: ByLabel<Resumed, Histogram>,
    local_latency: Histogram,
    bytes: ByLabel<Direction, Counter>,
    reloads: ByLabel<ReloadResult, Counter>,
    trust_reloads: ByLabel<ReloadResult, Counter>,
    credentials_issued: Counter,
    renewals: ByLabel<RenewalResult, Counter>,
    renewal_failures: ByLabel<RenewalFailure, Counter>,
    renewal_last_success: Gauge,
    endpoints: EndpointFamilies,
    sandbox: ByLabel<SandboxLayer, Gauge>,
    signer_refused: ByLabel<crate::key::Purpose, Counter>,
    /// Serialises bringing `signer_refused` up to the key's counts at a scrape.
    signer_refused_sync: std::sync::Mutex<()>,
    scrape_time: Arc<ScrapeTime>,
}

/// One `endpoint` label: an API server's `host:port` (as many as `--upstream` names).
type EndpointLabel = [(&'static str, String); 1];

/// The per-endpoint series, created when the upstream's endpoints are known.
#[derive(Debug)]
struct EndpointFamilies {
    up: Family<EndpointLabel, Gauge>,
    connections: Family<EndpointLabel, Counter>,
    failures: Family<EndpointLabel, Counter>,
}

/// The handles of one API server endpoint's series.
#[derive(Debug, Clone)]
pub struct EndpointMetrics {
    /// 1 while the endpoint is used, 0 while it is marked down.
    pub up: Gauge,
    /// Upstream connections made to it.
    pub connections: Counter,
    /// Connections to it that failed (refused, handshake failed, timed out), each marking it
    /// down for a while.
    pub failures: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Registers `metric` under `name` and returns it (a handle to the same series).
fn register<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// The client connections' metrics: accepted, open, refused, bytes bridged.
#[allow(clippy::type_complexity, reason = "four handles, named by the caller")]
fn connection_metrics(
    r: &mut Registry,
) -> (
    ByLabel<ListenerKind, Counter>,
    Gauge,
    ByLabel<Refusal, Counter>,
    ByLabel<Direction, Counter>,
) {
    let connections = ByLabel::register(
        r,
        "hwkey_connections",
        "Client connections accepted, by listener (refused ones included)",
        "listener",
        Counter::default,
    );
    let connections_active = register(
        r,
        "hwkey_connections_active",
        "Client connections open now (handshaking or bridging)",
        Gauge::default(),
    );
    let refused = ByLabel::register(
        r,
        "hwkey_connections_refused",
        "Local clients turned away before any upstream connection, by reason",
        "reason",
        Counter::default,
    );
    let bytes = ByLabel::register(
        r,
        "hwkey_bytes",
        "Bytes bridged, by direction (up: client to API server)",
        "direction",
        Counter::default,
    );
    (connections, connections_active, refused, bytes)
}

impl Metrics {
    /// Registers every metric once, with every label value it can take already present (at
    /// zero), so dashboards and alerts see a series before its first event.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let scrape_time = Arc::new(ScrapeTime::default());
        registry.register_collector(Box::new(ScrapeTimeCollector(scrape_time.clone())));
        let r = &mut registry;
        let (upstream_handshakes, upstream_errors, upstream_latency, spares, unix_opened) =
            upstream_metrics(r);
        let local_latency = register(
            r,
            "hwkey_local_handshake_seconds",
            "Loopback TLS handshake latency with local clients",
            latency_histogram(),
        );
        let (connections, connections_active, refused, bytes) = connection_metrics(r);
        let (reloads, trust_reloads) = reload_metrics(r);
        let credentials_issued = register(
            r,
            "hwkey_loopback_credentials_issued",
            "Loopback client credentials handed out on the control socket",
            Counter::default(),
        );
        let (renewals, renewal_failures, renewal_last_success) = renewal_metrics(r);
        let endpoints = endpoint_metrics(r);
        let (sandbox, signer_refused) = confinement_metrics(r);
        Metrics {
            registry,
            connections,
            connections_active,
            refused,
            upstream_handshakes,
            upstream_errors,
            spares,
            unix_opened,
            upstream_latency,
            local_latency,
            bytes,
            reloads,
            trust_reloads,
            credentials_issued,
            renewals,
            renewal_failures,
            renewal_last_success,
            endpoints,
            sandbox,
            signer_refused,
            signer_refused_sync: std::sync::Mutex::new(()),
            scrape_time,
        }
    }

    /// Records which layers of the sandbox are enforced.
    pub fn sandbox(&self, report: &super::sandbox::Report) {
        let on = |b: bool| i64::from(b);
        self.sandbox
            .get(SandboxLayer::Landlock)
            .set(on(report.landlock.is_some()));
        self.sandbox
            .get(SandboxLayer::Seccomp)
            .set(on(report.seccomp));
        self.sandbox
            .get(SandboxLayer::NoNewPrivs)
            .set(on(report.no_new_privs));
    }

    /// Counts a client connection accepted on a listener (refused ones included).
    pub fn connection_accepted(&self, kind: ListenerKind) {
        self.connections.get(kind).inc();
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
        self.refused.get(why).inc();
    }

    /// Counts an upstream handshake and observes its latency.
    pub fn upstream_handshake(&self, resumed: bool, took: Duration) {
        let label = if resumed { Resumed::Yes } else { Resumed::No };
        self.upstream_handshakes.get(label).inc();
        self.upstream_latency.get(label).observe(took.as_secs_f64());
    }

    /// The series of the API server endpoint `name` (`host:port`), created at 1 (up).
    pub fn endpoint(&self, name: &str) -> EndpointMetrics {
        let label = [("endpoint", name.to_string())];
        let m = EndpointMetrics {
            up: self.endpoints.up.get_or_create(&label).clone(),
            connections: self.endpoints.connections.get_or_create(&label).clone(),
            failures: self.endpoints.failures.get_or_create(&label).clone(),
        };
        m.up.set(1);
        m
    }

    /// Counts where a UNIX-socket client's connection was opened.
    pub fn unix_opened(&self, on: OpenedOn) {
        self.unix_opened.get(on).inc();
    }

    /// Counts what became of a spare upstream connection.
    pub fn spare(&self, outcome: SpareOutcome) {
        self.spares.get(outcome).inc();
    }

    /// Counts a failed upstream connection by step.
    pub fn upstream_error(&self, stage: UpstreamStage) {
        self.upstream_errors.get(stage).inc();
    }

    /// Failed upstream connections since start, every step together: news `/healthz` must not
    /// hide behind an answer it gave before.
    pub fn upstream_errors(&self) -> u64 {
        UpstreamStage::ALL
            .iter()
            .map(|s| self.upstream_errors.get(*s).get())
            .sum()
    }

    /// Observes a loopback TLS handshake's latency.
    pub fn local_handshake(&self, took: Duration) {
        self.local_latency.observe(took.as_secs_f64());
    }

    /// Adds the bytes a finished connection bridged each way.
    pub fn bytes(&self, up: u64, down: u64) {
        self.bytes.get(Direction::Up).inc_by(up);
        self.bytes.get(Direction::Down).inc_by(down);
    }

    /// Counts a certificate reload by result.
    pub fn reload(&self, ok: bool) {
        let result = if ok {
            ReloadResult::Ok
        } else {
            ReloadResult::Refused
        };
        self.reloads.get(result).inc();
    }

    /// Counts a reload of the upstream CA bundle by result.
    pub fn trust_reload(&self, ok: bool) {
        let result = if ok {
            ReloadResult::Ok
        } else {
            ReloadResult::Refused
        };
        self.trust_reloads.get(result).inc();
    }

    /// Records the NotAfter (Unix seconds) of the certificate now in use.
    pub fn certificate(&self, not_after_unix: Option<i64>) {
        self.scrape_time
            .not_after
            .store(not_after_unix.unwrap_or(i64::MIN), Ordering::Relaxed);
    }

    /// Counts a successful renewal and records when.
    pub fn renewal_succeeded(&self, at_unix: f64) {
        self.renewals.get(RenewalResult::Ok).inc();
        self.renewal_last_success.set(at_unix as i64);
    }

    /// Counts a failed renewal by reason.
    pub fn renewal_failed(&self, reason: RenewalFailure) {
        self.renewals.get(RenewalResult::Failed).inc();
        self.renewal_failures.get(reason).inc();
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
    pub fn render(
        &self,
        signatures: u64,
        signature_failures: u64,
        signer_refused: &[(crate::key::Purpose, u64)],
    ) -> String {
        {
            let _one = self
                .signer_refused_sync
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (purpose, count) in signer_refused {
                let counter = self.signer_refused.get(*purpose);
                counter.inc_by(count.saturating_sub(counter.get()));
            }
        }
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

/// The network side's confinement: the layers enforced, the signatures the signer refused.
fn confinement_metrics(
    r: &mut Registry,
) -> (
    ByLabel<SandboxLayer, Gauge>,
    ByLabel<crate::key::Purpose, Counter>,
) {
    let sandbox = ByLabel::register(
        r,
        "hwkey_sandbox_enforced",
        "1 when the layer confines the network side (Landlock, the seccomp filter, no_new_privs)",
        "layer",
        Gauge::default,
    );
    let signer_refused = ByLabel::register(
        r,
        "hwkey_signer_refused",
        "Signatures the signer refused: the message did not have its purpose's shape",
        "purpose",
        Counter::default,
    );
    (sandbox, signer_refused)
}

/// The upstream connections' metric families: handshakes, errors, handshake latency, spares,
/// where UNIX-socket clients' connections were opened.
type UpstreamFamilies = (
    ByLabel<Resumed, Counter>,
    ByLabel<UpstreamStage, Counter>,
    ByLabel<Resumed, Histogram>,
    ByLabel<SpareOutcome, Counter>,
    ByLabel<OpenedOn, Counter>,
);

/// The upstream connections' metrics.
fn upstream_metrics(r: &mut Registry) -> UpstreamFamilies {
    let handshakes = ByLabel::register(
        r,
        "hwkey_upstream_handshakes",
        "Completed TLS handshakes with the upstream; resumed ones needed no signature",
        "resumed",
        Counter::default,
    );
    let errors = ByLabel::register(
        r,
        "hwkey_upstream_errors",
        "Upstream connections that failed, by step",
        "stage",
        Counter::default,
    );
    let latency = ByLabel::register(
        r,
        "hwkey_upstream_handshake_seconds",
        "Upstream TLS handshake latency (TCP connect excluded)",
        "resumed",
        latency_histogram,
    );
    let spares = ByLabel::register(
        r,
        "hwkey_upstream_spares",
        "Spare upstream connections made ahead for local clients, and what became of them",
        "event",
        Counter::default,
    );
    let opened = ByLabel::register(
        r,
        "hwkey_unix_connections_opened",
        "UNIX-socket client connections by where their upstream connection was opened: on the relay loop that accepted them, or on a connection thread",
        "on",
        Counter::default,
    );
    (handshakes, errors, latency, spares, opened)
}

/// The renewal's metrics (`--renew`).
type Reloads = ByLabel<ReloadResult, Counter>;

fn reload_metrics(r: &mut Registry) -> (Reloads, Reloads) {
    let reloads = ByLabel::register(
        r,
        "hwkey_cert_reloads",
        "Certificate reloads, by result (refused: unreadable, expired or another key)",
        "result",
        Counter::default,
    );
    let trust_reloads = ByLabel::register(
        r,
        "hwkey_upstream_ca_reloads",
        "Reloads of the --upstream-ca bundle, by result (refused: unreadable or no usable CA; the previous trust stays)",
        "result",
        Counter::default,
    );
    (reloads, trust_reloads)
}

fn endpoint_metrics(r: &mut Registry) -> EndpointFamilies {
    let up = Family::<EndpointLabel, Gauge>::default();
    r.register(
        "hwkey_upstream_endpoint_up",
        "Whether an API server endpoint (--upstream) is used (1) or marked down after a failed connection (0)",
        up.clone(),
    );
    let connections = Family::<EndpointLabel, Counter>::default();
    r.register(
        "hwkey_upstream_endpoint_connections",
        "Upstream connections made, by API server endpoint",
        connections.clone(),
    );
    let failures = Family::<EndpointLabel, Counter>::default();
    r.register(
        "hwkey_upstream_endpoint_failures",
        "Upstream connections that failed, by API server endpoint (each marks it down for a while)",
        failures.clone(),
    );
    EndpointFamilies {
        up,
        connections,
        failures,
    }
}

fn renewal_metrics(
    r: &mut Registry,
) -> (
    ByLabel<RenewalResult, Counter>,
    ByLabel<RenewalFailure, Counter>,
    Gauge,
) {
    let renewals = ByLabel::register(
        r,
        "hwkey_renewals",
        "Certificate renewals through the CSR API (--renew), by result",
        "result",
        Counter::default,
    );
    let failures = ByLabel::register(
        r,
        "hwkey_renewal_failures",
        "Failed renewals, by reason (denied, failed, timeout, api, bad_certificate, capped, refused_upstream, install, key, other)",
        "reason",
        Counter::default,
    );
    let last_success = Gauge::default();
    r.register(
        "hwkey_renewal_last_success_timestamp_seconds",
        "When the last renewal succeeded (Unix time; 0: never)",
        last_success.clone(),
    );
    (renewals, failures, last_success)
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
            (
                "hwkey_copy_buffer_allocations",
                "Copy and read-ahead buffers allocated (zero-filled) since start; a buffer taken again from a thread's pool is not counted",
                super::buffers::buffers_allocated(),
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
        let mut gauges = vec![(
            "hwkey_copy_buffers",
            "Copy and read-ahead buffers held by connections now (16-64 KiB each; an idle connection holds none)",
            super::buffers::buffers_in_use(),
        )];
        gauges.extend(certificate_gauges(s.not_after.load(Ordering::Relaxed)));
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// The certificate's expiry gauges, when a certificate is known (`not_after` set).
fn certificate_gauges(not_after: i64) -> Vec<(&'static str, &'static str, i64)> {
    if not_after == i64::MIN {
        return Vec::new();
    }
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    vec![
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
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's handle is the one registered for it: `index` is its place in `ALL`.
    #[test]
    fn every_label_value_finds_its_own_handle() {
        for (i, v) in RenewalFailure::ALL.iter().enumerate() {
            assert_eq!(v.index(), i, "{v:?}");
        }
    }

    #[test]
    fn renders_the_contract_names() {
        let m = Metrics::default();
        m.upstream_handshake(false, Duration::from_millis(20));
        m.upstream_handshake(true, Duration::from_millis(2));
        m.upstream_handshake(true, Duration::from_millis(3));
        m.certificate(Some(4_000_000_000));
        let text = m.render(1, 0, &[]);
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
