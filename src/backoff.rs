//! One backoff for every retry loop: the approver's requeue and its trust source, the proxy's
//! renewal, a TPM reconnect.

use std::time::Duration;

/// Exponential backoff: doubles from `first` up to `max`, with up to a quarter of jitter so
/// replicas (and proxies on many nodes) do not retry in step.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `first`.
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    /// The delay before the next attempt; the one after it doubles.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        let mut byte = [0u8; 1];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut byte);
        delay + delay / 4 * u32::from(byte[0]) / 255
    }

    /// After a success: the next failure waits `first` again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(5));
        let delays: Vec<u64> = (0..5).map(|_| b.next_delay().as_millis() as u64).collect();
        for (d, base) in delays.iter().zip([1000, 2000, 4000, 5000, 5000]) {
            assert!((base..=base + base / 4).contains(d), "{delays:?}");
        }
        b.reset();
        assert!(b.next_delay() < Duration::from_millis(1300));
    }
}
