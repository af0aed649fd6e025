//! Real TLS peers: `openssl s_server`, nginx and Go's crypto/tls, all requiring client
//! certificates.

use std::fs::{self};
use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use crate::*;

/// The nginx binary of Debian's `nginx-light` package.
pub const NGINX: &str = "/usr/sbin/nginx";

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
    /// Holds the log and certificates until the server is gone.
    _dir: TempDir,
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
        OpensslServer {
            guard,
            port,
            _dir: dir,
        }
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

/// `hsm-fixtures/go-tls-server.go`: HTTPS on Go's crypto/tls, configured as kube-apiserver's
/// listener is for client certificates (TLS 1.3, `RequireAndVerifyClientCert`); killed on Drop.
/// Resuming, it sends its session ticket with its `Finished`, as no rustls or OpenSSL server
/// does.
pub struct GoTlsServer {
    _guard: ChildGuard,
    port: u16,
    /// Holds the binary and the log until the server is gone.
    _dir: TempDir,
}

impl GoTlsServer {
    /// Builds and starts it on a free 127.0.0.1 port with `cert`/`key`, trusting client
    /// certificates from `client_ca`.
    pub fn start(cert: &Path, key: &Path, client_ca: &Path) -> GoTlsServer {
        let (bin, dir) = crate::oracle::build_go("go-tls-server");
        let log = dir.path().join("go-tls-server.log");
        let (guard, port) = start_server("go-tls-server", &log, free_port, |port| {
            let mut cmd = Command::new(&bin);
            cmd.arg(port.to_string()).arg(cert).arg(key).arg(client_ca);
            cmd
        });
        GoTlsServer {
            _guard: guard,
            port,
            _dir: dir,
        }
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }
}
