//! What travels between a node and the approver when a TPM joins by its EK certificate, with
//! only a bootstrap token (docs/ATTESTATION.md, "Zero-touch bootstrap"):
//!
//! 1. the node's **carrier request**, a CertificateSigningRequest for [`CREDENTIAL_SIGNER`]
//!    whose PKCS#10 holds the TPM2_Certify evidence of the node key (as a kubelet request
//!    does), annotated with the TPM's enrollment (AK, EK, EK certificate and its NV
//!    intermediates: [`ANNOTATION_ENROLLMENT`]);
//! 2. the approver's **carrier certificate** ([`carrier_certificate`]), written as that
//!    request's `status.certificate`: nothing trusts it (self-signed by a key made for it and
//!    dropped, not a CA, an hour's validity); its subject directory attributes hold the
//!    credential (TPM2_MakeCredential to the EK for the AK's name);
//! 3. the node's kubelet client request, annotated with the carrier's name and the secret the
//!    TPM released ([`ANNOTATION_CARRIER`], [`ANNOTATION_ANSWER`]).
//!
//! The secret is not stored anywhere: [`credential_secret`] derives it, under the approver's
//! key, from everything the answer is bound to, so any replica checks an answer.

use yasna::models::ObjectIdentifier;

/// The signer name of carrier requests: hwkey's own, which no API server, kubelet or client
/// trusts.
pub const CREDENTIAL_SIGNER: &str = "hwkey.dev/tpm-credential";

/// The kubelet request's annotation naming the carrier request whose credential it answers.
pub const ANNOTATION_CARRIER: &str = "hwkey.dev/credential-carrier";

/// The kubelet request's annotation holding the secret the TPM released, hex.
pub const ANNOTATION_ANSWER: &str = "hwkey.dev/credential-answer";

/// A carrier request's `spec.usages` (the API server wants one; the carrier certificate has
/// no key usage at all).
pub const CARRIER_USAGES: &[&str] = &["digital signature"];

/// The carrier request's annotation holding the TPM's enrollment: YAML as `hwkey attest
/// enroll` prints it (AK and EK public areas, EK certificate, NV intermediates). At most
/// [`ENROLLMENT_MAX`] bytes.
pub const ANNOTATION_ENROLLMENT: &str = "hwkey.dev/tpm-enrollment";

/// The largest enrollment read (an EK certificate and a few intermediates fit: about 5 KiB).
pub const ENROLLMENT_MAX: usize = 16 * 1024;

/// The content bytes of hwkey's UUID arc, `2.25.142373734267622900942609493865913809953` (the
/// TPM2_Certify statement type is this arc itself).
const HWKEY_ARC: &[u8] = &[
    0x69, 0x81, 0xd6, 0x9c, 0x97, 0xc3, 0xc9, 0xe0, 0xd2, 0xb1, 0xaf, 0x9a, 0x9b, 0x8f, 0xe3, 0xe5,
    0xe8, 0xa9, 0xf8, 0x21,
];

/// The content bytes of `2.25.<hwkey uuid>.<sub>` (`sub` < 128).
fn hwkey_oid(sub: u8) -> Vec<u8> {
    let mut oid = HWKEY_ARC.to_vec();
    oid.push(sub & 0x7f);
    oid
}

/// An OID's DER from its content bytes.
fn oid_der(content: &[u8]) -> Vec<u8> {
    let mut der = vec![0x06, u8::try_from(content.len()).unwrap_or(0)];
    der.extend_from_slice(content);
    der
}

/// The attribute of the carrier certificate's subject directory attributes that holds the
/// credential (content bytes). Go's `crypto/x509` reads an extension's OID into an `[]int`, so
/// an extension of hwkey's UUID arc would make the API server refuse the certificate; inside
/// the standard subjectDirectoryAttributes extension (RFC 5280, 4.2.1.8), which Go does not
/// read, the attribute's type can be.
pub fn oid_credential() -> Vec<u8> {
    hwkey_oid(2)
}

/// subjectDirectoryAttributes, 2.5.29.9 (content bytes).
const OID_SUBJECT_DIRECTORY_ATTRIBUTES: &[u8] = &[0x55, 0x1d, 0x09];

/// Why a carrier certificate cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum JoinFormatError {
    #[error("the carrier certificate does not parse: {0}")]
    Certificate(String),
    #[error("the carrier certificate holds no credential extension")]
    NoCredential,
    #[error("the credential extension does not parse: {0}")]
    Credential(String),
}

/// The credential the approver made: what `TPM2_ActivateCredential` takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// `TPM2B_ID_OBJECT` contents.
    pub credential_blob: Vec<u8>,
    /// `TPM2B_ENCRYPTED_SECRET` contents.
    pub encrypted_secret: Vec<u8>,
    /// When the answer stops being accepted (Unix seconds).
    pub expires_at: i64,
}

/// The secret a credential carries, derived rather than stored: HMAC-SHA256 under the
/// approver's `key` of the carrier request's uid, the AK's name, the EK's hash, the node name
/// and the expiry, each length-prefixed. Any replica with the key recomputes it from the
/// carrier request alone; a changed input (another AK, node, request) gives another secret.
pub fn credential_secret(
    key: &[u8],
    carrier_uid: &str,
    ak_name: &[u8],
    ek_sha256: &str,
    node: &str,
    expires_at: i64,
) -> zeroize::Zeroizing<Vec<u8>> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(b"hwkey tpm-credential v1");
    for part in [
        carrier_uid.as_bytes(),
        ak_name,
        ek_sha256.as_bytes(),
        node.as_bytes(),
        &expires_at.to_be_bytes(),
    ] {
        ctx.update(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
        ctx.update(part);
    }
    zeroize::Zeroizing::new(ctx.sign().as_ref().to_vec())
}

/// Whether `answer` (hex, as the node wrote it) is `secret`, compared as HMACs so the timing
/// says nothing about the secret.
pub fn answer_matches(secret: &[u8], answer: &str) -> bool {
    let Ok(given) = hex::decode(answer.trim()) else {
        return false;
    };
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"hwkey answer comparison");
    let tag = ring::hmac::sign(&key, secret);
    ring::hmac::verify(&key, &given, tag.as_ref()).is_ok()
}

/// The carrier certificate (PEM) for `node`'s carrier request: self-signed by a P-256 key made
/// for it and dropped (no verifier holds an anchor for it), valid from `now` to
/// `credential.expires_at`, not a CA, and the credential in its subject directory attributes
/// (Go's `x509.ParseCertificate`, which the API server runs on every `status.certificate`,
/// accepts it).
pub fn carrier_certificate(
    node: &str,
    credential: &Credential,
    now: i64,
) -> Result<String, JoinFormatError> {
    use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
    let fail = |e: &dyn std::fmt::Display| JoinFormatError::Certificate(e.to_string());
    let random = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &random)
        .map_err(|e| fail(&e))?;
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &random)
        .map_err(|e| fail(&e))?;
    let mut serial = [0u8; 16];
    ring::rand::SecureRandom::fill(&random, &mut serial).map_err(|e| fail(&e))?;
    serial[0] &= 0x7f;
    serial[0] |= 0x01;
    let name = format!("hwkey tpm-credential for {node}");
    let tbs = carrier_tbs(&name, &serial, pair.public_key().as_ref(), credential, now)?;
    let signature = pair.sign(&random, &tbs).map_err(|e| fail(&e))?;
    let der = yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_der(&tbs);
            write_ecdsa_sha256(w.next());
            w.next()
                .write_bitvec_bytes(signature.as_ref(), signature.as_ref().len() * 8);
        })
    });
    Ok(crate::key::der::to_pem("CERTIFICATE", &der))
}

fn write_ecdsa_sha256(w: yasna::DERWriter<'_>) {
    w.write_sequence(|w| {
        w.next()
            .write_oid(&ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 4, 3, 2]))
    });
}

/// The TBSCertificate of a carrier certificate.
fn carrier_tbs(
    name: &str,
    serial: &[u8],
    point: &[u8],
    credential: &Credential,
    now: i64,
) -> Result<Vec<u8>, JoinFormatError> {
    let (from, to) = (der_time(now - 60)?, der_time(credential.expires_at)?);
    let write_name = |w: yasna::DERWriter<'_>| {
        w.write_sequence(|w| {
            w.next().write_set(|w| {
                w.next().write_sequence(|w| {
                    w.next()
                        .write_oid(&ObjectIdentifier::from_slice(&[2, 5, 4, 3]));
                    w.next().write_utf8_string(name);
                })
            })
        })
    };
    let content = credential_extension(credential);
    let basic = yasna::construct_der(|w| w.write_sequence(|_| {}));
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next()
                .write_tagged(yasna::Tag::context(0), |w| w.write_u8(2));
            w.next().write_bigint_bytes(serial, true);
            write_ecdsa_sha256(w.next());
            write_name(w.next());
            w.next().write_sequence(|w| {
                w.next().write_der(&from);
                w.next().write_der(&to);
            });
            write_name(w.next());
            w.next().write_sequence(|w| {
                w.next().write_sequence(|w| {
                    w.next()
                        .write_oid(&ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 2, 1]));
                    w.next()
                        .write_oid(&ObjectIdentifier::from_slice(&[1, 2, 840, 10045, 3, 1, 7]));
                });
                w.next().write_bitvec_bytes(point, point.len() * 8);
            });
            w.next().write_tagged(yasna::Tag::context(3), |w| {
                w.write_sequence(|w| {
                    for (oid, critical, value) in [
                        (vec![0x55, 0x1d, 0x13], true, &basic),
                        (OID_SUBJECT_DIRECTORY_ATTRIBUTES.to_vec(), false, &content),
                    ] {
                        w.next().write_sequence(|w| {
                            w.next().write_der(&oid_der(&oid));
                            if critical {
                                w.next().write_bool(true);
                            }
                            w.next().write_bytes(value);
                        });
                    }
                })
            });
        })
    }))
}

/// A certificate time (RFC 5280: UTCTime until 2049, GeneralizedTime from 2050), DER.
fn der_time(t: i64) -> Result<Vec<u8>, JoinFormatError> {
    let t = time::OffsetDateTime::from_unix_timestamp(t)
        .map_err(|e| JoinFormatError::Certificate(e.to_string()))?;
    let rest = format!(
        "{:02}{:02}{:02}{:02}{:02}Z",
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    );
    let (tag, text) = if (1950..2050).contains(&t.year()) {
        (0x17, format!("{:02}{rest}", t.year() % 100))
    } else {
        (0x18, format!("{:04}{rest}", t.year()))
    };
    let mut der = vec![tag, u8::try_from(text.len()).unwrap_or(0)];
    der.extend_from_slice(text.as_bytes());
    Ok(der)
}

/// The subjectDirectoryAttributes value: `SEQUENCE OF Attribute` with one attribute of type
/// [`oid_credential`] whose one value is `SEQUENCE { credentialBlob OCTET STRING,
/// encryptedSecret OCTET STRING, expiresAt INTEGER }`.
fn credential_extension(credential: &Credential) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_sequence(|w| {
                w.next().write_der(&oid_der(&oid_credential()));
                w.next().write_set(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_bytes(&credential.credential_blob);
                        w.next().write_bytes(&credential.encrypted_secret);
                        w.next().write_i64(credential.expires_at);
                    })
                });
            })
        })
    })
}

/// The credential in a carrier certificate (the first CERTIFICATE of `pem`).
pub fn credential_of(pem_text: &[u8]) -> Result<Credential, JoinFormatError> {
    use x509_parser::prelude::FromDer as _;
    let block = ::pem::parse_many(pem_text)
        .map_err(|e| JoinFormatError::Certificate(e.to_string()))?
        .into_iter()
        .find(|b| b.tag() == "CERTIFICATE")
        .ok_or_else(|| JoinFormatError::Certificate("no CERTIFICATE block".into()))?;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(block.contents())
        .map_err(|e| JoinFormatError::Certificate(e.to_string()))?;
    let extension = cert
        .extensions()
        .iter()
        .find(|e| e.oid.as_bytes() == OID_SUBJECT_DIRECTORY_ATTRIBUTES)
        .ok_or(JoinFormatError::NoCredential)?;
    let wanted = oid_der(&oid_credential());
    let attributes = yasna::parse_der(extension.value, |r| {
        r.collect_sequence_of(|r| {
            r.read_sequence(|r| {
                let oid = r.next().read_der()?;
                let values = r.next().collect_set_of(|r| r.read_der())?;
                Ok((oid, values))
            })
        })
    })
    .map_err(|e| JoinFormatError::Credential(e.to_string()))?;
    let mut found = attributes.into_iter().filter(|(oid, _)| *oid == wanted);
    let (Some((_, values)), None) = (found.next(), found.next()) else {
        return Err(JoinFormatError::NoCredential);
    };
    let [value] = values.as_slice() else {
        return Err(JoinFormatError::Credential("not one value".into()));
    };
    yasna::parse_der(value, |r| {
        r.read_sequence(|r| {
            Ok(Credential {
                credential_blob: r.next().read_bytes()?,
                encrypted_secret: r.next().read_bytes()?,
                expires_at: r.next().read_i64()?,
            })
        })
    })
    .map_err(|e| JoinFormatError::Credential(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credential() -> Credential {
        Credential {
            credential_blob: vec![1; 68],
            encrypted_secret: vec![2; 256],
            expires_at: 1_900_000_000,
        }
    }

    #[test]
    fn the_carrier_certificate_carries_the_credential_and_nothing_usable() {
        let pem = carrier_certificate("node-a", &credential(), 1_800_000_000).expect("made");
        assert_eq!(
            credential_of(pem.as_bytes()).expect("read back"),
            credential()
        );
        let der = ::pem::parse(&pem).expect("pem").into_contents();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("parses");
        assert!(!cert.is_ca());
        assert!(cert.key_usage().expect("ok").is_none());
        assert!(cert.extended_key_usage().expect("ok").is_none());
        // Every extension's OID is one Go's crypto/x509 reads (each arc fits an int).
        for e in cert.extensions() {
            let arcs: Vec<u64> = e.oid.iter().expect("small arcs").collect();
            assert!(arcs.iter().all(|a| *a < 1 << 31), "{arcs:?}");
        }
        assert_eq!(cert.validity().not_after.timestamp(), 1_900_000_000);
        cert.verify_signature(None).expect("self-signed");
    }

    #[test]
    fn the_secret_changes_with_every_input_and_only_the_secret_answers() {
        let base = credential_secret(b"k", "uid", b"ak", "ek", "node", 5);
        for other in [
            credential_secret(b"K", "uid", b"ak", "ek", "node", 5),
            credential_secret(b"k", "uie", b"ak", "ek", "node", 5),
            credential_secret(b"k", "uid", b"al", "ek", "node", 5),
            credential_secret(b"k", "uid", b"ak", "el", "node", 5),
            credential_secret(b"k", "uid", b"ak", "ek", "nodf", 5),
            credential_secret(b"k", "uid", b"ak", "ek", "node", 6),
            // Length prefixes: moving a byte from one part to the next is another input.
            credential_secret(b"k", "ui", b"dak", "ek", "node", 5),
        ] {
            assert_ne!(base, other);
        }
        assert!(answer_matches(&base, &hex::encode(&base[..])));
        assert!(answer_matches(&base, &hex::encode_upper(&base[..])));
        assert!(!answer_matches(&base, &hex::encode(&base[..31])));
        assert!(!answer_matches(&base, "not hex"));
        assert!(!answer_matches(&base, ""));
    }
}
