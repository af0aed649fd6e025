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
//! - [`renew`] (`hwkey renew`) and [`bootstrap`] (`hwkey bootstrap`, kubelet TLS bootstrapping);
//!   [`ek_proof`]: a TPM proving itself by its EK certificate first (`--ek-proof`).
//!
//! Threads: the key is opened and the CSR signed on the calling thread, before any runtime
//! exists; the API calls run on a small multi-thread runtime (handshake signatures run under
//! `block_in_place`, see [`crate::key::tls`]).

pub mod bootstrap;
pub mod client;
pub mod context;
pub mod csr_api;
#[cfg(feature = "tpm")]
pub mod ek_proof;
pub mod error;
pub mod issued;
pub mod renew;
pub mod renewal_lock;

use std::time::Duration;

pub use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER};
pub use error::LifecycleError;
pub use renew::{default_signer, CLIENT_USAGES};

/// Default `--wait`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(15 * 60);
