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
                alert(session, &mut records[fed.used + discard..], own);
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
/// Only what it queued is asked for: rustls hands queued records out before it reads again,
/// and a call after the last one would read `rest` again (a record that failed to decrypt
/// would fail again, and rustls would queue a second alert). `rest` is what is left of the
/// buffer the error came from, never an empty one: rustls keeps offsets into it while a
/// handshake message is only partly taken, and panicked on an empty buffer (a server whose
/// certificate is refused, with more of its flight in the same record).
fn alert<S: Session>(session: &mut S, rest: &mut [u8], own: &mut Out) {
    let mut used = 0;
    while session.common().wants_write() {
        let UnbufferedStatus { discard, state } = session.process(&mut rest[used..]);
        match state {
            Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                if encode_into(&mut encode, own).is_err() {
                    return;
                }
            }
            _ => return,
        }
        used += discard;
    }
}

/// Seals `plain` for `session`'s peer, appended to `out` after whatever the session had to
/// send first (a key update it owes). The session's handshake must be complete. `kept` is what
/// the session was last given and did not take (a record, or a handshake message, not yet
/// whole): rustls may hold offsets into it, so it is handed back, never an empty buffer in its
/// place. Returns how many bytes of `kept` the session took (the caller drops them).
pub fn seal<S: Session>(
    session: &mut S,
    kept: &mut [u8],
    plain: &[u8],
    out: &mut Out,
) -> io::Result<usize> {
    with_traffic(session, kept, out, |traffic, out| {
        encrypt(traffic, plain, out)
    })
}

/// Seals `close_notify` for `session`'s peer, appended to `out`; `kept` as for [`seal`].
pub fn seal_close_notify<S: Session>(
    session: &mut S,
    kept: &mut [u8],
    out: &mut Out,
) -> io::Result<usize> {
    with_traffic(session, kept, out, |traffic, out| {
        let room = out.room(64);
        let n = traffic
            .queue_close_notify(room)
            .map_err(|e| io::Error::other(e.to_string()))?;
        out.filled(n);
        Ok(())
    })
}

/// Runs `then` once `session` may send application data, after encoding what it queued
/// before (into `out`, in order); returns how many bytes of `kept` it took.
fn with_traffic<S: Session>(
    session: &mut S,
    kept: &mut [u8],
    out: &mut Out,
    then: impl FnOnce(&mut WriteTraffic<'_, S::Data>, &mut Out) -> io::Result<()>,
) -> io::Result<usize> {
    let mut used = 0;
    loop {
        let UnbufferedStatus { discard, state } = session.process(&mut kept[used..]);
        match state.map_err(tls_error)? {
            ConnectionState::EncodeTlsData(mut encode) => encode_into(&mut encode, out)?,
            ConnectionState::TransmitTlsData(transmit) => transmit.done(),
            ConnectionState::WriteTraffic(mut traffic) => {
                then(&mut traffic, out)?;
                return Ok(used + discard);
            }
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
        used += discard;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use rustls::pki_types::{PrivateKeyDer, ServerName};

    /// A buffered rustls server for `localhost` (TLS 1.3, records of at most `fragment`
    /// bytes) and a client config that trusts it, or not.
    fn configs(
        trusted: bool,
        fragment: Option<usize>,
    ) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
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
        server.max_fragment_size = fragment;
        let mut roots = rustls::RootCertStore::empty();
        if trusted {
            roots.add(der).unwrap();
        } else {
            let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
            roots.add(other.cert.der().clone()).unwrap();
        }
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    }

    /// Moves what `out` holds into `server` and returns what the server sends back.
    fn exchange(server: &mut rustls::ServerConnection, out: &mut Out) -> Vec<u8> {
        let mut from = out.bytes();
        while !from.is_empty() {
            server.read_tls(&mut from).unwrap();
        }
        out.clear();
        server.process_new_packets().unwrap();
        let mut back = Vec::new();
        while server.wants_write() {
            server.write_tls(&mut back).unwrap();
        }
        back
    }

    /// A server whose certificate is refused, its flight (EncryptedExtensions, Certificate,
    /// CertificateVerify, Finished) packed in one record: the session reports the error and
    /// queues its alert. rustls still held the messages after the refused one, at offsets into
    /// that record, and the alert was asked for with an empty buffer: rustls panicked.
    #[test]
    fn a_refused_server_certificate_is_an_error_with_its_alert_not_a_panic() {
        let (server_config, client_config) = configs(false, None);
        let mut server = rustls::ServerConnection::new(server_config).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = UnbufferedClientConnection::new(client_config, name).unwrap();
        let mut out = Out::default();
        let fed = feed(&mut client, &mut [], &mut out, |_| Ok(())).unwrap();
        assert!(!fed.traffic);
        let mut flight = exchange(&mut server, &mut out);
        let refused = feed(&mut client, &mut flight, &mut out, |_| Ok(()));
        let e = refused.expect_err("an untrusted server certificate");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        // The records queued: a ChangeCipherSpec for middleboxes, then the alert, encrypted
        // (an application-data record in TLS 1.3).
        let mut types = Vec::new();
        let mut rest = out.bytes();
        while rest.len() >= 5 {
            types.push(rest[0]);
            let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
            rest = &rest[(5 + len).min(rest.len())..];
        }
        assert_eq!(
            types.last(),
            Some(&0x17),
            "no alert record queued: {types:?}"
        );
    }

    /// A post-handshake message split over records (a session ticket in records of 32 bytes),
    /// of which only the first has come, and then plaintext to seal: the session is handed back
    /// what it kept. With an empty buffer in its place rustls panicked; now the plaintext is
    /// sealed, the rest of the message completes it, and the peer reads the plaintext.
    #[test]
    fn plaintext_is_sealed_while_a_split_handshake_message_waits_for_its_rest() {
        let (server_config, client_config) = configs(true, Some(32));
        let mut server = rustls::ServerConnection::new(server_config).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = UnbufferedClientConnection::new(client_config, name).unwrap();
        let mut out = Out::default();
        let mut incoming: Vec<u8> = Vec::new();
        loop {
            let fed = feed(&mut client, &mut incoming, &mut out, |_| Ok(())).unwrap();
            incoming.drain(..fed.used);
            incoming.extend(exchange(&mut server, &mut out));
            if fed.traffic && !server.is_handshaking() {
                break;
            }
        }
        // The tickets, in records of at most 32 bytes of plaintext: give the first record only.
        incoming.extend(exchange(&mut server, &mut out));
        let first = 5 + usize::from(u16::from_be_bytes([incoming[3], incoming[4]]));
        assert!(incoming.len() > first, "the tickets came in one record");
        let mut rest = incoming.split_off(first);
        let fed = feed(&mut client, &mut incoming, &mut out, |_| Ok(())).unwrap();
        incoming.drain(..fed.used);
        let took = seal(&mut client, &mut incoming, b"hello", &mut out).unwrap();
        incoming.drain(..took);
        let mut opened = Vec::new();
        let mut sealed = out.bytes();
        while !sealed.is_empty() {
            server.read_tls(&mut sealed).unwrap();
        }
        server.process_new_packets().unwrap();
        std::io::Read::read_to_end(&mut server.reader(), &mut opened).ok();
        assert_eq!(opened, b"hello");
        out.clear();
        incoming.append(&mut rest);
        let fed = feed(&mut client, &mut incoming, &mut out, |_| Ok(())).unwrap();
        assert_eq!(fed.used, incoming.len(), "the tickets were all taken");
    }
}
