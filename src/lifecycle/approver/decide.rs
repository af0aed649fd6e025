//! One request's decision, and recording it on the API server.
//!
//! A request is ours when its signerName is one of ours and it has no Approved or Denied
//! condition yet. It is approved only when every check holds, in this order (the first that
//! fails is the denial's reason, [`Reason`]):
//!
//! 1. `spec.request` is exactly one CERTIFICATE REQUEST block, read as Go reads it
//!    ([`policy::request_der`]): the approver decides on the bytes the signer signs;
//! 2. the signer's policy ([`policy::check_kubelet_client`]): the subject's DER RDNs, SANs,
//!    requested extensions and attributes, `spec.usages`;
//! 3. the requester may ask for that node: the node itself, or a bootstrap identity in one of
//!    the configured bootstrap groups;
//! 4. the TPM evidence holds ([`crate::pki::attestation::verify_evidence`]);
//! 5. it is fresh: made within the window before the request was created;
//! 6. it is not reused: no earlier request carries the same evidence ([`EvidenceIndex`]);
//! 7. the (AK, node) pair is registered ([`crate::pki::attestation::admit`]).

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use kube::api::{Api, PostParams};

use super::policy::{self, Reason};
use super::OnMissingEvidence;
use crate::lifecycle::LifecycleError;
use crate::pki::attestation::{self, RegisteredAk};

/// How far a node's clock may run ahead of the API server's: evidence made up to this long
/// after its request was created is still fresh.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

/// One decision.
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

/// The rules a decision applies beyond the signer's policy.
#[derive(Debug, Clone)]
pub struct Rules {
    /// Requests without evidence: deny or leave alone.
    pub on_missing_evidence: OnMissingEvidence,
    /// Groups whose bootstrap identities (`system:bootstrap:*`) may ask for a node identity.
    pub bootstrap_groups: Vec<String>,
    /// How old evidence may be when its request is created.
    pub evidence_max_age: Duration,
}

/// Whether `csr` is still to be decided by an approver of `signer_names`.
pub fn is_ours_and_open(csr: &CertificateSigningRequest, signer_names: &[String]) -> bool {
    if !signer_names.contains(&csr.spec.signer_name) {
        return false;
    }
    !csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| (c.type_ == "Approved" || c.type_ == "Denied") && c.status == "True")
        })
}

/// When a request was created (Unix seconds), as the API server stamped it.
fn created_at(csr: &CertificateSigningRequest) -> Option<i64> {
    csr.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
}

/// Which request first carried each piece of evidence: the earliest (creation time, name) of
/// every request of ours seen, decided or not. The API server keeps decided requests for an
/// hour (kube-controller-manager's cleaner), longer than the freshness window, so a copy of
/// fresh evidence always meets its original here, even across approver restarts.
#[derive(Debug, Default)]
pub struct EvidenceIndex {
    first: HashMap<[u8; 32], (i64, String)>,
}

impl EvidenceIndex {
    /// Records `csr`'s evidence (if it has any).
    pub fn record(&mut self, csr: &CertificateSigningRequest) {
        let (Some(name), Some(created)) = (csr.metadata.name.clone(), created_at(csr)) else {
            return;
        };
        let Some(digest) = policy::request_der(&csr.spec.request.0)
            .ok()
            .and_then(|der| attestation::evidence_digest(&der))
        else {
            return;
        };
        let candidate = (created, name);
        let entry = self
            .first
            .entry(digest)
            .or_insert_with(|| candidate.clone());
        if candidate < *entry {
            *entry = candidate;
        }
    }

    /// The earlier request holding `digest`, if it is not `name`.
    fn earlier_than(&self, digest: &[u8; 32], name: &str) -> Option<&str> {
        self.first
            .get(digest)
            .map(|(_, first)| first.as_str())
            .filter(|first| *first != name)
    }

    /// How many distinct pieces of evidence are recorded.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }
}

/// The decision for one open request of ours, or None when it is left to other approvers
/// (`--on-missing-evidence ignore` and no evidence). `trusted` are the registered nodes;
/// `index` must already hold `csr` and every request seen before it.
pub fn decide(
    csr: &CertificateSigningRequest,
    rules: &Rules,
    trusted: &[RegisteredAk],
    index: &EvidenceIndex,
) -> Option<Decision> {
    let name = csr.metadata.name.clone()?;
    let deny = |reason: Reason, message: String| {
        Some(Decision {
            name: name.clone(),
            approved: false,
            reason,
            message,
        })
    };
    let der = match policy::request_der(&csr.spec.request.0) {
        Ok(der) => der,
        Err(v) => return deny(v.reason, v.message),
    };
    let digest = attestation::evidence_digest(&der);
    if digest.is_none() && rules.on_missing_evidence == OnMissingEvidence::Ignore {
        return None;
    }
    let usages = csr.spec.usages.clone().unwrap_or_default();
    let checked = match policy::check_kubelet_client(&der, Some(&usages)) {
        Ok(c) => c,
        Err(v) => return deny(v.reason, v.message),
    };
    if let Err(message) = check_requester(csr, &checked.node, &rules.bootstrap_groups) {
        return deny(Reason::RequesterNotAllowed, message.to_string());
    }
    let attested = match attestation::verify_evidence(&checked.der) {
        Ok(a) => a,
        Err(r) => return deny(Reason::of(r.refusal), r.message),
    };
    if let Err(message) = check_fresh(csr, attested.made_at, rules.evidence_max_age) {
        return deny(Reason::EvidenceStale, message.to_string());
    }
    if let Some(first) = index.earlier_than(&attested.evidence_digest, &name) {
        return deny(
            Reason::EvidenceReused,
            format!(
                "the same TPM evidence is in request {first}, made earlier: evidence is used once"
            ),
        );
    }
    let admitted = match attestation::admit(attested, &checked.node, trusted) {
        Ok(a) => a,
        Err(r) => return deny(Reason::of(r.refusal), r.message),
    };
    Some(Decision {
        name,
        approved: true,
        reason: Reason::AttestedTPMKey,
        message: format!(
            "the key is in the TPM of node '{}' (attestation key {})",
            admitted.node, admitted.ak_name
        ),
    })
}

/// The node itself (renewal), or a bootstrap identity in an allowed group (first join).
fn check_requester(
    csr: &CertificateSigningRequest,
    node: &str,
    bootstrap_groups: &[String],
) -> Result<(), RequesterRefused> {
    let user = csr.spec.username.clone().unwrap_or_default();
    if user == format!("system:node:{node}") {
        return Ok(());
    }
    let groups = csr.spec.groups.clone().unwrap_or_default();
    if user.starts_with("system:bootstrap:") {
        if groups.iter().any(|g| bootstrap_groups.contains(g)) {
            return Ok(());
        }
        return Err(if bootstrap_groups.is_empty() {
            RequesterRefused::NoBootstrapGroup { user }
        } else {
            RequesterRefused::OtherGroups {
                user,
                groups,
                allowed: bootstrap_groups.to_vec(),
            }
        });
    }
    Err(RequesterRefused::NotTheNode {
        user,
        node: node.to_string(),
    })
}

/// Why a request's requester may not ask for the node identity it asks for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum RequesterRefused {
    #[error("{user} is a bootstrap identity, and no bootstrap group is allowed (pass --bootstrap-group with the group of the nodes' bootstrap tokens)")]
    NoBootstrapGroup { user: String },
    #[error("{user} is in groups {groups:?}, none of the bootstrap groups allowed to join nodes ({allowed:?})")]
    OtherGroups {
        user: String,
        groups: Vec<String>,
        allowed: Vec<String>,
    },
    #[error("{user} may not ask for system:node:{node}: only that node itself or a bootstrap identity of an allowed group may")]
    NotTheNode { user: String, node: String },
}

/// Why evidence is too old or too new for its request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum NotFresh {
    #[error("the request has no creation time")]
    NoCreationTime,
    #[error("the evidence was made {age} s before the request was created (at most {max} s): make a new request on the node")]
    TooOld { age: i64, max: i64 },
    #[error("the evidence claims to be made {ahead} s after the request was created (at most {skew} s of clock skew): check the node's clock")]
    FromTheFuture { ahead: i64, skew: i64 },
}

/// Evidence made at most `max_age` before the request was created, and not more than
/// [`CLOCK_SKEW`] after.
fn check_fresh(
    csr: &CertificateSigningRequest,
    made_at: u64,
    max_age: Duration,
) -> Result<(), NotFresh> {
    let created = created_at(csr).ok_or(NotFresh::NoCreationTime)?;
    let made = i64::try_from(made_at).unwrap_or(i64::MAX);
    let age = created.saturating_sub(made);
    let max = i64::try_from(max_age.as_secs()).unwrap_or(i64::MAX);
    let skew = i64::try_from(CLOCK_SKEW.as_secs()).unwrap_or(i64::MAX);
    if age > max {
        return Err(NotFresh::TooOld { age, max });
    }
    if -age > skew {
        return Err(NotFresh::FromTheFuture { ahead: -age, skew });
    }
    Ok(())
}

/// What became of a decision sent to the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The condition is on the request.
    Yes,
    /// The request changed since it was read (another approver, or a replica, decided it, or it
    /// was deleted): nothing was written, and the new state will be seen again.
    Conflict,
}

/// Writes `decision` on `csr` through the `approval` subresource (PUT: RBAC verb `update`).
/// The request as it was read, with its resourceVersion, is the precondition: a write over a
/// changed request is refused with 409 Conflict and reported as [`Recorded::Conflict`].
pub async fn record(
    api: &Api<CertificateSigningRequest>,
    csr: &CertificateSigningRequest,
    decision: &Decision,
) -> Result<Recorded, LifecycleError> {
    let mut updated = csr.clone();
    let status = updated.status.get_or_insert_with(Default::default);
    status
        .conditions
        .get_or_insert_with(Vec::new)
        .push(CertificateSigningRequestCondition {
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
    match api
        .replace_subresource::<CertificateSigningRequest>(
            "approval",
            &decision.name,
            &PostParams::default(),
            &updated,
        )
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(Recorded::Conflict),
        Err(source) => Err(LifecycleError::Approve {
            name: decision.name.clone(),
            source,
        }),
    }
}
