//! Rotating the cluster CA under a running proxy: `--upstream-ca` goes from
//! CA1 to a CA1+CA2 bundle to CA2, re-read on SIGHUP and when the file changes, with no restart
//! and no failed request; a file that no longer parses keeps the previous trust and says so.

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{run_ok, temp_dir, TestCa};

const OK: &str = "hwkey_upstream_ca_reloads_total{result=\"ok\"}";
const REFUSED: &str = "hwkey_upstream_ca_reloads_total{result=\"refused\"}";

/// Waits (at most 20 s) until the proxy has logged `n` reloads that installed a bundle of `cas`
/// certificates. Counting by content, not by the reload counter: a file change seen by the
/// watcher just before a SIGHUP reloads the same bundle twice, so a count of reloads cannot
/// say which bundle is in force.
fn wait_for_bundle(proxy: &ProxyProcess, cas: usize, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let count = || {
        proxy
            .log()
            .lines()
            .filter(|l| {
                l.contains("upstream CA bundle reloaded") && l.contains(&format!("cas={cas}"))
            })
            .count()
    };
    while count() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "no reload #{n} of a {cas}-certificate bundle:\n{}",
            proxy.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Twenty requests, all of which must succeed.
fn all_succeed(proxy: &ProxyProcess, stage: &str) {
    for i in 0..20 {
        let out = proxy.curl_unix(&["-sS", "-w", "\n%{http_code}"], "/version");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            text.ends_with("\n200"),
            "{stage}, request {i}: {text}\n{}",
            proxy.log()
        );
    }
}

#[test]
fn the_upstream_ca_rotates_from_ca1_through_a_bundle_to_ca2_without_a_restart() {
    let id = Identity::softhsm();
    let dir = temp_dir();
    std::fs::create_dir(dir.path().join("ca2")).expect("mkdir");
    let ca2 = TestCa::new(&dir.path().join("ca2"));
    let trust = dir.path().join("trust.pem");
    let write = |pem: String| {
        // Atomically, as a config manager writes it.
        let tmp = dir.path().join("trust.new");
        std::fs::write(&tmp, pem).expect("write");
        std::fs::rename(&tmp, &trust).expect("rename");
    };
    write(id.ca.ca_pem());
    let mut upstream = TestUpstream::start(&id.ca);
    let port = upstream.port();
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            upstream_ca: Some(&trust),
            args: vec!["--reload-interval".into(), "200ms".into()],
            ..Default::default()
        },
    );
    all_succeed(&proxy, "CA1");

    // The bundle of both, announced with SIGHUP.
    write(format!("{}{}", id.ca.ca_pem(), ca2.ca_pem()));
    proxy.signal(libc::SIGHUP);
    wait_for_bundle(&proxy, 2, 1);
    all_succeed(&proxy, "CA1+CA2, served by CA1");
    // The API server moves to a certificate from CA2.
    upstream.stop();
    let upstream = TestUpstream::start_serving(&id.ca, &ca2, port);
    all_succeed(&proxy, "CA1+CA2, served by CA2");

    // CA2 alone: picked up from the file change, no signal.
    write(ca2.ca_pem());
    wait_for_bundle(&proxy, 1, 1);
    all_succeed(&proxy, "CA2");

    // A bundle that no longer parses: the previous trust stays, and the log says so.
    write("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n".into());
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric(REFUSED, 1.0);
    all_succeed(&proxy, "after a broken bundle");
    assert!(
        proxy.log().contains("keeping the previous trust"),
        "{}",
        proxy.log()
    );

    // And the trust really changes: CA1 alone no longer admits the CA2 server.
    write(id.ca.ca_pem());
    wait_for_bundle(&proxy, 1, 2);
    assert!(proxy.metric(OK) >= 3.0, "{}", proxy.metrics());
    let out = proxy.curl_unix(&["-sS", "-w", "\n%{http_code}"], "/version");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.ends_with("\n502"), "{text}");
    drop(upstream);
}

/// A FIFO swapped in at the `--upstream-ca` path does not wedge the proxy: requests, the control
/// socket and `/healthz` keep answering (it says "degraded") and SIGHUP is handled; a symbolic
/// link to `/dev/zero` is refused without being read (the proxy's memory stays small); the
/// real file coming back is trusted again, without a restart. (Before: the watcher opened the
/// FIFO on the runtime's only worker and everything stopped for good; `/dev/zero` was read a
/// gigabyte at a time.)
#[test]
fn a_fifo_or_a_device_at_the_ca_path_neither_wedges_nor_bloats_the_proxy() {
    let id = Identity::softhsm();
    let dir = temp_dir();
    let trust = dir.path().join("trust.pem");
    std::fs::write(&trust, id.ca.ca_pem()).expect("write");
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            upstream_ca: Some(&trust),
            args: vec!["--reload-interval".into(), "100ms".into()],
            ..Default::default()
        },
    );
    all_succeed(&proxy, "before");
    let away = dir.path().join("trust.away");
    std::fs::rename(&trust, &away).expect("move the CA away");
    run_ok(std::process::Command::new("mkfifo").arg(&trust));
    // Several watcher ticks and a SIGHUP with the FIFO in place.
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric(REFUSED, 1.0);
    all_succeed(&proxy, "with a FIFO at the CA path");
    assert!(proxy.credential()["clientCertificatePem"].is_string());
    let body = proxy.wait_for_health(200);
    assert!(
        body.starts_with("degraded:") && body.contains("FIFO"),
        "{body}"
    );

    std::fs::remove_file(&trust).expect("remove the FIFO");
    std::os::unix::fs::symlink("/dev/zero", &trust).expect("symlink");
    let refused = proxy.metric(REFUSED);
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric(REFUSED, refused + 1.0);
    all_succeed(&proxy, "with /dev/zero at the CA path");
    let peak_kib: u64 = std::fs::read_to_string(format!("/proc/{}/status", proxy.guard.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    assert!(
        peak_kib < 200 * 1024,
        "the proxy read the device: peak {peak_kib} KiB"
    );

    // The real bundle back, with one more CA: trusted again, no restart.
    std::fs::remove_file(&trust).expect("remove the link");
    let ca2 = TestCa::new(dir.path());
    std::fs::write(&away, format!("{}{}", id.ca.ca_pem(), ca2.ca_pem())).expect("write");
    std::fs::rename(&away, &trust).expect("bring the CA back");
    wait_for_bundle(&proxy, 2, 1);
    all_succeed(&proxy, "after the file came back");
    // Healthy again once the degraded answer's --health-cache period is over.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while proxy.admin_get("/healthz").1.trim_end() != "ok" {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
