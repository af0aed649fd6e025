//! What a new connection costs the proxy in system calls, counted by kind with strace (a count,
//! not a clock): the calls a connection can do without are gone, each named by what it was.
//! One connection at a time, each with one request, with a pause between them so that no
//! call serves two connections. And where a client's first bytes, sent with the proxy's
//! `Finished` to save a write, may not go.

use std::collections::HashMap;
use std::time::Duration;

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::strace::Strace;

/// The relay loops' threads (`hwkey-proxy-relay`, as the kernel keeps 15 characters of it).
const RELAY_THREAD: &str = "hwkey-proxy-rel";
use support::upstream::TestUpstream;

/// The calls counted: every kind a connection makes, so a new one shows in the failure message.
const CALLS: &str =
    "epoll_ctl,epoll_wait,epoll_pwait,epoll_pwait2,ioctl,fcntl,accept4,socket,connect,\
getsockopt,setsockopt,getrandom,read,write,writev,sendto,sendmsg,recvfrom,recvmsg,shutdown,close,\
futex";

/// One `GET /version` on `conn`, answered.
fn ask<S: std::io::Read + std::io::Write>(proxy: &ProxyProcess, mut conn: RawHttp<S>) {
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\nUser-Agent: a-test/1.0\r\n\r\n");
    let (status, _) = conn.read_response();
    assert_eq!(status, 200, "{}", proxy.log());
}

/// Calls and failed calls per connection over `n` connections made by `one`, after two that
/// warm the proxy (the first one's full upstream handshake, the session ticket it leaves):
/// keyed by (thread name, call), and summed over the threads by call. By thread, because a
/// read that finds nothing means something else on a relay loop (a read before readiness) than
/// on a connection thread (a client whose bytes had not come yet).
#[allow(clippy::type_complexity)]
fn per_connection(
    proxy: &ProxyProcess,
    n: u32,
    one: impl Fn(),
) -> (
    HashMap<(String, String), (f64, f64)>,
    HashMap<String, (f64, f64)>,
) {
    one();
    one();
    let strace = Strace::attach_calls(proxy.guard.id(), CALLS);
    for _ in 0..n {
        one();
        std::thread::sleep(Duration::from_millis(5));
    }
    let each = |v: u64| v as f64 / f64::from(n);
    let by_thread: HashMap<(String, String), (f64, f64)> = strace
        .stop_by_thread_failed()
        .into_iter()
        .map(|(k, (calls, failed))| (k, (each(calls), each(failed))))
        .collect();
    let mut totals: HashMap<String, (f64, f64)> = HashMap::new();
    for ((_, call), (calls, failed)) in &by_thread {
        let t = totals.entry(call.clone()).or_insert((0.0, 0.0));
        t.0 += calls;
        t.1 += failed;
    }
    (by_thread, totals)
}

fn calls(counts: &HashMap<String, (f64, f64)>, call: &str) -> f64 {
    counts.get(call).map_or(0.0, |c| c.0)
}

/// Calls per connection by threads other than the relay loops.
fn off_the_loops(by_thread: &HashMap<(String, String), (f64, f64)>) -> f64 {
    by_thread
        .iter()
        .filter(|((thread, _), _)| thread != RELAY_THREAD)
        .map(|(_, (calls, _))| calls)
        .sum()
}

/// Failed calls of `call` per connection by the threads named `thread`.
fn failed_on(by_thread: &HashMap<(String, String), (f64, f64)>, thread: &str, call: &str) -> f64 {
    by_thread
        .get(&(thread.to_string(), call.to_string()))
        .map_or(0.0, |c| c.1)
}

/// Issue 55: a new UNIX-socket connection with one request, as a client that connects for each
/// request makes it, costs the proxy (per connection, on 261f1eb → d29cfef → now):
/// - `epoll_ctl` 8 → 4 → 2: the accept loop's runtime registered the accepted socket and took
///   it out again to hand it to a connection thread (2), and the connection thread registered
///   the client's socket, though its first read had the request, and took it out again for
///   the relay loop (2); then the upstream's registration on the connection thread and its
///   removal (2). Now the relay loop that accepts the connection opens it
///   (`proxy::relay_loop`'s `opening`): each socket is registered once, on that loop, and
///   leaves its epoll when it closes;
/// - every call is the relay loops': no connection thread and no accept loop makes one (on
///   d29cfef the connection thread made the upstream's connect and handshake, and the accept
///   loop's thread accepted);
/// - `ioctl` 1 → 0: the connection thread set the socket non-blocking, which `accept4` had
///   made it already;
/// - `writev` 4 → 3: the proxy's `Finished` and the client's request went upstream in two
///   writes; they go in one now, after the ClientHello and before the `close_notify`.
///
/// A read of the client that finds nothing is allowed once per connection: the loop reads a
/// connection at once when it accepts it (the request usually came with the connect), and
/// registers it only when the request has not come yet.
///
/// Counted without connections made ahead (`--no-preconnect`): a spare is made on a
/// connection thread, and its handshake has no request to send with its `Finished`.
#[test]
fn a_new_unix_connection_makes_no_system_call_it_can_do_without() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    let (by_thread, counts) = per_connection(&proxy, 40, || {
        ask(&proxy, RawHttp::connect(&proxy.socket));
    });
    let all = format!("per connection (calls, failed): {counts:?}; by thread: {by_thread:?}");
    let elsewhere = off_the_loops(&by_thread);
    // A few stray wake-ups of a runtime (a timer) are allowed: on d29cfef the connection
    // threads made about 20 calls per connection.
    assert!(
        elsewhere <= 0.25,
        "{elsewhere} calls per connection by threads other than the relay loops: the \
         connection is not accepted, opened and relayed on one loop; {all}"
    );
    assert!(
        failed_on(&by_thread, RELAY_THREAD, "accept4") <= 0.1,
        "{} accepts per connection found nothing: a wake-up accepts one connection, the \
         listener reports the rest; {all}",
        failed_on(&by_thread, RELAY_THREAD, "accept4")
    );
    assert!(
        calls(&counts, "accept4") >= 1.0,
        "the relay loops accepted {} per connection; {all}",
        calls(&counts, "accept4")
    );
    assert!(
        calls(&counts, "epoll_ctl") <= 2.5,
        "epoll_ctl {} per connection, 2 expected (4 when a connection thread connected \
         upstream, 8 when the accept loop registered each accepted socket too); {all}",
        calls(&counts, "epoll_ctl")
    );
    assert!(
        calls(&counts, "ioctl") == 0.0,
        "ioctl {} per connection: an accepted socket is non-blocking already; {all}",
        calls(&counts, "ioctl")
    );
    assert!(
        calls(&counts, "writev") <= 3.5,
        "writev {} per connection, 3 expected (ClientHello, Finished with the request, \
         close_notify); 4 when the request went upstream after the Finished; {all}",
        calls(&counts, "writev")
    );
    assert!(
        failed_on(&by_thread, RELAY_THREAD, "recvfrom") <= 1.0,
        "{} reads per connection by the relay loops found nothing: more than the first read \
         of a client whose request had not come yet; {all}",
        failed_on(&by_thread, RELAY_THREAD, "recvfrom")
    );
}

/// Issue 55: with connections made ahead (the default), a UNIX-socket client that connects for
/// each request is still served by the relay loops alone: the spare each client takes was
/// made on a loop (its connect, its resumed handshake and the ticket its API server sends
/// back), kept in no runtime, and taken by the next client's loop as it is. On 950a097 each
/// spare was made on a connection thread (woken for it, its socket registered with that
/// thread's runtime and taken out again for the loop): about 20 calls per connection there.
#[test]
fn a_new_unix_connection_that_takes_a_spare_makes_no_call_off_the_relay_loops() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let used = || proxy.metric("hwkey_upstream_spares_total{event=\"used\"}");
    let before = used();
    let (by_thread, counts) = per_connection(&proxy, 40, || {
        ask(&proxy, RawHttp::connect(&proxy.socket));
    });
    let all = format!("per connection (calls, failed): {counts:?}; by thread: {by_thread:?}");
    let taken = used() - before;
    assert!(
        taken >= 30.0,
        "{taken} of 42 clients took a spare: the clients did not come in a burst, or no \
         spare was made; {all}\n{}",
        proxy.log()
    );
    let elsewhere = off_the_loops(&by_thread);
    assert!(
        elsewhere <= 0.25,
        "{elsewhere} calls per connection by threads other than the relay loops: the spares \
         are not made on the loops; {all}"
    );
    assert!(
        calls(&counts, "connect") <= 1.0,
        "{} upstream connects per connection, 1 expected (the next client's spare): 2 when a \
         client made its own beside the spare it found; {all}",
        calls(&counts, "connect")
    );
    // Each spare's socket: registered once while its loop makes it, out again to be kept,
    // in again on the loop that takes it; the client's once.
    assert!(
        calls(&counts, "epoll_ctl") <= 4.5,
        "epoll_ctl {} per connection, 4 expected; {all}",
        calls(&counts, "epoll_ctl")
    );
}

/// Issue 55: a new loopback TLS connection (kubectl's) costs the proxy (per connection, on
/// 261f1eb → now):
/// - `epoll_ctl` 8 → 6: the accept loop's runtime registered each accepted socket and took it
///   out again. Its socket is registered once, on the connection thread, for the loopback
///   handshake;
/// - `writev` 6 → 5: a request that came with the client's `Finished` (rustls had opened it
///   during the loopback handshake) went upstream in a write of its own after the proxy's
///   `Finished`; it goes with it now;
/// - `setsockopt` 7 → 6: `TCP_NODELAY` was set on each accepted socket; it inherits it from the
///   listener now. Left: the upstream socket's five (`TCP_NODELAY` and keep-alive) and the
///   netlink socket's receive timeout (the peer's uid);
/// - failed `recvfrom` 0.93 → 0: the relay loop read the client once for `EAGAIN` as it took the
///   connection over.
#[test]
fn a_new_loopback_connection_makes_no_system_call_it_can_do_without() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let (by_thread, counts) = per_connection(&proxy, 40, || {
        ask(&proxy, RawHttp::connect_tls(proxy.tcp_port, &config));
    });
    let all = format!("per connection (calls, failed): {counts:?}; by thread: {by_thread:?}");
    assert!(
        calls(&counts, "epoll_ctl") <= 6.5,
        "epoll_ctl {} per connection, 6 expected (8 when the accept loop registered each \
         accepted socket); {all}",
        calls(&counts, "epoll_ctl")
    );
    assert!(
        calls(&counts, "writev") <= 5.5,
        "writev {} per connection, 5 expected; 6 when the request that came with the client's \
         Finished went upstream after the proxy's; {all}",
        calls(&counts, "writev")
    );
    assert!(
        calls(&counts, "setsockopt") <= 6.0,
        "setsockopt {} per connection, 6 expected; 7 when each accepted socket was given \
         TCP_NODELAY of its own; {all}",
        calls(&counts, "setsockopt")
    );
    // The connection thread's handshake reads wait for the client's flights through the
    // runtime: one that finds nothing there is the client's pace, not the proxy's.
    assert!(
        failed_on(&by_thread, RELAY_THREAD, "recvfrom") <= 0.2,
        "{} reads per connection by the relay loops found nothing; {all}",
        failed_on(&by_thread, RELAY_THREAD, "recvfrom")
    );
}

/// Issue 55: a client's first bytes go with the proxy's `Finished`, before the proxy checks the
/// protocol the API server chose; HTTP/2 bytes do so only for an API server that has agreed to
/// `h2` before. Against one that does not do ALPN at all (`openssl s_server -www`), an HTTP/2
/// client gets its 502 and the server gets nothing of the client's: the relay between them
/// sees the proxy send its `Finished` alone, one record. Sending them early regardless would
/// hand a server that then speaks HTTP/1.1 (or a balancer that takes HTTP/2 without agreeing
/// to it) a request the client is told failed, and would send again.
#[test]
fn an_http2_clients_bytes_reach_only_an_api_server_that_agreed_to_http2() {
    let id = Identity::softhsm();
    let (cert, key) = id.ca.server_cert(id.dir.path());
    let server = support::servers::OpensslServer::start(
        &id.ca.ca_path(),
        &cert,
        &key,
        support::servers::TlsVersion::Tls13,
    );
    let relay = support::relay::FreezableRelay::start(server.port());
    // Nothing made ahead: the relay's counts are the clients' connections alone (a spare made
    // after the second client could reach the relay after the count below).
    let proxy = ProxyProcess::start_to(
        &id,
        &format!("https://127.0.0.1:{}", relay.port),
        ProxyOptions::args(&["--no-preconnect"]),
    );
    // Two HTTP/1.1 requests: the full handshake, then a ticket to resume with.
    for _ in 0..2 {
        let out = proxy.curl_unix(&["--http1.1", "-i"], "/");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(text.starts_with("HTTP/1.0 200"), "{text}\n{}", proxy.log());
    }
    let (records, connections) = relay.settled();
    let out = proxy.curl_unix(&["--http2-prior-knowledge", "-i"], "/version");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("502") && text.contains("h2"),
        "an HTTP/2 client of a server without HTTP/2 is told why: {text}\n{}",
        proxy.log()
    );
    let (after, connections_after) = relay.settled();
    assert_eq!(
        connections_after - connections,
        1,
        "one upstream connection"
    );
    assert_eq!(
        after - records,
        1,
        "the proxy sent {} records to a server that did not agree to h2: more than its \
         Finished means the client's HTTP/2 bytes went too",
        after - records
    );
}

/// A relayed connection ends on its relay loop, which wakes no other thread for it: the loop
/// gives the connection's slot back, counts its bytes and watches its idle timeout itself, and
/// the connection's task ended at the hand-off. On 396926e the loop woke the task to end each
/// connection: one eventfd `write` by a relay loop per connection (and the connection thread
/// waking for it), for a UNIX-socket client and a loopback TLS one alike. Counted per thread
/// with strace, one connection at a time; the loops send with `writev` (a UNIX client's
/// upstream, through rustls's buffered session) or `sendto` (a loopback TLS client's records,
/// sealed in the loop's buffer), which shows that they relayed every connection.
///
/// The UNIX half is counted without connections made ahead (`--no-preconnect`): a UNIX
/// client's connection is opened on the loop that accepted it, and after it the loop starts
/// the next client's spare on a connection thread, one wake-up of that thread per connection.
/// The loopback half runs on a proxy as users run it (its spares are made on the connection
/// threads, which wakes no loop).
#[test]
fn a_relayed_connection_ends_without_waking_another_thread() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let plain = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let unix = || ask(&plain, RawHttp::connect(&plain.socket));
    let tls = || ask(&proxy, RawHttp::connect_tls(proxy.tcp_port, &config));
    for (kind, one, pid) in [
        ("UNIX", &unix as &dyn Fn(), plain.guard.id()),
        ("loopback TLS", &tls, proxy.guard.id()),
    ] {
        one();
        one();
        let n: u32 = 40;
        let strace = Strace::attach_calls(pid, "write,writev,sendto");
        for _ in 0..n {
            one();
            std::thread::sleep(Duration::from_millis(5));
        }
        let by_thread = strace.stop_by_thread();
        let by_loops = |call: &str| {
            by_thread
                .get(&(RELAY_THREAD.to_string(), call.to_string()))
                .copied()
                .unwrap_or(0)
        };
        let sends = by_loops("writev") + by_loops("sendto");
        assert!(
            sends >= u64::from(n),
            "{kind}: the relay loops made {sends} writevs and sendtos for {n} connections: they \
             did not relay them all, so their writes prove nothing; by thread: {by_thread:?}",
        );
        assert!(
            by_loops("write") as f64 / f64::from(n) <= 0.1,
            "{kind}: the relay loops made {} writes for {n} connections: one per connection \
             is the wake-up of the connection's task at its end; by thread: {by_thread:?}",
            by_loops("write")
        );
    }
}

/// Issue 55: a UNIX client's connection opened on a relay loop whose API server stops
/// answering (it accepts, then hangs, as one whose process is stuck) is told why after one
/// handshake timeout: the loop's attempt is the one attempt that API server gets for this
/// client, counted once, and the client gets the 502 naming the timeout from a connection
/// thread. A loop that handed the client on for a second attempt would count two timeouts.
#[test]
fn a_loops_attempt_on_a_hung_api_server_costs_its_client_one_timeout() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let relay = support::relay::FreezableRelay::start(upstream.port());
    let proxy = ProxyProcess::start_to(
        &id,
        &format!("https://127.0.0.1:{}", relay.port),
        ProxyOptions::args(&["--no-preconnect", "--handshake-timeout", "1s"]),
    );
    for _ in 0..3 {
        ask(&proxy, RawHttp::connect(&proxy.socket));
    }
    let on_loop = "hwkey_unix_connections_opened_total{on=\"relay_loop\"}";
    assert!(
        proxy.metric(on_loop) >= 2.0,
        "the resumed connections were not opened on the loops: the loops' path is not what is \
         tested\n{}",
        proxy.metrics()
    );
    relay.freeze();
    let mut conn = RawHttp::connect(&proxy.socket);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (status, body) = conn.read_response();
    assert_eq!(status, 502, "{body}\n{}", proxy.log());
    assert!(
        body.contains("did not complete a handshake within"),
        "the client is told why: {body}"
    );
    assert_eq!(
        proxy.metric("hwkey_upstream_errors_total{stage=\"timeout\"}"),
        1.0,
        "{}",
        proxy.metrics()
    );
}

/// Issue 55: a UNIX client's first bytes decide the protocol its upstream connection is
/// offered, and the relay loop that accepted it reads them now. A client whose first byte is
/// all that has come (`P`, which the HTTP/2 preface starts with too) is waited for, not
/// decided on: its `POST` that follows goes upstream whole, as HTTP/1.1, its body echoed back.
/// And a request that comes long after the connect (the loop read nothing at first, and
/// waits for it) is served as well. The HTTP/2 preface in two pieces is waited for whole
/// too: the upstream connection is offered `h2` (a loop that decided on the first piece would
/// offer HTTP/1.1).
#[test]
fn a_unix_clients_first_bytes_in_pieces_reach_the_api_server_whole() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    for _ in 0..2 {
        ask(&proxy, RawHttp::connect(&proxy.socket));
    }
    let mut conn = RawHttp::connect(&proxy.socket);
    std::thread::sleep(Duration::from_millis(50));
    conn.send("P");
    std::thread::sleep(Duration::from_millis(50));
    conn.send("OST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello");
    let (status, body) = conn.read_response();
    assert_eq!(status, 200, "{body}\n{}", proxy.log());
    assert_eq!(body, "hello");
    assert!(
        proxy.metric("hwkey_unix_connections_opened_total{on=\"relay_loop\"}") >= 2.0,
        "{}",
        proxy.metrics()
    );
    let h2 = upstream.stats().with_protocol("h2");
    let mut conn = RawHttp::connect(&proxy.socket);
    conn.send("PRI * HTTP/2.0\r\n");
    std::thread::sleep(Duration::from_millis(50));
    conn.send("\r\nSM\r\n\r\n");
    // The upstream records a connection once its handshake is done.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while upstream.stats().with_protocol("h2") == h2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no h2 connection upstream for a client whose preface came in two pieces: {:?}\n{}",
            upstream.stats(),
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Two UNIX sockets (`--listen unix:` twice, a user's and a service's): the relay loops accept
/// on both, and every client of either is served, its connection opened on a loop. When the
/// loops took one socket per loop-side slot, the second replaced the first, whose descriptor
/// was then closed: its clients were refused while the proxy said it listened.
#[test]
fn clients_of_two_unix_sockets_are_all_served() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let second = id.dir.path().join("second.sock");
    let listen = format!("unix:{}", second.display());
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--listen", &listen, "--no-preconnect"]),
    );
    for _ in 0..4 {
        ask(&proxy, RawHttp::connect(&proxy.socket));
        ask(&proxy, RawHttp::connect(&second));
    }
    let on_loop = proxy.metric("hwkey_unix_connections_opened_total{on=\"relay_loop\"}");
    assert!(
        on_loop >= 6.0,
        "{on_loop} of 8 connections opened on a relay loop\n{}",
        proxy.metrics()
    );
}
