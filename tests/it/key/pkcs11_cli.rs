//! The PKCS#11 key layer through the `hwkey` binary, against a real SoftHSMv2 token and real
//! foreign peers: `openssl req -verify`, `openssl s_server -Verify 1`, nginx with
//! `ssl_verify_client on`, and `pkcs11-tool`.

use std::path::PathBuf;
use std::process::{Command, Output};

use support::flow::{fails_with, stderr, stdout, Flow};
use support::{output_text, run_fail, run_ok, OpensslServer, SoftHsm, TlsVersion};

/// One SoftHSM token ("kube") and the shared operator flow (test CA, server certificate).
struct Setup {
    hsm: SoftHsm,
    flow: Flow,
}

impl Setup {
    fn new() -> Setup {
        let hsm = SoftHsm::new();
        hsm.init_token("kube");
        let flow = Flow::new(hsm.envs());
        Setup { hsm, flow }
    }

    fn hwkey(&self) -> Command {
        self.flow.hwkey()
    }

    fn key_uri(&self, object: &str) -> String {
        self.hsm.key_uri("kube", object)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.flow.path(name)
    }

    fn certify(&self, uri: &str, cn: &str) -> PathBuf {
        self.flow.certify(uri, cn)
    }

    fn probe(&self, uri: &str, url: &str) -> Output {
        self.flow.probe(uri, url)
    }
}

/// create → CSR verified by openssl → certificate from the test CA → probe against s_server
/// (TLS 1.3 and 1.2) and nginx, all requiring and verifying client certificates.
fn full_flow(algorithm: &str) {
    let s = Setup::new();
    s.flow.create_certify_probe(&s.key_uri("client"), algorithm);
}

#[test]
fn ec_p256_full_flow() {
    full_flow("ec-p256");
}

#[test]
fn ec_p384_full_flow() {
    full_flow("ec-p384");
}

#[test]
fn rsa_2048_full_flow() {
    full_flow("rsa-2048");
}

#[test]
fn rsa_3072_full_flow() {
    full_flow("rsa-3072");
}

#[test]
fn rsa_4096_full_flow() {
    full_flow("rsa-4096");
}

#[test]
fn private_key_is_sensitive_and_never_leaves_the_token() {
    let s = Setup::new();
    let uri = s.key_uri("locked");
    run_ok(s.hwkey().args(["key", "create", "--key", &uri]));

    let info = stdout(&run_ok(s.hwkey().args(["key", "info", "--key", &uri])));
    for line in [
        "CKA_SENSITIVE: true",
        "CKA_EXTRACTABLE: false",
        "CKA_NEVER_EXTRACTABLE: true",
        "CKA_ALWAYS_SENSITIVE: true",
        "private value readable: false",
    ] {
        assert!(info.contains(line), "missing '{line}' in:\n{info}");
    }

    // The same facts as a foreign tool sees them.
    let listed = s.hsm.pkcs11_tool(&[
        "--token-label",
        "kube",
        "--login",
        "--pin",
        support::USER_PIN,
        "--list-objects",
        "--type",
        "privkey",
    ]);
    let text = output_text(&listed);
    assert!(text.contains("locked"), "{text}");
    assert!(text.contains("sensitive"), "{text}");
    assert!(text.contains("never extractable"), "{text}");
}

#[test]
fn keys_made_by_pkcs11_tool_are_usable() {
    let s = Setup::new();
    s.hsm
        .pkcs11_keygen("kube", "from-opensc-ec", "EC:prime256v1");
    s.hsm.pkcs11_keygen("kube", "from-opensc-rsa", "rsa:2048");

    let list = stdout(&run_ok(s.hwkey().args([
        "key",
        "list",
        "--key",
        &s.hsm.token_uri("kube"),
    ])));
    assert!(
        list.contains("object=from-opensc-ec") && list.contains("ec-p256"),
        "{list}"
    );
    assert!(
        list.contains("object=from-opensc-rsa") && list.contains("rsa-2048"),
        "{list}"
    );

    let server = OpensslServer::start(
        &s.flow.ca.ca_path(),
        &s.flow.server_cert,
        &s.flow.server_key,
        TlsVersion::Tls13,
    );
    for object in ["from-opensc-ec", "from-opensc-rsa"] {
        let uri = s.key_uri(object);
        s.certify(&uri, object);
        let out = s.probe(&uri, &server.url());
        assert!(
            stderr(&out).contains("client signature:"),
            "{}",
            stderr(&out)
        );
    }
    // Listed keys now say they have a certificate; the JSON form says the same.
    let json = stdout(&run_ok(s.hwkey().args([
        "key",
        "list",
        "--json",
        "--key",
        &s.hsm.token_uri("kube"),
    ])));
    let parsed: serde_json::Value = serde_json::from_str(&json).expect("key list --json is JSON");
    let items = parsed.as_array().expect("array");
    assert_eq!(items.len(), 2, "{json}");
    assert!(items.iter().all(|i| i["certificate"] == true), "{json}");
}

fn token_state(s: &Setup) -> String {
    let out = s.hsm.pkcs11_tool(&[
        "--token-label",
        "kube",
        "--login",
        "--pin",
        support::USER_PIN,
        "--list-objects",
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    stdout(&out)
}

#[test]
fn bad_input_is_refused_clearly_and_changes_nothing() {
    let s = Setup::new();
    let uri = s.key_uri("alice");
    run_ok(s.hwkey().args(["key", "create", "--key", &uri]));
    let before = token_state(&s);

    fails_with(
        s.hwkey().args(["key", "public", "--key", "pkcs11:token"]),
        &["invalid key URI", "name=value"],
    );
    fails_with(
        s.hwkey().args(["key", "public", "--key", "tpm2:path=/x"]),
        &["must start with 'pkcs11:'"],
    );
    fails_with(
        s.hwkey().args([
            "key",
            "public",
            "--key",
            "pkcs11:token=kube;object=alice?module-path=/nonexistent/lib.so",
        ]),
        &["cannot load PKCS#11 module /nonexistent/lib.so"],
    );
    fails_with(
        s.hwkey()
            .args(["key", "public", "--key", &s.hsm.key_uri("nope", "alice")]),
        &["token 'nope' not found", "'kube'"],
    );
    fails_with(
        s.hwkey()
            .args(["key", "public", "--key", &s.key_uri("bob")]),
        &["key object='bob' not found", "'alice'"],
    );
    fails_with(
        s.hwkey()
            .args(["key", "create", "--key", &uri, "--algorithm", "dsa-1024"]),
        &["unknown algorithm 'dsa-1024'"],
    );

    // Duplicate create: refused, and the existing key is untouched.
    let public = stdout(&run_ok(s.hwkey().args(["key", "public", "--key", &uri])));
    fails_with(
        s.hwkey()
            .args(["key", "create", "--key", &uri, "--algorithm", "rsa-2048"]),
        &["already exists"],
    );
    assert_eq!(
        stdout(&run_ok(s.hwkey().args(["key", "public", "--key", &uri]))),
        public
    );

    // Delete without --yes.
    fails_with(
        s.hwkey().args(["key", "delete", "--key", &uri]),
        &["without --yes"],
    );

    // Certificate for another key.
    let other = s.key_uri("other");
    run_ok(s.hwkey().args(["key", "create", "--key", &other]));
    let other_crt = s.certify(&other, "other");
    let before_import = token_state(&s);
    fails_with(
        s.hwkey()
            .args(["cert", "import", "--key", &uri, "--cert"])
            .arg(&other_crt),
        &["different public key"],
    );
    assert_eq!(
        token_state(&s),
        before_import,
        "a refused import changes nothing on the token"
    );
    // `cert show` prints what it found and says NO, exiting non-zero.
    let shown = run_fail(
        s.hwkey()
            .args(["cert", "show", "--key", &uri, "--cert"])
            .arg(&other_crt),
    );
    assert!(
        stdout(&shown).contains("matches key: NO"),
        "{}",
        stdout(&shown)
    );
    assert!(
        stderr(&shown).contains("does not match"),
        "{}",
        stderr(&shown)
    );
    fails_with(
        s.hwkey().args([
            "cert",
            "import",
            "--key",
            &uri,
            "--cert",
            "/nonexistent.pem",
        ]),
        &["cannot read certificate file /nonexistent.pem"],
    );

    // The only changes on the token are the ones we asked for ('other' and its certificate).
    let after = token_state(&s);
    for line in before.lines().filter(|l| l.contains("label")) {
        assert!(after.contains(line), "lost '{line}'");
    }
    // Missing PIN source, unreadable PIN file.
    let no_pin = format!(
        "pkcs11:token=kube;object=alice?module-path={}",
        support::SOFTHSM_MODULE
    );
    fails_with(
        s.hwkey().args(["key", "public", "--key", &no_pin]),
        &["needs a PIN", "pin-source"],
    );
    let missing_pin = format!("{no_pin}&pin-source=file:/nonexistent/pin");
    fails_with(
        s.hwkey().args(["key", "public", "--key", &missing_pin]),
        &["cannot read the PIN from file /nonexistent/pin"],
    );
}

#[test]
fn wrong_pin_is_tried_once_and_the_token_keeps_working() {
    let s = Setup::new();
    let uri = s.key_uri("alice");
    run_ok(s.hwkey().args(["key", "create", "--key", &uri]));
    let wrong = s.path("wrong-pin");
    support::write_private(&wrong, b"999999");
    let wrong_uri = format!(
        "pkcs11:token=kube;object=alice?module-path={}&pin-source=file:{}",
        support::SOFTHSM_MODULE,
        wrong.display()
    );
    let err = fails_with(
        s.hwkey().args(["key", "public", "--key", &wrong_uri]),
        &["PIN", "rejected", "exactly one attempt"],
    );
    assert!(!err.contains("999999"), "the PIN is never printed: {err}");
    // PIN from the environment works, and the token was not locked by the failure.
    let env_uri = format!(
        "pkcs11:token=kube;object=alice?module-path={}&pin-source=env:HWKEY_TEST_PIN",
        support::SOFTHSM_MODULE
    );
    run_ok(
        s.hwkey()
            .args(["key", "public", "--key", &env_uri])
            .env("HWKEY_TEST_PIN", support::USER_PIN),
    );
    let info = s
        .hsm
        .pkcs11_tool(&["--token-label", "kube", "--list-token-slots"]);
    let _ = info;
    let slots = output_text(&s.hsm.pkcs11_tool(&["--list-slots"]));
    assert!(!slots.contains("PIN locked"), "{slots}");
}

#[test]
fn delete_with_yes_removes_key_public_key_and_certificates() {
    let s = Setup::new();
    let uri = s.key_uri("gone");
    run_ok(s.hwkey().args(["key", "create", "--key", &uri]));
    s.certify(&uri, "gone");
    assert!(token_state(&s).contains("gone"));
    let out = run_ok(s.hwkey().args(["key", "delete", "--yes", "--key", &uri]));
    let err = stderr(&out);
    assert!(
        err.contains("deleted private key")
            && err.contains("deleted public key")
            && err.contains("deleted certificate"),
        "{err}"
    );
    assert!(!token_state(&s).contains("gone"), "{}", token_state(&s));
    fails_with(
        s.hwkey().args(["key", "delete", "--yes", "--key", &uri]),
        &["not found"],
    );
}

#[test]
fn csr_as_a_kubernetes_certificate_signing_request() {
    let s = Setup::new();
    let uri = s.key_uri("node");
    run_ok(s.hwkey().args(["key", "create", "--key", &uri]));
    let out = run_ok(s.hwkey().args([
        "csr",
        "--key",
        &uri,
        "--subject",
        "CN=system:node:n1,O=system:nodes",
        "--k8s-name",
        "node-n1",
        "--expiration-seconds",
        "86400",
    ]));
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&stdout(&out)).expect("YAML");
    assert_eq!(doc["apiVersion"], "certificates.k8s.io/v1");
    assert_eq!(doc["kind"], "CertificateSigningRequest");
    assert_eq!(doc["metadata"]["name"], "node-n1");
    assert_eq!(
        doc["spec"]["signerName"],
        "kubernetes.io/kube-apiserver-client-kubelet"
    );
    assert_eq!(doc["spec"]["expirationSeconds"], 86400);
    let usages: Vec<&str> = doc["spec"]["usages"]
        .as_sequence()
        .expect("usages")
        .iter()
        .filter_map(|u| u.as_str())
        .collect();
    // kube-controller-manager before 1.22 signs node client certificates only with exactly
    // these three (the kubelet signer's object; other signers get the two without key
    // encipherment).
    assert_eq!(
        usages,
        ["digital signature", "key encipherment", "client auth"]
    );
    // The request is the PEM CSR, base64-encoded; openssl verifies its signature.
    use base64::Engine;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(doc["spec"]["request"].as_str().expect("request"))
        .expect("base64");
    let csr = s.path("node.csr");
    std::fs::write(&csr, &pem).expect("write");
    assert!(!pem.contains(&b'\r'), "PEM uses Unix line endings");
    let verify = run_ok(
        Command::new("openssl")
            .args(["req", "-verify", "-noout", "-subject", "-in"])
            .arg(&csr),
    );
    let text = output_text(&verify);
    assert!(text.contains("verify OK"), "{text}");
    assert!(text.contains("system:node:n1"), "{text}");
}

/// Issue 24, item 6: tokens that are not SoftHSM-shaped keep a private key and its certificate
/// but no public-key object (smart cards, keys imported without their public half). The public
/// key then comes from the certificate with the same CKA_ID, or from the private key's own
/// attributes (RSA's modulus and exponent); with neither, the error says what to write.
#[test]
fn a_private_key_without_a_public_key_object_still_works() {
    let s = Setup::new();
    let delete_public = |label: &str| {
        let out = s.hsm.pkcs11_tool(&[
            "--token-label",
            "kube",
            "--login",
            "--pin",
            support::USER_PIN,
            "--delete-object",
            "--type",
            "pubkey",
            "--label",
            label,
        ]);
        assert!(out.status.success(), "{}", output_text(&out));
        let left = s.hsm.pkcs11_tool(&[
            "--token-label",
            "kube",
            "--login",
            "--pin",
            support::USER_PIN,
            "--list-objects",
            "--type",
            "pubkey",
        ]);
        assert!(
            !output_text(&left).contains(&format!("label:      {label}")),
            "the public key object is still there: {}",
            output_text(&left)
        );
    };
    for (label, algorithm, certified) in [
        ("ec-with-cert", "ec-p256", true),
        ("rsa-bare", "rsa-2048", false),
        ("ec-bare", "ec-p256", false),
    ] {
        let uri = s.key_uri(label);
        let created =
            run_ok(
                s.hwkey()
                    .args(["key", "create", "--key", &uri, "--algorithm", algorithm]),
            );
        let pem = String::from_utf8_lossy(&created.stdout).to_string();
        if certified {
            s.certify(&uri, label);
        }
        delete_public(label);
        if label == "ec-bare" {
            // No public object, no certificate, no CKA_EC_POINT on SoftHSM's private key.
            let failed = run_fail(s.hwkey().args(["key", "public", "--key", &uri]));
            let text = output_text(&failed);
            assert!(
                text.contains("no public-key object") && text.contains("--write-object"),
                "{text}"
            );
            continue;
        }
        let public = run_ok(s.hwkey().args(["key", "public", "--key", &uri]));
        assert_eq!(
            String::from_utf8_lossy(&public.stdout),
            pem,
            "{label}: the public key from the certificate or the private key is the key's"
        );
        // And it signs: a CSR that openssl verifies, for the key printed above.
        s.certify(&uri, &format!("{label}-again"));
    }
}

/// Issue 35, finding "`hwkey probe` has no timeout": a server that accepts the connection and
/// never answers made `hwkey probe` wait for good (on 1e6941c it still ran after 20 s). Now the
/// whole exchange has a limit (`--timeout`, `HWKEY_PROBE_TIMEOUT`, default 30 s) and the error
/// says what did not answer and what to check.
#[test]
fn probe_gives_up_on_a_server_that_never_answers() {
    let id = support::proxy::Identity::softhsm();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "https://127.0.0.1:{}/version",
        silent.local_addr().expect("addr").port()
    );
    let out = support::run_fail_within(
        support::hwkey()
            .envs(id.envs())
            .env("HWKEY_PROBE_TIMEOUT", "2s")
            .args(["probe", "--key", &id.key_uri, "--cert"])
            .arg(&id.cert)
            .arg("--ca")
            .arg(id.ca.ca_path())
            .arg(&url),
        std::time::Duration::from_secs(20),
    );
    let text = output_text(&out);
    assert!(
        text.contains(&format!("no answer from {url} within 2s")) && text.contains("--timeout"),
        "{text}"
    );
    drop(silent);
}
