//! What every policy reads the same way: the request as the loop keeps it ([`Seen`]), the rules,
//! a requester's entitlement to a node ([`attested_node`]), TPM evidence verified and fresh
//! ([`attested`]), and the rank that decides which of several requests with the same evidence
//! gets it. The policies themselves are in [`super::policy`]; what depends on the cluster's
//! state is settled right before the decision is written ([`super::controller`]).
//!
//! Evidence is fresh when it was made within the window before the request was created, and
//! the request has not waited longer than the window since.

use std::time::Duration;

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};

use super::reason::{self, Reason, Violation};
use crate::pki::attestation::{self, Attested};
use crate::pki::request::Request;
use crate::pki::same_key::SameKey;

/// How far a node's clock may run ahead of the API server's: evidence made up to this long
/// after its request was created is still fresh.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

pub use super::rules::{OnMissingEvidence, Rules};

/// A request's identity and state, without its bytes: all the approver keeps of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// `metadata.uid`: requests are told apart by it, never by name (a name can be reused).
    pub uid: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.resourceVersion`: the write's precondition.
    pub resource_version: String,
    /// `spec.username`: requests are queued fairly per requester.
    pub requester: String,
    /// `spec.signerName`.
    pub signer: String,
    /// `spec.usages`.
    pub usages: Vec<String>,
    /// `status.conditions` as read (kept on the write).
    pub conditions: Vec<CertificateSigningRequestCondition>,
    /// `metadata.annotations` and `metadata.labels` as read, kept on the write (an API server
    /// before 1.21 takes the approval's metadata from its body, so a body without them would
    /// wipe them: a joining node's credential annotations, an operator's labels).
    pub metadata: KeptMetadata,
}

/// The annotations and labels an approval writes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptMetadata {
    /// Small enough to keep (at most [`KEPT_METADATA_MAX`] bytes).
    Kept {
        /// `metadata.annotations`.
        annotations: Option<std::collections::BTreeMap<String, String>>,
        /// `metadata.labels`.
        labels: Option<std::collections::BTreeMap<String, String>>,
    },
    /// Larger: read again right before the write (an attacker's megabyte annotations are not
    /// kept for every queued request).
    ReadAgain,
}

/// The most annotation and label bytes kept per request.
pub const KEPT_METADATA_MAX: usize = 4096;

impl KeptMetadata {
    /// What to keep of `meta`.
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> KeptMetadata {
        let size = |m: &Option<std::collections::BTreeMap<String, String>>| {
            m.iter()
                .flatten()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
        };
        if size(&meta.annotations) + size(&meta.labels) <= KEPT_METADATA_MAX {
            KeptMetadata::Kept {
                annotations: meta.annotations.clone(),
                labels: meta.labels.clone(),
            }
        } else {
            KeptMetadata::ReadAgain
        }
    }
}

impl Seen {
    /// What the approver keeps of `csr`.
    pub fn of(csr: &CertificateSigningRequest) -> Seen {
        let meta = &csr.metadata;
        let name = meta.name.clone().unwrap_or_default();
        Seen {
            uid: meta.uid.clone().unwrap_or_else(|| name.clone()),
            name,
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            requester: csr.spec.username.clone().unwrap_or_default(),
            signer: csr.spec.signer_name.clone(),
            usages: csr.spec.usages.clone().unwrap_or_default(),
            conditions: csr
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default(),
            metadata: KeptMetadata::of(meta),
        }
    }
}

/// Whether `csr` already has an Approved or Denied condition.
pub fn is_decided(csr: &CertificateSigningRequest) -> Option<bool> {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| {
            c.iter()
                .find_map(|c| match (c.type_.as_str(), c.status.as_str()) {
                    ("Approved", "True") => Some(true),
                    ("Denied", "True") => Some(false),
                    _ => None,
                })
        })
}

/// How strongly a requester is entitled to the identity it asks for, and when it asked: of
/// several requests carrying the same evidence, the lowest rank gets it. The requester cannot
/// choose a better class than it has, nor an earlier creation than its own (a copy is made
/// after its original, so within one second the store's revision still puts it later); the
/// uid is chosen by the API server. A name, which the requester chooses, never ranks.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    /// 0: the node itself (renewal); 1: a bootstrap identity (first join).
    pub class: u8,
    /// Creation time (Unix seconds, as the API server stamped it).
    pub created: i64,
    /// The resourceVersion as a number (etcd's revision: an open request nobody changed
    /// still has its creation revision); a version that is not a number ranks last.
    pub revision: u64,
    /// `metadata.uid`.
    pub uid: String,
}

/// A request that passed every check the request alone can show: the registered nodes and the
/// other requests carrying its evidence decide the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The node it asks to be.
    pub node: String,
    /// What its evidence proved.
    pub attested: Attested,
    /// Its rank among requests with the same evidence.
    pub rank: Rank,
    /// The credential it answers (a TPM joining by its EK certificate), if any.
    pub claim: Option<super::ek_join::Claim>,
}

/// How a person proved the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersonProof {
    /// The key of the certificate they hold now.
    SameKey(SameKey),
    /// A key in a TPM: settled as a node's evidence is, against the AKs registered for the
    /// user.
    Attested(Box<Candidate>),
    /// A key in a YubiKey (PIV attestation): settled against the devices registered for the
    /// user.
    Piv(Box<crate::pki::piv::PivFacts>),
}

/// A person's request that passed every check of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersonCandidate {
    /// `spec.username` (= the CN).
    pub user: String,
    /// `spec.groups`.
    pub groups: Vec<String>,
    /// The O values asked for.
    pub orgs: Vec<String>,
    /// The proof of the key.
    pub proof: PersonProof,
}

fn deny(reason: Reason, message: impl Into<String>) -> Violation {
    Violation {
        reason,
        message: message.into(),
    }
}

/// A request for `node` by a requester entitled to ask for it, with fresh TPM evidence.
pub fn attested_node(
    csr: &CertificateSigningRequest,
    request: &Request,
    node: String,
    rules: &Rules,
    now: i64,
) -> Result<Candidate, Violation> {
    let class = check_requester(csr, &node, &rules.bootstrap_groups)
        .map_err(|r| deny(Reason::RequesterNotAllowed, r.to_string()))?;
    attested(csr, request, node, class, rules, now)
}

/// The TPM evidence of `request` verified and fresh: a candidate for `name` (a node, or a
/// person registered by user name) of requester `class`.
pub fn attested(
    csr: &CertificateSigningRequest,
    request: &Request,
    name: String,
    class: u8,
    rules: &Rules,
    now: i64,
) -> Result<Candidate, Violation> {
    let attested = attestation::verify_evidence(request)
        .map_err(|r| deny(Reason::of(r.refusal), r.message))?;
    let created = created_at(csr)
        .ok_or_else(|| deny(Reason::EvidenceStale, NotFresh::NoCreationTime.to_string()))?;
    check_fresh(created, now, attested.made_at, rules.evidence_max_age)
        .map_err(|e| deny(Reason::EvidenceStale, e.to_string()))?;
    let uid = csr.metadata.uid.clone().unwrap_or_default();
    let revision = csr
        .metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    Ok(Candidate {
        node: name,
        attested,
        rank: Rank {
            class,
            created,
            revision,
            uid,
        },
        claim: None,
    })
}

/// When a request was created (Unix seconds), as the API server stamped it.
fn created_at(csr: &CertificateSigningRequest) -> Option<i64> {
    csr.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
}

/// The node itself (renewal, class 0), or a bootstrap identity in an allowed group (first
/// join, class 1).
fn check_requester(
    csr: &CertificateSigningRequest,
    node: &str,
    bootstrap_groups: &[String],
) -> Result<u8, RequesterRefused> {
    let user = csr.spec.username.clone().unwrap_or_default();
    if user == format!("system:node:{node}") {
        return Ok(0);
    }
    let groups = csr.spec.groups.clone().unwrap_or_default();
    if user.starts_with("system:bootstrap:") {
        if groups.iter().any(|g| bootstrap_groups.contains(g)) {
            return Ok(1);
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
    #[error("{} is a bootstrap identity, and no bootstrap group is allowed (pass --bootstrap-group with the group of the nodes' bootstrap tokens)", reason::bounded(.user))]
    NoBootstrapGroup { user: String },
    #[error("{} is in groups {}, none of the bootstrap groups allowed to join nodes ({allowed:?})", reason::bounded(.user), reason::bounded(&format!("{groups:?}")))]
    OtherGroups {
        user: String,
        groups: Vec<String>,
        allowed: Vec<String>,
    },
    #[error("{} may not ask for system:node:{node}: only that node itself or a bootstrap identity of an allowed group may", reason::bounded(.user))]
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
    #[error("the evidence is {age} s old now (at most {max} s): the request waited too long for a decision; make a new request on the node")]
    Waited { age: i64, max: i64 },
}

/// Evidence made at most `max_age` before the request was created and not more than
/// [`CLOCK_SKEW`] after; and, now, not older than `max_age` plus the skew (so a request that
/// waited through an outage is not approved on old evidence, and evidence that old can be
/// forgotten by the reuse index).
fn check_fresh(created: i64, now: i64, made_at: u64, max_age: Duration) -> Result<(), NotFresh> {
    let made = i64::try_from(made_at).unwrap_or(i64::MAX);
    let max = i64::try_from(max_age.as_secs()).unwrap_or(i64::MAX);
    let skew = i64::try_from(CLOCK_SKEW.as_secs()).unwrap_or(i64::MAX);
    let age = created.saturating_sub(made);
    if age > max {
        return Err(NotFresh::TooOld { age, max });
    }
    if -age > skew {
        return Err(NotFresh::FromTheFuture { ahead: -age, skew });
    }
    let now_age = now.saturating_sub(made);
    if now_age > max.saturating_add(skew) {
        return Err(NotFresh::Waited {
            age: now_age,
            max: max.saturating_add(skew),
        });
    }
    Ok(())
}

/// How long evidence matters after it was made (Unix seconds): no request carrying older
/// evidence is approved, so the reuse index may forget it.
pub fn evidence_lifetime(max_age: Duration) -> i64 {
    i64::try_from((max_age + CLOCK_SKEW).as_secs()).unwrap_or(i64::MAX)
}

/// A serving request that passed every check of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingCandidate {
    /// N.
    pub node: String,
    /// The names asked for.
    pub names: crate::pki::san::Names,
    /// What its TPM evidence proved, if it carries any.
    pub attested: Option<Box<Candidate>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freshness_bounds_the_evidence_against_creation_and_now() {
        let max = Duration::from_secs(900);
        assert_eq!(check_fresh(1000, 1000, 990, max), Ok(()));
        assert!(matches!(
            check_fresh(2000, 2000, 1000, max),
            Err(NotFresh::TooOld { age: 1000, .. })
        ));
        assert!(matches!(
            check_fresh(1000, 1000, 1400, max),
            Err(NotFresh::FromTheFuture { ahead: 400, .. })
        ));
        // Created on time, decided after an outage of an hour: stale.
        assert!(matches!(
            check_fresh(1000, 4600, 990, max),
            Err(NotFresh::Waited { .. })
        ));
    }
}
