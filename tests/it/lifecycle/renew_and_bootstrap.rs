//! The certificate lifecycle against a real kube-apiserver + kube-controller-manager 1.20
//! (built from Debian 12's source package by hsm-fixtures/build-kube.sh): `hwkey renew` for a
//! person (an admin approves) and for a node (auto-approved, no human step), `hwkey bootstrap`
//! with a bootstrap token, and a denied request. Every CSR is checked to carry the hardware
//! key's public key and a valid self-signature (openssl), so no software key stands in.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::kube::KubeCluster;
use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::*;

#[cfg(feature = "tpm")]
use super::kit::{bootstrap_attested, enroll_node};
use super::kit::{csr_field, wait_for_csr};

/// Lets group `devs` create and watch CertificateSigningRequests (what a person renewing needs).
const DEVS_MAY_REQUEST: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: devs-request-certificates
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:node-bootstrapper
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: devs
"#;

fn serial_of(path: &Path) -> String {
    let pem = std::fs::read(path).expect("read cert");
    let block = pem::parse(pem).expect("PEM");
    let (_, c) = x509_parser::parse_x509_certificate(block.contents()).expect("cert");
    c.raw_serial_as_string()
}

/// (subject, lifetime) of the leaf in a PEM file.
fn subject_and_lifetime(path: &Path) -> (String, Duration) {
    let pem = std::fs::read(path).expect("read cert");
    let block = pem::parse(pem).expect("PEM");
    let (_, c) = x509_parser::parse_x509_certificate(block.contents()).expect("cert");
    let v = c.validity();
    let secs = (v.not_after.timestamp() - v.not_before.timestamp()).max(0) as u64;
    (c.subject().to_string(), Duration::from_secs(secs))
}

/// `hwkey renew` for `id`'s key and certificate file `cert`, started in the background.
fn spawn_renew(id: &Identity, cluster: &KubeCluster, cert: &Path, dir: &Path) -> Child {
    hwkey()
        .envs(id.envs())
        .args(["renew", "--key", &id.key_uri, "--cert"])
        .arg(cert)
        .args(["--server", &cluster.url(), "--ca"])
        .arg(cluster.ca_path())
        .args(["--wait", "120s"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("renew.out")).expect("stdout file"))
        .stderr(std::fs::File::create(dir.join("renew.err")).expect("stderr file"))
        .spawn()
        .expect("spawn hwkey renew")
}

fn wait_child(child: &mut Child, dir: &Path, cluster: &KubeCluster) -> (bool, String, String) {
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "hwkey renew did not finish:\n{}\n{}",
                read(&dir.join("renew.err")),
                cluster.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (
        status.success(),
        read(&dir.join("renew.out")),
        read(&dir.join("renew.err")),
    )
}

/// The CSR object carries a request signed by the hardware key: openssl verifies its
/// self-signature and its public key is the one `hwkey key public` prints.
fn assert_signed_by_hardware(
    cluster: &KubeCluster,
    name: &str,
    id: &Identity,
    uri: &str,
    dir: &Path,
) {
    use base64::Engine;
    let b64 = csr_field(cluster, name, "{.spec.request}");
    let pem = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .expect("spec.request is base64");
    let csr_path = dir.join(format!("{name}.csr"));
    std::fs::write(&csr_path, &pem).expect("write CSR");
    let verified = run_ok(
        Command::new("openssl")
            .args(["req", "-verify", "-noout", "-pubkey", "-in"])
            .arg(&csr_path),
    );
    let csr_key = String::from_utf8_lossy(&verified.stdout).into_owned();
    let hw = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["key", "public", "--key", uri]),
    );
    assert_eq!(
        csr_key.trim(),
        String::from_utf8_lossy(&hw.stdout).trim(),
        "the CSR's public key is not the hardware key's"
    );
}

/// A person's PKCS#11 identity renews: `hwkey renew` + `kubectl certificate approve` by an
/// admin; the new certificate is installed (the old one kept as .prev) and the running proxy
/// picks it up without a restart.
#[cfg(feature = "pkcs11")]
#[test]
fn a_persons_pkcs11_identity_renews_with_admin_approval() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    cluster.apply(DEVS_MAY_REQUEST);
    let proxy = ProxyProcess::start_to(
        &id,
        &cluster.url(),
        ProxyOptions::args(&["--reload-interval", "200ms"]),
    );
    let out = proxy.curl_unix(&["--fail"], "/version");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );

    let work = temp_dir();
    let before = std::fs::read(&id.cert).expect("read cert");
    let old_serial = serial_of(&id.cert);
    let mut renew = spawn_renew(&id, &cluster, &id.cert, work.path());
    let name = wait_for_csr(&cluster, "hwkey-alice-");
    assert_eq!(csr_field(&cluster, &name, "{.spec.username}"), "alice");
    assert_eq!(
        csr_field(&cluster, &name, "{.spec.signerName}"),
        "kubernetes.io/kube-apiserver-client"
    );
    assert_signed_by_hardware(&cluster, &name, &id, &id.key_uri, work.path());
    cluster.kubectl_ok(&["certificate", "approve", &name]);

    let (ok, stdout, stderr) = wait_child(&mut renew, work.path(), &cluster);
    assert!(ok, "hwkey renew failed:\n{stderr}\n{}", cluster.logs());
    assert!(stdout.is_empty(), "stdout: {stdout}");
    assert!(
        stderr.contains("renewed: ") && stderr.contains("valid until"),
        "{stderr}"
    );
    assert_ne!(
        serial_of(&id.cert),
        old_serial,
        "the certificate was not replaced"
    );
    let mut prev = id.cert.clone().into_os_string();
    prev.push(".prev");
    assert_eq!(std::fs::read(PathBuf::from(prev)).expect(".prev"), before);
    let (subject, lifetime) = subject_and_lifetime(&id.cert);
    assert!(
        subject.contains("CN=alice") && subject.contains("O=devs"),
        "{subject}"
    );
    assert!(
        lifetime <= Duration::from_secs(11 * 60),
        "not from the cluster signer: {lifetime:?}"
    );
    let show = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["cert", "show", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert),
    );
    assert!(
        output_text(&show).contains("matches"),
        "{}",
        output_text(&show)
    );

    // The running proxy reloads the renewed file and keeps working, without a restart.
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.metric("hwkey_cert_reloads_total{result=\"ok\"}") < 1.0 {
        assert!(Instant::now() < deadline, "no reload:\n{}", proxy.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = proxy.curl_unix(&["--fail"], "/version");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
}

/// A node's TPM identity renews with no human step: kube-controller-manager's csrapproving
/// controller auto-approves a node renewing its own `system:node:NAME` identity.
#[cfg(feature = "tpm")]
#[test]
fn a_nodes_tpm_identity_renews_with_no_human_step() {
    let id = Identity::tpm();
    let node_cert = id.dir.path().join("node1.pem");
    id.issue(
        &id.key_uri,
        "CN=system:node:node1,O=system:nodes",
        &node_cert,
    );
    let cluster = KubeCluster::start(&id.ca, "10m");
    let work = temp_dir();
    let old_serial = serial_of(&node_cert);
    let mut renew = spawn_renew(&id, &cluster, &node_cert, work.path());
    let (ok, _, stderr) = wait_child(&mut renew, work.path(), &cluster);
    assert!(ok, "hwkey renew failed:\n{stderr}\n{}", cluster.logs());
    assert_ne!(serial_of(&node_cert), old_serial);
    let (subject, lifetime) = subject_and_lifetime(&node_cert);
    assert!(
        subject.contains("CN=system:node:node1") && subject.contains("O=system:nodes"),
        "{subject}"
    );
    assert!(lifetime <= Duration::from_secs(11 * 60), "{lifetime:?}");
    let name = wait_for_csr(&cluster, "hwkey-system-node-node1-");
    assert_eq!(
        csr_field(&cluster, &name, "{.spec.signerName}"),
        "kubernetes.io/kube-apiserver-client-kubelet"
    );
    assert_eq!(
        csr_field(&cluster, &name, "{.status.conditions[0].reason}"),
        "AutoApproved"
    );
    assert_eq!(
        csr_field(&cluster, &name, "{.spec.username}"),
        "system:node:node1"
    );
}

/// `hwkey bootstrap` with a bootstrap token yields a working node identity with no human step;
/// run again, it has nothing to do.
#[cfg(feature = "pkcs11")]
#[test]
fn bootstrap_with_a_token_yields_a_working_node_identity() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let work = temp_dir();
    let uri = id.sibling_uri("node2");
    let cert = work.path().join("node2.pem");
    let kubelet_conf = work.path().join("kubelet.conf");
    let state = work.path().join("state");
    let bootstrap = || {
        let mut cmd = hwkey();
        cmd.envs(id.envs())
            .arg("bootstrap")
            .arg("--bootstrap-kubeconfig")
            .arg(&cluster.bootstrap_kubeconfig)
            .args([
                "--node-name",
                "node2",
                "--key",
                &uri,
                "--create-key",
                "ec-p256",
            ])
            .arg("--cert")
            .arg(&cert)
            .arg("--out")
            .arg(&kubelet_conf)
            .arg("--state-dir")
            .arg(&state)
            .args(["--wait", "120s"]);
        cmd
    };
    let out = run_ok(&mut bootstrap());
    assert!(
        output_text(&out).contains("bootstrapped: "),
        "{}",
        output_text(&out)
    );
    let (subject, _) = subject_and_lifetime(&cert);
    assert!(subject.contains("CN=system:node:node2"), "{subject}");
    let name = wait_for_csr(&cluster, "hwkey-system-node-node2-");
    assert_eq!(
        csr_field(&cluster, &name, "{.spec.username}"),
        "system:bootstrap:abcdef"
    );
    assert_signed_by_hardware(&cluster, &name, &id, &uri, work.path());

    // The kubelet kubeconfig works: client-go runs `hwkey-credential`, which starts the proxy,
    // which presents the node certificate signed in the token; the API server sees a node.
    // A 1.20 cluster's kubelets may predate client.authentication.k8s.io/v1: v1beta1 (which
    // has no interactiveMode); kubectl 1.32 speaks it too.
    let kubeconfig_text = read(&kubelet_conf);
    assert!(
        kubeconfig_text.contains("apiVersion: client.authentication.k8s.io/v1beta1")
            && !kubeconfig_text.contains("interactiveMode")
            && kubeconfig_text.contains("/hwkey-credential"),
        "{kubeconfig_text}"
    );
    let out = Command::new("kubectl")
        .envs(id.envs())
        .env("KUBECONFIG", &kubelet_conf)
        .args([
            "auth",
            "can-i",
            "create",
            "certificatesigningrequests",
            "--subresource=selfnodeclient",
        ])
        .output()
        .expect("run kubectl");
    let pid = std::fs::read_to_string(state.join("proxy.pid")).ok();
    if let Some(pid) = pid.as_deref().and_then(|p| p.trim().parse::<i32>().ok()) {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "yes",
        "{}\n{}",
        output_text(&out),
        read(&state.join("proxy.log"))
    );

    // Idempotent: a valid node certificate is there, so no new request.
    let before = cluster.kubectl_ok(&["get", "csr", "-o", "name"]).stdout;
    let out = run_ok(&mut bootstrap());
    assert!(
        output_text(&out).contains("already bootstrapped"),
        "{}",
        output_text(&out)
    );
    assert_eq!(
        cluster.kubectl_ok(&["get", "csr", "-o", "name"]).stdout,
        before
    );
}

/// Denied: `hwkey renew` exits non-zero naming the reason, prints nothing on stdout, and the
/// current certificate is left byte for byte (no .prev either).
#[cfg(feature = "pkcs11")]
#[test]
fn a_denied_request_fails_naming_the_reason_and_keeps_the_certificate() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    cluster.apply(DEVS_MAY_REQUEST);
    let work = temp_dir();
    let before = std::fs::read(&id.cert).expect("read cert");
    let mut renew = spawn_renew(&id, &cluster, &id.cert, work.path());
    let name = wait_for_csr(&cluster, "hwkey-alice-");
    cluster.kubectl_ok(&["certificate", "deny", &name]);
    let (ok, stdout, stderr) = wait_child(&mut renew, work.path(), &cluster);
    assert!(!ok, "renew succeeded after a denial:\n{stderr}");
    assert!(stdout.is_empty(), "stdout: {stdout}");
    assert!(
        stderr.contains(&format!("CertificateSigningRequest {name} was denied"))
            && stderr.contains("KubectlDeny")
            && stderr.contains("left as it was"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&id.cert).expect("read cert"), before);
    let mut prev = id.cert.clone().into_os_string();
    prev.push(".prev");
    assert!(!PathBuf::from(prev).exists());
}

/// NotAfter (Unix seconds) of the certificate the proxy uses now, from its metrics.
fn proxy_not_after(proxy: &ProxyProcess) -> i64 {
    proxy.metric("hwkey_certificate_not_after_timestamp_seconds") as i64
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// `hwkey proxy --renew` with certificates that live about two minutes (kube-controller-manager
/// `--cluster-signing-duration 7m`, backdated 5m; renewals are at least a minute apart):
/// across at least two rotations, a client
/// making an authenticated request every second sees no failure; a watch opened before a
/// rotation ends no later than its certificate's expiry, and a new watch works afterwards.
#[cfg(feature = "pkcs11")]
#[test]
fn the_proxy_renews_by_itself_across_rotations_with_no_failed_request() {
    let id = Identity::softhsm();
    // The node identity the proxy starts with: first from the test CA, then one short-lived
    // certificate from the cluster (auto-approved), so that renewal is due at once.
    id.issue(&id.key_uri, "CN=system:node:node9,O=system:nodes", &id.cert);
    let cluster = KubeCluster::start(&id.ca, "7m");
    let work = temp_dir();
    let mut first = spawn_renew(&id, &cluster, &id.cert, work.path());
    let (ok, _, stderr) = wait_child(&mut first, work.path(), &cluster);
    assert!(ok, "first renewal failed:\n{stderr}\n{}", cluster.logs());

    let proxy = ProxyProcess::start_to(&id, &cluster.url(), ProxyOptions::args(&["--renew"]));
    const LIST: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

    // A watch opened under the current certificate; its NotAfter is the bound.
    let (watch, not_after) = loop {
        let before = proxy_not_after(&proxy);
        let mut w = support::proxy::RawHttp::connect(&proxy.socket);
        w.send(&format!(
            "GET {LIST}?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n"
        ));
        let (status, _) = w.read_head();
        assert_eq!(status, 200, "{}", proxy.log());
        if proxy_not_after(&proxy) == before {
            break (w, before);
        }
    };
    let watcher = std::thread::spawn(move || {
        let mut w = watch;
        w.reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(300)))
            .ok();
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::BufRead::read_line(&mut w.reader, &mut line) {
                Ok(0) => return Ok(unix_now()),
                Err(e) => return Err(e),
                Ok(_) => {}
            }
        }
    });

    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut ok_requests, mut failures) = (0u32, Vec::new());
    while proxy.metric("hwkey_renewals_total{result=\"ok\"}") < 2.0 || !watcher.is_finished() {
        assert!(
            Instant::now() < deadline,
            "fewer than two renewals, or the watch still open, after 5 minutes:\n{}\n{}",
            proxy.log(),
            cluster.logs()
        );
        let out = proxy.curl_unix(&["-o", "/dev/null", "-w", "%{http_code}"], LIST);
        let code = String::from_utf8_lossy(&out.stdout).into_owned();
        if code == "200" {
            ok_requests += 1;
        } else {
            failures.push(format!("{code} {}", output_text(&out)));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across the rotations: {:?}\n{}",
        failures.len(),
        failures.len() as u32 + ok_requests,
        &failures[..failures.len().min(3)],
        proxy.log()
    );
    let ended = watcher
        .join()
        .expect("watch thread")
        .unwrap_or_else(|e| panic!("the watch was never closed: {e}\n{}", proxy.log()));
    // The proxy closed it (its own words), by the certificate's expiry; the bound allows for
    // this thread seeing the close late on a loaded machine, not for a watch left open.
    assert!(
        proxy
            .log()
            .contains("closing a connection opened with a certificate"),
        "{}",
        proxy.log()
    );
    assert!(
        ended <= not_after + 10,
        "the watch ended at {ended}, after its certificate expired at {not_after}"
    );
    assert!(
        proxy_not_after(&proxy) > not_after,
        "no newer certificate in use"
    );
    // A new watch works, under the new certificate.
    let mut w = support::proxy::RawHttp::connect(&proxy.socket);
    w.send(&format!(
        "GET {LIST}?watch=1 HTTP/1.1\r\nHost: localhost\r\n\r\n"
    ));
    assert_eq!(w.read_head().0, 200, "{}", proxy.log());
    assert!(
        proxy.log().contains("certificate renewed and installed"),
        "{}",
        proxy.log()
    );
}

/// `hwkey proxy --renew --rotate-key`: each renewal makes a fresh key in the token, the issued
/// certificate is for it, the proxy signs with it at once once a request with it went
/// through; the configured key is never deleted (keys a rotation made are, when the next one
/// replaces them); a restarted proxy (same flags, same state directory) finds the new key
/// through STATE/current-key.
#[cfg(feature = "pkcs11")]
#[test]
fn the_proxy_rotates_its_hardware_key_with_each_renewal() {
    let id = Identity::softhsm();
    id.issue(&id.key_uri, "CN=system:node:node7,O=system:nodes", &id.cert);
    let cluster = KubeCluster::start(&id.ca, "7m");
    let work = temp_dir();
    let mut first = spawn_renew(&id, &cluster, &id.cert, work.path());
    let (ok, _, stderr) = wait_child(&mut first, work.path(), &cluster);
    assert!(ok, "first renewal failed:\n{stderr}\n{}", cluster.logs());
    let state = work.path().join("state");
    let opts = || ProxyOptions {
        args: vec!["--renew".into(), "--rotate-key".into()],
        state_dir: Some(&state),
        ..Default::default()
    };
    let proxy = ProxyProcess::start_to(&id, &cluster.url(), opts());
    const LIST: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
    let deadline = Instant::now() + Duration::from_secs(180);
    while proxy.metric("hwkey_renewals_total{result=\"ok\"}") < 1.0 {
        assert!(Instant::now() < deadline, "no renewal:\n{}", proxy.log());
        let out = proxy.curl_unix(&["-o", "/dev/null", "-w", "%{http_code}"], LIST);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "200",
            "{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    // The configured key stays (issue 22, finding 7: deleting it cut off every other user of
    // it); the proxy says what to update, and a second proxy on the original key, with its
    // previous certificate (kept as FILE.prev), keeps working.
    let token_uri = match &id.backend {
        support::proxy::Backend::SoftHsm(h) => h.token_uri("kube"),
        _ => unreachable!("a SoftHSM identity"),
    };
    let listed = String::from_utf8_lossy(
        &run_ok(
            hwkey()
                .envs(id.envs())
                .args(["key", "list", "--key", &token_uri]),
        )
        .stdout,
    )
    .into_owned();
    assert!(
        (listed.contains("object=alice;") || listed.contains("object=alice?"))
            && listed.contains("object=alice-r"),
        "{listed}"
    );
    assert!(
        proxy.log().contains("the configured key is kept") && proxy.log().contains("update --key"),
        "{}",
        proxy.log()
    );
    let mut previous = id.cert.clone().into_os_string();
    previous.push(".prev");
    let previous = std::path::PathBuf::from(previous);
    let other = ProxyProcess::start_to(
        &id,
        &cluster.url(),
        ProxyOptions {
            cert: Some(&previous),
            ..Default::default()
        },
    );
    let out = other.curl_unix(&["--fail"], LIST);
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        other.log()
    );
    drop(other);
    let pointer = std::fs::read_to_string(state.join("current-key")).expect("current-key");
    let new_uri = format!(
        "{}&pin-source=file:{}",
        pointer.trim(),
        match &id.backend {
            support::proxy::Backend::SoftHsm(h) => h.pin_path().display().to_string(),
            _ => unreachable!(),
        }
    );
    let public = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["key", "public", "--key", &new_uri]),
    );
    let show = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["cert", "show", "--key", &new_uri, "--cert"])
            .arg(&id.cert),
    );
    assert!(!public.stdout.is_empty());
    assert!(
        output_text(&show).contains("matches"),
        "{}",
        output_text(&show)
    );
    let out = proxy.curl_unix(&["--fail"], LIST);
    assert!(out.status.success(), "{}", proxy.log());

    // Restarted with the original flags, it signs with the new key.
    drop(proxy);
    let proxy = ProxyProcess::start_to(&id, &cluster.url(), opts());
    let out = proxy.curl_unix(&["--fail"], LIST);
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
    assert!(proxy.log().contains("current-key"), "{}", proxy.log());
}

/// A TPM node bootstraps with `--attest`: the CSR stored by the real API server still carries
/// the TPM2_Certify evidence, and the approver's check (`hwkey attest verify`) admits it for the
/// enrolled node, while kube-controller-manager issues the certificate as usual (the API server
/// ignores the extra attribute).
#[cfg(feature = "tpm")]
#[test]
fn a_tpm_node_bootstraps_with_evidence_that_survives_the_api_server() {
    use base64::Engine as _;
    let id = Identity::tpm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let work = temp_dir();
    let (trust, tcti) = enroll_node(&id, work.path(), "node3");

    let key = format!(
        "tpm:path={}?tcti={}",
        work.path().join("node3.tpm.pem").display(),
        tcti
    );
    let cert = work.path().join("node3.pem");
    let out = bootstrap_attested(&cluster, "node3", &key, work.path());
    assert!(
        output_text(&out).contains("bootstrapped: "),
        "{}",
        output_text(&out)
    );
    let (subject, _) = subject_and_lifetime(&cert);
    assert!(subject.contains("CN=system:node:node3"), "{subject}");

    let name = wait_for_csr(&cluster, "hwkey-system-node-node3-");
    let request = base64::engine::general_purpose::STANDARD
        .decode(csr_field(&cluster, &name, "{.spec.request}"))
        .expect("spec.request is base64");
    let stored = work.path().join("stored.csr");
    std::fs::write(&stored, &request).expect("write");
    let verdict = run_ok(
        hwkey()
            .args(["attest", "verify"])
            .arg(&stored)
            .arg("--trust")
            .arg(&trust),
    );
    assert!(
        output_text(&verdict).contains("node 'node3'"),
        "{}",
        output_text(&verdict)
    );
}

/// Two renewals of one certificate file at once (a person's `hwkey renew` beside another, or
/// beside a proxy's `--renew`) each requested a certificate, and the second install kept the
/// first one's certificate as `.prev`: the original was lost. Now the second finds the first's
/// lock and does not start, saying so; one request reaches the API server, and `.prev` is the
/// original.
#[cfg(feature = "pkcs11")]
#[test]
fn a_second_renewal_of_one_file_does_not_start_while_the_first_runs() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    cluster.apply(DEVS_MAY_REQUEST);
    let work = temp_dir();
    let before = std::fs::read(&id.cert).expect("read cert");
    let mut first = spawn_renew(&id, &cluster, &id.cert, work.path());
    let name = wait_for_csr(&cluster, "hwkey-alice-");
    let second_dir = work.path().join("second");
    std::fs::create_dir(&second_dir).expect("dir");
    let mut second = spawn_renew(&id, &cluster, &id.cert, &second_dir);
    let (ok, _, stderr) = wait_child(&mut second, &second_dir, &cluster);
    assert!(
        !ok && stderr.contains("another renewal") && stderr.contains(".renew.lock"),
        "the second renewal ran beside the first:\n{stderr}"
    );
    cluster.kubectl_ok(&["certificate", "approve", &name]);
    let (ok, _, stderr) = wait_child(&mut first, work.path(), &cluster);
    assert!(ok, "hwkey renew failed:\n{stderr}");
    let requests = cluster.kubectl_ok(&["get", "csr", "-o", "name"]);
    let ours = String::from_utf8_lossy(&requests.stdout)
        .lines()
        .filter(|l| l.contains("hwkey-alice-"))
        .count();
    assert_eq!(ours, 1, "{}", String::from_utf8_lossy(&requests.stdout));
    let mut prev = id.cert.clone().into_os_string();
    prev.push(".prev");
    assert_eq!(std::fs::read(PathBuf::from(prev)).expect(".prev"), before);
}
