//! The proxy's own limits: handshake and idle timeouts, the connection limit, idle admin and
//! control connections reaped, and descriptors after abortive closes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;

use super::{fd_count, loopback_client, loopback_get};

/// Reads until the peer closes: Ok(bytes) on a close, or a panic naming `what` if nothing
/// closed it within 20 s (a read timeout is never taken for a close).
fn read_until_closed(stream: &mut impl Read, what: &str) -> Vec<u8> {
    let mut got = Vec::new();
    match stream.read_to_end(&mut got) {
        Ok(_) => got,
        Err(e) => panic!("{what}: not closed within 20 s ({e}); read {got:?}"),
    }
}

/// A client that sends nothing is closed after `--handshake-timeout`, on the loopback TLS port
/// (no ClientHello) and on the UNIX socket (no request), and counted as `handshake_timeout`.
/// The verdict is the close itself and then the counter, never a read that merely timed out.
#[cfg(feature = "pkcs11")]
#[test]
fn a_silent_client_is_closed_after_the_handshake_timeout() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--handshake-timeout", "1s"]),
    );
    let refused = "hwkey_connections_refused_total{reason=\"handshake_timeout\"}";

    let mut silent = TcpStream::connect(("127.0.0.1", proxy.tcp_port)).expect("connect tcp");
    silent.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let got = read_until_closed(&mut silent, "a silent loopback TLS client");
    assert!(got.is_empty(), "the proxy sent {got:?} to a silent client");
    proxy.wait_for_metric(refused, 1.0);

    let mut silent = std::os::unix::net::UnixStream::connect(&proxy.socket).expect("connect");
    silent.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let got = read_until_closed(&mut silent, "a silent UNIX-socket client");
    assert!(got.is_empty(), "the proxy sent {got:?} to a silent client");
    proxy.wait_for_metric(refused, 2.0);
    assert_eq!(
        upstream.stats().tcp_connections,
        0,
        "a silent client reached upstream"
    );
}

/// A ClientHello that comes in pieces (a slow peer, or one that sends a few bytes and waits to
/// hold a place) is waited for, not polled: while the proxy has only its first 10 bytes, its
/// connection threads make at most a few reads of the socket, and once the rest comes the
/// handshake completes. The ClientHello's first read is made at once, around the runtime; a
/// read around the runtime leaves it believing the socket still readable, and a wait on it
/// then returns at once: a version that waited that way after such a read read the socket
/// thousands of times in these 300 ms, at full speed on one core.
#[cfg(feature = "pkcs11")]
#[test]
fn a_client_hello_in_pieces_is_waited_for_not_polled() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = loopback_client(&proxy.credential());
    let mut conn = rustls::ClientConnection::new(
        config,
        rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
    )
    .expect("client");
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello).expect("ClientHello");
    }
    let mut tcp = TcpStream::connect(("127.0.0.1", proxy.tcp_port)).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(10))).ok();
    tcp.write_all(&hello[..10]).expect("first bytes");
    // The connection has reached its thread and read its first bytes.
    proxy.wait_for_metric("hwkey_connections_total{listener=\"tcp\"}", 1.0);
    std::thread::sleep(Duration::from_millis(100));
    let strace = support::strace::Strace::attach_calls(proxy.guard.id(), "read,recvfrom");
    std::thread::sleep(Duration::from_millis(300));
    let by_thread = strace.stop_by_thread();
    let reads: u64 = by_thread
        .iter()
        .filter(|((thread, _), _)| thread.starts_with("hwkey-proxy-con"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        reads <= 4,
        "the connection threads read {reads} times while the ClientHello was incomplete: \
         they polled instead of waiting; by thread: {by_thread:?}"
    );
    tcp.write_all(&hello[10..]).expect("the rest");
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).expect("the handshake completes");
    }
}

/// A ClientHello a megabyte long (a handshake message that says it is 16 MiB, in records of
/// 16 KiB) is refused once it is longer than a handshake message may be: the proxy closes the
/// connection without reading the rest, counts it as a failed client authentication, and
/// nothing reaches the upstream.
#[cfg(feature = "pkcs11")]
#[test]
fn a_megabyte_client_hello_is_refused_unread() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let mut tcp = TcpStream::connect(("127.0.0.1", proxy.tcp_port)).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let mut hello = vec![0x01, 0xff, 0xff, 0xff];
    hello.resize(16 * 1024, 0);
    let mut sent = 0;
    for i in 0..64 {
        let body: &[u8] = if i == 0 { &hello } else { &[0u8; 16 * 1024] };
        let mut record = vec![0x16, 0x03, 0x01, 0x40, 0x00];
        record.extend_from_slice(body);
        if tcp.write_all(&record).is_err() {
            break;
        }
        sent += record.len();
    }
    // Closed with what it had not read still queued: the kernel resets the connection.
    let mut got = Vec::new();
    match tcp.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("a megabyte ClientHello: not closed within 20 s ({e})"),
    }
    assert!(got.len() < 64, "the proxy answered {} bytes", got.len());
    proxy.wait_for_metric(
        "hwkey_connections_refused_total{reason=\"client_auth\"}",
        1.0,
    );
    assert_eq!(
        upstream.stats().tcp_connections,
        0,
        "a ClientHello of {sent} bytes reached upstream"
    );
}

/// With `--max-connections 1`, a second client is accepted but not served while a watch holds
/// the one slot (no upstream connection is made for it, it reads nothing), and is served as soon
/// as the watch ends. No timer takes part: the watch holds its slot until the test drops it.
#[cfg(feature = "pkcs11")]
#[test]
fn a_client_beyond_max_connections_waits_for_a_slot() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--max-connections", "1"]),
    );
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);
    let upstream_before = upstream.stats().tcp_connections;

    let mut waiting = std::os::unix::net::UnixStream::connect(&proxy.socket).expect("connect");
    waiting
        .write_all(b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("write");
    proxy.wait_for_metric("hwkey_connections_total{listener=\"unix\"}", 2.0);
    // Accepted; give a wrongly served request time to reach upstream and answer.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        upstream.stats().tcp_connections,
        upstream_before,
        "served beyond --max-connections"
    );
    waiting.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 16];
    match waiting.read(&mut buf) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the waiting client got {other:?} while the slot was taken"),
    }
    waiting.set_nonblocking(false).expect("blocking");

    drop(watch);
    waiting.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let response =
        String::from_utf8(read_until_closed(&mut waiting, "the waiting client")).expect("UTF-8");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"user\":\"alice\""), "{response}");
}

/// A watch with no bytes either way is closed after `--idle-timeout` (the close, then the
/// reason in the proxy's log), not left holding a slot.
#[cfg(feature = "pkcs11")]
#[test]
fn a_quiet_connection_is_closed_after_the_idle_timeout() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--idle-timeout".into(), "1500ms".into()],
            envs: vec![("HWKEY_LOG".into(), "debug".into())],
            ..Default::default()
        },
    );
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);
    read_until_closed(&mut watch.reader, "a quiet watch");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !proxy.log().contains("idle timeout") {
        assert!(
            Instant::now() < deadline,
            "closed, but not for the idle timeout:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Idle admin connections are closed by the proxy (header timeout), not held forever.
#[test]
fn idle_admin_connections_are_reaped() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let mut idle = TcpStream::connect(("127.0.0.1", proxy.admin_port)).expect("connect");
    idle.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let n = idle.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "expected the proxy to close the idle connection");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(proxy.admin_get("/healthz").0, 200);
}

/// Issue 22, finding 15: the control socket had no connection cap and no idle timeout (350 idle
/// connections held 350 descriptors for as long as they stayed). Now at most 64 are open at
/// once, idle ones are closed after 5 s, and the exec plugin's request is answered again once
/// they are gone.
#[test]
fn idle_control_connections_are_capped_and_reaped() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let pid = proxy.guard.id();
    let baseline = fd_count(pid);
    let held: Vec<std::os::unix::net::UnixStream> = (0..350)
        .filter_map(|_| std::os::unix::net::UnixStream::connect(proxy.control_socket()).ok())
        .collect();
    assert!(held.len() >= 300, "connected {}", held.len());
    std::thread::sleep(Duration::from_secs(1));
    let during = fd_count(pid);
    assert!(
        during < baseline + 80,
        "descriptors with 350 idle control connections: {during} (baseline {baseline})"
    );
    // Idle ones are closed by the proxy.
    let deadline = Instant::now() + Duration::from_secs(15);
    while fd_count(pid) > baseline + 4 {
        assert!(
            Instant::now() < deadline,
            "idle control connections not reaped: {} (baseline {baseline})",
            fd_count(pid)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(held);
    let cred = proxy.credential();
    assert!(cred["clientCertificatePem"].is_string());
}

/// Connection churn with abortive closes: 200 loopback TLS clients send a request and reset the
/// connection (SO_LINGER 0) mid-answer; the proxy's descriptors return to their baseline and it
/// keeps serving.
#[test]
fn abortive_closes_leave_no_descriptors_behind() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let pid = proxy.guard.id();
    let config = loopback_client(&proxy.credential());
    assert_eq!(loopback_get(&config, proxy.tcp_port).0, "200");
    let baseline = fd_count(pid);
    for _ in 0..200 {
        let mut conn = rustls::ClientConnection::new(
            config.clone(),
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
        )
        .expect("client");
        let mut tcp = TcpStream::connect(("127.0.0.1", proxy.tcp_port)).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(10))).ok();
        {
            let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
            let _ = tls.write_all(b"GET /bytes?n=1000000 HTTP/1.1\r\nHost: localhost\r\n\r\n");
            let mut first = [0u8; 1024];
            let _ = tls.read(&mut first);
        }
        rustix::net::sockopt::set_socket_linger(&tcp, Some(Duration::ZERO)).expect("SO_LINGER");
        drop(tcp);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while fd_count(pid) > baseline + 4 {
        assert!(
            Instant::now() < deadline,
            "descriptors: {} (baseline {baseline})\n{}",
            fd_count(pid),
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(loopback_get(&config, proxy.tcp_port).0, "200");
}
