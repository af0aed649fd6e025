//! What the signer signs, decided on the exact bytes it is asked to sign.
//!
//! - [`Purpose::Handshake`]: a TLS 1.3 client `CertificateVerify` content (64 spaces, the
//!   client context string, a zero byte, a SHA-256 or SHA-384 transcript hash: RFC 8446
//!   §4.4.3), or — only when TLS 1.2 is enabled — the TLS 1.2 handshake messages a client
//!   signs (ClientHello, ServerHello … ClientKeyExchange, each framed as a handshake message,
//!   nothing after). A server's context string, or anything else, is refused.
//! - [`Purpose::CertificateRequest`]: a DER `CertificationRequestInfo` (version 0) whose subject
//!   is the identity's (the subject of the certificate the signer started with, attribute by
//!   attribute), whose public key is the signing key's, and whose only attribute, if any, is
//!   hwkey's TPM evidence. Renewal never changes who the key is.
//! - [`Purpose::HealthCheck`]: [`HEALTH_CHECK_MESSAGE`] and nothing else.
//! - Certification (TPM2_Certify for `--attest`): for a request subject that is the identity's,
//!   made within [`CERTIFY_WINDOW`] of now; the signer binds subject, key and time itself.

use crate::key::{Purpose, SignScheme, HEALTH_CHECK_MESSAGE};

/// How far a certification's `made_at` may be from the signer's clock.
pub const CERTIFY_WINDOW: u64 = 300;

/// The TLS 1.3 context string of a client's CertificateVerify.
const CLIENT_CONTEXT: &[u8] = b"TLS 1.3, client CertificateVerify";

/// The identity a signer serves, and what else its purposes depend on.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The identity's subject as (attribute type, value) pairs in order.
    pub identity: Vec<(String, String)>,
    /// Whether TLS 1.2 handshakes are signed.
    pub tls12: bool,
}

/// Why a request was refused: the reason in words (logged, and sent back).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

impl From<String> for Refusal {
    fn from(s: String) -> Refusal {
        Refusal(s)
    }
}

impl From<&str> for Refusal {
    fn from(s: &str) -> Refusal {
        Refusal(s.to_string())
    }
}

impl Policy {
    /// The policy for `leaf` (DER, the certificate the signer started with).
    pub fn for_certificate(leaf: &[u8], tls12: bool) -> Result<Policy, Refusal> {
        let (_, cert) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| Refusal(format!("the identity's certificate does not parse: {e}")))?;
        Ok(Policy {
            identity: name_pairs(cert.subject())?,
            tls12,
        })
    }

    /// Whether `other` serves the same identity, read as Kubernetes reads it (see
    /// [`same_name`]): a renewed certificate that Go's CA wrote in its own attribute order is
    /// the same identity.
    pub fn same_subject(&self, other: &Policy) -> bool {
        same_name(&self.identity) == same_name(&other.identity)
    }

    /// Whether `message` may be signed for `purpose` by the key whose SPKI is `spki`.
    pub fn check(
        &self,
        purpose: Purpose,
        scheme: SignScheme,
        message: &[u8],
        spki: &[u8],
    ) -> Result<(), Refusal> {
        let _ = scheme;
        match purpose {
            Purpose::Handshake => {
                if tls13_client_verify(message) {
                    return Ok(());
                }
                if self.tls12 && tls12_client_verify(message) {
                    return Ok(());
                }
                Err(Refusal::from(if self.tls12 {
                    "not a TLS client CertificateVerify (1.3 content or 1.2 handshake messages)"
                } else {
                    "not a TLS 1.3 client CertificateVerify content"
                }))
            }
            Purpose::CertificateRequest => self.certification_request_info(message, spki),
            Purpose::HealthCheck => {
                if message == HEALTH_CHECK_MESSAGE {
                    Ok(())
                } else {
                    Err(Refusal::from("a health check signs only its fixed message"))
                }
            }
        }
    }

    /// Whether a certification for a request of `subject_der` made at `made_at` may be made.
    pub fn check_certify(&self, subject_der: &[u8], made_at: u64, now: u64) -> Result<(), Refusal> {
        if made_at.abs_diff(now) > CERTIFY_WINDOW {
            return Err(Refusal(format!(
                "evidence for a request made at {made_at} is not for now ({now})"
            )));
        }
        self.same_identity(subject_der)
    }

    fn certification_request_info(&self, message: &[u8], spki: &[u8]) -> Result<(), Refusal> {
        let info = read_cri(message)
            .map_err(|e| Refusal(format!("not a CertificationRequestInfo: {e}")))?;
        if info.spki != spki {
            return Err(Refusal::from(
                "a request for another public key than the signing key's",
            ));
        }
        for oid in &info.attributes {
            if oid.as_slice() != crate::pki::attestation::OID_EVIDENCE {
                return Err(Refusal(format!(
                    "a request with an attribute other than hwkey's evidence ({})",
                    oid.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
                )));
            }
        }
        self.same_identity(&info.subject)
    }

    fn same_identity(&self, subject_der: &[u8]) -> Result<(), Refusal> {
        use x509_parser::prelude::FromDer as _;
        let (rest, name) = x509_parser::x509::X509Name::from_der(subject_der)
            .map_err(|e| Refusal(format!("the subject does not parse: {e}")))?;
        if !rest.is_empty() {
            return Err(Refusal::from("bytes after the subject"));
        }
        let pairs = name_pairs(&name)?;
        if same_name(&pairs) != same_name(&self.identity) {
            return Err(Refusal(format!(
                "a request for another subject ({}) than the identity's ({})",
                text(&pairs),
                text(&self.identity)
            )));
        }
        Ok(())
    }
}

/// A name as (dotted OID, value) pairs in order; a value that is not a string is refused.
fn name_pairs(name: &x509_parser::x509::X509Name<'_>) -> Result<Vec<(String, String)>, Refusal> {
    name.iter_attributes()
        .map(|a| {
            let value = a.as_str().map_err(|_| {
                format!("a subject attribute {} that is not a string", a.attr_type())
            })?;
            Ok((a.attr_type().to_id_string(), value.to_string()))
        })
        .collect()
}

/// What decides whether two subjects are one identity, as Kubernetes reads a client
/// certificate: the attributes as a set, except the CNs, whose order counts (the last is the
/// user name). So a certificate issued as `CN=alice,O=devs` (most CAs' order) renews with
/// hwkey's request for `O=devs,CN=alice` (Go's order).
fn same_name(pairs: &[(String, String)]) -> (Vec<&(String, String)>, Vec<&str>) {
    const CN: &str = "2.5.4.3";
    let mut others: Vec<&(String, String)> = pairs.iter().filter(|(t, _)| t != CN).collect();
    others.sort();
    let cns = pairs
        .iter()
        .filter(|(t, _)| t == CN)
        .map(|(_, v)| v.as_str())
        .collect();
    (others, cns)
}

fn text(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(t, v)| format!("{t}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The TLS 1.3 client CertificateVerify content for a SHA-256 or SHA-384 transcript.
fn tls13_client_verify(message: &[u8]) -> bool {
    let head = 64 + CLIENT_CONTEXT.len() + 1;
    let hash_len = message.len().saturating_sub(head);
    message.len() > head
        && (hash_len == 32 || hash_len == 48)
        && message[..64].iter().all(|b| *b == 0x20)
        && &message[64..64 + CLIENT_CONTEXT.len()] == CLIENT_CONTEXT
        && message[head - 1] == 0
}

/// The handshake messages a TLS 1.2 client signs: framed handshake messages from a TLS 1.2
/// ClientHello and a ServerHello through the ClientKeyExchange, exactly filling `message`.
fn tls12_client_verify(message: &[u8]) -> bool {
    const CLIENT_HELLO: u8 = 1;
    const SERVER_HELLO: u8 = 2;
    const CLIENT_KEY_EXCHANGE: u8 = 16;
    let mut types = Vec::new();
    let mut at = 0usize;
    while at < message.len() {
        let Some(header) = message.get(at..at + 4) else {
            return false;
        };
        let len =
            usize::from(header[1]) << 16 | usize::from(header[2]) << 8 | usize::from(header[3]);
        if message.len() - at - 4 < len {
            return false;
        }
        types.push(header[0]);
        at += 4 + len;
    }
    let version_ok = message.get(4..6) == Some(&[3, 3][..]);
    types.len() >= 3
        && types[0] == CLIENT_HELLO
        && types[1] == SERVER_HELLO
        && types.last() == Some(&CLIENT_KEY_EXCHANGE)
        && version_ok
}

/// The parts of a `CertificationRequestInfo` the policy checks.
struct Cri {
    subject: Vec<u8>,
    spki: Vec<u8>,
    attributes: Vec<Vec<u64>>,
}

/// Reads a DER `CertificationRequestInfo` strictly (yasna reads DER only): version 0, the
/// subject and SPKI as their DER, the attribute types.
fn read_cri(der: &[u8]) -> Result<Cri, yasna::ASN1Error> {
    yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            let version = r.next().read_u8()?;
            if version != 0 {
                return Err(yasna::ASN1Error::new(yasna::ASN1ErrorKind::Invalid));
            }
            let subject = r.next().read_der()?;
            let spki = r.next().read_der()?;
            let attributes = r.next().read_tagged_implicit(yasna::Tag::context(0), |r| {
                r.collect_set_of(|r| {
                    r.read_sequence(|r| {
                        let oid = r.next().read_oid()?;
                        let _values = r.next().read_der()?;
                        Ok(oid.components().to_vec())
                    })
                })
            })?;
            Ok(Cri {
                subject,
                spki,
                attributes,
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls13(hash: usize) -> Vec<u8> {
        let mut m = vec![0x20; 64];
        m.extend_from_slice(CLIENT_CONTEXT);
        m.push(0);
        m.extend(std::iter::repeat_n(7u8, hash));
        m
    }

    fn policy(tls12: bool) -> Policy {
        Policy {
            identity: vec![("2.5.4.3".into(), "alice".into())],
            tls12,
        }
    }

    #[test]
    fn only_a_client_certificate_verify_is_a_handshake() {
        let p = policy(false);
        let ok = |m: &[u8]| {
            p.check(Purpose::Handshake, SignScheme::EcdsaP256Sha256, m, b"")
                .is_ok()
        };
        assert!(ok(&tls13(32)) && ok(&tls13(48)));
        assert!(!ok(&tls13(31)) && !ok(&tls13(64)) && !ok(&tls13(0)));
        let mut server = tls13(32);
        server[64..64 + CLIENT_CONTEXT.len()].copy_from_slice(b"TLS 1.3, server CertificateVerify");
        assert!(!ok(&server));
        let mut spaces = tls13(32);
        spaces[3] = b'x';
        assert!(!ok(&spaces));
        assert!(!ok(b"{\"alg\":\"ES256\"}.payload"));
        assert!(!ok(HEALTH_CHECK_MESSAGE));
    }

    #[test]
    fn tls12_transcripts_only_when_tls12_is_on() {
        let msg = |t: u8, body: &[u8]| {
            let mut m = vec![t, 0, 0, body.len() as u8];
            m.extend_from_slice(body);
            m
        };
        let mut transcript = msg(1, &[3, 3, 9, 9]);
        transcript.extend(msg(2, &[3, 3]));
        transcript.extend(msg(11, &[1, 2, 3]));
        transcript.extend(msg(16, &[4]));
        let check = |p: &Policy, m: &[u8]| {
            p.check(Purpose::Handshake, SignScheme::RsaPkcs1Sha256, m, b"")
                .is_ok()
        };
        assert!(check(&policy(true), &transcript));
        assert!(!check(&policy(false), &transcript));
        let mut trailing = transcript.clone();
        trailing.push(0);
        assert!(!check(&policy(true), &trailing));
        let mut cut = transcript.clone();
        cut.pop();
        assert!(!check(&policy(true), &cut));
        assert!(!check(&policy(true), &transcript[8..]));
    }

    #[test]
    fn a_health_check_signs_its_message_only() {
        let p = policy(false);
        assert!(p
            .check(
                Purpose::HealthCheck,
                SignScheme::EcdsaP256Sha256,
                HEALTH_CHECK_MESSAGE,
                b""
            )
            .is_ok());
        assert!(p
            .check(
                Purpose::HealthCheck,
                SignScheme::EcdsaP256Sha256,
                &tls13(32),
                b""
            )
            .is_err());
    }

    #[test]
    fn certifications_are_for_now() {
        let p = policy(false);
        let subject = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next().write_set(|w| {
                    w.next().write_sequence(|w| {
                        w.next()
                            .write_oid(&yasna::models::ObjectIdentifier::from_slice(&[2, 5, 4, 3]));
                        w.next().write_utf8_string("alice");
                    })
                })
            })
        });
        assert!(p.check_certify(&subject, 1000, 1100).is_ok());
        assert!(p.check_certify(&subject, 1000, 1400).is_err());
    }

    fn name(pairs: &[(&[u64], &str)]) -> Vec<u8> {
        yasna::construct_der(|w| {
            w.write_sequence(|w| {
                for (oid, value) in pairs {
                    w.next().write_set(|w| {
                        w.next().write_sequence(|w| {
                            w.next()
                                .write_oid(&yasna::models::ObjectIdentifier::from_slice(oid));
                            w.next().write_utf8_string(value);
                        })
                    })
                }
            })
        })
    }

    /// A certificate issued as CN=alice,O=devs (a CA's order) renews with hwkey's request for
    /// O=devs,CN=alice (Go's order): the signer refused this before, so a person's
    /// exec-started proxy never renewed. Another identity, or CNs in another order, still
    /// are refused.
    #[test]
    fn the_identity_is_the_same_whatever_the_order_of_its_attributes_but_the_cns() {
        const CN: &[u64] = &[2, 5, 4, 3];
        const O: &[u64] = &[2, 5, 4, 10];
        let p = Policy {
            identity: vec![
                ("2.5.4.3".into(), "alice".into()),
                ("2.5.4.10".into(), "devs".into()),
            ],
            tls12: false,
        };
        assert!(p
            .same_identity(&name(&[(O, "devs"), (CN, "alice")]))
            .is_ok());
        assert!(p
            .same_identity(&name(&[(CN, "alice"), (O, "devs")]))
            .is_ok());
        assert!(p
            .same_identity(&name(&[(O, "ops"), (CN, "alice")]))
            .is_err());
        assert!(p
            .same_identity(&name(&[(O, "devs"), (O, "ops"), (CN, "alice")]))
            .is_err());
        let two = Policy {
            identity: vec![
                ("2.5.4.3".into(), "alice".into()),
                ("2.5.4.3".into(), "bob".into()),
            ],
            tls12: false,
        };
        assert!(two
            .same_identity(&name(&[(CN, "alice"), (CN, "bob")]))
            .is_ok());
        assert!(two
            .same_identity(&name(&[(CN, "bob"), (CN, "alice")]))
            .is_err());
    }
}
