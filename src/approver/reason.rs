//! Why a request was approved or denied ([`Reason`]: the condition's `reason` and a metric
//! label) and what did not hold ([`Violation`]), shared by every policy and by what records
//! their decisions.

use crate::label_values;
use crate::metric_labels::LabelValue;
use crate::pki::request::Malformed;

label_values! {
    /// Why a request was approved or denied: the condition's `reason`, and a metric label.
    pub enum Reason {
        /// Approved: the key is in the TPM registered for the node (or person) it asks to be.
        AttestedTpmKey => "AttestedTPMKey",
        /// Approved: a person's key is in a YubiKey registered for them (PIV attestation).
        AttestedPivKey => "AttestedPIVKey",
        /// Approved: a person renews with the key of the certificate they hold now.
        SameKeyRenewal => "SameKeyRenewal",
        /// A person renews with their current certificate alone (possession, not hardware)
        /// and the allow list does not name them under `certificateOnly`.
        HardwareProofRequired => "HardwareProofRequired",
        /// A person's request asks for no lifetime, or a longer one than allowed.
        LifetimeNotAllowed => "LifetimeNotAllowed",
        /// `spec.request` is not exactly one well-formed CERTIFICATE REQUEST (or is too large).
        MalformedRequest => "MalformedRequest",
        /// The subject is not exactly `CN=system:node:NODE, O=system:nodes`.
        SubjectNotAllowed => "SubjectNotAllowed",
        /// The request names a subject alternative name its kind of certificate has none of
        /// (any for a client; an e-mail, URI, wildcard or other for a serving certificate), or
        /// a serving request names none.
        SubjectAltNameNotAllowed => "SubjectAltNameNotAllowed",
        /// `spec.usages` (or a requested key usage) is not a node client's.
        UsagesNotAllowed => "UsagesNotAllowed",
        /// A requested extension or request attribute outside the policy.
        ExtensionNotAllowed => "ExtensionNotAllowed",
        /// The requester may not ask for this node (not the node, not an allowed bootstrap
        /// group).
        RequesterNotAllowed => "RequesterNotAllowed",
        /// The request carries no TPM evidence.
        NoEvidence => "NoEvidence",
        /// The evidence (or the request's own signature) does not hold.
        EvidenceInvalid => "EvidenceInvalid",
        /// The evidence was made outside the window around the request's creation, or the
        /// request waited longer than the window.
        EvidenceStale => "EvidenceStale",
        /// The same evidence is in another request that holds it.
        EvidenceReused => "EvidenceReused",
        /// The evidence's AK is not registered.
        UnknownAttestationKey => "UnknownAttestationKey",
        /// The evidence's AK is registered, for another node.
        SubjectMismatch => "SubjectMismatch",
        /// Issued (a carrier request): the TPM's EK certificate chains to a manufacturer CA
        /// and the binding policy allows it; the credential is in the carrier certificate.
        EkCertificateVerified => "EKCertificateVerified",
        /// A carrier request's EK certificate does not chain to a trusted manufacturer CA, is
        /// revoked or expired, is not an EK certificate, or is for another key.
        EkCertificateUntrusted => "EKCertificateUntrusted",
        /// The binding policy's allow list does not name this TPM for this node.
        TpmNotAllowed => "TPMNotAllowed",
        /// This TPM holds another node name already.
        TpmBoundToAnotherNode => "TPMBoundToAnotherNode",
        /// This node name is held by another TPM (or by an operator's registration).
        NodeBoundToAnotherTpm => "NodeBoundToAnotherTPM",
        /// The answer to a credential is wrong, or its carrier is not this request's.
        CredentialInvalid => "CredentialInvalid",
        /// The credential's answer came after it expired.
        CredentialExpired => "CredentialExpired",
        /// The credential was answered already, by another request.
        CredentialReplayed => "CredentialReplayed",
        /// Approved (a serving certificate): every DNS name and IP address asked for is one
        /// of the node's own.
        NodeAddressesVerified => "NodeAddressesVerified",
        /// A serving request names a DNS name or IP address that is not the node's.
        SubjectAltNameNotOwned => "SubjectAltNameNotOwned",
        /// A serving request's node does not exist (deleted while the request waited).
        NodeNotFound => "NodeNotFound",
        /// A serving request's node holds no attested client identity, and the approver
        /// requires one.
        NodeNotAttested => "NodeNotAttested",
    }
}

impl Reason {
    /// Whether this reason approves.
    pub fn approves(self) -> bool {
        matches!(
            self,
            Reason::AttestedTpmKey
                | Reason::AttestedPivKey
                | Reason::SameKeyRenewal
                | Reason::EkCertificateVerified
                | Reason::NodeAddressesVerified
        )
    }

    /// The reason for an evidence refusal.
    pub fn of(refusal: crate::pki::attestation::Refusal) -> Reason {
        use crate::pki::attestation::Refusal;
        match refusal {
            Refusal::NoEvidence => Reason::NoEvidence,
            Refusal::EvidenceInvalid => Reason::EvidenceInvalid,
            Refusal::UnknownAttestationKey => Reason::UnknownAttestationKey,
            Refusal::SubjectMismatch => Reason::SubjectMismatch,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with a request that carries no evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnMissingEvidence {
    /// Deny it (`NoEvidence`): only attested keys get in.
    #[default]
    Deny,
    /// Leave it to other approvers.
    Ignore,
}

/// A request the policy refuses: the reason and exactly what did not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Violation {
    /// The condition reason.
    pub reason: Reason,
    /// What did not hold.
    pub message: String,
}

/// A violation of `reason` saying `message`.
pub fn violation(reason: Reason, message: impl Into<String>) -> Violation {
    Violation {
        reason,
        message: message.into(),
    }
}

impl From<Malformed> for Violation {
    fn from(m: Malformed) -> Violation {
        violation(Reason::MalformedRequest, m.to_string())
    }
}

/// At most 64 characters of an attacker-chosen value, escaped, for a condition message or a log.
pub fn bounded(value: &str) -> String {
    let escaped = value.escape_debug().to_string();
    match escaped.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &escaped[..at]),
        None => escaped,
    }
}

/// Up to four values, bounded, for a message.
pub fn bounded_list(values: &[&str]) -> String {
    let shown: Vec<String> = values.iter().take(4).map(|v| bounded(v)).collect();
    format!(
        "[{}{}]",
        shown.join(", "),
        if values.len() > 4 { ", …" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_listed_once() {
        let mut names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len());
    }
}
