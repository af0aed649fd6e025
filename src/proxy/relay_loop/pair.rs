//! What a connection's task hands to a relay loop (its sockets and TLS state, taken back from
//! the runtime), and what the two share while the loop relays it.

use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

use rustls::ClientConnection;

use crate::egress::Tunnel;
use crate::proxy::readahead::ReadAhead;
use crate::proxy::unix_client::ClientUnixStream;

/// The upstream's stream as the runtime's handshake left it.
pub type UpstreamStream = tokio_rustls::client::TlsStream<ReadAhead<Tunnel>>;

/// What moves to a loop for a UNIX-socket client: an established connection, its two sockets
/// (non-blocking) and the upstream's TLS state, with the records already read that rustls has
/// not taken yet.
pub struct Pair {
    /// The local client, which speaks plaintext.
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

/// What a connection leaves for its end, run by the loop that ends it, on the loop's thread:
/// whatever it holds (a slot, an activity guard) is given back there.
pub type OnEnd = Box<dyn FnOnce(Outcome) + Send>;

impl Pair {
    /// Takes an established connection's sockets and TLS state back from the runtime: the
    /// UNIX-socket client, the upstream's TCP connection (only a plain one: the caller checks)
    /// and the records its read-ahead holds.
    pub fn from_runtime(
        client: ClientUnixStream,
        upstream: Box<UpstreamStream>,
    ) -> io::Result<Pair> {
        let (upstream, tls, records) = upstream_parts(upstream)?;
        Ok(Pair {
            client: client.into_std()?,
            upstream,
            tls,
            records,
        })
    }
}

/// An established upstream connection's socket and TLS state, taken back from the runtime
/// (only a plain TCP one), with the records its read-ahead holds.
pub fn upstream_parts(
    upstream: Box<UpstreamStream>,
) -> io::Result<(TcpStream, ClientConnection, Vec<u8>)> {
    let (ahead, tls) = (*upstream).into_inner();
    let (tunnel, records) = ahead.into_parts();
    let Tunnel::Tcp(tcp) = tunnel else {
        return Err(io::Error::other(
            "the upstream is not a plain TCP connection",
        ));
    };
    Ok((tcp.into_std()?, tls, records))
}
