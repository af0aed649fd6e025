//! What a policy's judgement leaves for the loop: [`Judged`] (ignore, deny, or settle later)
//! and [`Pending`] (the request as its policy read it), and what a settlement may consult and
//! change ([`Settling`]).

use crate::approver::ek_join::{CarrierCandidate, Carriers};
use crate::approver::evaluate::{Candidate, PersonCandidate, PersonProof, ServingCandidate};
use crate::approver::evidence_index::EvidenceIndex;
use crate::approver::reason::Violation;
use crate::approver::rules::Rules;
use crate::approver::trust::TrustKind;

/// What a request alone decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// Left to other approvers (no evidence, and told to ignore such requests).
    Ignore,
    /// Denied, whatever else holds.
    Deny(Violation),
    /// Passed every check of its own: the trust (and the cluster) settle the rest.
    Settle(Pending),
}

/// A request waiting to be settled, as its policy judged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pending {
    /// A node client request: approved if its node's AK is registered (or it answers a
    /// credential) and no better-ranked request holds its evidence.
    Node(Box<Candidate>),
    /// A person's request: approved if the people trust admits the requester and the proof.
    Person(Box<PersonCandidate>),
    /// A carrier request: issued if its EK certificate is trusted and the binding policy
    /// allows it; `true` when it is approved already and only its certificate is missing.
    Carrier(Box<CarrierCandidate>, bool),
    /// A serving request: approved if every name and address is the node's.
    Serving(Box<ServingCandidate>),
}

impl Pending {
    /// The trust source its settlement reads (when configured: a serving request settles
    /// without one).
    pub fn reads(&self) -> TrustKind {
        match self {
            Pending::Person(_) => TrustKind::People,
            Pending::Node(_) | Pending::Carrier(..) | Pending::Serving(_) => TrustKind::Nodes,
        }
    }

    /// The TPM evidence it would claim, to enter in the evidence index while it waits.
    pub fn evidence(&self) -> Option<&Candidate> {
        match self {
            Pending::Node(c) => Some(c),
            Pending::Person(p) => match &p.proof {
                PersonProof::Attested(c) => Some(c),
                _ => None,
            },
            Pending::Carrier(..) | Pending::Serving(_) => None,
        }
    }
}

/// What a settlement may consult and change besides the trust: the rules, the evidence index,
/// the carriers seen, and the approver's clock.
pub struct Settling<'a> {
    /// The rules beyond the signer's policy.
    pub rules: &'a Rules,
    /// Which request holds each piece of evidence.
    pub index: &'a mut EvidenceIndex,
    /// The carrier requests seen and answered.
    pub carriers: &'a mut Carriers,
    /// Now (Unix seconds).
    pub now: i64,
}
