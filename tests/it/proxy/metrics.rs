//! `/metrics` as a Prometheus server sees it: parsed by the reference Python client's strict
//! OpenMetrics parser (Debian's `python3-prometheus-client`), every contract name present with
//! its type, and the values following what the proxy did.

use std::io::Write;
use std::process::{Command, Stdio};

use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::{output_text, require_tool};

/// Every series an operator may alert on, with its OpenMetrics type.
const CONTRACT: [(&str, &str); 17] = [
    ("hwkey_signatures", "counter"),
    ("hwkey_signature_failures", "counter"),
    ("hwkey_upstream_handshakes", "counter"),
    ("hwkey_upstream_errors", "counter"),
    ("hwkey_upstream_handshake_seconds", "histogram"),
    ("hwkey_local_handshake_seconds", "histogram"),
    ("hwkey_connections", "counter"),
    ("hwkey_connections_active", "gauge"),
    ("hwkey_connections_refused", "counter"),
    ("hwkey_bytes", "counter"),
    ("hwkey_cert_reloads", "counter"),
    ("hwkey_loopback_credentials_issued", "counter"),
    ("hwkey_certificate_not_after_timestamp_seconds", "gauge"),
    ("hwkey_certificate_remaining_seconds", "gauge"),
    ("hwkey_renewals", "counter"),
    ("hwkey_renewal_failures", "counter"),
    ("hwkey_renewal_last_success_timestamp_seconds", "gauge"),
];

/// Parses an exposition with `prometheus_client.openmetrics.parser` (which rejects anything
/// that is not valid OpenMetrics) and returns `{family: {"type": …, "samples": {series: value}}}`.
fn parse_openmetrics(text: &str) -> serde_json::Value {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    samples = {}
    for s in fam.samples:
        labels = ",".join('%s="%s"' % kv for kv in sorted(s.labels.items()))
        samples[s.name + ("{" + labels + "}" if labels else "")] = s.value
    out[fam.name] = {"type": fam.type, "samples": samples}
print(json.dumps(out))
"#;
    require_tool("/usr/bin/python3", "python3-prometheus-client");
    let mut child = Command::new("/usr/bin/python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run /usr/bin/python3");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write the exposition");
    let out = child.wait_with_output().expect("python3");
    assert!(
        out.status.success(),
        "the OpenMetrics parser rejected /metrics (is python3-prometheus-client installed?): {}\n--- exposition ---\n{text}",
        output_text(&out)
    );
    serde_json::from_slice(&out.stdout).expect("parser output is JSON")
}

#[test]
fn metrics_parse_as_openmetrics_with_the_contract_names_and_live_values() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for _ in 0..3 {
        let out = proxy.curl_unix(&[], "/version");
        assert!(out.status.success(), "{}", output_text(&out));
    }
    // The connections made ahead after the second client and the third are done: no handshake
    // is counted while the exposition is written (its counter read before it, its latency
    // after).
    proxy.wait_for_metric("hwkey_upstream_spares_total{event=\"made\"}", 2.0);

    let families = parse_openmetrics(&proxy.metrics());
    for (name, kind) in CONTRACT {
        assert_eq!(
            families[name]["type"], kind,
            "{name} missing or of the wrong type in {families:#}"
        );
    }
    let sample = |family: &str, series: &str| -> f64 {
        families[family]["samples"][series]
            .as_f64()
            .unwrap_or_else(|| panic!("no sample {series} in {family}: {families:#}"))
    };
    // Three requests over the UNIX socket; with resumption at most one full handshake signs.
    assert_eq!(
        sample(
            "hwkey_connections",
            "hwkey_connections_total{listener=\"unix\"}"
        ),
        3.0
    );
    let signatures = sample("hwkey_signatures", "hwkey_signatures_total");
    assert!((1.0..=3.0).contains(&signatures), "{signatures}");
    assert_eq!(
        sample("hwkey_signature_failures", "hwkey_signature_failures_total"),
        0.0
    );
    let handshakes = sample(
        "hwkey_upstream_handshakes",
        "hwkey_upstream_handshakes_total{resumed=\"false\"}",
    ) + sample(
        "hwkey_upstream_handshakes",
        "hwkey_upstream_handshakes_total{resumed=\"true\"}",
    );
    assert!(handshakes >= 1.0, "{handshakes}");
    assert_eq!(
        sample(
            "hwkey_upstream_handshake_seconds",
            "hwkey_upstream_handshake_seconds_count{resumed=\"false\"}"
        ) + sample(
            "hwkey_upstream_handshake_seconds",
            "hwkey_upstream_handshake_seconds_count{resumed=\"true\"}"
        ),
        handshakes,
        "one latency observation per handshake"
    );
    // Every refusal reason is present before the first refusal, so alerts have a series.
    assert_eq!(
        sample(
            "hwkey_connections_refused",
            "hwkey_connections_refused_total{reason=\"busy\"}"
        ),
        0.0
    );
    // Issue 23: every renewal failure reason is a series from the start, the two the old
    // hand-kept list missed (`capped`, `refused_upstream`) included.
    for reason in [
        "denied",
        "failed",
        "timeout",
        "api",
        "bad_certificate",
        "capped",
        "refused_upstream",
        "install",
        "key",
        "other",
    ] {
        assert_eq!(
            sample(
                "hwkey_renewal_failures",
                &format!("hwkey_renewal_failures_total{{reason=\"{reason}\"}}")
            ),
            0.0
        );
    }
    let remaining = sample(
        "hwkey_certificate_remaining_seconds",
        "hwkey_certificate_remaining_seconds",
    );
    assert!(
        remaining > 3600.0,
        "test certificate expires soon? {remaining}"
    );
}

/// An admin port on a network address (`--unsafe-listen`) checked no `Host` at all: its uid
/// check admits the user's browser on the same machine, so a web page whose name was rebound
/// to the machine's address read `/metrics` there. Now a request naming a DNS name is refused
/// (421); one naming an IP address (a scraper's usual target) or localhost is answered.
#[cfg(feature = "pkcs11")]
#[test]
fn an_admin_port_on_a_network_address_refuses_requests_for_a_dns_name() {
    require_tool("curl", "curl");
    // The machine's own address on its default route (a UDP "connect" sends nothing).
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp");
    probe
        .connect("192.0.2.1:9")
        .expect("this test needs a network interface with a default route besides loopback");
    let ip = probe.local_addr().expect("local address").ip();
    assert!(
        !ip.is_loopback() && !ip.is_unspecified(),
        "this test needs a non-loopback address, found {ip}"
    );
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = support::temp_dir();
    let port = support::free_port();
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        support::proxy::ProxyOptions {
            bare: true,
            args: vec![
                "--key".into(),
                id.key_uri.clone(),
                "--cert".into(),
                id.cert.display().to_string(),
                "--upstream".into(),
                upstream.url(),
                "--upstream-ca".into(),
                id.ca.ca_path().display().to_string(),
                "--listen".into(),
                format!("unix:{}", dir.path().join("p.sock").display()),
                "--admin".into(),
                format!("tcp:0.0.0.0:{port}"),
                "--unsafe-listen".into(),
                "--state-dir".into(),
                dir.path().join("state").display().to_string(),
            ],
            ..Default::default()
        },
    );
    let code = |host: &str| {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "20",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .args(["-H", &format!("Host: {host}")])
            .arg(format!("http://{ip}:{port}/metrics"))
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for host in [
        "evil.example",
        &format!("evil.example:{port}"),
        "10.0.0.1.evil",
    ] {
        assert_eq!(
            code(host),
            "421",
            "Host: {host} was answered\n{}",
            proxy.log()
        );
    }
    for host in [format!("{ip}:{port}"), format!("localhost:{port}")] {
        assert_ne!(
            code(&host),
            "421",
            "Host: {host} was refused\n{}",
            proxy.log()
        );
    }
}

/// The loopback admin port answers only requests for a loopback host. Its uid check admits a
/// browser (it runs as the user), so a web page whose name was rebound to 127.0.0.1 (DNS
/// rebinding) read `/metrics` and `/healthz`'s reasons: the same request with the page's own
/// name in `Host` is refused now (421), with a loopback name it is answered (curl, Prometheus).
#[test]
fn the_admin_port_answers_only_requests_for_a_loopback_host() {
    require_tool("curl", "curl");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let get = |host: Option<&str>, path: &str| {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--max-time", "20", "-w", "\n%{http_code}"]);
        if let Some(h) = host {
            cmd.args(["-H", &format!("Host: {h}")]);
        }
        let out = cmd
            .arg(format!("http://127.0.0.1:{}{path}", proxy.admin_port))
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.to_string(), body.to_string())
    };
    for host in [
        "evil.example",
        "evil.example:80",
        "127.0.0.1.evil.example",
        "[::2]:1",
    ] {
        for path in ["/metrics", "/healthz"] {
            let (code, body) = get(Some(host), path);
            assert_eq!(code, "421", "Host: {host} {path} was answered: {body}");
            assert!(
                !body.contains("hwkey_") && body.contains("localhost"),
                "{body}"
            );
        }
    }
    let port = proxy.admin_port.to_string();
    for host in [
        None,
        Some("localhost".to_string()),
        Some(format!("localhost.:{port}")),
        Some(format!("LOCALHOST:{port}")),
        Some(format!("127.0.0.1:{port}")),
        Some(format!("[::1]:{port}")),
    ] {
        let (code, body) = get(host.as_deref(), "/metrics");
        assert_eq!(code, "200", "Host: {host:?}: {body}");
        assert!(body.contains("hwkey_"), "{body}");
    }
    // HTTP/1.0 with no Host at all: answered.
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            "--http1.0",
            "-H",
            "Host:",
            "-w",
            "\n%{http_code}",
        ])
        .arg(format!("http://127.0.0.1:{}/metrics", proxy.admin_port))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.ends_with("\n200") && text.contains("hwkey_"), "{text}");
}
