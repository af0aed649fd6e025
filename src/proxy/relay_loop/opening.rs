//! A UNIX-socket client's connection from its accept to its relay, on the loop that accepted
//! it: its first bytes, then its upstream connection (a spare taken as it is, or a TCP connect
//! and a resumed TLS handshake run here), then the relay, in the same slot and with the same
//! registrations.
//!
//! Before, a new connection crossed three threads: the accept loop's runtime accepted it, a
//! connection thread read its first bytes, connected upstream and handed both sockets to a relay
//! loop. Each crossing is a wake-up of another thread (an eventfd write, an `epoll_wait` that
//! returns, a task polled), and round ten's profile put those crossings, tokio and the
//! allocator at about a quarter of the proxy's CPU per connection (docs/BENCHMARKS.md). Here
//! one thread does it all, as the floor relay does.
//!
//! What the proxy decides (who is admitted, which API server, whether a spare is there, the
//! protocol's check, what a failure means) is the [`OpenJob`]'s, made by the [`Opener`] the
//! proxy gave the loops (`proxy::unix_open`); this module only moves bytes and follows
//! readiness. A connection the loop cannot open itself goes to a connection thread with what
//! it has read ([`OpenJob::on_task`]), where it is served as before: no ticket to resume with,
//! an API server that wants a full handshake (the key may then sign, which a loop never waits
//! for: every handshake step here runs with hardware signatures refused), an endpoint that
//! failed (the others are tried there), a protocol refused (the client is told there).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::event::epoll::{self, EventData, EventFlags};
use rustls::ClientConnection;

use super::conn::{client_interest, Conn, Side};
use super::dialed::{Dialed, Stage, UPSTREAM_INTEREST};
use super::filling::SpareMaker;
use super::pair::{OnEnd, Pair};
use super::watch::{Deadlines, Watch};
use crate::proxy::first_bytes::{self, FIRST_READ};

/// What the proxy gives the loops to decide on the UNIX-socket clients they accept.
pub trait Opener: Send + Sync {
    /// A client a loop accepted: its job, or None when the proxy refused it or took it to a
    /// connection thread itself (no connection slot free: it waits for one there).
    fn admit(&self, client: UnixStream) -> Option<(UnixStream, Box<dyn OpenJob>)>;
}

/// One client's connection while it opens: the proxy's decisions at each step.
pub trait OpenJob: Send {
    /// How long the client may take to send its first bytes.
    fn first_bytes_within(&self) -> Duration;
    /// The client's first bytes are in (`prefix`): how its upstream connection is made.
    fn route(&mut self, prefix: &[u8]) -> Route;
    /// The handshake of a [`Route::Dial`] is done: false when the proxy refuses the connection
    /// (the protocol the API server chose); the client is then told on a connection thread.
    fn established(&mut self, session: &ClientConnection) -> bool;
    /// The attempt of a [`Route::Dial`] failed at `stage` before any byte went upstream.
    fn attempt_failed(&mut self, stage: Stage, error: io::Error);
    /// The connection is established: what makes the spare for the next client on this loop,
    /// if one is wanted ([`super::filling`]). Asked before [`OpenJob::relay`]; run after the
    /// connection's first turn (its request goes upstream first), and it may then decline (a
    /// spare that would need a wait is made elsewhere).
    fn spare(&mut self) -> Option<SpareMaker>;
    /// The connection is established: its watch, and what the loop runs at its end. `replayed`
    /// bytes (its first bytes) went upstream before the relay.
    fn relay(self: Box<Self>, replayed: u64) -> (Watch, OnEnd);
    /// The connection goes on on a connection thread, with its first bytes (none read yet
    /// when `prefix` is empty).
    fn on_task(self: Box<Self>, client: UnixStream, prefix: Vec<u8>);
    /// The client left, failed or sent nothing in time (`timed_out`) before its first bytes.
    fn abandoned(self: Box<Self>, timed_out: bool, error: &io::Error);
}

/// How a client's upstream connection is made.
pub enum Route {
    /// On this connection, established already (a spare): its socket, its TLS session, and
    /// records read from it that the session has not taken yet.
    Established(TcpStream, Box<ClientConnection>, Vec<u8>),
    /// On this TCP connection, its connect under way, with this session's handshake, which
    /// must be done `within`; the first bytes go with the proxy's `Finished` when `early`.
    Dial {
        /// The TCP connection, non-blocking.
        tcp: TcpStream,
        /// The session, its ClientHello queued.
        session: Box<ClientConnection>,
        /// Whether the client's first bytes may go before the protocol is checked.
        early: bool,
        /// The attempt's deadline.
        within: Duration,
    },
    /// On a connection thread.
    Task,
}

/// Where a turn left an opening connection.
pub(super) enum Opened {
    /// It waits for an event.
    Waiting,
    /// Its upstream connection is established: it becomes a relayed connection.
    Ready,
    /// It goes to a connection thread.
    ToTask,
}

/// An opening connection, as the loop's table holds it.
pub(super) struct Opening {
    pub(super) client: Side<UnixStream>,
    /// The client's socket is registered with the loop (only once a read found nothing).
    registered: bool,
    prefix: Vec<u8>,
    job: Box<dyn OpenJob>,
    /// Its upstream connection, once routed.
    dial: Option<Dialed>,
    pub(super) deadlines: Deadlines,
    pub(super) last: u64,
}

impl Opening {
    pub(super) fn new(client: UnixStream, job: Box<dyn OpenJob>, now: u64) -> Opening {
        let mut client = Side::new(client);
        // Not registered yet: the first read is tried at once.
        client.readable = true;
        Opening {
            client,
            registered: false,
            prefix: Vec::new(),
            deadlines: Deadlines::within(job.first_bytes_within(), now),
            job,
            dial: None,
            last: now,
        }
    }

    pub(super) fn mark(&mut self, upstream: bool, flags: EventFlags) {
        match (&mut self.dial, upstream) {
            (Some(d), true) => d.up.mark(flags),
            (_, false) => self.client.mark(flags),
            (None, true) => {}
        }
    }

    /// What can move: the first bytes, then the route, then the handshake.
    pub(super) fn drive(
        &mut self,
        ep: &OwnedFd,
        slot: usize,
        records: &mut [u8],
        now: u64,
    ) -> io::Result<Opened> {
        if self.dial.is_none() {
            if !self.first_bytes(ep, slot, records)? {
                return Ok(Opened::Waiting);
            }
            match self.job.route(&self.prefix) {
                Route::Task => return Ok(Opened::ToTask),
                Route::Established(tcp, session, records) => {
                    let mut up = Side::new(tcp);
                    up.writable = true;
                    self.dial = Some(Dialed {
                        up,
                        session,
                        records,
                        sent: 0,
                        connected: true,
                        registered: false,
                    });
                    return Ok(Opened::Ready);
                }
                Route::Dial {
                    tcp,
                    session,
                    early,
                    within,
                } => {
                    if let Err(e) = self.dial(ep, slot, tcp, session, early) {
                        self.job.attempt_failed(Stage::Local, e);
                        return Ok(Opened::ToTask);
                    }
                    (self.deadlines, self.last) = (Deadlines::within(within, now), now);
                }
            }
        }
        self.handshake(records)
    }

    /// Reads the client's first bytes (as [`crate::proxy::first_bytes::sniff`] does): true
    /// once enough are in to tell the HTTP/2 preface from anything else. Registers the client
    /// when a read finds nothing.
    fn first_bytes(&mut self, ep: &OwnedFd, slot: usize, scratch: &mut [u8]) -> io::Result<bool> {
        while self.client.can_read() {
            // Read in the loop's buffer, kept in one of the size that came.
            let room = FIRST_READ
                .saturating_sub(self.prefix.len())
                .min(scratch.len());
            let buf = &mut scratch[..room];
            let n = match (&self.client.io).read(buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            self.prefix.extend_from_slice(&buf[..n]);
            buf[..n].fill(0);
            if n < room {
                self.client.readable = false;
            }
            if first_bytes::decided(&self.prefix) {
                return Ok(true);
            }
        }
        if !self.registered {
            let token = EventData::new_u64(2 * slot as u64);
            epoll::add(ep, &self.client.io, token, client_interest(false))?;
            self.registered = true;
        }
        Ok(false)
    }

    /// Starts the handshake on `tcp`: registered, and the first bytes given to the session
    /// when `early`.
    fn dial(
        &mut self,
        ep: &OwnedFd,
        slot: usize,
        tcp: TcpStream,
        mut session: Box<ClientConnection>,
        early: bool,
    ) -> io::Result<()> {
        let sent = match early {
            // Held by rustls until the handshake is done (a full buffer takes less).
            true => session.writer().write(&self.prefix).unwrap_or(0),
            false => 0,
        };
        let token = EventData::new_u64(2 * slot as u64 + 1);
        epoll::add(ep, &tcp, token, UPSTREAM_INTEREST)?;
        self.dial = Some(Dialed::started(tcp, session, sent));
        Ok(())
    }

    /// Moves the handshake on; every step of it with hardware signatures refused.
    fn handshake(&mut self, records: &mut [u8]) -> io::Result<Opened> {
        let Some(d) = self.dial.as_mut() else {
            return Ok(Opened::ToTask);
        };
        let step = d.step(records);
        match step {
            Ok(false) => Ok(Opened::Waiting),
            Ok(true) if self.job.established(&d.session) => Ok(Opened::Ready),
            Ok(true) => Ok(Opened::ToTask),
            Err((stage, e)) => {
                self.job.attempt_failed(stage, e);
                Ok(Opened::ToTask)
            }
        }
    }

    /// The established connection, relayed from now on in this slot: the upstream's socket
    /// registered if it was not (a spare's), the first bytes the session did not take before
    /// its handshake given to it now, and what each socket's events said carried over. An
    /// error when a socket could not be registered (the connection is then ended); the
    /// opening back when it has no upstream connection.
    pub(super) fn into_conn(
        mut self: Box<Self>,
        ep: &OwnedFd,
        slot: usize,
        now: u64,
    ) -> Result<(Conn, io::Result<()>), Box<Opening>> {
        let Some(d) = self.dial.take() else {
            return Err(self);
        };
        let Opening {
            client,
            registered,
            mut prefix,
            job,
            ..
        } = *self;
        let mut registering = Ok(());
        if !registered {
            let token = EventData::new_u64(2 * slot as u64);
            registering = epoll::add(ep, &client.io, token, client_interest(false));
        }
        if !d.registered {
            let token = EventData::new_u64(2 * slot as u64 + 1);
            registering = registering.and(epoll::add(ep, &d.up.io, token, UPSTREAM_INTEREST));
        }
        let (watch, on_end) = job.relay(prefix.len() as u64);
        let (up, sent) = (d.up, d.sent);
        let pair = Pair {
            client: client.io,
            upstream: up.io,
            tls: *d.session,
            records: d.records,
        };
        let mut conn = Conn::new(pair, Deadlines::new(&watch, now), on_end);
        (conn.client.readable, conn.client.read_closed) = (client.readable, client.read_closed);
        conn.client.writable = true;
        (conn.upstream.readable, conn.upstream.read_closed) = (up.readable, up.read_closed);
        conn.upstream.writable = up.writable;
        conn.last = now;
        let rest = prefix.get(sent..).unwrap_or_default();
        let given = match rest.is_empty() {
            true => Ok(()),
            false => conn.tls.writer().write_all(rest),
        };
        prefix.fill(0);
        Ok((conn, registering.map_err(io::Error::from).and(given)))
    }

    /// The spare its job wants made for the next client ([`OpenJob::spare`]).
    pub(super) fn spare(&mut self) -> Option<SpareMaker> {
        self.job.spare()
    }

    /// Hands the client to a connection thread (out of this loop's epoll first), with what it
    /// sent; an upstream attempt is closed.
    pub(super) fn hand_over(self, ep: &OwnedFd) {
        if self.registered {
            let _ = epoll::delete(ep, self.client.io.as_fd());
        }
        drop(self.dial);
        self.job.on_task(self.client.io, self.prefix);
    }

    /// Ends it with `result` (the loop's cutoff or the proxy's stop): an attempt past its
    /// deadline goes on on a connection thread (another endpoint, or the client told), a
    /// client that sent nothing in time or left is closed.
    pub(super) fn finish(mut self, ep: &OwnedFd, result: io::Result<()>) {
        let error = result
            .err()
            .unwrap_or_else(|| io::ErrorKind::UnexpectedEof.into());
        let timed_out = error.kind() == io::ErrorKind::TimedOut;
        if timed_out && self.dial.is_some() {
            self.job.attempt_failed(Stage::Timeout, error);
            return self.hand_over(ep);
        }
        self.prefix.fill(0);
        self.job.abandoned(timed_out, &error);
    }
}
