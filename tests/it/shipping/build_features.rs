//! The backends as Cargo features: what a single-backend build links, and what it says when it
//! is given a key of the backend it lacks. These run in every feature set CI builds (default,
//! `--no-default-features --features pkcs11`, `--no-default-features --features tpm`).

use std::process::Command;

use support::{hwkey_bin, output_text, run_ok};

/// The shared libraries the hwkey binary under test is linked against (`ldd`).
fn linked_libraries() -> String {
    output_text(&run_ok(Command::new("ldd").arg(hwkey_bin())))
}

/// The exec plugin binary that kubeconfigs run starts fast because it links neither the TSS
/// nor OpenSSL, in every feature set (docs/BENCHMARKS.md: 5.5 ms of start-up CPU for the full
/// binary, under 1 ms for this one).
#[test]
fn the_exec_plugin_binary_links_neither_the_tss_nor_openssl() {
    let plugin = hwkey_bin().with_file_name("hwkey-credential");
    let libs = output_text(&run_ok(Command::new("ldd").arg(&plugin)));
    assert!(!libs.contains("libtss2"), "{libs}");
    assert!(!libs.contains("libcrypto"), "{libs}");
    let version = output_text(&run_ok(Command::new(&plugin).arg("--version")));
    assert!(version.starts_with("hwkey-credential "), "{version}");
}

#[cfg(feature = "tpm")]
#[test]
fn a_build_with_the_tpm_backend_links_the_tss2_libraries() {
    // The counterpart of the PKCS#11-only check: proves `ldd` sees the TSS2 libraries when
    // they are linked, so their absence below means something.
    let libs = linked_libraries();
    assert!(libs.contains("libtss2-esys"), "{libs}");
}

#[cfg(not(feature = "tpm"))]
#[test]
fn a_pkcs11_only_build_links_no_tss2_library() {
    let libs = linked_libraries();
    assert!(
        !libs.contains("libtss2"),
        "the PKCS#11-only build links TSS2:\n{libs}"
    );
}

#[cfg(not(feature = "tpm"))]
#[test]
fn a_pkcs11_only_build_names_the_feature_for_a_tpm_key() {
    support::flow::fails_with(
        support::hwkey().args(["key", "public", "--key", "tpm:path=/nonexistent/key.pem"]),
        &["built without the TPM 2.0 backend", "--features tpm"],
    );
}

#[cfg(not(feature = "pkcs11"))]
#[test]
fn a_tpm_only_build_names_the_feature_for_a_pkcs11_key() {
    support::flow::fails_with(
        support::hwkey().args([
            "key",
            "public",
            "--key",
            "pkcs11:token=t;object=k?module-path=/usr/lib/softhsm/libsofthsm2.so",
        ]),
        &["built without the PKCS#11 backend", "--features pkcs11"],
    );
}
