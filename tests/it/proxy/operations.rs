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
        ProxyOptions::args(&["--reload-interval", "200ms"]),
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
    let body = proxy.wait_for_health(503);
    assert!(body.contains("upstream"), "{body}");

    // Back on the same port: the proxy recovers without a restart.
    let upstream = TestUpstream::start_on(&id.ca, port);
    assert_eq!(version(&proxy)["user"], "alice");
    let out = proxy.curl_tls(&cred, &["--fail"], "/version");
    assert!(out.status.success(), "{}", output_text(&out));
    proxy.wait_for_health(200);
    // The two clients' connections, and perhaps one made ahead for a next client of each kind
    // (each client just served came soon after the one of its kind the outage failed):
    // nothing else.
    let seen = upstream.stats().connections.len();
    assert!((2..=4).contains(&seen), "{seen} upstream connections");
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
            // Long enough that the watch is open before the idle period can end, however slow
            // the start.
            args: vec!["--idle-exit".into(), "6s".into()],
            ..Default::default()
        },
    );
    // An open connection keeps it alive past the idle limit...
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(watch.read_head().0, 200);
    std::thread::sleep(Duration::from_secs(7));
    assert!(
        proxy.guard.try_wait().is_none(),
        "exited with a connection open"
    );
    // ...and that connection still carries events.
    let n = upstream.emit_watch_event();
    watch.read_watch_event(n);
    drop(watch);
    let status = proxy.wait_exit(Duration::from_secs(15));
    assert!(status.success(), "{status}:\n{}", proxy.log());
    assert!(proxy.log().contains("no connection for"), "{}", proxy.log());
}

/// `/healthz` costs the key and the API server at most one check per `--health-cache` period,
/// however many probes arrive: 24 at once (another local user can send them) make at most one
/// test signature and one upstream connection between them, and 24 more within the period
/// make none. Counted, not timed: the signatures the key made and the connections the upstream
/// accepted.
#[cfg(feature = "pkcs11")]
#[test]
fn healthz_probes_share_one_check_per_health_cache_period() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--health-cache", "1h"]),
    );
    let (signatures, dials) = (proxy.signatures(), upstream.stats().tcp_connections);
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let probes: Vec<_> = (0..24)
            .map(|_| s.spawn(|| proxy.admin_get("/healthz")))
            .collect();
        probes
            .into_iter()
            .map(|p| p.join().expect("probe"))
            .collect()
    });
    for (status, body) in &answers {
        assert_eq!((*status, body.trim_end()), (200, "ok"), "{}", proxy.log());
    }
    assert!(
        proxy.signatures() <= signatures + 1,
        "24 probes at once made {} signatures",
        proxy.signatures() - signatures
    );
    let after_burst = upstream.stats().tcp_connections;
    assert!(
        after_burst <= dials + 1,
        "24 probes at once dialled the API server {} times",
        after_burst - dials
    );
    let signatures = proxy.signatures();
    for _ in 0..24 {
        assert_eq!(proxy.admin_get("/healthz").0, 200);
    }
    assert_eq!(
        proxy.signatures(),
        signatures,
        "probes within the period signed"
    );
    assert_eq!(
        upstream.stats().tcp_connections,
        after_burst,
        "probes within the period dialled the API server"
    );
}
