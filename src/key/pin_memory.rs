//! Remembering, across processes and restarts, a PIN the token rejected.
//!
//! Smart cards lock after three wrong PINs, and every `hwkey credential` run, proxy restart
//! (systemd `Restart=`) or operator command is a new process: a rejection kept in memory would
//! let each of them spend one more of the token's attempts. So a `CKR_PIN_INCORRECT` is written
//! down, keyed by the token (module, serial, label) and by the *identity of the PIN source* —
//! the source's name (a file's path, a variable's name) and an HMAC of the PIN it holds under a
//! random secret kept beside the records — and that PIN is never presented again until the
//! source holds another PIN. Changing the PIN file (or the variable) gives exactly one new
//! attempt, however it was changed (a same-length rewrite with the modification time put back
//! counts too); a successful login forgets the record.
//!
//! Records live in `$HWKEY_PIN_STATE_DIR`, else, for root (and so the systemd unit, which sets
//! `ProtectHome=yes`), the one system-wide `/var/lib/hwkey/rejected-pins`, else
//! `$XDG_STATE_HOME/hwkey-rejected-pins`, `~/.local/state/hwkey-rejected-pins`, or
//! `/var/lib/hwkey/rejected-pins`: beside the proxy's state directory, never in it (its network
//! side writes there). The directory must be this user's and writable by no one
//! else (mode 0700; not a symbolic link), like the state directory: a record another user
//! planted must not make hwkey refuse a good PIN. They hold no PIN and no PIN hash an attacker
//! could test offline without the secret. Without a usable directory hwkey presents no PIN at
//! all (fail closed): a rejection it could not remember would be tried again by the next
//! process.

use std::path::{Path, PathBuf};

use ring::{digest, hmac, rand::SecureRandom};

use super::pin::PinSource;

/// The system-wide location (root, the systemd unit).
pub const SYSTEM_DIR: &str = "/var/lib/hwkey/rejected-pins";

/// Where the records are kept (see the module comment).
pub fn memory_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HWKEY_PIN_STATE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if crate::state_dir::own_uid() == 0 {
        return PathBuf::from(SYSTEM_DIR);
    }
    default_dir(&crate::state_dir::StateDir::proxy_default())
}

/// [`memory_dir`] for reading and writing records: a person's records from before the memory
/// moved out of the state directory come along, so a PIN refused then is not tried once more
/// (a rename: atomic, and only when the default is in use and not there yet). Only where
/// records are used: a process that merely names the directory (the proxy's sandbox plan)
/// moves nothing.
fn records_dir() -> PathBuf {
    let dir = memory_dir();
    let state = crate::state_dir::StateDir::proxy_default();
    let old = state.join("rejected-pins");
    if dir == default_dir(&state) && dir != old && !dir.exists() && old.is_dir() {
        let _ = std::fs::rename(&old, &dir);
    }
    dir
}

/// A user's default, given the proxy's default state directory.
fn default_dir(state: &Path) -> PathBuf {
    // Beside the proxy's default state, not in it: the proxy's network side writes its state
    // directory, and must not be able to delete a rejection (a restart would then spend one
    // more of the token's tries).
    match state.parent() {
        Some(parent) if state != Path::new(crate::state_dir::SYSTEM_STATE_DIR) => {
            parent.join("hwkey-rejected-pins")
        }
        _ => PathBuf::from(SYSTEM_DIR),
    }
}

/// A file of the memory (its secret), for checks that it lies out of another process's reach.
pub fn memory_secret() -> PathBuf {
    memory_dir().join(SECRET_FILE)
}

/// The memory's HMAC secret, beside the records.
const SECRET_FILE: &str = "secret";

/// One (token, PIN source) pair's record.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    path: PathBuf,
}

impl Record {
    /// The record for `pin` from `source` on the token identified by `token_id` (module, serial
    /// and label). An error when the memory's secret cannot be made or read: the caller then
    /// presents no PIN (fail closed), as when the directory is unusable.
    pub(crate) fn for_source(
        token_id: &str,
        source: &PinSource,
        pin: &str,
    ) -> std::io::Result<Record> {
        let dir = records_dir();
        let identity = match source {
            // The PIN's keyed hash, not the file's metadata: a rewrite that restores size and
            // modification time is still another PIN.
            PinSource::File(path) => {
                let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
                format!("file:{}:{}", canonical.display(), fingerprint(&dir, pin)?)
            }
            PinSource::Env(var) => format!("env:{var}:{}", fingerprint(&dir, pin)?),
            PinSource::Value(_) => format!("value:{}", fingerprint(&dir, pin)?),
        };
        let token = token_prefix(token_id);
        let name = digest::digest(&digest::SHA256, identity.as_bytes());
        Ok(Record {
            path: dir.join(format!("{token}-{}", hex::encode(name.as_ref()))),
        })
    }

    /// True when this PIN was rejected before.
    pub(crate) fn exists(&self) -> bool {
        self.path.exists()
    }

    /// Where the record is (error messages name it, so an operator can remove it).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Fails unless a record can be written now: checked before a PIN is presented, so that a
    /// directory hwkey can read but not write (made read-only, a full file system) fails closed
    /// like an unusable one, instead of a rejection that only this process would remember.
    /// A throw-away file of a record's size is made beside the records and removed.
    pub(crate) fn check_writable(&self) -> std::io::Result<()> {
        use std::io::Write;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        ensure_dir(dir)?;
        let mut probe = tempfile::Builder::new()
            .prefix(".hwkey-probe-")
            .tempfile_in(dir)?;
        probe.write_all(&[0u8; 512])?;
        probe.flush()
    }

    /// Writes the record; failures are logged (the process still remembers).
    pub(crate) fn remember(&self, token: &str, source: &PinSource) {
        let text = format!(
            "token '{token}' rejected the PIN from {} (CKR_PIN_INCORRECT); hwkey will not present it again until that source changes.\n",
            describe_source(source)
        );
        let result = self
            .path
            .parent()
            .map(ensure_dir)
            .unwrap_or(Ok(()))
            .and_then(|()| crate::atomic_file::write_atomic(&self.path, text.as_bytes(), 0o600));
        if let Err(e) = result {
            tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "cannot record the rejected PIN on disk; only this process will remember it"
            );
        }
    }
}

/// An exclusive lock on one token's login, across processes: held from the record check through
/// `C_Login` and the record write, so of several processes with the same new wrong PIN exactly
/// one presents it and the others find its record (two kubeconfig contexts on one smart card
/// used in parallel spent four of its three attempts without it). Released on drop.
#[derive(Debug)]
pub(crate) struct TokenLock {
    _file: std::fs::File,
}

/// Takes the login lock of token `token_id` (waits while another process holds it).
pub(crate) fn lock_token(token_id: &str) -> std::io::Result<TokenLock> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = records_dir();
    ensure_dir(&dir)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir.join(format!("{}.lock", token_prefix(token_id))))?;
    file.lock()?;
    Ok(TokenLock { _file: file })
}

/// Forgets every rejection recorded for the token `token_id`: a successful login proves the
/// PIN in use works, so older records only describe PINs that are gone.
#[cfg_attr(
    not(feature = "pkcs11"),
    allow(dead_code, reason = "a good PKCS#11 login forgets a token's records")
)]
pub(crate) fn forget_token(token_id: &str) {
    let prefix = format!("{}-", token_prefix(token_id));
    let Ok(entries) = std::fs::read_dir(records_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The part of a record's name that names the token.
fn token_prefix(token_id: &str) -> String {
    let d = digest::digest(&digest::SHA256, token_id.as_bytes());
    hex::encode(&d.as_ref()[..8])
}

/// How a PIN source is named in messages (never the PIN).
pub(crate) fn describe_source(source: &PinSource) -> String {
    match source {
        PinSource::File(p) => format!("file {}", p.display()),
        PinSource::Env(v) => format!("environment variable {v}"),
        PinSource::Value(_) => "the key URI's pin-value".into(),
    }
}

/// HMAC-SHA256 of the PIN under the directory's secret (created on first use, mode 0600). An
/// error names what is wrong: a secret that is damaged (not 32 bytes, not a file) is never
/// replaced silently, since every record made under it would be forgotten.
fn fingerprint(dir: &Path, pin: &str) -> std::io::Result<String> {
    ensure_dir(dir)?;
    let secret_path = dir.join(SECRET_FILE);
    let damaged = |what: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "its secret {} {what}: delete it (the PINs it remembers as rejected are then forgotten)",
                secret_path.display()
            ),
        )
    };
    let secret = match crate::state_dir::read_private(&secret_path) {
        Ok(s) if s.len() == 32 => s,
        Ok(s) => return Err(damaged(format!("holds {} bytes, not 32", s.len()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut s = vec![0u8; 32];
            ring::rand::SystemRandom::new()
                .fill(&mut s)
                .map_err(|_| std::io::Error::other("the system random generator failed"))?;
            // Never replaced: two processes racing keep the first secret, and a crash leaves no
            // half-written one.
            match crate::atomic_file::create_atomic(&secret_path, &s, 0o600) {
                Ok(()) => s,
                Err(_) => crate::state_dir::read_private(&secret_path)
                    .ok()
                    .filter(|s| s.len() == 32)
                    .ok_or_else(|| damaged("cannot be created or read".into()))?,
            }
        }
        Err(e) => return Err(damaged(format!("cannot be read ({e})"))),
    };
    let key = hmac::Key::new(hmac::HMAC_SHA256, &secret);
    Ok(hex::encode(hmac::sign(&key, pin.as_bytes()).as_ref()))
}

/// Creates the directory (mode 0700) or checks that it is this user's, not a symbolic link
/// and writable by no one else.
fn ensure_dir(dir: &Path) -> std::io::Result<()> {
    crate::state_dir::ensure_private(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A person's memory lies beside the proxy's default state directory, never in it (the
    /// network side writes there and could delete a record); without a home, the system's.
    #[test]
    fn the_default_memory_is_beside_the_state_directory() {
        let state = Path::new("/home/alice/.local/state/hwkey");
        let memory = default_dir(state);
        assert_eq!(
            memory,
            Path::new("/home/alice/.local/state/hwkey-rejected-pins")
        );
        assert!(!memory.starts_with(state));
        assert_eq!(
            default_dir(Path::new(crate::state_dir::SYSTEM_STATE_DIR)),
            Path::new(SYSTEM_DIR)
        );
    }
}
