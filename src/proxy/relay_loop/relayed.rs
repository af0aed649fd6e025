//! A relayed connection of either kind, as the loop's table holds it: what the loop asks of
//! each (its events, a turn, its activity and deadlines, its registration, its end) goes to a
//! UNIX-socket client's [`Conn`] or a loopback TLS client's [`TlsConn`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::epoll::{self, EventData, EventFlags};

use super::conn::{client_interest, Conn, Scratch, Step};
use super::filling::Filling;
use super::loopback::TlsConn;
use super::opening::Opening;
use super::watch::Deadlines;

/// A relayed connection of either kind: the loop's table holds these.
pub(super) enum Relayed {
    /// A UNIX-socket client's ([`conn`]).
    Unix(Box<Conn>),
    /// A loopback TLS client's ([`loopback`]).
    Tls(Box<TlsConn>),
    /// A UNIX-socket client's the loop accepted, until its upstream connection is
    /// established ([`super::opening`]; the loop turns it with [`super::Loop::open_turn`]).
    Opening(Box<Opening>),
    /// A spare upstream connection being made for the next UNIX-socket client
    /// ([`super::filling`]; the loop turns it with [`super::Loop::fill_turn`]).
    Filling(Box<Filling>),
}

impl Relayed {
    pub(super) fn mark(&mut self, upstream: bool, flags: EventFlags) {
        match self {
            Relayed::Unix(c) => c.mark(upstream, flags),
            Relayed::Tls(c) if upstream => c.upstream.mark(flags),
            Relayed::Tls(c) => c.client.mark(flags),
            Relayed::Opening(o) => o.mark(upstream, flags),
            Relayed::Filling(f) if upstream => f.mark(flags),
            Relayed::Filling(_) => {}
        }
    }

    pub(super) fn drive(
        &mut self,
        ep: &OwnedFd,
        slot: usize,
        scratch: &mut Scratch,
    ) -> io::Result<Step> {
        match self {
            Relayed::Unix(c) => c.drive(ep, slot, scratch),
            Relayed::Tls(c) => c.drive(ep, slot, scratch),
            // Turned by the loop's `open_turn` and `fill_turn`, never here.
            Relayed::Opening(_) | Relayed::Filling(_) => Ok(Step::Waiting),
        }
    }

    /// The plaintext bytes moved each way so far.
    pub(super) fn moved(&self) -> (u64, u64) {
        match self {
            Relayed::Unix(c) => (c.up, c.down),
            Relayed::Tls(c) => (c.up, c.down),
            Relayed::Opening(_) | Relayed::Filling(_) => (0, 0),
        }
    }

    pub(super) fn last(&self) -> u64 {
        match self {
            Relayed::Unix(c) => c.last,
            Relayed::Tls(c) => c.last,
            Relayed::Opening(o) => o.last,
            Relayed::Filling(f) => f.last,
        }
    }

    pub(super) fn last_mut(&mut self) -> &mut u64 {
        match self {
            Relayed::Unix(c) => &mut c.last,
            Relayed::Tls(c) => &mut c.last,
            Relayed::Opening(o) => &mut o.last,
            Relayed::Filling(f) => &mut f.last,
        }
    }

    pub(super) fn deadlines(&self) -> &Deadlines {
        match self {
            Relayed::Unix(c) => &c.deadlines,
            Relayed::Tls(c) => &c.deadlines,
            Relayed::Opening(o) => &o.deadlines,
            Relayed::Filling(f) => &f.deadlines,
        }
    }

    /// Registers both sockets with `ep` (`token` the client's, `token + 1` the upstream's).
    /// Both have room: the first drive tries to write. Their bytes, if any, are reported by
    /// the registration itself (epoll reports a socket that is readable when it is added,
    /// edge-triggered or not), so neither is read on the chance: a UNIX client's first read
    /// drained its socket, and a read for nothing cost a system call per connection.
    pub(super) fn register(&mut self, ep: &OwnedFd, token: u64) -> io::Result<()> {
        let (client, upstream): (BorrowedFd<'_>, BorrowedFd<'_>) = match self {
            Relayed::Unix(c) => {
                c.client.readable = false;
                c.client.writable = true;
                c.upstream.writable = true;
                (c.client.io.as_fd(), c.upstream.io.as_fd())
            }
            Relayed::Tls(c) => {
                c.client.readable = false;
                c.client.writable = true;
                c.upstream.writable = true;
                (c.client.io.as_fd(), c.upstream.io.as_fd())
            }
            // Registers its sockets itself, as they come.
            Relayed::Opening(_) | Relayed::Filling(_) => return Ok(()),
        };
        epoll::add(
            ep,
            client,
            EventData::new_u64(token),
            client_interest(false),
        )?;
        epoll::add(
            ep,
            upstream,
            EventData::new_u64(token + 1),
            super::dialed::UPSTREAM_INTEREST,
        )?;
        Ok(())
    }

    /// Ends it with `result`; `ep` takes an opening connection's client out of the loop's
    /// epoll when it goes to a connection thread.
    pub(super) fn finish(self, ep: &OwnedFd, result: io::Result<()>) {
        match self {
            Relayed::Unix(c) => c.finish(result),
            Relayed::Tls(c) => c.finish(result),
            // Runs the proxy's decisions (the hand-over to a task, the logs): a bug there
            // loses this connection, not the loop.
            Relayed::Opening(o) => {
                let finish = std::panic::AssertUnwindSafe(|| o.finish(ep, result));
                let _ = std::panic::catch_unwind(finish);
            }
            // The loop ends a spare with `Loop::end_filling`, which keeps its expiry.
            Relayed::Filling(f) => {
                let filled = f.cut(result);
                let _ = f.end(ep, filled);
            }
        }
    }
}
