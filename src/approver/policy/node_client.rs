//! `kubernetes.io/kube-apiserver-client-kubelet`: a node's client certificate, checked like
//! Kubernetes' `ValidateKubeletClientCSR` and stricter (exactly one CN `system:node:NODE`, O
//! exactly `[system:nodes]`, no other subject attribute, no SAN, usages {digital signature,
//! client auth} plus key encipherment at most), then proven: fresh TPM evidence by an AK
//! registered for the node, used once; or, for a TPM that joined by its EK certificate, the
//! answer to the credential its carrier request was issued.

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;

use super::strict::{self, Purpose};
use super::verdict::{Pending, Settling};
use crate::approver::decision::{Decided, Decision, Effect};
use crate::approver::ek_join::{Binding, Join};
use crate::approver::evaluate::{self, Candidate, OnMissingEvidence, Seen};
use crate::approver::evidence_index::Claim;
use crate::approver::reason::{bounded, bounded_list};
use crate::approver::reason::{violation, Reason, Violation};
use crate::approver::trust::Registry;
use crate::pki::attestation;
use crate::pki::request::Request;

/// The node a request that satisfies the node policy asks to be (NODE of
/// `CN=system:node:NODE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The node's name.
    pub node: String,
}

/// Checks a node client request: its subject, SANs, requested extensions and attributes, and
/// `usages` (`spec.usages`; None for a bare request file, which has none).
pub fn check_node_client(
    request: &Request,
    usages: Option<&[String]>,
) -> Result<NodeIdentity, Violation> {
    let node = check_node_subject(request)?;
    strict::check_attributes(request)?;
    strict::check_extensions(request, Purpose::Client)?;
    if let Some(usages) = usages {
        strict::check_usages(usages, Purpose::Client)?;
    }
    Ok(NodeIdentity { node })
}

/// Exactly one CN `system:node:NODE`, O exactly `[system:nodes]`, nothing else (the reader
/// already refused empty and multi-valued RDNs and other string types).
pub fn check_node_subject(request: &Request) -> Result<String, Violation> {
    let refuse = |m: String| violation(Reason::SubjectNotAllowed, m);
    let (cn, orgs) = strict::cn_and_o(request, "a node's")?;
    if orgs != ["system:nodes"] {
        return Err(refuse(format!(
            "O must be exactly [system:nodes], not {}",
            bounded_list(&orgs)
        )));
    }
    cn.strip_prefix("system:node:")
        .filter(|n| crate::pki::registration::check_node_name(n).is_ok())
        .map(str::to_string)
        .ok_or_else(|| {
            refuse(format!(
                "CN '{}' is not system:node:NODE with a node name",
                bounded(cn)
            ))
        })
}

/// Judges a node client request by itself: the policy, then a requester entitled to the node
/// and fresh evidence ([`evaluate::attested_node`]); the credential it answers, if any.
pub fn judge(
    csr: &CertificateSigningRequest,
    rules: &evaluate::Rules,
    now: i64,
) -> Result<Option<Pending>, Violation> {
    let request = Request::from_pem(&csr.spec.request.0)?;
    if request.attributes_of(attestation::OID_EVIDENCE).is_empty()
        && rules.on_missing_evidence == OnMissingEvidence::Ignore
    {
        return Ok(None);
    }
    let usages = csr.spec.usages.clone().unwrap_or_default();
    let identity = check_node_client(&request, Some(&usages))?;
    let mut candidate = evaluate::attested_node(csr, &request, identity.node, rules, now)?;
    if rules.ek_join.is_some() {
        candidate.claim = crate::approver::ek_join::claim_of(csr)?;
    }
    Ok(Some(Pending::Node(Box::new(candidate))))
}

/// The decision for a node's request: by the credential it answers, or by its AK registered
/// for the node.
pub fn settle(
    s: &mut Settling<'_>,
    seen: Box<Seen>,
    candidate: Box<Candidate>,
    nodes: &Registry,
) -> Decided {
    if candidate.claim.is_some() {
        return settle_answer(s, seen, candidate, nodes);
    }
    let (decision, granted) = settle_attested(s, &seen, candidate, &nodes.aks, "node");
    Decided {
        seen,
        decision,
        granted,
        effect: Effect::None,
    }
}

/// The decision for a request that passed every check of its own: still fresh, its AK
/// registered for its node, and the evidence its own (see [`crate::approver::evidence_index::EvidenceIndex`]).
pub fn settle_attested(
    s: &mut Settling<'_>,
    seen: &Seen,
    candidate: Box<Candidate>,
    nodes: &[crate::pki::registration::RegisteredAk],
    what: &str,
) -> (Decision, Option<Box<Candidate>>) {
    let deny = |reason: Reason, message: String| Decision {
        name: seen.name.clone(),
        approved: false,
        reason,
        message,
    };
    let digest = candidate.attested.evidence_digest;
    let lifetime = evaluate::evidence_lifetime(s.rules.evidence_max_age);
    let age = s
        .now
        .saturating_sub(i64::try_from(candidate.attested.made_at).unwrap_or(0));
    if age > lifetime {
        s.index.forget(&digest, &seen.uid);
        return (deny(Reason::EvidenceStale, format!("the evidence is {age} s old now (at most {lifetime} s): the request waited too long for a decision; make a new request on the node")), None);
    }
    let admitted =
        match attestation::admit_as(candidate.attested.clone(), &candidate.node, nodes, what) {
            Ok(a) => a,
            Err(r) => {
                s.index.forget(&digest, &seen.uid);
                return (deny(Reason::of(r.refusal), r.message), None);
            }
        };
    match s.index.claim(&digest, &seen.uid) {
        Claim::HeldBy(other) => {
            s.index.forget(&digest, &seen.uid);
            (
                deny(
                    Reason::EvidenceReused,
                    format!("the same TPM evidence is in request {other}, which holds it: evidence is used once"),
                ),
                None,
            )
        }
        Claim::Granted => (
            Decision {
                name: seen.name.clone(),
                approved: true,
                reason: Reason::AttestedTpmKey,
                message: format!(
                    "the key is in the TPM of {what} '{}' (attestation key {})",
                    admitted.node, admitted.ak_name
                ),
            },
            Some(candidate),
        ),
    }
}

/// The binding a request's answer earns, or why it earns none.
fn answer_of(
    s: &Settling<'_>,
    seen: &Seen,
    candidate: &Candidate,
    nodes: &Registry,
) -> Result<Binding, Violation> {
    let (Some(settings), Some(claim)) = (s.rules.ek_join.as_deref(), &candidate.claim) else {
        return Err(violation(
            Reason::CredentialInvalid,
            "no credential is answered",
        ));
    };
    let join = Join {
        settings,
        held: crate::approver::binding::Held {
            nodes: &nodes.aks,
            invalid: &nodes.invalid,
        },
        ek: &nodes.ek,
    };
    join.answer(
        s.carriers,
        claim,
        &candidate.node,
        &candidate.attested.ak_name,
        &seen.requester,
        s.now,
    )
}

/// A kubelet request that answers a credential: judged by its answer (never by a
/// registration alone), then like any attested request (fresh, the evidence its own).
fn settle_answer(
    s: &mut Settling<'_>,
    seen: Box<Seen>,
    candidate: Box<Candidate>,
    nodes: &Registry,
) -> Decided {
    let binding = match answer_of(s, &seen, &candidate, nodes) {
        Ok(b) => b,
        Err(v) => {
            s.index
                .forget(&candidate.attested.evidence_digest, &seen.uid);
            return Decided::denied(seen, v);
        }
    };
    // The AK is trusted for this node from this answer on: settle as a registered one.
    let registered = [crate::pki::registration::RegisteredAk {
        node: candidate.node.clone(),
        ak_name: candidate.attested.ak_name.clone(),
        ek_sha256: Some(binding.ek_sha256.clone()),
        addresses: None,
    }];
    let (mut decision, granted) = settle_attested(s, &seen, candidate, &registered, "node");
    let effect = if decision.approved {
        decision.message = format!(
            "{}; the TPM (EK {}) answered the credential of carrier request {}, and the node is bound to it",
            decision.message, binding.ek_sha256, binding.carrier
        );
        s.carriers.answered_by(&binding.carrier, &seen.name, s.now);
        Effect::Record(Box::new(binding))
    } else {
        Effect::None
    };
    Decided {
        seen,
        decision,
        granted,
        effect,
    }
}

#[cfg(test)]
mod tests {
    use yasna::models::ObjectIdentifier;

    use super::super::signer::tests::request;
    use super::*;
    use crate::pki::request::{OID_EXTENSION_REQUEST, OID_EXT_KEY_USAGE, OID_SUBJECT_ALT_NAME};

    #[test]
    fn usages_are_a_node_clients() {
        let u = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let check_usages = |u: &[String]| strict::check_usages(u, Purpose::Client);
        assert!(check_usages(&u(&["digital signature", "client auth"])).is_ok());
        assert!(check_usages(&u(&[
            "client auth",
            "key encipherment",
            "digital signature"
        ]))
        .is_ok());
        for bad in [
            &["digital signature", "client auth", "server auth"][..],
            &["client auth"],
            &["digital signature", "client auth", "client auth"],
            &[],
        ] {
            assert_eq!(
                check_usages(&u(bad)).map_err(|v| v.reason),
                Err(Reason::UsagesNotAllowed),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_node_subject_passes_and_others_are_refused_with_bounded_messages() {
        use rcgen::DnType::*;
        let ok = request(&[
            (OrganizationName, "system:nodes"),
            (CommonName, "system:node:node-a"),
        ]);
        let checked = check_node_client(&ok, None).expect("a node's request");
        assert_eq!(checked.node, "node-a");
        let long = format!("system:node:{}\u{1b}[2J", "a".repeat(10_000));
        for (subject, want) in [
            (
                vec![(CommonName, "system:node:node-a")],
                "O must be exactly",
            ),
            (
                vec![
                    (OrganizationName, "system:masters"),
                    (CommonName, "system:node:node-a"),
                ],
                "O must be exactly",
            ),
            (
                vec![
                    (OrganizationName, "system:nodes"),
                    (CommonName, long.as_str()),
                ],
                "is not system:node:NODE",
            ),
            (
                vec![
                    (OrganizationName, "system:nodes"),
                    (OrganizationalUnitName, "x, CN=system:node:node-a"),
                    (CommonName, "system:node:node-b"),
                ],
                "CN and O only",
            ),
            (vec![(OrganizationName, "system:nodes")], "exactly one CN"),
        ] {
            let v = check_node_client(&request(&subject), None).expect_err(want);
            assert_eq!(v.reason, Reason::SubjectNotAllowed);
            assert!(v.message.contains(want), "{v}");
            assert!(
                v.message.len() < 400 && !v.message.contains('\u{1b}'),
                "{v}"
            );
        }
    }

    /// A request (unsigned: the policy reads structure, the evidence check verifies) for a
    /// node's subject with these attributes, each (type, DER of one value).
    fn request_with(attributes: &[(&[u64], Vec<u8>)]) -> Request {
        let subject = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in [
                    (&[2u64, 5, 4, 10][..], "system:nodes"),
                    (&[2, 5, 4, 3], "system:node:node-a"),
                ] {
                    w.next().write_set(|w| {
                        w.next().write_sequence(|w| {
                            w.next().write_oid(&ObjectIdentifier::from_slice(oid));
                            w.next().write_utf8_string(value);
                        })
                    });
                }
            })
        });
        let key = rcgen::KeyPair::generate().expect("key");
        let info = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_u8(0);
                w.next().write_der(&subject);
                let spki = pem::parse(key.public_key_pem()).expect("SPKI PEM");
                w.next().write_der(spki.contents());
                w.next().write_tagged_implicit(yasna::Tag::context(0), |w| {
                    w.write_set_of(|w| {
                        for (oid, value) in attributes {
                            w.next().write_sequence(|w| {
                                w.next().write_oid(&ObjectIdentifier::from_slice(oid));
                                w.next().write_set(|w| w.next().write_der(value));
                            });
                        }
                    })
                });
            })
        });
        let der = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&info);
                w.next().write_sequence(|w| {
                    w.next()
                        .write_oid(&ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 4, 3, 2]))
                });
                w.next().write_bitvec_bytes(&[0u8; 8], 64);
            })
        });
        Request::from_der(der).expect("a well-formed request")
    }

    /// Extensions (type, value DER) as one extension request's value.
    fn extensions(list: &[(&[u64], Vec<u8>)]) -> Vec<u8> {
        yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in list {
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&ObjectIdentifier::from_slice(oid));
                        w.next().write_bytes(value);
                    });
                }
            })
        })
    }

    /// A serving request may name SANs, once: a second SAN extension (Go keeps the last) or
    /// a SAN in a second extension request is refused, whatever the first one says.
    #[test]
    fn a_serving_requests_names_are_read_from_exactly_one_extension() {
        let san = |name: &str| {
            yasna::construct_der(|w| {
                w.write_sequence(|w| {
                    w.next()
                        .write_tagged_implicit(yasna::Tag::context(2), |w| w.write_ia5_string(name))
                })
            })
        };
        let one = request_with(&[(
            OID_EXTENSION_REQUEST,
            extensions(&[(OID_SUBJECT_ALT_NAME, san("node-a"))]),
        )]);
        let value = strict::check_extensions(&one, Purpose::Server).expect("one SAN");
        assert_eq!(value, Some(san("node-a").as_slice()));
        for attributes in [
            vec![(
                OID_EXTENSION_REQUEST,
                extensions(&[
                    (OID_SUBJECT_ALT_NAME, san("node-a")),
                    (OID_SUBJECT_ALT_NAME, san("node-b")),
                ]),
            )],
            vec![
                (
                    OID_EXTENSION_REQUEST,
                    extensions(&[(OID_SUBJECT_ALT_NAME, san("node-a"))]),
                ),
                (
                    OID_EXTENSION_REQUEST,
                    extensions(&[(OID_SUBJECT_ALT_NAME, san("node-b"))]),
                ),
            ],
        ] {
            let request = request_with(&attributes);
            let refused = strict::check_attributes(&request)
                .and_then(|()| strict::check_extensions(&request, Purpose::Server).map(|_| ()))
                .expect_err("two SANs");
            assert_eq!(refused.reason, Reason::ExtensionNotAllowed, "{refused}");
        }
    }

    /// Two of anything: a second extension request, the same extension twice, a SAN hidden
    /// in a second extension request, an unknown attribute or extension.
    #[test]
    fn duplicated_and_unknown_attributes_and_extensions_are_refused() {
        let client_auth = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_oid(&ObjectIdentifier::from_slice(&[1, 3, 6, 1, 5, 5, 7, 3, 2]))
            })
        });
        let eku = (OID_EXT_KEY_USAGE, client_auth.clone());
        let dns_san = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_tagged_implicit(yasna::Tag::context(2), |w| w.write_ia5_string("x"))
            })
        });
        let ok = request_with(&[(
            OID_EXTENSION_REQUEST,
            extensions(std::slice::from_ref(&eku)),
        )]);
        assert!(check_node_client(&ok, None).is_ok());
        for (attributes, want) in [
            (
                vec![
                    (
                        OID_EXTENSION_REQUEST,
                        extensions(std::slice::from_ref(&eku)),
                    ),
                    (
                        OID_EXTENSION_REQUEST,
                        extensions(&[(OID_SUBJECT_ALT_NAME, dns_san.clone())]),
                    ),
                ],
                Reason::SubjectAltNameNotAllowed,
            ),
            (
                vec![(
                    OID_EXTENSION_REQUEST,
                    extensions(&[eku.clone(), eku.clone()]),
                )],
                Reason::ExtensionNotAllowed,
            ),
            (
                vec![(
                    OID_EXTENSION_REQUEST,
                    extensions(&[eku.clone(), (OID_SUBJECT_ALT_NAME, dns_san.clone())]),
                )],
                Reason::SubjectAltNameNotAllowed,
            ),
            (
                vec![(
                    &[1, 2, 840, 113549, 1, 9, 7][..],
                    yasna::construct_der(|w| w.write_utf8_string("challenge")),
                )],
                Reason::ExtensionNotAllowed,
            ),
            (
                vec![(
                    OID_EXTENSION_REQUEST,
                    extensions(&[(&[2, 5, 29, 19][..], vec![0x30, 0x03, 0x01, 0x01, 0xff])]),
                )],
                Reason::ExtensionNotAllowed,
            ),
        ] {
            let v = check_node_client(&request_with(&attributes), None)
                .expect_err(&format!("{want:?}"));
            let either = [want, Reason::ExtensionNotAllowed];
            assert!(either.contains(&v.reason), "{want:?}: {v}");
        }
    }
}
