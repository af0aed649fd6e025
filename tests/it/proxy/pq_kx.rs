//! Post-quantum key exchange (issue 25, item 4): hwkey offers X25519MLKEM768 first and X25519
//! second, with both key shares in the first ClientHello, so a PQ-capable API server (Go ≥ 1.24,
//! here the stand-in with aws-lc-rs's hybrid first) negotiates the hybrid, and an old one
//! (kube-apiserver 1.20, Go 1.19) gets X25519 without a HelloRetryRequest. `--key-exchange
//! classical` turns the hybrid off.

use support::kube::KubeCluster;
use support::output_text;
use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;

#[test]
fn probe_reports_the_hybrid_from_a_pq_server_and_x25519_without_a_retry_from_an_old_one() {
    let id = Identity::softhsm();
    let pq = TestUpstream::start_pq(&id.ca);
    let text = id.probe(&pq.url(), &[]);
    assert!(text.contains("key exchange: X25519MLKEM768\n"), "{text}");
    let text = id.probe(&pq.url(), &["--key-exchange", "classical"]);
    assert!(text.contains("key exchange: X25519\n"), "{text}");

    let old = TestUpstream::start(&id.ca);
    let text = id.probe(&old.url(), &[]);
    assert!(text.contains("key exchange: X25519\n"), "{text}");
    assert!(!text.contains("HelloRetryRequest"), "{text}");
}

#[test]
fn the_proxy_negotiates_the_hybrid_upstream_unless_told_not_to() {
    let id = Identity::softhsm();
    for (args, want) in [
        (vec![], "X25519MLKEM768"),
        (
            vec!["--key-exchange".to_string(), "classical".to_string()],
            "X25519",
        ),
    ] {
        let upstream = TestUpstream::start_pq(&id.ca);
        let proxy = ProxyProcess::start_with(
            &id,
            &upstream,
            ProxyOptions {
                args,
                ..Default::default()
            },
        );
        for _ in 0..5 {
            let out = proxy.curl_unix(&["-f"], "/version");
            assert!(out.status.success(), "{}", output_text(&out));
        }
        let groups: Vec<String> = upstream
            .stats()
            .connections
            .iter()
            .filter(|c| !c.resumed)
            .map(|c| c.group.clone())
            .collect();
        assert!(
            !groups.is_empty() && groups.iter().all(|g| g == want),
            "want {want}: {groups:?}"
        );
    }
}

#[test]
fn the_real_kube_apiserver_1_20_gets_x25519_without_a_hello_retry() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let text = id.probe(&cluster.url(), &[]);
    assert!(text.contains("key exchange: X25519\n"), "{text}");
    assert!(!text.contains("HelloRetryRequest"), "{text}");
}
