//! The lifecycle's errors, each saying what happened to the installed certificate.

use std::path::PathBuf;
use std::time::Duration;

use super::{client, context, issued, renew};
use crate::key::KeyError;
use crate::pki::PkiError;

/// Errors of the lifecycle, each saying what happened to the installed certificate.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum LifecycleError {
    #[error("{0}")]
    RenewalLock(#[from] super::renewal_lock::RenewalLockError),

    #[error("invalid API server URL '{url}': {problem} (example: https://10.0.0.1:6443)")]
    InvalidServer { url: String, problem: &'static str },

    #[error("cannot set up the connection to {server}: {problem}")]
    Client {
        server: String,
        #[source]
        problem: client::ClientProblem,
    },

    #[error("cannot read kubeconfig {path}: {problem}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        problem: context::KubeconfigProblem,
    },

    #[error(
        "the API server {server} refused to create the CertificateSigningRequest: {source}{hint}"
    )]
    Create {
        server: String,
        #[source]
        source: kube::Error,
        hint: &'static str,
    },

    #[error("the API server {server} created the CertificateSigningRequest but answered without its name")]
    Unnamed { server: String },

    #[error("CertificateSigningRequest {name} was denied ({reason}): {message}; the current certificate was left as it was")]
    Denied {
        name: String,
        reason: String,
        message: String,
    },

    #[error("CertificateSigningRequest {name} failed ({reason}): {message}; the current certificate was left as it was")]
    Failed {
        name: String,
        reason: String,
        message: String,
    },

    #[error("CertificateSigningRequest {name} was not issued within {waited:?}: an administrator approves it with `kubectl certificate approve {name}` (or pass a longer --wait); the current certificate was left as it was")]
    Timeout { name: String, waited: Duration },

    #[error("watching CertificateSigningRequest {name} failed: {source}; the current certificate was left as it was")]
    Watch {
        name: String,
        #[source]
        source: kube::Error,
    },

    #[error("watching CertificateSigningRequest {name} failed: it was deleted before it was issued; the current certificate was left as it was")]
    Deleted { name: String },

    #[error("the certificate issued for CertificateSigningRequest {name} is not usable: {problem}; the current certificate was left as it was")]
    BadIssued {
        name: String,
        #[source]
        problem: issued::IssuedProblem,
    },

    #[error("the signer issued a certificate that expires no later than the one in use (NotAfter {issued}, in use until {current}): it caps certificate lifetimes (kube-controller-manager caps them at its CA's expiry); the current certificate stays, and renewal retries with backoff")]
    NotLonger { issued: String, current: String },

    #[error("the API server refused the renewed certificate in a handshake ({source}); the previous certificate was put back")]
    RefusedUpstream {
        #[source]
        source: crate::key::Cause,
    },

    #[error("cannot copy the subject of the current certificate ({problem}): pass --subject")]
    Subject {
        #[source]
        problem: renew::SubjectProblem,
    },

    #[error("cannot install the certificate at {path}: {source}; the current certificate was left as it was")]
    Install {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{0}")]
    Kubelet(String),

    #[error("the TPM's EK proof: {0}")]
    EkProof(String),

    #[error("{task} panicked: {source}")]
    Panicked {
        task: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },

    #[error("cannot write the kubelet kubeconfig: {0}")]
    KubeletKubeconfig(#[source] crate::kubeconfig::KubeconfigError),

    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),

    #[error("{0}")]
    Key(#[from] KeyError),

    #[error("{0}")]
    Pki(#[from] PkiError),
}
