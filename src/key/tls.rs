//! rustls adapter: a hardware key as a client-certificate signing key.
//!
//! rustls's `with_client_auth_cert` wants a software key, so the key goes in through a
//! [`HardwareCertResolver`]. The signature happens inside the handshake, on whatever thread
//! drives the connection; on a multi-thread tokio runtime the blocking hardware call runs under
//! `block_in_place` so other tasks on that worker move elsewhere instead of stalling.

use std::sync::{Arc, Mutex, RwLock};

use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, SubjectPublicKeyInfoDer};
use rustls::sign::{CertifiedKey, Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};

use super::{der, Key, KeyAlgorithm, KeyError, SignScheme, SigningPath};
use crate::key::CapabilityError;

/// How a failed hardware signature reads inside rustls's error (`rustls::Error::General`).
const SIGNATURE_FAILED: &str = "hardware signature failed";

/// Whether a TLS handshake failed because the hardware could not sign (not because of the
/// peer): the handshake's I/O error carries our rustls error.
pub fn is_signature_failure(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|r| matches!(r, rustls::Error::General(m) if m.starts_with(SIGNATURE_FAILED)))
}

/// The TLS versions a connection signed by `key` may use. A key that can make RSA-PSS or ECDSA
/// signatures offers TLS 1.3, and 1.2 too with `--allow-tls12-fallback` (a TLS 1.2 transcript
/// is a loose shape the signer would otherwise sign for anyone holding its socket; every
/// Kubernetes API server speaks 1.3). A PKCS#1-only RSA key cannot sign a TLS 1.3
/// CertificateVerify at all: it gets TLS 1.2 alone when the user allowed the fallback, and a
/// clear error otherwise — never a handshake that fails in a way users cannot read.
pub fn protocol_versions(
    key: &Key,
    allow_tls12_fallback: bool,
) -> Result<&'static [&'static rustls::SupportedProtocolVersion], KeyError> {
    static BOTH: [&rustls::SupportedProtocolVersion; 2] =
        [&rustls::version::TLS13, &rustls::version::TLS12];
    static TLS12_ONLY: [&rustls::SupportedProtocolVersion; 1] = [&rustls::version::TLS12];
    static TLS13_ONLY: [&rustls::SupportedProtocolVersion; 1] = [&rustls::version::TLS13];
    match key.signing_path() {
        SigningPath::Native | SigningPath::SoftwarePss { .. } if allow_tls12_fallback => Ok(&BOTH),
        SigningPath::Native | SigningPath::SoftwarePss { .. } => Ok(&TLS13_ONLY),
        SigningPath::Pkcs1Only { .. } if allow_tls12_fallback => {
            tracing::warn!(
                key = %key.describe(),
                "the token has no RSA-PSS: connections use TLS 1.2 with PKCS#1 v1.5 signatures (--allow-tls12-fallback)"
            );
            Ok(&TLS12_ONLY)
        }
        SigningPath::Pkcs1Only { missing } => {
            Err(KeyError::Capability(CapabilityError::NoTls13Signature {
                key: key.describe(),
                missing,
            }))
        }
        SigningPath::Unusable { missing } => Err(KeyError::Capability(
            CapabilityError::NoSignatureMechanism {
                key: key.describe(),
                missing,
            },
        )),
    }
}

/// Maps our scheme to the TLS code point.
pub fn to_rustls(scheme: SignScheme) -> SignatureScheme {
    match scheme {
        SignScheme::EcdsaP256Sha256 => SignatureScheme::ECDSA_NISTP256_SHA256,
        SignScheme::EcdsaP384Sha384 => SignatureScheme::ECDSA_NISTP384_SHA384,
        SignScheme::RsaPssSha256 => SignatureScheme::RSA_PSS_SHA256,
        SignScheme::RsaPssSha384 => SignatureScheme::RSA_PSS_SHA384,
        SignScheme::RsaPssSha512 => SignatureScheme::RSA_PSS_SHA512,
        SignScheme::RsaPkcs1Sha256 => SignatureScheme::RSA_PKCS1_SHA256,
        SignScheme::RsaPkcs1Sha384 => SignatureScheme::RSA_PKCS1_SHA384,
        SignScheme::RsaPkcs1Sha512 => SignatureScheme::RSA_PKCS1_SHA512,
    }
}

/// A hardware key as a rustls `SigningKey`.
#[derive(Debug, Clone)]
pub struct HardwareSigningKey {
    key: Arc<Key>,
    last_scheme: Arc<Mutex<Option<SignScheme>>>,
}

impl HardwareSigningKey {
    /// Wraps an opened key.
    pub fn new(key: Arc<Key>) -> HardwareSigningKey {
        HardwareSigningKey {
            key,
            last_scheme: Arc::new(Mutex::new(None)),
        }
    }

    /// The key underneath.
    pub fn key(&self) -> &Arc<Key> {
        &self.key
    }

    /// The scheme of the last signature made through this adapter (for `hwkey probe`'s report).
    pub fn last_scheme(&self) -> Option<SignScheme> {
        *self.last_scheme.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pick(&self, offered: &[SignatureScheme]) -> Option<SignScheme> {
        self.key
            .schemes()
            .into_iter()
            .find(|s| offered.contains(&to_rustls(*s)))
    }
}

impl SigningKey for HardwareSigningKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        match self.pick(offered) {
            Some(scheme) => Some(Box::new(HardwareSigner {
                key: self.clone(),
                scheme,
            })),
            None => {
                // rustls now silently sends an empty Certificate; say so loudly.
                tracing::error!(
                    key = %self.key.describe(),
                    offered = ?offered,
                    "the server accepts no signature scheme this {} key can make; no client certificate will be sent",
                    self.key.algorithm()
                );
                None
            }
        }
    }

    fn public_key(&self) -> Option<SubjectPublicKeyInfoDer<'_>> {
        Some(SubjectPublicKeyInfoDer::from(self.key.spki_der()))
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        match self.key.algorithm() {
            KeyAlgorithm::EcP256 | KeyAlgorithm::EcP384 => SignatureAlgorithm::ECDSA,
            KeyAlgorithm::Rsa { .. } => SignatureAlgorithm::RSA,
        }
    }
}

#[derive(Debug)]
struct HardwareSigner {
    key: HardwareSigningKey,
    scheme: SignScheme,
}

thread_local! {
    /// Set while a handshake step that must make no signature runs on this thread
    /// ([`without_signatures`]).
    static REFUSING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What a handshake run [`without_signatures`] fails with when its server wants a signature.
pub const SIGNATURE_REFUSED: &str =
    "no hardware signature for a connection no client has asked for yet";

/// Whether a handshake run [`without_signatures`] failed because its server wanted a
/// signature (it would not resume the session): the connection may try again where the key
/// may sign.
pub fn is_signature_refused(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|r| matches!(r, rustls::Error::General(m) if m == SIGNATURE_REFUSED))
}

/// Runs `step` (a synchronous step of a TLS handshake: rustls asks for the CertificateVerify
/// inside it) with every hardware signature on this thread refused: a connection made ahead
/// for a client that has not come yet resumes a session or fails, and never makes the key sign
/// (a TPM's queue, a token's touch or PIN prompt) for nobody. The same resolver serves it as
/// any connection, as rustls resumes only a session made with the same one.
pub fn without_signatures<R>(step: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            REFUSING.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(REFUSING.with(|r| r.replace(true)));
    step()
}

impl Signer for HardwareSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        if REFUSING.with(std::cell::Cell::get) {
            return Err(rustls::Error::General(SIGNATURE_REFUSED.into()));
        }
        let result = run_blocking(|| {
            self.key
                .key
                .sign_for(super::Purpose::Handshake, self.scheme, message)
        });
        match result {
            Ok(sig) => {
                *self
                    .key
                    .last_scheme
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(self.scheme);
                Ok(sig)
            }
            Err(e) => {
                tracing::error!(
                    "handshake signature with {} failed: {e}",
                    self.key.key.describe()
                );
                Err(rustls::Error::General(format!("{SIGNATURE_FAILED}: {e}")))
            }
        }
    }

    fn scheme(&self) -> SignatureScheme {
        to_rustls(self.scheme)
    }
}

/// Runs a blocking hardware call without stalling a multi-thread tokio runtime.
pub fn run_blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Hands rustls the hardware key and its certificate chain. The chain can be replaced while
/// connections run (certificate renewal), and so can the key together with a chain for it
/// (`--rotate-key`); the pair is swapped under one lock, so a handshake never sees a key with
/// another key's certificate.
#[derive(Debug)]
pub struct HardwareCertResolver {
    current: RwLock<(HardwareSigningKey, Arc<CertifiedKey>)>,
}

impl HardwareCertResolver {
    /// Pairs a key with its chain (leaf first). Refuses a leaf that holds another public key.
    pub fn new(
        signer: HardwareSigningKey,
        chain: Vec<CertificateDer<'static>>,
    ) -> Result<HardwareCertResolver, KeyError> {
        let certified = certified(&signer, chain)?;
        Ok(HardwareCertResolver {
            current: RwLock::new((signer, certified)),
        })
    }

    /// Installs a renewed chain for the same key; refuses (and keeps the old one) otherwise.
    pub fn replace_chain(&self, chain: Vec<CertificateDer<'static>>) -> Result<(), KeyError> {
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        current.1 = certified(&current.0, chain)?;
        Ok(())
    }

    /// Installs another key with its chain (key rotation); refuses a chain for another key.
    pub fn replace_key(
        &self,
        signer: HardwareSigningKey,
        chain: Vec<CertificateDer<'static>>,
    ) -> Result<(), KeyError> {
        let certified = certified(&signer, chain)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = (signer, certified);
        Ok(())
    }

    /// The signing key adapter in use now.
    pub fn signer(&self) -> HardwareSigningKey {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// The chain in use now.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .cert
            .clone()
    }
}

fn certified(
    signer: &HardwareSigningKey,
    chain: Vec<CertificateDer<'static>>,
) -> Result<Arc<CertifiedKey>, KeyError> {
    let leaf = chain.first().ok_or_else(|| KeyError::Malformed {
        what: "certificate chain".into(),
        problem: crate::key::Malformation::Empty,
    })?;
    let spki = der::cert_spki(leaf)?;
    if !der::same_public_key(&spki, signer.key.spki_der()) {
        return Err(KeyError::CertificateMismatch {
            key: signer.key.describe(),
            subject: subject_of(leaf),
        });
    }
    Ok(Arc::new(CertifiedKey::new(chain, Arc::new(signer.clone()))))
}

/// The subject of a certificate as text, for messages.
pub fn subject_of(cert: &[u8]) -> String {
    x509_parser::parse_x509_certificate(cert)
        .map(|(_, c)| c.tbs_certificate.subject.to_string())
        .unwrap_or_else(|_| "(unparsable certificate)".into())
}

impl ResolvesClientCert for HardwareCertResolver {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        if current.0.pick(sigschemes).is_none() {
            tracing::error!(
                key = %current.0.key.describe(),
                offered = ?sigschemes,
                "the server asked for a client certificate but accepts no scheme this key can sign with"
            );
        }
        Some(current.1.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}
