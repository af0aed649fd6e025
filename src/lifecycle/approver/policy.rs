//! What hwkey approves, per signer: the request Kubernetes will sign, read as Kubernetes reads it.
//!
//! The approver decides on the bytes the signer parses (the one PEM block Go's `pem.Decode`
//! returns, [`crate::pki::request_pem`]) and on the parsed DER, never on printed strings: Go's
//! `pkix.Name` takes the *last* CN, so a subject is checked RDN by RDN. The only signer with a
//! policy is kubelet's client signer, checked like Kubernetes' `ValidateKubeletClientCSR` and
//! stricter: exactly one CN `system:node:NODE`, O exactly `[system:nodes]`, no other attribute
//! and no multi-valued RDN; no SAN of any kind; usages {digital signature, client auth}, plus
//! key encipherment at most; no extension request beyond key usage and extended key usage that
//! agree with those; no request attribute but the extension request and hwkey's evidence.
//! An approver started for any other signer refuses to start: approving what a policy does not
//! describe would issue identities nobody checked (a `kube-apiserver-client` certificate can be
//! `system:kube-controller-manager`).

use x509_parser::oid_registry::{OID_X509_COMMON_NAME, OID_X509_ORGANIZATION_NAME};

use crate::pki::attestation::OID_EVIDENCE;
use crate::pki::csr::{OID_EXTENSION_REQUEST, OID_SUBJECT_ALT_NAME};
use crate::pki::request_pem;

/// Why a request was approved or denied: the condition's `reason`, and a metric label.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelValue,
)]
#[allow(clippy::upper_case_acronyms)]
pub enum Reason {
    /// Approved: the key is in the TPM registered for the node it asks to be.
    AttestedTPMKey,
    /// `spec.request` is not exactly one well-formed CERTIFICATE REQUEST.
    MalformedRequest,
    /// The subject is not exactly `CN=system:node:NODE, O=system:nodes`.
    SubjectNotAllowed,
    /// The request names a DNS, IP, email or URI subject alternative name.
    SubjectAltNameNotAllowed,
    /// `spec.usages` (or a requested key usage) is not a node client's.
    UsagesNotAllowed,
    /// A requested extension or request attribute outside the policy.
    ExtensionNotAllowed,
    /// The requester may not ask for this node (not the node, not an allowed bootstrap group).
    RequesterNotAllowed,
    /// The request carries no TPM evidence.
    NoEvidence,
    /// The evidence does not hold.
    EvidenceInvalid,
    /// The evidence was made outside the window around the request's creation.
    EvidenceStale,
    /// The same evidence is in an earlier request.
    EvidenceReused,
    /// The evidence's AK is not registered.
    UnknownAttestationKey,
    /// The evidence's AK is registered, for another node.
    SubjectMismatch,
}

impl Reason {
    /// Every reason, for metrics that start at zero.
    pub const ALL: [Reason; 13] = [
        Reason::AttestedTPMKey,
        Reason::MalformedRequest,
        Reason::SubjectNotAllowed,
        Reason::SubjectAltNameNotAllowed,
        Reason::UsagesNotAllowed,
        Reason::ExtensionNotAllowed,
        Reason::RequesterNotAllowed,
        Reason::NoEvidence,
        Reason::EvidenceInvalid,
        Reason::EvidenceStale,
        Reason::EvidenceReused,
        Reason::UnknownAttestationKey,
        Reason::SubjectMismatch,
    ];

    /// The condition reason as Kubernetes shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::AttestedTPMKey => "AttestedTPMKey",
            Reason::MalformedRequest => "MalformedRequest",
            Reason::SubjectNotAllowed => "SubjectNotAllowed",
            Reason::SubjectAltNameNotAllowed => "SubjectAltNameNotAllowed",
            Reason::UsagesNotAllowed => "UsagesNotAllowed",
            Reason::ExtensionNotAllowed => "ExtensionNotAllowed",
            Reason::RequesterNotAllowed => "RequesterNotAllowed",
            Reason::NoEvidence => "NoEvidence",
            Reason::EvidenceInvalid => "EvidenceInvalid",
            Reason::EvidenceStale => "EvidenceStale",
            Reason::EvidenceReused => "EvidenceReused",
            Reason::UnknownAttestationKey => "UnknownAttestationKey",
            Reason::SubjectMismatch => "SubjectMismatch",
        }
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
fn bounded(value: &str) -> String {
    let escaped = value.escape_debug().to_string();
    match escaped.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &escaped[..at]),
        None => escaped,
    }
}

fn violation(reason: Reason, message: impl Into<String>) -> Violation {
    Violation {
        reason,
        message: message.into(),
    }
}

/// An approver asked to decide for a signer hwkey has no policy for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hwkey has no approval policy for signer '{signer}': it approves only {kubelet} (node client certificates, checked like Kubernetes' ValidateKubeletClientCSR); approving another signer's requests would issue identities no policy checked", kubelet = crate::lifecycle::KUBELET_SIGNER)]
pub struct NoPolicy {
    /// The signer asked for (escaped).
    pub signer: String,
}

/// The signers hwkey has an approval policy for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignerPolicy {
    /// `kubernetes.io/kube-apiserver-client-kubelet`: node client certificates.
    KubeletClient,
}

impl SignerPolicy {
    /// The policy for `signer`, or why the approver must not start for it.
    pub fn for_signer(signer: &str) -> Result<SignerPolicy, NoPolicy> {
        if signer == crate::lifecycle::KUBELET_SIGNER {
            return Ok(SignerPolicy::KubeletClient);
        }
        Err(NoPolicy {
            signer: signer.escape_debug().to_string(),
        })
    }
}

/// A request that satisfies the policy: the DER the signer will sign and the node it asks to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The request's DER (the one PEM block).
    pub der: Vec<u8>,
    /// NODE of `CN=system:node:NODE`.
    pub node: String,
}

/// The DER of the request the signer will sign (`spec.request`'s one PEM block).
pub fn request_der(spec_request: &[u8]) -> Result<Vec<u8>, Violation> {
    request_pem::single_request_block(spec_request)
        .map_err(|e| violation(Reason::MalformedRequest, e.0))
}

/// Checks a node client request: the subject, SANs, requested extensions and attributes of
/// `der`, and `usages` (`spec.usages`; None for a bare request file, which has none).
pub fn check_kubelet_client(der: &[u8], usages: Option<&[String]>) -> Result<Checked, Violation> {
    let csr = request_pem::parse_request_exact(der)
        .map_err(|e| violation(Reason::MalformedRequest, e.to_string()))?;
    let cri = &csr.certification_request_info;
    let node = check_subject(&cri.subject)?;
    check_attributes(cri.raw)?;
    if let Some(usages) = usages {
        check_usages(usages)?;
    }
    Ok(Checked {
        der: der.to_vec(),
        node,
    })
}

/// Exactly one CN `system:node:NODE`, O exactly `[system:nodes]`, nothing else, one attribute
/// per RDN, each a UTF8String or PrintableString (what Go and Kubernetes write).
fn check_subject(subject: &x509_parser::x509::X509Name<'_>) -> Result<String, Violation> {
    use x509_parser::der_parser::asn1_rs::Tag;
    let refuse = |m: String| violation(Reason::SubjectNotAllowed, m);
    let (mut cns, mut orgs) = (Vec::new(), Vec::new());
    for rdn in subject.iter() {
        let attributes: Vec<_> = rdn.iter().collect();
        let [attribute] = attributes.as_slice() else {
            return Err(refuse(format!(
                "the subject has a multi-valued RDN ({} attributes in one): each attribute must be its own RDN",
                attributes.len()
            )));
        };
        let tag = attribute.attr_value().tag();
        if tag != Tag::Utf8String && tag != Tag::PrintableString {
            return Err(refuse(format!(
                "subject attribute {} is a {tag}, not a UTF8String or PrintableString",
                attribute.attr_type()
            )));
        }
        let value = attribute
            .as_str()
            .map_err(|e| refuse(format!("a subject attribute does not decode: {e}")))?;
        let oid = attribute.attr_type();
        if *oid == OID_X509_COMMON_NAME {
            cns.push(value);
        } else if *oid == OID_X509_ORGANIZATION_NAME {
            orgs.push(value);
        } else {
            return Err(refuse(format!(
                "the subject has attribute {oid} ('{}'): a node's subject is CN and O only",
                bounded(value)
            )));
        }
    }
    let list = |values: &[&str]| {
        let shown: Vec<String> = values.iter().take(4).map(|v| bounded(v)).collect();
        format!(
            "[{}{}]",
            shown.join(", "),
            if values.len() > 4 { ", …" } else { "" }
        )
    };
    if orgs != ["system:nodes"] {
        return Err(refuse(format!(
            "O must be exactly [system:nodes], not {}",
            list(&orgs)
        )));
    }
    let [cn] = cns.as_slice() else {
        return Err(refuse(format!(
            "the subject must have exactly one CN, not {} ({}): Kubernetes would take the last",
            cns.len(),
            list(&cns)
        )));
    };
    let node = cn
        .strip_prefix("system:node:")
        .filter(|n| crate::pki::registration::check_node_name(n).is_ok())
        .ok_or_else(|| {
            refuse(format!(
                "CN '{}' is not system:node:NODE with a node name",
                bounded(cn)
            ))
        })?;
    Ok(node.to_string())
}

const OID_KEY_USAGE: &[u64] = &[2, 5, 29, 15];
const OID_EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];
const OID_CLIENT_AUTH: &[u64] = &[1, 3, 6, 1, 5, 5, 7, 3, 2];

/// The request's attributes: at most one extension request and one evidence attribute.
fn check_attributes(cri_raw: &[u8]) -> Result<(), Violation> {
    let malformed = |e: yasna::ASN1Error| {
        violation(
            Reason::MalformedRequest,
            format!("the request's attributes do not parse: {e}"),
        )
    };
    let attributes = crate::pki::attributes::read(cri_raw).map_err(malformed)?;
    let oid = |o: &[u64]| yasna::models::ObjectIdentifier::from_slice(o);
    let mut seen = Vec::new();
    for (id, values) in &attributes {
        if seen.contains(&id) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {id} twice"),
            ));
        }
        seen.push(id);
        if *id == oid(OID_EVIDENCE) {
            continue;
        }
        if *id != oid(OID_EXTENSION_REQUEST) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {id}: only an extension request and hwkey's TPM evidence are allowed"),
            ));
        }
        let mut sets = Vec::new();
        yasna::parse_der(values, |r| {
            r.read_set_of(|r| {
                sets.push(r.read_der()?);
                Ok(())
            })
        })
        .map_err(malformed)?;
        let [extensions] = sets.as_slice() else {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                "the extension request must hold exactly one set of extensions",
            ));
        };
        check_extensions(extensions)?;
    }
    Ok(())
}

/// Requested extensions: key usage (digital signature, key encipherment at most) and extended
/// key usage (client auth only); a SAN of any kind, a second copy or anything else is refused.
fn check_extensions(der: &[u8]) -> Result<(), Violation> {
    let malformed = |e: yasna::ASN1Error| {
        violation(
            Reason::MalformedRequest,
            format!("the requested extensions do not parse: {e}"),
        )
    };
    let extensions = yasna::parse_der(der, |r| {
        r.collect_sequence_of(|r| {
            r.read_sequence(|r| {
                let id = r.next().read_oid()?;
                let _critical = r.read_default(false, |r| r.read_bool())?;
                let value = r.next().read_bytes()?;
                Ok((id, value))
            })
        })
    })
    .map_err(malformed)?;
    let oid = |o: &[u64]| yasna::models::ObjectIdentifier::from_slice(o);
    let mut seen = Vec::new();
    for (id, value) in &extensions {
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
                    "the request names subject alternative names ({}): a node client certificate has none",
                    san_kinds(value)
                ),
            ));
        } else if *id == oid(OID_KEY_USAGE) {
            let (bytes, _) =
                yasna::parse_der(value, |r| r.read_bitvec_bytes()).map_err(malformed)?;
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
        } else if *id == oid(OID_EXT_KEY_USAGE) {
            let purposes = yasna::parse_der(value, |r| r.collect_sequence_of(|r| r.read_oid()))
                .map_err(malformed)?;
            if purposes != [oid(OID_CLIENT_AUTH)] {
                let names: Vec<String> = purposes.iter().map(|p| p.to_string()).collect();
                return Err(violation(
                    Reason::UsagesNotAllowed,
                    format!(
                        "the requested extended key usage is [{}], not client auth alone",
                        names.join(", ")
                    ),
                ));
            }
        } else {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request asks for extension {id}: only key usage and extended key usage are allowed"),
            ));
        }
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
fn check_usages(usages: &[String]) -> Result<(), Violation> {
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
                "usages {} are not a node client's: [digital signature, client auth], optionally key encipherment",
                bounded(&format!("{usages:?}"))
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_kubelet_client_signer_has_a_policy() {
        assert_eq!(
            SignerPolicy::for_signer("kubernetes.io/kube-apiserver-client-kubelet"),
            Ok(SignerPolicy::KubeletClient)
        );
        for other in [
            "kubernetes.io/kube-apiserver-client",
            "kubernetes.io/kubelet-serving",
            "example.com/anything",
        ] {
            let e = SignerPolicy::for_signer(other)
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

    fn request(subject: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            dn.push(t.clone(), *v);
        }
        params.distinguished_name = dn;
        params
            .serialize_request(&key)
            .expect("request")
            .der()
            .to_vec()
    }

    #[test]
    fn a_node_subject_passes_and_others_are_refused_with_bounded_messages() {
        use rcgen::DnType::*;
        let ok = request(&[
            (OrganizationName, "system:nodes"),
            (CommonName, "system:node:node-a"),
        ]);
        let checked = check_kubelet_client(&ok, None).expect("a node's request");
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
            let v = check_kubelet_client(&request(&subject), None).expect_err(want);
            assert_eq!(v.reason, Reason::SubjectNotAllowed);
            assert!(v.message.contains(want), "{v}");
            assert!(
                v.message.len() < 400 && !v.message.contains('\u{1b}'),
                "{v}"
            );
        }
        let mut trailing = ok.clone();
        trailing.push(0);
        assert_eq!(
            check_kubelet_client(&trailing, None).map_err(|v| v.reason),
            Err(Reason::MalformedRequest)
        );
    }

    /// A request (unsigned: the policy reads structure, the evidence check verifies) for a
    /// node's subject with these attributes, each (type, DER of one value).
    fn request_with(attributes: &[(&[u64], Vec<u8>)]) -> Vec<u8> {
        let subject = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in [
                    (&[2u64, 5, 4, 10][..], "system:nodes"),
                    (&[2, 5, 4, 3], "system:node:node-a"),
                ] {
                    w.next().write_set(|w| {
                        w.next().write_sequence(|w| {
                            w.next()
                                .write_oid(&yasna::models::ObjectIdentifier::from_slice(oid));
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
                                w.next()
                                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(oid));
                                w.next().write_set(|w| w.next().write_der(value));
                            });
                        }
                    })
                });
            })
        });
        yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&info);
                w.next().write_sequence(|w| {
                    w.next()
                        .write_oid(&yasna::models::ObjectIdentifier::from_slice(&[
                            1, 2, 840, 10045, 4, 3, 2,
                        ]))
                });
                w.next().write_bitvec_bytes(&[0u8; 8], 64);
            })
        })
    }

    /// Extensions (type, value DER) as one extension request's value.
    fn extensions(list: &[(&[u64], Vec<u8>)]) -> Vec<u8> {
        yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in list {
                    w.next().write_sequence(|w| {
                        w.next()
                            .write_oid(&yasna::models::ObjectIdentifier::from_slice(oid));
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
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(&[
                        1, 3, 6, 1, 5, 5, 7, 3, 2,
                    ]))
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
        assert!(check_kubelet_client(&ok, None).is_ok());
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
                // Whichever is read first: the second request, or the SAN in it.
                Reason::SubjectAltNameNotAllowed,
            ),
            (
                vec![
                    (
                        OID_EXTENSION_REQUEST,
                        extensions(std::slice::from_ref(&eku)),
                    ),
                    (
                        OID_EXTENSION_REQUEST,
                        extensions(&[(OID_KEY_USAGE, vec![0x03, 0x02, 0x07, 0x80])]),
                    ),
                ],
                Reason::ExtensionNotAllowed,
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
            let v = check_kubelet_client(&request_with(&attributes), None)
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
