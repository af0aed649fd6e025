//! The signer process: opens the key (the only process that loads the PKCS#11 module or the TSS
//! libraries, reads the PIN source and holds sessions), greets with its public facts, then
//! answers requests on its socket until the other side closes it.
//!
//! Requests are served by a few threads, each reading its next request off the socket itself
//! (a PKCS#11 token signs on several sessions at once; a TPM serialises on its context) and
//! sending its reply when done. Every signature is checked
//! against its purpose first ([`super::policy`]); a refusal is answered, logged and counted.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::config::SignerConfig;
use super::error::SignerError;
use super::policy::{Policy, Refusal};
use super::protocol::{
    self, KeyInfo, PathWire, RemoteError, RemoteKind, Reply, Request, WatchedFile, FIRST_KEY,
    VERSION,
};
use crate::key::CapabilityError;
use crate::key::{Key, KeyError};

/// Threads serving requests at once.
const WORKERS: usize = 8;

/// The keys this signer holds, by id, and the one in use.
struct Keys {
    keys: RwLock<Vec<Option<Arc<Key>>>>,
    in_use: AtomicU32,
}

impl Keys {
    fn get(&self, id: u32) -> Result<Arc<Key>, RemoteError> {
        self.keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id as usize)
            .cloned()
            .flatten()
            .ok_or_else(|| refused(format!("no key {id} in this signer")))
    }
}

/// The signer's state shared by its threads.
struct Signer {
    config: SignerConfig,
    policy: Policy,
    keys: Keys,
    refused: AtomicU64,
    /// The watched file being read in parts, as it was at its offset-0 read.
    watched: std::sync::Mutex<Option<(WatchedFile, Vec<u8>)>>,
}

/// Opens the key, greets on `socket`, and serves until the other side closes it. Returns the
/// process exit code: 0 after a close, 77 when the PIN was refused, 1 for any other failure to
/// open (after telling the other side in words).
pub fn serve(socket: OwnedFd, config: SignerConfig) -> u8 {
    let signer = match open(config) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            let exit_code = if e.is_pin_refusal() {
                // The supervisor reads this before the network side hears of the refusal:
                // it does not present the same PIN again.
                tell_supervisor(super::supervisor::PIN_REFUSED_MARK);
                crate::key::pin::EXIT_PIN_REFUSED
            } else {
                1
            };
            let reply = Reply::Failed {
                error: remote_error(&e),
                exit_code,
            };
            let _ = protocol::send(socket.as_fd(), 0, &reply);
            return exit_code;
        }
    };
    tell_supervisor(super::supervisor::OPENED_MARK);
    let hello = match signer.keys.get(FIRST_KEY) {
        Ok(key) => Reply::Hello {
            version: VERSION,
            key: info(FIRST_KEY, &key),
        },
        Err(error) => Reply::Error { error },
    };
    if protocol::send(socket.as_fd(), 0, &hello).is_err() {
        return 1;
    }
    // Every worker reads requests itself (one whole request per datagram and per read, see
    // `protocol::recv`): no hand-over from a reader thread, one wake-up less per signature.
    let socket = Arc::new(socket);
    let workers: Vec<_> = (0..WORKERS)
        .map(|n| {
            let (signer, socket) = (signer.clone(), socket.clone());
            std::thread::Builder::new()
                .name(format!("hwkey-signer-{n}"))
                .spawn(move || serve_requests(&signer, &socket))
        })
        .collect();
    for w in workers.into_iter().flatten() {
        let _ = w.join();
    }
    0
}

/// How the opening went, on standard output (a pipe the supervisor reads): opened, or the
/// PIN refused.
fn tell_supervisor(mark: &[u8]) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(mark);
    let _ = out.flush();
}

/// One worker: reads a request, answers it, until the socket closes. Anything that is not a
/// request closes the socket for every worker (the network side is not speaking the protocol).
fn serve_requests(signer: &Signer, socket: &OwnedFd) {
    loop {
        match protocol::recv::<Request>(socket.as_fd()) {
            Ok(Some(request)) => {
                let reply = signer.answer(request.body);
                // A reply over the message limit (a stored chain of many certificates) is
                // answered with an error instead: dropped, its caller waited for good.
                if let Err(e @ (SignerError::TooLarge { .. } | SignerError::Encode(_))) =
                    protocol::send(socket.as_fd(), request.id, &reply)
                {
                    let error = Reply::Error {
                        error: RemoteError {
                            kind: RemoteKind::Failed,
                            message: format!("the signer cannot send its answer: {e}"),
                        },
                    };
                    let _ = protocol::send(socket.as_fd(), request.id, &error);
                }
            }
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "the signer's socket sent something that is not a request; closing");
                let _ = rustix::net::shutdown(socket.as_fd(), rustix::net::Shutdown::Both);
                return;
            }
        }
    }
}

/// Opens the configured key and the identity it serves.
fn open(config: SignerConfig) -> Result<Signer, KeyError> {
    let uri = match &config.rotation_state {
        Some(dir) => {
            crate::key::rotation::current_key(&config.key, &crate::state_dir::StateDir::new(dir))
        }
        None => config.key.clone(),
    };
    let key = Arc::new(Key::open(&uri)?);
    key.require_non_extractable(config.require_non_extractable)?;
    let leaf = identity_leaf(&config, &key)?;
    let policy = Policy::for_certificate(&leaf, config.tls12)
        .map_err(|r| KeyError::Capability(CapabilityError::Unsupported(r.to_string())))?;
    Ok(Signer {
        config,
        policy,
        keys: Keys {
            keys: RwLock::new(vec![Some(key)]),
            in_use: AtomicU32::new(FIRST_KEY),
        },
        refused: AtomicU64::new(0),
        watched: std::sync::Mutex::new(None),
    })
}

/// The identity's certificate: the one read before any network input when there is a
/// certificate file (never the file as it is now), else the chain stored with the key. Without
/// rotation it must hold the key's public key; with rotation the key may be a later one of the
/// series (the subject is what stays).
fn identity_leaf(config: &SignerConfig, key: &Key) -> Result<Vec<u8>, KeyError> {
    let leaf = match (&config.identity, &config.cert) {
        (Some(chain), _) => chain.first().cloned(),
        (None, Some(_)) => {
            return Err(KeyError::Capability(CapabilityError::Unsupported(
                "the signer was started without the identity read from --cert".into(),
            )))
        }
        (None, None) => key.stored_chain()?.and_then(|c| c.into_iter().next()),
    }
    .ok_or_else(|| {
        KeyError::Capability(CapabilityError::Unsupported(
            "the identity has no certificate".into(),
        ))
    })?;
    if config.rotation_state.is_none() {
        let (_, cert) = x509_parser::parse_x509_certificate(&leaf).map_err(|e| {
            KeyError::Capability(CapabilityError::Unsupported(format!(
                "the identity's certificate does not parse: {e}"
            )))
        })?;
        if cert.public_key().raw != key.spki_der() {
            return Err(KeyError::CertificateMismatch {
                key: key.describe(),
                subject: crate::key::tls::subject_of(&leaf),
            });
        }
    }
    Ok(leaf)
}

impl Signer {
    fn answer(&self, request: Request) -> Reply {
        let result = match request {
            Request::Sign {
                key,
                purpose,
                scheme,
                message,
            } => self.sign(key, purpose, scheme, &message),
            Request::CertifyRequest {
                key,
                ak_handle,
                subject,
                made_at,
            } => self.certify(key, ak_handle, &subject, made_at),
            Request::StoredChain { key } => self
                .keys
                .get(key)
                .and_then(|k| k.stored_chain().map_err(|e| remote_error(&e)))
                .map(|chain| Reply::Chain { chain }),
            Request::PivAttestation { key } => self
                .keys
                .get(key)
                .and_then(|k| k.piv_attestation().map_err(|e| remote_error(&e)))
                .map(|found| Reply::Chain {
                    chain: found.map(|p| vec![p.attestation, p.device]),
                }),
            Request::StoreChain { key, chain } => self.store_chain(key, &chain),
            Request::InstallCertificate {
                key,
                chain,
                keep_previous,
            } => self.install_certificate(key, &chain, keep_previous),
            // Creating, switching and deleting keys is rotation's (`--rotate-key`) alone: without
            // it the network side has no business changing which key exists or signs.
            Request::CreateNext | Request::Destroy { .. } | Request::Use { .. }
                if self.config.rotation_state.is_none() =>
            {
                Err(self.refuse(
                    "rotation",
                    "keys are created, switched and deleted only with --rotate-key".into(),
                ))
            }
            Request::ReadWatched { file, offset } => self.read_watched(file, offset),
            Request::CreateNext => self.create_next(),
            Request::Destroy { key } => self.destroy(key),
            Request::Use { key } => self.use_key(key),
        };
        result.unwrap_or_else(|error| Reply::Error { error })
    }

    fn sign(
        &self,
        id: u32,
        purpose: crate::key::Purpose,
        scheme: crate::key::SignScheme,
        message: &[u8],
    ) -> Result<Reply, RemoteError> {
        let key = self.keys.get(id)?;
        if let Err(why) = self.policy.check(purpose, scheme, message, key.spki_der()) {
            return Err(self.refuse(crate::metric_labels::LabelValue::as_str(purpose), why.0));
        }
        key.sign(scheme, message)
            .map(|signature| Reply::Signature { signature })
            .map_err(|e| remote_error(&e))
    }

    fn certify(
        &self,
        id: u32,
        ak_handle: u32,
        subject: &[u8],
        made_at: u64,
    ) -> Result<Reply, RemoteError> {
        let key = self.keys.get(id)?;
        let now = crate::key::attestation::unix_now();
        if let Err(why) = self.policy.check_certify(subject, made_at, now) {
            return Err(self.refuse("certify", why.0));
        }
        key.certify_request(ak_handle, subject, made_at)
            .map(|e| Reply::Evidence { evidence: e.into() })
            .map_err(|e| remote_error(&e))
    }

    fn store_chain(&self, id: u32, chain: &[Vec<u8>]) -> Result<Reply, RemoteError> {
        let key = self.chain_allowed("store_chain", id, chain)?;
        key.store_chain(chain)
            .map(|place| Reply::Stored { place })
            .map_err(|e| remote_error(&e))
    }

    /// Writes a renewed chain to the configured certificate file: the network side cannot
    /// write there, and the next start reads the identity from it.
    fn install_certificate(
        &self,
        id: u32,
        chain: &[Vec<u8>],
        keep_previous: bool,
    ) -> Result<Reply, RemoteError> {
        self.chain_allowed("install_certificate", id, chain)?;
        let Some(path) = &self.config.cert else {
            return Err(self.refuse(
                "install_certificate",
                "no certificate file is configured (the chain is stored with the key)".into(),
            ));
        };
        let der: Vec<_> = chain
            .iter()
            .map(|c| rustls::pki_types::CertificateDer::from(c.clone()))
            .collect();
        let pem = crate::pki::cert::chain_to_pem(&der);
        let written = if keep_previous {
            crate::atomic_file::write_keeping_previous(path, pem.as_bytes(), 0o644)
        } else {
            crate::atomic_file::write_atomic(path, pem.as_bytes(), 0o644)
        };
        written
            .map(|()| Reply::Stored {
                place: path.display().to_string(),
            })
            .map_err(|e| RemoteError {
                kind: RemoteKind::Failed,
                message: format!("cannot write {}: {e}", path.display()),
            })
    }

    /// The key `id`, when `chain`'s leaf is for it and names the identity's subject.
    fn chain_allowed(
        &self,
        what: &str,
        id: u32,
        chain: &[Vec<u8>],
    ) -> Result<Arc<Key>, RemoteError> {
        let key = self.keys.get(id)?;
        let leaf = chain
            .first()
            .ok_or_else(|| refused("an empty chain".into()))?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| refused(format!("the leaf does not parse: {e}")))?;
        if cert.public_key().raw != key.spki_der() {
            return Err(self.refuse(what, "a chain for another key".into()));
        }
        if let Err(why) = self.policy_allows_leaf(leaf) {
            return Err(self.refuse(what, why.0));
        }
        Ok(key)
    }

    /// A watched file's content from `offset`, when it is a regular file of this user or root
    /// that no one else may write, and the file opened lies in its configured directory (a
    /// link swapped in cannot lead elsewhere: checked on the opened descriptor).
    fn read_watched(&self, file: WatchedFile, offset: u64) -> Result<Reply, RemoteError> {
        let failed = |message: String| RemoteError {
            kind: RemoteKind::Failed,
            message,
        };
        let mut cache = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if offset == 0 || cache.as_ref().is_none_or(|(f, _)| *f != file) {
            let path = match file {
                WatchedFile::Certificate => self.config.cert.as_ref(),
                WatchedFile::UpstreamCa => self.config.upstream_ca.as_ref(),
            }
            .ok_or_else(|| refused(format!("no {file:?} file is configured")))?;
            let dir = path
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            let dir = std::fs::canonicalize(dir)
                .map_err(|e| failed(format!("cannot read {}: {e}", dir.display())))?;
            let bytes = match crate::small_file::read_watched_beneath(path, &dir) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    return Err(self.refuse("read_watched", format!("{}: {e}", path.display())))
                }
                Err(e) => return Err(failed(format!("cannot read {}: {e}", path.display()))),
            };
            *cache = Some((file, bytes));
        }
        let bytes = cache
            .as_ref()
            .map(|(_, b)| b.as_slice())
            .unwrap_or_default();
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        let end = (start + super::protocol::WATCHED_CHUNK).min(bytes.len());
        Ok(Reply::File {
            bytes: bytes[start..end].to_vec(),
            total: bytes.len() as u64,
        })
    }

    /// Key `id` is in use from now on; with `--rotate-key` the pointer a restart reads names
    /// it (only which key: the password source is always the configured key's).
    fn use_key(&self, id: u32) -> Result<Reply, RemoteError> {
        let key = self.keys.get(id)?;
        if let Some(dir) = &self.config.rotation_state {
            let state = crate::state_dir::StateDir::new(dir);
            crate::key::rotation::record_current(&state, key.uri()).map_err(|e| RemoteError {
                kind: RemoteKind::Failed,
                message: format!(
                    "cannot record the key in use in {}: {e}",
                    state.current_key().display()
                ),
            })?;
        }
        self.keys.in_use.store(id, Ordering::SeqCst);
        Ok(Reply::Done)
    }

    /// A stored certificate must name the identity: the network side cannot make the key carry
    /// another identity's chain.
    fn policy_allows_leaf(&self, leaf: &[u8]) -> Result<(), Refusal> {
        let other = Policy::for_certificate(leaf, self.policy.tls12)?;
        if other.same_subject(&self.policy) {
            Ok(())
        } else {
            Err(Refusal::from(
                "a certificate for another subject than the identity's",
            ))
        }
    }

    fn create_next(&self) -> Result<Reply, RemoteError> {
        let current = self.keys.get(self.keys.in_use.load(Ordering::SeqCst))?;
        let created = Arc::new(current.create_next().map_err(|e| remote_error(&e))?);
        if !crate::key::rotation::in_series(&self.config.key, created.uri()) {
            let _ = created.destroy();
            return Err(refused("the next key left the rotation series".into()));
        }
        let mut keys = self.keys.keys.write().unwrap_or_else(|p| p.into_inner());
        let id = u32::try_from(keys.len()).map_err(|_| refused("too many keys".into()))?;
        let reply = Reply::Created {
            key: info(id, &created),
        };
        keys.push(Some(created));
        Ok(reply)
    }

    fn destroy(&self, id: u32) -> Result<Reply, RemoteError> {
        let key = self.keys.get(id)?;
        if id == self.keys.in_use.load(Ordering::SeqCst) {
            return Err(self.refuse("destroy", "the key in use is never deleted".into()));
        }
        // However its URI is spelled (`/k/./key.pem`, `/k//key.pem`, a link to it): the
        // network side can write `current-key`, and a signer started after it opens that
        // spelling.
        if crate::key::rotation::same_key(key.uri(), &self.config.key) {
            return Err(self.refuse("destroy", "the configured key is never deleted".into()));
        }
        if !crate::key::rotation::in_series(&self.config.key, key.uri()) {
            return Err(self.refuse(
                "destroy",
                "only keys of the rotation series are deleted".into(),
            ));
        }
        let removed = key.destroy().map_err(|e| remote_error(&e))?;
        if let Some(slot) = self
            .keys
            .keys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(id as usize)
        {
            *slot = None;
        }
        Ok(Reply::Destroyed { removed })
    }

    /// Counts and logs a refusal (the first ten, then one in a thousand: a compromised network
    /// side must not fill the log).
    fn refuse(&self, what: &str, why: String) -> RemoteError {
        let n = self.refused.fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_multiple_of(1000) {
            tracing::warn!(
                purpose = what,
                refused = n + 1,
                "the signer refused a request: {why}"
            );
        }
        refused(why)
    }
}

/// The public facts of `key`, as key `id`.
fn info(id: u32, key: &Key) -> KeyInfo {
    KeyInfo {
        id,
        uri: key.uri().without_pin().to_string(),
        algorithm: key.algorithm(),
        spki: key.spki_der().to_vec(),
        describe: key.describe(),
        signing_path: PathWire::from(&key.signing_path()),
    }
}

fn refused(message: String) -> RemoteError {
    RemoteError {
        kind: RemoteKind::Refused,
        message,
    }
}

fn remote_error(e: &KeyError) -> RemoteError {
    RemoteError {
        kind: if e.is_pin_refusal() {
            RemoteKind::PinRefused
        } else {
            RemoteKind::Failed
        },
        message: e.to_string(),
    }
}
