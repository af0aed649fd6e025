//! A decision as the policies make it and the loop writes it: the condition, and what else the
//! write carries (a certificate, a binding, a Failed condition).

use super::ek_join::Binding;
use super::evaluate::{Candidate, Seen};
use super::reason::{Reason, Violation};

/// One decision, as written.
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

/// What a decision writes besides its condition.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Nothing.
    None,
    /// The carrier certificate, as `status.certificate` (after the approval, unless the
    /// request is approved already).
    Issue {
        /// The carrier certificate.
        pem: String,
        /// Whether the request is approved already.
        approved: bool,
    },
    /// The binding, in the trust ConfigMap, before the approval.
    Record(Box<Binding>),
    /// A Failed condition instead of a denial: the request is approved already (its
    /// certificate's write failed, and it can no longer be issued).
    Fail,
    /// The approval holds only if every name is one of the Node's addresses as the API server
    /// holds them when the decision is written (else it is a denial).
    NodeAddresses(Box<NodeCheck>),
}

/// A decision made: the request, the decision, the evidence it claimed and what else to write.
pub struct Decided {
    /// The request as read.
    pub seen: Box<Seen>,
    /// The condition to write.
    pub decision: Decision,
    /// The evidence it claimed (given back if the write does not happen).
    pub granted: Option<Box<Candidate>>,
    /// What else to write.
    pub effect: Effect,
}

impl Decided {
    /// A denial that writes nothing else.
    pub fn denied(seen: Box<Seen>, v: Violation) -> Decided {
        let decision = denial(&seen, v);
        Decided {
            seen,
            decision,
            granted: None,
            effect: Effect::None,
        }
    }
}

/// The decision that writes a denial.
pub fn denial(seen: &Seen, v: Violation) -> Decision {
    Decision::denied(&seen.name, v)
}

impl Decision {
    /// The denial of request `name` for `v`.
    pub fn denied(name: &str, v: Violation) -> Decision {
        Decision {
            name: name.to_string(),
            approved: false,
            reason: v.reason,
            message: v.message,
        }
    }
}

/// The names to check against a Node's status when the decision is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCheck {
    /// N.
    pub node: String,
    /// The names asked for.
    pub names: crate::pki::san::Names,
    /// What proves the node's hardware, for the approval's message.
    pub proof: String,
}
