//! One relayed connection's state machine: what its events said of each socket, and the moves
//! they allow in each direction. The UNIX-socket client's moves are here; a loopback TLS
//! client's are in [`super::loopback`].

use std::io::{self, BufRead, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::event::epoll::{self, EventData, EventFlags};
use rustls::{ClientConnection, ConnectionCommon};

use super::pair::{OnEnd, Outcome, Pair};
use super::watch::Deadlines;
use crate::proxy::buffers::Buffer;
use crate::proxy::unbuffered::Out;

/// The most bytes one read takes from the upstream (or a loopback client): four maximum-size
/// TLS records, as the runtime path's read-ahead ([`crate::proxy::readahead::READ_AHEAD`]).
pub(super) const RECORDS: usize = 64 * 1024;
/// Room before a read of [`RECORDS`] for a record not yet whole that a loopback TLS
/// connection kept from its last read (a TLS record is at most 16 KiB and 2 KiB of overhead):
/// a read after it still takes four records' worth, not a quarter less.
pub(super) const PARTIAL: usize = 16 * 1024 + 2048 + 5;
/// The most plaintext gathered for one write to a UNIX-socket client: four records' worth, so
/// a bulk download costs one write per read of the upstream, not one per record.
const OUT: usize = 64 * 1024;
/// The most bytes one read takes from a UNIX-socket client: one maximum-size TLS record's
/// plaintext.
pub(super) const PLAIN: usize = 16 * 1024;
/// Rounds of [`Conn::drive`] one connection gets before the loop serves the others: a busy
/// connection (a bulk transfer that always finds bytes and room) moves at most about 1 MiB per
/// turn, then waits behind every connection ready meanwhile.
pub(super) const ROUNDS_PER_TURN: usize = 16;

/// A loop's buffers, which serve each of its connections in turn.
pub(super) struct Scratch {
    /// Plaintext read from a UNIX-socket client, on its way into rustls (wiped after each use).
    pub(super) plain: Box<[u8]>,
    /// Records read from an upstream or a loopback client, on their way into rustls: a read
    /// of [`RECORDS`] at most, after a record not yet whole ([`PARTIAL`]).
    pub(super) records: Box<[u8]>,
    /// Plaintext opened by rustls, gathered for one write to a UNIX-socket client (wiped after
    /// each use).
    pub(super) out: Box<[u8]>,
    /// Records sealed for one side of a loopback TLS connection from what one read of the
    /// other opened ([`super::loopback`]).
    pub(super) sealed: Out,
    /// Buffers given back by loopback TLS connections whose peer had no room, for `sealed`
    /// to take next (two at most).
    pub(super) spare: Vec<Out>,
}

impl Scratch {
    /// Wipes the plaintext buffers (after a connection's turn that did not end normally, which
    /// skipped their wipe).
    pub(super) fn wipe(&mut self) {
        self.plain.fill(0);
        self.out.fill(0);
    }

    pub(super) fn new() -> Scratch {
        Scratch {
            plain: vec![0u8; PLAIN].into_boxed_slice(),
            records: vec![0u8; PARTIAL + RECORDS].into_boxed_slice(),
            out: vec![0u8; OUT].into_boxed_slice(),
            sealed: Out::with_capacity(RECORDS + 1024),
            spare: Vec::new(),
        }
    }
}

/// The client's registration: readable, and writable while a write waits for room.
pub(super) fn client_interest(writable: bool) -> EventFlags {
    let base = EventFlags::IN | EventFlags::RDHUP | EventFlags::ET;
    if writable {
        base | EventFlags::OUT
    } else {
        base
    }
}

/// A client's registration asks for writability exactly while it has no room (and its write
/// side is not shut); `registered` is what it asks for now, changed here.
pub(super) fn register_client<S: AsFd>(
    ep: &OwnedFd,
    slot: usize,
    client: &Side<S>,
    shut: bool,
    registered: &mut bool,
) -> io::Result<()> {
    let want = !client.writable && !shut;
    if want != *registered {
        epoll::modify(
            ep,
            &client.io,
            EventData::new_u64(2 * slot as u64),
            client_interest(want),
        )?;
        *registered = want;
    }
    Ok(())
}

/// A socket and what its events said of it since the last operation that found it not ready.
pub(super) struct Side<S> {
    pub(super) io: S,
    pub(super) readable: bool,
    /// The peer ended its output (or the socket failed): reads no longer wait.
    pub(super) read_closed: bool,
    pub(super) writable: bool,
}

impl<S> Side<S> {
    pub(super) fn new(io: S) -> Side<S> {
        Side {
            io,
            readable: false,
            read_closed: false,
            writable: false,
        }
    }

    pub(super) fn mark(&mut self, flags: EventFlags) {
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

    pub(super) fn can_read(&self) -> bool {
        self.readable || self.read_closed
    }
}

/// Where a connection's turn left it.
pub(super) enum Step {
    /// Nothing can move until an event.
    Waiting,
    /// Its turn is up with bytes still to move.
    More,
    /// Both directions are done.
    Done,
}

/// How far pending plaintext reached the client.
pub(super) enum Sent {
    /// All of it (or there was none).
    All,
    /// Some of it, then the client had no room.
    Some,
    /// None: the client has no room.
    Blocked,
}

/// One relayed connection.
pub(super) struct Conn {
    pub(super) client: Side<UnixStream>,
    pub(super) upstream: Side<TcpStream>,
    /// The TLS connection to the upstream.
    pub(super) tls: ClientConnection,
    /// Records read from the upstream and not yet given to rustls, kept only while the client
    /// has no room (a counted copy buffer): `held[pos..cap]`.
    pub(super) held: Option<Buffer>,
    pub(super) pos: usize,
    pub(super) cap: usize,
    /// Plaintext for the client that found no room, kept until it has some (a counted copy
    /// buffer): `pending[ppos..pcap]`.
    pending: Option<Buffer>,
    ppos: usize,
    pcap: usize,
    /// The client's registration includes writability.
    client_out: bool,
    /// The client ended its output.
    pub(super) client_eof: bool,
    /// `close_notify` is sent and the upstream's write side shut: the client-to-upstream
    /// direction is done.
    pub(super) upstream_shut: bool,
    /// The upstream saw TCP's end of stream.
    pub(super) upstream_eof: bool,
    /// The client's write side is shut: the upstream-to-client direction is done.
    pub(super) client_shut: bool,
    /// Plaintext bytes read from the client.
    pub(super) up: u64,
    /// Plaintext bytes written to the client.
    pub(super) down: u64,
    /// When a byte last moved ([`crate::proxy::idle::now_ms`]).
    pub(super) last: u64,
    /// When the loop itself ends it.
    pub(super) deadlines: Deadlines,
    /// What the loop does with its outcome, on the loop's thread.
    on_end: Option<OnEnd>,
    /// rustls may hold plaintext (or the upstream's end) not yet gathered: set by each
    /// `process_new_packets`, cleared when a gather finds nothing. A round that has nothing to
    /// send the client then asks rustls nothing: most rounds of a keep-alive request found
    /// the reader empty, and each such poll made and dropped an `io::Error` (about a fifth of
    /// the loop's own samples, docs/BENCHMARKS.md round sixteen).
    unread: bool,
    /// What a turn did, for the tests that count it.
    #[cfg(test)]
    pub(super) counts: Counts,
}

/// Rounds of [`Conn::drive`] and polls of rustls's reader, counted for the tests.
#[cfg(test)]
#[derive(Default, Debug, Clone, Copy)]
pub(super) struct Counts {
    pub(super) rounds: usize,
    pub(super) polls: usize,
}

impl Conn {
    pub(super) fn new(pair: Pair, deadlines: Deadlines, on_end: OnEnd) -> Conn {
        let mut tls = pair.tls;
        // The loop bounds what waits in rustls itself: a side is read only when everything
        // sealed for the other before has gone out.
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
            last: 0,
            deadlines,
            on_end: Some(on_end),
            // The handshake's last flight may have brought application data already.
            unread: true,
            #[cfg(test)]
            counts: Counts::default(),
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

    pub(super) fn mark(&mut self, upstream: bool, flags: EventFlags) {
        if upstream {
            self.upstream.mark(flags);
        } else {
            self.client.mark(flags);
        }
    }

    /// Moves bytes both ways until neither can move or the turn is up.
    pub(super) fn drive(
        &mut self,
        ep: &OwnedFd,
        slot: usize,
        scratch: &mut Scratch,
    ) -> io::Result<Step> {
        let mut step = Step::More;
        for _ in 0..ROUNDS_PER_TURN {
            #[cfg(test)]
            {
                self.counts.rounds += 1;
            }
            let forward = self.forward(scratch)?;
            let backward = self.backward(&mut scratch.records[..RECORDS], &mut scratch.out)?;
            if !(forward || backward) {
                step = Step::Waiting;
                break;
            }
        }
        register_client(
            ep,
            slot,
            &self.client,
            self.client_shut,
            &mut self.client_out,
        )?;
        if self.upstream_shut && self.client_shut {
            step = Step::Done;
        }
        Ok(step)
    }

    /// Client to upstream, one step; true if something moved.
    fn forward(&mut self, scratch: &mut Scratch) -> io::Result<bool> {
        if self.upstream_shut {
            // Done: an alert rustls queues from now on (a TLS 1.2 server's HelloRequest
            // answered with `no_renegotiation`) has no way out, and must not fail the other
            // direction.
            return Ok(false);
        }
        if self.tls.wants_write() {
            return self.write_upstream();
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
        let plain = &mut scratch.plain[..];
        match (&self.client.io).read(plain) {
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
                // Out now, in this round: a request costs one round, not one to seal and
                // another to send.
                self.write_upstream()?;
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

    /// Writes the sealed records rustls holds to the upstream, as far as it has room; true if
    /// some went.
    fn write_upstream(&mut self) -> io::Result<bool> {
        if !self.upstream.writable {
            return Ok(false);
        }
        match self.tls.write_tls(&mut self.upstream.io) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.upstream.writable = false;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Upstream to a UNIX-socket client, one step; true if something moved.
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
    /// them (the rest is held, the plaintext having no room to wait in); true if something
    /// moved.
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
                    settle(&mut *self.tls);
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.upstream.readable = false;
                settle(&mut *self.tls);
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

    pub(super) fn process(&mut self) -> io::Result<()> {
        // Even on an error: the plaintext of the records before a bad one is still gathered.
        self.unread = true;
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
        if !self.unread {
            return Ok(false);
        }
        let mut reader = self.tls.reader();
        while *n < out.len() {
            #[cfg(test)]
            {
                self.counts.polls += 1;
            }
            match reader.fill_buf() {
                Ok([]) => return Ok(true),
                Ok(chunk) => {
                    let k = chunk.len().min(out.len() - *n);
                    out[*n..*n + k].copy_from_slice(&chunk[..k]);
                    reader.consume(k);
                    *n += k;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.unread = false;
                    break;
                }
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

    /// Closes both sockets, then runs what the connection left for its end: its slot is
    /// given back only once its descriptors are.
    pub(super) fn finish(mut self, result: io::Result<()>) {
        let on_end = self.on_end.take();
        let (up, down) = (self.up, self.down);
        drop(self);
        if let Some(on_end) = on_end {
            on_end(Outcome { up, down, result });
        }
    }
}

/// Lets rustls shrink its record buffer once its peer has nothing more for now.
/// rustls gives a buffer grown for a large record back (to 4 KiB) only when a read finds
/// it empty; reading from a socket, that is the read which comes back `WouldBlock`, but
/// the loop hands rustls records from memory and never makes that read. Without this, a
/// connection kept up to 18 KiB after its last download (22 MiB more RSS at 1,000
/// connections that each moved 256 KiB, docs/BENCHMARKS.md).
pub(super) fn settle<D>(tls: &mut ConnectionCommon<D>) {
    /// A reader with nothing to read now.
    struct Drained;
    impl Read for Drained {
        fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            Err(io::ErrorKind::WouldBlock.into())
        }
    }
    let _ = tls.read_tls(&mut Drained);
}
