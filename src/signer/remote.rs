//! The network side's end of the signer: a [`KeyBackend`] whose every operation is a request
//! over the signer's socket. A [`Key`] made from it is used exactly like a key opened in this
//! process (the rustls and rcgen adapters, renewal, health), so the proxy's code does not know
//! where the key lives; it just cannot ask for anything the signer's policy refuses.
//!
//! The calling threads read the replies themselves, taking turns: the one reading hands each
//! reply to the thread waiting for it (by id), so signatures from many connection threads are
//! in flight at once and a lone one costs no thread hand-off. When the signer
//! goes away every waiting call fails at once ([`SignerError::Gone`]); the [`SignerLink`] asks
//! the supervisor for a new signer on the next call (with backoff: 200 ms doubling to 5 s), as
//! the key layer reconnects a TPM or re-finds a token. A new signer opens the same key again
//! (the key in use after a rotation: the state directory's pointer, within the series); calls
//! find their key in it by its public key. A signer that refuses the PIN is never asked again.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::error::SignerError;
use super::protocol::{
    self, KeyInfo, RemoteError, RemoteKind, Reply, Request, WatchedFile, VERSION,
};
use super::supervisor::Supervisor;
use crate::backoff::Backoff;
use crate::key::attestation::TpmEvidence;
use crate::key::{CapabilityError, PinError};
use crate::key::{
    Key, KeyAlgorithm, KeyBackend, KeyError, KeyUri, Protection, Purpose, SignScheme, SigningPath,
};

/// A connection to one signer process.
#[derive(Debug)]
pub struct SignerClient {
    socket: Arc<OwnedFd>,
    /// How long a call waits for its reply.
    deadline: Duration,
    waiting: Mutex<Waiting>,
    /// Wakes callers when a reply arrived, the reading turn is free, or the signer is gone.
    changed: Condvar,
    next_id: AtomicU64,
}

/// Calls waiting for their replies (None until answered), whether a caller is reading the
/// socket, and why the signer is gone once it is.
///
/// No reader thread: the caller whose turn it is reads one reply and hands it to whoever it
/// belongs to, so a lone call reads its own reply on its own thread (one wake-up less per
/// signature than a reader thread handing it over), and concurrent calls take turns.
#[derive(Debug, Default)]
struct Waiting {
    calls: HashMap<u64, Option<Reply>>,
    reading: bool,
    gone: Option<String>,
    /// A call waited out its deadline and no reply came since: later calls fail at once
    /// (after reading whatever replies arrived meanwhile) instead of each waiting it out on a
    /// thread of its own.
    stalled: bool,
}

/// Calls waiting at once at most: more fail at once (a stalled signer must not collect one
/// blocked thread per client).
const MAX_WAITING: usize = 256;

/// The deadline of a signer call unless the caller sets one ([`SignerLink::set_deadline`]).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);

impl SignerClient {
    /// Takes the signer's greeting from `socket` and starts reading replies. The greeting's
    /// `Failed` becomes the error the signer reported (a refused PIN stays recognisable).
    /// Each call then waits at most `deadline` for its reply.
    pub fn connect(
        socket: OwnedFd,
        deadline: Duration,
    ) -> Result<(Arc<SignerClient>, KeyInfo), KeyError> {
        // Opening the key includes the login: a device that hangs there fails this start at
        // the deadline (the login's own, at least a minute) instead of holding every caller.
        let opening = deadline.max(DEFAULT_DEADLINE);
        if !readable_within(&socket, opening).map_err(|e| signer_error(&e))? {
            return Err(KeyError::Signer {
                message: format!("the signer did not open the key within {opening:?}"),
            });
        }
        let hello = protocol::recv::<Reply>(socket.as_fd())
            .map_err(|e| signer_error(&e))?
            .ok_or_else(|| KeyError::Signer {
                message: "the signer exited before it opened the key".into(),
            })?;
        let info = match hello.body {
            Reply::Hello { version, key } if version == VERSION => key,
            Reply::Hello { version, .. } => {
                return Err(signer_error(&SignerError::Version {
                    theirs: version,
                    ours: VERSION,
                }))
            }
            Reply::Failed { error, .. } | Reply::Error { error } => return Err(key_error(error)),
            _ => return Err(signer_error(&SignerError::Unexpected("no greeting"))),
        };
        let client = Arc::new(SignerClient {
            socket: Arc::new(socket),
            deadline,
            waiting: Mutex::new(Waiting::default()),
            changed: Condvar::new(),
            next_id: AtomicU64::new(1),
        });
        Ok((client, info))
    }

    /// Whether the signer is gone (its socket closed or broke).
    pub fn is_gone(&self) -> bool {
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .gone
            .is_some()
    }

    /// One request and its reply. Blocking: a signature waits as long as the device takes (a
    /// stalled TPM stalls only the handshakes that need it, as in-process).
    fn call(&self, request: &Request) -> Result<Reply, KeyError> {
        self.call_raw(request).and_then(|reply| match reply {
            Reply::Error { error } => Err(key_error(error)),
            other => Ok(other),
        })
    }

    fn call_raw(&self, request: &Request) -> Result<Reply, KeyError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut waiting = self.lock();
            if let Some(why) = &waiting.gone {
                return Err(signer_error(&SignerError::Gone {
                    why: Some(why.clone()),
                }));
            }
            if waiting.stalled && !waiting.reading {
                self.read_ready(&mut waiting);
            }
            if waiting.stalled {
                return Err(self.stalled_error());
            }
            if waiting.calls.len() >= MAX_WAITING {
                return Err(KeyError::Signer {
                    message: format!("{MAX_WAITING} calls are already waiting for the signer"),
                });
            }
            waiting.calls.insert(id, None);
        }
        if let Err(e) = protocol::send(self.socket.as_fd(), id, request) {
            let mut waiting = self.lock();
            waiting.calls.remove(&id);
            // A message that could not be encoded or is over the limit was never sent: that
            // call fails, the signer is fine. Marking it gone failed every call in flight and
            // restarted the signer (a PIN login, then a back-off) for one oversized message.
            if !matches!(e, SignerError::TooLarge { .. } | SignerError::Encode(_)) {
                self.mark_gone(&mut waiting, e.to_string());
            }
            return Err(signer_error(&e));
        }
        // Signatures wait the short deadline, and one that misses it marks the signer stalled;
        // the rest (a key made for a rotation, a chain stored, a file read) may take longer on
        // a TPM and do not stall the handshakes.
        let signature = matches!(request, Request::Sign { .. });
        let wait = if signature {
            self.deadline
        } else {
            self.deadline.max(DEFAULT_DEADLINE)
        };
        self.wait_for(id, Instant::now() + wait, signature)
    }

    /// Waits for call `id`'s reply until `deadline`, reading replies in turn with the other
    /// callers.
    fn wait_for(&self, id: u64, deadline: Instant, stalls: bool) -> Result<Reply, KeyError> {
        let mut waiting = self.lock();
        loop {
            if let Some(Some(_)) = waiting.calls.get(&id) {
                return match waiting.calls.remove(&id).flatten() {
                    Some(reply) => Ok(reply),
                    None => Err(signer_error(&SignerError::Gone { why: None })),
                };
            }
            if let Some(why) = &waiting.gone {
                let why = why.clone();
                waiting.calls.remove(&id);
                return Err(signer_error(&SignerError::Gone { why: Some(why) }));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                waiting.calls.remove(&id);
                if stalls && !waiting.stalled {
                    tracing::error!(deadline = ?self.deadline, "the signer did not answer in time: signatures fail until it answers again");
                    waiting.stalled = true;
                }
                return Err(self.stalled_error());
            }
            if waiting.reading {
                waiting = self
                    .changed
                    .wait_timeout(waiting, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
            // This caller's turn to read one reply (its own or another's), if one comes in time.
            waiting.reading = true;
            drop(waiting);
            let read = match readable_within(&self.socket, left) {
                Ok(true) => protocol::recv::<Reply>(self.socket.as_fd()).map(Some),
                Ok(false) => Ok(None),
                Err(e) => Err(e),
            };
            waiting = self.lock();
            waiting.reading = false;
            match read {
                Ok(Some(reply)) => self.deliver(&mut waiting, reply),
                Ok(None) => {}
                Err(e) => self.mark_gone(&mut waiting, e.to_string()),
            }
            self.changed.notify_all();
        }
    }

    /// Hands a reply (or the end of the socket) to whoever waits for it; any reply means the
    /// signer answers again.
    fn deliver(&self, waiting: &mut Waiting, reply: Option<protocol::Envelope<Reply>>) {
        match reply {
            Some(reply) => {
                waiting.stalled = false;
                if let Some(slot) = waiting.calls.get_mut(&reply.id) {
                    *slot = Some(reply.body);
                }
            }
            None => self.mark_gone(waiting, "its socket closed".into()),
        }
    }

    /// Reads the replies that already arrived, without waiting (a stalled signer that answers
    /// again is noticed by the next call).
    fn read_ready(&self, waiting: &mut Waiting) {
        while let Ok(true) = readable_within(&self.socket, Duration::ZERO) {
            match protocol::recv::<Reply>(self.socket.as_fd()) {
                Ok(reply) => {
                    let end = reply.is_none();
                    self.deliver(waiting, reply);
                    if end {
                        return;
                    }
                }
                Err(e) => return self.mark_gone(waiting, e.to_string()),
            }
        }
        self.changed.notify_all();
    }

    fn stalled_error(&self) -> KeyError {
        KeyError::Signer {
            message: format!(
                "the signer did not answer within {:?} (stopped, or waiting on its device: a touch, a stalled TPM); signatures fail until it answers again",
                self.deadline
            ),
        }
    }

    /// The signer is gone: every waiting call fails (it asks again through a new signer).
    fn mark_gone(&self, waiting: &mut Waiting, why: String) {
        if waiting.gone.is_none() {
            tracing::error!(why = %why, "the signer is gone: signatures fail until it is back");
            waiting.gone = Some(why);
        }
        self.changed.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether `socket` has something to read (or hung up) within `wait`.
fn readable_within(socket: &OwnedFd, wait: Duration) -> Result<bool, SignerError> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec {
        tv_sec: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    loop {
        let mut fds = [PollFd::new(socket, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(SignerError::Recv(e)),
        }
    }
}

impl Drop for SignerClient {
    fn drop(&mut self) {
        // Shutting the socket down ends the signer, which serves until its socket closes.
        let _ = rustix::net::shutdown(self.socket.as_fd(), rustix::net::Shutdown::Both);
    }
}

/// The network side's way to its signer, across restarts of the signer.
#[derive(Debug)]
pub struct SignerLink {
    supervisor: Supervisor,
    /// Each call's deadline.
    deadline: Duration,
    state: RwLock<LinkState>,
    restart: Mutex<Restart>,
}

/// The signer in use and the ids of its keys, by public key.
#[derive(Debug)]
struct LinkState {
    client: Arc<SignerClient>,
    ids: HashMap<Vec<u8>, u32>,
}

/// When the next restart may be tried, and whether the PIN was refused (then the supervisor
/// starts a signer again only once the PIN source changed).
#[derive(Debug)]
struct Restart {
    backoff: Backoff,
    not_before: Option<Instant>,
    pin_refused: Option<String>,
}

impl SignerLink {
    /// Starts the first signer through `supervisor` and returns the link and the key it opened.
    /// Every call waits at most `deadline` for its answer; then it fails, and so does every
    /// call after it until the signer answers again.
    pub fn open(
        supervisor: Supervisor,
        deadline: Duration,
    ) -> Result<(Arc<SignerLink>, Key), KeyError> {
        let socket = supervisor.spawn_signer().map_err(|e| signer_error(&e))?;
        let (client, info) = SignerClient::connect(socket, deadline)?;
        let link = Arc::new(SignerLink {
            supervisor,
            deadline,
            state: RwLock::new(LinkState {
                client,
                ids: HashMap::from([(info.spki.clone(), info.id)]),
            }),
            restart: Mutex::new(Restart {
                backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
                not_before: None,
                pin_refused: None,
            }),
        });
        let key = link.key(info)?;
        Ok((link, key))
    }

    fn key(self: &Arc<Self>, info: KeyInfo) -> Result<Key, KeyError> {
        let uri: KeyUri = info.uri.parse()?;
        Ok(Key::from_backend(
            uri,
            Box::new(RemoteKey {
                link: self.clone(),
                path: info.signing_path.to_path(),
                info,
            }),
        ))
    }

    /// A request about the key whose public key is `spki`, to the signer in use (restarted
    /// first when it is gone).
    fn call(&self, spki: &[u8], request: impl Fn(u32) -> Request) -> Result<Reply, KeyError> {
        let (client, id) = self.current(spki)?;
        let first = request(id);
        let answer = client.call(&first);
        // A signer found dead by this call (it died while nothing was asked): a signature, or
        // a read, is asked again of the new one; a change (a key made or deleted, a chain
        // stored) is not repeated blindly.
        let repeatable = matches!(
            first,
            Request::Sign { .. } | Request::StoredChain { .. } | Request::PivAttestation { .. }
        );
        if answer.is_err() && repeatable && client.is_gone() {
            let (client, id) = self.current(spki)?;
            return client.call(&request(id));
        }
        answer
    }

    /// The signer in use and this key's id in it, restarting the signer if it is gone.
    fn current(&self, spki: &[u8]) -> Result<(Arc<SignerClient>, u32), KeyError> {
        {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            if !state.client.is_gone() {
                return state.id(spki).map(|id| (state.client.clone(), id));
            }
        }
        self.restart()?;
        let state = self.state.read().unwrap_or_else(|p| p.into_inner());
        state.id(spki).map(|id| (state.client.clone(), id))
    }

    /// Starts a new signer, unless one was started meanwhile, the backoff says not yet, or the
    /// PIN was refused.
    fn restart(&self) -> Result<(), KeyError> {
        let mut restart = self.restart.lock().unwrap_or_else(|p| p.into_inner());
        if !self
            .state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .is_gone()
        {
            return Ok(());
        }
        if restart.not_before.is_some_and(|t| Instant::now() < t) {
            return Err(match &restart.pin_refused {
                Some(message) => KeyError::Pin(PinError::SignerRefused {
                    message: message.clone(),
                }),
                None => KeyError::Signer {
                    message: "the signer is gone; it is being restarted".into(),
                },
            });
        }
        let started = self
            .supervisor
            .spawn_signer()
            .map_err(|e| signer_error(&e))
            .and_then(|socket| SignerClient::connect(socket, self.deadline));
        match started {
            Ok((client, info)) => {
                tracing::info!(key = %info.describe, "a new signer is serving the key");
                restart.backoff.reset();
                restart.not_before = None;
                restart.pin_refused = None;
                *self.state.write().unwrap_or_else(|p| p.into_inner()) = LinkState {
                    client,
                    ids: HashMap::from([(info.spki, info.id)]),
                };
                Ok(())
            }
            Err(e) => {
                // A refused PIN is asked about again after the backoff: the supervisor starts
                // no signer while the PIN source still holds the refused PIN, and one as soon
                // as it was fixed.
                restart.pin_refused = matches!(e, KeyError::Pin(PinError::SignerRefused { .. }))
                    .then(|| e.to_string());
                restart.not_before = Some(Instant::now() + restart.backoff.next_delay());
                tracing::error!(error = %e, "cannot restart the signer");
                Err(e)
            }
        }
    }

    /// Resolves when the signer supervisor is gone ([`Supervisor::gone`]).
    pub fn supervisor_gone(&self) -> Result<tokio::sync::oneshot::Receiver<String>, KeyError> {
        self.supervisor.gone().map_err(|e| signer_error(&e))
    }

    /// What a watched file (the certificate, the upstream CA bundle) holds now, read by the
    /// signer side: the network side is confined away from the directories they live in.
    /// Blocking.
    pub fn read_watched(&self, file: WatchedFile) -> Result<Vec<u8>, KeyError> {
        let client = {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            (!state.client.is_gone()).then(|| state.client.clone())
        };
        let client = match client {
            Some(c) => c,
            None => {
                self.restart()?;
                self.state
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .client
                    .clone()
            }
        };
        let mut all = Vec::new();
        loop {
            let offset = all.len() as u64;
            match client.call(&Request::ReadWatched { file, offset })? {
                Reply::File { bytes, total } => {
                    let done = bytes.is_empty();
                    all.extend_from_slice(&bytes);
                    if all.len() as u64 >= total || done {
                        return Ok(all);
                    }
                }
                _ => return Err(signer_error(&SignerError::Unexpected("a file"))),
            }
        }
    }

    /// Remembers a key the signer created, by its public key.
    fn learn(&self, info: &KeyInfo) {
        self.state
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .ids
            .insert(info.spki.clone(), info.id);
    }
}

impl LinkState {
    fn id(&self, spki: &[u8]) -> Result<u32, KeyError> {
        self.ids.get(spki).copied().ok_or_else(|| KeyError::Signer {
            message: "the signer serves another key since it restarted".into(),
        })
    }
}

/// A key that lives in the signer process.
#[derive(Debug)]
struct RemoteKey {
    link: Arc<SignerLink>,
    info: KeyInfo,
    path: SigningPath,
}

impl RemoteKey {
    fn expect<T>(
        &self,
        reply: Reply,
        want: &'static str,
        f: impl FnOnce(Reply) -> Option<T>,
    ) -> Result<T, KeyError> {
        f(reply).ok_or_else(|| signer_error(&SignerError::Unexpected(want)))
    }
}

impl KeyBackend for RemoteKey {
    fn algorithm(&self) -> KeyAlgorithm {
        self.info.algorithm
    }

    fn spki_der(&self) -> &[u8] {
        &self.info.spki
    }

    fn sign(&self, _scheme: SignScheme, _message: &[u8]) -> Result<Vec<u8>, KeyError> {
        Err(KeyError::SignerRefused {
            reason: "a signature without a stated purpose".into(),
        })
    }

    fn sign_for(
        &self,
        purpose: Purpose,
        scheme: SignScheme,
        message: &[u8],
    ) -> Result<Vec<u8>, KeyError> {
        let reply = self.link.call(&self.info.spki, |key| Request::Sign {
            key,
            purpose,
            scheme,
            message: message.to_vec(),
        })?;
        self.expect(reply, "a signature", |r| match r {
            Reply::Signature { signature } => Some(signature),
            _ => None,
        })
    }

    fn describe(&self) -> String {
        self.info.describe.clone()
    }

    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::StoredChain { key })?;
        self.expect(reply, "a chain", |r| match r {
            Reply::Chain { chain } => Some(chain),
            _ => None,
        })
    }

    fn piv_attestation(&self) -> Result<Option<crate::key::PivAttestationCerts>, KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::PivAttestation { key })?;
        let chain = self.expect(reply, "a PIV attestation", |r| match r {
            Reply::Chain { chain } => Some(chain),
            _ => None,
        })?;
        Ok(chain.and_then(|c| match <[Vec<u8>; 2]>::try_from(c) {
            Ok([attestation, device]) => Some(crate::key::PivAttestationCerts {
                attestation,
                device,
            }),
            Err(_) => None,
        }))
    }

    fn install_certificate(
        &self,
        chain: &[Vec<u8>],
        keep_previous: bool,
    ) -> Result<String, KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::InstallCertificate {
                key,
                chain: chain.to_vec(),
                keep_previous,
            })?;
        self.expect(reply, "where the certificate went", |r| match r {
            Reply::Stored { place } => Some(place),
            _ => None,
        })
    }

    fn protection(&self) -> Result<Protection, KeyError> {
        Err(KeyError::Capability(CapabilityError::Unsupported(
            "the signer checked the key's protection when it opened it".into(),
        )))
    }

    fn certify(&self, _ak_handle: u32, _qualifying_data: &[u8]) -> Result<TpmEvidence, KeyError> {
        Err(KeyError::SignerRefused {
            reason: "a certification of data the signer cannot read (it certifies requests)".into(),
        })
    }

    fn certify_request(
        &self,
        ak_handle: u32,
        subject_der: &[u8],
        made_at: u64,
    ) -> Result<TpmEvidence, KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::CertifyRequest {
                key,
                ak_handle,
                subject: subject_der.to_vec(),
                made_at,
            })?;
        self.expect(reply, "evidence", |r| match r {
            Reply::Evidence { evidence } => Some(evidence.into()),
            _ => None,
        })
    }

    fn signing_path(&self) -> SigningPath {
        self.path.clone()
    }

    fn store_chain(&self, _uri: &KeyUri, chain: &[Vec<u8>]) -> Result<String, KeyError> {
        let reply = self.link.call(&self.info.spki, |key| Request::StoreChain {
            key,
            chain: chain.to_vec(),
        })?;
        self.expect(reply, "a place", |r| match r {
            Reply::Stored { place } => Some(place),
            _ => None,
        })
    }

    fn destroy(&self, _uri: &KeyUri) -> Result<Vec<String>, KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::Destroy { key })?;
        self.expect(reply, "what was removed", |r| match r {
            Reply::Destroyed { removed } => Some(removed),
            _ => None,
        })
    }

    fn create_next(&self, _uri: &KeyUri) -> Result<(KeyUri, Box<dyn KeyBackend>), KeyError> {
        let reply = self.link.call(&self.info.spki, |_| Request::CreateNext)?;
        let info = self.expect(reply, "a new key", |r| match r {
            Reply::Created { key } => Some(key),
            _ => None,
        })?;
        self.link.learn(&info);
        let uri: KeyUri = info.uri.parse()?;
        Ok((
            uri,
            Box::new(RemoteKey {
                link: self.link.clone(),
                path: info.signing_path.to_path(),
                info,
            }),
        ))
    }

    fn mark_in_use(&self) -> Result<(), KeyError> {
        let reply = self
            .link
            .call(&self.info.spki, |key| Request::Use { key })?;
        self.expect(reply, "done", |r| matches!(r, Reply::Done).then_some(()))
    }
}

fn key_error(error: RemoteError) -> KeyError {
    match error.kind {
        RemoteKind::Refused => KeyError::SignerRefused {
            reason: error.message,
        },
        RemoteKind::PinRefused => KeyError::Pin(PinError::SignerRefused {
            message: error.message,
        }),
        RemoteKind::Failed => KeyError::Signer {
            message: error.message,
        },
    }
}

pub(crate) fn signer_error(e: &SignerError) -> KeyError {
    match e {
        SignerError::PinUnchanged => KeyError::Pin(PinError::SignerRefused {
            message: e.to_string(),
        }),
        _ => KeyError::Signer {
            message: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client whose calls wait `deadline`, and the signer's end of its socket.
    fn client_and_peer(deadline: Duration) -> (SignerClient, OwnedFd) {
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair");
        let client = SignerClient {
            socket: Arc::new(ours),
            deadline,
            waiting: Mutex::new(Waiting::default()),
            changed: Condvar::new(),
            next_id: AtomicU64::new(1),
        };
        (client, theirs)
    }

    /// A request over the message limit (a TLS 1.2 handshake's transcript with a long list of
    /// CA names is signed whole) failed, and the client declared the signer gone: every call in
    /// flight failed and the signer was restarted. Now that call alone fails; the next one is
    /// answered on the same socket.
    #[test]
    fn a_request_too_large_to_send_fails_alone_and_the_signer_stays() {
        let (client, theirs) = client_and_peer(DEFAULT_DEADLINE);
        let peer = std::thread::spawn(move || {
            let got = protocol::recv::<Request>(&theirs)
                .expect("recv")
                .expect("a request");
            protocol::send(theirs.as_fd(), got.id, &Reply::Chain { chain: None }).expect("send");
            theirs
        });
        let big = Request::StoreChain {
            key: 1,
            chain: vec![vec![0u8; protocol::MAX_MESSAGE]],
        };
        assert!(client.call_raw(&big).is_err());
        assert!(
            !client.is_gone(),
            "one oversized request made the signer gone"
        );
        let reply = client
            .call_raw(&Request::StoredChain { key: 1 })
            .expect("answered");
        assert!(matches!(reply, Reply::Chain { chain: None }), "{reply:?}");
        drop(peer.join().expect("peer"));
    }

    /// A signer that stops answering (SIGSTOP, a token waiting for a touch): the call fails
    /// at its deadline naming the stalled signer; the calls after it fail at once without
    /// being sent (no thread waits out the stall again); once the signer answers again (its
    /// late reply), calls are answered as before. Before, every call waited as long as the
    /// stall lasted.
    #[test]
    fn a_stalled_signer_fails_calls_at_their_deadline_and_then_at_once() {
        let (client, theirs) = client_and_peer(Duration::from_millis(200));
        let sign = || Request::Sign {
            key: 1,
            purpose: crate::key::Purpose::Handshake,
            scheme: SignScheme::EcdsaP256Sha256,
            message: vec![1, 2, 3],
        };
        let first = client.call_raw(&sign());
        let e = first.expect_err("no answer came");
        assert!(e.to_string().contains("did not answer within"), "{e}");
        let again = client.call_raw(&sign());
        assert!(
            again.is_err(),
            "a call while stalled waited and got {again:?}"
        );
        // The signer received the first request only.
        let got = protocol::recv::<Request>(&theirs)
            .expect("recv")
            .expect("one");
        assert!(!readable_within(&theirs, Duration::ZERO).expect("poll"));
        // It answers (late): the next call notices and is served.
        protocol::send(theirs.as_fd(), got.id, &Reply::Chain { chain: None }).expect("send");
        let peer = std::thread::spawn(move || {
            let got = protocol::recv::<Request>(&theirs)
                .expect("recv")
                .expect("a request");
            protocol::send(theirs.as_fd(), got.id, &Reply::Chain { chain: None }).expect("send");
            theirs
        });
        let reply = client.call_raw(&sign()).expect("answered again");
        assert!(matches!(reply, Reply::Chain { chain: None }), "{reply:?}");
        drop(peer.join().expect("peer"));
    }
}
