//! A loopback TLS client's moves: the connection holds both TLS sessions, the client's (the
//! proxy terminates it) and the upstream's (the proxy originates it), and what one opens is
//! sealed straight into the other. A record's plaintext goes from one rustls buffer into the
//! other's writer, with no copy buffer between and no stream layer around either, and what one
//! read of a socket opens goes out together (rustls writes its pending records with one
//! `writev` of up to 64 records: one for a read of full-size records, more for a read of many
//! tiny ones, each of which stays a record of its own).
//!
//! What may wait in flight is bounded as on the UNIX-socket path: a side is read only when
//! everything sealed for the other has gone out, so at most one read's records (64 KiB) wait
//! in rustls for a peer without room.

use std::io::{self, BufRead, Read, Write};
use std::net::Shutdown;

use rustls::ConnectionCommon;

use super::conn::{settle, Conn, Sent, Side};
use super::pair::Local;

/// What passing one session's plaintext into the other did.
enum Passed {
    /// Nothing was waiting.
    Nothing,
    /// Plaintext was sealed into the other session.
    Moved,
    /// The session's peer sent `close_notify`, and everything before it has passed.
    Closed,
}

/// Seals the plaintext `from` has opened into `to`, record by record, straight from `from`'s
/// buffer; adds the bytes to `count`. An error is the one `from` reports once its plaintext is
/// all passed (its peer cut the stream without `close_notify`).
fn pass<A, B>(
    from: &mut ConnectionCommon<A>,
    to: &mut ConnectionCommon<B>,
    count: &mut u64,
) -> io::Result<Passed> {
    let mut moved = false;
    let mut reader = from.reader();
    loop {
        match reader.fill_buf() {
            Ok([]) => return Ok(Passed::Closed),
            Ok(chunk) => {
                let k = chunk.len();
                to.writer().write_all(chunk)?;
                reader.consume(k);
                *count += k as u64;
                moved = true;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Ok(if moved {
                    Passed::Moved
                } else {
                    Passed::Nothing
                })
            }
            Err(e) => return Err(e),
        }
    }
}

impl Conn {
    /// Loopback client to upstream, one step (the upstream has taken everything sealed for it,
    /// and the client has not ended); true if something moved.
    pub(super) fn forward_tls(&mut self, records: &mut [u8]) -> io::Result<bool> {
        let Local::Tls(t) = &mut self.client.io else {
            return Ok(false);
        };
        // Plaintext rustls opened before the hand-off (a request that came with the client's
        // last handshake flight), then records read before it.
        match pass(&mut *t.tls, &mut *self.tls, &mut self.up)? {
            Passed::Nothing => {}
            Passed::Moved => return Ok(true),
            Passed::Closed => {
                self.client_ended();
                return Ok(true);
            }
        }
        if !t.records.is_empty() {
            let early = std::mem::take(&mut t.records);
            self.open_from_client(&early)?;
            return Ok(true);
        }
        if !(self.client.readable || self.client.read_closed) {
            return Ok(false);
        }
        let read = (&t.tcp).read(records);
        match read {
            Ok(0) => {
                // TCP's end: rustls tells a clean end (`close_notify` came) from a cut one,
                // which fails the connection as on the runtime's path.
                t.tls.read_tls(&mut io::empty())?;
                self.open_from_client(&[])?;
                Ok(true)
            }
            Ok(n) => {
                let drained = n < records.len();
                if drained {
                    self.client.readable = false;
                }
                self.open_from_client(&records[..n])?;
                if drained {
                    self.settle_client();
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.client.readable = false;
                self.settle_client();
                Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// The client's `close_notify` came, and everything before it is sealed for the upstream:
    /// the upstream gets its own, then TCP's end ([`Conn::drive`]'s next forward step).
    fn client_ended(&mut self) {
        self.client_eof = true;
        self.tls.send_close_notify();
    }

    /// Gives the client's `bytes` (records) to its session and seals what they open for the
    /// upstream, written by the next forward step: one write for the whole read.
    fn open_from_client(&mut self, bytes: &[u8]) -> io::Result<()> {
        let Local::Tls(t) = &mut self.client.io else {
            return Ok(());
        };
        let mut rest = bytes;
        loop {
            if let Passed::Closed = pass(&mut *t.tls, &mut *self.tls, &mut self.up)? {
                self.client_eof = true;
                self.tls.send_close_notify();
                return Ok(());
            }
            // After the client's `close_notify`, its session takes nothing more.
            if rest.is_empty() || t.tls.read_tls(&mut rest)? == 0 {
                return Ok(());
            }
            if let Err(e) = t.tls.process_new_packets() {
                // The records before the bad one are the client's: they still go up, as far as
                // the upstream's socket takes them now (the connection ends with this error, so
                // no later step would write them). Then the alert rustls queued, likewise.
                let _ = pass(&mut *t.tls, &mut *self.tls, &mut self.up);
                while self.tls.wants_write() {
                    if !matches!(self.tls.write_tls(&mut self.upstream.io), Ok(n) if n > 0) {
                        break;
                    }
                }
                let _ = t.tls.write_tls(&mut t.tcp);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Upstream to loopback client, one step; true if something moved.
    pub(super) fn backward_tls(&mut self, records: &mut [u8], out: &mut [u8]) -> io::Result<bool> {
        if self.client_shut {
            return Ok(false);
        }
        match self.flush_client()? {
            Sent::All => {}
            Sent::Some => return Ok(true),
            Sent::Blocked => return Ok(false),
        }
        match self.pass_down() {
            Ok(Passed::Nothing) => {}
            Ok(Passed::Moved) => {
                self.flush_client()?;
                return Ok(true);
            }
            Ok(Passed::Closed) => return self.close_client(),
            Err(e) => {
                // Everything before the cut reaches the client first.
                let _ = self.flush_client();
                return Err(e);
            }
        }
        if let Some(held) = self.held.take() {
            // Records read with the upstream's handshake, before the hand-off.
            let (pos, cap) = (self.pos, self.cap);
            (self.pos, self.cap) = (0, 0);
            self.open_into_client(&held.bytes()[pos..cap])?;
            return Ok(true);
        }
        self.read_upstream(records, out)
    }

    /// Gives the upstream's `bytes` (records) to its session, seals what they open for the
    /// client, and writes it: one write for the whole read, also of what opened before an
    /// error.
    pub(super) fn open_into_client(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut rest = bytes;
        let fed = loop {
            match self.pass_down() {
                Ok(Passed::Closed) => break Ok(()),
                Err(e) => break Err(e),
                Ok(_) => {}
            }
            if rest.is_empty() {
                break Ok(());
            }
            match self.tls.read_tls(&mut rest) {
                Ok(0) => break Ok(()), // after `close_notify`, rustls takes nothing more
                Ok(_) => {}
                Err(e) => break Err(e),
            }
            if let Err(e) = self.process() {
                let _ = self.pass_down();
                break Err(e);
            }
        };
        let flushed = self.flush_client();
        fed?;
        flushed.map(|_| ())
    }

    /// [`pass`]es what the upstream's session opened into the client's.
    fn pass_down(&mut self) -> io::Result<Passed> {
        let Local::Tls(t) = &mut self.client.io else {
            return Ok(Passed::Nothing);
        };
        pass(&mut *self.tls, &mut *t.tls, &mut self.down)
    }

    /// Writes the records sealed for the client, as far as it has room.
    fn flush_client(&mut self) -> io::Result<Sent> {
        let Side {
            io: Local::Tls(t),
            writable,
            ..
        } = &mut self.client
        else {
            return Ok(Sent::All);
        };
        let mut wrote = false;
        while t.tls.wants_write() {
            if !*writable {
                return Ok(if wrote { Sent::Some } else { Sent::Blocked });
            }
            match t.tls.write_tls(&mut t.tcp) {
                Ok(_) => wrote = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => *writable = false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Sent::All)
    }

    /// The upstream's `close_notify` came and everything before it is sealed for the client:
    /// the client gets a `close_notify` of its own, then TCP's end, and the upstream-to-client
    /// direction is done.
    fn close_client(&mut self) -> io::Result<bool> {
        if let Local::Tls(t) = &mut self.client.io {
            t.tls.send_close_notify();
        }
        match self.flush_client()? {
            Sent::All => {}
            Sent::Some => return Ok(true),
            Sent::Blocked => return Ok(false),
        }
        self.client_shut = true;
        self.held = None;
        (self.pos, self.cap) = (0, 0);
        let Local::Tls(t) = &self.client.io else {
            return Ok(true);
        };
        match t.tcp.shutdown(Shutdown::Write) {
            Err(e) if e.kind() != io::ErrorKind::NotConnected => Err(e),
            _ => Ok(true),
        }
    }

    /// [`settle`] for the client's session, once its socket is drained.
    fn settle_client(&mut self) {
        if let Local::Tls(t) = &mut self.client.io {
            settle(&mut *t.tls);
        }
    }
}
