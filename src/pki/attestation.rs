//! TPM attestation evidence carried inside a PKCS#10 request, and the check an approver makes.
//!
//! Encoding (documented in docs/ATTESTATION.md), following the structure of the IETF LAMPS draft
//! "Use of Remote Attestation with Certification Signing Requests"
//! (draft-ietf-lamps-csr-attestation):
//!
//! ```text
//! Attribute ::= SEQUENCE { id-aa-evidence (1.2.840.113549.1.9.16.2.59), SET { EvidenceBundles } }
//! EvidenceBundles ::= SEQUENCE OF EvidenceBundle            -- one
//! EvidenceBundle ::= SEQUENCE { evidences SEQUENCE OF EvidenceStatement,   -- one
//!                              certs SEQUENCE OF Certificate OPTIONAL }  -- the EK certificate
//! EvidenceStatement ::= SEQUENCE {
//!     type  OBJECT IDENTIFIER,  -- hwkey-tpm2-certify: 2.25.142373734267622900942609493865913809953
//!     stmt  SEQUENCE { attest OCTET STRING,      -- TPMS_ATTEST
//!                      signature OCTET STRING,   -- TPMT_SIGNATURE by the AK
//!                      keyPublic OCTET STRING,   -- TPMT_PUBLIC of the certified key
//!                      akPublic OCTET STRING },  -- TPMT_PUBLIC of the AK
//!     hint  UTF8String }        -- "hwkey TPM2_Certify"
//! ```
//!
//! The TPM's qualifying data is SHA-256(subject Name DER || SubjectPublicKeyInfo DER) of the
//! request, so evidence made for one request fails on any other (another subject or key).

use std::path::Path;

use super::PkiError;
use crate::key::attestation::TpmEvidence;

/// `id-aa-evidence` of the LAMPS draft.
const OID_EVIDENCE: &[u64] = &[1, 2, 840, 113549, 1, 9, 16, 2, 59];
/// DER of hwkey's statement type, a UUID OID (2.25.…): the draft registers no TPM2_Certify type.
const OID_TPM2_CERTIFY_DER: &[u8] = &[
    0x06, 0x14, 0x69, 0x81, 0xd6, 0x9c, 0x97, 0xc3, 0xc9, 0xe0, 0xd2, 0xb1, 0xaf, 0x9a, 0x9b, 0x8f,
    0xe3, 0xe5, 0xe8, 0xa9, 0xf8, 0x21,
];
const HINT: &str = "hwkey TPM2_Certify";

/// The qualifying data that binds evidence to a request's subject and key.
pub fn qualifying_data(subject_der: &[u8], spki_der: &[u8]) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(subject_der);
    ctx.update(spki_der);
    ctx.finish().as_ref().to_vec()
}

/// The request attribute (DER `Attribute`) carrying `evidence`.
pub fn evidence_attribute(evidence: &TpmEvidence) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next()
                .write_oid(&yasna::models::ObjectIdentifier::from_slice(OID_EVIDENCE));
            w.next().write_set(|w| {
                w.next().write_sequence(|w| {
                    // EvidenceBundles: one bundle
                    w.next().write_sequence(|w| {
                        // evidences: one statement
                        w.next().write_sequence(|w| {
                            w.next().write_sequence(|w| {
                                w.next().write_der(OID_TPM2_CERTIFY_DER);
                                w.next().write_sequence(|w| {
                                    w.next().write_bytes(&evidence.attest);
                                    w.next().write_bytes(&evidence.signature);
                                    w.next().write_bytes(&evidence.key_public);
                                    w.next().write_bytes(&evidence.ak_public);
                                });
                                w.next().write_utf8_string(HINT);
                            });
                        });
                        // certs: the EK certificate, when the TPM has one.
                        if let Some(cert) = &evidence.ek_certificate {
                            w.next().write_sequence(|w| w.next().write_der(cert));
                        }
                    });
                });
            });
        })
    })
}

/// Why a request is not admitted, as an approver reports it (the condition reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The request carries no hwkey TPM evidence.
    NoEvidence,
    /// The evidence does not hold (signature, binding, key, attributes).
    EvidenceInvalid,
    /// The evidence holds, but its attestation key is not registered.
    UnknownAttestationKey,
}

impl Refusal {
    /// The reason as a Kubernetes condition reason.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::NoEvidence => "NoEvidence",
            Refusal::EvidenceInvalid => "EvidenceInvalid",
            Refusal::UnknownAttestationKey => "UnknownAttestationKey",
        }
    }
}

/// A refused request: the reason and what exactly did not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", .refusal.reason())]
pub struct Refused {
    /// The reason.
    pub refusal: Refusal,
    /// What did not hold.
    pub message: String,
}

#[cfg(feature = "tpm")]
fn refused(refusal: Refusal, message: impl Into<String>) -> Refused {
    Refused {
        refusal,
        message: message.into(),
    }
}

/// A registered node: its name (the trust file's name) and its AK's TPM name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredAk {
    /// The node the AK belongs to.
    pub node: String,
    /// The AK's TPM name.
    pub ak_name: Vec<u8>,
}

/// Reads a registration: what `hwkey attest enroll` printed for `node` (`akName: HEX` is the
/// line that counts). The same text is a file in a `--trust` directory or a ConfigMap entry.
pub fn parse_registration(node: &str, text: &str) -> Result<RegisteredAk, String> {
    let name = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("akName:"))
        .map(str::trim)
        .ok_or_else(|| {
            format!("{node} has no akName line: store what `hwkey attest enroll` printed")
        })?;
    let ak_name = unhex(name).ok_or_else(|| format!("{node}: akName is not hex"))?;
    Ok(RegisteredAk {
        node: node.to_string(),
        ak_name,
    })
}

/// Reads a `--trust` directory: one file per node, named after it, holding what
/// `hwkey attest enroll` printed. Hidden entries are skipped, so a directory a Kubernetes
/// ConfigMap is mounted on (its `..data` links) reads as the ConfigMap's entries.
pub fn read_trust_dir(dir: &Path) -> Result<Vec<RegisteredAk>, PkiError> {
    let bad = |reason: String| PkiError::BadTrust {
        path: dir.to_path_buf(),
        reason,
    };
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| bad(e.to_string()))?;
    for entry in entries {
        let entry = entry.map_err(|e| bad(e.to_string()))?;
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let Some(node) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if node.starts_with('.') {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("{node}: {e}")))?;
        out.push(parse_registration(node, &text).map_err(bad)?);
    }
    Ok(out)
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(feature = "tpm")]
/// Finds hwkey's TPM evidence in a request's attributes. The attributes are read from the raw
/// `CertificationRequestInfo` (x509-parser keeps no value for attribute types it does not know).
fn find_evidence(cri_raw: &[u8]) -> Option<Result<TpmEvidence, String>> {
    let mut attributes: Vec<Vec<u8>> = Vec::new();
    let parsed = yasna::parse_der(cri_raw, |r| {
        r.read_sequence(|r| {
            r.next().read_u8()?;
            r.next().read_der()?; // subject
            r.next().read_der()?; // subjectPKInfo
            r.next().read_tagged_implicit(yasna::Tag::context(0), |r| {
                r.read_set_of(|r| {
                    attributes.push(r.read_der()?);
                    Ok(())
                })
            })
        })
    });
    if let Err(e) = parsed {
        return Some(Err(format!("the request's attributes do not parse: {e}")));
    }
    let wanted = yasna::models::ObjectIdentifier::from_slice(OID_EVIDENCE);
    attributes.iter().find_map(|attribute| {
        let (oid, values) = yasna::parse_der(attribute, |r| {
            r.read_sequence(|r| Ok((r.next().read_oid()?, r.next().read_der()?)))
        })
        .ok()?;
        (oid == wanted).then(|| decode_evidence(&values))
    })
}

/// Reads the evidence from the attribute's `values` (DER `SET`, one `EvidenceBundles`).
#[cfg(feature = "tpm")]
fn decode_evidence(values: &[u8]) -> Result<TpmEvidence, String> {
    let mut found = None;
    yasna::parse_der(values, |r| {
        r.read_set_of(|r| {
            found = Some(read_bundles(r)?);
            Ok(())
        })
    })
    .map_err(|e| format!("the evidence attribute does not parse: {e}"))?;
    found.ok_or_else(|| "the evidence attribute holds no statement".to_string())
}

/// EvidenceBundles (one bundle) → evidences (one statement) → hwkey's TPM2_Certify statement.
#[cfg(feature = "tpm")]
fn read_bundles(r: yasna::BERReader<'_, '_>) -> yasna::ASN1Result<TpmEvidence> {
    r.read_sequence(|r| {
        r.next().read_sequence(|r| {
            let mut evidence = r.next().read_sequence(|r| {
                r.next().read_sequence(|r| {
                    if r.next().read_der()? != OID_TPM2_CERTIFY_DER {
                        return Err(yasna::ASN1Error::new(yasna::ASN1ErrorKind::Invalid));
                    }
                    let evidence = r.next().read_sequence(|r| {
                        Ok(TpmEvidence {
                            attest: r.next().read_bytes()?,
                            signature: r.next().read_bytes()?,
                            key_public: r.next().read_bytes()?,
                            ak_public: r.next().read_bytes()?,
                            ek_certificate: None,
                        })
                    })?;
                    r.read_optional(|r| r.read_utf8string())?;
                    Ok(evidence)
                })
            })?;
            // certs (optional): the first is the EK certificate.
            let certs = r.read_optional(|r| r.collect_sequence_of(|r| r.read_der()))?;
            evidence.ek_certificate = certs.and_then(|c| c.into_iter().next());
            Ok(evidence)
        })
    })
}

/// A request whose evidence holds: its key is certified by the AK named here. Whether that AK
/// belongs to a registered node is [`admit`]'s question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attested {
    /// The TPM name of the AK that certified the key.
    pub ak_name: Vec<u8>,
    /// The request's subject.
    pub subject: String,
    /// The issuer of the EK certificate the evidence carries, if any (informational: not
    /// checked against any CA here).
    pub ek_certificate_issuer: Option<String>,
}

/// A request that passed: the registered node whose TPM holds its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The node (trust file) whose AK certified the key.
    pub node: String,
    /// The AK's TPM name, hex.
    pub ak_name: String,
    /// The request's subject.
    pub subject: String,
    /// The issuer of the EK certificate the evidence carries, if any (not checked).
    pub ek_certificate_issuer: Option<String>,
}

/// Checks a PKCS#10 request (DER): its own signature, the TPM evidence it carries, and that the
/// evidence's AK is registered in `trusted`.
#[cfg(feature = "tpm")]
pub fn verify_request(csr_der: &[u8], trusted: &[RegisteredAk]) -> Result<Admitted, Refused> {
    admit(verify_evidence(csr_der)?, trusted)
}

/// Checks a PKCS#10 request (DER) and the TPM evidence it carries, without the trust lookup:
/// the request's own signature, the AK's signature over TPMS_ATTEST, the certified key's name,
/// attributes and binding to this request.
#[cfg(feature = "tpm")]
pub fn verify_evidence(csr_der: &[u8]) -> Result<Attested, Refused> {
    use x509_parser::prelude::FromDer;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(csr_der)
        .map_err(|e| {
            refused(
                Refusal::EvidenceInvalid,
                format!("not a PKCS#10 request: {e}"),
            )
        })?;
    csr.verify_signature().map_err(|e| {
        refused(
            Refusal::EvidenceInvalid,
            format!("the request's own signature does not verify: {e}"),
        )
    })?;
    let cri = &csr.certification_request_info;
    let evidence = find_evidence(cri.raw)
        .ok_or_else(|| {
            refused(
                Refusal::NoEvidence,
                "the request carries no TPM evidence (made without `hwkey csr --attest`?)",
            )
        })?
        .map_err(|e| refused(Refusal::EvidenceInvalid, e))?;
    let qualifying = qualifying_data(cri.subject.as_raw(), cri.subject_pki.raw);
    let ak_name = crate::key::attestation::verify(&evidence, cri.subject_pki.raw, &qualifying)
        .map_err(|e| refused(Refusal::EvidenceInvalid, e.0))?;
    let ek_certificate_issuer = evidence.ek_certificate.as_deref().map(|der| {
        x509_parser::parse_x509_certificate(der)
            .map(|(_, c)| c.issuer().to_string())
            .unwrap_or_else(|_| "an unreadable certificate".into())
    });
    Ok(Attested {
        ak_name,
        subject: cri.subject.to_string(),
        ek_certificate_issuer,
    })
}

/// Admits attested evidence when its AK is registered in `trusted`.
#[cfg(feature = "tpm")]
pub fn admit(attested: Attested, trusted: &[RegisteredAk]) -> Result<Admitted, Refused> {
    use crate::key::attestation::hex;
    let node = trusted
        .iter()
        .find(|t| t.ak_name == attested.ak_name)
        .ok_or_else(|| {
            refused(
                Refusal::UnknownAttestationKey,
                format!(
                    "attestation key {} is not registered (register the node with what `hwkey attest enroll` prints)",
                    hex(&attested.ak_name)
                ),
            )
        })?;
    Ok(Admitted {
        node: node.node.clone(),
        ak_name: hex(&attested.ak_name),
        subject: attested.subject,
        ek_certificate_issuer: attested.ek_certificate_issuer,
    })
}
