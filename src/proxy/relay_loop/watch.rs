//! When a relay loop itself ends a connection: nothing moved for `--idle-timeout`, or the
//! certificate it was opened with expired or, with `--rotation-close immediate`, was replaced.
//! The same decisions [`crate::proxy::cutoff`] makes for a connection relayed on its task, made
//! here so that a relayed connection needs no task, no timer and no wake-up of another thread
//! to end.
//!
//! The loop looks at its connections when the earliest deadline among them comes (not sooner
//! than [`MIN_SCAN_MS`] after the last look, so that deadlines spread over time cost one pass
//! per interval, not one per connection), and at once when a newer certificate is installed
//! ([`super::RelayLoops::retire`]).

use std::time::Duration;

use crate::proxy::cutoff::Cutoff;
use crate::proxy::rotation::{self, CertEpoch, RotationClose};

/// The shortest time between two passes over a loop's connections, in milliseconds: an idle
/// timeout or an expiry is acted on at most this late.
pub const MIN_SCAN_MS: u64 = 50;

/// The longest a loop sleeps for a deadline, in milliseconds (an hour; it looks again then).
/// A certificate's expiry is usually weeks away: a longer timeout than `i32::MAX` milliseconds
/// would make rustix wait with `epoll_pwait2`, which kernels before 5.11 and older container
/// seccomp profiles refuse, and a loop whose wait fails ends its connections.
pub(super) const MAX_SLEEP_MS: u64 = 3_600_000;

/// [`super::Loop::timeout`]: no sleep with `more` to move, else until `next_check` (at most
/// [`MAX_SLEEP_MS`]), else none (until an event).
pub(super) fn sleep_for(
    more: bool,
    next_check: Option<u64>,
    now: u64,
) -> Option<rustix::event::Timespec> {
    let ms = if more {
        0
    } else {
        next_check?.saturating_sub(now).min(MAX_SLEEP_MS)
    };
    Some(rustix::event::Timespec {
        tv_sec: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        tv_nsec: i64::try_from(ms % 1000).unwrap_or(0) * 1_000_000,
    })
}

/// What ends a relayed connection besides its two sides, taken when it was opened.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    /// Close it after this long without a byte (None: never).
    pub idle: Option<Duration>,
    /// The certificate generation it was opened with.
    pub epoch: CertEpoch,
    /// Whether a newer certificate ends it.
    pub mode: RotationClose,
}

impl Watch {
    /// A connection only its two sides end.
    pub fn none() -> Watch {
        Watch {
            idle: None,
            epoch: CertEpoch {
                generation: 0,
                not_after_unix: None,
            },
            mode: RotationClose::Expiry,
        }
    }
}

/// A connection's deadlines on its loop's clock ([`crate::proxy::idle::now_ms`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadlines {
    idle_ms: Option<u64>,
    expires_ms: Option<u64>,
    generation: u64,
    immediate: bool,
}

impl Deadlines {
    /// One deadline, `within` from `now`: a connection being opened or a spare being made,
    /// which must move on in that time (as an idle timeout, counted from its last step).
    pub(super) fn within(within: Duration, now: u64) -> Deadlines {
        let watch = Watch {
            idle: Some(within),
            ..Watch::none()
        };
        Deadlines::new(&watch, now)
    }

    /// `watch` on the loop's clock, `now` being [`crate::proxy::idle::now_ms`]. An expiry
    /// beyond the clock's range is as good as never.
    pub(super) fn new(watch: &Watch, now: u64) -> Deadlines {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Deadlines {
            idle_ms: watch.idle.map(millis),
            expires_ms: watch
                .epoch
                .not_after_unix
                .and_then(|t| now.checked_add(millis(rotation::until_unix(t)))),
            generation: watch.epoch.generation,
            immediate: watch.mode == RotationClose::Immediate,
        }
    }

    /// Whether a certificate generation newer than this connection's, `newest`, ends it.
    pub(super) fn retired_by(&self, newest: u64) -> bool {
        self.immediate && newest > self.generation
    }

    /// The cutoff due at `now` for a connection last active at `last`, or when to look again
    /// (None: never by the clock).
    pub(super) fn due(&self, now: u64, last: u64) -> Result<Option<u64>, Cutoff> {
        if self.expires_ms.is_some_and(|e| e <= now) {
            return Err(Cutoff::Retired);
        }
        let idle_at = match self.idle_ms {
            Some(limit) => {
                let at = last.saturating_add(limit);
                if at <= now {
                    return Err(Cutoff::Idle);
                }
                Some(at)
            }
            None => None,
        };
        Ok(match (idle_at, self.expires_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(idle: Option<u64>, not_after_unix: Option<i64>, mode: RotationClose) -> Watch {
        Watch {
            idle: idle.map(Duration::from_millis),
            epoch: CertEpoch {
                generation: 3,
                not_after_unix,
            },
            mode,
        }
    }

    #[test]
    fn an_idle_connection_is_due_when_its_timeout_has_passed_since_its_last_byte() {
        let d = Deadlines::new(&watch(Some(1_000), None, RotationClose::Expiry), 5_000);
        assert_eq!(d.due(5_000, 5_000), Ok(Some(6_000)));
        // Activity moves the deadline.
        assert_eq!(d.due(5_900, 5_800), Ok(Some(6_800)));
        assert_eq!(d.due(6_800, 5_800), Err(Cutoff::Idle));
    }

    #[test]
    fn a_connection_is_due_when_its_certificate_expires_whatever_its_activity() {
        let now_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let d = Deadlines::new(
            &watch(Some(60_000), Some(now_unix + 10), RotationClose::Expiry),
            1_000,
        );
        let next = d.due(1_000, 1_000).unwrap().unwrap();
        assert!((9_000..=11_000).contains(&next), "{next}");
        assert_eq!(d.due(next, next), Err(Cutoff::Retired));
        // An expired certificate: due at once.
        let past = Deadlines::new(
            &watch(None, Some(now_unix - 5), RotationClose::Expiry),
            1_000,
        );
        assert_eq!(past.due(1_000, 1_000), Err(Cutoff::Retired));
    }

    #[test]
    fn without_deadlines_a_connection_is_never_due() {
        let d = Deadlines::new(&Watch::none(), 0);
        assert_eq!(d.due(u64::MAX - 1, 0), Ok(None));
    }

    #[test]
    fn only_an_immediate_connection_is_retired_and_only_by_a_newer_generation() {
        let immediate = Deadlines::new(&watch(None, None, RotationClose::Immediate), 0);
        assert!(!immediate.retired_by(3));
        assert!(!immediate.retired_by(2));
        assert!(immediate.retired_by(4));
        let expiry = Deadlines::new(&watch(None, None, RotationClose::Expiry), 0);
        assert!(!expiry.retired_by(4));
    }
}
