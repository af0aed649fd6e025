//! The attesting approver (`hwkey approver`) on a real kube-apiserver + kube-controller-manager
//! 1.20. The acceptance test runs a cluster whose controller manager only signs (no built-in
//! auto-approval, no auto-approval RBAC), installs `deploy/approver.yaml` as shipped and runs two
//! replicas with the Deployment's own arguments under its service account: a swtpm node
//! bootstraps with `--attest` and its identity works; a software key with the stolen bootstrap
//! token (`NoEvidence`), the node's evidence on another request (`EvidenceInvalid`) and an
//! unregistered TPM (`UnknownAttestationKey`) are denied; the leader's shutdown hands over to the other replica, a restarted replica
//! decides nothing twice, and two deciders racing without election write one condition per
//! request.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use super::kit::{
    create_as_bootstrap, decisions_on, install_approver, lease_holder, openssl_request,
    stop_bootstrap_proxy, submit_request, submit_software_request, wait_until, Replica,
    KUBELET_SIGNER,
};
use crate::lifecycle::kit::{csr_field, enroll_node};

/// Acceptance (issue 11): only the hwkey approver decides, with the shipped manifest's RBAC.
#[test]
fn on_a_signer_only_cluster_the_approver_alone_admits_attested_tpm_nodes() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node5");

    // Install the approver as shipped; register the node in its ConfigMap.
    install_approver(&cluster, &trust);
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let a = Replica::start(&account, dir, "approver-a");
    let b = Replica::start(&account, dir, "approver-b");
    wait_until("one replica leads", Duration::from_secs(30), || {
        a.leading() || b.leading()
    });
    assert!(
        !(a.leading() && b.leading()),
        "both replicas lead:\n{}\n{}",
        a.child.log(),
        b.child.log()
    );
    let (leader, standby) = if a.leading() { (a, b) } else { (b, a) };
    assert!(!lease_holder(&cluster).is_empty(), "no Lease holder");

    // The TPM node bootstraps with evidence: approved by hwkey alone, issued, and working.
    let key = format!(
        "tpm:path={}?tcti={tcti}",
        dir.join("node5.tpm.pem").display()
    );
    let node_csr = the_node_bootstraps_and_works_as_a_node(&cluster, dir, &key);

    // What must be denied, as (request, reason): a software key with the stolen bootstrap
    // token; the node's real evidence on another request its key signed (claiming another time
    // than the TPM certified: the binding catches it); a real TPM nobody registered.
    let (_stranger_tpm, stranger) = unregistered_tpm_request(dir);
    let denied = [
        (
            "stolen-token",
            software_request(dir, "stolen-token"),
            "NoEvidence",
        ),
        (
            "replayed",
            replayed_evidence_request(&key),
            "EvidenceInvalid",
        ),
        ("stranger", stranger, "UnknownAttestationKey"),
    ];
    for (name, pem, _) in &denied {
        submit_request(&cluster, dir, name, pem, KUBELET_SIGNER);
    }
    for (name, _, reason) in &denied {
        wait_until(
            &format!("{name} is decided"),
            Duration::from_secs(30),
            || !decisions_on(&cluster, name).is_empty(),
        );
        assert_eq!(
            (
                csr_field(&cluster, name, "{.status.conditions[0].type}"),
                csr_field(&cluster, name, "{.status.conditions[0].reason}"),
            ),
            ("Denied".to_string(), reason.to_string()),
            "{name}"
        );
        assert!(
            csr_field(&cluster, name, "{.status.certificate}").is_empty(),
            "{name}"
        );
    }

    // The leader made every decision; the standby none.
    assert_eq!(leader.decided("approved", "AttestedTPMKey"), 1.0);
    assert_eq!(leader.decided("denied", "NoEvidence"), 1.0);
    assert_eq!(leader.decided("denied", "EvidenceInvalid"), 1.0);
    assert_eq!(leader.decided("denied", "UnknownAttestationKey"), 1.0);
    assert_eq!(standby.decided("approved", "AttestedTPMKey"), 0.0);
    assert_eq!(standby.decided("denied", "NoEvidence"), 0.0);
    assert_eq!(standby.decided("denied", "UnknownAttestationKey"), 0.0);
    assert!(leader.metric("hwkey_approver_verify_seconds_count ") >= 4.0);

    // The leader stops (SIGTERM, released lease): the standby takes over and decides.
    let status = leader.terminate();
    assert!(status.success(), "the approver exited with {status}");
    wait_until("the standby leads", Duration::from_secs(15), || {
        standby.leading()
    });
    submit_software_request(&cluster, dir, "after-handover", "node5", KUBELET_SIGNER);
    wait_until("the new leader decides", Duration::from_secs(30), || {
        !decisions_on(&cluster, "after-handover").is_empty()
    });
    assert_eq!(standby.decided("denied", "NoEvidence"), 1.0);

    // A restarted replica stands by and decides nothing twice.
    let restarted = Replica::start(&account, dir, "approver-a2");
    std::thread::sleep(Duration::from_secs(3));
    assert!(!restarted.leading());
    assert_eq!(restarted.metric("hwkey_approver_conflicts_total "), 0.0);
    for name in [
        node_csr.as_str(),
        "stolen-token",
        "replayed",
        "stranger",
        "after-handover",
    ] {
        assert_eq!(decisions_on(&cluster, name).len(), 1, "{name}");
    }
    assert_eq!(restarted.terminate().code(), Some(0));
    assert_eq!(standby.terminate().code(), Some(0));

    two_deciders_without_election_write_one_condition_each(&cluster, dir, &account);
    the_account_may_approve_only_for_its_signer(&cluster, dir);
}

/// `hwkey bootstrap --attest` of node5 with `key`: approved as `AttestedTPMKey`, and the
/// kubeconfig it writes works as a node (the Node authorizer's answers). Returns the request's
/// name.
fn the_node_bootstraps_and_works_as_a_node(cluster: &KubeCluster, dir: &Path, key: &str) -> String {
    let kubelet_conf = dir.join("kubelet.conf");
    let state = dir.join("state");
    let out = crate::lifecycle::kit::bootstrap_attested(cluster, "node5", key, dir);
    assert!(
        output_text(&out).contains("bootstrapped: "),
        "{}",
        output_text(&out)
    );
    let node_csr = crate::lifecycle::kit::wait_for_csr(cluster, "hwkey-system-node-node5-");
    assert_eq!(
        csr_field(cluster, &node_csr, "{.status.conditions[0].reason}"),
        "AttestedTPMKey"
    );
    let can_i = |verb: &str, resource: &str| {
        let out = Command::new("kubectl")
            .env("KUBECONFIG", &kubelet_conf)
            .args(["auth", "can-i", verb, resource])
            .output()
            .expect("run kubectl");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let (nodes, secrets) = (can_i("get", "nodes"), can_i("list", "secrets"));
    stop_bootstrap_proxy(&state);
    // The Node authorizer answers "no - No Object name found" for a list.
    assert!(
        nodes == "yes" && secrets.starts_with("no"),
        "{nodes} / {secrets}: the node identity does not work as a node:\n{}",
        std::fs::read_to_string(state.join("proxy.log")).unwrap_or_default()
    );
    node_csr
}

/// A software key's request for node5 (made by openssl), as a thief with the bootstrap token
/// would send it.
fn software_request(dir: &Path, name: &str) -> Vec<u8> {
    openssl_request(dir, name, "/O=system:nodes/CN=system:node:node5", None)
}

/// node5's real TPM evidence on a request its key signed, claiming another time than the TPM
/// certified.
fn replayed_evidence_request(key: &str) -> Vec<u8> {
    let subject =
        hwkey::pki::csr::CsrRequest::parse("CN=system:node:node5,O=system:nodes", &[], &[])
            .expect("subject");
    let node_key = hwkey::key::Key::open(&key.parse().expect("URI")).expect("open the node key");
    let subject_der = yasna::construct_der(|w| subject.subject.write_der(w));
    let made_at = hwkey::pki::attestation::unix_now();
    let binding =
        hwkey::pki::attestation::qualifying_data(&subject_der, node_key.spki_der(), made_at);
    let mut evidence = node_key.certify(0x8101_0002, &binding).expect("certify");
    evidence.made_at = Some(made_at - 1);
    let replayed =
        hwkey::pki::csr::build_with_evidence(&node_key, &subject, &evidence).expect("CSR");
    drop(node_key); // swtpm serves one connection at a time
    hwkey::pki::csr::request_pem(&replayed).into_bytes()
}

/// A real TPM nobody registered, asking for node5 with evidence: (the TPM, the request).
fn unregistered_tpm_request(dir: &Path) -> (Swtpm, Vec<u8>) {
    let stranger = Swtpm::start();
    let stranger_key = format!(
        "tpm:path={}?tcti={}",
        dir.join("stranger.tpm.pem").display(),
        stranger.tcti()
    );
    run_ok(hwkey().args([
        "key",
        "create",
        "--key",
        &stranger_key,
        "--algorithm",
        "ec-p256",
    ]));
    let stranger_csr = run_ok(hwkey().args([
        "csr",
        "--key",
        &stranger_key,
        "--subject",
        "CN=system:node:node5,O=system:nodes",
        "--attest",
    ]));
    (stranger, stranger_csr.stdout)
}

/// Two deciders racing without election (no lease): one condition per request, and the
/// decisions they report add up to the number of requests (the loser of each race backs off).
fn two_deciders_without_election_write_one_condition_each(
    cluster: &KubeCluster,
    dir: &Path,
    account: &Path,
) {
    let names: Vec<String> = (0..12).map(|i| format!("race-{i}")).collect();
    for name in &names {
        submit_software_request(cluster, dir, name, "node5", KUBELET_SIGNER);
    }
    let racer = || {
        let mut cmd = hwkey();
        cmd.arg("approver")
            .arg("--kubeconfig")
            .arg(account)
            .args(["--signer-name", KUBELET_SIGNER])
            .args(["--trust-configmap", "hwkey-system/hwkey-approver-trust"])
            .args(["--once", "--leader-elect=false"]);
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn approver")
    };
    let (first, second) = (racer(), racer());
    let (first, second) = (
        first.wait_with_output().expect("wait"),
        second.wait_with_output().expect("wait"),
    );
    assert!(first.status.success(), "{}", output_text(&first));
    assert!(second.status.success(), "{}", output_text(&second));
    let reported = [&first, &second]
        .iter()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .matches("denied race-")
                .count()
        })
        .sum::<usize>();
    assert_eq!(
        reported,
        names.len(),
        "{}\n{}",
        output_text(&first),
        output_text(&second)
    );
    for name in &names {
        assert_eq!(decisions_on(cluster, name), ["Denied"], "{name}");
    }
}

/// Least privilege: the account may not approve for another signer (hwkey itself refuses to
/// start for a signer it has no policy for: attacks.rs). A SubjectAccessReview: kubectl's
/// `auth can-i` cannot name the signers resource.
fn the_account_may_approve_only_for_its_signer(cluster: &KubeCluster, dir: &Path) {
    let can_approve = |signer: &str| {
        let review = dir.join("review.yaml");
        std::fs::write(
            &review,
            format!(
                "apiVersion: authorization.k8s.io/v1\nkind: SubjectAccessReview\nspec:\n  user: system:serviceaccount:hwkey-system:hwkey-approver\n  groups: [system:serviceaccounts, system:serviceaccounts:hwkey-system]\n  resourceAttributes:\n    group: certificates.k8s.io\n    resource: signers\n    verb: approve\n    name: {signer}\n"
            ),
        )
        .expect("write review");
        let out = cluster.kubectl_ok(&[
            "create",
            "-f",
            &review.display().to_string(),
            "-o",
            "jsonpath={.status.allowed}",
        ]);
        String::from_utf8_lossy(&out.stdout).trim() == "true"
    };
    assert!(can_approve(KUBELET_SIGNER));
    assert!(!can_approve("kubernetes.io/kube-apiserver-client"));
}

/// The attesting approver on a real API server: a request whose key is proven to be in the
/// enrolled node's TPM is approved (`AttestedTPMKey`) and then issued; one without evidence is
/// denied (`NoEvidence`); running the approver again decides nothing twice.
#[test]
fn the_approver_admits_only_attested_keys_and_decides_once() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let (trust, tcti) = enroll_node(&id, work.path(), "node4");
    let key = format!(
        "tpm:path={}?tcti={}",
        work.path().join("node4.tpm.pem").display(),
        tcti
    );
    run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
    // Both requests come from the bootstrap identity, as a joining node's would.
    for (name, attest) in [("attested-node4", true), ("plain-node4", false)] {
        let mut csr = hwkey();
        csr.args([
            "csr",
            "--key",
            &key,
            "--subject",
            "CN=system:node:node4,O=system:nodes",
            "--k8s-name",
            name,
            "--signer-name",
            KUBELET_SIGNER,
        ]);
        if attest {
            csr.arg("--attest");
        }
        let object = work.path().join(format!("{name}.yaml"));
        std::fs::write(&object, &run_ok(&mut csr).stdout).expect("write CSR object");
        create_as_bootstrap(&cluster, &object);
    }
    let approver = || {
        let mut cmd = hwkey();
        cmd.arg("approver")
            .arg("--kubeconfig")
            .arg(&cluster.admin_kubeconfig)
            .args([
                "--signer-name",
                KUBELET_SIGNER,
                "--bootstrap-group",
                support::kube::BOOTSTRAP_GROUP,
                "--trust",
            ])
            .arg(&trust)
            .arg("--once");
        cmd
    };
    let first = output_text(&run_ok(&mut approver()));
    assert!(
        first.contains("approved attested-node4: AttestedTPMKey"),
        "{first}"
    );
    assert!(first.contains("denied plain-node4: NoEvidence"), "{first}");
    assert_eq!(
        csr_field(&cluster, "attested-node4", "{.status.conditions[0].reason}"),
        "AttestedTPMKey"
    );
    assert_eq!(
        csr_field(&cluster, "plain-node4", "{.status.conditions[0].type}"),
        "Denied"
    );
    // kube-controller-manager issues the approved one.
    let deadline = Instant::now() + Duration::from_secs(60);
    while csr_field(&cluster, "attested-node4", "{.status.certificate}").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the approved request was never issued"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A restarted approver decides nothing twice.
    let second = output_text(&run_ok(&mut approver()));
    assert!(
        !second.contains("approved") && !second.contains("denied"),
        "{second}"
    );
    for name in ["attested-node4", "plain-node4"] {
        let conditions = csr_field(&cluster, name, "{.status.conditions[*].type}");
        assert_eq!(
            conditions.split_whitespace().count(),
            1,
            "{name}: {conditions}"
        );
    }
}

/// `hwkey proxy --renew --attest`: each renewal request carries TPM2_Certify evidence, so on a
/// cluster where only the hwkey approver decides, the proxy keeps its node identity by itself.
/// (Without `--attest` the approver would deny the renewals: `NoEvidence`.)
#[test]
fn the_proxy_renews_with_evidence_that_the_approver_admits() {
    use support::proxy::{ProxyOptions, ProxyProcess};
    let id = Identity::tpm();
    // Certificates that live about two minutes (7m, backdated 5m), so renewal is due at once;
    // renewals are at least a minute apart.
    let cluster = KubeCluster::start_with(&id.ca, "7m", Approval::SignerOnly);
    let work = temp_dir();
    let (trust, _) = enroll_node(&id, work.path(), "node6");
    id.issue(&id.key_uri, "CN=system:node:node6,O=system:nodes", &id.cert);
    let mut approver = hwkey();
    approver
        .arg("approver")
        .arg("--kubeconfig")
        .arg(&cluster.admin_kubeconfig)
        .args([
            "--signer-name",
            KUBELET_SIGNER,
            "--leader-elect=false",
            "--trust",
        ])
        .arg(&trust);
    let approver = ChildGuard::spawn(&mut approver, "approver", &work.path().join("approver.log"));
    // The node's first certificate from the cluster, renewed by hand with evidence.
    run_ok(
        hwkey()
            .envs(id.envs())
            .args(["renew", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert)
            .args(["--server", &cluster.url(), "--ca"])
            .arg(cluster.ca_path())
            .args(["--wait", "120s", "--attest"]),
    );
    let proxy = ProxyProcess::start_to(
        &id,
        &cluster.url(),
        ProxyOptions::args(&["--renew", "--attest"]),
    );
    wait_until("the proxy renews", Duration::from_secs(180), || {
        proxy.metric("hwkey_renewals_total{result=\"ok\"}") >= 1.0
    });
    let reasons = csr_field_all(&cluster, "{.items[*].status.conditions[0].reason}");
    assert!(
        reasons.len() >= 2 && reasons.iter().all(|r| r == "AttestedTPMKey"),
        "{reasons:?}\n{}\n{}",
        approver.log(),
        proxy.log()
    );
}

/// A field of every CertificateSigningRequest.
fn csr_field_all(cluster: &KubeCluster, jsonpath: &str) -> Vec<String> {
    let out = cluster.kubectl_ok(&["get", "csr", "-o", &format!("jsonpath={jsonpath}")]);
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}
