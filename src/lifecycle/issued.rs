//! Checking an issued certificate and installing it where the proxy reads it.
//!
//! Nothing is installed unless the certificate holds the hardware key's public key and is valid
//! now: a signer that answered with someone else's certificate, or one not yet valid, must not
//! replace a working identity. Installing is atomic (temp file + rename, or on the token new
//! objects before old ones are removed); a file keeps its predecessor beside it as `FILE.prev`,
//! so an operator can go back.

use std::path::PathBuf;

use rustls::pki_types::CertificateDer;

use super::LifecycleError;
use crate::key::Key;
use crate::pki::cert;

/// A certificate that passed the checks.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The issued chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's subject (`CN=…, O=…`).
    pub subject: String,
    /// The leaf's serial number (hex).
    pub serial: String,
    /// NotBefore, Unix seconds.
    pub not_before_unix: i64,
    /// NotAfter, Unix seconds.
    pub not_after_unix: i64,
    /// NotAfter, RFC 3339, for messages.
    pub not_after: String,
}

/// Why an issued certificate is not installed, for [`LifecycleError::BadIssued`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum IssuedProblem {
    #[error("not PEM: {0}")]
    NotPem(#[source] pem::PemError),
    #[error("it holds no certificate")]
    Empty,
    #[error("it does not hold the public key of {0}")]
    OtherKey(String),
    #[error("{0}")]
    NotForImport(#[source] crate::pki::PkiError),
    #[error("unreadable: {0}")]
    Unreadable(#[source] x509_parser::error::X509Error),
    #[error("it is valid only from {from} to {to}")]
    NotValidNow { from: String, to: String },
}

/// Parses the PEM chain of CertificateSigningRequest `name` and checks it against `key`.
pub fn check_issued(name: &str, pem_chain: &[u8], key: &Key) -> Result<Issued, LifecycleError> {
    let bad = |problem| LifecycleError::BadIssued {
        name: name.to_string(),
        problem,
    };
    let chain: Vec<CertificateDer<'static>> = pem::parse_many(pem_chain)
        .map_err(|e| bad(IssuedProblem::NotPem(e)))?
        .into_iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| CertificateDer::from(b.into_contents()))
        .collect();
    let leaf = chain.first().ok_or_else(|| bad(IssuedProblem::Empty))?;
    if !cert::matches_key(leaf, key)? {
        return Err(bad(IssuedProblem::OtherKey(key.describe())));
    }
    // What `cert import` checks: a client certificate the API server will take (valid now,
    // digitalSignature, clientAuth, not a CA). A signer that returns a serverAuth-only or CA
    // certificate must not get it installed.
    cert::check_for_import(&chain, &[]).map_err(|e| bad(IssuedProblem::NotForImport(e)))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| bad(IssuedProblem::Unreadable(e.into())))?;
    let validity = parsed.validity();
    if !validity.is_valid() {
        return Err(bad(IssuedProblem::NotValidNow {
            from: validity.not_before.to_string(),
            to: validity.not_after.to_string(),
        }));
    }
    Ok(Issued {
        subject: crate::pki::cert::printable(&parsed.subject().to_string()),
        serial: parsed.raw_serial_as_string(),
        not_before_unix: validity.not_before.timestamp(),
        not_after_unix: validity.not_after.timestamp(),
        not_after: validity.not_after.to_string(),
        chain,
    })
}

/// Where a certificate lives.
#[derive(Debug, Clone)]
pub enum Target {
    /// A PEM file (`hwkey renew --cert`), written by this process.
    File(PathBuf),
    /// The certificate file the key's signer was configured with (the proxy's `--cert`),
    /// written by the signer, which takes only a chain for its key and identity: the proxy's
    /// network side cannot write that file itself.
    SignerFile(std::sync::Arc<crate::key::Key>),
    /// The key's own store (PKCS#11 certificate objects, or `NAME.crt.pem` beside a TPM key),
    /// written through the key (a signer's key stores through the signer).
    KeyStore(std::sync::Arc<crate::key::Key>),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::File(p) => write!(f, "{}", p.display()),
            Target::SignerFile(key) => write!(
                f,
                "the certificate file of the signer of {}",
                key.uri().without_pin()
            ),
            Target::KeyStore(key) => write!(f, "the store of {}", key.uri().without_pin()),
        }
    }
}

/// Installs `issued` at `target`. A file's previous content is kept as `FILE.prev` first.
/// Returns where it went, for the user.
pub fn install(target: &Target, issued: &Issued) -> Result<String, LifecycleError> {
    write(target, &issued.chain, true)
}

/// Writes `chain` at `target` without keeping what is there ([`install`] keeps it; a roll-back
/// to the chain that was in use does not).
pub fn install_chain(
    target: &Target,
    chain: &[CertificateDer<'static>],
) -> Result<String, LifecycleError> {
    write(target, chain, false)
}

fn write(
    target: &Target,
    chain: &[CertificateDer<'static>],
    keep_previous: bool,
) -> Result<String, LifecycleError> {
    let der = || chain.iter().map(|c| c.to_vec()).collect::<Vec<_>>();
    match target {
        Target::File(path) => {
            let pem = cert::chain_to_pem(chain);
            let written = if keep_previous {
                crate::atomic_file::write_keeping_previous(path, pem.as_bytes(), 0o644)
            } else {
                crate::atomic_file::write_atomic(path, pem.as_bytes(), 0o644)
            };
            written.map_err(|source| LifecycleError::Install {
                path: path.clone(),
                source,
            })?;
            Ok(path.display().to_string())
        }
        Target::SignerFile(key) => Ok(key.install_certificate(&der(), keep_previous)?),
        Target::KeyStore(key) => Ok(key.store_chain(&der())?),
    }
}
