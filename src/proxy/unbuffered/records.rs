//! The moves both drivers of an unbuffered session make ([`super::stream`] on a connection
//! thread, the relay loop once established): [`feed`] it the records a socket gave, [`seal`]
//! plaintext for its peer, [`seal_close_notify`] at the end; [`Out`] holds what it sealed.

use std::io;

use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, EncodeTlsData, EncryptError, InsufficientSizeError,
    UnbufferedStatus, WriteTraffic,
};
use rustls::CommonState;

/// An unbuffered session of either side: rustls defines `process_tls_records` for each side
/// apart.
pub trait Session: Send + 'static {
    /// The side's connection data.
    type Data;
    /// rustls's `process_tls_records` for this side.
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, Self::Data>;
    /// What the handshake settled (protocol, certificates, resumption).
    fn common(&self) -> &CommonState;
}

impl Session for UnbufferedClientConnection {
    type Data = ClientConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, ClientConnectionData> {
        self.process_tls_records(incoming)
    }
    fn common(&self) -> &CommonState {
        self
    }
}

impl Session for UnbufferedServerConnection {
    type Data = ServerConnectionData;
    fn process<'c, 'i>(
        &'c mut self,
        incoming: &'i mut [u8],
    ) -> UnbufferedStatus<'c, 'i, ServerConnectionData> {
        self.process_tls_records(incoming)
    }
    fn common(&self) -> &CommonState {
        self
    }
}

/// What [`feed`] did with a buffer of records.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fed {
    /// Bytes taken from the front of the buffer; the rest is a record not yet whole.
    pub used: usize,
    /// The peer's `close_notify` came (reported once): nothing after it is read.
    pub peer_closed: bool,
    /// The handshake is complete: application data may be sealed.
    pub traffic: bool,
}

/// The error a session reports, as the proxy's I/O errors carry it (what tokio-rustls does).
pub fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Gives `records` (bytes a socket gave, from the front) to `session`: the plaintext they
/// open goes to `opened`, record by record, and what the session has to send its own peer
/// (its handshake flights, session tickets, a key update, an alert) is appended to `own`,
/// which the caller writes to that peer before anything sealed later. Stops when no whole
/// record is left. On an error, the alert rustls queued for it is in `own` too.
pub fn feed<S: Session>(
    session: &mut S,
    records: &mut [u8],
    own: &mut Out,
    mut opened: impl FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<Fed> {
    let mut fed = Fed::default();
    loop {
        let UnbufferedStatus { discard, state } = session.process(&mut records[fed.used..]);
        let state = match state {
            Ok(s) => s,
            Err(e) => {
                alert(session, own);
                return Err(tls_error(e));
            }
        };
        let mut extra = 0;
        let more = match state {
            ConnectionState::ReadTraffic(mut read) => {
                while let Some(record) = read.next_record() {
                    let record = record.map_err(tls_error)?;
                    extra += record.discard;
                    opened(record.payload)?;
                }
                true
            }
            ConnectionState::EncodeTlsData(mut encode) => {
                encode_into(&mut encode, own)?;
                true
            }
            ConnectionState::TransmitTlsData(transmit) => {
                // The caller writes `own` before anything it seals later, and before it waits
                // for the peer.
                transmit.done();
                true
            }
            ConnectionState::PeerClosed => {
                fed.peer_closed = true;
                true
            }
            ConnectionState::WriteTraffic(_) => {
                fed.traffic = true;
                false
            }
            ConnectionState::Closed => false,
            // The handshake needs more records; also a state a later rustls may add.
            _ => false,
        };
        fed.used += discard + extra;
        if !more {
            return Ok(fed);
        }
    }
}

/// Appends what `session` queued for its peer after an error (its fatal alert) to `own`.
fn alert<S: Session>(session: &mut S, own: &mut Out) {
    for _ in 0..4 {
        let UnbufferedStatus { state, .. } = session.process(&mut []);
        match state {
            Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                if encode_into(&mut encode, own).is_err() {
                    return;
                }
            }
            Ok(ConnectionState::TransmitTlsData(transmit)) => transmit.done(),
            _ => return,
        }
    }
}

/// Seals `plain` for `session`'s peer, appended to `out` after whatever the session had to
/// send first (a key update it owes). The session's handshake must be complete.
pub fn seal<S: Session>(session: &mut S, plain: &[u8], out: &mut Out) -> io::Result<()> {
    with_traffic(session, out, |traffic, out| encrypt(traffic, plain, out))
}

/// Seals `close_notify` for `session`'s peer, appended to `out`.
pub fn seal_close_notify<S: Session>(session: &mut S, out: &mut Out) -> io::Result<()> {
    with_traffic(session, out, |traffic, out| {
        let room = out.room(64);
        let n = traffic
            .queue_close_notify(room)
            .map_err(|e| io::Error::other(e.to_string()))?;
        out.filled(n);
        Ok(())
    })
}

/// Runs `then` once `session` may send application data, after encoding what it queued
/// before (into `out`, in order).
fn with_traffic<S: Session>(
    session: &mut S,
    out: &mut Out,
    then: impl FnOnce(&mut WriteTraffic<'_, S::Data>, &mut Out) -> io::Result<()>,
) -> io::Result<()> {
    loop {
        let UnbufferedStatus { state, .. } = session.process(&mut []);
        match state.map_err(tls_error)? {
            ConnectionState::EncodeTlsData(mut encode) => encode_into(&mut encode, out)?,
            ConnectionState::TransmitTlsData(transmit) => transmit.done(),
            ConnectionState::WriteTraffic(mut traffic) => return then(&mut traffic, out),
            ConnectionState::PeerClosed => {}
            ConnectionState::Closed => {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the TLS session is closed both ways",
                ))
            }
            ConnectionState::ReadTraffic(_) => {
                return Err(io::Error::other(
                    "a TLS session still holds plaintext it opened",
                ))
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the TLS handshake is not complete",
                ))
            }
        }
    }
}

/// Encrypts `plain` into `out`, growing it as rustls asks.
fn encrypt<D>(traffic: &mut WriteTraffic<'_, D>, plain: &[u8], out: &mut Out) -> io::Result<()> {
    // A record's overhead: its header, the content type and the tag (TLS 1.2: the explicit
    // nonce instead of the content type), per 16 KiB fragment.
    let mut need = plain.len() + (plain.len() / 16_384 + 1) * 40;
    loop {
        let room = out.room(need);
        match traffic.encrypt(plain, room) {
            Ok(n) => {
                out.filled(n);
                return Ok(());
            }
            Err(EncryptError::InsufficientSize(InsufficientSizeError { required_size }))
                if required_size > need =>
            {
                need = required_size;
            }
            Err(e) => return Err(io::Error::other(e.to_string())),
        }
    }
}

/// Encodes a handshake record (or an alert) onto the end of `out`.
fn encode_into<D>(encode: &mut EncodeTlsData<'_, D>, out: &mut Out) -> io::Result<()> {
    let mut need = 512;
    loop {
        match encode.encode(out.room(need)) {
            Ok(n) => {
                out.filled(n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(InsufficientSizeError { required_size }))
                if required_size > need =>
            {
                need = required_size;
            }
            Err(e) => return Err(io::Error::other(e.to_string())),
        }
    }
}

/// Sealed records on their way to a socket: `buf[..len]`. The buffer keeps its size between
/// uses (a loop's is reused for every connection), so sealing into it neither allocates nor
/// clears memory once it has grown to a read's worth.
#[derive(Default)]
pub struct Out {
    buf: Vec<u8>,
    len: usize,
}

impl Out {
    /// An empty buffer of `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Out {
        Out {
            buf: vec![0; capacity],
            len: 0,
        }
    }

    /// At least `need` bytes of room after what is there.
    fn room(&mut self, need: usize) -> &mut [u8] {
        if self.buf.len() < self.len + need {
            self.buf.resize(self.len + need, 0);
        }
        &mut self.buf[self.len..]
    }

    fn filled(&mut self, n: usize) {
        self.len += n;
    }

    /// Appends `bytes`.
    pub fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len();
        self.room(n)[..n].copy_from_slice(bytes);
        self.len += n;
    }

    /// What is there.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// Empties it (the room stays).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Whether nothing is there.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
