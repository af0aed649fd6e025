//! An upstream connection's TLS as the connector makes it: on rustls's unbuffered API for a
//! relay loop ([`super::unbuffered`]), or buffered (tokio-rustls, over the read-ahead) for the
//! runtime's path and for the proxy's own requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, ReadBuf};
use tokio_rustls::client::TlsStream;

use super::readahead::ReadAhead;
use super::relay_loop::LoopSpare;
use super::unbuffered::{tls_error, Lean, Session};
use crate::egress::Tunnel;

/// An established upstream connection, of either kind ([`Upstream::connect_loopback`], a spare).
pub struct OriginConn {
    /// The TLS session and its socket.
    pub origin: Origin,
    /// The protocol the upstream agreed to (None: no ALPN).
    pub alpn: Option<Vec<u8>>,
    /// Whether the handshake resumed a session (no signature made).
    pub resumed: bool,
    /// How many of the bytes given went out with the handshake; the caller sends the rest.
    pub sent: usize,
}

/// The upstream's TLS session, as [`Upstream::connect_loopback`] made it.
pub enum Origin {
    /// Over plain TCP, on rustls's unbuffered API: for a relay loop.
    Lean(Box<Lean<UnbufferedClientConnection>>),
    /// Through an `https://` forward proxy: relayed on the connection's task.
    Buffered(Box<TlsStream<ReadAhead<Tunnel>>>),
    /// A UNIX-socket client's spare made on a relay loop ([`super::relay_loop`]): a buffered
    /// rustls session and its socket, in no runtime and no epoll, for the loop that takes it.
    Loop(Box<LoopSpare>),
}

/// An established upstream connection.
pub struct UpstreamConn {
    /// The TLS stream to the API server (its socket read in large reads). Boxed: the
    /// connection's task moves it a few times on its way to the relay, and each move of a
    /// 1 KiB value would otherwise keep its own slot in the task's state for the connection's
    /// whole life (memory per idle connection, docs/BENCHMARKS.md).
    pub stream: Box<TlsStream<ReadAhead<Tunnel>>>,
    /// The protocol the upstream agreed to (None: no ALPN).
    pub alpn: Option<Vec<u8>>,
    /// Whether the handshake resumed a session (no signature made).
    pub resumed: bool,
    /// How many of the bytes given to [`Upstream::connect_sending`] went out with the
    /// handshake (all of them unless rustls's buffer was full); the caller writes the rest.
    pub sent: usize,
}

impl Origin {
    /// What the handshake settled: the protocol, the key exchange, whether it resumed.
    pub fn state(&self) -> &rustls::CommonState {
        match self {
            Origin::Lean(c) => c.session.common(),
            Origin::Buffered(s) => s.get_ref().1,
            Origin::Loop(c) => &c.session,
        }
    }
}

/// How long a spare waits after its handshake for the session ticket its server sends, when
/// none came with the handshake (Go's server sends it with its `Finished` when resuming, and
/// the spare waits for nothing; rustls and OpenSSL one round trip later).
const NEW_TICKET_WAIT: Duration = Duration::from_millis(250);
/// What a read for the session tickets after a buffered handshake takes at once.
const TICKETS_READ: usize = 2048;

/// How an upstream connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dial {
    /// Buffered (tokio-rustls): for a UNIX-socket client, the runtime's path and the proxy's
    /// own requests.
    Buffered,
    /// On rustls's unbuffered API over plain TCP, for a loopback client on a relay loop.
    Lean,
    /// A spare ([`super::spare`]) for the next client of this kind, made as that client's own
    /// connection would be: only over plain TCP and only with a session ticket to resume.
    Spare(ClientKind),
}

/// The kind of local client a connection is for, which decides its upstream session's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// A loopback TLS client: both sessions on rustls's unbuffered API ([`Dial::Lean`]).
    Loopback,
    /// A UNIX-socket client: the upstream session buffered ([`Dial::Buffered`]).
    Unix,
}

impl Dial {
    /// Whether this is a spare's connection.
    pub fn spare(self) -> bool {
        matches!(self, Dial::Spare(_))
    }
}

impl OriginConn {
    /// The buffered connection a UNIX-socket client is relayed with (None: an unbuffered one).
    pub fn into_buffered(self) -> Option<UpstreamConn> {
        match self.origin {
            Origin::Buffered(stream) => Some(UpstreamConn {
                stream,
                alpn: self.alpn,
                resumed: self.resumed,
                sent: self.sent,
            }),
            Origin::Lean(_) | Origin::Loop(_) => None,
        }
    }
}

/// The TLS handshake with `name` over `tcp`, with `first` (a client's first bytes) sealed after
/// the proxy's `Finished`, in its write: on rustls's unbuffered API for a loopback client when
/// `tcp` is plain TCP, buffered otherwise. A spare sends nothing, refuses signatures and takes
/// in the ticket its server sends back. Returns the session and how many bytes of `first` went
/// (all of them, unless a buffered session's buffer was full).
pub(super) async fn handshake(
    tcp: Tunnel,
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    first: &[u8],
    how: Dial,
) -> io::Result<(Origin, usize)> {
    match (tcp, how) {
        (Tunnel::Tcp(tcp), Dial::Lean | Dial::Spare(ClientKind::Loopback)) => {
            let session = UnbufferedClientConnection::new(config, name).map_err(tls_error)?;
            let mut conn = Lean::new(tcp, session, Vec::new());
            if how.spare() {
                conn.refuse_signatures();
            }
            conn.handshake_sending(first).await?;
            if how.spare() {
                // The ticket the server sends back, for the client that waits for it.
                conn.take_in(NEW_TICKET_WAIT, |s| s.tls13_tickets_received() > 0)
                    .await?;
            }
            Ok((Origin::Lean(Box::new(conn)), first.len()))
        }
        (tcp @ Tunnel::Tcp(_), Dial::Spare(ClientKind::Unix)) => {
            let connect =
                tokio_rustls::TlsConnector::from(config).connect(name, ReadAhead::new(tcp));
            let mut connect = std::pin::pin!(connect);
            // Each step of the handshake runs with hardware signatures refused.
            let mut stream = std::future::poll_fn(|cx| {
                crate::key::tls::without_signatures(|| connect.as_mut().poll(cx))
            })
            .await?;
            take_in(&mut stream, NEW_TICKET_WAIT).await?;
            Ok((Origin::Buffered(Box::new(stream)), 0))
        }
        // A spare's handshake refuses signatures only over plain TCP: a TLS-in-TLS session's
        // outer handshake is another one.
        (_, Dial::Spare(_)) => Err(io::Error::other(
            "no spare connection through an https:// forward proxy",
        )),
        (tcp, _) => {
            let mut sent = 0;
            let queue_first = |c: &mut rustls::ClientConnection| {
                // Buffered by rustls until the handshake completes (a full buffer takes less).
                if !first.is_empty() {
                    sent = io::Write::write(&mut c.writer(), first).unwrap_or(0);
                }
            };
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect_with(name, ReadAhead::new(tcp), queue_first)
                .await?;
            Ok((Origin::Buffered(Box::new(stream)), sent))
        }
    }
}

/// [`Lean::take_in`] for a buffered session: waits up to `within` for the session ticket the
/// server sends after the handshake, giving the session what arrives. Returns as soon as a
/// ticket is in (a ticket split over reads is waited for whole), and the read-ahead holds no
/// buffer afterwards.
async fn take_in(stream: &mut TlsStream<ReadAhead<Tunnel>>, within: Duration) -> io::Result<()> {
    // Go's server sends its ticket with its `Finished` when resuming: taken in already.
    if stream.get_ref().1.tls13_tickets_received() > 0 {
        return Ok(());
    }
    let mut chunk = [0u8; TICKETS_READ];
    let read = std::future::poll_fn(|cx| loop {
        let (io, session) = stream.get_mut();
        let mut buf = ReadBuf::new(&mut chunk);
        match Pin::new(io).poll_read(cx, &mut buf) {
            Poll::Ready(Ok(())) if buf.filled().is_empty() => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection right after the TLS handshake",
                )))
            }
            Poll::Ready(Ok(())) => {
                let mut bytes = buf.filled();
                while !bytes.is_empty() {
                    if session.read_tls(&mut bytes)? == 0 {
                        return Poll::Ready(Err(io::Error::other("the TLS session took no bytes")));
                    }
                    let state = session.process_new_packets().map_err(tls_error)?;
                    if state.peer_has_closed() {
                        return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                    }
                }
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            // Everything that came is read (the read-ahead gave its buffer back).
            Poll::Pending if session.tls13_tickets_received() > 0 => return Poll::Ready(Ok(())),
            Poll::Pending => return Poll::Pending,
        }
    });
    match tokio::time::timeout(within, read).await {
        Ok(r) => r,
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use support::ca::TestCa;
    use support::servers::GoTlsServer;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const VERSION: &[u8] = b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

    /// A client of `ca`'s server with a software key (a spare's refusal is for hardware keys:
    /// the first connection here signs in software).
    fn client_config(ca: &TestCa, dir: &std::path::Path) -> Arc<ClientConfig> {
        let (cert, key) = ca.client_cert(dir, "alice", "alice", None);
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(ca.ca_der())).unwrap();
        let chain = CertificateDer::pem_file_iter(cert)
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    async fn dial(port: u16) -> Tunnel {
        Tunnel::Tcp(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        )
    }

    /// `GET /version` on an established connection: the answer.
    async fn ask(origin: Origin) -> String {
        let mut io: Box<dyn super::super::bridge::ClientIo> = match origin {
            Origin::Lean(lean) => lean,
            Origin::Buffered(stream) => stream,
            Origin::Loop(_) => panic!("the handshake here makes no loop spare"),
        };
        io.write_all(VERSION).await.unwrap();
        io.flush().await.unwrap();
        let mut answer = Vec::new();
        io.read_to_end(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// Go's server (kube-apiserver's TLS stack) sends a resumed session's ticket with its
    /// `Finished`: a spare of either kind has it when its handshake ends, and waits for none.
    /// The clock is paused around the spare's handshake, so a wait for a ticket would show as
    /// the clock moving on by the whole wait (tokio advances a paused clock to the next timer
    /// whenever the runtime has nothing to do), on any machine. Before, each spare read on
    /// for 250 ms after its ticket had come, and was ready for no client in that time.
    #[tokio::test(flavor = "current_thread")]
    async fn a_spare_waits_for_no_ticket_go_sent_with_its_finished() {
        // Its buffered spare holds a counted read-ahead buffer, which a test asserting that
        // none is held (`proxy::relay`'s) saw when both ran at once.
        let _serial = crate::proxy::buffers::TEST_SERIAL.lock().await;
        let dir = support::temp_dir();
        let ca = TestCa::new(dir.path());
        let (cert, key) = ca.server_cert(dir.path());
        let go = GoTlsServer::start(&cert, &key, &ca.ca_path());
        let config = client_config(&ca, dir.path());
        let name = ServerName::try_from("localhost").unwrap();
        // A full handshake; its ticket comes after it, before the answer.
        let tcp = dial(go.port()).await;
        let (first, _) = handshake(tcp, config.clone(), name.clone(), VERSION, Dial::Buffered)
            .await
            .unwrap();
        let mut io = match first {
            Origin::Buffered(s) => s,
            Origin::Lean(_) | Origin::Loop(_) => panic!("asked for a buffered session"),
        };
        let mut answer = Vec::new();
        io.read_to_end(&mut answer).await.unwrap();
        assert!(String::from_utf8_lossy(&answer).contains("\"user\":\"alice\""));

        for kind in [ClientKind::Unix, ClientKind::Loopback, ClientKind::Unix] {
            let tcp = dial(go.port()).await;
            tokio::time::pause();
            let start = tokio::time::Instant::now();
            let (spare, sent) =
                handshake(tcp, config.clone(), name.clone(), b"", Dial::Spare(kind))
                    .await
                    .unwrap();
            let waited = start.elapsed();
            tokio::time::resume();
            assert_eq!(sent, 0);
            assert_eq!(
                spare.state().handshake_kind(),
                Some(rustls::HandshakeKind::Resumed),
                "{kind:?}"
            );
            assert_eq!(
                waited,
                Duration::ZERO,
                "the {kind:?} spare waited for a ticket it had"
            );
            let answer = ask(spare).await;
            assert!(answer.contains("\"resumed\":true"), "{answer}");
        }
    }
}
