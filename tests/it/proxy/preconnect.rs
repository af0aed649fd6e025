//! Spare upstream connections (`proxy::spare`): while clients (loopback TLS or UNIX socket) come
//! in a burst (kubectl run by a script), the proxy connects upstream for the next client before it comes, so its
//! request goes up at once. What the API server sees is the signal here (its TCP connections,
//! counted before each client connects), and what the client gets. The waits are for the
//! proxy's own count of what it made; what is asserted is what the API server saw.

use std::time::Duration;

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;

const MADE: &str = "hwkey_upstream_spares_total{event=\"made\"}";
const USED: &str = "hwkey_upstream_spares_total{event=\"used\"}";
const EXPIRED: &str = "hwkey_upstream_spares_total{event=\"expired\"}";
const DROPPED: &str = "hwkey_upstream_spares_total{event=\"dropped\"}";

/// One `GET /version` over a new loopback TLS connection: the status.
fn ask(proxy: &ProxyProcess, config: &std::sync::Arc<rustls::ClientConfig>) -> u16 {
    let mut conn = RawHttp::connect_tls(proxy.tcp_port, config);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    conn.read_response().0
}

/// One `GET /version` over a new UNIX-socket connection: the status and the body.
fn ask_unix(proxy: &ProxyProcess) -> (u16, String) {
    let mut conn = RawHttp::connect(&proxy.socket);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    conn.read_response()
}

/// Waits until the proxy has made `n` connections ahead (each counted once its handshake is
/// done and it is kept), then returns the TCP connections the upstream has accepted.
fn made_ahead(proxy: &ProxyProcess, upstream: &TestUpstream, n: u64) -> u64 {
    proxy.wait_for_metric(MADE, n as f64);
    upstream.stats().tcp_connections
}

/// Clients one after another: from the third on, each finds its upstream connection made
/// before it connected (the API server has accepted one connection more than there were
/// clients, before the client connects), its request is answered on it, and no signature is
/// made for any of them (each spare resumed a session). At most one connection is ever made
/// ahead.
#[test]
fn loopback_clients_in_a_burst_find_their_upstream_connection_made_ahead() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    // The first client: a full handshake (a signature) and nothing made ahead (no client
    // came before it). The second came soon after the first: one is made ahead after it.
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    let signed = proxy.signatures();
    for clients in 2..12u64 {
        // The next client's connection is there before the client is.
        assert_eq!(
            made_ahead(&proxy, &upstream, clients - 1),
            clients + 1,
            "{}",
            proxy.log()
        );
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    assert_eq!(
        made_ahead(&proxy, &upstream, 11),
        13,
        "12 clients: 12 connections and one made ahead for a 13th, never more"
    );
    assert_eq!(proxy.metric(USED), 10.0, "{}", proxy.metrics());
    assert_eq!(
        proxy.signatures(),
        signed,
        "a connection made ahead resumes a session: no signature"
    );
    assert_eq!(
        upstream.stats().full(),
        1,
        "only the first client's handshake was full"
    );
}

/// A client that comes alone (the last one came long ago, or never) makes nothing ahead, and
/// `--no-preconnect` makes nothing ahead for a burst either.
#[test]
fn a_lone_client_or_no_preconnect_makes_no_connection_ahead() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(upstream.stats().tcp_connections, 1, "{}", proxy.log());

    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    let config = support::proxy::loopback_client_config(&proxy.credential());
    for _ in 0..5 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(upstream.stats().tcp_connections, 5, "{}", proxy.log());
    assert_eq!(proxy.metric(USED), 0.0);
}

/// A connection made ahead that the API server has closed since (a restart) is not used: the
/// next client is not handed a closed connection (its request lost), but gets what a client
/// gets from an API server that is down, a 502 naming it; once the API server is back, the
/// next client is served on a fresh connection.
#[test]
fn a_connection_made_ahead_that_the_api_server_closed_is_not_used() {
    let id = Identity::softhsm();
    let mut upstream = TestUpstream::start(&id.ca);
    let port = upstream.port();
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    for _ in 0..2 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    assert_eq!(made_ahead(&proxy, &upstream, 1), 3);
    upstream.stop();
    assert_eq!(ask(&proxy, &config), 502, "{}", proxy.log());
    assert_eq!(proxy.metric(DROPPED), 1.0, "{}", proxy.metrics());
    assert_eq!(proxy.metric(USED), 0.0);
    let _back = TestUpstream::start_on(&id.ca, port);
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
}

/// A connection made ahead that nobody comes for is closed after 3 s, and counted; a client
/// that comes later finds none and is served on a connection of its own (and, having come
/// long after the one before, makes none ahead).
#[test]
fn a_connection_made_ahead_and_not_used_is_closed() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    for _ in 0..2 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    assert_eq!(made_ahead(&proxy, &upstream, 1), 3);
    proxy.wait_for_metric(EXPIRED, 1.0);
    // Three seconds after the last client: the next one comes alone.
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(upstream.stats().tcp_connections, 4, "{}", proxy.log());
    assert_eq!(proxy.metric(USED), 0.0);
    assert_eq!(proxy.metric(MADE), 1.0);
}

/// A connection made ahead under a certificate that has been replaced since is not used: the
/// next client's request goes up under the new certificate (the API server names it), never
/// under the one the proxy no longer presents.
#[test]
fn a_connection_made_ahead_under_a_replaced_certificate_is_not_used() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--reload-interval", "100ms"]),
    );
    let config = support::proxy::loopback_client_config(&proxy.credential());
    // The new certificate is ready before the burst: installing it takes the proxy a moment,
    // well within the 3 s a connection made ahead is kept.
    let renewed = id.dir.path().join("renewed.pem");
    id.issue(&id.key_uri, "CN=alice,O=devs", &renewed);
    for _ in 0..2 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    assert_eq!(made_ahead(&proxy, &upstream, 1), 3);
    let tmp = id.cert.with_extension("new");
    std::fs::copy(&renewed, &tmp).expect("copy");
    std::fs::rename(&tmp, &id.cert).expect("rename");
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);

    let mut conn = RawHttp::connect_tls(proxy.tcp_port, &config);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let (status, body) = conn.read_response();
    assert_eq!(status, 200, "{}", proxy.log());
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let pem = std::fs::read(&renewed).expect("read");
    let block = pem::parse(pem).expect("PEM");
    let (_, c) = x509_parser::parse_x509_certificate(block.contents()).expect("cert");
    assert_eq!(v["serial"], c.raw_serial_as_string().as_str(), "{v}");
    assert_eq!(proxy.metric(DROPPED), 1.0, "{}", proxy.metrics());
    assert_eq!(proxy.metric(USED), 0.0);
}

/// An API server that resumes no session (its ticket keys keep changing) makes every handshake
/// full, a signature each. A connection made ahead would need one too, for a client that has
/// not come: it is tried once and refused (its handshake fails without a signature), and then
/// no more are tried. The clients are served, each with its own signature, and no more.
#[test]
fn a_connection_made_ahead_never_costs_a_signature() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start_never_resuming(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let before = proxy.signatures();
    for _ in 0..5 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    }
    // The one attempt made ahead has failed (its handshake refused to sign): an event, not a
    // pause, so a late attempt on a loaded machine is still counted below.
    proxy.wait_for_metric("hwkey_upstream_errors_total{stage=\"handshake\"}", 1.0);
    assert_eq!(
        proxy.signatures() - before,
        5,
        "one signature per client, none for a connection made ahead"
    );
    assert_eq!(proxy.metric(MADE), 0.0);
    assert_eq!(
        upstream.stats().tcp_connections,
        6,
        "one attempt to make a connection ahead, then none: {}",
        proxy.log()
    );
}

/// Against an API server that sends one session ticket per handshake, as Go's crypto/tls
/// (kube-apiserver) does, a burst still gets its connections made ahead: a spare waits for the
/// ticket the client connection just made brings back, and its own handshake brings one back
/// for the next. And no client is made to sign by a spare that took the only ticket: after the
/// first client's full handshake, no signature at all.
#[test]
fn a_burst_gets_connections_made_ahead_from_an_api_server_sending_one_ticket() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start_one_ticket(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    let signed = proxy.signatures();
    for made in 1..8u64 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
        proxy.wait_for_metric(MADE, made as f64);
    }
    assert_eq!(proxy.signatures(), signed, "{}", proxy.log());
    assert_eq!(proxy.metric(USED), 6.0, "{}", proxy.metrics());
    assert_eq!(upstream.stats().full(), 1);
}

/// One upstream session store serves every protocol, and a session made for one resumes for
/// another: an HTTP/2 client after HTTP/1.1 ones makes no full handshake. Before, each
/// protocol's configuration had its own server-certificate verifier, rustls resumes a session
/// only with the verifier that made it, and the HTTP/2 connection took the HTTP/1.1 ticket,
/// could not use it, and signed.
#[test]
fn a_session_made_for_one_protocol_resumes_for_another() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    for args in [
        ["--http1.1"],
        ["--http1.1"],
        ["--http2-prior-knowledge"],
        ["--http2-prior-knowledge"],
    ] {
        let out = proxy.curl_unix(&args, "/version");
        assert!(out.status.success(), "{}", proxy.log());
    }
    let stats = upstream.stats();
    assert_eq!(stats.with_protocol("h2"), 2, "{stats:?}");
    assert_eq!(
        stats.full(),
        1,
        "only the first connection signs: {stats:?}"
    );
}

/// UNIX-socket clients one after another get the same: from the third on, each finds its
/// upstream connection made before it connected, its request (sent on a connection whose
/// handshake is long over) is answered, and no signature is made. The request reaches the API
/// server whole and in order (the body names the client certificate).
#[test]
fn unix_clients_in_a_burst_find_their_upstream_connection_made_ahead() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for _ in 0..2 {
        assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    }
    let signed = proxy.signatures();
    for clients in 2..10u64 {
        assert_eq!(
            made_ahead(&proxy, &upstream, clients - 1),
            clients + 1,
            "{}",
            proxy.log()
        );
        let (status, body) = ask_unix(&proxy);
        assert_eq!(status, 200, "{}", proxy.log());
        assert!(body.contains("\"user\":\"alice\""), "{body}");
    }
    assert_eq!(
        made_ahead(&proxy, &upstream, 9),
        11,
        "never more than one ahead"
    );
    assert_eq!(proxy.metric(USED), 8.0, "{}", proxy.metrics());
    assert_eq!(proxy.signatures(), signed, "a spare resumes: no signature");
    assert_eq!(upstream.stats().full(), 1);
}

/// An HTTP/2 client on the UNIX socket (curl with prior knowledge, whose preface the proxy
/// reads before it connects upstream) is given a spare made for HTTP/2, never one made for
/// HTTP/1.1: the API server sees every request on an `h2` connection.
#[test]
fn unix_http2_clients_get_a_connection_made_ahead_for_http2() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for args in [["--http1.1"], ["--http1.1"], ["--http1.1"]] {
        let out = proxy.curl_unix(&args, "/version");
        assert!(out.status.success(), "{}", proxy.log());
    }
    // Two made for HTTP/1.1 (after the second client and the third).
    proxy.wait_for_metric(MADE, 2.0);
    for client in 0..4u64 {
        let out = proxy.curl_unix(&["--http2-prior-knowledge"], "/version");
        assert!(out.status.success(), "{}", proxy.log());
        let body = String::from_utf8_lossy(&out.stdout);
        assert!(body.contains("\"protocol\":\"HTTP/2.0\""), "{body}");
        if client >= 1 {
            proxy.wait_for_metric(MADE, (2 + client) as f64);
        }
    }
    let stats = upstream.stats();
    assert_eq!(
        stats.with_protocol("h2"),
        4 + 1,
        "{stats:?}\n{}",
        proxy.log()
    );
    assert_eq!(proxy.metric(USED), 1.0 + 2.0, "{}", proxy.metrics());
    assert_eq!(stats.full(), 1, "{stats:?}");
}

/// Loopback TLS and UNIX-socket clients taking turns: each kind is given a spare made for its
/// own kind (an unbuffered session for a loopback client, a buffered one for a UNIX client),
/// and every client is served.
#[test]
fn loopback_and_unix_clients_taking_turns_each_get_their_own_kind_of_spare() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    for round in 0..6u64 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
        assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
        if round >= 1 {
            proxy.wait_for_metric(MADE, (2 * round) as f64);
        }
    }
    assert_eq!(proxy.metric(USED), 8.0, "{}", proxy.metrics());
    assert_eq!(upstream.stats().full(), 1);
}

/// A UNIX client's spare that the API server has closed since is not used: the client gets
/// the 502 naming the API server, not a closed connection.
#[test]
fn a_unix_clients_connection_made_ahead_that_the_api_server_closed_is_not_used() {
    let id = Identity::softhsm();
    let mut upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for _ in 0..2 {
        assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    }
    assert_eq!(made_ahead(&proxy, &upstream, 1), 3);
    upstream.stop();
    assert_eq!(ask_unix(&proxy).0, 502, "{}", proxy.log());
    assert_eq!(proxy.metric(DROPPED), 1.0, "{}", proxy.metrics());
    assert_eq!(proxy.metric(USED), 0.0);
}

/// A UNIX client's spare, made on a relay loop and kept in no runtime, that nobody comes for is
/// closed after 3 s by the loop that made it, and counted: the proxy then holds no connection
/// to the API server. A client that comes later finds none and is served on a connection of
/// its own.
#[test]
fn a_unix_clients_connection_made_ahead_and_not_used_is_closed() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for _ in 0..2 {
        assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    }
    assert_eq!(made_ahead(&proxy, &upstream, 1), 3);
    assert_eq!(connected_to(upstream.port()), 1, "the spare, held");
    proxy.wait_for_metric(EXPIRED, 1.0);
    // Closed as it was counted (the loop closes it right after), the kernel's state a moment
    // later.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while connected_to(upstream.port()) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        connected_to(upstream.port()),
        0,
        "the spare is still open after it was counted expired\n{}",
        proxy.log()
    );
    assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(upstream.stats().tcp_connections, 4, "{}", proxy.log());
    assert_eq!(proxy.metric(USED), 0.0);
    assert_eq!(proxy.metric(MADE), 1.0);
}

/// Go's crypto/tls server (kube-apiserver's TLS stack) and a proxy in front of it.
fn proxy_to_go_tls(id: &Identity) -> (support::servers::GoTlsServer, ProxyProcess) {
    let (cert, key) = id.ca.server_cert(id.dir.path());
    let go = support::servers::GoTlsServer::start(&cert, &key, &id.ca.ca_path());
    let url = format!("https://127.0.0.1:{}", go.port());
    let proxy = ProxyProcess::start_to(id, &url, ProxyOptions::default());
    (go, proxy)
}

/// Established TCP connections on this machine to `port` on 127.0.0.1 (the proxy's side of
/// its connections to a test's API server: the server's side has `port` as its own).
fn connected_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("the kernel's TCP table");
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// Against an API server that resumes nothing, a UNIX client's spare is refused too: its
/// buffered handshake fails without a signature, and no more are tried. So is a relay loop's
/// own resumption (a connection the loop opens, `proxy::relay_loop`'s `opening`): the client is
/// served on a connection thread with a full handshake, and loops try no more for a minute.
/// At most two connections are refused in all: the spare's and, when the second client
/// comes before the spare's refusal leaves no ticket to claim, the loop's.
#[test]
fn a_unix_clients_connection_made_ahead_never_costs_a_signature() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start_never_resuming(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let before = proxy.signatures();
    for _ in 0..5 {
        assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    }
    proxy.wait_for_metric("hwkey_upstream_errors_total{stage=\"handshake\"}", 1.0);
    assert_eq!(proxy.signatures() - before, 5, "{}", proxy.log());
    assert_eq!(proxy.metric(MADE), 0.0);
    let connections = upstream.stats().tcp_connections;
    assert!(
        (6..=7).contains(&connections),
        "{connections} connections for 5 clients, a refused spare and at most one refused \
         attempt of a relay loop\n{}",
        proxy.log()
    );
}

/// Against Go's crypto/tls (one ticket per handshake), clients that come while a relay loop
/// makes a spare never sign: the spare took the one ticket the store held, and a client that
/// finds none waits for the ticket that spare's handshake brings back instead of leading a
/// full handshake. UNIX-socket and loopback clients, several at once, again and again. (The
/// window is a round trip on loopback: this run rarely hits it, and passed against a build
/// whose loop spares did not count as coming; `proxy::sessions`'s
/// `a_client_waits_for_the_ticket_a_loops_spare_brings_back` holds the count itself.)
#[test]
fn clients_that_come_while_a_loop_makes_a_spare_never_sign() {
    let id = Identity::softhsm();
    let (_go, proxy) = proxy_to_go_tls(&id);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    let signed = proxy.signatures();
    for _ in 0..20 {
        std::thread::scope(|s| {
            let unix: Vec<_> = (0..3).map(|_| s.spawn(|| ask_unix(&proxy).0)).collect();
            let tls = s.spawn(|| ask(&proxy, &config));
            for client in unix {
                assert_eq!(client.join().unwrap(), 200, "{}", proxy.log());
            }
            assert_eq!(tls.join().unwrap(), 200, "{}", proxy.log());
        });
    }
    assert!(
        proxy.metric(USED) >= 1.0,
        "no spare was used\n{}",
        proxy.metrics()
    );
    assert_eq!(
        proxy.signatures() - signed,
        0,
        "clients signed after the first one's full handshake\n{}",
        proxy.log()
    );
}

/// A spare whose handshake stalls (an API server behind a balancer whose backend accepted it
/// and never answers) costs one signature, not one per client waiting: against Go's TLS (one
/// ticket per handshake) the spare took the store's only ticket, so the clients that come
/// meanwhile find none and wait for the spare's; after a second one of them leads a full
/// handshake, and the others resume with the tickets that brings. They used to wait the gate's
/// 3 s and then make a full handshake each.
#[test]
fn clients_waiting_for_a_stalled_spare_sign_once_between_them() {
    let id = Identity::softhsm();
    let (cert, key) = id.ca.server_cert(id.dir.path());
    let go = support::servers::GoTlsServer::start(&cert, &key, &id.ca.ca_path());
    // The first client's connection resumes nothing; the second client's is the first
    // resumption, and the spare made after it the second: that one stalls.
    let relay = support::relay::StallingRelay::start(go.port(), 2);
    let url = format!("https://127.0.0.1:{}", relay.port);
    let proxy = ProxyProcess::start_to(&id, &url, ProxyOptions::default());
    assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    let signed = proxy.signatures();
    let (status, body) = ask_unix(&proxy);
    assert_eq!(status, 200, "{}", proxy.log());
    assert!(body.contains("\"resumed\":true"), "{body}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while relay.stalled() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no spare was begun after the second client\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::scope(|s| {
        let clients: Vec<_> = (0..3).map(|_| s.spawn(|| ask_unix(&proxy).0)).collect();
        for client in clients {
            assert_eq!(client.join().unwrap(), 200, "{}", proxy.log());
        }
    });
    assert_eq!(
        proxy.signatures() - signed,
        1,
        "three clients waiting for a stalled spare: one full handshake between them\n{}",
        proxy.log()
    );
}

/// Against Go's crypto/tls (kube-apiserver's TLS stack: one ticket per handshake, a resumed
/// session's ticket sent with the server's `Finished`), clients of both kinds in a burst find
/// their upstream connections made ahead, every one of them resumed, and no signature is made
/// after the first client's full handshake.
#[test]
fn clients_in_a_burst_against_go_tls_find_connections_made_ahead() {
    let id = Identity::softhsm();
    let (_go, proxy) = proxy_to_go_tls(&id);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    assert_eq!(ask_unix(&proxy).0, 200, "{}", proxy.log());
    let signed = proxy.signatures();
    for made in 1..6u64 {
        let (status, body) = ask_unix(&proxy);
        assert_eq!(status, 200, "{}", proxy.log());
        assert!(body.contains("\"resumed\":true"), "{body}");
        proxy.wait_for_metric(MADE, made as f64);
    }
    assert_eq!(proxy.metric(USED), 4.0, "{}", proxy.metrics());
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    for made in 6..9u64 {
        assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
        proxy.wait_for_metric(MADE, made as f64);
    }
    assert_eq!(ask(&proxy, &config), 200, "{}", proxy.log());
    assert_eq!(proxy.metric(USED), 4.0 + 3.0, "{}", proxy.metrics());
    assert_eq!(proxy.signatures(), signed, "{}", proxy.log());
}
