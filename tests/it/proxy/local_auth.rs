//! Local hop security: an unauthenticated loopback TLS client, a client with a certificate from
//! another CA, and another user on the UNIX socket are all refused, and none of them causes an
//! upstream connection or a hardware signature. Non-loopback listeners need --unsafe-listen.
//!
//! The other-user cases run curl as `nobody` with setpriv (the tests run as root).

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use support::proxy::{metric_in, Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

const NOBODY: u32 = 65534;

proxy_tests_on_both_backends!(
    unauthenticated_and_wrong_ca_loopback_clients_are_refused,
    another_uid_on_the_unix_socket_is_refused_unless_allowed,
);

/// `curl` run as uid/gid 65534 against the UNIX socket `socket`.
fn curl_as_nobody(socket: &std::path::Path, url: &str) -> std::process::Output {
    require_tool("setpriv", "util-linux");
    Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "curl",
            "-sS",
            "--max-time",
            "20",
            "--unix-socket",
        ])
        .arg(socket)
        .arg(url)
        .output()
        .expect("run setpriv curl")
}

fn assert_nothing_upstream(upstream: &TestUpstream, proxy: &ProxyProcess, sigs_before: u64) {
    let s = upstream.stats();
    assert_eq!(
        s.tcp_connections, 0,
        "the upstream saw a connection from a refused client: {s:?}"
    );
    assert_eq!(
        proxy.signatures(),
        sigs_before,
        "a refused client caused a signature"
    );
}

fn unauthenticated_and_wrong_ca_loopback_clients_are_refused(identity: fn() -> Identity) {
    require_tool("curl", "curl");
    let id = identity();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let dir = temp_dir();
    let (loop_ca, _, _) = proxy.credential_files(dir.path());
    let sigs = proxy.signatures();

    // No client certificate at all.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert"])
        .arg(&loop_ca)
        .arg(format!("{}/version", proxy.tls_url()))
        .output()
        .expect("curl");
    assert!(
        !out.status.success(),
        "accepted without a client cert: {}",
        output_text(&out)
    );

    // A client certificate from another CA (the upstream's CA, even: it is not the loopback CA).
    let (cert, key) = id
        .ca
        .client_cert(dir.path(), "other", "mallory", Some("devs"));
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert"])
        .arg(&loop_ca)
        .arg("--cert")
        .arg(&cert)
        .arg("--key")
        .arg(&key)
        .arg(format!("{}/version", proxy.tls_url()))
        .output()
        .expect("curl");
    assert!(
        !out.status.success(),
        "accepted a foreign client cert: {}",
        output_text(&out)
    );

    assert_nothing_upstream(&upstream, &proxy, sigs);
    // Counted once the refused connection is dropped, which may follow curl's exit.
    let refused = "hwkey_connections_refused_total{reason=\"client_auth\"}";
    proxy.wait_for_metric(refused, 2.0);
    assert_eq!(metric_in(&proxy.metrics(), refused), 2.0);
}

fn another_uid_on_the_unix_socket_is_refused_unless_allowed(identity: fn() -> Identity) {
    require_tool("curl", "curl");
    let id = identity();
    let upstream = TestUpstream::start(&id.ca);
    // A directory nobody can traverse, so that only the socket's own mode and the uid check
    // stand in the way.
    let open_dir = temp_dir();
    std::fs::set_permissions(open_dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod 755");
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            socket_dir: Some(open_dir.path()),
            state_dir: Some(&open_dir.path().join("state")),
            ..Default::default()
        },
    );
    let mode = std::fs::metadata(&proxy.socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the socket must be created 0600");
    let sigs = proxy.signatures();

    // 0600: the kernel refuses nobody's connect.
    let out = curl_as_nobody(&proxy.socket, "http://localhost/version");
    assert!(
        !out.status.success(),
        "nobody got through a 0600 socket: {}",
        output_text(&out)
    );

    // Even with the mode opened up, the peer-uid check refuses nobody.
    std::fs::set_permissions(&proxy.socket, std::fs::Permissions::from_mode(0o666))
        .expect("chmod 666");
    let out = curl_as_nobody(&proxy.socket, "http://localhost/version");
    assert!(
        !out.status.success(),
        "nobody was served: {}",
        output_text(&out)
    );
    assert_nothing_upstream(&upstream, &proxy, sigs);
    assert_eq!(
        proxy.metric("hwkey_connections_refused_total{reason=\"peer_uid\"}"),
        1.0
    );
    // The control socket checks the uid too: no loopback credential for nobody.
    std::fs::set_permissions(&proxy.state_dir, std::fs::Permissions::from_mode(0o755))
        .expect("chmod state dir");
    std::fs::set_permissions(
        proxy.control_socket(),
        std::fs::Permissions::from_mode(0o666),
    )
    .expect("chmod control");
    let out = curl_as_nobody(&proxy.control_socket(), "http://localhost/v1/credential");
    assert!(
        !out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("PRIVATE KEY"),
        "nobody got a loopback credential: {}",
        output_text(&out)
    );
    // It got as far as the socket, and the uid check turned it away.
    assert!(
        proxy
            .log()
            .contains("refused a control-socket client of another user"),
        "{}",
        proxy.log()
    );
    assert_eq!(proxy.metric("hwkey_loopback_credentials_issued_total"), 0.0);
    drop(proxy);

    // With --allow-uid 65534 the same user is served.
    let allowed_dir = temp_dir();
    std::fs::set_permissions(allowed_dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod 755");
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            socket_dir: Some(allowed_dir.path()),
            args: vec!["--allow-uid".into(), NOBODY.to_string()],
            ..Default::default()
        },
    );
    // No chmod: with another user allowed, the proxy makes its socket reachable (0666) and
    // its peer-uid check decides. At 0600 `connect` failed for the allowed user.
    let mode = std::fs::metadata(&proxy.socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(
        mode, 0o666,
        "the socket of a proxy that allows another user"
    );
    let out = curl_as_nobody(&proxy.socket, "http://localhost/version");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"user\":\"alice\""));
}

#[cfg(feature = "pkcs11")]
#[test]
fn non_loopback_listen_needs_unsafe_listen() {
    let id = Identity::softhsm();
    let dir = temp_dir();
    let port = free_port();
    let out = run_fail(
        hwkey()
            .envs(id.envs())
            .args(["proxy", "--key", &id.key_uri])
            .arg("--cert")
            .arg(&id.cert)
            .args(["--upstream", "https://127.0.0.1:1"])
            .args(["--listen", &format!("tcp:0.0.0.0:{port}")])
            .arg("--state-dir")
            .arg(dir.path().join("state")),
    );
    let text = output_text(&out);
    assert!(text.contains("--unsafe-listen"), "{text}");
    assert!(!port_is_open(port));
}

/// A loopback client is sent a session ticket only if it can use one. One that asks for none
/// (RFC 9149 `ticket_request`, as a one-shot process would) gets none, and its next connection
/// is a full handshake; one that does not ask gets one and resumes with it; one that asks for
/// 255 gets one. (kubectl gets none
/// either way: client-go sets no session cache, so its ClientHello offers no PSK mode.)
#[cfg(feature = "pkcs11")]
#[test]
fn a_loopback_client_that_asks_for_no_session_ticket_gets_none() {
    use support::proxy::{loopback_client_config, loopback_get};
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let cred = proxy.credential();
    // A fresh config each: its own session cache.
    let asking = |request: Option<rustls::client::TicketRequest>| {
        let mut config = (*loopback_client_config(&cred)).clone();
        config.send_ticket_request = request;
        std::sync::Arc::new(config)
    };
    let ok = |resumed: bool| ("200".to_string(), resumed);
    let silent = asking(None);
    assert_eq!(
        loopback_get(&silent, proxy.tcp_port),
        ok(false),
        "{}",
        proxy.log()
    );
    assert_eq!(
        loopback_get(&silent, proxy.tcp_port),
        ok(true),
        "a client that did not ask for tickets got none to resume with: the test proves nothing"
    );
    let none = asking(Some(rustls::client::TicketRequest {
        new_session_count: 0,
        resumption_count: 0,
    }));
    assert_eq!(loopback_get(&none, proxy.tcp_port), ok(false));
    assert_eq!(
        loopback_get(&none, proxy.tcp_port),
        ok(false),
        "a client that asked for no session ticket was sent one, and resumed with it"
    );
    // A client asking for many gets one (a ticket is a cache entry and a record of the
    // proxy's): it resumes once with it, asks for none then, and has none left.
    let greedy = asking(Some(rustls::client::TicketRequest {
        new_session_count: 255,
        resumption_count: 0,
    }));
    assert_eq!(loopback_get(&greedy, proxy.tcp_port), ok(false));
    assert_eq!(
        loopback_get(&greedy, proxy.tcp_port),
        ok(true),
        "a client that asked for 255 tickets got none"
    );
    assert_eq!(
        loopback_get(&greedy, proxy.tcp_port),
        ok(false),
        "a client that asked for 255 session tickets was sent more than one"
    );
}
