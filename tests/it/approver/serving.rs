//! Kubelet serving certificates (`kubernetes.io/kubelet-serving`) on the real kube-apiserver +
//! kube-controller-manager: approved only for the node's own names and addresses (its Node's
//! `status.addresses`, read when the decision is written), denied with a typed reason
//! otherwise, nothing issued. The approver runs with deploy/approver.yaml plus
//! deploy/approver-serving.yaml's RBAC, exactly as shipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use super::kit::*;
use crate::lifecycle::kit::{csr_field, enroll_node};

const SERVING_MANIFEST: &str = include_str!("../../../deploy/approver-serving.yaml");
const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";
const SERVING_USAGES: &str = "[digital signature, key encipherment, server auth]";

/// Node `name` with `addresses` (type, address) in its status (the API server keeps a Node's
/// status as created).
fn create_node(cluster: &KubeCluster, dir: &Path, name: &str, addresses: &[(&str, &str)]) {
    let list: Vec<String> = addresses
        .iter()
        .map(|(t, a)| format!("{{\"type\": \"{t}\", \"address\": \"{a}\"}}"))
        .collect();
    let path = dir.join(format!("node-{name}.json"));
    std::fs::write(
        &path,
        format!(
            "{{\"apiVersion\": \"v1\", \"kind\": \"Node\", \"metadata\": {{\"name\": \"{name}\"}}, \"status\": {{\"addresses\": [{}]}}}}",
            list.join(", ")
        ),
    )
    .expect("write node");
    cluster.kubectl_ok(&["create", "-f", &path.display().to_string()]);
}

/// Replaces node `name`'s status addresses, as its kubelet would after a change.
fn set_addresses(cluster: &KubeCluster, name: &str, addresses: &[(&str, &str)]) {
    let list: Vec<String> = addresses
        .iter()
        .map(|(t, a)| format!("{{\"type\": \"{t}\", \"address\": \"{a}\"}}"))
        .collect();
    cluster.kubectl_ok(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!("{{\"status\": {{\"addresses\": [{}]}}}}", list.join(", ")),
    ]);
}

/// How many serving requests node B floods with.
const FLOOD: usize = 300;

/// `count` serving requests from node B for node A's name, created at once.
fn flood_as_node_b(cluster: &KubeCluster, dir: &Path, count: usize) {
    let pem = openssl_request(
        dir,
        "flood",
        "/O=system:nodes/CN=system:node:node-b",
        Some("subjectAltName=DNS:node-a"),
    );
    let folder = dir.join("flood");
    std::fs::create_dir_all(&folder).expect("folder");
    for i in 0..count {
        let name = format!("flood-{i:05}");
        let path = csr_object(dir, &name, &pem, SERVING_SIGNER, SERVING_USAGES);
        std::fs::rename(&path, folder.join(format!("{name}.yaml"))).expect("move");
    }
    create_as(cluster, "system:node:node-b", &["system:nodes"], &folder);
}

/// `kubectl create -f OBJECT` as `user` in `groups` (the admin impersonates: the API server
/// writes `spec.username` and `spec.groups` as it authenticated them).
fn create_as(cluster: &KubeCluster, user: &str, groups: &[&str], object: &Path) {
    let mut cmd = Command::new("kubectl");
    cmd.arg("--kubeconfig")
        .arg(&cluster.admin_kubeconfig)
        .arg(format!("--as={user}"));
    for g in groups {
        cmd.arg(format!("--as-group={g}"));
    }
    run_ok(cmd.args(["create", "-f"]).arg(object));
}

/// A serving request for `node`'s CN with the SANs `san` (openssl's syntax, e.g.
/// "DNS:node-a,IP:10.0.0.1"; None: none) and `more` extensions, created by `as_node` (a node
/// in group system:nodes) under `signer` with `usages`.
struct Ask<'a> {
    name: &'a str,
    cn_node: &'a str,
    san: Option<&'a str>,
    more: Option<&'a str>,
    as_node: &'a str,
    signer: &'a str,
    usages: &'a str,
}

impl<'a> Ask<'a> {
    fn serving(name: &'a str, node: &'a str, san: &'a str) -> Ask<'a> {
        Ask {
            name,
            cn_node: node,
            san: Some(san),
            more: None,
            as_node: node,
            signer: SERVING_SIGNER,
            usages: SERVING_USAGES,
        }
    }

    fn object(&self, dir: &Path) -> PathBuf {
        let subject = format!("/O=system:nodes/CN=system:node:{}", self.cn_node);
        let san = self.san.map(|s| format!("subjectAltName={s}"));
        let pem = match (san.as_deref(), self.more) {
            (Some(s), Some(m)) => openssl_two(dir, self.name, &subject, s, m),
            (one, None) | (None, one) => openssl_request(dir, self.name, &subject, one),
        };
        csr_object(dir, self.name, &pem, self.signer, self.usages)
    }

    fn create(&self, cluster: &KubeCluster, dir: &Path) {
        let object = self.object(dir);
        create_as(
            cluster,
            &format!("system:node:{}", self.as_node),
            &["system:nodes"],
            &object,
        );
    }
}

/// An openssl request with two `-addext` extensions.
fn openssl_two(dir: &Path, name: &str, subject: &str, a: &str, b: &str) -> Vec<u8> {
    let out = dir.join(format!("{name}.csr"));
    run_ok(
        Command::new("openssl")
            .args(["req", "-new", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:P-256", "-nodes", "-subj", subject])
            .args(["-addext", a, "-addext", b, "-keyout"])
            .arg(dir.join(format!("{name}.key")))
            .arg("-out")
            .arg(&out),
    );
    std::fs::read(&out).expect("read CSR")
}

/// The DNS names and IP addresses of the certificate issued for `name`, as openssl prints them.
fn issued_names(cluster: &KubeCluster, dir: &Path, name: &str) -> String {
    use base64::Engine as _;
    let b64 = csr_field(cluster, name, "{.status.certificate}");
    let pem = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .expect("an issued certificate");
    let path = dir.join(format!("{name}.crt"));
    std::fs::write(&path, pem).expect("write");
    let out = run_ok(
        Command::new("openssl")
            .args([
                "x509",
                "-noout",
                "-ext",
                "subjectAltName,extendedKeyUsage",
                "-in",
            ])
            .arg(&path),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits for `name`'s certificate.
fn wait_issued(cluster: &KubeCluster, name: &str) {
    wait_until(
        &format!("{name} is issued"),
        Duration::from_secs(30),
        || !csr_field(cluster, name, "{.status.certificate}").is_empty(),
    );
}

/// The legitimate requests are approved and issued with exactly their names; every attack in
/// the issue is denied with its reason and nothing is issued; a node deleted while its request
/// waits is denied; a node whose addresses changed gets its new ones, not its old ones.
#[test]
fn a_node_gets_a_serving_certificate_for_its_own_addresses_only() {
    require_tool("kubectl", "kubectl (from the machine image)");
    require_tool("openssl", "openssl");
    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node-a");
    let a_tpm = Tpm::with(None, tcti, dir, "node-a");
    install_approver(&cluster, &trust);
    cluster.apply(SERVING_MANIFEST);
    cluster.apply(ANYONE_MAY_REQUEST);
    create_node(
        &cluster,
        dir,
        "node-a",
        &[
            ("Hostname", "node-a"),
            ("InternalIP", "10.0.0.1"),
            ("ExternalIP", "203.0.113.1"),
        ],
    );
    // An AWS-style node: several DNS names and addresses of every type.
    create_node(
        &cluster,
        dir,
        "ip-10-0-1-7.ec2.internal",
        &[
            ("InternalIP", "10.0.1.7"),
            ("InternalIP", "10.0.1.8"),
            ("ExternalIP", "198.51.100.7"),
            ("InternalDNS", "ip-10-0-1-7.ec2.internal"),
            ("ExternalDNS", "ec2-198-51-100-7.compute-1.amazonaws.com"),
            ("Hostname", "ip-10-0-1-7.ec2.internal"),
        ],
    );
    create_node(
        &cluster,
        dir,
        "node-b",
        &[("Hostname", "node-b"), ("InternalIP", "10.0.0.2")],
    );
    create_node(
        &cluster,
        dir,
        "node-c",
        &[("Hostname", "node-c"), ("InternalIP", "10.0.0.3")],
    );
    // Node C's request waits while no approver runs, and node C is deleted meanwhile.
    Ask::serving("c-deleted", "node-c", "DNS:node-c,IP:10.0.0.3").create(&cluster, dir);
    cluster.kubectl_ok(&["delete", "node", "node-c"]);

    // Node B floods; node A's client renewal waits behind it in the list.
    let flood = FLOOD;
    flood_as_node_b(&cluster, dir, flood);
    let renewal = a_tpm.request("CN=system:node:node-a,O=system:nodes", &[]);
    let object = csr_object(dir, "zzzz-a-renewal", &renewal, KUBELET_SIGNER, NODE_USAGES);
    create_as(&cluster, "system:node:node-a", &["system:nodes"], &object);

    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let replica = Replica::start_extra(
        &account,
        dir,
        "approver",
        &[format!("--signer-name={SERVING_SIGNER}")],
    );
    let log = || replica.child.log();
    assert_decided(&cluster, "c-deleted", "Denied", "NodeNotFound", &log);
    assert_decided(
        &cluster,
        "zzzz-a-renewal",
        "Approved",
        "AttestedTPMKey",
        &log,
    );
    // The order decisions were written in, from the approver's own log: the renewal's write
    // starts after at most one of the flood's (lanes take turns), and the flood writes started
    // before it (at most IN_FLIGHT - 1 at once) may finish first.
    let text = log();
    let renewal_line = text
        .lines()
        .position(|l| l.contains("approved=") && l.contains("csr=zzzz-a-renewal"))
        .expect("the renewal's decision is logged");
    let flood_before = text
        .lines()
        .take(renewal_line)
        .filter(|l| l.contains("approved=") && l.contains("csr=flood-"))
        .count();
    eprintln!("serving flood: {flood_before} of {flood} flood decisions were written before node A's renewal");
    assert!(
        flood_before <= hwkey::approver::controller::IN_FLIGHT + 1,
        "{flood_before} of node B's flood were written before node A's renewal\n{}",
        log()
    );
    wait_until("the flood is decided", Duration::from_secs(120), || {
        replica.decided("denied", "SubjectAltNameNotOwned") >= flood as f64
    });
    // Not vacuous: the log names every flood decision.
    let logged = log()
        .lines()
        .filter(|l| l.contains("approved=") && l.contains("csr=flood-"))
        .count();
    assert_eq!(logged, flood, "flood decisions in the log");

    legitimate(&cluster, dir, &a_tpm, &log);
    refused(&cluster, dir, &log);

    // Node A's addresses change; its next request names the new ones and is approved, one
    // naming the old address is not.
    set_addresses(
        &cluster,
        "node-a",
        &[("Hostname", "node-a"), ("InternalIP", "10.0.9.1")],
    );
    Ask::serving("a-moved", "node-a", "DNS:node-a,IP:10.0.9.1").create(&cluster, dir);
    assert_decided(
        &cluster,
        "a-moved",
        "Approved",
        "NodeAddressesVerified",
        &log,
    );
    Ask::serving("a-old-address", "node-a", "DNS:node-a,IP:10.0.0.1").create(&cluster, dir);
    assert_decided(
        &cluster,
        "a-old-address",
        "Denied",
        "SubjectAltNameNotOwned",
        &log,
    );
    // Node A writes node B's IP and name into its own status (what its kubelet may do: a node
    // writes its own Node's status) and asks for them: another node's, refused.
    set_addresses(
        &cluster,
        "node-a",
        &[
            ("Hostname", "node-a"),
            ("InternalIP", "10.0.9.1"),
            ("InternalIP", "10.0.0.2"),
            ("Hostname", "node-b"),
        ],
    );
    for (name, san) in [
        ("a-claims-b-ip", "DNS:node-a,IP:10.0.0.2"),
        ("a-claims-b-name", "DNS:node-b"),
    ] {
        Ask::serving(name, "node-a", san).create(&cluster, dir);
        assert_decided(&cluster, name, "Denied", "SubjectAltNameNotOwned", &log);
        let message = csr_field(&cluster, name, "{.status.conditions[0].message}");
        assert!(message.contains("node 'node-b'"), "{message}");
    }
    assert!(replica.decided("approved", "NodeAddressesVerified") >= 4.0);
    assert_eq!(replica.terminate().code(), Some(0));
}

/// Node A's own names (its key in its TPM, reported), the AWS node's many names with Go's
/// case and trailing dot: approved and issued with exactly those names.
fn legitimate(cluster: &KubeCluster, dir: &Path, a_tpm: &Tpm, log: &dyn Fn() -> String) {
    Ask::serving("a-own", "node-a", "DNS:node-a,IP:10.0.0.1,IP:203.0.113.1").create(cluster, dir);
    assert_decided(cluster, "a-own", "Approved", "NodeAddressesVerified", log);
    wait_issued(cluster, "a-own");
    let names = issued_names(cluster, dir, "a-own");
    for want in [
        "DNS:node-a",
        "IP Address:10.0.0.1",
        "IP Address:203.0.113.1",
        "TLS Web Server Authentication",
    ] {
        assert!(names.contains(want), "{want} in {names}");
    }
    let message = csr_field(cluster, "a-own", "{.status.conditions[0].message}");
    assert!(message.contains("client identity is attested"), "{message}");

    // The serving key in node A's TPM, its evidence by the registered AK: reported.
    let pem = a_tpm.request(
        "CN=system:node:node-a,O=system:nodes",
        &["--dns", "node-a", "--ip", "10.0.0.1"],
    );
    let object = csr_object(dir, "a-attested", &pem, SERVING_SIGNER, SERVING_USAGES);
    create_as(cluster, "system:node:node-a", &["system:nodes"], &object);
    assert_decided(
        cluster,
        "a-attested",
        "Approved",
        "NodeAddressesVerified",
        log,
    );
    let message = csr_field(cluster, "a-attested", "{.status.conditions[0].message}");
    assert!(
        message.contains("serving key is in node 'node-a''s TPM"),
        "{message}"
    );

    let aws = "ip-10-0-1-7.ec2.internal";
    Ask::serving(
        "aws-own",
        aws,
        "DNS:IP-10-0-1-7.EC2.internal.,DNS:ec2-198-51-100-7.compute-1.amazonaws.com,IP:10.0.1.7,IP:10.0.1.8,IP:198.51.100.7",
    )
    .create(cluster, dir);
    assert_decided(cluster, "aws-own", "Approved", "NodeAddressesVerified", log);
    wait_issued(cluster, "aws-own");
    let names = issued_names(cluster, dir, "aws-own");
    assert!(names.contains("DNS:IP-10-0-1-7.EC2.internal."), "{names}");
}

/// Every attack of the issue: denied with its reason, nothing issued.
fn refused(cluster: &KubeCluster, dir: &Path, log: &dyn Fn() -> String) {
    let cases: Vec<(Ask, &str)> = vec![
        (
            Ask::serving("x-other-ip", "node-a", "DNS:node-a,IP:10.0.0.2"),
            "SubjectAltNameNotOwned",
        ),
        (
            Ask::serving("x-other-name", "node-a", "DNS:node-a,DNS:node-b"),
            "SubjectAltNameNotOwned",
        ),
        (
            Ask::serving("x-unlisted", "node-a", "DNS:node-a,DNS:kubernetes.default"),
            "SubjectAltNameNotOwned",
        ),
        // Go reads a 16-byte ::ffff:10.0.0.2 as node B's 10.0.0.2 and issues it so.
        (
            Ask::serving("x-mapped-ip", "node-a", "DNS:node-a,IP:::ffff:10.0.0.2"),
            "SubjectAltNameNotOwned",
        ),
        (
            Ask::serving("x-wildcard", "node-a", "DNS:*.node-a"),
            "SubjectAltNameNotAllowed",
        ),
        (
            Ask::serving("x-uri", "node-a", "DNS:node-a,URI:https://node-a"),
            "SubjectAltNameNotAllowed",
        ),
        (
            Ask::serving("x-email", "node-a", "DNS:node-a,email:root@node-a"),
            "SubjectAltNameNotAllowed",
        ),
        (
            Ask {
                san: None,
                ..Ask::serving("x-no-names", "node-a", "")
            },
            "SubjectAltNameNotAllowed",
        ),
        // Node A asks for node B's names under node B's CN.
        (
            Ask {
                as_node: "node-a",
                ..Ask::serving("x-other-cn", "node-b", "DNS:node-b,IP:10.0.0.2")
            },
            "RequesterNotAllowed",
        ),
        (
            Ask {
                more: Some("basicConstraints=critical,CA:TRUE"),
                ..Ask::serving("x-extra-ext", "node-a", "DNS:node-a")
            },
            "ExtensionNotAllowed",
        ),
        // A serving request under the client signer, a client request under the serving one.
        (
            Ask {
                signer: KUBELET_SIGNER,
                ..Ask::serving("x-serving-as-client", "node-a", "DNS:node-a")
            },
            "SubjectAltNameNotAllowed",
        ),
        (
            Ask {
                usages: NODE_USAGES,
                ..Ask::serving("x-client-as-serving", "node-a", "DNS:node-a")
            },
            "UsagesNotAllowed",
        ),
    ];
    for (ask, _) in &cases {
        ask.create(cluster, dir);
    }
    // A requester that is not a node: the bootstrap identity.
    let object = Ask::serving("x-bootstrap", "node-a", "DNS:node-a").object(dir);
    create_as_bootstrap(cluster, &object);
    let all = cases.iter().map(|(a, r)| (a.name, *r));
    for (ask, reason) in all.chain([("x-bootstrap", "RequesterNotAllowed")]) {
        assert_decided(cluster, ask, "Denied", reason, log);
    }
    let message = csr_field(cluster, "x-mapped-ip", "{.status.conditions[0].message}");
    assert!(message.contains("IP address 10.0.0.2"), "{message}");
}
