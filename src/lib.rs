//! hwkey keeps Kubernetes mTLS client keys inside a PKCS#11 token or a TPM 2.0 and still lets
//! kubectl and kubelet use them.
//!
//! Data flows one way: the CLI ([`cli`]) calls the PKI helpers ([`pki`]) and the probe client
//! ([`probe`]), which use the key layer ([`key`]), which talks to the hardware.

#[cfg(not(any(feature = "pkcs11", feature = "tpm")))]
compile_error!(
    "hwkey needs at least one key backend: enable the `pkcs11` or `tpm` feature (both are default)"
);

pub mod atomic_file;
pub mod cli;
pub mod control_api;
pub mod duration;
pub mod endpoint;
pub mod error_chain;
pub mod exec;
pub mod http_serve;
pub mod key;
pub mod kubeconfig;
pub mod lifecycle;
pub mod pki;
pub mod probe;
pub mod proxy;
pub mod small_file;
pub mod state_dir;
