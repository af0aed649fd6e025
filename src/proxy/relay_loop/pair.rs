//! What a connection's task hands to a relay loop (its sockets and TLS state, taken back from
//! the runtime), and what the two share while the loop relays it.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;

use rustls::{ClientConnection, ServerConnection};

use crate::egress::Tunnel;
use crate::proxy::readahead::ReadAhead;
use crate::proxy::unix_client::ClientUnixStream;

/// The upstream's stream as the runtime's handshake left it.
pub type UpstreamStream = tokio_rustls::client::TlsStream<ReadAhead<Tunnel>>;
/// A loopback client's stream as the runtime's handshake left it.
pub type LoopbackStream = tokio_rustls::server::TlsStream<ReadAhead<tokio::net::TcpStream>>;

/// What moves to a loop: an established connection, its two sockets (non-blocking) and the
/// TLS state of each, with the records already read that rustls has not taken yet.
pub struct Pair {
    /// The local client.
    pub client: Local,
    /// The TCP connection to the API server.
    pub upstream: TcpStream,
    /// The TLS connection to the API server, handshake done.
    pub tls: ClientConnection,
    /// Bytes read from `upstream` before the hand-off and not yet given to `tls`.
    pub records: Vec<u8>,
}

/// A relayed connection's local client.
pub enum Local {
    /// A UNIX-socket client, which speaks plaintext.
    Unix(UnixStream),
    /// A loopback client, which speaks TLS the proxy terminates: its handshake is done and its
    /// loopback credential checked before the hand-off. Boxed: a UNIX-socket connection, the
    /// most numerous, does not carry the room of a server connection.
    Tls(Box<LoopbackTls>),
}

/// A loopback client's socket and TLS state.
pub struct LoopbackTls {
    /// The client's TCP connection.
    pub tcp: TcpStream,
    /// The proxy's end of the client's TLS, handshake done.
    pub tls: ServerConnection,
    /// Bytes read from `tcp` before the hand-off and not yet given to `tls`.
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

/// What a connection leaves for its end, run by the loop that ends it, on the loop's thread:
/// whatever it holds (a slot, an activity guard) is given back there.
pub type OnEnd = Box<dyn FnOnce(Outcome) + Send>;

impl Pair {
    /// Takes an established connection's sockets and TLS state back from the runtime: the
    /// client (see [`Local::unix`], [`Local::loopback`]), the upstream's TCP connection (only a
    /// plain one: the caller checks) and the records its read-ahead holds.
    pub fn from_runtime(client: Local, upstream: Box<UpstreamStream>) -> io::Result<Pair> {
        let (ahead, tls) = (*upstream).into_inner();
        let (tunnel, records) = ahead.into_parts();
        let Tunnel::Tcp(tcp) = tunnel else {
            return Err(io::Error::other(
                "the upstream is not a plain TCP connection",
            ));
        };
        Ok(Pair {
            client,
            upstream: tcp.into_std()?,
            tls,
            records,
        })
    }
}

impl Local {
    /// A UNIX-socket client taken back from the runtime.
    pub fn unix(client: ClientUnixStream) -> io::Result<Local> {
        Ok(Local::Unix(client.into_std()?))
    }

    /// A loopback TLS client taken back from the runtime, with the records its read-ahead
    /// holds. The box is taken apart here: moving `*stream` out in the caller would keep the
    /// emptied allocation for the connection's whole life.
    pub fn loopback(stream: Box<LoopbackStream>) -> io::Result<Local> {
        let (ahead, tls) = (*stream).into_inner();
        let (tcp, records) = ahead.into_parts();
        Ok(Local::Tls(Box::new(LoopbackTls {
            tcp: tcp.into_std()?,
            tls,
            records,
        })))
    }
}

impl AsFd for Local {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Local::Unix(s) => s.as_fd(),
            Local::Tls(t) => t.tcp.as_fd(),
        }
    }
}
