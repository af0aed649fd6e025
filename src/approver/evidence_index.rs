//! Which request holds each piece of TPM evidence: evidence is used once.
//!
//! A copy of a node's request (same subject, key and evidence) issues nothing the node could
//! not have, but it must neither be approved as well nor keep the original out. So the index
//! keeps, per evidence digest, the request that was approved with it (by uid, so a request
//! deleted and re-created under its own name is a new request), and the requests waiting for
//! a decision that passed every other check, each with its [`Rank`]. When one is settled, the
//! best-ranked waiting request gets the evidence and the others are denied `EvidenceReused`.
//! A request whose requester may not ask for the identity never gets here (it is denied
//! `RequesterNotAllowed` first), so a stranger's copy cannot outrank the original.
//!
//! Memory is bounded by time, not by what is in the cluster: an entry is forgotten once its
//! evidence is older than the freshness window (no request carrying it can be approved then),
//! and nothing of a request but its uid, name and rank is kept.

use std::collections::HashMap;

use super::evaluate::Rank;

/// One piece of evidence.
#[derive(Debug, Default)]
struct Entry {
    /// When the evidence was made (Unix seconds).
    made_at: u64,
    /// The request approved with it (uid, name), or being approved right now.
    holder: Option<(String, String)>,
    /// Requests waiting for a decision that passed every other check: rank and name.
    waiting: Vec<(Rank, String)>,
}

/// What settling a waiting request decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// It holds the evidence now: approve it (and [`EvidenceIndex::release`] on a failed
    /// write).
    Granted,
    /// Another request holds it, or ranks before it: the other's name.
    HeldBy(String),
}

/// The evidence digests of the requests seen.
#[derive(Debug, Default)]
pub struct EvidenceIndex {
    entries: HashMap<[u8; 32], Entry>,
}

impl EvidenceIndex {
    /// Records that request `uid` (`name`) was approved with the evidence `digest`.
    pub fn approved(&mut self, digest: [u8; 32], made_at: u64, uid: &str, name: &str) {
        let entry = self.entries.entry(digest).or_default();
        entry.made_at = made_at;
        entry.waiting.retain(|(r, _)| r.uid != uid);
        if entry.holder.is_none() {
            entry.holder = Some((uid.to_string(), name.to_string()));
        }
    }

    /// Records a request waiting for a decision (it replaces an earlier record of the same
    /// uid).
    pub fn waiting(&mut self, digest: [u8; 32], made_at: u64, rank: Rank, name: &str) {
        let entry = self.entries.entry(digest).or_default();
        entry.made_at = made_at;
        entry.waiting.retain(|(r, _)| r.uid != rank.uid);
        entry.waiting.push((rank, name.to_string()));
    }

    /// Forgets a waiting request (deleted, or denied for another reason). A holder stays: the
    /// evidence was used.
    pub fn forget(&mut self, digest: &[u8; 32], uid: &str) {
        if let Some(entry) = self.entries.get_mut(digest) {
            entry.waiting.retain(|(r, _)| r.uid != uid);
        }
    }

    /// Forgets a waiting request whose evidence is not known here (deleted, or decided
    /// elsewhere).
    pub fn forget_uid(&mut self, uid: &str) {
        for entry in self.entries.values_mut() {
            entry.waiting.retain(|(r, _)| r.uid != uid);
        }
    }

    /// Settles waiting request `uid`: it gets the evidence when nobody holds it and it ranks
    /// first among the waiting.
    pub fn claim(&mut self, digest: &[u8; 32], uid: &str) -> Claim {
        let Some(entry) = self.entries.get_mut(digest) else {
            return Claim::HeldBy("(unknown: the request was not recorded)".into());
        };
        if let Some((holder, name)) = &entry.holder {
            if holder != uid {
                return Claim::HeldBy(name.clone());
            }
            return Claim::Granted;
        }
        let best = entry.waiting.iter().min_by(|a, b| a.0.cmp(&b.0));
        match best {
            Some((rank, name)) if rank.uid != uid => Claim::HeldBy(name.clone()),
            Some((_, name)) => {
                entry.holder = Some((uid.to_string(), name.clone()));
                entry.waiting.retain(|(r, _)| r.uid != uid);
                Claim::Granted
            }
            None => Claim::HeldBy("(unknown: the request was not recorded)".into()),
        }
    }

    /// Gives the evidence back after a write that did not happen: `uid` waits again with
    /// `rank`.
    pub fn release(&mut self, digest: &[u8; 32], rank: Rank, name: &str) {
        if let Some(entry) = self.entries.get_mut(digest) {
            if entry.holder.as_ref().is_some_and(|(h, _)| *h == rank.uid) {
                entry.holder = None;
            }
            entry.waiting.retain(|(r, _)| r.uid != rank.uid);
            entry.waiting.push((rank, name.to_string()));
        }
    }

    /// Forgets evidence made before `cutoff` (Unix seconds): no request carrying it can be
    /// approved any more.
    pub fn prune(&mut self, cutoff: i64) {
        self.entries
            .retain(|_, e| i64::try_from(e.made_at).unwrap_or(i64::MAX) >= cutoff);
    }

    /// Forgets every waiting record whose uid is not in `live` (after a relist: requests
    /// deleted while the watch was down).
    pub fn keep_waiting(&mut self, live: &std::collections::HashSet<String>) {
        for entry in self.entries.values_mut() {
            entry.waiting.retain(|(r, _)| live.contains(&r.uid));
        }
    }

    /// How many pieces of evidence are recorded.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(class: u8, created: i64, uid: &str) -> Rank {
        Rank {
            class,
            created,
            revision: 1,
            uid: uid.into(),
        }
    }

    #[test]
    fn the_best_ranked_waiting_request_gets_the_evidence_whatever_the_names() {
        let d = [7u8; 32];
        let mut index = EvidenceIndex::default();
        // A copy by a bootstrap identity made in the same second, named to sort first, and
        // the node's own renewal: the node's class wins.
        index.waiting(d, 100, rank(1, 100, "uid-copy"), "aaaa-copy");
        index.waiting(d, 100, rank(0, 100, "uid-node"), "zzzz-node");
        assert_eq!(
            index.claim(&d, "uid-copy"),
            Claim::HeldBy("zzzz-node".into())
        );
        assert_eq!(index.claim(&d, "uid-node"), Claim::Granted);
        assert_eq!(
            index.claim(&d, "uid-copy"),
            Claim::HeldBy("zzzz-node".into())
        );
        // Asked again (a retried write), the holder keeps it.
        assert_eq!(index.claim(&d, "uid-node"), Claim::Granted);
    }

    #[test]
    fn a_failed_write_gives_the_evidence_back_and_a_reused_uid_is_a_new_request() {
        let d = [1u8; 32];
        let mut index = EvidenceIndex::default();
        index.waiting(d, 100, rank(1, 100, "u1"), "n");
        assert_eq!(index.claim(&d, "u1"), Claim::Granted);
        index.release(&d, rank(1, 100, "u1"), "n");
        assert_eq!(index.claim(&d, "u1"), Claim::Granted);
        // The request is deleted and created again under its own name: another uid.
        index.waiting(d, 100, rank(1, 200, "u2"), "n");
        assert_eq!(index.claim(&d, "u2"), Claim::HeldBy("n".into()));
    }

    #[test]
    fn evidence_past_the_window_is_forgotten() {
        let mut index = EvidenceIndex::default();
        index.approved([1; 32], 100, "u1", "a");
        index.approved([2; 32], 500, "u2", "b");
        index.prune(300);
        assert_eq!(index.len(), 1);
    }
}
