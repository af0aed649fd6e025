//! Issue 52: TPMs that join by their manufacturer's EK certificate, on the real API server,
//! with only the bootstrap token and no operator step per node (`hwkey bootstrap --attest
//! --ek-proof`; the approver with `--signer-name hwkey.dev/tpm-credential`). The TPMs are
//! swtpm's, manufactured by `swtpm_setup --create-ek-cert` with one local CA standing in for a
//! TPM vendor.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::swtpm::Swtpm;
use support::*;

use super::kit::*;
use crate::lifecycle::kit::csr_field;

/// The overlay operators apply for zero-touch nodes.
const EK_MANIFEST: &str = include_str!("../../../deploy/approver-ek.yaml");

/// Carrier requests in the flood of another bootstrap token.
const FLOOD: usize = 300;

/// The carrier requests' signer.
const CARRIER_SIGNER: &str = "hwkey.dev/tpm-credential";

/// One CertificateSigningRequest as the tests look at it.
#[derive(Debug, Clone)]
struct Csr {
    name: String,
    signer: String,
    decision: String,
    reason: String,
    message: String,
    annotations: serde_json::Map<String, serde_json::Value>,
    issued: bool,
}

/// Every CertificateSigningRequest in the cluster.
fn csrs(cluster: &KubeCluster) -> Vec<Csr> {
    let out = cluster.kubectl_ok(&["get", "csr", "-o", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("csr list JSON");
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|c| Csr {
            name: text(&c["metadata"]["name"]),
            signer: text(&c["spec"]["signerName"]),
            decision: text(&c["status"]["conditions"][0]["type"]),
            reason: text(&c["status"]["conditions"][0]["reason"]),
            message: text(&c["status"]["conditions"][0]["message"]),
            annotations: c["metadata"]["annotations"]
                .as_object()
                .cloned()
                .unwrap_or_default(),
            issued: c["status"]["certificate"].as_str().is_some(),
        })
        .collect()
}

/// The requests whose name starts with `prefix`, for `signer`.
fn requests_for(cluster: &KubeCluster, prefix: &str, signer: &str) -> Vec<Csr> {
    csrs(cluster)
        .into_iter()
        .filter(|c| c.name.starts_with(prefix) && c.signer == signer)
        .collect()
}

/// The trust ConfigMap's entries.
fn trust_entries(cluster: &KubeCluster) -> serde_json::Map<String, serde_json::Value> {
    let out = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "get",
        "configmap",
        "hwkey-approver-trust",
        "-o",
        "json",
    ]);
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).expect("configmap JSON");
    map["data"].as_object().cloned().unwrap_or_default()
}

/// Sets one entry of the trust ConfigMap (a merge patch: the other entries stay).
fn patch_trust(cluster: &KubeCluster, entry: &str, text: &str) {
    let patch = serde_json::json!({"data": {entry: text}});
    cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "patch",
        "configmap",
        "hwkey-approver-trust",
        "--type=merge",
        "-p",
        &patch.to_string(),
    ]);
}

/// A field of an entry's YAML (`field: value` on one line).
fn entry_field(entry: &str, field: &str) -> String {
    entry
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}: ")))
        .unwrap_or_default()
        .to_string()
}

/// A node's directory and key for a TPM.
struct Node {
    name: String,
    dir: PathBuf,
    tcti: String,
}

impl Node {
    fn new(root: &Path, name: &str, tpm: &Swtpm) -> Node {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).expect("node dir");
        Node {
            name: name.into(),
            dir,
            tcti: tpm.tcti(),
        }
    }

    /// `hwkey bootstrap --attest --ek-proof [EK]` with the cluster's bootstrap token.
    fn bootstrap(&self, token: &Path, ek: Option<&str>) -> Command {
        let mut cmd = hwkey();
        cmd.arg("bootstrap")
            .arg("--bootstrap-kubeconfig")
            .arg(token)
            .args(["--node-name", &self.name])
            .arg("--key")
            .arg(format!(
                "tpm:path={}?tcti={}",
                self.dir.join("node.tpm.pem").display(),
                self.tcti
            ))
            .args(["--create-key", "ec-p256", "--attest"])
            .arg(match ek {
                Some(ek) => format!("--ek-proof={ek}"),
                None => "--ek-proof".into(),
            })
            .arg("--cert")
            .arg(self.dir.join("node.pem"))
            .arg("--out")
            .arg(self.dir.join("kubelet.conf"))
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .args(["--wait", "90s"]);
        cmd
    }

    fn join(&self, cluster: &KubeCluster, ek: Option<&str>) -> Output {
        let out = self
            .bootstrap(&cluster.bootstrap_kubeconfig, ek)
            .output()
            .expect("run hwkey bootstrap");
        stop_bootstrap_proxy(&self.dir.join("state"));
        out
    }

    /// The subject of the node certificate bootstrap installed.
    fn subject(&self) -> String {
        let out = Command::new("openssl")
            .args(["x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in"])
            .arg(self.dir.join("node.pem"))
            .output()
            .expect("openssl");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// 32 random bytes for `--credential-key`.
fn credential_key(dir: &Path) -> PathBuf {
    let path = dir.join("credential.key");
    run_ok(
        Command::new("openssl")
            .args(["rand", "-out"])
            .arg(&path)
            .arg("32"),
    );
    path
}

fn start_approver(
    cluster: &KubeCluster,
    dir: &Path,
    name: &str,
    ca: &Path,
    key: &Path,
    ttl: &str,
) -> Replica {
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    Replica::start_extra(
        &account,
        dir,
        name,
        &[
            format!("--signer-name={CARRIER_SIGNER}"),
            format!("--ek-ca={}", ca.display()),
            format!("--credential-key={}", key.display()),
            format!("--credential-ttl={ttl}"),
        ],
    )
}

/// Asserts a join failed with `reason` on its carrier or kubelet request, and that the node
/// got no certificate and no entry in the trust.
fn assert_refused(node: &Node, out: &Output, reason: &str, log: &dyn Fn() -> String) {
    let all = text(out);
    assert!(
        !out.status.success(),
        "{} joined: {all}\n{}",
        node.name,
        log()
    );
    assert!(
        all.contains(reason),
        "{} was refused, but not for {reason}: {all}\n{}",
        node.name,
        log()
    );
    assert!(
        !node.dir.join("node.pem").exists(),
        "{} got a certificate",
        node.name
    );
}

/// The legitimate fleet and every refusal, on one cluster: an RSA-EK node and an ECC-EK node
/// join with no operator step; 20 nodes join at once; a reinstalled node (AK evicted, its
/// directory wiped) re-joins on the same TPM; then each attack is refused with its reason and
/// nothing issued: an EK certificate from another CA, a second TPM for a bound name, one TPM
/// for a second name, a revoked EK certificate (by a CRL added to the trust ConfigMap), a
/// replayed answer, another bootstrap token that read a node's carrier and answer, and an
/// answer after its credential expired.
#[test]
fn a_fleet_joins_by_its_ek_certificates_and_every_attack_is_refused() {
    require_tool("kubectl", "kubectl (from the machine image)");
    require_tool("tpm2_evictcontrol", "tpm2-tools");
    let id = support::proxy::Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let maker = dir.join("manufacturer");
    let (rsa_tpm, ca) = Swtpm::start_with_ek_certificate_from(&maker);
    let (ecc_tpm, _) = Swtpm::start_with_ek_certificate_from(&maker);
    ecc_tpm.add_ecc_p256_ek_certificate();
    cluster.apply(MANIFEST);
    cluster.apply(EK_MANIFEST);
    apply_trust(&cluster, dir, &[]);
    let key = credential_key(dir);
    let replica = start_approver(&cluster, dir, "approver", &ca, &key, "1h");
    let log = || format!("--- approver ---\n{}", replica.child.log());

    // An RSA EK and an ECC EK, each with no operator step.
    let node_r = Node::new(dir, "node-r", &rsa_tpm);
    let out = node_r.join(&cluster, None);
    assert!(out.status.success(), "node-r: {}\n{}", text(&out), log());
    assert_eq!(
        node_r.subject(),
        "subject=CN=system:node:node-r,O=system:nodes"
    );
    let node_e = Node::new(dir, "node-e", &ecc_tpm);
    let out = node_e.join(&cluster, Some("ecc"));
    assert!(out.status.success(), "node-e: {}\n{}", text(&out), log());
    let carriers = requests_for(&cluster, "hwkey-carrier-node-", CARRIER_SIGNER);
    assert_eq!(carriers.len(), 2, "{carriers:?}");
    for c in &carriers {
        assert_eq!(
            (c.decision.as_str(), c.reason.as_str()),
            ("Approved", "EKCertificateVerified"),
            "{c:?}"
        );
        assert!(c.issued, "{c:?}");
        assert!(c.message.contains("is issued by"), "{c:?}");
    }
    let entries = trust_entries(&cluster);
    let bound = |node: &str| entries[node].as_str().expect("entry").to_string();
    let (first_r, first_e) = (bound("node-r"), bound("node-e"));
    assert_eq!(entry_field(&first_r, "node"), "node-r");
    assert_ne!(
        entry_field(&first_r, "ekSha256"),
        entry_field(&first_e, "ekSha256")
    );
    assert_eq!(entry_field(&first_r, "ekSha256").len(), 64, "{first_r}");

    // A reinstall: the AK evicted and the node's directory wiped; the same TPM re-joins.
    run_ok(
        Command::new("tpm2_evictcontrol")
            .envs(rsa_tpm.envs())
            .args(["-C", "o", "-c", "0x81010002"]),
    );
    std::fs::remove_dir_all(&node_r.dir).expect("wipe node-r");
    let node_r = Node::new(dir, "node-r", &rsa_tpm);
    let out = node_r.join(&cluster, None);
    assert!(
        out.status.success(),
        "reinstalled node-r: {}\n{}",
        text(&out),
        log()
    );
    let again = trust_entries(&cluster)["node-r"]
        .as_str()
        .expect("entry")
        .to_string();
    assert_eq!(
        entry_field(&again, "ekSha256"),
        entry_field(&first_r, "ekSha256")
    );
    assert_ne!(
        entry_field(&again, "akName"),
        entry_field(&first_r, "akName"),
        "a new AK"
    );

    fleet_joins_at_once(&cluster, dir, &maker, &log);

    // Refusals at the carrier: nothing is issued, the reason names what failed.
    let (stranger, stranger_ca) = Swtpm::start_with_ek_certificate();
    let node_x = Node::new(dir, "node-x", &stranger);
    let out = node_x.join(&cluster, None);
    assert_refused(&node_x, &out, "EKCertificateUntrusted", &log);
    assert!(text(&out).contains("does not chain"), "{}", text(&out));
    // That manufacturer's CA added as data (the trust's _ek-ca.pem entry), no restart: it joins.
    patch_trust(
        &cluster,
        "_ek-ca.pem",
        &std::fs::read_to_string(&stranger_ca).expect("ca"),
    );
    let out = node_x.join(&cluster, None);
    assert!(
        out.status.success(),
        "node-x after its CA was added: {}\n{}",
        text(&out),
        log()
    );
    let (second, _) = Swtpm::start_with_ek_certificate_from(&maker);
    let impostor = Node::new(&dir.join("second"), "node-r", &second);
    let out = impostor.join(&cluster, None);
    assert_refused(&impostor, &out, "NodeBoundToAnotherTPM", &log);
    let renamed = Node::new(dir, "node-z", &rsa_tpm);
    let out = renamed.join(&cluster, None);
    assert_refused(&renamed, &out, "TPMBoundToAnotherNode", &log);

    // A revoked EK certificate: the manufacturer's CRL added to the trust ConfigMap.
    let (revoked_tpm, _) = Swtpm::start_with_ek_certificate_from(&maker);
    let ek_pem = dir.join("revoked-ek.pem");
    run_ok(
        Command::new("tpm2_nvread")
            .envs(revoked_tpm.envs())
            .args(["0x01c00002", "-o"])
            .arg(dir.join("revoked-ek.der")),
    );
    run_ok(
        Command::new("openssl")
            .args(["x509", "-inform", "DER", "-in"])
            .arg(dir.join("revoked-ek.der"))
            .arg("-out")
            .arg(&ek_pem),
    );
    let crl = revoked_tpm.ek_crl(&[&ek_pem], None);
    patch_trust(
        &cluster,
        "_ek-crl.pem",
        &std::fs::read_to_string(&crl).expect("crl"),
    );
    let node_v = Node::new(dir, "node-v", &revoked_tpm);
    let out = node_v.join(&cluster, None);
    assert_refused(&node_v, &out, "EKCertificateUntrusted", &log);
    assert!(text(&out).contains("revoked"), "{}", text(&out));

    answers_are_not_reusable(&cluster, dir, &node_e, &second, &log);
    a_node_itself_gets_no_carrier(&cluster, &id.ca, dir, &node_r, &log);
    a_spliced_enrollment_opens_in_neither_tpm(&cluster, dir, &maker, &log);
    let log_before = replica.child.log();
    assert_eq!(replica.terminate().code(), Some(0), "{log_before}");
    an_answer_after_expiry_is_refused(&cluster, dir, &maker, &ca, &key);
    let entries = trust_entries(&cluster);
    for refused in ["node-v", "node-z", "node-w", "node-s"] {
        assert!(
            !entries.contains_key(refused),
            "{refused} is in the trust: {entries:?}"
        );
    }
}

/// 20 TPMs of the manufacturer join at once, each as its own node, all approved and bound.
fn fleet_joins_at_once(cluster: &KubeCluster, dir: &Path, maker: &Path, log: &dyn Fn() -> String) {
    const FLEET: usize = 20;
    let tpms: Vec<Swtpm> = std::thread::scope(|s| {
        let made: Vec<_> = (0..FLEET)
            .map(|_| s.spawn(|| Swtpm::start_with_ek_certificate_from(maker).0))
            .collect();
        made.into_iter().map(|h| h.join().expect("swtpm")).collect()
    });
    let fleet = dir.join("fleet");
    let nodes: Vec<Node> = tpms
        .iter()
        .enumerate()
        .map(|(i, t)| Node::new(&fleet, &format!("fleet-{i:02}"), t))
        .collect();
    let outs: Vec<Output> = std::thread::scope(|s| {
        let joins: Vec<_> = nodes
            .iter()
            .map(|n| s.spawn(|| n.join(cluster, None)))
            .collect();
        joins.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let failed: Vec<String> = nodes
        .iter()
        .zip(&outs)
        .filter(|(_, o)| !o.status.success())
        .map(|(n, o)| format!("{}: {}", n.name, text(o)))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {FLEET} failed:\n{}\n{}",
        failed.len(),
        failed.join("\n"),
        log()
    );
    let entries = trust_entries(cluster);
    let hashes: std::collections::HashSet<String> = nodes
        .iter()
        .map(|n| entry_field(entries[&n.name].as_str().expect("bound"), "ekSha256"))
        .collect();
    assert_eq!(hashes.len(), FLEET, "one TPM per node");
}

/// A replayed answer (a second request citing node-e's carrier and answer, from node-e's own
/// TPM) and another bootstrap token's request citing them (from another TPM) are denied.
fn answers_are_not_reusable(
    cluster: &KubeCluster,
    dir: &Path,
    node_e: &Node,
    other_tpm: &Swtpm,
    log: &dyn Fn() -> String,
) {
    let joined = requests_for(
        cluster,
        "hwkey-system-node-node-e-",
        "kubernetes.io/kube-apiserver-client-kubelet",
    );
    let joined = joined
        .iter()
        .find(|c| c.annotations.contains_key("hwkey.dev/credential-carrier"))
        .unwrap_or_else(|| {
            panic!(
                "node-e's kubelet request answers a credential: {:?}",
                csrs(cluster)
            )
        });
    let annotation = |k: &str| {
        joined.annotations[k]
            .as_str()
            .expect("annotation")
            .to_string()
    };
    let (carrier, answer) = (
        annotation("hwkey.dev/credential-carrier"),
        annotation("hwkey.dev/credential-answer"),
    );
    // The carrier certificate opens in node-e's TPM (and `hwkey attest activate` reads it):
    // the secret is the answer node-e gave.
    {
        use base64::Engine as _;
        let cert = base64::engine::general_purpose::STANDARD
            .decode(csr_field(cluster, &carrier, "{.status.certificate}").trim())
            .expect("base64");
        let path = dir.join("node-e-carrier.pem");
        std::fs::write(&path, cert).expect("write");
        let opened = run_ok(
            hwkey()
                .args(["attest", "activate"])
                .arg(&path)
                .args(["--key", &format!("tpm:?tcti={}", node_e.tcti)]),
        );
        assert_eq!(String::from_utf8_lossy(&opened.stdout).trim(), answer);
    }
    let node_key = format!(
        "tpm:path={}?tcti={}",
        node_e.dir.join("node.tpm.pem").display(),
        node_e.tcti
    );
    let request = |key: &str| {
        run_ok(hwkey().args([
            "csr",
            "--key",
            key,
            "--subject",
            "CN=system:node:node-e,O=system:nodes",
            "--attest",
        ]))
        .stdout
    };
    let annotated = |name: &str, pem: &[u8]| {
        csr_object_with(
            dir,
            name,
            pem,
            KUBELET_SIGNER,
            NODE_USAGES,
            &[
                ("hwkey.dev/credential-carrier", &carrier),
                ("hwkey.dev/credential-answer", &answer),
            ],
        )
    };
    let replay = annotated("replayed-answer", &request(&node_key));
    create_as_bootstrap(cluster, &replay);
    assert_decided(
        cluster,
        "replayed-answer",
        "Denied",
        "CredentialReplayed",
        log,
    );

    // Another bootstrap token of the allowed group reads node-e's carrier certificate (the
    // default role lets it) and the answer, and answers with a key of another TPM.
    let other_token = cluster.bootstrap_token_kubeconfig(
        "zyxwvu",
        "0123456789abcdef",
        support::kube::BOOTSTRAP_GROUP,
    );
    let read = run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&other_token)
            .args([
                "get",
                "csr",
                &carrier,
                "-o",
                "jsonpath={.status.certificate}",
            ]),
    );
    assert!(
        !read.stdout.is_empty(),
        "the carrier certificate is readable, and useless"
    );
    let other_key = format!(
        "tpm:path={}?tcti={}",
        dir.join("other.tpm.pem").display(),
        other_tpm.tcti()
    );
    run_ok(hwkey().args([
        "key",
        "create",
        "--key",
        &other_key,
        "--algorithm",
        "ec-p256",
    ]));
    let stolen = annotated("stolen-answer", &request(&other_key));
    create_with(&other_token, &stolen);
    assert_decided(cluster, "stolen-answer", "Denied", "CredentialInvalid", log);
    assert!(
        csr_field(cluster, "stolen-answer", "{.status.conditions[0].message}")
            .contains("not by this request's requester"),
        "{}",
        csr_field(cluster, "stolen-answer", "{.status.conditions[0].message}")
    );
}

/// With a 30 s credential lifetime: the node's TPM is paused after its carrier request is made
/// and until the credential expired; its late answer is denied (CredentialExpired). Meanwhile
/// another bootstrap token's flood of carrier requests, pending when the approver starts,
/// does not delay node-w's carrier (lanes per requester).
fn an_answer_after_expiry_is_refused(
    cluster: &KubeCluster,
    dir: &Path,
    maker: &Path,
    ca: &Path,
    key: &Path,
) {
    let (late_tpm, _) = Swtpm::start_with_ek_certificate_from(maker);
    let node_w = Node::new(dir, "node-w", &late_tpm);
    // No approver runs: the carrier request waits.
    let mut joining = ChildGuard::spawn(
        &mut node_w.bootstrap(&cluster.bootstrap_kubeconfig, None),
        "node-w",
        &dir.join("node-w.log"),
    );
    let carrier = {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(c) = requests_for(cluster, "hwkey-carrier-node-w-", CARRIER_SIGNER).pop() {
                break c.name;
            }
            assert!(
                Instant::now() < deadline,
                "node-w made no carrier request: {}",
                joining.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let paused = late_tpm.pause();
    let created = Instant::now();
    // A flood of carrier requests from another bootstrap token, pending with it: node-w's
    // carrier is decided in its own lane, not after the flood.
    let flood_token = cluster.bootstrap_token_kubeconfig(
        "floodr",
        "0123456789abcdef",
        support::kube::BOOTSTRAP_GROUP,
    );
    let junk = openssl_request(dir, "flood", "/O=system:nodes/CN=system:node:flood", None);
    let objects: String = (0..FLOOD)
        .map(|i| {
            use base64::Engine as _;
            format!(
                "---\napiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: aa-flood-{i:04}\nspec:\n  signerName: {CARRIER_SIGNER}\n  usages: [digital signature]\n  request: {}\n",
                base64::engine::general_purpose::STANDARD.encode(&junk)
            )
        })
        .collect();
    std::fs::write(dir.join("flood.yaml"), objects).expect("write");
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&flood_token)
            .args(["create", "-o", "name", "-f"])
            .arg(dir.join("flood.yaml")),
    );
    let replica = start_approver(cluster, dir, "approver-short", ca, key, "30s");
    // Waits on the decision, not on a clock: on a slow machine the approver may start so late
    // that the carrier itself is refused as expired, which the assertion below accepts too.
    wait_until("the carrier is decided", Duration::from_secs(60), || {
        csrs(cluster)
            .iter()
            .any(|c| c.name == carrier && (c.issued || c.decision == "Denied"))
    });
    let written_before = replica
        .child
        .log()
        .lines()
        .filter(|l| l.contains("approved=") && l.contains("csr="))
        .take_while(|l| !l.contains(&carrier))
        .count();
    // Decisions are logged as their writes finish. The carrier's turn comes after at most one
    // flood write (the lanes take turns); its settlement then takes a trust reading and four
    // API round trips (read, approve, read, write the certificate), while each of the other
    // IN_FLIGHT - 1 slots finishes a one-round-trip denial per round trip. Without lanes it
    // would come after all of the flood (its name sorts after theirs).
    let bound = 1 + (hwkey::approver::controller::IN_FLIGHT - 1) * 5;
    assert!(
        written_before <= bound,
        "{written_before} of the flood's {FLOOD} decisions were written before node-w's carrier (at most {bound})\n{}",
        replica.child.log()
    );
    // `created` was taken after the carrier was seen, so after it was made: 32 s from it is
    // past the 30 s credential.
    std::thread::sleep(Duration::from_secs(32).saturating_sub(created.elapsed()));
    drop(paused);
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(status) = joining.try_wait() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "node-w never ends: {}",
            joining.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = joining.log();
    assert!(
        !status.success(),
        "node-w joined late: {out}\n{}",
        replica.child.log()
    );
    assert!(
        out.contains("CredentialExpired"),
        "{out}\n{}",
        replica.child.log()
    );
    stop_bootstrap_proxy(&node_w.dir.join("state"));
}

/// The EK certificate of one TPM with the AK of another, in one carrier request (a peer that
/// lies: the EK's chain and the AK's attributes each hold, so a credential is issued): neither
/// TPM can open it, so no answer exists and nothing is bound.
fn a_spliced_enrollment_opens_in_neither_tpm(
    cluster: &KubeCluster,
    dir: &Path,
    maker: &Path,
    log: &dyn Fn() -> String,
) {
    let (ek_tpm, _) = Swtpm::start_with_ek_certificate_from(maker);
    let (ak_tpm, _) = Swtpm::start_with_ek_certificate_from(maker);
    let enroll = |tpm: &Swtpm| -> serde_yaml_ng::Mapping {
        let out = run_ok(hwkey().args([
            "attest",
            "enroll",
            "--key",
            &format!("tpm:?tcti={}", tpm.tcti()),
        ]));
        serde_yaml_ng::from_slice(&out.stdout).expect("enrollment YAML")
    };
    let (mut spliced, ak) = (enroll(&ek_tpm), enroll(&ak_tpm));
    for field in ["akName", "akPublic", "akPublicKeyPem"] {
        spliced.insert(field.into(), ak[field].clone());
    }
    let key = format!(
        "tpm:path={}?tcti={}",
        dir.join("spliced.tpm.pem").display(),
        ak_tpm.tcti()
    );
    run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
    let pem = run_ok(hwkey().args([
        "csr",
        "--key",
        &key,
        "--subject",
        "CN=system:node:node-s,O=system:nodes",
        "--attest",
    ]))
    .stdout;
    let enrollment = serde_yaml_ng::to_string(&spliced).expect("yaml");
    let path = carrier_object(dir, "spliced-carrier", &pem, &enrollment);
    create_as_bootstrap(cluster, &path);
    assert_decided(
        cluster,
        "spliced-carrier",
        "Approved",
        "EKCertificateVerified",
        log,
    );
    wait_until(
        "the spliced carrier is issued",
        Duration::from_secs(30),
        || {
            csrs(cluster)
                .iter()
                .any(|c| c.name == "spliced-carrier" && c.issued)
        },
    );
    use base64::Engine as _;
    let cert = base64::engine::general_purpose::STANDARD
        .decode(csr_field(cluster, "spliced-carrier", "{.status.certificate}").trim())
        .expect("base64");
    let carrier = dir.join("spliced-carrier.pem");
    std::fs::write(&carrier, cert).expect("write");
    for (which, tpm) in [("the EK's TPM", &ek_tpm), ("the AK's TPM", &ak_tpm)] {
        let out = hwkey()
            .args(["attest", "activate"])
            .arg(&carrier)
            .args(["--key", &format!("tpm:?tcti={}", tpm.tcti())])
            .output()
            .expect("run hwkey attest activate");
        assert!(
            !out.status.success(),
            "{which} opened the credential: {}",
            text(&out)
        );
        assert!(
            text(&out).contains("did not release the secret"),
            "{which}: {}",
            text(&out)
        );
    }
}

/// A carrier request object (JSON) named `name` for the PEM request `pem`, carrying
/// `enrollment` as the enrollment annotation.
fn carrier_object(dir: &Path, name: &str, pem: &[u8], enrollment: &str) -> PathBuf {
    use base64::Engine as _;
    let object = serde_json::json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {
            "name": name,
            "annotations": {"hwkey.dev/tpm-enrollment": enrollment},
        },
        "spec": {
            "signerName": CARRIER_SIGNER,
            "usages": ["digital signature"],
            "request": base64::engine::general_purpose::STANDARD.encode(pem),
        },
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, object.to_string()).expect("write");
    path
}

/// A node that holds its certificate asks for a carrier as itself (a node whose entry an
/// operator removed would bind its name again so): only bootstrap identities get carriers.
fn a_node_itself_gets_no_carrier(
    cluster: &KubeCluster,
    ca: &support::ca::TestCa,
    dir: &Path,
    node_r: &Node,
    log: &dyn Fn() -> String,
) {
    let key = format!(
        "tpm:path={}?tcti={}",
        node_r.dir.join("node.tpm.pem").display(),
        node_r.tcti
    );
    let pem = run_ok(hwkey().args([
        "csr",
        "--key",
        &key,
        "--subject",
        "CN=system:node:node-r,O=system:nodes",
        "--attest",
    ]))
    .stdout;
    let enrollment = run_ok(hwkey().args([
        "attest",
        "enroll",
        "--key",
        &format!("tpm:?tcti={}", node_r.tcti),
    ]))
    .stdout;
    let path = carrier_object(
        dir,
        "carrier-by-the-node",
        &pem,
        &String::from_utf8_lossy(&enrollment),
    );
    let (cert, cert_key) = ca.client_cert(
        dir,
        "node-r-client",
        "system:node:node-r",
        Some("system:nodes"),
    );
    let as_node = cluster.cert_kubeconfig("node-r", &cert, &cert_key);
    create_with(&as_node, &path);
    assert_decided(
        cluster,
        "carrier-by-the-node",
        "Denied",
        "RequesterNotAllowed",
        log,
    );
    // A carrier whose enrollment is 200 KB (the API server keeps annotations up to 256 KiB):
    // refused unread, as a request larger than its bound is.
    let padded = format!(
        "{}# {}\n",
        String::from_utf8_lossy(&enrollment),
        "x".repeat(200_000)
    );
    let path = carrier_object(dir, "carrier-huge-enrollment", &pem, &padded);
    create_as_bootstrap(cluster, &path);
    assert_decided(
        cluster,
        "carrier-huge-enrollment",
        "Denied",
        "MalformedRequest",
        log,
    );
}
