//! `hwkey proxy` moves bytes faithfully: curl over the UNIX socket (HTTP/1.1 and h2 prior
//! knowledge) and over loopback TLS with a loopback credential (ALPN h2 / http/1.1) reaches the
//! test API server with the hardware identity and the client's protocol; 64 MiB each way
//! intact; watch events arrive as they happen; an Upgrade echoes; 200 concurrent connections.
//! Real SoftHSM and swtpm keys, real rustls/hyper upstream, real curl.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::io::{Read, Write};
use std::sync::{Arc, Barrier};

use support::proxy::{Identity, ProxyProcess, RawHttp};
use support::upstream::{pattern_byte, TestUpstream};
use support::*;

proxy_tests_on_both_backends!(
    unix_socket_http1_and_h2_prior_knowledge,
    loopback_tls_with_a_loopback_credential_propagates_alpn,
    self_subject_review_shows_the_hardware_identity,
    sixty_four_mib_each_way_intact,
    watch_events_arrive_as_they_happen,
    upgrade_echoes_through,
    two_hundred_concurrent_connections,
);

fn setup(identity: fn() -> Identity) -> (Identity, TestUpstream, ProxyProcess) {
    require_tool("curl", "curl");
    let id = identity();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    (id, upstream, proxy)
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "curl failed: {}", output_text(out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", output_text(out)))
}

fn unix_socket_http1_and_h2_prior_knowledge(identity: fn() -> Identity) {
    let (_id, upstream, proxy) = setup(identity);

    let v = json(&proxy.curl_unix(&[], "/version"));
    assert_eq!(v["user"], "alice", "{v}");
    assert_eq!(v["protocol"], "HTTP/1.1", "{v}");
    let s = upstream.stats();
    let last = s.connections.last().expect("upstream saw a connection");
    assert_eq!(last.protocol, "http/1.1");
    assert_eq!(last.cn, "alice");
    assert_eq!(last.orgs, vec!["devs"]);

    let v = json(&proxy.curl_unix(&["--http2-prior-knowledge"], "/version"));
    assert_eq!(v["user"], "alice", "{v}");
    assert_eq!(v["protocol"], "HTTP/2.0", "{v}");
    let s = upstream.stats();
    assert_eq!(s.connections.last().expect("record").protocol, "h2");
    assert_eq!(
        s.connections.len(),
        2,
        "one upstream connection per client connection"
    );
}

fn loopback_tls_with_a_loopback_credential_propagates_alpn(identity: fn() -> Identity) {
    let (_id, upstream, proxy) = setup(identity);
    let dir = temp_dir();
    let cred = proxy.credential_files(dir.path());
    let c = proxy.credential();
    assert_eq!(c["server"], proxy.tls_url());
    assert!(c["expirationTimestamp"]
        .as_str()
        .is_some_and(|t| t.ends_with('Z')));

    // curl offers h2 and http/1.1; the upstream picks h2 and so does the client.
    let out = proxy.curl_tls(&cred, &["-w", "\n%{http_version}"], "/version");
    assert!(out.status.success(), "{}", output_text(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, version) = text.rsplit_once('\n').expect("version line");
    assert_eq!(version, "2", "{text}");
    let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
    assert_eq!(v["user"], "alice");
    assert_eq!(
        upstream
            .stats()
            .connections
            .last()
            .expect("record")
            .protocol,
        "h2"
    );

    // A client that offers only http/1.1 gets http/1.1 on both hops.
    let v = json(&proxy.curl_tls(&cred, &["--http1.1"], "/version"));
    assert_eq!(v["protocol"], "HTTP/1.1");
    assert_eq!(
        upstream
            .stats()
            .connections
            .last()
            .expect("record")
            .protocol,
        "http/1.1"
    );
}

fn self_subject_review_shows_the_hardware_identity(identity: fn() -> Identity) {
    let (_id, _upstream, proxy) = setup(identity);
    let v = json(&proxy.curl_unix(
        &[
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "-d",
            "{}",
        ],
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
    ));
    assert_eq!(v["kind"], "SelfSubjectReview");
    assert_eq!(v["status"]["userInfo"]["username"], "alice");
    let groups: Vec<&str> = v["status"]["userInfo"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .filter_map(|g| g.as_str())
        .collect();
    assert_eq!(groups, vec!["devs", "system:authenticated"]);
}

fn sha256_file(path: &std::path::Path) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    ctx.finish().as_ref().to_vec()
}

const BULK: u64 = 64 * 1024 * 1024;

fn sixty_four_mib_each_way_intact(identity: fn() -> Identity) {
    let (_id, _upstream, proxy) = setup(identity);
    let dir = temp_dir();

    // Up and down at once: POST /echo streams the body back (UNIX socket, HTTP/1.1).
    let input = dir.path().join("in.bin");
    {
        use ring::rand::SecureRandom;
        let rng = ring::rand::SystemRandom::new();
        let mut f = std::io::BufWriter::new(std::fs::File::create(&input).expect("create"));
        let mut chunk = vec![0u8; 1 << 20];
        for _ in 0..(BULK >> 20) {
            rng.fill(&mut chunk).expect("random");
            f.write_all(&chunk).expect("write");
        }
        f.flush().expect("flush");
    }
    let echoed = dir.path().join("echoed.bin");
    let out = proxy.curl_unix(
        &[
            "--fail",
            "-H",
            "Expect:",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            &format!("@{}", input.display()),
            "-o",
            echoed.to_str().expect("utf-8"),
        ],
        "/echo",
    );
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(std::fs::metadata(&echoed).expect("echoed").len(), BULK);
    assert_eq!(sha256_file(&input), sha256_file(&echoed), "echo differs");

    // Down over loopback TLS (h2): 64 MiB of the known pattern.
    let cred = proxy.credential_files(dir.path());
    let down = dir.path().join("down.bin");
    let out = proxy.curl_tls(
        &cred,
        &["--fail", "-o", down.to_str().expect("utf-8")],
        &format!("/bytes?n={BULK}"),
    );
    assert!(out.status.success(), "{}", output_text(&out));
    let mut expected = ring::digest::Context::new(&ring::digest::SHA256);
    let mut chunk = Vec::with_capacity(1 << 20);
    let mut i = 0u64;
    while i < BULK {
        chunk.clear();
        let end = (i + (1 << 20)).min(BULK);
        chunk.extend((i..end).map(pattern_byte));
        expected.update(&chunk);
        i = end;
    }
    assert_eq!(std::fs::metadata(&down).expect("down").len(), BULK);
    assert_eq!(
        sha256_file(&down),
        expected.finish().as_ref(),
        "download differs"
    );

    // Added when a bridged connection ends, which may follow the client's last read.
    proxy.wait_for_metric("hwkey_bytes_total{direction=\"up\"}", BULK as f64);
    proxy.wait_for_metric("hwkey_bytes_total{direction=\"down\"}", 2.0 * BULK as f64);
}

fn watch_events_arrive_as_they_happen(identity: fn() -> Identity) {
    let (_id, upstream, proxy) = setup(identity);
    let mut http = RawHttp::connect(&proxy.socket);
    http.send(
        "GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    let (status, headers) = http.read_head();
    assert_eq!(status, 200);
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v == "chunked"),
        "{headers:?}"
    );
    for _ in 0..3 {
        let n = upstream.emit_watch_event();
        // The next event is not emitted yet, so seeing this one proves it was delivered as it
        // happened.
        let event = http.read_watch_event(n);
        assert_eq!(event["type"], "ADDED");
    }
}

fn upgrade_echoes_through(identity: fn() -> Identity) {
    let (_id, _upstream, proxy) = setup(identity);
    let mut http = RawHttp::connect(&proxy.socket);
    http.send(
        "GET /upgrade HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: hwkey-echo\r\n\r\n",
    );
    let (status, headers) = http.read_head();
    assert_eq!(status, 101, "{headers:?}");
    assert!(headers
        .iter()
        .any(|(k, v)| k == "upgrade" && v == "hwkey-echo"));
    let mut payload = vec![0u8; 1 << 20];
    for (i, b) in payload.iter_mut().enumerate() {
        *b = (i * 7 % 256) as u8;
    }
    let mut writer = http.reader.get_ref().try_clone().expect("clone");
    let send = payload.clone();
    let t = std::thread::spawn(move || writer.write_all(&send).expect("write upgraded"));
    let mut back = vec![0u8; payload.len()];
    http.reader.read_exact(&mut back).expect("read echo");
    t.join().expect("writer");
    assert!(back == payload, "echoed bytes differ");
}

fn two_hundred_concurrent_connections(identity: fn() -> Identity) {
    let (_id, upstream, proxy) = setup(identity);
    const N: usize = 200;
    let all_served = Arc::new(Barrier::new(N + 1));
    let release = Arc::new(Barrier::new(N + 1));
    let mut threads = Vec::new();
    for _ in 0..N {
        let socket = proxy.socket.clone();
        let all_served = all_served.clone();
        let release = release.clone();
        threads.push(std::thread::spawn(move || {
            let mut http = RawHttp::connect(&socket);
            http.send("GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n");
            let (status, body) = http.read_response();
            all_served.wait();
            release.wait();
            (status, body)
        }));
    }
    all_served.wait();
    // Every connection is open and has been answered.
    let active = proxy.metric("hwkey_connections_active");
    release.wait();
    let mut ok = 0;
    for t in threads {
        let (status, body) = t.join().expect("client thread");
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"user\":\"alice\""), "{body}");
        ok += 1;
    }
    assert_eq!(ok, N);
    assert!(active >= N as f64, "hwkey_connections_active was {active}");
    // One upstream connection each, and perhaps one made ahead for a next client.
    let made = upstream.stats().connections.len();
    assert!(
        (N..=N + 1).contains(&made),
        "{made} upstream connections for {N} clients"
    );
    // A burst at a cold proxy: one connection makes the full (signed) handshake, the others
    // wait for its session ticket and resume.
    let stats = upstream.stats();
    assert!(
        proxy.signatures() <= 3,
        "{N} concurrent cold connections cost {} hardware signatures (upstream: {} full, {} resumed)",
        proxy.signatures(),
        stats.full(),
        stats.resumed()
    );
}

/// Vanilla kubectl, with a kubeconfig holding only a loopback credential, sees the hardware
/// identity (`kubectl auth whoami` posts a SelfSubjectReview through the proxy).
#[cfg(feature = "pkcs11")]
#[test]
fn kubectl_auth_whoami_through_loopback_tls() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let (_id, upstream, proxy) = setup(Identity::softhsm);
    let dir = temp_dir();
    let c = proxy.credential();
    let b64 = |field: &str| {
        use std::process::Stdio;
        let mut child = std::process::Command::new("base64")
            .arg("-w0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("base64");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(c[field].as_str().expect("field").as_bytes())
            .expect("write");
        String::from_utf8(child.wait_with_output().expect("base64").stdout).expect("utf-8")
    };
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hw\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: hw\n  user:\n    client-certificate-data: {cert}\n    client-key-data: {key}\ncontexts:\n- name: hw\n  context: {{cluster: hw, user: hw}}\ncurrent-context: hw\n",
            server = proxy.tls_url(),
            ca = b64("certificateAuthorityPem"),
            cert = b64("clientCertificatePem"),
            key = b64("clientKeyPem"),
        ),
    )
    .expect("write kubeconfig");
    let out = run_ok(
        std::process::Command::new("kubectl")
            .env("KUBECONFIG", &kubeconfig)
            .args(["auth", "whoami", "-o", "json"]),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["status"]["userInfo"]["username"], "alice", "{v}");
    // client-go speaks h2 when offered: the upstream saw h2 from the proxy.
    assert!(
        upstream.stats().with_protocol("h2") >= 1,
        "{:?}",
        upstream.stats()
    );
}
