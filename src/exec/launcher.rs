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
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use super::settings::Settings;
use super::{control_client, ExecError};
use crate::control_api::ProxyInfo;
use crate::key::pin::PinSource;
use crate::key::KeyUri;
use crate::kubeconfig::PLUGIN_BINARY;

/// How long a starting proxy may take to answer on its control socket (opening a key may need a
/// TPM or a slow token).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes sure a proxy for these settings answers on the settings' control socket.
pub fn ensure_proxy(settings: &Settings, pin: Option<Zeroizing<String>>) -> Result<(), ExecError> {
    let sock = settings.control_socket();
    if let Ok(info) = control_client::info(&sock) {
        return same_proxy(settings, &info);
    }
    let start_err = |problem| ExecError::ProxyStart {
        server: settings.server.clone(),
        problem,
        log: String::new(),
    };
    crate::state_dir::ensure_private(&settings.state_dir).map_err(|source| {
        start_err(StartProblem::StateDir {
            path: settings.state_dir.to_path_buf(),
            source,
        })
    })?;
    // A control socket that is not ours is neither used nor removed.
    if std::fs::symlink_metadata(&sock).is_ok() {
        if let Err(e) = crate::state_dir::check_file(&sock) {
            if e.kind() == std::io::ErrorKind::PermissionDenied {
                return Err(start_err(StartProblem::ForeignSocket(e)));
            }
        }
    }
    let lock_path = settings.state_dir.start_lock();
    let lock = crate::state_dir::open_private(
        &lock_path,
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600),
    )
    .map_err(|source| {
        start_err(StartProblem::Open {
            path: lock_path.clone(),
            source,
        })
    })?;
    lock.lock().map_err(|source| {
        start_err(StartProblem::Lock {
            path: lock_path.clone(),
            source,
        })
    })?;
    // Someone else may have started it while we waited for the lock.
    let unanswered = match control_client::info(&sock) {
        Ok(info) => return same_proxy(settings, &info),
        Err(e) => e,
    };
    // A socket file nobody listens on is left by a proxy that was killed: remove it (under the
    // lock, so never a live one another plugin just created). One that a process still listens
    // on but that did not answer (a proxy stopped with SIGSTOP, busy, or of another hwkey
    // version) stays: a second proxy would fail on its port, and the first would keep running
    // without its socket.
    if std::fs::symlink_metadata(&sock).is_ok() {
        match std::os::unix::net::UnixStream::connect(&sock) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                if let Err(source) = fs::remove_file(&sock) {
                    return Err(start_err(StartProblem::Stale { path: sock, source }));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            _ => {
                return Err(start_err(StartProblem::Unanswered {
                    sock,
                    pid_file: settings.state_dir.proxy_pid(),
                    problem: Box::new(unanswered),
                }))
            }
        }
    }
    start(settings, pin, &lock)
}

/// Checks that the proxy answering in the state directory serves this kubeconfig's upstream
/// and key: a proxy left running for other settings must not carry this cluster's traffic.
pub fn same_proxy(settings: &Settings, info: &ProxyInfo) -> Result<(), ExecError> {
    let wanted_upstream = settings.upstream.to_string();
    let wanted_key = settings.key.without_pin().to_string();
    let running_upstream = info.upstream.as_str();
    // A proxy of an older hwkey does not report its key URI: compare what it reports.
    let running_key = info.key_uri.as_deref().unwrap_or(&wanted_key);
    // The forward proxy it was started with (this kubectl's environment, or the cluster's
    // proxy-url) must be the one this kubectl would use.
    let wanted_egress = wanted_egress(settings);
    let running_egress = info.egress.as_deref().unwrap_or(&wanted_egress);
    // The address kubectl will connect to (the kubeconfig's server): a proxy of the same state
    // directory listening elsewhere (the kubeconfig regenerated with another --port) would hand
    // out credentials for a port nobody serves.
    let running_server = info.server.as_deref().unwrap_or("no loopback address");
    let same_address = info
        .server
        .as_deref()
        .and_then(|s| super::settings::listen_from_server(s).ok())
        .is_some_and(|l| l == settings.listen);
    if running_upstream == wanted_upstream
        && running_key == wanted_key
        && running_egress == wanted_egress
        && same_address
    {
        return Ok(());
    }
    // The pid from the proxy's own answer: proxy.pid may be another proxy's, long gone.
    Err(ExecError::ProxyMismatch {
        state_dir: settings.state_dir.to_path_buf(),
        running: format!(
            "upstream {running_upstream}, key {running_key}, connecting {running_egress}, listening at {running_server}"
        ),
        wanted: format!(
            "upstream {wanted_upstream}, key {wanted_key}, connecting {wanted_egress}, listening at {}",
            settings.server
        ),
        pid: info.pid.to_string(),
    })
}

/// How a proxy started now would connect (see [`start`]: the cluster's proxy-url is handed
/// over as `HWKEY_UPSTREAM_PROXY`, else it inherits this environment), in the words of
/// [`crate::egress::Egress::routes`].
fn wanted_egress(settings: &Settings) -> String {
    use crate::egress::{Egress, ForwardProxy};
    let explicit = settings.upstream_proxy.clone().or_else(|| {
        std::env::var("HWKEY_UPSTREAM_PROXY")
            .ok()
            .filter(|v| !v.is_empty())
    });
    let egress = match explicit {
        Some(url) => ForwardProxy::parse(&url).map(Egress::through),
        None => Egress::from_env(),
    };
    match egress {
        Ok(e) => e.routes(std::iter::once(&settings.upstream)),
        Err(e) => format!("nowhere ({e})"),
    }
}

fn start(
    settings: &Settings,
    pin: Option<Zeroizing<String>>,
    _lock: &File,
) -> Result<(), ExecError> {
    let log_path = settings.state_dir.proxy_log();
    let fail = |problem| ExecError::ProxyStart {
        server: settings.server.clone(),
        problem,
        log: last_log_line(&log_path),
    };
    let open_err = |source| {
        fail(StartProblem::Open {
            path: log_path.clone(),
            source,
        })
    };
    let exe = proxy_binary().map_err(fail)?;
    let mut log = crate::state_dir::open_private(
        &log_path,
        OpenOptions::new().create(true).append(true).mode(0o600),
    )
    .map_err(open_err)?;
    let _ = writeln!(
        log,
        "--- hwkey credential starting the proxy for {}",
        settings.server
    );
    let pin = pin_for_stdin(settings, pin);
    let stderr = log.try_clone().map_err(open_err)?;
    let mut cmd = proxy_command(exe, settings, pin.is_some());
    cmd.stdin(if pin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::from(stderr))
    // Its own process group: kubectl's Ctrl-C must not take the shared proxy down.
    .process_group(0);
    let mut child = cmd.spawn().map_err(|e| fail(StartProblem::Spawn(e)))?;
    if let (Some(p), Some(mut stdin)) = (&pin, child.stdin.take()) {
        let mut line = Zeroizing::new(p.as_bytes().to_vec());
        line.push(b'\n');
        // The pipe closes when `stdin` drops: the proxy reads one line, then end of file.
        if let Err(e) = stdin.write_all(&line) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(StartProblem::Pin(e)));
        }
    }
    drop(pin);
    // Operators (and tests) find the detached proxy by this file.
    let _ = crate::atomic_file::write_atomic(
        &settings.state_dir.proxy_pid(),
        format!("{}\n", child.id()).as_bytes(),
        0o600,
    );
    wait_until_ready(settings, &mut child).map_err(|e| match e {
        Waited::PinRefused => ExecError::ProxyPinRefused {
            server: settings.server.clone(),
            log: last_log_line(&log_path),
        },
        Waited::Failed(problem) => fail(problem),
    })
}

/// A PIN that is not in a file or the environment (prompted, or a pin-value, which the URI's
/// text never shows) reaches the proxy on its standard input: a pipe only it reads, never argv
/// or the environment (both readable in /proc).
fn pin_for_stdin(settings: &Settings, pin: Option<Zeroizing<String>>) -> Option<Zeroizing<String>> {
    match (&settings.key, pin) {
        (_, Some(p)) => Some(p),
        (KeyUri::Pkcs11(u), None) => match &u.pin {
            Some(PinSource::Value(v)) => Some(v.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// `hwkey proxy` with the settings of this kubeconfig.
fn proxy_command(exe: PathBuf, settings: &Settings, pin_on_stdin: bool) -> Command {
    let mut cmd = Command::new(exe);
    // The plugin's inputs (which may name a forward proxy with its credentials) are not the
    // proxy's: it takes its settings as flags, and the forward proxy below.
    cmd.env_remove(crate::kubeconfig::CLUSTER_ENV)
        .env_remove("KUBERNETES_EXEC_INFO");
    cmd.arg("proxy")
        .arg("--key")
        .arg(settings.key.to_string())
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
    if let Some(p) = &settings.upstream_proxy {
        cmd.env("HWKEY_UPSTREAM_PROXY", p);
    }
    if pin_on_stdin {
        cmd.arg("--pin-stdin");
    }
    if settings.renew {
        cmd.arg("--renew");
    }
    if let Some(handle) = settings.attest {
        cmd.arg("--attest")
            .arg("--ak-handle")
            .arg(format!("{handle:#010x}"));
    }
    cmd
}

/// How waiting for a started proxy ended, when not with its control socket answering.
enum Waited {
    PinRefused,
    Failed(StartProblem),
}

/// Waits until the started proxy answers on its control socket, exits, or [`START_TIMEOUT`]
/// passes (then it is killed).
fn wait_until_ready(settings: &Settings, child: &mut std::process::Child) -> Result<(), Waited> {
    let sock = settings.control_socket();
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if control_client::info(&sock).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            if status.code() == Some(i32::from(crate::key::pin::EXIT_PIN_REFUSED)) {
                // Typed, so the plugin exits with the PIN-refused code too.
                return Err(Waited::PinRefused);
            }
            return Err(Waited::Failed(StartProblem::Exited(status)));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Waited::Failed(StartProblem::Silent { sock }));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Why the exec plugin could not start a proxy, for [`ExecError::ProxyStart`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum StartProblem {
    #[error("cannot use the state directory {}: {source}", .path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing the control socket: {0}")]
    ForeignSocket(#[source] std::io::Error),
    #[error("cannot open {}: {source}", .path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot lock {}: {source}", .path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a stale control socket {} is in the way and cannot be removed: {source}", .path.display())]
    Stale {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a process listens on the control socket {} but did not answer as this hwkey's proxy ({problem}): a proxy stopped (SIGSTOP), busy, or of another hwkey version; hwkey starts no second proxy beside it. Resume or stop it (its pid is in {}) and try again", .sock.display(), .pid_file.display())]
    Unanswered {
        sock: PathBuf,
        pid_file: PathBuf,
        #[source]
        problem: Box<ExecError>,
    },
    #[error("cannot find the hwkey binary: {0}")]
    NoExe(#[source] std::io::Error),
    #[error("{PLUGIN_BINARY} starts the proxy with the hwkey binary next to it, and {} does not exist (install both: `cargo install --path .` does)", .0.display())]
    NoHwkey(PathBuf),
    #[error("cannot run hwkey proxy: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("cannot hand the PIN to the proxy: {0}")]
    Pin(#[source] std::io::Error),
    #[error("it exited ({0})")]
    Exited(std::process::ExitStatus),
    #[error("it did not answer on {} within {}s", .sock.display(), START_TIMEOUT.as_secs())]
    Silent { sock: PathBuf },
}

/// The proxy's last complaint, for the one-line error kubectl shows.
fn last_log_line(path: &Path) -> String {
    let text = log_tail(path).unwrap_or_default();
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("---"))
        .map(|l| format!(": {l} (log: {})", path.display()))
        .unwrap_or_default()
}

/// The end of the proxy's log (its last 64 KiB: the log grows for the proxy's life), opened as a
/// state file ([`crate::state_dir::open_private`]).
fn log_tail(path: &Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 * 1024;
    let mut f = crate::state_dir::open_private(path, OpenOptions::new().read(true))?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
    let mut bytes = Vec::new();
    f.take(TAIL).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The binary that runs `hwkey proxy`: this one, or the `hwkey` installed next to
/// `hwkey-credential`.
pub fn proxy_binary() -> Result<PathBuf, StartProblem> {
    let exe = std::env::current_exe().map_err(StartProblem::NoExe)?;
    if !crate::kubeconfig::is_plugin_binary(&exe) {
        return Ok(exe);
    }
    let hwkey = exe.with_file_name("hwkey");
    if hwkey.is_file() {
        Ok(hwkey)
    } else {
        Err(StartProblem::NoHwkey(hwkey))
    }
}
