//! The data path of an established UNIX-socket connection: an event loop per core, with no
//! runtime between the sockets and rustls.
//!
//! A keep-alive request through a tokio task costs the proxy its runtime's work per event
//! (the task's wake-up and poll, the waker, the scheduler's bookkeeping) and the stream layers
//! between the socket and rustls (tokio-rustls, the read-ahead, the copy buffer, the activity
//! counter): 1.5–2 µs per request above a relay that does the same TLS work in a plain event
//! loop (docs/BENCHMARKS.md, "the TLS floor on a thread per core"). Here the connection's two
//! sockets and its rustls client connection move, once the upstream handshake is done and the
//! client's first bytes are forwarded, to one of N threads (N = the cores) that each wait on
//! their own epoll: one `epoll_wait` wakes the loop for every ready connection, a read goes
//! straight into rustls, and the plaintext rustls opens is written to the client from rustls's
//! own buffer (no copy buffer on the way down).
//!
//! What the connection's task did, it still decides: the task waits (asleep) for the loop's
//! outcome, its idle timeout and the retirement of its certificate, and asks the loop to close
//! the connection when one of the latter comes ([`Relayed::close`]); dropping the task (the
//! proxy's stop) closes it too. Its slot, its `--idle-exit` activity and its metrics stay the
//! task's, as on the runtime's path ([`super::relay`]), which still carries loopback-TLS
//! clients and upstreams behind an `https://` forward proxy.
//!
//! The connection's behaviour is [`super::relay`]'s: half-close passes through (a client's end
//! of input sends `close_notify` and shuts the upstream's write side; the upstream's
//! `close_notify` shuts the client's write side), the first error ends both sides, and bytes
//! wait in flight only as far as the slower side lets them: a direction whose writer has no
//! room stops reading. A connection holds copy buffers (counted in `hwkey_copy_buffers`: the
//! plaintext its client has no room for, and the records read with it) only while its client
//! has no room for what the upstream sent; otherwise the loop's own two
//! buffers serve all its connections, one event at a time.
//!
//! Sockets are registered edge-triggered, and readiness is tracked here: a read that returns
//! less than it asked for has drained the socket, so the next read waits for the next edge
//! (as tokio does). The client's socket is registered for writability only while a write waits
//! for room, for the reason [`super::unix_client`] gives (a UNIX socket signals "writable"
//! each time its peer reads).

use std::io::{self, BufRead, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rustix::event::epoll::{self, EventData, EventFlags};
use rustls::ClientConnection;
use tokio::sync::oneshot;

use super::buffers::Buffer;
use super::idle::{self, LastActivity};
use super::readahead::ReadAhead;
use super::unix_client::ClientUnixStream;
use crate::egress::Tunnel;
use tokio_rustls::client::TlsStream;

/// The most bytes one read takes from the upstream: four maximum-size TLS records, as the
/// runtime path's read-ahead ([`super::readahead::READ_AHEAD`]).
const RECORDS: usize = 64 * 1024;
/// The most plaintext gathered for one write to the client: four records' worth, so a bulk
/// download costs one write per read of the upstream, not one per record.
const OUT: usize = 64 * 1024;
/// The most bytes one read takes from the client: one maximum-size TLS record's plaintext.
const PLAIN: usize = 16 * 1024;
/// Events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// Rounds of [`Conn::drive`] one connection gets before the loop serves the others: a busy
/// connection (a bulk transfer that always finds bytes and room) moves at most about 1 MiB per
/// turn, then waits behind every connection ready meanwhile.
const ROUNDS_PER_TURN: usize = 16;
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

/// What moves to a loop: an established connection, its two sockets (non-blocking) and the
/// upstream's TLS state, with the records already read from the upstream that rustls has not
/// taken yet.
pub struct Pair {
    /// The local client.
    pub client: UnixStream,
    /// The TCP connection to the API server.
    pub upstream: TcpStream,
    /// The TLS connection to the API server, handshake done.
    pub tls: ClientConnection,
    /// Bytes read from `upstream` before the hand-off and not yet given to `tls`.
    pub records: Vec<u8>,
}

/// How a relayed connection ended: the bytes it moved each way and the first error (an
/// [`io::ErrorKind::Interrupted`] one when the proxy closed it).
pub struct Outcome {
    /// Bytes read from the client.
    pub up: u64,
    /// Bytes written to the client.
    pub down: u64,
    /// Ok when both sides ended cleanly.
    pub result: io::Result<()>,
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

/// What a connection's loop and its task share.
struct Link {
    last: LastActivity,
    /// The connection's place in its loop, once added.
    slot: AtomicUsize,
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

impl Pair {
    /// Takes an established connection's sockets and TLS state back from the runtime: the
    /// client's socket, the upstream's TCP connection (only a plain one: the caller checks) and
    /// the records its read-ahead holds.
    pub fn from_runtime(
        client: ClientUnixStream,
        upstream: Box<TlsStream<ReadAhead<Tunnel>>>,
    ) -> io::Result<Pair> {
        let (ahead, tls) = (*upstream).into_inner();
        let (tunnel, records) = ahead.into_parts();
        let Tunnel::Tcp(tcp) = tunnel else {
            return Err(io::Error::other(
                "the upstream is not a plain TCP connection",
            ));
        };
        Ok(Pair {
            client: client.into_std()?,
            upstream: tcp.into_std()?,
            tls,
            records,
        })
    }
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

/// A loop's buffers, which serve each of its connections in turn.
struct Scratch {
    /// Plaintext read from a client, on its way into rustls (wiped after each use).
    plain: Box<[u8]>,
    /// Records read from an upstream, on their way into rustls.
    records: Box<[u8]>,
    /// Plaintext opened by rustls, gathered for one write to the client (wiped after each use).
    out: Box<[u8]>,
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
            scratch: Scratch {
                plain: vec![0u8; PLAIN].into_boxed_slice(),
                records: vec![0u8; RECORDS].into_boxed_slice(),
                out: vec![0u8; OUT].into_boxed_slice(),
            },
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
        // Its client may already have bytes, and both sockets room: the first drive tries.
        conn.client.readable = true;
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

/// The client's registration: readable, and writable while a write waits for room.
fn client_interest(writable: bool) -> EventFlags {
    let base = EventFlags::IN | EventFlags::RDHUP | EventFlags::ET;
    if writable {
        base | EventFlags::OUT
    } else {
        base
    }
}

/// A socket and what its events said of it since the last operation that found it not ready.
struct Side<S> {
    io: S,
    readable: bool,
    /// The peer ended its output (or the socket failed): reads no longer wait.
    read_closed: bool,
    writable: bool,
}

impl<S> Side<S> {
    fn new(io: S) -> Side<S> {
        Side {
            io,
            readable: false,
            read_closed: false,
            writable: false,
        }
    }

    fn mark(&mut self, flags: EventFlags) {
        let closed = EventFlags::RDHUP | EventFlags::HUP | EventFlags::ERR;
        if flags.intersects(EventFlags::IN | closed) {
            self.readable = true;
        }
        if flags.intersects(closed) {
            self.read_closed = true;
        }
        if flags.intersects(EventFlags::OUT | EventFlags::HUP | EventFlags::ERR) {
            self.writable = true;
        }
    }

    fn can_read(&self) -> bool {
        self.readable || self.read_closed
    }
}

/// Where a connection's turn left it.
enum Step {
    /// Nothing can move until an event.
    Waiting,
    /// Its turn is up with bytes still to move.
    More,
    /// Both directions are done.
    Done,
}

/// How far pending plaintext reached the client.
enum Sent {
    /// All of it (or there was none).
    All,
    /// Some of it, then the client had no room.
    Some,
    /// None: the client has no room.
    Blocked,
}

/// One relayed connection.
struct Conn {
    client: Side<UnixStream>,
    upstream: Side<TcpStream>,
    tls: ClientConnection,
    /// Records read from the upstream and not yet given to rustls, kept only while the client
    /// has no room (a counted copy buffer): `held[pos..cap]`.
    held: Option<Buffer>,
    pos: usize,
    cap: usize,
    /// Plaintext for the client that found no room, kept until it has some (a counted copy
    /// buffer): `pending[ppos..pcap]`.
    pending: Option<Buffer>,
    ppos: usize,
    pcap: usize,
    /// The client's registration includes writability.
    client_out: bool,
    /// The client ended its output.
    client_eof: bool,
    /// `close_notify` is sent and the upstream's write side shut: the client-to-upstream
    /// direction is done.
    upstream_shut: bool,
    /// The upstream saw TCP's end of stream.
    upstream_eof: bool,
    /// The client's write side is shut: the upstream-to-client direction is done.
    client_shut: bool,
    up: u64,
    down: u64,
    link: Arc<Link>,
    done: Option<oneshot::Sender<Outcome>>,
}

impl Conn {
    fn new(pair: Pair, link: Arc<Link>, done: oneshot::Sender<Outcome>) -> Conn {
        let mut tls = pair.tls;
        // The loop bounds what waits in rustls itself: a client is read only when everything
        // sealed before has gone out.
        tls.set_buffer_limit(None);
        let mut conn = Conn {
            client: Side::new(pair.client),
            upstream: Side::new(pair.upstream),
            tls,
            held: None,
            pos: 0,
            cap: 0,
            pending: None,
            ppos: 0,
            pcap: 0,
            client_out: false,
            client_eof: false,
            upstream_shut: false,
            upstream_eof: false,
            client_shut: false,
            up: 0,
            down: 0,
            link,
            done: Some(done),
        };
        if !pair.records.is_empty() {
            // Usually a session ticket or two: a buffer of their size, not a pooled 64 KiB one
            // taken on the task's thread and given back on the loop's.
            let mut held = Buffer::new(pair.records.len());
            held.bytes_mut().copy_from_slice(&pair.records);
            held.filled(pair.records.len());
            conn.held = Some(held);
            (conn.pos, conn.cap) = (0, pair.records.len());
        }
        conn
    }

    fn mark(&mut self, upstream: bool, flags: EventFlags) {
        if upstream {
            self.upstream.mark(flags);
        } else {
            self.client.mark(flags);
        }
    }

    /// Moves bytes both ways until neither can move or the turn is up.
    fn drive(&mut self, ep: &OwnedFd, slot: usize, scratch: &mut Scratch) -> io::Result<Step> {
        let mut step = Step::More;
        for _ in 0..ROUNDS_PER_TURN {
            let forward = self.forward(&mut scratch.plain)?;
            let backward = self.backward(&mut scratch.records, &mut scratch.out)?;
            if !(forward || backward) {
                step = Step::Waiting;
                break;
            }
        }
        self.register_client(ep, slot)?;
        if self.upstream_shut && self.client_shut {
            step = Step::Done;
        }
        Ok(step)
    }

    /// The client's registration asks for writability exactly while the client has no room.
    fn register_client(&mut self, ep: &OwnedFd, slot: usize) -> io::Result<()> {
        let want = !self.client.writable && !self.client_shut;
        if want != self.client_out {
            epoll::modify(
                ep,
                &self.client.io,
                EventData::new_u64(2 * slot as u64),
                client_interest(want),
            )?;
            self.client_out = want;
        }
        Ok(())
    }

    /// Client to upstream, one step; true if something moved.
    fn forward(&mut self, plain: &mut [u8]) -> io::Result<bool> {
        if self.upstream_shut {
            // Done: an alert rustls queues from now on (a TLS 1.2 server's HelloRequest
            // answered with `no_renegotiation`) has no way out, and must not fail the other
            // direction.
            return Ok(false);
        }
        if self.tls.wants_write() {
            if !self.upstream.writable {
                return Ok(false);
            }
            return match self.tls.write_tls(&mut self.upstream.io) {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.upstream.writable = false;
                    Ok(false)
                }
                Err(e) => Err(e),
            };
        }
        if self.client_eof {
            self.upstream_shut = true;
            return match self.upstream.io.shutdown(Shutdown::Write) {
                Err(e) if e.kind() != io::ErrorKind::NotConnected => Err(e),
                _ => Ok(true),
            };
        }
        if !self.client.can_read() {
            return Ok(false);
        }
        match self.client.io.read(plain) {
            Ok(0) => {
                self.client_eof = true;
                self.tls.send_close_notify();
                Ok(true)
            }
            Ok(n) => {
                if n < plain.len() {
                    self.client.readable = false;
                }
                let sealed = self.tls.writer().write_all(&plain[..n]);
                plain[..n].fill(0);
                sealed?;
                self.up += n as u64;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.client.readable = false;
                Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Upstream to client, one step; true if something moved.
    fn backward(&mut self, records: &mut [u8], out: &mut [u8]) -> io::Result<bool> {
        if self.client_shut {
            return Ok(false);
        }
        match self.flush_pending()? {
            Sent::All => {}
            Sent::Some => return Ok(true),
            Sent::Blocked => return Ok(false),
        }
        if !self.client.writable {
            // Not reached today (a write that finds no room leaves bytes pending); kept so
            // that nothing is read for a client without room.
            return Ok(false);
        }
        let mut n = 0;
        let closed = self.gather(out, &mut n)?;
        if n > 0 {
            let sent = self.send_out(&out[..n]);
            out[..n].fill(0);
            sent?;
            return Ok(true);
        }
        if closed {
            // Nothing after `close_notify` counts.
            self.client_shut = true;
            self.held = None;
            (self.pos, self.cap) = (0, 0);
            return match self.client.io.shutdown(Shutdown::Write) {
                Err(e) if e.kind() != io::ErrorKind::NotConnected => Err(e),
                _ => Ok(true),
            };
        }
        if let Some(held) = self.held.take() {
            if self.pos < self.cap {
                let used = self.open(&held.bytes()[self.pos..self.cap], out)?;
                self.pos += used;
                self.held = Some(held);
                return Ok(used > 0);
            }
            // Drained, and the client took everything: back to the pool.
            drop(held);
        }
        self.read_upstream(records, out)
    }

    /// A fresh read of the upstream's records, opened and delivered as far as the client takes
    /// them (the rest is held); true if something moved.
    fn read_upstream(&mut self, records: &mut [u8], out: &mut [u8]) -> io::Result<bool> {
        if self.upstream_eof || !self.upstream.can_read() {
            return Ok(false);
        }
        match self.upstream.io.read(records) {
            Ok(0) => {
                // TCP's end: rustls tells a clean end (`close_notify` came) from a cut one.
                self.upstream_eof = true;
                self.tls.read_tls(&mut io::empty())?;
                self.process()?;
                Ok(true)
            }
            Ok(n) => {
                if n < records.len() {
                    self.upstream.readable = false;
                }
                let used = self.open(&records[..n], out)?;
                if used < n {
                    self.hold(&records[used..n]);
                } else if !self.upstream.readable {
                    self.settle();
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.upstream.readable = false;
                self.settle();
                Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Gives `bytes` (records) to rustls and writes what they open to the client, `out` at a
    /// time (one write for several records); returns how many bytes rustls took (fewer than
    /// all only when the client has no room, or the upstream ended its side).
    fn open(&mut self, bytes: &[u8], out: &mut [u8]) -> io::Result<usize> {
        let mut rest = bytes;
        let mut n = 0;
        let fed = self.feed(&mut rest, out, &mut n);
        // What opened before an error still goes to the client (the records before a bad one
        // are the upstream's, and rustls keeps their plaintext), and `out` never keeps
        // plaintext past this call.
        if fed.is_err() {
            let _ = self.gather(out, &mut n);
        }
        if n > 0 {
            let sent = self.send_out(&out[..n]);
            out[..n].fill(0);
            if fed.is_ok() {
                sent?;
            }
        }
        fed?;
        Ok(bytes.len() - rest.len())
    }

    /// [`Conn::open`]'s loop: gathers what rustls opened into `out[..*n]`, writing `out` each
    /// time it fills, and gives rustls the next records from `rest`; stops when `rest` is
    /// used, the upstream ended its side, or the client has no room.
    fn feed(&mut self, rest: &mut &[u8], out: &mut [u8], n: &mut usize) -> io::Result<()> {
        loop {
            let closed = self.gather(out, n)?;
            if *n == out.len() {
                let sent = self.send_out(&out[..*n]);
                out[..*n].fill(0);
                *n = 0;
                if !sent? {
                    return Ok(());
                }
                continue;
            }
            if closed || rest.is_empty() {
                return Ok(());
            }
            if self.tls.read_tls(rest)? == 0 {
                return Ok(()); // after `close_notify`, rustls takes nothing more
            }
            self.process()?;
        }
    }

    /// Lets rustls shrink its record buffer once the upstream has nothing more for now.
    /// rustls gives a buffer grown for a large record back (to 4 KiB) only when a read finds
    /// it empty; reading from a socket, that is the read which comes back `WouldBlock`, but
    /// the loop hands rustls records from memory and never makes that read. Without this, a
    /// connection kept up to 18 KiB after its last download (22 MiB more RSS at 1,000
    /// connections that each moved 256 KiB, docs/BENCHMARKS.md).
    fn settle(&mut self) {
        /// A reader with nothing to read now.
        struct Drained;
        impl Read for Drained {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::ErrorKind::WouldBlock.into())
            }
        }
        let _ = self.tls.read_tls(&mut Drained);
    }

    fn process(&mut self) -> io::Result<()> {
        if let Err(e) = self.tls.process_new_packets() {
            // The alert rustls queued, if the socket takes it.
            let _ = self.tls.write_tls(&mut self.upstream.io);
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
        Ok(())
    }

    /// Moves the plaintext rustls holds into `out[*n..]` until `out` is full or nothing is
    /// left; true once the upstream's `close_notify` came and everything before it is taken.
    /// An error (the upstream cut the stream without `close_notify`) comes once what was
    /// gathered is out.
    fn gather(&mut self, out: &mut [u8], n: &mut usize) -> io::Result<bool> {
        let mut reader = self.tls.reader();
        while *n < out.len() {
            match reader.fill_buf() {
                Ok([]) => return Ok(true),
                Ok(chunk) => {
                    let k = chunk.len().min(out.len() - *n);
                    out[*n..*n + k].copy_from_slice(&chunk[..k]);
                    reader.consume(k);
                    *n += k;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) if *n > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Writes `bytes` (gathered plaintext) to the client; what does not fit is kept in the
    /// connection's pending buffer (counted: bytes in flight) until the client has room.
    /// True when all of it went.
    fn send_out(&mut self, bytes: &[u8]) -> io::Result<bool> {
        let mut sent = 0;
        while sent < bytes.len() {
            match (&self.client.io).write(&bytes[sent..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.client.writable = false;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.down += sent as u64;
        let rest = &bytes[sent..];
        if rest.is_empty() {
            return Ok(true);
        }
        let mut pending = Buffer::new(OUT.max(rest.len()));
        pending.bytes_mut()[..rest.len()].copy_from_slice(rest);
        pending.filled(rest.len());
        self.pending = Some(pending);
        (self.ppos, self.pcap) = (0, rest.len());
        Ok(false)
    }

    /// Writes the pending plaintext, if any, to the client.
    fn flush_pending(&mut self) -> io::Result<Sent> {
        let Some(pending) = self.pending.take() else {
            return Ok(Sent::All);
        };
        let mut wrote = false;
        while self.ppos < self.pcap {
            if !self.client.writable {
                self.pending = Some(pending);
                return Ok(if wrote { Sent::Some } else { Sent::Blocked });
            }
            match (&self.client.io).write(&pending.bytes()[self.ppos..self.pcap]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(k) => {
                    self.ppos += k;
                    self.down += k as u64;
                    wrote = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.client.writable = false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Sent::All) // the buffer goes back to the pool
    }

    /// Keeps `rest` (records rustls has not taken) in the connection's own buffer, which it
    /// holds while the client has no room.
    fn hold(&mut self, rest: &[u8]) {
        if self.held.is_some() && self.pos < self.cap {
            // Still holding unopened records: nothing new was read, `rest` is empty.
            return;
        }
        if self.held.as_ref().is_none_or(|h| h.len() < rest.len()) {
            self.held = Some(Buffer::new(RECORDS.max(rest.len())));
        }
        if let Some(held) = self.held.as_mut() {
            held.bytes_mut()[..rest.len()].copy_from_slice(rest);
            held.filled(rest.len());
        }
        self.pos = 0;
        self.cap = rest.len();
    }

    fn finish(mut self, result: io::Result<()>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(Outcome {
                up: self.up,
                down: self.down,
                result,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    use rustls::pki_types::{PrivateKeyDer, ServerName};

    use super::super::buffers::{buffers_in_use, TEST_SERIAL};

    /// A TLS 1.3 server config (self-signed `localhost`) and a client config trusting it.
    fn configs(half_rtt: bool) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = made.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        server.send_half_rtt_data = half_rtt;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    }

    /// A TLS server on a loopback port that runs `script` on its one connection (blocking).
    fn server(
        config: Arc<rustls::ServerConfig>,
        script: impl FnOnce(&mut rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>)
            + Send
            + 'static,
    ) -> (u16, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let thread = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let conn = rustls::ServerConnection::new(config).unwrap();
            let mut stream = rustls::StreamOwned::new(conn, tcp);
            script(&mut stream);
        });
        (port, thread)
    }

    /// Connects to `port`, handshakes (blocking), and returns the pair to hand off with the
    /// test's end of the client's UNIX socket.
    fn connect(port: u16, config: Arc<rustls::ClientConfig>) -> (Pair, UnixStream) {
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = ClientConnection::new(config, name).unwrap();
        while tls.is_handshaking() {
            tls.complete_io(&mut tcp).unwrap();
        }
        tcp.set_nonblocking(true).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs.set_nonblocking(true).unwrap();
        let pair = Pair {
            client: theirs,
            upstream: tcp,
            tls,
            records: Vec::new(),
        };
        (pair, ours)
    }

    /// Reads the server's plaintext until `close_notify`.
    fn read_to_close(
        stream: &mut rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>,
    ) -> Vec<u8> {
        let mut got = Vec::new();
        stream.read_to_end(&mut got).unwrap();
        got
    }

    /// Bytes go both ways; the client's end of input reaches the upstream as `close_notify`
    /// (and the upstream can still answer), and the upstream's reaches the client as the end of
    /// its stream; the outcome counts both ways.
    #[test]
    fn relays_both_ways_and_passes_half_close_on() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(false);
        let (port, upstream) = server(server_config, |s| {
            let got = read_to_close(s);
            s.write_all(format!("got {} bytes", got.len()).as_bytes())
                .unwrap();
            s.write_all(&got[..1000]).unwrap();
            s.conn.send_close_notify();
            s.flush().unwrap();
        });
        let loops = RelayLoops::start(2).unwrap();
        let (pair, mut client) = connect(port, client_config);
        let mut relayed = loops.hand_off(pair).unwrap();
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).unwrap();
        let head = b"got 300000 bytes";
        assert_eq!(&answer[..head.len()], head);
        assert_eq!(&answer[head.len()..], &sent[..1000]);
        let outcome = futures::executor::block_on(relayed.ended());
        outcome.result.unwrap();
        assert_eq!((outcome.up, outcome.down), (300_000, answer.len() as u64));
        upstream.join().unwrap();
        loops.shutdown();
    }

    /// The CPU time (in clock ticks) the relay loops' threads have used.
    fn loop_ticks() -> u64 {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| {
                let dir = t.ok()?.path();
                let name = std::fs::read_to_string(dir.join("comm")).ok()?;
                if !name.starts_with("hwkey-proxy-rel") {
                    return None;
                }
                let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
                let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
                Some(fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?)
            })
            .sum()
    }

    /// A client that reads nothing: the upstream's bytes wait, the connection holds a counted
    /// buffer meanwhile, and the loop sleeps instead of spinning (its threads use next to no
    /// CPU while it waits); once the client reads, every byte arrives in order, and the buffer
    /// goes back.
    #[test]
    fn a_client_without_room_stops_the_upstream_and_gets_everything_later() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(false);
        let data: Vec<u8> = (0..8_000_000u32).map(|i| (i % 253) as u8).collect();
        let expected = data.clone();
        let (port, upstream) = server(server_config, move |s| {
            s.write_all(&data).unwrap();
            s.conn.send_close_notify();
            s.flush().unwrap();
            let _ = read_to_close(s);
        });
        let loops = RelayLoops::start(1).unwrap();
        let (pair, mut client) = connect(port, client_config);
        let mut relayed = loops.hand_off(pair).unwrap();
        let mut waited = 0;
        while buffers_in_use() < 1 {
            std::thread::sleep(Duration::from_millis(10));
            waited += 1;
            assert!(waited < 1000, "no buffer held for a client without room");
        }
        let before = loop_ticks();
        std::thread::sleep(Duration::from_millis(500));
        let spent = loop_ticks() - before;
        assert!(
            spent <= 5,
            "the loop used {spent} ticks in 0.5 s while waiting for the client"
        );
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = client.read(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(
            got == expected,
            "{} bytes arrived, not the 8,000,000 sent in order",
            got.len()
        );
        client.shutdown(Shutdown::Write).unwrap();
        let outcome = futures::executor::block_on(relayed.ended());
        outcome.result.unwrap();
        assert_eq!(outcome.down, 8_000_000);
        assert_eq!(buffers_in_use(), 0);
        upstream.join().unwrap();
        loops.shutdown();
    }

    /// The proxy closing a connection (idle timeout, retired certificate) or dropping its task
    /// ends it: both the client and the upstream see the end.
    #[test]
    fn a_close_or_a_dropped_task_ends_the_connection() {
        let _serial = TEST_SERIAL.blocking_lock();
        let loops = RelayLoops::start(1).unwrap();
        for by_drop in [false, true] {
            let (server_config, client_config) = configs(false);
            let (port, upstream) = server(server_config, |s| {
                let mut rest = Vec::new();
                // The proxy's close is not a clean one: no close_notify, just the end.
                let r = s.read_to_end(&mut rest);
                assert!(r.is_err() || rest.is_empty());
            });
            let (pair, mut client) = connect(port, client_config);
            let relayed = loops.hand_off(pair).unwrap();
            if by_drop {
                drop(relayed);
            } else {
                let outcome = futures::executor::block_on(relayed.close());
                assert_eq!(
                    outcome.result.unwrap_err().kind(),
                    io::ErrorKind::Interrupted
                );
            }
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).unwrap();
            assert!(rest.is_empty());
            upstream.join().unwrap();
        }
        loops.shutdown();
    }

    /// What the upstream sent with the end of the handshake (here 100 KB of half-RTT data, as
    /// an HTTP/2 server's SETTINGS come) can sit in the read-ahead, in rustls's buffers or in
    /// the socket when the connection moves to a loop: all of it reaches the client, in order.
    #[test]
    fn bytes_read_before_the_hand_off_reach_the_client() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(true);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 249) as u8).collect();
        let expected = data.clone();
        let (port, upstream) = server(server_config, move |s| {
            s.conn.set_buffer_limit(None);
            s.conn.writer().write_all(&data).unwrap();
            while s.conn.is_handshaking() || s.conn.wants_write() {
                s.conn.complete_io(&mut s.sock).unwrap();
            }
            s.conn.send_close_notify();
            s.flush().unwrap();
            let _ = read_to_close(s);
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let loops = RelayLoops::start(1).unwrap();
        let (pair, mut client) = runtime.block_on(async {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            let tls = tokio_rustls::TlsConnector::from(client_config)
                .connect(name, ReadAhead::new(Tunnel::Tcp(tcp)))
                .await
                .unwrap();
            // Let the rest of the server's flight arrive before the hand-off.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (ours, theirs) = UnixStream::pair().unwrap();
            let theirs = ClientUnixStream::new(theirs).unwrap();
            (Pair::from_runtime(theirs, Box::new(tls)).unwrap(), ours)
        });
        eprintln!(
            "{} bytes of records were in the read-ahead at the hand-off",
            pair.records.len()
        );
        let mut relayed = loops.hand_off(pair).unwrap();
        let mut got = Vec::new();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let r = client.read_to_end(&mut got);
        assert!(
            r.is_ok() && got == expected,
            "{} bytes arrived, not the 100,000 sent in order ({r:?})",
            got.len()
        );
        client.shutdown(Shutdown::Write).unwrap();
        futures::executor::block_on(relayed.ended()).result.unwrap();
        upstream.join().unwrap();
        loops.shutdown();
    }

    /// A connection's turn ends after [`ROUNDS_PER_TURN`] rounds even with bytes still
    /// waiting, so a connection that always has bytes to move (a bulk upload from a fast
    /// client) leaves its loop to the others between turns. Here the client has sent more than
    /// a turn moves before the turn: the turn ends with `More`, having read less than was
    /// waiting. (Without turns it read until the client had nothing left.) Counted in bytes
    /// and rounds, not timed.
    #[test]
    fn a_turn_ends_after_its_rounds_with_bytes_still_waiting() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(false);
        let (port, upstream) = server(server_config, |s| {
            // The connection is dropped mid-stream: no clean end to wait for.
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got);
        });
        let (pair, mut client) = connect(port, client_config);
        // Room for what is sent before the turn, and for what the turn moves.
        let room = 4 << 20;
        rustix::net::sockopt::set_socket_send_buffer_size(&client, room).unwrap();
        rustix::net::sockopt::set_socket_send_buffer_size(&pair.upstream, room).unwrap();
        client.set_nonblocking(true).unwrap();
        let chunk = vec![1u8; 4096];
        let mut waiting = 0usize;
        while let Ok(n) = client.write(&chunk) {
            waiting += n;
        }
        let a_turn = ROUNDS_PER_TURN * PLAIN;
        assert!(
            waiting > a_turn,
            "only {waiting} bytes fit in the client's socket"
        );
        let (done, _outcome) = oneshot::channel();
        let link = Arc::new(Link {
            last: LastActivity::default(),
            slot: AtomicUsize::new(0),
        });
        let mut conn = Box::new(Conn::new(pair, link, done));
        conn.client.readable = true;
        conn.client.writable = true;
        conn.upstream.writable = true;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        let mut scratch = Scratch {
            plain: vec![0u8; PLAIN].into_boxed_slice(),
            records: vec![0u8; RECORDS].into_boxed_slice(),
            out: vec![0u8; OUT].into_boxed_slice(),
        };
        let step = conn.drive(&ep, 0, &mut scratch).unwrap();
        assert!(
            matches!(step, Step::More),
            "the turn did not end with bytes waiting"
        );
        assert!(
            conn.up > 0 && conn.up <= a_turn as u64 && conn.up < waiting as u64,
            "one turn read {} of the {waiting} bytes waiting (at most {a_turn})",
            conn.up
        );
        drop(conn);
        upstream.join().unwrap();
    }

    /// Once the loops have stopped, a connection handed to them is refused (and closed: its
    /// client sees the end) instead of waiting in a queue nobody reads.
    #[test]
    fn a_stopped_loop_takes_no_connection() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(false);
        let (port, upstream) = server(server_config, |s| {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let loops = RelayLoops::start(2).unwrap();
        loops.shutdown();
        let (pair, mut client) = connect(port, client_config);
        assert!(loops.hand_off(pair).is_none());
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        upstream.join().unwrap();
    }

    /// Records that open before a bad one in the same read reach the client, and then the
    /// connection ends with the error. (The loop gathered their plaintext for one write and
    /// returned on the error with it unsent, and unwiped in its buffer.)
    #[test]
    fn records_before_a_bad_one_reach_the_client_first() {
        let _serial = TEST_SERIAL.blocking_lock();
        let (server_config, client_config) = configs(false);
        let (port, upstream) = server(server_config, |s| {
            while s.conn.is_handshaking() || s.conn.wants_write() {
                s.conn.complete_io(&mut s.sock).unwrap();
            }
            // Two good records and a forged one, in one write: one read of the loop.
            s.conn.writer().write_all(b"hello ").unwrap();
            s.conn.writer().write_all(b"world").unwrap();
            let mut wire = Vec::new();
            while s.conn.wants_write() {
                s.conn.write_tls(&mut wire).unwrap();
            }
            wire.extend_from_slice(&[0x17, 0x03, 0x03, 0x00, 0x20]);
            wire.extend_from_slice(&[0x55; 0x20]);
            s.sock.write_all(&wire).unwrap();
            let mut rest = Vec::new();
            let _ = s.sock.read_to_end(&mut rest);
        });
        let loops = RelayLoops::start(1).unwrap();
        let (pair, mut client) = connect(port, client_config);
        let mut relayed = loops.hand_off(pair).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        let _ = client.read_to_end(&mut got);
        assert_eq!(String::from_utf8_lossy(&got), "hello world");
        let outcome = futures::executor::block_on(relayed.ended());
        assert_eq!(
            outcome.result.unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        upstream.join().unwrap();
        loops.shutdown();
    }
}
