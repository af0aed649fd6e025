//! hwkey's integration tests: one test binary (linking the library, the fixtures and the test
//! code once instead of once per file), one module per area.
//!
//! Each test drives real parts: SoftHSMv2 tokens, swtpm simulators, openssl, curl, nginx,
//! kubectl and a real kube-apiserver; fixtures come from the `hwkey-test-support` crate
//! (imported as `support`). Modules that need a backend are compiled only with its Cargo
//! feature, so `--no-default-features --features pkcs11` (or `tpm`) runs that build's tests.

#[cfg(feature = "tpm")]
mod approver;
#[cfg(feature = "tpm")]
mod approver_attacks;
#[cfg(feature = "tpm")]
mod approver_round_two;
// The package and the image are built with both backends (hsm-fixtures/package.sh).
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod approver_image;
#[cfg(feature = "tpm")]
mod attestation;
mod build_features;
#[cfg(feature = "pkcs11")]
mod ca_rotation;
#[cfg(feature = "pkcs11")]
mod cert_import;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod clean_root;
#[cfg(feature = "tpm")]
mod csr_oracle;
#[cfg(feature = "pkcs11")]
mod deploy;
mod faults;
mod fixtures;
#[cfg(feature = "pkcs11")]
mod forward_proxy;
#[cfg(feature = "pkcs11")]
mod fuzz_props;
#[cfg(feature = "pkcs11")]
mod hardening;
mod key_contract;
mod key_policy;
#[cfg(feature = "pkcs11")]
mod kubeconfig_merge;
mod kubectl_e2e;
mod lifecycle;
#[cfg(feature = "pkcs11")]
mod metrics;
#[cfg(feature = "pkcs11")]
mod p11kit;
#[cfg(feature = "pkcs11")]
mod pin_always;
#[cfg(feature = "pkcs11")]
mod pin_safety;
#[cfg(feature = "pkcs11")]
mod pkcs11_cli;
#[cfg(feature = "pkcs11")]
mod pkcs11_key;
#[cfg(feature = "pkcs11")]
mod pq_kx;
mod proxy_foreign;
mod proxy_local_auth;
mod proxy_operations;
mod proxy_resumption;
#[cfg(feature = "pkcs11")]
mod proxy_rotation;
#[cfg(feature = "pkcs11")]
mod proxy_stress;
#[cfg(feature = "tpm")]
mod proxy_tpm_stall;
mod proxy_transport;
#[cfg(feature = "pkcs11")]
mod renewal_faults;
#[cfg(feature = "pkcs11")]
mod rsa_mechanisms;
#[cfg(feature = "pkcs11")]
mod several_apiservers;
#[cfg(feature = "tpm")]
mod shared_tpm;
#[cfg(all(feature = "pkcs11", feature = "tpm"))]
mod shipping;
#[cfg(feature = "pkcs11")]
mod state_dir;
#[cfg(feature = "pkcs11")]
mod tpm2_pkcs11;
#[cfg(feature = "tpm")]
mod tpm_cli;
#[cfg(feature = "tpm")]
mod tpm_hierarchy;
#[cfg(feature = "tpm")]
mod tpm_key;
#[cfg(feature = "tpm")]
mod tpm_password;
