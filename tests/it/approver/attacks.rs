//! Issue 21: the approver decides on exactly what the signer signs. Every way to a wrong
//! identity found by attacking the approver on a real kube-apiserver + kube-controller-manager
//! 1.20 (the controller manager only signs; the approver runs with `deploy/approver.yaml`'s
//! account and arguments) is tried here, each denied with its precise reason and never issued;
//! the legitimate flows still pass.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use super::kit::{
    apply_trust, assert_decided, create_as_bootstrap, create_with, csr_object, openssl_request,
    submit_request, wait_until, Leases, Replica, Tpm, KUBELET_SIGNER, MANIFEST, NODE_USAGES,
};
use crate::lifecycle::kit::{csr_field, enroll_node};

/// The cluster every attack runs against: four TPMs, the trust ConfigMap of round one's
/// findings (node-a also registered as node-0, node-c with a fake akName hidden in a block
/// scalar, a typo'd entry), and one approver replica as shipped.
struct Scene {
    id: Identity,
    cluster: KubeCluster,
    _work: tempfile::TempDir,
    dir: PathBuf,
    a: Tpm,
    b: Tpm,
    stranger: Tpm,
    entries: Vec<(&'static str, String)>,
    account: PathBuf,
}

const NODE_A: &str = "CN=system:node:node-a,O=system:nodes";
const NODE_B: &str = "CN=system:node:node-b,O=system:nodes";

impl Scene {
    fn new() -> Scene {
        require_tool("kubectl", "kubectl (from the machine image)");
        let id = Identity::tpm();
        let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
        let work = temp_dir();
        let dir = work.path().to_path_buf();
        let (_, tcti_a) = enroll_node(&id, &dir, "node-a");
        let a = Tpm::with(None, tcti_a, &dir, "node-a");
        let b = Tpm::new(&dir, "node-b");
        let stranger = Tpm::new(&dir, "stranger");
        let x = Tpm::new(&dir, "node-x");
        let enroll_a = a.enrollment();
        let stranger_name = stranger
            .enrollment()
            .lines()
            .find_map(|l| l.strip_prefix("akName: ").map(str::to_string))
            .expect("akName");
        // node-c's registration is node-x's TPM, with a fake akName (the stranger's) hidden in
        // a block scalar ahead of the real fields (finding 5).
        let fake_c = format!(
            "akPublicKeyPem: |\n  akName: {stranger_name}\n{}",
            without_field(&x.enrollment(), "akPublicKeyPem")
        );
        let entries = vec![
            ("node-a", enroll_a.clone()),
            ("node-b", b.enrollment()),
            ("node-c", fake_c),
            // node-a's AK registered again under a name that sorts first (finding 7).
            ("node-0", enroll_a),
            // A typo'd entry (finding 6).
            ("bad-node", "akName: zz\n".to_string()),
        ];
        cluster.apply(MANIFEST);
        apply_trust(&cluster, &dir, &entries);
        let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
        Scene {
            id,
            cluster,
            _work: work,
            dir,
            a,
            b,
            stranger,
            entries,
            account,
        }
    }
}

/// Who creates an attack's request.
enum Creator {
    /// The bootstrap token of the allowed group (a joining node).
    Bootstrap,
    /// Another identity, by its kubeconfig.
    As(PathBuf),
}

/// One way to a wrong identity: the request, who creates it with which usages, and the reason
/// it must be denied with (never issued).
struct Attack {
    name: &'static str,
    pem: Vec<u8>,
    usages: &'static str,
    creator: Creator,
    reason: &'static str,
}

impl Attack {
    fn new(name: &'static str, pem: Vec<u8>, reason: &'static str) -> Attack {
        Attack {
            name,
            pem,
            usages: NODE_USAGES,
            creator: Creator::Bootstrap,
            reason,
        }
    }

    fn by(mut self, creator: Creator) -> Attack {
        self.creator = creator;
        self
    }

    fn usages(mut self, usages: &'static str) -> Attack {
        self.usages = usages;
        self
    }

    fn submit(&self, cluster: &KubeCluster, dir: &Path) {
        let object = csr_object(dir, self.name, &self.pem, KUBELET_SIGNER, self.usages);
        match &self.creator {
            Creator::Bootstrap => create_as_bootstrap(cluster, &object),
            Creator::As(kubeconfig) => create_with(kubeconfig, &object),
        }
    }
}

/// Every attack of round one, as a table of (request, creator, expected reason). `good_a` is
/// node-a's approved request.
fn attacks(s: &Scene, good_a: &[u8]) -> Vec<Attack> {
    let (dir, a) = (s.dir.as_path(), &s.a);
    // Finding 1: node-a's attested request followed by a software request for node-b. Go's
    // pem.Decode skips "x" + the first block when BEGIN is mid-line and signs the second.
    let software_b = openssl_request(dir, "soft-b", "/O=system:nodes/CN=system:node:node-b", None);
    let mut two = b"x".to_vec();
    two.extend_from_slice(good_a);
    two.extend_from_slice(&software_b);
    let (cert_a, key_a) = s.id.ca.client_cert(
        dir,
        "node-a-client",
        "system:node:node-a",
        Some("system:nodes"),
    );
    let as_node_a = s.cluster.cert_kubeconfig("node-a", &cert_a, &key_a);
    // Finding 9: a bootstrap token of another group.
    let other_group = s.cluster.bootstrap_token_kubeconfig(
        "ghijkl",
        "0123456789abcdef",
        "system:bootstrappers:other",
    );
    let openssl_a = "/O=system:nodes/CN=system:node:node-a";
    vec![
        Attack::new("two-blocks-bootstrap", two.clone(), "MalformedRequest"),
        Attack::new("two-blocks-node", two, "MalformedRequest").by(Creator::As(as_node_a)),
        // Findings 2 and 3: subjects Go reads as another node, or as more than a node.
        Attack::new(
            "two-cn",
            a.request(
                "CN=system:node:node-a,CN=system:node:node-b,O=system:nodes",
                &[],
            ),
            "SubjectNotAllowed",
        ),
        Attack::new(
            "hidden-cn",
            a.request(
                "CN=system:node:node-b,OU=x\\, CN=system:node:node-a,O=system:nodes",
                &[],
            ),
            "SubjectNotAllowed",
        ),
        Attack::new(
            "extra-o",
            a.request("CN=system:node:node-a,O=system:nodes,O=system:masters", &[]),
            "SubjectNotAllowed",
        ),
        Attack::new(
            "missing-o",
            a.request("CN=system:node:node-a", &[]),
            "SubjectNotAllowed",
        ),
        // Finding 3 (and 12: the attributes SET is in DER order, so these parse): each SAN kind.
        Attack::new(
            "san-dns",
            a.request(NODE_A, &["--dns", "kubernetes.default.svc"]),
            "SubjectAltNameNotAllowed",
        ),
        Attack::new(
            "san-ip",
            a.request(NODE_A, &["--ip", "10.0.0.1"]),
            "SubjectAltNameNotAllowed",
        ),
        Attack::new(
            "san-email",
            openssl_request(
                dir,
                "san-email",
                openssl_a,
                Some("subjectAltName=email:node@example.com"),
            ),
            "SubjectAltNameNotAllowed",
        ),
        Attack::new(
            "san-uri",
            openssl_request(
                dir,
                "san-uri",
                openssl_a,
                Some("subjectAltName=URI:spiffe://cluster/node-a"),
            ),
            "SubjectAltNameNotAllowed",
        ),
        Attack::new("server-auth", a.request(NODE_A, &[]), "UsagesNotAllowed")
            .usages("[digital signature, key encipherment, client auth, server auth]"),
        Attack::new("wrong-group", a.request(NODE_A, &[]), "RequesterNotAllowed")
            .by(Creator::As(other_group)),
        // Finding 10: node-a's approved request, resubmitted as is.
        Attack::new("resubmitted", good_a.to_vec(), "EvidenceReused"),
        // Finding 5: the stranger TPM whose AK name hides in node-c's registration.
        Attack::new(
            "fake-ak-name",
            s.stranger
                .request("CN=system:node:node-c,O=system:nodes", &[]),
            "UnknownAttestationKey",
        ),
    ]
}

#[test]
fn the_approver_denies_every_way_to_a_wrong_identity() {
    let s = Scene::new();
    let replica = Replica::start(&s.account, &s.dir, "approver");
    wait_until("the approver leads", Duration::from_secs(30), || {
        replica.leading()
    });
    let log = || replica.child.log();
    let good_a = legitimate_requests_pass(&s, &replica);

    let attacks = attacks(&s, &good_a);
    for attack in &attacks {
        attack.submit(&s.cluster, &s.dir);
    }
    for attack in &attacks {
        assert_decided(&s.cluster, attack.name, "Denied", attack.reason, &log);
    }

    // Finding 4: node-b is removed from the ConfigMap; its next request is denied within
    // seconds, without a restart.
    let without_b: Vec<(&str, String)> = s
        .entries
        .iter()
        .filter(|(n, _)| *n != "node-b")
        .cloned()
        .collect();
    apply_trust(&s.cluster, &s.dir, &without_b);
    wait_until(
        "the approver sees node-b removed",
        Duration::from_secs(10),
        || replica.metric("hwkey_approver_registered_nodes ") == 3.0,
    );
    let removed = s.b.request(NODE_B, &[]);
    submit_request(&s.cluster, &s.dir, "removed-b", &removed, KUBELET_SIGNER);
    assert_decided(
        &s.cluster,
        "removed-b",
        "Denied",
        "UnknownAttestationKey",
        &log,
    );
    assert_eq!(replica.terminate().code(), Some(0));

    a_restart_keeps_deciding(&s);
    stale_evidence_and_unknown_signers_are_refused(&s);
    a_frozen_leader_steps_down(&s);
}

/// The legitimate flow: node-a's attested request from a bootstrap identity of the allowed
/// group is approved and issued, even with its AK also registered as node-0; node-b's too.
/// The trust's bad and duplicate entries are counted and reported. Returns node-a's request.
fn legitimate_requests_pass(s: &Scene, replica: &Replica) -> Vec<u8> {
    let log = || replica.child.log();
    let good_a = s.a.request(NODE_A, &[]);
    submit_request(&s.cluster, &s.dir, "good-a", &good_a, KUBELET_SIGNER);
    assert_decided(&s.cluster, "good-a", "Approved", "AttestedTPMKey", &log);
    wait_until("good-a is issued", Duration::from_secs(60), || {
        !csr_field(&s.cluster, "good-a", "{.status.certificate}").is_empty()
    });
    let good_b = s.b.request(NODE_B, &[]);
    submit_request(&s.cluster, &s.dir, "good-b", &good_b, KUBELET_SIGNER);
    assert_decided(&s.cluster, "good-b", "Approved", "AttestedTPMKey", &log);
    assert_eq!(replica.metric("hwkey_approver_trust_invalid_entries "), 1.0);
    assert_eq!(replica.metric("hwkey_approver_trust_duplicate_aks "), 1.0);
    assert_eq!(replica.metric("hwkey_approver_registered_nodes "), 4.0);
    let events = s.cluster.kubectl_ok(&[
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
    good_a
}

/// Finding 6: a restart with the malformed entry still there starts, and approves node-a.
fn a_restart_keeps_deciding(s: &Scene) {
    let restarted = Replica::start(&s.account, &s.dir, "approver-2");
    wait_until(
        "the restarted approver leads",
        Duration::from_secs(30),
        || restarted.leading(),
    );
    let again_a = s.a.request(NODE_A, &[]);
    submit_request(
        &s.cluster,
        &s.dir,
        "after-restart",
        &again_a,
        KUBELET_SIGNER,
    );
    assert_decided(
        &s.cluster,
        "after-restart",
        "Approved",
        "AttestedTPMKey",
        &|| restarted.child.log(),
    );
    assert_eq!(restarted.terminate().code(), Some(0));
}

/// Finding 10: evidence older than the window is stale (age only grows: waiting past the
/// window is a clock wait, not a race). Finding 3: a signer without a policy is refused at
/// start.
fn stale_evidence_and_unknown_signers_are_refused(s: &Scene) {
    let stale = s.a.request(NODE_A, &[]);
    std::thread::sleep(Duration::from_secs(3));
    submit_request(&s.cluster, &s.dir, "stale", &stale, KUBELET_SIGNER);
    let once = run_ok(
        hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&s.account)
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
    let out = run_fail(
        hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&s.account)
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
}

/// Finding 11: a leader whose API server stops answering steps down by the renew deadline
/// (3 s here), though its renewal call never returns: its own "not leading" line, well before
/// the connection's keepalive (15 s) could end the call.
fn a_frozen_leader_steps_down(s: &Scene) {
    let relay = support::relay::FreezableRelay::start(s.cluster.port);
    let through_relay = relayed_kubeconfig(&s.account, s.cluster.port, relay.port, &s.dir);
    let frozen_leader = Replica::start_with(
        hwkey(),
        &through_relay,
        &s.dir,
        "approver-relayed",
        Leases::Short,
    );
    wait_until(
        "the relayed approver leads",
        Duration::from_secs(30),
        || frozen_leader.leading(),
    );
    relay.freeze();
    let frozen_at = Instant::now();
    wait_until(
        "the frozen leader says it stands by",
        Duration::from_secs(12),
        || {
            frozen_leader
                .child
                .log()
                .contains("not leading: standing by")
        },
    );
    assert!(!frozen_leader.leading());
    assert!(frozen_at.elapsed() < Duration::from_secs(12));
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
