//! A TPM set up by other tools (issue 24, item 2): an owner-hierarchy password set with
//! `tpm2_changeauth -c owner`, and storage keys another tool made persistent. hwkey takes the
//! owner password from `owner-pin-source=`, makes keys under a persistent SRK with `parent=`,
//! and never changes a persistent handle it did not make: a handle that holds the wrong kind
//! of key, or a storage key other than a key file's, is said as such.

use std::path::Path;
use std::process::{Command, Output};

use support::*;

fn hwkey_on(tpm: &Swtpm, args: &[&str]) -> Output {
    hwkey()
        .envs(tpm.envs())
        .args(args)
        .output()
        .expect("run hwkey")
}

fn fails_with(out: &Output, needles: &[&str]) {
    let text = output_text(out);
    assert!(!out.status.success(), "succeeded: {text}");
    for n in needles {
        assert!(text.contains(n), "no '{n}' in: {text}");
    }
}

fn csr_verifies(tpm: &Swtpm, key: &str, dir: &Path) {
    let out = hwkey_on(tpm, &["csr", "--key", key, "--subject", "CN=h"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let path = dir.join("req.csr");
    std::fs::write(&path, &out.stdout).expect("write CSR");
    let verified = run_ok(
        Command::new("openssl")
            .args(["req", "-verify", "-noout", "-in"])
            .arg(&path),
    );
    assert!(output_text(&verified).contains("verify OK"));
}

/// `tpm2_getcap handles-persistent`, as text.
fn persistent_handles(tpm: &Swtpm) -> String {
    output_text(&run_ok(
        Command::new("tpm2_getcap")
            .envs(tpm.envs())
            .arg("handles-persistent"),
    ))
}

/// The name of the object at a persistent handle (changes if the object is replaced).
fn name_at(tpm: &Swtpm, handle: &str) -> String {
    let out = run_ok(
        Command::new("tpm2_readpublic")
            .envs(tpm.envs())
            .args(["-c", handle]),
    );
    output_text(&out)
        .lines()
        .find(|l| l.starts_with("name:"))
        .unwrap_or_else(|| panic!("no name in {}", output_text(&out)))
        .to_string()
}

#[test]
fn an_owner_password_is_taken_from_owner_pin_source() {
    require_tool("tpm2_changeauth", "tpm2-tools");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    run_ok(
        Command::new("tpm2_changeauth")
            .envs(tpm.envs())
            .args(["-c", "owner", "owner secret"]),
    );
    let key_path = dir.path().join("k.tpm.pem");
    let bare = format!("tpm:path={}?tcti={}", key_path.display(), tpm.tcti());
    // Without the owner password: said in words, and nothing is written.
    fails_with(
        &hwkey_on(&tpm, &["key", "create", "--key", &bare]),
        &[
            "owner-hierarchy",
            "tpm2_changeauth -c owner",
            "owner-pin-source=",
        ],
    );
    assert!(!key_path.exists(), "a key file was left behind");
    // A wrong owner password: the same words. Hierarchy passwords are outside the TPM's
    // dictionary-attack protection: the lockout counter does not move.
    let before = lockout_counter(tpm.envs());
    let wrong = dir.path().join("wrong");
    write_private(&wrong, b"not the owner");
    let with_wrong = format!("{bare}&owner-pin-source=file:{}", wrong.display());
    fails_with(
        &hwkey_on(&tpm, &["key", "create", "--key", &with_wrong]),
        &["owner-hierarchy", "owner-pin-source="],
    );
    assert!(!key_path.exists());
    assert_eq!(lockout_counter(tpm.envs()), before);

    let owner = dir.path().join("owner");
    write_private(&owner, b"owner secret");
    let key = format!("{bare}&owner-pin-source=file:{}", owner.display());
    run_ok(
        hwkey()
            .envs(tpm.envs())
            .args(["key", "create", "--key", &key]),
    );
    // Loading the key file needs the storage key again, so the owner password too.
    csr_verifies(&tpm, &key, dir.path());
    fails_with(
        &hwkey_on(&tpm, &["csr", "--key", &bare, "--subject", "CN=h"]),
        &["owner-pin-source="],
    );
    // From the environment, too.
    let from_env = format!("{bare}&owner-pin-source=env:OWNER_PW");
    let out = hwkey()
        .envs(tpm.envs())
        .env("OWNER_PW", "owner secret")
        .args(["csr", "--key", &from_env, "--subject", "CN=h"])
        .output()
        .expect("hwkey");
    assert!(out.status.success(), "{}", output_text(&out));
    // A persistent key: EvictControl is the owner's too.
    let handle = format!(
        "tpm:handle=0x81000123?tcti={}&owner-pin-source=file:{}",
        tpm.tcti(),
        owner.display()
    );
    run_ok(
        hwkey()
            .envs(tpm.envs())
            .args(["key", "create", "--key", &handle]),
    );
    run_ok(
        hwkey()
            .envs(tpm.envs())
            .args(["key", "delete", "--yes", "--key", &handle]),
    );
}

#[test]
fn keys_are_made_under_a_persistent_srk_and_foreign_handles_are_never_changed() {
    let tpm = Swtpm::start();
    let dir = temp_dir();
    // An SRK another tool made persistent, and a signing key beside it.
    tpm.tool(
        dir.path(),
        &[
            "tpm2_createprimary",
            "-C",
            "o",
            "-G",
            "rsa2048",
            "-c",
            "srk.ctx",
        ],
    );
    tpm.tool(
        dir.path(),
        &[
            "tpm2_evictcontrol",
            "-C",
            "o",
            "-c",
            "srk.ctx",
            "0x81000001",
        ],
    );
    tpm.tool(
        dir.path(),
        &[
            "tpm2_createprimary",
            "-C",
            "o",
            "-G",
            "ecc256:ecdsa",
            "-a",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
            "-c",
            "sig.ctx",
        ],
    );
    tpm.tool(
        dir.path(),
        &[
            "tpm2_evictcontrol",
            "-C",
            "o",
            "-c",
            "sig.ctx",
            "0x81000002",
        ],
    );
    let srk_name = name_at(&tpm, "0x81000001");
    let signer_name = name_at(&tpm, "0x81000002");

    let key_path = dir.path().join("k.tpm.pem");
    let under = |parent: &str| {
        format!(
            "tpm:path={}?tcti={}&parent={parent}",
            key_path.display(),
            tpm.tcti()
        )
    };
    // A signing key is no parent; an empty handle neither. Nothing is written or changed.
    fails_with(
        &hwkey_on(&tpm, &["key", "create", "--key", &under("0x81000002")]),
        &["0x81000002", "not a storage key", "never changes"],
    );
    fails_with(
        &hwkey_on(&tpm, &["key", "create", "--key", &under("0x81000003")]),
        &["0x81000003", "holds no object", "0x81000001, 0x81000002"],
    );
    assert!(!key_path.exists());
    // A persistent key is never made over a taken handle.
    let taken = format!("tpm:handle=0x81000001?tcti={}", tpm.tcti());
    fails_with(
        &hwkey_on(&tpm, &["key", "create", "--key", &taken]),
        &["0x81000001"],
    );

    // Under the SRK: the file names it as its parent, and the key signs.
    let key = under("0x81000001");
    run_ok(
        hwkey()
            .envs(tpm.envs())
            .args(["key", "create", "--key", &key]),
    );
    let plain = format!("tpm:path={}?tcti={}", key_path.display(), tpm.tcti());
    csr_verifies(&tpm, &plain, dir.path());
    let der = pem::parse(std::fs::read(&key_path).expect("key file"))
        .expect("PEM")
        .into_contents();
    assert!(
        der.windows(7)
            .any(|w| w == [0x02, 0x05, 0x00, 0x81, 0x00, 0x00, 0x01]),
        "the key file does not name parent 0x81000001"
    );

    // Another tool replaces the SRK with one of another template: the key file's blob no
    // longer loads, and hwkey says why instead of a TPM code.
    tpm.tool(
        dir.path(),
        &["tpm2_evictcontrol", "-C", "o", "-c", "0x81000001"],
    );
    tpm.tool(
        dir.path(),
        &[
            "tpm2_createprimary",
            "-C",
            "o",
            "-G",
            "ecc256",
            "-c",
            "srk2.ctx",
        ],
    );
    tpm.tool(
        dir.path(),
        &[
            "tpm2_evictcontrol",
            "-C",
            "o",
            "-c",
            "srk2.ctx",
            "0x81000001",
        ],
    );
    let new_srk_name = name_at(&tpm, "0x81000001");
    assert_ne!(new_srk_name, srk_name);
    fails_with(
        &hwkey_on(&tpm, &["csr", "--key", &plain, "--subject", "CN=h"]),
        &[
            "0x81000001",
            "other than the one this key file was made under",
        ],
    );
    // Every persistent handle is as the other tools left it.
    assert_eq!(name_at(&tpm, "0x81000001"), new_srk_name);
    assert_eq!(name_at(&tpm, "0x81000002"), signer_name);
    let handles = persistent_handles(&tpm);
    assert!(
        handles.contains("0x81000001") && handles.contains("0x81000002"),
        "{handles}"
    );
}
