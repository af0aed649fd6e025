//! What a connection costs the proxy, counted rather than timed: copy buffers held by idle
//! connections and taken from the pool instead of allocated, thread wake-ups per keep-alive
//! request (strace), and the memory of an idle connection.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::time::{Duration, Instant};

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::*;

proxy_tests_on_both_backends!(idle_connections_hold_no_copy_buffers);

/// One keep-alive `GET /version` on each of `conns`, all sent before any answer is read.
fn request_on_each<S: std::io::Read + std::io::Write>(
    proxy: &ProxyProcess,
    conns: &mut [RawHttp<S>],
) {
    for c in conns.iter_mut() {
        c.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    }
    for c in conns.iter_mut() {
        let (status, _) = c.read_response();
        assert_eq!(status, 200, "{}", proxy.log());
    }
}

/// Downloads `size` bytes (`GET /bytes`) on `conn`, reading every byte.
fn download(proxy: &ProxyProcess, conn: &mut RawHttp, size: u64) {
    conn.send(&format!(
        "GET /bytes?n={size} HTTP/1.1\r\nHost: localhost\r\n\r\n"
    ));
    download_rest(proxy, conn, size);
}

/// Proxy RSS added per connection, in KiB, with the two readings: `warm` connections made by
/// `open` first (the allocator's growth), then `more`, each reading taken once every
/// connection is open and holds no copy buffer.
fn rss_per_connection<C>(
    proxy: &ProxyProcess,
    open: impl Fn(usize) -> Vec<C>,
    warm: usize,
    more: usize,
) -> (f64, u64, u64) {
    let rss = || rss_kib(proxy.guard.id());
    let _warm = open(warm);
    proxy.wait_for_metric("hwkey_connections_active", warm as f64);
    wait_until_no_copy_buffers(proxy);
    let before = rss();
    let _more = open(more);
    proxy.wait_for_metric("hwkey_connections_active", (warm + more) as f64);
    wait_until_no_copy_buffers(proxy);
    let after = rss();
    assert_eq!(
        proxy.metric("hwkey_connections_active"),
        (warm + more) as f64
    );
    let per = after.saturating_sub(before) as f64 / more as f64;
    (per, before, after)
}

/// Waits (at most 10 s) until the proxy's connections hold no copy buffer.
fn wait_until_no_copy_buffers(proxy: &ProxyProcess) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric("hwkey_copy_buffers") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "idle connections still hold {} copy buffers",
            proxy.metric("hwkey_copy_buffers")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Idle streams hold no copy buffers (issue 12): with 20 watches open through the proxy and
/// waiting for events, `hwkey_copy_buffers` is 0. A download whose client stops reading keeps
/// its bytes in flight, so the gauge does rise: it counts what it says.
fn idle_connections_hold_no_copy_buffers(identity: fn() -> Identity) {
    let id = identity();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let watches: Vec<RawHttp> = (0..20)
        .map(|_| {
            let mut w = RawHttp::connect(&proxy.socket);
            w.send("GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n");
            let (status, _) = w.read_head();
            assert_eq!(status, 200, "{}", proxy.log());
            w
        })
        .collect();
    assert_eq!(proxy.metric("hwkey_connections_active"), 20.0);
    wait_until_no_copy_buffers(&proxy);

    // A client that asks for 64 MiB and reads nothing: the proxy holds the bytes it could not
    // write yet.
    let mut stalled = RawHttp::connect(&proxy.socket);
    stalled.send("GET /bytes?n=67108864 HTTP/1.1\r\nHost: localhost\r\n\r\n");
    proxy.wait_for_metric("hwkey_copy_buffers", 1.0);
    drop(stalled);
    drop(watches);
}

/// Issue 27: a keep-alive request allocates no buffer. Each request takes a copy buffer in
/// each direction and a read-ahead buffer for the upstream's answer, and gives them back once
/// answered; they used to be allocated (and zero-filled: 11.5 % of the proxy's CPU on small
/// requests) every time, about three per request. Now they come back from the thread's pool:
/// 2,000 requests on 8 connections allocate at most what fills each worker thread's pool once
/// (3 sizes × 4 buffers), however many requests follow; and idle, the connections hold none.
#[cfg(feature = "pkcs11")]
#[test]
fn keep_alive_requests_reuse_pooled_buffers_instead_of_allocating() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let request = "GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let mut conns: Vec<RawHttp> = (0..8).map(|_| RawHttp::connect(&proxy.socket)).collect();
    let ask = |c: &mut RawHttp| {
        c.send(request);
        let (status, _) = c.read_response();
        assert_eq!(status, 200, "{}", proxy.log());
    };
    // Each connection's upstream handshake and first request.
    for c in conns.iter_mut() {
        ask(c);
    }
    let allocations = "hwkey_copy_buffer_allocations_total";
    let before = proxy.metric(allocations);
    for i in 0..2000 {
        ask(&mut conns[i % 8]);
    }
    let allocated = proxy.metric(allocations) - before;
    let workers = std::fs::read_dir(format!("/proc/{}/task", proxy.guard.id()))
        .expect("the proxy's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("hwkey-proxy"))
        .count();
    assert!(workers >= 2, "no worker threads found");
    let bound = (3 * hwkey::proxy::buffers::KEPT_PER_SIZE * workers) as f64;
    assert!(
        allocated <= bound,
        "2,000 keep-alive requests allocated {allocated} buffers (at most {bound}: each of {workers} worker threads fills its pool once)"
    );
    wait_until_no_copy_buffers(&proxy);
}

/// Issue 27: a keep-alive request wakes no other thread of the proxy. On one multi-thread
/// runtime, the worker that saw several connections' requests at once woke a parked worker to
/// steal some (a futex wake-up: 0.36 per request in the 8-connection benchmark, ~2 µs each on
/// this virtual machine). Each connection now lives on one single-worker runtime
/// (`proxy::threads`), which has no other worker to wake: 2,000 requests on 8 connections, 8
/// in flight at a time, make (almost) no futex call. Counted with strace on every thread of
/// the proxy: a count, not a clock.
#[cfg(feature = "pkcs11")]
#[test]
fn keep_alive_requests_wake_no_other_proxy_thread() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let mut conns: Vec<RawHttp> = (0..8).map(|_| RawHttp::connect(&proxy.socket)).collect();
    let round = |conns: &mut Vec<RawHttp>| request_on_each(&proxy, conns);
    round(&mut conns); // the upstream handshakes
    let strace = support::strace::Strace::attach(proxy.guard.id(), "futex");
    for _ in 0..250 {
        round(&mut conns);
    }
    let futex = strace.stop();
    assert!(
        futex <= 20,
        "2,000 keep-alive requests made {futex} futex calls in the proxy (a thread waking another; at most 20 expected)"
    );
}

/// Issue 38: a client reading its response does not wake the proxy. tokio registers every
/// socket for writability too (edge-triggered), and the kernel signals a UNIX stream socket
/// writable each time its peer reads from it, so each response a UNIX-socket client read
/// signalled the connection's runtime once more, for an event nobody waited for, and woke it
/// when it slept between requests. The client's socket is
/// now registered for reading only, and for writing only while a write waits for room
/// (`proxy::unix_client`). Counted with strace: one connection, 200 requests, the client
/// pausing after each response so that every wake-up is an `epoll_wait` of its own. A request
/// needs two (the client's request, the upstream's answer); the old registration made three.
#[cfg(feature = "pkcs11")]
#[test]
fn a_client_reading_its_response_does_not_wake_the_proxy() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let mut conn = RawHttp::connect(&proxy.socket);
    let mut ask = || {
        conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
        let (status, _) = conn.read_response();
        assert_eq!(status, 200, "{}", proxy.log());
    };
    ask(); // the upstream handshake
    let requests = 200;
    // Whichever the C library calls: glibc on aarch64 and musl wait with epoll_pwait.
    let strace =
        support::strace::Strace::attach(proxy.guard.id(), "epoll_wait,epoll_pwait,epoll_pwait2");
    for _ in 0..requests {
        ask();
        std::thread::sleep(Duration::from_millis(2));
    }
    let waits = strace.stop();
    let per_request = waits as f64 / requests as f64;
    assert!(
        (1.5..=2.3).contains(&per_request),
        "{waits} epoll_wait calls for {requests} requests ({per_request:.2} each): 2 expected (the request, the answer), 3 when the client's reads wake the proxy"
    );
}

/// What an idle connection costs the proxy (issue 12: ≤ 16 KiB each beyond the kernel's
/// buffers, 1,000 of them in ≤ 32 MiB). After 100 connections have warmed the allocator, 500 more
/// keep-alive connections, each after one request and so with its upstream TLS connection open,
/// may add at most 11 KiB of RSS apiece (10.4 KiB in this test's debug build). It was 13.8–14.3
/// KiB before the upstream TLS stream and the handshake futures were boxed, and 12.0 KiB while a
/// connection moved to a relay loop kept the emptied box of its TLS stream and its task kept the
/// certificate-retirement future twice (docs/BENCHMARKS.md).
#[cfg(feature = "pkcs11")]
#[test]
fn an_idle_connection_costs_the_proxy_at_most_11_kib() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let open = |n: usize| -> Vec<RawHttp> {
        (0..n)
            .map(|_| {
                let mut c = RawHttp::connect(&proxy.socket);
                c.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
                let (status, _) = c.read_response();
                assert_eq!(status, 200, "{}", proxy.log());
                c
            })
            .collect()
    };
    let (per, before, after) = rss_per_connection(&proxy, open, 100, 500);
    assert!(
        per <= 11.0,
        "each idle connection added {per:.1} KiB of proxy RSS ({before} → {after} KiB for 500)"
    );
}

/// What an idle loopback TLS connection (kubectl's and kubelet's way in) costs the proxy: after
/// 100 connections have warmed the allocator, 500 more, each after one request and so with its
/// upstream TLS connection open, may add at most 11 KiB of RSS apiece, as a UNIX-socket one. Its
/// two TLS sessions are on rustls's unbuffered API and keep no receive buffer at rest; as
/// buffered sessions they kept 4 KiB each, and a connection added 17–18 KiB here
/// (docs/BENCHMARKS.md, issue 55). The same after a 256 KiB download each: what the download
/// needed was the loop's, not the connection's.
#[cfg(feature = "pkcs11")]
#[test]
fn an_idle_loopback_connection_costs_the_proxy_at_most_11_kib() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    for size in [0u64, 256 * 1024] {
        let open = |n: usize| -> Vec<RawHttp<support::proxy::LoopbackTls>> {
            (0..n)
                .map(|_| {
                    let mut c = RawHttp::connect_tls(proxy.tcp_port, &config);
                    c.send(&format!(
                        "GET /bytes?n={size} HTTP/1.1\r\nHost: localhost\r\n\r\n"
                    ));
                    let (status, _) = c.read_response();
                    assert_eq!(status, 200, "{}", proxy.log());
                    c
                })
                .collect()
        };
        let (per, before, after) = rss_per_connection(&proxy, open, 100, 500);
        assert!(
            per <= 11.0,
            "each idle loopback connection that moved {size} bytes added {per:.1} KiB of proxy \
             RSS ({before} → {after} KiB for 500)"
        );
    }
}

/// A connection made ahead for a loopback client (proxy::spare) costs the proxy no memory once
/// a client has it: the task that made it ends when it is taken. 0bcf4ae's task slept on for
/// the spare's whole life with the connect's state in it: 9.6–10.8 KiB per idle connection
/// opened within that time, against 8.4 with `--no-preconnect`.
#[cfg(feature = "pkcs11")]
#[test]
fn a_connection_made_ahead_costs_no_memory_once_used() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut per = Vec::new();
    for args in [&["--no-preconnect"][..], &[]] {
        let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(args));
        let config = support::proxy::loopback_client_config(&proxy.credential());
        let open = |n: usize| -> Vec<RawHttp<support::proxy::LoopbackTls>> {
            (0..n)
                .map(|_| {
                    let mut c = RawHttp::connect_tls(proxy.tcp_port, &config);
                    c.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
                    assert_eq!(c.read_response().0, 200, "{}", proxy.log());
                    c
                })
                .collect()
        };
        per.push(rss_per_connection(&proxy, open, 100, 400).0);
        if args.is_empty() {
            assert!(
                proxy.metric("hwkey_upstream_spares_total{event=\"used\"}") >= 300.0,
                "the clients used connections made ahead: {}",
                proxy.metrics()
            );
        }
    }
    assert!(
        per[1] <= per[0] + 0.6,
        "an idle loopback connection costs {:.1} KiB with connections made ahead, {:.1} KiB \
         without",
        per[1],
        per[0]
    );
}

/// The network side (the process that relays) copies large buffers with vector loops, not
/// `rep movsb`: its environment carries glibc's tunable, which its dynamic loader read when
/// `hwkey proxy` became `hwkey-net` (docs/BENCHMARKS.md, issue 55 round nine: the copy rustls
/// makes to seal each record ran at half speed on AMD EPYC).
#[cfg(all(feature = "pkcs11", target_arch = "x86_64", target_env = "gnu"))]
#[test]
fn the_network_side_copies_with_vector_loops() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let environ = std::fs::read(format!("/proc/{}/environ", proxy.guard.id())).expect("environ");
    let tunables: Vec<String> = environ
        .split(|b| *b == 0)
        .filter_map(|v| v.strip_prefix(b"GLIBC_TUNABLES="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert_eq!(
        tunables,
        ["glibc.cpu.x86_rep_movsb_threshold=2097152"],
        "the network side's glibc tunables"
    );
}

/// A proxy with `--idle-exit` (every proxy the exec plugin starts: 30 minutes by default) does
/// not wake its main thread, where the idle watch runs, for each connection. Each connection's
/// start and end notified the watch, which woke, saw the proxy busy or not yet idle long
/// enough, and slept again: two cross-thread wake-ups per kubectl connection, for nothing. The
/// watch now sleeps until the earliest moment the proxy could be idle long enough, and looks.
/// Counted as the main thread's voluntary context switches over 60 connections, one request
/// each; on 3f1d951 there were about 2 per connection.
#[cfg(feature = "pkcs11")]
#[test]
fn connections_do_not_wake_the_idle_watch() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        support::proxy::ProxyOptions::args(&["--idle-exit", "10m"]),
    );
    let one = || {
        let mut c = RawHttp::connect(&proxy.socket);
        c.send("GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        let (status, _) = c.read_response();
        assert_eq!(status, 200, "{}", proxy.log());
    };
    one(); // the upstream handshake
    let pid = proxy.guard.id();
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).expect("the proxy's name");
    assert!(name.starts_with("hwkey-net"), "the network side is {name}");
    let main_thread = || switches_of_threads(pid, "hwkey-net");
    let before = main_thread();
    let connections = 60;
    for _ in 0..connections {
        one();
    }
    // Each connection has ended in the proxy too (a connection's end is where it woke).
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.metric("hwkey_connections_active") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "connections stay open in the proxy"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let woken = main_thread() - before;
    assert!(
        woken <= 6,
        "{connections} connections woke the proxy's main thread (the idle watch) {woken} times; it should sleep through them"
    );
}

/// The voluntary context switches of the proxy's threads whose name starts with `prefix`
/// (`/proc/PID/task/*/comm`, at most 15 bytes of the name): how often they went to sleep and
/// were woken.
fn switches_of_threads(pid: u32, prefix: &str) -> u64 {
    switches_by_thread(pid, prefix).into_iter().sum()
}

/// [`switches_of_threads`], one count per thread (in the order `/proc` lists them).
fn switches_by_thread(pid: u32, prefix: &str) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the proxy's threads")
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            if !name.starts_with(prefix) {
                return None;
            }
            std::fs::read_to_string(dir.join("status"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .collect()
}

/// Issue 38: an established UNIX-socket connection is relayed by an event loop of its own
/// (`proxy::relay_loop`), not by its task on a connection runtime: the task sleeps until the
/// connection ends. 250 rounds of a request on each of 8 connections (the client waits for all
/// 8 answers before the next round, so every round the proxy goes idle once) put the relay
/// loops' threads to sleep at least once per round and the connection runtimes' threads
/// (almost) never. Counted by the threads' voluntary context switches, not timed. On the
/// runtime's path (before the loops) the runtimes' threads slept once per round or more, and
/// no relay thread existed.
#[cfg(feature = "pkcs11")]
#[test]
fn keep_alive_requests_on_the_unix_socket_are_relayed_by_the_loops_not_the_runtimes() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let conns: Vec<RawHttp> = (0..8).map(|_| RawHttp::connect(&proxy.socket)).collect();
    relayed_by_the_loops(&proxy, conns);
}

/// Issue 55: so is an established loopback TLS connection (kubectl's and kubelet's), with both
/// of its TLS sessions: 250 rounds of a request on each of 8 loopback TLS connections put the
/// relay loops' threads to sleep at least once per round and the connection runtimes' threads
/// (almost) never. On cf927b3, where loopback TLS connections stayed on their tasks, the loops
/// never slept for them and the runtimes slept once per round or more.
#[cfg(feature = "pkcs11")]
#[test]
fn keep_alive_requests_over_loopback_tls_are_relayed_by_the_loops_not_the_runtimes() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let conns: Vec<_> = (0..8)
        .map(|_| RawHttp::connect_tls(proxy.tcp_port, &config))
        .collect();
    relayed_by_the_loops(&proxy, conns);
}

/// Issue 55: UNIX-socket connections accepted while the proxy is idle are relayed by every
/// relay loop, not one. A loop accepts and opens the connections itself now, and the kernel
/// wakes the first idle loop in its order for each one, so connections made one after
/// another often land on the same loop; once established, one moves to a loop with at least
/// two fewer. Four connections per loop (one loop per core), then 100 rounds of a request on
/// each, wake every relay loop about as often as each other; without the move, half the runs
/// here (two cores) had one loop never woken, or woken 0.37 as often as the other or less.
/// Counted by each relay thread's voluntary context switches, not timed. Needs two cores (two
/// loops), as CI has.
#[cfg(feature = "pkcs11")]
#[test]
fn unix_connections_made_one_after_another_are_relayed_by_every_loop() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--no-preconnect"]));
    let pid = proxy.guard.id();
    let loops = switches_by_thread(pid, "hwkey-proxy-rel").len();
    assert!(
        loops >= 2,
        "the proxy runs {loops} relay loop(s): this test needs two cores"
    );
    let mut conns: Vec<RawHttp> = Vec::new();
    for _ in 0..4 * loops {
        let mut conn = RawHttp::connect(&proxy.socket);
        request_on_each(&proxy, std::slice::from_mut(&mut conn));
        conns.push(conn);
        // Every loop back in its wait before the next connect: the kernel then wakes the same
        // one (its first) each time.
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = switches_by_thread(pid, "hwkey-proxy-rel");
    let rounds: u64 = 100;
    for _ in 0..rounds {
        request_on_each(&proxy, &mut conns);
    }
    let after = switches_by_thread(pid, "hwkey-proxy-rel");
    let woken: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    // Four connections on a loop wake it about as often as another's four (0.9 of it here;
    // three against five after the move, at worst); one loop with seven and the other with
    // one, or none, 0.4 of it or less.
    let (least, most) = (woken.iter().min(), woken.iter().max());
    assert!(
        least
            .zip(most)
            .is_some_and(|(&l, &m)| 2 * l >= m && l >= rounds / 2),
        "relay loops woken {woken:?} times in {rounds} rounds on {} connections: the \
         connections are not shared out among the loops",
        conns.len()
    );
    drop(conns);
}

/// The check of the two tests above: 250 rounds of a request on each of `conns` wake the relay
/// loops' threads at least once per round and the connection runtimes' at most 20 times.
fn relayed_by_the_loops<S: std::io::Read + std::io::Write>(
    proxy: &ProxyProcess,
    mut conns: Vec<RawHttp<S>>,
) {
    let pid = proxy.guard.id();
    let round = |conns: &mut Vec<RawHttp<S>>| request_on_each(proxy, conns);
    round(&mut conns); // the handshakes, on the runtimes
    std::thread::sleep(Duration::from_millis(100));
    let runtimes = switches_of_threads(pid, "hwkey-proxy-con");
    let loops = switches_of_threads(pid, "hwkey-proxy-rel");
    let rounds = 250;
    for _ in 0..rounds {
        round(&mut conns);
    }
    let runtimes = switches_of_threads(pid, "hwkey-proxy-con") - runtimes;
    let loops = switches_of_threads(pid, "hwkey-proxy-rel") - loops;
    assert!(
        loops >= rounds,
        "the relay loops slept {loops} times in {rounds} rounds: the requests did not go through them"
    );
    assert!(
        runtimes <= 20,
        "the connection runtimes' threads were woken {runtimes} times in {rounds} rounds of keep-alive requests (at most 20 expected: the loops relay them)"
    );
    drop(conns);
}

/// Issue 38: a download costs the proxy one write to its UNIX-socket client per read of the
/// upstream (about 64 KiB: four TLS records), not one per record. The relay loop gathers what
/// rustls opens from a read before it writes (`proxy::relay_loop`); writing each record's
/// plaintext as rustls handed it out made four writes per read, each waking the client, and
/// cost 15 % more CPU per GB (docs/BENCHMARKS.md). Counted with strace over a 64 MiB download:
/// the writes to the client (`sendto`: Rust's socket writes pass `MSG_NOSIGNAL`) against the
/// reads of the upstream (`recvfrom`); a write the client's full socket cuts short is finished
/// by one more.
#[cfg(feature = "pkcs11")]
#[test]
fn a_download_is_written_to_the_client_once_per_read_of_the_upstream() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let mut conn = RawHttp::connect(&proxy.socket);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (status, _) = conn.read_response();
    assert_eq!(status, 200, "{}", proxy.log());
    let strace = support::strace::Strace::attach(proxy.guard.id(), "sendto,recvfrom");
    let size: u64 = 64 << 20;
    download(&proxy, &mut conn, size);
    let counts = strace.stop_each();
    let count = |name: &str| {
        counts
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, c)| *c)
    };
    let (writes, reads) = (count("sendto"), count("recvfrom"));
    let records = size / (16 * 1024);
    assert!(
        reads > 0 && reads < records,
        "{reads} reads of the upstream for {records} records: the download was not read in large reads"
    );
    assert!(
        writes <= 2 * reads,
        "{writes} writes to the client for {reads} reads of the upstream ({records} records): at most two per read expected"
    );
}

/// Issue 55: a loopback TLS client's download costs the proxy one write to the client per read
/// of the upstream, as on the UNIX socket. What one read of the upstream brings (about 64 KiB:
/// four records) is opened and sealed again for the client into one buffer and written once
/// (`proxy::relay_loop::loopback`). A guard, not a defect test: the runtime's path this
/// replaced (4ea3478) wrote once per read too (tokio-rustls's `writev` of every record it had),
/// and passes it. The loop made to write one record per call (a mutation tried once, not
/// kept) fails it: 4,117 writes for 1,026 reads. Counted with strace over a 64 MiB download,
/// the calls that moved at least 4 KiB: a write the client's full socket cuts short is
/// finished by one more.
#[cfg(feature = "pkcs11")]
#[test]
fn a_loopback_download_is_written_to_the_client_once_per_read_of_the_upstream() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let mut conn = RawHttp::connect_tls(proxy.tcp_port, &config);
    conn.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (status, _) = conn.read_response();
    assert_eq!(status, 200, "{}", proxy.log());
    // Every way a relay could write or read (4ea3478's loopback path wrote with `writev`).
    let strace = support::strace::Strace::attach_calls(
        proxy.guard.id(),
        "write,writev,sendto,sendmsg,read,readv,recvfrom,recvmsg",
    );
    let size: u64 = 64 << 20;
    conn.send(&format!(
        "GET /bytes?n={size} HTTP/1.1\r\nHost: localhost\r\n\r\n"
    ));
    download_rest(&proxy, &mut conn, size);
    // Calls that moved at least 4 KiB: the download's records, not the request (a few hundred
    // bytes), a wake-up's 8 bytes or a read that found nothing (`EAGAIN`), which would make a
    // loop that reads once more than it writes look as if it wrote half as often.
    let moved = strace.stop_moving_at_least(4096);
    let sum = |calls: &[&str]| -> u64 { calls.iter().filter_map(|c| moved.get(*c)).sum() };
    let writes = sum(&["write", "writev", "sendto", "sendmsg"]);
    let reads = sum(&["read", "readv", "recvfrom", "recvmsg"]);
    let records = size / (16 * 1024);
    assert!(
        reads > 0 && reads < records,
        "{reads} reads for {records} records: the download was not read in large reads"
    );
    assert!(
        writes <= 2 * reads,
        "{writes} writes for {reads} reads ({records} records of the upstream): at most two writes to the client per read of the upstream expected"
    );
    // And the writes were seen at all: a relay writing through a call not traced here
    // would otherwise pass with none.
    assert!(
        2 * writes >= reads,
        "{writes} writes for {reads} reads: the download's writes were not traced (a call missing from the list?)"
    );
}

/// What a connection costs once its download is over: 200 connections that each moved 256 KiB
/// and then went idle may add at most 16 KiB of proxy RSS apiece (12.0–12.4 KiB in this test's
/// debug build, about what an idle connection that moved one response costs). rustls gives the
/// record buffer it grew for a download back only on a read that finds nothing; the relay loop
/// hands it records from memory, and before it asked rustls to settle once the upstream was
/// drained each such connection added 30–34 KiB here (RSS at 1,000 of them: 45 MiB against
/// 23 MiB on the runtime's path; docs/BENCHMARKS.md).
#[cfg(feature = "pkcs11")]
#[test]
fn a_connection_done_with_a_download_costs_no_more_than_an_idle_one() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let size: u64 = 256 * 1024;
    let open = |n: usize| -> Vec<RawHttp> {
        (0..n)
            .map(|_| {
                let mut c = RawHttp::connect(&proxy.socket);
                download(&proxy, &mut c, size);
                c
            })
            .collect()
    };
    let (per, before, after) = rss_per_connection(&proxy, open, 50, 200);
    assert!(
        per <= 16.0,
        "each connection done with a 256 KiB download added {per:.1} KiB of proxy RSS ({before} → {after} KiB for 200)"
    );
}

/// Issue 55: a loopback TLS client that stops reading makes the proxy hold no copy buffer.
/// On a relay loop, what the upstream sent for it waits sealed in the client's own TLS
/// session (one read of the upstream, 64 KiB at most) and nothing more is read for it; on the
/// runtime's path (cf927b3) the relay's copy buffer held the bytes in flight, counted in
/// `hwkey_copy_buffers`, besides the two sessions' own buffers. A 16 MiB download the client
/// does not read for a while: the gauge stays 0 at every look (twenty, over a second, after the
/// transfer has stalled), and once the client reads, every byte arrives.
#[cfg(feature = "pkcs11")]
#[test]
fn a_loopback_client_without_room_makes_the_proxy_hold_no_copy_buffer() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let config = support::proxy::loopback_client_config(&proxy.credential());
    let mut conn = RawHttp::connect_tls(proxy.tcp_port, &config);
    let size: u64 = 16 << 20;
    conn.send(&format!(
        "GET /bytes?n={size} HTTP/1.1\r\nHost: localhost\r\n\r\n"
    ));
    std::thread::sleep(Duration::from_millis(500));
    for look in 0..20 {
        let held = proxy.metric("hwkey_copy_buffers");
        assert_eq!(
            held, 0.0,
            "look {look}: the proxy holds {held} copy buffers for a loopback client without room"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    download_rest(&proxy, &mut conn, size);
}

/// Reads the answer to a `GET /bytes?n=size` already sent on `conn`, every byte.
fn download_rest<S: std::io::Read + std::io::Write>(
    proxy: &ProxyProcess,
    conn: &mut RawHttp<S>,
    size: u64,
) {
    use std::io::Read;
    let (status, _) = conn.read_head();
    assert_eq!(status, 200, "{}", proxy.log());
    let got = std::io::copy(&mut (&mut conn.reader).take(size), &mut std::io::sink())
        .expect("the download");
    assert_eq!(got, size);
}

/// Issue 55: a new UNIX-socket client's request reaches the API server in one TLS record. The
/// proxy read just the 24 bytes that tell the HTTP/2 preface from HTTP/1.1 before it connected
/// upstream, and replayed them alone: every connection's first request went up as two records
/// (two seals and two writes in the proxy, two reads for the API server). Counted by a relay
/// between the proxy and the upstream that follows the records the proxy sends: after a
/// resumed handshake, a connection sends its `Finished`, the request and its `close_notify`
/// (4 records per connection on 38436d2, 3 now).
#[cfg(feature = "pkcs11")]
#[test]
fn a_new_unix_connections_request_goes_upstream_in_one_record() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let relay = support::relay::FreezableRelay::start(upstream.port());
    // The path without a connection made ahead: a spare's handshake has no request to seal
    // with its `Finished`, and the one left unused at the end adds its own records.
    let proxy = ProxyProcess::start_to(
        &id,
        &format!("https://127.0.0.1:{}", relay.port),
        ProxyOptions::args(&["--no-preconnect"]),
    );
    let one = |path: &str| {
        let mut conn = RawHttp::connect(&proxy.socket);
        conn.send(&format!(
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: a-client-with-headers/1.0\r\nAccept: application/json\r\n\r\n"
        ));
        let (status, _) = conn.read_response();
        assert_eq!(status, 200, "{}", proxy.log());
    };
    one("/version"); // the full handshake; the next ones resume
                     // Every record counted: the proxy has ended every upstream connection it opened.
    let (records, connections) = relay.settled();
    let n = 20;
    for _ in 0..n {
        one("/version");
    }
    let records = relay.settled().0 - records;
    assert_eq!(
        relay.connections() - connections,
        n,
        "one upstream connection each"
    );
    assert!(
        records <= 3 * n,
        "{records} records sent upstream by {n} new connections with one request each: \
         more than 3 each (Finished, the request, close_notify) means the request was split"
    );
}
