//! TPM keys through the `hwkey` binary, against a real swtpm and real foreign peers
//! (`openssl req -verify`, `openssl s_server -Verify 1`, nginx `ssl_verify_client on`).
//! Each test starts its own swtpm on a free loopback port.

use std::fs;

use support::flow::{fails_with, stdout, Flow};
use support::{free_port, run_ok, Swtpm};

fn file_uri(flow: &Flow, tpm: &Swtpm, name: &str) -> String {
    format!("tpm:path={}?tcti={}", flow.path(name).display(), tpm.tcti())
}

#[test]
fn ec_p256_file_key_full_flow() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    flow.create_certify_probe(&file_uri(&flow, &tpm, "alice.pem"), "ec-p256");
    // The certificate was stored beside the key file.
    assert!(flow.path("alice.crt.pem").exists());
}

#[test]
fn ec_p384_file_key_full_flow() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    flow.create_certify_probe(&file_uri(&flow, &tpm, "alice.pem"), "ec-p384");
}

#[test]
fn rsa_2048_file_key_full_flow() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    flow.create_certify_probe(&file_uri(&flow, &tpm, "alice.pem"), "rsa-2048");
}

#[test]
fn persistent_handle_key_signs_csr_and_handshake() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    let uri = format!("tpm:handle=0x81000123?tcti={}", tpm.tcti());
    run_ok(flow.hwkey().args(["key", "create", "--key", &uri]));
    let list = stdout(&run_ok(flow.hwkey().args([
        "key",
        "list",
        "--key",
        &format!("tpm:?tcti={}", tpm.tcti()),
    ])));
    assert!(
        list.contains("handle=0x81000123") && list.contains("ec-p256"),
        "{list}"
    );
    // A persistent key has no file to keep its certificate beside: import says so.
    let crt = {
        let csr = flow.path("h.csr");
        run_ok(
            flow.hwkey()
                .args([
                    "csr",
                    "--key",
                    &uri,
                    "--subject",
                    "CN=node1,O=system:nodes",
                    "--out",
                ])
                .arg(&csr),
        );
        let crt = flow.path("h.crt");
        flow.ca.sign_csr_file(&csr, 1, &crt);
        crt
    };
    fails_with(
        flow.hwkey()
            .args(["cert", "import", "--key", &uri, "--cert"])
            .arg(&crt),
        &["--cert"],
    );
    let server = support::OpensslServer::start(
        &flow.ca.ca_path(),
        &flow.server_cert,
        &flow.server_key,
        support::TlsVersion::Tls13,
    );
    let out = run_ok(
        flow.hwkey()
            .args(["probe", "--key", &uri, "--cert"])
            .arg(&crt)
            .arg("--ca")
            .arg(flow.ca.ca_path())
            .arg(server.url()),
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("client signature: ecdsa_secp256r1_sha256")
    );
    run_ok(flow.hwkey().args(["key", "delete", "--yes", "--key", &uri]));
    let list = stdout(&run_ok(flow.hwkey().args([
        "key",
        "list",
        "--key",
        &format!("tpm:?tcti={}", tpm.tcti()),
    ])));
    assert!(!list.contains("0x81000123"), "{list}");
}

#[test]
fn tpm_bad_input_is_refused_clearly_and_changes_nothing() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    let uri = file_uri(&flow, &tpm, "k.pem");
    run_ok(flow.hwkey().args(["key", "create", "--key", &uri]));
    let original = fs::read(flow.path("k.pem")).expect("key file");

    // Duplicate create: refused, file byte-identical.
    fails_with(
        flow.hwkey().args(["key", "create", "--key", &uri]),
        &["already exists"],
    );
    assert_eq!(fs::read(flow.path("k.pem")).expect("key file"), original);

    // Unreachable TCTI: a closed port.
    let closed = format!(
        "tpm:path={}?tcti=swtpm:host=127.0.0.1,port={}",
        flow.path("k.pem").display(),
        free_port()
    );
    fails_with(
        flow.hwkey().args(["key", "public", "--key", &closed]),
        &["cannot open the TPM through TCTI"],
    );

    // Corrupt TSS2 PEM file: named in the error, left as it was.
    let corrupt = flow.path("corrupt.pem");
    fs::write(
        &corrupt,
        "-----BEGIN TSS2 PRIVATE KEY-----\nAAAA\n-----END TSS2 PRIVATE KEY-----\n",
    )
    .expect("write");
    let before = fs::read(&corrupt).expect("read");
    fails_with(
        flow.hwkey().args([
            "key",
            "public",
            "--key",
            &file_uri(&flow, &tpm, "corrupt.pem"),
        ]),
        &["corrupt.pem", "TSS2 PRIVATE KEY"],
    );
    assert_eq!(fs::read(&corrupt).expect("read"), before);

    // Missing file, delete without --yes.
    fails_with(
        flow.hwkey()
            .args(["key", "public", "--key", &file_uri(&flow, &tpm, "nope.pem")]),
        &["not found"],
    );
    fails_with(
        flow.hwkey().args(["key", "delete", "--key", &uri]),
        &["without --yes"],
    );
    assert_eq!(fs::read(flow.path("k.pem")).expect("still there"), original);

    // Certificate of another key: refused, nothing written beside the key.
    let other = file_uri(&flow, &tpm, "other.pem");
    run_ok(flow.hwkey().args(["key", "create", "--key", &other]));
    let other_crt = flow.certify(&other, "other");
    fails_with(
        flow.hwkey()
            .args(["cert", "import", "--key", &uri, "--cert"])
            .arg(&other_crt),
        &["different public key"],
    );
    assert!(!flow.path("k.crt.pem").exists());
}

/// Issue 24: no `ERROR` line on a successful command. On a fresh TPM, `attest enroll` probes for
/// an AK handle and EK certificate that are not there yet: the TSS logs those lookups as errors
/// unless told not to, which reads as a failure.
#[test]
fn successful_commands_on_a_fresh_tpm_log_no_error() {
    let tpm = Swtpm::start();
    let flow = Flow::new(Vec::new());
    let key = file_uri(&flow, &tpm, "node.pem");
    let tpm_only = format!("tpm:?tcti={}", tpm.tcti());
    for args in [
        vec!["attest", "enroll", "--key", &tpm_only],
        vec!["attest", "enroll", "--key", &tpm_only],
        vec!["key", "create", "--key", &key],
        vec![
            "csr",
            "--attest",
            "--key",
            &key,
            "--subject",
            "CN=system:node:n1,O=system:nodes",
        ],
        vec!["key", "info", "--key", &key],
    ] {
        let out = run_ok(flow.hwkey().env_remove("TSS2_LOG").args(&args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("ERROR"),
            "`hwkey {}` succeeded but logged an error:\n{stderr}",
            args.join(" ")
        );
    }
}
