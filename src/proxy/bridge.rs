//! The data path: connect upstream for an authenticated local client, then copy bytes both
//! ways until either side closes ([`super::relay`], which holds a copy buffer only while bytes
//! are in flight). No HTTP parsing, so HTTP/1.1, HTTP/2,
//! watches and protocol upgrades (exec, attach, port-forward) pass untouched.
//!
//! The one place the proxy writes HTTP itself is a failure before any byte was forwarded
//! ([`super::failure`]: a `502` with a Kubernetes `Status` naming the cause, over HTTP/1.1 or
//! HTTP/2).
//!
//! Runs on the connection's task. The idle timeout is watched by the same task; the half-close
//! of one direction is passed on (`shutdown`), so request bodies ending early work.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::metrics::Metrics;
use super::rotation::RotationClose;
use super::upstream::Upstream;
use super::write_through::write_through;

/// A local client's stream: loopback TLS or a UNIX socket.
pub trait ClientIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> ClientIo for T {}

/// What bridging a connection needs.
pub struct Bridge {
    /// The connector to the API server.
    pub upstream: Arc<Upstream>,
    /// Bytes moved.
    pub metrics: Arc<Metrics>,
    /// Close a connection after this long without a byte (None: never).
    pub idle_timeout: Option<Duration>,
    /// When a connection opened with a replaced certificate ends.
    pub rotation_close: RotationClose,
}

impl Bridge {
    /// Connects upstream offering `alpn`, replays `prefix` (bytes already read from the client),
    /// then bridges until both directions are done.
    pub async fn serve(&self, client: Box<dyn ClientIo>, prefix: Vec<u8>, alpn: Option<Vec<u8>>) {
        serve(self, client, prefix, alpn).await
    }
}

async fn serve(shared: &Bridge, client: Box<dyn ClientIo>, prefix: Vec<u8>, alpn: Option<Vec<u8>>) {
    // The certificate this connection is opened with (read before the handshake: if a rotation
    // races it, the connection is attributed to the older one and ends earlier, never later).
    let epoch = shared.upstream.epoch();
    // Boxed: the connect and handshake state lives on the heap only while it runs, not in this
    // task's state for the connection's whole life (memory per idle connection, docs/BENCHMARKS.md).
    // Each attempt (one per API server, at most) has the handshake timeout.
    let connected = Box::pin(shared.upstream.connect(alpn.as_deref())).await;
    let upstream = match connected {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "upstream connection failed");
            // Boxed: the HTTP/2 answer's state is large and only this rare path needs it; inline, it
            // would sit in every connection task's state for the connection's whole life.
            Box::pin(super::failure::tell_client(
                client,
                prefix,
                alpn.as_deref(),
                &e,
            ))
            .await;
            return;
        }
    };
    let mut up = upstream.stream;
    if !prefix.is_empty() {
        if let Err(e) = up.write_all(&prefix).await {
            tracing::debug!(error = %e, "upstream closed before the first bytes were forwarded");
            return;
        }
    }
    let last = Arc::new(LastActivity::new());
    let mut a = Tracked::new(client, last.clone());
    let mut b = Tracked::new(up, last.clone());
    let copy = super::relay::copy_bidirectional(&mut a, &mut b);
    let idle = async {
        match shared.idle_timeout {
            Some(limit) => last.idle(limit).await,
            None => std::future::pending::<()>().await,
        }
    };
    let retired = super::rotation::retire(shared.upstream.epochs(), epoch, shared.rotation_close);
    let outcome = tokio::select! {
        r = copy => r.map(|_| ()),
        _ = idle => Err(io::Error::new(io::ErrorKind::TimedOut, "idle timeout")),
        _ = retired => {
            tracing::info!("closing a connection opened with a certificate that was replaced or has expired");
            Err(io::Error::other("certificate rotated"))
        }
    };
    if let Err(e) = outcome {
        tracing::debug!(error = %e, "connection ended with an error");
    }
    shared
        .metrics
        .bytes(a.bytes() + prefix.len() as u64, b.bytes());
}

/// When either side last moved a byte, for the idle timeout.
struct LastActivity {
    base: Instant,
    millis: AtomicU64,
}

impl LastActivity {
    fn new() -> LastActivity {
        LastActivity {
            base: Instant::now(),
            millis: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let now = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.millis.store(now, Ordering::Relaxed);
    }

    fn since(&self) -> Duration {
        let last = Duration::from_millis(self.millis.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }

    /// Resolves once nothing moved for `limit`.
    async fn idle(&self, limit: Duration) {
        loop {
            let since = self.since();
            if since >= limit {
                return;
            }
            tokio::time::sleep(limit - since).await;
        }
    }
}

/// A stream that records activity and counts the bytes read from it.
struct Tracked<S> {
    inner: S,
    last: Arc<LastActivity>,
    read: u64,
}

impl<S> Tracked<S> {
    fn new(inner: S, last: Arc<LastActivity>) -> Tracked<S> {
        Tracked {
            inner,
            last,
            read: 0,
        }
    }

    fn bytes(&self) -> u64 {
        self.read
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.read += n as u64;
            self.last.touch();
        }
        r
    }
}

write_through!(Tracked<S>, inner);
