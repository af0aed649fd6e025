//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's rules, so that of
//! several replicas of a controller exactly one acts at a time.
//!
//! - A candidate takes the Lease when nobody holds it, or when its record has not changed for
//!   `leaseDurationSeconds` *as observed on this candidate's clock* (no comparison of clocks
//!   between machines, as in client-go).
//! - Every write carries the resourceVersion that was read, so of two candidates writing at once
//!   only one succeeds (409 Conflict for the other).
//! - The leader renews every `retry`; when it cannot renew for `renew_deadline` (shorter than the
//!   lease duration) it steps down before anyone else may take over.
//! - On shutdown the leader releases the Lease (empty holder), so a standby takes over at its next
//!   try instead of waiting out the lease.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::watch;

use super::error::ApproverError;
use crate::stop::stopped;

/// Where the Lease lives and how it is held.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// This candidate's identity (`holderIdentity`): unique per process.
    pub identity: String,
    /// How long a Lease stands without renewal before another candidate may take it.
    pub duration: Duration,
    /// How long the leader keeps trying to renew before it steps down.
    pub renew_deadline: Duration,
    /// How often candidates try to take the Lease and the leader renews it.
    pub retry: Duration,
}

impl LeaseConfig {
    /// Checks client-go's ordering: retry < renew deadline < duration.
    pub fn check(&self) -> Result<(), TimingError> {
        if self.retry.is_zero() || self.retry >= self.renew_deadline {
            return Err(TimingError::Retry {
                retry: self.retry,
                renew_deadline: self.renew_deadline,
            });
        }
        if self.renew_deadline >= self.duration {
            return Err(TimingError::RenewDeadline {
                renew_deadline: self.renew_deadline,
                duration: self.duration,
            });
        }
        if self.duration.as_secs() == 0 {
            return Err(TimingError::Duration);
        }
        Ok(())
    }
}

/// Lease timings that break client-go's ordering (see [`LeaseConfig::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum TimingError {
    #[error(
        "the retry period ({retry:?}) must be shorter than the renew deadline ({renew_deadline:?})"
    )]
    Retry {
        retry: Duration,
        renew_deadline: Duration,
    },
    #[error("the renew deadline ({renew_deadline:?}) must be shorter than the lease duration ({duration:?}), or two replicas could lead at once")]
    RenewDeadline {
        renew_deadline: Duration,
        duration: Duration,
    },
    #[error("the lease duration must be at least 1s")]
    Duration,
}

/// A unique identity for this process: the host (a pod's name in a Deployment) and a random
/// suffix, as client-go makes it.
pub fn default_identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "hwkey".into());
    let mut suffix = [0u8; 6];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut suffix);
    format!("{host}_{}", hex::encode(suffix))
}

/// One candidate's view of the Lease.
pub struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    /// The record last seen (resourceVersion) and when this process first saw it.
    observed: Option<(String, Instant)>,
    /// This process has seen the Lease, or made it.
    known: bool,
    /// The Lease this process had seen or made is gone (etcd restored or wiped, or the Lease
    /// deleted): not yet reported ([`Elector::take_vanished`]).
    vanished: bool,
}

impl Elector {
    /// A candidate for `config`'s Lease.
    pub fn new(client: &kube::Client, config: LeaseConfig) -> Elector {
        Elector {
            api: Api::namespaced(client.clone(), &config.namespace),
            config,
            observed: None,
            known: false,
            vanished: false,
        }
    }

    fn error(&self, source: kube::Error) -> ApproverError {
        ApproverError::Lease {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    /// One attempt to take or renew the Lease: true when this candidate holds it afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, ApproverError> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let duration = i32::try_from(self.config.duration.as_secs()).unwrap_or(i32::MAX);
        let current = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.error(e))?;
        let Some(mut lease) = current else {
            // Seen or made before, gone now: the store lost it (or someone deleted it), so
            // what the approver's watch holds may be gone too.
            self.vanished |= std::mem::take(&mut self.known);
            self.observed = None;
            let made = self.create(now, duration).await;
            self.known = matches!(made, Ok(true));
            return made;
        };
        self.known = true;
        let version = lease.metadata.resource_version.clone().unwrap_or_default();
        let first_seen = match &self.observed {
            Some((seen, at)) if *seen == version => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((version, at));
                at
            }
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(self.config.identity.as_str());
        let held_for = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(duration)).unwrap_or(0),
        );
        if holder.is_some() && !mine && first_seen.elapsed() < held_for {
            return Ok(false);
        }
        if !mine {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        spec.holder_identity = Some(self.config.identity.clone());
        spec.lease_duration_seconds = Some(duration);
        spec.renew_time = Some(now);
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(self.error(e)),
        }
    }

    /// Whether the Lease this process had seen vanished since the last call: a watch that
    /// resumes across an etcd wipe misses what was written before the store's revision passed
    /// the watch's, and no resource version tells (the approver lists again on it).
    pub fn take_vanished(&mut self) -> bool {
        std::mem::take(&mut self.vanished)
    }

    /// Takes a Lease nobody created yet: true when this candidate made it (409: another did).
    async fn create(&self, now: MicroTime, duration: i32) -> Result<bool, ApproverError> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                lease_duration_seconds: Some(duration),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(self.error(e)),
        }
    }

    /// Gives the Lease up if this candidate holds it: an empty holder and a 1 s duration, so a
    /// standby takes over at once.
    pub async fn release(&mut self) -> Result<(), ApproverError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.error(e))?
        else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }
}

/// When this replica last renewed its Lease, shared between the elector and every task that
/// acts as leader: a write checks it right before it is sent, so a leader that was frozen, or
/// whose renewals hang, acts on elapsed time and not on a flag nobody has updated yet.
#[derive(Debug, Clone)]
pub struct Validity {
    renewed: std::sync::Arc<std::sync::Mutex<Option<Instant>>>,
    renew_deadline: Duration,
    /// How many times the Lease vanished under this replica ([`Elector::take_vanished`]).
    vanished: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Validity {
    /// Not renewed yet.
    pub fn new(renew_deadline: Duration) -> Validity {
        Validity {
            renewed: Default::default(),
            renew_deadline,
            vanished: Default::default(),
        }
    }

    fn set(&self, at: Option<Instant>) {
        if let Ok(mut r) = self.renewed.lock() {
            *r = at;
        }
    }

    /// How many times the Lease this replica had seen vanished: the controller lists again
    /// each time the count moves.
    pub fn lease_vanished(&self) -> u64 {
        self.vanished.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn last(&self) -> Option<Instant> {
        self.renewed.lock().ok().and_then(|r| *r)
    }

    /// Ok while the last renewal is within the renew deadline.
    pub fn check(&self) -> Result<(), ApproverError> {
        match self.last() {
            Some(at) if at.elapsed() < self.renew_deadline => Ok(()),
            last => Err(ApproverError::LeaseExpired {
                elapsed: last.map(|at| at.elapsed()).unwrap_or(Duration::MAX),
                deadline: self.renew_deadline,
            }),
        }
    }
}

/// Campaigns for the Lease and holds it until `stop`, publishing whether this process leads on
/// `leading` and when it last renewed on `validity`. Steps down (false) as soon as the renew
/// deadline has passed since the last renewal, whatever the calls are doing: each attempt is
/// bounded by the time left until that deadline, so a hanging API server cannot keep a leader
/// leading. Releases the Lease when stopped while leading.
pub async fn hold(
    mut elector: Elector,
    leading: watch::Sender<bool>,
    validity: Validity,
    mut stop: watch::Receiver<bool>,
) {
    let retry = elector.config.retry;
    let renew_deadline = elector.config.renew_deadline;
    let mut last_renewal: Option<Instant> = None;
    loop {
        // Elapsed time first: a leader past its deadline steps down before anything else.
        if last_renewal.is_some_and(|at| at.elapsed() >= renew_deadline) {
            last_renewal = None;
            validity.set(None);
            publish(&elector, &leading, false);
        }
        // A leader's attempt may take only what is left of its deadline; a standby's, one
        // renew deadline.
        let now_leading = attempt(&mut elector, &mut last_renewal, &validity).await;
        if !now_leading {
            last_renewal = None;
            validity.set(None);
        }
        publish(&elector, &leading, now_leading);
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = stopped(&mut stop) => break,
        }
    }
    validity.set(None);
    if *leading.borrow() {
        leading.send_replace(false);
        release(&mut elector, renew_deadline).await;
    }
}

/// One attempt to take or renew the Lease, bounded: a leader's attempt may take only what is
/// left of its renew deadline, a standby's one renew deadline. Whether this replica leads
/// after it (a leader whose call failed still leads until its deadline has passed).
async fn attempt(
    elector: &mut Elector,
    last_renewal: &mut Option<Instant>,
    validity: &Validity,
) -> bool {
    let renew_deadline = elector.config.renew_deadline;
    let bound = last_renewal
        .map(|at| renew_deadline.saturating_sub(at.elapsed()))
        .unwrap_or(renew_deadline)
        .max(Duration::from_millis(1));
    let result = match tokio::time::timeout(bound, elector.try_acquire_or_renew()).await {
        Ok(result) => result,
        Err(_) => Err(ApproverError::LeaseTimeout {
            namespace: elector.config.namespace.clone(),
            name: elector.config.name.clone(),
            bound,
        }),
    };
    if elector.take_vanished() {
        tracing::warn!("the Lease this replica had seen is gone (etcd restored or wiped, or the Lease deleted): listing every request again");
        validity
            .vanished
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    match result {
        Ok(true) => {
            let now = Instant::now();
            *last_renewal = Some(now);
            validity.set(Some(now));
            true
        }
        Ok(false) => false,
        Err(e) => {
            tracing::warn!(error = %e, "cannot take or renew the lease");
            last_renewal.is_some_and(|at| at.elapsed() < renew_deadline)
        }
    }
}

/// Gives the Lease up at the stop, within the renew deadline.
async fn release(elector: &mut Elector, renew_deadline: Duration) {
    match tokio::time::timeout(renew_deadline, elector.release()).await {
        Ok(Ok(())) => tracing::info!("released the lease"),
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot release the lease; it expires by itself"),
        Err(_) => tracing::warn!("no answer releasing the lease; it expires by itself"),
    }
}

fn publish(elector: &Elector, leading: &watch::Sender<bool>, now_leading: bool) {
    if *leading.borrow() != now_leading {
        tracing::info!(
            identity = %elector.config.identity,
            lease = %format!("{}/{}", elector.config.namespace, elector.config.name),
            "{}",
            if now_leading { "leading" } else { "not leading: standing by" }
        );
        leading.send_replace(now_leading);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(retry: u64, renew: u64, duration: u64) -> LeaseConfig {
        LeaseConfig {
            namespace: "ns".into(),
            name: "n".into(),
            identity: "me".into(),
            duration: Duration::from_secs(duration),
            renew_deadline: Duration::from_secs(renew),
            retry: Duration::from_secs(retry),
        }
    }

    #[test]
    fn timings_must_leave_room_for_stepping_down() {
        assert!(config(2, 10, 15).check().is_ok());
        assert!(config(10, 10, 15)
            .check()
            .unwrap_err()
            .to_string()
            .contains("retry"));
        assert!(config(2, 15, 15)
            .check()
            .unwrap_err()
            .to_string()
            .contains("two replicas could lead"));
    }

    #[test]
    fn identities_are_unique_per_process() {
        assert_ne!(default_identity(), default_identity());
    }
}
