//! `--require-non-extractable` (on by default): a key the device says could leave it is refused
//! by every command that makes or uses a hardware identity, with the device's reasons and the
//! way out; keys hwkey creates pass, and so do keys other tools made the right way.

use support::flow::{fails_with, stdout};
use support::{hwkey, run_ok, temp_dir};

#[cfg(feature = "pkcs11")]
#[test]
fn an_extractable_token_key_is_refused_unless_allowed() {
    use support::{SoftHsm, USER_PIN};
    let hsm = SoftHsm::new();
    hsm.init_token("kube");
    let made = hsm.pkcs11_tool(&[
        "--token-label",
        "kube",
        "--login",
        "--pin",
        USER_PIN,
        "--keypairgen",
        "--key-type",
        "EC:prime256v1",
        "--label",
        "exportable",
        "--extractable",
    ]);
    assert!(made.status.success(), "{}", support::output_text(&made));
    let uri = hsm.key_uri("kube", "exportable");
    let csr = |extra: &[&str]| {
        let mut c = hwkey();
        c.envs(hsm.envs())
            .args(["csr", "--key", &uri, "--subject", "CN=alice"])
            .args(extra);
        c
    };

    fails_with(
        &mut csr(&[]),
        &[
            "could leave its device",
            "CKA_EXTRACTABLE is true",
            "--require-non-extractable=false",
        ],
    );
    let info = stdout(&run_ok(
        hwkey()
            .envs(hsm.envs())
            .args(["key", "info", "--key", &uri]),
    ));
    assert!(info.contains("extractable: YES"), "{info}");
    // The proxy refuses it too, before listening.
    let dir = temp_dir();
    fails_with(
        hwkey().envs(hsm.envs()).args([
            "proxy",
            "--key",
            &uri,
            "--upstream",
            "https://127.0.0.1:1",
            "--listen",
            &format!("unix:{}", dir.path().join("s.sock").display()),
            "--state-dir",
            &dir.path().join("state").display().to_string(),
        ]),
        &["CKA_EXTRACTABLE is true"],
    );
    assert!(!dir.path().join("s.sock").exists());

    // The user may accept it, explicitly.
    let pem = stdout(&run_ok(&mut csr(&["--require-non-extractable=false"])));
    assert!(pem.contains("BEGIN CERTIFICATE REQUEST"), "{pem}");

    // A key hwkey creates passes with the policy on.
    let own = hsm.key_uri("kube", "own");
    run_ok(hwkey().envs(hsm.envs()).args([
        "key",
        "create",
        "--key",
        &own,
        "--algorithm",
        "ec-p256",
    ]));
    let pem = stdout(&run_ok(hwkey().envs(hsm.envs()).args([
        "csr",
        "--key",
        &own,
        "--subject",
        "CN=alice",
    ])));
    assert!(pem.contains("BEGIN CERTIFICATE REQUEST"), "{pem}");
    let info = stdout(&run_ok(
        hwkey()
            .envs(hsm.envs())
            .args(["key", "info", "--key", &own]),
    ));
    assert!(info.contains("extractable: no"), "{info}");
}

#[cfg(feature = "tpm")]
#[test]
fn a_duplicable_tpm_key_is_refused_unless_allowed() {
    use support::{require_tool, Swtpm};
    require_tool("tpm2_create", "tpm2-tools");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let d = dir.path();
    let tool = |args: &[&str]| tpm.tool(d, args);
    tpm.create_primary(d, "p.ctx");
    // No fixedtpm / fixedparent: a key that may be duplicated to another TPM.
    for (name, attributes, handle) in [
        ("dup", "sensitivedataorigin|userwithauth|sign", "0x81000300"),
        (
            "fixed",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
            "0x81000301",
        ),
    ] {
        let (public, private, ctx) = (
            format!("{name}.pub"),
            format!("{name}.priv"),
            format!("{name}.ctx"),
        );
        tool(&[
            "tpm2_create",
            "-C",
            "p.ctx",
            "-G",
            "ecc256:ecdsa-sha256",
            "-a",
            attributes,
            "-u",
            &public,
            "-r",
            &private,
        ]);
        tool(&[
            "tpm2_load",
            "-C",
            "p.ctx",
            "-u",
            &public,
            "-r",
            &private,
            "-c",
            &ctx,
        ]);
        tool(&["tpm2_evictcontrol", "-C", "o", "-c", &ctx, handle]);
    }
    let uri = |handle: &str| format!("tpm:handle={handle}?tcti={}", tpm.tcti());
    let csr = |handle: &str, extra: &[&str]| {
        let mut c = hwkey();
        c.args(["csr", "--key", &uri(handle), "--subject", "CN=node"])
            .args(extra);
        c
    };
    fails_with(
        &mut csr("0x81000300", &[]),
        &["fixedTPM is clear", "--require-non-extractable=false"],
    );
    let pem = stdout(&run_ok(&mut csr(
        "0x81000300",
        &["--require-non-extractable=false"],
    )));
    assert!(pem.contains("BEGIN CERTIFICATE REQUEST"), "{pem}");
    // The same key made with fixedTPM passes.
    let pem = stdout(&run_ok(&mut csr("0x81000301", &[])));
    assert!(pem.contains("BEGIN CERTIFICATE REQUEST"), "{pem}");
    let info = stdout(&run_ok(hwkey().args([
        "key",
        "info",
        "--key",
        &uri("0x81000300"),
    ])));
    assert!(
        info.contains("fixedTPM: false") && info.contains("extractable: YES"),
        "{info}"
    );
}
