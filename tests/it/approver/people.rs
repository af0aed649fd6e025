//! Issues 36 and 50: people renew their own certificates with no human step, through the
//! approver's self-renewal policy (`kubernetes.io/kube-apiserver-client`,
//! `deploy/approver-people.yaml`), on a real kube-apiserver + kube-controller-manager 1.20 that
//! only signs. Every attack is denied with its reason and never issued; the legitimate flows
//! pass: a same-key renewal by `hwkey renew --attest` with fresh TPM evidence, a new TPM key with
//! evidence, the proxy that the exec plugin starts renewing while kubectl runs in a loop, and a
//! certificate-only renewal for the one person the allow list opts in. Hardware proof is asked
//! at every issuance: a person's current certificate alone renews nothing by default, and
//! deleting their AK entry denies their next renewal within seconds.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::ca::TestCa;
use support::kube::{Approval, KubeCluster};
use support::kubectl::stop_pid;
use support::proxy::{Backend, Identity};
use support::requests::{self as rq, Node, RequestTree, SoftwareKey};
use support::*;

use super::kit::{
    apply_config_map, apply_trust, assert_decided, create_as_bootstrap, create_with, csr_object,
    decided_as, Replica, Tpm, ANYONE_MAY_REQUEST, CLIENT_SIGNER, MANIFEST, PEOPLE_MANIFEST, USAGES,
};
use crate::lifecycle::kit::csr_field;

/// The cluster, alice (a TPM identity with a certificate from the cluster CA), the people trust
/// and the approver as deploy/approver-people.yaml configures it.
struct Scene {
    id: Identity,
    cluster: KubeCluster,
    _work: tempfile::TempDir,
    dir: PathBuf,
    alice_tcti: String,
    /// Another person's TPM, registered for user dave.
    dave: Tpm,
    entries: Vec<(&'static str, String)>,
    replica: Replica,
}

/// alice by name (hardware proof only, the default); bob and mallory opted in to renew with
/// their current certificate alone; the group devs, which admits nobody (a person's groups are
/// their certificate's O values).
const ALLOW: &str = "users: [alice]\ncertificateOnly: [bob, mallory]\ngroups: [devs]\n";

impl Scene {
    fn new() -> Scene {
        require_tool("kubectl", "kubectl (from the machine image)");
        let id = Identity::tpm();
        let cluster = KubeCluster::start_with(&id.ca, "7m", Approval::SignerOnly);
        let work = temp_dir();
        let dir = work.path().to_path_buf();
        let Backend::Tpm(tpm) = &id.backend else {
            unreachable!("a TPM identity")
        };
        let alice_tcti = tpm.tcti();
        let alice_enrollment = String::from_utf8_lossy(
            &run_ok(hwkey().args([
                "attest",
                "enroll",
                "--key",
                &format!("tpm:?tcti={alice_tcti}"),
            ]))
            .stdout,
        )
        .into_owned();
        let dave = Tpm::new(&dir, "dave");
        let entries = vec![
            ("_allow", ALLOW.to_string()),
            ("alice", alice_enrollment),
            ("dave", dave.enrollment()),
        ];
        cluster.apply(MANIFEST);
        cluster.apply(PEOPLE_MANIFEST);
        cluster.apply(ANYONE_MAY_REQUEST);
        apply_people(&cluster, &dir, &entries);
        // The nodes' trust the shipped Deployment names: no node registered.
        apply_trust(&cluster, &dir, &[]);
        let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
        let replica = Replica::start_extra(
            &account,
            &dir,
            "approver",
            &[
                format!("--signer-name={CLIENT_SIGNER}"),
                "--people-trust-configmap=hwkey-system/hwkey-approver-people".into(),
                format!("--people-client-ca={}", cluster.ca_path().display()),
                // The attack "no certificate" is denied; the default leaves such a
                // request to a human (an administrator enrolling someone).
                "--people-on-missing-proof=deny".into(),
            ],
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while !replica.leading() {
            assert!(Instant::now() < deadline, "{}", replica.child.log());
            std::thread::sleep(Duration::from_millis(200));
        }
        Scene {
            id,
            cluster,
            _work: work,
            dir,
            alice_tcti,
            dave,
            entries,
            replica,
        }
    }

    fn log(&self) -> String {
        self.replica.child.log()
    }

    /// A software identity of the cluster CA for `cn` (in `org`): its kubeconfig.
    fn person(&self, cn: &str, org: Option<&str>) -> PathBuf {
        let (cert, key) = self
            .id
            .ca
            .client_cert(&self.dir, &format!("{cn}-login"), cn, org);
        self.cluster.cert_kubeconfig(cn, &cert, &key)
    }

    fn submit(&self, creator: &Creator, name: &str, pem: &[u8]) {
        let object = csr_object(&self.dir, name, pem, CLIENT_SIGNER, USAGES);
        match creator {
            Creator::Bootstrap => create_as_bootstrap(&self.cluster, &object),
            Creator::As(kubeconfig) => create_with(kubeconfig, &object),
        }
    }
}

/// The people trust ConfigMap from `entries` (name → text), replacing what is there.
fn apply_people(cluster: &KubeCluster, dir: &Path, entries: &[(&str, String)]) {
    apply_config_map(cluster, dir, "hwkey-approver-people", entries);
}

/// Who creates a request.
enum Creator {
    /// The cluster's bootstrap token.
    Bootstrap,
    /// An identity, by its kubeconfig.
    As(PathBuf),
}

type Subject<'a> = &'a [(&'a [u64], &'a str)];

/// A request for `subject` signed by the software key `key`, carrying `attributes`: PEM.
fn request(key: &SoftwareKey, subject: Subject<'_>, attributes: Vec<Node>) -> Vec<u8> {
    let names = subject
        .iter()
        .map(|(oid, value)| Node::rdn(oid, rq::tag::UTF8, value))
        .collect();
    let tree = RequestTree::new(Node::seq(names), &key.spki(), attributes);
    rq::pem(&tree.signed(|info| key.sign(info), &[])).into_bytes()
}

/// A certificate (DER) from `ca` for `key` and `subject`: valid now, or expired.
fn certificate(ca: &TestCa, key: &SoftwareKey, subject: Subject<'_>, expired: bool) -> Vec<u8> {
    let csr = String::from_utf8(request(key, subject, vec![])).expect("PEM");
    let pem = if expired {
        ca.sign_csr_pem_expired(&csr)
    } else {
        ca.sign_csr_pem(&csr, 1)
    };
    pem::parse(pem).expect("PEM").into_contents()
}

/// The attribute carrying `cert` as the current certificate (the same key's proof).
fn same_key(cert: &[u8]) -> Node {
    Node::Raw(hwkey::pki::same_key::attribute(cert))
}

/// The evidence attribute holding two current-certificate statements' bundles as two values.
fn two_certificates(cert: &[u8]) -> Node {
    let one = hwkey::pki::same_key::attribute(cert);
    // Attribute ::= SEQUENCE { type, SET { value } }: repeat the value inside the SET.
    let (_, value) = yasna::parse_der(&one, |r| {
        r.read_sequence(|r| {
            let oid = r.next().read_oid()?;
            let values = r.next().collect_set_of(|r| r.read_der())?;
            Ok((oid, values.into_iter().next().unwrap_or_default()))
        })
    })
    .expect("the attribute parses");
    Node::seq(vec![
        Node::oid(&[1, 2, 840, 113549, 1, 9, 16, 2, 59]),
        Node::set(vec![Node::Raw(value.clone()), Node::Raw(value)]),
    ])
}

const CN: &[u64] = rq::CN;
const O: &[u64] = rq::O;

/// Every attack of issue 36 and the legitimate flows, on one cluster with the approver as
/// shipped plus the people overlay.
#[test]
fn people_renew_themselves_and_every_way_to_another_identity_is_denied() {
    let s = Scene::new();
    let log = || s.log();
    let ca = &s.id.ca;
    let (alice, bob, carol, mallory) = (
        s.person("alice", Some("devs")),
        s.person("bob", Some("devs")),
        s.person("carol", Some("ops")),
        s.person("mallory", Some("system:masters")),
    );
    assert!(
        log().contains("ignores spec.expirationSeconds"),
        "the 1.20 lifetime note is missing:\n{}",
        log()
    );

    // Legitimate: bob (opted in to certificate-only renewals) renews with the key his
    // certificate is for.
    let bob_key = SoftwareKey::generate();
    let bob_subject: Subject<'_> = &[(O, "devs"), (CN, "bob")];
    let bob_cert = certificate(ca, &bob_key, bob_subject, false);
    s.submit(
        &Creator::As(bob.clone()),
        "bob-renews",
        &request(&bob_key, bob_subject, vec![same_key(&bob_cert)]),
    );
    assert_decided(&s.cluster, "bob-renews", "Approved", "SameKeyRenewal", &log);

    // Legitimate: alice moves to a new key in her TPM, with evidence from her registered AK.
    let next = Tpm::with(None, s.alice_tcti.clone(), &s.dir, "alice-next");
    let attested = next.request("CN=alice,O=devs", &[]);
    s.submit(&Creator::As(alice.clone()), "alice-new-key", &attested);
    assert_decided(
        &s.cluster,
        "alice-new-key",
        "Approved",
        "AttestedTPMKey",
        &log,
    );
    let issued = Instant::now() + Duration::from_secs(60);
    while csr_field(&s.cluster, "alice-new-key", "{.status.certificate}").is_empty() {
        assert!(Instant::now() < issued, "alice-new-key is never issued");
        std::thread::sleep(Duration::from_millis(200));
    }

    // O=system:masters: kube-apiserver itself refuses such a request for this signer (the
    // approver's rule, to name the group in the allow list, is the second line: unit tests).
    let mallory_key = SoftwareKey::generate();
    let masters: Subject<'_> = &[(O, "system:masters"), (CN, "mallory")];
    let mallory_cert = certificate(ca, &mallory_key, masters, false);
    let object = csr_object(
        &s.dir,
        "masters",
        &request(&mallory_key, masters, vec![same_key(&mallory_cert)]),
        CLIENT_SIGNER,
        USAGES,
    );
    let refused = run_fail(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&mallory)
            .args(["create", "-f"])
            .arg(&object),
    );
    assert!(
        output_text(&refused).contains("system:masters group is not allowed"),
        "{}",
        output_text(&refused)
    );

    let attacks = attacks(&s, &alice, &bob, &carol, &attested);
    for (name, creator, pem, _) in &attacks {
        s.submit(creator, name, pem);
    }
    for (name, _, _, reason) in &attacks {
        assert_decided(&s.cluster, name, "Denied", reason, &log);
    }

    alice_renews_with_hwkey(&s);

    // Removal is revocation: bob leaves the allow list; his next renewal is refused within
    // seconds, without a restart.
    let without_devs: Vec<(&str, String)> = s
        .entries
        .iter()
        .map(|(n, t)| match *n {
            "_allow" => (*n, "users: [alice]\ngroups: [devs]\n".to_string()),
            _ => (*n, t.clone()),
        })
        .collect();
    apply_people(&s.cluster, &s.dir, &without_devs);
    let removed_at = Instant::now();
    s.submit(
        &Creator::As(bob),
        "bob-removed",
        &request(&bob_key, bob_subject, vec![same_key(&bob_cert)]),
    );
    if let Err(e) = decided_as(
        &s.cluster,
        "bob-removed",
        "Denied",
        "RequesterNotAllowed",
        Duration::from_secs(15),
    ) {
        panic!("{e}\n{}", log());
    }
    assert!(removed_at.elapsed() < Duration::from_secs(15));

    the_plugins_proxy_renews_while_kubectl_runs(&s);
    removing_alices_ak_denies_her_next_renewal(&s);
    an_enrolment_without_proof_waits_only_for_the_requesters_own_name(s);
}

/// `hwkey renew` of alice's TPM key through the cluster, `attest`ing or not: its output and the
/// name of the request it made.
fn renew_alice(s: &Scene, attest: bool) -> (std::process::Output, String) {
    let before = csr_names(&s.cluster, "hwkey-alice-");
    let mut cmd = hwkey();
    cmd.envs(s.id.envs())
        .args(["renew", "--key", &s.id.key_uri, "--cert"])
        .arg(&s.id.cert)
        .args(["--server", &s.cluster.url(), "--ca"])
        .arg(s.cluster.ca_path())
        .args(["--wait", "60s"]);
    if attest {
        cmd.arg("--attest");
    }
    let out = cmd.output().expect("run hwkey renew");
    let name = new_csr(&s.cluster, "hwkey-alice-", &before);
    (out, name)
}

/// Removal bites: with alice's AK entry deleted from the people trust (she stays in the allow
/// list), her next renewal is denied within seconds, with fresh evidence from the same TPM
/// (UnknownAttestationKey) and with her current certificate alone (HardwareProofRequired), and
/// her certificate file is left as it was.
fn removing_alices_ak_denies_her_next_renewal(s: &Scene) {
    let without_alice: Vec<(&str, String)> = s
        .entries
        .iter()
        .filter(|(n, _)| *n != "alice")
        .map(|(n, t)| (*n, t.clone()))
        .collect();
    apply_people(&s.cluster, &s.dir, &without_alice);
    let removed_at = Instant::now();
    let before = std::fs::read(&s.id.cert).expect("alice's certificate");
    let (out, name) = renew_alice(s, true);
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("was denied"),
        "{}",
        output_text(&out)
    );
    assert_eq!(
        csr_field(&s.cluster, &name, "{.status.conditions[0].reason}"),
        "UnknownAttestationKey",
        "{}",
        s.log()
    );
    // The renewal finding 1 of issue 50 saw approved: the same key, her certificate only.
    let (out, name) = renew_alice(s, false);
    assert!(!out.status.success(), "{}", output_text(&out));
    assert_eq!(
        csr_field(&s.cluster, &name, "{.status.conditions[0].reason}"),
        "HardwareProofRequired",
        "{}",
        s.log()
    );
    assert!(
        removed_at.elapsed() < Duration::from_secs(30),
        "denied only after {:?}",
        removed_at.elapsed()
    );
    assert_eq!(std::fs::read(&s.id.cert).expect("certificate"), before);
    apply_people(&s.cluster, &s.dir, &s.entries);
}

/// By default a request with no proof of the key is left alone only when the requester asks
/// for their own name (erin's enrolment, which an administrator then approves); the same
/// request made by someone else for erin's name (an administrator's own, or an attacker's) is
/// denied with its reason. And a person's stale TPM evidence is refused as a node's is.
fn an_enrolment_without_proof_waits_only_for_the_requesters_own_name(s: Scene) {
    let Scene {
        id,
        cluster,
        dir,
        replica,
        alice_tcti,
        ..
    } = s;
    assert_eq!(replica.terminate().code(), Some(0));
    // Stale evidence: alice's new TPM key, evidence made 3 s before the request, decided with a
    // 2 s window.
    let next = Tpm::with(None, alice_tcti, &dir, "alice-stale");
    let stale = next.request("CN=alice,O=devs", &[]);
    std::thread::sleep(Duration::from_secs(3));
    let (cert, key) = id.ca.client_cert(&dir, "alice-late", "alice", Some("devs"));
    let alice = cluster.cert_kubeconfig("alice-late", &cert, &key);
    create_with(
        &alice,
        &csr_object(&dir, "stale", &stale, CLIENT_SIGNER, USAGES),
    );
    let key = SoftwareKey::generate();
    let pem = request(&key, &[(O, "devs"), (CN, "erin")], vec![]);
    // erin's own request (she signed in some other way: here a certificate of her own).
    let (erin_cert, erin_key) = id.ca.client_cert(&dir, "erin-login", "erin", Some("devs"));
    let erin = cluster.cert_kubeconfig("erin", &erin_cert, &erin_key);
    create_with(
        &erin,
        &csr_object(&dir, "enrol-erin", &pem, CLIENT_SIGNER, USAGES),
    );
    // The same request, made by the administrator and by bob for erin's name.
    let object = csr_object(&dir, "enrol-for-erin", &pem, CLIENT_SIGNER, USAGES);
    cluster.kubectl_ok(&["create", "-f", &object.display().to_string()]);
    let (bob_cert, bob_key) = id.ca.client_cert(&dir, "bob-late", "bob", Some("devs"));
    let bob = cluster.cert_kubeconfig("bob-late", &bob_cert, &bob_key);
    create_with(
        &bob,
        &csr_object(&dir, "bob-for-erin", &pem, CLIENT_SIGNER, USAGES),
    );
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let once = run_ok(
        hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&account)
            .args(["--signer-name", CLIENT_SIGNER])
            .args([
                "--people-trust-configmap",
                "hwkey-system/hwkey-approver-people",
            ])
            .arg(format!("--people-client-ca={}", id.ca.ca_path().display()))
            .args(["--evidence-max-age", "2s", "--once"]),
    );
    let text = output_text(&once);
    assert!(
        !text.contains("enrol-erin") && text.contains("denied stale: EvidenceStale"),
        "{text}"
    );
    for name in ["enrol-for-erin", "bob-for-erin"] {
        assert!(
            text.contains(&format!("denied {name}: RequesterNotAllowed")),
            "{name}: {text}"
        );
        assert_eq!(
            csr_field(&cluster, name, "{.status.conditions[0].reason}"),
            "RequesterNotAllowed"
        );
    }
    assert_eq!(
        csr_field(&cluster, "enrol-erin", "{.status.conditions[*].type}"),
        ""
    );
    cluster.kubectl_ok(&["certificate", "approve", "enrol-erin"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while csr_field(&cluster, "enrol-erin", "{.status.certificate}").is_empty() {
        assert!(Instant::now() < deadline, "enrol-erin is never issued");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// (name, creator, request, the reason it is denied with).
type Attack = (&'static str, Creator, Vec<u8>, &'static str);

fn attacks(s: &Scene, alice: &Path, bob: &Path, carol: &Path, attested: &[u8]) -> Vec<Attack> {
    let ca = &s.id.ca;
    let as_ = |k: &Path| Creator::As(k.to_path_buf());
    let key = SoftwareKey::generate();
    let alice_devs: Subject<'_> = &[(O, "devs"), (CN, "alice")];
    let alice_cert = certificate(ca, &key, alice_devs, false);
    let good = |k: &SoftwareKey| request(k, alice_devs, vec![same_key(&alice_cert)]);
    // Other identities that ask for a person's name.
    let (node_cert, node_key) =
        ca.client_cert(&s.dir, "node-login", "system:node:n1", Some("system:nodes"));
    let node = s.cluster.cert_kubeconfig("node", &node_cert, &node_key);
    s.cluster
        .kubectl_ok(&["-n", "default", "create", "serviceaccount", "intruder"]);
    let account = s.cluster.service_account_kubeconfig("default", "intruder");
    // Same-key proofs that do not hold.
    let other_key = SoftwareKey::generate();
    let expired = certificate(ca, &key, alice_devs, true);
    let stranger_dir = s.dir.join("stranger-ca");
    std::fs::create_dir_all(&stranger_dir).expect("mkdir");
    let stranger = TestCa::new(&stranger_dir);
    let foreign = certificate(&stranger, &key, alice_devs, false);
    let alice_ops = certificate(ca, &key, &[(O, "ops"), (CN, "alice")], false);
    let carol_key = SoftwareKey::generate();
    let carol_subject: Subject<'_> = &[(O, "ops"), (CN, "carol")];
    let carol_cert = certificate(ca, &carol_key, carol_subject, false);
    // dan is in devs only because his certificate says so: devs does not admit him.
    let dan = s.person("dan", Some("devs"));
    let dan_key = SoftwareKey::generate();
    let dan_subject: Subject<'_> = &[(O, "devs"), (CN, "dan")];
    let dan_cert = certificate(ca, &dan_key, dan_subject, false);
    // gus is in devs by his login certificate's O and asks for a certificate without it: a
    // group admits nobody, whatever the certificate asked for carries.
    let gus = s.person("gus", Some("devs"));
    let gus_key = SoftwareKey::generate();
    let gus_subject: Subject<'_> = &[(CN, "gus")];
    let gus_cert = certificate(ca, &gus_key, gus_subject, false);
    let san = rq::extension_request(vec![rq::extension(
        rq::SAN,
        None,
        rq::dns_san("alice.example.com"),
    )]);
    vec![
        (
            "bob-asks-alice",
            as_(bob),
            good(&key),
            "RequesterNotAllowed",
        ),
        (
            "extra-group",
            as_(alice),
            request(
                &key,
                &[(O, "devs"), (O, "ops"), (CN, "alice")],
                vec![same_key(&alice_cert)],
            ),
            "SubjectNotAllowed",
        ),
        (
            "service-account",
            as_(&account),
            good(&key),
            "RequesterNotAllowed",
        ),
        ("node", as_(&node), good(&key), "RequesterNotAllowed"),
        (
            "bootstrap-token",
            Creator::Bootstrap,
            good(&key),
            "RequesterNotAllowed",
        ),
        (
            "two-cn",
            as_(alice),
            request(
                &key,
                &[(O, "devs"), (CN, "alice"), (CN, "bob")],
                vec![same_key(&alice_cert)],
            ),
            "SubjectNotAllowed",
        ),
        (
            "ou",
            as_(alice),
            request(
                &key,
                &[(O, "devs"), (rq::OU, "x"), (CN, "alice")],
                vec![same_key(&alice_cert)],
            ),
            "SubjectNotAllowed",
        ),
        (
            "san",
            as_(alice),
            // The attributes SET in DER order: the extension request sorts first.
            request(&key, alice_devs, vec![san, same_key(&alice_cert)]),
            "SubjectAltNameNotAllowed",
        ),
        (
            "another-key",
            as_(alice),
            good(&other_key),
            "EvidenceInvalid",
        ),
        (
            "expired",
            as_(alice),
            request(&key, alice_devs, vec![same_key(&expired)]),
            "EvidenceInvalid",
        ),
        (
            "another-ca",
            as_(alice),
            request(&key, alice_devs, vec![same_key(&foreign)]),
            "EvidenceInvalid",
        ),
        (
            "another-subject",
            as_(alice),
            request(&key, alice_devs, vec![same_key(&alice_ops)]),
            "SubjectMismatch",
        ),
        (
            "two-certificates",
            as_(alice),
            request(&key, alice_devs, vec![two_certificates(&alice_cert)]),
            "ExtensionNotAllowed",
        ),
        (
            "no-certificate",
            as_(alice),
            request(&key, alice_devs, vec![]),
            "NoEvidence",
        ),
        (
            "not-in-the-list",
            as_(carol),
            request(&carol_key, carol_subject, vec![same_key(&carol_cert)]),
            "RequesterNotAllowed",
        ),
        (
            "another-users-ak",
            as_(alice),
            s.dave.request("CN=alice,O=devs", &[]),
            "SubjectMismatch",
        ),
        (
            "reused-evidence",
            as_(alice),
            attested.to_vec(),
            "EvidenceReused",
        ),
        (
            "group-vouches-for-itself",
            as_(&dan),
            request(&dan_key, dan_subject, vec![same_key(&dan_cert)]),
            "RequesterNotAllowed",
        ),
        (
            "group-vouches-for-another",
            as_(&gus),
            request(&gus_key, gus_subject, vec![same_key(&gus_cert)]),
            "RequesterNotAllowed",
        ),
        // alice's valid certificate for exactly this key: possession, not hardware, and alice
        // is not opted in to certificate-only renewals.
        (
            "certificate-only",
            as_(alice),
            good(&key),
            "HardwareProofRequired",
        ),
    ]
}

/// Legitimate: alice renews with the key she holds through `hwkey renew --attest`, fresh TPM
/// evidence in the request (AttestedTPMKey), and the new certificate is installed. Without
/// `--attest` the same renewal is denied (HardwareProofRequired), and her file is untouched.
fn alice_renews_with_hwkey(s: &Scene) {
    let before = std::fs::read(&s.id.cert).expect("alice's certificate");
    let (denied, name) = renew_alice(s, false);
    assert!(!denied.status.success(), "{}", output_text(&denied));
    assert_eq!(
        csr_field(&s.cluster, &name, "{.status.conditions[0].reason}"),
        "HardwareProofRequired",
        "{}",
        s.log()
    );
    assert_eq!(std::fs::read(&s.id.cert).expect("certificate"), before);
    let (out, name) = renew_alice(s, true);
    assert!(
        out.status.success() && output_text(&out).contains("renewed: "),
        "{}",
        output_text(&out)
    );
    assert_ne!(std::fs::read(&s.id.cert).expect("renewed"), before);
    assert_eq!(
        csr_field(&s.cluster, &name, "{.status.conditions[0].reason}"),
        "AttestedTPMKey",
        "{}",
        s.log()
    );
}

/// The names of the CertificateSigningRequests that start with `prefix`.
fn csr_names(cluster: &KubeCluster, prefix: &str) -> Vec<String> {
    let out = cluster.kubectl_ok(&["get", "csr", "-o", "jsonpath={.items[*].metadata.name}"]);
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

/// The one CertificateSigningRequest starting with `prefix` that is not in `before` (creation
/// times have a second's resolution: two requests in one second have no order).
fn new_csr(cluster: &KubeCluster, prefix: &str, before: &[String]) -> String {
    let new: Vec<String> = csr_names(cluster, prefix)
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    match new.as_slice() {
        [one] => one.clone(),
        _ => panic!("expected one new CSR named {prefix}*, found {new:?}"),
    }
}

/// Legitimate: the proxy `hwkey credential` starts (kubeconfig written with `--renew`) renews
/// alice's certificate, due at once, while kubectl runs in a loop: no command fails, and the new
/// certificate is in the file and in use afterwards.
fn the_plugins_proxy_renews_while_kubectl_runs(s: &Scene) {
    let dir = s.dir.join("plugin");
    std::fs::create_dir_all(&dir).expect("plugin dir");
    // A certificate an hour into its life with 90 s left: renewal is due at once, and the
    // cluster's certificate (7m from a start backdated 5m) ends later.
    let csr = run_ok(hwkey().envs(s.id.envs()).args([
        "csr",
        "--key",
        &s.id.key_uri,
        "--subject",
        "CN=alice,O=devs",
    ]));
    let cert = dir.join("alice.pem");
    std::fs::write(
        &cert,
        s.id.ca.sign_csr_pem_window(
            &String::from_utf8_lossy(&csr.stdout),
            Duration::from_secs(3600),
            Duration::from_secs(90),
        ),
    )
    .expect("write certificate");
    let first = std::fs::read(&cert).expect("certificate");
    let requests_before = csr_names(&s.cluster, "hwkey-alice-");
    let (kubeconfig, state) = (dir.join("kubeconfig"), dir.join("state"));
    run_ok(
        hwkey()
            .envs(s.id.envs())
            .args([
                "kubeconfig",
                "--name",
                "people",
                "--renew",
                "--attest",
                "--key",
                &s.id.key_uri,
            ])
            .arg("--cert")
            .arg(&cert)
            .args(["--server", &s.cluster.url()])
            .arg("--ca")
            .arg(s.cluster.ca_path())
            .arg("--out")
            .arg(&kubeconfig)
            .arg("--state-dir")
            .arg(&state),
    );
    let kubectl = || {
        let mut cmd = Command::new("kubectl");
        cmd.envs(s.id.envs())
            .env("HOME", &dir)
            .env_remove("KUBERNETES_EXEC_INFO")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["get", "csr", "-o", "name"]);
        cmd
    };
    let proxy_log = || std::fs::read_to_string(state.join("proxy.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut ok, mut failed) = (0u32, Vec::new());
    while std::fs::read(&cert).expect("certificate") == first {
        assert!(
            Instant::now() < deadline,
            "the plugin's proxy did not renew within 2 minutes:\n{}\n{}",
            proxy_log(),
            s.log()
        );
        let out = kubectl().output().expect("run kubectl");
        if out.status.success() {
            ok += 1;
        } else {
            failed.push(output_text(&out));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let after = kubectl().output().expect("run kubectl");
    let pid = std::fs::read_to_string(state.join("proxy.pid"))
        .ok()
        .and_then(|p| p.trim().parse().ok());
    let renewed = std::fs::read(&cert).expect("certificate");
    if let Some(pid) = pid {
        stop_pid(pid);
    }
    assert!(
        failed.is_empty(),
        "{} of {} kubectl commands failed while the proxy renewed: {:?}\n{}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(2)],
        proxy_log()
    );
    assert!(ok >= 1, "kubectl never ran before the renewal");
    assert!(after.status.success(), "{}", output_text(&after));
    assert_ne!(renewed, first, "the certificate file was not renewed");
    let name = new_csr(&s.cluster, "hwkey-alice-", &requests_before);
    assert_eq!(
        csr_field(&s.cluster, &name, "{.status.conditions[0].reason}"),
        "AttestedTPMKey",
        "{}",
        s.log()
    );
}
