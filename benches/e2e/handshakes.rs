//! Figures: handshakes and resumption (the connector in process, and whole connections
//! through the proxy).

use super::*;

/// New upstream connections per second (TLS 1.3 handshake + one GET /version, one at a time):
/// the proxy's own connector (`proxy::upstream::Upstream`, the code every proxied connection
/// runs) signing in SoftHSM, against rustls with a software key. The GET makes both clients
/// read the server's session tickets, as a proxied connection does.
pub(crate) async fn handshakes(f: &Fixture) -> Vec<Row> {
    const AREA: &str = "handshakes";
    let key = Arc::new(Key::open(&f.id.key_uri.parse::<KeyUri>().expect("URI")).expect("open key"));
    let connector = connector(f, &key, &f.upstream.url(), KeyExchange::Hybrid);
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

/// Issue 35: a full upstream handshake now crosses a process boundary (the network side asks
/// the signer process over a socketpair). The proxy's connector with no session to resume,
/// signing in the same SoftHSM key either in this process (as before the split) or through a
/// signer side started exactly as `hwkey proxy` starts it (supervisor and signer, the release
/// binary), in interleaved rounds; target ≥ 0.9× (and every signature counted by the signer).
pub(crate) async fn signer_handshakes(f: &Fixture) -> Vec<Row> {
    const AREA: &str = "handshakes";
    let uri: KeyUri = f.id.key_uri.parse().expect("URI");
    let local = Arc::new(Key::open(&uri).expect("open key"));
    std::env::set_var("HWKEY_SIGNER_BIN", support::hwkey_bin());
    let supervisor = hwkey::signer::Supervisor::start(&hwkey::signer::SignerConfig {
        key: uri,
        rotation_state: None,
        cert: Some(f.id.cert.clone()),
        identity: None,
        upstream_ca: None,
        tls12: false,
        require_non_extractable: false,
    })
    .expect("start the signer supervisor");
    let (_, remote) = hwkey::signer::remote::SignerLink::open(
        supervisor,
        hwkey::signer::remote::DEFAULT_DEADLINE,
    )
    .expect("signer");
    let remote = Arc::new(remote);
    let in_process = connector(f, &local, &f.upstream.url(), KeyExchange::Hybrid);
    let through_signer = connector(f, &remote, &f.upstream.url(), KeyExchange::Hybrid);
    let n = pick(200, 40);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let remote_before = remote.signatures();
    let mut results = vec![Vec::new(); 2];
    let mut resumed = 0usize;
    for series in schedule(rounds, 2) {
        let connector = if series == 0 {
            &in_process
        } else {
            &through_signer
        };
        let start = Instant::now();
        for _ in 0..n {
            connector.reset_sessions();
            let mut c = connector
                .connect(Some(b"http/1.1"))
                .await
                .expect("connector");
            http1_get(&mut c.stream, "/version", &mut buf).await;
            resumed += usize::from(c.resumed);
        }
        results[series].push(n as f64 / start.elapsed().as_secs_f64());
    }
    let remote_signatures = remote.signatures() - remote_before;
    vec![at_least(
        ratio_row(
            AREA,
            "full handshake + GET, signing through the signer process (issue 35)",
            "conn/s",
            &results[1],
            "the same connector signing in this process (before the split)",
            &results[0],
        ),
        0.9,
    )
    .note(format!(
        "SoftHSM P-256; {resumed} of {} handshakes resumed; signatures through the signer: {remote_signatures}",
        2 * n * rounds
    ))]
}

/// The proxy's connector to `url`, signing with `key`, offering `kx`.
fn connector(f: &Fixture, key: &Arc<Key>, url: &str, kx: KeyExchange) -> Upstream {
    connector_via(f, key, url, kx, Egress::direct())
}

/// The same, reaching the server the way `egress` says.
fn connector_via(
    f: &Fixture,
    key: &Arc<Key>,
    url: &str,
    kx: KeyExchange,
    egress: Egress,
) -> Upstream {
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
    let target: UpstreamTarget = url.parse().expect("target");
    Upstream::new(
        &hwkey::proxy::settings::UpstreamSettings {
            targets: vec![target],
            ca: None,
            egress,
            key_exchange: kx,
            tls_server_name: None,
            handshake_timeout: Duration::from_secs(10),
            preconnect: false,
        },
        hwkey::proxy::upstream::Identity {
            key: key.clone(),
            resolver,
        },
        roots,
        hwkey::key::tls::protocol_versions(key, false).expect("TLS versions"),
        Arc::new(Metrics::default()),
    )
    .expect("connector")
}

/// Issue 25: what the post-quantum hybrid costs per connection. The proxy's connector against
/// an API server that prefers X25519MLKEM768 (the stand-in with aws-lc-rs's hybrid, as Go ≥
/// 1.24), offering the hybrid (negotiated) against offering X25519 alone, for full handshakes
/// (each signed in SoftHSM) and resumed ones (PSK with (EC)DHE: the key exchange runs again).
pub(crate) async fn key_exchange(f: &Fixture) -> Vec<Row> {
    const AREA: &str = "key exchange";
    let key = Arc::new(Key::open(&f.id.key_uri.parse::<KeyUri>().expect("URI")).expect("open key"));
    let pq = TestUpstream::start_pq(&f.id.ca);
    let hybrid = connector(f, &key, &pq.url(), KeyExchange::Hybrid);
    let classical = connector(f, &key, &pq.url(), KeyExchange::Classical);
    let n = pick(200, 40);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let mut results = vec![Vec::new(); 4];
    for series in schedule(rounds, 4) {
        let c = if series % 2 == 0 { &hybrid } else { &classical };
        let full = series < 2;
        let start = Instant::now();
        for _ in 0..n {
            if full {
                c.reset_sessions();
            }
            let mut conn = c.connect(Some(b"http/1.1")).await.expect("connector");
            http1_get(&mut conn.stream, "/version", &mut buf).await;
        }
        results[series].push(n as f64 / start.elapsed().as_secs_f64());
    }
    let groups: Vec<String> = pq
        .stats()
        .connections
        .iter()
        .map(|c| c.group.clone())
        .collect();
    let hybrid_count = groups.iter().filter(|g| *g == "X25519MLKEM768").count();
    let bulk = bulk_by_key_exchange(&hybrid, &classical, rounds).await;
    vec![
        at_least(
            ratio_row(
                AREA,
                "full handshake + GET, X25519MLKEM768 offered and negotiated",
                "conn/s",
                &results[0],
                "X25519 alone, same connector and server",
                &results[1],
            ),
            0.9,
        )
        .note(format!(
            "{hybrid_count} of the {} handshakes of both series negotiated X25519MLKEM768 (the X25519 series does not offer it)",
            groups.len()
        )),
        at_least(
            ratio_row(
                AREA,
                "resumed handshake + GET, X25519MLKEM768",
                "conn/s",
                &results[2],
                "X25519 alone, resumed",
                &results[3],
            ),
            0.9,
        ),
        at_least(
            ratio_row(
                AREA,
                "bulk download on a connection keyed with X25519MLKEM768",
                "MB/s",
                &bulk[0],
                "keyed with X25519",
                &bulk[1],
            ),
            0.98,
        )
        .note("the key exchange ends with the handshake; the records use the same cipher suite"),
    ]
}

/// Download MB/s on one established connection from each connector, alternating.
async fn bulk_by_key_exchange(
    hybrid: &Upstream,
    classical: &Upstream,
    rounds: usize,
) -> Vec<Vec<f64>> {
    let size: u64 = pick(64, 16) << 20;
    let path = format!("/bytes?n={size}");
    let mut buf = vec![0u8; 256 * 1024];
    let mut conns = Vec::new();
    for c in [hybrid, classical] {
        let mut conn = c.connect(Some(b"http/1.1")).await.expect("connector");
        http1_get(&mut conn.stream, &path, &mut buf).await;
        conns.push(conn);
    }
    let mut bulk = vec![Vec::new(); 2];
    for series in schedule(rounds, 2) {
        let start = Instant::now();
        let got = http1_get(&mut conns[series].stream, &path, &mut buf).await;
        bulk[series].push(got as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    bulk
}

/// Issue 25: new connections through an HTTP CONNECT proxy (squid, on loopback): the proxy's
/// connector signing in SoftHSM against rustls with a software key, both through the same
/// squid to the same server, with resumption (as proxied connections mostly are).
pub(crate) async fn through_forward_proxy(f: &Fixture) -> Vec<Row> {
    const AREA: &str = "forward proxy";
    let squid = support::forward_proxies::Squid::start(None);
    let egress = Egress::through(ForwardProxy::parse(&squid.url()).expect("squid URL"));
    let key = Arc::new(Key::open(&f.id.key_uri.parse::<KeyUri>().expect("URI")).expect("open key"));
    let hw = connector_via(
        f,
        &key,
        &f.upstream.url(),
        KeyExchange::Hybrid,
        egress.clone(),
    );
    let port = f.upstream.port();
    let n = pick(200, 40);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let mut rates = vec![Vec::new(); 2];
    let mut medians = vec![Vec::new(); 2];
    for series in schedule(rounds, 2) {
        let mut times = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            if series == 0 {
                let mut c = hw.connect(Some(b"http/1.1")).await.expect("connector");
                http1_get(&mut c.stream, "/version", &mut buf).await;
            } else {
                let tunnel = egress.dial("127.0.0.1", port).await.expect("CONNECT");
                let mut s = tokio_rustls::TlsConnector::from(f.direct.clone())
                    .connect(
                        ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into()),
                        tunnel,
                    )
                    .await
                    .expect("TLS through squid");
                http1_get(&mut s, "/version", &mut buf).await;
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        rates[series].push(n as f64 / start.elapsed().as_secs_f64());
        times.sort_by(f64::total_cmp);
        medians[series].push(times[times.len() / 2]);
    }
    vec![
        ratio_row(
            AREA,
            "new connections through squid (CONNECT), proxy connector signing in SoftHSM",
            "conn/s",
            &rates[0],
            "rustls with a software key through the same squid",
            &rates[1],
        ),
        ratio_row(
            AREA,
            "time per connection through squid (CONNECT + TLS + GET), median",
            "ms",
            &medians[0],
            "rustls with a software key through the same squid",
            &medians[1],
        ),
    ]
}

/// New client connections through the running proxy (each: connect, GET /version, close)
/// against new direct connections that resume; and the hardware signatures they cost.
pub(crate) async fn through_proxy(f: &Fixture) -> Vec<Row> {
    let n = pick(200, 50);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    // One connection first so the proxy holds a session and the clients hold tickets.
    warm(f, &mut buf).await;
    let sigs_before = f.proxy.signatures();
    let metrics_before = f.proxy.metrics();
    let mut loopback_resumed = 0usize;
    let mut results = vec![Vec::new(); 3];
    // Per round: what the loopback hop cannot do without, timed in this process right after
    // the loopback series (µs): its X25519 work and a loopback TCP connection.
    let mut x25519_us = Vec::new();
    let mut tcp_us = Vec::new();
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
        if series == 1 {
            x25519_us.push(x25519_exchanges_us(200));
            tcp_us.push(tcp_connection_us(200));
        }
    }
    // The loopback path's ceiling against the UNIX path in each round: a UNIX connection's
    // time plus the loopback hop's unavoidable work. The rounds are in the same order as the
    // series' results (one of each per round).
    let ceilings: Vec<f64> = results[0]
        .iter()
        .zip(x25519_us.iter().zip(&tcp_us))
        .map(|(unix_rate, (x, t))| {
            let unix_us = 1e6 / unix_rate;
            unix_us / (unix_us + x + t)
        })
        .collect();
    let ceiling = Stat::of(&ceilings);
    let (x, t) = (Stat::of(&x25519_us).median, Stat::of(&tcp_us).median);
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
        at_least(
            ratio_row("handshakes", "new client connection + GET through the proxy, loopback TLS ÷ UNIX socket", "conn/s", &results[1], "the same through the UNIX socket", &results[0]),
            0.8,
        )
        .note(format!(
            "ceiling in the same rounds {:.2}× [{:.2}–{:.2}]: a UNIX connection's time plus what the loopback hop cannot do without, timed in this process after each loopback series: the TLS 1.3 resumption's X25519 key shares and agreements on both ends ({x:.0} µs; rustls resumes only with psk_dhe_ke, which keeps forward secrecy) and a loopback TCP connect, accept, one byte each way and close ({t:.0} µs)",
            ceiling.median, ceiling.p25, ceiling.p75
        )),
        Row::new("resumption", "hardware signatures per 1,000 client connections", "signatures", Some(Stat::of(&[per_1000])))
            .target("≤ 10", Some(per_1000 <= 10.0))
            .note(format!(
                "{sigs} signatures for {clients} client connections (UNIX and loopback TLS); proxy /metrics: {full} full, {res} resumed upstream handshakes"
            )),
    ]
}

pub(crate) async fn warm(f: &Fixture, buf: &mut [u8]) {
    let mut s = UnixStream::connect(&f.proxy.socket)
        .await
        .expect("UNIX connect");
    http1_get(&mut s, "/version", buf).await;
    let mut s = tls_connect(&f.loopback, f.proxy.tcp_port).await;
    http1_get(&mut s, "/version", buf).await;
    let mut s = tls_connect(&f.direct, f.upstream.port()).await;
    http1_get(&mut s, "/version", buf).await;
}

/// Mean µs of one loopback TLS 1.3 resumption's key exchange, both ends: two X25519 key
/// shares and two agreements (ring, as the proxy's provider), over `n` runs.
pub(crate) fn x25519_exchanges_us(n: usize) -> f64 {
    use ring::agreement::{agree_ephemeral, EphemeralPrivateKey, UnparsedPublicKey, X25519};
    let rng = ring::rand::SystemRandom::new();
    let start = Instant::now();
    for _ in 0..n {
        let client = EphemeralPrivateKey::generate(&X25519, &rng).expect("client share");
        let client_pub = client.compute_public_key().expect("client public");
        let server = EphemeralPrivateKey::generate(&X25519, &rng).expect("server share");
        let server_pub = server.compute_public_key().expect("server public");
        let a = agree_ephemeral(
            client,
            &UnparsedPublicKey::new(&X25519, server_pub.as_ref()),
            |k| k[0],
        )
        .expect("client agreement");
        let b = agree_ephemeral(
            server,
            &UnparsedPublicKey::new(&X25519, client_pub.as_ref()),
            |k| k[0],
        )
        .expect("server agreement");
        assert_eq!(a, b);
    }
    start.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// Mean µs of one loopback TCP connection in this thread: connect, accept, one byte each way,
/// close both ends, over `n` runs (no scheduling between processes: a lower bound).
pub(crate) fn tcp_connection_us(n: usize) -> f64 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
    let addr = listener.local_addr().expect("address");
    let mut byte = [0u8; 1];
    let start = Instant::now();
    for _ in 0..n {
        let mut c = std::net::TcpStream::connect(addr).expect("connect");
        let (mut s, _) = listener.accept().expect("accept");
        c.write_all(b"?").expect("write");
        s.read_exact(&mut byte).expect("read");
        s.write_all(b"!").expect("write back");
        c.read_exact(&mut byte).expect("read back");
    }
    start.elapsed().as_secs_f64() * 1e6 / n as f64
}
