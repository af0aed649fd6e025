//! The spare upstream connections, made ahead ([`super::preconnect`]) for the next loopback client while clients come in
//! a burst (predictive preconnect, as Envoy's `preconnect_policy` does it).
//!
//! kubectl is a new process each time: every command is a new loopback connection, and the
//! proxy's upstream connection for it costs a TCP connect and a (resumed) TLS handshake — two
//! round trips to the API server before its request can go. A script that runs kubectl in a
//! loop, or a person running one command after another, pays them each time. So after an
//! authenticated client's connection, when the client before it came less than [`MAX_AGE`]
//! ago, the proxy makes one more upstream connection for the same protocol and keeps it: the
//! next client's request goes up at once, on a connection already established.
//!
//! What keeps this safe and cheap:
//! - A spare is made only after an authenticated client's connection, at most one per protocol
//!   at a time: an unauthenticated peer cannot make the proxy connect anywhere.
//! - Only with a session ticket in hand ([`super::sessions::SessionStore::claim_only`]): the
//!   spare's handshake resumes, and never costs a hardware signature.
//! - It is used only while fresh (less than [`MAX_AGE`], far below what API servers allow a
//!   connection that has sent nothing yet: Go's HTTP/2 server waits 10 s for the preface,
//!   kube-apiserver 32 s for a request's headers), with the certificate it was made with (a
//!   rotation retires it), and while the API server has not closed it (`POLLRDHUP`).
//! - Unused, it is closed with `close_notify` when it ages out: one connection at the end of
//!   a burst is what it costs. `--no-preconnect` turns it off.
//! - Over plain TCP only: through a forward proxy the first spare turns the feature off.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::metrics::{Metrics, SpareOutcome};
use super::origin::{Origin, OriginConn};
use super::rotation::CertEpoch;

/// How long a spare is kept, and how close together two clients must come for one to be made.
pub const MAX_AGE: Duration = Duration::from_secs(5);

/// The spares, one place per protocol a loopback client was connected with.
pub struct Spares {
    enabled: AtomicBool,
    places: Mutex<Vec<Place>>,
    serial: AtomicU64,
    pub(super) metrics: Arc<Metrics>,
}

/// One protocol's place.
struct Place {
    alpn: Option<Vec<u8>>,
    /// When the last client came.
    last_client: Option<Instant>,
    /// Whether the next client is expected soon (the last came soon after the one before, or
    /// took a spare).
    wanted: bool,
    /// A spare is being made.
    filling: bool,
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
            metrics,
        }
    }

    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// For a loopback client's upstream connection offering `alpn`, with the certificate
    /// generation `epoch` in use: the spare, if there is one still fit to use. Also notes the
    /// client's arrival, which decides whether a spare is made after it
    /// ([`super::preconnect`]).
    pub fn take(&self, alpn: Option<&[u8]>, epoch: CertEpoch) -> Option<OriginConn> {
        if !self.enabled() {
            return None;
        }
        let now = Instant::now();
        let found = {
            let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
            let place = place_for(&mut places, alpn);
            let recent = place
                .last_client
                .is_some_and(|t| now.duration_since(t) < MAX_AGE);
            place.last_client = Some(now);
            let found = place.spare.take();
            place.wanted = recent || found.is_some();
            found
        }?;
        if found.epoch == epoch && now.duration_since(found.made) < MAX_AGE && open(&found.conn) {
            self.metrics.spare(SpareOutcome::Used);
            return Some(found.conn);
        }
        // Closed by the API server, too old, or made with a retired certificate: dropped.
        self.metrics.spare(SpareOutcome::Dropped);
        None
    }

    /// Whether to make a spare for `alpn` now; if so, the place is marked as filling.
    pub(super) fn begin(&self, alpn: Option<&[u8]>) -> bool {
        if !self.enabled() {
            return false;
        }
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn);
        let go = place.wanted && !place.filling && place.spare.is_none();
        place.filling |= go;
        go
    }

    /// Keeps `conn`, made with `epoch`, for the next client; returns its serial number.
    pub(super) fn put(&self, alpn: Option<&[u8]>, conn: OriginConn, epoch: CertEpoch) -> u64 {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn);
        place.filling = false;
        place.spare = Some(Spare {
            conn,
            epoch,
            made: Instant::now(),
            serial,
        });
        serial
    }

    /// A spare could not be made; with `off`, none will be made again.
    pub(super) fn failed(&self, alpn: Option<&[u8]>, off: bool) {
        if off {
            self.enabled.store(false, Ordering::Relaxed);
        }
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        place_for(&mut places, alpn).filling = false;
    }

    /// The spare numbered `serial`, if nobody took it.
    pub(super) fn expire(&self, alpn: Option<&[u8]>, serial: u64) -> Option<OriginConn> {
        let mut places = self.places.lock().unwrap_or_else(|p| p.into_inner());
        let place = place_for(&mut places, alpn);
        match &place.spare {
            Some(s) if s.serial == serial => place.spare.take().map(|s| s.conn),
            _ => None,
        }
    }
}

/// The place for `alpn` (a client's protocol is one the proxy chose: a handful at most).
fn place_for<'a>(places: &'a mut Vec<Place>, alpn: Option<&[u8]>) -> &'a mut Place {
    let i = match places.iter().position(|p| p.alpn.as_deref() == alpn) {
        Some(i) => i,
        None => {
            places.push(Place {
                alpn: alpn.map(<[u8]>::to_vec),
                last_client: None,
                wanted: false,
                filling: false,
                spare: None,
            });
            places.len() - 1
        }
    };
    &mut places[i]
}

/// Whether the API server has left the connection open: no end of stream, no error.
fn open(conn: &OriginConn) -> bool {
    let Origin::Lean(lean) = &conn.origin else {
        return false;
    };
    let fd = lean.tcp_fd();
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
