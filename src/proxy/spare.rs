//! The spare upstream connections, made ahead ([`super::preconnect`]) for the next local client
//! (loopback TLS or UNIX socket) while clients come in a burst (predictive preconnect, as
//! Envoy's `preconnect_policy` does it).
//!
//! kubectl is a new process each time: every command is a new loopback connection, and the
//! proxy's upstream connection for it costs a TCP connect and a (resumed) TLS handshake — two
//! round trips to the API server before its request can go. A script that runs kubectl in a
//! loop pays them each time. So after an authenticated client's connection, when the client
//! before it came less than [`MAX_AGE`] ago and no spare is held or being made for its
//! protocol, the proxy makes one more upstream connection for that protocol and keeps it: the
//! next client's request goes up at once, on a connection already established.
//!
//! What keeps this safe and cheap:
//! - Made only after an authenticated client's connection, at most one per protocol at a time:
//!   an unauthenticated peer cannot make the proxy connect anywhere.
//! - Never a signature: it claims a session ticket (waiting up to a second for the one the
//!   client connection just made brings back), none while the store counts no tickets (TLS 1.2
//!   sessions, a server that sends none), and its handshake runs with hardware signatures
//!   refused (`key::tls::without_signatures`): a server that wants a full handshake fails the
//!   spare, and no spare is tried for a minute then. Its handshake brings a ticket back (Go's
//!   server sends one per handshake), which it takes in before it is kept; a client that finds
//!   no ticket meanwhile waits for that one rather than lead a full handshake
//!   (`sessions.rs`).
//! - A spare's failure is nobody's: no API server is marked down for it, no other tried.
//! - Used only while fresh (less than [`MAX_AGE`], far below what API servers allow a
//!   connection that has sent nothing yet: Go's HTTP/2 server waits 10 s for the preface,
//!   kube-apiserver 32 s for a request's headers), with the certificate it was made with, and
//!   while the API server has not closed it (`POLLRDHUP`). A certificate installed, a CA bundle
//!   reloaded or the session store emptied drops every spare ([`Spares::retire`]). One found
//!   closed stops spares for that protocol for a minute (a balancer closing idle connections
//!   sooner than [`MAX_AGE`] would otherwise get two connections per client).
//! - Unused, it is closed with `close_notify` when it ages out: one connection at the end of
//!   a burst is what it costs. `--no-preconnect` turns it off.
//! - Not through an `https://` forward proxy (the outer TLS session's handshake is not one the
//!   spare's refusal covers): the first attempt fails, and spares rest a minute.
//! - A UNIX-socket client's spare is a buffered session (the relay loop's UNIX connections
//!   take one), whose handshake runs with signatures refused at each step the same way.
//!
//! Left: a spare the API server closes after the check and before the client's request (a
//! window of microseconds, or an HTTP/2 GOAWAY, which only HTTP/2 framing shows) ends that
//! client's connection without the 502 and the retry on another API server a fresh connection
//! gets.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::metrics::{Metrics, SpareOutcome};
use super::origin::{ClientKind, Origin, OriginConn};
use super::rotation::CertEpoch;
use crate::egress::Tunnel;

/// How long a spare is kept, and how close together two clients must come for one to be made.
pub const MAX_AGE: Duration = Duration::from_secs(3);
/// The longest a client waits for a spare being made ([`Spares::take`]): as long as
/// that spare may wait for a session ticket to resume with (`sessions::TICKET_WAIT`).
const FILLING_WAIT: Duration = super::sessions::TICKET_WAIT;
/// After a spare was found closed by the API server (or a balancer in front of it, closing
/// connections idle for less than [`MAX_AGE`]), no spare is made for this long.
const QUIET: Duration = Duration::from_secs(60);
/// The most spare sockets open at once: for each kind of client (loopback TLS, UNIX socket)
/// and each protocol it can be given (`h2`, `http/1.1`, none), one held or being made and one
/// being closed. Kept aside by [`super::limits`].
pub const DESCRIPTORS: usize = 12;

/// The spares, one place per kind of client and protocol it was connected with. A spare is made
/// as that kind's own connection would be (an unbuffered session for a loopback TLS client, a
/// buffered one for a UNIX-socket client), so either relays it as its own.
pub struct Spares {
    enabled: AtomicBool,
    places: Mutex<Vec<Place>>,
    serial: AtomicU64,
    /// Counts [`Spares::retire`]: a spare made before the last one is not kept.
    era: AtomicU64,
    /// Told when a spare is taken or dropped ([`Spares::gone`]).
    taken: tokio::sync::Notify,
    /// Told when a spare being made is kept or has failed ([`Spares::take`]).
    ready: tokio::sync::Notify,
    pub(super) metrics: Arc<Metrics>,
}

/// One protocol's place, for one kind of client.
struct Place {
    alpn: Option<Vec<u8>>,
    kind: ClientKind,
    /// When the last client came.
    last_client: Option<Instant>,
    /// Whether the next client is expected soon (the last came soon after the one before, or
    /// took a spare).
    wanted: bool,
    /// A spare is being made.
    filling: bool,
    /// The spare being made has its session ticket and is connecting: a client may wait for it.
    connecting: bool,
    /// A client waits for the spare being made ([`Spares::take`]).
    waiter: bool,
    /// No spare is made before this (one was found closed by the API server).
    quiet_until: Option<Instant>,
    spare: Option<Spare>,
}

struct Spare {
    conn: OriginConn,
    epoch: CertEpoch,
    made: Instant,
    serial: u64,
}

impl Spares {
    /// Spares for a proxy that makes them (`enabled`) or not.
    pub fn new(enabled: bool, metrics: Arc<Metrics>) -> Spares {
        Spares {
            enabled: AtomicBool::new(enabled),
            places: Mutex::new(Vec::new()),
            serial: AtomicU64::new(0),
            era: AtomicU64::new(0),
            taken: tokio::sync::Notify::new(),
            ready: tokio::sync::Notify::new(),
            metrics,
        }
    }

    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// For a `kind` client's upstream connection offering `alpn`, with the certificate
    /// generation `epoch` in use: the spare, if there is one still fit to use. Also notes the
    /// client's arrival, which decides whether a spare is made after it
    /// ([`super::preconnect`]). When no spare is held but one is being made, and no other
    /// client waits for it, waits for it up to [`FILLING_WAIT`]. Its handshake began before this
    /// client came, so it is ready sooner than a connection this client would begin now: with
    /// clients closer together than a spare takes to make, every one finds its connection made
    /// ahead instead of every other one. Only one client waits for a spare: the others of a
    /// burst connect at once, not after a spare that only one of them can have.
    pub async fn take(
        &self,
        alpn: Option<&[u8]>,
        kind: ClientKind,
        epoch: CertEpoch,
    ) -> Option<OriginConn> {
        let (found, waiter) = self.arrive((alpn, kind), epoch);
        if found.is_some() || !waiter {
            return found;
        }
        let _waiter = Waiter {
            spares: self,
            place: (alpn, kind),
        };
        let deadline = tokio::time::Instant::now() + FILLING_WAIT;
        loop {
            let ready = self.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            {
                let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
                let place = place_for(&mut places, alpn, kind);
                if let Some(found) = place.spare.take() {
                    return self.use_found(place, found, epoch);
                }
                if !place.filling {
                    return None;
                }
            }
            if tokio::time::timeout_at(deadline, ready).await.is_err() {
                return None;
            }
        }
    }

    /// Notes a client's arrival at `place` and takes the spare held there. When none is held
    /// but one is being made and nobody waits for it yet, the client becomes its waiter (the
    /// second value).
    fn arrive(
        &self,
        (alpn, kind): (Option<&[u8]>, ClientKind),
        epoch: CertEpoch,
    ) -> (Option<OriginConn>, bool) {
        if !self.enabled() {
            return (None, false);
        }
        let now = Instant::now();
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        let recent = place
            .last_client
            .is_some_and(|t| now.duration_since(t) < MAX_AGE);
        place.last_client = Some(now);
        place.wanted = recent;
        match place.spare.take() {
            Some(found) => (self.use_found(place, found, epoch), false),
            None => {
                let waits = place.filling && place.connecting && !place.waiter;
                place.waiter |= waits;
                (None, waits)
            }
        }
    }

    /// The spare `found` (just taken from `place`) for a client, if it is still fit to use:
    /// open, made with the certificate of `epoch`, and fresh. Dropped otherwise.
    fn use_found(&self, place: &mut Place, found: Spare, epoch: CertEpoch) -> Option<OriginConn> {
        let now = Instant::now();
        self.taken.notify_waiters();
        if !open(&found.conn) {
            // Closed by the API server, or a balancer: spares would only cost it connections.
            place.quiet_until = Some(now + QUIET);
            place.wanted = false;
        } else if found.epoch == epoch && now.duration_since(found.made) < MAX_AGE {
            place.wanted = true;
            self.metrics.spare(SpareOutcome::Used);
            return Some(found.conn);
        }
        // Closed, too old, or made with a retired certificate: dropped.
        self.metrics.spare(SpareOutcome::Dropped);
        None
    }

    /// Drops every spare held, and any being made: the certificate or the trust they were
    /// made with is no longer in use, or the session store was emptied.
    pub fn retire(&self) {
        self.era.fetch_add(1, Ordering::SeqCst);
        let dropped: Vec<Spare> = {
            let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
            places.iter_mut().filter_map(|p| p.spare.take()).collect()
        };
        self.taken.notify_waiters();
        for _ in &dropped {
            self.metrics.spare(SpareOutcome::Dropped);
        }
    }

    /// The current era, for [`Spares::put`].
    pub(super) fn era(&self) -> u64 {
        self.era.load(Ordering::SeqCst)
    }

    /// Whether to make a spare for `alpn` now; if so, the place is marked as filling.
    pub(super) fn begin(&self, alpn: Option<&[u8]>, kind: ClientKind) -> bool {
        if !self.enabled() {
            return false;
        }
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        let quiet = place.quiet_until.is_some_and(|t| Instant::now() < t);
        let go = place.wanted && !quiet && !place.filling && place.spare.is_none();
        place.filling |= go;
        go
    }

    /// The spare being made for `alpn` has claimed its session ticket and is connecting (an
    /// API server's round trips from being ready): a client that comes now waits for it
    /// rather than begin a connection of its own. One still waiting for a ticket may wait up
    /// to a second for it, and a client does not wait that long.
    pub(super) fn connecting(&self, alpn: Option<&[u8]>, kind: ClientKind) {
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        place.connecting = place.filling;
    }

    /// Keeps `conn`, made with `epoch` in `era`, for the next client; returns its serial
    /// number. None (it is dropped) when spares were retired since it was begun.
    pub(super) fn put(
        &self,
        (alpn, kind): (Option<&[u8]>, ClientKind),
        conn: OriginConn,
        (epoch, era): (CertEpoch, u64),
    ) -> Option<u64> {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        place.filling = false;
        place.connecting = false;
        // Counted under the lock: a client that sees the count finds the spare.
        self.metrics.spare(SpareOutcome::Made);
        if era != self.era() {
            drop(places);
            self.ready.notify_waiters();
            self.metrics.spare(SpareOutcome::Dropped);
            return None;
        }
        place.spare = Some(Spare {
            conn,
            epoch,
            made: Instant::now(),
            serial,
        });
        drop(places);
        self.ready.notify_waiters();
        Some(serial)
    }

    /// A spare could not be made: with `quiet`, none is tried for a while (it failed in a way
    /// that would repeat); with `off`, none will be made again.
    pub(super) fn failed(
        &self,
        (alpn, kind): (Option<&[u8]>, ClientKind),
        (quiet, off): (bool, bool),
    ) {
        if off {
            self.enabled.store(false, Ordering::Relaxed);
        }
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        place.filling = false;
        place.connecting = false;
        if quiet {
            place.quiet_until = Some(Instant::now() + QUIET);
        }
        drop(places);
        self.ready.notify_waiters();
    }

    /// Returns once the spare numbered `serial` is held no more (taken or dropped).
    pub(super) async fn gone(&self, serial: u64) {
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            taken.as_mut().enable();
            let held = {
                let places = self.places.lock().unwrap_or_else(|p| p.into_inner());
                places
                    .iter()
                    .any(|p| p.spare.as_ref().is_some_and(|s| s.serial == serial))
            };
            if !held {
                return;
            }
            taken.await;
        }
    }

    /// The spare numbered `serial`, if nobody took it.
    pub(super) fn expire(
        &self,
        (alpn, kind): (Option<&[u8]>, ClientKind),
        serial: u64,
    ) -> Option<OriginConn> {
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        match &place.spare {
            Some(s) if s.serial == serial => place.spare.take().map(|s| s.conn),
            _ => None,
        }
    }
}

/// The client waiting for a spare being made, at its place; it waits no more once dropped
/// (served, or gone itself).
struct Waiter<'a> {
    spares: &'a Spares,
    place: (Option<&'a [u8]>, ClientKind),
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut places = self.spares.places.lock().unwrap_or_else(|p| p.into_inner());
        place_for(&mut places, self.place.0, self.place.1).waiter = false;
    }
}

/// The place for `alpn` (a client's protocol is one the proxy chose: a handful at most).
fn place_for<'a>(
    places: &'a mut Vec<Place>,
    alpn: Option<&[u8]>,
    kind: ClientKind,
) -> &'a mut Place {
    let i = match places
        .iter()
        .position(|p| p.alpn.as_deref() == alpn && p.kind == kind)
    {
        Some(i) => i,
        None => {
            places.push(Place {
                alpn: alpn.map(<[u8]>::to_vec),
                kind,
                last_client: None,
                wanted: false,
                filling: false,
                connecting: false,
                waiter: false,
                quiet_until: None,
                spare: None,
            });
            places.len() - 1
        }
    };
    &mut places[i]
}

/// Whether the API server has left the connection open: no end of stream, no error.
fn open(conn: &OriginConn) -> bool {
    let fd = match &conn.origin {
        Origin::Lean(lean) => lean.tcp_fd(),
        Origin::Buffered(stream) => match stream.get_ref().0.get_ref() {
            Tunnel::Tcp(tcp) => tcp.as_fd(),
            Tunnel::Tls(_) => return false,
        },
    };
    let mut fds = [PollFd::new(&fd, PollFlags::IN | PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&now)) {
        Ok(_) => !fds[0]
            .revents()
            .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;
    use rustls::client::UnbufferedClientConnection;
    use rustls::pki_types::ServerName;

    const EPOCH: CertEpoch = CertEpoch {
        generation: 1,
        not_after_unix: None,
    };
    const PLACE: (Option<&[u8]>, ClientKind) = (Some(b"http/1.1".as_slice()), ClientKind::Unix);

    /// A connection to keep as a spare: an open TCP connection (its peer returned, to keep it
    /// open) and a session that never handshakes (the store only looks at the socket).
    async fn connection() -> (OriginConn, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (peer, _) = listener.accept().unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let name = ServerName::try_from("localhost").unwrap();
        let session = UnbufferedClientConnection::new(Arc::new(config), name).unwrap();
        let lean = super::super::unbuffered::Lean::new(tcp, session, Vec::new());
        let conn = OriginConn {
            origin: Origin::Lean(Box::new(lean)),
            alpn: None,
            resumed: true,
            sent: 0,
        };
        (conn, peer)
    }

    fn is_waited_for(spares: &Spares) -> bool {
        let mut places = spares.places.lock().unwrap();
        place_for(&mut places, PLACE.0, PLACE.1).waiter
    }

    /// A client that comes while the spare for it is being made waits for that spare and is
    /// served on it; a second client that comes meanwhile does not wait (only one of them
    /// could have it) and is told at once to connect itself; and when the spare being made
    /// fails, its waiter is told at once, not after the longest wait. (The clock is paused: a
    /// waiter that timed out would move it on by the whole wait.)
    #[tokio::test(start_paused = true)]
    async fn one_client_waits_for_the_spare_being_made() {
        let (conn, _peer) = connection().await;
        let spares = Arc::new(Spares::new(true, Arc::new(Metrics::new())));
        for _ in 0..2 {
            assert!(spares.take(PLACE.0, PLACE.1, EPOCH).await.is_none());
        }
        assert!(spares.begin(PLACE.0, PLACE.1), "clients in a burst");
        // Before the spare has its ticket, a client does not wait for it.
        let early = spares.take(PLACE.0, PLACE.1, EPOCH).now_or_never();
        assert!(
            matches!(early, Some(None)),
            "no wait for a spare without a ticket"
        );
        spares.connecting(PLACE.0, PLACE.1);
        let waiter = tokio::spawn({
            let spares = spares.clone();
            async move { spares.take(PLACE.0, PLACE.1, EPOCH).await }
        });
        while !is_waited_for(&spares) {
            tokio::task::yield_now().await;
        }
        let second = spares.take(PLACE.0, PLACE.1, EPOCH).now_or_never();
        assert!(
            matches!(second, Some(None)),
            "a second client connects at once"
        );
        spares.put(PLACE, conn, (EPOCH, spares.era())).unwrap();
        let served = waiter.await.unwrap();
        assert!(served.is_some(), "the waiter is served on the spare");
        let text = spares.metrics.render(0, 0, &[]);
        assert!(
            text.contains("hwkey_upstream_spares_total{event=\"used\"} 1\n"),
            "{text}"
        );
        assert!(!is_waited_for(&spares));

        // The next spare fails: its waiter connects itself at once.
        assert!(spares.begin(PLACE.0, PLACE.1));
        spares.connecting(PLACE.0, PLACE.1);
        let waiter = tokio::spawn({
            let spares = spares.clone();
            async move { spares.take(PLACE.0, PLACE.1, EPOCH).await }
        });
        while !is_waited_for(&spares) {
            tokio::task::yield_now().await;
        }
        let started = tokio::time::Instant::now();
        spares.failed(PLACE, (true, false));
        assert!(waiter.await.unwrap().is_none());
        assert_eq!(started.elapsed(), Duration::ZERO, "told at once");
        assert!(!is_waited_for(&spares));
    }

    /// A waiter that gives up (its client went away) leaves the place free for the next one.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_gives_up_leaves_the_place_free() {
        let spares = Arc::new(Spares::new(true, Arc::new(Metrics::new())));
        for _ in 0..2 {
            assert!(spares.take(PLACE.0, PLACE.1, EPOCH).await.is_none());
        }
        assert!(spares.begin(PLACE.0, PLACE.1));
        spares.connecting(PLACE.0, PLACE.1);
        let mut waiting = Box::pin(spares.take(PLACE.0, PLACE.1, EPOCH));
        assert!((&mut waiting).now_or_never().is_none(), "it waits");
        assert!(is_waited_for(&spares));
        drop(waiting);
        assert!(!is_waited_for(&spares), "no waiter left behind");
    }
}
