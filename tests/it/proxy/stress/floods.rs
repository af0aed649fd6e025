//! The local hop on a bad day (issue 9, findings 3–6, 16, 17, 19): another local user floods
//! the admin and loopback listeners, ClientHellos carry made-up ALPN strings, a resumed TLS
//! session outlives its loopback credential, unauthenticated pokes try to keep an idle proxy
//! alive, refusals try to flood the log, and settings that cannot work are refused up front.
//! The second user is `nobody` (setpriv), so these tests run as root in CI; elsewhere they
//! fail saying so, they never skip. Loads are bounded in count and time and stay on loopback.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

use super::{fd_count, loopback_client, loopback_get};

/// Runs a perl `script` with `args` as user nobody (setpriv), with 8192 descriptors; its stdout
/// is piped.
fn perl_as_nobody(script: &str, args: &[&str]) -> Child {
    require_tool("setpriv", "util-linux");
    Command::new("prlimit")
        .args(["--nofile=8192:8192", "--"])
        .args([
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
        ])
        .args(["/usr/bin/perl", "-e", script])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run perl as nobody")
}

/// Holds `count` TCP connections to 127.0.0.1:`port` as user nobody until killed; returns the
/// child once it reports how many it holds.
fn hold_connections_as_nobody(port: u16, count: usize) -> (Child, usize) {
    let script = r#"
        use IO::Socket::INET;
        my ($port, $n) = @ARGV; my @held;
        for (1..$n) {
            my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $port,
                                          Proto => "tcp", Timeout => 2);
            push @held, $s if $s;
        }
        $| = 1; print "held " . scalar(@held) . "\n";
        sleep 60;
    "#;
    let mut child = perl_as_nobody(script, &[&port.to_string(), &count.to_string()]);
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    let held = line
        .trim()
        .strip_prefix("held ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {line:?}"));
    (child, held)
}

/// Keeps `count` TCP connections to 127.0.0.1:`port` open as user nobody for `secs` seconds,
/// opening a new one whenever the proxy closes one (the flood that switched the loopback TLS
/// listener off, issue 22). Returns the child once it holds its connections; it prints
/// "reconnects N" when it ends.
fn reconnecting_flood_as_nobody(port: u16, count: usize, secs: u64) -> Child {
    let script = r#"
        use IO::Socket::INET; use IO::Select;
        my ($port, $n, $secs) = @ARGV; my $sel = IO::Select->new; my $reconnects = 0;
        sub conn { my $s = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $port,
                                                 Proto => "tcp", Timeout => 2);
                   $sel->add($s) if $s; }
        conn() for 1..$n;
        $| = 1; print "held " . $sel->count . "\n";
        my $end = time + $secs;
        while (time < $end) {
            for my $s ($sel->can_read(0.1)) {
                my $buf; my $r = sysread($s, $buf, 4096);
                if (!$r) { $sel->remove($s); close $s; conn(); $reconnects++; }
            }
            conn() while $sel->count < $n && time < $end;
        }
        print "reconnects $reconnects\n";
    "#;
    let mut child = perl_as_nobody(
        script,
        &[&port.to_string(), &count.to_string(), &secs.to_string()],
    );
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("read");
    assert!(line.starts_with("held "), "unexpected output {line:?}");
    child.stdout = Some(out.into_inner());
    child
}

/// How many times a flood reconnected, once it ended.
fn reconnects(child: Child) -> u64 {
    let out = child.wait_with_output().expect("wait for the flood");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("reconnects "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Issue 22, finding 1: another uid holds 200 unauthenticated connections to the loopback TLS
/// port and 200 to the admin port, reconnecting whenever the proxy closes one. The owner's
/// kubectl over loopback TLS (the path kubectl and kubelet use) and `/healthz` keep working:
/// the peers' uids come from the kernel, the flood sheds only its own oldest connections and
/// never the owner's. On the old code (a full budget closed the *new* connection) kubectl got
/// 0 of 10 through.
#[test]
fn a_reconnecting_flood_of_another_uid_never_turns_the_owner_away() {
    require_root("this test runs a load as another user (nobody, via setpriv)");
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let work = temp_dir();
    let (ca, cert, key) = proxy.credential_files(work.path());
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: u\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n",
            proxy.tls_url(),
            ca.display(),
            cert.display(),
            key.display()
        ),
    )
    .expect("write kubeconfig");
    let tls_flood = reconnecting_flood_as_nobody(proxy.tcp_port, 200, 30);
    let admin_flood = reconnecting_flood_as_nobody(proxy.admin_port, 200, 30);
    std::thread::sleep(Duration::from_secs(3));
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = Instant::now();
        let out = Command::new("kubectl")
            .env("KUBECONFIG", &kubeconfig)
            .args(["get", "--raw", "/version", "--request-timeout=10s"])
            .output()
            .expect("run kubectl");
        slowest = slowest.max(started.elapsed());
        assert!(
            out.status.success(),
            "kubectl {i} during the flood: {}\n{}",
            output_text(&out),
            proxy.log()
        );
        for j in 0..2 {
            let started = Instant::now();
            let (status, body) = proxy.admin_get("/healthz");
            slowest = slowest.max(started.elapsed());
            assert_eq!(status, 200, "/healthz {i}.{j} during the flood: {body}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let shed = proxy.metric("hwkey_connections_refused_total{reason=\"busy\"}");
    let (tls, admin) = (reconnects(tls_flood), reconnects(admin_flood));
    assert!(
        tls > 0 && admin > 0 && shed > 0.0,
        "the flood never had to reconnect ({tls}, {admin}, shed {shed}): it tested nothing"
    );
    // Every owner call succeeded within its own timeout (kubectl 10 s, /healthz 20 s); how long
    // the slowest took is information, not a verdict (it depends on the machine).
    eprintln!("slowest owner call during the reconnecting floods: {slowest:?}");
}

/// Issue 22, finding 1, the kubelet's way in: a kubeconfig from `hwkey kubeconfig --for
/// kubelet` (the exec plugin, never interactive) whose proxy listens on loopback TLS. Another
/// uid floods that port, reconnecting; kubectl with the kubelet's kubeconfig works 10 of 10.
#[test]
fn a_reconnecting_flood_does_not_cut_off_the_kubelet_identity() {
    require_root("this test runs a load as another user (nobody, via setpriv)");
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let work = temp_dir();
    let port = free_port();
    let kubeconfig = work.path().join("kubelet.conf");
    let state = work.path().join("state");
    run_ok(
        hwkey()
            .envs(id.envs())
            .args(["kubeconfig", "--for", "kubelet", "--name", "kubelet"])
            .args(["--key", &id.key_uri, "--cert"])
            .arg(&id.cert)
            .args([
                "--server",
                &upstream.url(),
                "--port",
                &port.to_string(),
                "--ca",
            ])
            .arg(id.ca.ca_path())
            .arg("--state-dir")
            .arg(&state)
            .arg("--out")
            .arg(&kubeconfig),
    );
    let kubectl = || {
        Command::new("kubectl")
            .envs(id.envs())
            .env("KUBECONFIG", &kubeconfig)
            .args(["get", "--raw", "/version", "--request-timeout=10s"])
            .output()
            .expect("run kubectl")
    };
    // The first run starts the proxy on the kubelet's port.
    let out = kubectl();
    assert!(out.status.success(), "{}", output_text(&out));
    let flood = reconnecting_flood_as_nobody(port, 200, 20);
    std::thread::sleep(Duration::from_secs(2));
    for i in 0..10 {
        let out = kubectl();
        assert!(
            out.status.success(),
            "kubelet kubectl {i} during the flood: {}\n{}",
            output_text(&out),
            std::fs::read_to_string(state.join("proxy.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        reconnects(flood) > 0,
        "the flood never had to reconnect: it tested nothing"
    );
    if let Ok(pid) = std::fs::read_to_string(state.join("proxy.pid")) {
        let _ = Command::new("kill").arg(pid.trim()).status();
    }
}

/// 1,100 idle admin connections and 600 unauthenticated loopback TLS connections from another
/// user, against a proxy with the 1024-descriptor limit an auto-started proxy inherits and
/// `--max-connections 256`: the owner's UNIX-socket requests and the control socket still
/// answer in under a second each, and the descriptors come back when the flood ends.
#[test]
fn another_users_flood_does_not_stall_the_owner() {
    require_root("this test runs a load as another user (nobody, via setpriv)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--max-connections".into(), "256".into()],
            nofile: Some(1024),
            ..Default::default()
        },
    );
    let pid = proxy.guard.id();
    assert!(proxy.curl_unix(&["--fail"], "/version").status.success());
    let baseline = fd_count(pid);

    let (mut admin_flood, admin_held) = hold_connections_as_nobody(proxy.admin_port, 1100);
    let (mut tls_flood, tls_held) = hold_connections_as_nobody(proxy.tcp_port, 600);
    assert!(
        admin_held >= 1000 && tls_held >= 500,
        "{admin_held} {tls_held}"
    );

    // The owner is served while the flood holds its connections: every request succeeds within
    // curl's own timeout (the timings are printed, not judged: they depend on the machine).
    let mut slowest = Duration::ZERO;
    for i in 0..10 {
        let started = Instant::now();
        let out = proxy.curl_unix(&["--fail", "--max-time", "5"], "/version");
        slowest = slowest.max(started.elapsed());
        assert!(
            out.status.success(),
            "request {i}: {}\n{}",
            output_text(&out),
            proxy.log()
        );
    }
    let started = Instant::now();
    let cred = proxy.credential();
    assert!(cred["clientCertificatePem"].is_string());
    eprintln!(
        "during the held flood: slowest request {slowest:?}, control socket {:?}",
        started.elapsed()
    );
    assert!(fd_count(pid) < 900, "descriptors in use: {}", fd_count(pid));

    let _ = admin_flood.kill();
    let _ = tls_flood.kill();
    let _ = admin_flood.wait();
    let _ = tls_flood.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    while fd_count(pid) > baseline + 8 {
        assert!(
            Instant::now() < deadline,
            "descriptors not released: {} (baseline {baseline})",
            fd_count(pid)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(proxy.metric("hwkey_connections_refused_total{reason=\"busy\"}") > 0.0);
    // The refusals did not flood the log (finding 17).
    let warnings = proxy.log().lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings < 30, "{warnings} warnings:\n{}", proxy.log());
}

/// 20,000 ClientHellos with distinct made-up ALPN strings: the proxy's memory grows by less
/// than 2 MiB (only the protocols it serves are cached).
#[test]
fn made_up_alpn_strings_do_not_grow_memory() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let port = proxy.tcp_port;
    let ca = proxy.credential()["certificateAuthorityPem"]
        .as_str()
        .expect("CA")
        .to_string();
    // Warm up (allocator arenas, the first configs), then measure.
    hellos(port, &ca, 0, 2_000);
    let before = rss_kib(proxy.guard.id());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let ca = ca.clone();
            std::thread::spawn(move || hellos(port, &ca, 10_000 + t * 5_000, 5_000))
        })
        .collect();
    for t in threads {
        t.join().expect("hello thread");
    }
    let after = rss_kib(proxy.guard.id());
    assert!(
        after.saturating_sub(before) < 2048,
        "RSS grew from {before} KiB to {after} KiB"
    );
    assert!(proxy.curl_unix(&["--fail"], "/version").status.success());
}

/// Sends `count` ClientHellos offering ALPN `x-N` (N from `first`), each on its own connection,
/// waits for the server's first flight, and hangs up.
fn hellos(port: u16, ca_pem: &str, first: usize, count: usize) {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.expect("CA PEM")).expect("root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let base = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    for i in first..first + count {
        let mut config = base.clone();
        config.alpn_protocols = vec![format!("x-{i}").into_bytes()];
        let mut conn = rustls::ClientConnection::new(
            Arc::new(config),
            rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
        )
        .expect("client");
        let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
            continue;
        };
        tcp.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let _ = conn.write_tls(&mut tcp);
        let mut buf = [0u8; 512];
        let _ = tcp.read(&mut buf);
    }
}

/// Issue 22, finding 8: without `--renew`, `/healthz` said 200 with an expired certificate
/// (every request then failed at the API server): it is 503 outside the validity window,
/// naming the expiry and what to do. And no loopback credential is issued then: one was,
/// already expired (its NotAfter capped at the certificate's, before its NotBefore), so
/// client-go ran the plugin again for every request and each failed with an unclear TLS error.
#[test]
fn healthz_is_unhealthy_and_no_credential_is_issued_once_the_certificate_expired() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let (status, body) = proxy.admin_get("/healthz");
    assert_eq!(status, 200, "{body}");
    let not_after = proxy.swap_in_short_lived_cert(&id, Duration::from_secs(6));
    // The clock only moves forward: past NotAfter is an event, not a race.
    while unix_now() <= not_after + 1 {
        std::thread::sleep(Duration::from_millis(200));
    }
    let body = proxy.wait_for_health(503);
    assert!(
        body.contains("certificate: expired at") && body.contains("--renew"),
        "{body}"
    );
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            "-w",
            "\n%{http_code}",
            "--unix-socket",
        ])
        .arg(proxy.control_socket())
        .arg("http://localhost/v1/credential")
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').expect("status line");
    assert_eq!(
        code, "503",
        "a credential was issued after the certificate expired: {body}"
    );
    assert!(
        body.contains("expired at")
            && body.contains("hwkey renew")
            && !body.contains("PRIVATE KEY"),
        "{body}"
    );
}

/// A resumed loopback TLS session whose credential expired is refused before anything goes
/// upstream (before the fix it was resumed, bridged, and signed upstream).
#[test]
fn a_resumed_session_does_not_outlive_its_loopback_credential() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    // The shortest credential there is; it is made after start-up, so start-up costs none of it.
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--credential-validity", "10s"]),
    );
    let cred = proxy.credential();
    let expires = cred["expirationUnix"].as_i64().expect("expiry");
    let config = loopback_client(&cred);

    let (status, resumed) = loopback_get(&config, proxy.tcp_port);
    assert_eq!(
        (status.as_str(), resumed),
        ("200", false),
        "{}",
        proxy.log()
    );
    while unix_now() <= expires + 1 {
        std::thread::sleep(Duration::from_millis(200));
    }
    let upstream_before = upstream.stats().tcp_connections;
    let (status, resumed) = loopback_get(&config, proxy.tcp_port);
    assert!(
        resumed,
        "the client did not resume: the test proves nothing"
    );
    assert_eq!(status, "", "an expired credential was served");
    assert_eq!(upstream.stats().tcp_connections, upstream_before);
    assert_eq!(
        proxy.metric("hwkey_connections_refused_total{reason=\"expired_credential\"}"),
        1.0
    );
}

/// Unauthenticated connections do not keep an `--idle-exit` proxy alive.
#[test]
fn unauthenticated_pokes_do_not_keep_an_idle_proxy_alive() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut proxy =
        ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--idle-exit", "3s"]));
    let port = proxy.tcp_port;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(40);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                    let _ = s.write_all(b"not TLS\r\n");
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let status = proxy.wait_exit(Duration::from_secs(25));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    poker.join().expect("poker");
    assert!(status.success(), "{status}\n{}", proxy.log());
    assert!(
        proxy.log().contains("stopped (no connection for 3s)"),
        "{}",
        proxy.log()
    );
}

/// Settings that cannot work are refused before the proxy says it is ready.
#[test]
fn impossible_settings_are_refused_before_ready() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let base = |extra: &[&str]| {
        let mut cmd = hwkey();
        cmd.envs(id.envs())
            .args(["proxy", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert)
            .args(["--upstream", &upstream.url(), "--upstream-ca"])
            .arg(id.ca.ca_path())
            .args(["--listen", &format!("tcp:127.0.0.1:{}", free_port())])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(extra);
        cmd
    };
    for (extra, needle) in [
        (
            vec!["--handshake-timeout", "0"],
            "handshake-timeout must be more than 0",
        ),
        (
            vec!["--credential-validity", "0s"],
            "credential-validity must be more than 0",
        ),
        (
            vec!["--lock-file", "/nonexistent/hwkey.lock"],
            "cannot open the lock file /nonexistent/hwkey.lock",
        ),
        // Issue 22, findings 9-11: settings that cannot work, refused before anything runs.
        (
            vec!["--drain-timeout", "18446744073709551615"],
            "drain-timeout = ",
        ),
        (
            vec!["--max-connections", "0"],
            "max-connections = 0 cannot work",
        ),
        (
            vec!["--handshake-timeout", "1ns"],
            "handshake-timeout = 1ns cannot work",
        ),
        (vec!["--idle-exit", "1ns"], "idle-exit = 1ns cannot work"),
    ] {
        let out = run_fail_within(&mut base(&extra), Duration::from_secs(30));
        let text = output_text(&out);
        assert!(text.contains(needle), "{extra:?}: {text}");
        assert!(!text.contains("ready"), "{extra:?} said ready: {text}");
    }
    // An out-of-range port was read as "no port": the proxy connected to 443.
    let out = run_fail_within(
        hwkey()
            .envs(id.envs())
            .args(["proxy", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert)
            .args(["--upstream", "https://127.0.0.1:99999", "--state-dir"])
            .arg(dir.path().join("state")),
        Duration::from_secs(30),
    );
    assert!(
        output_text(&out).contains("port '99999' is out of range"),
        "{}",
        output_text(&out)
    );
}

/// Seconds since the Unix epoch.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// `GET path` on the admin port as user nobody (curl under setpriv): (status, body).
fn admin_get_as_nobody(port: u16, path: &str) -> (String, String) {
    require_tool("setpriv", "util-linux");
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .args(["curl", "-sS", "--max-time", "20", "-w", "\n%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .expect("curl as nobody");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.to_string(), body.trim_end().to_string())
}

/// Another local user's `/healthz` probes never make the key sign: they get the last status in
/// one word ("unknown" before any check), without the reasons, and no `/metrics`; a monitoring
/// uid named by `--admin-allow-uid` gets both. (Before: 24 probes from nobody made 18
/// signatures, and the error text of the key showed.)
#[test]
fn another_users_health_probes_cost_no_signature_and_show_no_details() {
    require_root("this test runs a load as another user (nobody, via setpriv)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--health-cache", "1s"]),
    );
    let port = proxy.admin_port;
    let signatures = proxy.signatures();
    for _ in 0..8 {
        let (code, body) = admin_get_as_nobody(port, "/healthz");
        assert_eq!(
            (code.as_str(), body.as_str()),
            ("503", "unknown"),
            "{}",
            proxy.log()
        );
    }
    assert_eq!(
        proxy.signatures(),
        signatures,
        "another user's probes made the key sign"
    );
    let (code, _) = admin_get_as_nobody(port, "/metrics");
    assert_eq!(code, "403");
    // The proxy's own user checks (one signature at most); nobody then sees the word only.
    assert_eq!(proxy.admin_get("/healthz"), (200, "ok\n".to_string()));
    std::thread::sleep(Duration::from_millis(1100));
    for _ in 0..8 {
        assert_eq!(
            admin_get_as_nobody(port, "/healthz"),
            ("200".into(), "ok".into())
        );
    }
    assert!(proxy.signatures() <= signatures + 1);

    let monitored = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--admin-allow-uid", "65534"]),
    );
    let (code, body) = admin_get_as_nobody(monitored.admin_port, "/healthz");
    assert_eq!((code.as_str(), body.as_str()), ("200", "ok"));
    let (code, body) = admin_get_as_nobody(monitored.admin_port, "/metrics");
    assert_eq!(code, "200");
    assert!(body.contains("hwkey_signatures_total"), "{body}");
}

/// The threads of process `pid` named `comm`, stopped where they are until this is dropped: a
/// python helper seizes and interrupts each with ptrace (the process's other threads keep
/// running) and detaches when its stdin closes, or when it is killed (the kernel detaches a dead
/// tracer's tracees). A stand-in for connection threads too busy to take new work.
struct StoppedThreads {
    tracer: Child,
    count: usize,
}

impl StoppedThreads {
    fn stop(pid: u32, comm: &str) -> StoppedThreads {
        let script = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
SEIZE, INTERRUPT, DETACH, WALL = 0x4206, 0x4207, 17, 0x40000000
pid, comm = sys.argv[1], sys.argv[2]
seized, failed = [], []
for tid in os.listdir(f"/proc/{pid}/task"):
    try:
        name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
    except OSError:
        continue
    if name != comm:
        continue
    tid = int(tid)
    if libc.ptrace(SEIZE, tid, None, None) != 0:
        failed.append(f"{tid}: PTRACE_SEIZE {os.strerror(ctypes.get_errno())}")
        continue
    seized.append(tid)
    if libc.ptrace(INTERRUPT, tid, None, None) != 0:
        failed.append(f"{tid}: PTRACE_INTERRUPT {os.strerror(ctypes.get_errno())}")
        continue
    os.waitpid(tid, WALL)
print("stopped", len(seized) - len(failed), "failed", "; ".join(failed) or "none", flush=True)
sys.stdin.read()
for tid in seized:
    libc.ptrace(DETACH, tid, None, 0)
"#;
        require_tool("python3", "python3");
        let mut tracer = Command::new("python3")
            .args(["-c", script, &pid.to_string(), comm])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run the ptrace helper");
        let mut out = BufReader::new(tracer.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("read");
        let (count, failed) = line
            .trim()
            .strip_prefix("stopped ")
            .and_then(|rest| rest.split_once(" failed "))
            .and_then(|(n, failed)| Some((n.parse::<usize>().ok()?, failed.to_string())))
            .unwrap_or_else(|| panic!("unexpected output {line:?}"));
        assert_eq!(
            failed, "none",
            "could not stop every {comm} thread of {pid} with ptrace (the test needs root with CAP_SYS_PTRACE): {failed}"
        );
        StoppedThreads { tracer, count }
    }
}

/// A load child (and what it reported), killed when dropped, also when the test panics.
struct KillOnDrop(Child, usize);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for StoppedThreads {
    fn drop(&mut self) {
        drop(self.tracer.stdin.take());
        if !matches!(self.tracer.wait(), Ok(s) if s.success()) {
            let _ = self.tracer.kill();
        }
    }
}

/// Issue 35: connections between accept and admission were unbounded. While the connection
/// threads cannot take new work (here stopped with ptrace; under a flood, busy), 350
/// connections from another uid arrive: the proxy accepts at most 256 of them and leaves the
/// rest in the kernel's backlog (128 here), instead of holding a descriptor and a queued task
/// for each (the old code held all 350). Once the threads run again every waiting connection is
/// accepted in turn, and the owner is served.
#[test]
fn connections_wait_in_the_kernel_while_the_connection_threads_cannot_take_them() {
    require_root("this test runs a load as another user (nobody, via setpriv)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let pid = proxy.guard.id();
    assert!(proxy.curl_unix(&["--fail"], "/version").status.success());
    let accepted = |p: &ProxyProcess| p.metric("hwkey_connections_total{listener=\"tcp\"}");
    let accepted_before = accepted(&proxy);
    let baseline = fd_count(pid);

    // One runtime per core, each with its worker thread (its blocking threads have the name too).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let stopped = StoppedThreads::stop(pid, "hwkey-proxy-con");
    assert!(
        stopped.count >= cores,
        "stopped {} connection threads of {pid}, expected at least {cores}",
        stopped.count
    );
    let flood = hold_connections_as_nobody(proxy.tcp_port, 350);
    let flood = KillOnDrop(flood.0, flood.1);
    assert!(
        flood.1 >= 340,
        "the flood holds only {} connections",
        flood.1
    );
    // The accept loop takes connections up to the bound (else this tests nothing), then stops:
    // give it time to take more than it may.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fd_count(pid).saturating_sub(baseline) < 250 {
        assert!(
            Instant::now() < deadline,
            "the accept loop took only {} connections while the threads were stopped",
            fd_count(pid).saturating_sub(baseline)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut most = 0;
    for _ in 0..20 {
        most = most.max(fd_count(pid).saturating_sub(baseline));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        most <= 256 + 8,
        "{most} descriptors taken by connections nobody admitted (bound 256)"
    );
    drop(stopped);
    let held = flood.1;

    // Nothing was lost: the connections that waited in the backlog are accepted now.
    proxy.wait_for_metric(
        "hwkey_connections_total{listener=\"tcp\"}",
        accepted_before + held as f64,
    );
    let out = proxy.curl_unix(&["--fail", "--max-time", "5"], "/version");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
    drop(flood);
    eprintln!(
        "most descriptors held while the threads were stopped: {most}; accepted: {}",
        accepted(&proxy) - accepted_before
    );
}
