//! Issue 34: the approver, attacked again as a cluster attacker would, on a real kube-apiserver +
//! kube-controller-manager 1.20 that only signs, with `deploy/approver.yaml`'s account and
//! arguments. Each finding is a case here, and each fails on 1e6941c:
//!
//! 1. an empty RDN hid the rest of the subject (approved as one node, issued as another);
//! 2. a cluster full of megabyte requests took the approver's memory at every start;
//! 3. a copy of a node's request made by someone else was approved too, or kept the original
//!    out, depending on names and seconds the copier chose;
//! 4. a trust source emptied of every node kept the previous trust;
//! 5. a connection dropped silently left the leader deciding nothing;
//! 6. liveness shared the metrics listener's slots;
//! 7. a write that failed while deciding the first list was never retried;
//!
//! and the low ones: a request deleted and re-created under its own name, a trust ConfigMap
//! deleted and re-created around a request, a flood from one bootstrap token.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::requests::{self as rq, Node, RequestTree, SoftwareKey};
use support::*;

use super::kit::{apply_trust, assert_decided, create_with, decided_as, Tpm};
use super::kit::{
    csr_object, decisions_on, submit_request, wait_until, Leases, Replica, KUBELET_SIGNER,
    MANIFEST, NODE_USAGES,
};
use crate::lifecycle::kit::{csr_field, enroll_node};

/// The subject text of node `n`'s request.
fn node_subject(n: &str) -> String {
    format!("CN=system:node:{n},O=system:nodes")
}

/// A kubeconfig that is node `n` (a client certificate from the cluster's CA).
fn node_kubeconfig(cluster: &KubeCluster, id: &Identity, dir: &Path, n: &str) -> PathBuf {
    let (cert, key) = id.ca.client_cert(
        dir,
        &format!("{n}-client"),
        &format!("system:node:{n}"),
        Some("system:nodes"),
    );
    cluster.cert_kubeconfig(n, &cert, &key)
}

/// Creates request `name` holding `pem` as whoever `kubeconfig` is.
fn create_as(kubeconfig: &Path, dir: &Path, name: &str, pem: &[u8]) {
    create_with(
        kubeconfig,
        &csr_object(dir, name, pem, KUBELET_SIGNER, NODE_USAGES),
    );
}

/// Finding 1's request: node-s's key, certified by node-s's own AK, for a subject
/// `{O=system:nodes}, {CN=system:node:node-s}, {}, {CN=system:node:node-b}`, the evidence bound
/// to the subject bytes x509-parser read (up to the empty SET) as 1e6941c's approver bound them.
/// Go reads every RDN and keeps the last CN: node-b.
fn empty_rdn_request(tpm: &Tpm) -> Vec<u8> {
    use hwkey::pki::attestation;
    let key = hwkey::key::Key::open(&tpm.key.parse().expect("key URI")).expect("open node-s's key");
    let spki = key.spki_der().to_vec();
    let rdn = |oid, text: &str| Node::rdn(oid, rq::tag::UTF8, text);
    let subject = Node::seq(vec![
        rdn(rq::O, "system:nodes"),
        rdn(rq::CN, "system:node:node-s"),
        Node::set(vec![]),
        rdn(rq::CN, "system:node:node-b"),
    ]);
    let draft = RequestTree::new(subject.clone(), &spki, vec![]).signed(|_| vec![0x30, 0x00], &[]);
    let prefix = {
        use x509_parser::prelude::FromDer;
        let (_, parsed) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&draft)
                .expect("x509-parser reads the draft");
        parsed.certification_request_info.subject.as_raw().to_vec()
    };
    assert!(
        prefix.len() < subject.encode().len(),
        "x509-parser read the whole subject: the premise of finding 1 is gone"
    );
    let made_at = attestation::unix_now();
    let qualifying = attestation::qualifying_data(&prefix, &spki, made_at);
    let mut evidence = key
        .certify(hwkey::key::attestation::DEFAULT_AK_HANDLE, &qualifying)
        .expect("TPM2_Certify");
    evidence.made_at = Some(made_at);
    let tree = RequestTree::new(
        subject,
        &spki,
        vec![Node::Raw(attestation::evidence_attribute(&evidence))],
    );
    let der = tree.signed(
        |info| {
            key.sign(hwkey::key::SignScheme::EcdsaP256Sha256, info)
                .expect("sign in the TPM")
        },
        &[],
    );
    rq::pem(&der).into_bytes()
}

/// Findings 1, 3 and 4, and a request re-created under its own name, a trust ConfigMap deleted
/// and re-created around a request: the approver decides on what Go reads, by what the
/// requester is entitled to and by uid, and on what the trust source holds now.
#[test]
fn the_approver_decides_on_what_go_reads_who_is_entitled_and_what_the_trust_holds() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (_, tcti_a) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti_a, dir, "node-a");
    let b = Tpm::new(dir, "node-b");
    let s = Tpm::new(dir, "node-s");
    let entries = vec![
        ("node-a", a.enrollment()),
        ("node-b", b.enrollment()),
        ("node-s", s.enrollment()),
    ];
    cluster.apply(MANIFEST);
    apply_trust(&cluster, dir, &entries);
    let as_node_a = node_kubeconfig(&cluster, &id, dir, "node-a");
    let as_node_b = node_kubeconfig(&cluster, &id, dir, "node-b");
    let as_node_s = node_kubeconfig(&cluster, &id, dir, "node-s");
    let other_token = cluster.bootstrap_token_kubeconfig(
        "qrstuv",
        "0123456789abcdef",
        support::kube::BOOTSTRAP_GROUP,
    );

    // Pending before the approver starts: node-a's renewal, and copies of it by another node
    // and by another bootstrap token of the allowed group, named to be listed first and made
    // at once (so in the same second, as a watching copier manages).
    let renewal = a.request(&node_subject("node-a"), &[]);
    std::thread::scope(|scope| {
        for (kubeconfig, name) in [
            (&as_node_a, "zz-node-a-renewal"),
            (&as_node_b, "aa-copy-by-node-b"),
            (&other_token, "aa-copy-by-bootstrap"),
        ] {
            let renewal = &renewal;
            scope.spawn(move || create_as(kubeconfig, dir, name, renewal));
        }
    });
    // Finding 1: node-s asks for a subject whose last CN is node-b.
    create_as(&as_node_s, dir, "empty-rdn", &empty_rdn_request(&s));

    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let replica = Replica::start(&account, dir, "approver");
    // Every finding is checked, and all that fail are reported together.
    let mut failed: Vec<String> = Vec::new();
    let mut expect = |finding: &str, name: &str, want: &str, reason: &str| {
        if let Err(e) = decided_as(&cluster, name, want, reason, Duration::from_secs(30)) {
            failed.push(format!("{finding}: {e}"));
        }
    };
    expect(
        "finding 3",
        "zz-node-a-renewal",
        "Approved",
        "AttestedTPMKey",
    );
    expect(
        "finding 3",
        "aa-copy-by-node-b",
        "Denied",
        "RequesterNotAllowed",
    );
    expect(
        "finding 3",
        "aa-copy-by-bootstrap",
        "Denied",
        "EvidenceReused",
    );
    expect("finding 1", "empty-rdn", "Denied", "MalformedRequest");

    // A copy made while the approver runs, by the allowed bootstrap token: the original holds
    // the evidence, whatever the copy's name.
    let join = a.request(&node_subject("node-a"), &[]);
    submit_request(&cluster, dir, "zz-join-a", &join, KUBELET_SIGNER);
    create_as(&other_token, dir, "aa-join-copy", &join);
    expect("finding 3", "zz-join-a", "Approved", "AttestedTPMKey");
    expect("finding 3", "aa-join-copy", "Denied", "EvidenceReused");
    // Deleted and created again under its own name: another request, the evidence is used.
    cluster.kubectl_ok(&["delete", "csr", "zz-join-a"]);
    submit_request(&cluster, dir, "zz-join-a", &join, KUBELET_SIGNER);
    expect(
        "re-created under its name",
        "zz-join-a",
        "Denied",
        "EvidenceReused",
    );

    // Finding 4: a trust ConfigMap with no usable entry trusts nobody.
    apply_trust(&cluster, dir, &[("node-b", "akName: zz\n".to_string())]);
    wait_until(
        "the approver reads the unusable trust",
        Duration::from_secs(30),
        || {
            replica.metric("hwkey_approver_registered_nodes ") == 0.0
                && replica.metric("hwkey_approver_trust_invalid_entries ") == 1.0
        },
    );
    let removed = b.request(&node_subject("node-b"), &[]);
    submit_request(
        &cluster,
        dir,
        "after-every-node-removed",
        &removed,
        KUBELET_SIGNER,
    );
    expect(
        "finding 4",
        "after-every-node-removed",
        "Denied",
        "UnknownAttestationKey",
    );

    // The ConfigMap deleted and created again around a request: the request waits for the
    // trust and is approved once it is back, never denied for a trust that was missing.
    let waiting = b.request(&node_subject("node-b"), &[]);
    cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "delete",
        "configmap",
        "hwkey-approver-trust",
    ]);
    wait_until(
        "the approver sees the trust gone",
        Duration::from_secs(30),
        || replica.metric("hwkey_approver_trust_available ") == 0.0,
    );
    let waits = || {
        replica
            .child
            .log()
            .matches("cannot read the trust source to settle requests")
            .count()
    };
    let waits_before = waits();
    submit_request(
        &cluster,
        dir,
        "while-trust-missing",
        &waiting,
        KUBELET_SIGNER,
    );
    wait_until(
        "the request waits for the trust",
        Duration::from_secs(30),
        || waits() > waits_before,
    );
    apply_trust(&cluster, dir, &entries);
    expect(
        "trust re-created",
        "while-trust-missing",
        "Approved",
        "AttestedTPMKey",
    );
    assert!(
        failed.is_empty(),
        "{}\n--- approver ---\n{}",
        failed.join("\n"),
        replica.child.log()
    );
    // The approval keeps the request's annotations and labels (an API server before 1.21 takes
    // the approval's metadata from its body).
    for (field, want) in [
        ("{.metadata.annotations}", super::kit::KIT_ANNOTATION.1),
        ("{.metadata.labels}", "hwkey-test/made-by"),
    ] {
        let got = csr_field(&cluster, "zz-node-a-renewal", field);
        assert!(got.contains(want), "{field} after the approval: {got}");
    }
    assert!(
        csr_field(&cluster, "empty-rdn", "{.status.conditions[0].message}").contains("empty RDN"),
        "{}",
        csr_field(&cluster, "empty-rdn", "{.status.conditions[0].message}")
    );
    assert_eq!(replica.terminate().code(), Some(0));
}

/// A request for kubelet's signer whose PEM is about `size` bytes: a valid software-key
/// request for node `node` carrying a junk attribute (the API server accepts it).
fn large_request(key: &SoftwareKey, node: &str, size: usize) -> Vec<u8> {
    let rdn = |oid, text: &str| Node::rdn(oid, rq::tag::UTF8, text);
    let junk = Node::seq(vec![
        Node::oid(&[1, 3, 6, 1, 4, 1, 99999, 1]),
        Node::set(vec![Node::Prim(rq::tag::OCTET_STRING, vec![0x5a; size])]),
    ]);
    let tree = RequestTree::new(
        Node::seq(vec![
            rdn(rq::O, "system:nodes"),
            rdn(rq::CN, &format!("system:node:{node}")),
        ]),
        &key.spki(),
        vec![junk],
    );
    rq::pem(&tree.signed(|info| key.sign(info), &[])).into_bytes()
}

/// `VmHWM` (peak resident set) of a process, KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// Writes `count` CSR objects for `pem` named `PREFIX-N` into a new folder (one `kubectl
/// create -f FOLDER` creates them all).
fn objects(dir: &Path, prefix: &str, count: usize, pem: &[u8]) -> PathBuf {
    let folder = dir.join(prefix);
    std::fs::create_dir_all(&folder).expect("folder");
    for i in 0..count {
        let name = format!("{prefix}-{i:05}");
        let path = csr_object(dir, &name, pem, KUBELET_SIGNER, NODE_USAGES);
        std::fs::rename(&path, folder.join(format!("{name}.yaml"))).expect("move");
    }
    folder
}

/// The release build `hsm-fixtures/package.sh` made from this checkout: the binary operators
/// run and the approver's image holds (a debug build's own code pages alone are 29 MiB).
/// It is in the Cargo target directory this test was built in (`TARGET/debug/deps/it-…` →
/// `TARGET/release/hwkey`), wherever `CARGO_TARGET_DIR` put it.
fn released_hwkey() -> Command {
    let exe = std::env::current_exe().expect("path of the running test binary");
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test binary is in TARGET/debug/deps");
    let bin = target.join("release/hwkey");
    assert!(
        bin.is_file(),
        "{} is missing: build it with hsm-fixtures/package.sh (hsm-fixtures/test.sh does)",
        bin.display()
    );
    let version = |mut cmd: Command| {
        let out = run_ok(cmd.arg("--version"));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.contains("commit"))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        version(Command::new(&bin)),
        version(hwkey()),
        "{} was built from another commit: rerun hsm-fixtures/package.sh",
        bin.display()
    );
    Command::new(bin)
}

/// Finding 2: 100 requests of 1.3 MB in the cluster (denied, kept an hour by the cleaner) cost a
/// starting approver (the release build) at most 64 MiB, and it still decides a node's request
/// (how soon is benches/approver.rs's figure).
#[test]
fn megabyte_requests_in_the_cluster_cost_a_starting_approver_little_memory() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti, dir, "node-a");
    super::kit::install_approver(&cluster, &trust);
    // A PEM of 1.3 MB (the API server's store takes objects up to 1.5 MiB).
    let large = large_request(&SoftwareKey::generate(), "node-x", 950_000);
    assert!(
        (1_250_000..1_400_000).contains(&large.len()),
        "{}",
        large.len()
    );
    let folder = objects(dir, "large", 100, &large);
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&cluster.bootstrap_kubeconfig)
            .args(["create", "-f"])
            .arg(&folder),
    );
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    // A first replica denies them all (MalformedRequest: larger than 64 KiB, refused unread).
    let first = Replica::start(&account, dir, "approver-first");
    wait_until(
        "the large requests are denied",
        Duration::from_secs(120),
        || first.decided("denied", "MalformedRequest") >= 100.0,
    );
    assert_eq!(first.terminate().code(), Some(0));
    // A node's request waits; a replica starts, lists all of it, and decides it.
    let request = a.request(&node_subject("node-a"), &[]);
    submit_request(
        &cluster,
        dir,
        "node-a-after-restart",
        &request,
        KUBELET_SIGNER,
    );
    let started = Instant::now();
    let replica = Replica::start_with(
        released_hwkey(),
        &account,
        dir,
        "approver-restarted",
        Leases::Steady,
    );
    assert_decided(
        &cluster,
        "node-a-after-restart",
        "Approved",
        "AttestedTPMKey",
        &|| replica.child.log(),
    );
    let took = started.elapsed();
    let peak = peak_rss_kib(replica.child.id());
    eprintln!("approver restart with 100 x 1.3 MB requests: peak RSS {peak} KiB, node decided {took:?} after start");
    assert!(
        peak <= 64 * 1024,
        "the starting approver peaked at {peak} KiB (at most 65536)"
    );
    assert_eq!(replica.terminate().code(), Some(0));
}

/// The LOW finding and the acceptance's flood: 3,000 requests from one bootstrap token wait
/// when a replica starts, with a node's renewal among them (named to be listed last). The
/// node's lane takes its turn at once: at most one write slot's worth of flood decisions is
/// written before the renewal's approval (1e6941c wrote all 3,000 first), and the approver's
/// memory stays bounded. The order is the approver's own log of the writes, not a clock.
#[test]
fn a_flood_from_one_bootstrap_token_does_not_hold_back_a_nodes_renewal() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti, dir, "node-a");
    super::kit::install_approver(&cluster, &trust);
    let key = SoftwareKey::generate();
    let flood = rq::pem(
        &RequestTree::new(
            Node::seq(vec![
                Node::rdn(rq::O, rq::tag::UTF8, "system:nodes"),
                Node::rdn(rq::CN, rq::tag::UTF8, "system:node:node-x"),
            ]),
            &key.spki(),
            vec![],
        )
        .signed(|info| key.sign(info), &[]),
    )
    .into_bytes();
    let folder = objects(dir, "flood", 3000, &flood);
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&cluster.bootstrap_kubeconfig)
            .args(["create", "-f"])
            .arg(&folder),
    );
    let renewal = a.request(&node_subject("node-a"), &[]);
    let as_node_a = node_kubeconfig(&cluster, &id, dir, "node-a");
    create_as(&as_node_a, dir, "zzzz-node-a-renewal", &renewal);
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let replica = Replica::start(&account, dir, "approver");
    assert_decided(
        &cluster,
        "zzzz-node-a-renewal",
        "Approved",
        "AttestedTPMKey",
        &|| replica.child.log(),
    );
    // The order decisions were written in, from the approver's own log.
    let written_before = replica
        .child
        .log()
        .lines()
        .filter(|l| l.contains("approved=") && l.contains("csr="))
        .take_while(|l| !l.contains("zzzz-node-a-renewal"))
        .count();
    eprintln!("flood: {written_before} flood decisions were written before the renewal's");
    // Writes finish in any order: the renewal's starts after at most one flood write, and the
    // writes started after it (at most IN_FLIGHT - 1 at once) may finish first.
    assert!(
        written_before <= hwkey::approver::controller::IN_FLIGHT + 1,
        "{written_before} flood decisions were written before the node's renewal"
    );
    wait_until("the flood is decided", Duration::from_secs(300), || {
        replica.decided("denied", "NoEvidence") >= 3000.0
    });
    let peak = peak_rss_kib(replica.child.id());
    eprintln!("flood: peak RSS {peak} KiB");
    assert!(peak <= 64 * 1024, "peaked at {peak} KiB");
    assert_eq!(replica.terminate().code(), Some(0));
}

/// `kubeconfig` with its server's port replaced by `relay`'s.
fn relayed(kubeconfig: &Path, port: u16, relay: u16, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("kubeconfig");
    let path = dir.join("relayed.kubeconfig");
    std::fs::write(
        &path,
        text.replace(&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{relay}")),
    )
    .expect("write");
    path
}

/// Findings 5 and 7: through a path that forgets flows idle for 10 s, the leader keeps seeing
/// requests and the trust (its HTTP/2 PINGs keep the flow alive); and with the approve rule
/// missing when it starts, the first list's decision is retried until the rule is back.
#[test]
fn a_silent_path_and_a_refused_write_do_not_stall_the_leader() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (_, tcti) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti, dir, "node-a");
    let b = Tpm::new(dir, "node-b");
    let entries = vec![("node-a", a.enrollment()), ("node-b", b.enrollment())];
    // The manifest without the approve rule, and a request waiting.
    let without_approve = MANIFEST.replace(
        "- apiGroups: [\"certificates.k8s.io\"]\n  resources: [\"certificatesigningrequests/approval\"]\n  verbs: [\"update\"]\n",
        "",
    );
    assert_ne!(
        without_approve, MANIFEST,
        "the manifest's approve rule moved"
    );
    cluster.apply(&without_approve);
    apply_trust(&cluster, dir, &entries);
    let first = a.request(&node_subject("node-a"), &[]);
    submit_request(&cluster, dir, "before-the-rule", &first, KUBELET_SIGNER);
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let relay =
        support::relay::FreezableRelay::forgetting_idle(cluster.port, Duration::from_secs(10));
    let through = relayed(&account, cluster.port, relay.port, dir);
    let replica = Replica::start(&through, dir, "approver");
    let mut failed: Vec<String> = Vec::new();
    // Finding 7: the write is refused (the approver says so in its log), the rule comes back,
    // and the request is decided without a restart.
    wait_until("the write is refused", Duration::from_secs(30), || {
        replica
            .child
            .log()
            .contains("needs `update` on certificatesigningrequests/approval")
    });
    assert!(decisions_on(&cluster, "before-the-rule").is_empty());
    cluster.apply(MANIFEST);
    if let Err(e) = decided_as(
        &cluster,
        "before-the-rule",
        "Approved",
        "AttestedTPMKey",
        Duration::from_secs(40),
    ) {
        failed.push(format!("finding 7: {e}"));
    }

    // Finding 5: nothing happens for 14 s (a flow idle for 10 s is forgotten by the path);
    // then node-b is removed and asks, and node-a asks: both are decided within seconds, and
    // node-b is denied.
    std::thread::sleep(Duration::from_secs(14));
    apply_trust(&cluster, dir, &entries[..1]);
    let removed = b.request(&node_subject("node-b"), &[]);
    submit_request(&cluster, dir, "removed-b", &removed, KUBELET_SIGNER);
    let again = a.request(&node_subject("node-a"), &[]);
    submit_request(&cluster, dir, "after-idle", &again, KUBELET_SIGNER);
    let asked = Instant::now();
    for (name, want, reason) in [
        ("removed-b", "Denied", "UnknownAttestationKey"),
        ("after-idle", "Approved", "AttestedTPMKey"),
    ] {
        if let Err(e) = decided_as(&cluster, name, want, reason, Duration::from_secs(10)) {
            failed.push(format!("finding 5: {e}"));
        }
    }
    eprintln!(
        "after 14 s idle through the forgetting path: decided in {:?}; flows forgotten: {}",
        asked.elapsed(),
        relay.forgotten()
    );
    assert!(
        failed.is_empty(),
        "{}\n--- approver ---\n{}",
        failed.join("\n"),
        replica.child.log()
    );
    assert_eq!(replica.metric("hwkey_approver_leader "), 1.0);
    assert_eq!(replica.terminate().code(), Some(0));
}

/// Finding 6: 40 connections held on the metrics port leave the liveness port answering. No
/// API server is needed: the approver starts, stands by and keeps its decision loop alive.
#[test]
fn liveness_has_its_own_listener_that_metrics_clients_cannot_starve() {
    let work = temp_dir();
    let dir = work.path();
    let ca = TestCa::new(dir);
    let kubeconfig = dir.join("unreachable.kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{}\n    certificate-authority: {}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n",
            free_port(),
            ca.ca_path().display()
        ),
    )
    .expect("kubeconfig");
    let trust = dir.join("trust");
    std::fs::create_dir(&trust).expect("trust dir");
    let (metrics, health) = (free_port(), free_port());
    let mut cmd = hwkey();
    cmd.arg("approver")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--signer-name", KUBELET_SIGNER, "--trust"])
        .arg(&trust)
        .args(["--leader-elect=false"])
        .arg(format!("--metrics-listen=127.0.0.1:{metrics}"))
        .arg(format!("--health-listen=127.0.0.1:{health}"));
    let mut child = ChildGuard::spawn(&mut cmd, "approver", &dir.join("approver.log"));
    child
        .wait_for_port(health, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the approver did not start: {e}\n{}", child.log()));
    let held: Vec<std::net::TcpStream> = (0..40)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", metrics)).ok())
        .collect();
    assert_eq!(held.len(), 40);
    // The metrics port itself is full (checked first, long before its 5 s header timeout
    // frees a slot): a new connection is closed unanswered. What a pod holding it achieves
    // stops there.
    {
        use std::io::{Read, Write};
        let mut extra = std::net::TcpStream::connect(("127.0.0.1", metrics)).expect("connect");
        extra.set_read_timeout(Some(Duration::from_secs(20))).ok();
        let _ = extra.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut got = Vec::new();
        match extra.read_to_end(&mut got) {
            Ok(_) => assert!(got.is_empty(), "a full metrics port answered: {got:?}"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("a full metrics port neither answered nor closed: {e}"),
        }
    }
    let probe = |port: u16| {
        let out = Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "3",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .arg(format!("http://127.0.0.1:{port}/healthz"))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let answered = (0..5).filter(|_| probe(health) == "200").count();
    assert_eq!(answered, 5, "{}", child.log());
    drop(held);
}
