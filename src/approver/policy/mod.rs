//! What hwkey approves, per signer: one module per policy, each reading the request once
//! (the strict reading of `spec.request`, the same bytes Go signs from), deciding, and
//! returning a typed [`Reason`]. The loop ([`super::controller`]) knows only [`SignerPolicy`],
//! [`Judged`] and [`Pending`]; it never looks inside a verdict.
//!
//! - [`node_client`]: `kubernetes.io/kube-apiserver-client-kubelet`, node client certificates
//!   proven by TPM evidence (or by a credential answered, for a TPM that joined by its EK).
//! - [`person`]: `kubernetes.io/kube-apiserver-client`, people renewing their own identity.
//! - [`carrier`]: `hwkey.dev/tpm-credential`, TPMs joining by their EK certificate.
//! - [`serving`]: `kubernetes.io/kubelet-serving`, a node's serving certificate for its own
//!   names and addresses.
//! - [`strict`]: the rules every policy shares (subject, attributes, extensions).
//! - [`signer`]: which policy decides which signer, and the dispatch; [`verdict`]: what a
//!   judgement leaves for the loop.
//!
//! An approver started for any other signer refuses to start: approving what a policy does not
//! describe would issue identities nobody checked (a `kube-apiserver-client` certificate can
//! be `system:kube-controller-manager`).

pub mod carrier;
pub mod node_client;
pub mod person;
pub mod serving;
pub mod signer;
pub mod strict;
pub mod verdict;

pub use self::node_client::{check_node_client, NodeIdentity};
pub use self::signer::{settle, Configured, SignerPolicy};
pub use self::strict::check_usages;
pub use self::verdict::{Judged, Pending, Settling};
pub use crate::approver::error::NoPolicy;
pub use crate::approver::reason::{bounded, bounded_list, OnMissingEvidence, Reason, Violation};
