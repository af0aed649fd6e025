//! The approver's errors: what could not be done, and what the operator can do about it. A
//! request's own faults are never errors here: they are denials with a [`super::Reason`].

use std::time::Duration;

use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER, SERVING_SIGNER};

/// Why the approver could not do something (start, read, write, lead).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum ApproverError {
    #[error("{0}")]
    Policy(#[from] NoPolicy),

    #[error("cannot record the decision on CertificateSigningRequest {name}: {source} (the approver's account needs `update` on certificatesigningrequests/approval and `approve` on the signer: see deploy/approver.yaml)")]
    Approve {
        name: String,
        #[source]
        source: kube::Error,
    },

    #[error("cannot list or watch CertificateSigningRequests: {source} (the approver's account needs get, list and watch on certificatesigningrequests)")]
    Watch {
        #[source]
        source: kube::runtime::watcher::Error,
    },

    #[error("{0}")]
    Trust(#[from] super::trust::TrustError),

    #[error("cannot record the binding of node '{node}' to its TPM: {source}")]
    Record {
        node: String,
        #[source]
        source: super::trust::RecordError,
    },

    #[error("cannot issue the credential of CertificateSigningRequest {name}: {source} (the approver's account needs `update` on certificatesigningrequests/status and `sign` on signer hwkey.dev/tpm-credential: see deploy/approver-ek.yaml)")]
    Issue {
        name: String,
        #[source]
        source: kube::Error,
    },

    #[error("cannot read Node {node} (or every Node's addresses) to check a serving request's names: {source} (the approver's account needs `get` and `list` on nodes: see deploy/approver-serving.yaml)")]
    ReadNode {
        node: String,
        #[source]
        source: kube::Error,
    },

    #[error("cannot make the carrier certificate: {0}")]
    Carrier(String),

    #[error("not writing a decision: this replica's Lease was last renewed {elapsed:?} ago, past the renew deadline ({deadline:?}); another replica may lead now")]
    LeaseExpired {
        elapsed: Duration,
        deadline: Duration,
    },

    #[error("leader election on Lease {namespace}/{name} failed: {source} (the approver's account needs get, create and update on leases in {namespace})")]
    Lease {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },

    #[error("leader election on Lease {namespace}/{name} failed: no answer from the API server within {bound:?}")]
    LeaseTimeout {
        namespace: String,
        name: String,
        bound: Duration,
    },

    #[error("{task} stopped unexpectedly: {source}")]
    Panicked {
        task: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },

    #[error("{count} request(s) could not be decided and stay open; the first: {first}")]
    Undecided {
        count: usize,
        first: Box<ApproverError>,
    },
}

/// An approver asked to decide for a signer hwkey has no policy for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hwkey has no approval policy for signer '{signer}': it approves only {} (node client certificates, checked like Kubernetes' ValidateKubeletClientCSR) and, with --people-trust or --people-trust-configmap, {} (people renewing their own identity) and, with --ek-ca and --credential-key, hwkey.dev/tpm-credential (TPMs joining by their EK certificate) and {} (a node's serving certificate for its own addresses); approving another signer's requests would issue identities no policy checked", KUBELET_SIGNER, CLIENT_SIGNER, SERVING_SIGNER)]
pub struct NoPolicy {
    /// The signer asked for (escaped).
    pub signer: String,
}
