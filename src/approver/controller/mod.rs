//! The decision loop: kube's watcher brings the requests of our signers; each is judged from
//! its own content at once (its policy's `judge`) and kept only as a small `Work` item in a fair
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

mod observe;
mod state;
mod writes;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use tokio::sync::watch;

use super::decision::Decision;
use super::ek_join::Carriers;
use super::error::ApproverError;
use super::evaluate;
use super::evidence_index::EvidenceIndex;
use super::lease::Validity;
use super::metrics::ApproverMetrics;
use super::node_addresses::NodeIndex;
use super::policy::{self, Configured, SignerPolicy};
use super::queue::{WorkQueue, LANE_MAX};
pub use super::relist::PROBE_EVERY;
use super::relist::{Probe, Versions};
use super::trust::Trust;
use super::write::WriteFuture;

use self::state::{now_unix, sleep_until, Refresh, TRUST_RETRY};
pub use self::state::{Controller, Mode, Settings, IN_FLIGHT};

/// Requests per list page: an attacker's 1.3 MB requests cost at most this many at once.
pub const PAGE_SIZE: u32 = 4;

/// The watch's server-side timeout; kube's watcher takes a silent connection for dead 5 s after.
const WATCH_TIMEOUT_SECS: u32 = 30;

/// How often everything is listed again, whatever else happens.
pub const RESYNC: Duration = Duration::from_secs(15 * 60);

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
            lease_vanished: 0,
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
                    if mode == Mode::Follow && self.lease_vanished() {
                        return Next::Resync;
                    }
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

    /// Whether the Lease vanished under this replica since the last look: etcd was wiped (or
    /// restored without its Lease), and a watch that resumed after the store's revision passed
    /// its own misses everything written before, with no error and no version going back.
    fn lease_vanished(&mut self) -> bool {
        let now = self.validity.as_ref().map_or(0, Validity::lease_vanished);
        std::mem::replace(&mut self.lease_vanished, now) != now
    }
}
