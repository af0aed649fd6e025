//! A stand-in for kube-apiserver's x509 authenticator, for proxy tests: a rustls server that
//! requires a client certificate from a [`TestCa`], speaks HTTP/1.1 and h2 (hyper, chosen by
//! ALPN), issues TLS 1.3 session tickets (so resumption is observable), and records what it
//! saw: TCP connections, full vs resumed handshakes, protocols, client identities and serials.
//!
//! Endpoints:
//! - `GET /version`: JSON with the client's CN, certificate serial and HTTP version.
//! - `POST /apis/authentication.k8s.io/v1/selfsubjectreviews`: a SelfSubjectReview with
//!   user = CN, groups = every O (+ system:authenticated), as `kubectl auth whoami` expects.
//! - `GET /api/v1/namespaces/default/configmaps?watch=1`: a chunked stream of JSON watch
//!   events, one per [`TestUpstream::emit_watch_event`] call.
//! - `GET /upgrade` with `Upgrade: X`: 101 Switching Protocols, then echoes bytes (as exec does).
//! - `POST /echo`: streams the request body back; `GET /bytes?n=N`: N bytes of
//!   [`pattern_byte`].
//!
//! Runs on its own thread with its own multi-thread runtime, on a free 127.0.0.1 port; Drop
//! stops it (all connections closed).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tempfile::TempDir;

use crate::{temp_dir, TestCa};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ResBody = BoxBody<Bytes, BoxError>;

/// What the upstream saw on one TLS connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnRecord {
    /// Common name of the client certificate.
    pub cn: String,
    /// Organizations (Kubernetes groups) of the client certificate.
    pub orgs: Vec<String>,
    /// Serial of the client certificate (hex, as x509-parser prints it).
    pub serial: String,
    /// `h2`, `http/1.1`, or `none` when no ALPN was negotiated.
    pub protocol: String,
    /// True for a resumed (PSK) handshake.
    pub resumed: bool,
    /// The negotiated TLS version (`TLSv1_3`, `TLSv1_2`).
    pub version: String,
    /// The negotiated key-exchange group (`X25519MLKEM768`, `X25519`, …).
    pub group: String,
}

/// Counters of a [`TestUpstream`].
#[derive(Debug, Clone, Default)]
pub struct UpstreamStats {
    /// TCP connections accepted.
    pub tcp_connections: u64,
    /// TLS handshakes that failed (e.g. no or wrong client certificate).
    pub failed_handshakes: u64,
    /// One record per completed TLS handshake, in order.
    pub connections: Vec<ConnRecord>,
}

impl UpstreamStats {
    pub fn full(&self) -> usize {
        self.connections.iter().filter(|c| !c.resumed).count()
    }
    pub fn resumed(&self) -> usize {
        self.connections.iter().filter(|c| c.resumed).count()
    }
    pub fn with_protocol(&self, p: &str) -> usize {
        self.connections.iter().filter(|c| c.protocol == p).count()
    }
}

#[derive(Default)]
struct Shared {
    tcp: AtomicU64,
    failed: AtomicU64,
    records: Mutex<Vec<ConnRecord>>,
}

/// The running test API server.
pub struct TestUpstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    events: tokio::sync::watch::Sender<u64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    _dir: TempDir,
}

/// Byte `i` of the `/bytes` body.
pub fn pattern_byte(i: u64) -> u8 {
    (i % 251) as u8
}

impl TestUpstream {
    /// Starts on a free 127.0.0.1 port, trusting client certificates from `ca`.
    pub fn start(ca: &TestCa) -> TestUpstream {
        Self::start_on(ca, 0)
    }

    /// Starts on 127.0.0.1:`port` (0: any free port), e.g. to come back after [`Drop`].
    pub fn start_on(ca: &TestCa, port: u16) -> TestUpstream {
        Self::start_serving(ca, ca, port)
    }

    /// Like [`TestUpstream::start_on`], presenting a server certificate `serving` issued (a
    /// cluster whose serving CA was rotated) while trusting client certificates from
    /// `client_ca`.
    pub fn start_serving(client_ca: &TestCa, serving: &TestCa, port: u16) -> TestUpstream {
        Self::start_full(client_ca, serving, port, (false, true, 4))
    }

    /// Like [`TestUpstream::start`], as an API server whose ticket keys keep changing (one
    /// restarted between every two connections): it sends session tickets and accepts none, so
    /// every handshake is full.
    pub fn start_never_resuming(ca: &TestCa) -> TestUpstream {
        Self::start_full(ca, ca, 0, (false, false, 4))
    }

    /// Like [`TestUpstream::start`], as an API server built with Go ≥ 1.24 serves: it prefers
    /// the X25519MLKEM768 hybrid key exchange (from aws-lc-rs), then X25519.
    pub fn start_pq(ca: &TestCa) -> TestUpstream {
        Self::start_full(ca, ca, 0, (true, true, 4))
    }

    /// Like [`TestUpstream::start`], sending one session ticket per handshake, as Go's
    /// crypto/tls (kube-apiserver) does, not four.
    pub fn start_one_ticket(ca: &TestCa) -> TestUpstream {
        Self::start_full(ca, ca, 0, (false, true, 1))
    }

    fn start_full(
        client_ca: &TestCa,
        serving: &TestCa,
        port: u16,
        (pq, resumes, tickets): (bool, bool, usize),
    ) -> TestUpstream {
        let dir = temp_dir();
        let (cert, key) = serving.server_cert(dir.path());
        let mut config = server_config(&client_ca.ca_path(), &cert, &key, pq);
        if !resumes {
            config.ticketer = Arc::new(Forgetful);
        }
        config.send_tls13_tickets = tickets;
        let config = Arc::new(config);
        let std_listener = bind_retrying(port);
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("local_addr");
        let shared = Arc::new(Shared::default());
        let (events, events_rx) = tokio::sync::watch::channel(0u64);
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("test-upstream".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("upstream runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(std_listener).expect("tokio listener");
                    let acceptor = tokio_rustls::TlsAcceptor::from(config);
                    tokio::select! {
                        _ = stop_rx => {}
                        _ = accept_loop(listener, acceptor, thread_shared, events_rx) => {}
                    }
                });
                rt.shutdown_timeout(std::time::Duration::from_secs(2));
            })
            .expect("spawn upstream thread");
        TestUpstream {
            addr,
            shared,
            events,
            stop: Some(stop),
            thread: Some(thread),
            _dir: dir,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> UpstreamStats {
        UpstreamStats {
            tcp_connections: self.shared.tcp.load(Ordering::SeqCst),
            failed_handshakes: self.shared.failed.load(Ordering::SeqCst),
            connections: self
                .shared
                .records
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// Makes every open watch stream emit its next event now; returns the event's number.
    pub fn emit_watch_event(&self) -> u64 {
        let mut n = 0;
        self.events.send_modify(|v| {
            *v += 1;
            n = *v;
        });
        n
    }

    /// Stops the server now (as Drop does), closing every connection.
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.stop();
    }
}

fn bind_retrying(port: u16) -> std::net::TcpListener {
    let mut last = None;
    for _ in 0..100 {
        match std::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(l) => return l,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("bind 127.0.0.1:{port}: {last:?}");
}

/// ring's provider with its cipher suites in Go's order (crypto/tls on a CPU with AES
/// instructions): AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305 for each TLS version. The
/// stand-in serves with it and chooses by its own order, as kube-apiserver (Go) does; the
/// benchmarks' direct and loopback clients offer it, as kubectl (Go) does.
pub fn go_provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite as cs;
    let mut provider = rustls::crypto::ring::default_provider();
    // crypto/tls's cipherSuitesPreferenceOrder (and TLS 1.3's order) with AES hardware.
    provider.cipher_suites = vec![
        cs::TLS13_AES_128_GCM_SHA256,
        cs::TLS13_AES_256_GCM_SHA384,
        cs::TLS13_CHACHA20_POLY1305_SHA256,
        cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(provider)
}

fn server_config(ca: &Path, cert: &Path, key: &Path, pq: bool) -> rustls::ServerConfig {
    let mut provider = go_provider();
    if pq {
        Arc::make_mut(&mut provider)
            .kx_groups
            .insert(0, rustls::crypto::aws_lc_rs::kx_group::X25519MLKEM768);
    }
    let mut roots = rustls::RootCertStore::empty();
    for c in pem_certs(ca) {
        roots.add(c).expect("add CA");
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .expect("client verifier");
    let key_pem = std::fs::read(key).expect("read server key");
    let key = PrivateKeyDer::try_from(
        pem::parse(&key_pem)
            .expect("server key PEM")
            .into_contents(),
    )
    .expect("server key DER");
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .expect("versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(pem_certs(cert), key)
        .expect("server cert");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.ticketer = rustls::crypto::ring::Ticketer::new().expect("ticketer");
    config.send_tls13_tickets = 4;
    // A client that asks for fewer (RFC 9149) gets what it asks for: the benches' stand-in for
    // kubectl asks for none, as kubectl, offering no PSK mode, gets none from Go's server.
    config.max_tls13_tickets = 4;
    // Go's server picks the suite by its own preference, not the client's.
    config.ignore_client_order = true;
    config
}

/// Tickets that open nothing: each one a new blob, none accepted back.
#[derive(Debug)]
struct Forgetful;

impl rustls::server::ProducesTickets for Forgetful {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        3600
    }

    fn encrypt(&self, _plain: &[u8]) -> Option<Vec<u8>> {
        static ISSUED: AtomicU64 = AtomicU64::new(0);
        Some(
            ISSUED
                .fetch_add(1, Ordering::Relaxed)
                .to_be_bytes()
                .repeat(4),
        )
    }

    fn decrypt(&self, _cipher: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

fn pem_certs(path: &Path) -> Vec<CertificateDer<'static>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    pem::parse_many(bytes)
        .expect("PEM")
        .into_iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| CertificateDer::from(b.into_contents()))
        .collect()
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: Arc<Shared>,
    events: tokio::sync::watch::Receiver<u64>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        shared.tcp.fetch_add(1, Ordering::SeqCst);
        // Like kube-apiserver (Go sets TCP_NODELAY on every connection): without it, the
        // response written right after the session tickets waits for a delayed ACK (~40 ms).
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let shared = shared.clone();
        let events = events.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(t) => t,
                Err(_) => {
                    shared.failed.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            };
            let record = {
                let (_, conn) = tls.get_ref();
                let (cn, orgs, serial) = conn
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| identity(c))
                    .unwrap_or_default();
                ConnRecord {
                    cn,
                    orgs,
                    serial,
                    protocol: conn
                        .alpn_protocol()
                        .map(|p| String::from_utf8_lossy(p).into_owned())
                        .unwrap_or_else(|| "none".into()),
                    resumed: conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
                    group: conn
                        .negotiated_key_exchange_group()
                        .map(|g| format!("{:?}", g.name()))
                        .unwrap_or_default(),
                    version: conn
                        .protocol_version()
                        .map(|v| format!("{v:?}"))
                        .unwrap_or_default(),
                }
            };
            shared
                .records
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(record.clone());
            let record = Arc::new(record);
            let service = hyper::service::service_fn(move |req| {
                let record = record.clone();
                let events = events.clone();
                async move { Ok::<_, Infallible>(route(req, &record, events).await) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .await;
        });
    }
}

fn identity(cert: &CertificateDer<'_>) -> (String, Vec<String>, String) {
    let (_, c) = x509_parser::parse_x509_certificate(cert).expect("client cert parses");
    let subject = c.subject();
    let cn = subject
        .iter_common_name()
        .filter_map(|a| a.as_str().ok())
        .next()
        .unwrap_or("")
        .to_string();
    let orgs = subject
        .iter_organization()
        .filter_map(|a| a.as_str().ok().map(str::to_string))
        .collect();
    (cn, orgs, c.raw_serial_as_string())
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<ResBody> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        content_type.parse().expect("content type"),
    );
    r
}

async fn route(
    req: Request<Incoming>,
    who: &ConnRecord,
    events: tokio::sync::watch::Receiver<u64>,
) -> Response<ResBody> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    match (req.method().as_str(), path.as_str()) {
        ("GET", "/version") => {
            let body = serde_json::json!({
                "major": "1",
                "minor": "32",
                "gitVersion": "v1.32.0+hwkey-test",
                "platform": "linux/amd64",
                "user": who.cn,
                "groups": who.orgs,
                "serial": who.serial,
                "protocol": format!("{:?}", req.version()),
                "resumed": who.resumed,
            });
            full(StatusCode::OK, "application/json", body.to_string())
        }
        ("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews") => {
            let _ = req.into_body().collect().await;
            let mut groups = who.orgs.clone();
            groups.push("system:authenticated".into());
            let body = serde_json::json!({
                "kind": "SelfSubjectReview",
                "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": null},
                "status": {"userInfo": {"username": who.cn, "groups": groups}},
            });
            full(StatusCode::CREATED, "application/json", body.to_string())
        }
        ("GET", "/api/v1/namespaces/default/configmaps")
            if query
                .split('&')
                .any(|p| p == "watch=1" || p == "watch=true") =>
        {
            let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
            let mut events = events;
            let mut sent = *events.borrow_and_update();
            tokio::spawn(async move {
                while events.changed().await.is_ok() {
                    let now = *events.borrow_and_update();
                    while sent < now {
                        sent += 1;
                        let line = serde_json::json!({
                            "type": "ADDED",
                            "object": {
                                "kind": "ConfigMap",
                                "apiVersion": "v1",
                                "metadata": {
                                    "name": format!("cm-{sent}"),
                                    "namespace": "default",
                                    "resourceVersion": sent.to_string(),
                                },
                            },
                        })
                        .to_string()
                            + "\n";
                        if tx.send(Bytes::from(line)).await.is_err() {
                            return;
                        }
                    }
                }
            });
            let mut r = Response::new(ChannelBody { rx }.boxed());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                "application/json".parse().expect("content type"),
            );
            r
        }
        ("GET", "/upgrade") => {
            let Some(proto) = req.headers().get(hyper::header::UPGRADE).cloned() else {
                return full(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    "Upgrade header required\n",
                );
            };
            tokio::spawn(async move {
                if let Ok(upgraded) = hyper::upgrade::on(req).await {
                    let io = TokioIo::new(upgraded);
                    let (mut r, mut w) = tokio::io::split(io);
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    use tokio::io::AsyncWriteExt;
                    let _ = w.shutdown().await;
                }
            });
            let mut r = Response::new(Full::new(Bytes::new()).map_err(|n| match n {}).boxed());
            *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            r.headers_mut().insert(hyper::header::UPGRADE, proto);
            r.headers_mut().insert(
                hyper::header::CONNECTION,
                "Upgrade".parse().expect("header"),
            );
            r
        }
        ("POST", "/echo") => {
            let body = req.into_body().map_err(|e| Box::new(e) as BoxError).boxed();
            let mut r = Response::new(body);
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                "application/octet-stream".parse().expect("header"),
            );
            r
        }
        ("GET", "/bytes") => {
            let n: u64 = query
                .split('&')
                .find_map(|p| p.strip_prefix("n="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut r = Response::new(PatternBody { next: 0, end: n }.boxed());
            r.headers_mut().insert(
                hyper::header::CONTENT_LENGTH,
                n.to_string().parse().expect("header"),
            );
            r
        }
        _ => full(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// A body fed by a channel (the watch stream).
struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// `end - next` bytes of [`pattern_byte`], in 64 KiB frames.
struct PatternBody {
    next: u64,
    end: u64,
}

impl Body for PatternBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.next >= self.end {
            return Poll::Ready(None);
        }
        const FRAME: u64 = 64 * 1024;
        // The pattern repeats every 251 bytes: every frame is a slice of one block made once
        // (no per-byte work, so the direct baseline of the benchmarks is not held back).
        static BLOCK: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
        let block = BLOCK.get_or_init(|| (0..FRAME + 251).map(pattern_byte).collect());
        let len = (self.end - self.next).min(FRAME);
        let offset = (self.next % 251) as usize;
        let chunk = block.slice(offset..offset + len as usize);
        self.next += len;
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.next >= self.end
    }
}
