//! Rate-limited warnings: a flood of refused handshakes or a run of accept errors (EMFILE)
//! must not turn into a flood of log lines (disk, journald, the operator's attention). The
//! first event of a kind is logged at once; later ones at most once per interval, with the
//! number suppressed in between. Counters in `/metrics` keep the exact totals.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One kind of event.
#[derive(Debug)]
pub struct RateLimited {
    every: Duration,
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl RateLimited {
    /// At most one message per `every`.
    pub const fn new(every: Duration) -> RateLimited {
        RateLimited {
            every,
            last: Mutex::new(None),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Returns Some(number suppressed since the last logged one) when this event should be
    /// logged now, None when it should be counted silently.
    pub fn allow(&self) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match *last {
            Some(t) if now.duration_since(t) < self.every => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.suppressed.swap(0, Ordering::Relaxed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_the_first_and_counts_the_rest() {
        let r = RateLimited::new(Duration::from_secs(3600));
        assert_eq!(r.allow(), Some(0));
        for _ in 0..99 {
            assert_eq!(r.allow(), None);
        }
        let r = RateLimited::new(Duration::ZERO);
        assert_eq!(r.allow(), Some(0));
        assert_eq!(r.allow(), Some(0));
    }
}
