//! An unbuffered session with its socket on a connection thread: the handshake, and a stream
//! for what runs on the connection's task before (or instead of) a relay loop: the failure
//! answer to a client whose upstream could not be reached, a relay through an `https://`
//! forward proxy.
//!
//! Its buffers hold only what is in flight, and are given back once empty: records read and
//! not yet whole, records sealed and not yet written, plaintext opened and not yet taken.
//! [`Lean::into_parts`] hands all three to the relay loop with the socket and the session.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::records::{feed, seal, seal_close_notify, Fed, Out, Session};

/// The most a read takes during a handshake (and on the task): a record's worth.
const READ: usize = 16 * 1024 + 2048;
/// The most records kept while they are not yet whole: a handshake message may span records
/// (a long certificate chain) and rustls joins them in place, up to 64 KiB.
const MAX_INCOMING: usize = 64 * 1024 + READ;
/// What a read for the session tickets after a handshake takes at most ([`Lean::take_in`]).
const TICKETS_READ: usize = 2048;
/// The most plaintext one write seals at once.
const MAX_SEAL: usize = 64 * 1024;

/// A TLS session on rustls's unbuffered API and its TCP connection, registered with the
/// connection thread's runtime.
pub struct Lean<S> {
    tcp: TcpStream,
    /// The session.
    pub session: S,
    /// Records read and not yet given to the session (a record not yet whole):
    /// `incoming[..have]`.
    incoming: Vec<u8>,
    have: usize,
    /// `incoming[..have]` holds bytes the session has not seen yet.
    unfed: bool,
    /// Records sealed for the peer and not yet written: `out.bytes()[sent..]`.
    out: Out,
    sent: usize,
    /// Plaintext opened and not yet taken: `plain[taken..]`.
    plain: Vec<u8>,
    taken: usize,
    /// The peer's `close_notify` came.
    peer_closed: bool,
    /// Ours is sealed.
    closing: bool,
    /// The session failed (a bad record): it is not asked for anything again. Its buffer
    /// still holds what failed, and rustls would read it again and queue a second alert.
    failed: Option<io::ErrorKind>,
    /// The session is given records with hardware signatures refused (a connection made
    /// ahead for a client that has not come yet: `proxy::spare`).
    unsigned: bool,
}

/// What the relay loop takes from a [`Lean`]: the socket (non-blocking, registered nowhere),
/// the session, and what was in flight.
pub struct LeanParts<S> {
    /// The socket.
    pub tcp: std::net::TcpStream,
    /// The session, handshake done.
    pub session: S,
    /// Records read and not yet given to the session (a record not yet whole).
    pub incoming: Vec<u8>,
    /// Records sealed and not yet written.
    pub out: Vec<u8>,
    /// Plaintext opened and not yet passed on.
    pub plain: Vec<u8>,
    /// The peer's `close_notify` came.
    pub peer_closed: bool,
}

impl<S: Session> Lean<S> {
    /// `session` on `tcp`, with `read` (bytes already read from `tcp`, the ClientHello) still
    /// to be given to it.
    pub fn new(tcp: TcpStream, session: S, read: Vec<u8>) -> Lean<S> {
        let have = read.len();
        Lean {
            tcp,
            session,
            incoming: read,
            have,
            unfed: have > 0,
            out: Out::default(),
            sent: 0,
            plain: Vec::new(),
            taken: 0,
            peer_closed: false,
            closing: false,
            failed: None,
            unsigned: false,
        }
    }

    /// From now on, the handshake makes no hardware signature: it resumes, or fails
    /// (`key::tls::without_signatures`).
    pub fn refuse_signatures(&mut self) {
        self.unsigned = true;
    }

    /// Runs the handshake to its end. What the peer sent after its last flight and the
    /// session opened already (a request that came with a client's `Finished`) waits in
    /// [`Lean::take_opened`]. The caller bounds the time it takes.
    pub async fn handshake(&mut self) -> io::Result<()> {
        self.handshake_sending(&[]).await
    }

    /// [`Lean::handshake`], and `first` sealed as soon as the handshake allows: in TLS 1.3
    /// (and a resumed TLS 1.2 session), written with the session's last flight (a client's
    /// `Finished`), in one write; after a full TLS 1.2 handshake, on its own once the server's
    /// `Finished` came. The session authenticates its peer before it lets anything be sealed.
    pub async fn handshake_sending(&mut self, first: &[u8]) -> io::Result<()> {
        loop {
            let fed = self.feed_incoming();
            let mut sealed = Ok(());
            if let Ok(Fed { traffic: true, .. }) = fed {
                if !first.is_empty() {
                    sealed = self.seal(first);
                }
            }
            // The session's flight (or its alert) goes out before its error is reported.
            let flushed = self.flush_out().await;
            let fed = fed?;
            sealed?;
            flushed?;
            if fed.traffic {
                return Ok(());
            }
            if fed.peer_closed || self.read_more().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection during the TLS handshake",
                ));
            }
        }
    }

    /// Waits up to `within` for what the peer sends right after the handshake (a TLS 1.3
    /// server's session tickets) and gives it to the session, with what was read already and
    /// not given yet; what it opens is kept for the relay. Nothing in time is no error, the
    /// peer closing is. Returns as soon as the session has what it waits for (`enough`: a
    /// ticket), without a read when it has it already (Go's server sends it with its
    /// `Finished`).
    pub async fn take_in(
        &mut self,
        within: std::time::Duration,
        enough: impl Fn(&S) -> bool,
    ) -> io::Result<()> {
        if self.have > 0 {
            self.feed_incoming()?;
        }
        let deadline = tokio::time::Instant::now() + within;
        let taken = loop {
            if enough(&self.session) {
                break Ok(());
            }
            // Tickets are small: a small read, and no read buffer kept if none came (the
            // spare's memory at rest, and the heap's: a freed record buffer per spare fragments
            // it).
            let got = tokio::time::timeout_at(deadline, self.read_up_to(TICKETS_READ)).await;
            match got {
                Err(_) => break Ok(()),
                Ok(Ok(0)) => {
                    break Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection right after the TLS handshake",
                    ))
                }
                Ok(Ok(_)) => {
                    let fed = self.feed_incoming()?;
                    self.flush_out().await?;
                    if fed.peer_closed {
                        break Err(io::Error::from(io::ErrorKind::UnexpectedEof));
                    }
                }
                Ok(Err(e)) => break Err(e),
            }
        };
        if self.have == 0 {
            self.incoming = Vec::new();
        }
        taken
    }

    /// Seals `plain` for the peer; it is written by the next flush (or by the relay loop).
    pub fn seal(&mut self, plain: &[u8]) -> io::Result<()> {
        self.check()?;
        // Records read and not given to the session yet are given first: what they open waits
        // in `plain`, and the session is handed back exactly what it kept.
        if self.unfed {
            self.feed_incoming()?;
        }
        let took = seal(
            &mut self.session,
            &mut self.incoming[..self.have],
            plain,
            &mut self.out,
        )?;
        self.drop_front(took);
        Ok(())
    }

    /// [`Lean::seal`] for `close_notify`.
    fn seal_close_notify(&mut self) -> io::Result<()> {
        self.check()?;
        if self.unfed {
            self.feed_incoming()?;
        }
        let took = seal_close_notify(
            &mut self.session,
            &mut self.incoming[..self.have],
            &mut self.out,
        )?;
        self.drop_front(took);
        Ok(())
    }

    /// The error the session failed with, if it did.
    fn check(&self) -> io::Result<()> {
        match self.failed {
            Some(kind) => Err(io::Error::new(kind, "the TLS session failed earlier")),
            None => Ok(()),
        }
    }

    /// Drops the first `n` bytes kept; the buffer itself once nothing is kept.
    fn drop_front(&mut self, n: usize) {
        self.incoming.copy_within(n..self.have, 0);
        self.have -= n;
        if self.have == 0 {
            self.incoming = Vec::new();
        }
    }

    /// The socket, for a look at its state (whether the peer has closed it).
    pub fn tcp_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.tcp)
    }

    /// Takes the plaintext the session has opened and nobody has taken yet.
    pub fn take_opened(&mut self) -> Vec<u8> {
        let mut opened = std::mem::take(&mut self.plain);
        opened.drain(..self.taken);
        self.taken = 0;
        opened
    }

    /// The socket, the session and what is in flight, for the relay loop; the socket leaves
    /// the runtime.
    pub fn into_parts(mut self) -> io::Result<LeanParts<S>> {
        let plain = self.take_opened();
        let incoming = if self.peer_closed {
            Vec::new()
        } else {
            self.incoming[..self.have].to_vec()
        };
        let out = self.out.bytes()[self.sent..].to_vec();
        Ok(LeanParts {
            tcp: self.tcp.into_std()?,
            session: self.session,
            incoming,
            out,
            plain,
            peer_closed: self.peer_closed,
        })
    }

    /// Gives the session the records not yet given: the plaintext they open is kept in
    /// `plain`, and what the session sends its peer in `out`.
    fn feed_incoming(&mut self) -> io::Result<Fed> {
        self.check()?;
        self.unfed = false;
        let (session, out, plain) = (&mut self.session, &mut self.out, &mut self.plain);
        let incoming = &mut self.incoming[..self.have];
        let mut step = || {
            feed(session, incoming, out, |p| {
                plain.extend_from_slice(p);
                Ok(())
            })
        };
        let fed = if self.unsigned {
            crate::key::tls::without_signatures(step)
        } else {
            step()
        };
        let fed = fed.inspect_err(|e| self.failed = Some(e.kind()))?;
        if fed.peer_closed {
            self.peer_closed = true;
            self.drop_front(self.have);
        } else {
            self.drop_front(fed.used);
        }
        Ok(fed)
    }

    /// Room for a read of `read` bytes after the records kept.
    fn make_room(&mut self, read: usize) -> io::Result<()> {
        if self.have >= MAX_INCOMING {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer sent more than a TLS message can hold",
            ));
        }
        let want = (self.have + read).min(MAX_INCOMING);
        if self.incoming.len() < want {
            self.incoming.resize(want, 0);
        }
        Ok(())
    }

    async fn read_more(&mut self) -> io::Result<usize> {
        self.read_up_to(READ).await
    }

    async fn read_up_to(&mut self, read: usize) -> io::Result<usize> {
        self.make_room(read)?;
        let n = self.tcp.read(&mut self.incoming[self.have..]).await?;
        self.have += n;
        self.unfed = n > 0;
        Ok(n)
    }

    async fn flush_out(&mut self) -> io::Result<()> {
        if self.sent < self.out.bytes().len() {
            self.tcp.write_all(&self.out.bytes()[self.sent..]).await?;
        }
        self.out = Out::default();
        self.sent = 0;
        Ok(())
    }

    fn poll_flush_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.out.bytes().len() {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.out.bytes()[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        // Given back: a connection relayed on its task holds no buffer between its writes.
        self.out = Out::default();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: Session + Unpin> AsyncRead for Lean<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.taken < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.taken);
                buf.put_slice(&this.plain[this.taken..this.taken + n]);
                this.taken += n;
                if this.taken == this.plain.len() {
                    this.plain = Vec::new();
                    this.taken = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if this.unfed {
                let fed = this.feed_incoming();
                // What the session owes its peer (a key update, an alert) goes when it can.
                let _ = this.poll_flush_out(cx)?;
                fed?;
                continue;
            }
            this.make_room(READ)?;
            let mut read = ReadBuf::new(&mut this.incoming[this.have..]);
            ready!(Pin::new(&mut this.tcp).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer ended its TLS stream without close_notify",
                )));
            }
            this.have += n;
            this.unfed = true;
        }
    }
}

impl<S: Session + Unpin> AsyncWrite for Lean<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // At most one write's records wait for a peer without room.
        ready!(this.poll_flush_out(cx))?;
        let n = data.len().min(MAX_SEAL);
        this.seal(&data[..n])?;
        if let Poll::Ready(Err(e)) = this.poll_flush_out(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_flush_out(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.closing {
            this.closing = true;
            this.seal_close_notify()?;
        }
        ready!(this.poll_flush_out(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;

    use rustls::pki_types::{PrivateKeyDer, ServerName};
    use rustls::server::UnbufferedServerConnection;
    use tokio::io::AsyncReadExt;

    /// A server whose peer sent a record that fails authentication reports the error, and is
    /// asked for nothing again: a seal afterwards (the other direction of a relay on the
    /// task, in the same poll) returns the error. It used to hand rustls the buffer that still
    /// held the bad record; rustls read it again and queued a second alert (a debug assertion
    /// of rustls's).
    #[tokio::test]
    async fn a_session_that_failed_on_a_bad_record_is_asked_for_nothing_again() {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = made.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let peer = std::thread::spawn(move || {
            let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            let name = ServerName::try_from("localhost").unwrap();
            let mut tls = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
            while tls.is_handshaking() {
                tls.complete_io(&mut tcp).unwrap();
            }
            // A record of the right shape whose tag cannot verify.
            let mut bad = vec![0x17, 0x03, 0x03, 0x00, 0x40];
            bad.extend((0..0x40u8).map(|i| i.wrapping_mul(37)));
            tcp.write_all(&bad).unwrap();
            let mut rest = Vec::new();
            let _ = std::io::Read::read_to_end(&mut tcp, &mut rest);
        });
        let (tcp, _) = listener.accept().unwrap();
        tcp.set_nonblocking(true).unwrap();
        let tcp = TcpStream::from_std(tcp).unwrap();
        let session = UnbufferedServerConnection::new(Arc::new(server)).unwrap();
        let mut lean = Lean::new(tcp, session, Vec::new());
        lean.handshake().await.unwrap();
        let mut buf = [0u8; 64];
        let read = lean.read(&mut buf).await;
        assert_eq!(
            read.expect_err("a bad record").kind(),
            io::ErrorKind::InvalidData
        );
        let sealed = lean.seal(b"after the bad record");
        assert_eq!(
            sealed.expect_err("a failed session seals nothing").kind(),
            io::ErrorKind::InvalidData
        );
        drop(lean);
        peer.join().unwrap();
    }
}
