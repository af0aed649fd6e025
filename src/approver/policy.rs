//! What hwkey approves, per signer, read from a [`Request`] (the one strict reading of
//! `spec.request`, the same bytes Go signs from).
//!
//! The only signer with a policy is kubelet's client signer, checked like Kubernetes'
//! `ValidateKubeletClientCSR` and stricter: exactly one CN `system:node:NODE`, O exactly
//! `[system:nodes]`, no other subject attribute; no SAN of any kind; usages {digital signature,
//! client auth}, plus key encipherment at most; no extension request beyond key usage and
//! extended key usage that agree with those; no request attribute but one extension request
//! and hwkey's evidence. An approver started for any other signer refuses to start: approving
//! what a policy does not describe would issue identities nobody checked (a
//! `kube-apiserver-client` certificate can be `system:kube-controller-manager`).

use yasna::models::ObjectIdentifier;

use crate::label_values;
use crate::metric_labels::LabelValue;
use crate::pki::attestation::OID_EVIDENCE;
use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER};
use crate::pki::request::{
    Malformed, Request, OID_COMMON_NAME, OID_EXTENSION_REQUEST, OID_EXT_KEY_USAGE, OID_KEY_USAGE,
    OID_ORGANIZATION, OID_SUBJECT_ALT_NAME,
};

label_values! {
    /// Why a request was approved or denied: the condition's `reason`, and a metric label.
    pub enum Reason {
        /// Approved: the key is in the TPM registered for the node (or person) it asks to be.
        AttestedTpmKey => "AttestedTPMKey",
        /// Approved: a person's key is in a YubiKey registered for them (PIV attestation).
        AttestedPivKey => "AttestedPIVKey",
        /// Approved: a person renews with the key of the certificate they hold now.
        SameKeyRenewal => "SameKeyRenewal",
        /// A person renews with their current certificate alone (possession, not hardware)
        /// and the allow list does not name them under `certificateOnly`.
        HardwareProofRequired => "HardwareProofRequired",
        /// A person's request asks for no lifetime, or a longer one than allowed.
        LifetimeNotAllowed => "LifetimeNotAllowed",
        /// `spec.request` is not exactly one well-formed CERTIFICATE REQUEST (or is too large).
        MalformedRequest => "MalformedRequest",
        /// The subject is not exactly `CN=system:node:NODE, O=system:nodes`.
        SubjectNotAllowed => "SubjectNotAllowed",
        /// The request names a DNS, IP, email or URI subject alternative name.
        SubjectAltNameNotAllowed => "SubjectAltNameNotAllowed",
        /// `spec.usages` (or a requested key usage) is not a node client's.
        UsagesNotAllowed => "UsagesNotAllowed",
        /// A requested extension or request attribute outside the policy.
        ExtensionNotAllowed => "ExtensionNotAllowed",
        /// The requester may not ask for this node (not the node, not an allowed bootstrap
        /// group).
        RequesterNotAllowed => "RequesterNotAllowed",
        /// The request carries no TPM evidence.
        NoEvidence => "NoEvidence",
        /// The evidence (or the request's own signature) does not hold.
        EvidenceInvalid => "EvidenceInvalid",
        /// The evidence was made outside the window around the request's creation, or the
        /// request waited longer than the window.
        EvidenceStale => "EvidenceStale",
        /// The same evidence is in another request that holds it.
        EvidenceReused => "EvidenceReused",
        /// The evidence's AK is not registered.
        UnknownAttestationKey => "UnknownAttestationKey",
        /// The evidence's AK is registered, for another node.
        SubjectMismatch => "SubjectMismatch",
        /// Issued (a carrier request): the TPM's EK certificate chains to a manufacturer CA
        /// and the binding policy allows it; the credential is in the carrier certificate.
        EkCertificateVerified => "EKCertificateVerified",
        /// A carrier request's EK certificate does not chain to a trusted manufacturer CA, is
        /// revoked or expired, is not an EK certificate, or is for another key.
        EkCertificateUntrusted => "EKCertificateUntrusted",
        /// The binding policy's allow list does not name this TPM for this node.
        TpmNotAllowed => "TPMNotAllowed",
        /// This TPM holds another node name already.
        TpmBoundToAnotherNode => "TPMBoundToAnotherNode",
        /// This node name is held by another TPM (or by an operator's registration).
        NodeBoundToAnotherTpm => "NodeBoundToAnotherTPM",
        /// The answer to a credential is wrong, or its carrier is not this request's.
        CredentialInvalid => "CredentialInvalid",
        /// The credential's answer came after it expired.
        CredentialExpired => "CredentialExpired",
        /// The credential was answered already, by another request.
        CredentialReplayed => "CredentialReplayed",
    }
}

impl Reason {
    /// Whether this reason approves.
    pub fn approves(self) -> bool {
        matches!(
            self,
            Reason::AttestedTpmKey
                | Reason::AttestedPivKey
                | Reason::SameKeyRenewal
                | Reason::EkCertificateVerified
        )
    }

    /// The reason for an evidence refusal.
    pub fn of(refusal: crate::pki::attestation::Refusal) -> Reason {
        use crate::pki::attestation::Refusal;
        match refusal {
            Refusal::NoEvidence => Reason::NoEvidence,
            Refusal::EvidenceInvalid => Reason::EvidenceInvalid,
            Refusal::UnknownAttestationKey => Reason::UnknownAttestationKey,
            Refusal::SubjectMismatch => Reason::SubjectMismatch,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do with a request that carries no evidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnMissingEvidence {
    /// Deny it (`NoEvidence`): only attested keys get in.
    #[default]
    Deny,
    /// Leave it to other approvers.
    Ignore,
}

/// A request the policy refuses: the reason and exactly what did not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Violation {
    /// The condition reason.
    pub reason: Reason,
    /// What did not hold.
    pub message: String,
}

/// At most 64 characters of an attacker-chosen value, escaped, for a condition message or a log.
pub fn bounded(value: &str) -> String {
    let escaped = value.escape_debug().to_string();
    match escaped.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &escaped[..at]),
        None => escaped,
    }
}

pub(super) fn violation(reason: Reason, message: impl Into<String>) -> Violation {
    Violation {
        reason,
        message: message.into(),
    }
}

impl From<Malformed> for Violation {
    fn from(m: Malformed) -> Violation {
        violation(Reason::MalformedRequest, m.to_string())
    }
}

/// An approver asked to decide for a signer hwkey has no policy for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hwkey has no approval policy for signer '{signer}': it approves only {KUBELET_SIGNER} (node client certificates, checked like Kubernetes' ValidateKubeletClientCSR) and, with --people-trust or --people-trust-configmap, {CLIENT_SIGNER} (people renewing their own identity) and, with --ek-ca and --credential-key, hwkey.dev/tpm-credential (TPMs joining by their EK certificate); approving another signer's requests would issue identities no policy checked")]
pub struct NoPolicy {
    /// The signer asked for (escaped).
    pub signer: String,
}

/// The signers hwkey has an approval policy for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignerPolicy {
    /// `kubernetes.io/kube-apiserver-client-kubelet`: node client certificates.
    KubeletClient,
    /// `kubernetes.io/kube-apiserver-client`: people renewing their own identity
    /// ([`super::person`]), only when a people trust is configured.
    PersonClient,
    /// `hwkey.dev/tpm-credential`: carrier requests of TPMs joining by their EK certificate
    /// ([`super::ek_join`]), only when the manufacturer CAs and a credential key are
    /// configured.
    TpmCredential,
}

impl SignerPolicy {
    /// The policy for `signer` (`people`: whether a people trust is configured), or why the
    /// approver must not start for it.
    pub fn for_signer(signer: &str, people: bool, ek_join: bool) -> Result<SignerPolicy, NoPolicy> {
        if signer == KUBELET_SIGNER {
            return Ok(SignerPolicy::KubeletClient);
        }
        if signer == CLIENT_SIGNER && people {
            return Ok(SignerPolicy::PersonClient);
        }
        if signer == crate::pki::ek_join::CREDENTIAL_SIGNER && ek_join {
            return Ok(SignerPolicy::TpmCredential);
        }
        Err(NoPolicy {
            signer: signer.escape_debug().to_string(),
        })
    }
}

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
    check_attributes(request)?;
    check_extensions(request)?;
    if let Some(usages) = usages {
        check_usages(usages)?;
    }
    Ok(NodeIdentity { node })
}

/// Exactly one CN `system:node:NODE`, O exactly `[system:nodes]`, nothing else (the reader
/// already refused empty and multi-valued RDNs and other string types).
fn check_node_subject(request: &Request) -> Result<String, Violation> {
    let refuse = |m: String| violation(Reason::SubjectNotAllowed, m);
    let (cn, o) = (
        ObjectIdentifier::from_slice(OID_COMMON_NAME),
        ObjectIdentifier::from_slice(OID_ORGANIZATION),
    );
    if let Some(other) = request.subject.iter().find(|a| a.oid != cn && a.oid != o) {
        return Err(refuse(format!(
            "the subject has attribute {} ('{}'): a node's subject is CN and O only",
            other.oid,
            bounded(&other.value)
        )));
    }
    let orgs = request.subject_values(OID_ORGANIZATION);
    if orgs != ["system:nodes"] {
        return Err(refuse(format!(
            "O must be exactly [system:nodes], not {}",
            list(&orgs)
        )));
    }
    let cns = request.subject_values(OID_COMMON_NAME);
    let [cn] = cns.as_slice() else {
        return Err(refuse(format!(
            "the subject must have exactly one CN, not {} ({}): Kubernetes would take the last",
            cns.len(),
            list(&cns)
        )));
    };
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

/// Up to four values, bounded, for a message.
pub(super) fn list(values: &[&str]) -> String {
    let shown: Vec<String> = values.iter().take(4).map(|v| bounded(v)).collect();
    format!(
        "[{}{}]",
        shown.join(", "),
        if values.len() > 4 { ", …" } else { "" }
    )
}

/// The request's attributes: at most one extension request and one evidence attribute, each
/// with exactly one value.
pub(super) fn check_attributes(request: &Request) -> Result<(), Violation> {
    let (ext, evidence) = (
        ObjectIdentifier::from_slice(OID_EXTENSION_REQUEST),
        ObjectIdentifier::from_slice(OID_EVIDENCE),
    );
    let mut seen = Vec::new();
    for attribute in &request.attributes {
        if seen.contains(&&attribute.oid) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {} twice", attribute.oid),
            ));
        }
        seen.push(&attribute.oid);
        if attribute.oid != ext && attribute.oid != evidence {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {}: only an extension request and hwkey's TPM evidence are allowed", attribute.oid),
            ));
        }
        if attribute.values.len() != 1 {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!(
                    "attribute {} must hold exactly one value, not {}",
                    attribute.oid,
                    attribute.values.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Requested extensions: key usage (digital signature, key encipherment at most) and extended
/// key usage (client auth only); a SAN of any kind, a second copy or anything else is refused.
pub(super) fn check_extensions(request: &Request) -> Result<(), Violation> {
    let oid = ObjectIdentifier::from_slice;
    let mut seen = Vec::new();
    for extension in &request.extensions {
        let id = &extension.oid;
        if seen.contains(&id) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("extension {id} is requested twice"),
            ));
        }
        seen.push(id);
        if *id == oid(OID_SUBJECT_ALT_NAME) {
            return Err(violation(
                Reason::SubjectAltNameNotAllowed,
                format!(
                    "the request names subject alternative names ({}): a client certificate of this kind has none",
                    san_kinds(&extension.value)
                ),
            ));
        } else if *id == oid(OID_KEY_USAGE) {
            check_key_usage(&extension.value)?;
        } else if *id == oid(OID_EXT_KEY_USAGE) {
            check_extended_key_usage(&extension.value)?;
        } else {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request asks for extension {id}: only key usage and extended key usage are allowed"),
            ));
        }
    }
    Ok(())
}

fn malformed_extension(e: yasna::ASN1Error) -> Violation {
    violation(
        Reason::MalformedRequest,
        format!("a requested extension does not parse: {e}"),
    )
}

/// A requested key usage: digital signature and key encipherment at most.
fn check_key_usage(value: &[u8]) -> Result<(), Violation> {
    let (bytes, _) =
        yasna::parse_der(value, |r| r.read_bitvec_bytes()).map_err(malformed_extension)?;
    // Bit 0 digitalSignature (0x80 of the first byte), bit 2 keyEncipherment (0x20).
    let extra = bytes
        .iter()
        .enumerate()
        .any(|(i, b)| if i == 0 { b & !0xa0 != 0 } else { *b != 0 });
    if extra {
        return Err(violation(
            Reason::UsagesNotAllowed,
            "the requested key usage has bits beyond digital signature and key encipherment",
        ));
    }
    Ok(())
}

/// A requested extended key usage: client auth alone.
fn check_extended_key_usage(value: &[u8]) -> Result<(), Violation> {
    let purposes = yasna::parse_der(value, |r| r.collect_sequence_of(|r| r.read_oid()))
        .map_err(malformed_extension)?;
    if purposes != [ObjectIdentifier::from_slice(&[1, 3, 6, 1, 5, 5, 7, 3, 2])] {
        let names: Vec<String> = purposes.iter().map(|p| p.to_string()).collect();
        return Err(violation(
            Reason::UsagesNotAllowed,
            format!(
                "the requested extended key usage is [{}], not client auth alone",
                names.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The kinds of names in a GeneralNames value, for the denial message.
fn san_kinds(value: &[u8]) -> String {
    let mut kinds = Vec::new();
    let _ = yasna::parse_der(value, |r| {
        r.read_sequence_of(|r| {
            let tag = r.lookahead_tag()?;
            kinds.push(match tag.tag_number {
                1 => "email",
                2 => "DNS",
                6 => "URI",
                7 => "IP",
                _ => "other",
            });
            r.read_der().map(|_| ())
        })
    });
    if kinds.is_empty() {
        "unreadable".into()
    } else {
        kinds.join(", ")
    }
}

/// `spec.usages`: {digital signature, client auth}, plus key encipherment at most, each once.
pub fn check_usages(usages: &[String]) -> Result<(), Violation> {
    let mut sorted: Vec<&str> = usages.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    let ok = sorted == ["client auth", "digital signature"]
        || sorted == ["client auth", "digital signature", "key encipherment"];
    if ok {
        Ok(())
    } else {
        Err(violation(
            Reason::UsagesNotAllowed,
            format!(
                "usages {} are not a client certificate's: [digital signature, client auth], optionally key encipherment",
                bounded(&format!("{usages:?}"))
            ),
        ))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn only_the_kubelet_client_signer_has_a_policy_without_a_people_trust() {
        assert_eq!(
            SignerPolicy::for_signer("kubernetes.io/kube-apiserver-client-kubelet", false, false),
            Ok(SignerPolicy::KubeletClient)
        );
        assert_eq!(
            SignerPolicy::for_signer("kubernetes.io/kube-apiserver-client", true, false),
            Ok(SignerPolicy::PersonClient)
        );
        for other in [
            "kubernetes.io/kube-apiserver-client",
            "kubernetes.io/kubelet-serving",
            "example.com/anything",
        ] {
            let e = SignerPolicy::for_signer(other, false, false)
                .expect_err(other)
                .to_string();
            assert!(e.contains("no approval policy"), "{e}");
        }
    }

    #[test]
    fn usages_are_a_node_clients() {
        let u = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
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

    /// A well-formed request (rcgen, a fresh key) for `subject`: shared with the people
    /// policy's tests.
    pub(in crate::approver) fn request(subject: &[(rcgen::DnType, &str)]) -> Request {
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
        Request::from_der(der).expect("a well-formed request")
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

    #[test]
    fn every_reason_is_listed_once() {
        let mut names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len());
    }
}
