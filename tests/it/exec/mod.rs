//! The exec credential front end as client-go runs it: kubectl end to end, kubeconfig merging,
//! and a token that asks for its PIN on every login.

#[cfg(feature = "pkcs11")]
mod kubeconfig_merge;
mod kubectl;
#[cfg(feature = "pkcs11")]
mod pin_always;
