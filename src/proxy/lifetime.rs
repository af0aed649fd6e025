//! How long the proxy lives, and how it stops.
//!
//! Stop causes (KEP-2718 lifetimes plus the usual signals): SIGTERM or SIGINT; the owner of
//! `--lock-file` is gone (its `flock` lock can be taken); no connection for `--idle-exit`.
//! On any of them the main task stops the listeners, removes the socket files, then waits for
//! open connections to finish, at most `--drain-timeout`, and the process exits 0.
//!
//! [`Activity`] counts open client connections: each holds a [`ConnGuard`] while it is open
//! (its task, or the relay loop that relays it). The main task's [`wait_for_stop`] and
//! [`drain`] read it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Notify;

use super::error::StartError;
use super::metrics::Metrics;

/// Why the proxy stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM or SIGINT.
    Signal(&'static str),
    /// The process holding `--lock-file` went away.
    LockOwnerGone(PathBuf),
    /// No client connection for `--idle-exit`.
    Idle(Duration),
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::Signal(s) => write!(f, "{s} received"),
            StopReason::LockOwnerGone(p) => {
                write!(f, "the owner of the lock file {} is gone", p.display())
            }
            StopReason::Idle(d) => write!(f, "no connection for {d:?}"),
        }
    }
}

/// Open connections and the time of the last change.
///
/// Nothing is woken when a connection opens or ends or a credential is handed out: the idle
/// watch ([`watch_idle`]) reads the time of the last change when its own sleep ends. (It was
/// woken at each of them before, a cross-thread wake-up of the main thread twice per
/// connection, for nothing.) Only the last connection's end notifies, for [`drain`].
#[derive(Debug)]
pub struct Activity {
    open: AtomicUsize,
    last_change: Mutex<Instant>,
    /// Notified when the last open connection ends.
    emptied: Notify,
    metrics: Arc<Metrics>,
}

impl Activity {
    /// Starts counting; every connection reports to `metrics` too.
    pub fn new(metrics: Arc<Metrics>) -> Activity {
        Activity {
            open: AtomicUsize::new(0),
            last_change: Mutex::new(Instant::now()),
            emptied: Notify::new(),
            metrics,
        }
    }

    /// Registers an open connection until the guard is dropped.
    pub fn enter(self: &Arc<Self>) -> ConnGuard {
        self.changed(|open| open.fetch_add(1, Ordering::SeqCst));
        self.metrics.active_inc();
        ConnGuard {
            activity: self.clone(),
        }
    }

    /// Changes the count of open connections and the time of the last change together, under
    /// the lock [`Activity::idle_for`] reads both under: the idle watch never sees the count
    /// of after a connection's end with the time of before it (which would make a proxy whose
    /// one long watch just ended idle at once, not `--idle-exit` later).
    fn changed(&self, change: impl FnOnce(&AtomicUsize) -> usize) -> usize {
        let mut last = self.last_change.lock().unwrap_or_else(|p| p.into_inner());
        *last = Instant::now();
        change(&self.open)
    }

    /// Marks activity without a connection (e.g. a credential handed out).
    pub fn touch(&self) {
        *self.last_change.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    fn idle_for(&self) -> Option<Duration> {
        let last = self.last_change.lock().unwrap_or_else(|p| p.into_inner());
        (self.open() == 0).then(|| last.elapsed())
    }
}

/// Held for a connection while it is open (by its task, then by its relay loop).
#[derive(Debug)]
pub struct ConnGuard {
    activity: Arc<Activity>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let was = self
            .activity
            .changed(|open| open.fetch_sub(1, Ordering::SeqCst));
        self.activity.metrics.active_dec();
        if was == 1 {
            // Wakes a drain only (nobody else waits on it): no wake-up while the proxy runs.
            self.activity.emptied.notify_waiters();
        }
    }
}

/// Resolves when the proxy should stop.
pub async fn wait_for_stop(
    activity: Arc<Activity>,
    lock_file: Option<(PathBuf, File)>,
    idle_exit: Option<Duration>,
    signer_side: tokio::sync::oneshot::Receiver<String>,
) -> Result<StopReason, StartError> {
    let sig = |kind: SignalKind, name: &'static str| {
        signal(kind).map_err(|source| StartError::Signal { name, source })
    };
    let mut term = sig(SignalKind::terminate(), "SIGTERM")?;
    let mut int = sig(SignalKind::interrupt(), "SIGINT")?;
    let lock = async {
        match &lock_file {
            Some((p, f)) => watch_lock(p, f).await,
            None => std::future::pending().await,
        }
    };
    let idle = async {
        match idle_exit {
            Some(d) if !d.is_zero() => watch_idle(&activity, d).await,
            _ => std::future::pending().await,
        }
    };
    // The signer supervisor's end (see `Supervisor::gone`).
    let signer_gone = async {
        match signer_side.await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        why = signer_gone => Err(StartError::SignerSideGone { why }),
        _ = term.recv() => Ok(StopReason::Signal("SIGTERM")),
        _ = int.recv() => Ok(StopReason::Signal("SIGINT")),
        r = lock => r,
        r = idle => Ok(r),
    }
}

/// Resolves when no connection has been open for `limit` since the last change. It sleeps
/// until the earliest moment that could be, and looks: while connections are open that is
/// `limit` from now (the last one to end makes the proxy idle from its end, found exactly by
/// the look after), else `limit` after the last change. Nothing wakes it in between.
async fn watch_idle(activity: &Activity, limit: Duration) -> StopReason {
    loop {
        match activity.idle_for() {
            Some(idle) if idle >= limit => return StopReason::Idle(limit),
            Some(idle) => tokio::time::sleep(limit - idle).await,
            None => tokio::time::sleep(limit).await,
        }
    }
}

/// How often the lock file is tried.
const LOCK_POLL: Duration = Duration::from_millis(250);

/// Polls the lock: the owner holds an exclusive `flock` on the file; when the proxy can take
/// it, the owner is gone. A lock nobody holds at start counts as an owner already gone, so
/// the starter must take the lock before it starts the proxy.
async fn watch_lock(path: &Path, file: &File) -> Result<StopReason, StartError> {
    loop {
        if try_flock(file) {
            return Ok(StopReason::LockOwnerGone(path.to_path_buf()));
        }
        tokio::time::sleep(LOCK_POLL).await;
    }
}

/// Opens the `--lock-file` before the proxy says it is ready, so a missing or unreadable lock
/// file is an error at start, not after "ready".
pub fn open_lock_file(path: &Path) -> Result<File, StartError> {
    File::open(path).map_err(|source| StartError::LockFile {
        path: path.to_path_buf(),
        source,
    })
}

fn try_flock(file: &File) -> bool {
    // std's File::try_lock is flock(LOCK_EX | LOCK_NB) on Linux: the same lock the owner holds.
    file.try_lock().is_ok()
}

/// Waits until no connection is open or `timeout` passes; true if all finished.
pub async fn drain(activity: &Activity, timeout: Duration) -> bool {
    // Saturating: a drain timeout the clock cannot add (it panicked at SIGTERM) waits "forever".
    let now = tokio::time::Instant::now();
    let deadline = now
        .checked_add(timeout)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 24 * 3600));
    loop {
        let notified = activity.emptied.notified();
        if activity.open() == 0 {
            return true;
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep_until(deadline) => return activity.open() == 0,
        }
    }
}

/// Waits for open connections to finish, at most `timeout`, and says how the proxy stopped.
pub async fn drain_and_report(activity: &Activity, timeout: Duration, reason: &StopReason) {
    tracing::info!(%reason, open = activity.open(), "stopping: draining open connections");
    if drain(activity, timeout).await {
        eprintln!("hwkey proxy: stopped ({reason})");
    } else {
        eprintln!(
            "hwkey proxy: stopped ({reason}); {} connection(s) still open after {timeout:?} were closed",
            activity.open(),
        );
    }
}
