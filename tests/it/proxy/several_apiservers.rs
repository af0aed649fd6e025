//! Several API servers (issue 25, item 2): two real kube-apiservers on one etcd, as an HA
//! control plane has them, both given to one proxy (`--upstream` twice). kubectl commands run
//! through the proxy while one API server is killed and later started again: no command fails
//! after one retry (a request in flight on the killed server may fail once, as it would
//! against any load balancer), the endpoint's state shows in `/metrics`, and the returning
//! server is used again.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::kube::KubeCluster;
use support::kubectl::require_kubectl;
use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{output_text, temp_dir};

/// Commands kubectl runs in a row (a count, not a duration).
const COMMANDS: usize = 40;

/// `GET /version` over the proxy's UNIX socket (curl), answered 200 (request `i` in the
/// failure's message).
fn version_is_served(proxy: &ProxyProcess, i: usize) {
    let out = proxy.curl_unix(&["-sS", "-w", "\n%{http_code}"], "/version");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.ends_with("\n200"),
        "request {i}: {text}\n{}",
        proxy.log()
    );
}

fn endpoint(series: &str, port: u16) -> String {
    format!("{series}{{endpoint=\"127.0.0.1:{port}\"}}")
}

#[test]
fn one_of_two_real_apiservers_killed_and_back_costs_no_kubectl_command() {
    require_kubectl();
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let mut second = cluster.another_apiserver();
    let proxy = ProxyProcess::start_to(
        &id,
        &cluster.url(),
        ProxyOptions {
            args: vec!["--upstream".into(), second.url()],
            ..Default::default()
        },
    );
    let dir = temp_dir();
    let (ca, cert, key) = proxy.credential_files(dir.path());
    let kubectl = || {
        let mut cmd = Command::new("kubectl");
        cmd.env("KUBECONFIG", "/dev/null")
            .env("HOME", dir.path())
            .args(["--server", &proxy.tls_url(), "--certificate-authority"])
            .arg(&ca)
            .arg("--client-certificate")
            .arg(&cert)
            .arg("--client-key")
            .arg(&key)
            .args(["get", "--raw", "/version", "--request-timeout=20s"]);
        cmd
    };
    // A command that fails is retried once; a second failure is a failure.
    let run = || -> Result<(), String> {
        let first = kubectl().output().expect("kubectl");
        if first.status.success() {
            return Ok(());
        }
        let again = kubectl().output().expect("kubectl");
        if again.status.success() {
            return Ok(());
        }
        Err(format!("{}\n{}", output_text(&first), output_text(&again)))
    };
    let (p1, p2) = (cluster.port, second.port);
    let conns = "hwkey_upstream_endpoint_connections_total";
    for _ in 0..6 {
        run().unwrap_or_else(|e| panic!("{e}\n{}", proxy.log()));
    }
    assert!(
        proxy.metric(&endpoint(conns, p1)) >= 1.0 && proxy.metric(&endpoint(conns, p2)) >= 1.0,
        "round robin did not use both:\n{}",
        proxy.metrics()
    );

    // Commands keep running while the second API server is killed.
    let running = AtomicBool::new(true);
    let failures: Vec<String> = std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let mut failures = Vec::new();
            let mut n = 0;
            while n < COMMANDS || running.load(Ordering::Relaxed) {
                if let Err(e) = run() {
                    failures.push(e);
                }
                n += 1;
            }
            failures
        });
        std::thread::sleep(Duration::from_millis(300));
        second.kill();
        // The proxy notices (a connection to it fails) and marks it down.
        let deadline = Instant::now() + Duration::from_secs(30);
        while proxy.metric(&endpoint("hwkey_upstream_endpoint_up", p2)) != 0.0 {
            assert!(Instant::now() < deadline, "{}", proxy.metrics());
            std::thread::sleep(Duration::from_millis(100));
        }
        running.store(false, Ordering::Relaxed);
        worker.join().expect("kubectl thread")
    });
    assert!(
        failures.is_empty(),
        "{} kubectl commands failed twice:\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        proxy.log()
    );
    assert!(proxy.metric(&endpoint("hwkey_upstream_endpoint_failures_total", p2)) >= 1.0);
    assert_eq!(
        proxy.metric(&endpoint("hwkey_upstream_endpoint_up", p1)),
        1.0
    );

    // Back on its port: used again once its backoff has passed.
    second.start();
    let before = proxy.metric(&endpoint(conns, p2));
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.metric(&endpoint(conns, p2)) <= before {
        assert!(
            Instant::now() < deadline,
            "the returning API server is not used again:\n{}",
            proxy.metrics()
        );
        run().unwrap_or_else(|e| panic!("{e}\n{}", proxy.log()));
    }
    assert_eq!(
        proxy.metric(&endpoint("hwkey_upstream_endpoint_up", p2)),
        1.0
    );
}

/// A peer that lies: of two `--upstream`s, one presents a certificate the trust does not hold
/// (another CA's, as an impostor on the network would). Every request is still answered, all
/// by the genuine API server: the impostor's handshakes fail, it is marked down, and it never
/// completes a handshake (so never gets a request, nor the client certificate's signature
/// over a finished transcript).
#[test]
fn an_upstream_with_an_untrusted_certificate_is_never_used() {
    let id = Identity::softhsm();
    let dir = temp_dir();
    std::fs::create_dir(dir.path().join("other-ca")).expect("mkdir");
    let other_ca = support::TestCa::new(&dir.path().join("other-ca"));
    let genuine = TestUpstream::start(&id.ca);
    let impostor = TestUpstream::start_serving(&id.ca, &other_ca, 0);
    let proxy = ProxyProcess::start_to(
        &id,
        &impostor.url(),
        ProxyOptions {
            args: vec!["--upstream".into(), genuine.url()],
            ..Default::default()
        },
    );
    for i in 0..20 {
        version_is_served(&proxy, i);
    }
    assert!(
        impostor.stats().connections.is_empty(),
        "a handshake with the impostor completed"
    );
    // Every connection the proxy counts is one the genuine API server completed (a connection
    // made ahead for the next client may still be finishing its handshake: waited for).
    let counted = || {
        let p = genuine.port();
        proxy.metric(&endpoint("hwkey_upstream_endpoint_connections_total", p))
    };
    // First the connection made ahead after the last client: counted by the proxy the moment
    // its handshake ends, it could otherwise land between an equal read and the assertion.
    let spares =
        |event: &str| proxy.metric(&format!("hwkey_upstream_spares_total{{event=\"{event}\"}}"));
    let in_stock = || spares("made") - spares("used") - spares("expired") - spares("dropped");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while in_stock() < 1.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while genuine.stats().connections.len() as f64 != counted()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(genuine.stats().connections.len() as f64, counted());
    assert!(
        proxy.metric(&endpoint(
            "hwkey_upstream_endpoint_failures_total",
            impostor.port()
        )) >= 1.0
    );
}

/// Issue 35, finding "renewal uses only the first --upstream": with the first API server gone
/// for good, the proxied traffic went to the second but every renewal went to the first and
/// failed until the certificate expired (on 1e6941c: no renewal in 60 s, each attempt
/// "cannot connect"). Now a renewal tries the servers in the order traffic does and is issued
/// by the one that answers; the unreachable one is marked down.
#[test]
fn renewal_goes_to_an_api_server_that_answers() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let work = temp_dir();
    // A node certificate an hour into its lifetime with 150 s left: renewal is due at once.
    let csr = support::run_ok(support::hwkey().envs(id.envs()).args([
        "csr",
        "--key",
        &id.key_uri,
        "--subject",
        "CN=system:node:node-r,O=system:nodes",
    ]));
    let pem = id.ca.sign_csr_pem_window(
        &String::from_utf8(csr.stdout).expect("UTF-8"),
        Duration::from_secs(3600),
        Duration::from_secs(150),
    );
    let cert = work.path().join("node-r.pem");
    std::fs::write(&cert, &pem).expect("write cert");
    let gone = format!("https://127.0.0.1:{}", support::free_port());
    let proxy = ProxyProcess::start_to(
        &id,
        &gone,
        ProxyOptions {
            args: vec!["--upstream".into(), cluster.url(), "--renew".into()],
            cert: Some(&cert),
            ..Default::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.metric("hwkey_renewals_total{result=\"ok\"}") < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no renewal in 60 s with one of two API servers up:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_ne!(
        std::fs::read_to_string(&cert).expect("cert"),
        pem,
        "the renewed certificate is written in place:\n{}",
        proxy.log()
    );
}

/// Issue 55: a UNIX client's connection is opened on the relay loop that accepts it, with a
/// resumed handshake to the API server whose turn it is. When that attempt fails (the API
/// server went away: connection refused), the client is not lost: a connection thread tries
/// the other API server, the failed one is marked down, and the failure is counted once (the
/// endpoint is not tried a second time for the same client).
#[test]
fn a_unix_client_whose_loop_cannot_reach_its_api_server_is_served_by_the_other() {
    let id = Identity::softhsm();
    let mut first = TestUpstream::start(&id.ca);
    let second = TestUpstream::start(&id.ca);
    // Nothing made ahead: every client's connection is the loop's own attempt.
    let proxy = ProxyProcess::start_to(
        &id,
        &first.url(),
        ProxyOptions::args(&["--upstream", &second.url(), "--no-preconnect"]),
    );
    let ask = |i: usize| version_is_served(&proxy, i);
    // Both API servers' full handshakes, then resumed ones on the loops, taking turns.
    for i in 0..8 {
        ask(i);
    }
    let on_loop = "hwkey_unix_connections_opened_total{on=\"relay_loop\"}";
    let on_thread = "hwkey_unix_connections_opened_total{on=\"connection_thread\"}";
    let looped = proxy.metric(on_loop);
    assert!(
        looped >= 4.0,
        "{looped} of 8 connections opened on a relay loop: the loops' path is not what is tested\n{}",
        proxy.metrics()
    );
    assert!(first.stats().connections.len() >= 2 && second.stats().connections.len() >= 2);
    let threads = proxy.metric(on_thread);
    first.stop();
    let refused = "hwkey_upstream_errors_total{stage=\"connect\"}";
    // Until one client's loop has met the stopped API server (one of two in turn) and one
    // has been opened on a loop with the other; each check right after the request that made
    // it true, so no other request stands between (a second one more than a second later
    // would find the stopped API server due back and try it again).
    let (mut failed, mut back_on_loops, mut at_failure) = (false, false, looped);
    for i in 8..16 {
        ask(i);
        if !failed && proxy.metric(refused) >= 1.0 {
            failed = true;
            at_failure = proxy.metric(on_loop);
            assert_eq!(
                proxy.metric(refused),
                1.0,
                "the API server that went away is tried once for the client, then marked down\n{}",
                proxy.metrics()
            );
            assert_eq!(
                proxy.metric(&endpoint("hwkey_upstream_endpoint_up", first.port())),
                0.0
            );
            assert!(
                proxy.metric(on_thread) > threads,
                "the client whose loop failed went on on a connection thread\n{}",
                proxy.metrics()
            );
        } else if failed && proxy.metric(on_loop) > at_failure {
            back_on_loops = true;
            break;
        }
    }
    assert!(
        failed && back_on_loops,
        "after the API server went away: its failure seen {failed}, clients opened on the \
         loops again {back_on_loops}\n{}",
        proxy.metrics()
    );
}
