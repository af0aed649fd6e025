//! PKCS#11 backend (crate `cryptoki`): HSMs, smart cards, SoftHSMv2.
//!
//! Layout: [`module`] loads and initialises libraries once per process; [`token`] finds a token by
//! label and logs in; [`pool`] keeps logged-in sessions for parallel signing; [`objects`] finds
//! keys, public keys and certificates; [`keygen`] creates keys; [`sign`] maps schemes to
//! mechanisms.
//!
//! Concurrency: a [`Pkcs11Key`] is shared by all signing threads. Each signature borrows one
//! session from the pool, so signatures run in parallel up to the pool's size (SoftHSM, with
//! `CKF_OS_LOCKING_OK`, signs in parallel on separate sessions). When the token invalidates
//! sessions (reset, removal, logout by someone else), the signature that notices drops every idle
//! session, opens a fresh one, logs in again (unless the PIN was rejected before), finds the key
//! again and retries once. When the token itself went away (`CKR_GENERAL_ERROR`,
//! `CKR_DEVICE_REMOVED`, `CKR_TOKEN_NOT_PRESENT`, …: a card pulled, a SoftHSM token directory
//! moved), the token is looked up again by label/serial — after re-initialising the module,
//! which some modules need to see a token that came back — and the key must still have the same
//! public key.

mod keygen;
mod module;
mod objects;
mod pool;
mod rv;
mod sign;
mod token;

use std::sync::RwLock;

use cryptoki::error::{Error as CkError, RvError};
use cryptoki::mechanism::MechanismType;
use cryptoki::object::{Attribute, AttributeType, CertificateType, ObjectClass, ObjectHandle};
use cryptoki::session::UserType;

use self::objects::{Access, FoundKey, KeyIdent};
use self::pool::{PooledSession, SessionPool};
use self::sign::SignError;
use self::token::Token;
use super::{
    der, KeyAlgorithm, KeyBackend, KeyError, KeyListing, KeyUri, Pkcs11Uri, SessionStats,
    SignScheme, SigningPath,
};
use crate::key::{CapabilityError, DeviceError, LocateError};

/// How many sessions one key may have open at once. Enough for every core of a busy proxy; small
/// enough for tokens that allow only a few sessions.
const MAX_SESSIONS: usize = 16;

/// A private key on a PKCS#11 token.
#[derive(Debug)]
pub struct Pkcs11Key {
    token: Token,
    uri: Pkcs11Uri,
    ident: KeyIdent,
    /// The private key's handle and the module generation it was found in: a
    /// re-initialisation (see `module`) makes every handle stale, and one may then name
    /// another object, so the key is found again before its next signature.
    handle: RwLock<(ObjectHandle, u64)>,
    algorithm: KeyAlgorithm,
    spki: Vec<u8>,
    path: SigningPath,
    pool: SessionPool,
    /// `CKA_ALWAYS_AUTHENTICATE`: every signature re-authenticates (PIN always).
    always_auth: bool,
}

/// True when a failure (from the token, or from logging in / opening a session on it) means the
/// token (or the module's view of it) went away: look the token up again, re-initialising the
/// module if needed. Decided on cryptoki's typed return value, carried as the error's source.
fn device_gone(ck: Option<&CkError>, err: &KeyError) -> bool {
    let ck = ck.or(match err {
        KeyError::Device(DeviceError::Pkcs11 {
            source: Some(cause),
            ..
        }) => cause.downcast_ref::<CkError>(),
        _ => None,
    });
    matches!(
        ck,
        Some(CkError::Pkcs11(
            RvError::GeneralError
                | RvError::DeviceError
                | RvError::DeviceRemoved
                | RvError::TokenNotPresent
                | RvError::TokenNotRecognized
                | RvError::SlotIdInvalid
                // A re-initialisation that failed while the device was away leaves the module
                // uninitialised: that is the device being gone too, and it is retried (at the
                // module's re-initialisation spacing) until it works.
                | RvError::CryptokiNotInitialized,
            _
        ))
    )
}

/// Errors after which the session (not the request) is what failed.
fn session_lost(e: &CkError) -> bool {
    matches!(
        e,
        CkError::Pkcs11(
            RvError::SessionHandleInvalid
                | RvError::SessionClosed
                | RvError::DeviceRemoved
                | RvError::TokenNotPresent
                | RvError::UserNotLoggedIn
                | RvError::KeyHandleInvalid
                | RvError::ObjectHandleInvalid
                | RvError::CryptokiNotInitialized,
            _
        )
    )
}

/// Opens the key a URI names: finds the token, logs in once, finds the key and its public key.
pub fn open(uri: &Pkcs11Uri) -> Result<Pkcs11Key, KeyError> {
    let _reading = objects_read();
    open_unguarded(uri)
}

/// [`open`], for a caller that holds [`OBJECTS`] already.
fn open_unguarded(uri: &Pkcs11Uri) -> Result<Pkcs11Key, KeyError> {
    let FoundKey {
        token,
        session,
        handle,
    } = objects::find_key(uri, Access::Read)?;
    let calls = token.enter();
    let generation = token.calls.generation();
    let ident = objects::ident(&token, &session, handle)?;
    let algorithm = objects::algorithm(&token, &session, handle)?;
    let spki = objects::public_spki(&token, &session, handle, &ident, algorithm)?;
    let path = signing_path(&token, algorithm);
    let always_auth = objects::always_authenticate(&token, &session, handle)?;
    if always_auth {
        check_reauthentication(&token, &ident, algorithm)?;
    }
    let pool = SessionPool::new(match token.session_limit() {
        Some(limit) => limit.min(MAX_SESSIONS),
        None => MAX_SESSIONS,
    });
    // The first session stays open in the pool, which keeps this process logged in.
    pool.adopt(session);
    drop(calls);
    Ok(Pkcs11Key {
        token,
        uri: uri.clone(),
        ident,
        handle: RwLock::new((handle, generation)),
        algorithm,
        spki,
        path,
        pool,
        always_auth,
    })
}

/// For a key that asks for the PIN at every signature: the token must offer the hashing
/// mechanisms its signatures then need ([`sign::reauthenticated_mechanism`]).
fn check_reauthentication(
    token: &Token,
    ident: &objects::KeyIdent,
    algorithm: KeyAlgorithm,
) -> Result<(), KeyError> {
    // A token that cannot list its mechanisms is given the benefit of the doubt (its C_SignInit
    // then says what is missing).
    let _calls = token.enter();
    let Ok(offered) = token.ctx.get_mechanism_list(token.slot()) else {
        return Ok(());
    };
    let needed = match algorithm {
        KeyAlgorithm::EcP256 => (MechanismType::ECDSA_SHA256, "CKM_ECDSA_SHA256"),
        KeyAlgorithm::EcP384 => (MechanismType::ECDSA_SHA384, "CKM_ECDSA_SHA384"),
        KeyAlgorithm::Rsa { .. } => (
            MechanismType::SHA256_RSA_PKCS_PSS,
            "CKM_SHA256_RSA_PKCS_PSS",
        ),
    };
    if offered.contains(&needed.0) {
        return Ok(());
    }
    Err(KeyError::Capability(CapabilityError::NoReauthMechanism {
        key: ident.describe(),
        missing: needed.1,
    }))
}

/// Reads the token's mechanism list once per key and picks how an RSA key signs (see
/// [`SigningPath`]): the token's PSS, else PSS padded by hwkey over raw RSA (`CKM_RSA_X_509`),
/// else PKCS#1 v1.5 only (TLS 1.2). EC keys always sign natively with `CKM_ECDSA`.
fn signing_path(token: &Token, algorithm: KeyAlgorithm) -> SigningPath {
    if !matches!(algorithm, KeyAlgorithm::Rsa { .. }) {
        return SigningPath::Native;
    }
    let _calls = token.enter();
    let mechanisms = match token.ctx.get_mechanism_list(token.slot()) {
        Ok(m) => m,
        Err(e) => {
            // A token that cannot list its mechanisms is assumed to have the standard ones.
            tracing::warn!("{}: {}", token.place(), token.err("C_GetMechanismList", &e));
            return SigningPath::Native;
        }
    };
    let signs = |m: MechanismType| {
        mechanisms.contains(&m)
            && token
                .ctx
                .get_mechanism_info(token.slot(), m)
                .map(|info| info.sign())
                .unwrap_or(false)
    };
    if signs(MechanismType::RSA_PKCS_PSS) {
        SigningPath::Native
    } else if signs(MechanismType::RSA_X_509) {
        SigningPath::SoftwarePss {
            mechanism: "CKM_RSA_X_509",
        }
    } else if signs(MechanismType::RSA_PKCS) {
        SigningPath::Pkcs1Only {
            missing: "CKM_RSA_PKCS_PSS and CKM_RSA_X_509",
        }
    } else {
        SigningPath::Unusable {
            missing: "CKM_RSA_PKCS_PSS, CKM_RSA_X_509 and CKM_RSA_PKCS",
        }
    }
}

/// Key creation and deletion in this process, one at a time, and never beside a read of the
/// token's objects.
///
/// The check for an existing label or id and the generation must be one step: two threads
/// creating the same label both passed the check and made two keys. And SoftHSM's object store
/// fails concurrent `C_GenerateKeyPair` calls on one token now and then with
/// `CKR_GENERAL_ERROR` (SoftHSMv2#573; parsec serialises its key creation for it). Keys are
/// made rarely, so one lock for the process costs nothing. Another process creating the same
/// label at the same moment is not covered: a token has no transaction for it. Deletion takes
/// the same lock: a key destroyed while a creation listed the token's keys made that listing
/// fail with `CKR_OBJECT_HANDLE_INVALID` (a rotation deletes the previous key in the signer).
///
/// What changes a token's objects (creating, deleting, storing a chain) takes it to write;
/// what walks them (opening a key, listing, reading a key's protection, its stored chain or
/// its PIV attestation) takes it to read. SoftHSM's reads of a token another thread is writing
/// fail now and then, and so do its writes: an open beside a generation failed with "the
/// value is not one of the expected options" or `CKR_OBJECT_HANDLE_INVALID`, and the
/// generation with `CKR_GENERAL_ERROR` or `CKR_TEMPLATE_INCONSISTENT` (the key contract
/// tests, three suite runs in twelve here). A signature takes no part in it, nor the search
/// for its key after a lost session (`recover`): they run as calls in flight, which a
/// module's re-initialisation under the write lock waits for, so they must not wait for the
/// lock. One lock for every token of the process: keys are made rarely.
static OBJECTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Holds [`OBJECTS`] to read a token's objects.
fn objects_read() -> std::sync::RwLockReadGuard<'static, ()> {
    OBJECTS.read().unwrap_or_else(|p| p.into_inner())
}

/// Holds [`OBJECTS`] to change a token's objects.
fn objects_write() -> std::sync::RwLockWriteGuard<'static, ()> {
    OBJECTS.write().unwrap_or_else(|p| p.into_inner())
}

/// Creates a key pair on the token. Refuses when a private key with that label or id exists.
pub fn create(uri: &Pkcs11Uri, algorithm: KeyAlgorithm) -> Result<Pkcs11Key, KeyError> {
    let Some(label) = uri.object.clone() else {
        return Err(KeyError::InvalidUri {
            uri: uri.to_string(),
            reason: "a new key needs a label: add object=NAME to the URI".into(),
        });
    };
    let creating = objects_write();
    let token = Token::find(uri)?;
    let calls = token.enter();
    let session = token.open_session(true)?;
    for (_, existing) in objects::private_keys(&token, &session)? {
        let same_label = existing.label.as_deref() == Some(label.as_str());
        let same_id = uri.id.as_ref().is_some_and(|id| *id == existing.id);
        if same_label || same_id {
            return Err(KeyError::Locate(LocateError::KeyExists {
                what: format!("a key {}", existing.describe()),
                place: token.place(),
            }));
        }
    }
    let id = match &uri.id {
        Some(id) => id.clone(),
        None => {
            let mut id = vec![0u8; 8];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id).map_err(
                |_| {
                    KeyError::Capability(CapabilityError::Unsupported(
                        "the system random generator failed".into(),
                    ))
                },
            )?;
            id
        }
    };
    let ident = KeyIdent {
        label: Some(label),
        id,
    };
    keygen::generate(&token, &session, algorithm, &ident)?;
    drop(session);
    drop(calls);
    let uri = uri.with_key(ident.label.clone(), Some(ident.id.clone()));
    // Opened under the lock too: SoftHSM's reads of a token being written by another thread's
    // generation fail the same way (CKR_OBJECT_HANDLE_INVALID, CKR_GENERAL_ERROR).
    let key = open_unguarded(&uri);
    drop(creating);
    key
}

/// Lists the private keys on the token the URI names.
pub fn list(uri: &Pkcs11Uri) -> Result<Vec<KeyListing>, KeyError> {
    let _reading = objects_read();
    let token = Token::find(uri)?;
    let _calls = token.enter();
    let session = token.try_open_session()?.ok_or_else(|| {
        KeyError::Device(DeviceError::SessionLimit {
            token: token.place(),
        })
    })?;
    let mut out = Vec::new();
    for (handle, ident) in objects::private_keys(&token, &session)? {
        let algorithm = match objects::algorithm(&token, &session, handle) {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!("skipping key {}: {e}", ident.describe());
                continue;
            }
        };
        let has_certificate = !objects::certificates(&token, &session, &ident)?.is_empty();
        let key_uri = Pkcs11Uri {
            token: Some(token.label.clone()),
            serial: None,
            slot_id: None,
            manufacturer: None,
            model: None,
            ..uri.with_key(
                ident.label.clone(),
                Some(ident.id.clone()).filter(|i| !i.is_empty()),
            )
        };
        out.push(KeyListing {
            uri: KeyUri::Pkcs11(key_uri),
            algorithm,
            has_certificate,
        });
    }
    Ok(out)
}

/// Deletes the private key, its public key and its certificates.
pub fn delete(uri: &Pkcs11Uri) -> Result<Vec<String>, KeyError> {
    let _deleting = objects_write();
    let FoundKey {
        token,
        session,
        handle: private,
    } = objects::find_key(uri, Access::Write)?;
    let _calls = token.enter();
    let ident = objects::ident(&token, &session, private)?;
    let mut doomed = vec![(private, format!("private key {}", ident.describe()))];
    for public in objects::public_keys(&token, &session, &ident)? {
        doomed.push((public, format!("public key {}", ident.describe())));
    }
    for (cert, _) in objects::certificates(&token, &session, &ident)? {
        doomed.push((cert, format!("certificate {}", ident.describe())));
    }
    let mut removed = Vec::new();
    for (handle, what) in doomed {
        session
            .destroy_object(handle)
            .map_err(|e| token.err("C_DestroyObject", &e))?;
        removed.push(format!("{what} on {}", token.place()));
    }
    Ok(removed)
}

/// Stores certificates as `CKO_CERTIFICATE` objects sharing the key's id and label. The new
/// objects are written before the old ones are removed, so a failure leaves the old chain.
pub fn store_chain(uri: &Pkcs11Uri, chain: &[Vec<u8>]) -> Result<String, KeyError> {
    let _storing = objects_write();
    let FoundKey {
        token,
        session,
        handle: private,
    } = objects::find_key(uri, Access::Write)?;
    let _calls = token.enter();
    let ident = objects::ident(&token, &session, private)?;
    let old = objects::certificates(&token, &session, &ident)?;
    let mut created = Vec::new();
    for cert in chain {
        let template = certificate_template(&ident, cert)?;
        match session.create_object(&template) {
            Ok(h) => created.push(h),
            Err(e) => {
                for h in created {
                    let _ = session.destroy_object(h);
                }
                return Err(token.err("C_CreateObject", &e));
            }
        }
    }
    for (h, _) in old {
        session
            .destroy_object(h)
            .map_err(|e| token.err("C_DestroyObject", &e))?;
    }
    Ok(format!(
        "{} certificate object(s) for key {} on {}",
        chain.len(),
        ident.describe(),
        token.place()
    ))
}

fn certificate_template(ident: &KeyIdent, cert: &[u8]) -> Result<Vec<Attribute>, KeyError> {
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert).map_err(|e| KeyError::Malformed {
            what: "certificate".into(),
            problem: crate::key::Malformation::Certificate(e.into()),
        })?;
    let tbs = &parsed.tbs_certificate;
    let serial = yasna::construct_der(|w| w.write_bigint_bytes(tbs.raw_serial(), true));
    let mut t = vec![
        Attribute::Class(ObjectClass::CERTIFICATE),
        Attribute::CertificateType(CertificateType::X_509),
        Attribute::Token(true),
        Attribute::Private(false),
        Attribute::Value(cert.to_vec()),
        Attribute::Subject(tbs.subject.as_raw().to_vec()),
        Attribute::Issuer(tbs.issuer.as_raw().to_vec()),
        Attribute::SerialNumber(serial),
        Attribute::Id(ident.id.clone()),
    ];
    if let Some(label) = &ident.label {
        t.push(Attribute::Label(label.as_bytes().to_vec()));
    }
    Ok(t)
}

impl Pkcs11Key {
    fn sign_once(
        &self,
        scheme: SignScheme,
        message: &[u8],
    ) -> Result<Vec<u8>, (Option<CkError>, Box<KeyError>)> {
        // The error is boxed: this is the cold path, and the pair would be the largest value
        // every signature returns.
        let session = self
            .pool
            .get(&self.token)
            .map_err(|e| (None, Box::new(e)))?;
        let handle = self
            .current_handle(&session)
            .map_err(|e| (None, Box::new(e)))?;
        let signed = if self.always_auth {
            let attempt = self
                .token
                .prepare_context_login()
                .map_err(|e| (None, Box::new(e)))?;
            sign::sign_reauthenticated(session.session(), handle, scheme, message, || {
                attempt.present(session.session(), UserType::ContextSpecific)
            })
        } else {
            sign::sign(
                session.session(),
                handle,
                (self.algorithm, &self.path),
                scheme,
                message,
            )
        };
        match signed {
            Ok(sig) => {
                if scheme.is_pss() && matches!(self.path, SigningPath::SoftwarePss { .. }) {
                    self.check_raw_rsa(scheme, message, &sig)
                        .map_err(|e| (None, Box::new(e)))?;
                }
                Ok(sig)
            }
            Err(SignError::Encoding(e)) => Err((None, Box::new(e))),
            // The context login failed after C_SignInit: the signing operation is still active
            // on this session (SoftHSM answers the next C_SignInit with CKR_OPERATION_ACTIVE).
            // Closing the session ends it; a pooled session kept would fail every signature.
            Err(SignError::Login(e)) => {
                session.discard();
                Err((None, Box::new(e)))
            }
            Err(SignError::Token(e)) => {
                let err = self.token.err("C_Sign", &e);
                if session_lost(&e) {
                    session.discard();
                }
                Err((Some(e), Box::new(err)))
            }
        }
    }

    /// Verifies a signature made with hwkey's PSS padding and the token's raw RSA before it
    /// leaves the key layer: a wrong raw RSA result is never released (a faulty RSA-CRT
    /// signature can reveal the private key), and a peer never gets a signature it rejects.
    fn check_raw_rsa(
        &self,
        scheme: SignScheme,
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), KeyError> {
        match super::verify::verify_signature(&self.spki, scheme, message, signature) {
            Ok(true) => Ok(()),
            // ring checks moduli of 2048 bits and more only; smaller keys go unchecked.
            _ if matches!(self.algorithm, KeyAlgorithm::Rsa { bits } if bits < 2048) => Ok(()),
            Ok(false) => Err(KeyError::Device(DeviceError::Pkcs11 {
                source: None,
                operation: "C_Sign (CKM_RSA_X_509 for RSA-PSS)",
                token: self.token.label.clone(),
                reason: "the token's raw RSA result does not verify against the key's public \
                         key; the signature was discarded"
                    .into(),
            })),
            Err(e) => Err(e),
        }
    }

    /// After the token went away: re-initialises the module (at most once per
    /// [`module::REINIT_INTERVAL`]), finds the token again by label/serial (maybe in another
    /// slot), logs in again, finds the key, and checks it is the same key (public key unchanged).
    fn reattach(&self) -> Result<(), KeyError> {
        self.pool.discard_idle();
        if self.token.relocate().is_err() {
            module::reinitialize(&self.token.module, &self.token.ctx, &self.token.calls);
            self.token.relocate()?;
        }
        self.recover()?;
        tracing::info!("{}: the token is back; signing again", self.describe());
        Ok(())
    }

    /// Replaces dead sessions and finds the key again after the token invalidated them.
    fn recover(&self) -> Result<(), KeyError> {
        self.pool.discard_idle();
        self.pool.note_recovered();
        let session = self.pool.get(&self.token)?;
        let handle = self.find_same_key(&session)?;
        *self.handle.write().unwrap_or_else(|p| p.into_inner()) =
            (handle, self.token.calls.generation());
        Ok(())
    }

    /// The key's private object found again by the URI, and only if its public key is the one
    /// this key was opened with: a key deleted and created again under the same label and id
    /// (by an operator, another process, a re-initialised token) is another key, and a
    /// handshake signed with it would fail at the API server, or worse, the signature would be
    /// the other key's. The handle is never kept when the check fails.
    fn find_same_key(&self, session: &PooledSession<'_>) -> Result<ObjectHandle, KeyError> {
        let handle = objects::find_private_key(&self.token, session.session(), &self.uri)?;
        let spki = objects::public_spki(
            &self.token,
            session.session(),
            handle,
            &self.ident,
            self.algorithm,
        )?;
        if !der::same_public_key(&spki, &self.spki) {
            return Err(KeyError::Device(DeviceError::TpmKeyUnusable {
                key: self.describe(),
                problem: crate::key::Unusable::ReplacedOnToken,
            }));
        }
        Ok(handle)
    }

    /// The key's handle in the module's current generation (found again after a
    /// re-initialisation). `session` keeps this thread inside the module's gate, so the
    /// generation cannot move while the handle is used.
    fn current_handle(&self, session: &PooledSession<'_>) -> Result<ObjectHandle, KeyError> {
        let generation = self.token.calls.generation();
        let (handle, found_in) = *self.handle.read().unwrap_or_else(|p| p.into_inner());
        if found_in == generation {
            return Ok(handle);
        }
        let handle = self.find_same_key(session)?;
        *self.handle.write().unwrap_or_else(|p| p.into_inner()) = (handle, generation);
        Ok(handle)
    }
}

impl KeyBackend for Pkcs11Key {
    fn algorithm(&self) -> KeyAlgorithm {
        self.algorithm
    }

    fn protection(&self) -> Result<crate::key::Protection, KeyError> {
        Ok(crate::key::Protection::from_pkcs11(protection(&self.uri)?))
    }

    fn spki_der(&self) -> &[u8] {
        &self.spki
    }

    fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        match self.sign_once(scheme, message) {
            Ok(sig) => Ok(sig),
            Err((Some(ck), err)) if session_lost(&ck) => {
                tracing::warn!(
                    "{}: {err}; reopening sessions and logging in again",
                    self.describe()
                );
                match self.recover() {
                    Ok(()) => self.sign_once(scheme, message).map_err(|(_, e)| *e),
                    Err(e) if device_gone(None, &e) => {
                        self.reattach()?;
                        self.sign_once(scheme, message).map_err(|(_, e)| *e)
                    }
                    Err(e) => Err(e),
                }
            }
            Err((ck, err)) if device_gone(ck.as_ref(), &err) => {
                tracing::warn!("{}: {err}; looking for the token again", self.describe());
                self.reattach()?;
                self.sign_once(scheme, message).map_err(|(_, e)| *e)
            }
            Err((_, e)) => Err(*e),
        }
    }

    fn describe(&self) -> String {
        format!(
            "PKCS#11 token '{}', key {}",
            self.token.label,
            self.ident.describe()
        )
    }

    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        let _reading = objects_read();
        let read = || -> Result<Vec<(ObjectHandle, Vec<u8>)>, KeyError> {
            let session = self.pool.get(&self.token)?;
            objects::certificates(&self.token, session.session(), &self.ident)
        };
        // A token that went away and came back (SIGHUP reload after a card was re-inserted).
        let certs = match read() {
            Err(e) if device_gone(None, &e) => {
                self.reattach()?;
                read()?
            }
            other => other?,
        };
        if certs.is_empty() {
            return Ok(None);
        }
        let certs = certs.into_iter().map(|(_, der)| der).collect();
        Ok(Some(der::order_chain(&self.spki, certs)))
    }

    fn piv_attestation(&self) -> Result<Option<super::PivAttestationCerts>, KeyError> {
        let _reading = objects_read();
        let read = || -> Result<Vec<(String, Vec<u8>)>, KeyError> {
            let session = self.pool.get(&self.token)?;
            objects::labelled_certificates(&self.token, session.session())
        };
        let certs = match read() {
            Err(e) if device_gone(None, &e) => {
                self.reattach()?;
                read()?
            }
            other => other?,
        };
        let slot_prefix = format!("{} ", objects::PIV_ATTESTATION_LABEL);
        // The slot's attestation is the one certifying this very key; the device's is f9.
        let attestation = certs.iter().find(|(label, der)| {
            label.starts_with(&slot_prefix)
                && der::cert_spki(der).is_ok_and(|s| der::same_public_key(&s, &self.spki))
        });
        let device = certs
            .iter()
            .find(|(label, _)| label == objects::PIV_ATTESTATION_LABEL);
        Ok(match (attestation, device) {
            (Some((_, a)), Some((_, f9))) => Some(super::PivAttestationCerts {
                attestation: a.clone(),
                device: f9.clone(),
            }),
            _ => None,
        })
    }

    fn session_stats(&self) -> Option<SessionStats> {
        Some(self.pool.stats())
    }

    fn signing_path(&self) -> SigningPath {
        self.path.clone()
    }
}

/// Reads the attributes that prove a private key cannot leave the token, as (name, value) pairs:
/// `CKA_SENSITIVE`, `CKA_EXTRACTABLE`, `CKA_NEVER_EXTRACTABLE`, `CKA_ALWAYS_SENSITIVE`, and
/// whether `CKA_VALUE` was readable. `hwkey key show` prints them; tests assert on them.
pub fn protection(uri: &Pkcs11Uri) -> Result<Vec<(&'static str, bool)>, KeyError> {
    let _reading = objects_read();
    let FoundKey {
        token,
        session,
        handle,
    } = objects::find_key(uri, Access::Read)?;
    let _calls = token.enter();
    let attrs = session
        .get_attributes(
            handle,
            &[
                AttributeType::Sensitive,
                AttributeType::Extractable,
                AttributeType::NeverExtractable,
                AttributeType::AlwaysSensitive,
                AttributeType::AlwaysAuthenticate,
            ],
        )
        .map_err(|e| token.err("C_GetAttributeValue", &e))?;
    let mut out = Vec::new();
    for a in attrs {
        match a {
            Attribute::Sensitive(v) => out.push(("CKA_SENSITIVE", v)),
            Attribute::Extractable(v) => out.push(("CKA_EXTRACTABLE", v)),
            Attribute::NeverExtractable(v) => out.push(("CKA_NEVER_EXTRACTABLE", v)),
            Attribute::AlwaysSensitive(v) => out.push(("CKA_ALWAYS_SENSITIVE", v)),
            Attribute::AlwaysAuthenticate(v) => out.push(("CKA_ALWAYS_AUTHENTICATE", v)),
            _ => {}
        }
    }
    // Ask for the private value itself: a sensitive key must not hand it out.
    let value = session
        .get_attributes(
            handle,
            &[
                AttributeType::Value,
                AttributeType::PrivateExponent,
                AttributeType::Prime,
            ],
        )
        .map(|v| !v.is_empty())
        .unwrap_or(false);
    out.push(("private value readable", value));
    Ok(out)
}
