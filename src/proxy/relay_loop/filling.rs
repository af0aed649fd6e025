//! A spare upstream connection made on a relay loop, for the next UNIX-socket client
//! (`proxy::spare`): its connect and resumed handshake run here, as a client's do in
//! [`super::opening`], and the session ticket its API server sends back is taken in; then it
//! leaves the loop's epoll and is kept, for whichever loop's client comes next.
//!
//! Made on a connection thread instead, each spare woke that thread, registered its socket with
//! the thread's runtime and took it out again for the loop that took it: round thirteen
//! measured the UNIX socket's new connections at 1.40–1.53× the floor relay's CPU with spares
//! against 1.04–1.25× without (docs/BENCHMARKS.md).
//!
//! Which API server, whether a spare is wanted, how it counts and where it is kept are the
//! proxy's ([`SpareJob`], made by [`super::OpenJob::spare`]); this module moves bytes. A spare
//! never signs: every step of its handshake runs with hardware signatures refused, and it is
//! begun only with a ticket claimed.

use std::io;
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::event::epoll;
use rustls::ClientConnection;

use super::dialed::{Dialed, Stage, UPSTREAM_INTEREST};
use super::watch::Deadlines;

/// How long a spare waits after its handshake for the session ticket its server sends, when
/// none came with the handshake (Go's server sends it with its `Finished` when resuming;
/// rustls and OpenSSL one round trip later), as the connection thread's spare does.
const TICKET_WAIT: Duration = Duration::from_millis(250);

/// A spare the proxy asks a loop to make: its connect started, its ClientHello queued.
pub struct SpareDial {
    /// The TCP connection, non-blocking, its connect under way.
    pub tcp: TcpStream,
    /// The session, its ClientHello (with the ticket) queued.
    pub session: Box<ClientConnection>,
    /// The attempt's deadline.
    pub within: Duration,
    /// What the proxy decides at its end.
    pub job: Box<dyn SpareJob>,
}

/// What makes a spare's [`SpareDial`] (None: it is made elsewhere, or not at all).
pub type SpareMaker = Box<dyn FnOnce() -> Option<SpareDial> + Send>;

/// A spare made on a loop, established: its socket (non-blocking, in no epoll) and session,
/// with the records read from it that the session has not taken.
pub struct LoopSpare {
    /// The TCP connection to the API server.
    pub tcp: TcpStream,
    /// The TLS session, its handshake done.
    pub session: Box<ClientConnection>,
    /// Records read and not yet given to the session.
    pub records: Vec<u8>,
}

impl LoopSpare {
    /// Closes it as a spare nobody took is closed: a `close_notify` written if the socket
    /// takes it at once (it never waits), then the socket.
    pub fn close(mut self) {
        self.session.send_close_notify();
        let _ = self.session.write_tls(&mut self.tcp);
    }
}

/// What the loop runs when a kept spare is due to age out.
pub type Expiry = Box<dyn FnOnce() + Send>;

/// The proxy's decisions on a spare a loop makes.
pub trait SpareJob: Send {
    /// Its handshake is done: false when the proxy refuses it (the protocol the API server
    /// chose); it is then closed.
    fn established(&mut self, session: &ClientConnection) -> bool;
    /// It failed at `stage` (its deadline passed: [`Stage::Timeout`]) or the loop stopped.
    fn failed(self: Box<Self>, stage: Stage, error: io::Error);
    /// It is ready: kept for the next client. What to run, and after how long, to close it
    /// if nobody took it by then (None: it was not kept).
    fn keep(self: Box<Self>, spare: LoopSpare) -> Option<(Duration, Expiry)>;
}

/// Where a turn left a spare being made.
pub(super) enum Filled {
    /// It waits for an event or its deadline.
    Waiting,
    /// It is established, its ticket taken in (or not come in time): to be kept.
    Ready,
    /// It failed at this stage.
    Failed(Stage, io::Error),
    /// The proxy refused it ([`SpareJob::established`]).
    Refused,
}

/// A spare being made, as the loop's table holds it.
pub(super) struct Filling {
    dial: Dialed,
    job: Box<dyn SpareJob>,
    /// The handshake is done; the ticket is awaited.
    taking_in: bool,
    pub(super) deadlines: Deadlines,
    pub(super) last: u64,
}

impl Filling {
    /// The spare `dial` asks for, registered with `ep` as the upstream of `slot`; None (the
    /// proxy told) when it cannot be registered.
    pub(super) fn start(dial: SpareDial, ep: &OwnedFd, slot: usize, now: u64) -> Option<Filling> {
        let SpareDial {
            tcp,
            session,
            within,
            job,
        } = dial;
        let token = epoll::EventData::new_u64(2 * slot as u64 + 1);
        if let Err(e) = epoll::add(ep, &tcp, token, UPSTREAM_INTEREST) {
            job.failed(Stage::Local, e.into());
            return None;
        }
        Some(Filling {
            dial: Dialed::started(tcp, session, 0),
            job,
            taking_in: false,
            deadlines: Deadlines::within(within, now),
            last: now,
        })
    }

    pub(super) fn mark(&mut self, flags: epoll::EventFlags) {
        self.dial.up.mark(flags);
    }

    /// Moves it on: the handshake, then the ticket (with a deadline of its own).
    pub(super) fn drive(&mut self, records: &mut [u8], now: u64) -> Filled {
        if !self.taking_in {
            match self.dial.step(records) {
                Ok(false) => return Filled::Waiting,
                Ok(true) => {}
                Err((stage, e)) => return Filled::Failed(stage, e),
            }
            if !self.job.established(&self.dial.session) {
                return Filled::Refused;
            }
            self.taking_in = true;
            (self.deadlines, self.last) = (Deadlines::within(TICKET_WAIT, now), now);
        }
        while self.dial.session.tls13_tickets_received() == 0 {
            if !self.dial.up.can_read() {
                return Filled::Waiting;
            }
            match self.dial.read(records) {
                Ok(true) => {}
                Ok(false) => return Filled::Waiting,
                Err(e) => return Filled::Failed(Stage::Handshake, e),
            }
            if self.dial.peer_closed() {
                let closed = io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the API server closed the connection right after the TLS handshake",
                );
                return Filled::Failed(Stage::Handshake, closed);
            }
        }
        Filled::Ready
    }

    /// What its end with `result` (its deadline, the loop's stop) means: a spare that waits
    /// for its ticket is kept without one; any other failed.
    pub(super) fn cut(&self, result: io::Result<()>) -> Filled {
        let error = result
            .err()
            .unwrap_or_else(|| io::ErrorKind::UnexpectedEof.into());
        match (self.taking_in, error.kind()) {
            (true, io::ErrorKind::TimedOut) => Filled::Ready,
            (false, io::ErrorKind::TimedOut) => Filled::Failed(Stage::Timeout, error),
            _ => Filled::Failed(Stage::Local, error),
        }
    }

    /// Takes it out of the loop's epoll and tells the proxy how it ended (`filled`, not
    /// [`Filled::Waiting`]): kept, with what to run when it is due to age out, or closed.
    pub(super) fn end(self, ep: &OwnedFd, filled: Filled) -> Option<(Duration, Expiry)> {
        let _ = epoll::delete(ep, &self.dial.up.io);
        let Dialed {
            up,
            session,
            records,
            ..
        } = self.dial;
        match filled {
            Filled::Ready => self.job.keep(LoopSpare {
                tcp: up.io,
                session,
                records,
            }),
            Filled::Failed(stage, e) => {
                self.job.failed(stage, e);
                None
            }
            Filled::Waiting | Filled::Refused => None,
        }
    }
}
