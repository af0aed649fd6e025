//! Issue 50: keys on PIV tokens (YubiKeys) prove they live in hardware. The chain checks of a
//! PIV attestation on chains made in Yubico's format (a local root standing in for Yubico's, the
//! 5.7.4 chain's extra intermediates, an f9 certificate with and without basic constraints) and
//! on real YubiKeys' attestations (`tests/data/yubikey`); `hwkey attest piv-verify`; and the
//! client side: a key on a token exposing ykcs11's attestation objects carries them in its
//! requests, and the attestation certificate is never taken for the key's own certificate.

use std::path::Path;

use hwkey::pki::piv::{self, PivRefusal, PivRoots, TouchPolicy};
use support::piv::{ChainShape, PivDevice, Slot, TOUCH_ALWAYS, TOUCH_CACHED};
use support::requests::SoftwareKey;
use support::softhsm::SoftHsm;
use support::*;

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

fn roots(device: &PivDevice) -> PivRoots {
    PivRoots::from_pem(&device.roots_pem()).expect("the fixture roots")
}

fn refusal(result: Result<piv::PivFacts, PivRefusal>) -> PivRefusal {
    match result {
        Ok(facts) => panic!("accepted: {facts:?}"),
        Err(r) => r,
    }
}

/// Every chain shape a real device has holds; every bent chain is refused with its reason.
#[test]
fn a_piv_attestation_holds_only_on_an_unbent_chain_to_a_configured_root() {
    let key = SoftwareKey::generate();
    let spki = key.spki();
    let slot = Slot::new(4242, TOUCH_CACHED);

    // Firmware before 5.7.4: root → f9 → attestation.
    let device = PivDevice::new(&ChainShape::default());
    let attestation = device.attest(&spki, slot);
    let facts = piv::verify_attestation(&attestation, &device.f9_der(), &roots(&device), now())
        .expect("a device's own chain");
    assert_eq!(
        (facts.serial, facts.touch_policy, facts.slot.as_deref()),
        (4242, TouchPolicy::Cached, Some("9a"))
    );
    assert_eq!(facts.spki, spki);
    assert_eq!(facts.root, "Test PIV Root CA");

    // A YubiKey 4's f9 certificate has no basic constraints: accepted.
    let old = PivDevice::new(&ChainShape {
        f9_basic_constraints: false,
        ..ChainShape::default()
    });
    piv::verify_attestation(&old.attest(&spki, slot), &old.f9_der(), &roots(&old), now())
        .expect("an f9 without basic constraints");

    // Firmware 5.7.4: two intermediates the device does not carry; they come from the roots
    // file, and without them there is no path.
    let new = PivDevice::new(&ChainShape {
        intermediates: 2,
        ..ChainShape::default()
    });
    let attested = new.attest(&spki, slot);
    piv::verify_attestation(&attested, &new.f9_der(), &roots(&new), now())
        .expect("the 5.7.4 chain");
    let root_only = PivRoots::from_pem(&new.root_only_pem()).expect("root");
    let r = refusal(piv::verify_attestation(
        &attested,
        &new.f9_der(),
        &root_only,
        now(),
    ));
    assert!(matches!(r, PivRefusal::NoPathToRoot { .. }), "{r}");

    // A root named as Yubico's, with another key: no path to Yubico's real roots.
    let impostor = PivDevice::new(&ChainShape {
        root_cn: "Yubico PIV Root CA Serial 263751",
        ..ChainShape::default()
    });
    let r = refusal(piv::verify_attestation(
        &impostor.attest(&spki, slot),
        &impostor.f9_der(),
        &PivRoots::yubico(),
        now(),
    ));
    assert!(matches!(r, PivRefusal::NoPathToRoot { .. }), "{r}");

    // Another device's f9 certificate does not sign this device's attestation.
    let r = refusal(piv::verify_attestation(
        &attestation,
        &old.f9_der(),
        &roots(&old),
        now(),
    ));
    assert!(matches!(r, PivRefusal::NotSignedByF9 { .. }), "{r}");

    // A slot's attestation posing as the f9 (its issuer, a trusted f9, put into the roots
    // file by mistake): the slot key is any device holder's, so a leaf signed with it could
    // claim any serial, policy and key. Refused.
    let holder = rcgen::KeyPair::generate().expect("key");
    let holder_spki = pem::parse(holder.public_key_pem())
        .expect("PEM")
        .into_contents();
    let slot_cert = device.attest(&holder_spki, slot);
    let mut forged = rcgen::CertificateParams::default();
    forged
        .distinguished_name
        .push(rcgen::DnType::CommonName, "YubiKey PIV Attestation 9a");
    forged.custom_extensions = vec![
        rcgen::CustomExtension::from_oid_content(&[1, 3, 6, 1, 4, 1, 41482, 3, 3], vec![5, 7, 4]),
        rcgen::CustomExtension::from_oid_content(
            &[1, 3, 6, 1, 4, 1, 41482, 3, 7],
            yasna::construct_der(|w| w.write_u64(1)),
        ),
        rcgen::CustomExtension::from_oid_content(&[1, 3, 6, 1, 4, 1, 41482, 3, 8], vec![3, 2]),
    ];
    let issuer =
        rcgen::Issuer::from_ca_cert_der(&slot_cert.clone().into(), &holder).expect("issuer");
    let forged = forged
        .signed_by(
            &rcgen::SubjectPublicKeyInfo::from_der(&spki).expect("SPKI"),
            &issuer,
        )
        .expect("forged leaf")
        .der()
        .to_vec();
    let mut careless = roots(&device);
    careless.add(
        PivRoots::from_pem(&pem::encode(&pem::Pem::new("CERTIFICATE", device.f9_der())))
            .expect("the f9 as an intermediate"),
    );
    let r = refusal(piv::verify_attestation(
        &forged,
        &slot_cert,
        &careless,
        now(),
    ));
    assert!(matches!(r, PivRefusal::F9IsASlotAttestation { .. }), "{r}");

    // An expired chain.
    let expired = PivDevice::new(&ChainShape {
        expired: true,
        ..ChainShape::default()
    });
    let r = refusal(piv::verify_attestation(
        &expired.attest(&spki, slot),
        &expired.f9_der(),
        &roots(&expired),
        now(),
    ));
    assert!(matches!(r, PivRefusal::NotValidNow { .. }), "{r}");

    // An unknown critical extension, and bytes after the certificate.
    let critical = rcgen::CustomExtension::from_oid_content(&[1, 2, 3, 4], vec![0x05, 0x00]);
    let mut critical = critical;
    critical.set_criticality(true);
    let r = refusal(piv::verify_attestation(
        &device.attest_with(&spki, slot, vec![critical]),
        &device.f9_der(),
        &roots(&device),
        now(),
    ));
    assert!(matches!(r, PivRefusal::Unreadable { .. }), "{r}");
    let mut trailing = attestation.clone();
    trailing.extend_from_slice(&[0x05, 0x00]);
    let r = refusal(piv::verify_attestation(
        &trailing,
        &device.f9_der(),
        &roots(&device),
        now(),
    ));
    assert!(matches!(r, PivRefusal::Unreadable { .. }), "{r}");
}

fn data(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/yubikey")
        .join(name)
}

/// `hwkey attest piv-verify` on real YubiKeys' attestations: what it prints, and the
/// failures an operator checking a token would meet.
#[test]
fn piv_verify_prints_what_a_real_yubikey_attests() {
    let verify = |attestation: &str, f9: &str| {
        let mut cmd = hwkey();
        cmd.args(["attest", "piv-verify", "--attestation"])
            .arg(data(attestation))
            .arg("--intermediate")
            .arg(data(f9));
        cmd
    };
    let out = run_ok(&mut verify("attestation-9a-5.4.3.pem", "f9-5.4.3.pem"));
    let text = String::from_utf8_lossy(&out.stdout);
    for line in [
        "serial: 15732500",
        "firmware: 5.4.3",
        "slot: 9a",
        "pinPolicy: once",
        "touchPolicy: never",
        "formFactor: USB-C nano",
        "root: Yubico PIV Root CA Serial 263751",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    let out = run_ok(&mut verify("attestation-9c-5.7.4.pem", "f9-5.7.4.pem"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("serial: 38906327") && text.contains("root: Yubico Attestation Root 1"),
        "{text}"
    );
    // The attestation of one key checked against another key.
    let dir = temp_dir();
    let other = dir.path().join("other.pem");
    std::fs::write(
        &other,
        pem::encode(&pem::Pem::new("PUBLIC KEY", SoftwareKey::generate().spki())),
    )
    .expect("write");
    let out = run_fail(
        verify("attestation-9a-5.4.3.pem", "f9-5.4.3.pem")
            .arg("--pubkey")
            .arg(&other),
    );
    assert!(
        output_text(&out).contains("another key than --pubkey"),
        "{}",
        output_text(&out)
    );
    // A YubiKey 4: its root (the U2F root) is not trusted by default.
    let out = run_fail(&mut verify("attestation-9a-4.3.7.pem", "f9-4.3.7.pem"));
    assert!(
        output_text(&out).contains("no path from 'Yubico PIV Attestation'"),
        "{}",
        output_text(&out)
    );
    // Its parts swapped.
    let out = run_fail(&mut verify("f9-5.4.3.pem", "attestation-9a-5.4.3.pem"));
    assert!(
        output_text(&out).contains("not signed by the device's attestation certificate"),
        "{}",
        output_text(&out)
    );
}

/// A SoftHSM token holding key `pat` (CKA_ID 01) and, once installed, ykcs11's attestation
/// objects for it.
struct Token {
    hsm: SoftHsm,
    uri: String,
    spki: Vec<u8>,
}

impl Token {
    fn new() -> Token {
        let hsm = SoftHsm::new();
        hsm.init_token("yk");
        hsm.pkcs11_keygen_with_id("yk", "pat", "EC:prime256v1", "01");
        let uri = hsm.key_uri("yk", "pat");
        let spki = csr_of(&hsm, &uri).spki_der().to_vec();
        Token { hsm, uri, spki }
    }
}

/// `hwkey csr` for `CN=pat` with the key at `uri`, read back.
fn csr_of(hsm: &SoftHsm, uri: &str) -> hwkey::pki::request::Request {
    let out = run_ok(
        hwkey()
            .envs(hsm.envs())
            .args(["csr", "--key", uri, "--subject", "CN=pat"]),
    );
    hwkey::pki::request::Request::from_pem(&out.stdout).expect("hwkey csr's request")
}

/// The client side: with ykcs11's attestation objects on the token, `hwkey csr` carries the
/// key's attestation and the device's f9 certificate, which verify for exactly that key;
/// without them it carries nothing. The attestation certificate shares the key's CKA_ID but
/// is never part of the key's own chain.
#[test]
fn a_key_on_a_piv_token_carries_its_attestation_and_keeps_its_own_certificate() {
    let token = Token::new();
    assert_eq!(
        hwkey::pki::same_key::proof_of(&csr_of(&token.hsm, &token.uri)),
        hwkey::pki::same_key::Proof::Missing,
        "no attestation objects yet"
    );
    let device = PivDevice::new(&ChainShape::default());
    let attestation = device.attest(&token.spki, Slot::new(777, TOUCH_ALWAYS));
    device.install(&token.hsm, "yk", "01", "9a", &attestation);
    // Another slot's attestation (another key) on the same token is not this key's.
    let other = device.attest(
        &SoftwareKey::generate().spki(),
        Slot::new(777, TOUCH_ALWAYS),
    );
    token.hsm.write_certificate(
        "yk",
        &other,
        "X.509 Certificate for PIV Attestation 9c",
        "02",
    );

    let request = csr_of(&token.hsm, &token.uri);
    let hwkey::pki::same_key::Proof::PivAttestation {
        attestation: carried,
        certs,
    } = hwkey::pki::same_key::proof_of(&request)
    else {
        panic!("no PIV attestation in the request");
    };
    assert_eq!(carried, attestation);
    assert_eq!(certs, vec![device.f9_der()]);
    let facts =
        piv::verify_attestation(&carried, &certs[0], &roots(&device), now()).expect("holds");
    assert_eq!(
        (facts.serial, facts.spki.as_slice()),
        (777, request.spki_der())
    );

    // The key's own certificate, stored beside it with the same CKA_ID, is its chain; the
    // attestation certificate is not.
    let dir = temp_dir();
    let ca = support::ca::TestCa::new(dir.path());
    let csr = hwkey::pki::csr::request_pem(request.der());
    let own = pem::parse(ca.sign_csr_pem(&csr, 1))
        .expect("PEM")
        .into_contents();
    token.hsm.write_certificate("yk", &own, "pat", "01");
    let out = run_ok(
        hwkey()
            .envs(token.hsm.envs())
            .args(["cert", "show", "--json", "--key", &token.uri]),
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let chain = shown.as_array().expect("a list");
    assert_eq!(
        chain.len(),
        1,
        "the key's chain holds only its own certificate: {shown}"
    );
    assert!(
        chain[0].to_string().contains("CN=pat") && !chain[0].to_string().contains("Attestation"),
        "{shown}"
    );
}
