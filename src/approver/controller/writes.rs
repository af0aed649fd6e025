//! Starting writes while there is room (fairly per requester, a settlement only on a fresh
//! trust reading), settling through the policies, and what a write's outcome changes.

use std::sync::Arc;
use std::time::Instant;

use futures::stream::FuturesUnordered;

use super::state::{now_unix, Controller, Mode, Refresh, Work, Writing, IN_FLIGHT};
use crate::approver::decision::{Decided, Effect};
use crate::approver::error::ApproverError;
use crate::approver::evaluate::Candidate;
use crate::approver::policy::{self, Settling};
use crate::approver::trust::{Registry, Trust, TrustKind, FRESH_FOR};
use crate::approver::write::{write_decision, Recorded, WriteFuture};

impl Controller {
    /// Starts writes while there is room: in turn per requester; a settlement needs the trust
    /// read within [`FRESH_FOR`], so those wait for a reading while denials go on.
    pub(super) fn dispatch(
        &mut self,
        writes: &mut FuturesUnordered<WriteFuture>,
        refresh: &mut Option<Refresh>,
    ) {
        while writes.len() < IN_FLIGHT {
            let fresh = |t: &Option<Trust>| t.as_ref().and_then(|t| t.now().fresh(FRESH_FOR));
            let (nodes, people) = (fresh(&self.trust), fresh(&self.people));
            // A settlement passed over for want of a fresh reading starts one at once (denials
            // in other lanes do not wait for it, nor it for them).
            let passed_over = std::cell::Cell::new(false);
            let waits = |w: &Work| {
                let waits = match w {
                    Work::Deny(..) | Work::Fail(..) => false,
                    Work::Settle(_, p) => match p.reads() {
                        TrustKind::Nodes => self.trust.is_some() && nodes.is_none(),
                        TrustKind::People => self.people.is_some() && people.is_none(),
                    },
                };
                passed_over.set(passed_over.get() || waits);
                waits
            };
            let taken = self.queue.take(Instant::now(), waits);
            if passed_over.get() && refresh.is_none() {
                self.start_refresh(refresh);
            }
            let Some((uid, work)) = taken else {
                return;
            };
            // While a settlement waits for its reading (one API round trip), no other write
            // starts: its turn comes right after the reading, not after whatever started
            // meanwhile.
            if passed_over.get() && refresh.is_some() {
                self.queue.put_back(&uid, work);
                return;
            }
            let Some(decided) = self.decide(work, [&nodes, &people]) else {
                self.queue.retry(&uid, Instant::now());
                continue;
            };
            writes.push(self.start_write(uid, decided));
        }
    }
    /// The decision for `work`, with the `[nodes, people]` trusts as read (None when the one
    /// it needs is not fresh: it waits).
    pub(super) fn decide(
        &mut self,
        work: Work,
        [nodes, people]: [&Option<Arc<Registry>>; 2],
    ) -> Option<Decided> {
        match work {
            Work::Deny(seen, v) => Some(Decided::denied(seen, v)),
            Work::Fail(seen, v) => Some(Decided {
                effect: Effect::Fail,
                ..Decided::denied(seen, v)
            }),
            Work::Settle(seen, pending) => {
                let mut settling = Settling {
                    rules: &self.settings.rules,
                    index: &mut self.index,
                    carriers: &mut self.carriers,
                    now: now_unix(),
                };
                policy::settle(
                    &mut settling,
                    seen,
                    pending,
                    [nodes.as_ref(), people.as_ref()],
                )
            }
        }
    }
    /// Remembers what is being written (to give the evidence back if the write fails) and
    /// returns the write.
    pub(super) fn start_write(&mut self, uid: String, decided: Decided) -> WriteFuture {
        let answering = match &decided.effect {
            Effect::Record(b) => Some(b.carrier.clone()),
            _ => None,
        };
        self.writing.insert(
            uid.clone(),
            Writing {
                decision: decided.decision.clone(),
                granted: decided.granted,
                answering,
            },
        );
        write_decision(
            self.api.clone(),
            self.validity.clone(),
            self.trust.clone(),
            self.nodes.clone(),
            uid,
            *decided.seen,
            (decided.decision, decided.effect),
        )
    }
    pub(super) fn start_refresh(&mut self, refresh: &mut Option<Refresh>) {
        if self.trust_retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let trusts: Vec<Trust> = [&self.trust, &self.people]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        // Each source on its own: one that cannot be read does not hold the other back.
        *refresh = Some(Box::pin(async move {
            let readings = futures::future::join_all(trusts.iter().map(|t| t.refresh(FRESH_FOR)));
            match readings.await.into_iter().find_map(Result::err) {
                Some(e) => Err(ApproverError::from(e)),
                None => Ok(()),
            }
        }));
    }
    /// `--once` with no trust to settle on: the waiting requests cannot be decided.
    pub(super) fn fail_waiting_settles(&mut self, error: ApproverError) {
        let mut failed = false;
        while let Some((uid, _)) = self.queue.take(Instant::now(), |w| !w.settles()) {
            self.queue.done(&uid);
            failed = true;
        }
        if failed {
            self.failures.push(error);
        }
    }
    pub(super) fn on_written(
        &mut self,
        uid: &str,
        result: Result<Recorded, ApproverError>,
        mode: Mode,
    ) {
        let Some(writing) = self.writing.remove(uid) else {
            return;
        };
        let mut decision = writing.decision;
        if let Ok(Recorded::Instead(now)) = &result {
            decision = (**now).clone();
        }
        match result {
            Ok(Recorded::Yes | Recorded::Instead(_)) => {
                self.queue.done(uid);
                self.metrics.decided(decision.reason);
                tracing::info!(
                    csr = %decision.name,
                    approved = decision.approved,
                    reason = %decision.reason,
                    "{}",
                    decision.message
                );
                if mode == Mode::Once {
                    self.decided.push(decision);
                }
            }
            Ok(Recorded::Conflict) => {
                self.queue.done(uid);
                self.release(uid, writing.granted, &decision.name);
                if let Some(carrier) = &writing.answering {
                    self.carriers.release(carrier, &decision.name);
                }
                self.metrics.conflicts.inc();
                tracing::info!(csr = %decision.name, "changed since it was read (decided by another approver, or deleted): left as it is");
            }
            Err(e) => {
                self.release(uid, writing.granted, &decision.name);
                if let Some(carrier) = &writing.answering {
                    self.carriers.release(carrier, &decision.name);
                }
                if mode == Mode::Once {
                    self.queue.done(uid);
                    tracing::error!(csr = %decision.name, error = %e, "cannot record a decision; it stays open");
                    self.failures.push(e);
                } else {
                    self.metrics.retries.inc();
                    tracing::error!(csr = %decision.name, approved = decision.approved, reason = %decision.reason, error = %e, "cannot record a decision now; retrying with backoff");
                    self.queue.retry(uid, Instant::now());
                }
            }
        }
    }
    /// A grant whose write did not happen gives the evidence back.
    pub(super) fn release(&mut self, uid: &str, granted: Option<Box<Candidate>>, name: &str) {
        if let Some(c) = granted {
            debug_assert_eq!(c.rank.uid, uid);
            self.index
                .release(&c.attested.evidence_digest, c.rank, name);
        }
    }
}
