//! Operating `hwkey proxy`: certificate reload (file change and SIGHUP; same key accepted,
//! another key refused), SIGTERM drain, upstream outage and recovery, `/healthz`, the config
//! file and environment twins, and the KEP-2718 lifetimes (`--lock-file`, `--idle-exit`).

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::fs::File;
use std::time::{Duration, Instant};

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::*;

proxy_tests_on_both_backends!(
    reload_installs_a_renewed_cert_and_refuses_another_key,
    upstream_outage_fails_cleanly_and_recovers,
    idle_connections_hold_no_copy_buffers,
);

fn version(proxy: &ProxyProcess) -> serde_json::Value {
    let out = proxy.curl_unix(&["--fail"], "/version");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn serial_of(pem_path: &std::path::Path) -> String {
    let pem = std::fs::read(pem_path).expect("read cert");
    let block = pem::parse(pem).expect("PEM");
    let (_, c) = x509_parser::parse_x509_certificate(block.contents()).expect("cert");
    c.raw_serial_as_string()
}

/// Replaces `path` atomically (write beside, rename), as cert managers do.
fn replace_file(path: &std::path::Path, from: &std::path::Path) {
    let tmp = path.with_extension("new");
    std::fs::copy(from, &tmp).expect("copy");
    std::fs::rename(&tmp, path).expect("rename");
}

fn reload_installs_a_renewed_cert_and_refuses_another_key(identity: fn() -> Identity) {
    require_tool("curl", "curl");
    let mut id = identity();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--reload-interval".into(), "200ms".into()],
            ..Default::default()
        },
    );
    let first = serial_of(&id.cert);
    assert_eq!(version(&proxy)["serial"], first.as_str());

    // An open connection, to show it survives the reloads.
    let mut open = RawHttp::connect(&proxy.socket);
    open.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (status, body) = open.read_response();
    assert_eq!(status, 200);
    assert!(body.contains(&first), "{body}");

    // Renewed certificate, same key: new connections present it.
    let renewed = id.dir.path().join("renewed.pem");
    id.issue(&id.key_uri.clone(), "CN=alice,O=devs", &renewed);
    let second = serial_of(&renewed);
    assert_ne!(first, second);
    replace_file(&id.cert, &renewed);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);
    assert_eq!(version(&proxy)["serial"], second.as_str());

    // A certificate for another key: refused, the renewed one stays.
    let bob_uri = id.sibling_uri("bob");
    id.create_key(&bob_uri);
    let bob = id.dir.path().join("bob.pem");
    id.issue(&bob_uri, "CN=bob,O=devs", &bob);
    replace_file(&id.cert, &bob);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"refused\"}", 1.0);
    let v = version(&proxy);
    assert_eq!(v["serial"], second.as_str());
    assert_eq!(v["user"], "alice");
    assert!(
        proxy.log().contains("certificate reload refused"),
        "{}",
        proxy.log()
    );

    // SIGHUP reloads too (the file holds the renewed cert again).
    replace_file(&id.cert, &renewed);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 2.0);
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 3.0);
    assert_eq!(version(&proxy)["serial"], second.as_str());

    // The connection opened before all this still works, with its original certificate.
    open.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let (status, body) = open.read_response();
    assert_eq!(status, 200);
    assert!(body.contains(&first), "{body}");
}

#[cfg(feature = "pkcs11")]
#[test]
fn sigterm_drains_open_connections_removes_sockets_and_exits_zero() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut proxy = ProxyProcess::start(&id, &upstream);
    let control = proxy.control_socket();
    assert!(proxy.socket.exists() && control.exists());

    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);

    proxy.signal(libc::SIGTERM);
    // The listeners go away at once...
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.socket.exists() || control.exists() {
        assert!(
            Instant::now() < deadline,
            "sockets not removed:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(std::os::unix::net::UnixStream::connect(&proxy.socket).is_err());
    // ...while the open watch keeps flowing.
    let n = upstream.emit_watch_event();
    let mut line = String::new();
    loop {
        line.clear();
        let read = std::io::BufRead::read_line(&mut watch.reader, &mut line).expect("read event");
        assert!(read > 0, "the watch was cut during the drain");
        if line.contains(&format!("cm-{n}")) {
            break;
        }
    }
    assert!(
        proxy.guard.try_wait().is_none(),
        "exited before the drain finished"
    );
    drop(watch);
    let status = proxy.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "exit status {status}:\n{}", proxy.log());
    assert!(
        proxy.log().contains("stopped (SIGTERM received)"),
        "{}",
        proxy.log()
    );
}

fn upstream_outage_fails_cleanly_and_recovers(identity: fn() -> Identity) {
    require_tool("curl", "curl");
    let id = identity();
    let mut upstream = TestUpstream::start(&id.ca);
    let port = upstream.port();
    let proxy = ProxyProcess::start(&id, &upstream);
    let dir = temp_dir();
    let cred = proxy.credential_files(dir.path());
    assert_eq!(version(&proxy)["user"], "alice");
    assert_eq!(proxy.admin_get("/healthz"), (200, "ok\n".to_string()));

    upstream.stop();
    // HTTP/1.1 over the UNIX socket: a 502 with a Kubernetes Status body.
    let out = proxy.curl_unix(&["-w", "\n%{http_code}"], "/version");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').expect("status line");
    assert_eq!(code, "502", "{text}");
    let status: serde_json::Value = serde_json::from_str(body).expect("Status JSON");
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["code"], 502);
    // h2 over loopback TLS: the same Status, over HTTP/2 (no hang, no bare close).
    let out = proxy.curl_tls(&cred, &["-w", "\n%{http_code}"], "/version");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.ends_with("\n502") && text.contains("\"kind\":\"Status\""),
        "{text} {}",
        output_text(&out)
    );
    let (code, body) = proxy.admin_get("/healthz");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("upstream"), "{body}");

    // Back on the same port: the proxy recovers without a restart.
    let upstream = TestUpstream::start_on(&id.ca, port);
    assert_eq!(version(&proxy)["user"], "alice");
    let out = proxy.curl_tls(&cred, &["--fail"], "/version");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(proxy.admin_get("/healthz").0, 200);
    assert_eq!(upstream.stats().connections.len(), 2);
}

#[cfg(feature = "pkcs11")]
#[test]
fn settings_come_from_a_toml_or_yaml_config_file_and_the_environment() {
    require_tool("curl", "curl");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let d = dir.path();

    // TOML: everything in the file.
    let sock = d.join("toml.sock");
    let admin = free_port();
    let toml_path = d.join("proxy.toml");
    std::fs::write(
        &toml_path,
        format!(
            "key = {key:?}\ncert = {cert:?}\nupstream = {up:?}\nupstream-ca = {ca:?}\nlisten = [{listen:?}]\nadmin = {admin:?}\nstate-dir = {state:?}\n",
            key = id.key_uri,
            cert = id.cert.display().to_string(),
            up = upstream.url(),
            ca = id.ca.ca_path().display().to_string(),
            listen = format!("unix:{}", sock.display()),
            admin = format!("tcp:127.0.0.1:{admin}"),
            state = d.join("state-toml").display().to_string(),
        ),
    )
    .expect("write toml");
    let mut p = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            bare: true,
            args: vec!["--config".into(), toml_path.display().to_string()],
            ..Default::default()
        },
    );
    p.socket = sock;
    p.admin_port = admin;
    assert_eq!(version(&p)["user"], "alice");
    assert_eq!(p.admin_get("/healthz").0, 200);
    drop(p);

    // YAML for some settings, environment twins for the rest; the flag beats the file.
    let sock = d.join("yaml.sock");
    let yaml_path = d.join("proxy.yaml");
    std::fs::write(
        &yaml_path,
        format!(
            "upstream: {up}\nupstream-ca: {ca}\nlisten:\n  - unix:{wrong}\nstate-dir: {state}\nhandshake-timeout: 5s\n",
            up = upstream.url(),
            ca = id.ca.ca_path().display(),
            wrong = d.join("not-this.sock").display(),
            state = d.join("state-yaml").display(),
        ),
    )
    .expect("write yaml");
    let mut p = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            bare: true,
            args: vec![
                "--config".into(),
                yaml_path.display().to_string(),
                "--listen".into(),
                format!("unix:{}", sock.display()),
            ],
            envs: vec![
                ("HWKEY_KEY".into(), id.key_uri.clone()),
                ("HWKEY_CERT".into(), id.cert.display().to_string()),
            ],
            ..Default::default()
        },
    );
    p.socket = sock;
    assert_eq!(version(&p)["user"], "alice");
    assert!(!d.join("not-this.sock").exists());
}

#[cfg(feature = "pkcs11")]
#[test]
fn exits_when_the_lock_owner_goes_away() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let lock_path = dir.path().join("owner.lock");
    let lock = File::create(&lock_path).expect("create lock");
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).expect("flock");
    let mut proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--lock-file".into(), lock_path.display().to_string()],
            ..Default::default()
        },
    );
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        proxy.guard.try_wait().is_none(),
        "exited while the owner lives"
    );
    assert_eq!(version(&proxy)["user"], "alice");
    drop(lock); // the owner "dies": its lock goes with its descriptor
    let status = proxy.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status}:\n{}", proxy.log());
    assert!(proxy.log().contains("is gone"), "{}", proxy.log());
    assert!(!proxy.socket.exists());
}

#[cfg(feature = "pkcs11")]
#[test]
fn exits_after_idle_exit_without_connections() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--idle-exit".into(), "1s".into()],
            ..Default::default()
        },
    );
    // An open connection keeps it alive past the idle limit.
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        proxy.guard.try_wait().is_none(),
        "exited with a connection open"
    );
    drop(watch);
    let status = proxy.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status}:\n{}", proxy.log());
    assert!(proxy.log().contains("no connection for"), "{}", proxy.log());
}

#[cfg(feature = "pkcs11")]
#[test]
fn handshake_timeout_idle_timeout_and_connection_limit() {
    use std::io::{Read, Write};
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec![
                "--handshake-timeout".into(),
                "1s".into(),
                "--idle-timeout".into(),
                "1500ms".into(),
                "--max-connections".into(),
                "1".into(),
            ],
            ..Default::default()
        },
    );

    // A loopback client that never sends a ClientHello is cut off after the handshake timeout.
    let mut silent =
        std::net::TcpStream::connect(("127.0.0.1", proxy.tcp_port)).expect("connect tcp");
    silent.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut buf = [0u8; 16];
    assert_eq!(silent.read(&mut buf).unwrap_or(0), 0, "expected a close");
    assert_eq!(
        proxy.metric("hwkey_connections_refused_total{reason=\"handshake_timeout\"}"),
        1.0
    );
    drop(silent);

    // One slot: while a watch holds it, a second client is not served...
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);
    let mut waiting = std::os::unix::net::UnixStream::connect(&proxy.socket).expect("connect");
    waiting
        .write_all(b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("write");
    waiting
        .set_read_timeout(Some(Duration::from_millis(700)))
        .ok();
    assert!(
        waiting.read(&mut buf).is_err(),
        "served beyond --max-connections"
    );
    // ...until the idle timeout closes the quiet watch, which frees the slot.
    let mut rest = Vec::new();
    let n = std::io::Read::read_to_end(&mut watch.reader, &mut rest).unwrap_or(0);
    assert_eq!(n, 0, "the idle watch should just be closed");
    waiting.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut response = String::new();
    waiting.read_to_string(&mut response).expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"user\":\"alice\""), "{response}");
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
    let request = "GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let mut conns: Vec<RawHttp> = (0..8).map(|_| RawHttp::connect(&proxy.socket)).collect();
    let round = |conns: &mut Vec<RawHttp>| {
        for c in conns.iter_mut() {
            c.send(request);
        }
        for c in conns.iter_mut() {
            let (status, _) = c.read_response();
            assert_eq!(status, 200, "{}", proxy.log());
        }
    };
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

/// What an idle connection costs the proxy (issue 12: ≤ 16 KiB each beyond the kernel's
/// buffers, 1,000 of them in ≤ 32 MiB). After 100 connections have warmed the allocator, 500 more
/// keep-alive connections, each after one request and so with its upstream TLS connection open,
/// may add at most 12 KiB of RSS apiece. The connection's task used to keep every move of the
/// upstream TLS stream in its own slot of its state (5.8 KiB per task; 13.8–14.3 KiB per
/// connection in all, in this test's debug build); boxing the stream and the handshake futures
/// took it to 10.4–10.8 KiB.
#[cfg(feature = "pkcs11")]
#[test]
fn an_idle_connection_costs_the_proxy_at_most_12_kib() {
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
    let rss = || rss_kib(proxy.guard.id());
    let _warm = open(100);
    std::thread::sleep(Duration::from_millis(300));
    let before = rss();
    let more = open(500);
    std::thread::sleep(Duration::from_millis(300));
    let after = rss();
    assert_eq!(proxy.metric("hwkey_connections_active"), 600.0);
    let per = after.saturating_sub(before) as f64 / more.len() as f64;
    assert!(
        per <= 12.0,
        "each idle connection added {per:.1} KiB of proxy RSS ({before} → {after} KiB for 500)"
    );
}
