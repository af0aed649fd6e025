//! The attesting approver on a real kube-apiserver + kube-controller-manager: replicas and
//! leadership, round one's attacks, round two's attacks, people's self-renewal (issue 36),
//! zero-touch nodes, kubelet serving certificates, recovery from an etcd restore, and the
//! request reader against Go's crypto/x509 (oracle). `kit` holds what they (and the image
//! test) share.

mod attacks;
mod cert_oracle;
pub(crate) mod kit;
mod oracle;
mod people;
#[cfg(feature = "pkcs11")]
mod people_piv;
mod replicas;
mod restore;
mod round_two;
mod san_oracle;
mod serving;
mod zero_touch;
