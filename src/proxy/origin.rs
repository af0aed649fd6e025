//! An upstream connection's TLS as the connector makes it: on rustls's unbuffered API for a
//! relay loop ([`super::unbuffered`]), or buffered (tokio-rustls, over the read-ahead) for the
//! runtime's path and for the proxy's own requests.

use std::io;
use std::sync::Arc;

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio_rustls::client::TlsStream;

use super::readahead::ReadAhead;
use super::unbuffered::{tls_error, Lean, Session};
use crate::egress::Tunnel;

/// An established upstream connection for a loopback TLS client ([`Upstream::connect_loopback`]).
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
        }
    }
}

/// How long a spare waits after its handshake for the session ticket its server sends (Go's
/// server sends it with its `Finished` when resuming; others one round trip later).
const NEW_TICKET_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// How an upstream connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dial {
    /// Buffered (tokio-rustls): for the runtime's path and the proxy's own requests.
    Buffered,
    /// On rustls's unbuffered API over plain TCP, for a loopback client on a relay loop.
    Lean,
    /// [`Dial::Lean`] for a spare ([`super::spare`]): only with a session ticket to resume.
    Spare,
}

/// The TLS handshake with `name` over `tcp`, with `first` (a client's first bytes) sealed after
/// the proxy's `Finished`, in its write: on rustls's unbuffered API unless [`Dial::Buffered`], when `tcp` is
/// plain TCP, buffered otherwise. Returns the session and how many bytes of `first` went (all
/// of them, unless a buffered session's buffer was full).
pub(super) async fn handshake(
    tcp: Tunnel,
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    first: &[u8],
    how: Dial,
) -> io::Result<(Origin, usize)> {
    match tcp {
        Tunnel::Tcp(tcp) if how != Dial::Buffered => {
            let session = UnbufferedClientConnection::new(config, name).map_err(tls_error)?;
            let mut conn = Lean::new(tcp, session, Vec::new());
            if how == Dial::Spare {
                conn.refuse_signatures();
            }
            conn.handshake_sending(first).await?;
            if how == Dial::Spare {
                // The ticket the server sends back, for the client that waits for it.
                conn.take_in(NEW_TICKET_WAIT).await?;
            }
            Ok((Origin::Lean(Box::new(conn)), first.len()))
        }
        // Only the unbuffered session's handshake runs with signatures refused.
        _ if how == Dial::Spare => Err(io::Error::other(
            "no spare connection through an https:// forward proxy",
        )),
        tcp => {
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
