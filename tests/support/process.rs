//! Child processes that are killed and reaped on Drop, and `Command` runners that fail with
//! the command's own output.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::*;

/// How long a started server may take to accept connections.
pub const START_TIMEOUT: Duration = Duration::from_secs(15);

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
pub(crate) fn start_server(
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

/// The hwkey binary under test: `HWKEY_BIN` when set, else the `hwkey` that Cargo built beside
/// the running test or bench binary (`target/PROFILE/deps/it-…` → `target/PROFILE/hwkey`).
/// Cargo builds a package's binaries before its integration tests and benches run, and this
/// crate is not the hwkey package, so `CARGO_BIN_EXE_hwkey` is not visible here.
pub fn hwkey_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("HWKEY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("path of the running test binary");
    let mut dir = exe
        .parent()
        .expect("test binary has a directory")
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("hwkey");
    assert!(
        bin.is_file(),
        "{} does not exist: run the tests through `cargo test` (which builds it) or set HWKEY_BIN",
        bin.display()
    );
    bin
}

/// A `Command` for the hwkey binary under test, with `RUST_LOG` removed from its environment.
pub fn hwkey() -> Command {
    let mut cmd = Command::new(hwkey_bin());
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

/// The resident set size of process `pid` in KiB (`VmRSS` in `/proc/PID/status`): the memory
/// figure the tests bound and the benches report.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A field of `/proc/PID/status` (empty when the process or the field is not there).
pub fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{field}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// The pids of `pid`'s children (over all its threads).
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|t| std::fs::read_to_string(t.path().join("children")).unwrap_or_default())
        .collect::<Vec<String>>()
        .join(" ")
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Fails unless the test runs as root, saying `why` it needs root (CI runs as root).
pub fn require_root(why: &str) {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective uid.
    let uid = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    assert_eq!(uid, 0, "{why}: run it as root (CI does)");
}

/// True when `needle` is anywhere in `pid`'s readable memory (every mapping `/proc/PID/maps`
/// lists as readable, freed heap included), its command line or its environment. Needs root
/// for a process that made itself undumpable.
pub fn memory_holds(pid: u32, needle: &[u8]) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    for file in ["cmdline", "environ"] {
        if found(&std::fs::read(format!("/proc/{pid}/{file}")).unwrap_or_default()) {
            return true;
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read maps");
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("open mem");
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.ends_with("[vvar]") || line.ends_with("[vsyscall]") {
            continue;
        }
        let (start, end) = range.split_once('-').expect("a range");
        let start = u64::from_str_radix(start, 16).expect("hex");
        let end = u64::from_str_radix(end, 16).expect("hex");
        let mut bytes = vec![0u8; (end - start) as usize];
        if mem.seek(SeekFrom::Start(start)).is_ok()
            && mem.read_exact(&mut bytes).is_ok()
            && found(&bytes)
        {
            return true;
        }
    }
    false
}
