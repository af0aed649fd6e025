//! The decision loop's state ([`Controller`]) and the small types the loop and its halves
//! share: the work queued, the writes in flight, the mode.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Future;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;

use crate::approver::decision::Decision;
use crate::approver::ek_join::Carriers;
use crate::approver::error::ApproverError;
use crate::approver::evaluate::{Candidate, Rules, Seen};
use crate::approver::evidence_index::EvidenceIndex;
use crate::approver::lease::Validity;
use crate::approver::metrics::ApproverMetrics;
use crate::approver::node_addresses::NodeIndex;
use crate::approver::policy::{Pending, SignerPolicy, Violation};
use crate::approver::queue::WorkQueue;
use crate::approver::relist::Versions;
use crate::approver::trust::Trust;
use crate::pki::attestation;

/// Decisions written at once: the API server's round trip, not the check, bounds the rate.
pub const IN_FLIGHT: usize = 16;

/// How long a failed trust reading waits before the next.
pub(super) const TRUST_RETRY: Duration = Duration::from_secs(1);

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
pub(super) enum Work {
    /// Denied by the request alone.
    Deny(Box<Seen>, Violation),
    /// To be settled by its policy against the trust.
    Settle(Box<Seen>, Pending),
    /// Approved, but it can no longer be finished (a carrier whose certificate's write
    /// failed): a Failed condition.
    Fail(Box<Seen>, Violation),
}

impl Work {
    pub(super) fn seen(&self) -> &Seen {
        match self {
            Work::Deny(s, _) | Work::Settle(s, _) | Work::Fail(s, _) => s,
        }
    }

    /// Whether writing it needs a fresh reading of a trust source.
    pub(super) fn settles(&self) -> bool {
        matches!(self, Work::Settle(..))
    }
}

/// A write in flight: what was decided, and whether it claimed the evidence.
pub(super) struct Writing {
    pub(super) decision: Decision,
    pub(super) granted: Option<Box<Candidate>>,
    /// The carrier it answers, claimed while it is written.
    pub(super) answering: Option<String>,
}

/// A reading of the trust sources in flight.
pub(super) type Refresh = Pin<Box<dyn Future<Output = Result<(), ApproverError>> + Send>>;

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
    pub(super) api: Api<CertificateSigningRequest>,
    pub(super) settings: Settings,
    /// The policy of each signer decided for.
    pub(super) policies: Vec<(String, SignerPolicy)>,
    /// Every Node's names and addresses (read by serving decisions only).
    pub(super) nodes: NodeIndex,
    /// The registered nodes (None: no kubelet signer decided).
    pub(super) trust: Option<Trust>,
    /// The people trust (None: no people policy).
    pub(super) people: Option<Trust>,
    pub(super) index: EvidenceIndex,
    /// The carrier requests seen and answered (TPMs joining by their EK certificate).
    pub(super) carriers: Carriers,
    pub(super) queue: WorkQueue<Work>,
    pub(super) writing: std::collections::HashMap<String, Writing>,
    pub(super) metrics: Arc<ApproverMetrics>,
    pub(super) validity: Option<Validity>,
    /// The uids seen during the (re)list in progress.
    pub(super) listing: Option<HashSet<String>>,
    pub(super) listed_once: bool,
    /// A full lane left requests out: list again once the queue has drained.
    pub(super) deferred: bool,
    /// The watch cannot resume from its version: list again now.
    pub(super) relist_now: bool,
    /// The resource versions seen, and the probe that tells an etcd restore.
    pub(super) versions: Versions,
    /// [`crate::approver::lease::Validity::lease_vanished`] when last looked at.
    pub(super) lease_vanished: u64,
    pub(super) trust_retry_at: Option<Instant>,
    /// `--once`: the decisions written and the failures.
    pub(super) decided: Vec<Decision>,
    pub(super) failures: Vec<ApproverError>,
}

pub(super) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// The approver's clock, Unix seconds.
pub(super) fn now_unix() -> i64 {
    i64::try_from(attestation::unix_now()).unwrap_or(i64::MAX)
}
