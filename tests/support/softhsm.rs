//! A private SoftHSMv2 installation per test: its own config, token directory and PIN file.

use std::fs::{self};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tempfile::TempDir;

use crate::*;

/// The SoftHSMv2 PKCS#11 module installed by Debian's `softhsm2` package.
pub const SOFTHSM_MODULE: &str = "/usr/lib/softhsm/libsofthsm2.so";
/// Security-officer PIN of every token made by [`SoftHsm::init_token`].
pub const SO_PIN: &str = "12345678";
/// User PIN of every token made by [`SoftHsm::init_token`] (also in [`SoftHsm::pin_path`]).
pub const USER_PIN: &str = "1234";

/// A private SoftHSMv2 installation: its own softhsm2.conf, token directory and PIN file.
pub struct SoftHsm {
    conf: PathBuf,
    pin: PathBuf,
    dir: TempDir,
}

/// The directory of the process's one SoftHSM ([`SoftHsm::for_the_process`]).
static PROCESS_WIDE: std::sync::OnceLock<SoftHsm> = std::sync::OnceLock::new();

/// Removes [`PROCESS_WIDE`]'s directory; run by the C library's `exit`.
extern "C" fn remove_the_process_wide_directory() {
    if let Some(hsm) = PROCESS_WIDE.get() {
        let _ = fs::remove_dir_all(hsm.dir());
    }
}

impl Default for SoftHsm {
    fn default() -> SoftHsm {
        SoftHsm::new()
    }
}

impl SoftHsm {
    /// A new empty SoftHSM setup in a temp dir (config from softhsm-config/, PIN file written).
    pub fn new() -> SoftHsm {
        Self::with_config("")
    }

    /// The one SoftHSM of this process, made (and `init` run on it) at the first call, for
    /// tests of the library in this process: SoftHSM reads `SOFTHSM2_CONF` once, when the
    /// module is loaded. A static is never dropped, so its directory is removed when the
    /// process exits (`atexit`): a test run leaves nothing in the temporary directory.
    pub fn for_the_process(init: impl FnOnce(&SoftHsm)) -> &'static SoftHsm {
        PROCESS_WIDE.get_or_init(|| {
            let hsm = SoftHsm::new();
            println!("the process-wide SoftHSM is in {}", hsm.dir().display());
            init(&hsm);
            // SAFETY: atexit takes a plain function, called once at exit; it only reads a
            // OnceLock that is set before it is registered and removes files.
            let rc = unsafe { libc::atexit(remove_the_process_wide_directory) };
            assert_eq!(rc, 0, "atexit");
            hsm
        })
    }

    /// Like [`SoftHsm::new`] with `extra` lines appended to softhsm2.conf (e.g. a
    /// `slots.mechanisms = -…` filter that makes SoftHSM play a limited smart card).
    pub fn with_config(extra: &str) -> SoftHsm {
        require_tool("softhsm2-util", "softhsm2");
        softhsm_module();
        let dir = temp_dir();
        let tokens = dir.path().join("tokens");
        fs::create_dir(&tokens).expect("create token dir");
        let template = fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../softhsm-config/softhsm2.conf.template"
        ))
        .expect("read softhsm-config/softhsm2.conf.template");
        assert!(template.contains("@TOKENDIR@"), "template lacks @TOKENDIR@");
        let conf = dir.path().join("softhsm2.conf");
        fs::write(
            &conf,
            template.replace("@TOKENDIR@", tokens.to_str().expect("UTF-8 temp path"))
                + "\n"
                + extra
                + "\n",
        )
        .expect("write softhsm2.conf");
        let pin = dir.path().join("pin");
        write_private(&pin, USER_PIN.as_bytes());
        SoftHsm { conf, pin, dir }
    }

    /// Initializes a token named `label` in the next free slot (SO PIN [`SO_PIN`], user PIN [`USER_PIN`]).
    pub fn init_token(&self, label: &str) {
        run_ok(
            Command::new("softhsm2-util")
                .envs(self.envs())
                .args(["--init-token", "--free", "--label", label])
                .args(["--so-pin", SO_PIN, "--pin", USER_PIN]),
        );
    }

    /// The temp dir holding softhsm2.conf, tokens/ and pin.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Path of this setup's softhsm2.conf (the value for `SOFTHSM2_CONF`).
    pub fn conf_path(&self) -> PathBuf {
        self.conf.clone()
    }

    /// Path of the file holding the user PIN (mode 0600, no trailing newline).
    pub fn pin_path(&self) -> PathBuf {
        self.pin.clone()
    }

    /// Environment for processes using this SoftHSM: `SOFTHSM2_CONF`.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![(
            "SOFTHSM2_CONF".to_string(),
            self.conf.to_str().expect("UTF-8 path").to_string(),
        )]
    }

    /// `pkcs11:token=LABEL?module-path=...&pin-source=file:PIN` (RFC 7512 token URI).
    pub fn token_uri(&self, label: &str) -> String {
        format!(
            "pkcs11:token={label}?module-path={SOFTHSM_MODULE}&pin-source=file:{}",
            self.pin.display()
        )
    }

    /// `pkcs11:token=LABEL;object=OBJ?module-path=...&pin-source=file:PIN` (RFC 7512 key URI).
    pub fn key_uri(&self, label: &str, object: &str) -> String {
        format!(
            "pkcs11:token={label};object={object}?module-path={SOFTHSM_MODULE}&pin-source=file:{}",
            self.pin.display()
        )
    }

    /// Runs `pkcs11-tool --module libsofthsm2.so ARGS` with this setup's environment.
    pub fn pkcs11_tool(&self, args: &[&str]) -> Output {
        require_tool("pkcs11-tool", "opensc");
        Command::new("pkcs11-tool")
            .envs(self.envs())
            .arg("--module")
            .arg(SOFTHSM_MODULE)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run pkcs11-tool")
    }

    /// Makes a key pair labelled `object` on token `label` with pkcs11-tool (`key_type` e.g. `EC:prime256v1`, `rsa:2048`).
    pub fn pkcs11_keygen(&self, label: &str, object: &str, key_type: &str) -> Output {
        self.logged_in(
            label,
            "--keypairgen",
            &["--key-type", key_type, "--label", object],
        )
    }

    /// [`SoftHsm::pkcs11_keygen`] with `CKA_ID` `id_hex` (e.g. `01`).
    pub fn pkcs11_keygen_with_id(
        &self,
        label: &str,
        object: &str,
        key_type: &str,
        id_hex: &str,
    ) -> Output {
        self.logged_in(
            label,
            "--keypairgen",
            &["--key-type", key_type, "--label", object, "--id", id_hex],
        )
    }

    /// Writes the certificate `der` onto token `label` as an object labelled `object` with
    /// `CKA_ID` `id_hex`, with pkcs11-tool.
    pub fn write_certificate(&self, label: &str, der: &[u8], object: &str, id_hex: &str) -> Output {
        let dir = crate::temp_dir();
        let path = dir.path().join("certificate.der");
        std::fs::write(&path, der).expect("write the certificate");
        let path = path.display().to_string();
        self.logged_in(
            label,
            "--write-object",
            &[&path, "--type", "cert", "--label", object, "--id", id_hex],
        )
    }

    /// pkcs11-tool's `operation` with `args`, logged in to token `label`; fails the test
    /// when it fails.
    fn logged_in(&self, label: &str, operation: &str, args: &[&str]) -> Output {
        let mut all = vec![
            "--token-label",
            label,
            "--login",
            "--pin",
            USER_PIN,
            operation,
        ];
        all.extend_from_slice(args);
        let out = self.pkcs11_tool(&all);
        assert!(
            out.status.success(),
            "pkcs11-tool {operation} failed:\n{}",
            output_text(&out)
        );
        out
    }
}
