//! Proof that a renewal request is for the key its requester already holds: the request carries
//! the requester's current certificate, and the approver checks that it chains to the cluster's
//! client CA, is valid now, names the request's subject and certifies exactly the request's
//! public key. The request's own signature then proves possession of that key, so a renewal
//! with the same key needs no TPM evidence (and works for PKCS#11 keys, which have none).
//!
//! Encoding: inside hwkey's evidence attribute (`id-aa-evidence`, see [`super::attestation`]),
//! one evidence statement of type hwkey-current-certificate
//! (2.25.184959475948495205439231631349799324371) whose statement is the DER certificate:
//!
//! ```text
//! EvidenceBundles ::= SEQUENCE OF EvidenceBundle                       -- one
//! EvidenceBundle  ::= SEQUENCE { evidences SEQUENCE OF EvidenceStatement }  -- one
//! EvidenceStatement ::= SEQUENCE { type OBJECT IDENTIFIER, stmt Certificate,
//!                                  hint UTF8String }  -- "hwkey current certificate"
//! ```
//!
//! One attribute type for both proofs keeps the rule "one evidence attribute, one value": a
//! request cannot carry a certificate and TPM evidence at once, nor two certificates.

use super::attestation::{Refusal, Refused, OID_EVIDENCE, OID_TPM2_CERTIFY_DER};
use super::certificate::Certificate;
use super::request::{Request, SubjectAttribute};
use super::PkiError;

/// DER of the statement type: a UUID OID (2.25.…), since no standard type says "the
/// certificate this key already has".
pub const OID_CURRENT_CERTIFICATE_DER: &[u8] = &[
    0x06, 0x14, 0x69, 0x82, 0x96, 0xa5, 0xf3, 0x8e, 0xc0, 0xbd, 0x9a, 0x83, 0xc3, 0xac, 0xd6, 0xd4,
    0xb4, 0xbc, 0xa9, 0xf8, 0x95, 0x53,
];
const HINT: &str = "hwkey current certificate";

/// The request attribute (DER `Attribute`) carrying `cert_der` as the current certificate.
pub fn attribute(cert_der: &[u8]) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next()
                .write_oid(&yasna::models::ObjectIdentifier::from_slice(OID_EVIDENCE));
            w.next().write_set(|w| {
                w.next().write_sequence(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_sequence(|w| {
                            w.next().write_sequence(|w| {
                                w.next().write_der(OID_CURRENT_CERTIFICATE_DER);
                                w.next().write_der(cert_der);
                                w.next().write_utf8_string(HINT);
                            });
                        });
                    });
                });
            });
        })
    })
}

/// What proof of the key a request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// No evidence attribute.
    Missing,
    /// TPM2_Certify evidence (a key in a TPM, checked by [`super::attestation`]).
    TpmCertify,
    /// The requester's current certificate (DER), for a renewal with the same key.
    CurrentCertificate(Vec<u8>),
    /// A PIV attestation (a key in a YubiKey, checked by [`super::piv`]): the slot's
    /// attestation certificate and the bundle's certificates (the device's f9, exactly one).
    PivAttestation {
        /// The attestation certificate (DER).
        attestation: Vec<u8>,
        /// The bundle's `certs` (DER each).
        certs: Vec<Vec<u8>>,
    },
    /// An evidence attribute that cannot be read, and why.
    Unreadable(String),
}

/// Reads which proof a request carries (the first evidence attribute: the approver's policy
/// refuses a second one).
pub fn proof_of(request: &Request) -> Proof {
    let Some(attribute) = request.attributes_of(OID_EVIDENCE).first().copied() else {
        return Proof::Missing;
    };
    let [value] = attribute.values.as_slice() else {
        return Proof::Unreadable("the evidence attribute does not hold exactly one value".into());
    };
    match yasna::parse_der(value, read_statement) {
        Ok((kind, _, _)) if kind == OID_TPM2_CERTIFY_DER => Proof::TpmCertify,
        Ok((kind, statement, _)) if kind == OID_CURRENT_CERTIFICATE_DER => {
            Proof::CurrentCertificate(statement)
        }
        Ok((kind, attestation, certs)) if kind == super::piv::OID_PIV_ATTESTATION_DER => {
            Proof::PivAttestation { attestation, certs }
        }
        Ok(_) => {
            Proof::Unreadable("the evidence statement is of a type hwkey does not know".into())
        }
        Err(e) => Proof::Unreadable(format!("the evidence attribute does not parse: {e}")),
    }
}

/// EvidenceBundles (one) → EvidenceBundle { evidences (one statement), certs OPTIONAL } →
/// (type DER, statement DER, certs DER); what follows the statement inside it (a hint) is read
/// and not used, and nothing may follow `certs`.
type Statement = (Vec<u8>, Vec<u8>, Vec<Vec<u8>>);

fn read_statement(r: yasna::BERReader<'_, '_>) -> yasna::ASN1Result<Statement> {
    r.read_sequence(|r| {
        r.next().read_sequence(|r| {
            let (kind, statement) = r.next().read_sequence(|r| {
                r.next().read_sequence(|r| {
                    let kind = r.next().read_der()?;
                    let statement = r.next().read_der()?;
                    while r.read_optional(|r| r.read_der())?.is_some() {}
                    Ok((kind, statement))
                })
            })?;
            let certs = r
                .read_optional(|r| r.collect_sequence_of(|r| r.read_der()))?
                .unwrap_or_default();
            Ok((kind, statement, certs))
        })
    })
}

/// The certificates that issue the cluster's client certificates (`--people-client-ca`): the
/// CA of `kubernetes.io/kube-apiserver-client` (kube-controller-manager's
/// `--cluster-signing-cert-file`, usually the API server's `--client-ca-file`).
#[derive(Debug, Clone)]
pub struct ClientCas {
    ders: Vec<Vec<u8>>,
}

impl ClientCas {
    /// Reads a PEM bundle; fails when it holds no certificate, or one the strict reader
    /// refuses (said at start, not at the first renewal).
    pub fn from_pem_file(path: &std::path::Path) -> Result<ClientCas, PkiError> {
        let chain = super::cert::load_chain(path)?;
        let ders: Vec<Vec<u8>> = chain.into_iter().map(|c| c.to_vec()).collect();
        for (index, der) in ders.iter().enumerate() {
            Certificate::from_der_in_chain(der).map_err(|problem| PkiError::BadClientCa {
                path: path.to_path_buf(),
                index,
                problem,
            })?;
        }
        Ok(ClientCas { ders })
    }

    /// From DER certificates.
    pub fn from_ders(ders: Vec<Vec<u8>>) -> ClientCas {
        ClientCas { ders }
    }

    /// Whether one of these CAs issued and signed `cert`. A CA is read with the chain profile:
    /// kubeadm's and kind's carry a SAN (`DNS:kubernetes`), which a client certificate may not.
    fn issued(&self, cert: &Certificate) -> bool {
        self.ders
            .iter()
            .any(|der| Certificate::from_der_in_chain(der).is_ok_and(|ca| cert.is_signed_by(&ca)))
    }
}

/// What a verified current certificate showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SameKey {
    /// Its serial number (hex), for the decision's message.
    pub serial: String,
    /// When it expires (Unix seconds).
    pub not_after: i64,
}

fn refused(refusal: Refusal, message: impl Into<String>) -> Refused {
    Refused {
        refusal,
        message: message.into(),
    }
}

/// Checks that `cert_der` is a valid client certificate from `cas` for exactly the request's
/// subject and public key, and that the request's own signature verifies (possession). `now`
/// is Unix seconds.
pub fn verify_same_key(
    request: &Request,
    cert_der: &[u8],
    cas: &ClientCas,
    now: i64,
) -> Result<SameKey, Refused> {
    let invalid = |m: String| refused(Refusal::EvidenceInvalid, m);
    if !request.signature_verifies() {
        return Err(invalid(
            "the request's own signature does not verify with its key".into(),
        ));
    }
    // Read as kube-apiserver reads it (Go's x509 and pkix.Name), or refused.
    let cert = Certificate::from_der(cert_der)
        .map_err(|e| invalid(format!("the attached certificate is refused: {e}")))?;
    if !cas.issued(&cert) {
        return Err(invalid(
            "the attached certificate was not issued by the cluster's client CA".into(),
        ));
    }
    let (from, to) = (cert.not_before, cert.not_after);
    if now > to {
        return Err(invalid(format!(
            "the attached certificate expired {} s ago: a person whose certificate expired enrols again",
            now - to
        )));
    }
    if now < from {
        return Err(invalid(
            "the attached certificate is not valid yet".to_string(),
        ));
    }
    match cert.allows_client_auth() {
        Ok(true) => {}
        Ok(false) => {
            return Err(invalid(
                "the attached certificate is not for client authentication".into(),
            ))
        }
        Err(e) => return Err(invalid(format!("the attached certificate: {e}"))),
    }
    let certified = pairs(&cert.subject);
    let asked = pairs(&request.subject);
    if certified != asked {
        return Err(refused(
            Refusal::SubjectMismatch,
            format!(
                "the attached certificate is for {}, the request asks for {}",
                bounded(&text(&certified)),
                bounded(&text(&asked))
            ),
        ));
    }
    if cert.spki_der() != request.spki_der() {
        return Err(invalid(
            "the attached certificate is for another key than the request's: a renewal with a new key needs TPM evidence (hwkey renew --attest)".into(),
        ));
    }
    Ok(SameKey {
        serial: cert.serial_hex(),
        not_after: to,
    })
}

/// A name's attributes as sorted (dotted OID, value) pairs: the identity Go reads from a
/// strictly read name (CN and O sets, order aside).
fn pairs(names: &[SubjectAttribute]) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = names
        .iter()
        .map(|a| (a.oid.to_string(), a.value.clone()))
        .collect();
    pairs.sort();
    pairs
}

fn text(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(t, v)| {
            let short = match t.as_str() {
                "2.5.4.3" => "CN",
                "2.5.4.10" => "O",
                other => other,
            };
            format!("{short}={v}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// At most 64 characters of a value from a request, escaped, for a message.
fn bounded(value: &str) -> String {
    let escaped = value.escape_debug().to_string();
    match escaped.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &escaped[..at]),
        None => escaped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use yasna::models::ObjectIdentifier;

    /// A CA, and a client certificate from it for `subject` and `key`, valid `from..to`.
    fn issue(
        ca: &(rcgen::Certificate, rcgen::KeyPair),
        key: &rcgen::KeyPair,
        subject: &[(rcgen::DnType, &str)],
        from: time::OffsetDateTime,
        to: time::OffsetDateTime,
    ) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            dn.push(t.clone(), *v);
        }
        params.distinguished_name = dn;
        params.not_before = from;
        params.not_after = to;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = rcgen::Issuer::from_ca_cert_der(ca.0.der(), &ca.1).expect("issuer");
        params.signed_by(key, &issuer).expect("sign").der().to_vec()
    }

    fn ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().expect("key");
        // As kubeadm and kind make it: the cluster CA carries DNS:kubernetes.
        let mut params =
            rcgen::CertificateParams::new(vec!["kubernetes".to_string()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        (params.self_signed(&key).expect("CA"), key)
    }

    /// A request for `subject` (CN, then O values) signed by `key`, carrying `attribute`.
    fn request(
        key: &rcgen::KeyPair,
        cn: &str,
        orgs: &[&str],
        attribute: Option<Vec<u8>>,
    ) -> Request {
        let subject = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in orgs
                    .iter()
                    .map(|o| (&[2u64, 5, 4, 10][..], *o))
                    .chain([(&[2u64, 5, 4, 3][..], cn)])
                {
                    w.next().write_set(|w| {
                        w.next().write_sequence(|w| {
                            w.next().write_oid(&ObjectIdentifier::from_slice(oid));
                            w.next().write_utf8_string(value);
                        })
                    });
                }
            })
        });
        let spki = pem::parse(key.public_key_pem()).expect("SPKI PEM");
        let info = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_u8(0);
                w.next().write_der(&subject);
                w.next().write_der(spki.contents());
                w.next().write_tagged_implicit(yasna::Tag::context(0), |w| {
                    w.write_set_of(|w| {
                        if let Some(a) = &attribute {
                            w.next().write_der(a);
                        }
                    })
                });
            })
        });
        let signature = rcgen::SigningKey::sign(key, &info).expect("sign");
        let der = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&info);
                w.next().write_sequence(|w| {
                    w.next()
                        .write_oid(&ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 4, 3, 2]))
                });
                w.next().write_bitvec_bytes(&signature, signature.len() * 8);
            })
        });
        Request::from_der(der).expect("a well-formed request")
    }

    fn now() -> (time::OffsetDateTime, i64) {
        let t = time::OffsetDateTime::now_utc();
        (t, t.unix_timestamp())
    }

    /// The same-key proof holds only for a valid certificate from the client CA for exactly
    /// the request's subject and key: another key, an expired certificate, another CA, another
    /// subject are each refused with their reason.
    #[test]
    fn the_current_certificate_proves_only_its_own_key_and_subject() {
        use rcgen::DnType::{CommonName as Cn, OrganizationName as O};
        let (t, unix) = now();
        let hour = time::Duration::hours(1);
        let cluster = ca("cluster");
        let cas = ClientCas::from_ders(vec![cluster.0.der().to_vec()]);
        let key = rcgen::KeyPair::generate().expect("key");
        let alice = [(Cn, "alice"), (O, "devs")];
        let good = issue(&cluster, &key, &alice, t - hour, t + hour);
        let ok = request(&key, "alice", &["devs"], Some(attribute(&good)));
        assert_eq!(proof_of(&ok), Proof::CurrentCertificate(good.clone()));
        assert!(verify_same_key(&ok, &good, &cas, unix).is_ok());

        let other_key = rcgen::KeyPair::generate().expect("key");
        let rotated = request(&other_key, "alice", &["devs"], Some(attribute(&good)));
        let expired = issue(&cluster, &key, &alice, t - hour * 2, t - hour);
        let stranger = ca("cluster");
        let foreign = issue(&stranger, &key, &alice, t - hour, t + hour);
        let bob = issue(
            &cluster,
            &key,
            &[(Cn, "bob"), (O, "devs")],
            t - hour,
            t + hour,
        );
        for (what, request, cert, want, words) in [
            (
                "another key",
                &rotated,
                &good,
                Refusal::EvidenceInvalid,
                "another key",
            ),
            (
                "expired",
                &ok,
                &expired,
                Refusal::EvidenceInvalid,
                "expired",
            ),
            (
                "another CA",
                &ok,
                &foreign,
                Refusal::EvidenceInvalid,
                "client CA",
            ),
            (
                "another subject",
                &ok,
                &bob,
                Refusal::SubjectMismatch,
                "CN=bob",
            ),
        ] {
            let refused = verify_same_key(request, cert, &cas, unix).expect_err(what);
            assert_eq!(refused.refusal, want, "{what}: {refused}");
            assert!(refused.message.contains(words), "{what}: {refused}");
        }
        let more_groups = request(&key, "alice", &["devs", "ops"], None);
        assert_eq!(
            verify_same_key(&more_groups, &good, &cas, unix).map_err(|r| r.refusal),
            Err(Refusal::SubjectMismatch)
        );
    }

    /// A client certificate from `ca` with `subject` (a Name's DER, as given) for `key`'s
    /// public key, valid an hour either side of now: built by hand, so the subject can hold
    /// what no certificate library writes.
    fn issue_raw(
        ca: &(rcgen::Certificate, rcgen::KeyPair),
        key: &rcgen::KeyPair,
        subject: &[u8],
    ) -> Vec<u8> {
        let ecdsa = || ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 4, 3, 2]);
        let issuer = x509_parser::parse_x509_certificate(ca.0.der())
            .expect("CA")
            .1
            .subject()
            .as_raw()
            .to_vec();
        let spki = pem::parse(key.public_key_pem()).expect("SPKI PEM");
        let (t, _) = now();
        let time = |d: time::OffsetDateTime| {
            yasna::models::UTCTime::from_datetime(d.replace_nanosecond(0).expect("time"))
        };
        let tbs = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_tagged(yasna::Tag::context(0), |w| w.write_u8(2));
                w.next().write_u8(7);
                w.next().write_sequence(|w| w.next().write_oid(&ecdsa()));
                w.next().write_der(&issuer);
                w.next().write_sequence(|w| {
                    w.next().write_utctime(&time(t - time::Duration::hours(1)));
                    w.next().write_utctime(&time(t + time::Duration::hours(1)));
                });
                w.next().write_der(subject);
                w.next().write_der(spki.contents());
            })
        });
        let signature = rcgen::SigningKey::sign(&ca.1, &tbs).expect("sign");
        yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&tbs);
                w.next().write_sequence(|w| w.next().write_oid(&ecdsa()));
                w.next().write_bitvec_bytes(&signature, signature.len() * 8);
            })
        })
    }

    /// A CA-issued certificate (a review's finding) whose subject is `O=devs, CN=alice`, an
    /// empty RDN, then `CN=root`. x509-parser reads `CN=alice,O=devs` (it stops at the empty
    /// RDN), the request's subject, and approved the renewal; Go reads CN=root, the user
    /// kube-apiserver would authenticate. It is refused now, with the reason.
    #[test]
    fn a_certificate_go_reads_as_another_user_proves_nothing() {
        let (_, unix) = now();
        let cluster = ca("cluster");
        let cas = ClientCas::from_ders(vec![cluster.0.der().to_vec()]);
        let key = rcgen::KeyPair::generate().expect("key");
        let rdn = |oid: &[u64], value: &str| {
            yasna::construct_der(|w| {
                w.write_set(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&ObjectIdentifier::from_slice(oid));
                        w.next().write_utf8_string(value);
                    })
                })
            })
        };
        let subject = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&rdn(&[2, 5, 4, 10], "devs"));
                w.next().write_der(&rdn(&[2, 5, 4, 3], "alice"));
                w.next().write_der(&[0x31, 0x00]);
                w.next().write_der(&rdn(&[2, 5, 4, 3], "root"));
            })
        });
        let hidden = issue_raw(&cluster, &key, &subject);
        let alice = request(&key, "alice", &["devs"], Some(attribute(&hidden)));
        let refused =
            verify_same_key(&alice, &hidden, &cas, unix).expect_err("an empty RDN hides CN=root");
        assert_eq!(refused.refusal, Refusal::EvidenceInvalid, "{refused}");
        assert!(refused.message.contains("empty RDN"), "{refused}");
        // The same certificate without the empty RDN and CN=root holds: only the hidden part
        // is refused.
        let plain = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_der(&rdn(&[2, 5, 4, 10], "devs"));
                w.next().write_der(&rdn(&[2, 5, 4, 3], "alice"));
            })
        });
        let good = issue_raw(&cluster, &key, &plain);
        assert!(verify_same_key(&alice, &good, &cas, unix).is_ok());
    }

    #[test]
    fn a_second_certificate_or_an_unknown_statement_is_unreadable() {
        let key = rcgen::KeyPair::generate().expect("key");
        let (t, _) = now();
        let cluster = ca("cluster");
        let cert = issue(
            &cluster,
            &key,
            &[(rcgen::DnType::CommonName, "alice")],
            t - time::Duration::hours(1),
            t + time::Duration::hours(1),
        );
        assert_eq!(proof_of(&request(&key, "alice", &[], None)), Proof::Missing);
        // Two values in the one attribute: the attribute's SET holds a bundle twice.
        let two = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_oid(&ObjectIdentifier::from_slice(OID_EVIDENCE));
                w.next().write_set_of(|w| {
                    for _ in 0..2 {
                        w.next().write_sequence(|w| {
                            w.next().write_sequence(|w| {
                                w.next().write_sequence(|w| {
                                    w.next().write_der(OID_CURRENT_CERTIFICATE_DER);
                                    w.next().write_der(&cert);
                                })
                            })
                        });
                    }
                });
            })
        });
        assert!(matches!(
            proof_of(&request(&key, "alice", &[], Some(two))),
            Proof::Unreadable(_)
        ));
    }
}
