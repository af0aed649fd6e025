//! Issue 50: a person whose key is on a YubiKey enrols and renews with no human, on the real
//! kube-apiserver + kube-controller-manager 1.20, proving the key with its PIV attestation at
//! every issuance; bent attestations are denied with their reason; deleting the person's
//! entry denies their next renewal within seconds. The YubiKey is SoftHSM holding the key and
//! ykcs11-shaped attestation objects (`support::piv`) of a 5.7.4-style chain, whose root and
//! intermediates the approver is given with `--piv-roots`.

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use support::ca::TestCa;
use support::kube::{Approval, KubeCluster};
use support::piv::{ChainShape, PivDevice, Slot, TOUCH_ALWAYS, TOUCH_NEVER};
use support::requests::{self as rq, tag, Node, RequestTree, SoftwareKey};
use support::softhsm::SoftHsm;
use support::*;

use super::kit::{
    apply_config_map, apply_trust, assert_decided, create_with, csr_object, decided_as, Replica,
    ANYONE_MAY_REQUEST, CLIENT_SIGNER, MANIFEST, PEOPLE_MANIFEST, USAGES,
};
use crate::lifecycle::kit::csr_field;

/// pat's registration: YubiKey 4242, a touch at least every 15 s.
const PAT: &str = "piv:\n  serials: [4242]\n  touchPolicy: cached\n  minFirmware: 5.4.0\n";

/// A request for `CN=pat` by the software key `key`, carrying `attribute`: PEM.
fn request(key: &SoftwareKey, attribute: Vec<u8>) -> Vec<u8> {
    let subject = Node::seq(vec![Node::rdn(rq::CN, tag::UTF8, "pat")]);
    let tree = RequestTree::new(subject, &key.spki(), vec![Node::Raw(attribute)]);
    rq::pem(&tree.signed(|info| key.sign(info), &[])).into_bytes()
}

/// The evidence attribute with `attestations` as the bundle's statements and `certs` as its
/// certificates (two where one belongs).
fn attribute_with(attestations: &[Vec<u8>], certs: &[Vec<u8>]) -> Vec<u8> {
    let oid = |arcs: &[u64]| yasna::models::ObjectIdentifier::from_slice(arcs);
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next()
                .write_oid(&oid(&[1, 2, 840, 113549, 1, 9, 16, 2, 59]));
            w.next().write_set(|w| {
                w.next().write_sequence(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_sequence(|w| {
                            for attestation in attestations {
                                w.next().write_sequence(|w| {
                                    w.next().write_der(hwkey::pki::piv::OID_PIV_ATTESTATION_DER);
                                    w.next().write_der(attestation);
                                });
                            }
                        });
                        w.next().write_sequence(|w| {
                            for c in certs {
                                w.next().write_der(c);
                            }
                        });
                    });
                });
            });
        })
    })
}

/// `hwkey renew` of pat's certificate file with the key on the token: its output and the name
/// of the request it made.
fn renew(
    cluster: &KubeCluster,
    hsm: &SoftHsm,
    uri: &str,
    cert: &Path,
) -> (std::process::Output, String) {
    let before = names(cluster);
    let out = hwkey()
        .envs(hsm.envs())
        .args(["renew", "--key", uri, "--cert"])
        .arg(cert)
        .args(["--server", &cluster.url(), "--ca"])
        .arg(cluster.ca_path())
        .args(["--wait", "60s"])
        .output()
        .expect("run hwkey renew");
    let new: Vec<String> = names(cluster)
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    let [name] = new.as_slice() else {
        panic!(
            "expected one new request, found {new:?}: {}",
            output_text(&out)
        );
    };
    (out, name.clone())
}

fn names(cluster: &KubeCluster) -> Vec<String> {
    let out = cluster.kubectl_ok(&["get", "csr", "-o", "jsonpath={.items[*].metadata.name}"]);
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|n| n.starts_with("hwkey-pat-"))
        .map(str::to_string)
        .collect()
}

/// The issued certificate of request `name`, written to `path` (PEM).
fn wait_issued(cluster: &KubeCluster, name: &str, path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let b64 = csr_field(cluster, name, "{.status.certificate}");
        if !b64.is_empty() {
            let pem = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .expect("base64");
            std::fs::write(path, pem).expect("write certificate");
            return;
        }
        assert!(Instant::now() < deadline, "{name} is never issued");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_yubikey_person_enrols_and_renews_with_no_human_and_removal_bites() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let work = temp_dir();
    let dir = work.path();
    let ca_dir = dir.join("ca");
    std::fs::create_dir_all(&ca_dir).expect("mkdir");
    let ca = TestCa::new(&ca_dir);
    let cluster = KubeCluster::start_with(&ca, "7m", Approval::SignerOnly);

    // pat's YubiKey: key 01 on a token, attested by a device of the 5.7.4 shape.
    let hsm = SoftHsm::new();
    hsm.init_token("yk");
    hsm.pkcs11_keygen_with_id("yk", "pat", "EC:prime256v1", "01");
    let uri = hsm.key_uri("yk", "pat");
    let plain =
        run_ok(
            hwkey()
                .envs(hsm.envs())
                .args(["csr", "--key", &uri, "--subject", "CN=pat"]),
        );
    let spki = hwkey::pki::request::Request::from_pem(&plain.stdout)
        .expect("request")
        .spki_der()
        .to_vec();
    let device = PivDevice::new(&ChainShape {
        intermediates: 2,
        ..ChainShape::default()
    });
    device.install(
        &hsm,
        "yk",
        "01",
        "9a",
        &device.attest(&spki, Slot::new(4242, TOUCH_ALWAYS)),
    );
    let roots = dir.join("piv-roots.pem");
    std::fs::write(&roots, device.roots_pem()).expect("write roots");

    let entries: Vec<(&str, String)> =
        vec![("_allow", "users: [pat]\n".into()), ("pat", PAT.into())];
    cluster.apply(MANIFEST);
    cluster.apply(PEOPLE_MANIFEST);
    cluster.apply(ANYONE_MAY_REQUEST);
    apply_config_map(&cluster, dir, "hwkey-approver-people", &entries);
    apply_trust(&cluster, dir, &[]);
    let account = cluster.service_account_kubeconfig("hwkey-system", "hwkey-approver");
    let replica = Replica::start_extra(
        &account,
        dir,
        "approver",
        &[
            format!("--signer-name={CLIENT_SIGNER}"),
            "--people-trust-configmap=hwkey-system/hwkey-approver-people".into(),
            format!("--people-client-ca={}", cluster.ca_path().display()),
            format!("--piv-roots={}", roots.display()),
        ],
    );
    let log = || replica.child.log();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !replica.leading() {
        assert!(Instant::now() < deadline, "{}", log());
        std::thread::sleep(Duration::from_millis(200));
    }

    // Enrolment, no human: pat (signed in some other way: a login certificate here) asks for
    // CN=pat with the key on the YubiKey; `hwkey csr` attaches the attestation by itself.
    let (login_cert, login_key) = ca.client_cert(dir, "pat-login", "pat", None);
    let pat = cluster.cert_kubeconfig("pat", &login_cert, &login_key);
    let attested =
        run_ok(
            hwkey()
                .envs(hsm.envs())
                .args(["csr", "--key", &uri, "--subject", "CN=pat"]),
        );
    create_with(
        &pat,
        &csr_object(dir, "pat-enrols", &attested.stdout, CLIENT_SIGNER, USAGES),
    );
    assert_decided(&cluster, "pat-enrols", "Approved", "AttestedPIVKey", &log);
    let cert = dir.join("pat.pem");
    wait_issued(&cluster, "pat-enrols", &cert);

    // A renewal with the same key: hwkey renew attaches the attestation again.
    let (out, name) = renew(&cluster, &hsm, &uri, &cert);
    assert!(out.status.success(), "{}\n{}", output_text(&out), log());
    assert_eq!(
        csr_field(&cluster, &name, "{.status.conditions[0].reason}"),
        "AttestedPIVKey"
    );

    // Bent attestations, each denied with its reason.
    let (attestation, f9) = (
        device.attest(&spki, Slot::new(4242, TOUCH_ALWAYS)),
        device.f9_der(),
    );
    let other = SoftwareKey::generate();
    let attacks: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "another-key",
            request(&other, hwkey::pki::piv::attribute(&attestation, &f9)),
            "EvidenceInvalid",
        ),
        (
            "another-serial",
            request(
                &other,
                hwkey::pki::piv::attribute(
                    &device.attest(&other.spki(), Slot::new(9999, TOUCH_ALWAYS)),
                    &f9,
                ),
            ),
            "UnknownAttestationKey",
        ),
        (
            "touch-below-required",
            request(
                &other,
                hwkey::pki::piv::attribute(
                    &device.attest(&other.spki(), Slot::new(4242, TOUCH_NEVER)),
                    &f9,
                ),
            ),
            "EvidenceInvalid",
        ),
        (
            "two-f9",
            request(
                &other,
                attribute_with(
                    &[device.attest(&other.spki(), Slot::new(4242, TOUCH_ALWAYS))],
                    &[f9.clone(), f9.clone()],
                ),
            ),
            "EvidenceInvalid",
        ),
        // Two attestations in one bundle: the other key's, then one for this key.
        (
            "two-attestations",
            request(
                &other,
                attribute_with(
                    &[
                        attestation.clone(),
                        device.attest(&other.spki(), Slot::new(4242, TOUCH_ALWAYS)),
                    ],
                    std::slice::from_ref(&f9),
                ),
            ),
            "EvidenceInvalid",
        ),
    ];
    for (name, pem, _) in &attacks {
        create_with(&pat, &csr_object(dir, name, pem, CLIENT_SIGNER, USAGES));
    }
    for (name, _, reason) in &attacks {
        assert_decided(&cluster, name, "Denied", reason, &log);
    }

    // Removal bites: pat's entry deleted, pat still in the allow list; the next renewal is
    // denied within seconds and the certificate file is left as it was.
    apply_config_map(&cluster, dir, "hwkey-approver-people", &entries[..1]);
    let removed_at = Instant::now();
    let before = std::fs::read(&cert).expect("certificate");
    let (out, name) = renew(&cluster, &hsm, &uri, &cert);
    assert!(!out.status.success(), "{}", output_text(&out));
    if let Err(e) = decided_as(
        &cluster,
        &name,
        "Denied",
        "UnknownAttestationKey",
        Duration::from_secs(15),
    ) {
        panic!("{e}\n{}", log());
    }
    assert!(
        removed_at.elapsed() < Duration::from_secs(30),
        "denied only after {:?}",
        removed_at.elapsed()
    );
    assert_eq!(std::fs::read(&cert).expect("certificate"), before);
}
