//! `hwkey.dev/tpm-credential`: the carrier request of a TPM joining by its EK certificate. It
//! asks for nothing a cluster trusts: approved, it carries the credential (MakeCredential to
//! the TPM's EK) in a carrier certificate the approver writes itself. Judged like a node's
//! first request (a node's subject, a bootstrap requester, fresh TPM2_Certify evidence) plus
//! an enrollment whose AK is the evidence's; issued when the EK certificate chains to a
//! trusted manufacturer CA and the binding policy allows the TPM this node name
//! ([`crate::approver::ek_join`]).

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;

use super::verdict::{Pending, Settling};
use crate::approver::binding;
use crate::approver::decision::{denial, Decided, Decision, Effect};
use crate::approver::ek_join::{self, CarrierCandidate, Join};
use crate::approver::evaluate::{self, Seen};
use crate::approver::reason::bounded;
use crate::approver::reason::{violation, Reason, Violation};
use crate::approver::rules::Rules;
use crate::approver::trust::Registry;
use crate::metric_labels::LabelValue;
use crate::pki::request::Request;

/// The facts of a carrier request whose subject is a node's and whose enrollment reads, to
/// remember once it is approved ([`ek_join::facts_for`]).
pub fn facts_of(csr: &CertificateSigningRequest) -> Option<ek_join::CarrierFacts> {
    let request = Request::from_pem(&csr.spec.request.0).ok()?;
    let node = super::check_node_client(&request, None).ok()?.node;
    ek_join::facts_for(csr, node)
}

/// Whether an approved carrier still waits for its certificate (its write failed): it is
/// issued now, or failed if it no longer can be.
pub fn issue_only(csr: &CertificateSigningRequest) -> bool {
    evaluate::is_decided(csr) == Some(true)
        && !has_certificate(csr)
        && !has_condition(csr, "Failed")
}

/// Judges a carrier request by itself: a node's subject and nothing else, usages
/// [`CARRIER_USAGES`](crate::pki::ek_join::CARRIER_USAGES), a requester that may ask for the
/// node, fresh TPM2_Certify evidence of its key, and an enrollment whose AK is the evidence's
/// ([`ek_join::carrier_candidate`]).
pub fn judge(
    csr: &CertificateSigningRequest,
    rules: &Rules,
    now: i64,
) -> Result<Option<Pending>, Violation> {
    use crate::pki::ek_join::CARRIER_USAGES;
    let request = Request::from_pem(&csr.spec.request.0)?;
    let identity = super::check_node_client(&request, None)?;
    let usages = csr.spec.usages.clone().unwrap_or_default();
    if usages != CARRIER_USAGES {
        return Err(violation(
            Reason::UsagesNotAllowed,
            format!(
                "a carrier request's usages are {CARRIER_USAGES:?}, not {}",
                bounded(&format!("{usages:?}"))
            ),
        ));
    }
    let candidate = evaluate::attested_node(csr, &request, identity.node, rules, now)?;
    if candidate.rank.class != 1 {
        return Err(violation(
            Reason::RequesterNotAllowed,
            "a carrier request comes from a bootstrap identity: a node that holds its certificate renews with it (a node whose entry was removed does not bind its name again by itself)",
        ));
    }
    let carrier = ek_join::carrier_candidate(csr, candidate.node, &candidate.attested.ak_name)?;
    Ok(Some(Pending::Carrier(Box::new(carrier), issue_only(csr))))
}

/// A carrier request: its credential in a carrier certificate, or the denial.
pub fn settle(
    s: &Settling<'_>,
    seen: Box<Seen>,
    candidate: &CarrierCandidate,
    approved: bool,
    nodes: &Registry,
) -> Decided {
    let join = s.rules.ek_join.as_deref().map(|settings| Join {
        settings,
        held: binding::Held {
            nodes: &nodes.aks,
            invalid: &nodes.invalid,
        },
        ek: &nodes.ek,
    });
    let issued = match join {
        Some(join) => join.issue(candidate, s.now),
        None => Err(violation(
            Reason::EkCertificateUntrusted,
            "this approver is not configured for TPMs that join by their EK certificate",
        )),
    };
    match issued {
        Ok((pem, message)) => Decided {
            decision: Decision {
                name: seen.name.clone(),
                approved: true,
                reason: Reason::EkCertificateVerified,
                message,
            },
            seen,
            granted: None,
            effect: Effect::Issue { pem, approved },
        },
        Err(v) => {
            let decision = denial(&seen, v);
            Decided {
                seen,
                decision,
                granted: None,
                effect: if approved { Effect::Fail } else { Effect::None },
            }
        }
    }
}

/// Whether a request has a condition of `kind` (True).
fn has_condition(csr: &CertificateSigningRequest, kind: &str) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"))
}

/// Whether a request's certificate has been written.
fn has_certificate(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty())
}

/// The carrier an approved kubelet request answered, from its annotation (counted only for
/// requests hwkey approved as attested: another approver's approval marks nothing).
pub fn answered_carrier(csr: &CertificateSigningRequest) -> Option<&str> {
    let attested = csr
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == "Approved"
                    && c.reason.as_deref() == Some(Reason::AttestedTpmKey.as_str())
            })
        });
    if !attested {
        return None;
    }
    csr.metadata
        .annotations
        .as_ref()?
        .get(crate::pki::ek_join::ANNOTATION_CARRIER)
        .map(String::as_str)
}
