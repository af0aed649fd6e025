//! The TLS-offload proxy: who may use it (local_auth), the upstream side (transport, foreign,
//! resumption, rotation, CA rotation, several API servers, post-quantum key exchange, the forward
//! proxy and NO_PROXY as Go decides it, connections made ahead), operating it (operations, metrics, state directory), a stalled TPM, what a connection
//! costs (efficiency, new_connections), parsers under random input (fuzz), and stress.

#[cfg(feature = "pkcs11")]
mod boundary;
#[cfg(feature = "pkcs11")]
mod ca_rotation;
mod efficiency;
mod foreign;
#[cfg(feature = "pkcs11")]
mod forward_proxy;
#[cfg(feature = "pkcs11")]
mod fuzz;
mod local_auth;
#[cfg(feature = "pkcs11")]
mod metrics;
#[cfg(feature = "pkcs11")]
mod new_connections;
#[cfg(feature = "pkcs11")]
mod no_proxy_oracle;
mod operations;
#[cfg(feature = "pkcs11")]
mod pq_kx;
#[cfg(feature = "pkcs11")]
mod preconnect;
mod resumption;
#[cfg(feature = "pkcs11")]
mod rotation;
#[cfg(feature = "pkcs11")]
mod sandbox;
#[cfg(feature = "pkcs11")]
mod several_apiservers;
mod signer;
#[cfg(feature = "pkcs11")]
mod state_dir;
mod stress;
#[cfg(feature = "tpm")]
mod tpm_stall;
mod transport;
