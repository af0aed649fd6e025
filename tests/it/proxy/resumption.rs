//! Few hardware signatures: thirty sequential new client connections through `hwkey proxy`
//! cost at most three signatures (read from `/metrics`), because the upstream connections
//! resume TLS 1.3 sessions; the upstream itself reports the resumed handshakes and still sees
//! the hardware identity on them. Counts, not timings.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use support::proxy::{metric_in, Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

const CONNECTIONS: usize = 30;
const MAX_SIGNATURES: u64 = 3;

fn check_resumption(identity: fn() -> Identity, over_tls: bool) {
    require_tool("curl", "curl");
    let id = identity();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let dir = temp_dir();
    let cred = proxy.credential_files(dir.path());

    let before = proxy.signatures();
    for i in 0..CONNECTIONS {
        let out = if over_tls {
            proxy.curl_tls(&cred, &["--fail"], "/version")
        } else {
            proxy.curl_unix(&["--fail"], "/version")
        };
        assert!(
            out.status.success(),
            "connection {i}: {}",
            output_text(&out)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["user"], "alice", "connection {i}: {v}");
    }
    let m = proxy.metrics();
    let used = metric_in(&m, "hwkey_signatures_total") as u64 - before;
    let resumed = metric_in(&m, "hwkey_upstream_handshakes_total{resumed=\"true\"}");
    let full = metric_in(&m, "hwkey_upstream_handshakes_total{resumed=\"false\"}");
    eprintln!(
        "{CONNECTIONS} connections ({}): {used} signatures, {full} full / {resumed} resumed handshakes",
        if over_tls { "loopback TLS" } else { "UNIX socket" }
    );
    assert!(
        used <= MAX_SIGNATURES,
        "{CONNECTIONS} connections cost {used} signatures (at most {MAX_SIGNATURES} allowed)"
    );
    // Clients one after another: the proxy made a connection ahead for each next one
    // (proxy::spare); the last may still be held (or being made), for a client that has not
    // come. Never more than that one.
    let within = CONNECTIONS as f64..=(CONNECTIONS + 1) as f64;
    assert!(
        within.contains(&(resumed + full)),
        "{resumed} + {full} handshakes"
    );

    let s = upstream.stats();
    assert!(
        (CONNECTIONS..=CONNECTIONS + 1).contains(&s.connections.len()),
        "{} upstream connections for {CONNECTIONS} clients",
        s.connections.len()
    );
    assert!(
        s.resumed() >= CONNECTIONS - MAX_SIGNATURES as usize,
        "upstream saw {} resumed of {CONNECTIONS}",
        s.resumed()
    );
    assert!(
        s.connections.iter().all(|c| c.cn == "alice"),
        "a resumed connection lost the client identity: {:?}",
        s.connections
    );
}

proxy_tests_on_both_backends!(
    thirty_unix_socket_connections_cost_at_most_three_signatures,
    thirty_loopback_tls_connections_cost_at_most_three_signatures,
);

fn thirty_unix_socket_connections_cost_at_most_three_signatures(identity: fn() -> Identity) {
    check_resumption(identity, false);
}

fn thirty_loopback_tls_connections_cost_at_most_three_signatures(identity: fn() -> Identity) {
    check_resumption(identity, true);
}
