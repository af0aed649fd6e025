//! The attesting approver (`hwkey approver`): approves CertificateSigningRequests whose key is
//! proven to live in a registered node's TPM, and denies the others with a precise reason.
//!
//! - [`policy`]: what may be approved for each signer, read as Kubernetes reads the request.
//! - [`decide`]: one request's decision (policy, requester, evidence, freshness, reuse, trust)
//!   and writing it through the `approval` subresource, with the request's resourceVersion as
//!   the precondition.
//! - [`trust`]: the registered nodes, from a directory or a ConfigMap, followed as they change.
//! - [`metrics`]: decisions by reason, verification latency, leadership, trust health.
//!
//! The loop lists the requests of its signers once (a `spec.signerName` field selector), then
//! watches from the list's resourceVersion and decides each request as it is created; after a
//! watch ends (timeout, 410 Gone) it lists again. A request that could not be decided for a
//! transient reason (the trust source unreadable, the API server refusing a write) is retried
//! with exponential backoff, as a controller's work queue does, not left to the next list. With
//! leader election ([`crate::lifecycle::lease`]) only the replica holding the Lease decides; the
//! others stand by. A decision is never made twice: a request that already has an Approved or
//! Denied condition is skipped, and a write over a request that changed since it was read is
//! refused by the API server (409), so even two deciders at once (a lease handover, or
//! `--leader-elect=false`) write one condition per request. A leader whose Lease was not renewed
//! within the renew deadline writes nothing, whatever its tasks believe ([`lease::Validity`]).

pub mod decide;
pub mod metrics;
pub mod policy;
pub mod trust;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::watch;

use self::decide::{Decision, EvidenceIndex, Recorded, Rules};
use self::metrics::ApproverMetrics;
use self::policy::{Reason, SignerPolicy};
use self::trust::{Trust, TrustSource};
use super::lease::{self, Elector, LeaseConfig, Validity};
use super::LifecycleError;
use crate::backoff::Backoff;

/// What to do with a request that carries no evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnMissingEvidence {
    /// Deny it (`NoEvidence`): only attested keys get in.
    #[default]
    Deny,
    /// Leave it to other approvers.
    Ignore,
}

/// The approver's settings.
#[derive(Debug, Clone)]
pub struct ApproverOptions {
    /// The signerNames whose requests this approver decides (each must have a
    /// [`SignerPolicy`]).
    pub signer_names: Vec<String>,
    /// The registered nodes (`hwkey attest enroll` output, one entry per node).
    pub trust: TrustSource,
    /// What a decision checks beyond the signer's policy.
    pub rules: Rules,
}

/// What one pass over the listed requests did.
#[derive(Debug)]
pub struct Round {
    /// The decisions written.
    pub decisions: Vec<Decision>,
    /// Requests that could not be decided (they stay open).
    pub failures: Vec<LifecycleError>,
    /// The list's resourceVersion, to watch from.
    pub version: String,
}

/// Decisions being written at once: the API server's round trip, not the check, bounds the
/// rate (benches/approver.rs), so writes overlap.
const IN_FLIGHT: usize = 16;

/// How long to wait before listing again after the API server failed.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(2);

/// The first and longest wait before a request that hit a transient error is tried again.
const REQUEUE_FIRST: Duration = Duration::from_millis(500);
const REQUEUE_MAX: Duration = Duration::from_secs(30);

/// Requests to try again, each with its own backoff (a work queue's rate limiter).
#[derive(Default)]
struct Requeue {
    due: HashMap<String, (Instant, Backoff)>,
}

impl Requeue {
    fn push(&mut self, name: String) {
        let entry = self
            .due
            .entry(name)
            .or_insert_with(|| (Instant::now(), Backoff::new(REQUEUE_FIRST, REQUEUE_MAX)));
        entry.0 = Instant::now() + entry.1.next_delay();
    }

    fn forget(&mut self, name: &str) {
        self.due.remove(name);
    }

    fn next_due(&self) -> Option<Instant> {
        self.due.values().map(|(at, _)| *at).min()
    }

    /// The names due now (they stay queued until forgotten or pushed again).
    fn ready(&self) -> Vec<String> {
        let now = Instant::now();
        self.due
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// Decides requests: holds the client, the trust as last read and the metrics.
pub struct Approver {
    api: Api<CertificateSigningRequest>,
    options: ApproverOptions,
    trust: Trust,
    index: EvidenceIndex,
    validity: Option<Validity>,
    metrics: Arc<ApproverMetrics>,
}

/// Checks that every signer has a policy: the approver refuses to start otherwise.
pub fn check_signers(signer_names: &[String]) -> Result<(), LifecycleError> {
    for signer in signer_names {
        SignerPolicy::for_signer(signer)?;
    }
    Ok(())
}

impl Approver {
    /// Checks the signers and reads the trust source once; fails when either is unusable.
    pub async fn new(
        client: &kube::Client,
        options: ApproverOptions,
        metrics: Arc<ApproverMetrics>,
    ) -> Result<Approver, LifecycleError> {
        check_signers(&options.signer_names)?;
        let trust = Trust::load(options.trust.clone(), client, metrics.clone()).await?;
        Ok(Approver {
            api: Api::all(client.clone()),
            options,
            trust,
            index: EvidenceIndex::default(),
            validity: None,
            metrics,
        })
    }

    /// The decision for `csr` if it is ours and open (not yet written). Every request of ours
    /// goes into the evidence index first, decided or not.
    async fn prepare(
        &mut self,
        csr: &CertificateSigningRequest,
    ) -> Result<Option<Decision>, LifecycleError> {
        if !self.options.signer_names.contains(&csr.spec.signer_name) {
            return Ok(None);
        }
        self.index.record(csr);
        if !decide::is_ours_and_open(csr, &self.options.signer_names) {
            return Ok(None);
        }
        let started = Instant::now();
        let rules = &self.options.rules;
        let mut decision = decide::decide(csr, rules, &self.trust.nodes(), &self.index);
        self.metrics
            .verify_seconds
            .observe(started.elapsed().as_secs_f64());
        let not_registered = |d: &Option<Decision>| {
            d.as_ref().is_some_and(|d| {
                matches!(
                    d.reason,
                    Reason::UnknownAttestationKey | Reason::SubjectMismatch
                )
            })
        };
        // A node registered a moment ago: read the trust again (at most once a second).
        if not_registered(&decision) && self.trust.reload_if_stale().await? {
            decision = decide::decide(csr, rules, &self.trust.nodes(), &self.index);
        }
        Ok(decision)
    }

    /// A future that writes `decision` on `csr` and counts it; it borrows nothing from `self`,
    /// so up to [`IN_FLIGHT`] of them run at once. A leader whose Lease is out of date writes
    /// nothing.
    fn write(
        &self,
        csr: CertificateSigningRequest,
        decision: Decision,
    ) -> impl std::future::Future<Output = Result<Option<Decision>, LifecycleError>> + 'static {
        let api = self.api.clone();
        let metrics = self.metrics.clone();
        let validity = self.validity.clone();
        async move {
            if let Some(v) = &validity {
                v.check()?;
            }
            match decide::record(&api, &csr, &decision).await? {
                Recorded::Yes => {
                    metrics.decided(decision.reason);
                    tracing::info!(
                        csr = %decision.name,
                        approved = decision.approved,
                        reason = %decision.reason,
                        "{}",
                        decision.message
                    );
                    Ok(Some(decision))
                }
                Recorded::Conflict => {
                    metrics.conflicts.inc();
                    tracing::info!(csr = %decision.name, "changed since it was read (decided by another approver?): left as it is");
                    Ok(None)
                }
            }
        }
    }

    /// Only the requests of our signers (the API server filters on `spec.signerName` when we
    /// decide for one signer).
    fn list_params(&self) -> ListParams {
        match self.options.signer_names.as_slice() {
            [one] => ListParams::default().fields(&format!("spec.signerName={one}")),
            _ => ListParams::default(),
        }
    }

    /// Lists the requests and decides every open one of ours (checks one after the other, up
    /// to [`IN_FLIGHT`] writes at once).
    pub async fn decide_pending(&mut self) -> Result<Round, LifecycleError> {
        let list =
            self.api
                .list(&self.list_params())
                .await
                .map_err(|source| LifecycleError::List {
                    verb: "list",
                    source,
                })?;
        let mut round = Round {
            decisions: Vec::new(),
            failures: Vec::new(),
            version: list.metadata.resource_version.unwrap_or_default(),
        };
        // Every request goes into the evidence index before any is decided: a copy listed
        // before its original is still recognised.
        for csr in &list.items {
            if self.options.signer_names.contains(&csr.spec.signer_name) {
                self.index.record(csr);
            }
        }
        let mut writes = Vec::new();
        for csr in list.items {
            match self.prepare(&csr).await {
                Ok(Some(d)) => writes.push(self.write(csr, d)),
                Ok(None) => {}
                Err(e) => round.failures.push(e),
            }
        }
        let mut written = futures::stream::iter(writes).buffer_unordered(IN_FLIGHT);
        while let Some(result) = written.next().await {
            match result {
                Ok(Some(d)) => round.decisions.push(d),
                Ok(None) => {}
                Err(e) => round.failures.push(e),
            }
        }
        for e in &round.failures {
            tracing::error!(error = %e, "cannot decide a request; it stays open");
        }
        Ok(round)
    }

    /// Lists, then watches and decides requests as they come (up to [`IN_FLIGHT`] writes at
    /// once), until the watch ends. Requests that hit a transient error are requeued with
    /// backoff and read again when due.
    async fn list_and_watch(&mut self, requeue: &mut Requeue) -> Result<(), LifecycleError> {
        let version = self.decide_pending().await?.version;
        let watch_err = |source: kube::Error| LifecycleError::List {
            verb: "watch",
            source,
        };
        let params = WatchParams {
            field_selector: self.list_params().field_selector,
            ..WatchParams::default().timeout(290)
        };
        let stream = self.api.watch(&params, &version).await.map_err(watch_err)?;
        futures::pin_mut!(stream);
        let mut in_flight = futures::stream::FuturesUnordered::new();
        // Requests whose decision is being written: their own updates (and the write's echo)
        // come back as events and must not be decided again.
        let mut writing = std::collections::HashSet::new();
        loop {
            let next_due = requeue.next_due();
            tokio::select! {
                Some((name, result)) = in_flight.next(), if !in_flight.is_empty() => {
                    writing.remove(&name);
                    self.finished(name, result, requeue);
                }
                _ = sleep_until(next_due), if next_due.is_some() && in_flight.len() < IN_FLIGHT => {
                    for name in requeue.ready() {
                        if writing.contains(&name) {
                            continue;
                        }
                        self.metrics.retries.inc();
                        let csr = match self.api.get_opt(&name).await {
                            Ok(Some(csr)) => csr,
                            Ok(None) => { requeue.forget(&name); continue; }
                            Err(e) => {
                                tracing::warn!(csr = %name, error = %e, "cannot read a request to retry it");
                                requeue.push(name);
                                continue;
                            }
                        };
                        self.start(csr, &mut writing, &mut in_flight, requeue).await;
                    }
                }
                event = stream.try_next(), if in_flight.len() < IN_FLIGHT => {
                    match event.map_err(watch_err)? {
                        Some(WatchEvent::Added(csr) | WatchEvent::Modified(csr)) => {
                            let name = csr.metadata.name.clone().unwrap_or_default();
                            if writing.contains(&name) {
                                continue;
                            }
                            self.start(csr, &mut writing, &mut in_flight, requeue).await;
                        }
                        // 410 Gone and the like: list again.
                        Some(WatchEvent::Error(e)) => {
                            tracing::debug!(error = %e.message, "watch ended; listing again");
                            break;
                        }
                        Some(WatchEvent::Deleted(csr)) => {
                            requeue.forget(&csr.metadata.name.unwrap_or_default());
                        }
                        Some(WatchEvent::Bookmark(_)) => {}
                        None => break,
                    }
                }
            }
        }
        // Finish the writes already sent before listing again.
        while let Some((name, result)) = in_flight.next().await {
            self.finished(name, result, requeue);
        }
        Ok(())
    }

    /// Prepares `csr` and, when there is a decision, starts writing it.
    async fn start(
        &mut self,
        csr: CertificateSigningRequest,
        writing: &mut std::collections::HashSet<String>,
        in_flight: &mut InFlight,
        requeue: &mut Requeue,
    ) {
        let name = csr.metadata.name.clone().unwrap_or_default();
        match self.prepare(&csr).await {
            Ok(Some(d)) => {
                writing.insert(name.clone());
                let write = self.write(csr, d);
                in_flight.push(Box::pin(async move { (name, write.await) }));
            }
            Ok(None) => requeue.forget(&name),
            Err(e) => {
                tracing::error!(csr = %name, error = %e, "cannot decide a request now; retrying with backoff");
                requeue.push(name);
            }
        }
    }

    fn finished(&self, name: String, result: WriteResult, requeue: &mut Requeue) {
        match result {
            Ok(_) => requeue.forget(&name),
            Err(e) => {
                tracing::error!(csr = %name, error = %e, "cannot record a decision now; retrying with backoff");
                requeue.push(name);
            }
        }
    }
}

type WriteResult = Result<Option<Decision>, LifecycleError>;

/// Decisions being written, each with its request's name.
type InFlight = futures::stream::FuturesUnordered<
    std::pin::Pin<Box<dyn std::future::Future<Output = (String, WriteResult)> + Send>>,
>;

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Runs until `stop`: decides while leading (always, without `election`), stands by otherwise.
/// Follows the trust source all the while. Releases the Lease on the way out.
pub async fn run(
    client: &kube::Client,
    options: ApproverOptions,
    election: Option<LeaseConfig>,
    metrics: Arc<ApproverMetrics>,
    leading_tx: watch::Sender<bool>,
    stop: watch::Receiver<bool>,
) -> Result<(), LifecycleError> {
    let mut approver = Approver::new(client, options, metrics.clone()).await?;
    let follower = tokio::spawn(approver.trust.clone().follow());
    let mut leading = leading_tx.subscribe();
    // Without election this process always decides; the sender is kept for the whole run.
    let (holder, _always) = match election {
        Some(config) => {
            leading_tx.send_replace(false);
            let validity = Validity::new(config.renew_deadline);
            approver.validity = Some(validity.clone());
            let task = lease::hold(
                Elector::new(client, config),
                leading_tx,
                validity,
                stop.clone(),
            );
            (Some(tokio::spawn(task)), None)
        }
        None => {
            leading_tx.send_replace(true);
            (None, Some(leading_tx))
        }
    };
    let mut stop_wait = stop.clone();
    let mut requeue = Requeue::default();
    loop {
        tokio::select! {
            _ = crate::stop::stopped(&mut stop_wait) => break,
            closed = until(&mut leading, true) => if closed { break },
        }
        metrics.leader.set(1);
        let mut lost = leading.clone();
        tokio::select! {
            _ = crate::stop::stopped(&mut stop_wait) => break,
            _ = until(&mut lost, false) => {
                tracing::info!("lost the lease: no more decisions until it is won again");
            }
            _ = async {
                loop {
                    if let Err(e) = approver.list_and_watch(&mut requeue).await {
                        tracing::error!(error = %e, "listing or watching requests failed; retrying");
                        tokio::time::sleep(RETRY_AFTER_ERROR).await;
                    }
                }
            } => {}
        }
        metrics.leader.set(0);
    }
    metrics.leader.set(0);
    follower.abort();
    if let Some(holder) = holder {
        let _ = holder.await;
    }
    Ok(())
}

/// Resolves when `leading` equals `wanted`; true when its sender is gone instead.
async fn until(leading: &mut watch::Receiver<bool>, wanted: bool) -> bool {
    leading.wait_for(|l| *l == wanted).await.is_err()
}
