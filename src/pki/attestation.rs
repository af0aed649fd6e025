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
//!                      akPublic OCTET STRING,   -- TPMT_PUBLIC of the AK
//!                      madeAt INTEGER },        -- when it was made, Unix seconds
//!     hint  UTF8String }        -- "hwkey TPM2_Certify"
//! ```
//!
//! The TPM's qualifying data is SHA-256(subject Name DER || SubjectPublicKeyInfo DER || madeAt as
//! 8 bytes big-endian) of the request, so evidence made for one request fails on any other
//! (another subject or key), and its time cannot be changed without the TPM: an approver can
//! refuse evidence older than its window (an old blob of a key rotated away).

#[cfg(feature = "tpm")]
use super::request::Request;
use crate::key::attestation::TpmEvidence;

/// `id-aa-evidence` of the LAMPS draft: the attribute type of hwkey's evidence.
pub const OID_EVIDENCE: &[u64] = &[1, 2, 840, 113549, 1, 9, 16, 2, 59];
/// DER of hwkey's statement type, a UUID OID (2.25.…): the draft registers no TPM2_Certify type.
pub(crate) const OID_TPM2_CERTIFY_DER: &[u8] = &[
    0x06, 0x14, 0x69, 0x81, 0xd6, 0x9c, 0x97, 0xc3, 0xc9, 0xe0, 0xd2, 0xb1, 0xaf, 0x9a, 0x9b, 0x8f,
    0xe3, 0xe5, 0xe8, 0xa9, 0xf8, 0x21,
];
const HINT: &str = "hwkey TPM2_Certify";

pub use crate::key::attestation::{qualifying_data, unix_now};

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
                                    if let Some(made_at) = evidence.made_at {
                                        w.next().write_u64(made_at);
                                    }
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
    /// The evidence holds and its AK is registered, but for another node than the one asked for.
    SubjectMismatch,
}

impl Refusal {
    /// The reason as a Kubernetes condition reason.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::NoEvidence => "NoEvidence",
            Refusal::EvidenceInvalid => "EvidenceInvalid",
            Refusal::UnknownAttestationKey => "UnknownAttestationKey",
            Refusal::SubjectMismatch => "SubjectMismatch",
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

pub use super::registration::{parse_registration, read_trust_dir, RegisteredAk};

#[cfg(feature = "tpm")]
/// Finds hwkey's TPM evidence in a request's attributes (the first evidence attribute; the
/// approver's policy refuses a second one).
fn find_evidence(request: &Request) -> Option<Result<TpmEvidence, Unreadable>> {
    let attribute = *request.attributes_of(OID_EVIDENCE).first()?;
    Some(match attribute.values.as_slice() {
        [one] => decode_evidence(one),
        _ => Err(Unreadable::NotOneValue),
    })
}

/// Reads the evidence from the attribute's value (one `EvidenceBundles`).
#[cfg(feature = "tpm")]
fn decode_evidence(value: &[u8]) -> Result<TpmEvidence, Unreadable> {
    yasna::parse_der(value, read_bundles).map_err(Unreadable::Attribute)
}

/// Why the evidence attribute of a request cannot be read.
#[cfg(feature = "tpm")]
#[derive(Debug, thiserror::Error)]
enum Unreadable {
    #[error("the evidence attribute does not hold exactly one value")]
    NotOneValue,
    #[error("the evidence attribute does not parse: {0}")]
    Attribute(#[source] yasna::ASN1Error),
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
                            made_at: r.read_optional(|r| r.read_u64())?,
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
/// belongs to a registered node is [`admit`]'s question; whether the evidence is fresh is the
/// approver's (it knows when the request was made).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attested {
    /// The TPM name of the AK that certified the key.
    pub ak_name: Vec<u8>,
    /// When the evidence was made (Unix seconds, bound into what the TPM signed).
    pub made_at: u64,
    /// SHA-256 of the TPM's `TPMS_ATTEST`: the same evidence in two requests has the same digest.
    pub evidence_digest: [u8; 32],
    /// The request's subject (for messages only: decisions read the DER RDNs).
    pub subject: String,
    /// The issuer of the EK certificate the evidence carries, if any (informational: not
    /// checked against any CA here).
    pub ek_certificate_issuer: Option<String>,
}

/// A request that passed: the registered node whose TPM holds its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The node (trust entry) whose AK certified the key.
    pub node: String,
    /// The AK's TPM name, hex.
    pub ak_name: String,
    /// The request's subject.
    pub subject: String,
    /// When the evidence was made (Unix seconds).
    pub made_at: u64,
    /// SHA-256 of the evidence's `TPMS_ATTEST`.
    pub evidence_digest: [u8; 32],
    /// The issuer of the EK certificate the evidence carries, if any (not checked).
    pub ek_certificate_issuer: Option<String>,
}

/// Checks a request that asks for node `node`: its own signature, the TPM evidence it
/// carries, and that the evidence's AK is registered for that very node in `trusted`.
#[cfg(feature = "tpm")]
pub fn verify_request(
    request: &Request,
    node: &str,
    trusted: &[RegisteredAk],
) -> Result<Admitted, Refused> {
    admit(verify_evidence(request)?, node, trusted)
}

/// Checks a request and the TPM evidence it carries, without the trust lookup: the request's
/// own signature, the AK's signature over TPMS_ATTEST, the certified key's name, attributes
/// and binding to this request (its exact subject and key bytes, and the time it was made).
#[cfg(feature = "tpm")]
pub fn verify_evidence(request: &Request) -> Result<Attested, Refused> {
    if !request.signature_verifies() {
        return Err(refused(
            Refusal::EvidenceInvalid,
            "the request's own signature does not verify with its key",
        ));
    }
    let evidence = find_evidence(request)
        .ok_or_else(|| {
            refused(
                Refusal::NoEvidence,
                "the request carries no TPM evidence (made without `hwkey csr --attest`?)",
            )
        })?
        .map_err(|e| refused(Refusal::EvidenceInvalid, e.to_string()))?;
    let made_at = evidence.made_at.ok_or_else(|| {
        refused(
            Refusal::EvidenceInvalid,
            "the evidence carries no time (made by an older hwkey): make the request again",
        )
    })?;
    let qualifying = qualifying_data(request.subject_der(), request.spki_der(), made_at);
    let ak_name =
        crate::key::tpm::evidence::verify_certify(&evidence, request.spki_der(), &qualifying)
            .map_err(|e| refused(Refusal::EvidenceInvalid, e.0))?;
    let ek_certificate_issuer = evidence.ek_certificate.as_deref().map(|der| {
        x509_parser::parse_x509_certificate(der)
            .map(|(_, c)| c.issuer().to_string())
            .unwrap_or_else(|_| "an unreadable certificate".into())
    });
    Ok(Attested {
        ak_name,
        made_at,
        evidence_digest: digest_of(&evidence),
        subject: subject_text(request),
        ek_certificate_issuer,
    })
}

/// The subject as a message shows it (`CN=…, O=…`, escaped), never decided on.
#[cfg(feature = "tpm")]
fn subject_text(request: &Request) -> String {
    request
        .subject
        .iter()
        .map(|a| {
            let name = match a.oid.components().as_slice() {
                [2, 5, 4, 3] => "CN".to_string(),
                [2, 5, 4, 10] => "O".to_string(),
                [2, 5, 4, 11] => "OU".to_string(),
                _ => a.oid.to_string(),
            };
            format!("{name}={}", a.value.escape_debug())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(feature = "tpm")]
fn digest_of(evidence: &TpmEvidence) -> [u8; 32] {
    let mut digest = [0u8; 32];
    digest.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, &evidence.attest).as_ref());
    digest
}

/// Admits attested evidence when its AK is registered for `node` in `trusted`: the pair (AK,
/// node) must be registered, so an AK registered under two names still admits each for its own.
#[cfg(feature = "tpm")]
pub fn admit(
    attested: Attested,
    node: &str,
    trusted: &[RegisteredAk],
) -> Result<Admitted, Refused> {
    admit_as(attested, node, trusted, "node")
}

/// [`admit`] for registrations of `what` ("node", or "user" for the people policy's AKs
/// registered per person), in the refusal's words.
#[cfg(feature = "tpm")]
pub fn admit_as(
    attested: Attested,
    node: &str,
    trusted: &[RegisteredAk],
    what: &str,
) -> Result<Admitted, Refused> {
    let ak = hex::encode(&attested.ak_name);
    if !trusted
        .iter()
        .any(|t| t.node == node && t.ak_name == attested.ak_name)
    {
        let owners: Vec<&str> = trusted
            .iter()
            .filter(|t| t.ak_name == attested.ak_name)
            .map(|t| t.node.as_str())
            .collect();
        return Err(if owners.is_empty() {
            refused(
                Refusal::UnknownAttestationKey,
                format!(
                    "attestation key {ak} is not registered (register the {what} with what `hwkey attest enroll` prints)"
                ),
            )
        } else {
            refused(
                Refusal::SubjectMismatch,
                format!(
                    "the key is in the TPM registered as {what} {}, but the request asks for {what} '{node}'",
                    owners.join(", ")
                ),
            )
        });
    }
    Ok(Admitted {
        node: node.to_string(),
        ak_name: ak,
        subject: attested.subject,
        made_at: attested.made_at,
        evidence_digest: attested.evidence_digest,
        ek_certificate_issuer: attested.ek_certificate_issuer,
    })
}

/// SHA-256 of the `TPMS_ATTEST` in a request's evidence and the time the evidence claims,
/// without checking anything: what two requests carrying the same evidence have in common.
/// None when the request carries no readable evidence.
#[cfg(feature = "tpm")]
pub fn evidence_digest(request: &Request) -> Option<([u8; 32], u64)> {
    find_evidence(request)?
        .ok()
        .map(|e| (digest_of(&e), e.made_at.unwrap_or(0)))
}
