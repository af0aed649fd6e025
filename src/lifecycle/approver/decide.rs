//! One request's decision, and recording it on the API server.
//!
//! A request is ours when its signerName is one of ours and it has no Approved or Denied
//! condition yet. It is approved when its TPM evidence holds, the evidence's AK is a registered
//! node's, the subject is that node's (`CN=system:node:NAME`) and the requester may ask for it
//! (the node itself, or a bootstrap identity `system:bootstrap:…`); it is denied otherwise, with
//! the reason that did not hold.

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use kube::api::{Api, PostParams};

use super::OnMissingEvidence;
use crate::lifecycle::LifecycleError;
use crate::pki::attestation::{self, Refusal};

/// The approval condition's reason for an attested key.
pub const APPROVED_REASON: &str = "AttestedTPMKey";
/// The denial reason when the key is attested but the subject or requester is wrong.
pub const SUBJECT_MISMATCH: &str = "SubjectMismatch";

/// One decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The request's name.
    pub name: String,
    /// Approved (true) or denied.
    pub approved: bool,
    /// The condition's reason (`AttestedTPMKey`, `NoEvidence`, …).
    pub reason: String,
    /// The condition's message.
    pub message: String,
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

/// The decision for one open request of ours, or None when it is left to other approvers
/// (`--on-missing-evidence ignore` and no evidence). `trusted` are the registered nodes.
pub fn decide(
    csr: &CertificateSigningRequest,
    on_missing_evidence: OnMissingEvidence,
    trusted: &[attestation::RegisteredAk],
) -> Option<Decision> {
    let name = csr.metadata.name.clone()?;
    let deny = |reason: &str, message: String| {
        Some(Decision {
            name: name.clone(),
            approved: false,
            reason: reason.into(),
            message,
        })
    };
    let der = match pem::parse(&csr.spec.request.0) {
        Ok(p) => p.into_contents(),
        Err(_) => csr.spec.request.0.clone(),
    };
    let admitted = match attestation::verify_request(&der, trusted) {
        Ok(a) => a,
        Err(r)
            if r.refusal == Refusal::NoEvidence
                && on_missing_evidence == OnMissingEvidence::Ignore =>
        {
            return None
        }
        Err(r) => return deny(r.refusal.reason(), r.message),
    };
    let wanted_cn = format!("system:node:{}", admitted.node);
    let subject_ok = admitted
        .subject
        .split(',')
        .map(str::trim)
        .any(|part| part == format!("CN={wanted_cn}"));
    if !subject_ok {
        return deny(
            SUBJECT_MISMATCH,
            format!(
                "the key is in node '{}'s TPM, but the request asks for {}",
                admitted.node, admitted.subject
            ),
        );
    }
    let user = csr.spec.username.clone().unwrap_or_default();
    if user != wanted_cn && !user.starts_with("system:bootstrap:") {
        return deny(
            SUBJECT_MISMATCH,
            format!("{user} may not ask for {wanted_cn}: only that node itself or a bootstrap identity may"),
        );
    }
    Some(Decision {
        name,
        approved: true,
        reason: APPROVED_REASON.into(),
        message: format!(
            "the key is in the TPM of node '{}' (attestation key {})",
            admitted.node, admitted.ak_name
        ),
    })
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
            reason: Some(decision.reason.clone()),
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
        Err(e) => Err(LifecycleError::Approve {
            name: decision.name.clone(),
            reason: e.to_string(),
        }),
    }
}
