//! When the watch must list everything again at once, as client-go's reflector does: the API
//! server no longer has the version the watch resumes from (410, "too large resource
//! version"), or its current version went back (an etcd restore, which a watch resuming from a
//! version etcd has not reached yet never reports).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;
use kube::runtime::watcher;

/// A reading of the API server's current resource version in flight.
pub type Probe = Pin<Box<dyn Future<Output = Option<u64>> + Send>>;

/// How often the loop asks the API server for its current resource version (a list of one
/// request): a version lower than one the watch has seen means etcd was restored, and a watch
/// resuming from a version etcd has not reached yet stays silent until it does, so only a new
/// list sees what happened since.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);

/// The resource versions the loop has seen and the API server has answered with.
#[derive(Debug, Default)]
pub struct Versions {
    /// The newest resource version seen on the current watch.
    newest: u64,
    /// The highest version the API server answered a probe with (etcd's revision never goes
    /// down but by a restore).
    highest_probe: u64,
    /// What a probe's answer is compared with: the highest version known when it was sent (a
    /// write landing after the probe's read cannot make it look like a step back).
    baseline: u64,
    /// When the API server's version was last asked for.
    probed_at: Option<Instant>,
}

impl Versions {
    /// A new watch starts (its list brings the versions again).
    pub fn new_watch(&mut self) {
        self.newest = 0;
    }

    /// A request with resource version `v` was seen.
    pub fn saw(&mut self, v: u64) {
        self.newest = self.newest.max(v);
    }

    /// A reading of the API server's current resource version (a list of one), every
    /// [`PROBE_EVERY`] at most (`--once` never lists twice, so it never asks).
    pub fn probe(&mut self, api: &Api<CertificateSigningRequest>) -> Option<Probe> {
        if self.probed_at.is_some_and(|at| at.elapsed() < PROBE_EVERY) {
            return None;
        }
        self.baseline = self.newest.max(self.highest_probe);
        self.probed_at = Some(Instant::now());
        let api = api.clone();
        Some(Box::pin(async move {
            let params = kube::api::ListParams::default().limit(1);
            let listed = tokio::time::timeout(PROBE_EVERY, api.list_metadata(&params)).await;
            listed.ok()?.ok()?.metadata.resource_version?.parse().ok()
        }))
    }

    /// Whether a probe's answer is a step back from what was known when it was sent: etcd
    /// restored (from nothing or from a backup). The next probe starts a new baseline.
    pub fn went_back(&mut self, current: Option<u64>) -> bool {
        let Some(current) = current else {
            return false;
        };
        if current < self.baseline {
            tracing::warn!(current, known = self.baseline, "the API server's resource version went back (etcd restored): listing everything again");
            self.highest_probe = 0;
            return true;
        }
        self.highest_probe = self.highest_probe.max(current);
        false
    }
}

/// Whether a watch error means the API server no longer has the version the watch resumes
/// from, so that only a new list helps (client-go's reflector relists on the same two): 410
/// Gone (compacted), or "too large resource version" (504, cause ResourceVersionTooLarge),
/// which a restored etcd answers to every version written before the restore. kube's watcher
/// relists on a 410 in a watch's events, but retries a watch that fails to start from the same
/// version forever.
pub fn must_relist(e: &watcher::Error) -> bool {
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
