//! Finding the proxy for a cluster, and starting it when there is none.
//!
//! One proxy per state directory. Two kubectl processes started at the same moment must start
//! one proxy: the check-and-start runs under an exclusive lock on `STATE_DIR/start.lock`, and
//! the second caller finds the first one's proxy answering when it gets the lock. The proxy is
//! started detached (its own process group, stdio to `STATE_DIR/proxy.log`) and exits by itself
//! after `--idle-exit` without clients.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use super::settings::Settings;
use super::{control_client, ExecError};
use crate::control_api::ProxyInfo;
use crate::key::pin::PinSource;
use crate::key::KeyUri;

/// How long a starting proxy may take to answer on its control socket (opening a key may need a
/// TPM or a slow token).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes sure a proxy for these settings answers on the settings' control socket.
pub fn ensure_proxy(settings: &Settings, pin: Option<Zeroizing<String>>) -> Result<(), ExecError> {
    let sock = settings.control_socket();
    if let Ok(info) = control_client::info(&sock) {
        return same_proxy(settings, &info);
    }
    let start_err = |reason: String| ExecError::ProxyStart {
        server: settings.server.clone(),
        reason,
        log: String::new(),
    };
    crate::state_dir::ensure_private(&settings.state_dir).map_err(|e| {
        start_err(format!(
            "cannot use the state directory {}: {e}",
            settings.state_dir.display()
        ))
    })?;
    // A control socket that is not ours is neither used nor removed.
    if std::fs::symlink_metadata(&sock).is_ok() {
        if let Err(e) = crate::state_dir::check_file(&sock) {
            if e.kind() == std::io::ErrorKind::PermissionDenied {
                return Err(start_err(format!("refusing the control socket: {e}")));
            }
        }
    }
    let lock_path = settings.state_dir.start_lock();
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
    if let Ok(info) = control_client::info(&sock) {
        return same_proxy(settings, &info);
    }
    // A socket file nobody answers on is left by a proxy that was killed: remove it (under the
    // lock, so never a live one another plugin just created).
    if std::fs::symlink_metadata(&sock).is_ok() {
        if let Err(e) = fs::remove_file(&sock) {
            return Err(start_err(format!(
                "a stale control socket {} is in the way and cannot be removed: {e}",
                sock.display()
            )));
        }
    }
    start(settings, pin, &lock)
}

/// Checks that the proxy answering in the state directory serves this kubeconfig's upstream
/// and key: a proxy left running for other settings must not carry this cluster's traffic.
fn same_proxy(settings: &Settings, info: &ProxyInfo) -> Result<(), ExecError> {
    let wanted_upstream = settings.upstream.to_string();
    let wanted_key = settings.key.without_pin().to_string();
    let running_upstream = info.upstream.as_str();
    // A proxy of an older hwkey does not report its key URI: compare what it reports.
    let running_key = info.key_uri.as_deref().unwrap_or(&wanted_key);
    if running_upstream == wanted_upstream && running_key == wanted_key {
        return Ok(());
    }
    // The pid from the proxy's own answer: proxy.pid may be another proxy's, long gone.
    Err(ExecError::ProxyMismatch {
        state_dir: settings.state_dir.to_path_buf(),
        running: format!("upstream {running_upstream}, key {running_key}"),
        wanted: format!("upstream {wanted_upstream}, key {wanted_key}"),
        pid: info.pid.to_string(),
    })
}

fn start(
    settings: &Settings,
    pin: Option<Zeroizing<String>>,
    _lock: &File,
) -> Result<(), ExecError> {
    let log_path = settings.state_dir.proxy_log();
    let fail = |reason: String| ExecError::ProxyStart {
        server: settings.server.clone(),
        reason,
        log: last_log_line(&log_path),
    };
    let exe = super::proxy_binary().map_err(fail)?;
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

    // A PIN that is not in a file or the environment (prompted, or a pin-value, which the URI's
    // text never shows) reaches the proxy on its standard input: a pipe only it reads, never
    // argv or the environment (both readable in /proc).
    let pin = match (&settings.key, pin) {
        (_, Some(p)) => Some(p),
        (KeyUri::Pkcs11(u), None) => match &u.pin {
            Some(PinSource::Value(v)) => Some(v.clone()),
            _ => None,
        },
        _ => None,
    };
    let key = settings.key.clone();

    let mut cmd = Command::new(exe);
    cmd.arg("proxy")
        .arg("--key")
        .arg(key.to_string())
        .arg("--upstream")
        .arg(settings.upstream.to_string())
        .arg("--listen")
        .arg(&settings.listen)
        .arg("--state-dir")
        .arg(&settings.state_dir)
        .arg("--idle-exit")
        .arg(humantime::format_duration(settings.idle_exit).to_string());
    if let Some(c) = &settings.cert {
        cmd.arg("--cert").arg(c);
    }
    if let Some(c) = &settings.upstream_ca {
        cmd.arg("--upstream-ca").arg(c);
    }
    if let Some(n) = &settings.tls_server_name {
        cmd.arg("--tls-server-name").arg(n);
    }
    if pin.is_some() {
        cmd.arg("--pin-stdin");
    }
    let stderr = log
        .try_clone()
        .map_err(|e| fail(format!("cannot open {}: {e}", log_path.display())))?;
    cmd.stdin(if pin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::from(stderr))
    // Its own process group: kubectl's Ctrl-C must not take the shared proxy down.
    .process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot run hwkey proxy: {e}")))?;
    if let (Some(p), Some(mut stdin)) = (&pin, child.stdin.take()) {
        let mut line = Zeroizing::new(p.as_bytes().to_vec());
        line.push(b'\n');
        // The pipe closes when `stdin` drops: the proxy reads one line, then end of file.
        if let Err(e) = stdin.write_all(&line) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!("cannot hand the PIN to the proxy: {e}")));
        }
    }
    drop(pin);
    // Operators (and tests) find the detached proxy by this file.
    let _ = crate::atomic_file::write_atomic(
        &settings.state_dir.proxy_pid(),
        format!("{}\n", child.id()).as_bytes(),
        0o600,
    );

    let sock = settings.control_socket();
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if control_client::info(&sock).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            if status.code() == Some(i32::from(crate::key::pin::EXIT_PIN_REFUSED)) {
                // Typed, so the plugin exits with the PIN-refused code too (issue 22, 14).
                return Err(ExecError::ProxyPinRefused {
                    server: settings.server.clone(),
                    log: last_log_line(&log_path),
                });
            }
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
