//! An upstream connection a relay loop makes itself: its TCP connect under way and its resumed
//! TLS handshake, moved on as readiness comes, every step with hardware signatures refused. A
//! UNIX-socket client's ([`super::opening`]) and a spare's, made for the next one
//! ([`super::filling`]).

use std::io::{self, Read};
use std::net::TcpStream;

use rustix::event::epoll::EventFlags;
use rustls::ClientConnection;

use super::conn::Side;
use crate::proxy::unbuffered::tls_error;

/// Where an attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The TCP connect.
    Connect,
    /// The TLS handshake.
    Handshake,
    /// Its deadline passed.
    Timeout,
    /// The loop could not make it (its socket could not be registered): nothing was tried.
    Local,
}

/// How an upstream socket is registered: edge-triggered, for both directions and its end.
pub(super) const UPSTREAM_INTEREST: EventFlags = EventFlags::IN
    .union(EventFlags::OUT)
    .union(EventFlags::RDHUP)
    .union(EventFlags::ET);

/// An upstream connection: one under way, or an established one (a spare's).
pub(super) struct Dialed {
    pub(super) up: Side<TcpStream>,
    pub(super) session: Box<ClientConnection>,
    /// Records read from it that the session has not taken (a spare's).
    pub(super) records: Vec<u8>,
    /// How many of the client's first bytes the session took before its handshake.
    pub(super) sent: usize,
    /// A write has gone through: a failure now is the handshake's, not the connect's.
    pub(super) connected: bool,
    /// Its socket is registered with the loop.
    pub(super) registered: bool,
}

impl Dialed {
    /// A connection whose connect was started on `tcp` and whose session has its ClientHello
    /// queued (`registered` with the loop already).
    pub(super) fn started(tcp: TcpStream, session: Box<ClientConnection>, sent: usize) -> Dialed {
        let mut up = Side::new(tcp);
        // On loopback the connect is usually done already: the ClientHello is tried at once.
        up.writable = true;
        Dialed {
            up,
            session,
            records: Vec::new(),
            sent,
            connected: false,
            registered: true,
        }
    }

    /// Moves the handshake on as far as the socket lets it: true once it is done and its last
    /// flight (the `Finished`, and a client's first bytes with it) is written or waits for
    /// room (whatever the proxy then decides, the API server has a whole handshake); false
    /// while it waits for an event. An error says at which stage it failed.
    pub(super) fn step(&mut self, records: &mut [u8]) -> Result<bool, (Stage, io::Error)> {
        loop {
            let mut moved = false;
            if self.session.wants_write() && self.up.writable {
                match self.session.write_tls(&mut self.up.io) {
                    Ok(_) => (self.connected, moved) = (true, true),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.up.writable = false,
                    Err(e) => return Err((self.stage(), e)),
                }
            }
            if self.up.can_read() {
                match self.read(records) {
                    Ok(m) => moved |= m,
                    Err(e) => return Err((Stage::Handshake, e)),
                }
            }
            let flight_left = self.session.wants_write() && self.up.writable;
            if !self.session.is_handshaking() && !flight_left {
                return Ok(true);
            }
            if !moved {
                return Ok(false);
            }
        }
    }

    /// Where a failed write failed: before a write went through, the connect's failure.
    fn stage(&self) -> Stage {
        match self.connected {
            true => Stage::Handshake,
            false => Stage::Connect,
        }
    }

    /// Whether the API server has sent its `close_notify`.
    pub(super) fn peer_closed(&mut self) -> bool {
        let session = &mut self.session;
        crate::key::tls::without_signatures(|| session.process_new_packets())
            .map_or(true, |state| state.peer_has_closed())
    }

    /// One read of the upstream, given to the session whole; true if something moved.
    pub(super) fn read(&mut self, records: &mut [u8]) -> io::Result<bool> {
        let n = match self.up.io.read(records) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the API server closed the connection during the TLS handshake",
                ))
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.up.readable = false;
                return Ok(false);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(true),
            Err(e) => return Err(e),
        };
        if n < records.len() {
            self.up.readable = false;
        }
        let mut bytes = &records[..n];
        while !bytes.is_empty() {
            if self.session.read_tls(&mut bytes)? == 0 {
                return Err(io::Error::other("the TLS session took no bytes"));
            }
            let session = &mut self.session;
            crate::key::tls::without_signatures(|| session.process_new_packets())
                .map_err(tls_error)?;
        }
        Ok(true)
    }
}
