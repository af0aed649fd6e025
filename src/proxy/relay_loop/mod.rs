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
//! Two kinds of client come here ([`Local`]):
//! - a UNIX-socket client speaks plaintext: what the client writes is sealed into the
//!   upstream's records, and the plaintext rustls opens is written to the client from one
//!   gathering buffer ([`conn`]);
//! - a loopback client (kubectl, kubelet) speaks TLS, which the proxy terminates with its
//!   loopback credential: both TLS sessions sit in the same connection, and what one opens is
//!   sealed straight into the other, from rustls's buffer to rustls's buffer, and what one
//!   read opens goes out together ([`loopback`]).
//!
//! What the connection's task did, it still decides: the task waits (asleep) for the loop's
//! outcome, its idle timeout and the retirement of its certificate, and asks the loop to close
//! the connection when one of the latter comes ([`Relayed::close`]); dropping the task (the
//! proxy's stop) closes it too. Its slot, its `--idle-exit` activity and its metrics stay the
//! task's, as on the runtime's path ([`super::relay`]), which still carries upstreams behind an
//! `https://` forward proxy.
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

mod conn;
mod loopback;
#[cfg(test)]
mod loopback_tests;
mod pair;
#[cfg(test)]
mod tests;

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rustix::event::epoll::{self, EventData, EventFlags};
use tokio::sync::oneshot;

use super::idle::{self, LastActivity};
use conn::{client_interest, Conn, Scratch, Step};
use pair::Link;
pub use pair::{Local, LoopbackStream, LoopbackTls, Outcome, Pair, UpstreamStream};

/// Events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// The token of the loop's waker (commands in its inbox); connections use `2 × slot + side`.
const WAKER: u64 = u64::MAX;

/// Descriptors each loop holds (its epoll and its waker), for the descriptor budget of
/// [`super::limits`].
pub const DESCRIPTORS_PER_LOOP: usize = 2;

/// The relay loops, one thread each.
pub struct RelayLoops {
    loops: Vec<Arc<Inbox>>,
    /// Where the search for the least-loaded loop starts (ties rotate).
    next: AtomicUsize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The connection task's side of a relayed connection: its outcome to wait for, its activity
/// stamp, and closing it (also when dropped before its outcome came).
pub struct Relayed {
    link: Arc<Link>,
    inbox: Arc<Inbox>,
    done: oneshot::Receiver<Outcome>,
    ended: bool,
}

/// A relayed connection's activity stamp.
pub struct Activity(Arc<Link>);

impl Activity {
    /// When the connection last moved a byte.
    pub fn last(&self) -> &LastActivity {
        &self.0.last
    }
}

/// A loop's commands, and the eventfd that wakes it for them.
struct Inbox {
    queue: Mutex<Queue>,
    wake: OwnedFd,
    /// Connections on this loop, for placing the next one.
    load: AtomicUsize,
}

/// The commands not yet run, and whether the loop has stopped (then none is taken: a command
/// sent to a stopped loop is dropped at once, and a connection's task learns it from its
/// outcome's sender going away).
#[derive(Default)]
struct Queue {
    commands: Vec<Command>,
    stopped: bool,
}

enum Command {
    /// A connection made on the task's thread: one allocation there, in the place of the
    /// TLS stream it replaces, rather than one there and another on the loop's.
    Add(Box<Conn>),
    Close(Arc<Link>),
    Stop,
}

impl RelayLoops {
    /// `n` loops (at least one), their threads named `hwkey-proxy-relay`. On an error, the
    /// loops already started are stopped again.
    pub fn start(n: usize) -> io::Result<RelayLoops> {
        let mut made = RelayLoops {
            loops: Vec::new(),
            next: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
        };
        for _ in 0..n.max(1) {
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
            let wake = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )?;
            epoll::add(&ep, &wake, EventData::new_u64(WAKER), EventFlags::IN)?;
            let inbox = Arc::new(Inbox {
                queue: Mutex::new(Queue::default()),
                wake,
                load: AtomicUsize::new(0),
            });
            let mine = inbox.clone();
            let thread = std::thread::Builder::new()
                .name("hwkey-proxy-relay".into())
                .spawn(move || Loop::new(ep, mine).run())?;
            made.loops.push(inbox);
            made.threads_mut().push(thread);
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

    /// Moves `pair` to the running loop with the fewest connections; None (the pair dropped,
    /// so the connection is closed) when no loop runs any more.
    pub fn hand_off(&self, pair: Pair) -> Option<Relayed> {
        let n = self.loops.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let inbox = (0..n)
            .map(|i| &self.loops[(start + i) % n])
            .filter(|l| !l.stopped())
            .min_by_key(|l| l.load.load(Ordering::Relaxed))?
            .clone();
        inbox.load.fetch_add(1, Ordering::Relaxed);
        let link = Arc::new(Link {
            last: LastActivity::default(),
            slot: AtomicUsize::new(usize::MAX),
        });
        let (tx, done) = oneshot::channel();
        inbox.send(Command::Add(Box::new(Conn::new(pair, link.clone(), tx))));
        Some(Relayed {
            link,
            inbox,
            done,
            ended: false,
        })
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

    fn send(&self, command: Command) {
        let was_empty = {
            let mut queue = self.queue();
            if queue.stopped {
                return; // dropped here: an Add's sender with it
            }
            queue.commands.push(command);
            queue.commands.len() == 1
        };
        // The loop drains the whole queue after each wake-up: one wake per batch is enough.
        if was_empty {
            let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        }
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

impl Relayed {
    /// The connection's activity stamp (for the idle timeout), apart from `self` so that it
    /// can be watched while the outcome is awaited.
    pub fn activity(&self) -> Activity {
        Activity(self.link.clone())
    }

    /// Waits until the connection ends by itself (cancel-safe).
    pub async fn ended(&mut self) -> Outcome {
        let outcome = (&mut self.done).await;
        self.ended = true;
        outcome.unwrap_or_else(|_| stopped())
    }

    /// Closes the connection and waits for its outcome.
    pub async fn close(mut self) -> Outcome {
        self.inbox.send(Command::Close(self.link.clone()));
        self.ended().await
    }
}

impl Drop for Relayed {
    fn drop(&mut self) {
        if !self.ended {
            self.inbox.send(Command::Close(self.link.clone()));
        }
    }
}

/// The outcome of a connection whose loop stopped before it answered.
fn stopped() -> Outcome {
    Outcome {
        up: 0,
        down: 0,
        result: Err(io::Error::new(
            io::ErrorKind::Interrupted,
            "the relay loop stopped",
        )),
    }
}

/// One loop's thread state.
struct Loop {
    ep: OwnedFd,
    inbox: Arc<Inbox>,
    /// Boxed: the table holds a pointer per slot, and growing it moves pointers, not
    /// connections (a connection with its rustls state is over a kilobyte).
    conns: Vec<Option<Box<Conn>>>,
    free: Vec<usize>,
    scratch: Scratch,
    /// Connections that used up their turn with bytes still to move.
    again: Vec<usize>,
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
        }
    }

    fn run(mut self) {
        let _closing = Closing(self.inbox.clone());
        let mut events = Vec::with_capacity(EVENTS);
        let no_wait = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            events.clear();
            // Connections left with bytes to move: look for events without sleeping, then
            // give them their next turn.
            let timeout = (!self.again.is_empty()).then_some(&no_wait);
            match epoll::wait(
                &self.ep,
                rustix::buffer::spare_capacity(&mut events),
                timeout,
            ) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "relay loop: epoll_wait failed; its connections are closed");
                    break;
                }
            }
            let now = idle::now_ms();
            let mut commands = false;
            for event in events.drain(..) {
                let token = event.data.u64();
                if token == WAKER {
                    commands = true;
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
            if commands && !self.commands(now) {
                break;
            }
        }
        for slot in 0..self.conns.len() {
            self.end(slot, Err(interrupted("the proxy is stopping")));
        }
    }

    /// A connection's turn: move what can be moved (at most [`ROUNDS_PER_TURN`] rounds),
    /// stamp its activity if bytes moved, end it when both directions are done or it failed.
    fn turn(&mut self, slot: usize, now: u64) {
        let Some(Some(conn)) = self.conns.get_mut(slot) else {
            return;
        };
        let moved = (conn.up, conn.down);
        let step = conn.drive(&self.ep, slot, &mut self.scratch);
        if (conn.up, conn.down) != moved {
            conn.link.last.touch_at(now);
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
                Command::Close(link) => {
                    let slot = link.slot.load(Ordering::Relaxed);
                    let ours = matches!(self.conns.get(slot), Some(Some(c)) if Arc::ptr_eq(&c.link, &link));
                    if ours {
                        self.end(slot, Err(interrupted("closed by the proxy")));
                    }
                }
                Command::Stop => return false,
            }
        }
        true
    }

    fn add(&mut self, mut conn: Box<Conn>, now: u64) {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        conn.link.slot.store(slot, Ordering::Relaxed);
        conn.link.last.touch_at(now);
        // Both sockets have room: the first drive tries to write. Their bytes, if any, are
        // reported by the registration itself (epoll reports a socket that is readable when it
        // is added, edge-triggered or not), so neither is read on the chance: a UNIX client's
        // first read drained its socket, and a read for nothing cost a system call per
        // connection.
        conn.client.readable = false;
        conn.client.writable = true;
        conn.upstream.writable = true;
        let token = 2 * slot as u64;
        let registered = epoll::add(
            &self.ep,
            &conn.client.io,
            EventData::new_u64(token),
            client_interest(false),
        )
        .and_then(|()| {
            epoll::add(
                &self.ep,
                &conn.upstream.io,
                EventData::new_u64(token + 1),
                EventFlags::IN | EventFlags::OUT | EventFlags::RDHUP | EventFlags::ET,
            )
        });
        self.conns[slot] = Some(conn);
        if let Err(e) = registered {
            self.end(slot, Err(e.into()));
            return;
        }
        // Whatever arrived before the hand-off (records, opened plaintext, unsent records)
        // moves now; the sockets' own readiness comes as events.
        self.turn(slot, now);
    }

    /// Removes the connection at `slot` (closing both sockets) and tells its task.
    fn end(&mut self, slot: usize, result: io::Result<()>) {
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::take) else {
            return;
        };
        self.free.push(slot);
        self.inbox.load.fetch_sub(1, Ordering::Relaxed);
        conn.finish(result);
    }
}

fn interrupted(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, why)
}
