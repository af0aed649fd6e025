//! The proxy between foreign peers: nginx (`ssl_verify_client on`) as the upstream, and
//! `openssl s_client` as the local client on the loopback TLS listener.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::io::Write;
use std::process::{Command, Stdio};

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{output_text, temp_dir, Nginx};

/// nginx verifies the hardware client certificate and reports it; after the first connection
/// the proxy resumes TLS sessions with nginx, so more connections cost no signature.
fn nginx_upstream(identity: fn() -> Identity) {
    let id = identity();
    let dir = temp_dir();
    let (cert, key) = id.ca.server_cert(dir.path());
    let nginx = Nginx::start(&id.ca.ca_path(), &cert, &key);
    let proxy = ProxyProcess::start_to(&id, &nginx.url(), ProxyOptions::default());
    for _ in 0..5 {
        let out = proxy.curl_unix(&["--fail"], "/");
        let text = output_text(&out);
        assert!(out.status.success(), "{text}\n{}", proxy.log());
        assert!(
            text.contains("client=O=devs,CN=alice proto=TLSv1.3"),
            "nginx saw: {text}"
        );
    }
    assert!(
        proxy.signatures() <= 2,
        "5 connections to nginx cost {} signatures:\n{}",
        proxy.signatures(),
        proxy.metrics()
    );
    assert!(proxy.metric("hwkey_upstream_handshakes_total{resumed=\"true\"}") >= 3.0);
}

#[cfg(feature = "pkcs11")]
#[test]
fn nginx_as_upstream_softhsm() {
    nginx_upstream(Identity::softhsm);
}

#[cfg(feature = "tpm")]
#[test]
fn nginx_as_upstream_tpm() {
    nginx_upstream(Identity::tpm);
}

/// `openssl s_client` with a loopback credential gets through; without one it is refused and
/// the upstream sees nothing.
#[cfg(feature = "pkcs11")]
#[test]
fn openssl_s_client_as_local_client() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let dir = temp_dir();
    let (ca, cert, key) = proxy.credential_files(dir.path());
    let s_client = |with_cert: bool| {
        let mut cmd = Command::new("openssl");
        cmd.args(["s_client", "-connect"])
            .arg(format!("127.0.0.1:{}", proxy.tcp_port))
            .arg("-CAfile")
            .arg(&ca)
            .args(["-alpn", "http/1.1", "-quiet", "-verify_return_error"]);
        if with_cert {
            cmd.arg("-cert").arg(&cert).arg("-key").arg(&key);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("openssl s_client");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(b"GET /version HTTP/1.1\r\nHost: kube\r\nConnection: close\r\n\r\n")
            .expect("write request");
        child.wait_with_output().expect("s_client output")
    };
    let refused = s_client(false);
    assert!(
        !String::from_utf8_lossy(&refused.stdout).contains("alice"),
        "{}",
        output_text(&refused)
    );
    assert_eq!(upstream.stats().tcp_connections, 0, "upstream saw nothing");
    let ok = s_client(true);
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(
        text.contains("200 OK") && text.contains("\"user\":\"alice\""),
        "{}",
        output_text(&ok)
    );
}
