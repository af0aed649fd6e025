//! Makes the spare upstream connections [`super::spare`] keeps: after an authenticated local
//! client's connection, one for the next client of its kind while clients come in a burst, on
//! the connection thread's runtime, off that client's path (a relay loop makes a UNIX-socket
//! client's itself when it needs no wait: [`super::loop_spare`]); and a client's connect, which
//! takes the spare made for it first.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::endpoints::Attempted;
use super::error::UpstreamError;
use super::metrics::SpareOutcome;
use super::origin::{ClientKind, Dial, Origin, OriginConn, UpstreamConn};
use super::spare::MAX_AGE;
use super::threads::Spawner;
use super::upstream::Upstream;

/// How long closing an aged-out spare may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

impl Upstream {
    /// [`Upstream::connect_sending`] for a UNIX-socket client: on the spare made ahead for it
    /// ([`super::spare`]) if there is one, its first bytes then all still to send.
    /// `looked` says how far a relay loop went first: a spare is looked for only when it did
    /// not (a second look would count the client twice for the next spare's making), and
    /// what its attempt left is honoured ([`Upstream::connect_any_after`]).
    pub async fn connect_unix(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
        looked: Looked,
    ) -> Result<UpstreamConn, UpstreamError> {
        let attempted = match looked {
            Looked::Nothing => {
                let spare = self
                    .spares()
                    .take_on_task(alpn, ClientKind::Unix, self.epoch());
                if let Some(conn) = spare.and_then(OriginConn::into_buffered) {
                    return Ok(conn);
                }
                Attempted::default()
            }
            Looked::After(attempted) => attempted,
        };
        self.connect_sending_after(alpn, first, attempted).await
    }

    /// [`Upstream::connect_sending`] for a loopback TLS client's connection: over plain TCP the
    /// session is on rustls's unbuffered API ([`Origin::Lean`]), for a relay loop; through an
    /// `https://` forward proxy it is a buffered one, relayed on the task.
    pub async fn connect_loopback(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
    ) -> Result<OriginConn, UpstreamError> {
        if let Some(spare) = self.spares().take(alpn, ClientKind::Loopback, self.epoch()) {
            return Ok(spare);
        }
        self.connect_any(alpn, first, Dial::Lean).await
    }
}

/// How far a relay loop went with a UNIX-socket client's upstream connection before its task
/// took over ([`super::relay_loop`]).
pub enum Looked {
    /// Not at all: the task looks for a spare first.
    Nothing,
    /// It looked for a spare (none, or none it could use), and maybe tried an endpoint.
    After(Attempted),
}

/// After an authenticated client's upstream connection offering `alpn`: makes the next
/// client's (of the same `kind`) on this connection thread's runtime, if clients come in a
/// burst (see the module comment). Returns at once.
pub fn preconnect(upstream: &Arc<Upstream>, alpn: Option<&[u8]>, kind: ClientKind) {
    if !upstream.spares().begin(alpn, kind) {
        return;
    }
    let upstream = upstream.clone();
    let alpn = alpn.map(<[u8]>::to_vec);
    tokio::spawn(async move { fill(&upstream, alpn, kind).await });
}

/// A spare [`Spares::begin`](super::spare::Spares) marked as being made, made on a
/// connection thread placed by `spawner` for a thread without a runtime (a relay loop that
/// cannot make it itself: it would have to wait for a ticket, a name or a forward proxy).
pub fn fill_from_loop(
    upstream: &Arc<Upstream>,
    alpn: Option<&[u8]>,
    kind: ClientKind,
    spawner: &Spawner,
) {
    let upstream = upstream.clone();
    let alpn = alpn.map(<[u8]>::to_vec);
    spawner.spawn(move || async move { fill(&upstream, alpn, kind).await });
}

/// Makes a spare, keeps it for [`MAX_AGE`], and closes it then if nobody took it.
async fn fill(upstream: &Upstream, alpn: Option<Vec<u8>>, kind: ClientKind) {
    let spares = upstream.spares();
    let alpn = alpn.as_deref();
    let place = (alpn, kind);
    let made_with = (upstream.epoch(), spares.era());
    // Boxed: the connection's state lives on the heap while it is made, not in this task's
    // for as long as it then waits.
    let conn = match Box::pin(upstream.connect_any(alpn, &[], Dial::Spare(kind))).await {
        Ok(conn) => conn,
        Err(UpstreamError::NoTicket) => return spares.failed(place, (false, false)),
        Err(e) => {
            tracing::debug!(error = %e, "no spare upstream connection; none tried for a while");
            return spares.failed(place, (true, false));
        }
    };
    let Some(serial) = spares.put(place, conn, made_with) else {
        return;
    };
    // Until it ages out, or a client takes it (then this task ends at once).
    let _ = tokio::time::timeout(MAX_AGE, spares.gone(serial)).await;
    let Some(conn) = spares.expire(place, serial) else {
        return;
    };
    spares.metrics.spare(SpareOutcome::Expired);
    let close = async {
        match conn.origin {
            Origin::Lean(mut lean) => lean.shutdown().await,
            Origin::Buffered(mut stream) => stream.shutdown().await,
            Origin::Loop(spare) => {
                spare.close();
                Ok(())
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, close).await;
}
