//! Real forward proxies from Debian on loopback ports of the test's own: squid (HTTP CONNECT,
//! with or without Basic authentication) and dante (SOCKS5), and a firewall rule that makes an
//! API server reachable only through them.

use std::process::Command;

use tempfile::TempDir;

use std::time::Duration;

use crate::{free_port, require_tool, run_ok, temp_dir, ChildGuard};

/// A squid on 127.0.0.1.
pub struct Squid {
    pub port: u16,
    dir: TempDir,
    _child: ChildGuard,
}

impl Squid {
    /// Starts squid allowing CONNECT to any port; with `auth` (user, password) it requires
    /// Basic proxy authentication (`basic_ncsa_auth` against an htpasswd file).
    pub fn start(auth: Option<(&str, &str)>) -> Squid {
        require_tool("squid", "squid");
        let dir = temp_dir();
        let d = dir.path();
        // squid drops to the `proxy` user: it must be able to write its logs here.
        run_ok(Command::new("chmod").arg("0777").arg(d));
        let port = free_port();
        let mut conf = format!(
            "http_port 127.0.0.1:{port}\n\
             pid_filename none\n\
             cache deny all\n\
             cache_mem 8 MB\n\
             shutdown_lifetime 0 seconds\n\
             access_log stdio:{d}/access.log\n\
             cache_log {d}/cache.log\n\
             coredump_dir {d}\n\
             acl CONNECT method CONNECT\n",
            d = d.display()
        );
        match auth {
            Some((user, password)) => {
                let hash = run_ok(Command::new("openssl").args(["passwd", "-apr1", password]));
                let line = format!("{user}:{}", String::from_utf8_lossy(&hash.stdout).trim());
                std::fs::write(d.join("passwd"), line + "\n").expect("write passwd");
                conf.push_str(&format!(
                    "auth_param basic program /usr/lib/squid/basic_ncsa_auth {}/passwd\n\
                     auth_param basic realm hwkey-test\n\
                     acl authed proxy_auth REQUIRED\n\
                     http_access allow CONNECT authed\n",
                    d.display()
                ));
            }
            None => conf.push_str("http_access allow CONNECT localhost\n"),
        }
        conf.push_str("http_access deny all\n");
        std::fs::write(d.join("squid.conf"), conf).expect("write squid.conf");
        let mut cmd = Command::new("squid");
        cmd.args(["-N", "-f"]).arg(d.join("squid.conf"));
        let mut child = ChildGuard::spawn(&mut cmd, "squid", &d.join("squid.out"));
        if let Err(e) = child.wait_for_port(port, Duration::from_secs(30)) {
            panic!(
                "squid did not start: {e}\n{}",
                std::fs::read_to_string(d.join("cache.log")).unwrap_or_default()
            );
        }
        Squid {
            port,
            dir,
            _child: child,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// squid's access log: one line per request (`CONNECT 127.0.0.1:6443 user …`).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }
}

/// A dante SOCKS5 server on 127.0.0.1, without authentication.
pub struct Dante {
    pub port: u16,
    dir: TempDir,
    _child: ChildGuard,
}

impl Dante {
    /// Starts danted allowing CONNECT from loopback to anywhere; it connects out as `nobody`.
    pub fn start() -> Dante {
        require_tool("danted", "dante-server");
        let dir = temp_dir();
        let d = dir.path();
        let port = free_port();
        let conf = format!(
            "logoutput: {d}/danted.log\n\
             internal: 127.0.0.1 port = {port}\n\
             external: 127.0.0.1\n\
             clientmethod: none\n\
             socksmethod: none\n\
             user.privileged: root\n\
             user.unprivileged: nobody\n\
             client pass {{\n  from: 127.0.0.0/8 to: 0.0.0.0/0\n  log: error\n}}\n\
             socks pass {{\n  from: 127.0.0.0/8 to: 0.0.0.0/0\n  command: connect\n  log: connect error\n}}\n",
            d = d.display()
        );
        std::fs::write(d.join("danted.conf"), conf).expect("write danted.conf");
        let mut cmd = Command::new("danted");
        cmd.args(["-N", "1", "-f"]).arg(d.join("danted.conf"));
        let mut child = ChildGuard::spawn(&mut cmd, "danted", &d.join("danted.out"));
        if let Err(e) = child.wait_for_port(port, Duration::from_secs(30)) {
            panic!(
                "danted did not start: {e}\n{}",
                std::fs::read_to_string(d.join("danted.log")).unwrap_or_default()
            );
        }
        Dante {
            port,
            dir,
            _child: child,
        }
    }

    /// `socks5://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("socks5://127.0.0.1:{}", self.port)
    }

    /// dante's log (one line per connection it passed).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("danted.log")).unwrap_or_default()
    }
}

/// An iptables rule: TCP to 127.0.0.1:`port` is refused unless the connecting process runs as
/// `uid_owner` (the forward proxy's user). Removed on drop.
pub struct OnlyThrough {
    rule: Vec<String>,
}

impl OnlyThrough {
    /// Blocks `port` on loopback for everyone but `user`.
    pub fn user(port: u16, user: &str) -> OnlyThrough {
        require_tool("iptables", "iptables");
        assert!(
            is_root(),
            "the forward-proxy tests firewall the API server's loopback port with iptables, which needs root: run them as root (CI does)"
        );
        let rule: Vec<String> = [
            "OUTPUT",
            "-o",
            "lo",
            "-p",
            "tcp",
            "-d",
            "127.0.0.1",
            "--dport",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([port.to_string()])
        .chain(
            [
                "-m",
                "owner",
                "!",
                "--uid-owner",
                user,
                "-j",
                "REJECT",
                "--reject-with",
                "tcp-reset",
            ]
            .iter()
            .map(|s| s.to_string()),
        )
        .collect();
        run_ok(Command::new("iptables").arg("-I").args(&rule));
        OnlyThrough { rule }
    }
}

impl Drop for OnlyThrough {
    fn drop(&mut self) {
        let _ = Command::new("iptables").arg("-D").args(&self.rule).status();
    }
}

fn is_root() -> bool {
    // `id -u` rather than libc: the support crate has no libc dependency of its own.
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
