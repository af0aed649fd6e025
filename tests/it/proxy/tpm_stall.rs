//! A slow signer must not stall data on established connections. The slowest TPM there is: a
//! swtpm paused with SIGSTOP. While a new connection's full handshake waits inside the TPM, a
//! watch opened before keeps delivering every event, and the stalled handshake completes once
//! the TPM answers again. No timing is measured: events delivered during the stall are counted.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::proxy::{Backend, Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::{output_text, require_tool};

#[test]
fn a_stalled_tpm_does_not_stall_established_connections() {
    require_tool("curl", "curl");
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    // The handshakes wait as long as the TPM is frozen (no timeout ends them first), and the
    // debug log says when a connection stops waiting for a ticket and goes to the signer.
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            args: vec!["--handshake-timeout".into(), "120s".into()],
            envs: vec![("HWKEY_LOG".into(), "debug".into())],
            ..Default::default()
        },
    );
    let Backend::Tpm(tpm) = &id.backend else {
        unreachable!("Identity::tpm has a TPM backend")
    };

    // An established watch (its handshake was signed while the TPM was running).
    let mut http = RawHttp::connect(&proxy.socket);
    http.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    let (status, _) = http.read_head();
    assert_eq!(status, 200);
    http.read_watch_event(upstream.emit_watch_event());

    // Forget the session tickets (a reload does), so the next connection must sign; then
    // freeze the TPM and start that connection.
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);
    let signatures_before = proxy.signatures();
    let before = upstream.stats().tcp_connections;
    let paused = tpm.pause();
    // More stalled handshakes than the proxy has runtime workers: a signer that blocked its
    // worker (instead of handing it over) would leave none for the watch.
    let stalled: Vec<_> = (0..3)
        .map(|_| {
            Command::new("curl")
                .args(["-sS", "--max-time", "120", "--unix-socket"])
                .arg(&proxy.socket)
                .arg("http://localhost/version")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("curl")
        })
        .collect();
    // Wait until they reach the upstream (TCP), then until the two that waited for the first
    // one's ticket give up waiting, so that all three are inside the (frozen) signer.
    let deadline = Instant::now() + Duration::from_secs(30);
    while upstream.stats().tcp_connections < before + 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        upstream.stats().tcp_connections >= before + 3,
        "the new connections reached the upstream ({} before, {} now):\n{}",
        before,
        upstream.stats().tcp_connections,
        proxy.log()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.log().matches("no session ticket within").count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the waiting handshakes never went to the signer:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // While the TPM is frozen, the established watch delivers every event.
    for _ in 0..5 {
        http.read_watch_event(upstream.emit_watch_event());
    }
    assert_eq!(
        proxy.signatures(),
        signatures_before,
        "the frozen TPM has made no signature yet"
    );

    // The TPM answers again: the stalled connections complete with the hardware identity.
    drop(paused);
    for curl in stalled {
        let out = curl.wait_with_output().expect("curl");
        assert!(
            out.status.success(),
            "{}\n{}",
            output_text(&out),
            proxy.log()
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("\"user\":\"alice\""));
    }
    assert!(proxy.signatures() > signatures_before);
}

/// `/healthz` probes that gave up while the test signature waited in a frozen TPM (a probe
/// whose timeout is shorter than a signature: Kubernetes' default is 1 s) each started another
/// test signature, since a cancelled probe's result was dropped with it; they piled up in the
/// TPM and in blocked threads. Now one test signature runs however many probes give up, and its
/// result answers the next probe. Counted, not timed: the key's signatures once the TPM runs.
#[test]
fn healthz_probes_that_give_up_start_no_second_test_signature() {
    use std::io::{Read, Write};
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let Backend::Tpm(tpm) = &id.backend else {
        unreachable!("Identity::tpm has a TPM backend")
    };
    let before = proxy.signatures();
    let paused = tpm.pause();
    for _ in 0..4 {
        let mut probe =
            std::net::TcpStream::connect(("127.0.0.1", proxy.admin_port)).expect("admin port");
        probe
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        write!(
            probe,
            "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n",
            proxy.admin_port
        )
        .expect("probe");
        let mut answer = [0u8; 64];
        assert!(
            probe.read(&mut answer).is_err(),
            "a probe was answered while the TPM was frozen:\n{}",
            proxy.log()
        );
        // The probe gives up: the proxy sees the connection close.
        drop(probe);
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(paused);
    let (status, body) = proxy.admin_get("/healthz");
    assert_eq!(status, 200, "{body}\n{}", proxy.log());
    assert_eq!(
        proxy.signatures() - before,
        1,
        "probes that gave up made more than one test signature:\n{}",
        proxy.log()
    );
}
