//! When the proxy itself ends a bridged connection: nothing moved for `--idle-timeout`, or the
//! certificate it was opened with expired or, with `--rotation-close immediate`, was replaced
//! ([`super::rotation`]).
//!
//! This is for a connection relayed on its task (an upstream through a forward proxy); a relay
//! loop decides the same for its connections itself (`relay_loop/watch.rs`).
//!
//! One timer watches both deadlines, the earlier first. A connection's task holds this future
//! for the connection's whole life; an idle timer and a retirement timer side by side held two
//! tokio timers and a select, about 300 bytes more per connection (docs/BENCHMARKS.md,
//! "the 2 KiB per connection found").

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::idle::LastActivity;
use super::rotation::{self, CertEpoch, RotationClose};

/// Why the proxy ends a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cutoff {
    /// Nothing moved for the idle timeout.
    Idle,
    /// The certificate it was opened with expired, or a newer one replaced it
    /// (`--rotation-close immediate`).
    Retired,
}

impl Cutoff {
    /// The error a connection the proxy ended ends with.
    pub fn error(self) -> std::io::Error {
        match self {
            Cutoff::Idle => std::io::Error::new(std::io::ErrorKind::TimedOut, "idle timeout"),
            Cutoff::Retired => std::io::Error::other("certificate rotated"),
        }
    }
}

/// Says that `n` connections are being closed because the certificate they were opened with
/// was replaced or has expired: one line, said before they close (a client sees its end at
/// once, and the log then has why), and one per pass of a relay loop, not one per connection.
pub fn say_retired(n: usize) {
    match n {
        0 => {}
        1 => tracing::info!(
            "closing a connection opened with a certificate that was replaced or has expired"
        ),
        n => tracing::info!(
            "closing {n} connections opened with a certificate that was replaced or has expired"
        ),
    }
}

/// What decides one connection's cutoff, taken when it was opened.
pub struct Deadlines {
    /// The idle timeout (None: never).
    pub idle: Option<Duration>,
    /// The certificate epochs ([`super::upstream::Upstream::epochs`]).
    pub epochs: watch::Receiver<CertEpoch>,
    /// The epoch the connection was opened in.
    pub used: CertEpoch,
    /// Whether a newer certificate ends it.
    pub mode: RotationClose,
}

/// Resolves with the first cutoff that comes for a connection whose activity is `last`.
///
/// An `async` block rather than an `async fn`: an `async fn` keeps each argument twice, as
/// given and as its local (64 bytes more per connection here); a block's captures are used in
/// place, and `deadlines` is not taken apart for the same reason.
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn would keep its arguments twice in every connection's task"
)]
pub fn cutoff(
    mut deadlines: Deadlines,
    last: &LastActivity,
) -> impl std::future::Future<Output = Cutoff> + Send + '_ {
    async move {
        // An instant beyond the clock's range is as good as never.
        let expires = deadlines
            .used
            .not_after_unix
            .and_then(|t| Instant::now().checked_add(rotation::until_unix(t)));
        loop {
            let wake = match next_wake(deadlines.idle, expires, last) {
                Ok(wake) => wake,
                Err(cut) => return cut,
            };
            let timer = async move {
                match wake {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending::<()>().await,
                }
            };
            let (mode, generation) = (deadlines.mode, deadlines.used.generation);
            let epochs = &mut deadlines.epochs;
            let replaced = async move {
                match mode {
                    // A dropped sender (the proxy is stopping) ends the connection too.
                    RotationClose::Immediate => {
                        let _ = epochs.wait_for(|e| e.generation != generation).await;
                    }
                    RotationClose::Expiry => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                // A deadline came: the loop decides which (activity may have moved the idle one).
                () = timer => {}
                () = replaced => return Cutoff::Retired,
            }
        }
    }
}

/// When to look again (None: never by the clock), or the cutoff that is due now.
fn next_wake(
    idle: Option<Duration>,
    expires: Option<Instant>,
    last: &LastActivity,
) -> Result<Option<Instant>, Cutoff> {
    let now = Instant::now();
    if expires.is_some_and(|e| e <= now) {
        return Err(Cutoff::Retired);
    }
    let idle_at = match idle {
        Some(limit) => {
            let since = last.since();
            if since >= limit {
                return Err(Cutoff::Idle);
            }
            now.checked_add(limit - since)
        }
        None => None,
    };
    Ok(match (idle_at, expires) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadlines(
        idle: Option<Duration>,
        not_after_unix: Option<i64>,
        mode: RotationClose,
    ) -> (watch::Sender<CertEpoch>, Deadlines) {
        let used = CertEpoch {
            generation: 0,
            not_after_unix,
        };
        let tx = watch::Sender::new(used);
        let d = Deadlines {
            idle,
            epochs: tx.subscribe(),
            used,
            mode,
        };
        (tx, d)
    }

    fn unix_now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0)
    }

    /// Every test ends within this, passing or failing: a broken cutoff must not hang CI.
    const ENOUGH: Duration = Duration::from_secs(10);

    async fn within<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(ENOUGH, f)
            .await
            .expect("no cutoff within 10 s")
    }

    #[tokio::test]
    async fn idle_comes_once_nothing_moved_and_activity_moves_it_later() {
        let last = LastActivity::default();
        let limit = Duration::from_secs(1);
        let (_tx, d) = deadlines(Some(limit), None, RotationClose::Expiry);
        let started = std::time::Instant::now();
        // Touched every 50 ms for 400 ms: only a stall of nearly a second could let the idle
        // cutoff in between two touches.
        let touching = async {
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                last.touch();
            }
            std::future::pending::<()>().await
        };
        let cut = within(async {
            tokio::select! {
                c = cutoff(d, &last) => c,
                () = touching => unreachable!(),
            }
        })
        .await;
        assert_eq!(cut, Cutoff::Idle);
        // The last touch came at 400 ms or later: no cutoff before 400 ms + 1 s (less the
        // activity clock's millisecond); without the touches it would have come at 1 s.
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(1350),
            "idle cutoff after {took:?}"
        );
    }

    #[tokio::test]
    async fn an_expired_certificate_retires_at_once_whatever_the_mode() {
        for mode in [RotationClose::Expiry, RotationClose::Immediate] {
            let last = LastActivity::default();
            let (_tx, d) = deadlines(Some(Duration::from_secs(3600)), Some(unix_now() - 1), mode);
            assert_eq!(within(cutoff(d, &last)).await, Cutoff::Retired);
        }
    }

    #[tokio::test]
    async fn a_certificate_expiring_retires_then_even_before_the_idle_timeout() {
        let last = LastActivity::default();
        let (_tx, d) = deadlines(
            Some(Duration::from_secs(3600)),
            Some(unix_now() + 1),
            RotationClose::Expiry,
        );
        assert_eq!(within(cutoff(d, &last)).await, Cutoff::Retired);
        let (_tx, d) = deadlines(None, Some(unix_now() + 1), RotationClose::Expiry);
        assert_eq!(within(cutoff(d, &last)).await, Cutoff::Retired);
    }

    #[tokio::test]
    async fn a_new_certificate_retires_only_with_immediate() {
        let last = LastActivity::default();
        let (tx, d) = deadlines(None, Some(unix_now() + 3600), RotationClose::Immediate);
        let cut = cutoff(d, &last);
        tx.send_modify(|e| e.generation += 1);
        assert_eq!(within(cut).await, Cutoff::Retired);

        let (tx, d) = deadlines(
            Some(Duration::from_millis(200)),
            Some(unix_now() + 3600),
            RotationClose::Expiry,
        );
        tx.send_modify(|e| e.generation += 1);
        // Not retired by the new certificate: the idle timeout is what ends it.
        assert_eq!(within(cutoff(d, &last)).await, Cutoff::Idle);
    }

    #[tokio::test]
    async fn the_epochs_ending_retires_only_with_immediate() {
        let last = LastActivity::default();
        let (tx, d) = deadlines(None, None, RotationClose::Immediate);
        drop(tx);
        assert_eq!(within(cutoff(d, &last)).await, Cutoff::Retired);

        let (tx, d) = deadlines(None, None, RotationClose::Expiry);
        drop(tx);
        let waited = tokio::time::timeout(Duration::from_millis(200), cutoff(d, &last)).await;
        assert!(waited.is_err(), "retired in expiry mode by the epochs' end");
    }

    #[tokio::test]
    async fn without_deadlines_nothing_comes() {
        let last = LastActivity::default();
        let (_tx, d) = deadlines(None, None, RotationClose::Expiry);
        let waited = tokio::time::timeout(Duration::from_millis(200), cutoff(d, &last)).await;
        assert!(waited.is_err(), "a cutoff came without a deadline");
    }
}
