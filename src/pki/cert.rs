//! Reading certificate chains and checking them against a key.

use std::path::Path;

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;

use super::PkiError;
use crate::key::{der, Key, KeyError};

/// Reads a chain (leaf first) from a PEM file of `CERTIFICATE` blocks, or one DER certificate.
pub fn load_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let bytes = crate::small_file::read(path).map_err(|source| PkiError::ReadCert {
        path: path.to_path_buf(),
        source,
    })?;
    parse_chain(&bytes, path)
}

/// [`load_chain`] on the bytes `path` held. The whole file or nothing: a PEM block that is cut
/// off or malformed (a file copied while it was written, a truncated secret) refuses the file,
/// where skipping it installed the leaf without its intermediate and every handshake failed.
pub fn parse_chain(bytes: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let chain: Vec<CertificateDer<'static>> = match pem::parse_many(bytes) {
        Ok(blocks) if !blocks.is_empty() => {
            let begins = pem_markers(bytes, b"-----BEGIN ");
            let ends = pem_markers(bytes, b"-----END ");
            if begins != blocks.len() || ends != blocks.len() {
                return Err(PkiError::TruncatedPem {
                    path: path.to_path_buf(),
                    begins,
                    whole: blocks.len(),
                });
            }
            blocks
                .into_iter()
                .filter(|b| b.tag() == "CERTIFICATE")
                .map(|b| CertificateDer::from(b.into_contents()))
                .collect()
        }
        _ if bytes.first() == Some(&0x30) => vec![CertificateDer::from(bytes.to_vec())],
        _ if pem_markers(bytes, b"-----BEGIN ") > 0 => {
            return Err(PkiError::TruncatedPem {
                path: path.to_path_buf(),
                begins: pem_markers(bytes, b"-----BEGIN "),
                whole: 0,
            })
        }
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
            problem: CertProblem::Unparsable(e.into()),
        })?;
    }
    Ok(chain)
}

/// How many times `marker` occurs in `bytes` (anywhere, as the PEM parser finds blocks: two
/// certificates joined without a newline are two blocks).
fn pem_markers(bytes: &[u8], marker: &[u8]) -> usize {
    bytes.windows(marker.len()).filter(|w| *w == marker).count()
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
        problem: CertProblem::NoPublicKey(Box::new(e)),
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
    /// Subject DN, RFC 4514 style.
    pub subject: String,
    /// Issuer DN, RFC 4514 style.
    pub issuer: String,
    /// Serial number, hex.
    pub serial: String,
    /// NotBefore, RFC 3339.
    pub not_before: String,
    /// NotAfter, RFC 3339.
    pub not_after: String,
    /// Seconds since the Unix epoch, for callers that compare.
    pub not_after_unix: i64,
    /// DNS names and IP addresses of the subjectAltName extension.
    pub subject_alt_names: Vec<String>,
    /// The public key's algorithm (`ec-p256`, `rsa-2048`, …).
    pub key_algorithm: String,
}

/// A name from a certificate, safe for a terminal or a log line: control characters (an
/// issuer's choice) are shown escaped, never sent to the terminal as they are.
pub fn printable(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Summarises a certificate (names made [`printable`]).
pub fn summarize(cert: &[u8]) -> Result<CertSummary, PkiError> {
    let (_, c) = x509_parser::parse_x509_certificate(cert).map_err(|e| PkiError::BadCert {
        what: "the certificate".into(),
        problem: CertProblem::Unparsable(e.into()),
    })?;
    let tbs = &c.tbs_certificate;
    let mut sans = Vec::new();
    if let Ok(Some(ext)) = tbs.subject_alternative_name() {
        for name in &ext.value.general_names {
            sans.push(match name {
                GeneralName::DNSName(d) => format!("DNS:{}", printable(d)),
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
                GeneralName::RFC822Name(e) => format!("email:{}", printable(e)),
                GeneralName::URI(u) => format!("URI:{}", printable(u)),
                other => printable(&format!("{other:?}")),
            });
        }
    }
    let key_algorithm = der::parse_spki(tbs.subject_pki.raw)
        .map(|i| i.algorithm.to_string())
        .unwrap_or_else(|_| tbs.subject_pki.algorithm.algorithm.to_id_string());
    Ok(CertSummary {
        subject: printable(&tbs.subject.to_string()),
        issuer: printable(&tbs.issuer.to_string()),
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

/// What is wrong with a certificate, for [`PkiError::BadCert`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CertProblem {
    #[error("{0}")]
    Unparsable(#[source] x509_parser::error::X509Error),
    #[error("{0}")]
    NoPublicKey(#[source] Box<crate::key::KeyError>),
    #[error("it holds no certificate")]
    Empty,
    #[error(
        "it is valid only from {from} to {to} (check the clock, or import a current certificate)"
    )]
    NotValidNow { from: String, to: String },
    #[error("its keyUsage does not allow digitalSignature, which a TLS client key needs")]
    NoDigitalSignature,
    #[error("its extendedKeyUsage does not include clientAuth: it is not a client certificate")]
    NotClientAuth,
    #[error("it is a CA certificate (basicConstraints CA:TRUE), not a client certificate: the API server refuses it for clients")]
    IsCa,
    #[error("its DNS name '{0}' holds control characters or spaces: no DNS name does")]
    DnsWithControl(String),
    #[error("its signature does not verify with the next certificate's key ({next}): the file is corrupted or out of order")]
    BrokenLink { next: String },
    #[error("its signature does not verify with any certificate of --ca: the file is corrupted, or it was issued by another CA")]
    Untrusted,
}

/// A client certificate's extensions: keyUsage allows digitalSignature, extendedKeyUsage (when
/// there) includes clientAuth, it is not a CA, and its DNS names hold no control characters.
fn check_leaf_extensions(
    leaf: &x509_parser::certificate::X509Certificate<'_>,
) -> Result<(), CertProblem> {
    use x509_parser::extensions::ParsedExtension;
    for ext in leaf.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::KeyUsage(ku) if !ku.digital_signature() => {
                return Err(CertProblem::NoDigitalSignature)
            }
            ParsedExtension::ExtendedKeyUsage(eku) if !(eku.client_auth || eku.any) => {
                return Err(CertProblem::NotClientAuth)
            }
            ParsedExtension::BasicConstraints(bc) if bc.ca => return Err(CertProblem::IsCa),
            ParsedExtension::SubjectAlternativeName(san) => {
                for name in &san.general_names {
                    if let GeneralName::DNSName(d) = name {
                        if d.chars().any(|c| c.is_control() || c.is_whitespace()) {
                            return Err(CertProblem::DnsWithControl(printable(d)));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Checks a chain before it replaces the stored one (`hwkey cert import`): the leaf is valid now,
/// may sign (keyUsage digitalSignature) and authenticate clients (extendedKeyUsage clientAuth,
/// when the extension is there); every certificate is signed by the next one; and when
/// `anchors` are given, the last one is signed by one of them (or is one of them). A corrupted
/// certificate (a flipped bit in its body or signature) fails the signature check.
pub fn check_for_import(
    chain: &[CertificateDer<'_>],
    anchors: &[CertificateDer<'_>],
) -> Result<(), PkiError> {
    let mut certs = Vec::with_capacity(chain.len());
    for (i, der) in chain.iter().enumerate() {
        let (_, c) = x509_parser::parse_x509_certificate(der).map_err(|e| PkiError::BadCert {
            what: format!("certificate #{}", i + 1),
            problem: CertProblem::Unparsable(e.into()),
        })?;
        certs.push(c);
    }
    let leaf = certs.first().ok_or_else(|| PkiError::BadCert {
        what: "the chain".into(),
        problem: CertProblem::Empty,
    })?;
    let bad_leaf = |problem| PkiError::BadCert {
        what: format!(
            "the certificate for {}",
            printable(&leaf.subject().to_string())
        ),
        problem,
    };
    let validity = leaf.validity();
    if !validity.is_valid() {
        return Err(bad_leaf(CertProblem::NotValidNow {
            from: validity.not_before.to_string(),
            to: validity.not_after.to_string(),
        }));
    }
    check_leaf_extensions(leaf).map_err(bad_leaf)?;
    for (i, pair) in certs.windows(2).enumerate() {
        pair[0]
            .verify_signature(Some(pair[1].public_key()))
            .map_err(|_| PkiError::BadCert {
                what: format!("certificate #{} ({})", i + 1, pair[0].subject()),
                problem: CertProblem::BrokenLink {
                    next: pair[1].subject().to_string(),
                },
            })?;
    }
    if !anchors.is_empty() {
        let last = certs.last().unwrap_or(leaf);
        let last_der = chain.last().map(|c| c.as_ref()).unwrap_or_default();
        let trusted = anchors.iter().any(|a| {
            a.as_ref() == last_der
                || x509_parser::parse_x509_certificate(a)
                    .map(|(_, ca)| last.verify_signature(Some(ca.public_key())).is_ok())
                    .unwrap_or(false)
        });
        if !trusted {
            return Err(PkiError::BadCert {
                what: format!("the certificate for {}", last.subject()),
                problem: CertProblem::Untrusted,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem_of(der: &[u8]) -> String {
        pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()))
    }

    /// A chain file cut inside its second block, or with a block whose base64 is broken, is
    /// refused whole, naming the file; before, the cut block was skipped and the leaf alone was
    /// installed.
    #[test]
    fn a_chain_file_with_a_cut_or_broken_block_is_refused_whole() {
        let leaf = rcgen::generate_simple_self_signed(vec!["a".into()]).expect("cert");
        let ca = rcgen::generate_simple_self_signed(vec!["b".into()]).expect("cert");
        let whole = format!("{}{}", pem_of(leaf.cert.der()), pem_of(ca.cert.der()));
        let path = Path::new("/etc/hwkey/chain.pem");
        assert_eq!(parse_chain(whole.as_bytes(), path).expect("whole").len(), 2);
        let cut = &whole[..whole.len() - 200];
        let e = parse_chain(cut.as_bytes(), path).expect_err("a cut chain");
        assert!(
            matches!(
                e,
                PkiError::TruncatedPem {
                    begins: 2,
                    whole: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("/etc/hwkey/chain.pem"), "{e}");
        let broken = whole.replacen("-----END CERTIFICATE-----", "-----END CERTIFICATE", 2);
        assert!(parse_chain(broken.as_bytes(), path).is_err());
        // Joined without a newline: still two whole blocks.
        let joined = format!(
            "{}{}",
            pem_of(leaf.cert.der()).trim_end(),
            pem_of(ca.cert.der())
        );
        assert_eq!(
            parse_chain(joined.as_bytes(), path).expect("joined").len(),
            2
        );
        let only_cut = &pem_of(leaf.cert.der())[..100];
        assert!(matches!(
            parse_chain(only_cut.as_bytes(), path),
            Err(PkiError::TruncatedPem { .. })
        ));
    }
}
