//! The key layer's contract, one suite run on both backends (like the proxy suites): whatever
//! the device, a key signs every scheme of its algorithm with signatures ring verifies (or the
//! backend refuses the algorithm in words that name another), signs
//! from several threads at once, is the same key when opened again from its URI, and fails in
//! words that name it, leaving it as it was (library and CLI alike).
//!
//! PKCS#11 runs on the in-process SoftHSM of `pkcs11_key` (SoftHSM reads its configuration once
//! per process), each test with its own labels; the TPM on a swtpm of the test's own.

use std::sync::Arc;

use hwkey::key::{CapabilityError, LocateError};
use hwkey::key::{Key, KeyAlgorithm, KeyError, KeyUri, SignScheme};
use support::hwkey;
#[cfg(feature = "tpm")]
use support::{temp_dir, Swtpm};

/// Instantiates each contract test once per backend built.
macro_rules! key_contract_on_both_backends {
    ($($name:ident),* $(,)?) => {
        #[cfg(feature = "pkcs11")]
        mod softhsm {
            $(#[test] fn $name() { super::$name(super::Device::softhsm(stringify!($name))) })*
        }
        #[cfg(feature = "tpm")]
        mod tpm {
            $(#[test] fn $name() { super::$name(super::Device::tpm()) })*
        }
    };
}

key_contract_on_both_backends!(
    every_scheme_of_every_algorithm_verifies,
    four_threads_sign_400_times_on_one_key,
    a_key_opened_again_is_the_same_key,
    errors_name_the_key_and_change_nothing,
    the_cli_refuses_to_overwrite_a_key_and_names_it,
);

/// The contract tests that run `hwkey` processes on their device ([`Device::softhsm`]).
#[cfg(feature = "pkcs11")]
const CLI_TESTS: [&str; 1] = ["the_cli_refuses_to_overwrite_a_key_and_names_it"];

/// Where a test's keys live.
enum Device {
    /// A token of the shared in-process SoftHSM; labels are prefixed with the test's name.
    #[cfg(feature = "pkcs11")]
    SoftHsm { token: &'static str, prefix: String },
    /// A swtpm of this test; key files in `dir`.
    #[cfg(feature = "tpm")]
    Tpm { tpm: Swtpm, dir: tempfile::TempDir },
}

impl Device {
    /// A test that runs `hwkey` on its token gets a token of its own: SoftHSM keeps no
    /// transaction across processes, and another process using the token while this one
    /// generates keys on it fails reads and generations now and then (seen with a
    /// `hwkey key create` loop beside creations in this process).
    #[cfg(feature = "pkcs11")]
    fn softhsm(test: &str) -> Device {
        let runs_hwkey = CLI_TESTS.contains(&test);
        Device::SoftHsm {
            token: if runs_hwkey {
                "contract-cli"
            } else {
                "contract"
            },
            prefix: test.chars().take(24).collect(),
        }
    }

    #[cfg(feature = "tpm")]
    fn tpm() -> Device {
        Device::Tpm {
            tpm: Swtpm::start(),
            dir: temp_dir(),
        }
    }

    /// The URI of key `name` on this device (it need not exist).
    fn uri(&self, name: &str) -> KeyUri {
        self.uri_text(name).parse().expect("the URI parses")
    }

    fn uri_text(&self, name: &str) -> String {
        match self {
            #[cfg(feature = "pkcs11")]
            Device::SoftHsm { token, prefix } => {
                crate::key::pkcs11::hsm().key_uri(token, &format!("{prefix}-{name}"))
            }
            #[cfg(feature = "tpm")]
            Device::Tpm { tpm, dir } => format!(
                "tpm:path={}?tcti={}",
                dir.path().join(format!("{name}.pem")).display(),
                tpm.tcti()
            ),
        }
    }

    /// The environment a `hwkey` process needs to reach this device.
    fn envs(&self) -> Vec<(String, String)> {
        match self {
            #[cfg(feature = "pkcs11")]
            Device::SoftHsm { .. } => crate::key::pkcs11::hsm().envs(),
            #[cfg(feature = "tpm")]
            Device::Tpm { .. } => Vec::new(),
        }
    }
}

/// Verifies with ring against the key's SPKI.
fn verify(key: &Key, scheme: SignScheme, message: &[u8], signature: &[u8]) {
    assert!(
        hwkey::key::verify::verify_signature(key.spki_der(), scheme, message, signature)
            .expect("the key's SPKI parses"),
        "{}: the {scheme} signature does not verify with ring",
        key.describe()
    );
}

fn every_scheme_of_every_algorithm_verifies(device: Device) {
    for (name, alg) in [
        ("p256", KeyAlgorithm::EcP256),
        ("p384", KeyAlgorithm::EcP384),
        ("rsa2048", KeyAlgorithm::Rsa { bits: 2048 }),
        ("rsa3072", KeyAlgorithm::Rsa { bits: 3072 }),
    ] {
        let key = match Key::create(&device.uri(name), alg) {
            Ok(key) => key,
            // A backend that does not make this algorithm says so, naming one it makes (the
            // TPM backend makes no RSA-3072: TPMs need only implement RSA-2048).
            Err(KeyError::Capability(CapabilityError::UnsupportedAlgorithm { hint, .. }))
                if alg != KeyAlgorithm::EcP256 =>
            {
                assert!(hint.contains("ec-p256"), "no way out named: {hint}");
                continue;
            }
            Err(e) => panic!("cannot create {alg}: {e}"),
        };
        assert_eq!(key.algorithm(), alg);
        assert!(!key.schemes().is_empty(), "{alg} offers no scheme");
        for scheme in key.schemes() {
            let message = format!("contract message for {scheme}");
            let sig = key
                .sign(scheme, message.as_bytes())
                .unwrap_or_else(|e| panic!("{} cannot sign {scheme}: {e}", key.describe()));
            verify(&key, scheme, message.as_bytes(), &sig);
        }
        // A scheme of another algorithm is refused before reaching the device, uncounted.
        let before = key.signatures();
        let foreign = if alg.is_ec() {
            SignScheme::RsaPssSha256
        } else {
            SignScheme::EcdsaP256Sha256
        };
        assert!(matches!(
            key.sign(foreign, b"x"),
            Err(KeyError::Capability(
                CapabilityError::UnsupportedScheme { .. }
            ))
        ));
        assert_eq!(key.signatures(), before);
    }
}

fn four_threads_sign_400_times_on_one_key(device: Device) {
    let key = Arc::new(Key::create(&device.uri("threads"), KeyAlgorithm::EcP256).expect("create"));
    let signed: Vec<(String, Vec<u8>)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let key = Arc::clone(&key);
                s.spawn(move || {
                    (0..100)
                        .map(|i| {
                            let message = format!("thread {t} message {i}");
                            let sig = key
                                .sign(SignScheme::EcdsaP256Sha256, message.as_bytes())
                                .expect("sign");
                            (message, sig)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().expect("signing thread"))
            .collect()
    });
    for (message, sig) in &signed {
        verify(&key, SignScheme::EcdsaP256Sha256, message.as_bytes(), sig);
    }
    assert_eq!(signed.len(), 400);
    assert_eq!(key.signatures(), 400, "every signature made and counted");
}

fn a_key_opened_again_is_the_same_key(device: Device) {
    let uri = device.uri("again");
    let spki = {
        let key = Key::create(&uri, KeyAlgorithm::EcP384).expect("create");
        key.spki_der().to_vec()
    };
    let again = Key::open(&uri).expect("open from the URI alone");
    assert_eq!(again.spki_der(), &spki[..], "another public key");
    assert_eq!(again.algorithm(), KeyAlgorithm::EcP384);
    let sig = again
        .sign(SignScheme::EcdsaP384Sha384, b"again")
        .expect("sign");
    verify(&again, SignScheme::EcdsaP384Sha384, b"again", &sig);
}

fn errors_name_the_key_and_change_nothing(device: Device) {
    // A key that is not there: KeyNotFound naming what was asked for.
    let missing = device.uri("missing");
    match Key::open(&missing) {
        Err(KeyError::Locate(LocateError::KeyNotFound { what, .. })) => {
            assert!(what.contains("missing"), "the error names the key: {what}")
        }
        Err(KeyError::Io { path, .. }) => assert!(path.ends_with("missing.pem"), "{path:?}"),
        Err(other) => panic!("expected KeyNotFound, got {other}"),
        Ok(_) => panic!("opened a key that does not exist"),
    }
    // Creating over an existing key: KeyExists, and the key is the one it was.
    let uri = device.uri("taken");
    let spki = Key::create(&uri, KeyAlgorithm::EcP256)
        .expect("create")
        .spki_der()
        .to_vec();
    match Key::create(&uri, KeyAlgorithm::EcP256) {
        Err(KeyError::Locate(LocateError::KeyExists { what, .. })) => {
            assert!(what.contains("taken"), "{what}")
        }
        Err(other) => panic!("expected KeyExists, got {other}"),
        Ok(_) => panic!("created a second key over the first"),
    }
    let key = Key::open(&uri).expect("the first key is still there");
    assert_eq!(key.spki_der(), &spki[..], "the key was replaced");
}

fn the_cli_refuses_to_overwrite_a_key_and_names_it(device: Device) {
    let uri = device.uri_text("cli");
    // Dropped at once: swtpm serves one connection at a time, and this process's stays open
    // while a key is.
    let spki = Key::create(&device.uri("cli"), KeyAlgorithm::EcP256)
        .expect("create")
        .spki_der()
        .to_vec();
    let out = hwkey()
        .envs(device.envs())
        .args(["key", "create", "--key", &uri, "--algorithm", "ec-p256"])
        .output()
        .expect("run hwkey");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second key was created: {stderr}");
    assert!(out.stdout.is_empty(), "no public key is printed on failure");
    assert!(
        stderr.contains("already exists") && stderr.contains("cli"),
        "the message names the key and the problem: {stderr}"
    );
    assert!(
        stderr.contains("hwkey key delete"),
        "the message says how to fix it: {stderr}"
    );
    let key = Key::open(&device.uri("cli")).expect("the first key is still there");
    assert_eq!(key.spki_der(), &spki[..], "the key was replaced");
}
