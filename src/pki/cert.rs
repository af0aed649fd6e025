//! Reading certificate chains and checking them against a key.

use std::path::Path;

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

use super::PkiError;
use crate::key::{der, Key, KeyError};

/// Reads a chain (leaf first) from a PEM file of `CERTIFICATE` blocks, or one DER certificate.
pub fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let bytes = std::fs::read(path).map_err(|source| PkiError::ReadCert {
        path: path.to_path_buf(),
        source,
    })?;
    let chain: Vec<CertificateDer<'static>> = match pem::parse_many(&bytes) {
        Ok(blocks) if !blocks.is_empty() => blocks
            .into_iter()
            .filter(|b| b.tag() == "CERTIFICATE")
            .map(|b| CertificateDer::from(b.into_contents()))
            .collect(),
        _ if bytes.first() == Some(&0x30) => vec![CertificateDer::from(bytes)],
        _ => Vec::new(),
    };
    if chain.is_empty() {
        return Err(PkiError::NoCertInFile {
            path: path.to_path_buf(),
        });
    }
    for (i, cert) in chain.iter().enumerate() {
        x509_parser::parse_x509_certificate(cert).map_err(|e| PkiError::BadCert {
            what: format!("certificate #{} in {}", i + 1, path.display()),
            reason: e.to_string(),
        })?;
    }
    Ok(chain)
}

/// The chain for a key: from `--cert` when given, else the one stored with the key.
pub fn chain_for_key(
    key: &Key,
    cert: Option<&Path>,
) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let chain = match cert {
        Some(path) => load_chain(path)?,
        None => key
            .stored_chain()?
            .ok_or_else(|| PkiError::NoCertificate {
                key: key.describe(),
            })?
            .into_iter()
            .map(CertificateDer::from)
            .collect(),
    };
    Ok(chain)
}

/// True when the certificate holds the key's public key.
pub fn matches_key(cert: &[u8], key: &Key) -> Result<bool, PkiError> {
    let spki = der::cert_spki(cert).map_err(|e| PkiError::BadCert {
        what: "the certificate".into(),
        reason: e.to_string(),
    })?;
    Ok(der::same_public_key(&spki, key.spki_der()))
}

/// Fails with a message naming both sides when the leaf does not belong to the key.
pub fn ensure_matches(cert: &[u8], key: &Key) -> Result<(), PkiError> {
    if matches_key(cert, key)? {
        Ok(())
    } else {
        Err(PkiError::Key(KeyError::CertificateMismatch {
            key: key.describe(),
            subject: crate::key::tls::subject_of(cert),
        }))
    }
}

/// What `hwkey cert show` prints about a certificate.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CertSummary {
    pub subject: String,
    pub issuer: String,
    pub serial: String,
    pub not_before: String,
    pub not_after: String,
    /// Seconds since the Unix epoch, for callers that compare.
    pub not_after_unix: i64,
    pub subject_alt_names: Vec<String>,
    pub key_algorithm: String,
}

/// Summarises a certificate.
pub fn summarize(cert: &[u8]) -> Result<CertSummary, PkiError> {
    let (_, c) = x509_parser::parse_x509_certificate(cert).map_err(|e| PkiError::BadCert {
        what: "the certificate".into(),
        reason: e.to_string(),
    })?;
    let tbs = &c.tbs_certificate;
    let mut sans = Vec::new();
    if let Ok(Some(ext)) = tbs.subject_alternative_name() {
        for name in &ext.value.general_names {
            sans.push(match name {
                GeneralName::DNSName(d) => format!("DNS:{d}"),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => format!(
                        "IP:{}",
                        std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).unwrap_or([0; 4]))
                    ),
                    16 => format!(
                        "IP:{}",
                        std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).unwrap_or([0; 16]))
                    ),
                    _ => "IP:(malformed)".into(),
                },
                GeneralName::RFC822Name(e) => format!("email:{e}"),
                GeneralName::URI(u) => format!("URI:{u}"),
                other => format!("{other:?}"),
            });
        }
    }
    let key_algorithm = der::parse_spki(tbs.subject_pki.raw)
        .map(|i| i.algorithm.to_string())
        .unwrap_or_else(|_| tbs.subject_pki.algorithm.algorithm.to_id_string());
    Ok(CertSummary {
        subject: tbs.subject.to_string(),
        issuer: tbs.issuer.to_string(),
        serial: tbs.raw_serial_as_string(),
        not_before: tbs.validity.not_before.to_string(),
        not_after: tbs.validity.not_after.to_string(),
        not_after_unix: tbs.validity.not_after.timestamp(),
        subject_alt_names: sans,
        key_algorithm,
    })
}

/// Encodes a chain as PEM.
pub fn chain_to_pem(chain: &[CertificateDer<'_>]) -> String {
    chain
        .iter()
        .map(|c| der::to_pem("CERTIFICATE", c))
        .collect()
}
