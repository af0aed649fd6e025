//! The decisions waiting to be written, served fairly per requester.
//!
//! Anyone who can create a CSR can create thousands. Served in arrival order, a node's renewal
//! would wait behind all of them; here each requester (`spec.username`) has its own lane and the
//! lanes take turns, so a flood from one bootstrap token delays another requester's request by
//! at most one decision per flooding requester. A lane holds at most [`LANE_MAX`] requests;
//! more are not kept, so memory is bounded per requester (the controller lists again once the
//! queue has drained, and the requests left out come back then).
//!
//! Items are keyed by the request's uid. A write that failed for a transient reason comes back
//! after a per-item exponential backoff, on every path (as a controller's work queue does).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::backoff::Backoff;

/// Requests queued per requester at most.
pub const LANE_MAX: usize = 1024;

const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

struct Slot<T> {
    requester: String,
    item: T,
    backoff: Backoff,
    /// Set while it waits out a backoff.
    due: Option<Instant>,
}

/// Whether an item was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// Queued (or replaced in place).
    Yes,
    /// Its requester's lane is full: not kept.
    LaneFull,
}

/// A fair queue of items keyed by uid.
pub struct WorkQueue<T> {
    slots: HashMap<String, Slot<T>>,
    lanes: HashMap<String, VecDeque<String>>,
    /// Requesters with a non-empty lane, in turn order.
    turn: VecDeque<String>,
    delayed: BTreeSet<(Instant, String)>,
    taken: HashSet<String>,
    /// The newest version of an item that arrived while it was taken.
    newer: HashMap<String, T>,
}

impl<T> Default for WorkQueue<T> {
    fn default() -> Self {
        WorkQueue {
            slots: HashMap::new(),
            lanes: HashMap::new(),
            turn: VecDeque::new(),
            delayed: BTreeSet::new(),
            taken: HashSet::new(),
            newer: HashMap::new(),
        }
    }
}

impl<T> WorkQueue<T> {
    /// Queues `item` for `uid`, or replaces the queued one in place (its turn kept).
    pub fn put(&mut self, uid: &str, requester: &str, item: T) -> Queued {
        if self.taken.contains(uid) {
            self.newer.insert(uid.to_string(), item);
            return Queued::Yes;
        }
        if let Some(slot) = self.slots.get_mut(uid) {
            slot.item = item;
            return Queued::Yes;
        }
        let lane = self.lanes.entry(requester.to_string()).or_default();
        if lane.len() >= LANE_MAX {
            return Queued::LaneFull;
        }
        if lane.is_empty() {
            self.turn.push_back(requester.to_string());
        }
        lane.push_back(uid.to_string());
        self.slots.insert(
            uid.to_string(),
            Slot {
                requester: requester.to_string(),
                item,
                backoff: Backoff::new(RETRY_FIRST, RETRY_MAX),
                due: None,
            },
        );
        Queued::Yes
    }

    /// Drops `uid` (decided elsewhere, deleted), wherever it is.
    pub fn remove(&mut self, uid: &str) {
        self.newer.remove(uid);
        let Some(slot) = self.slots.remove(uid) else {
            return;
        };
        if let Some(due) = slot.due {
            self.delayed.remove(&(due, uid.to_string()));
        }
        if let Some(lane) = self.lanes.get_mut(&slot.requester) {
            lane.retain(|u| u != uid);
            if lane.is_empty() {
                self.lanes.remove(&slot.requester);
                self.turn.retain(|r| *r != slot.requester);
            }
        }
    }

    /// Moves items whose backoff is over back into their lanes.
    fn promote(&mut self, now: Instant) {
        while let Some((at, uid)) = self.delayed.first().cloned() {
            if at > now {
                break;
            }
            self.delayed.pop_first();
            if let Some(slot) = self.slots.get_mut(&uid) {
                slot.due = None;
                let lane = self.lanes.entry(slot.requester.clone()).or_default();
                if lane.is_empty() {
                    self.turn.push_back(slot.requester.clone());
                }
                lane.push_back(uid);
            }
        }
    }

    /// The next item in turn (the requester whose turn it is goes to the back), taken until
    /// [`WorkQueue::done`] or [`WorkQueue::retry`]; `skip` passes items over for now.
    pub fn take(&mut self, now: Instant, skip: impl Fn(&T) -> bool) -> Option<(String, T)>
    where
        T: Clone,
    {
        self.promote(now);
        for _ in 0..self.turn.len() {
            let requester = self.turn.pop_front()?;
            let lane = self.lanes.get_mut(&requester)?;
            let position = lane
                .iter()
                .position(|uid| self.slots.get(uid).is_some_and(|s| !skip(&s.item)));
            let Some(position) = position else {
                self.turn.push_back(requester);
                continue;
            };
            let uid = lane.remove(position)?;
            if lane.is_empty() {
                self.lanes.remove(&requester);
            } else {
                self.turn.push_back(requester);
            }
            let item = self.slots.get(&uid)?.item.clone();
            self.taken.insert(uid.clone());
            return Some((uid, item));
        }
        None
    }

    /// Returns a taken item, unchanged, to the front of its lane (its requester keeps its
    /// place in the turn order only as far as the lane goes: the lane goes to the back).
    pub fn put_back(&mut self, uid: &str, item: T) {
        if !self.taken.remove(uid) {
            return;
        }
        let newer = self.newer.remove(uid);
        let Some(slot) = self.slots.get_mut(uid) else {
            return;
        };
        slot.item = newer.unwrap_or(item);
        let lane = self.lanes.entry(slot.requester.clone()).or_default();
        if lane.is_empty() {
            self.turn.push_front(slot.requester.clone());
        }
        lane.push_front(uid.to_string());
    }

    /// A taken item is finished (written, or found changed): forgotten, unless a newer
    /// version came meanwhile, which is queued.
    pub fn done(&mut self, uid: &str) {
        self.taken.remove(uid);
        let slot = self.slots.remove(uid);
        if let (Some(newer), Some(slot)) = (self.newer.remove(uid), slot) {
            self.put(uid, &slot.requester, newer);
        }
    }

    /// A taken item failed for a transient reason: it comes back after its backoff (the
    /// newest version of it, if one came meanwhile).
    pub fn retry(&mut self, uid: &str, now: Instant) {
        self.taken.remove(uid);
        let newer = self.newer.remove(uid);
        if let Some(slot) = self.slots.get_mut(uid) {
            if let Some(newer) = newer {
                slot.item = newer;
            }
            let due = now + slot.backoff.next_delay();
            slot.due = Some(due);
            self.delayed.insert((due, uid.to_string()));
        }
    }

    /// When the next delayed item is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.delayed.first().map(|(at, _)| *at)
    }

    /// Whether some item is ready to be taken now (in a lane, not waiting out a backoff).
    pub fn has_ready(&self) -> bool {
        !self.turn.is_empty()
    }

    /// Items queued, delayed or taken.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether nothing is queued, delayed or taken.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Drops every item whose uid is not in `live` and not taken (after a relist).
    pub fn keep(&mut self, live: &HashSet<String>) {
        let gone: Vec<String> = self
            .slots
            .keys()
            .filter(|u| !live.contains(*u) && !self.taken.contains(*u))
            .cloned()
            .collect();
        for uid in gone {
            self.remove(&uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requesters_take_turns_however_many_one_of_them_queued() {
        let mut q = WorkQueue::default();
        let now = Instant::now();
        for i in 0..1000 {
            assert_eq!(q.put(&format!("flood-{i}"), "bootstrap", i), Queued::Yes);
        }
        q.put("renewal", "system:node:a", 9999);
        let first = q.take(now, |_| false).expect("item");
        assert_eq!(first.0, "flood-0");
        let second = q.take(now, |_| false).expect("item");
        assert_eq!(
            second.0, "renewal",
            "the node waits for one flood item, not 999"
        );
    }

    #[test]
    fn a_full_lane_keeps_nothing_more_and_other_lanes_are_not_affected() {
        let mut q = WorkQueue::default();
        for i in 0..LANE_MAX {
            q.put(&format!("u{i}"), "bootstrap", ());
        }
        assert_eq!(q.put("one-more", "bootstrap", ()), Queued::LaneFull);
        assert_eq!(q.put("node", "system:node:a", ()), Queued::Yes);
        assert_eq!(q.len(), LANE_MAX + 1);
    }

    #[test]
    fn a_failed_item_comes_back_after_its_backoff_and_a_newer_version_replaces_it() {
        let mut q = WorkQueue::default();
        let now = Instant::now();
        q.put("u", "r", 1);
        let (uid, _) = q.take(now, |_| false).expect("item");
        q.put("u", "r", 2); // a newer version while the write is in flight
        q.retry(&uid, now);
        assert!(q.take(now, |_| false).is_none(), "not before its backoff");
        let later = q.next_due().expect("delayed");
        assert_eq!(q.take(later, |_| false), Some(("u".into(), 2)));
        q.done("u");
        assert!(q.is_empty());
    }

    #[test]
    fn skipped_items_wait_while_others_go() {
        let mut q = WorkQueue::default();
        let now = Instant::now();
        q.put("a", "r", true);
        q.put("b", "r", false);
        assert_eq!(q.take(now, |waits| *waits), Some(("b".into(), false)));
        assert!(q.take(now, |waits| *waits).is_none());
        assert_eq!(q.take(now, |_| false), Some(("a".into(), true)));
    }
}
