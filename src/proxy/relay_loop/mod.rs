//! The data path of an established connection: an event loop per core, with no runtime
//! between the sockets and rustls.
//!
//! A keep-alive request through a tokio task costs the proxy its runtime's work per event
//! (the task's wake-up and poll, the waker, the scheduler's bookkeeping) and the stream layers
//! between the socket and rustls (tokio-rustls, the read-ahead, the copy buffer, the activity
//! counter): 1.5–2 µs per request above a relay that does the same TLS work in a plain event
//! loop (docs/BENCHMARKS.md, "the TLS floor on a thread per core"). Here the connection's two
//! sockets and their TLS state move, once the upstream handshake is done, to one of N threads
//! (N = the cores) that each wait on their own epoll: one `epoll_wait` wakes the loop for every
//! ready connection, and a read goes straight into rustls.
//!
//! Two kinds of client come here:
//! - a UNIX-socket client speaks plaintext: what the client writes is sealed into the
//!   upstream's records, and the plaintext rustls opens is written to the client from one
//!   gathering buffer ([`conn`]);
//! - a loopback client (kubectl, kubelet) speaks TLS, which the proxy terminates with its
//!   loopback credential: both TLS sessions sit in the same connection, on rustls's unbuffered
//!   API; what one read of a socket brings is opened in the loop's record buffer, sealed for
//!   the other side into the loop's out buffer and written at once ([`loopback`]).
//!
//! The loop also ends a connection the way its task would have: at its idle timeout, and when
//! the certificate it was opened with expires or (`--rotation-close immediate`) is replaced
//! ([`watch`]). When a connection ends, the loop runs what its task left for the end ([`OnEnd`]:
//! the bytes for the metrics, its slot and its `--idle-exit` activity given back) on its own
//! thread: a relayed connection has no task, and its end wakes no other thread. The runtime's
//! path ([`super::relay`]) still carries upstreams behind an `https://` forward proxy.
//!
//! The connection's behaviour is [`super::relay`]'s: half-close passes through (a client's end
//! of input sends `close_notify` and shuts the upstream's write side; the upstream's
//! `close_notify` shuts the client's write side, after a `close_notify` of its own to a TLS
//! client), the first error ends both sides (a TLS client that cuts its stream without
//! `close_notify` is one), and bytes wait in flight only as far as the slower side lets them: a
//! direction whose writer has no room stops reading.
//!
//! Sockets are registered edge-triggered, and readiness is tracked here: a read that returns
//! less than it asked for has drained the socket, so the next read waits for the next edge
//! (as tokio does). The client's socket is registered for writability only while a write waits
//! for room, for the reason [`super::unix_client`] gives (a UNIX socket signals "writable"
//! each time its peer reads).

mod accepting;
mod conn;
mod dialed;
mod filling;
mod listening;
mod loopback;
#[cfg(test)]
mod loopback_tests;
mod opening;
mod pair;
mod relayed;
mod spare_turns;
#[cfg(test)]
mod tests;
mod watch;
#[cfg(test)]
mod watch_tests;

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rustix::event::epoll::{self, EventData, EventFlags};

use super::cutoff::{say_retired, Cutoff};
use super::idle;
use conn::{Conn, Scratch, Step};
pub use dialed::Stage;
pub use filling::{Expiry, LoopSpare, SpareDial, SpareJob, SpareMaker};
use listening::Listening;
use loopback::TlsConn;
pub use loopback::TlsPair;
pub use opening::{OpenJob, Opener, Route};
pub use pair::{upstream_parts, OnEnd, Outcome, Pair, UpstreamStream};
use relayed::Relayed;
use watch::Deadlines;
pub use watch::Watch;

/// Events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// The token of the loop's waker (commands in its inbox); connections use `2 × slot + side`.
const WAKER: u64 = u64::MAX;

/// Descriptors each loop holds (its epoll, a copy of it for registering from other threads,
/// and its waker; and a copy of each UNIX socket listener, counted by the caller), for the
/// descriptor budget of [`super::limits`].
pub const DESCRIPTORS_PER_LOOP: usize = 3;

/// The relay loops, one thread each.
pub struct RelayLoops {
    loops: Vec<Arc<Inbox>>,
    /// Where the search for the least-loaded loop starts (ties rotate).
    next: AtomicUsize,
    /// UNIX socket listeners given to the loops ([`RelayLoops::listen`]).
    listeners: AtomicUsize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A loop's commands, and the eventfd that wakes it for them.
struct Inbox {
    queue: Mutex<Queue>,
    wake: OwnedFd,
    /// The loop's epoll (a copy), where another thread registers a listener for it.
    ep: OwnedFd,
    /// Connections on this loop, for placing the next one.
    load: AtomicUsize,
}

/// The commands not yet run, and whether the loop has stopped (then none is taken: a command
/// sent to a stopped loop is dropped at once, an Add's connection closed with it and its
/// [`OnEnd`] dropped unrun, which gives back what it held).
#[derive(Default)]
struct Queue {
    commands: Vec<Command>,
    stopped: bool,
}

enum Command {
    /// A connection made on the task's thread: one allocation there, in the place of the
    /// TLS stream it replaces, rather than one there and another on the loop's.
    Add(Relayed),
    /// The newest certificate generation: connections opened with an older one end if
    /// `--rotation-close immediate`.
    Retire(u64),
    /// Accept the clients of UNIX socket listener `.0` ([`RelayLoops::listen`], registered
    /// already); every loop's inbox, for moving an established connection to a loop with
    /// fewer.
    Listen(usize, Box<Listening>, Vec<Arc<Inbox>>),
    /// Accept no more.
    Unlisten,
    Stop,
}

impl RelayLoops {
    /// `n` loops (at least one), their threads named `hwkey-proxy-relay` and each running when
    /// this returns (a new thread names itself when first scheduled: `top -H` and the tests
    /// missed one). On an error, the loops already started are stopped again.
    pub fn start(n: usize) -> io::Result<RelayLoops> {
        let mut made = RelayLoops {
            loops: Vec::new(),
            next: AtomicUsize::new(0),
            listeners: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
        };
        let (running, started) = std::sync::mpsc::channel::<()>();
        for _ in 0..n.max(1) {
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
            let wake = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )?;
            epoll::add(&ep, &wake, EventData::new_u64(WAKER), EventFlags::IN)?;
            let inbox = Arc::new(Inbox {
                queue: Mutex::new(Queue::default()),
                ep: ep.try_clone()?,
                wake,
                load: AtomicUsize::new(0),
            });
            let mine = inbox.clone();
            let running = running.clone();
            let thread = std::thread::Builder::new()
                .name("hwkey-proxy-relay".into())
                .spawn(move || {
                    let _ = { running }.send(()); // and dropped: see below
                    Loop::new(ep, mine).run()
                })?;
            made.loops.push(inbox);
            made.threads_mut().push(thread);
        }
        drop(running);
        // `recv` fails only once no thread is left that has not said it runs.
        for _ in 0..made.loops.len() {
            if started.recv().is_err() {
                break;
            }
        }
        Ok(made)
    }

    fn threads_mut(&self) -> std::sync::MutexGuard<'_, Vec<JoinHandle<()>>> {
        match self.threads.lock() {
            Ok(t) => t,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// How many loops run.
    pub fn len(&self) -> usize {
        self.loops.len()
    }

    /// Whether there are none (never: [`RelayLoops::start`] makes at least one).
    pub fn is_empty(&self) -> bool {
        self.loops.is_empty()
    }

    /// Moves `pair` (a UNIX-socket client's connection) to the running loop with the fewest
    /// connections, to be relayed until both sides end or `watch` ends it; `on_end` runs with
    /// its outcome on the loop's thread. False (the pair and `on_end` dropped unrun, so the
    /// connection is closed) when no loop runs any more.
    pub fn hand_off(&self, pair: Pair, watch: Watch, on_end: OnEnd) -> bool {
        self.place(&watch, |deadlines| {
            Ok(Relayed::Unix(Box::new(Conn::new(pair, deadlines, on_end))))
        })
        .unwrap_or(false)
    }

    /// [`RelayLoops::hand_off`] for a loopback TLS client's connection; an error when what
    /// was in flight at the hand-off could not be sealed (the connection is closed).
    pub fn hand_off_tls(&self, pair: TlsPair, watch: Watch, on_end: OnEnd) -> io::Result<bool> {
        self.place(&watch, |deadlines| {
            TlsConn::new(pair, deadlines, on_end).map(|c| Relayed::Tls(Box::new(c)))
        })
    }

    fn place(
        &self,
        watch: &Watch,
        make: impl FnOnce(Deadlines) -> io::Result<Relayed>,
    ) -> io::Result<bool> {
        let n = self.loops.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let Some(inbox) = (0..n)
            .map(|i| &self.loops[(start + i) % n])
            .filter(|l| !l.stopped())
            .min_by_key(|l| l.load.load(Ordering::Relaxed))
        else {
            return Ok(false);
        };
        let relayed = make(Deadlines::new(watch, idle::now_ms()))?;
        inbox.load.fetch_add(1, Ordering::Relaxed);
        Ok(inbox.send(Command::Add(relayed)))
    }

    /// Says that certificate generation `newest` is installed: every loop ends, at once, the
    /// connections opened with an older one under `--rotation-close immediate`, and any such
    /// connection handed to it later.
    pub fn retire(&self, newest: u64) {
        for inbox in &self.loops {
            inbox.send(Command::Retire(newest));
        }
    }

    /// Closes every connection still relayed and stops the loops.
    pub fn shutdown(&self) {
        for inbox in &self.loops {
            inbox.send(Command::Stop);
        }
        let threads = std::mem::take(&mut *self.threads_mut());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for RelayLoops {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inbox {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        match self.queue.lock() {
            Ok(q) => q,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn stopped(&self) -> bool {
        self.queue().stopped
    }

    /// Queues `command`; false (the command dropped, an Add's connection closed with it) when
    /// the loop has stopped.
    fn send(&self, command: Command) -> bool {
        let was_empty = {
            let mut queue = self.queue();
            if queue.stopped {
                drop(queue);
                if let Command::Add(_) = command {
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
                return false;
            }
            queue.commands.push(command);
            queue.commands.len() == 1
        };
        // The loop drains the whole queue after each wake-up: one wake per batch is enough.
        if was_empty {
            let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        }
        true
    }

    fn take(&self) -> Vec<Command> {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut buf);
        std::mem::take(&mut self.queue().commands)
    }

    /// Marks the loop stopped and drops what waits for it (also when its thread unwinds).
    fn close(&self) {
        let left = {
            let mut queue = self.queue();
            queue.stopped = true;
            std::mem::take(&mut queue.commands)
        };
        drop(left);
    }
}

/// Closes its loop's inbox when the loop's thread ends, however it ends.
struct Closing(Arc<Inbox>);

impl Drop for Closing {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// One loop's thread state.
struct Loop {
    ep: OwnedFd,
    inbox: Arc<Inbox>,
    /// Boxed: the table holds a pointer per slot, and growing it moves pointers, not
    /// connections (a connection with its rustls state is over a kilobyte).
    conns: Vec<Option<Relayed>>,
    free: Vec<usize>,
    scratch: Scratch,
    /// Connections that used up their turn with bytes still to move.
    again: Vec<usize>,
    /// When to look for connections whose deadline came ([`watch`]; None: no connection has
    /// one).
    next_check: Option<u64>,
    /// The newest certificate generation the loop was told of ([`RelayLoops::retire`]).
    newest: u64,
    /// The UNIX socket listeners, by index, while the loop accepts their clients.
    listening: Vec<Option<Box<Listening>>>,
    /// Every loop's inbox (this one's too), while it accepts.
    loops: Vec<Arc<Inbox>>,
    /// When to close each spare this loop made, if nobody took it by then ([`filling`]).
    expiries: Vec<(u64, Expiry)>,
}

/// However the loop's thread ends (its run returned, or a bug unwound it past the guards around
/// each connection), the spares it made and nobody took are closed: their closes are only in
/// this loop's list, and a spare left open would hold a connection to the API server until a
/// client found it too old.
impl Drop for Loop {
    fn drop(&mut self) {
        self.run_expiries(idle::now_ms(), true);
    }
}

impl Loop {
    fn new(ep: OwnedFd, inbox: Arc<Inbox>) -> Loop {
        Loop {
            ep,
            inbox,
            conns: Vec::new(),
            free: Vec::new(),
            scratch: Scratch::new(),
            again: Vec::new(),
            next_check: None,
            newest: 0,
            listening: Vec::new(),
            loops: Vec::new(),
            expiries: Vec::new(),
        }
    }

    fn run(mut self) {
        let _closing = Closing(self.inbox.clone());
        let mut events = Vec::with_capacity(EVENTS);
        loop {
            events.clear();
            let timeout = self.timeout(idle::now_ms());
            match epoll::wait(
                &self.ep,
                rustix::buffer::spare_capacity(&mut events),
                timeout.as_ref(),
            ) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "relay loop: epoll_wait failed; its connections are closed");
                    break;
                }
            }
            let now = idle::now_ms();
            let (mut commands, mut accepting) = (false, 0u32);
            for event in events.drain(..) {
                let token = event.data.u64();
                if token == WAKER {
                    commands = true;
                    continue;
                }
                if let Some(i) = listening::index(token) {
                    accepting |= 1 << i;
                    continue;
                }
                let slot = usize::try_from(token / 2).unwrap_or(usize::MAX);
                if let Some(Some(conn)) = self.conns.get_mut(slot) {
                    conn.mark(token % 2 == 1, event.flags);
                    self.turn(slot, now);
                }
            }
            for slot in std::mem::take(&mut self.again) {
                self.turn(slot, now);
            }
            for i in (0..listening::MAX_LISTENERS).filter(|i| accepting & (1 << i) != 0) {
                self.accept(i, now);
            }
            if commands && !self.commands(now) {
                break;
            }
            if self.next_check.is_some_and(|at| at <= now) {
                self.check(now);
                self.wake_listeners(now);
            }
        }
        for slot in 0..self.conns.len() {
            self.end(slot, Err(interrupted("the proxy is stopping")));
        }
        // The spares this loop made and the proxy still keeps are closed as `self` drops.
    }

    /// How long `epoll_wait` may sleep: not at all while connections have bytes left to move,
    /// until the next deadline if one is set (at most [`watch::MAX_SLEEP_MS`]), else until an event
    /// comes.
    fn timeout(&self, now: u64) -> Option<rustix::event::Timespec> {
        watch::sleep_for(!self.again.is_empty(), self.next_check, now)
    }

    /// A connection's turn: move what can be moved (at most [`ROUNDS_PER_TURN`] rounds),
    /// stamp its activity if bytes moved, end it when both directions are done or it failed.
    fn turn(&mut self, slot: usize, now: u64) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        match conn {
            Relayed::Opening(_) => return self.open_turn(slot, now),
            Relayed::Filling(_) => return self.fill_turn(slot, now),
            Relayed::Unix(_) | Relayed::Tls(_) => {}
        }
        let moved = conn.moved();
        // A bug that panics on one connection's bytes (rustls's, or the loop's own) ends that
        // connection, not the loop with every connection it holds.
        let ep = &self.ep;
        let scratch = &mut self.scratch;
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            conn.drive(ep, slot, scratch)
        }))
        .unwrap_or_else(|_| {
            self.scratch.wipe();
            Err(io::Error::other(
                "the relay loop failed on this connection (a bug, logged above); closed",
            ))
        });
        if conn.moved() != moved {
            *conn.last_mut() = now;
        }
        match step {
            Ok(Step::Waiting) => {}
            Ok(Step::More) => self.again.push(slot),
            Ok(Step::Done) => self.end(slot, Ok(())),
            Err(e) => self.end(slot, Err(e)),
        }
    }

    /// Runs the inbox's commands; false on `Stop`.
    fn commands(&mut self, now: u64) -> bool {
        for command in self.inbox.take() {
            match command {
                Command::Add(conn) => self.add(conn, now),
                Command::Retire(newest) if newest > self.newest => {
                    self.newest = newest;
                    let due = (0..self.conns.len())
                        .filter(|&slot| {
                            matches!(&self.conns[slot], Some(c) if c.deadlines().retired_by(newest))
                        })
                        .map(|slot| (slot, Cutoff::Retired))
                        .collect();
                    self.cut_off(due);
                }
                Command::Retire(_) => {}
                Command::Listen(i, listening, loops) => self.listen(i, listening, loops),
                Command::Unlisten => self.unlisten(),
                Command::Stop => return false,
            }
        }
        true
    }

    /// Ends the connections whose deadline has come, and sets when to look next.
    fn check(&mut self, now: u64) {
        let mut next: Option<u64> = None;
        let mut due = Vec::new();
        for (slot, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn else {
                continue;
            };
            match conn.deadlines().due(now, conn.last()) {
                Ok(Some(at)) => next = Some(next.map_or(at, |n| n.min(at))),
                Ok(None) => {}
                Err(cut) => due.push((slot, cut)),
            }
        }
        self.cut_off(due);
        if let Some(at) = self.run_expiries(now, false) {
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        self.next_check = next.map(|at| at.max(now.saturating_add(watch::MIN_SCAN_MS)));
    }

    /// Ends the connections `due`, each for its cutoff. The retirements are said first: a
    /// client sees its end as soon as the loop closes it, and a log read then has the line.
    fn cut_off(&mut self, due: Vec<(usize, Cutoff)>) {
        say_retired(due.iter().filter(|(_, c)| *c == Cutoff::Retired).count());
        for (slot, cut) in due {
            self.end(slot, Err(cut.error()));
        }
    }

    fn add(&mut self, mut conn: Relayed, now: u64) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        *conn.last_mut() = now;
        let registered = conn.register(&self.ep, 2 * slot as u64);
        self.conns[slot] = Some(conn);
        if let Err(e) = registered {
            self.end(slot, Err(e));
            return;
        }
        if self.schedule(slot, now) {
            // Whatever arrived before the hand-off (records, opened plaintext, unsent
            // records) moves now; the sockets' own readiness comes as events.
            self.turn(slot, now);
        }
    }

    /// Sets when to look at the connection at `slot` for its deadline, or ends it at once:
    /// opened with a certificate retired before it got here, or already past a deadline.
    /// False when it was ended.
    fn schedule(&mut self, slot: usize, now: u64) -> bool {
        let Some(Some(conn)) = self.conns.get(slot) else {
            return false;
        };
        let due = conn.deadlines().due(now, conn.last());
        let retired = conn.deadlines().retired_by(self.newest);
        match due {
            Err(cut) => self.cut_off(vec![(slot, cut)]),
            _ if retired => self.cut_off(vec![(slot, Cutoff::Retired)]),
            Ok(Some(at)) => {
                let at = at.max(now.saturating_add(watch::MIN_SCAN_MS));
                self.next_check = Some(self.next_check.map_or(at, |n| n.min(at)));
                return true;
            }
            Ok(None) => return true,
        }
        false
    }

    /// Removes the connection at `slot` (closing both sockets) and runs what it left for its
    /// end.
    fn end(&mut self, slot: usize, result: io::Result<()>) {
        if let Some(Some(Relayed::Filling(filling))) = self.conns.get(slot) {
            let filled = filling.cut(result);
            return self.end_filling(slot, filled, idle::now_ms());
        }
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.free.push(slot);
        self.inbox.load.fetch_sub(1, Ordering::Relaxed);
        conn.finish(&self.ep, result);
    }
}

fn interrupted(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, why)
}
