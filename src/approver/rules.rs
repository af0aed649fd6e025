//! The rules a decision applies beyond the signer's policy, and each optional policy's
//! settings: what the flags configure ([`super::settings`]) and the policies read.

use std::time::Duration;

use crate::pki::same_key::ClientCas;

pub use super::reason::OnMissingEvidence;

/// The rules a decision applies beyond the signer's policy.
#[derive(Debug, Clone)]
pub struct Rules {
    /// Requests without evidence: deny or leave alone.
    pub on_missing_evidence: OnMissingEvidence,
    /// Groups whose bootstrap identities (`system:bootstrap:*`) may ask for a node identity.
    pub bootstrap_groups: Vec<String>,
    /// How old evidence may be when its request is created.
    pub evidence_max_age: Duration,
    /// The people policy (`kubernetes.io/kube-apiserver-client`), when configured.
    pub people: Option<PeopleRules>,
    /// TPMs that join by their EK certificate (`hwkey.dev/tpm-credential`), when configured.
    pub ek_join: Option<std::sync::Arc<super::ek_join::JoinSettings>>,
    /// Kubelet serving certificates (`kubernetes.io/kubelet-serving`), when asked for.
    pub serving: Option<ServingRules>,
}

/// The people policy's settings.
#[derive(Debug, Clone)]
pub struct PeopleRules {
    /// The CA(s) of the cluster's client certificates: a current certificate must chain here.
    pub client_cas: ClientCas,
    /// The longest lifetime asked for (`spec.expirationSeconds`) that is approved.
    pub max_lifetime: Duration,
    /// Whether the API server knows `spec.expirationSeconds` (1.22 and later): then a request
    /// must ask for a lifetime within [`PeopleRules::max_lifetime`]. Shared with the task that
    /// reads the API server's version again ([`super::lifetime`]).
    pub expiration_known: crate::approver::lifetime::LifetimeSupport,
    /// The PIV attestation roots a YubiKey's chain must end at (Yubico's, as shipped, and
    /// `--piv-roots`).
    pub piv_roots: crate::pki::piv::PivRoots,
    /// Requests that carry no proof of the key (an administrator enrolling someone, a
    /// controller's own request): left to a human approver by default, since a denial is
    /// final and would block every enrolment.
    pub on_missing_proof: OnMissingEvidence,
}

/// The serving policy's settings.
#[derive(Debug, Clone, Default)]
pub struct ServingRules {
    /// The node must hold an attested client identity: its AK registered in the trust.
    pub require_attested_node: bool,
    /// The longest lifetime a request may ask for (`spec.expirationSeconds`); a request asking
    /// for none gets the signer's (`--cluster-signing-duration`).
    pub max_lifetime: Option<Duration>,
}
