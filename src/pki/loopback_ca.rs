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
const CA_LOCK_FILE: &str = "loopback-ca.lock";

/// What [`LoopbackCa::load`] found.
enum Stored {
    Ca(Box<LoopbackCa>),
    Nothing,
    KeyWithoutCertificate,
}

/// The lock creators of the CA take: an exclusive `flock` on `loopback-ca.lock`, released when
/// dropped (or when the process dies: a crash leaves no stale lock).
struct CreationLock {
    _file: fs::File,
}

impl CreationLock {
    fn take(dir: &Path) -> Result<CreationLock, PkiError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(CA_LOCK_FILE);
        let file = crate::state_dir::open_private(
            &path,
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600),
        )
        .and_then(|f| f.lock().map(|()| f))
        .map_err(|e| PkiError::LoopbackCa {
            path,
            problem: CaProblem::Io(e),
        })?;
        Ok(CreationLock { _file: file })
    }
}

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
    ///
    /// Creation runs under an `flock` on `loopback-ca.lock` in `dir`, and so does a load that
    /// finds the key without its certificate: a creator writes the key, then the certificate,
    /// and a process that read between the two failed. Under the lock, a key still without its
    /// certificate was left by a creation that was interrupted; no client can trust a CA whose
    /// certificate was never written, so a new CA is made and the orphaned key is kept beside
    /// it (renamed, never deleted). A CA that loads needs no lock (a read-only state directory
    /// works).
    pub fn load_or_create(dir: &Path) -> Result<LoopbackCa, PkiError> {
        crate::state_dir::ensure_private(dir).map_err(|source| PkiError::StateDir {
            path: dir.to_path_buf(),
            source,
        })?;
        if let Stored::Ca(ca) = Self::load(dir)? {
            return Ok(*ca);
        }
        let _lock = CreationLock::take(dir)?;
        match Self::load(dir)? {
            Stored::Ca(ca) => Ok(*ca),
            Stored::Nothing => Self::create(dir),
            Stored::KeyWithoutCertificate => {
                let key_path = dir.join(CA_KEY_FILE);
                let kept = dir.join(format!(
                    "{CA_KEY_FILE}.orphaned-{}",
                    OffsetDateTime::now_utc().unix_timestamp()
                ));
                fs::rename(&key_path, &kept).map_err(|e| PkiError::LoopbackCa {
                    path: key_path,
                    problem: CaProblem::Io(e),
                })?;
                tracing::warn!(
                    kept = %kept.display(),
                    "the loopback CA key had no certificate (its creation was interrupted), so no client trusts it: creating a new loopback CA"
                );
                Self::create(dir)
            }
        }
    }

    /// What the state directory holds.
    fn load(dir: &Path) -> Result<Stored, PkiError> {
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        let key_bytes = match crate::state_dir::read_private(&key_path) {
            Ok(b) => Zeroizing::new(b),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Stored::Nothing),
            Err(e) => {
                return Err(PkiError::LoopbackCa {
                    path: key_path,
                    problem: CaProblem::Io(e),
                })
            }
        };
        let key_pem = Zeroizing::new(
            std::str::from_utf8(&key_bytes)
                .map_err(|_| PkiError::LoopbackCa {
                    path: key_path.clone(),
                    problem: CaProblem::NotPemText,
                })?
                .to_string(),
        );
        let mode = fs::metadata(&key_path)
            .map_err(|source| PkiError::StateDir {
                path: dir.to_path_buf(),
                source,
            })?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(PkiError::LoopbackCa {
                path: key_path,
                problem: CaProblem::Readable(mode & 0o777),
            });
        }
        let cert_pem = match crate::state_dir::read_private(&cert_path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Stored::KeyWithoutCertificate),
            Err(e) => {
                return Err(PkiError::LoopbackCa {
                    path: cert_path,
                    problem: CaProblem::Io(e),
                })
            }
        };
        Self::from_pem(dir, &cert_pem, &key_pem).map(|ca| Stored::Ca(Box::new(ca)))
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

    /// Makes a new CA: under the creation lock, with no key (or only a moved-aside one) there.
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
        // The key first and without clobbering (an hwkey of before the lock may be creating
        // one beside us: its CA is then used), the certificate second.
        match crate::atomic_file::create_atomic(&dir.join(CA_KEY_FILE), key_pem.as_bytes(), 0o600) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                std::thread::sleep(Duration::from_millis(200));
                return match Self::load(dir)? {
                    Stored::Ca(ca) => Ok(*ca),
                    _ => Err(fail(CaProblem::Io(e))),
                };
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

    /// A creation interrupted between the key and the certificate (a crash, a full disk) left
    /// a key alone, and every later start failed on the missing certificate until someone
    /// deleted the key by hand. Now a new CA is made and the orphaned key is kept beside it.
    #[test]
    fn a_key_left_without_its_certificate_is_kept_aside_and_a_new_ca_made() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        LoopbackCa::load_or_create(&state).unwrap();
        let orphan = fs::read(state.join(CA_KEY_FILE)).unwrap();
        fs::remove_file(state.join(CA_CERT_FILE)).unwrap();
        let new = LoopbackCa::load_or_create(&state).expect("a new CA");
        let kept: Vec<_> = fs::read_dir(&state)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("loopback-ca.key.orphaned-")
            })
            .collect();
        assert_eq!(kept.len(), 1, "the orphaned key is kept, once");
        assert_eq!(fs::read(kept[0].path()).unwrap(), orphan);
        assert_ne!(fs::read(state.join(CA_KEY_FILE)).unwrap(), orphan);
        let again = LoopbackCa::load_or_create(&state).unwrap();
        assert_eq!(
            new.cert_der(),
            again.cert_der(),
            "the new CA is the one kept"
        );
    }

    /// Eight processes' worth of starts at once on an empty state directory: one CA, the same
    /// for all. A start that read the key between the creator's key and certificate writes
    /// failed on the missing certificate.
    #[test]
    fn starts_at_once_on_an_empty_directory_share_one_ca() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let state = dir.path().join("state");
            let barrier = std::sync::Barrier::new(8);
            let certs: Vec<_> = std::thread::scope(|s| {
                let starts: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            LoopbackCa::load_or_create(&state).map(|ca| ca.cert_pem().to_string())
                        })
                    })
                    .collect();
                starts.into_iter().map(|t| t.join().unwrap()).collect()
            });
            let first = certs[0].as_ref().expect("a CA").clone();
            for c in &certs {
                assert_eq!(c.as_ref().expect("a CA"), &first);
            }
            assert_eq!(fs::read_to_string(state.join(CA_CERT_FILE)).unwrap(), first);
        }
    }

    #[test]
    fn rfc3339_text() {
        let t = OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20Z");
    }
}
