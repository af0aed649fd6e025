//! The UNIX-socket listener on the relay loops: each loop waits for it in its own epoll
//! (`EPOLLEXCLUSIVE`, so one loop wakes per connection, not all of them), accepts, and opens
//! the connection itself ([`super::opening`]) from its first bytes to its relay.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rustix::event::epoll::{self, EventData, EventFlags};
use rustix::net::SocketFlags;

use super::listening::{token, Listening, MAX_LISTENERS};
use super::opening::{OpenJob, Opened, Opener, Opening};
use super::relayed::Relayed;
use super::{Command, Inbox, Loop, RelayLoops};
use crate::proxy::ratelimit::RateLimited;

/// Connections one wake-up accepts. One: the listener is level-triggered, so the rest are
/// reported again at once, and a client that comes alone costs no accept that finds nothing
/// (one per connection when each wake-up read the queue until it was empty).
const ACCEPTS_PER_WAKE: usize = 1;
/// After a failed accept (out of descriptors, say), the listener rests this long instead of
/// waking the loop for the same failure at once.
const REST_MS: u64 = 100;

static ACCEPT_ERROR_LOG: RateLimited = RateLimited::new(Duration::from_secs(10));

impl RelayLoops {
    /// Every loop accepts the clients of `listener` from now on (each on a copy of its
    /// descriptor, registered in its epoll here) and opens their connections, `opener`
    /// deciding on each, until [`RelayLoops::unlisten`]. An error (no loop accepts; the
    /// caller accepts itself) when a copy cannot be made or registered for every loop.
    pub fn listen(&self, listener: &UnixListener, opener: Arc<dyn Opener>) -> io::Result<()> {
        let i = self.listeners.fetch_add(1, Ordering::Relaxed);
        if i >= MAX_LISTENERS {
            return Err(io::Error::other(
                "more UNIX socket listeners than the relay loops take",
            ));
        }
        let mut added: Vec<(&Arc<Inbox>, UnixListener)> = Vec::new();
        for inbox in &self.loops {
            match register(&inbox.ep, listener, i) {
                Ok(copy) => added.push((inbox, copy)),
                Err(e) => {
                    for (inbox, copy) in &added {
                        let _ = epoll::delete(&inbox.ep, copy);
                    }
                    return Err(e);
                }
            }
        }
        for (inbox, copy) in added {
            let listening = Listening {
                listener: copy,
                opener: opener.clone(),
                resting_until: None,
            };
            inbox.send(Command::Listen(i, Box::new(listening), self.loops.clone()));
        }
        Ok(())
    }

    /// The loops accept no more (the proxy is stopping); connections already accepted go on.
    pub fn unlisten(&self) {
        for inbox in &self.loops {
            inbox.send(Command::Unlisten);
        }
    }
}

/// A copy of `listener`, non-blocking, registered in `ep` as listener `i`: one wake-up per
/// connection among the loops (`EPOLLEXCLUSIVE`), level-triggered (what one wake-up leaves is
/// reported again).
fn register(ep: &OwnedFd, listener: &UnixListener, i: usize) -> io::Result<UnixListener> {
    let copy = listener.try_clone()?;
    copy.set_nonblocking(true)?;
    let interest = EventFlags::IN | EventFlags::EXCLUSIVE;
    epoll::add(ep, &copy, EventData::new_u64(token(i)), interest)?;
    Ok(copy)
}

impl Loop {
    /// Keeps listener `i` (registered already) and every loop's inbox.
    pub(super) fn listen(&mut self, i: usize, listening: Box<Listening>, loops: Vec<Arc<Inbox>>) {
        if self.listening.len() <= i {
            self.listening.resize_with(i + 1, || None);
        }
        self.listening[i] = Some(listening);
        self.loops = loops;
    }

    /// Accepts no more clients.
    pub(super) fn unlisten(&mut self) {
        for l in std::mem::take(&mut self.listening).into_iter().flatten() {
            if l.resting_until.is_none() {
                let _ = epoll::delete(&self.ep, &l.listener);
            }
        }
        self.loops.clear();
    }

    /// Accepts what listener `i` has (at most [`ACCEPTS_PER_WAKE`]), each client admitted or
    /// refused by the opener and, admitted, opened on this loop.
    pub(super) fn accept(&mut self, i: usize, now: u64) {
        let Some(opener) = self.listener(i).map(|l| l.opener.clone()) else {
            return;
        };
        for _ in 0..ACCEPTS_PER_WAKE {
            let Some(l) = self.listener(i) else {
                return;
            };
            let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
            match rustix::net::accept_with(&l.listener, flags) {
                Ok(fd) => {
                    let client = UnixStream::from(fd);
                    // A bug in the proxy's decision loses this client, not the loop.
                    let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        opener.admit(client)
                    }));
                    if let Ok(Some((client, job))) = admitted {
                        self.open(client, job, now);
                    }
                }
                Err(rustix::io::Errno::AGAIN) => return,
                Err(rustix::io::Errno::INTR | rustix::io::Errno::CONNABORTED) => {}
                Err(e) => return self.rest(i, e, now),
            }
        }
    }

    fn listener(&self, i: usize) -> Option<&Listening> {
        self.listening.get(i)?.as_deref()
    }

    /// After a failed accept: listener `i` out of the epoll for [`REST_MS`].
    fn rest(&mut self, i: usize, e: rustix::io::Errno, now: u64) {
        if let Some(suppressed) = ACCEPT_ERROR_LOG.allow() {
            tracing::warn!(listener = "unix", error = %e, suppressed, "accept failed");
        }
        let Some(Some(l)) = self.listening.get_mut(i) else {
            return;
        };
        if l.resting_until.is_none() {
            let _ = epoll::delete(&self.ep, &l.listener);
        }
        let at = now.saturating_add(REST_MS);
        l.resting_until = Some(at);
        self.next_check = Some(self.next_check.map_or(at, |n| n.min(at)));
    }

    /// The resting listeners whose rest is over are waited for again.
    pub(super) fn wake_listeners(&mut self, now: u64) {
        for i in 0..self.listening.len() {
            let Some(Some(l)) = self.listening.get_mut(i) else {
                continue;
            };
            match l.resting_until {
                Some(at) if at <= now => {
                    l.resting_until = None;
                    let interest = EventFlags::IN | EventFlags::EXCLUSIVE;
                    let token = EventData::new_u64(token(i));
                    if let Err(e) = epoll::add(&self.ep, &l.listener, token, interest) {
                        self.rest(i, e, now);
                    }
                }
                Some(at) => self.next_check = Some(self.next_check.map_or(at, |n| n.min(at))),
                None => {}
            }
        }
    }

    /// An admitted client's connection, opened in a slot of this loop: its first read at once.
    fn open(&mut self, client: UnixStream, job: Box<dyn OpenJob>, now: u64) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        self.inbox
            .load
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let opening = Opening::new(client, job, now);
        self.conns[slot] = Some(Relayed::Opening(Box::new(opening)));
        self.open_turn(slot, now);
    }

    /// An opening connection's turn: it waits (with its deadline kept), becomes a relayed
    /// connection (and takes its first turn as one), or goes to a connection thread.
    pub(super) fn open_turn(&mut self, slot: usize, now: u64) {
        let Some(Some(Relayed::Opening(opening))) = self.conns.get_mut(slot) else {
            return;
        };
        let (ep, records) = (&self.ep, &mut self.scratch.records[..]);
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            opening.drive(ep, slot, records, now)
        }))
        .unwrap_or_else(|_| {
            Err(io::Error::other(
                "the relay loop failed on this connection (a bug, logged above); closed",
            ))
        });
        match step {
            Ok(Opened::Waiting) => {
                self.schedule(slot, now);
            }
            Ok(Opened::Ready) => self.opened(slot, now),
            Ok(Opened::ToTask) => {
                if let Some(Relayed::Opening(opening)) = self.release(slot) {
                    hand_over(*opening, &self.ep);
                }
            }
            Err(e) => self.end(slot, Err(e)),
        }
    }

    /// The opening connection at `slot` is established: relayed from now on; then the spare
    /// its job wants for the next client is begun on this loop, after the client's first turn.
    fn opened(&mut self, slot: usize, now: u64) {
        let Some(Some(Relayed::Opening(opening))) = self.conns.get_mut(slot) else {
            return;
        };
        let spare = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| opening.spare()));
        self.relay_opened(slot, now);
        let Ok(Some(make)) = spare else {
            return;
        };
        if let Ok(Some(dial)) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(make)) {
            self.fill(dial, now);
        }
    }

    /// [`Loop::opened`]'s relay: the connection moves to a lighter loop, or takes its first
    /// turn here.
    fn relay_opened(&mut self, slot: usize, now: u64) {
        let Some(held) = self.conns.get_mut(slot) else {
            return;
        };
        let Some(Relayed::Opening(_)) = held else {
            return;
        };
        let Some(Relayed::Opening(opening)) = held.take() else {
            return;
        };
        let ep = &self.ep;
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            opening.into_conn(ep, slot, now)
        }));
        let Ok(made) = made else {
            // A bug in the proxy's part (logged above): this connection is lost, its slot
            // given back; the loop goes on.
            self.free.push(slot);
            self.inbox.load.fetch_sub(1, Ordering::Relaxed);
            return;
        };
        match made {
            Ok((conn, registered)) => {
                self.conns[slot] = Some(Relayed::Unix(Box::new(conn)));
                match registered {
                    Ok(()) => {
                        if let Some(to) = self.lighter() {
                            return self.move_to(slot, &to);
                        }
                        if self.schedule(slot, now) {
                            self.turn(slot, now);
                        }
                    }
                    Err(e) => self.end(slot, Err(e)),
                }
            }
            Err(opening) => {
                self.conns[slot] = Some(Relayed::Opening(opening));
                if let Some(Relayed::Opening(opening)) = self.release(slot) {
                    hand_over(*opening, &self.ep);
                }
            }
        }
    }

    /// A loop with at least two connections fewer than this one (its new connection counted),
    /// which an established connection moves to: the loop woken for the listener is the first
    /// idle one in the kernel's order, so connections made while the proxy is idle (kubelet's,
    /// a client's pool) would otherwise all be relayed by one loop on one core. A connection
    /// moves only when the loads differ by two or more: one client after another stays where
    /// it was accepted, with no crossing.
    fn lighter(&self) -> Option<Arc<Inbox>> {
        if self.loops.is_empty() {
            return None;
        }
        let ours = self.inbox.load.load(std::sync::atomic::Ordering::Relaxed);
        self.loops
            .iter()
            .filter(|other| !Arc::ptr_eq(other, &self.inbox) && !other.stopped())
            .min_by_key(|other| other.load.load(std::sync::atomic::Ordering::Relaxed))
            .filter(|other| other.load.load(std::sync::atomic::Ordering::Relaxed) + 1 < ours)
            .cloned()
    }

    /// Moves the established connection at `slot` to `to`'s loop: out of this loop's epoll
    /// and table, into that loop's inbox, which registers it and turns it there.
    fn move_to(&mut self, slot: usize, to: &Inbox) {
        let Some(conn) = self.release(slot) else {
            return;
        };
        if let Relayed::Unix(c) = &conn {
            let _ = epoll::delete(&self.ep, &c.client.io);
            let _ = epoll::delete(&self.ep, &c.upstream.io);
        }
        to.load.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        to.send(Command::Add(conn));
    }

    /// Takes the connection out of `slot` without ending it (it goes elsewhere).
    pub(super) fn release(&mut self, slot: usize) -> Option<Relayed> {
        let conn = self.conns.get_mut(slot).and_then(Option::take)?;
        self.free.push(slot);
        self.inbox
            .load
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        Some(conn)
    }
}

/// Hands an opening connection to a connection thread; a bug in the proxy's hand-over loses
/// this connection, not the loop.
fn hand_over(opening: Opening, ep: &OwnedFd) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| opening.hand_over(ep)));
}
