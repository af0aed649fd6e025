//! Client listeners and the local hop's authentication.
//!
//! Two kinds of listener take kubectl/kubelet connections:
//! - **loopback TLS** (`tcp:127.0.0.1:PORT`): the proxy serves a certificate from its loopback
//!   CA and *requires* a client certificate from that CA (rustls `WebPkiClientVerifier`). The
//!   ClientHello is read first (rustls's `Acceptor`) to learn the client's ALPN offer; the
//!   protocol is chosen from it (see [`super::upstream`] for why before the upstream), and the
//!   handshake is finished — and the client certificate verified — before anything upstream.
//! - **UNIX socket** (`unix:PATH`, plaintext): created mode 0600, and every peer's uid
//!   (SO_PEERCRED) must be the proxy's own or in `--allow-uid`. The first bytes are read to
//!   tell the HTTP/2 preface from HTTP/1.1; they are replayed upstream untouched.
//!
//! A peer that fails either check is closed here: no upstream connection, no signature.
//!
//! Tasks: one accept loop task for all client listeners; one task per connection, on a connection
//! thread ([`super::threads`]), which runs the local handshake, then [`super::bridge::serve`].
//! A semaphore of `--max-connections` permits is taken once the peer is authenticated (UNIX: at
//! once, by uid; loopback TCP: after the TLS handshake, which the separate [`PREAUTH_BUDGET`]
//! bounds); an authenticated client past the limit waits for a permit, holding its socket.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::server::{UnbufferedServerConnection, WebPkiClientVerifier};
use rustls::ServerConfig;
use tokio::net::TcpStream;
use tokio::sync::watch;

use tokio::sync::Semaphore;

use super::accept::{poll_any, Accepted, ClientBound};
use super::admission::{Admission, Ticket};
use super::bridge::{Bridge, Held};
use super::client_hello::read_client_hello;
use super::error::StartError;
use super::lifetime::Activity;
pub use super::limits::PREAUTH_BUDGET;
use super::metrics::{ListenerKind, Metrics, Refusal};
use super::parts::Parts;
use super::ratelimit::RateLimited;
use super::settings::ClientSettings;
use super::threads::Spawner;
use super::unbuffered::{tls_error, Lean, Session};
use super::unix_client::ClientUnixStream;
use crate::endpoint::ListenAddr;
use crate::pki::loopback_ca::LoopbackCa;
use crate::stop::stopped;

/// What serving client connections needs: the local hop's TLS and rules, the connection limits,
/// and the bridge to the API server. Shared by the accept loop and every connection task.
pub struct Clients {
    /// The loopback listener's TLS configs.
    pub local_tls: LocalTls,
    /// Unauthenticated loopback handshakes in flight, admitted by uid ([`PREAUTH_BUDGET`]).
    pub preauth: Arc<Admission>,
    /// Accepted connections whose peer is not yet admitted ([`AWAITING_ADMISSION`]): when
    /// they are all taken the accept loop stops accepting, and new connections wait in the
    /// kernel's backlog instead of in this process's descriptors and memory.
    pub awaiting: Arc<Semaphore>,
    /// `--max-connections` slots, taken once a peer is authenticated.
    pub slots: Arc<Semaphore>,
    /// UNIX-socket peers allowed besides the proxy's own uid.
    pub allowed_uids: Vec<u32>,
    /// How long the local handshake may take.
    pub handshake_timeout: Duration,
    /// Refusals, accepts, local handshakes.
    pub metrics: Arc<Metrics>,
    /// Open connections, for `--idle-exit` and the drain.
    pub activity: Arc<Activity>,
    /// Where connection tasks run ([`super::threads`]).
    pub connections: Spawner,
    /// Connects upstream and relays.
    pub bridge: Bridge,
}

impl Clients {
    /// The client connections' component (and the bridge they use), from the clients'
    /// settings and the addresses bound for them (the loopback certificate names them).
    pub fn build(
        settings: &ClientSettings,
        parts: &Parts,
        bound: &[ListenAddr],
    ) -> Result<Clients, StartError> {
        let c = settings;
        Ok(Clients {
            awaiting: Arc::new(Semaphore::new(AWAITING_ADMISSION)),
            local_tls: LocalTls::new(&parts.ca, &loopback_names(bound))?,
            preauth: Admission::new(
                PREAUTH_BUDGET,
                PREAUTH_RESERVED,
                vec![own_uid()],
                c.allow_uids.clone(),
            ),
            slots: Arc::new(Semaphore::new(super::limits::fit_connections(
                c.max_connections.max(1),
                parts.connections.threads() + 1,
                (parts.loops.len(), unix_listeners(bound)),
            ))),
            allowed_uids: c.allow_uids.clone(),
            handshake_timeout: c.handshake_timeout,
            metrics: parts.metrics.clone(),
            activity: parts.activity.clone(),
            connections: parts.connections.clone(),
            bridge: Bridge {
                upstream: parts.upstream.clone(),
                metrics: parts.metrics.clone(),
                idle_timeout: c.idle_timeout,
                rotation_close: c.rotation_close,
                relay_loops: Some(parts.loops.clone()),
            },
        })
    }
}

/// How many UNIX sockets the proxy listens on (each relay loop holds a copy of each).
fn unix_listeners(bound: &[ListenAddr]) -> usize {
    bound
        .iter()
        .filter(|a| matches!(a, ListenAddr::Unix(_)))
        .count()
}

/// Why a loopback client's certificate is refused after a (resumed) handshake.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum LoopbackRefused {
    #[error("no client certificate")]
    NoCertificate,
    #[error("unreadable client certificate: {0}")]
    Unreadable(#[source] x509_parser::error::X509Error),
    #[error("its loopback credential is not valid before {0} (check the clocks)")]
    NotYetValid(String),
    #[error("its loopback credential expired at {0} (a resumed TLS session does not extend it)")]
    Expired(String),
}

pub use super::first_bytes::H2_PREFACE;

pub use super::bind::Bound;

/// The effective uid of this process: UNIX-socket peers must match it (or be allowed).
pub use crate::state_dir::own_uid;

/// Checks a UNIX-socket peer's uid (`SO_PEERCRED`); Err(uid) when it must be refused.
pub fn check_peer(stream: &impl std::os::fd::AsFd, allowed: &[u32]) -> Result<u32, Option<u32>> {
    match rustix::net::sockopt::socket_peercred(stream).map(|cred| cred.uid.as_raw()) {
        Ok(uid) if uid == own_uid() || allowed.contains(&uid) => Ok(uid),
        Ok(uid) => Err(Some(uid)),
        Err(_) => Err(None),
    }
}

/// The loopback listener's TLS server configs, one per negotiated protocol, sharing the
/// certificate, the client verifier and the session cache.
pub struct LocalTls {
    base: ServerConfig,
    by_alpn: Mutex<HashMap<Option<Vec<u8>>, Arc<ServerConfig>>>,
    /// The last client certificate checked and its validity window (Unix seconds): clients
    /// reuse one loopback credential, so most connections skip parsing it again.
    last_client: Mutex<Option<(Vec<u8>, i64, i64)>>,
}

impl std::fmt::Debug for LocalTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTls").finish_non_exhaustive()
    }
}

/// The loopback listener's TLS configuration, before a client's ALPN is chosen: a fresh server
/// certificate for `ips` from the loopback CA, a client certificate from the same CA required,
/// TLS 1.3 and 1.2 with classical key exchange, at most one TLS 1.3 ticket per handshake. Public so the
/// loopback path's floor (`benches/e2e/loopback_floor.rs`) is measured with exactly this.
pub fn loopback_server_config(ca: &LoopbackCa, ips: &[IpAddr]) -> Result<ServerConfig, StartError> {
    // The loopback hop: classical key exchange (see pki::tls::provider_for).
    let provider = crate::pki::tls::provider_for(crate::pki::tls::KeyExchange::Classical);
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.cert_der().clone())
        .map_err(StartError::LocalTls)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| StartError::LocalTls(rustls::Error::General(e.to_string())))?;
    let (chain, key) = ca.server_cert(ips)?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(StartError::LocalTls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(StartError::LocalTls)?;
    // One ticket per handshake, not rustls's two, to a client that can resume (it offers the
    // PSK key exchange mode; rustls sends none to a client that does not). client-go sets no
    // session cache, so kubectl and kubelet offer no mode and get none. A client that asks
    // for fewer (RFC 9149 `ticket_request`: a one-shot process asks for none) gets what it
    // asks for: a ticket it will not use costs a record, a cache entry and three random draws.
    config.send_tls13_tickets = 1;
    config.max_tls13_tickets = 1;
    Ok(config)
}

impl LocalTls {
    /// A server config presenting a fresh loopback certificate for `ips` and requiring a client
    /// certificate from the loopback CA.
    pub fn new(ca: &LoopbackCa, ips: &[IpAddr]) -> Result<LocalTls, StartError> {
        let base = loopback_server_config(ca, ips)?;
        Ok(LocalTls {
            base,
            by_alpn: Mutex::new(HashMap::new()),
            last_client: Mutex::new(None),
        })
    }

    /// The loopback client's certificate must be valid now (the verifier checked it when it was
    /// presented; resumption skips that).
    fn client_cert_valid(
        &self,
        certs: Option<&[rustls::pki_types::CertificateDer<'_>]>,
    ) -> Result<(), LoopbackRefused> {
        let leaf = certs
            .and_then(|c| c.first())
            .ok_or(LoopbackRefused::NoCertificate)?;
        let now = rustls::pki_types::UnixTime::now().as_secs() as i64;
        let mut last = self.last_client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((der, not_before, not_after)) = last.as_ref() {
            if der.as_slice() == leaf.as_ref() && (*not_before..=*not_after).contains(&now) {
                return Ok(());
            }
        }
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| LoopbackRefused::Unreadable(e.into()))?;
        let validity = parsed.validity();
        if (validity.not_before.timestamp()..=validity.not_after.timestamp()).contains(&now) {
            *last = Some((
                leaf.to_vec(),
                validity.not_before.timestamp(),
                validity.not_after.timestamp(),
            ));
            Ok(())
        } else if now < validity.not_before.timestamp() {
            Err(LoopbackRefused::NotYetValid(
                validity.not_before.to_string(),
            ))
        } else {
            Err(LoopbackRefused::Expired(validity.not_after.to_string()))
        }
    }

    fn config_for(&self, alpn: Option<&[u8]>) -> Arc<ServerConfig> {
        let key = alpn.map(<[u8]>::to_vec);
        let mut map = self.by_alpn.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(key.clone())
            .or_insert_with(|| {
                let mut c = self.base.clone();
                c.alpn_protocols = key.into_iter().collect();
                Arc::new(c)
            })
            .clone()
    }
}

/// A loopback address set for the loopback server certificate's SANs.
pub fn loopback_names(listen: &[ListenAddr]) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = vec![
        IpAddr::from([127, 0, 0, 1]),
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
    ];
    for l in listen {
        if let ListenAddr::Tcp(a) = l {
            if !ips.contains(&a.ip()) && !a.ip().is_unspecified() {
                ips.push(a.ip());
            }
        }
    }
    ips
}

/// How many accepted connections may wait for their admission at once (the connection
/// threads are busy, a flood arrives faster than the kernel answers who is calling).
pub const AWAITING_ADMISSION: usize = 256;
/// Places of [`PREAUTH_BUDGET`] other uids can never take.
pub const PREAUTH_RESERVED: usize = 32;
/// How long an unauthenticated peer may take to complete the loopback TLS handshake (a real
/// client on loopback needs milliseconds).
pub const PREAUTH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a peer may take to send its whole ClientHello: kubectl sends it right after
/// connecting; a peer that connects and waits is an idle slot-holder.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(1);

static REFUSED_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));
static BUSY_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));
static ACCEPT_ERROR_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));

/// Runs until `stop` turns true: accepts on whichever client listener is ready first, one task
/// per connection. One loop for all listeners, polled round-robin so a busy listener cannot
/// starve the others. A connection takes one of the `--max-connections` slots only once its
/// peer is authenticated (UNIX: uid at once; TCP: after the loopback TLS handshake, which runs
/// under the separate [`PREAUTH_BUDGET`] and [`PREAUTH_TIMEOUT`]).
pub async fn accept_loop(
    shared: Arc<Clients>,
    listeners: Vec<ClientBound>,
    mut stop: watch::Receiver<bool>,
) {
    if listeners.is_empty() {
        // Its clients are accepted elsewhere (the UNIX socket's by the relay loops).
        stopped(&mut stop).await;
        return;
    }
    let mut first = 0;
    loop {
        // A place among the connections awaiting admission before the next accept.
        let waiting = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            p = shared.awaiting.clone().acquire_owned() => p,
        };
        let Ok(waiting) = waiting else { break };
        let (i, accepted) = tokio::select! {
            biased;
            _ = stopped(&mut stop) => break,
            r = std::future::poll_fn(|cx| poll_any(&listeners, first, cx)) => r,
        };
        first = (i + 1) % listeners.len();
        if let Err(e) = spawn_connection(&shared, accepted, waiting) {
            accept_error(&listeners[i].addr().to_string(), e).await
        }
    }
    tracing::debug!("stopped accepting");
}

/// Hands an accepted connection to a connection thread, where its peer is admitted (and
/// `waiting`, its place among the connections awaiting admission, is given back) before
/// anything else. The accept's own error is returned for the caller to report.
fn spawn_connection(
    shared: &Arc<Clients>,
    accepted: Accepted,
    waiting: tokio::sync::OwnedSemaphorePermit,
) -> std::io::Result<()> {
    match accepted {
        Accepted::Unix(Ok(stream)) => {
            shared.metrics.connection_accepted(ListenerKind::Unix);
            let task_shared = shared.clone();
            shared.connections.spawn(move || async move {
                // The peer's uid is checked in this same poll, before any await.
                drop(waiting);
                handle_unix(&task_shared, ClientUnixStream::accepted(stream)).await
            });
        }
        Accepted::Tcp(Ok((stream, peer))) => {
            shared.metrics.connection_accepted(ListenerKind::Tcp);
            let task_shared = shared.clone();
            shared.connections.spawn(move || async move {
                let shared = task_shared;
                let Some(stream) = handed_over(TcpStream::from_std(stream), "register") else {
                    return;
                };
                let admitted = admit_connection(&shared.preauth, &shared.metrics, &stream, peer);
                drop(waiting);
                let Some(preauth) = admitted else {
                    return;
                };
                handle_tcp(&shared, stream, peer, preauth).await
            });
        }
        Accepted::Unix(Err(e)) | Accepted::Tcp(Err(e)) => return Err(e),
    }
    Ok(())
}

/// An accepted socket, registered nowhere ([`super::accept`]), is registered with its
/// connection thread's runtime ([`super::threads`]) by `from_std` there. None (the connection
/// is closed, and `what` failed is logged) when that fails.
fn handed_over<S>(step: std::io::Result<S>, what: &str) -> Option<S> {
    step.map_err(|e| tracing::warn!(error = %e, "could not {what} a connection on its thread"))
        .ok()
}

/// Admits a loopback TCP connection by its peer's uid ([`super::admission`]), counting the
/// connections shed for it. None when the stream has no addresses any more.
pub(crate) fn admit_connection(
    gate: &Arc<Admission>,
    metrics: &Metrics,
    stream: &TcpStream,
    peer: SocketAddr,
) -> Option<Ticket> {
    let local = stream.local_addr().ok()?;
    let uid = super::admission::tcp_peer_uid(peer, local);
    let (ticket, admitted) = gate.admit(uid);
    for _ in 0..admitted.shed {
        metrics.refused(Refusal::Busy);
    }
    if admitted.shed > 0 {
        if let Some(suppressed) = BUSY_LOG.allow() {
            let (privileged, others) = gate.held();
            tracing::warn!(
                %peer,
                uid = ?uid,
                suppressed,
                privileged,
                others,
                "unauthenticated loopback connections at their limit: closed the oldest of another user"
            );
        }
    }
    Some(ticket)
}

/// After a failed accept (EMFILE and friends): back off instead of spinning, and log at most
/// once per interval.
pub async fn accept_error(name: &str, e: std::io::Error) {
    if let Some(suppressed) = ACCEPT_ERROR_LOG.allow() {
        tracing::warn!(listener = %name, error = %e, suppressed, "accept failed");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// A warning about a refused peer, rate-limited.
fn refused(what: &str, detail: &dyn std::fmt::Display) {
    if let Some(suppressed) = REFUSED_LOG.allow() {
        tracing::warn!(suppressed, "{what}: {detail}");
    }
}

async fn handle_unix(shared: &Clients, stream: ClientUnixStream) {
    match stream.socket() {
        Some(socket) if admit_unix_peer(shared, socket) => {
            serve_admitted_unix(shared, stream).await
        }
        _ => {}
    }
}

/// Whether a UNIX-socket client's peer may use the proxy (its uid: the proxy's own or one
/// allowed); a refusal is counted and logged.
pub(super) fn admit_unix_peer(shared: &Clients, socket: &std::os::unix::net::UnixStream) -> bool {
    match check_peer(socket, &shared.allowed_uids) {
        Ok(_) => true,
        Err(uid) => {
            shared.metrics.refused(Refusal::PeerUid);
            refused(
                "refused a UNIX-socket client of another user (allow it with --allow-uid)",
                &format!("peer uid {uid:?}, proxy uid {}", own_uid()),
            );
            false
        }
    }
}

/// An admitted UNIX-socket client, served on its connection thread: a connection slot (waited
/// for), its first bytes, then its upstream connection and the relay.
pub(super) async fn serve_admitted_unix(shared: &Clients, mut stream: ClientUnixStream) {
    // Authenticated: a connection slot, and activity for --idle-exit.
    let Ok(slot) = shared.slots.clone().acquire_owned().await else {
        return;
    };
    let held = Held {
        slot,
        active: shared.activity.enter(),
    };
    let prefix = match tokio::time::timeout(
        shared.handshake_timeout,
        super::first_bytes::sniff(&mut stream),
    )
    .await
    {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "UNIX-socket client went away before sending a request");
            return;
        }
        Err(_) => {
            shared.metrics.refused(Refusal::HandshakeTimeout);
            tracing::info!("UNIX-socket client sent no request in time; closed");
            return;
        }
    };
    let alpn: &[u8] = if prefix.starts_with(H2_PREFACE) {
        b"h2"
    } else {
        b"http/1.1"
    };
    shared
        .bridge
        .serve_unix(stream, prefix, Some(alpn.to_vec()), held)
        .await;
}

async fn handle_tcp(shared: &Clients, stream: TcpStream, peer: SocketAddr, preauth: Ticket) {
    // TCP_NODELAY: inherited from the listener (accept.rs).
    let started = Instant::now();
    let handshake = async {
        let (read, offered) = tokio::time::timeout(HELLO_TIMEOUT, read_client_hello(&stream))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "no ClientHello in time")
            })??;
        let chosen = shared.bridge.upstream.choose_alpn(&offered);
        let config = shared.local_tls.config_for(chosen.as_deref());
        let session = UnbufferedServerConnection::new(config).map_err(tls_error)?;
        let mut tls = Box::new(Lean::new(stream, session, read));
        tls.handshake().await?;
        Ok::<_, std::io::Error>((tls, chosen))
    };
    let limit = shared.handshake_timeout.min(PREAUTH_TIMEOUT);
    // Boxed, and the stream it yields too: the handshake's state lives on the heap only while
    // it runs, and the stream's moves to the relay cost a pointer each, not a slot of 1 KiB in
    // this task for the connection's whole life (memory per idle connection, docs/BENCHMARKS.md).
    let outcome = tokio::select! {
        r = Box::pin(tokio::time::timeout(limit, handshake)) => r,
        _ = preauth.shed() => {
            refused("closed an unauthenticated loopback connection to make room", &peer);
            return;
        }
    };
    let Some((tls, alpn)) = handshake_outcome(&shared.metrics, outcome, peer) else {
        return;
    };
    // A resumed session carries the certificate of the handshake it resumes: check it is still
    // valid, so a session outliving its short-lived loopback credential gets nothing.
    if let Err(why) = shared
        .local_tls
        .client_cert_valid(tls.session.common().peer_certificates())
    {
        shared.metrics.refused(Refusal::Expired);
        refused("refused a loopback client", &format!("{peer}: {why}"));
        return;
    }
    drop(preauth);
    let Ok(slot) = shared.slots.clone().acquire_owned().await else {
        return;
    };
    let held = Held {
        slot,
        active: shared.activity.enter(),
    };
    shared.metrics.local_handshake(started.elapsed());
    shared.bridge.serve_loopback(tls, alpn, held).await;
}

/// What a loopback handshake's outcome means: the stream and protocol, or a refusal counted and
/// logged (None).
fn handshake_outcome<T>(
    metrics: &Metrics,
    outcome: Result<std::io::Result<T>, tokio::time::error::Elapsed>,
    peer: SocketAddr,
) -> Option<T> {
    match outcome {
        Ok(Ok(done)) => Some(done),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
            metrics.refused(Refusal::HandshakeTimeout);
            refused("loopback client sent no ClientHello in time; closed", &peer);
            None
        }
        Ok(Err(e)) => {
            metrics.refused(Refusal::ClientAuth);
            refused(
                "refused a loopback client: TLS handshake failed (a client certificate from the loopback CA is required)",
                &format!("{peer}: {e}"),
            );
            None
        }
        Err(_) => {
            metrics.refused(Refusal::HandshakeTimeout);
            refused("loopback TLS handshake timed out; closed", &peer);
            None
        }
    }
}
