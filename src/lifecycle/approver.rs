//! The attesting approver: approves CertificateSigningRequests whose key is proven to live in a
//! registered node's TPM, and denies the others with a precise reason.
//!
//! For each undecided request of the configured signers it checks the TPM evidence
//! ([`crate::pki::attestation::verify_request`]) and that the requester may ask for that
//! subject: a node renews only its own `system:node:NAME`, and a bootstrap identity
//! (`system:bootstrap:…`) may ask only for a registered node's name. Decisions go through the
//! `approval` subresource, with the request's resourceVersion as a precondition: a request that
//! already has an Approved or Denied condition is never touched again (a restarted approver makes
//! no second decision), and of two replicas deciding the same request at once only the first
//! write lands (the other gets 409 Conflict and backs off).

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use kube::api::{Api, ListParams, Patch, PatchParams};

use super::LifecycleError;
use crate::pki::attestation::{self, Refusal};

/// What to do with a request that carries no evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
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
    /// The registered nodes (`hwkey attest enroll` output, one file per node).
    pub trust: PathBuf,
    /// Requests without evidence: deny or leave alone.
    pub on_missing_evidence: OnMissingEvidence,
}

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

/// Decides every undecided request of the configured signers once; returns the decisions made.
pub async fn decide_pending(
    client: &kube::Client,
    options: &ApproverOptions,
) -> Result<Vec<Decision>, LifecycleError> {
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let trusted = attestation::read_trust_dir(&options.trust)?;
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| LifecycleError::Watch {
            name: "certificatesigningrequests".into(),
            reason: e.to_string(),
        })?;
    let mut decisions = Vec::new();
    for csr in list.items {
        let Some(decision) = decide(&csr, options, &trusted) else {
            continue;
        };
        let condition = CertificateSigningRequestCondition {
            type_: if decision.approved {
                "Approved".into()
            } else {
                "Denied".into()
            },
            status: "True".into(),
            reason: Some(decision.reason.clone()),
            message: Some(decision.message.clone()),
            ..Default::default()
        };
        // The resourceVersion read with the request is a precondition: if another approver (a
        // second replica) decided it meanwhile, the API server answers 409 and this one backs off.
        let patch = serde_json::json!({
            "metadata": { "resourceVersion": csr.metadata.resource_version },
            "status": { "conditions": [condition] },
        });
        match api
            .patch_approval(
                &decision.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::info!(csr = %decision.name, "decided by another approver meanwhile");
                continue;
            }
            Err(e) => {
                return Err(LifecycleError::Watch {
                    name: decision.name.clone(),
                    reason: format!("cannot record the decision: {e}"),
                })
            }
        }
        tracing::info!(
            csr = %decision.name,
            approved = decision.approved,
            reason = %decision.reason,
            "{}",
            decision.message
        );
        decisions.push(decision);
    }
    Ok(decisions)
}

/// Runs until the process ends: decides pending requests every `interval`.
pub async fn run(
    client: &kube::Client,
    options: &ApproverOptions,
    interval: Duration,
) -> Result<(), LifecycleError> {
    loop {
        if let Err(e) = decide_pending(client, options).await {
            tracing::error!(error = %e, "approver round failed; retrying");
        }
        tokio::time::sleep(interval).await;
    }
}

/// The decision for one request, or None when it is not ours to decide.
fn decide(
    csr: &CertificateSigningRequest,
    options: &ApproverOptions,
    trusted: &[attestation::RegisteredAk],
) -> Option<Decision> {
    let name = csr.metadata.name.clone()?;
    if !options.signer_names.contains(&csr.spec.signer_name) {
        return None;
    }
    let decided = csr
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| (c.type_ == "Approved" || c.type_ == "Denied") && c.status == "True")
        });
    if decided {
        return None;
    }
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
                && options.on_missing_evidence == OnMissingEvidence::Ignore =>
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
            "SubjectMismatch",
            format!(
                "the key is in node '{}'s TPM, but the request asks for {}",
                admitted.node, admitted.subject
            ),
        );
    }
    let user = csr.spec.username.clone().unwrap_or_default();
    if user != wanted_cn && !user.starts_with("system:bootstrap:") {
        return deny(
            "SubjectMismatch",
            format!("{user} may not ask for {wanted_cn}: only that node itself or a bootstrap identity may"),
        );
    }
    Some(Decision {
        name,
        approved: true,
        reason: "AttestedTPMKey".into(),
        message: format!(
            "the key is in the TPM of node '{}' (attestation key {})",
            admitted.node, admitted.ak_name
        ),
    })
}
