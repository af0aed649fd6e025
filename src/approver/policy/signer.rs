//! Which policy decides each signer ([`SignerPolicy`]), what is configured for the optional
//! ones ([`Configured`]), and the dispatch: judge a request by its policy, settle it by its
//! policy.

use std::sync::Arc;

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;

use super::verdict::{Judged, Pending, Settling};
use super::{carrier, node_client, person, serving};
use crate::approver::decision::Decided;
use crate::approver::error::NoPolicy;
use crate::approver::evaluate::Seen;
use crate::approver::rules::Rules;
use crate::approver::trust::Registry;
use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER, SERVING_SIGNER};

/// The signers hwkey has an approval policy for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignerPolicy {
    /// `kubernetes.io/kube-apiserver-client-kubelet`: node client certificates
    /// ([`node_client`]).
    KubeletClient,
    /// `kubernetes.io/kube-apiserver-client`: people renewing their own identity
    /// ([`person`]), only when a people trust is configured.
    PersonClient,
    /// `hwkey.dev/tpm-credential`: carrier requests of TPMs joining by their EK certificate
    /// ([`carrier`]), only when a credential key is configured.
    TpmCredential,
    /// `kubernetes.io/kubelet-serving`: a node's serving certificate ([`serving`]), only when
    /// asked for.
    KubeletServing,
}

/// Which optional policies are configured (each needs its own settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Configured {
    /// A people trust (and its rules).
    pub people: bool,
    /// TPMs joining by their EK certificate.
    pub ek_join: bool,
    /// Kubelet serving certificates.
    pub serving: bool,
}

impl Configured {
    /// What `rules` configure.
    pub fn of(rules: &Rules) -> Configured {
        Configured {
            people: rules.people.is_some(),
            ek_join: rules.ek_join.is_some(),
            serving: rules.serving.is_some(),
        }
    }
}

impl SignerPolicy {
    /// The policy for `signer` with what is `configured`, or why the approver must not start
    /// for it.
    pub fn for_signer(signer: &str, configured: Configured) -> Result<SignerPolicy, NoPolicy> {
        let policy = match signer {
            KUBELET_SIGNER => Some(SignerPolicy::KubeletClient),
            CLIENT_SIGNER if configured.people => Some(SignerPolicy::PersonClient),
            crate::pki::ek_join::CREDENTIAL_SIGNER if configured.ek_join => {
                Some(SignerPolicy::TpmCredential)
            }
            SERVING_SIGNER if configured.serving => Some(SignerPolicy::KubeletServing),
            _ => None,
        };
        policy.ok_or_else(|| NoPolicy {
            signer: signer.escape_debug().to_string(),
        })
    }

    /// Judges an open request of this policy's signer by what it alone shows. `now` is the
    /// approver's clock (Unix seconds).
    pub fn judge(self, csr: &CertificateSigningRequest, rules: &Rules, now: i64) -> Judged {
        let judged = match self {
            SignerPolicy::KubeletClient => node_client::judge(csr, rules, now),
            SignerPolicy::PersonClient => person::judge(csr, rules, now),
            SignerPolicy::TpmCredential => carrier::judge(csr, rules, now),
            SignerPolicy::KubeletServing => serving::judge(csr, rules, now),
        };
        match judged {
            Ok(Some(pending)) => Judged::Settle(pending),
            Ok(None) => Judged::Ignore,
            Err(v) => Judged::Deny(v),
        }
    }
}

/// The decision for `pending`, with the `[nodes, people]` trusts as read (None: the one it
/// needs is not fresh, or not configured): None when it must wait for a reading.
pub fn settle(
    s: &mut Settling<'_>,
    seen: Box<Seen>,
    pending: Pending,
    [nodes, people]: [Option<&Arc<Registry>>; 2],
) -> Option<Decided> {
    Some(match pending {
        Pending::Node(candidate) => node_client::settle(s, seen, candidate, nodes?),
        Pending::Person(candidate) => person::settle(s, seen, *candidate, people?),
        Pending::Carrier(candidate, approved) => {
            carrier::settle(s, seen, &candidate, approved, nodes?)
        }
        Pending::Serving(candidate) => serving::settle(s, seen, *candidate, nodes.map(|n| &**n)),
    })
}

#[cfg(test)]
pub(in crate::approver) mod tests {
    use super::*;

    #[test]
    fn only_the_kubelet_client_signer_has_a_policy_without_a_people_trust() {
        assert_eq!(
            SignerPolicy::for_signer(
                "kubernetes.io/kube-apiserver-client-kubelet",
                Configured::default()
            ),
            Ok(SignerPolicy::KubeletClient)
        );
        assert_eq!(
            SignerPolicy::for_signer(
                "kubernetes.io/kube-apiserver-client",
                Configured {
                    people: true,
                    ..Configured::default()
                }
            ),
            Ok(SignerPolicy::PersonClient)
        );
        for other in [
            "kubernetes.io/kube-apiserver-client",
            "kubernetes.io/kubelet-serving",
            "example.com/anything",
        ] {
            let e = SignerPolicy::for_signer(other, Configured::default())
                .expect_err(other)
                .to_string();
            assert!(e.contains("no approval policy"), "{e}");
        }
    }

    /// A well-formed request (rcgen, a fresh key) for `subject`: shared with the people
    /// policy's tests.
    pub(in crate::approver) fn request(
        subject: &[(rcgen::DnType, &str)],
    ) -> crate::pki::request::Request {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            dn.push(t.clone(), *v);
        }
        params.distinguished_name = dn;
        let der = params
            .serialize_request(&key)
            .expect("request")
            .der()
            .to_vec();
        crate::pki::request::Request::from_der(der).expect("a well-formed request")
    }
}
