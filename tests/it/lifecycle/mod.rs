//! The certificate lifecycle on a real kube-apiserver + kube-controller-manager: renewal and
//! bootstrap, and renewal when things fail. `kit` holds what the approver's tests share.

pub(crate) mod kit;
mod renew_and_bootstrap;
#[cfg(feature = "pkcs11")]
mod renewal_faults;
