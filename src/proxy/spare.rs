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
//!   take one), whose handshake runs with signatures refused at each step the same way. The
//!   relay loops make it themselves when they can ([`super::loop_spare`]): kept then in no
//!   runtime ([`Origin::Loop`]), for a loop to take; a connection's task leaves it
//!   ([`Spares::take_on_task`]).
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
            metrics,
        }
    }

    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// For a `kind` client's upstream connection offering `alpn`, with the certificate
    /// generation `epoch` in use: the spare, if there is one still fit to use. Also notes the
    /// client's arrival, which decides whether a spare is made after it
    /// ([`super::preconnect`]).
    pub fn take(
        &self,
        alpn: Option<&[u8]>,
        kind: ClientKind,
        epoch: CertEpoch,
    ) -> Option<OriginConn> {
        self.take_where(alpn, kind, epoch, |_| true)
    }

    /// [`Spares::take`] for a connection's task: a spare made on a relay loop, which a loop
    /// relays as it is and a task cannot, is left for the next client a loop opens.
    pub fn take_on_task(
        &self,
        alpn: Option<&[u8]>,
        kind: ClientKind,
        epoch: CertEpoch,
    ) -> Option<OriginConn> {
        self.take_where(alpn, kind, epoch, |origin| {
            !matches!(origin, Origin::Loop(_))
        })
    }

    fn take_where(
        &self,
        alpn: Option<&[u8]>,
        kind: ClientKind,
        epoch: CertEpoch,
        usable: impl Fn(&Origin) -> bool,
    ) -> Option<OriginConn> {
        if !self.enabled() {
            return None;
        }
        let now = Instant::now();
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn, kind);
        let recent = place
            .last_client
            .is_some_and(|t| now.duration_since(t) < MAX_AGE);
        place.last_client = Some(now);
        place.wanted = recent;
        if !place.spare.as_ref().is_some_and(|s| usable(&s.conn.origin)) {
            return None;
        }
        let found = place.spare.take()?;
        self.taken.notify_waiters();
        if !open(&found.conn) {
            // Closed by the API server, or a balancer: spares would only cost it connections.
            place.quiet_until = Some(now + QUIET);
            place.wanted = false;
        } else if found.epoch == epoch && now.duration_since(found.made) < MAX_AGE {
            place.wanted = true;
            drop(places);
            self.metrics.spare(SpareOutcome::Used);
            return Some(found.conn);
        }
        // Closed, too old, or made with a retired certificate: dropped.
        drop(places);
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
        // Counted under the lock: a client that sees the count finds the spare.
        self.metrics.spare(SpareOutcome::Made);
        if era != self.era() {
            drop(places);
            self.metrics.spare(SpareOutcome::Dropped);
            return None;
        }
        place.spare = Some(Spare {
            conn,
            epoch,
            made: Instant::now(),
            serial,
        });
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
        if quiet {
            place.quiet_until = Some(Instant::now() + QUIET);
        }
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
        Origin::Loop(spare) => spare.tcp.as_fd(),
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
