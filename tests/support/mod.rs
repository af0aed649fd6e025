//! Shared support for hwkey's integration tests: real SoftHSMv2 tokens, real swtpm
//! simulators, a test CA, and real TLS servers (`openssl s_server`, nginx). No mocks.
//!
//! Every helper fails loudly (panics) when a tool is missing: a missing fixture is a broken
//! test machine, never a reason to skip. Every process is killed and reaped on Drop and every
//! temporary directory is removed.
#![allow(dead_code)]

pub mod flow;
pub mod kube;
pub mod proxy;
pub mod upstream;

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
    PKCS_ECDSA_P256_SHA256,
};
use tempfile::TempDir;

/// The SoftHSMv2 PKCS#11 module installed by Debian's `softhsm2` package.
pub const SOFTHSM_MODULE: &str = "/usr/lib/softhsm/libsofthsm2.so";
/// Security-officer PIN of every token made by [`SoftHsm::init_token`].
pub const SO_PIN: &str = "12345678";
/// User PIN of every token made by [`SoftHsm::init_token`] (also in [`SoftHsm::pin_path`]).
pub const USER_PIN: &str = "1234";
/// The nginx binary of Debian's `nginx-light` package.
pub const NGINX: &str = "/usr/sbin/nginx";
/// How long a started server may take to accept connections.
pub const START_TIMEOUT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// Tools
// ---------------------------------------------------------------------------------------------

/// Full path of `cmd` if it is on PATH (or, when it contains a `/`, if that file exists).
pub fn find_tool(cmd: &str) -> Option<PathBuf> {
    if cmd.contains('/') {
        let p = PathBuf::from(cmd);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(cmd))
        .find(|p| {
            p.is_file()
                && p.metadata()
                    .map(|m| m.permissions().mode() & 0o111 != 0)
                    .unwrap_or(false)
        })
}

/// Panics (a test failure, never a skip) if `cmd` is not on PATH, naming the apt package.
pub fn require_tool(cmd: &str, apt_package: &str) {
    if find_tool(cmd).is_none() {
        panic!(
            "{cmd} not found: install it with `apt-get install {apt_package}` \
             (or run hsm-fixtures/install-deps.sh)"
        );
    }
}

/// Path of the SoftHSMv2 PKCS#11 module; panics with the install hint if it is missing.
pub fn softhsm_module() -> PathBuf {
    let p = PathBuf::from(SOFTHSM_MODULE);
    if !p.exists() {
        panic!(
            "{SOFTHSM_MODULE} not found: install it with `apt-get install softhsm2` \
             (or run hsm-fixtures/install-deps.sh)"
        );
    }
    p
}

/// A new temporary directory (removed on Drop) whose name starts with `hwkey-test-`.
pub fn temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("hwkey-test-")
        .tempdir()
        .expect("create a temporary directory")
}

// ---------------------------------------------------------------------------------------------
// Ports
// ---------------------------------------------------------------------------------------------

/// Ports already handed out in this test binary, so parallel tests never get the same one.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// Records `ports` as handed out; false if any of them was handed out before.
fn reserve(ports: &[u16]) -> bool {
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let set = guard.get_or_insert_with(HashSet::new);
    if ports.iter().any(|p| set.contains(p)) {
        return false;
    }
    set.extend(ports.iter().copied());
    true
}

/// A currently free TCP port on 127.0.0.1 (never the same one twice in one test binary).
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local_addr").port();
        if reserve(&[port]) {
            return port;
        }
    }
    panic!("no free TCP port found on 127.0.0.1");
}

/// A port P such that P and P+1 are both currently free on 127.0.0.1 (swtpm needs two).
pub fn free_port_pair() -> u16 {
    for _ in 0..1000 {
        let first = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let port = first.local_addr().expect("local_addr").port();
        if port == u16::MAX {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port + 1)).is_ok() && reserve(&[port, port + 1])
        {
            return port;
        }
    }
    panic!("no free pair of adjacent TCP ports found on 127.0.0.1");
}

/// True if something accepts TCP connections on 127.0.0.1:`port` right now.
pub fn port_is_open(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// Waits until 127.0.0.1:`port` accepts connections; panics after `timeout`.
pub fn wait_for_port(port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if port_is_open(port) {
            return;
        }
        sleep(Duration::from_millis(20));
    }
    panic!("nothing listens on 127.0.0.1:{port} after {timeout:?}");
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// A child process that is killed and reaped on Drop, with stdout+stderr in a log file.
pub struct ChildGuard {
    child: Option<Child>,
    name: String,
    log_path: PathBuf,
}

impl ChildGuard {
    /// Spawns `cmd` (stdin null, stdout+stderr appended to `log_path`) under the name `name`.
    pub fn spawn(cmd: &mut Command, name: &str, log_path: &Path) -> ChildGuard {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .unwrap_or_else(|e| panic!("open log {}: {e}", log_path.display()));
        let log2 = log.try_clone().expect("clone log file handle");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({cmd:?}): {e}"));
        ChildGuard {
            child: Some(child),
            name: name.to_string(),
            log_path: log_path.to_path_buf(),
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Path of the stdout+stderr log file.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The exit status if the process has exited, without blocking.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
    }

    /// Waits until `port` accepts; Err with the log if the process exits first or on timeout.
    pub fn wait_for_port(&mut self, port: u16, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait() {
                return Err(format!(
                    "{} exited ({status}) before listening on 127.0.0.1:{port}; its output:\n{}",
                    self.name,
                    self.log()
                ));
            }
            if port_is_open(port) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} does not listen on 127.0.0.1:{port} after {timeout:?}; its output:\n{}",
                    self.name,
                    self.log()
                ));
            }
            sleep(Duration::from_millis(20));
        }
    }

    /// Sends SIGKILL and reaps the process (idempotent); returns its exit status.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How many times a server start is retried when its port was taken in the meantime.
const START_ATTEMPTS: usize = 5;

/// Spawns a server with `make_cmd(port)` on fresh ports until it listens; panics otherwise.
fn start_server(
    name: &str,
    log_path: &Path,
    mut pick_port: impl FnMut() -> u16,
    mut make_cmd: impl FnMut(u16) -> Command,
) -> (ChildGuard, u16) {
    let mut errors = Vec::new();
    for _ in 0..START_ATTEMPTS {
        let port = pick_port();
        let mut cmd = make_cmd(port);
        let mut guard = ChildGuard::spawn(&mut cmd, name, log_path);
        match guard.wait_for_port(port, START_TIMEOUT) {
            Ok(()) => return (guard, port),
            Err(e) => {
                // An early exit is most likely a port taken in the meantime: retry on another
                // port. A process that runs but never listens is broken: give up at once.
                let exited = guard.try_wait().is_some();
                guard.kill();
                errors.push(e);
                if !exited {
                    break;
                }
            }
        }
    }
    panic!("could not start {name}:\n{}", errors.join("\n---\n"));
}

/// Runs `cmd` to completion capturing output; panics showing stdout+stderr if it failed.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "command failed ({}): {cmd:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// Runs `cmd` to completion capturing output; panics showing stdout+stderr if it succeeded.
pub fn run_fail(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    if out.status.success() {
        panic!(
            "command unexpectedly succeeded: {cmd:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// Like [`run_fail`] for a command that would run forever if it wrongly succeeded (a proxy that
/// should refuse to start): panics if it is still running after `limit` (it is killed).
pub fn run_fail_within(cmd: &mut Command, limit: Duration) -> Output {
    let dir = temp_dir();
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out_path).expect("stdout file"))
        .stderr(fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "still running after {limit:?} instead of refusing: {cmd:?}\n--- stderr ---\n{}",
                fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        sleep(Duration::from_millis(20));
    };
    let out = Output {
        status,
        stdout: fs::read(&out_path).unwrap_or_default(),
        stderr: fs::read(&err_path).unwrap_or_default(),
    };
    if out.status.success() {
        panic!(
            "command unexpectedly succeeded: {cmd:?}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// stdout and stderr of `out` as one lossy UTF-8 string (for assertions and messages).
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A `Command` for the hwkey binary under test, with `RUST_LOG` removed from its environment.
pub fn hwkey() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hwkey"));
    cmd.env_remove("RUST_LOG");
    cmd
}

/// Writes `contents` to `path` with mode 0600 (created or truncated).
pub fn write_private(path: &Path, contents: &[u8]) {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all(contents)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).expect("chmod 0600");
}

// ---------------------------------------------------------------------------------------------
// SoftHSM
// ---------------------------------------------------------------------------------------------

/// A private SoftHSMv2 installation: its own softhsm2.conf, token directory and PIN file.
pub struct SoftHsm {
    conf: PathBuf,
    pin: PathBuf,
    dir: TempDir,
}

impl SoftHsm {
    /// A new empty SoftHSM setup in a temp dir (config from softhsm-config/, PIN file written).
    pub fn new() -> SoftHsm {
        Self::with_config("")
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
            "/softhsm-config/softhsm2.conf.template"
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
        let out = self.pkcs11_tool(&[
            "--token-label",
            label,
            "--login",
            "--pin",
            USER_PIN,
            "--keypairgen",
            "--key-type",
            key_type,
            "--label",
            object,
        ]);
        assert!(
            out.status.success(),
            "pkcs11-tool --keypairgen failed:\n{}",
            output_text(&out)
        );
        out
    }
}

// ---------------------------------------------------------------------------------------------
// swtpm
// ---------------------------------------------------------------------------------------------

/// A TPM 2.0 simulator (swtpm) on 127.0.0.1:P (commands) and P+1 (control); killed on Drop.
pub struct Swtpm {
    guard: ChildGuard,
    port: u16,
    dir: TempDir,
}

impl Swtpm {
    /// Starts swtpm with fresh state in a temp dir on a free port pair and waits until it listens.
    pub fn start() -> Swtpm {
        require_tool("swtpm", "swtpm");
        let dir = temp_dir();
        let (guard, port) = Self::spawn(dir.path(), free_port_pair);
        Swtpm { guard, port, dir }
    }

    /// Spawns swtpm with its state in DIR/state on the port `pick_port` gives (retrying on early exit).
    fn spawn(dir: &Path, pick_port: impl FnMut() -> u16) -> (ChildGuard, u16) {
        let state = dir.join("state");
        fs::create_dir_all(&state).expect("create swtpm state dir");
        let log = dir.join("swtpm.log");
        start_server("swtpm", &log, pick_port, |port| {
            let mut cmd = Command::new("swtpm");
            cmd.arg("socket")
                .arg("--tpmstate")
                .arg(format!("dir={}", state.display()))
                .arg("--tpm2")
                .arg("--server")
                .arg(format!("type=tcp,port={port},bindaddr=127.0.0.1"))
                .arg("--ctrl")
                .arg(format!("type=tcp,port={},bindaddr=127.0.0.1", port + 1))
                .args(["--flags", "not-need-init,startup-clear"]);
            cmd
        })
    }

    /// Kills swtpm and starts it again on the same ports and state (a TPM reset: transient objects are gone, persistent ones stay).
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Kills swtpm (the TPM is gone until [`Swtpm::start_again`]).
    pub fn stop(&mut self) {
        self.guard.kill();
    }

    /// Starts a stopped swtpm again on the same ports and state.
    pub fn start_again(&mut self) {
        let port = self.port;
        let mut ports = std::iter::repeat(port);
        let (guard, _) = Self::spawn(self.dir.path(), move || ports.next().unwrap_or(port));
        self.guard = guard;
    }

    /// The simulator's process id (tests pause it with SIGSTOP to play a very slow TPM).
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }

    /// The TCTI string for tpm2-tools / tss-esapi: `swtpm:host=127.0.0.1,port=P`.
    pub fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }

    /// The TPM command port P (the control port is P+1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temp dir holding the TPM state and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Environment for tpm2-tools and hwkey: `TPM2TOOLS_TCTI`.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![("TPM2TOOLS_TCTI".to_string(), self.tcti())]
    }

    /// What swtpm wrote to stdout/stderr so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }
}

// ---------------------------------------------------------------------------------------------
// Test CA
// ---------------------------------------------------------------------------------------------

/// A throw-away EC P-256 certificate authority (software key; tests only).
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    ca_path: PathBuf,
    key_path: PathBuf,
}

/// A fresh random positive 16-byte serial number.
fn random_serial() -> SerialNumber {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("random serial");
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&bytes)
}

/// Converts an x509-parser name into an rcgen name, keeping string types where rcgen can.
fn dn_from_x509(name: &x509_parser::x509::X509Name<'_>) -> DistinguishedName {
    use x509_parser::der_parser::asn1_rs::Tag;
    let mut dn = DistinguishedName::new();
    for rdn in name.iter() {
        for attr in rdn.iter() {
            let oid: Vec<u64> = attr
                .attr_type()
                .iter()
                .expect("attribute OID fits in u64")
                .collect();
            let s = attr
                .as_str()
                .unwrap_or_else(|e| panic!("subject attribute {oid:?} is not a string: {e}"));
            let value = match attr.attr_value().tag() {
                Tag::PrintableString => DnValue::PrintableString(
                    s.try_into().expect("valid PrintableString in CSR subject"),
                ),
                Tag::Ia5String => {
                    DnValue::Ia5String(s.try_into().expect("valid IA5String in CSR subject"))
                }
                _ => DnValue::Utf8String(s.to_string()),
            };
            dn.push(DnType::from_oid(&oid), value);
        }
    }
    dn
}

/// Converts the subjectAltName entries of a CSR into rcgen SANs.
fn sans_from_x509(names: &[x509_parser::extensions::GeneralName<'_>]) -> Vec<SanType> {
    use x509_parser::extensions::GeneralName;
    names
        .iter()
        .map(|name| match name {
            GeneralName::DNSName(s) => SanType::DnsName((*s).try_into().expect("DNS SAN")),
            GeneralName::RFC822Name(s) => SanType::Rfc822Name((*s).try_into().expect("email SAN")),
            GeneralName::URI(s) => SanType::URI((*s).try_into().expect("URI SAN")),
            GeneralName::IPAddress(b) => SanType::IpAddress(match b.len() {
                4 => IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])),
                16 => {
                    let mut a = [0u8; 16];
                    a.copy_from_slice(b);
                    IpAddr::V6(Ipv6Addr::from(a))
                }
                n => panic!("IP SAN with {n} bytes"),
            }),
            other => panic!("TestCa cannot copy SAN {other:?}"),
        })
        .collect()
}

impl TestCa {
    /// Makes a CA (CN "hwkey test CA", CA:TRUE, keyCertSign) and writes DIR/ca.pem and DIR/ca.key.
    pub fn new(dir: &Path) -> TestCa {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate CA key");
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "hwkey test CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        params.serial_number = Some(random_serial());
        let key_pem = key.serialize_pem();
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-sign the test CA");
        let ca_path = dir.join("ca.pem");
        let key_path = dir.join("ca.key");
        fs::write(&ca_path, issuer.pem()).expect("write ca.pem");
        write_private(&key_path, key_pem.as_bytes());
        TestCa {
            issuer,
            ca_path,
            key_path,
        }
    }

    /// The CA certificate in PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA certificate in DER.
    pub fn ca_der(&self) -> Vec<u8> {
        self.issuer.der().to_vec()
    }

    /// Path of ca.pem.
    pub fn ca_path(&self) -> PathBuf {
        self.ca_path.clone()
    }

    /// Path of ca.key (PKCS#8 PEM, mode 0600).
    pub fn key_path(&self) -> PathBuf {
        self.key_path.clone()
    }

    /// Issues a server certificate for `localhost` + 127.0.0.1; writes and returns DIR/server.pem, DIR/server.key.
    pub fn server_cert(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate server key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("server SANs");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "localhost");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(365);
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("sign server certificate");
        let cert_path = dir.join("server.pem");
        let key_path = dir.join("server.key");
        fs::write(&cert_path, cert.pem()).expect("write server.pem");
        write_private(&key_path, key.serialize_pem().as_bytes());
        (cert_path, key_path)
    }

    /// Issues a client certificate with a software key for subject `CN=cn[,O=org]`; writes DIR/NAME.pem and DIR/NAME.key.
    pub fn client_cert(
        &self,
        dir: &Path,
        name: &str,
        cn: &str,
        org: Option<&str>,
    ) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate client key");
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        if let Some(org) = org {
            dn.push(DnType::OrganizationName, org);
        }
        dn.push(DnType::CommonName, cn);
        params.distinguished_name = dn;
        let cert = self.sign_params(params, &key, Duration::from_secs(30 * 86400));
        let cert_path = dir.join(format!("{name}.pem"));
        let key_path = dir.join(format!("{name}.key"));
        fs::write(&cert_path, cert).expect("write client cert");
        write_private(&key_path, key.serialize_pem().as_bytes());
        (cert_path, key_path)
    }

    /// Signs a PEM CSR: a clientAuth/digitalSignature cert valid `days` days, subject and SANs copied.
    pub fn sign_csr_pem(&self, csr_pem: &str, days: u32) -> String {
        self.sign_csr_pem_for(csr_pem, Duration::from_secs(u64::from(days) * 86400))
    }

    /// Like [`TestCa::sign_csr_pem`] but valid for `validity` from now (for expiry tests).
    pub fn sign_csr_pem_for(&self, csr_pem: &str, validity: Duration) -> String {
        use x509_parser::prelude::{FromDer, ParsedExtension, X509CertificationRequest};
        let block = pem::parse(csr_pem).expect("CSR is PEM");
        assert!(
            block.tag() == "CERTIFICATE REQUEST" || block.tag() == "NEW CERTIFICATE REQUEST",
            "expected a CERTIFICATE REQUEST PEM block, got {}",
            block.tag()
        );
        let (_, csr) = X509CertificationRequest::from_der(block.contents()).expect("parse CSR");
        csr.verify_signature()
            .expect("the CSR's self-signature must verify");
        let info = &csr.certification_request_info;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn_from_x509(&info.subject);
        if let Some(exts) = csr.requested_extensions() {
            for ext in exts {
                if let ParsedExtension::SubjectAlternativeName(san) = ext {
                    params
                        .subject_alt_names
                        .extend(sans_from_x509(&san.general_names));
                }
            }
        }
        let spki = rcgen::SubjectPublicKeyInfo::from_der(info.subject_pki.raw)
            .expect("CSR public key algorithm supported by rcgen");
        self.sign_params(params, &spki, validity)
    }

    /// Signs a PEM CSR like [`TestCa::sign_csr_pem`] and writes the certificate to `out`.
    pub fn sign_csr_to_file(&self, csr_pem: &str, days: u32, out: &Path) {
        fs::write(out, self.sign_csr_pem(csr_pem, days))
            .unwrap_or_else(|e| panic!("write {}: {e}", out.display()));
    }

    /// Signs a PEM CSR file into a certificate file (see [`TestCa::sign_csr_pem`]).
    pub fn sign_csr_file(&self, csr_path: &Path, days: u32, out: &Path) {
        let csr = fs::read_to_string(csr_path)
            .unwrap_or_else(|e| panic!("read {}: {e}", csr_path.display()));
        self.sign_csr_to_file(&csr, days, out);
    }

    /// Adds the client-certificate profile and validity to `params` and signs them for `key`.
    fn sign_params(
        &self,
        mut params: CertificateParams,
        key: &impl rcgen::PublicKeyData,
        validity: Duration,
    ) -> String {
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + validity;
        params.serial_number = Some(random_serial());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params
            .signed_by(key, &self.issuer)
            .expect("sign client certificate")
            .pem()
    }
}

// ---------------------------------------------------------------------------------------------
// TLS servers
// ---------------------------------------------------------------------------------------------

/// The single TLS version an [`OpensslServer`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsVersion {
    /// `-tls1_2`
    Tls12,
    /// `-tls1_3`
    Tls13,
}

/// `openssl s_server -www` requiring a client certificate from a CA; killed on Drop.
pub struct OpensslServer {
    guard: ChildGuard,
    port: u16,
    dir: TempDir,
}

impl OpensslServer {
    /// Starts `openssl s_server -Verify 1 -verify_return_error -www` on a free 127.0.0.1 port.
    pub fn start(ca: &Path, cert: &Path, key: &Path, tls: TlsVersion) -> OpensslServer {
        Self::start_with(ca, cert, key, tls, &[])
    }

    /// Like [`OpensslServer::start`] with extra s_server arguments (e.g. `-alpn h2`).
    pub fn start_with(
        ca: &Path,
        cert: &Path,
        key: &Path,
        tls: TlsVersion,
        extra: &[&str],
    ) -> OpensslServer {
        require_tool("openssl", "openssl");
        let dir = temp_dir();
        let log = dir.path().join("s_server.log");
        let (guard, port) = start_server("openssl s_server", &log, free_port, |port| {
            let mut cmd = Command::new("openssl");
            cmd.arg("s_server")
                .arg("-accept")
                .arg(format!("127.0.0.1:{port}"))
                .arg("-cert")
                .arg(cert)
                .arg("-key")
                .arg(key)
                .arg("-CAfile")
                .arg(ca)
                .args(["-Verify", "1", "-verify_return_error", "-www"])
                .arg(match tls {
                    TlsVersion::Tls12 => "-tls1_2",
                    TlsVersion::Tls13 => "-tls1_3",
                })
                .args(extra);
            cmd
        });
        OpensslServer { guard, port, dir }
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `https://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}/", self.port)
    }

    /// What s_server printed so far (verify lines name the client's certificate subject).
    pub fn log(&self) -> String {
        self.guard.log()
    }
}

/// nginx requiring a client certificate (`ssl_verify_client on`); runs as a child, killed on Drop.
pub struct Nginx {
    guard: ChildGuard,
    port: u16,
    dir: TempDir,
}

impl Nginx {
    /// Starts nginx on a free 127.0.0.1 port; `/` answers `client=$ssl_client_s_dn proto=$ssl_protocol`.
    pub fn start(ca: &Path, cert: &Path, key: &Path) -> Nginx {
        Self::start_with(ca, cert, key, "")
    }

    /// Like [`Nginx::start`] with extra directives inside the `server { }` block.
    pub fn start_with(ca: &Path, cert: &Path, key: &Path, extra_server_conf: &str) -> Nginx {
        if !Path::new(NGINX).is_file() {
            panic!(
                "{NGINX} not found: install it with `apt-get install nginx-light` \
                 (or run hsm-fixtures/install-deps.sh)"
            );
        }
        let dir = temp_dir();
        let d = dir.path().to_path_buf();
        let error_log = d.join("error.log");
        let conf_path = d.join("nginx.conf");
        // SAFETY: geteuid has no preconditions and cannot fail.
        let is_root = unsafe { libc::geteuid() } == 0;
        let (guard, port) = start_server("nginx", &d.join("nginx.out"), free_port, |port| {
            let conf = format!(
                r#"daemon off;
master_process off;
{user}worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/client_body_temp;
    proxy_temp_path {d}/proxy_temp;
    fastcgi_temp_path {d}/fastcgi_temp;
    uwsgi_temp_path {d}/uwsgi_temp;
    scgi_temp_path {d}/scgi_temp;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_client_certificate {ca};
        ssl_verify_client on;
        ssl_protocols TLSv1.2 TLSv1.3;
        {extra_server_conf}
        location / {{
            default_type text/plain;
            return 200 "client=$ssl_client_s_dn proto=$ssl_protocol\n";
        }}
    }}
}}
"#,
                user = if is_root { "user root;\n" } else { "" },
                d = d.display(),
                cert = cert.display(),
                key = key.display(),
                ca = ca.display(),
            );
            fs::write(&conf_path, conf).expect("write nginx.conf");
            let mut cmd = Command::new(NGINX);
            cmd.arg("-p")
                .arg(&d)
                .arg("-c")
                .arg(&conf_path)
                .arg("-e")
                .arg(&error_log);
            cmd
        });
        Nginx { guard, port, dir }
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `https://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}/", self.port)
    }

    /// nginx's error log (level info: handshake failures and missing client certs show here).
    pub fn log(&self) -> String {
        let mut s = self.guard.log();
        s.push_str(&fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default());
        s
    }

    /// nginx's access log.
    pub fn access_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }
}

/// Reads a whole file to a String, panicking with the path on error.
pub fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
