//! The TPM backend against a real swtpm (one per test), tpm2-tools and tpm2-openssl. No mocks.
//! What every backend must do (every scheme verifies, threads, errors) is `key_contract`, run on
//! a swtpm and on a SoftHSM token; this file holds what only a TPM has (key files, handles,
//! object attributes, resets).
//!
//! swtpm serves one TCP connection at a time, and hwkey keeps its connection open while a key is
//! open: every test drops its keys before running tpm2-tools or openssl on the same swtpm.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use hwkey::key::{der, Key, KeyAlgorithm, KeyError, KeyUri, SignScheme};
use hwkey::key::{CapabilityError, DeviceError, LocateError};
use support::{require_tool, run_ok, temp_dir, Swtpm};

fn file_uri(path: &Path, tpm: &Swtpm) -> KeyUri {
    format!("tpm:path={}?tcti={}", path.display(), tpm.tcti())
        .parse()
        .expect("file URI parses")
}

fn handle_uri(handle: u32, tpm: &Swtpm) -> KeyUri {
    format!("tpm:handle={handle:#010x}?tcti={}", tpm.tcti())
        .parse()
        .expect("handle URI parses")
}

fn tpm_uri(tpm: &Swtpm) -> KeyUri {
    format!("tpm:?tcti={}", tpm.tcti())
        .parse()
        .expect("TPM URI parses")
}

/// Verifies with ring against `spki`.
fn verify(spki: &[u8], scheme: SignScheme, message: &[u8], signature: &[u8]) {
    assert!(
        hwkey::key::verify::verify_signature(spki, scheme, message, signature)
            .expect("the key's SPKI parses"),
        "{scheme} signature does not verify with ring"
    );
}

/// Signs with every scheme the key offers and verifies each signature.
fn sign_every_scheme(key: &Key) {
    let schemes = key.algorithm().schemes();
    assert!(!schemes.is_empty());
    for &scheme in schemes {
        let message = format!("hwkey TPM test message for {scheme}");
        let sig = key
            .sign(scheme, message.as_bytes())
            .unwrap_or_else(|e| panic!("{} cannot sign {scheme}: {e}", key.describe()));
        verify(key.spki_der(), scheme, message.as_bytes(), &sig);
    }
}

/// The `objectAttributes` of a TSS2 key file, read straight from its DER (independently of
/// hwkey's own parser): SEQUENCE { OID, [0] BOOLEAN, INTEGER, OCTET STRING pub, OCTET STRING priv }.
fn file_attributes(path: &Path) -> u32 {
    let text = fs::read_to_string(path).expect("read key file");
    let block = pem::parse(text).expect("key file is PEM");
    assert_eq!(block.tag(), "TSS2 PRIVATE KEY");
    let (parent, public) = yasna::parse_der(block.contents(), |r| {
        r.read_sequence(|r| {
            let oid = r.next().read_oid()?;
            assert_eq!(oid.to_string(), "2.23.133.10.1.3");
            let empty_auth = r
                .next()
                .read_tagged(yasna::Tag::context(0), |r| r.read_bool())?;
            assert!(empty_auth, "emptyAuth TRUE");
            let parent = r.next().read_u32()?;
            let public = r.next().read_bytes()?;
            let _private = r.next().read_bytes()?;
            Ok((parent, public))
        })
    })
    .expect("TSS2 key structure");
    assert_eq!(parent, 0x4000_0001, "parent is the owner hierarchy");
    // TPM2B_PUBLIC: size u16, type u16, nameAlg u16, objectAttributes u32.
    assert_eq!(
        usize::from(u16::from_be_bytes([public[0], public[1]])),
        public.len() - 2
    );
    u32::from_be_bytes([public[6], public[7], public[8], public[9]])
}

const FIXED_TPM: u32 = 1 << 1;
const FIXED_PARENT: u32 = 1 << 4;
const SENSITIVE_DATA_ORIGIN: u32 = 1 << 5;
const USER_WITH_AUTH: u32 = 1 << 6;
const RESTRICTED: u32 = 1 << 16;
const SIGN: u32 = 1 << 18;

fn assert_key_file_mode(path: &Path) {
    let mode = fs::metadata(path).expect("stat key").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{} has mode {mode:o}", path.display());
}

#[test]
fn file_keys_sign_every_scheme_and_reopen() {
    let tpm = Swtpm::start();
    let dir = temp_dir();
    for (name, alg) in [
        ("p256.pem", KeyAlgorithm::EcP256),
        ("p384.pem", KeyAlgorithm::EcP384),
        ("rsa.pem", KeyAlgorithm::Rsa { bits: 2048 }),
    ] {
        let path = dir.path().join(name);
        let uri = file_uri(&path, &tpm);
        let spki = {
            let key = Key::create(&uri, alg).expect("create file key");
            assert_eq!(key.algorithm(), alg);
            sign_every_scheme(&key);
            key.spki_der().to_vec()
        };
        assert_key_file_mode(&path);
        let attrs = file_attributes(&path);
        for (bit, name) in [
            (FIXED_TPM, "fixedTPM"),
            (FIXED_PARENT, "fixedParent"),
            (SENSITIVE_DATA_ORIGIN, "sensitiveDataOrigin"),
            (USER_WITH_AUTH, "userWithAuth"),
            (SIGN, "sign"),
        ] {
            assert_ne!(
                attrs & bit,
                0,
                "{name} is set on {alg} (attributes {attrs:#x})"
            );
        }
        assert_eq!(attrs & RESTRICTED, 0, "not restricted");

        // A new Key from the URI alone: same public key, signs again.
        let again = Key::open(&uri).expect("reopen file key");
        assert_eq!(again.spki_der(), &spki[..]);
        assert_eq!(again.algorithm(), alg);
        sign_every_scheme(&again);
        assert!(again.describe().contains(name), "{}", again.describe());
    }
}

#[test]
fn handle_keys_sign_every_scheme_and_reopen() {
    require_tool("tpm2_readpublic", "tpm2-tools");
    let tpm = Swtpm::start();
    for (handle, alg) in [
        (0x8100_0101, KeyAlgorithm::EcP256),
        (0x8100_0102, KeyAlgorithm::Rsa { bits: 2048 }),
    ] {
        let uri = handle_uri(handle, &tpm);
        let spki = {
            let key = Key::create(&uri, alg).expect("create persistent key");
            sign_every_scheme(&key);
            key.spki_der().to_vec()
        };
        let again = Key::open(&uri).expect("reopen persistent key");
        assert_eq!(again.spki_der(), &spki[..]);
        sign_every_scheme(&again);
        drop(again);

        // tpm2-tools sees the key's attributes (hwkey's connection is closed by now).
        let out = run_ok(
            Command::new("tpm2_readpublic")
                .envs(tpm.envs())
                .args(["-c", &format!("{handle:#010x}")]),
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let attrs = text
            .lines()
            .skip_while(|l| !l.starts_with("attributes:"))
            .nth(1)
            .unwrap_or_default()
            .to_string();
        for flag in ["fixedtpm", "fixedparent", "sensitivedataorigin", "sign"] {
            assert!(attrs.contains(flag), "{flag} missing: {attrs}");
        }
        assert!(!attrs.contains("restricted"), "{attrs}");
    }

    // Both keys are listed; neither has a place for a certificate.
    let listed = hwkey::key::list(&tpm_uri(&tpm)).expect("list TPM");
    let handles: Vec<String> = listed.iter().map(|l| l.uri.to_string()).collect();
    assert_eq!(listed.len(), 2, "{handles:?}");
    assert!(handles[0].contains("handle=0x81000101"), "{handles:?}");
    let err = hwkey::key::store_chain(&handle_uri(0x8100_0101, &tpm), &[vec![0x30, 0x00]])
        .expect_err("no chain for handles");
    assert!(
        matches!(
            err,
            KeyError::Capability(CapabilityError::TpmNoChainStore { .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--cert"), "{err}");

    // Creating over a taken handle changes nothing.
    let err = Key::create(&handle_uri(0x8100_0101, &tpm), KeyAlgorithm::EcP256)
        .expect_err("handle taken");
    assert!(
        matches!(err, KeyError::Locate(LocateError::KeyExists { .. })),
        "{err}"
    );
    let again = Key::open(&handle_uri(0x8100_0101, &tpm)).expect("still there");
    assert_eq!(again.algorithm(), KeyAlgorithm::EcP256);
    drop(again);

    // Delete evicts; then the key is gone.
    let removed = hwkey::key::delete(&handle_uri(0x8100_0102, &tpm)).expect("evict");
    assert_eq!(removed.len(), 1, "{removed:?}");
    let err = Key::open(&handle_uri(0x8100_0102, &tpm)).expect_err("evicted");
    match &err {
        KeyError::Locate(LocateError::KeyNotFound { present, .. }) => {
            assert_eq!(present, &vec!["0x81000101".to_string()], "{err}")
        }
        other => panic!("expected KeyNotFound, got {other}"),
    }
}

/// A sign-only RSA key made by tpm2-tools signs PSS through TPM2_Sign RSAPSS, where swtpm picks
/// the salt length; ring's RSA_PSS_2048_8192_SHA256 (salt = hash length, as TLS 1.3) must accept
/// it. Also: hwkey refuses to evict a persistent storage key.
#[test]
fn swtpm_pss_signatures_verify_with_ring_and_storage_keys_are_not_deleted() {
    require_tool("tpm2_create", "tpm2-tools");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let d = dir.path();
    let tool = |args: &[&str]| tpm.tool(d, args);
    tpm.create_primary(d, "primary.ctx");
    tool(&[
        "tpm2_create",
        "-C",
        "primary.ctx",
        "-G",
        "rsa2048:null:null",
        "-a",
        "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
        "-u",
        "k.pub",
        "-r",
        "k.priv",
    ]);
    tool(&[
        "tpm2_load",
        "-C",
        "primary.ctx",
        "-u",
        "k.pub",
        "-r",
        "k.priv",
        "-c",
        "k.ctx",
    ]);
    tool(&["tpm2_evictcontrol", "-C", "o", "-c", "k.ctx", "0x81000200"]);
    tool(&[
        "tpm2_evictcontrol",
        "-C",
        "o",
        "-c",
        "primary.ctx",
        "0x81000201",
    ]);

    {
        let key = Key::open(&handle_uri(0x8100_0200, &tpm)).expect("open tpm2-tools key");
        assert_eq!(key.algorithm(), KeyAlgorithm::Rsa { bits: 2048 });
        for scheme in [
            SignScheme::RsaPssSha256,
            SignScheme::RsaPssSha384,
            SignScheme::RsaPssSha512,
        ] {
            for i in 0..5 {
                let message = format!("pss message {i}");
                let sig = key
                    .sign(scheme, message.as_bytes())
                    .unwrap_or_else(|e| panic!("swtpm PSS signature: {e}"));
                verify(key.spki_der(), scheme, message.as_bytes(), &sig);
            }
        }
    }

    let err = Key::open(&handle_uri(0x8100_0201, &tpm)).expect_err("a storage key");
    assert!(
        matches!(err, KeyError::Device(DeviceError::TpmKeyUnusable { .. })),
        "{err}"
    );
    let err = hwkey::key::delete(&handle_uri(0x8100_0201, &tpm)).expect_err("storage key kept");
    assert!(
        matches!(err, KeyError::Device(DeviceError::TpmKeyUnusable { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("tpm2_evictcontrol"), "{err}");
    let listed = hwkey::key::list(&tpm_uri(&tpm)).expect("list");
    assert_eq!(
        listed.len(),
        1,
        "only the signing key is listed: {listed:?}"
    );
}

#[test]
fn openssl_signs_with_a_key_file_made_by_hwkey() {
    require_tool("openssl", "openssl");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let key_path = dir.path().join("key.pem");
    let spki = {
        let key = Key::create(&file_uri(&key_path, &tpm), KeyAlgorithm::EcP256).expect("create");
        key.spki_der().to_vec()
    };
    let pub_path = dir.path().join("pub.pem");
    fs::write(&pub_path, der::to_pem("PUBLIC KEY", &spki)).expect("write pub");
    let message = b"signed by tpm2-openssl with a key hwkey made";
    let digest = ring::digest::digest(&ring::digest::SHA256, message);
    let dgst_path = dir.path().join("dgst.bin");
    fs::write(&dgst_path, digest.as_ref()).expect("write digest");
    let sig_path = dir.path().join("sig.bin");

    run_ok(
        Command::new("openssl")
            .env("TPM2OPENSSL_TCTI", tpm.tcti())
            .args([
                "pkeyutl",
                "-provider",
                "tpm2",
                "-provider",
                "default",
                "-sign",
            ])
            .arg("-inkey")
            .arg(&key_path)
            .arg("-in")
            .arg(&dgst_path)
            .arg("-out")
            .arg(&sig_path),
    );
    let out = run_ok(
        Command::new("openssl")
            .args(["pkeyutl", "-verify", "-pubin"])
            .arg("-inkey")
            .arg(&pub_path)
            .arg("-in")
            .arg(&dgst_path)
            .arg("-sigfile")
            .arg(&sig_path),
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("Signature Verified Successfully"),
        "{}",
        support::output_text(&out)
    );
    let sig = fs::read(&sig_path).expect("read signature");
    verify(&spki, SignScheme::EcdsaP256Sha256, message, &sig);

    // And hwkey still opens the file afterwards.
    let key = Key::open(&file_uri(&key_path, &tpm)).expect("reopen");
    sign_every_scheme(&key);
}

#[test]
fn hwkey_signs_with_key_files_made_by_openssl() {
    require_tool("openssl", "openssl");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    for (name, genpkey_args, alg) in [
        (
            "ec.pem",
            &["-algorithm", "EC", "-pkeyopt", "group:P-256"][..],
            KeyAlgorithm::EcP256,
        ),
        (
            "rsa.pem",
            &["-algorithm", "RSA", "-pkeyopt", "bits:2048"][..],
            KeyAlgorithm::Rsa { bits: 2048 },
        ),
    ] {
        let path = dir.path().join(name);
        run_ok(
            Command::new("openssl")
                .env("TPM2OPENSSL_TCTI", tpm.tcti())
                .args(["genpkey", "-provider", "tpm2"])
                .args(genpkey_args)
                .arg("-out")
                .arg(&path),
        );
        let out = run_ok(
            Command::new("openssl")
                .env("TPM2OPENSSL_TCTI", tpm.tcti())
                .args([
                    "pkey",
                    "-provider",
                    "tpm2",
                    "-provider",
                    "default",
                    "-pubout",
                ])
                .args(["-outform", "DER", "-in"])
                .arg(&path),
        );
        let openssl_spki = out.stdout;

        let key = Key::open(&file_uri(&path, &tpm)).expect("open an openssl-made key");
        assert_eq!(key.algorithm(), alg);
        assert_eq!(
            key.spki_der(),
            &openssl_spki[..],
            "same public key as openssl sees"
        );
        sign_every_scheme(&key);
    }
}

#[test]
fn errors_name_the_problem_and_change_nothing() {
    let tpm = Swtpm::start();
    let dir = temp_dir();

    // Unreachable TCTI: nothing listens on a free port.
    let dead = format!("swtpm:host=127.0.0.1,port={}", support::free_port());
    let uri: KeyUri = format!("tpm:handle=0x81000101?tcti={dead}")
        .parse()
        .expect("uri");
    match Key::open(&uri).expect_err("no TPM there") {
        KeyError::Device(DeviceError::TpmConnect { tcti, .. }) => assert_eq!(tcti, dead),
        other => panic!("expected TpmConnect, got {other}"),
    }
    let uri: KeyUri = format!("tpm:?tcti={dead}").parse().expect("uri");
    let err = hwkey::key::list(&uri).expect_err("no TPM there");
    assert!(
        matches!(err, KeyError::Device(DeviceError::TpmConnect { .. })),
        "{err}"
    );
    assert!(err.to_string().contains(&dead), "{err}");
    let uri: KeyUri = "tpm:?tcti=bogus:whatever".parse().expect("uri");
    let err = hwkey::key::list(&uri).expect_err("unknown TCTI");
    assert!(
        matches!(err, KeyError::Device(DeviceError::TpmConnect { .. })),
        "{err}"
    );

    // A corrupt TSS2 file: Tss2Pem naming the path, the file untouched.
    let good = dir.path().join("good.pem");
    drop(Key::create(&file_uri(&good, &tpm), KeyAlgorithm::EcP256).expect("create"));
    let good_bytes = fs::read(&good).expect("read");
    let block = pem::parse(&good_bytes).expect("pem");
    let truncated = pem::encode(&pem::Pem::new(
        "TSS2 PRIVATE KEY",
        block.contents()[..block.contents().len() - 20].to_vec(),
    ));
    for (name, contents) in [
        ("truncated.pem", truncated.into_bytes()),
        (
            "garbage.pem",
            b"-----BEGIN TSS2 PRIVATE KEY-----\nAAAA\n-----END TSS2 PRIVATE KEY-----\n".to_vec(),
        ),
        ("notpem.pem", b"hello".to_vec()),
    ] {
        let path = dir.path().join(name);
        fs::write(&path, &contents).expect("write corrupt file");
        match Key::open(&file_uri(&path, &tpm)).expect_err("corrupt") {
            KeyError::Device(DeviceError::Tss2Pem { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected Tss2Pem for {name}, got {other}"),
        }
        assert_eq!(fs::read(&path).expect("read"), contents, "{name} unchanged");
    }
    // Deleting a file that is not a TSS2 key is refused.
    let err =
        hwkey::key::delete(&file_uri(&dir.path().join("notpem.pem"), &tpm)).expect_err("not a key");
    assert!(
        matches!(err, KeyError::Device(DeviceError::Tss2Pem { .. })),
        "{err}"
    );
    assert!(dir.path().join("notpem.pem").exists());

    // Creating over an existing file: KeyExists, the file byte-identical.
    let err =
        Key::create(&file_uri(&good, &tpm), KeyAlgorithm::Rsa { bits: 2048 }).expect_err("exists");
    assert!(
        matches!(err, KeyError::Locate(LocateError::KeyExists { .. })),
        "{err}"
    );
    assert_eq!(fs::read(&good).expect("read"), good_bytes);

    // A missing file: KeyNotFound, listing the key files that are there.
    let err = Key::open(&file_uri(&dir.path().join("missing.pem"), &tpm)).expect_err("missing");
    match &err {
        KeyError::Locate(LocateError::KeyNotFound { present, .. }) => {
            assert_eq!(present, &vec!["good.pem".to_string()], "{err}")
        }
        other => panic!("expected KeyNotFound, got {other}"),
    }

    // Algorithms a TPM key is never created with.
    for bits in [3072, 4096] {
        let err = Key::create(
            &file_uri(&dir.path().join("big.pem"), &tpm),
            KeyAlgorithm::Rsa { bits },
        )
        .expect_err("too big");
        assert!(
            matches!(
                err,
                KeyError::Capability(CapabilityError::UnsupportedAlgorithm { .. })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("ec-p256"), "{err}");
    }
    assert!(!dir.path().join("big.pem").exists());
}

#[test]
fn key_files_list_store_chains_and_delete() {
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let a = dir.path().join("a.pem");
    let b = dir.path().join("b.pem");
    drop(Key::create(&file_uri(&a, &tpm), KeyAlgorithm::EcP256).expect("a"));
    drop(Key::create(&file_uri(&b, &tpm), KeyAlgorithm::Rsa { bits: 2048 }).expect("b"));
    fs::write(dir.path().join("notes.txt"), "not a key").expect("junk");

    let ca = support::TestCa::new(dir.path());
    let chain = vec![ca.ca_der()];
    let stored = hwkey::key::store_chain(&file_uri(&a, &tpm), &chain).expect("store chain");
    let crt = dir.path().join("a.crt.pem");
    assert_eq!(Path::new(&stored), crt);
    assert_eq!(
        fs::metadata(&crt).expect("stat").permissions().mode() & 0o777,
        0o644
    );
    // Storing again replaces the chain.
    let chain2 = vec![ca.ca_der(), ca.ca_der()];
    hwkey::key::store_chain(&file_uri(&a, &tpm), &chain2).expect("replace chain");
    {
        let key = Key::open(&file_uri(&a, &tpm)).expect("open a");
        assert_eq!(key.stored_chain().expect("read chain"), Some(chain2));
    }

    let dir_uri: KeyUri = format!("tpm:path={}?tcti={}", dir.path().display(), tpm.tcti())
        .parse()
        .expect("dir uri");
    let listed = hwkey::key::list(&dir_uri).expect("list dir");
    let summary: Vec<(String, KeyAlgorithm, bool)> = listed
        .iter()
        .map(|l| (l.uri.to_string(), l.algorithm, l.has_certificate))
        .collect();
    assert_eq!(summary.len(), 2, "{summary:?}");
    assert!(
        summary[0].0.contains("a.pem") && summary[0].2,
        "{summary:?}"
    );
    assert_eq!(summary[0].1, KeyAlgorithm::EcP256);
    assert!(
        summary[1].0.contains("b.pem") && !summary[1].2,
        "{summary:?}"
    );
    assert_eq!(summary[1].1, KeyAlgorithm::Rsa { bits: 2048 });
    // A listed URI opens its key.
    drop(Key::open(&listed[1].uri).expect("open listed"));

    let removed = hwkey::key::delete(&file_uri(&a, &tpm)).expect("delete a");
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(!a.exists() && !crt.exists());
    assert_eq!(hwkey::key::list(&dir_uri).expect("list").len(), 1);
    let err = hwkey::key::delete(&file_uri(&a, &tpm)).expect_err("gone");
    assert!(
        matches!(err, KeyError::Locate(LocateError::KeyNotFound { .. })),
        "{err}"
    );
}

/// swtpm restarts (a TPM reset: the TCP connection breaks and transient objects are gone):
/// open keys reconnect, reload and keep signing.
#[test]
fn keys_survive_a_tpm_restart() {
    let mut tpm = Swtpm::start();
    let dir = temp_dir();
    let file_key = Key::create(
        &file_uri(&dir.path().join("k.pem"), &tpm),
        KeyAlgorithm::EcP256,
    )
    .expect("create file key");
    let handle_key = Key::create(
        &handle_uri(0x8100_0301, &tpm),
        KeyAlgorithm::Rsa { bits: 2048 },
    )
    .expect("create handle key");
    sign_every_scheme(&file_key);
    sign_every_scheme(&handle_key);

    tpm.restart();
    sign_every_scheme(&file_key);
    sign_every_scheme(&handle_key);

    // Twice, to be sure the second connection is as good as the first.
    tpm.restart();
    sign_every_scheme(&handle_key);
    sign_every_scheme(&file_key);
}
