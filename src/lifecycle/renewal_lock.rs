//! One renewal of a certificate file at a time, across processes.
//!
//! `hwkey renew` and a proxy's `--renew` (or two proxies sharing a `--cert`) renewing one file at
//! once would each request a certificate; the second install would keep the first one's
//! certificate as `.prev` and the original would be lost, or a key's certificate would replace
//! another key's after a rotation. So a renewal holds an exclusive `flock` on
//! `<cert>.renew.lock` from before it reads the certificate until it has installed the new one;
//! a renewal that finds it held does not start. The lock file stays (an `flock` dies with its
//! holder: no stale lock after a crash).

use std::fs::{File, OpenOptions, TryLockError};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Why a renewal could not take its lock.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum RenewalLockError {
    #[error("another renewal of {} is running (hwkey renew, or a proxy with --renew, holds {}): two at once would each request a certificate and the second would replace the first's; let it finish", .cert.display(), .lock.display())]
    Busy { cert: PathBuf, lock: PathBuf },
    #[error("cannot lock {}: {source}", .lock.display())]
    Io {
        lock: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Held for one renewal of a certificate file; released when dropped.
#[derive(Debug)]
pub struct RenewalLock {
    file: std::sync::Arc<File>,
}

impl RenewalLock {
    /// Takes the lock of `cert`'s renewals, or fails at once naming the lock when another
    /// renewal holds it.
    pub fn take(cert: &Path) -> Result<RenewalLock, RenewalLockError> {
        LockFile::open(cert)?.take()
    }
}

impl Drop for RenewalLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

/// The lock file of `cert`'s renewals, opened once: a proxy opens it before it confines itself
/// (its network side may not create files beside the certificate) and takes it for each
/// renewal.
#[derive(Debug, Clone)]
pub struct LockFile {
    file: std::sync::Arc<File>,
    cert: PathBuf,
    lock: PathBuf,
}

impl LockFile {
    /// Opens (creates) `<cert>.renew.lock`, never through a link.
    pub fn open(cert: &Path) -> Result<LockFile, RenewalLockError> {
        let lock = lock_path(cert);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&lock)
            .map_err(|source| RenewalLockError::Io {
                lock: lock.clone(),
                source,
            })?;
        Ok(LockFile {
            file: std::sync::Arc::new(file),
            cert: cert.to_path_buf(),
            lock,
        })
    }

    /// Takes the lock for one renewal, or fails at once when another renewal holds it.
    pub fn take(&self) -> Result<RenewalLock, RenewalLockError> {
        match self.file.try_lock() {
            Ok(()) => Ok(RenewalLock {
                file: self.file.clone(),
            }),
            Err(TryLockError::WouldBlock) => Err(RenewalLockError::Busy {
                cert: self.cert.clone(),
                lock: self.lock.clone(),
            }),
            Err(TryLockError::Error(source)) => Err(RenewalLockError::Io {
                lock: self.lock.clone(),
                source,
            }),
        }
    }
}

fn lock_path(cert: &Path) -> PathBuf {
    let mut name = cert.as_os_str().to_os_string();
    name.push(".renew.lock");
    PathBuf::from(name)
}
