//! When a bridged connection last moved a byte, for `--idle-timeout`.
//!
//! The stamp is milliseconds on one clock for the whole process, so a relay loop
//! ([`super::relay_loop`]) that serves many connections reads the clock once per wake-up and
//! stamps every connection it served with that reading, instead of once per read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Milliseconds since the first use of this clock in the process.
pub fn now_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// When either side of one connection last moved a byte.
pub struct LastActivity {
    millis: AtomicU64,
}

impl Default for LastActivity {
    fn default() -> LastActivity {
        LastActivity {
            millis: AtomicU64::new(now_ms()),
        }
    }
}

impl LastActivity {
    /// Bytes moved now.
    pub fn touch(&self) {
        self.touch_at(now_ms());
    }

    /// Bytes moved at `now` (a reading of [`now_ms`] the caller already has).
    pub fn touch_at(&self, now: u64) {
        self.millis.store(now, Ordering::Relaxed);
    }

    /// How long nothing moved.
    pub fn since(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.millis.load(Ordering::Relaxed)))
    }
}
