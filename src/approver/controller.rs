//! The decision loop: kube's watcher brings the requests of our signers; each is judged from
//! its own content at once ([`evaluate`]) and kept only as a small [`Work`] item in a fair
//! queue ([`WorkQueue`]); items are settled against the trust and the evidence index and
//! written up to [`IN_FLIGHT`] at a time, while this replica leads.
//!
//! - Memory is bounded whatever is in the cluster: the watcher lists in pages of
//!   [`PAGE_SIZE`] (an attacker's megabyte requests arrive a few at a time), a request larger
//!   than 64 KiB is denied unread, and nothing of a request is kept but its uid, name, version,
//!   requester, small annotations and labels (to write back) and the decision's reason (a
//!   carrier request waiting also keeps its enrollment, at most 16 KiB).
//! - A (re)list is finished before anything is written, so the evidence index has seen every
//!   listed request before ranking them; the watcher relists after a 410, a dead connection
//!   (its idle deadline) and every [`RESYNC`], and the loop starts a new list at once when a
//!   watch cannot resume from its version (an etcd restore: `must_relist`).
//! - Every failed write comes back with backoff ([`WorkQueue::retry`]), from the first list
//!   on. A write carries the resourceVersion and uid that were read, so two deciders (a lease
//!   handover, `--leader-elect=false`) write one condition per request (409 for the other).
//! - A standby follows the requests too, writing nothing: it takes over warm.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{Future, StreamExt};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use tokio::sync::watch;

use super::decision::{Decided, Decision, Effect};
use super::ek_join::{Carriers, CREDENTIAL_SIGNER};
use super::error::ApproverError;
use super::evaluate::{self, Candidate, Rules, Seen};
use super::evidence_index::EvidenceIndex;
use super::lease::Validity;
use super::metrics::ApproverMetrics;
use super::node_addresses::NodeIndex;
use super::policy::{
    self, carrier, Configured, Judged, Pending, Settling, SignerPolicy, Violation,
};
use super::queue::{Queued, WorkQueue, LANE_MAX};
pub use super::relist::PROBE_EVERY;
use super::relist::{must_relist, Probe, Versions};
use super::trust::{Registry, Trust, TrustKind, FRESH_FOR};
use super::write::{write, Recorded, WriteFuture};
use crate::pki::attestation;
use crate::pki::request::Request;

/// Decisions written at once: the API server's round trip, not the check, bounds the rate.
pub const IN_FLIGHT: usize = 16;

/// Requests per list page: an attacker's 1.3 MB requests cost at most this many at once.
pub const PAGE_SIZE: u32 = 4;

/// The watch's server-side timeout; kube's watcher takes a silent connection for dead 5 s after.
const WATCH_TIMEOUT_SECS: u32 = 30;

/// How often everything is listed again, whatever else happens.
pub const RESYNC: Duration = Duration::from_secs(15 * 60);

/// How long a failed trust reading waits before the next.
const TRUST_RETRY: Duration = Duration::from_secs(1);

/// What the approver decides for and with what.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The signerNames whose requests this approver decides (each must have a policy).
    pub signer_names: Vec<String>,
    /// The rules beyond the signer's policy.
    pub rules: Rules,
}

/// A decision waiting to be written.
#[derive(Debug, Clone)]
enum Work {
    /// Denied by the request alone.
    Deny(Box<Seen>, Violation),
    /// To be settled by its policy against the trust.
    Settle(Box<Seen>, Pending),
    /// Approved, but it can no longer be finished (a carrier whose certificate's write
    /// failed): a Failed condition.
    Fail(Box<Seen>, Violation),
}

impl Work {
    fn seen(&self) -> &Seen {
        match self {
            Work::Deny(s, _) | Work::Settle(s, _) | Work::Fail(s, _) => s,
        }
    }

    /// Whether writing it needs a fresh reading of a trust source.
    fn settles(&self) -> bool {
        matches!(self, Work::Settle(..))
    }
}

/// A write in flight: what was decided, and whether it claimed the evidence.
struct Writing {
    decision: Decision,
    granted: Option<Box<Candidate>>,
    /// The carrier it answers, claimed while it is written.
    answering: Option<String>,
}

type Refresh = Pin<Box<dyn Future<Output = Result<(), ApproverError>> + Send>>;

/// What the loop does after one watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Start a new watcher (a full list).
    Resync,
    /// Stop.
    End,
}

/// What the loop has in flight besides the watcher.
struct InFlight {
    writes: FuturesUnordered<WriteFuture>,
    refresh: Option<Refresh>,
    /// A reading of the API server's current resource version (see [`PROBE_EVERY`]).
    probe: Option<Probe>,
    tick: tokio::time::Interval,
}

/// Whether the loop follows the requests until stopped, or decides the listed ones and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Follow, deciding while leading.
    Follow,
    /// Decide what the first list shows, then end (`hwkey approver --once`).
    Once,
}

/// The decision loop's state.
pub struct Controller {
    api: Api<CertificateSigningRequest>,
    settings: Settings,
    /// The policy of each signer decided for.
    policies: Vec<(String, SignerPolicy)>,
    /// Every Node's names and addresses (read by serving decisions only).
    nodes: NodeIndex,
    /// The registered nodes (None: no kubelet signer decided).
    trust: Option<Trust>,
    /// The people trust (None: no people policy).
    people: Option<Trust>,
    index: EvidenceIndex,
    /// The carrier requests seen and answered (TPMs joining by their EK certificate).
    carriers: Carriers,
    queue: WorkQueue<Work>,
    writing: std::collections::HashMap<String, Writing>,
    metrics: Arc<ApproverMetrics>,
    validity: Option<Validity>,
    /// The uids seen during the (re)list in progress.
    listing: Option<HashSet<String>>,
    listed_once: bool,
    /// A full lane left requests out: list again once the queue has drained.
    deferred: bool,
    /// The watch cannot resume from its version: list again now.
    relist_now: bool,
    /// The resource versions seen, and the probe that tells an etcd restore.
    versions: Versions,
    trust_retry_at: Option<Instant>,
    /// `--once`: the decisions written and the failures.
    decided: Vec<Decision>,
    failures: Vec<ApproverError>,
}

/// What `--once` did.
#[derive(Debug)]
pub struct Round {
    /// The decisions written.
    pub decisions: Vec<Decision>,
    /// Requests that could not be decided (they stay open).
    pub failures: Vec<ApproverError>,
}

impl Controller {
    /// A loop over `client`'s requests for `settings`' signers, deciding with `[nodes, people]`
    /// trusts.
    pub fn new(
        client: &kube::Client,
        settings: Settings,
        [trust, people]: [Option<Trust>; 2],
        metrics: Arc<ApproverMetrics>,
        validity: Option<Validity>,
    ) -> Controller {
        let configured = Configured::of(&settings.rules);
        let policies = settings
            .signer_names
            .iter()
            .filter_map(|s| Some((s.clone(), SignerPolicy::for_signer(s, configured).ok()?)))
            .collect();
        Controller {
            api: Api::all(client.clone()),
            settings,
            policies,
            nodes: NodeIndex::default(),
            trust,
            people,
            index: EvidenceIndex::default(),
            carriers: Carriers::default(),
            queue: WorkQueue::default(),
            writing: Default::default(),
            metrics,
            validity,
            listing: None,
            listed_once: false,
            deferred: false,
            relist_now: false,
            versions: Versions::default(),
            trust_retry_at: None,
            decided: Vec::new(),
            failures: Vec::new(),
        }
    }

    fn watcher_config(&self) -> watcher::Config {
        let config = watcher::Config::default()
            .page_size(PAGE_SIZE)
            .timeout(WATCH_TIMEOUT_SECS);
        // The API server filters on spec.signerName when we decide for one signer.
        match self.settings.signer_names.as_slice() {
            [one] => config.fields(&format!("spec.signerName={one}")),
            _ => config,
        }
    }

    /// Runs until `stop` (or, with [`Mode::Once`], until the listed requests are decided),
    /// writing only while `leading` is true.
    pub async fn run(
        &mut self,
        mode: Mode,
        mut leading: watch::Receiver<bool>,
        mut stop: watch::Receiver<bool>,
    ) -> Round {
        let mut io = InFlight {
            writes: FuturesUnordered::new(),
            refresh: None,
            probe: None,
            tick: tokio::time::interval(Duration::from_secs(1)),
        };
        while self.one_watch(mode, &mut leading, &mut stop, &mut io).await == Next::Resync {}
        // Writes already sent finish before the loop ends.
        while let Some((uid, result)) = io.writes.next().await {
            self.on_written(&uid, result, mode);
        }
        Round {
            decisions: std::mem::take(&mut self.decided),
            failures: std::mem::take(&mut self.failures),
        }
    }

    /// One watcher, from its list to a resync or the end.
    async fn one_watch(
        &mut self,
        mode: Mode,
        leading: &mut watch::Receiver<bool>,
        stop: &mut watch::Receiver<bool>,
        io: &mut InFlight,
    ) -> Next {
        let mut stream = std::pin::pin!(
            watcher::watcher(self.api.clone(), self.watcher_config()).default_backoff()
        );
        let resync_at = tokio::time::Instant::now() + RESYNC;
        self.versions.new_watch();
        io.probe = None;
        let mut listening = true;
        loop {
            if let Some(next) = self.before_waiting(mode, *leading.borrow(), io) {
                return next;
            }
            let next_due = self.queue.next_due();
            let refreshing = io.refresh.is_some();
            tokio::select! {
                _ = crate::stop::stopped(stop) => return Next::End,
                event = stream.next(), if listening => match event {
                    Some(event) => {
                        self.on_event(event);
                        if std::mem::take(&mut self.relist_now) && mode == Mode::Follow {
                            return Next::Resync;
                        }
                        listening = mode == Mode::Follow || !self.listed_once || self.listing.is_some();
                    }
                    None => return Next::Resync,
                },
                Some((uid, result)) = io.writes.next(), if !io.writes.is_empty() => {
                    self.on_written(&uid, result, mode);
                }
                Some(result) = futures::future::OptionFuture::from(io.refresh.as_mut()), if refreshing => {
                    io.refresh = None;
                    self.refreshed(result, mode);
                }
                _ = sleep_until(next_due), if next_due.is_some() => {}
                changed = leading.changed() => if changed.is_err() { return Next::End },
                _ = tokio::time::sleep_until(resync_at), if mode == Mode::Follow => return Next::Resync,
                Some(current) = futures::future::OptionFuture::from(io.probe.as_mut()), if io.probe.is_some() => {
                    io.probe = None;
                    if self.versions.went_back(current) {
                        return Next::Resync;
                    }
                }
                _ = io.tick.tick() => {
                    self.housekeeping();
                    if mode == Mode::Follow && io.probe.is_none() {
                        io.probe = self.versions.probe(&self.api);
                    }
                }
            }
        }
    }

    /// What happens before the loop waits: writes start while leading; `--once` ends when the
    /// list is decided; requests a full lane left out come back once there is room for them.
    fn before_waiting(&mut self, mode: Mode, leading: bool, io: &mut InFlight) -> Option<Next> {
        if leading && self.listing.is_none() && self.listed_once {
            self.dispatch(&mut io.writes, &mut io.refresh);
        }
        if mode == Mode::Once && self.listed_once && self.queue.is_empty() && io.writes.is_empty() {
            return Some(Next::End);
        }
        if mode == Mode::Follow
            && self.deferred
            && self.listing.is_none()
            && self.queue.len() < LANE_MAX / 2
        {
            self.deferred = false;
            return Some(Next::Resync);
        }
        None
    }

    /// A trust reading for waiting settlements ended.
    fn refreshed(&mut self, result: Result<(), ApproverError>, mode: Mode) {
        if let Err(e) = result {
            tracing::warn!(error = %e, "cannot read the trust source to settle requests; retrying");
            self.trust_retry_at = Some(Instant::now() + TRUST_RETRY);
            if mode == Mode::Once {
                self.fail_waiting_settles(e);
            }
        }
    }

    /// Once a second: the heartbeat the liveness probe reads, the queue gauge, and forgetting
    /// evidence past the freshness window.
    fn housekeeping(&mut self) {
        self.metrics.heartbeat.beat();
        self.metrics
            .queued
            .set(i64::try_from(self.queue.len()).unwrap_or(i64::MAX));
        let lifetime = evaluate::evidence_lifetime(self.settings.rules.evidence_max_age);
        self.index.prune(now_unix().saturating_sub(lifetime));
        if let Some(join) = &self.settings.rules.ek_join {
            self.carriers.prune(now_unix(), join.ttl);
        }
        self.metrics
            .evidence_index
            .set(i64::try_from(self.index.len()).unwrap_or(i64::MAX));
    }

    fn on_event(
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
    fn observe(&mut self, csr: &CertificateSigningRequest) {
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
    fn note_carrier(&mut self, csr: &CertificateSigningRequest, seen: &Seen) -> bool {
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
    fn policy_of(&self, signer: &str) -> Option<SignerPolicy> {
        self.policies
            .iter()
            .find(|(name, _)| name == signer)
            .map(|(_, p)| *p)
    }

    /// A decided request: an approved one holds its evidence (and the credential it answered).
    fn observe_decided(&mut self, csr: &CertificateSigningRequest, seen: &Seen, approved: bool) {
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
    fn index_waiting(&mut self, c: &Candidate, name: &str) {
        self.index.waiting(
            c.attested.evidence_digest,
            c.attested.made_at,
            c.rank.clone(),
            name,
        );
    }

    /// Starts writes while there is room: in turn per requester; a settlement needs the trust
    /// read within [`FRESH_FOR`], so those wait for a reading while denials go on.
    fn dispatch(
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
    fn decide(
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
    fn start_write(&mut self, uid: String, decided: Decided) -> WriteFuture {
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
        write(
            self.api.clone(),
            self.validity.clone(),
            self.trust.clone(),
            self.nodes.clone(),
            uid,
            *decided.seen,
            (decided.decision, decided.effect),
        )
    }

    fn start_refresh(&mut self, refresh: &mut Option<Refresh>) {
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
    fn fail_waiting_settles(&mut self, error: ApproverError) {
        let mut failed = false;
        while let Some((uid, _)) = self.queue.take(Instant::now(), |w| !w.settles()) {
            self.queue.done(&uid);
            failed = true;
        }
        if failed {
            self.failures.push(error);
        }
    }

    fn on_written(&mut self, uid: &str, result: Result<Recorded, ApproverError>, mode: Mode) {
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
    fn release(&mut self, uid: &str, granted: Option<Box<Candidate>>, name: &str) {
        if let Some(c) = granted {
            debug_assert_eq!(c.rank.uid, uid);
            self.index
                .release(&c.attested.evidence_digest, c.rank, name);
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

fn now_unix() -> i64 {
    i64::try_from(attestation::unix_now()).unwrap_or(i64::MAX)
}
