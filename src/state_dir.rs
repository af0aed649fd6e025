//! The state directory (loopback CA key, control socket, start lock, logs) must belong to the
//! user who runs hwkey and be writable by nobody else: a proxy that loaded a CA key from a
//! directory another user controls would mint loopback credentials that user chose, and a
//! control socket planted by another user would hand out that user's credentials. Files in it
//! are opened without following symbolic links.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// A proxy's state directory, and every file in it named in one place: the proxy, the exec
/// plugin that starts it, `doctor` and the lifecycle all find the same control socket, lock,
/// log and key pointer through this type, never through a literal of their own.
///
/// It dereferences to its [`Path`], so code that only needs the directory uses it as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir(PathBuf);

impl StateDir {
    /// The state directory at `path`.
    pub fn new(path: impl Into<PathBuf>) -> StateDir {
        StateDir(path.into())
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The proxy's control socket (`hwkey credential` asks it for loopback credentials).
    pub fn control_socket(&self) -> PathBuf {
        self.0.join("control.sock")
    }

    /// The lock `hwkey credential` holds while it starts a proxy, so two kubectl calls at once
    /// start one.
    pub fn start_lock(&self) -> PathBuf {
        self.0.join("start.lock")
    }

    /// The pid of a proxy the exec plugin started (operators and tests find it there).
    pub fn proxy_pid(&self) -> PathBuf {
        self.0.join("proxy.pid")
    }

    /// The log of a proxy the exec plugin started.
    pub fn proxy_log(&self) -> PathBuf {
        self.0.join("proxy.log")
    }

    /// The key a rotation switched to, so a restarted proxy signs with it.
    pub fn current_key(&self) -> PathBuf {
        self.0.join(CURRENT_KEY_FILE)
    }

    /// The API server's CA, when a bootstrap kubeconfig carried it inline.
    pub fn apiserver_ca(&self) -> PathBuf {
        self.0.join("apiserver-ca.pem")
    }

    /// The proxy's default: `$XDG_STATE_HOME/hwkey`, `$HOME/.local/state/hwkey`, or
    /// [`SYSTEM_STATE_DIR`] when there is no home (system services).
    pub fn proxy_default() -> StateDir {
        if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
            return StateDir(Path::new(&d).join("hwkey"));
        }
        match home() {
            Some(h) => StateDir(h.join(".local/state/hwkey")),
            None => StateDir(PathBuf::from(SYSTEM_STATE_DIR)),
        }
    }

    /// The exec plugin's default for a proxy on `listen` (`tcp:127.0.0.1:PORT`):
    /// `$XDG_RUNTIME_DIR/hwkey/127.0.0.1-PORT`, else `~/.kube/cache/hwkey/127.0.0.1-PORT`.
    pub fn plugin_default(listen: &str) -> StateDir {
        let leaf = listen
            .trim_start_matches("tcp:")
            .replace(['[', ']'], "")
            .replace(':', "-");
        let base = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
            Some(d) => PathBuf::from(d).join("hwkey"),
            None => kube_cache(),
        };
        StateDir(base.join(leaf))
    }

    /// `hwkey kubeconfig`'s default for context `name`: `~/.kube/cache/hwkey/NAME` for kubectl,
    /// `/var/lib/hwkey/NAME` for a system service (kubelet).
    pub fn kubeconfig_default(name: &str, system: bool) -> StateDir {
        if system {
            StateDir(Path::new(SYSTEM_STATE_DIR).join(name))
        } else {
            StateDir(kube_cache().join(name))
        }
    }
}

impl std::ops::Deref for StateDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for StateDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for StateDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl From<PathBuf> for StateDir {
    fn from(path: PathBuf) -> StateDir {
        StateDir(path)
    }
}

/// The system-wide state of hwkey (system services, kubelet's proxy).
pub const SYSTEM_STATE_DIR: &str = "/var/lib/hwkey";

/// The file naming the key a rotation switched to (see [`StateDir::current_key`]).
pub const CURRENT_KEY_FILE: &str = "current-key";

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

fn kube_cache() -> PathBuf {
    home()
        .unwrap_or_else(|| PathBuf::from("/"))
        .join(".kube")
        .join("cache")
        .join("hwkey")
}

/// The effective uid of this process.
pub fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Creates `dir` (mode 0700) if it does not exist; otherwise checks that it is a real directory
/// owned by this user and writable by no one else. The error says what is wrong and how to fix
/// it.
pub fn ensure_private(dir: &Path) -> io::Result<()> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        }
        Err(e) => Err(e),
        Ok(meta) => check(dir, &meta, true),
    }
}

/// Checks that `path` (a file in a state directory) is not a symlink, belongs to this user, and
/// is writable by no one else.
pub fn check_file(path: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    check(path, &meta, false)
}

fn check(path: &Path, meta: &fs::Metadata, want_dir: bool) -> io::Result<()> {
    let refuse = |what: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, what));
    if meta.file_type().is_symlink() {
        return refuse(format!(
            "{} is a symbolic link; hwkey's state must be a real {} owned by you",
            path.display(),
            if want_dir { "directory" } else { "file" }
        ));
    }
    if want_dir && !meta.is_dir() {
        return refuse(format!("{} is not a directory", path.display()));
    }
    let me = own_uid();
    if meta.uid() != me && !(me == 0 && root_may_trust(path, meta.uid())) {
        // Root trusts one other owner, in one place: see root_may_trust.
        return refuse(format!(
            "{} belongs to uid {}, not to uid {me} who runs hwkey: use a state directory of your own (--state-dir), or `chown` it if it really is yours",
            path.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "{} is writable by other users (mode {:o}): chmod go-w it",
            path.display(),
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

/// Whether root may use `path` although it belongs to `owner`: systemd's `StateDirectory=` gives
/// `/var/lib/hwkey/INSTANCE` to the proxy unit's system user, and root's exec plugin (kubelet's)
/// talks to that proxy. Acceptable only when `owner` is that service user ([`SERVICE_USER`]: the
/// proxy itself, whose state it is) and the ownership chain ends at root: every directory above
/// `path` up to the first one root owns belongs to `owner`, and none of them (that root-owned
/// one included) is writable by anyone else. Any other user's directory stays refused (it could
/// hold a loopback CA of that user's making).
fn root_may_trust(path: &Path, owner: u32) -> bool {
    if service_uid() != Some(owner) {
        return false;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(mut dir) = fs::canonicalize(parent) else {
        return false;
    };
    loop {
        let Ok(meta) = fs::symlink_metadata(&dir) else {
            return false;
        };
        if !meta.is_dir() || meta.mode() & 0o022 != 0 {
            return false;
        }
        if meta.uid() == 0 {
            return true;
        }
        if meta.uid() != owner || !dir.pop() {
            return false;
        }
    }
}

/// The system user `hwkey-proxy@.service` runs as; the package makes it.
pub const SERVICE_USER: &str = "hwkey";

/// The uid of the service user (`HWKEY_SERVICE_USER` names another, for hosts that run the unit
/// as a user of their own), from `/etc/passwd` (system users are local).
fn service_uid() -> Option<u32> {
    let name = std::env::var("HWKEY_SERVICE_USER")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| SERVICE_USER.to_string());
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name)
            .then(|| fields.nth(1)?.parse().ok())
            .flatten()
    })
}

/// Opens a file of a state directory with `options` without following a symbolic link and
/// without waiting (a FIFO planted there is refused, not waited on), then checks that it is a
/// regular file, its owner and its mode. Root's exec plugin writes and locks files in the proxy
/// service user's directory (see `root_may_trust`): a symbolic link planted there by that user
/// must not make root create, append to or read a file elsewhere.
pub fn open_private(path: &Path, options: &mut fs::OpenOptions) -> io::Result<fs::File> {
    let f = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            match e.raw_os_error() {
                Some(libc::ELOOP) => io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is a symbolic link; hwkey's state files must be real files owned by you: remove it",
                        path.display()
                    ),
                ),
                // Opening a FIFO for writing without waiting, when nobody reads it.
                Some(libc::ENXIO) => not_regular(path),
                _ => e,
            }
        })?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(path));
    }
    // A hard link to a file elsewhere is that file (fs.protected_hardlinks=0 lets anyone make
    // one to a file they cannot write).
    if meta.nlink() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} has {} hard links; hwkey's state files have one: remove it",
                path.display(),
                meta.nlink()
            ),
        ));
    }
    check(path, &meta, false)?;
    Ok(f)
}

fn not_regular(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{} is not a regular file (a FIFO, socket, device or directory): remove it",
            path.display()
        ),
    )
}

/// The largest state file hwkey reads (a CA key and certificate, a key pointer): far above any.
const MAX_STATE_FILE: u64 = 1024 * 1024;

/// Reads a file of a state directory ([`open_private`]), at most [`MAX_STATE_FILE`] bytes.
pub fn read_private(path: &Path) -> io::Result<Vec<u8>> {
    let f = open_private(path, fs::OpenOptions::new().read(true))?;
    let mut out = Vec::new();
    f.take(MAX_STATE_FILE + 1).read_to_end(&mut out)?;
    if out.len() as u64 > MAX_STATE_FILE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is longer than any state file hwkey writes",
                path.display()
            ),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private directory of the test's own.
    fn private_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("dir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700)).expect("chmod");
        dir
    }

    /// A FIFO where a state file belongs (the loopback CA's key, say) was opened waiting for a
    /// writer: the proxy hung at start. Now it is refused at once, naming the file.
    #[test]
    fn a_fifo_for_a_state_file_is_refused_at_once() {
        let dir = private_dir();
        let fifo = dir.path().join("loopback-ca-key.pem");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || drop(tx.send(read_private(&path).map_err(|e| e.to_string()))));
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the read of a FIFO returned")
            .expect_err("a FIFO is no state file");
        assert!(
            e.contains("not a regular file") && e.contains("loopback-ca-key.pem"),
            "{e}"
        );
    }

    /// A state file is opened neither through a symbolic link nor when another user can write
    /// it; a real private file is read.
    #[test]
    fn a_state_file_is_a_real_private_file() {
        let dir = private_dir();
        let real = dir.path().join("real");
        fs::write(&real, b"state").expect("write");
        fs::set_permissions(&real, fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(read_private(&real).expect("read"), b"state");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("link");
        let e = read_private(&link).expect_err("a link").to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let hard = dir.path().join("hard");
        fs::hard_link(&real, &hard).expect("hard link");
        let e = read_private(&hard).expect_err("a hard link").to_string();
        assert!(e.contains("hard links"), "{e}");
        fs::remove_file(&hard).expect("unlink");
        fs::set_permissions(&real, fs::Permissions::from_mode(0o622)).expect("chmod");
        let e = read_private(&real)
            .expect_err("writable by others")
            .to_string();
        assert!(e.contains("chmod go-w"), "{e}");
    }
}
