//! The attesting approver (`hwkey approver`): approves CertificateSigningRequests whose key is
//! proven to live in a registered node's TPM, and denies the others with a precise reason.
//!
//! - [`policy`]: what may be approved for each signer, read from the request exactly as Go
//!   reads it ([`crate::pki::request`]).
//! - [`evaluate`]: what a request's own content decides (policy, requester, evidence,
//!   freshness).
//! - [`ek_join`]: TPMs that join by their EK certificate: carrier requests, credential
//!   answers, and [`binding`], which TPM may be which node.
//! - [`evidence_index`]: which request holds each piece of evidence (used once).
//! - [`queue`]: decisions waiting to be written, served fairly per requester.
//! - [`controller`]: the loop (kube's watcher, paged), settling against the trust and writing
//!   through the `approval` subresource while this replica leads.
//! - [`trust`]: the registered nodes, from a directory or a ConfigMap; what the source holds
//!   decides, and approvals use a fresh reading.
//! - [`lease`]: client-go-style leader election on a `coordination.k8s.io` Lease.
//! - [`lifetime`]: whether the API server keeps `spec.expirationSeconds`, read again while
//!   running.
//! - [`metrics`]: decisions by reason, queue and trust health, the metrics and liveness
//!   listeners.
//!
//! Threads: a small multi-thread runtime, so the Lease's renewals, the liveness probe and the
//! decision loop never wait for one another.

pub mod allow_list;
pub mod binding;
pub mod controller;
pub mod decision;
pub mod ek_join;
pub mod error;
pub mod evaluate;
pub mod evidence_index;
pub mod lease;
pub mod lifetime;
pub mod metrics;
pub mod node_addresses;
pub mod policy;
pub mod queue;
pub mod reason;
pub mod relist;
pub mod rules;
pub mod settings;
pub mod trust;
pub mod write;

use std::sync::Arc;

use tokio::sync::watch;

pub use self::controller::{Mode, Round, Settings};
pub use self::decision::Decision;
pub use self::error::ApproverError;
pub use self::evaluate::{OnMissingEvidence, Rules};
pub use self::policy::{Reason, SignerPolicy};

use self::controller::Controller;
use self::lease::{Elector, LeaseConfig, Validity};
use self::metrics::ApproverMetrics;
use self::trust::{Trust, TrustKind, TrustSource};

/// The approver's settings.
#[derive(Debug, Clone)]
pub struct ApproverOptions {
    /// The signers decided for and the rules.
    pub settings: Settings,
    /// The registered nodes (`hwkey attest enroll` output, one entry per node); needed to
    /// decide for the kubelet signer.
    pub trust: Option<TrustSource>,
    /// The people trust: the allow list (`_allow`) and AKs registered per user; needed to
    /// decide for `kubernetes.io/kube-apiserver-client`.
    pub people: Option<TrustSource>,
}

/// Checks that every signer has a policy with what `rules` configure: the approver refuses to
/// start otherwise.
pub fn check_signers(signer_names: &[String], rules: &Rules) -> Result<(), ApproverError> {
    let configured = policy::Configured::of(rules);
    for signer in signer_names {
        SignerPolicy::for_signer(signer, configured)?;
    }
    Ok(())
}

/// [`check_signers`] for `options`.
fn check_options(options: &ApproverOptions) -> Result<(), ApproverError> {
    check_signers(&options.settings.signer_names, &options.settings.rules)
}

/// Reads both trust sources once (each that is configured).
async fn load_trusts(
    options: &ApproverOptions,
    client: &kube::Client,
    metrics: &Arc<ApproverMetrics>,
) -> Result<(Option<Trust>, Option<Trust>), ApproverError> {
    let mut loaded = [None, None];
    for (slot, source, kind) in [
        (0, &options.trust, TrustKind::Nodes),
        (1, &options.people, TrustKind::People),
    ] {
        if let Some(source) = source {
            loaded[slot] = Some(Trust::load(source.clone(), kind, client, metrics.clone()).await?);
        }
    }
    let [nodes, people] = loaded;
    Ok((nodes, people))
}

/// Whether the API server keeps `spec.expirationSeconds`, read once now (people's rules only).
async fn learn_lifetime_support(client: &kube::Client, settings: &Settings) {
    if let Some(people) = &settings.rules.people {
        lifetime::learn(client, &people.expiration_known, true).await;
    }
}

/// Decides the requests open now and returns (`hwkey approver --once`): no election.
pub async fn decide_once(
    client: &kube::Client,
    options: ApproverOptions,
    metrics: Arc<ApproverMetrics>,
) -> Result<Round, ApproverError> {
    check_options(&options)?;
    let (trust, people) = load_trusts(&options, client, &metrics).await?;
    let settings = options.settings;
    learn_lifetime_support(client, &settings).await;
    let mut controller = Controller::new(client, settings, [trust, people], metrics, None);
    let (_leading_tx, leading) = watch::channel(true);
    let (_stop_tx, stop) = watch::channel(false);
    Ok(controller.run(Mode::Once, leading, stop).await)
}

/// Runs until `stop`: decides while leading (always, without `election`), follows the requests
/// and the trust source all the while, and releases the Lease on the way out.
pub async fn run(
    client: &kube::Client,
    options: ApproverOptions,
    election: Option<LeaseConfig>,
    metrics: Arc<ApproverMetrics>,
    stop: watch::Receiver<bool>,
) -> Result<(), ApproverError> {
    check_options(&options)?;
    let (trust, people) = load_trusts(&options, client, &metrics).await?;
    let followers: Vec<_> = [&trust, &people]
        .into_iter()
        .flatten()
        .map(|t| tokio::spawn(t.clone().follow()))
        .collect();
    let settings = options.settings;
    learn_lifetime_support(client, &settings).await;
    // Read again while running: an in-place upgrade of the API server turns lifetime checks on
    // without a restart.
    let relearn = settings.rules.people.as_ref().map(|people| {
        tokio::spawn(lifetime::follow(
            client.clone(),
            people.expiration_known.clone(),
            lifetime::RELEARN,
        ))
    });
    let (leading_tx, leading) = watch::channel(election.is_none());
    let validity = election
        .as_ref()
        .map(|config| Validity::new(config.renew_deadline));
    // Without election this process always decides; the sender lives for the run.
    let mut _always = None;
    let holder = match (election, &validity) {
        (Some(config), Some(validity)) => Some(tokio::spawn(lease::hold(
            Elector::new(client, config),
            leading_tx,
            validity.clone(),
            stop.clone(),
        ))),
        _ => {
            _always = Some(leading_tx);
            None
        }
    };
    let gauge = tokio::spawn(follow_leadership(leading.clone(), metrics.clone()));
    let mut controller =
        Controller::new(client, settings, [trust, people], metrics.clone(), validity);
    controller.run(Mode::Follow, leading, stop).await;
    metrics.leader.set(0);
    for follower in followers.into_iter().chain(relearn) {
        follower.abort();
    }
    gauge.abort();
    if let Some(holder) = holder {
        holder.await.map_err(|source| ApproverError::Panicked {
            task: "the Lease holder",
            source,
        })?;
    }
    Ok(())
}

/// Keeps `hwkey_approver_leader` equal to whether this replica leads.
async fn follow_leadership(mut leading: watch::Receiver<bool>, metrics: Arc<ApproverMetrics>) {
    loop {
        let now = *leading.borrow_and_update();
        metrics.leader.set(i64::from(now));
        if now {
            tracing::info!("deciding: this replica leads");
        }
        if leading.changed().await.is_err() {
            return;
        }
    }
}
