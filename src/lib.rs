//! hwkey keeps Kubernetes mTLS client keys inside a PKCS#11 token or a TPM 2.0 and still lets
//! kubectl and kubelet use them.
//!
//! Imports run one way, hardware up to the command line (docs/ARCHITECTURE.md, checked by
//! `hsm-fixtures/structure.py`): small base modules ([`state_dir`], [`endpoint`],
//! [`duration`], …) → the key layer ([`key`], PKCS#11 and TPM) → [`pki`] (requests,
//! certificates, TLS material, attestation) → what the exec plugin and the proxy share
//! ([`kubeconfig`], [`control_api`], the way out through forward proxies [`egress`]) → the exec plugin ([`exec`]) → the certificate lifecycle
//! ([`lifecycle`]) → the proxy ([`proxy`], [`probe`]) → the subcommands ([`cli`]), which
//! nothing imports.

#[cfg(not(any(feature = "pkcs11", feature = "tpm")))]
compile_error!(
    "hwkey needs at least one key backend: enable the `pkcs11` or `tpm` feature (both are default)"
);

#[cfg(feature = "tpm")]
pub mod approver;
pub mod atomic_file;
pub mod backoff;
pub mod cli;
pub mod control_api;
pub mod duration;
pub mod egress;
pub mod endpoint;
pub mod error_chain;
pub mod exec;
pub mod http_serve;
pub mod key;
pub mod kubeconfig;
pub mod lifecycle;
pub mod metric_labels;
pub mod pki;
pub mod probe;
pub mod proxy;
pub mod serde_text;
pub mod signer;
pub mod small_file;
pub mod state_dir;
pub mod stop;
