//! Issue 21: the approver decides on exactly what the signer signs. Every way to a wrong
//! identity found by attacking the approver on a real kube-apiserver + kube-controller-manager
//! 1.20 (the controller manager only signs; the approver runs with `deploy/approver.yaml`'s
//! account and arguments) is tried here, each denied with its precise reason and never issued;
//! the legitimate flows still pass.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use crate::approver::{
    create_as_bootstrap, csr_object, decisions_on, openssl_request, submit_request, wait_until,
    Replica, KUBELET_SIGNER, MANIFEST, NODE_USAGES,
};
use crate::lifecycle::{csr_field, enroll_node};

/// A TPM with a key of its own.
pub(crate) struct Tpm {
    _tpm: Option<Swtpm>,
    pub(crate) tcti: String,
    pub(crate) key: String,
}

impl Tpm {
    pub(crate) fn new(dir: &Path, name: &str) -> Tpm {
        let tpm = Swtpm::start();
        let tcti = tpm.tcti();
        Tpm::with(Some(tpm), tcti, dir, name)
    }

    pub(crate) fn with(tpm: Option<Swtpm>, tcti: String, dir: &Path, name: &str) -> Tpm {
        let key = format!(
            "tpm:path={}?tcti={tcti}",
            dir.join(format!("{name}.tpm.pem")).display()
        );
        run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
        Tpm {
            _tpm: tpm,
            tcti,
            key,
        }
    }

    pub(crate) fn enrollment(&self) -> String {
        let out = run_ok(hwkey().args([
            "attest",
            "enroll",
            "--key",
            &format!("tpm:?tcti={}", self.tcti),
        ]));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `hwkey csr --attest` for `subject` (extra arguments: `--dns`, `--ip`): PEM.
    pub(crate) fn request(&self, subject: &str, extra: &[&str]) -> Vec<u8> {
        run_ok(
            hwkey()
                .args(["csr", "--key", &self.key, "--subject", subject, "--attest"])
                .args(extra),
        )
        .stdout
    }
}

/// `kubectl create -f OBJECT` with `kubeconfig`.
pub(crate) fn create_with(kubeconfig: &Path, object: &Path) {
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["create", "-f"])
            .arg(object),
    );
}

/// Waits for `name`'s decision; asserts it is `want` with `reason`, and (when denied) that no
/// certificate was issued.
pub(crate) fn assert_decided(
    cluster: &KubeCluster,
    name: &str,
    want: &str,
    reason: &str,
    log: &dyn Fn() -> String,
) {
    if let Err(e) = decided_as(cluster, name, want, reason, Duration::from_secs(30)) {
        panic!("{e}\n{}", log());
    }
}

/// Waits up to `limit` for `name`'s decision: Ok when it is `want` with `reason` (and, when
/// denied, nothing was issued), else what happened instead, in words.
pub(crate) fn decided_as(
    cluster: &KubeCluster,
    name: &str,
    want: &str,
    reason: &str,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while decisions_on(cluster, name).is_empty() {
        if Instant::now() >= deadline {
            return Err(format!("{name} is never decided (waited {limit:?})"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let got = (
        csr_field(cluster, name, "{.status.conditions[0].type}"),
        csr_field(cluster, name, "{.status.conditions[0].reason}"),
    );
    if (got.0.as_str(), got.1.as_str()) != (want, reason) {
        std::thread::sleep(Duration::from_millis(500));
        let issued = issued_subject(cluster, name);
        return Err(format!(
            "{name}: {} {} ({}), not {want} {reason}{}",
            got.0,
            got.1,
            csr_field(cluster, name, "{.status.conditions[0].message}"),
            issued
                .map(|s| format!("; issued a certificate for {s}"))
                .unwrap_or_default()
        ));
    }
    if want == "Denied" {
        std::thread::sleep(Duration::from_millis(300));
        if let Some(s) = issued_subject(cluster, name) {
            return Err(format!("{name} was denied, yet issued for {s}"));
        }
    }
    Ok(())
}

/// The subject of the certificate issued for `name`, if one was.
fn issued_subject(cluster: &KubeCluster, name: &str) -> Option<String> {
    use base64::Engine as _;
    let cert = csr_field(cluster, name, "{.status.certificate}");
    let pem = base64::engine::general_purpose::STANDARD
        .decode(cert.trim())
        .ok()?;
    let der = pem::parse(pem).ok()?.into_contents();
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).ok()?;
    Some(parsed.subject().to_string())
}

/// The trust ConfigMap from `entries` (name → text), replacing what is there.
pub(crate) fn apply_trust(cluster: &KubeCluster, dir: &Path, entries: &[(&str, String)]) {
    let folder = dir.join(format!("trust-{}", entries.len()));
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir(&folder).expect("trust folder");
    for (name, text) in entries {
        std::fs::write(folder.join(name), text).expect("entry");
    }
    let yaml = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "create",
        "configmap",
        "hwkey-approver-trust",
        &format!("--from-file={}", folder.display()),
        "--dry-run=client",
        "-o",
        "yaml",
    ]);
    let path = dir.join("trust.yaml");
    std::fs::write(&path, &yaml.stdout).expect("write");
    cluster.kubectl_ok(&["apply", "-f", &path.display().to_string()]);
}

#[test]
fn the_approver_denies_every_way_to_a_wrong_identity() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (_, tcti_a) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti_a, dir, "node-a");
    let b = Tpm::new(dir, "node-b");
    let stranger = Tpm::new(dir, "stranger");
    let x = Tpm::new(dir, "node-x");
    let enroll_a = a.enrollment();
    let stranger_name = stranger
        .enrollment()
        .lines()
        .find_map(|l| l.strip_prefix("akName: ").map(str::to_string))
        .expect("akName");
    // node-c's registration is node-x's TPM, with a fake akName (the stranger's) hidden in a
    // block scalar ahead of the real fields (finding 5).
    let fake_c = format!(
        "akPublicKeyPem: |\n  akName: {stranger_name}\n{}",
        without_field(&x.enrollment(), "akPublicKeyPem")
    );
    let entries = vec![
        ("node-a", enroll_a.clone()),
        ("node-b", b.enrollment()),
        ("node-c", fake_c),
        // node-a's AK registered again under a name that sorts first (finding 7).
        ("node-0", enroll_a.clone()),
        // A typo'd entry (finding 6).
        ("bad-node", "akName: zz\n".to_string()),
    ];
    cluster.apply(MANIFEST);
    apply_trust(&cluster, dir, &entries);
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let replica = Replica::start(&account, dir, "approver");
    wait_until("the approver leads", Duration::from_secs(30), || {
        replica.leading()
    });
    let log = || replica.child.log();

    // The legitimate flow: node-a's attested request from a bootstrap identity of the allowed
    // group, approved and issued, even with its AK also registered as node-0.
    let good_a = a.request("CN=system:node:node-a,O=system:nodes", &[]);
    submit_request(&cluster, dir, "good-a", &good_a, KUBELET_SIGNER);
    assert_decided(&cluster, "good-a", "Approved", "AttestedTPMKey", &log);
    wait_until("good-a is issued", Duration::from_secs(60), || {
        !csr_field(&cluster, "good-a", "{.status.certificate}").is_empty()
    });
    let good_b = b.request("CN=system:node:node-b,O=system:nodes", &[]);
    submit_request(&cluster, dir, "good-b", &good_b, KUBELET_SIGNER);
    assert_decided(&cluster, "good-b", "Approved", "AttestedTPMKey", &log);
    assert_eq!(replica.metric("hwkey_approver_trust_invalid_entries "), 1.0);
    assert_eq!(replica.metric("hwkey_approver_trust_duplicate_aks "), 1.0);
    assert_eq!(replica.metric("hwkey_approver_registered_nodes "), 4.0);
    let events = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "get",
        "events",
        "--field-selector",
        "reason=InvalidRegistration",
        "-o",
        "jsonpath={.items[*].message}",
    ]);
    assert!(
        output_text(&events).contains("entry 'bad-node' is skipped"),
        "{}",
        output_text(&events)
    );

    // Finding 1: node-a's attested request followed by a software request for node-b. Go's
    // pem.Decode skips "x" + the first block when BEGIN is mid-line and signs the second.
    let software_b = openssl_request(dir, "soft-b", "/O=system:nodes/CN=system:node:node-b", None);
    let mut two = b"x".to_vec();
    two.extend_from_slice(&good_a);
    two.extend_from_slice(&software_b);
    submit_request(&cluster, dir, "two-blocks-bootstrap", &two, KUBELET_SIGNER);
    let (cert_a, key_a) = id.ca.client_cert(
        dir,
        "node-a-client",
        "system:node:node-a",
        Some("system:nodes"),
    );
    let as_node_a = cluster.cert_kubeconfig("node-a", &cert_a, &key_a);
    let object = csr_object(dir, "two-blocks-node", &two, KUBELET_SIGNER, NODE_USAGES);
    create_with(&as_node_a, &object);

    // Findings 2 and 3: subjects that Go reads as another node, or as more than a node.
    let subjects = [
        (
            "two-cn",
            "CN=system:node:node-a,CN=system:node:node-b,O=system:nodes",
        ),
        (
            "hidden-cn",
            "CN=system:node:node-b,OU=x\\, CN=system:node:node-a,O=system:nodes",
        ),
        (
            "extra-o",
            "CN=system:node:node-a,O=system:nodes,O=system:masters",
        ),
        ("missing-o", "CN=system:node:node-a"),
    ];
    for (name, subject) in subjects {
        submit_request(
            &cluster,
            dir,
            name,
            &a.request(subject, &[]),
            KUBELET_SIGNER,
        );
    }
    // Finding 3 (and 12: the attributes SET is in DER order, so these parse): each SAN kind.
    let node_a = "CN=system:node:node-a,O=system:nodes";
    submit_request(
        &cluster,
        dir,
        "san-dns",
        &a.request(node_a, &["--dns", "kubernetes.default.svc"]),
        KUBELET_SIGNER,
    );
    submit_request(
        &cluster,
        dir,
        "san-ip",
        &a.request(node_a, &["--ip", "10.0.0.1"]),
        KUBELET_SIGNER,
    );
    let openssl_a = "/O=system:nodes/CN=system:node:node-a";
    for (name, ext) in [
        ("san-email", "subjectAltName=email:node@example.com"),
        ("san-uri", "subjectAltName=URI:spiffe://cluster/node-a"),
    ] {
        submit_request(
            &cluster,
            dir,
            name,
            &openssl_request(dir, name, openssl_a, Some(ext)),
            KUBELET_SIGNER,
        );
    }
    let server_auth = csr_object(
        dir,
        "server-auth",
        &a.request(node_a, &[]),
        KUBELET_SIGNER,
        "[digital signature, key encipherment, client auth, server auth]",
    );
    create_as_bootstrap(&cluster, &server_auth);
    // Finding 9: a bootstrap token of another group.
    let other_token = cluster.bootstrap_token_kubeconfig(
        "ghijkl",
        "0123456789abcdef",
        "system:bootstrappers:other",
    );
    let object = csr_object(
        dir,
        "wrong-group",
        &a.request(node_a, &[]),
        KUBELET_SIGNER,
        NODE_USAGES,
    );
    create_with(&other_token, &object);
    // Finding 10: node-a's approved request, resubmitted as is.
    submit_request(&cluster, dir, "resubmitted", &good_a, KUBELET_SIGNER);
    // Finding 5: the stranger TPM whose AK name hides in node-c's registration.
    submit_request(
        &cluster,
        dir,
        "fake-ak-name",
        &stranger.request("CN=system:node:node-c,O=system:nodes", &[]),
        KUBELET_SIGNER,
    );
    for (name, reason) in [
        ("two-blocks-bootstrap", "MalformedRequest"),
        ("two-blocks-node", "MalformedRequest"),
        ("two-cn", "SubjectNotAllowed"),
        ("hidden-cn", "SubjectNotAllowed"),
        ("extra-o", "SubjectNotAllowed"),
        ("missing-o", "SubjectNotAllowed"),
        ("san-dns", "SubjectAltNameNotAllowed"),
        ("san-ip", "SubjectAltNameNotAllowed"),
        ("san-email", "SubjectAltNameNotAllowed"),
        ("san-uri", "SubjectAltNameNotAllowed"),
        ("server-auth", "UsagesNotAllowed"),
        ("wrong-group", "RequesterNotAllowed"),
        ("resubmitted", "EvidenceReused"),
        ("fake-ak-name", "UnknownAttestationKey"),
    ] {
        assert_decided(&cluster, name, "Denied", reason, &log);
    }

    // Finding 4: node-b is removed from the ConfigMap; its next request is denied within
    // seconds, without a restart.
    let without_b: Vec<(&str, String)> = entries
        .iter()
        .filter(|(n, _)| *n != "node-b")
        .cloned()
        .collect();
    apply_trust(&cluster, dir, &without_b);
    wait_until(
        "the approver sees node-b removed",
        Duration::from_secs(10),
        || replica.metric("hwkey_approver_registered_nodes ") == 3.0,
    );
    let removed = b.request("CN=system:node:node-b,O=system:nodes", &[]);
    submit_request(&cluster, dir, "removed-b", &removed, KUBELET_SIGNER);
    assert_decided(
        &cluster,
        "removed-b",
        "Denied",
        "UnknownAttestationKey",
        &log,
    );

    // Finding 6: a restart with the malformed entry still there starts, and approves node-a.
    assert_eq!(replica.terminate().code(), Some(0));
    let restarted = Replica::start(&account, dir, "approver-2");
    wait_until(
        "the restarted approver leads",
        Duration::from_secs(30),
        || restarted.leading(),
    );
    let again_a = a.request(node_a, &[]);
    submit_request(&cluster, dir, "after-restart", &again_a, KUBELET_SIGNER);
    assert_decided(
        &cluster,
        "after-restart",
        "Approved",
        "AttestedTPMKey",
        &|| restarted.child.log(),
    );
    assert_eq!(restarted.terminate().code(), Some(0));

    // Finding 10: evidence older than the window is stale.
    let stale = a.request(node_a, &[]);
    std::thread::sleep(Duration::from_secs(3));
    submit_request(&cluster, dir, "stale", &stale, KUBELET_SIGNER);
    let once = run_ok(
        hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&account)
            .args(["--signer-name", KUBELET_SIGNER])
            .args(["--trust-configmap", "hwkey-system/hwkey-approver-trust"])
            .args(["--bootstrap-group", support::kube::BOOTSTRAP_GROUP])
            .args(["--evidence-max-age", "2s", "--once"]),
    );
    assert!(
        output_text(&once).contains("denied stale: EvidenceStale"),
        "{}",
        output_text(&once)
    );

    // Finding 3: a signer without a policy is refused at start.
    let out = run_fail(
        hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&account)
            .args(["--signer-name", "kubernetes.io/kube-apiserver-client"])
            .args([
                "--trust-configmap",
                "hwkey-system/hwkey-approver-trust",
                "--once",
            ]),
    );
    assert!(
        output_text(&out)
            .contains("no approval policy for signer 'kubernetes.io/kube-apiserver-client'"),
        "{}",
        output_text(&out)
    );

    // Finding 11: a leader whose API server stops answering steps down by the renew deadline
    // (3 s here), though its renewal call never returns.
    let relay = support::relay::FreezableRelay::start(cluster.port);
    let through_relay = relayed_kubeconfig(&account, cluster.port, relay.port, dir);
    let frozen_leader = Replica::start(&through_relay, dir, "approver-relayed");
    wait_until(
        "the relayed approver leads",
        Duration::from_secs(30),
        || frozen_leader.leading(),
    );
    relay.freeze();
    let frozen_at = Instant::now();
    wait_until(
        "the frozen leader steps down",
        Duration::from_secs(8),
        || !frozen_leader.leading(),
    );
    assert!(frozen_at.elapsed() < Duration::from_secs(8));
    relay.thaw();
    assert_eq!(frozen_leader.terminate().code(), Some(0));
}

/// `kubeconfig` with its server's port replaced by the relay's.
fn relayed_kubeconfig(kubeconfig: &Path, port: u16, relay: u16, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let path = dir.join("relayed.kubeconfig");
    std::fs::write(
        &path,
        text.replace(&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{relay}")),
    )
    .expect("write");
    path
}

/// An enrollment without top-level `field` (and its indented block).
fn without_field(text: &str, field: &str) -> String {
    let mut skipping = false;
    text.lines()
        .filter(|l| {
            if !l.starts_with(' ') {
                skipping = l.starts_with(&format!("{field}:"));
            }
            !skipping
        })
        .map(|l| format!("{l}\n"))
        .collect()
}
