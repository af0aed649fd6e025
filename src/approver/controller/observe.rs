//! What the loop takes note of: each watch event, each request of ours (judged by its policy
//! and queued, or remembered as decided), the carriers approved.

use std::collections::HashSet;
use std::time::Instant;

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::runtime::watcher;

use super::state::{now_unix, Controller, Work};
use crate::approver::ek_join::CREDENTIAL_SIGNER;
use crate::approver::error::ApproverError;
use crate::approver::evaluate::{self, Candidate, Seen};
use crate::approver::policy::{carrier, Judged, SignerPolicy};
use crate::approver::queue::Queued;
use crate::approver::relist::must_relist;
use crate::pki::attestation;
use crate::pki::request::Request;

impl Controller {
    pub(super) fn on_event(
        &mut self,
        event: Result<watcher::Event<CertificateSigningRequest>, watcher::Error>,
    ) {
        match event {
            Ok(watcher::Event::Init) => self.listing = Some(HashSet::new()),
            Ok(watcher::Event::InitApply(csr)) => {
                if let Some(listing) = &mut self.listing {
                    listing.insert(Seen::of(&csr).uid);
                }
                self.observe(&csr);
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(live) = self.listing.take() {
                    self.queue.keep(&live);
                    self.index.keep_waiting(&live);
                }
                self.listed_once = true;
            }
            Ok(watcher::Event::Apply(csr)) => self.observe(&csr),
            Ok(watcher::Event::Delete(csr)) => {
                let seen = Seen::of(&csr);
                if seen.signer == CREDENTIAL_SIGNER {
                    self.carriers.deleted(&seen.name);
                }
                self.queue.remove(&seen.uid);
                self.index.forget_uid(&seen.uid);
            }
            Err(e) => {
                self.metrics.watch_errors.inc();
                let relist = must_relist(&e);
                let e = ApproverError::Watch { source: e };
                if relist {
                    // kube's watcher would retry from the version it holds, forever.
                    tracing::warn!(error = %e, "the API server no longer has the version this watch resumes from (an etcd restore, or compaction): listing everything again");
                    self.relist_now = true;
                } else {
                    tracing::warn!(error = %e, "watching requests failed; kube's watcher retries with backoff");
                }
            }
        }
    }
    /// Takes note of one request of ours: the evidence an approved one holds; the decision an
    /// open one gets from its own content.
    pub(super) fn observe(&mut self, csr: &CertificateSigningRequest) {
        if !self.settings.signer_names.contains(&csr.spec.signer_name) {
            return;
        }
        let seen = Seen::of(csr);
        if let Ok(v) = seen.resource_version.parse::<u64>() {
            self.versions.saw(v);
        }
        let issue_only = self.note_carrier(csr, &seen);
        if let Some(approved) = evaluate::is_decided(csr).filter(|_| !issue_only) {
            self.observe_decided(csr, &seen, approved);
            return;
        }
        let Some(policy) = self.policy_of(&seen.signer) else {
            return;
        };
        let started = Instant::now();
        let judged = policy.judge(csr, &self.settings.rules, now_unix());
        self.metrics
            .verify_seconds
            .observe(started.elapsed().as_secs_f64());
        let work = match judged {
            Judged::Ignore => {
                self.queue.remove(&seen.uid);
                return;
            }
            Judged::Deny(v) if issue_only => Work::Fail(Box::new(seen), v),
            Judged::Deny(v) => {
                self.index.forget_uid(&seen.uid);
                Work::Deny(Box::new(seen), v)
            }
            Judged::Settle(pending) => {
                if let Some(c) = pending.evidence() {
                    self.index_waiting(c, &seen.name);
                }
                Work::Settle(Box::new(seen), pending)
            }
        };
        let (uid, requester) = (work.seen().uid.clone(), work.seen().requester.clone());
        if self.queue.put(&uid, &requester, work) == Queued::LaneFull {
            self.metrics.deferred.inc();
            self.deferred = true;
            tracing::debug!(requester = %super::policy::bounded(&requester), "this requester has too many open requests queued; the rest wait for the next resync");
        }
    }
    /// Takes note of a carrier request's facts (any state); returns whether it is approved
    /// but not issued (its certificate's write failed: it is issued now).
    pub(super) fn note_carrier(&mut self, csr: &CertificateSigningRequest, seen: &Seen) -> bool {
        if seen.signer != CREDENTIAL_SIGNER {
            return false;
        }
        // Only an approved carrier's credential can be answered: others are not remembered.
        if evaluate::is_decided(csr) == Some(true) {
            if let Some(facts) = carrier::facts_of(csr) {
                self.carriers.seen(&seen.name, facts);
            }
        }
        carrier::issue_only(csr)
    }
    /// The policy of `signer`, when this approver decides for it.
    pub(super) fn policy_of(&self, signer: &str) -> Option<SignerPolicy> {
        self.policies
            .iter()
            .find(|(name, _)| name == signer)
            .map(|(_, p)| *p)
    }
    /// A decided request: an approved one holds its evidence (and the credential it answered).
    pub(super) fn observe_decided(
        &mut self,
        csr: &CertificateSigningRequest,
        seen: &Seen,
        approved: bool,
    ) {
        self.queue.remove(&seen.uid);
        if !approved {
            self.index.forget_uid(&seen.uid);
            return;
        }
        if let Some(carrier) = carrier::answered_carrier(csr) {
            self.carriers.answered_by(carrier, &seen.name, now_unix());
        }
        let held = Request::from_pem(&csr.spec.request.0)
            .ok()
            .and_then(|r| attestation::evidence_digest(&r));
        if let Some((digest, made_at)) = held {
            self.index.approved(digest, made_at, &seen.uid, &seen.name);
        }
    }
    /// Enters a candidate's evidence in the index, as waiting for its decision.
    pub(super) fn index_waiting(&mut self, c: &Candidate, name: &str) {
        self.index.waiting(
            c.attested.evidence_digest,
            c.attested.made_at,
            c.rank.clone(),
            name,
        );
    }
}
