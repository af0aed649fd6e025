//! Revocation of EK certificates: the manufacturers' certificate revocation lists (CRLs), given
//! as data beside their CA bundle (`hwkey attest challenge --ek-crl`).
//!
//! A TPM vendor revokes the EK certificates of parts it knows are compromised (a firmware flaw
//! that leaks the EK, as with ROCA's RSA keys on Infineon TPMs) by listing them in the CRL its
//! issuing CA publishes. An EK certificate listed in a valid CRL of its issuer is refused,
//! naming its serial and subject. Fail closed on the lists given: a CRL for the issuer that is
//! not signed by it, or whose `nextUpdate` has passed, refuses the certificate too (a stale
//! list would hide a newer revocation); an issuer without a CRL here is not checked (most TPM
//! issuers publish one at the URL in their certificates' CRL distribution points: fetch it and
//! give it here).

use x509_parser::prelude::*;
use x509_parser::revocation_list::CertificateRevocationList;

/// The CRLs given, DER each.
#[derive(Debug, Default, Clone)]
pub struct EkCrls(Vec<Vec<u8>>);

impl EkCrls {
    /// Reads a file's bytes: PEM (`X509 CRL` blocks, any number) or one DER CRL. Every list must
    /// parse: a file that holds something else is an error, not an empty list.
    pub fn parse(bytes: &[u8]) -> Result<EkCrls, CrlError> {
        let ders: Vec<Vec<u8>> = if bytes.starts_with(&[0x30]) {
            vec![bytes.to_vec()]
        } else {
            ::pem::parse_many(bytes)
                .map_err(CrlError::Pem)?
                .into_iter()
                .filter(|p| p.tag() == "X509 CRL")
                .map(|p| p.into_contents())
                .collect()
        };
        if ders.is_empty() {
            return Err(CrlError::Empty);
        }
        for der in &ders {
            CertificateRevocationList::from_der(der).map_err(|e| CrlError::Parse(e.into()))?;
        }
        Ok(EkCrls(ders))
    }

    /// The lists of several files.
    pub fn join(parts: Vec<EkCrls>) -> EkCrls {
        EkCrls(parts.into_iter().flat_map(|p| p.0).collect())
    }

    /// Checks `cert`, issued by `issuer`, against every list of that issuer.
    pub fn check(
        &self,
        cert: &X509Certificate<'_>,
        issuer: &X509Certificate<'_>,
    ) -> Result<(), CrlError> {
        for der in &self.0 {
            let Ok((_, crl)) = CertificateRevocationList::from_der(der) else {
                continue;
            };
            if crl.issuer() != issuer.subject() {
                continue;
            }
            let issuer_name = issuer.subject().to_string();
            crl.verify_signature(issuer.public_key())
                .map_err(|_| CrlError::NotSignedByIssuer {
                    issuer: issuer_name.clone(),
                })?;
            match crl.next_update() {
                Some(next) if next < ASN1Time::now() => {
                    return Err(CrlError::Stale {
                        issuer: issuer_name,
                        next_update: next.to_string(),
                    })
                }
                _ => {}
            }
            let revoked = crl
                .iter_revoked_certificates()
                .find(|r| r.serial() == &cert.tbs_certificate.serial)
                .map(|r| CrlError::Revoked {
                    serial: r.raw_serial_as_string(),
                    subject: cert.subject().to_string(),
                    issuer: issuer_name.clone(),
                    since: r.revocation_date.to_string(),
                    reason: r
                        .reason_code()
                        .map(|(_, reason)| format!(" ({reason})"))
                        .unwrap_or_default(),
                });
            if let Some(revoked) = revoked {
                return Err(revoked);
            }
        }
        Ok(())
    }
}

/// Why an EK certificate is refused by, or a file is not, a revocation list.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CrlError {
    #[error("--ek-crl is not PEM: {0}")]
    Pem(#[source] ::pem::PemError),
    #[error("--ek-crl holds no X509 CRL block (give the issuers' CRLs, PEM or DER)")]
    Empty,
    #[error("--ek-crl holds a CRL that does not parse: {0}")]
    Parse(#[source] x509_parser::error::X509Error),
    #[error("the EK certificate {serial} ({subject}) is revoked by its issuer {issuer} since {since}{reason}")]
    Revoked {
        serial: String,
        subject: String,
        issuer: String,
        since: String,
        reason: String,
    },
    #[error("the CRL given for {issuer} is not signed by it: fetch the issuer's CRL again")]
    NotSignedByIssuer { issuer: String },
    #[error(
        "the CRL given for {issuer} expired at {next_update}: fetch a fresh one from the issuer"
    )]
    Stale { issuer: String, next_update: String },
}
