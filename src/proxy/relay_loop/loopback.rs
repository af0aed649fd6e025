//! A loopback TLS client's connection: both TLS sessions on rustls's unbuffered API
//! ([`crate::proxy::unbuffered`]), the client's (the proxy terminates it) and the upstream's
//! (the proxy originates it). What one read of a socket brings is opened in the loop's record
//! buffer and sealed for the other side into the loop's out buffer, then written with one
//! `write`: no buffer of the connection's own is used on the way. The connection keeps only
//! what it could not pass on: a record not yet whole, and records its peer had no room for
//! (freed once written). At rest it holds its two sessions and its sockets.
//!
//! What may wait in flight is bounded as on the UNIX-socket path: a side is read only when
//! everything sealed for the other has gone out, so at most one read's records wait for a
//! peer without room.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::OwnedFd;

use rustls::client::UnbufferedClientConnection;
use rustls::server::UnbufferedServerConnection;

use super::conn::{register_client, Scratch, Sent, Side, Step, RECORDS, ROUNDS_PER_TURN};
use super::pair::{OnEnd, Outcome};
use super::watch::Deadlines;
use crate::proxy::unbuffered::stream::LeanParts;
use crate::proxy::unbuffered::{feed, seal, seal_close_notify, Out, Session};

/// What moves to a loop for a loopback TLS client: both sides, handshakes done.
pub struct TlsPair {
    /// The loopback client: its socket and the session the proxy terminates.
    pub client: LeanParts<UnbufferedServerConnection>,
    /// The API server: its socket and the session the proxy originates.
    pub upstream: LeanParts<UnbufferedClientConnection>,
}

/// One relayed loopback TLS connection.
pub(super) struct TlsConn {
    pub(super) client: Side<TcpStream>,
    pub(super) upstream: Side<TcpStream>,
    /// The client's session.
    local: UnbufferedServerConnection,
    /// The upstream's session.
    remote: UnbufferedClientConnection,
    /// A record from the client not yet whole.
    client_in: Vec<u8>,
    /// A record from the upstream not yet whole.
    upstream_in: Vec<u8>,
    /// Records for the client that found no room: `to_client.bytes()[client_sent..]`.
    to_client: Out,
    client_sent: usize,
    /// Records for the upstream that found no room.
    to_upstream: Out,
    upstream_sent: usize,
    /// The client's registration includes writability.
    client_out: bool,
    /// The client's `close_notify` came, and the upstream's is sealed.
    client_eof: bool,
    /// The upstream's write side is shut: the client-to-upstream direction is done.
    pub(super) upstream_shut: bool,
    /// The upstream's `close_notify` came, and the client's is sealed.
    upstream_eof: bool,
    /// The client's write side is shut: the upstream-to-client direction is done.
    pub(super) client_shut: bool,
    /// Plaintext bytes opened from the client.
    pub(super) up: u64,
    /// Plaintext bytes sealed for the client.
    pub(super) down: u64,
    /// When a byte last moved ([`crate::proxy::idle::now_ms`]).
    pub(super) last: u64,
    /// When the loop itself ends it.
    pub(super) deadlines: Deadlines,
    on_end: Option<OnEnd>,
}

impl TlsConn {
    /// The connection `pair` was, with what was in flight at the hand-off: a record not yet
    /// whole, records not yet written, plaintext opened and not yet sealed for the other side
    /// (sealed now).
    pub(super) fn new(pair: TlsPair, deadlines: Deadlines, on_end: OnEnd) -> io::Result<TlsConn> {
        let TlsPair { client, upstream } = pair;
        let mut conn = TlsConn {
            client: Side::new(client.tcp),
            upstream: Side::new(upstream.tcp),
            local: client.session,
            remote: upstream.session,
            client_in: client.incoming,
            upstream_in: upstream.incoming,
            to_client: Out::default(),
            client_sent: 0,
            to_upstream: Out::default(),
            upstream_sent: 0,
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
        };
        conn.to_client.push(&client.out);
        conn.to_upstream.push(&upstream.out);
        if !client.plain.is_empty() {
            seal_with(
                &mut conn.remote,
                &mut conn.upstream_in,
                &client.plain,
                &mut conn.to_upstream,
            )?;
            conn.up += client.plain.len() as u64;
        }
        if client.peer_closed {
            conn.client_eof = true;
            close_with(
                &mut conn.remote,
                &mut conn.upstream_in,
                &mut conn.to_upstream,
            )?;
        }
        if !upstream.plain.is_empty() {
            seal_with(
                &mut conn.local,
                &mut conn.client_in,
                &upstream.plain,
                &mut conn.to_client,
            )?;
            conn.down += upstream.plain.len() as u64;
        }
        if upstream.peer_closed {
            conn.upstream_eof = true;
            close_with(&mut conn.local, &mut conn.client_in, &mut conn.to_client)?;
        }
        Ok(conn)
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
            let forward = self.forward(scratch)?;
            let backward = self.backward(scratch)?;
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
            return Ok(false);
        }
        match send(
            &mut self.upstream,
            &mut self.to_upstream,
            &mut self.upstream_sent,
            &mut scratch.spare,
        )? {
            Sent::All => {}
            Sent::Some => return Ok(true),
            Sent::Blocked => return Ok(false),
        }
        if self.client_eof {
            // The client's `close_notify` is passed on: now TCP's end.
            self.upstream_shut = true;
            return shut(&self.upstream.io);
        }
        if !self.client.can_read() {
            return Ok(false);
        }
        match read_kept(
            &mut self.client,
            &mut self.client_in,
            &mut scratch.records,
            "the loopback client",
        )? {
            Brought::Got(n) => {
                self.open_from_client(
                    &mut scratch.records[..n],
                    &mut scratch.sealed,
                    &mut scratch.spare,
                )?;
                Ok(true)
            }
            Brought::Nothing => Ok(false),
            Brought::Again => Ok(true),
        }
    }

    /// Gives the client's `records` to its session and seals what they open for the
    /// upstream: one write for the whole read. On an error (a bad record), what the records
    /// before it opened still goes up as far as the socket takes it now, and the alert the
    /// session queued goes to the client.
    fn open_from_client(
        &mut self,
        records: &mut [u8],
        sealed: &mut Out,
        spare: &mut Vec<Out>,
    ) -> io::Result<()> {
        sealed.clear();
        let remote = &mut self.remote;
        let kept = &mut self.upstream_in;
        let up = &mut self.up;
        let fed = feed(&mut self.local, records, &mut self.to_client, |plain| {
            *up += plain.len() as u64;
            seal_with(remote, kept, plain, sealed)
        });
        match fed {
            Ok(fed) => {
                if fed.peer_closed {
                    self.client_eof = true;
                    close_with(&mut self.remote, &mut self.upstream_in, sealed)?;
                } else if fed.used < records.len() {
                    self.client_in = records[fed.used..].to_vec();
                }
                queue(
                    &mut self.upstream,
                    &mut self.to_upstream,
                    &mut self.upstream_sent,
                    sealed,
                    spare,
                )
            }
            Err(e) => {
                let _ = queue(
                    &mut self.upstream,
                    &mut self.to_upstream,
                    &mut self.upstream_sent,
                    sealed,
                    spare,
                );
                let _ = send(
                    &mut self.client,
                    &mut self.to_client,
                    &mut self.client_sent,
                    spare,
                );
                Err(e)
            }
        }
    }

    /// Upstream to client, one step; true if something moved.
    fn backward(&mut self, scratch: &mut Scratch) -> io::Result<bool> {
        if self.client_shut {
            return Ok(false);
        }
        match send(
            &mut self.client,
            &mut self.to_client,
            &mut self.client_sent,
            &mut scratch.spare,
        )? {
            Sent::All => {}
            Sent::Some => return Ok(true),
            Sent::Blocked => return Ok(false),
        }
        if self.upstream_eof {
            // The upstream's `close_notify` is passed on: now TCP's end.
            self.client_shut = true;
            return shut(&self.client.io);
        }
        if !self.upstream.can_read() {
            return Ok(false);
        }
        match read_kept(
            &mut self.upstream,
            &mut self.upstream_in,
            &mut scratch.records,
            "the API server",
        )? {
            Brought::Got(n) => {
                self.open_from_upstream(
                    &mut scratch.records[..n],
                    &mut scratch.sealed,
                    &mut scratch.spare,
                )?;
                Ok(true)
            }
            Brought::Nothing => Ok(false),
            Brought::Again => Ok(true),
        }
    }

    /// [`TlsConn::open_from_client`] the other way.
    fn open_from_upstream(
        &mut self,
        records: &mut [u8],
        sealed: &mut Out,
        spare: &mut Vec<Out>,
    ) -> io::Result<()> {
        sealed.clear();
        let local = &mut self.local;
        let kept = &mut self.client_in;
        let down = &mut self.down;
        let fed = feed(&mut self.remote, records, &mut self.to_upstream, |plain| {
            *down += plain.len() as u64;
            seal_with(local, kept, plain, sealed)
        });
        match fed {
            Ok(fed) => {
                if fed.peer_closed {
                    self.upstream_eof = true;
                    close_with(&mut self.local, &mut self.client_in, sealed)?;
                } else if fed.used < records.len() {
                    self.upstream_in = records[fed.used..].to_vec();
                }
                queue(
                    &mut self.client,
                    &mut self.to_client,
                    &mut self.client_sent,
                    sealed,
                    spare,
                )
            }
            Err(e) => {
                let _ = queue(
                    &mut self.client,
                    &mut self.to_client,
                    &mut self.client_sent,
                    sealed,
                    spare,
                );
                let _ = send(
                    &mut self.upstream,
                    &mut self.to_upstream,
                    &mut self.upstream_sent,
                    spare,
                );
                Err(e)
            }
        }
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

/// Writes `sealed` to `side` after what waits for it in `pending`. What the socket does not
/// take now is not copied: the connection keeps the loop's buffer it was sealed in (from
/// `sent` on) and the loop takes a spare one, which the connection's buffer becomes once it
/// is written ([`send`]). `sealed` is left empty.
fn queue(
    side: &mut Side<TcpStream>,
    pending: &mut Out,
    sent: &mut usize,
    sealed: &mut Out,
    spare: &mut Vec<Out>,
) -> io::Result<()> {
    if sealed.is_empty() {
        return Ok(());
    }
    if !pending.is_empty() {
        pending.push(sealed.bytes());
        sealed.clear();
        return send(side, pending, sent, spare).map(|_| ());
    }
    let bytes = sealed.bytes();
    let mut done = 0;
    let mut result = Ok(());
    while done < bytes.len() && side.writable {
        match (&side.io).write(&bytes[done..]) {
            Ok(0) => {
                result = Err(io::ErrorKind::WriteZero.into());
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => side.writable = false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    if result.is_ok() && done < bytes.len() {
        std::mem::swap(pending, sealed);
        *sent = done;
        *sealed = spare.pop().unwrap_or_default();
    } else {
        sealed.clear();
    }
    result
}

/// Writes what waits in `pending` as far as `side` has room; gives the buffer back once all of
/// it is written.
fn send(
    side: &mut Side<TcpStream>,
    pending: &mut Out,
    sent: &mut usize,
    spare: &mut Vec<Out>,
) -> io::Result<Sent> {
    if pending.is_empty() {
        return Ok(Sent::All);
    }
    let mut wrote = false;
    while *sent < pending.bytes().len() {
        if !side.writable {
            return Ok(if wrote { Sent::Some } else { Sent::Blocked });
        }
        match (&side.io).write(&pending.bytes()[*sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                *sent += n;
                wrote = true;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => side.writable = false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut done = std::mem::take(pending);
    *sent = 0;
    if spare.len() < SPARE {
        done.clear();
        spare.push(done);
    }
    Ok(Sent::All)
}

/// [`seal`] into `session`, handing it back what it `kept` (and dropping what it took of it).
fn seal_with<S: Session>(
    session: &mut S,
    kept: &mut Vec<u8>,
    plain: &[u8],
    out: &mut Out,
) -> io::Result<()> {
    let took = seal(session, kept, plain, out)?;
    kept.drain(..took);
    Ok(())
}

/// [`seal_with`] for `close_notify`.
fn close_with<S: Session>(session: &mut S, kept: &mut Vec<u8>, out: &mut Out) -> io::Result<()> {
    let took = seal_close_notify(session, kept, out)?;
    kept.drain(..took);
    Ok(())
}

/// Buffers a loop keeps for the connections whose peer had no room ([`queue`]).
const SPARE: usize = 2;

/// What a read of a side brought.
enum Brought {
    /// `records[..n]` holds what the side kept and what the read brought.
    Got(usize),
    /// Nothing: the socket is drained.
    Nothing,
    /// A signal interrupted the read: try again.
    Again,
}

/// Reads `side` into the loop's `records`, after what it `kept` from its last read (given up
/// to the buffer: the connection keeps nothing while the loop holds it). A read that fills its
/// room leaves the side readable (edge-triggered: more may wait); TCP's end is `who` cutting
/// its TLS stream (after its `close_notify` the side is not read again).
fn read_kept(
    side: &mut Side<TcpStream>,
    kept: &mut Vec<u8>,
    records: &mut [u8],
    who: &str,
) -> io::Result<Brought> {
    let k = kept.len();
    let records = with_kept(records, kept)?;
    match (&side.io).read(&mut records[k..]) {
        Ok(0) => Err(cut(who)),
        Ok(n) => {
            if k + n < records.len() {
                side.readable = false;
            }
            *kept = Vec::new();
            Ok(Brought::Got(k + n))
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            side.readable = false;
            Ok(Brought::Nothing)
        }
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Brought::Again),
        Err(e) => Err(e),
    }
}

/// The loop's record buffer with `kept` (what a connection kept from its last read) at its
/// front and room for a read of [`RECORDS`] after it (less, for a handshake message that
/// spans records and is still not whole; none, and an error, for one that fills the buffer).
fn with_kept<'a>(records: &'a mut [u8], kept: &[u8]) -> io::Result<&'a mut [u8]> {
    let k = kept.len();
    let end = (k + RECORDS).min(records.len());
    if end <= k {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer sent a TLS message longer than the relay takes",
        ));
    }
    records[..k].copy_from_slice(kept);
    Ok(&mut records[..end])
}

/// Shuts `tcp`'s write side (a peer already gone is no error).
fn shut(tcp: &TcpStream) -> io::Result<bool> {
    match tcp.shutdown(Shutdown::Write) {
        Err(e) if e.kind() != io::ErrorKind::NotConnected => Err(e),
        _ => Ok(true),
    }
}

/// A peer that ended its TCP stream without `close_notify`: a truncation, never a clean end.
fn cut(who: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("{who} ended its TLS stream without close_notify"),
    )
}
