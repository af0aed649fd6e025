//! A private swtpm TPM 2.0 simulator per test, on free loopback ports.

use std::fs::{self};
use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use crate::*;

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

    /// Starts swtpm on a TPM manufactured by `swtpm_setup --create-ek-cert`: RSA-2048 and ECC
    /// EKs whose certificates (NV 0x01c00002 and 0x01c00016) a fresh local CA (`swtpm_localca`)
    /// issued, as a TPM vendor's would be. Returns the simulator and the CA bundle (root and
    /// issuing certificate) a verifier trusts.
    pub fn start_with_ek_certificate() -> (Swtpm, std::path::PathBuf) {
        Swtpm::start_manufactured(None)
    }

    /// As [`Swtpm::start_with_ek_certificate`], with the EK certificates issued by the local CA
    /// kept in `ca` (made there by the first TPM): TPMs of one manufacturer. The TPM's
    /// `localca` is a link to it, so its CRLs ([`Swtpm::ek_crl`]) are that CA's.
    pub fn start_with_ek_certificate_from(ca: &Path) -> (Swtpm, std::path::PathBuf) {
        Swtpm::start_manufactured(Some(ca))
    }

    fn start_manufactured(shared: Option<&Path>) -> (Swtpm, std::path::PathBuf) {
        require_tool("swtpm", "swtpm");
        require_tool("swtpm_setup", "swtpm-tools");
        let dir = temp_dir();
        let d = dir.path();
        let ca = d.join("localca");
        match shared {
            Some(shared) => {
                fs::create_dir_all(shared).expect("create the shared local CA dir");
                std::os::unix::fs::symlink(shared, &ca).expect("link the shared local CA");
            }
            None => fs::create_dir_all(&ca).expect("create the local CA dir"),
        }
        fs::create_dir_all(d.join("state")).expect("create swtpm state dir");
        let write = |name: &str, text: String| {
            fs::write(d.join(name), text).expect("write swtpm_setup config")
        };
        write(
            "localca.conf",
            format!(
                "statedir = {c}\nsigningkey = {c}/signkey.pem\nissuercert = {c}/issuercert.pem\ncertserial = {c}/certserial\n",
                c = ca.display()
            ),
        );
        write(
            "localca.options",
            "--platform-manufacturer hwkey-test\n--platform-version 2.1\n--platform-model swtpm\n"
                .into(),
        );
        write(
            "setup.conf",
            format!(
                "create_certs_tool = /usr/bin/swtpm_localca\ncreate_certs_tool_config = {}\ncreate_certs_tool_options = {}\nactive_pcr_banks = sha256\n",
                d.join("localca.conf").display(),
                d.join("localca.options").display()
            ),
        );
        run_ok(
            Command::new("swtpm_setup")
                .args(["--tpm2", "--create-ek-cert", "--overwrite", "--tpmstate"])
                .arg(d.join("state"))
                .arg("--config")
                .arg(d.join("setup.conf")),
        );
        let bundle = d.join("ek-ca.pem");
        let mut pem =
            fs::read(ca.join("swtpm-localca-rootca-cert.pem")).expect("the local root CA");
        pem.extend(fs::read(ca.join("issuercert.pem")).expect("the local issuing CA"));
        fs::write(&bundle, pem).expect("write the EK CA bundle");
        let (guard, port) = Self::spawn(d, free_port_pair);
        (Swtpm { guard, port, dir }, bundle)
    }

    /// Spawns swtpm with its state in DIR/state on the port `pick_port` gives (retrying on early exit).
    fn spawn(dir: &Path, pick_port: impl FnMut() -> u16) -> (ChildGuard, u16) {
        let state = dir.join("state");
        fs::create_dir_all(&state).expect("create swtpm state dir");
        let log = dir.join("swtpm.log");
        let (guard, port) = start_server("swtpm", &log, pick_port, |port| {
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
        });
        // Handed out only once it has answered a TPM command through the swtpm TCTI (which
        // also opens the control port, to set the locality): twice in CI the first command of a
        // TPM handed out when its command port accepted failed with "TCTI I/O error
        // (0xa000a)" (approver::attacks, at the start of the busiest test run).
        crate::ports::wait_for_port(port + 1, std::time::Duration::from_secs(10));
        answers_a_command(guard, port, &log)
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

    /// The simulator's process id.
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }

    /// Stops the simulator (SIGSTOP) until the guard is dropped: the slowest TPM there is, for
    /// the tests and benches of what a slow signature must not stall.
    pub fn pause(&self) -> Paused {
        let pid = i32::try_from(self.pid()).expect("pid fits");
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
        let rc = unsafe { libc::kill(pid, libc::SIGSTOP) };
        assert_eq!(rc, 0, "SIGSTOP swtpm ({pid})");
        Paused(pid)
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

    /// `tpm2_createprimary`: an ECC P-256 primary key in the owner hierarchy, its context saved
    /// as DIR/CTX, the parent tpm2-tools keys are then made under.
    pub fn create_primary(&self, dir: &Path, ctx: &str) {
        self.tool(
            dir,
            &["tpm2_createprimary", "-C", "o", "-G", "ecc256", "-c", ctx],
        );
    }

    /// Runs a tpm2-tools command (`args[0]` is the tool) in `dir` against this TPM, then flushes
    /// the transient objects it left loaded: without a resource manager every tpm2-tools run
    /// leaves its objects in the TPM, and swtpm has three slots.
    pub fn tool(&self, dir: &Path, args: &[&str]) {
        crate::run_ok(
            Command::new(args[0])
                .envs(self.envs())
                .args(&args[1..])
                .current_dir(dir),
        );
        crate::run_ok(
            Command::new("tpm2_flushcontext")
                .envs(self.envs())
                .arg("-t"),
        );
    }

    /// Gives the TPM an ECC P-256 EK certificate at NV index 0x01c0000a, issued by the same
    /// local CA as [`Swtpm::start_with_ek_certificate`]'s (which swtpm_setup makes for the RSA
    /// EK and a P-384 EK only): what a manufacturer shipping the TCG L-2 template's
    /// certificate does.
    pub fn add_ecc_p256_ek_certificate(&self) {
        let d = self.dir.path();
        let conf = d.join("localca.conf");
        assert!(
            conf.exists(),
            "start the TPM with start_with_ek_certificate first"
        );
        let work = d.join("ecc-p256");
        fs::create_dir_all(&work).expect("mkdir");
        let pem = work.join("ek.pem");
        crate::run_ok(
            Command::new("tpm2_createek")
                .envs(self.envs())
                .args(["-G", "ecc", "-c", "-", "-f", "pem", "-u"])
                .arg(&pem),
        );
        let text = crate::run_ok(
            Command::new("openssl")
                .args(["ec", "-pubin", "-noout", "-text", "-in"])
                .arg(&pem),
        );
        let text = String::from_utf8_lossy(&text.stdout).into_owned();
        let hex: String = text
            .lines()
            .skip_while(|l| !l.starts_with("pub:"))
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .flat_map(|l| l.chars().filter(char::is_ascii_hexdigit))
            .collect();
        assert_eq!(hex.len(), 130, "an uncompressed P-256 point: {text}");
        crate::run_ok(
            Command::new("swtpm_localca")
                .args(["--type", "ek", "--ek"])
                .arg(format!("x={},y={},id=secp256r1", &hex[2..66], &hex[66..]))
                .arg("--dir")
                .arg(&work)
                .args(["--tpm-spec-family", "2.0", "--tpm-spec-level", "0"])
                .args([
                    "--tpm-spec-revision",
                    "164",
                    "--tpm-manufacturer",
                    "id:00001014",
                ])
                .args([
                    "--tpm-model",
                    "swtpm",
                    "--tpm-version",
                    "id:20191023",
                    "--tpm2",
                ])
                .arg("--configfile")
                .arg(&conf)
                .arg("--optsfile")
                .arg(d.join("localca.options")),
        );
        self.write_manufacturer_nv("0x01c0000a", &work.join("ek.cert"));
        crate::run_ok(
            Command::new("tpm2_flushcontext")
                .envs(self.envs())
                .arg("-t"),
        );
    }

    /// A CRL of the local CA that issued this TPM's EK certificates
    /// ([`Swtpm::start_with_ek_certificate`]), listing `revoked` (PEM certificates it issued,
    /// reason keyCompromise), valid from `last` to `next` (`YYYYMMDDHHMMSSZ`, or None: now to
    /// 30 days on). Made with `openssl ca`, as the CA's operator would.
    pub fn ek_crl(&self, revoked: &[&Path], dates: Option<(&str, &str)>) -> std::path::PathBuf {
        let d = self.dir.path();
        let ca = d.join("localca");
        assert!(
            ca.join("signkey.pem").exists(),
            "start the TPM with start_with_ek_certificate first"
        );
        // Inside the TPM's directory, which goes with it.
        let work = d.join(format!("crl-{}", fs::read_dir(d).expect("dir").count()));
        fs::create_dir(&work).expect("mkdir");
        fs::write(work.join("index.txt"), "").expect("index");
        fs::write(work.join("crlnumber"), "1000\n").expect("crlnumber");
        let conf = work.join("ca.cnf");
        fs::write(
            &conf,
            format!(
                "[ca]\ndefault_ca = ek\n[ek]\ndatabase = {w}/index.txt\ncrlnumber = {w}/crlnumber\ndefault_md = sha256\ndefault_crl_days = 30\n",
                w = work.display()
            ),
        )
        .expect("ca.cnf");
        let openssl_ca = || {
            let mut cmd = Command::new("openssl");
            cmd.args(["ca", "-config"])
                .arg(&conf)
                .arg("-keyfile")
                .arg(ca.join("signkey.pem"))
                .arg("-cert")
                .arg(ca.join("issuercert.pem"));
            cmd
        };
        for cert in revoked {
            crate::run_ok(
                openssl_ca()
                    .arg("-revoke")
                    .arg(cert)
                    .args(["-crl_reason", "keyCompromise"]),
            );
        }
        let out = work.join("crl.pem");
        let mut gen = openssl_ca();
        gen.arg("-gencrl").arg("-out").arg(&out);
        if let Some((last, next)) = dates {
            gen.args(["-crl_lastupdate", last, "-crl_nextupdate", next]);
        }
        crate::run_ok(&mut gen);
        out
    }

    /// The local CA's root and issuing (intermediate) certificates, PEM, of a TPM started with
    /// [`Swtpm::start_with_ek_certificate`] (its bundle holds both).
    pub fn ek_ca_files(&self) -> (std::path::PathBuf, std::path::PathBuf) {
        let ca = self.dir.path().join("localca");
        (
            ca.join("swtpm-localca-rootca-cert.pem"),
            ca.join("issuercert.pem"),
        )
    }

    /// Stores `pems` (PEM certificate files), DER back to back, at NV index 0x01c00100, the
    /// first of the TCG EK Credential Profile's EK-chain indices, as a manufacturer stores the
    /// intermediates of the EK certificate's chain (replacing what was there).
    pub fn store_ek_chain(&self, pems: &[&Path]) {
        let mut der = Vec::new();
        for pem in pems {
            der.extend(
                crate::run_ok(
                    Command::new("openssl")
                        .args(["x509", "-outform", "der", "-in"])
                        .arg(pem),
                )
                .stdout,
            );
        }
        let file = self.dir.path().join("ek-chain.der");
        fs::write(&file, &der).expect("write the chain");
        self.write_manufacturer_nv("0x01c00100", &file);
    }

    /// Writes `file` to the NV index `index` as a manufacturer does: defined by the platform
    /// (replacing an index already there), readable by the owner and with its own
    /// authorization, not subject to dictionary-attack protection.
    fn write_manufacturer_nv(&self, index: &str, file: &Path) {
        let size = fs::metadata(file).expect("the NV contents").len();
        let _ = Command::new("tpm2_nvundefine")
            .envs(self.envs())
            .args([index, "-C", "p"])
            .output();
        crate::run_ok(Command::new("tpm2_nvdefine").envs(self.envs()).args([
            index,
            "-C",
            "p",
            "-s",
            &size.to_string(),
            "-a",
            "ppwrite|ppread|ownerread|authread|no_da|platformcreate",
        ]));
        crate::run_ok(
            Command::new("tpm2_nvwrite")
                .envs(self.envs())
                .args([index, "-C", "p", "-i"])
                .arg(file),
        );
    }

    /// What swtpm wrote to stdout/stderr so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }
}

/// A stopped swtpm ([`Swtpm::pause`]), resumed (SIGCONT) when dropped, also when a test fails
/// half-way.
pub struct Paused(i32);

impl Drop for Paused {
    fn drop(&mut self) {
        // SAFETY: as in `Swtpm::pause`.
        let _ = unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

/// A TPM shared the way a host shares its TPM: swtpm behind the access broker and resource
/// manager `tpm2-abrmd`, on a private D-Bus session bus of this test (no root services). Every
/// client (hwkey processes, tpm2-tools) connects through `tabrmd:bus_type=session` with
/// [`SharedTpm::envs`]; the broker gives each its own transient objects and sessions, so no
/// client may assume it is the TPM's only one.
pub struct SharedTpm {
    /// The simulator behind the broker (restart it to reset the TPM).
    pub swtpm: Swtpm,
    abrmd: ChildGuard,
    dbus: ChildGuard,
    bus: String,
    _dir: TempDir,
}

impl SharedTpm {
    /// Starts a session bus, swtpm and tpm2-abrmd in front of it; waits until the broker answers.
    pub fn start() -> SharedTpm {
        SharedTpm::start_with(&[])
    }

    /// [`SharedTpm::start`] with more tpm2-abrmd arguments (e.g. `--max-connections 1`).
    pub fn start_with(abrmd_args: &[&str]) -> SharedTpm {
        require_tool("dbus-daemon", "dbus");
        require_tool("tpm2-abrmd", "tpm2-abrmd");
        require_tool("tpm2_getrandom", "tpm2-tools");
        assert!(
            Path::new("/usr/lib/x86_64-linux-gnu/libtss2-tcti-tabrmd.so.0").exists(),
            "the tabrmd TCTI is missing: apt-get install libtss2-tcti-tabrmd0"
        );
        let swtpm = Swtpm::start();
        let dir = temp_dir();
        let socket = dir.path().join("bus");
        let bus = format!("unix:path={}", socket.display());
        let mut dbus = ChildGuard::spawn(
            Command::new("dbus-daemon")
                .args(["--session", "--nofork", "--nopidfile"])
                .arg(format!("--address={bus}")),
            "dbus-daemon",
            &dir.path().join("dbus.log"),
        );
        wait_until("the D-Bus session bus", &mut dbus, || socket.exists());
        let mut abrmd = ChildGuard::spawn(
            Command::new("tpm2-abrmd")
                .env("DBUS_SESSION_BUS_ADDRESS", &bus)
                .args(["--session", "--allow-root"])
                .args(abrmd_args)
                .arg(format!("--tcti={}", swtpm.tcti())),
            "tpm2-abrmd",
            &dir.path().join("abrmd.log"),
        );
        wait_until("tpm2-abrmd", &mut abrmd, || {
            Command::new("tpm2_getrandom")
                .env("DBUS_SESSION_BUS_ADDRESS", &bus)
                .args(["-T", "tabrmd:bus_type=session", "8"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        SharedTpm {
            swtpm,
            abrmd,
            dbus,
            bus,
            _dir: dir,
        }
    }

    /// The TCTI string every client uses.
    pub fn tcti(&self) -> String {
        "tabrmd:bus_type=session".to_string()
    }

    /// The environment that reaches this test's bus.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![("DBUS_SESSION_BUS_ADDRESS".to_string(), self.bus.clone())]
    }
}

impl Drop for SharedTpm {
    fn drop(&mut self) {
        self.abrmd.kill();
        self.dbus.kill();
    }
}

/// Polls `ready` until it holds; panics with the process's log if it exits or 15 s pass.
fn wait_until(what: &str, child: &mut ChildGuard, mut ready: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + START_TIMEOUT;
    while !ready() {
        if let Some(status) = child.try_wait() {
            panic!("{what} exited ({status}):\n{}", child.log());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} not ready after {START_TIMEOUT:?}:\n{}",
            child.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The TPM's failed-authorization counter (`TPM2_PT_LOCKOUT_COUNTER`), through the TPM client
/// environment `envs`.
pub fn lockout_counter(envs: Vec<(String, String)>) -> u64 {
    crate::require_tool("tpm2_getcap", "tpm2-tools");
    let out = crate::run_ok(
        Command::new("tpm2_getcap")
            .envs(envs)
            .arg("properties-variable"),
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // `TPM2_PT_LOCKOUT_COUNTER: 0x1`
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix("TPM2_PT_LOCKOUT_COUNTER:"))
        .unwrap_or_else(|| panic!("no TPM2_PT_LOCKOUT_COUNTER in:\n{text}"));
    u64::from_str_radix(value.trim().trim_start_matches("0x"), 16).expect("hex counter")
}

/// Waits until the swtpm on `port` answers `tpm2_getrandom` through the swtpm TCTI (10 s at
/// most; it normally answers the first time); panics with its log if it exits or never does.
fn answers_a_command(mut guard: ChildGuard, port: u16, log: &Path) -> (ChildGuard, u16) {
    require_tool("tpm2_getrandom", "tpm2-tools");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut failures = Vec::new();
    loop {
        let out = Command::new("tpm2_getrandom")
            .env(
                "TPM2TOOLS_TCTI",
                format!("swtpm:host=127.0.0.1,port={port}"),
            )
            .args(["1", "--hex"])
            .output();
        match out {
            Ok(o) if o.status.success() => {
                if !failures.is_empty() {
                    eprintln!(
                        "swtpm on port {port} answered after {} failed attempt(s): {}",
                        failures.len(),
                        failures.join(" | ")
                    );
                }
                return (guard, port);
            }
            Ok(o) => failures.push(String::from_utf8_lossy(&o.stderr).trim().to_string()),
            Err(e) => failures.push(e.to_string()),
        }
        let exited = guard.try_wait();
        if exited.is_some() || std::time::Instant::now() >= deadline {
            panic!(
                "swtpm on port {port} {} without answering a command ({}):\n{}",
                if exited.is_some() {
                    "exited"
                } else {
                    "ran 10 s"
                },
                failures.join(" | "),
                fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
