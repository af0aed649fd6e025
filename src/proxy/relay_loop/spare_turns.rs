//! The loop's part in making spares ([`super::filling`]): a slot for each while it is made,
//! its turns, its end, and the expiry of each it made and the proxy kept, run on this loop when
//! due (a spare nobody took is closed by the loop that made it).

use std::time::Duration;

use super::dialed::Stage;
use super::filling::{Expiry, Filled, Filling, SpareDial};
use super::relayed::Relayed;
use super::{watch, Loop};

impl Loop {
    /// Makes the spare `dial` asks for, in a slot of this loop.
    pub(super) fn fill(&mut self, dial: SpareDial, now: u64) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        let Some(filling) = Filling::start(dial, &self.ep, slot, now) else {
            self.free.push(slot);
            return;
        };
        // Not counted in the loop's load, which places connections: a spare is no client's
        // yet, and is here for a round trip or two.
        self.conns[slot] = Some(Relayed::Filling(Box::new(filling)));
        self.fill_turn(slot, now);
    }

    /// A spare's turn: it waits (with its deadline kept), or is done with this loop.
    pub(super) fn fill_turn(&mut self, slot: usize, now: u64) {
        let Some(Some(Relayed::Filling(filling))) = self.conns.get_mut(slot) else {
            return;
        };
        let records = &mut self.scratch.records[..];
        let filled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| filling.drive(records, now)))
                .unwrap_or_else(|_| {
                    Filled::Failed(
                        Stage::Local,
                        std::io::Error::other(
                            "the relay loop failed on a spare (a bug, logged above)",
                        ),
                    )
                });
        match filled {
            Filled::Waiting => {
                self.schedule(slot, now);
            }
            done => self.end_filling(slot, done, now),
        }
    }

    /// Ends the spare at `slot` as `filled` says; one the proxy kept is closed here when its
    /// expiry is due, if nobody took it.
    pub(super) fn end_filling(&mut self, slot: usize, filled: Filled, now: u64) {
        let Some(held) = self.conns.get_mut(slot) else {
            return;
        };
        if !matches!(held, Some(Relayed::Filling(_))) {
            return;
        }
        let Some(Relayed::Filling(filling)) = held.take() else {
            return;
        };
        self.free.push(slot);
        let ep = &self.ep;
        let kept =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| filling.end(ep, filled)));
        if let Ok(Some((after, expiry))) = kept {
            self.later(after, expiry, now);
        }
    }

    /// Runs `expiry` `after` from `now`, on this loop.
    fn later(&mut self, after: Duration, expiry: Expiry, now: u64) {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        let at = now.saturating_add(ms);
        self.expiries.push((at, expiry));
        let at = at.max(now.saturating_add(watch::MIN_SCAN_MS));
        self.next_check = Some(self.next_check.map_or(at, |n| n.min(at)));
    }

    /// Runs the expiries due by `now` (all of them when `all`: the loop stops); the next one
    /// left, if any.
    pub(super) fn run_expiries(&mut self, now: u64, all: bool) -> Option<u64> {
        let (due, left): (Vec<_>, Vec<_>) = std::mem::take(&mut self.expiries)
            .into_iter()
            .partition(|(at, _)| all || *at <= now);
        self.expiries = left;
        for (_, expiry) in due {
            // A bug in the proxy's part loses that spare's close, not the loop.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(expiry));
        }
        self.expiries.iter().map(|(at, _)| *at).min()
    }
}
