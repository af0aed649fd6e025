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

/// The connection threads (`hwkey-proxy-conn`, as the kernel keeps 15 characters of it).
const CONNECTION_THREAD: &str = "hwkey-proxy-con";

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

/// Failed calls of `call` per connection by the threads named `thread`.
fn failed_on(by_thread: &HashMap<(String, String), (f64, f64)>, thread: &str, call: &str) -> f64 {
    by_thread
        .get(&(thread.to_string(), call.to_string()))
        .map_or(0.0, |c| c.1)
}

/// Issue 55: a new UNIX-socket connection with one request, as a client that connects for each
/// request makes it, costs the proxy (per connection, on 261f1eb → now):
/// - `epoll_ctl` 8 → 4: the accept loop's runtime registered the accepted socket and took it
///   out again to hand it to a connection thread (2), and the connection thread registered the
///   client's socket, though its first read had the request, and took it out again for the
///   relay loop (2). Left: the upstream's registration on the connection thread and its
///   removal, and the relay loop's two;
/// - `ioctl` 1 → 0: the connection thread set the socket non-blocking, which `accept4` had
///   made it already;
/// - `writev` 4 → 3: the proxy's `Finished` and the client's request went upstream in two
///   writes; they go in one now, after the ClientHello and before the `close_notify`;
/// - failed `recvfrom` 1 → 0: the relay loop read the client once for `EAGAIN` as it took the
///   connection over, though the first read had drained the socket.
///
/// A request that comes after the connection thread's first read (the client descheduled
/// between its connect and its write) costs that connection a registration of the client's
/// socket (2 `epoll_ctl`): allowed, as counted by the connection threads' failed reads.
///
/// Counted without connections made ahead (`--no-preconnect`): a spare's handshake has no
/// request to send with its `Finished` (one `writev` more per connection, made before the
/// client comes, for the two round trips it saves it).
#[test]
fn a_new_unix_connection_makes_no_system_call_it_can_do_without() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    let (by_thread, counts) = per_connection(&proxy, 40, || {
        ask(&proxy, RawHttp::connect(&proxy.socket));
    });
    let all = format!("per connection (calls, failed): {counts:?}; by thread: {by_thread:?}");
    // A request that was not there yet when the connection thread first read the client (the
    // test's client is descheduled between its connect and its write, as on a busy CI
    // machine): that connection waits for it through the runtime, which registers the client's
    // socket and takes it out again (2 epoll_ctl). Counted by the failed first reads.
    let late = failed_on(&by_thread, CONNECTION_THREAD, "recvfrom");
    assert!(
        late <= 0.75,
        "the request came after the proxy's first read on {late} of each connection: the \
         count below proves little; {all}"
    );
    assert!(
        calls(&counts, "epoll_ctl") <= 4.5 + 2.0 * late,
        "epoll_ctl {} per connection, 4 expected, 2 more for each of the {late} whose request \
         came late (8 when each accepted socket was registered twice on its way to the relay \
         loop); {all}",
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
        failed_on(&by_thread, RELAY_THREAD, "recvfrom") <= 0.2,
        "{} reads per connection by the relay loops found nothing: the relay loop reads a \
         client it was handed before a readiness says there is something; {all}",
        failed_on(&by_thread, RELAY_THREAD, "recvfrom")
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
#[test]
fn a_relayed_connection_ends_without_waking_another_thread() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let unix = || ask(&proxy, RawHttp::connect(&proxy.socket));
    let tls = || ask(&proxy, RawHttp::connect_tls(proxy.tcp_port, &config));
    for (kind, one) in [("UNIX", &unix as &dyn Fn()), ("loopback TLS", &tls)] {
        one();
        one();
        let n: u32 = 40;
        let strace = Strace::attach_calls(proxy.guard.id(), "write,writev,sendto");
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
