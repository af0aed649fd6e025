//! The stop signal every long-running task watches: a `watch` channel set to true once (SIGTERM,
//! the lock owner gone, `--idle-exit`, the approver's shutdown).

use tokio::sync::watch;

/// Resolves once `stop` is true (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
