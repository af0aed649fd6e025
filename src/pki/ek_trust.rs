//! Registering a node by its TPM's endorsement-key certificate instead of by an operator's word:
//! the EK certificate must chain to a manufacturer CA the verifier trusts, and credential
//! activation proves that the enrolled AK lives in that same TPM.
//!
//! Three steps, as `tpm2_makecredential` / `tpm2_activatecredential` users know them:
//! 1. [`challenge`] (verifier, `hwkey attest challenge`): reads the node's enrollment, checks the
//!    EK certificate against `--ek-ca`, that it certifies the enrolled EK, that the AK is an
//!    attestation key of the enrolled name, and encrypts a fresh secret to the EK for that AK
//!    name ([`super::credential`]). The challenge goes to the node; the expected answer stays.
//! 2. `hwkey attest activate` (node): TPM2_ActivateCredential gives the secret back only in the
//!    TPM that holds both the EK and an AK of that name.
//! 3. [`register`] (verifier, `hwkey attest register`): the answer must equal the secret (compared
//!    in constant time) and the enrollment must be the one challenged; then the node's
//!    registration is written to the trust directory, where the approver reads it like any other.

use std::path::Path;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

pub use super::registration::EnrollmentFile;

/// What the node's TPM must answer (`hwkey attest activate` reads it).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChallengeFile {
    /// The AK's TPM name, hex (the credential opens only for an object of this name).
    pub ak_name: String,
    /// `TPM2B_ID_OBJECT` contents, base64.
    pub credential_blob: String,
    /// `TPM2B_ENCRYPTED_SECRET` contents, base64.
    pub encrypted_secret: String,
}

/// What the verifier keeps to check the answer: secret, so written with mode 0600.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExpectedAnswer {
    /// The node the challenge is for: the answer registers this name and no other.
    pub node: String,
    /// SHA-256 of the enrollment text that was challenged.
    pub enrollment_sha256: String,
    /// The AK's name.
    pub ak_name: String,
    /// Who issued the EK certificate (for the registration's record).
    pub ek_issuer: String,
    /// The secret, hex.
    pub secret: String,
}

/// Checks an enrollment against the manufacturer CAs (`ca_pem`, a PEM bundle: every certificate
/// in it is trusted) and their revocation lists (`crls`), and makes the challenge for it.
pub fn challenge(
    enrollment_text: &str,
    ca_pem: &[u8],
    crls: &super::ek_crl::EkCrls,
    node: &str,
) -> Result<(ChallengeFile, ExpectedAnswer), EkTrustError> {
    super::registration::check_node_name(node)?;
    let checked = check_enrollment(enrollment_text, ca_pem, crls)?;
    let made = crate::key::tpm::credential::make_credential(&checked.ek_public, &checked.ak_name)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let challenge = ChallengeFile {
        ak_name: hex::encode(&checked.ak_name),
        credential_blob: b64.encode(&made.credential_blob),
        encrypted_secret: b64.encode(&made.encrypted_secret),
    };
    let expected = ExpectedAnswer {
        node: node.to_string(),
        enrollment_sha256: sha256_hex(enrollment_text.as_bytes()),
        ak_name: hex::encode(&checked.ak_name),
        ek_issuer: checked.issuer,
        secret: hex::encode(&made.secret),
    };
    Ok((challenge, expected))
}

/// What an enrollment proved once its EK certificate was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedEnrollment {
    /// The AK's TPM name (an attestation key's: restricted, signing, fixedTPM).
    pub ak_name: Vec<u8>,
    /// The AK's `TPMT_PUBLIC`.
    pub ak_public: Vec<u8>,
    /// The EK's `TPMT_PUBLIC`: what the credential is encrypted to.
    pub ek_public: Vec<u8>,
    /// SHA-256 of the EK's SubjectPublicKeyInfo (DER), hex: how a TPM is known across
    /// reinstalls and in vendors' manifests.
    pub ek_sha256: String,
    /// Who issued the EK certificate.
    pub issuer: String,
}

/// Checks an enrollment's AK and its EK certificate against the manufacturer CAs (`ca_pem`, a
/// PEM bundle: every certificate in it is trusted) and their revocation lists (`crls`). What
/// is not checked here is whether the AK is in that TPM: the credential's answer proves it.
pub fn check_enrollment(
    enrollment_text: &str,
    ca_pem: &[u8],
    crls: &super::ek_crl::EkCrls,
) -> Result<CheckedEnrollment, EkTrustError> {
    let enrollment = EnrollmentFile::parse(enrollment_text)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let ak_public = enrollment.ak_public()?;
    let ak_name = crate::key::tpm::evidence::check_attestation_key(&ak_public)?;
    if ak_name != enrollment.ak_name()? {
        return Err(EkTrustError::AkName);
    }
    let ek_public = b64
        .decode(
            enrollment
                .ek_public
                .as_deref()
                .ok_or(EkTrustError::NoEkPublic)?
                .trim(),
        )
        .map_err(EkTrustError::EkPublic)?;
    let cert_pem = enrollment
        .ek_certificate_pem
        .as_deref()
        .ok_or(EkTrustError::NoEkCertificate)?;
    let cert_der = pem::parse(cert_pem)
        .map_err(EkTrustError::EkCertificatePem)?
        .into_contents();
    let intermediates: Vec<Vec<u8>> = match enrollment.ek_intermediates_pem.as_deref() {
        Some(text) => ::pem::parse_many(text)
            .map_err(EkTrustError::EkCertificatePem)?
            .into_iter()
            .filter(|p| p.tag() == "CERTIFICATE")
            .map(|p| p.into_contents())
            .collect(),
        None => Vec::new(),
    };
    let issuer = check_ek_certificate(&cert_der, ca_pem, &intermediates, crls, &ek_public)?;
    let ek_spki = crate::key::tpm::evidence::public_key_spki(&ek_public)?;
    Ok(CheckedEnrollment {
        ak_name,
        ak_public,
        ek_public,
        ek_sha256: sha256_hex(&ek_spki),
        issuer,
    })
}

/// Checks the node's answer, the enrollment and the node's name against what was challenged;
/// returns the AK's name and the canonical registration to store as TRUST_DIR/NODE (built from
/// the fields checked, not the node's text).
pub fn register(
    enrollment_text: &str,
    expected: &ExpectedAnswer,
    answer: &str,
    node: &str,
) -> Result<(Vec<u8>, String), EkTrustError> {
    if node != expected.node {
        return Err(EkTrustError::OtherNode {
            challenged: expected.node.clone(),
            given: node.to_string(),
        });
    }
    if sha256_hex(enrollment_text.as_bytes()) != expected.enrollment_sha256 {
        return Err(EkTrustError::OtherEnrollment);
    }
    // Compared as digests, so the comparison's timing says nothing about the secret.
    let answer = answer.trim().to_ascii_lowercase();
    if sha256_hex(answer.as_bytes()) != sha256_hex(expected.secret.as_bytes()) {
        return Err(EkTrustError::WrongAnswer);
    }
    let enrollment = EnrollmentFile::parse(enrollment_text)?;
    let ak_public = enrollment.ak_public()?;
    let ak_name = crate::key::tpm::evidence::check_attestation_key(&ak_public)?;
    if hex::encode(&ak_name) != expected.ak_name {
        return Err(EkTrustError::OtherAk);
    }
    let text = EnrollmentFile::canonical(
        node,
        &ak_public,
        &format!(
            "hwkey attest register: EK certificate issued by {}; AK activated in that TPM",
            expected.ek_issuer
        ),
    )?;
    Ok((ak_name, text))
}

/// Checks that `cert_der` chains to a certificate in `ca_pem` (directly, or through
/// `intermediates`, the chain the TPM stored), is valid now, is not revoked by a list in
/// `crls` (nor is an intermediate), and certifies the key of `ek_public` (a `TPMT_PUBLIC`).
/// Returns its issuer's name.
fn check_ek_certificate(
    cert_der: &[u8],
    ca_pem: &[u8],
    intermediates: &[Vec<u8>],
    crls: &super::ek_crl::EkCrls,
    ek_public: &[u8],
) -> Result<String, EkTrustError> {
    use x509_parser::prelude::*;
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| EkTrustError::EkCertificate(e.into()))?;
    if !cert.validity().is_valid() {
        return Err(EkTrustError::EkCertificateExpired {
            from: cert.validity().not_before.to_string(),
            to: cert.validity().not_after.to_string(),
        });
    }
    let cas: Vec<Vec<u8>> = ::pem::parse_many(ca_pem)
        .map_err(EkTrustError::CaPem)?
        .into_iter()
        .filter(|p| p.tag() == "CERTIFICATE")
        .map(|p| p.into_contents())
        .collect();
    if cas.is_empty() {
        return Err(EkTrustError::NoCa);
    }
    check_is_ek_certificate(&cert)?;
    let issuer = chain_to_anchor(&cert, &cas, intermediates, crls)?;
    let enrolled = crate::key::tpm::evidence::public_key_spki(ek_public)?;
    let (_, enrolled) =
        SubjectPublicKeyInfo::from_der(&enrolled).map_err(|e| EkTrustError::EkKey(e.into()))?;
    if !same_key(cert.public_key(), &enrolled) {
        return Err(EkTrustError::OtherKey);
    }
    Ok(issuer)
}

/// `tcg-kp-EKCertificate` (TCG EK Credential Profile): the extended key usage that makes a
/// certificate an EK certificate.
const TCG_KP_EK_CERTIFICATE: &str = "2.23.133.8.1";

/// A certificate under a vendor's CA is an EK certificate only if it says so: the EK extended
/// key usage, and not a CA. Without this, any end-entity certificate from a CA that also issues
/// EK certificates (a TLS client's, a device's software key) would pass for a TPM's EK, and its
/// holder could answer the credential in software.
fn check_is_ek_certificate(
    cert: &x509_parser::certificate::X509Certificate<'_>,
) -> Result<(), EkTrustError> {
    let is_ek = cert.extended_key_usage().ok().flatten().is_some_and(|eku| {
        eku.value
            .other
            .iter()
            .any(|oid| oid.to_id_string() == TCG_KP_EK_CERTIFICATE)
    });
    let is_ca = cert
        .basic_constraints()
        .ok()
        .flatten()
        .is_some_and(|bc| bc.value.ca);
    if !is_ek || is_ca {
        return Err(EkTrustError::NotAnEkCertificate(cert.subject().to_string()));
    }
    Ok(())
}

/// How many intermediates a path from an EK certificate to a trusted CA may pass (vendors use
/// one or two).
const MAX_INTERMEDIATES: usize = 4;

/// Walks from `leaf` to a certificate of `anchors` (each one trusted), through `intermediates`
/// (untrusted: each must be signed in turn, a CA, valid now), checking each certificate on the
/// way against its issuer's revocation lists. Returns the name of `leaf`'s issuer.
fn chain_to_anchor(
    leaf: &x509_parser::certificate::X509Certificate<'_>,
    anchors: &[Vec<u8>],
    intermediates: &[Vec<u8>],
    crls: &super::ek_crl::EkCrls,
) -> Result<String, EkTrustError> {
    use x509_parser::prelude::*;
    let (anchors, intermediates) = (parse_all(anchors), parse_all(intermediates));
    let signs = |issuer: &X509Certificate<'_>, child: &X509Certificate<'_>| {
        issuer.subject() == child.issuer()
            && child.verify_signature(Some(issuer.public_key())).is_ok()
    };
    let is_ca = |c: &X509Certificate<'_>| {
        c.basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|bc| bc.value.ca)
            && c.validity().is_valid()
    };
    let mut current = leaf;
    let mut issuer_name = None;
    for _ in 0..=MAX_INTERMEDIATES {
        if let Some(anchor) = anchors.iter().find(|a| signs(a, current)) {
            crls.check(current, anchor)?;
            return Ok(issuer_name.unwrap_or_else(|| anchor.subject().to_string()));
        }
        let Some(next) = intermediates.iter().find(|i| is_ca(i) && signs(i, current)) else {
            break;
        };
        crls.check(current, next)?;
        issuer_name.get_or_insert_with(|| next.subject().to_string());
        current = next;
    }
    Err(EkTrustError::UnknownIssuer(leaf.issuer().to_string()))
}

/// The certificates of `ders` that parse.
fn parse_all(ders: &[Vec<u8>]) -> Vec<x509_parser::certificate::X509Certificate<'_>> {
    use x509_parser::prelude::FromDer as _;
    ders.iter()
        .filter_map(|d| {
            x509_parser::certificate::X509Certificate::from_der(d)
                .ok()
                .map(|(_, c)| c)
        })
        .collect()
}

/// Whether two public keys are the same key (RSA: modulus and exponent; EC: the point), however
/// their encodings differ in leading zeros or parameters.
fn same_key(
    a: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
    b: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
) -> bool {
    use x509_parser::public_key::PublicKey;
    let strip = |v: &[u8]| -> Vec<u8> { v.iter().skip_while(|&&x| x == 0).copied().collect() };
    match (a.parsed(), b.parsed()) {
        (Ok(PublicKey::RSA(a)), Ok(PublicKey::RSA(b))) => {
            strip(a.modulus) == strip(b.modulus) && strip(a.exponent) == strip(b.exponent)
        }
        (Ok(PublicKey::EC(a)), Ok(PublicKey::EC(b))) => a.data() == b.data(),
        _ => false,
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref())
}

/// Reads an enrollment file, naming it in the error.
pub fn read_text(path: &Path, what: &'static str) -> Result<String, EkTrustError> {
    std::fs::read_to_string(path).map_err(|source| EkTrustError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Why an enrollment cannot be challenged or registered.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum EkTrustError {
    #[error("{0}")]
    Registration(#[from] super::registration::RegistrationError),
    #[error("{0}")]
    Evidence(#[from] crate::key::attestation::EvidenceInvalid),
    #[error("{0}")]
    Credential(#[from] crate::key::tpm::credential::CredentialError),
    #[error("{0}")]
    Revocation(#[from] super::ek_crl::CrlError),
    #[error("akName is not the name of akPublic")]
    AkName,
    #[error("the enrollment has no ekPublic: enroll the node again with this hwkey")]
    NoEkPublic,
    #[error("ekPublic is not base64: {0}")]
    EkPublic(#[source] base64::DecodeError),
    #[error("the enrollment has no EK certificate (its TPM has none in NV): register the node with `--trust` as an operator instead")]
    NoEkCertificate,
    #[error("ekCertificatePem is not PEM: {0}")]
    EkCertificatePem(#[source] pem::PemError),
    #[error("the EK certificate does not parse: {0}")]
    EkCertificate(#[source] x509_parser::error::X509Error),
    #[error("the EK certificate is not valid now ({from} to {to})")]
    EkCertificateExpired { from: String, to: String },
    #[error("the manufacturer CAs (--ek-ca, the trust's _ek-ca.pem) are not PEM: {0}")]
    CaPem(#[source] pem::PemError),
    #[error("no TPM manufacturer CA is given (--ek-ca, or the approver trust's _ek-ca.pem entry)")]
    NoCa,
    #[error("the EK certificate (issuer {0}) does not chain to a trusted manufacturer CA (--ek-ca; for the approver also the trust's _ek-ca.pem), directly or through the intermediates its TPM stores: add the vendor's root or intermediate CA to the bundle")]
    UnknownIssuer(String),
    #[error("the certificate given as the EK certificate ({0}) is not one: it lacks the EK extended key usage (tcg-kp-EKCertificate, 2.23.133.8.1) or is a CA; enroll the node again from its TPM")]
    NotAnEkCertificate(String),
    #[error("the enrolled EK's key does not encode: {0}")]
    EkKey(#[source] x509_parser::error::X509Error),
    #[error("the EK certificate is for another key than the enrolled EK")]
    OtherKey,
    #[error("the challenge was made for node '{challenged}', not '{given}'")]
    OtherNode { challenged: String, given: String },
    #[error("this enrollment is not the one the challenge was made for")]
    OtherEnrollment,
    #[error("the answer is not the challenge's secret: the attestation key is not in the TPM whose EK certificate was checked")]
    WrongAnswer,
    #[error("the enrollment's AK is not the one challenged")]
    OtherAk,
    #[error("cannot read {what} {}: {source}", .path.display())]
    Read {
        what: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}
