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
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition, CertificateSigningRequestSpec,
    CertificateSigningRequestStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use tokio::sync::watch;

use super::ek_join::CREDENTIAL_SIGNER;
use super::ek_join::{Binding, CarrierCandidate, Carriers, Join};
use super::error::ApproverError;
use super::evaluate::{self, Candidate, Evaluated, Rules, Seen};
use super::evaluate::{KeptMetadata, PersonCandidate, PersonProof};
use super::evidence_index::{Claim, EvidenceIndex};
use super::lease::Validity;
use super::metrics::ApproverMetrics;
use super::person;
use super::policy;
use super::policy::{Reason, Violation};
use super::queue::{Queued, WorkQueue, LANE_MAX};
use super::trust::{Registry, Trust, FRESH_FOR};
use crate::metric_labels::LabelValue;
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

/// One decision, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The request's name.
    pub name: String,
    /// Approved (true) or denied.
    pub approved: bool,
    /// The condition's reason.
    pub reason: Reason,
    /// The condition's message.
    pub message: String,
}

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
    /// To be settled against the trust and the evidence index.
    Settle(Box<Seen>, Box<Candidate>),
    /// A person's request, to be settled against the people trust.
    Person(Box<Seen>, Box<PersonCandidate>),
    /// A carrier request, to be settled against the trust (EK CAs, bindings); `true` when it
    /// is approved already and only its certificate is missing.
    Carrier(Box<Seen>, Box<CarrierCandidate>, bool),
    /// An approved carrier that cannot be issued any more: a Failed condition.
    Fail(Box<Seen>, Violation),
}

impl Work {
    fn seen(&self) -> &Seen {
        match self {
            Work::Deny(s, _)
            | Work::Settle(s, _)
            | Work::Person(s, _)
            | Work::Carrier(s, _, _)
            | Work::Fail(s, _) => s,
        }
    }

    /// Whether writing it needs a fresh reading of a trust source.
    fn settles(&self) -> bool {
        !matches!(self, Work::Deny(..) | Work::Fail(..))
    }
}

/// A write in flight: what was decided, and whether it claimed the evidence.
struct Writing {
    decision: Decision,
    granted: Option<Box<Candidate>>,
    /// The carrier it answers, claimed while it is written.
    answering: Option<String>,
}

/// What a decision writes besides its condition.
#[derive(Debug, Clone)]
enum Effect {
    /// Nothing.
    None,
    /// The carrier certificate, as `status.certificate` (after the approval, unless the
    /// request is approved already).
    Issue { pem: String, approved: bool },
    /// The binding, in the trust ConfigMap, before the approval.
    Record(Box<Binding>),
    /// A Failed condition instead of a denial: the request is approved already (its
    /// certificate's write failed, and it can no longer be issued).
    Fail,
}

/// A decision made: the request, the decision, the evidence it claimed and what else to write.
struct Decided {
    seen: Box<Seen>,
    decision: Decision,
    granted: Option<Box<Candidate>>,
    effect: Effect,
}

impl Decided {
    /// A denial that writes nothing else.
    fn denied(seen: Box<Seen>, v: Violation) -> Decided {
        let decision = denial(&seen, v);
        Decided {
            seen,
            decision,
            granted: None,
            effect: Effect::None,
        }
    }
}

type WriteFuture = Pin<Box<dyn Future<Output = (String, Result<Recorded, ApproverError>)> + Send>>;
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

type Probe = Pin<Box<dyn Future<Output = Option<u64>> + Send>>;

/// How often the loop asks the API server for its current resource version (a list of one
/// request): a version lower than one the watch has seen means etcd was restored, and a watch
/// resuming from a version etcd has not reached yet stays silent until it does, so only a new
/// list sees what happened since.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);

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
    /// The newest resource version seen on the current watch.
    newest_version: u64,
    /// The highest version the API server answered a probe with (etcd's revision never goes
    /// down but by a restore).
    highest_probe: u64,
    /// What a probe's answer is compared with: the highest version known when it was sent (a
    /// write landing after the probe's read cannot make it look like a step back).
    probe_baseline: u64,
    /// When the API server's version was last asked for.
    probed_at: Option<Instant>,
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
        Controller {
            api: Api::all(client.clone()),
            settings,
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
            newest_version: 0,
            highest_probe: 0,
            probe_baseline: 0,
            probed_at: None,
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
        self.newest_version = 0;
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
                    if self.version_went_back(current) {
                        return Next::Resync;
                    }
                }
                _ = io.tick.tick() => {
                    self.housekeeping();
                    if mode == Mode::Follow {
                        self.start_probe(&mut io.probe);
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
            self.newest_version = self.newest_version.max(v);
        }
        let issue_only = self.note_carrier(csr, &seen);
        if let Some(approved) = evaluate::is_decided(csr).filter(|_| !issue_only) {
            self.observe_decided(csr, &seen, approved);
            return;
        }
        let started = Instant::now();
        let evaluated = evaluate::evaluate(csr, &self.settings.rules, now_unix());
        self.metrics
            .verify_seconds
            .observe(started.elapsed().as_secs_f64());
        let work = match evaluated {
            Evaluated::Ignore => {
                self.queue.remove(&seen.uid);
                return;
            }
            Evaluated::Deny(v) if issue_only => Work::Fail(Box::new(seen), v),
            Evaluated::Deny(v) => {
                self.index.forget_uid(&seen.uid);
                Work::Deny(Box::new(seen), v)
            }
            Evaluated::Candidate(c) => {
                self.index_waiting(&c, &seen.name);
                Work::Settle(Box::new(seen), c)
            }
            Evaluated::Person(p) => {
                if let PersonProof::Attested(c) = &p.proof {
                    self.index_waiting(c, &seen.name);
                }
                Work::Person(Box::new(seen), p)
            }
            Evaluated::Carrier(c) => Work::Carrier(Box::new(seen), c, issue_only),
        };
        let (uid, requester) = (work.seen().uid.clone(), work.seen().requester.clone());
        if self.queue.put(&uid, &requester, work) == Queued::LaneFull {
            self.metrics.deferred.inc();
            self.deferred = true;
            tracing::debug!(requester = %super::policy::bounded(&requester), "this requester has too many open requests queued; the rest wait for the next resync");
        }
    }

    /// Asks for the API server's current resource version every [`PROBE_EVERY`] (`--once`
    /// never lists twice, so it never asks).
    fn start_probe(&mut self, probe: &mut Option<Probe>) {
        if probe.is_some() || self.probed_at.is_some_and(|at| at.elapsed() < PROBE_EVERY) {
            return;
        }
        self.probe_baseline = self.newest_version.max(self.highest_probe);
        self.probed_at = Some(Instant::now());
        let api = self.api.clone();
        *probe = Some(Box::pin(async move {
            let params = kube::api::ListParams::default().limit(1);
            let listed = tokio::time::timeout(PROBE_EVERY, api.list_metadata(&params)).await;
            listed.ok()?.ok()?.metadata.resource_version?.parse().ok()
        }));
    }

    /// Whether a probe's answer is a step back from what was known when it was sent: etcd
    /// restored (from nothing or from a backup). The next probe starts a new baseline.
    fn version_went_back(&mut self, current: Option<u64>) -> bool {
        let Some(current) = current else {
            return false;
        };
        if current < self.probe_baseline {
            tracing::warn!(current, known = self.probe_baseline, "the API server's resource version went back (etcd restored): listing everything again");
            self.highest_probe = 0;
            return true;
        }
        self.highest_probe = self.highest_probe.max(current);
        false
    }

    /// Takes note of a carrier request's facts (any state); returns whether it is approved
    /// but not issued (its certificate's write failed: it is issued now).
    fn note_carrier(&mut self, csr: &CertificateSigningRequest, seen: &Seen) -> bool {
        if seen.signer != CREDENTIAL_SIGNER {
            return false;
        }
        // Only an approved carrier's credential can be answered: others are not remembered.
        if evaluate::is_decided(csr) == Some(true) {
            if let Some(facts) = super::ek_join::facts_of(csr) {
                self.carriers.seen(&seen.name, facts);
            }
        }
        evaluate::is_decided(csr) == Some(true)
            && !has_certificate(csr)
            && !has_condition(csr, "Failed")
    }

    /// A decided request: an approved one holds its evidence (and the credential it answered).
    fn observe_decided(&mut self, csr: &CertificateSigningRequest, seen: &Seen, approved: bool) {
        self.queue.remove(&seen.uid);
        if !approved {
            self.index.forget_uid(&seen.uid);
            return;
        }
        if let Some(carrier) = answered_carrier(csr) {
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
                    Work::Settle(..) | Work::Carrier(..) => nodes.is_none(),
                    Work::Person(..) => people.is_none(),
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
        Some(match work {
            Work::Deny(seen, v) => Decided::denied(seen, v),
            Work::Fail(seen, v) => Decided {
                effect: Effect::Fail,
                ..Decided::denied(seen, v)
            },
            Work::Settle(seen, candidate) => {
                let nodes = nodes.as_ref()?;
                if candidate.claim.is_some() {
                    return Some(self.settle_answer(seen, candidate, nodes));
                }
                let (decision, granted) = self.settle(&seen, candidate, &nodes.aks, "node");
                Decided {
                    seen,
                    decision,
                    granted,
                    effect: Effect::None,
                }
            }
            Work::Person(seen, candidate) => {
                let people = people.as_ref()?;
                let (decision, granted) = self.settle_person(&seen, *candidate, people);
                Decided {
                    seen,
                    decision,
                    granted,
                    effect: Effect::None,
                }
            }
            Work::Carrier(seen, candidate, approved) => {
                let nodes = nodes.as_ref()?;
                self.settle_carrier(seen, &candidate, approved, nodes)
            }
        })
    }

    /// A carrier request: its credential in a carrier certificate, or the denial.
    fn settle_carrier(
        &self,
        seen: Box<Seen>,
        candidate: &CarrierCandidate,
        approved: bool,
        nodes: &Registry,
    ) -> Decided {
        let join = self.settings.rules.ek_join.as_deref().map(|settings| Join {
            settings,
            held: super::binding::Held {
                nodes: &nodes.aks,
                invalid: &nodes.invalid,
            },
            ek: &nodes.ek,
        });
        let issued = match join {
            Some(join) => join.issue(candidate, now_unix()),
            None => Err(policy::violation(
                Reason::EkCertificateUntrusted,
                "this approver is not configured for TPMs that join by their EK certificate",
            )),
        };
        match issued {
            Ok((pem, message)) => Decided {
                decision: Decision {
                    name: seen.name.clone(),
                    approved: true,
                    reason: Reason::EkCertificateVerified,
                    message,
                },
                seen,
                granted: None,
                effect: Effect::Issue { pem, approved },
            },
            Err(v) => {
                let decision = denial(&seen, v);
                Decided {
                    seen,
                    decision,
                    granted: None,
                    effect: if approved { Effect::Fail } else { Effect::None },
                }
            }
        }
    }

    /// The binding a request's answer earns, or why it earns none.
    fn answer_of(
        &self,
        seen: &Seen,
        candidate: &Candidate,
        nodes: &Registry,
    ) -> Result<Binding, Violation> {
        let (Some(settings), Some(claim)) =
            (self.settings.rules.ek_join.as_deref(), &candidate.claim)
        else {
            return Err(policy::violation(
                Reason::CredentialInvalid,
                "no credential is answered",
            ));
        };
        let join = Join {
            settings,
            held: super::binding::Held {
                nodes: &nodes.aks,
                invalid: &nodes.invalid,
            },
            ek: &nodes.ek,
        };
        join.answer(
            &self.carriers,
            claim,
            &candidate.node,
            &candidate.attested.ak_name,
            &seen.requester,
            now_unix(),
        )
    }

    /// A kubelet request that answers a credential: judged by its answer (never by a
    /// registration alone), then like any attested request (fresh, the evidence its own).
    fn settle_answer(
        &mut self,
        seen: Box<Seen>,
        candidate: Box<Candidate>,
        nodes: &Registry,
    ) -> Decided {
        let binding = match self.answer_of(&seen, &candidate, nodes) {
            Ok(b) => b,
            Err(v) => {
                self.index
                    .forget(&candidate.attested.evidence_digest, &seen.uid);
                return Decided::denied(seen, v);
            }
        };
        // The AK is trusted for this node from this answer on: settle as a registered one.
        let registered = [crate::pki::registration::RegisteredAk {
            node: candidate.node.clone(),
            ak_name: candidate.attested.ak_name.clone(),
            ek_sha256: Some(binding.ek_sha256.clone()),
        }];
        let (mut decision, granted) = self.settle(&seen, candidate, &registered, "node");
        let effect = if decision.approved {
            decision.message = format!(
                "{}; the TPM (EK {}) answered the credential of carrier request {}, and the node is bound to it",
                decision.message, binding.ek_sha256, binding.carrier
            );
            self.carriers
                .answered_by(&binding.carrier, &seen.name, now_unix());
            Effect::Record(Box::new(binding))
        } else {
            Effect::None
        };
        Decided {
            seen,
            decision,
            granted,
            effect,
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

    /// The decision for a request that passed every check of its own: still fresh, its AK
    /// registered for its node, and the evidence its own (see [`EvidenceIndex`]).
    fn settle(
        &mut self,
        seen: &Seen,
        candidate: Box<Candidate>,
        nodes: &[crate::pki::registration::RegisteredAk],
        what: &str,
    ) -> (Decision, Option<Box<Candidate>>) {
        let deny = |reason: Reason, message: String| Decision {
            name: seen.name.clone(),
            approved: false,
            reason,
            message,
        };
        let digest = candidate.attested.evidence_digest;
        let lifetime = evaluate::evidence_lifetime(self.settings.rules.evidence_max_age);
        let age = now_unix().saturating_sub(i64::try_from(candidate.attested.made_at).unwrap_or(0));
        if age > lifetime {
            self.index.forget(&digest, &seen.uid);
            return (deny(Reason::EvidenceStale, format!("the evidence is {age} s old now (at most {lifetime} s): the request waited too long for a decision; make a new request on the node")), None);
        }
        let admitted =
            match attestation::admit_as(candidate.attested.clone(), &candidate.node, nodes, what) {
                Ok(a) => a,
                Err(r) => {
                    self.index.forget(&digest, &seen.uid);
                    return (deny(Reason::of(r.refusal), r.message), None);
                }
            };
        match self.index.claim(&digest, &seen.uid) {
            Claim::HeldBy(other) => {
                self.index.forget(&digest, &seen.uid);
                (
                    deny(
                        Reason::EvidenceReused,
                        format!("the same TPM evidence is in request {other}, which holds it: evidence is used once"),
                    ),
                    None,
                )
            }
            Claim::Granted => (
                Decision {
                    name: seen.name.clone(),
                    approved: true,
                    reason: Reason::AttestedTpmKey,
                    message: format!(
                        "the key is in the TPM of {what} '{}' (attestation key {})",
                        admitted.node, admitted.ak_name
                    ),
                },
                Some(candidate),
            ),
        }
    }

    /// The decision for a person's request that passed every check of its own: the allow list
    /// admits the requester; a TPM key is then settled like a node's, against the AKs
    /// registered per user.
    fn settle_person(
        &mut self,
        seen: &Seen,
        candidate: PersonCandidate,
        people: &Registry,
    ) -> (Decision, Option<Box<Candidate>>) {
        let same_key = matches!(candidate.proof, PersonProof::SameKey(_));
        let allowed = person::admit(
            &candidate.user,
            &candidate.orgs,
            same_key,
            people.allow.as_deref(),
        );
        if let Err(v) = allowed {
            if let PersonProof::Attested(c) = &candidate.proof {
                self.index.forget(&c.attested.evidence_digest, &seen.uid);
            }
            let decision = Decision {
                name: seen.name.clone(),
                approved: false,
                reason: v.reason,
                message: v.message,
            };
            return (decision, None);
        }
        match candidate.proof {
            PersonProof::SameKey(held) if held.not_after < now_unix() => {
                let decision = Decision {
                    name: seen.name.clone(),
                    approved: false,
                    reason: Reason::EvidenceInvalid,
                    message: "the attached certificate expired while the request waited: a person whose certificate expired enrols again".into(),
                };
                (decision, None)
            }
            PersonProof::SameKey(held) => {
                let until = time::OffsetDateTime::from_unix_timestamp(held.not_after)
                    .map(|t| t.to_string())
                    .unwrap_or_else(|_| held.not_after.to_string());
                let decision = Decision {
                    name: seen.name.clone(),
                    approved: true,
                    reason: Reason::SameKeyRenewal,
                    message: format!(
                        "'{}' renews with the key of the certificate they hold (serial {}, valid until {until})",
                        super::policy::bounded(&candidate.user),
                        held.serial
                    ),
                };
                (decision, None)
            }
            PersonProof::Attested(c) => self.settle(seen, c, &people.aks, "user"),
            PersonProof::Piv(facts) => {
                (settle_piv(seen, &candidate.user, &facts, &people.piv), None)
            }
        }
    }

    fn on_written(&mut self, uid: &str, result: Result<Recorded, ApproverError>, mode: Mode) {
        let Some(writing) = self.writing.remove(uid) else {
            return;
        };
        let decision = writing.decision;
        match result {
            Ok(Recorded::Yes) => {
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

/// What became of a decision sent to the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The condition is on the request.
    Yes,
    /// The request changed since it was read (another approver or replica decided it, or it
    /// was deleted): nothing was written, and the new state will be seen again.
    Conflict,
}

/// Writes `decision` through the `approval` subresource (PUT: RBAC verb `update`), unless
/// this replica's Lease is out of date. The body is the request as it was read without its
/// bytes (the API server keeps the spec of the stored object on this subresource): its uid and
/// resourceVersion are the precondition, so a write over a changed or re-created request is
/// refused with 409 and reported as [`Recorded::Conflict`].
fn write(
    api: Api<CertificateSigningRequest>,
    validity: Option<Validity>,
    trust: Option<Trust>,
    uid: String,
    seen: Seen,
    (decision, effect): (Decision, Effect),
) -> WriteFuture {
    Box::pin(async move {
        if let Some(v) = &validity {
            if let Err(e) = v.check() {
                return (uid, Err(e));
            }
        }
        let result = match effect {
            Effect::None => record(&api, &seen, &decision).await,
            Effect::Record(binding) => match record_binding(trust.as_ref(), &binding).await {
                Ok(()) => record(&api, &seen, &decision).await,
                Err(source) => Err(ApproverError::Record {
                    node: binding.node.clone(),
                    source,
                }),
            },
            Effect::Issue { pem, approved } => issue(&api, &seen, &decision, &pem, approved).await,
            Effect::Fail => fail(&api, &seen, &decision).await,
        };
        (uid, result)
    })
}

/// Records `binding` in the trust ConfigMap if the binding policy still allows it on what the
/// ConfigMap holds at the moment of writing.
async fn record_binding(
    trust: Option<&Trust>,
    binding: &Binding,
) -> Result<(), super::trust::RecordError> {
    let Some(trust) = trust else {
        return Err(super::trust::RecordError::NotAConfigMap(
            "not configured".into(),
        ));
    };
    trust
        .record(&binding.node, &binding.text, |read| {
            let invalid: Vec<String> = read.invalid.iter().map(|i| i.entry.clone()).collect();
            let held = super::binding::Held {
                nodes: &read.nodes,
                invalid: &invalid,
            };
            super::binding::check(
                &binding.node,
                &binding.ek_sha256,
                read.ek.binding.as_deref(),
                held,
            )
            .map(|_| ())
        })
        .await
}

/// Approves a carrier request (unless `approved` already) and writes its certificate through
/// the `status` subresource (RBAC: `update` on certificatesigningrequests/status, `sign` on
/// the signer).
async fn issue(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
    pem: &str,
    approved: bool,
) -> Result<Recorded, ApproverError> {
    let mut current = match api.get(&seen.name).await {
        Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => c,
        Ok(_) => return Ok(Recorded::Conflict),
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Recorded::Conflict),
        Err(source) => {
            return Err(ApproverError::Issue {
                name: seen.name.clone(),
                source,
            })
        }
    };
    if !approved {
        let fresh = Seen {
            metadata: KeptMetadata::Kept {
                annotations: current.metadata.annotations.clone(),
                labels: current.metadata.labels.clone(),
            },
            ..seen.clone()
        };
        if record(api, &fresh, decision).await? == Recorded::Conflict {
            return Ok(Recorded::Conflict);
        }
        current = api
            .get(&seen.name)
            .await
            .map_err(|source| ApproverError::Issue {
                name: seen.name.clone(),
                source,
            })?;
    }
    let status = current.status.get_or_insert_with(Default::default);
    status.certificate = Some(k8s_openapi::ByteString(pem.as_bytes().to_vec()));
    match api
        .replace_status(&seen.name, &PostParams::default(), &current)
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Recorded::Conflict),
        Err(source) => Err(ApproverError::Issue {
            name: seen.name.clone(),
            source,
        }),
    }
}

/// Writes a Failed condition (through `status`, as a signer does) on an approved request that
/// cannot be issued.
async fn fail(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Recorded, ApproverError> {
    let issue_error = |source| ApproverError::Issue {
        name: seen.name.clone(),
        source,
    };
    let mut current = match api.get(&seen.name).await {
        Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => c,
        Ok(_) => return Ok(Recorded::Conflict),
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Recorded::Conflict),
        Err(source) => return Err(issue_error(source)),
    };
    let status = current.status.get_or_insert_with(Default::default);
    status
        .conditions
        .get_or_insert_with(Vec::new)
        .push(CertificateSigningRequestCondition {
            type_: "Failed".into(),
            status: "True".into(),
            reason: Some(decision.reason.as_str().into()),
            message: Some(decision.message.clone()),
            ..Default::default()
        });
    match api
        .replace_status(&seen.name, &PostParams::default(), &current)
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(Recorded::Conflict),
        Err(source) => Err(issue_error(source)),
    }
}

/// Whether a watch error means the API server no longer has the version the watch resumes
/// from, so that only a new list helps (client-go's reflector relists on the same two): 410
/// Gone (compacted), or "too large resource version" (504, cause ResourceVersionTooLarge),
/// which a restored etcd answers to every version written before the restore. kube's watcher
/// relists on a 410 in a watch's events, but retries a watch that fails to start from the same
/// version forever.
fn must_relist(e: &watcher::Error) -> bool {
    let status = match e {
        watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.as_ref(),
        watcher::Error::WatchError(s) => s.as_ref(),
        _ => return false,
    };
    let too_large = status.message.contains("Too large resource version")
        || status.details.as_ref().is_some_and(|d| {
            d.causes
                .iter()
                .any(|c| c.reason == "ResourceVersionTooLarge")
        });
    status.code == 410 || (status.code == 504 && too_large)
}

/// Whether a request has a condition of `kind` (True).
fn has_condition(csr: &CertificateSigningRequest, kind: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"))
}

/// Whether a request's certificate has been written.
fn has_certificate(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty())
}

/// The carrier an approved kubelet request answered, from its annotation (counted only for
/// requests hwkey approved as attested: another approver's approval marks nothing).
fn answered_carrier(csr: &CertificateSigningRequest) -> Option<&str> {
    let attested = csr
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == "Approved"
                    && c.reason.as_deref() == Some(Reason::AttestedTpmKey.as_str())
            })
        });
    if !attested {
        return None;
    }
    csr.metadata
        .annotations
        .as_ref()?
        .get(crate::pki::ek_join::ANNOTATION_CARRIER)
        .map(String::as_str)
}

/// The decision that writes a denial.
fn denial(seen: &Seen, v: Violation) -> Decision {
    Decision {
        name: seen.name.clone(),
        approved: false,
        reason: v.reason,
        message: v.message,
    }
}

/// The annotations and labels to write back (None: the request changed or is gone).
async fn kept_metadata(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Option<(Option<Labels>, Option<Labels>)>, ApproverError> {
    match &seen.metadata {
        KeptMetadata::Kept {
            annotations,
            labels,
        } => Ok(Some((annotations.clone(), labels.clone()))),
        KeptMetadata::ReadAgain => match api.get(&seen.name).await {
            Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => {
                Ok(Some((c.metadata.annotations, c.metadata.labels)))
            }
            Ok(_) => Ok(None),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
            Err(source) => Err(ApproverError::Approve {
                name: decision.name.clone(),
                source,
            }),
        },
    }
}

type Labels = std::collections::BTreeMap<String, String>;

/// The PUT itself.
pub async fn record(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Recorded, ApproverError> {
    let Some((annotations, labels)) = kept_metadata(api, seen, decision).await? else {
        return Ok(Recorded::Conflict);
    };
    let mut conditions = seen.conditions.clone();
    conditions.push(CertificateSigningRequestCondition {
        type_: if decision.approved {
            "Approved".into()
        } else {
            "Denied".into()
        },
        status: "True".into(),
        reason: Some(decision.reason.as_str().into()),
        message: Some(decision.message.clone()),
        ..Default::default()
    });
    let body = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(seen.name.clone()),
            uid: Some(seen.uid.clone()),
            resource_version: Some(seen.resource_version.clone()),
            annotations,
            labels,
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            signer_name: seen.signer.clone(),
            usages: Some(seen.usages.clone()),
            ..Default::default()
        },
        status: Some(CertificateSigningRequestStatus {
            conditions: Some(conditions),
            ..Default::default()
        }),
    };
    match api
        .replace_subresource::<CertificateSigningRequest>(
            "approval",
            &seen.name,
            &PostParams::default(),
            &body,
        )
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(Recorded::Conflict),
        Err(source) => Err(ApproverError::Approve {
            name: decision.name.clone(),
            source,
        }),
    }
}
/// The decision for a person's key attested by a YubiKey: the devices registered for them
/// decide ([`person::settle_piv`]).
fn settle_piv(
    seen: &Seen,
    user: &str,
    facts: &crate::pki::piv::PivFacts,
    registered: &[crate::pki::registration::RegisteredPiv],
) -> Decision {
    let (approved, reason, message) = match person::settle_piv(user, facts, registered) {
        Ok(m) => (true, Reason::AttestedPivKey, m),
        Err(v) => (false, v.reason, v.message),
    };
    Decision {
        name: seen.name.clone(),
        approved,
        reason,
        message,
    }
}
