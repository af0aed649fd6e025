//! The loopback CA: the trust anchor of the local hop between kubectl/kubelet and the proxy.
//!
//! client-go insists on a client certificate *and* key, and the hardware key cannot be handed
//! out, so local clients get throw-away credentials: a software P-256 key and a short-lived
//! certificate from this CA. They authenticate only the local hop; the API server never sees
//! them. The CA's own key is a software key too, kept in `--state-dir` (mode 0600) so that
//! credentials survive a proxy restart; the hardware key is never used here.
//!
//! The proxy's loopback TLS server certificate is minted from the same CA at every start (in
//! memory only), so a client needs just the CA certificate to verify the proxy.
//!
//! Everything here is synchronous and cheap (software ECDSA); it runs on whichever task asks.

use std::fs;
use std::io::ErrorKind;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;
use zeroize::Zeroizing;

use super::PkiError;

const CA_CERT_FILE: &str = "loopback-ca.pem";
const CA_KEY_FILE: &str = "loopback-ca.key";

/// The loopback CA, loaded from or created in the state directory.
pub struct LoopbackCa {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    dir: PathBuf,
}

impl std::fmt::Debug for LoopbackCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackCa")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// A loopback client credential: what the control socket hands out.
pub struct LoopbackCredential {
    /// The client certificate (PEM) for the local hop.
    pub cert_pem: String,
    /// The throw-away private key (PKCS#8 PEM); wiped from memory on drop.
    pub key_pem: Zeroizing<String>,
    /// The loopback CA certificate (PEM) that the proxy's server certificate chains to.
    pub ca_pem: String,
    /// The client certificate's NotAfter.
    pub not_after: OffsetDateTime,
}

/// What is wrong with the loopback CA's files, for [`PkiError::LoopbackCa`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CaProblem {
    #[error("it is not PEM text")]
    NotPemText,
    #[error("mode {0:o} lets other users read it; chmod 600 it (or delete the state directory to start a new CA)")]
    Readable(u32),
    #[error("{0}")]
    Io(#[source] std::io::Error),
    #[error("{0}")]
    Rcgen(#[source] rcgen::Error),
    #[error("{0}")]
    Pem(#[source] pem::PemError),
}

impl LoopbackCa {
    /// Loads the CA from `dir`, or creates it there (directory 0700, files 0600).
    ///
    /// Refuses a CA key file that other users can read: anyone holding it could mint loopback
    /// credentials and use the hardware identity.
    pub fn load_or_create(dir: &Path) -> Result<LoopbackCa, PkiError> {
        let state = |source: std::io::Error| PkiError::StateDir {
            path: dir.to_path_buf(),
            source,
        };
        crate::state_dir::ensure_private(dir).map_err(state)?;
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        match crate::state_dir::read_private(&key_path) {
            Ok(key_bytes) => {
                let key_bytes = Zeroizing::new(key_bytes);
                let key_pem = Zeroizing::new(
                    std::str::from_utf8(&key_bytes)
                        .map_err(|_| PkiError::LoopbackCa {
                            path: key_path.clone(),
                            problem: CaProblem::NotPemText,
                        })?
                        .to_string(),
                );
                let mode = fs::metadata(&key_path).map_err(state)?.permissions().mode();
                if mode & 0o077 != 0 {
                    return Err(PkiError::LoopbackCa {
                        path: key_path,
                        problem: CaProblem::Readable(mode & 0o777),
                    });
                }
                let cert_pem = crate::state_dir::read_private(&cert_path)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .map_err(|e| PkiError::LoopbackCa {
                        path: cert_path.clone(),
                        problem: CaProblem::Io(e),
                    })?;
                Self::from_pem(dir, &cert_pem, &key_pem)
            }
            Err(e) if e.kind() == ErrorKind::NotFound => Self::create(dir),
            Err(e) => Err(PkiError::LoopbackCa {
                path: key_path,
                problem: CaProblem::Io(e),
            }),
        }
    }

    fn from_pem(dir: &Path, cert_pem: &str, key_pem: &str) -> Result<LoopbackCa, PkiError> {
        let bad = |problem| PkiError::LoopbackCa {
            path: dir.join(CA_CERT_FILE),
            problem,
        };
        let key = KeyPair::from_pem(key_pem).map_err(|e| bad(CaProblem::Rcgen(e)))?;
        let block = pem::parse(cert_pem).map_err(|e| bad(CaProblem::Pem(e)))?;
        let cert_der = CertificateDer::from(block.into_contents());
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(|e| bad(CaProblem::Rcgen(e)))?;
        Ok(LoopbackCa {
            issuer,
            cert_der,
            cert_pem: cert_pem.to_string(),
            dir: dir.to_path_buf(),
        })
    }

    fn create(dir: &Path) -> Result<LoopbackCa, PkiError> {
        let fail = |problem| PkiError::LoopbackCa {
            path: dir.join(CA_KEY_FILE),
            problem,
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(|e| fail(CaProblem::Rcgen(e)))?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "hwkey loopback CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        params.serial_number = Some(random_serial()?);
        let cert = params
            .self_signed(&key)
            .map_err(|e| fail(CaProblem::Rcgen(e)))?;
        let key_pem = Zeroizing::new(key.serialize_pem());
        let cert_pem = cert.pem();
        // The key first and without clobbering: if another proxy created the CA at the same
        // moment, use its CA instead of overwriting what its clients already trust.
        match crate::atomic_file::create_atomic(&dir.join(CA_KEY_FILE), key_pem.as_bytes(), 0o600) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                std::thread::sleep(Duration::from_millis(200));
                return Self::load_or_create(dir);
            }
            Err(e) => return Err(fail(CaProblem::Io(e))),
        }
        crate::atomic_file::write_atomic(&dir.join(CA_CERT_FILE), cert_pem.as_bytes(), 0o600)
            .map_err(|e| fail(CaProblem::Io(e)))?;
        tracing::info!(dir = %dir.display(), "created a new loopback CA");
        Self::from_pem(dir, &cert_pem, &key_pem)
    }

    /// The CA certificate (PEM), what local clients trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// Path of the CA certificate file.
    pub fn cert_path(&self) -> PathBuf {
        self.dir.join(CA_CERT_FILE)
    }

    /// A server certificate for the loopback listener (localhost + the given addresses),
    /// valid for a year; minted at every start and kept in memory only.
    pub fn server_cert(
        &self,
        ips: &[IpAddr],
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), PkiError> {
        let fail = |e: rcgen::Error| PkiError::LoopbackCa {
            path: self.cert_path(),
            problem: CaProblem::Rcgen(e),
        };
        let (key, mut params) = leaf(
            "hwkey proxy (loopback)",
            ExtendedKeyUsagePurpose::ServerAuth,
        )
        .map_err(fail)?;
        params
            .subject_alt_names
            .push(SanType::DnsName("localhost".try_into().map_err(fail)?));
        for ip in ips {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::minutes(5);
        params.not_after = now + time::Duration::days(365);
        params.serial_number = Some(random_serial()?);
        let cert = params.signed_by(&key, &self.issuer).map_err(fail)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((vec![cert.der().clone()], key_der))
    }

    /// Mints a loopback client credential valid for `validity`, but never past `cap` (the
    /// hardware certificate's NotAfter: a local credential must not outlive the identity it
    /// stands for).
    pub fn mint_client(
        &self,
        validity: Duration,
        cap: Option<OffsetDateTime>,
    ) -> Result<LoopbackCredential, PkiError> {
        let fail = |e: rcgen::Error| PkiError::LoopbackCa {
            path: self.cert_path(),
            problem: CaProblem::Rcgen(e),
        };
        let (key, mut params) =
            leaf("hwkey loopback client", ExtendedKeyUsagePurpose::ClientAuth).map_err(fail)?;
        let now = OffsetDateTime::now_utc();
        let wanted = now + time::Duration::try_from(validity).unwrap_or(time::Duration::MAX);
        let not_after = match cap {
            Some(c) if c < wanted => c,
            _ => wanted,
        };
        // NotAfter has second precision in X.509; report exactly what the certificate says.
        let not_after = not_after.replace_nanosecond(0).unwrap_or(not_after);
        params.not_before = now - time::Duration::minutes(1);
        params.not_after = not_after;
        params.serial_number = Some(random_serial()?);
        let cert = params.signed_by(&key, &self.issuer).map_err(fail)?;
        Ok(LoopbackCredential {
            cert_pem: cert.pem(),
            key_pem: Zeroizing::new(key.serialize_pem()),
            ca_pem: self.cert_pem.clone(),
            not_after,
        })
    }
}

fn random_serial() -> Result<SerialNumber, PkiError> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| PkiError::Random)?;
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    Ok(SerialNumber::from_slice(&bytes))
}

/// A fresh software P-256 key and the parameters every loopback leaf shares: one CN, not a CA,
/// digitalSignature, one extended key usage, an authority key identifier.
fn leaf(
    cn: &str,
    usage: ExtendedKeyUsagePurpose,
) -> Result<(KeyPair, CertificateParams), rcgen::Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    Ok((key, params))
}

/// RFC 3339 UTC text (`2026-01-02T03:04:05Z`) without pulling in time's formatting feature.
pub fn rfc3339(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_then_reloads_the_same_ca() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let a = LoopbackCa::load_or_create(&state).unwrap();
        let mode = fs::metadata(state.join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let b = LoopbackCa::load_or_create(&state).unwrap();
        assert_eq!(a.cert_der(), b.cert_der());
        let cred = b.mint_client(Duration::from_secs(600), None).unwrap();
        assert!(cred.key_pem.contains("PRIVATE KEY"));
        let cap = OffsetDateTime::now_utc() + time::Duration::seconds(30);
        let capped = b.mint_client(Duration::from_secs(600), Some(cap)).unwrap();
        assert!(capped.not_after <= cap);
        fs::set_permissions(state.join(CA_KEY_FILE), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(LoopbackCa::load_or_create(&state).is_err());
    }

    #[test]
    fn rfc3339_text() {
        let t = OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20Z");
    }
}
