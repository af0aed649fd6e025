//! The proxy under test: a hardware identity (key + certificate from a [`TestCa`]) and a
//! running `hwkey proxy` process with a UNIX socket, a loopback TLS listener and an admin
//! listener, killed on Drop. Helpers read `/metrics`, fetch loopback credentials from the
//! control socket, and speak raw HTTP/1.1 over the UNIX socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::upstream::TestUpstream;
use crate::{free_port, hwkey, run_ok, temp_dir, ChildGuard, SharedTpm, SoftHsm, Swtpm, TestCa};

/// How long the proxy may take to print its ready line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the hardware key lives.
pub enum Backend {
    SoftHsm(SoftHsm),
    Tpm(Swtpm),
    /// A TPM behind tpm2-abrmd, as hosts share theirs.
    SharedTpm(Box<SharedTpm>),
}

/// A hardware key with a certificate from the test CA, which also signs the upstream's
/// server certificate.
pub struct Identity {
    pub backend: Backend,
    pub key_uri: String,
    pub cert: PathBuf,
    pub ca: TestCa,
    pub dir: TempDir,
}

impl Identity {
    /// A SoftHSM token `kube` with an EC P-256 key `alice` and a certificate for
    /// `CN=alice,O=devs` in DIR/alice.pem.
    pub fn softhsm() -> Identity {
        let hsm = SoftHsm::new();
        hsm.init_token("kube");
        let key_uri = hsm.key_uri("kube", "alice");
        Identity::provision(Backend::SoftHsm(hsm), key_uri, temp_dir())
    }

    /// A swtpm with an EC P-256 key in DIR/alice.tpm.pem and the same certificate as
    /// [`Identity::softhsm`].
    pub fn tpm() -> Identity {
        let tpm = Swtpm::start();
        let dir = temp_dir();
        let key_uri = format!(
            "tpm:path={}?tcti={}",
            dir.path().join("alice.tpm.pem").display(),
            tpm.tcti()
        );
        Identity::provision(Backend::Tpm(tpm), key_uri, dir)
    }

    /// Like [`Identity::tpm`] on a TPM shared through tpm2-abrmd ([`SharedTpm`]).
    pub fn shared_tpm() -> Identity {
        let tpm = SharedTpm::start();
        let dir = temp_dir();
        let key_uri = format!(
            "tpm:path={}?tcti={}",
            dir.path().join("alice.tpm.pem").display(),
            tpm.tcti()
        );
        Identity::provision(Backend::SharedTpm(Box::new(tpm)), key_uri, dir)
    }

    /// A key of `algorithm` (e.g. `rsa-2048`) named `alice` on token `kube` of the given
    /// SoftHSM setup (e.g. one with a mechanism filter), certified like [`Identity::softhsm`].
    pub fn softhsm_with(hsm: SoftHsm, algorithm: &str) -> Identity {
        hsm.init_token("kube");
        let key_uri = hsm.key_uri("kube", "alice");
        let dir = temp_dir();
        let ca = TestCa::new(dir.path());
        let id = Identity {
            backend: Backend::SoftHsm(hsm),
            cert: dir.path().join("alice.pem"),
            key_uri,
            ca,
            dir,
        };
        run_ok(hwkey().envs(id.envs()).args([
            "key",
            "create",
            "--key",
            &id.key_uri,
            "--algorithm",
            algorithm,
        ]));
        id.issue(&id.key_uri, "CN=alice,O=devs", &id.cert);
        id
    }

    /// Creates the key `key_uri` on `backend` and has a new test CA in `dir` certify it for
    /// `CN=alice,O=devs` into DIR/alice.pem.
    fn provision(backend: Backend, key_uri: String, dir: TempDir) -> Identity {
        let mut id = Identity::uncertified(backend, key_uri, dir);
        id.create_key(&id.key_uri.clone());
        id.certify();
        id
    }

    /// An identity for a key that already exists on `backend` (made by another tool, or with
    /// options `hwkey key create` was given): a new test CA in `dir` certifies it for
    /// `CN=alice,O=devs` into DIR/alice.pem.
    pub fn of_existing_key(backend: Backend, key_uri: String, dir: TempDir) -> Identity {
        let id = Identity::uncertified(backend, key_uri, dir);
        id.certify();
        id
    }

    fn uncertified(backend: Backend, key_uri: String, dir: TempDir) -> Identity {
        let ca = TestCa::new(dir.path());
        Identity {
            backend,
            cert: dir.path().join("alice.pem"),
            key_uri,
            ca,
            dir,
        }
    }

    fn certify(&self) {
        self.issue(&self.key_uri, "CN=alice,O=devs", &self.cert);
    }

    /// `hwkey probe` of `url`/version with this identity (trusting its CA) and `extra` flags;
    /// its report (stderr) and body.
    pub fn probe(&self, url: &str, extra: &[&str]) -> String {
        let out = run_ok(
            hwkey()
                .envs(self.envs())
                .args(["probe", "--key", &self.key_uri, "--cert"])
                .arg(&self.cert)
                .arg("--ca")
                .arg(self.ca.ca_path())
                .args(extra)
                .arg(format!("{url}/version")),
        );
        crate::output_text(&out)
    }

    /// The URI of another key `name` beside this one (same token or directory).
    pub fn sibling_uri(&self, name: &str) -> String {
        match &self.backend {
            Backend::SoftHsm(h) => h.key_uri("kube", name),
            Backend::Tpm(t) => format!(
                "tpm:path={}?tcti={}",
                self.dir.path().join(format!("{name}.tpm.pem")).display(),
                t.tcti()
            ),
            Backend::SharedTpm(t) => format!(
                "tpm:path={}?tcti={}",
                self.dir.path().join(format!("{name}.tpm.pem")).display(),
                t.tcti()
            ),
        }
    }

    /// Environment the hwkey processes need for this backend.
    pub fn envs(&self) -> Vec<(String, String)> {
        match &self.backend {
            Backend::SoftHsm(h) => h.envs(),
            Backend::Tpm(t) => t.envs(),
            Backend::SharedTpm(t) => t.envs(),
        }
    }

    /// `hwkey key create --key URI`.
    pub fn create_key(&mut self, uri: &str) {
        run_ok(
            hwkey()
                .envs(self.envs())
                .args(["key", "create", "--key", uri]),
        );
    }

    /// Replaces the certificate file with one for `CN=alice,O=devs` that expires `validity` from
    /// now (NotBefore backdated 5 minutes): for tests of expiry, rotation and renewal.
    pub fn short_lived_cert(&self, validity: Duration) {
        let csr = run_ok(hwkey().envs(self.envs()).args([
            "csr",
            "--key",
            &self.key_uri,
            "--subject",
            "CN=alice,O=devs",
        ]));
        let pem = self.ca.sign_csr_pem_for(
            &String::from_utf8(csr.stdout).expect("CSR is UTF-8"),
            validity,
        );
        // Atomically, so a proxy watching the file never reads half of it.
        let tmp = self.cert.with_extension("short-lived");
        std::fs::write(&tmp, pem).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
        std::fs::rename(&tmp, &self.cert)
            .unwrap_or_else(|e| panic!("rename to {}: {e}", self.cert.display()));
    }

    /// The key URI with its PIN file copied to `path` and read from there (a SoftHSM
    /// identity): a PIN file placed where a test wants it.
    pub fn key_uri_with_pin_at(&self, path: &Path) -> String {
        let Backend::SoftHsm(hsm) = &self.backend else {
            panic!("a SoftHSM identity has a PIN file")
        };
        std::fs::copy(hsm.pin_path(), path).expect("copy the PIN file");
        let key = self.key_uri.replace(
            &format!("pin-source=file:{}", hsm.pin_path().display()),
            &format!("pin-source=file:{}", path.display()),
        );
        assert_ne!(key, self.key_uri, "the URI names no PIN file");
        key
    }

    /// `hwkey proxy` with `key`, this identity's certificate and CA, a free loopback port, the
    /// state directory `state` and `extra` flags, which must refuse to start within 30 s: its
    /// output.
    pub fn proxy_refused(
        &self,
        upstream: &TestUpstream,
        key: &str,
        state: &Path,
        extra: &[&str],
    ) -> String {
        self.proxy_refused_with(upstream, key, state, extra, &[])
    }

    /// [`Identity::proxy_refused`] with more environment.
    pub fn proxy_refused_with(
        &self,
        upstream: &TestUpstream,
        key: &str,
        state: &Path,
        extra: &[&str],
        envs: &[(&str, &Path)],
    ) -> String {
        let out = crate::run_fail_within(
            hwkey()
                .envs(self.envs())
                .envs(envs.iter().copied())
                .args(["proxy", "--key", key, "--cert"])
                .arg(&self.cert)
                .args(["--upstream", &upstream.url(), "--upstream-ca"])
                .arg(self.ca.ca_path())
                .args(["--listen", &format!("tcp:127.0.0.1:{}", free_port())])
                .arg("--state-dir")
                .arg(state)
                .args(extra),
            Duration::from_secs(30),
        );
        crate::output_text(&out)
    }

    /// A CSR signed in the hardware for `subject`, signed by the test CA into `out`.
    pub fn issue(&self, uri: &str, subject: &str, out: &Path) {
        let csr =
            run_ok(
                hwkey()
                    .envs(self.envs())
                    .args(["csr", "--key", uri, "--subject", subject]),
            );
        let pem = String::from_utf8(csr.stdout).expect("CSR is UTF-8");
        std::fs::write(out, self.ca.sign_csr_pem(&pem, 30))
            .unwrap_or_else(|e| panic!("write {}: {e}", out.display()));
    }
}

/// The backend suite: defines `mod softhsm` and `mod tpm` in the invoking module, each with one
/// `#[test]` per named function of that module, called with the backend's [`Identity`]
/// constructor. Each half is compiled only with the invoking crate's `pkcs11` / `tpm` feature,
/// so a single-backend build runs its half.
#[macro_export]
macro_rules! proxy_tests_on_both_backends {
    ($($name:ident),* $(,)?) => {
        #[cfg(feature = "pkcs11")]
        mod softhsm {
            $(#[test] fn $name() { super::$name($crate::proxy::Identity::softhsm) })*
        }
        #[cfg(feature = "tpm")]
        mod tpm {
            $(#[test] fn $name() { super::$name($crate::proxy::Identity::tpm) })*
        }
    };
}

/// A running `hwkey proxy`.
pub struct ProxyProcess {
    pub guard: ChildGuard,
    pub socket: PathBuf,
    pub tcp_port: u16,
    pub admin_port: u16,
    pub state_dir: PathBuf,
    pub dir: TempDir,
}

/// Options for [`ProxyProcess::start_with`].
#[derive(Default)]
pub struct ProxyOptions<'a> {
    /// Extra command-line arguments.
    pub args: Vec<String>,
    /// Extra environment.
    pub envs: Vec<(String, String)>,
    /// Directory to hold the UNIX socket (default: a private temp dir).
    pub socket_dir: Option<&'a Path>,
    /// The state directory (default: DIR/state in a private temp dir).
    pub state_dir: Option<&'a Path>,
    /// Leave out --key/--cert/--upstream/... (they come from a config file or the environment).
    pub bare: bool,
    /// Run under `prlimit --nofile=N:N` (the descriptor limit an auto-started proxy may get).
    pub nofile: Option<u64>,
    /// Another key of the identity's token than its own (with [`ProxyOptions::cert`]).
    pub key: Option<&'a str>,
    /// Another certificate file than the identity's.
    pub cert: Option<&'a Path>,
    /// Another `--upstream-ca` than the identity's CA.
    pub upstream_ca: Option<&'a Path>,
    /// Another hwkey binary (an earlier build, for a benchmark's baseline).
    pub bin: Option<&'a Path>,
}

impl ProxyOptions<'_> {
    /// Only extra command-line arguments: `ProxyOptions::args(&["--idle-exit", "6s"])`.
    pub fn args(args: &[&str]) -> Self {
        ProxyOptions {
            args: args.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        }
    }
}

impl ProxyProcess {
    /// `hwkey proxy` for `id` in front of `upstream` with a UNIX socket, a loopback TLS
    /// listener and an admin listener; waits for the ready line.
    pub fn start(id: &Identity, upstream: &TestUpstream) -> ProxyProcess {
        Self::start_with(id, upstream, ProxyOptions::default())
    }

    pub fn start_with(id: &Identity, upstream: &TestUpstream, opts: ProxyOptions) -> ProxyProcess {
        Self::start_to(id, &upstream.url(), opts)
    }

    /// Like [`ProxyProcess::start_with`] in front of any upstream URL whose server certificate
    /// the identity's test CA issued (e.g. nginx).
    pub fn start_to(id: &Identity, upstream_url: &str, opts: ProxyOptions) -> ProxyProcess {
        let dir = temp_dir();
        let socket = opts.socket_dir.unwrap_or(dir.path()).join("proxy.sock");
        let state_dir = opts
            .state_dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| dir.path().join("state"));
        let tcp_port = free_port();
        let admin_port = free_port();
        let mut cmd = match opts.bin {
            Some(bin) => Command::new(bin),
            None => hwkey(),
        };
        cmd.envs(id.envs()).env("HWKEY_LOG", "info").arg("proxy");
        if !opts.bare {
            cmd.args(["--key", opts.key.unwrap_or(&id.key_uri)])
                .arg("--cert")
                .arg(opts.cert.unwrap_or(&id.cert))
                .args(["--upstream", upstream_url])
                .arg("--upstream-ca")
                .arg(
                    opts.upstream_ca
                        .map(Path::to_path_buf)
                        .unwrap_or_else(|| id.ca.ca_path()),
                )
                .arg("--listen")
                .arg(format!("unix:{}", socket.display()))
                .args(["--listen", &format!("tcp:127.0.0.1:{tcp_port}")])
                .args(["--admin", &format!("tcp:127.0.0.1:{admin_port}")])
                .arg("--state-dir")
                .arg(&state_dir);
        }
        cmd.args(&opts.args).envs(opts.envs.iter().cloned());
        if let Some(n) = opts.nofile {
            let mut wrapped = Command::new("prlimit");
            wrapped
                .arg(format!("--nofile={n}:{n}"))
                .arg("--")
                .arg(cmd.get_program())
                .args(cmd.get_args());
            for (k, v) in cmd.get_envs() {
                match v {
                    Some(v) => wrapped.env(k, v),
                    None => wrapped.env_remove(k),
                };
            }
            cmd = wrapped;
        }
        let log = dir.path().join("proxy.log");
        let guard = ChildGuard::spawn(&mut cmd, "hwkey proxy", &log);
        let mut p = ProxyProcess {
            guard,
            socket,
            tcp_port,
            admin_port,
            state_dir,
            dir,
        };
        p.wait_ready();
        p
    }

    /// The proxy's signer process (its supervisor's child), waiting for one to exist.
    pub fn signer_pid(&self) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let supervisors = crate::children(self.guard.id());
            if let Some(signer) = supervisors.iter().flat_map(|s| crate::children(*s)).next() {
                return signer;
            }
            assert!(Instant::now() < deadline, "no signer under the proxy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the "ready" line; panics with the log if the proxy exits or times out.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let log = self.guard.log();
            if log.contains("hwkey proxy: ready") {
                return;
            }
            if let Some(status) = self.guard.try_wait() {
                panic!("hwkey proxy exited ({status}) before it was ready:\n{log}");
            }
            if Instant::now() > deadline {
                panic!("hwkey proxy not ready after {READY_TIMEOUT:?}:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The proxy's stderr so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }

    /// `https://127.0.0.1:PORT`.
    pub fn tls_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.tcp_port)
    }

    /// The control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.state_dir.join("control.sock")
    }

    /// GET `path` on the admin listener: (status, body).
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.admin_port))
            .unwrap_or_else(|e| panic!("connect to the admin port: {e}\n{}", self.log()));
        s.set_read_timeout(Some(Duration::from_secs(20))).ok();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.admin_port
        )
        .expect("write admin request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("read admin response");
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }

    /// Polls `/healthz` (at most 30 s) until it answers `status`; returns the body. The answer
    /// is cached for `--health-cache` unless a failure came since, so a change shows within
    /// that time.
    pub fn wait_for_health(&self, status: u16) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (got, body) = self.admin_get("/healthz");
            if got == status {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "/healthz never answered {status} (last: {got} {body}):\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The `/metrics` text.
    pub fn metrics(&self) -> String {
        let (status, body) = self.admin_get("/metrics");
        assert_eq!(status, 200, "GET /metrics: {body}");
        body
    }

    /// The value of the sample named exactly `series` (e.g. `hwkey_signatures_total` or
    /// `hwkey_upstream_handshakes_total{resumed="true"}`).
    pub fn metric(&self, series: &str) -> f64 {
        let text = self.metrics();
        metric_in(&text, series)
    }

    /// Waits (at most 20 s) until the metric `series` reaches `value`.
    pub fn wait_for_metric(&self, series: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.metric(series) < value {
            assert!(
                Instant::now() < deadline,
                "{series} never reached {value}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Replaces `id`'s certificate with one valid for `validity` from now, has this proxy reload
    /// it (SIGHUP) and waits until it is the one in use; returns its NotAfter (Unix seconds) as
    /// the proxy reports it. A test of expiry starts with a normal certificate and swaps, so the
    /// proxy's start-up never eats into the short lifetime.
    pub fn swap_in_short_lived_cert(&self, id: &Identity, validity: Duration) -> i64 {
        const NOT_AFTER: &str = "hwkey_certificate_not_after_timestamp_seconds";
        let before = self.metric(NOT_AFTER);
        id.short_lived_cert(validity);
        self.signal(libc::SIGHUP);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.metric(NOT_AFTER) == before {
            assert!(
                Instant::now() < deadline,
                "the short-lived certificate was never reloaded:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.metric(NOT_AFTER) as i64
    }

    /// `hwkey_signatures_total`.
    pub fn signatures(&self) -> u64 {
        self.metric("hwkey_signatures_total") as u64
    }

    /// A loopback credential from the control socket (JSON).
    pub fn credential(&self) -> serde_json::Value {
        let out = run_ok(
            Command::new("curl")
                .args(["-sS", "--fail", "--unix-socket"])
                .arg(self.control_socket())
                .arg("http://localhost/v1/credential"),
        );
        serde_json::from_slice(&out.stdout).expect("credential JSON")
    }

    /// Writes a loopback credential to DIR/loop-{ca,cert,key}.pem; returns (ca, cert, key).
    pub fn credential_files(&self, dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let c = self.credential();
        let ca = dir.join("loop-ca.pem");
        let cert = dir.join("loop-cert.pem");
        let key = dir.join("loop-key.pem");
        std::fs::write(&ca, c["certificateAuthorityPem"].as_str().expect("CA")).expect("write");
        std::fs::write(&cert, c["clientCertificatePem"].as_str().expect("cert")).expect("write");
        crate::write_private(&key, c["clientKeyPem"].as_str().expect("key").as_bytes());
        (ca, cert, key)
    }

    /// curl over the UNIX socket: `curl -sS --unix-socket SOCK ARGS... http://localhost{path}`.
    pub fn curl_unix(&self, args: &[&str], path: &str) -> Output {
        Command::new("curl")
            .args(["-sS", "--max-time", "60", "--unix-socket"])
            .arg(&self.socket)
            .args(args)
            .arg(format!("http://localhost{path}"))
            .output()
            .expect("run curl")
    }

    /// curl over loopback TLS with the files from [`ProxyProcess::credential_files`].
    pub fn curl_tls(
        &self,
        cred: &(PathBuf, PathBuf, PathBuf),
        args: &[&str],
        path: &str,
    ) -> Output {
        Command::new("curl")
            .args(["-sS", "--max-time", "60", "--cacert"])
            .arg(&cred.0)
            .arg("--cert")
            .arg(&cred.1)
            .arg("--key")
            .arg(&cred.2)
            .args(args)
            .arg(format!("{}{path}", self.tls_url()))
            .output()
            .expect("run curl")
    }

    /// Sends a signal to the proxy.
    pub fn signal(&self, sig: i32) {
        let pid = i32::try_from(self.guard.id()).expect("pid fits");
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig})");
    }

    /// Waits for the proxy to exit; panics after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.guard.try_wait() {
                return s;
            }
            if Instant::now() > deadline {
                panic!(
                    "hwkey proxy still running after {timeout:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The value of `series` in a Prometheus text; panics if absent.
pub fn metric_in(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

/// A raw HTTP/1.1 exchange on a stream: the proxy's UNIX socket by default, or its loopback
/// TLS listener ([`RawHttp::connect_tls`]).
pub struct RawHttp<S = UnixStream> {
    pub reader: BufReader<S>,
}

/// A loopback TLS client's stream (blocking).
pub type LoopbackTls = rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>;

impl RawHttp {
    pub fn connect(socket: &Path) -> RawHttp {
        let s = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
        s.set_read_timeout(Some(Duration::from_secs(20))).ok();
        RawHttp {
            reader: BufReader::new(s),
        }
    }
}

impl RawHttp<LoopbackTls> {
    /// Connects to the proxy's loopback TLS listener on `port` with `config` (a loopback
    /// credential: [`loopback_client_config`]); the handshake happens with the first request.
    pub fn connect_tls(port: u16, config: &std::sync::Arc<rustls::ClientConfig>) -> Self {
        let tcp = std::net::TcpStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("connect 127.0.0.1:{port}: {e}"));
        tcp.set_read_timeout(Some(Duration::from_secs(20))).ok();
        tcp.set_nodelay(true).ok();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
        let conn = rustls::ClientConnection::new(config.clone(), name).expect("client");
        RawHttp {
            reader: BufReader::new(rustls::StreamOwned::new(conn, tcp)),
        }
    }
}

/// A rustls client config holding the loopback credential `cred` (the control socket's JSON:
/// [`ProxyProcess::credential`]), HTTP/1.1 offered.
pub fn loopback_client_config(cred: &serde_json::Value) -> std::sync::Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let pem = |f: &str| cred[f].as_str().expect("field").as_bytes().to_vec();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem("certificateAuthorityPem")) {
        roots.add(c.expect("CA")).expect("root");
    }
    let chain: Vec<_> = CertificateDer::pem_slice_iter(&pem("clientCertificatePem"))
        .collect::<Result<_, _>>()
        .expect("cert");
    let key = PrivateKeyDer::from_pem_slice(&pem("clientKeyPem")).expect("key");
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .expect("client auth");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    std::sync::Arc::new(config)
}

/// GET /version over loopback TLS: (status code or "" when the proxy closed, resumed?).
pub fn loopback_get(config: &std::sync::Arc<rustls::ClientConfig>, port: u16) -> (String, bool) {
    let mut conn = rustls::ClientConnection::new(
        config.clone(),
        rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
    )
    .expect("client");
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok();
    use std::io::{Read as _, Write as _};
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    let _ = tls.write_all(b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let mut text = Vec::new();
    let _ = tls.read_to_end(&mut text);
    let resumed = conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (status, resumed)
}

impl<S: Read + Write> RawHttp<S> {
    pub fn send(&mut self, text: &str) {
        self.reader
            .get_mut()
            .write_all(text.as_bytes())
            .expect("write request");
    }

    /// Reads a status line and headers: (status, lowercased headers).
    pub fn read_head(&mut self) -> (u16, Vec<(String, String)>) {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.reader.read_line(&mut h).expect("header line");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        (status, headers)
    }

    /// Reads chunked watch lines until event `n` (`"name":"cm-N"`) shows up and returns it;
    /// panics if the stream ends, times out, or shows a later event first (one emitted after
    /// `n` cannot have arrived before it).
    pub fn read_watch_event(&mut self, n: u64) -> serde_json::Value {
        let wanted = format!("\"name\":\"cm-{n}\"");
        let later = format!("\"name\":\"cm-{}\"", n + 1);
        loop {
            let mut line = String::new();
            let read = self
                .reader
                .read_line(&mut line)
                .unwrap_or_else(|e| panic!("event {n} did not arrive: {e}"));
            assert!(read > 0, "stream ended before event {n}");
            assert!(
                !line.contains(&later),
                "an event arrived before it was emitted"
            );
            if line.contains(&wanted) {
                return serde_json::from_str(line.trim()).expect("a watch event is JSON");
            }
        }
    }

    /// Reads a response with Content-Length: (status, body).
    pub fn read_response(&mut self) -> (u16, String) {
        let (status, headers) = self.read_head();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .map(|(_, v)| v.parse().expect("content-length"))
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        self.reader.read_exact(&mut body).expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}
