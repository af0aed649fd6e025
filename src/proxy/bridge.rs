//! The data path: connect upstream for an authenticated local client, then copy bytes both
//! ways until either side closes: on a relay loop ([`super::relay_loop`], no runtime per
//! event) for a UNIX-socket or loopback TLS client whose upstream is a plain TCP connection, on
//! the connection's task for the others ([`super::relay`]: an upstream through an `https://`
//! forward proxy, or a proxy run without loops); both hold a copy buffer only while bytes are
//! in flight. No HTTP parsing, so HTTP/1.1, HTTP/2,
//! watches and protocol upgrades (exec, attach, port-forward) pass untouched.
//!
//! The one place the proxy writes HTTP itself is a failure before any byte was forwarded
//! ([`super::failure`]: a `502` with a Kubernetes `Status` naming the cause, over HTTP/1.1 or
//! HTTP/2).
//!
//! Runs on the connection's task until the connection is established. On a relay loop, the loop
//! watches the idle timeout and the certificate's retirement and, when the connection ends,
//! gives back what it [`Held`] and counts its bytes; the task has ended long before. On the
//! task, the task does all that. The half-close of one direction is passed on (`shutdown`), so
//! request bodies ending early work.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{watch, OwnedSemaphorePermit};

use super::cutoff::{cutoff, say_retired, Cutoff, Deadlines};
use super::idle::LastActivity;
use super::lifetime::ConnGuard;
use super::metrics::Metrics;
use super::preconnect::Looked;
use super::relay_loop::{OnEnd, Outcome, Pair, RelayLoops, TlsPair, UpstreamStream, Watch};
use super::rotation::{CertEpoch, RotationClose};
use super::unbuffered::Lean;
use super::unix_client::ClientUnixStream;
use super::upstream::{ClientKind, Origin, Upstream};
use super::write_through::write_through;
use crate::egress::Tunnel;

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
    /// The event loops that relay established connections, UNIX-socket and loopback TLS
    /// (None: every connection stays on its task, [`super::relay`]).
    pub relay_loops: Option<Arc<RelayLoops>>,
}

/// What an authenticated connection holds while it is open: its `--max-connections` slot, and
/// its place in the open connections (`--idle-exit`, the drain at a stop). Given back when the
/// connection ends, on whichever thread ends it.
pub struct Held {
    /// The slot.
    pub slot: OwnedSemaphorePermit,
    /// The open connection's count.
    pub active: ConnGuard,
}

/// A loopback TLS client's session, handshake done and credential checked.
pub type LoopbackClient = Lean<rustls::server::UnbufferedServerConnection>;

impl Bridge {
    /// Connects upstream for a UNIX-socket client offering `alpn`, replays `prefix` (bytes
    /// already read from the client), then bridges until both directions are done: once
    /// established, the connection moves to a relay loop ([`super::relay_loop`]) when the proxy
    /// runs them.
    pub async fn serve_unix(
        &self,
        client: ClientUnixStream,
        prefix: Vec<u8>,
        alpn: Option<Vec<u8>>,
        held: Held,
    ) {
        serve(self, client, prefix, alpn, held, Looked::Nothing).await
    }

    /// [`Bridge::serve_unix`] for a client whose connection a relay loop began to open, as
    /// far as `looked` says ([`Upstream::connect_unix`]).
    pub async fn serve_unix_after(
        &self,
        client: ClientUnixStream,
        prefix: Vec<u8>,
        alpn: Option<Vec<u8>>,
        held: Held,
        looked: Looked,
    ) {
        serve(self, client, prefix, alpn, held, looked).await
    }

    /// [`Bridge::serve_unix`] for a loopback TLS client (its handshake done and its credential
    /// checked): what its session opened already (a request that came with the client's
    /// `Finished`) goes upstream with the proxy's own `Finished`, as a UNIX client's first
    /// bytes do. Over plain TCP both sessions are on rustls's unbuffered API, and the
    /// connection moves to a relay loop with both ([`super::relay_loop`]); through an
    /// `https://` forward proxy it is relayed on this task.
    pub async fn serve_loopback(
        &self,
        mut client: Box<LoopbackClient>,
        alpn: Option<Vec<u8>>,
        held: Held,
    ) {
        let first = client.take_opened();
        let epoch = self.upstream.epoch();
        let connected = Box::pin(self.upstream.connect_loopback(alpn.as_deref(), &first)).await;
        let conn = match connected {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "upstream connection failed");
                Box::pin(super::failure::tell_client(
                    client,
                    first,
                    alpn.as_deref(),
                    &e,
                ))
                .await;
                return;
            }
        };
        // The next client's, made ahead while clients come in a burst (this one is
        // authenticated).
        super::preconnect::preconnect(&self.upstream, alpn.as_deref(), ClientKind::Loopback);
        let rest = first.get(conn.sent..).unwrap_or_default();
        let replayed = first.len() as u64;
        match conn.origin {
            Origin::Lean(mut up) => {
                if !rest.is_empty() {
                    if let Err(e) = up.seal(rest) {
                        tracing::debug!(error = %e, "could not seal the first bytes for the upstream");
                        return;
                    }
                }
                drop(first);
                self.relay_lean(client, up, (replayed, epoch), held).await;
            }
            Origin::Buffered(mut up) => {
                if !rest.is_empty() {
                    if let Err(e) = up.write_all(rest).await {
                        tracing::debug!(error = %e, "upstream closed before the first bytes were forwarded");
                        return;
                    }
                }
                drop(first);
                self.relay_on_task(client, up, replayed, epoch, held).await;
            }
            // Made by a relay loop for a UNIX-socket client, and kept in that kind's place
            // only: never given to a loopback client.
            Origin::Loop(spare) => {
                spare.close();
                tracing::error!("a UNIX-socket client's spare was given to a loopback client (a bug); the client is closed");
            }
        }
    }

    /// A loopback connection whose two sessions are unbuffered: to a relay loop, or on this
    /// task when the proxy runs none. `replayed` bytes went upstream with the handshake.
    async fn relay_lean(
        &self,
        client: Box<LoopbackClient>,
        mut up: Box<Lean<rustls::client::UnbufferedClientConnection>>,
        (replayed, epoch): (u64, CertEpoch),
        held: Held,
    ) {
        match self.relay_loops.as_deref() {
            Some(loops) => {
                let end = ending(self, epoch, replayed, held);
                in_loop_tls(loops, *client, *up, end);
            }
            None => {
                // What was sealed after the handshake goes now, not with the client's next
                // bytes.
                if let Err(e) = up.flush().await {
                    tracing::debug!(error = %e, "upstream closed before the first bytes were forwarded");
                    return;
                }
                self.relay_on_task(client, up, replayed, epoch, held).await
            }
        }
    }

    /// Relays on this task until both directions end; counts the bytes and gives back what
    /// the connection held.
    async fn relay_on_task(
        &self,
        client: Box<dyn ClientIo>,
        up: Box<dyn ClientIo>,
        replayed: u64,
        epoch: CertEpoch,
        held: Held,
    ) {
        let (to_upstream, to_client) = on_task(self, client, up, epoch).await;
        self.metrics.bytes(to_upstream + replayed, to_client);
        drop(held);
    }
}

async fn serve(
    shared: &Bridge,
    client: ClientUnixStream,
    prefix: Vec<u8>,
    alpn: Option<Vec<u8>>,
    held: Held,
    looked: Looked,
) {
    // The certificate this connection is opened with (read before the handshake: if a rotation
    // races it, the connection is attributed to the older one and ends earlier, never later).
    let epoch = shared.upstream.epoch();
    // Boxed: the connect and handshake state lives on the heap only while it runs, not in this
    // task's state for the connection's whole life (memory per idle connection, docs/BENCHMARKS.md).
    // Each attempt (one per API server, at most) has the handshake timeout.
    let connecting = shared
        .upstream
        .connect_unix(alpn.as_deref(), &prefix, looked);
    let connected = Box::pin(connecting).await;
    let upstream = match connected {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "upstream connection failed");
            // Boxed: the HTTP/2 answer's state is large and only this rare path needs it; inline, it
            // would sit in every connection task's state for the connection's whole life.
            Box::pin(super::failure::tell_client(
                Box::new(client),
                prefix,
                alpn.as_deref(),
                &e,
            ))
            .await;
            return;
        }
    };
    // The next client's, made ahead while clients come in a burst (this one is authenticated).
    super::preconnect::preconnect(&shared.upstream, alpn.as_deref(), ClientKind::Unix);
    let mut up = upstream.stream;
    // The first bytes went with the handshake's last flight; what rustls could not hold, now.
    if let Some(rest) = prefix.get(upstream.sent..).filter(|r| !r.is_empty()) {
        if let Err(e) = up.write_all(rest).await {
            tracing::debug!(error = %e, "upstream closed before the first bytes were forwarded");
            return;
        }
    }
    // Freed before the relay: the first read's buffer (up to a record's plaintext) would
    // otherwise stay with the connection for its whole life.
    let replayed = prefix.len() as u64;
    drop(prefix);
    relay_unix(shared, client, up, (replayed, epoch), held).await
}

/// A UNIX-socket client's established connection: to a relay loop over plain TCP, on this
/// task otherwise. `replayed` bytes went upstream before.
async fn relay_unix(
    shared: &Bridge,
    client: ClientUnixStream,
    up: Box<UpstreamStream>,
    (replayed, epoch): (u64, CertEpoch),
    held: Held,
) {
    let loops = shared
        .relay_loops
        .as_deref()
        .filter(|_| matches!(up.get_ref().0.get_ref(), Tunnel::Tcp(_)));
    match loops {
        Some(loops) => {
            let end = ending(shared, epoch, replayed, held);
            in_loop(loops, client, up, end);
        }
        None => {
            shared
                .relay_on_task(Box::new(client), up, replayed, epoch, held)
                .await
        }
    }
}

/// When the proxy ends a connection opened with the certificate of `epoch`. Made by the future
/// that awaits it, not passed in: an argument moved into an awaited future keeps its space in
/// the caller's state too, for the connection's whole life.
fn deadlines(shared: &Bridge, epoch: CertEpoch) -> Deadlines {
    Deadlines {
        idle: shared.idle_timeout,
        epochs: shared.upstream.epochs(),
        used: epoch,
        mode: shared.rotation_close,
    }
}

/// Relays on this task ([`super::relay`]) until both directions end, the idle timeout or the
/// certificate's retirement; returns the bytes read from each side.
async fn on_task(
    shared: &Bridge,
    client: Box<dyn ClientIo>,
    up: Box<dyn ClientIo>,
    epoch: CertEpoch,
) -> (u64, u64) {
    let last = Arc::new(LastActivity::default());
    let mut a = Tracked::new(client, last.clone());
    let mut b = Tracked::new(up, last.clone());
    let copy = super::relay::copy_bidirectional(&mut a, &mut b);
    let outcome = tokio::select! {
        r = copy => r.map(|_| ()),
        cut = cutoff(deadlines(shared, epoch), &last) => {
            say_retired(usize::from(cut == Cutoff::Retired));
            Err(cut.error())
        }
    };
    if let Err(e) = outcome {
        tracing::debug!(error = %e, "connection ended with an error");
    }
    (a.bytes(), b.bytes())
}

/// What ends a connection on a relay loop besides its two sides (its idle timeout, the
/// retirement of the certificate of `epoch`), and what the loop does at its end: count its
/// bytes (`replayed` went upstream before the loop had it) and give back what it `held`.
pub(super) fn ending(
    shared: &Bridge,
    epoch: CertEpoch,
    replayed: u64,
    held: Held,
) -> (Watch, OnEnd) {
    let metrics = shared.metrics.clone();
    let on_end: OnEnd = Box::new(move |outcome: Outcome| {
        if let Err(e) = &outcome.result {
            tracing::debug!(error = %e, "connection ended with an error");
        }
        metrics.bytes(outcome.up + replayed, outcome.down);
        drop(held);
    });
    let watch = Watch {
        idle: shared.idle_timeout,
        epoch,
        mode: shared.rotation_close,
    };
    (watch, on_end)
}

/// Moves the connection to a relay loop, which relays it until both sides end or its [`Watch`]
/// ends it, and then runs its [`OnEnd`] (on the loop's thread). When the sockets cannot be taken
/// from the runtime or no loop runs, the connection is closed and its `OnEnd` dropped unrun
/// (what it holds is given back).
fn in_loop(
    loops: &RelayLoops,
    client: ClientUnixStream,
    up: Box<UpstreamStream>,
    (watch, on_end): (Watch, OnEnd),
) {
    let pair = match Pair::from_runtime(client, up) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "could not move a connection to a relay loop; closed");
            return;
        }
    };
    if !loops.hand_off(pair, watch, on_end) {
        tracing::warn!(
            "no relay loop runs (the proxy is stopping, or a loop failed); connection closed"
        );
    }
}

/// [`in_loop`] for a loopback TLS client's connection, both sessions unbuffered.
fn in_loop_tls(
    loops: &RelayLoops,
    client: LoopbackClient,
    up: Lean<rustls::client::UnbufferedClientConnection>,
    (watch, on_end): (Watch, OnEnd),
) {
    let pair = match client.into_parts().and_then(|client| {
        Ok(TlsPair {
            client,
            upstream: up.into_parts()?,
        })
    }) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "could not move a connection to a relay loop; closed");
            return;
        }
    };
    match loops.hand_off_tls(pair, watch, on_end) {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            "no relay loop runs (the proxy is stopping, or a loop failed); connection closed"
        ),
        Err(e) => tracing::warn!(error = %e, "could not move a connection to a relay loop; closed"),
    }
}

impl Bridge {
    /// Under `--rotation-close immediate`, the task that tells the relay loops of every
    /// certificate installed, until `stop`, so that they end the connections opened with an
    /// older one at once (None: nothing to tell them).
    pub fn retirements(
        &self,
        stop: watch::Receiver<bool>,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        let loops = self.relay_loops.clone()?;
        (self.rotation_close == RotationClose::Immediate)
            .then(|| retire_on_rotation(self.upstream.epochs(), loops, stop))
    }
}

/// Tells `loops` of every certificate installed from now on, until `stop`.
async fn retire_on_rotation(
    mut epochs: watch::Receiver<CertEpoch>,
    loops: Arc<RelayLoops>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            changed = epochs.changed() => {
                if changed.is_err() {
                    return;
                }
                let newest = epochs.borrow_and_update().generation;
                loops.retire(newest);
            }
            _ = stop.wait_for(|s| *s) => return,
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
