//! End-to-end benchmarks on the real fixtures: a SoftHSM token and a swtpm, the kube-apiserver
//! stand-in (`tests/support/upstream.rs`), the release `hwkey proxy` binary, and kubectl.
//!
//! Method: every figure has a baseline measured in the same process, interleaved with it
//! round by round (subject and baseline alternate which goes first), so a compile job that
//! starts on the shared machine slows both sides of a round alike; ratios are taken per round
//! and summarised as median and p25–p75. Loops are bounded by counts, never by "until fast".
//! Everything started here (token dirs, swtpm, upstreams, proxies, the proxy the exec plugin
//! starts) is stopped by PID before the process exits.
//!
//! The baseline for the network figures is a client talking straight to the same upstream with
//! rustls and an in-memory software key (the upstream requires TLS 1.3 client certificates
//! from the same test CA). Clients run on one current-thread runtime: on 2 cores the client,
//! the proxy and the upstream share the machine, as kubectl, hwkey and a local API server would.

mod common;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hwkey::key::tls::{HardwareCertResolver, HardwareSigningKey};
use hwkey::key::{Key, KeyUri};
use hwkey::proxy::metrics::Metrics;
use hwkey::proxy::upstream::Upstream;
use hwkey::proxy::UpstreamTarget;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, HandshakeKind, RootCertStore};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::client::TlsStream;

use common::{paired_ratios, pick, Results, Row, Stat};
use support::proxy::{metric_in, Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::{hwkey, run_ok, temp_dir};

// ---------------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------------

/// A rustls client configuration: `roots` PEM, client certificate and key PEM, ALPN list, and
/// whether TLS 1.3 sessions are cached for resumption.
fn client_config(
    roots: &[u8],
    cert: &[u8],
    key: &[u8],
    alpn: &[&[u8]],
    resume: bool,
) -> Arc<ClientConfig> {
    let mut store = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(roots) {
        store.add(c.expect("root PEM")).expect("add root");
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .expect("client certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(key).expect("client key PEM");
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(store)
            .with_client_auth_cert(chain, key)
            .expect("client certificate");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    if !resume {
        config.resumption = Resumption::disabled();
    }
    Arc::new(config)
}

async fn tls_connect(config: &Arc<ClientConfig>, port: u16) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("TCP connect");
    tcp.set_nodelay(true).expect("nodelay");
    tokio_rustls::TlsConnector::from(config.clone())
        .connect(
            ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into()),
            tcp,
        )
        .await
        .expect("TLS handshake")
}

fn resumed(s: &TlsStream<TcpStream>) -> bool {
    s.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed)
}

/// One HTTP/1.1 keep-alive GET on `s`; returns the body length. Hand-written (no client
/// library) so the client costs the same few microseconds on every path.
async fn http1_get<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    path: &str,
    buf: &mut [u8],
) -> u64 {
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(request.as_bytes())
        .await
        .expect("write request");
    let mut filled = 0;
    let head_end = loop {
        let n = s.read(&mut buf[filled..]).await.expect("read response");
        assert!(n > 0, "connection closed before the response head");
        filled += n;
        if let Some(i) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        assert!(filled < buf.len(), "response head too large");
    };
    let head = std::str::from_utf8(&buf[..head_end]).expect("UTF-8 head");
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "unexpected response: {head}"
    );
    let length: u64 = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("Content-Length");
    let mut got = (filled - head_end) as u64;
    while got < length {
        let n = s.read(buf).await.expect("read body");
        assert!(n > 0, "connection closed in the body");
        got += n as u64;
    }
    length
}

/// An HTTP/2 connection (hyper) over `io`; the connection task runs on the current runtime.
async fn h2_client<S>(io: S) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

async fn h2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    uri: &str,
) -> u64 {
    let req = hyper::Request::get(uri)
        .body(Empty::new())
        .expect("request");
    let resp = sender.send_request(req).await.expect("h2 request");
    assert_eq!(resp.status(), 200);
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("h2 body")
        .to_bytes();
    body.len() as u64
}

// ---------------------------------------------------------------------------------------------
// The fixture: one SoftHSM identity, its upstream, a proxy in front of it, and direct clients
// ---------------------------------------------------------------------------------------------

struct Fixture {
    id: Identity,
    upstream: TestUpstream,
    proxy: ProxyProcess,
    /// Direct to the upstream with a software key; sessions cached.
    direct: Arc<ClientConfig>,
    direct_full: Arc<ClientConfig>,
    direct_h2: Arc<ClientConfig>,
    /// To the proxy's loopback TLS listener with a loopback credential.
    loopback: Arc<ClientConfig>,
    loopback_h2: Arc<ClientConfig>,
    /// The software client certificate and key files (for kubectl's plain kubeconfig).
    soft_cert: PathBuf,
    soft_key: PathBuf,
    /// Holds the software certificate files.
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        let id = Identity::softhsm();
        let upstream = TestUpstream::start(&id.ca);
        let proxy = ProxyProcess::start(&id, &upstream);
        let dir = temp_dir();
        let (soft_cert, soft_key) = id.ca.client_cert(dir.path(), "soft", "alice", Some("devs"));
        let ca = id.ca.ca_pem().into_bytes();
        let cert = std::fs::read(&soft_cert).expect("cert");
        let key = std::fs::read(&soft_key).expect("key");
        let cred = proxy.credential();
        let field = |name: &str| cred[name].as_str().expect(name).as_bytes().to_vec();
        let (lca, lcert, lkey) = (
            field("certificateAuthorityPem"),
            field("clientCertificatePem"),
            field("clientKeyPem"),
        );
        Fixture {
            direct: client_config(&ca, &cert, &key, &[b"http/1.1"], true),
            direct_full: client_config(&ca, &cert, &key, &[b"http/1.1"], false),
            direct_h2: client_config(&ca, &cert, &key, &[b"h2"], true),
            loopback: client_config(&lca, &lcert, &lkey, &[b"http/1.1"], true),
            loopback_h2: client_config(&lca, &lcert, &lkey, &[b"h2"], true),
            id,
            upstream,
            proxy,
            soft_cert,
            soft_key,
            _dir: dir,
        }
    }
}

/// The order of trials: `rounds` rounds of every series, the order reversed every other round
/// so that neither side always runs first (or right after a warm cache).
fn schedule(rounds: usize, series: usize) -> Vec<usize> {
    (0..rounds)
        .flat_map(|round| {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..series).collect()
            } else {
                (0..series).rev().collect()
            };
            order
        })
        .collect()
}

fn ratio_row(
    area: &str,
    measure: &str,
    unit: &str,
    subject: &[f64],
    label: &str,
    baseline: &[f64],
) -> Row {
    let ratios = paired_ratios(subject, baseline);
    Row::new(area, measure, unit, Some(Stat::of(subject))).versus(
        label,
        Some(Stat::of(baseline)),
        Some(Stat::of(&ratios)),
    )
}

fn at_least(row: Row, target: f64) -> Row {
    let met = row.ratio.map(|r| r.median >= target);
    row.target(&format!("≥ {target}×"), met)
}

// ---------------------------------------------------------------------------------------------
// Handshakes and resumption
// ---------------------------------------------------------------------------------------------

/// New upstream connections per second (TLS 1.3 handshake + one GET /version, one at a time):
/// the proxy's own connector (`proxy::upstream::Upstream`, the code every proxied connection
/// runs) signing in SoftHSM, against rustls with a software key. The GET makes both clients
/// read the server's session tickets, as a proxied connection does.
async fn handshakes(f: &Fixture) -> Vec<Row> {
    const AREA: &str = "handshakes";
    let key = Arc::new(Key::open(&f.id.key_uri.parse::<KeyUri>().expect("URI")).expect("open key"));
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&f.id.cert)
        .expect("cert file")
        .collect::<Result<_, _>>()
        .expect("cert PEM");
    let resolver = Arc::new(
        HardwareCertResolver::new(HardwareSigningKey::new(key.clone()), chain).expect("resolver"),
    );
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from(f.id.ca.ca_der()))
        .expect("root");
    let target: UpstreamTarget = f.upstream.url().parse().expect("target");
    let connector = Upstream::new(
        target,
        None,
        resolver,
        roots,
        hwkey::key::tls::protocol_versions(&key, false).expect("TLS versions"),
        Arc::new(Metrics::default()),
    )
    .expect("connector");
    let port = f.upstream.port();
    let n = pick(200, 40);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let signatures_before = key.signatures();
    let mut resumed_counts = [0usize; 4];
    let mut results = vec![Vec::new(); 4];
    for series in schedule(rounds, 4) {
        let (connector, buf, counts) = (&connector, &mut buf, &mut resumed_counts);
        let rate = {
            let start = Instant::now();
            for _ in 0..n {
                let r = match series {
                    0 | 1 => {
                        if series == 0 {
                            connector.reset_sessions();
                        }
                        let mut c = connector
                            .connect(Some(b"http/1.1"))
                            .await
                            .expect("connector");
                        http1_get(&mut c.stream, "/version", buf).await;
                        c.resumed
                    }
                    _ => {
                        let config = if series == 2 {
                            &f.direct_full
                        } else {
                            &f.direct
                        };
                        let mut s = tls_connect(config, port).await;
                        http1_get(&mut s, "/version", buf).await;
                        resumed(&s)
                    }
                };
                counts[series] += usize::from(r);
            }
            n as f64 / start.elapsed().as_secs_f64()
        };
        results[series].push(rate);
    }
    let signatures = key.signatures() - signatures_before;
    let total = n * rounds;
    let note = |s: usize| format!("{} of {total} handshakes resumed", resumed_counts[s]);
    vec![
        at_least(
            ratio_row(
                AREA,
                "full handshake + GET, proxy connector signing in SoftHSM P-256",
                "conn/s",
                &results[0],
                "direct rustls, software P-256 key, no resumption",
                &results[2],
            ),
            0.8,
        )
        .note(format!("{}; hardware signatures: {signatures}", note(0))),
        at_least(
            ratio_row(
                AREA,
                "resumed handshake + GET, proxy connector",
                "conn/s",
                &results[1],
                "direct rustls, software key, resumption",
                &results[3],
            ),
            0.9,
        )
        .note(format!("{} (direct: {})", note(1), note(3))),
    ]
}

/// New client connections through the running proxy (each: connect, GET /version, close)
/// against new direct connections that resume; and the hardware signatures they cost.
async fn through_proxy(f: &Fixture) -> Vec<Row> {
    let n = pick(200, 50);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    // One connection first so the proxy holds a session and the clients hold tickets.
    warm(f, &mut buf).await;
    let sigs_before = f.proxy.signatures();
    let metrics_before = f.proxy.metrics();
    let mut loopback_resumed = 0usize;
    let mut results = vec![Vec::new(); 3];
    for series in schedule(rounds, 3) {
        let buf = &mut buf;
        let rate = {
            let start = Instant::now();
            for _ in 0..n {
                match series {
                    0 => {
                        let mut s = UnixStream::connect(&f.proxy.socket)
                            .await
                            .expect("UNIX connect");
                        http1_get(&mut s, "/version", buf).await;
                    }
                    1 => {
                        let mut s = tls_connect(&f.loopback, f.proxy.tcp_port).await;
                        http1_get(&mut s, "/version", buf).await;
                        loopback_resumed += usize::from(resumed(&s));
                    }
                    _ => {
                        let mut s = tls_connect(&f.direct, f.upstream.port()).await;
                        http1_get(&mut s, "/version", buf).await;
                    }
                }
            }
            n as f64 / start.elapsed().as_secs_f64()
        };
        results[series].push(rate);
    }
    let sigs = f.proxy.signatures() - sigs_before;
    let metrics_after = f.proxy.metrics();
    let delta =
        |series: &str| metric_in(&metrics_after, series) - metric_in(&metrics_before, series);
    let full = delta("hwkey_upstream_handshakes_total{resumed=\"false\"}");
    let res = delta("hwkey_upstream_handshakes_total{resumed=\"true\"}");
    let clients = (2 * n * rounds) as f64;
    let per_1000 = sigs as f64 * 1000.0 / clients;
    vec![
        at_least(
            ratio_row("handshakes", "new client connection + GET through the proxy, UNIX socket", "conn/s", &results[0], "direct TLS 1.3, resumed, software key", &results[2]),
            0.9,
        )
        .note("client → UNIX socket → proxy → resumed TLS 1.3 upstream; each connection is new"),
        at_least(
            ratio_row("handshakes", "new client connection + GET through the proxy, loopback TLS", "conn/s", &results[1], "direct TLS 1.3, resumed, software key", &results[2]),
            0.9,
        )
        .note(format!(
            "two TLS handshakes per connection: loopback (client ↔ proxy, {loopback_resumed} of {} resumed) and upstream (resumed)",
            n * rounds
        )),
        Row::new("resumption", "hardware signatures per 1,000 client connections", "signatures", Some(Stat::of(&[per_1000])))
            .target("≤ 10", Some(per_1000 <= 10.0))
            .note(format!(
                "{sigs} signatures for {clients} client connections (UNIX and loopback TLS); proxy /metrics: {full} full, {res} resumed upstream handshakes"
            )),
    ]
}

async fn warm(f: &Fixture, buf: &mut [u8]) {
    let mut s = UnixStream::connect(&f.proxy.socket)
        .await
        .expect("UNIX connect");
    http1_get(&mut s, "/version", buf).await;
    let mut s = tls_connect(&f.loopback, f.proxy.tcp_port).await;
    http1_get(&mut s, "/version", buf).await;
    let mut s = tls_connect(&f.direct, f.upstream.port()).await;
    http1_get(&mut s, "/version", buf).await;
}

// ---------------------------------------------------------------------------------------------
// Throughput and latency
// ---------------------------------------------------------------------------------------------

/// One established connection of each kind: direct TLS, proxy UNIX, proxy loopback TLS.
enum Conn {
    Tls(Box<TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl Conn {
    async fn get(&mut self, path: &str, buf: &mut [u8]) -> u64 {
        match self {
            Conn::Tls(s) => http1_get(s.as_mut(), path, buf).await,
            Conn::Unix(s) => http1_get(s, path, buf).await,
        }
    }
}

async fn three_conns(f: &Fixture) -> Vec<Conn> {
    vec![
        Conn::Tls(Box::new(tls_connect(&f.direct, f.upstream.port()).await)),
        Conn::Unix(
            UnixStream::connect(&f.proxy.socket)
                .await
                .expect("UNIX connect"),
        ),
        Conn::Tls(Box::new(tls_connect(&f.loopback, f.proxy.tcp_port).await)),
    ]
}

/// Download MB/s on an established keep-alive connection (GET /bytes?n=SIZE).
async fn throughput(f: &Fixture) -> Vec<Row> {
    let size: u64 = pick(64, 16) << 20;
    let rounds = pick(5, 3);
    let path = format!("/bytes?n={size}");
    let mut buf = vec![0u8; 256 * 1024];
    let mut conns = three_conns(f).await;
    for c in conns.iter_mut() {
        c.get(&path, &mut buf).await;
    }
    let mut results = vec![Vec::new(); 3];
    for series in schedule(rounds, 3) {
        let start = Instant::now();
        let got = conns[series].get(&path, &mut buf).await;
        results[series].push(got as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    let size_mib = size >> 20;
    vec![
        at_least(
            ratio_row(
                "throughput",
                &format!("download {size_mib} MiB through the proxy, UNIX socket"),
                "MB/s",
                &results[1],
                "direct TLS to the same upstream",
                &results[0],
            ),
            0.85,
        ),
        at_least(
            ratio_row(
                "throughput",
                &format!("download {size_mib} MiB through the proxy, loopback TLS"),
                "MB/s",
                &results[2],
                "direct TLS to the same upstream",
                &results[0],
            ),
            0.85,
        ),
    ]
}

/// p50 and p99 (µs) of `samples`.
fn p50_p99(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(|a, b| a.total_cmp(b));
    (
        common::percentile_sorted(samples, 50.0),
        common::percentile_sorted(samples, 99.0),
    )
}

/// Request latency on one keep-alive connection, HTTP/1.1 (hand-written client) and h2
/// (hyper): per round, `m` sequential GET /version on each path; the round's p50 and p99.
async fn latency(f: &Fixture) -> Vec<Row> {
    let m = pick(1000, 200);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let mut conns = three_conns(f).await;
    for c in conns.iter_mut() {
        c.get("/version", &mut buf).await;
    }
    let mut h2 = [
        h2_client(tls_connect(&f.direct_h2, f.upstream.port()).await).await,
        h2_client(
            UnixStream::connect(&f.proxy.socket)
                .await
                .expect("UNIX connect"),
        )
        .await,
        h2_client(tls_connect(&f.loopback_h2, f.proxy.tcp_port).await).await,
    ];
    for s in h2.iter_mut() {
        h2_get(s, "https://127.0.0.1/version").await;
    }
    // Series 0..3: HTTP/1.1 direct, UNIX, TLS; 3..6: h2 direct, UNIX, TLS. Each trial yields
    // p50 and p99; they are kept apart below.
    let mut p99s: Vec<Vec<f64>> = vec![Vec::new(); 6];
    let mut p50s: Vec<Vec<f64>> = vec![Vec::new(); 6];
    for series in schedule(rounds, 6) {
        {
            let mut samples = Vec::with_capacity(m);
            for _ in 0..m {
                let start = Instant::now();
                if series < 3 {
                    conns[series].get("/version", &mut buf).await;
                } else {
                    h2_get(&mut h2[series - 3], "https://127.0.0.1/version").await;
                }
                samples.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let (p50, p99) = p50_p99(&mut samples);
            p99s[series].push(p99);
            p50s[series].push(p50);
        }
    }
    let mut rows = Vec::new();
    for (proto, base) in [("HTTP/1.1", 0), ("h2", 3)] {
        for (path, s) in [("UNIX socket", base + 1), ("loopback TLS", base + 2)] {
            let row = ratio_row(
                "latency",
                &format!("p50, {proto} keep-alive, proxy {path}"),
                "µs",
                &p50s[s],
                &format!("direct TLS, {proto}"),
                &p50s[base],
            );
            let overhead: Vec<f64> = p50s[s]
                .iter()
                .zip(&p50s[base])
                .map(|(a, b)| a - b)
                .collect();
            let o = Stat::of(&overhead);
            rows.push(
                row.target("p50 overhead ≤ 100 µs", Some(o.median <= 100.0))
                    .note(format!(
                        "overhead {:.0} µs [{:.0}–{:.0}]",
                        o.median, o.p25, o.p75
                    )),
            );
            let r = ratio_row(
                "latency",
                &format!("p99, {proto} keep-alive, proxy {path}"),
                "µs",
                &p99s[s],
                &format!("direct TLS, {proto}"),
                &p99s[base],
            );
            rows.push(r);
        }
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// kubectl and the exec plugin
// ---------------------------------------------------------------------------------------------

/// A kubeconfig written by `hwkey kubeconfig` (exec plugin, proxy started on first use) and a
/// plain one with the software certificate, both for the same upstream.
struct Kube {
    dir: tempfile::TempDir,
    hwkey_config: PathBuf,
    plain_config: PathBuf,
    state: PathBuf,
    envs: Vec<(String, String)>,
}

impl Kube {
    fn new(f: &Fixture) -> Kube {
        let dir = temp_dir();
        let hwkey_config = dir.path().join("hwkey.kubeconfig");
        let plain_config = dir.path().join("plain.kubeconfig");
        let state = dir.path().join("state");
        run_ok(
            hwkey()
                .envs(f.id.envs())
                .args(["kubeconfig", "--name", "bench", "--key", &f.id.key_uri])
                .arg("--cert")
                .arg(&f.id.cert)
                .args(["--server", &f.upstream.url()])
                .arg("--ca")
                .arg(f.id.ca.ca_path())
                .arg("--out")
                .arg(&hwkey_config)
                .arg("--state-dir")
                .arg(&state)
                .args(["--idle-exit", "15m"]),
        );
        let plain = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: plain\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: plain\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: plain\n  context:\n    cluster: plain\n    user: plain\ncurrent-context: plain\n",
            f.upstream.url(),
            f.id.ca.ca_path().display(),
            f.soft_cert.display(),
            f.soft_key.display()
        );
        std::fs::write(&plain_config, plain).expect("write the plain kubeconfig");
        Kube {
            envs: f.id.envs(),
            dir,
            hwkey_config,
            plain_config,
            state,
        }
    }

    fn kubectl(&self, config: &Path) -> Command {
        let mut cmd = Command::new("/usr/bin/kubectl");
        cmd.envs(self.envs.clone())
            .env("HOME", self.dir.path())
            .env_remove("KUBERNETES_EXEC_INFO")
            .env_remove("KUBECONFIG")
            .arg("--kubeconfig")
            .arg(config)
            .args(["get", "--raw", "/version"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Wall time of one command in ms; panics (with its output) if it fails.
    fn time(cmd: &mut Command) -> f64 {
        let start = Instant::now();
        let out = cmd.output().expect("run");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ms
    }

    /// What client-go would put in KUBERNETES_EXEC_INFO for the hwkey kubeconfig.
    fn exec_info(&self) -> String {
        let text = std::fs::read_to_string(&self.hwkey_config).expect("kubeconfig");
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
        let cluster = &doc["clusters"][0]["cluster"];
        let ext = serde_json::to_value(&cluster["extensions"][0]["extension"]).expect("JSON");
        serde_json::json!({
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "spec": {"interactive": false, "cluster": {
                "server": cluster["server"].as_str().expect("server"),
                "config": ext,
            }},
        })
        .to_string()
    }

    fn proxy_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.state.join("proxy.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Kube {
    /// Stops the proxy the exec plugin started (SIGTERM, then SIGKILL), by its PID.
    fn drop(&mut self) {
        if let Some(pid) = self.proxy_pid() {
            let signal = |s| {
                if let Some(p) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(p, s);
                }
            };
            signal(rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
                std::thread::sleep(Duration::from_millis(20));
            }
            if Path::new(&format!("/proc/{pid}")).exists() {
                signal(rustix::process::Signal::KILL);
            }
        }
    }
}

fn kubectl_and_exec(f: &Fixture) -> Vec<Row> {
    if !Path::new("/usr/bin/kubectl").exists() {
        return vec![
            Row::new("kubectl", "kubectl get --raw /version", "ms", None)
                .note("not measured: /usr/bin/kubectl is missing"),
        ];
    }
    let kube = Kube::new(f);
    // Warm: the first hwkey run starts the proxy; both warm the page cache.
    Kube::time(&mut kube.kubectl(&kube.hwkey_config));
    Kube::time(&mut kube.kubectl(&kube.plain_config));
    let rounds = pick(12, 4);
    let mut hw = Vec::new();
    let mut plain = Vec::new();
    for round in 0..rounds {
        if round % 2 == 0 {
            hw.push(Kube::time(&mut kube.kubectl(&kube.hwkey_config)));
            plain.push(Kube::time(&mut kube.kubectl(&kube.plain_config)));
        } else {
            plain.push(Kube::time(&mut kube.kubectl(&kube.plain_config)));
            hw.push(Kube::time(&mut kube.kubectl(&kube.hwkey_config)));
        }
    }
    let kubectl = ratio_row(
        "kubectl",
        "`kubectl get --raw /version`, hwkey kubeconfig, proxy warm",
        "ms",
        &hw,
        "plain cert/key kubeconfig, same upstream",
        &plain,
    );
    let met = kubectl.ratio.map(|r| r.median <= 1.25);
    let kubectl = kubectl.target("≤ 1.25×", met).note("includes one `hwkey credential` run per kubectl invocation (client-go caches only in-process)");

    let info = kube.exec_info();
    let runs = pick(30, 8);
    let mut cred = Vec::new();
    let mut spawn = Vec::new();
    for _ in 0..runs {
        let mut cmd = hwkey();
        cmd.envs(kube.envs.clone())
            .env("KUBERNETES_EXEC_INFO", &info)
            .arg("credential")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cred.push(Kube::time(&mut cmd));
        spawn.push(Kube::time(Command::new("/bin/true").stdout(Stdio::null())));
    }
    let c = Stat::of(&cred);
    let exec = ratio_row(
        "exec",
        "`hwkey credential` wall time, proxy warm",
        "ms",
        &cred,
        "spawning /bin/true (process start cost)",
        &spawn,
    )
    .target("≤ 10 ms median", Some(c.median <= 10.0))
    .note("the ratio is to process start-up only, not a target");
    vec![kubectl, exec]
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb / 1024.0
}

/// RSS of a fresh proxy after one connection (idle), then with 1,000 client connections open,
/// each having finished one request (so its upstream connection exists too); and again, in
/// another fresh proxy, with every open connection having moved `moved` bytes first: what a
/// connection costs once data went through it (its buffers touched), as a watch's would.
async fn open_connections(f: &Fixture, path: &str) -> (f64, f64, f64, f64) {
    const OPEN: usize = 1000;
    let proxy = ProxyProcess::start_with(&f.id, &f.upstream, ProxyOptions::default());
    let pid = proxy.guard.id();
    let mut buf = vec![0u8; 256 * 1024];
    {
        let mut s = UnixStream::connect(&proxy.socket)
            .await
            .expect("UNIX connect");
        http1_get(&mut s, "/version", &mut buf).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = rss_mib(pid);
    let mut open = Vec::with_capacity(OPEN);
    for _ in 0..OPEN {
        let mut s = UnixStream::connect(&proxy.socket)
            .await
            .expect("UNIX connect");
        http1_get(&mut s, path, &mut buf).await;
        open.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let active = metric_in(&proxy.metrics(), "hwkey_connections_active");
    let loaded = rss_mib(pid);
    drop(open);
    tokio::time::sleep(Duration::from_millis(500)).await;
    (idle, loaded, rss_mib(pid), active)
}

async fn memory(f: &Fixture) -> Vec<Row> {
    let moved = 256u64 << 10;
    let (idle, loaded, after, active) = open_connections(f, "/version").await;
    let (idle2, busy, after2, active2) = open_connections(f, &format!("/bytes?n={moved}")).await;
    let per = |total: f64, base: f64| (total - base) * 1024.0 / 1000.0;
    vec![
        Row::new("memory", "proxy RSS, idle (after one connection)", "MiB", Some(Stat::of(&[idle]))),
        Row::new("memory", "proxy RSS, 1,000 open client connections (one GET /version each)", "MiB", Some(Stat::of(&[loaded])))
            .target("≤ 40 MiB", Some(loaded <= 40.0))
            .note(format!(
                "hwkey_connections_active = {active}; each is a UNIX client plus an upstream TLS connection; {:.1} KiB per connection above idle; {after:.1} MiB once they closed",
                per(loaded, idle)
            )),
        Row::new("memory", &format!("proxy RSS, 1,000 open client connections that each moved {} KiB", moved >> 10), "MiB", Some(Stat::of(&[busy])))
            .target("≤ 40 MiB", Some(busy <= 40.0))
            .note(format!(
                "a fresh proxy (idle {idle2:.1} MiB); hwkey_connections_active = {active2}; {:.1} KiB per connection above idle; {after2:.1} MiB once they closed",
                per(busy, idle2)
            )),
    ]
}

// ---------------------------------------------------------------------------------------------
// TPM stall
// ---------------------------------------------------------------------------------------------

/// Bytes/s on established connections through a TPM-backed proxy, with and without full
/// handshakes (and so TPM signatures) running at the same time. A full handshake is forced by
/// SIGHUP, which reloads the certificate and empties the proxy's session store.
fn tpm_stall(rt: &tokio::runtime::Runtime) -> Vec<Row> {
    const STREAMS: usize = 2;
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let window = pick(Duration::from_millis(2000), Duration::from_millis(800));
    let rounds = pick(5, 2);
    let chunk = format!("/bytes?n={}", 4u64 << 20);
    let mut streams: Vec<UnixStream> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..STREAMS {
            v.push(
                UnixStream::connect(&proxy.socket)
                    .await
                    .expect("UNIX connect"),
            );
        }
        v
    });
    let mut bufs: Vec<Vec<u8>> = (0..STREAMS).map(|_| vec![0u8; 256 * 1024]).collect();
    let full_series = "hwkey_upstream_handshakes_total{resumed=\"false\"}";
    let mut handshake_rates = Vec::new();
    let mut results = vec![Vec::new(); 2];
    for series in schedule(rounds, 2) {
        let bytes = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let stop_driver = AtomicBool::new(false);
        let full_before = metric_in(&proxy.metrics(), full_series);
        let start = Instant::now();
        std::thread::scope(|scope| {
            // The driver has its own thread and blocking I/O: it neither waits for nor slows
            // the readers' runtime; only the proxy, the upstream and the TPM are shared.
            let driver =
                (series == 1).then(|| scope.spawn(|| force_full_handshakes(&proxy, &stop_driver)));
            rt.block_on(async {
                let readers = streams.iter_mut().zip(bufs.iter_mut()).map(|(s, buf)| {
                    let (bytes, stop, chunk) = (&bytes, &stop, chunk.as_str());
                    async move {
                        while !stop.load(Ordering::Relaxed) {
                            let n = http1_get(s, chunk, buf).await;
                            bytes.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                });
                let timer = async {
                    tokio::time::sleep(window).await;
                    stop.store(true, Ordering::Relaxed);
                };
                let ((), ()) = tokio::join!(futures_join_all(readers), timer);
            });
            stop_driver.store(true, Ordering::Relaxed);
            if let Some(d) = driver {
                d.join().expect("handshake driver");
            }
        });
        let elapsed = start.elapsed().as_secs_f64();
        if series == 1 {
            let full_after = metric_in(&proxy.metrics(), full_series);
            handshake_rates.push((full_after - full_before) / elapsed);
        }
        results[series].push(bytes.load(Ordering::Relaxed) as f64 / elapsed / 1e6);
    }
    let h = Stat::of(&handshake_rates);
    vec![at_least(
        ratio_row(
            "TPM stall",
            &format!("MB/s on {STREAMS} established connections while full TPM handshakes run"),
            "MB/s",
            &results[1],
            "same connections, no handshakes",
            &results[0],
        ),
        0.9,
    )
    .note(format!(
        "swtpm P-256 key; {:.0} full handshakes/s [{:.0}–{:.0}] during the window, one at a time (each forced by SIGHUP, which empties the session store); each window ends after the 4 MiB responses in flight",
        h.median, h.p25, h.p75
    ))]
}

/// Until `stop`: SIGHUP the proxy, wait until it reloaded (so its session store is empty),
/// then open a connection and GET /version through it, which makes a full handshake.
fn force_full_handshakes(proxy: &ProxyProcess, stop: &AtomicBool) {
    let reloads = || metric_in(&proxy.metrics(), "hwkey_cert_reloads_total{result=\"ok\"}");
    while !stop.load(Ordering::Relaxed) {
        let before = reloads();
        proxy.signal(libc::SIGHUP);
        for _ in 0..200 {
            if reloads() > before {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut http = RawHttp::connect(&proxy.socket);
        http.send("GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        let (status, _) = http.read_response();
        assert_eq!(status, 200, "GET /version through the TPM proxy");
    }
}

/// Awaits every future of `futs` concurrently on the current task.
async fn futures_join_all<F: Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------

/// Lets the process hold the 2,000+ sockets of the memory benchmark (and its children
/// inherit the limit).
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        },
    );
}

fn main() {
    if common::skip_unless_cargo_bench("e2e") {
        return;
    }
    let started = Instant::now();
    let load_before = common::loadavg();
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let f = Fixture::new();
    // The in-process connector opens the same SoftHSM token as the proxy.
    for (k, v) in f.id.envs() {
        std::env::set_var(k, v);
    }
    let mut rows = Vec::new();
    let step = |name: &str| eprintln!("e2e: {name} ({:.0}s)", started.elapsed().as_secs_f64());
    step("handshakes");
    rows.extend(rt.block_on(handshakes(&f)));
    step("through the proxy");
    rows.extend(rt.block_on(through_proxy(&f)));
    step("throughput");
    rows.extend(rt.block_on(throughput(&f)));
    step("latency");
    rows.extend(rt.block_on(latency(&f)));
    step("kubectl and exec");
    rows.extend(kubectl_and_exec(&f));
    step("memory");
    rows.extend(rt.block_on(memory(&f)));
    step("TPM stall");
    rows.extend(tpm_stall(&rt));
    step("done");
    drop(f);
    common::save(
        "e2e",
        &Results {
            quick: common::quick(),
            load_before,
            load_after: common::loadavg(),
            seconds: started.elapsed().as_secs_f64(),
            rows,
        },
    );
}
