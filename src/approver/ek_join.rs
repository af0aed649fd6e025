//! TPMs that join by their EK certificate, with only a bootstrap token (docs/ATTESTATION.md,
//! "Zero-touch bootstrap"): the approver's two decisions.
//!
//! - A **carrier request** ([`CREDENTIAL_SIGNER`]) is judged by itself (`evaluate`, then
//!   [`carrier_candidate`]: subject, requester, TPM2_Certify evidence, the enrollment's AK the
//!   one that certified),
//!   then against the trust ([`Join::issue`]): the EK certificate chains to a manufacturer CA
//!   and is not revoked, the binding policy allows the TPM for the name; the approver then
//!   approves it and writes the carrier certificate, which holds the credential.
//! - A **kubelet request that answers** a credential ([`claim_of`]) is settled by
//!   [`Join::answer`]: the carrier is the request's own (same requester, node and AK), not
//!   expired, not answered before, the answer is the secret, the binding policy still allows
//!   it. The approval then records the binding in the trust ConfigMap, where renewals find
//!   the AK like any registered node's.
//!
//! What the approver keeps of carriers is [`CarrierFacts`] (under a kilobyte each: the AK's
//! public area, hashes, names) of the carriers it approved, for the credential's lifetime and
//! ten minutes more, learnt from its own watch: any replica settles an answer. A carrier
//! waiting in the queue also holds its enrollment (at most [`ek_join::ENROLLMENT_MAX`]).

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;

use super::reason::{self, Reason, Violation};
use crate::pki::ek_crl::EkCrls;
use crate::pki::ek_join::{self, Credential};
use crate::pki::registration::EnrollmentFile;

pub use crate::pki::ek_join::CREDENTIAL_SIGNER;

/// How long an expired carrier is remembered, so that a late answer is denied as late
/// (`CredentialExpired`) rather than unknown.
pub const REMEMBER_EXPIRED: Duration = Duration::from_secs(10 * 60);

/// The longest answer or carrier name read from an annotation.
const CLAIM_MAX: usize = 256;

/// What the approver needs to let TPMs join by their EK certificate (`--ek-ca`, `--ek-crl`,
/// `--credential-key`, `--credential-ttl`).
pub struct JoinSettings {
    /// The manufacturer CAs from `--ek-ca` (PEM), beside the trust's `_ek-ca.pem`.
    pub ca_pem: Vec<u8>,
    /// The CRLs from `--ek-crl`, beside the trust's `_ek-crl.pem`.
    pub crls: Vec<EkCrls>,
    /// The key the credentials' secrets are derived with (shared by the replicas).
    pub key: zeroize::Zeroizing<Vec<u8>>,
    /// How long a credential may be answered after its carrier request was made.
    pub ttl: Duration,
}

impl std::fmt::Debug for JoinSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinSettings")
            .field("ca_pem", &format!("{} bytes", self.ca_pem.len()))
            .field("crls", &self.crls.len())
            .field("key", &"(secret)")
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// A carrier request that passed every check of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarrierCandidate {
    /// The node it asks to join as.
    pub node: String,
    /// Its facts (what an answer is checked against).
    pub facts: CarrierFacts,
    /// The enrollment it carries.
    pub enrollment: String,
}

/// What the approver keeps of a carrier request: what its credential's secret is derived from
/// and what an answer must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarrierFacts {
    /// `metadata.uid`.
    pub uid: String,
    /// `spec.username`: the answer must come from the same requester.
    pub requester: String,
    /// The node it asks to join as.
    pub node: String,
    /// When it was created (Unix seconds): the credential expires a TTL later.
    pub created: i64,
    /// The enrolled AK's name.
    pub ak_name: Vec<u8>,
    /// The enrolled AK's `TPMT_PUBLIC` (what the binding records).
    pub ak_public: Vec<u8>,
    /// SHA-256 of the enrolled EK's SubjectPublicKeyInfo, hex.
    pub ek_sha256: String,
    /// Who issued the enrolled EK certificate (for the record).
    pub ek_issuer: String,
}

/// A kubelet request's claim to answer a credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The carrier request's name.
    pub carrier: String,
    /// The secret, hex.
    pub answer: String,
}

/// The claim a kubelet request makes in its annotations: both or neither.
pub fn claim_of(csr: &CertificateSigningRequest) -> Result<Option<Claim>, Violation> {
    let annotations = csr.metadata.annotations.as_ref();
    let get = |k: &str| annotations.and_then(|a| a.get(k));
    match (
        get(ek_join::ANNOTATION_CARRIER),
        get(ek_join::ANNOTATION_ANSWER),
    ) {
        (None, None) => Ok(None),
        (Some(carrier), Some(answer)) if carrier.len() <= CLAIM_MAX && answer.len() <= CLAIM_MAX => {
            Ok(Some(Claim {
                carrier: carrier.clone(),
                answer: answer.clone(),
            }))
        }
        _ => Err(invalid(format!(
            "a request that answers a credential has both annotations {} and {} (each at most {CLAIM_MAX} bytes)",
            ek_join::ANNOTATION_CARRIER,
            ek_join::ANNOTATION_ANSWER
        ))),
    }
}

fn invalid(message: String) -> Violation {
    Violation {
        reason: Reason::CredentialInvalid,
        message,
    }
}

fn deny(reason: Reason, message: impl Into<String>) -> Violation {
    Violation {
        reason,
        message: message.into(),
    }
}

/// The facts of any carrier request for `node` whose enrollment reads (None otherwise: an
/// answer to it cannot be checked, so none is accepted).
pub fn facts_for(csr: &CertificateSigningRequest, node: String) -> Option<CarrierFacts> {
    let text = enrollment_text(csr).ok()?;
    let enrollment = EnrollmentFile::parse(text).ok()?;
    facts_from(csr, node, &enrollment).ok()
}

fn enrollment_text(csr: &CertificateSigningRequest) -> Result<&str, Violation> {
    let text = csr
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ek_join::ANNOTATION_ENROLLMENT))
        .ok_or_else(|| {
            deny(
                Reason::NoEvidence,
                format!(
                    "a carrier request holds the TPM's enrollment in annotation {} (made by `hwkey bootstrap --attest --ek-proof`)",
                    ek_join::ANNOTATION_ENROLLMENT
                ),
            )
        })?;
    if text.len() > ek_join::ENROLLMENT_MAX {
        return Err(deny(
            Reason::MalformedRequest,
            format!(
                "the enrollment is {} bytes (at most {})",
                text.len(),
                ek_join::ENROLLMENT_MAX
            ),
        ));
    }
    Ok(text)
}

fn facts_from(
    csr: &CertificateSigningRequest,
    node: String,
    enrollment: &EnrollmentFile,
) -> Result<CarrierFacts, Violation> {
    let bad =
        |e: &dyn std::fmt::Display| deny(Reason::EvidenceInvalid, format!("the enrollment: {e}"));
    let ak_public = enrollment.ak_public().map_err(|e| bad(&e))?;
    let ak_name = enrollment.ak_name().map_err(|e| bad(&e))?;
    let ek_public = enrollment
        .ek_public
        .as_deref()
        .ok_or_else(|| bad(&"it has no ekPublic"))
        .and_then(|b| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .map_err(|e| bad(&e))
        })?;
    let spki = crate::key::tpm::evidence::public_key_spki(&ek_public).map_err(|e| bad(&e))?;
    let ek_issuer = enrollment
        .ek_certificate_pem
        .as_deref()
        .and_then(|p| ::pem::parse(p).ok())
        .and_then(|p| {
            x509_parser::parse_x509_certificate(p.contents())
                .ok()
                .map(|(_, c)| reason::bounded(&c.issuer().to_string()))
        })
        .unwrap_or_else(|| "an unreadable certificate".into());
    Ok(CarrierFacts {
        uid: csr.metadata.uid.clone().unwrap_or_default(),
        requester: csr.spec.username.clone().unwrap_or_default(),
        node,
        created: csr
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
            .unwrap_or(0),
        ak_name,
        ak_public,
        ek_sha256: hex::encode(ring::digest::digest(&ring::digest::SHA256, &spki).as_ref()),
        ek_issuer,
    })
}

/// A carrier request for `node` whose key the AK `ak_name` certified: its enrollment's AK must
/// be that one.
pub fn carrier_candidate(
    csr: &CertificateSigningRequest,
    node: String,
    ak_name: &[u8],
) -> Result<CarrierCandidate, Violation> {
    let text = enrollment_text(csr)?;
    let enrollment = EnrollmentFile::parse(text)
        .map_err(|e| deny(Reason::EvidenceInvalid, format!("the enrollment: {e}")))?;
    let facts = facts_from(csr, node.clone(), &enrollment)?;
    if facts.ak_name != ak_name {
        return Err(deny(
            Reason::EvidenceInvalid,
            format!(
                "the enrollment's AK ({}) is not the one that certified the key ({})",
                hex::encode(&facts.ak_name),
                hex::encode(ak_name)
            ),
        ));
    }
    Ok(CarrierCandidate {
        node,
        facts,
        enrollment: text.to_string(),
    })
}

/// The carriers seen, and which were answered: the approver's memory of the exchange.
#[derive(Debug, Default)]
pub struct Carriers {
    facts: HashMap<String, CarrierFacts>,
    /// Carrier name → the request that answered it (approved, or being written), and when
    /// that was learnt (Unix seconds). Kept apart from the facts: after a restart the list may
    /// bring the answer before its carrier.
    answered: HashMap<String, (String, i64)>,
}

impl Carriers {
    /// Takes note of a carrier request (any state).
    pub fn seen(&mut self, name: &str, facts: CarrierFacts) {
        self.facts.insert(name.to_string(), facts);
    }

    /// A carrier request was deleted.
    pub fn deleted(&mut self, name: &str) {
        self.facts.remove(name);
    }

    /// An approved kubelet request answered `carrier` (learnt at `now`).
    pub fn answered_by(&mut self, carrier: &str, request: &str, now: i64) {
        self.answered
            .insert(carrier.to_string(), (request.to_string(), now));
    }

    /// A write that would have answered `carrier` did not happen.
    pub fn release(&mut self, carrier: &str, request: &str) {
        if self
            .answered
            .get(carrier)
            .is_some_and(|(r, _)| r == request)
        {
            self.answered.remove(carrier);
        }
    }

    /// Forgets carriers whose credential expired [`REMEMBER_EXPIRED`] before `now` (Unix
    /// seconds): a late answer until then is told it came late.
    pub fn prune(&mut self, now: i64, ttl: Duration) {
        let keep = i64::try_from((ttl + REMEMBER_EXPIRED).as_secs()).unwrap_or(i64::MAX);
        let facts = &mut self.facts;
        facts.retain(|_, f| f.created.saturating_add(keep) >= now);
        self.answered
            .retain(|carrier, _| facts.contains_key(carrier));
    }

    /// The facts of the carrier `claim` names, if it is this request's: made by `requester`,
    /// for `node`, for AK `ak_name`.
    fn matching(
        &self,
        claim: &Claim,
        node: &str,
        ak_name: &[u8],
        requester: &str,
    ) -> Result<&CarrierFacts, Violation> {
        let carrier = reason::bounded(&claim.carrier);
        let facts = self.facts.get(&claim.carrier).ok_or_else(|| {
            invalid(format!("there is no carrier request '{carrier}' with a TPM enrollment (expired and deleted, or never made)"))
        })?;
        let mismatch = if facts.requester != requester {
            format!(
                "was made by {}, not by this request's requester",
                reason::bounded(&facts.requester)
            )
        } else if facts.node != node {
            format!("is for node '{}', not '{node}'", facts.node)
        } else if facts.ak_name != ak_name {
            format!(
                "is for AK {}, and this request's key is certified by AK {}",
                hex::encode(&facts.ak_name),
                hex::encode(ak_name)
            )
        } else {
            return Ok(facts);
        };
        Err(invalid(format!("carrier request '{carrier}' {mismatch}")))
    }

    /// How many carriers are remembered.
    pub fn len(&self) -> usize {
        self.facts.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.facts.is_empty()
    }
}

/// A binding to record before an approval is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The node name.
    pub node: String,
    /// The TPM's EK hash.
    pub ek_sha256: String,
    /// The entry's text (a canonical registration with `ekSha256`).
    pub text: String,
    /// The carrier answered.
    pub carrier: String,
}

/// The two decisions, with the settings.
pub struct Join<'a> {
    /// The settings.
    pub settings: &'a JoinSettings,
    /// What the trust holds.
    pub held: super::binding::Held<'a>,
    /// The trust's EK entries.
    pub ek: &'a crate::pki::registration::EkEntries,
}

impl Join<'_> {
    /// The carrier certificate for a carrier request that passed `policy::carrier::judge`, or why
    /// none is issued.
    pub fn issue(
        &self,
        candidate: &CarrierCandidate,
        now: i64,
    ) -> Result<(String, String), Violation> {
        let facts = &candidate.facts;
        let expires_at = self.expiry(facts);
        if now > expires_at {
            return Err(deny(
                Reason::CredentialExpired,
                format!("the carrier request is older than the credential's lifetime ({} s): make a new one", self.settings.ttl.as_secs()),
            ));
        }
        let (ca, crls) = self.anchors()?;
        let checked = crate::pki::ek_trust::check_enrollment(&candidate.enrollment, &ca, &crls)
            .map_err(|e| deny(Reason::EkCertificateUntrusted, e.to_string()))?;
        if checked.ak_name != facts.ak_name || checked.ek_sha256 != facts.ek_sha256 {
            return Err(deny(
                Reason::EvidenceInvalid,
                "the enrollment reads two ways",
            ));
        }
        let rejoin = super::binding::check_binding(
            &candidate.node,
            &facts.ek_sha256,
            self.ek.binding.as_deref(),
            self.held,
        )?;
        let secret = ek_join::credential_secret(
            &self.settings.key,
            &facts.uid,
            &facts.ak_name,
            &facts.ek_sha256,
            &candidate.node,
            expires_at,
        );
        let made = crate::key::tpm::credential::make_credential_for(
            &checked.ek_public,
            &facts.ak_name,
            secret,
        )
        .map_err(|e| deny(Reason::EvidenceInvalid, format!("the EK: {e}")))?;
        let credential = Credential {
            credential_blob: made.credential_blob,
            encrypted_secret: made.encrypted_secret,
            expires_at,
        };
        let pem = ek_join::carrier_certificate(&candidate.node, &credential, now)
            .map_err(|e| deny(Reason::EvidenceInvalid, e.to_string()))?;
        let message = format!(
            "the TPM's EK certificate (EK {}) is issued by {}, which is trusted, and {}: the credential for AK {} is in the certificate, to be answered within {} s",
            facts.ek_sha256,
            checked.issuer,
            if rejoin { format!("it holds node '{}' (a re-join)", candidate.node) } else { format!("node '{}' is free for it", candidate.node) },
            hex::encode(&facts.ak_name),
            self.settings.ttl.as_secs()
        );
        Ok((pem, message))
    }

    /// The CA bundle and CRLs: the flags' and the trust's.
    fn anchors(&self) -> Result<(Vec<u8>, EkCrls), Violation> {
        let mut ca = self.settings.ca_pem.clone();
        if let Some(more) = &self.ek.ca {
            // Read apart first, so that the entry at fault is the one named.
            let certs = ::pem::parse_many(more.as_bytes()).map_err(|e| {
                deny(
                    Reason::EkCertificateUntrusted,
                    format!(
                        "the trust's {} entry is not PEM: {e}",
                        crate::pki::registration::EK_CA_ENTRY
                    ),
                )
            })?;
            if !certs.iter().any(|c| c.tag() == "CERTIFICATE") {
                return Err(deny(
                    Reason::EkCertificateUntrusted,
                    format!(
                        "the trust's {} entry holds no CERTIFICATE",
                        crate::pki::registration::EK_CA_ENTRY
                    ),
                ));
            }
            ca.push(b'\n');
            ca.extend_from_slice(more.as_bytes());
        }
        let mut crls = self.settings.crls.clone();
        if let Some(text) = &self.ek.crl {
            crls.push(EkCrls::parse(text.as_bytes()).map_err(|e| {
                deny(
                    Reason::EkCertificateUntrusted,
                    format!(
                        "the trust's {} entry: {e}",
                        crate::pki::registration::EK_CRL_ENTRY
                    ),
                )
            })?);
        }
        Ok((ca, EkCrls::join(crls)))
    }

    fn expiry(&self, facts: &CarrierFacts) -> i64 {
        facts
            .created
            .saturating_add(i64::try_from(self.settings.ttl.as_secs()).unwrap_or(i64::MAX))
    }

    /// Settles a kubelet request's answer (`claim`) for `node` by AK `ak_name`, made by
    /// `requester`: the binding to record on approval, or the denial.
    pub fn answer(
        &self,
        carriers: &Carriers,
        claim: &Claim,
        node: &str,
        ak_name: &[u8],
        requester: &str,
        now: i64,
    ) -> Result<Binding, Violation> {
        let carrier = reason::bounded(&claim.carrier);
        let facts = carriers.matching(claim, node, ak_name, requester)?;
        let expires_at = self.expiry(facts);
        if now > expires_at {
            return Err(deny(Reason::CredentialExpired, format!("the credential of carrier request '{carrier}' expired {} s ago: bootstrap again", now - expires_at)));
        }
        if let Some((by, _)) = carriers.answered.get(&claim.carrier) {
            return Err(deny(Reason::CredentialReplayed, format!("the credential of carrier request '{carrier}' was answered already, by request {by}: a credential is answered once")));
        }
        let secret = ek_join::credential_secret(
            &self.settings.key,
            &facts.uid,
            &facts.ak_name,
            &facts.ek_sha256,
            node,
            expires_at,
        );
        if !ek_join::answer_matches(&secret, &claim.answer) {
            return Err(invalid(format!("the answer is not the secret of carrier request '{carrier}'s credential: the AK is not in the TPM whose EK certificate was checked (or the approver's replicas do not share one --credential-key and --credential-ttl)")));
        }
        super::binding::check_binding(
            node,
            &facts.ek_sha256,
            self.ek.binding.as_deref(),
            self.held,
        )?;
        let text = EnrollmentFile::canonical_bound(
            node,
            &facts.ak_public,
            Some(&facts.ek_sha256),
            &format!("hwkey approver: EK certificate issued by {}; AK activated in that TPM (carrier request {})", facts.ek_issuer, claim.carrier),
        )
        .map_err(|e| deny(Reason::EvidenceInvalid, e.to_string()))?;
        Ok(Binding {
            node: node.to_string(),
            ek_sha256: facts.ek_sha256.clone(),
            text,
            carrier: claim.carrier.clone(),
        })
    }
}
