//! When bridged connections end after the certificate changes (`--rotation-close`): with
//! `immediate` (kubelet's behaviour) a connection opened with a replaced certificate is closed at
//! once and the client reconnects under the new one; in every mode a connection never outlives
//! the certificate it was opened with. Real SoftHSM key, real rustls/hyper upstream.

use std::io::BufRead;
use std::time::{Duration, Instant};

use support::proxy::{Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::*;

const WATCH: &str =
    "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n";

/// Reads until the stream ends; panics if it is still open after `limit`.
fn ends_within(w: &mut RawHttp, limit: Duration, proxy: &ProxyProcess) -> Duration {
    let started = Instant::now();
    w.reader.get_ref().set_read_timeout(Some(limit)).ok();
    let mut line = String::new();
    loop {
        line.clear();
        match w.reader.read_line(&mut line) {
            Ok(0) => return started.elapsed(),
            Ok(_) => continue,
            Err(e) => panic!(
                "the watch was not closed within {limit:?} ({e}):\n{}",
                proxy.log()
            ),
        }
    }
}

#[test]
fn immediate_closes_connections_of_a_replaced_certificate() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&[
            "--rotation-close",
            "immediate",
            "--reload-interval",
            "100ms",
        ]),
    );
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(WATCH);
    assert_eq!(watch.read_head().0, 200);

    let renewed = id.dir.path().join("renewed.pem");
    id.issue(&id.key_uri, "CN=alice,O=devs", &renewed);
    let tmp = id.cert.with_extension("new");
    std::fs::copy(&renewed, &tmp).expect("copy");
    std::fs::rename(&tmp, &id.cert).expect("rename");
    ends_within(&mut watch, Duration::from_secs(20), &proxy);

    // The client reconnects and is served under the new certificate.
    let out = proxy.curl_unix(&["--fail"], "/version");
    assert!(out.status.success(), "{}", output_text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let pem = std::fs::read(&renewed).expect("read");
    let block = pem::parse(pem).expect("PEM");
    let (_, c) = x509_parser::parse_x509_certificate(block.contents()).expect("cert");
    assert_eq!(v["serial"], c.raw_serial_as_string().as_str());
}

/// Without any rotation, a watch is closed when the certificate it was opened with expires:
/// nothing goes on under an expired identity.
#[test]
fn a_connection_never_outlives_its_certificate() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    // A certificate that expires in a few seconds, in use before the watch opens.
    proxy.swap_in_short_lived_cert(&id, Duration::from_secs(10));
    let mut watch = RawHttp::connect(&proxy.socket);
    watch.send(WATCH);
    assert_eq!(watch.read_head().0, 200);
    ends_within(&mut watch, Duration::from_secs(30), &proxy);
    assert!(
        proxy
            .log()
            .contains("closing a connection opened with a certificate"),
        "{}",
        proxy.log()
    );
}

/// `--renew` with a certificate past 90 % of its lifetime and a renewal that keeps failing (the
/// stand-in upstream has no CSR API): `/healthz` still answers 200 but says "degraded" with the
/// reason, the failures are counted, and `hwkey doctor` calls the renewal overdue.
#[test]
fn a_failing_renewal_near_expiry_is_reported_as_degraded() {
    let id = Identity::softhsm();
    // NotBefore is backdated 5 minutes: 30 s left is past 90 % of the lifetime.
    id.short_lived_cert(Duration::from_secs(30));
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--renew"]));
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (status, body) = proxy.admin_get("/healthz");
        assert_eq!(status, 200, "{body}");
        if body.starts_with("degraded:") {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "never degraded: {body}\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(body.contains("past 90% of its lifetime"), "{body}");
    assert!(proxy.metric("hwkey_renewals_total{result=\"failed\"}") >= 1.0);
    let doctor = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["doctor", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert),
    );
    assert!(
        output_text(&doctor).contains("renewal: overdue"),
        "{}",
        output_text(&doctor)
    );
}
