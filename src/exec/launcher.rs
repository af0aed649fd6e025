//! Finding the proxy for a cluster, and starting it when there is none.
//!
//! One proxy per state directory. Two kubectl processes started at the same moment must start
//! one proxy: the check-and-start runs under an exclusive lock on `STATE_DIR/start.lock`, and
//! the second caller finds the first one's proxy answering when it gets the lock. The proxy is
//! started detached (its own process group, stdio to `STATE_DIR/proxy.log`) and exits by itself
//! after `--idle-exit` without clients.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use super::settings::{with_env_pin, Settings};
use super::{control_client, ExecError};
use crate::key::pin::PinSource;
use crate::key::KeyUri;

/// How long a starting proxy may take to answer on its control socket (opening a key may need a
/// TPM or a slow token).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The environment variable that carries a prompted PIN to the proxy process (never argv).
const PIN_VAR: &str = "HWKEY_PROXY_PIN";

/// Makes sure a proxy answers on the settings' control socket.
pub fn ensure_proxy(settings: &Settings, pin: Option<Zeroizing<String>>) -> Result<(), ExecError> {
    let sock = settings.control_socket();
    if control_client::get_json(&sock, "/v1/info").is_ok() {
        return Ok(());
    }
    let start_err = |reason: String| ExecError::ProxyStart {
        server: settings.server.clone(),
        reason,
        log: String::new(),
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&settings.state_dir)
        .map_err(|e| {
            start_err(format!(
                "cannot create {}: {e}",
                settings.state_dir.display()
            ))
        })?;
    let lock_path = settings.state_dir.join("start.lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .map_err(|e| start_err(format!("cannot open {}: {e}", lock_path.display())))?;
    lock.lock()
        .map_err(|e| start_err(format!("cannot lock {}: {e}", lock_path.display())))?;
    // Someone else may have started it while we waited for the lock.
    if control_client::get_json(&sock, "/v1/info").is_ok() {
        return Ok(());
    }
    start(settings, pin, &lock)
}

fn start(
    settings: &Settings,
    pin: Option<Zeroizing<String>>,
    _lock: &File,
) -> Result<(), ExecError> {
    let log_path = settings.state_dir.join("proxy.log");
    let fail = |reason: String| ExecError::ProxyStart {
        server: settings.server.clone(),
        reason,
        log: last_log_line(&log_path),
    };
    let exe =
        std::env::current_exe().map_err(|e| fail(format!("cannot find the hwkey binary: {e}")))?;
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&log_path)
        .map_err(|e| fail(format!("cannot open {}: {e}", log_path.display())))?;
    let _ = writeln!(
        log,
        "--- hwkey credential starting the proxy for {}",
        settings.server
    );

    // A PIN that is not in a file or the environment reaches the proxy through its environment.
    let pin = match (&settings.key, pin) {
        (_, Some(p)) => Some(p),
        (KeyUri::Pkcs11(u), None) => match &u.pin {
            Some(PinSource::Value(v)) => Some(v.clone()),
            _ => None,
        },
        _ => None,
    };
    let key = if pin.is_some() {
        with_env_pin(&settings.key, PIN_VAR)
    } else {
        settings.key.clone()
    };

    let mut cmd = Command::new(exe);
    cmd.arg("proxy")
        .arg("--key")
        .arg(key.to_string())
        .arg("--upstream")
        .arg(&settings.upstream)
        .arg("--listen")
        .arg(&settings.listen)
        .arg("--state-dir")
        .arg(&settings.state_dir)
        .arg("--idle-exit")
        .arg(&settings.idle_exit);
    if let Some(c) = &settings.cert {
        cmd.arg("--cert").arg(c);
    }
    if let Some(c) = &settings.upstream_ca {
        cmd.arg("--upstream-ca").arg(c);
    }
    if let Some(n) = &settings.tls_server_name {
        cmd.arg("--tls-server-name").arg(n);
    }
    if let Some(p) = &pin {
        cmd.env(PIN_VAR, p.as_str());
    }
    let stderr = log
        .try_clone()
        .map_err(|e| fail(format!("cannot open {}: {e}", log_path.display())))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        // Its own process group: kubectl's Ctrl-C must not take the shared proxy down.
        .process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot run hwkey proxy: {e}")))?;
    drop(pin);
    // Operators (and tests) find the detached proxy by this file.
    let _ = crate::atomic_file::write_atomic(
        &settings.state_dir.join("proxy.pid"),
        format!("{}\n", child.id()).as_bytes(),
        0o600,
    );

    let sock = settings.control_socket();
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if control_client::get_json(&sock, "/v1/info").is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(fail(format!("it exited ({status})")));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "it did not answer on {} within {}s",
                sock.display(),
                START_TIMEOUT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The proxy's last complaint, for the one-line error kubectl shows.
fn last_log_line(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("---"))
        .map(|l| format!(": {l} (log: {})", path.display()))
        .unwrap_or_default()
}
