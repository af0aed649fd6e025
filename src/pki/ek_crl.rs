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

/// CRL extensions that make a list partial (a delta CRL, or one scoped by an issuing
/// distribution point): such a list does not say a certificate it omits is good.
const PARTIAL: [&str; 2] = ["2.5.29.27", "2.5.29.28"];

/// Critical CRL extensions understood: none beyond the partial ones (refused above).
const KNOWN_CRITICAL: [&str; 0] = [];

/// The CRLs given, DER each.
#[derive(Debug, Default, Clone)]
pub struct EkCrls(Vec<Vec<u8>>);

impl EkCrls {
    /// Reads a file's bytes: PEM (`X509 CRL` blocks, any number) or one DER CRL. Every list must
    /// parse: a file that holds something else is an error, not an empty list.
    pub fn parse(bytes: &[u8]) -> Result<EkCrls, CrlError> {
        let ders: Vec<Vec<u8>> = if bytes.starts_with(&[0x30]) {
            split_der(bytes)?
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

    /// Checks `cert`, issued by `issuer`, against that issuer's newest list here (a partial,
    /// unsigned or stale one refuses).
    pub fn check(
        &self,
        cert: &X509Certificate<'_>,
        issuer: &X509Certificate<'_>,
    ) -> Result<(), CrlError> {
        let issuer_name = issuer.subject().to_string();
        let lists: Vec<CertificateRevocationList<'_>> = self
            .0
            .iter()
            .filter_map(|der| {
                CertificateRevocationList::from_der(der)
                    .ok()
                    .map(|(_, c)| c)
            })
            .filter(|crl| {
                crl.issuer().as_raw() == issuer.subject().as_raw()
                    || crl.issuer().to_string() == issuer_name
            })
            .collect();
        // The issuer's newest list decides (an older one beside it is history, not a refusal).
        let newest = lists.iter().max_by_key(|crl| crl.last_update().timestamp());
        if let Some(crl) = newest {
            if let Some(ext) = crl.extensions().iter().find(|e| {
                e.critical && !KNOWN_CRITICAL.contains(&e.oid.to_id_string().as_str())
                    || PARTIAL.contains(&e.oid.to_id_string().as_str())
            }) {
                return Err(CrlError::Partial {
                    issuer: issuer_name,
                    extension: ext.oid.to_id_string(),
                });
            }
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

/// The CRLs written back to back in a DER file; anything after the last one is an error.
fn split_der(bytes: &[u8]) -> Result<Vec<Vec<u8>>, CrlError> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let (after, _) =
            CertificateRevocationList::from_der(rest).map_err(|e| CrlError::Parse(e.into()))?;
        out.push(rest[..rest.len() - after.len()].to_vec());
        rest = after;
    }
    Ok(out)
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
    #[error("the CRL given for {issuer} is partial or has a critical extension hwkey does not know ({extension}): give the issuer's full CRL")]
    Partial { issuer: String, extension: String },
    #[error("the CRL given for {issuer} is not signed by it: fetch the issuer's CRL again")]
    NotSignedByIssuer { issuer: String },
    #[error(
        "the CRL given for {issuer} expired at {next_update}: fetch a fresh one from the issuer"
    )]
    Stale { issuer: String, next_update: String },
}
