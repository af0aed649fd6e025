//! `hwkey cert import` checks a certificate before it replaces the stored one (issue 9,
//! finding 18): a flipped bit in the signature or in the body fails the signature check
//! against `--ca`; an expired certificate and a non-client certificate are refused; every
//! refusal leaves the stored certificate as it was.

use std::path::Path;
use std::time::Duration;

use support::proxy::Identity;
use support::*;

fn der_of(path: &Path) -> Vec<u8> {
    pem::parse(std::fs::read(path).expect("read"))
        .expect("PEM")
        .into_contents()
}

fn write_der(path: &Path, der: Vec<u8>) {
    std::fs::write(path, pem::encode(&pem::Pem::new("CERTIFICATE", der))).expect("write");
}

fn stored_serial(id: &Identity) -> String {
    let out =
        run_ok(
            hwkey()
                .envs(id.envs())
                .args(["cert", "show", "--json", "--key", &id.key_uri]),
        );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v[0]["serial"].as_str().expect("serial").to_string()
}

fn import(id: &Identity, cert: &Path) -> std::process::Command {
    let mut cmd = hwkey();
    cmd.envs(id.envs())
        .args(["cert", "import", "--key", &id.key_uri, "--cert"])
        .arg(cert)
        .arg("--ca")
        .arg(id.ca.ca_path());
    cmd
}

#[test]
fn corrupted_expired_and_non_client_certificates_are_refused_and_nothing_changes() {
    let id = Identity::softhsm();
    run_ok(&mut import(&id, &id.cert));
    let stored = stored_serial(&id);
    let dir = temp_dir();

    let renewed = dir.path().join("renewed.pem");
    id.issue(&id.key_uri, "CN=alice,O=devs", &renewed);
    let good = der_of(&renewed);

    // A flipped bit in the signature (the last bytes of the DER).
    let mut sig_flip = good.clone();
    let n = sig_flip.len();
    sig_flip[n - 3] ^= 0x01;
    let path = dir.path().join("sig.pem");
    write_der(&path, sig_flip);
    let out = run_fail(&mut import(&id, &path));
    assert!(
        output_text(&out).contains("signature does not verify"),
        "{}",
        output_text(&out)
    );

    // A flipped bit in the body: the 'a' of CN=alice becomes '`'.
    let mut body_flip = good.clone();
    let at = body_flip
        .windows(5)
        .position(|w| w == b"alice")
        .expect("CN in the DER");
    body_flip[at] ^= 0x01;
    let path = dir.path().join("body.pem");
    write_der(&path, body_flip);
    let out = run_fail(&mut import(&id, &path));
    assert!(
        output_text(&out).contains("signature does not verify"),
        "{}",
        output_text(&out)
    );

    // Expired.
    let csr = run_ok(hwkey().envs(id.envs()).args([
        "csr",
        "--key",
        &id.key_uri,
        "--subject",
        "CN=alice,O=devs",
    ]));
    let expired = id.ca.sign_csr_pem_for(
        &String::from_utf8(csr.stdout).expect("UTF-8"),
        Duration::ZERO,
    );
    std::thread::sleep(Duration::from_millis(1100));
    let path = dir.path().join("expired.pem");
    std::fs::write(&path, expired).expect("write");
    let out = run_fail(&mut import(&id, &path));
    assert!(
        output_text(&out).contains("it is valid only from"),
        "{}",
        output_text(&out)
    );

    // A server certificate (extendedKeyUsage serverAuth only).
    let (server, _) = id.ca.server_cert(dir.path());
    let out = run_fail(&mut import(&id, &server));
    assert!(
        output_text(&out).contains("not a client certificate"),
        "{}",
        output_text(&out)
    );

    // Issue 22, findings 5 and 13: a CA certificate for the key (what a misbehaving signer
    // returned), and a DNS name carrying a terminal escape. `cert show` escapes it.
    let csr_path = dir.path().join("key.csr");
    let csr = run_ok(hwkey().envs(id.envs()).args([
        "csr",
        "--key",
        &id.key_uri,
        "--subject",
        "CN=alice,O=devs",
    ]));
    std::fs::write(&csr_path, &csr.stdout).expect("write CSR");
    for (name, ext, needle) in [
        (
            "ca",
            "basicConstraints=critical,CA:TRUE\nkeyUsage=digitalSignature,keyCertSign\n",
            "it is a CA certificate",
        ),
        (
            "escape",
            "subjectAltName=DNS:evil\x1b[2J.example\nextendedKeyUsage=clientAuth\n",
            "holds control characters",
        ),
    ] {
        let ext_path = dir.path().join(format!("{name}.cnf"));
        std::fs::write(&ext_path, ext).expect("write extensions");
        let path = dir.path().join(format!("{name}.pem"));
        run_ok(
            std::process::Command::new("openssl")
                .args(["x509", "-req", "-days", "1", "-in"])
                .arg(&csr_path)
                .arg("-CA")
                .arg(id.ca.ca_path())
                .arg("-CAkey")
                .arg(id.ca.key_path())
                .args(["-CAcreateserial", "-CAserial"])
                .arg(dir.path().join("serial"))
                .arg("-extfile")
                .arg(&ext_path)
                .arg("-out")
                .arg(&path),
        );
        let out = run_fail(&mut import(&id, &path));
        let text = output_text(&out);
        assert!(
            text.contains(needle) && !text.contains('\x1b'),
            "{name}: {text:?}"
        );
        if name == "escape" {
            let shown = run_ok(
                hwkey()
                    .envs(id.envs())
                    .args(["cert", "show", "--key", &id.key_uri, "--cert"])
                    .arg(&path),
            );
            let text = String::from_utf8_lossy(&shown.stdout);
            assert!(
                text.contains("DNS:evil\\u{1b}[2J.example") && !text.contains('\x1b'),
                "{text:?}"
            );
        }
    }

    assert_eq!(
        stored_serial(&id),
        stored,
        "a refused import changed the stored certificate"
    );
    // And the good one goes in.
    run_ok(&mut import(&id, &renewed));
    assert_ne!(stored_serial(&id), stored);
}
