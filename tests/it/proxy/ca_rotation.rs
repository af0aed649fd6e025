//! Rotating the cluster CA under a running proxy: `--upstream-ca` goes from
//! CA1 to a CA1+CA2 bundle to CA2, re-read on SIGHUP and when the file changes, with no restart
//! and no failed request; a file that no longer parses keeps the previous trust and says so.

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{temp_dir, TestCa};

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
