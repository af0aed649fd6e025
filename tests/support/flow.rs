//! The operator's flow, shared by the PKCS#11 and TPM command-line tests: create a key, make a
//! CSR that `openssl req -verify` accepts, have the test CA issue a certificate, import it, and
//! `hwkey probe` servers that require and verify client certificates.

use std::path::PathBuf;
use std::process::{Command, Output};

use tempfile::TempDir;

use crate::{hwkey, output_text, run_ok, Nginx, OpensslServer, TestCa, TlsVersion};

/// A test CA with a server certificate, a scratch dir, and the environment the key needs
/// (`SOFTHSM2_CONF` or nothing: TPM URIs carry their TCTI).
pub struct Flow {
    pub ca: TestCa,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub dir: TempDir,
    pub envs: Vec<(String, String)>,
}

impl Flow {
    /// A new CA and server certificate; `envs` go to every hwkey process.
    pub fn new(envs: Vec<(String, String)>) -> Flow {
        let dir = crate::temp_dir();
        let ca = TestCa::new(dir.path());
        let (server_cert, server_key) = ca.server_cert(dir.path());
        Flow {
            ca,
            server_cert,
            server_key,
            dir,
            envs,
        }
    }

    /// `hwkey` with this flow's environment.
    pub fn hwkey(&self) -> Command {
        let mut cmd = hwkey();
        cmd.envs(self.envs.clone());
        cmd
    }

    /// A path in the scratch dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `hwkey csr` → `openssl req -verify` → the test CA → `hwkey cert import`; returns the cert.
    pub fn certify(&self, uri: &str, cn: &str) -> PathBuf {
        let csr = self.path(&format!("{cn}.csr"));
        run_ok(self.hwkey().args(["csr", "--key", uri]).args([
            "--subject",
            &format!("CN={cn},O=devs"),
            "--dns",
            &format!("{cn}.example"),
            "--ip",
            "127.0.0.1",
            "--out",
            csr.to_str().expect("utf-8"),
        ]));
        let verify = run_ok(
            Command::new("openssl")
                .args(["req", "-verify", "-noout", "-in"])
                .arg(&csr),
        );
        assert!(
            output_text(&verify).contains("verify OK"),
            "openssl req -verify: {}",
            output_text(&verify)
        );
        let crt = self.path(&format!("{cn}.crt"));
        self.ca.sign_csr_file(&csr, 30, &crt);
        run_ok(
            self.hwkey()
                .args(["cert", "import", "--key", uri, "--cert"])
                .arg(&crt),
        );
        crt
    }

    /// `hwkey probe` with the test CA; must succeed.
    pub fn probe(&self, uri: &str, url: &str) -> Output {
        self.probe_with(uri, url, &[])
    }

    /// [`Flow::probe`] with more flags.
    pub fn probe_with(&self, uri: &str, url: &str, flags: &[&str]) -> Output {
        run_ok(
            self.hwkey()
                .args(["probe", "--key", uri, "--ca"])
                .arg(self.ca.ca_path())
                .args(flags)
                .arg(url),
        )
    }

    /// The whole flow for a key that does not exist yet: create with `algorithm`, certify, then
    /// probe openssl s_server (TLS 1.3, then TLS 1.2 — RSA restricted to PKCS#1 v1.5 by the
    /// server) and nginx, each requiring and verifying the client certificate.
    pub fn create_certify_probe(&self, uri: &str, algorithm: &str) {
        let created =
            run_ok(
                self.hwkey()
                    .args(["key", "create", "--key", uri, "--algorithm", algorithm]),
            );
        let pem = stdout(&created);
        assert!(pem.starts_with("-----BEGIN PUBLIC KEY-----"), "{pem}");
        let public = run_ok(self.hwkey().args(["key", "public", "--key", uri]));
        assert_eq!(
            stdout(&public),
            pem,
            "key public prints what create printed"
        );

        self.certify_and_probe(uri, algorithm);
    }

    /// Certifies an existing key for `CN=alice,O=devs` and probes s_server (TLS 1.3, and 1.2
    /// with `--allow-tls12-fallback` only) and nginx with it, all requiring and verifying
    /// client certificates.
    pub fn certify_and_probe(&self, uri: &str, algorithm: &str) {
        self.certify(uri, "alice");
        let show = run_ok(self.hwkey().args(["cert", "show", "--key", uri]));
        assert!(
            stdout(&show).contains("matches key: yes"),
            "{}",
            stdout(&show)
        );
        assert!(stdout(&show).contains("CN=alice"), "{}", stdout(&show));

        let rsa = algorithm.starts_with("rsa");
        let tls13_scheme = match algorithm {
            "ec-p256" => "ecdsa_secp256r1_sha256",
            "ec-p384" => "ecdsa_secp384r1_sha384",
            _ => "rsa_pss_rsae_sha256",
        };
        let ca = self.ca.ca_path();

        let server =
            OpensslServer::start(&ca, &self.server_cert, &self.server_key, TlsVersion::Tls13);
        let out = self.probe(uri, &server.url());
        assert!(stderr(&out).contains("tls: TLSv1.3"), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("client signature: {tls13_scheme}")),
            "{}",
            stderr(&out)
        );
        assert!(
            stdout(&out).contains("CN=alice") || server.log().contains("CN = alice"),
            "s_server saw the hardware identity: {}\n{}",
            stdout(&out),
            server.log()
        );
        drop(server);

        let extra: &[&str] = if rsa {
            &["-client_sigalgs", "RSA+SHA256"]
        } else {
            &[]
        };
        let server = OpensslServer::start_with(
            &ca,
            &self.server_cert,
            &self.server_key,
            TlsVersion::Tls12,
            extra,
        );
        // TLS 1.2 only with the fallback flag: without it the signer signs no 1.2 transcript
        // and the client offers 1.3 alone.
        let refused = crate::run_fail(
            self.hwkey()
                .args(["probe", "--key", uri, "--ca"])
                .arg(self.ca.ca_path())
                .arg(server.url()),
        );
        assert!(!refused.status.success());
        let out = self.probe_with(uri, &server.url(), &["--allow-tls12-fallback"]);
        let tls12_scheme = if rsa {
            "rsa_pkcs1_sha256"
        } else {
            tls13_scheme
        };
        assert!(stderr(&out).contains("tls: TLSv1.2"), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("client signature: {tls12_scheme}")),
            "{}",
            stderr(&out)
        );
        drop(server);

        let nginx = Nginx::start(&ca, &self.server_cert, &self.server_key);
        let out = self.probe(uri, &nginx.url());
        assert!(
            stdout(&out).contains("client=O=devs,CN=alice"), // nginx prints RFC 2253 order (last RDN first)
            "nginx saw the hardware identity: {}",
            stdout(&out)
        );
    }
}

/// stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs a command that must fail cleanly: non-zero exit, nothing on stdout, every needle in
/// stderr, no panic. Returns stderr.
pub fn fails_with(cmd: &mut Command, needles: &[&str]) -> String {
    let out = crate::run_fail(cmd);
    let err = stderr(&out);
    assert!(
        out.stdout.is_empty(),
        "stdout must stay empty on error: {}",
        stdout(&out)
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    for n in needles {
        assert!(err.contains(n), "expected '{n}' in: {err}");
    }
    err
}
