//! The certificate lifecycle: a hardware identity never expires in place.
//!
//! A key in hardware lives for years; its client certificate does not. This module renews it the
//! way kubelet's certificate manager renews software keys, but with the key in the device: a
//! PKCS#10 request signed *inside* the PKCS#11 token or TPM ([`crate::pki::csr`]), submitted as a
//! `certificates.k8s.io/v1` CertificateSigningRequest, watched until it is issued (or denied),
//! then checked (it must hold the hardware public key and be valid now) and installed atomically
//! where the proxy reads it.
//!
//! - [`client`]: a `kube` client whose TLS client certificate is signed by the hardware key
//!   (hyper-rustls with hwkey's own rustls `ClientConfig`), or that authenticates with a
//!   bootstrap token from a kubeconfig.
//! - [`csr_api`]: create the CertificateSigningRequest and wait for its outcome.
//! - [`issued`]: check and install what was issued, keeping the previous certificate.
//! - [`renew`] (`hwkey renew`) and [`bootstrap`] (`hwkey bootstrap`, kubelet TLS bootstrapping).
//!
//! Threads: the key is opened and the CSR signed on the calling thread, before any runtime
//! exists; the API calls run on a small multi-thread runtime (handshake signatures run under
//! `block_in_place`, see [`crate::key::tls`]).

pub mod bootstrap;
pub mod client;
pub mod context;
pub mod csr_api;
pub mod issued;
pub mod renew;

use std::path::PathBuf;
use std::time::Duration;

use crate::key::KeyError;
use crate::pki::PkiError;

/// The usages of a client-certificate request. kube-controller-manager 1.20's auto-approver
/// accepts a kubelet client CSR only with exactly these three (EC keys included); newer servers
/// also accept it without key encipherment.
pub const CLIENT_USAGES: [&str; 3] = ["digital signature", "key encipherment", "client auth"];

pub use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER};

/// Default `--wait`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(15 * 60);

/// Errors of the lifecycle, each saying what happened to the installed certificate.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum LifecycleError {
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

    #[error(transparent)]
    Key(#[from] KeyError),

    #[error(transparent)]
    Pki(#[from] PkiError),
}

/// The signer for a subject: kubelet's when it is a node identity (`CN=system:node:NAME`,
/// `O=system:nodes`), the generic client signer otherwise.
pub fn default_signer(common_name: &str, organizations: &[String]) -> &'static str {
    if common_name.starts_with("system:node:") && organizations.iter().any(|o| o == "system:nodes")
    {
        KUBELET_SIGNER
    } else {
        CLIENT_SIGNER
    }
}

/// A multi-thread runtime for the API calls (block_in_place needs one).
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, LifecycleError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(LifecycleError::Runtime)
}
