//! The attesting approver (`hwkey approver`): approves CertificateSigningRequests whose key is
//! proven to live in a registered node's TPM, and denies the others with a precise reason.
//!
//! - [`decide`]: one request's decision ([`crate::pki::attestation::verify_request`] plus who may
//!   ask for which subject) and writing it through the `approval` subresource, with the
//!   request's resourceVersion as the precondition.
//! - [`trust`]: the registered nodes, from a directory or a ConfigMap.
//! - [`metrics`]: decisions by reason, verification latency, leadership.
//!
//! The loop lists the requests once, then watches from the list's resourceVersion and decides
//! each request as it is created; after a watch ends (timeout, 410 Gone) it lists again. With
//! leader election ([`crate::lifecycle::lease`]) only the replica holding the Lease decides; the
//! others stand by. A decision is never made twice: a request that already has an Approved or
//! Denied condition is skipped, and a write over a request that changed since it was read is
//! refused by the API server (409), so even two deciders at once (a lease handover, or
//! `--leader-elect=false`) write one condition per request.

pub mod decide;
pub mod metrics;
pub mod trust;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::watch;

use self::decide::{Decision, Recorded};
use self::metrics::ApproverMetrics;
use self::trust::{Trust, TrustSource};
use super::lease::{self, Elector, LeaseConfig};
use super::LifecycleError;
use crate::pki::attestation::Refusal;

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
    /// The signerNames whose requests this approver decides.
    pub signer_names: Vec<String>,
    /// The registered nodes (`hwkey attest enroll` output, one entry per node).
    pub trust: TrustSource,
    /// Requests without evidence: deny or leave alone.
    pub on_missing_evidence: OnMissingEvidence,
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

/// Decides requests: holds the client, the trust as last read and the metrics.
pub struct Approver {
    client: kube::Client,
    api: Api<CertificateSigningRequest>,
    options: ApproverOptions,
    trust: Trust,
    metrics: Arc<ApproverMetrics>,
}

impl Approver {
    /// Reads the trust source once; fails when it cannot be read.
    pub async fn new(
        client: &kube::Client,
        options: ApproverOptions,
        metrics: Arc<ApproverMetrics>,
    ) -> Result<Approver, LifecycleError> {
        let mut trust = Trust::new(options.trust.clone());
        trust.load(client).await?;
        metrics
            .registered_nodes
            .set(i64::try_from(trust.nodes().len()).unwrap_or(i64::MAX));
        Ok(Approver {
            client: client.clone(),
            api: Api::all(client.clone()),
            options,
            trust,
            metrics,
        })
    }

    /// The decision for `csr` if it is ours and open (not yet written).
    async fn prepare(
        &mut self,
        csr: &CertificateSigningRequest,
    ) -> Result<Option<Decision>, LifecycleError> {
        if !decide::is_ours_and_open(csr, &self.options.signer_names) {
            return Ok(None);
        }
        let started = Instant::now();
        let mut decision =
            decide::decide(csr, self.options.on_missing_evidence, self.trust.nodes());
        self.metrics
            .verify_seconds
            .observe(started.elapsed().as_secs_f64());
        let unknown_ak = |d: &Option<Decision>| {
            d.as_ref()
                .is_some_and(|d| d.reason == Refusal::UnknownAttestationKey.reason())
        };
        // A node registered since the trust was read: read it again (at most once a second).
        if unknown_ak(&decision) && self.trust.reload_if_stale(&self.client).await? {
            self.metrics
                .registered_nodes
                .set(i64::try_from(self.trust.nodes().len()).unwrap_or(i64::MAX));
            decision = decide::decide(csr, self.options.on_missing_evidence, self.trust.nodes());
        }
        Ok(decision)
    }

    /// A future that writes `decision` on `csr` and counts it; it borrows nothing from `self`,
    /// so up to [`IN_FLIGHT`] of them run at once.
    fn write(
        &self,
        csr: CertificateSigningRequest,
        decision: Decision,
    ) -> impl std::future::Future<Output = Result<Option<Decision>, LifecycleError>> + 'static {
        let api = self.api.clone();
        let metrics = self.metrics.clone();
        async move {
            match decide::record(&api, &csr, &decision).await? {
                Recorded::Yes => {
                    metrics.decided(decision.approved, &decision.reason);
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

    /// Lists the requests and decides every open one of ours (checks one after the other, up
    /// to [`IN_FLIGHT`] writes at once).
    pub async fn decide_pending(&mut self) -> Result<Round, LifecycleError> {
        let list =
            self.api
                .list(&ListParams::default())
                .await
                .map_err(|e| LifecycleError::List {
                    reason: e.to_string(),
                })?;
        let mut round = Round {
            decisions: Vec::new(),
            failures: Vec::new(),
            version: list.metadata.resource_version.unwrap_or_default(),
        };
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
    /// once), until the watch ends.
    async fn list_and_watch(&mut self) -> Result<(), LifecycleError> {
        let version = self.decide_pending().await?.version;
        let watch_err = |e: kube::Error| LifecycleError::List {
            reason: format!("watch: {e}"),
        };
        let stream = self
            .api
            .watch(&WatchParams::default().timeout(290), &version)
            .await
            .map_err(watch_err)?;
        futures::pin_mut!(stream);
        let mut in_flight = futures::stream::FuturesUnordered::new();
        // Requests whose decision is being written: their own updates (and the write's echo)
        // come back as events and must not be decided again.
        let mut writing = std::collections::HashSet::new();
        let finished = |(name, result): (String, Result<Option<Decision>, LifecycleError>),
                        writing: &mut std::collections::HashSet<String>| {
            writing.remove(&name);
            if let Err(e) = result {
                tracing::error!(error = %e, "cannot decide a request; it stays open");
            }
        };
        loop {
            tokio::select! {
                Some(done) = in_flight.next(), if !in_flight.is_empty() => finished(done, &mut writing),
                event = stream.try_next(), if in_flight.len() < IN_FLIGHT => {
                    match event.map_err(watch_err)? {
                        Some(WatchEvent::Added(csr) | WatchEvent::Modified(csr)) => {
                            let name = csr.metadata.name.clone().unwrap_or_default();
                            if writing.contains(&name) {
                                continue;
                            }
                            match self.prepare(&csr).await {
                                Ok(Some(d)) => {
                                    writing.insert(name.clone());
                                    let write = self.write(csr, d);
                                    in_flight.push(async move { (name, write.await) });
                                }
                                Ok(None) => {}
                                Err(e) => tracing::error!(error = %e, "cannot decide a request; it stays open"),
                            }
                        }
                        // 410 Gone and the like: list again.
                        Some(WatchEvent::Error(e)) => {
                            tracing::debug!(error = %e.message, "watch ended; listing again");
                            break;
                        }
                        Some(WatchEvent::Deleted(_) | WatchEvent::Bookmark(_)) => {}
                        None => break,
                    }
                }
            }
        }
        // Finish the writes already sent before listing again.
        while let Some(done) = in_flight.next().await {
            finished(done, &mut writing);
        }
        Ok(())
    }
}

/// Runs until `stop`: decides while leading (always, without `election`), stands by otherwise.
/// Releases the Lease on the way out.
pub async fn run(
    client: &kube::Client,
    options: ApproverOptions,
    election: Option<LeaseConfig>,
    metrics: Arc<ApproverMetrics>,
    leading_tx: watch::Sender<bool>,
    stop: watch::Receiver<bool>,
) -> Result<(), LifecycleError> {
    let mut approver = Approver::new(client, options, metrics.clone()).await?;
    let mut leading = leading_tx.subscribe();
    // Without election this process always decides; the sender is kept for the whole run.
    let (holder, _always) = match election {
        Some(config) => {
            leading_tx.send_replace(false);
            let task = lease::hold(Elector::new(client, config), leading_tx, stop.clone());
            (Some(tokio::spawn(task)), None)
        }
        None => {
            leading_tx.send_replace(true);
            (None, Some(leading_tx))
        }
    };
    let mut stop_wait = stop.clone();
    loop {
        tokio::select! {
            _ = lease::stopped(&mut stop_wait) => break,
            closed = until(&mut leading, true) => if closed { break },
        }
        metrics.leader.set(1);
        let mut lost = leading.clone();
        tokio::select! {
            _ = lease::stopped(&mut stop_wait) => break,
            _ = until(&mut lost, false) => {
                tracing::info!("lost the lease: no more decisions until it is won again");
            }
            _ = async {
                loop {
                    if let Err(e) = approver.list_and_watch().await {
                        tracing::error!(error = %e, "listing or watching requests failed; retrying");
                        tokio::time::sleep(RETRY_AFTER_ERROR).await;
                    }
                }
            } => {}
        }
        metrics.leader.set(0);
    }
    metrics.leader.set(0);
    if let Some(holder) = holder {
        let _ = holder.await;
    }
    Ok(())
}

/// Resolves when `leading` equals `wanted`; true when its sender is gone instead.
async fn until(leading: &mut watch::Receiver<bool>, wanted: bool) -> bool {
    leading.wait_for(|l| *l == wanted).await.is_err()
}
