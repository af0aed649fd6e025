//! Makes the spare upstream connections [`super::spare`] keeps: after an authenticated
//! loopback client's connection, one for the next client while clients come in a burst, on
//! the connection thread's runtime, off that client's path.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::error::UpstreamError;
use super::metrics::SpareOutcome;
use super::origin::{Dial, Origin, OriginConn};
use super::spare::MAX_AGE;
use super::upstream::Upstream;

/// How long closing an aged-out spare may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// After an authenticated loopback client's upstream connection offering `alpn`: makes the
/// next client's on this connection thread's runtime, if clients come in a burst (see the
/// module comment). Returns at once.
pub fn preconnect(upstream: &Arc<Upstream>, alpn: Option<&[u8]>) {
    if !upstream.spares().begin(alpn) {
        return;
    }
    let upstream = upstream.clone();
    let alpn = alpn.map(<[u8]>::to_vec);
    tokio::spawn(async move { fill(&upstream, alpn).await });
}

/// Makes a spare, keeps it for [`MAX_AGE`], and closes it then if nobody took it.
async fn fill(upstream: &Upstream, alpn: Option<Vec<u8>>) {
    let spares = upstream.spares();
    let alpn = alpn.as_deref();
    let made_with = (upstream.epoch(), spares.era());
    // Boxed: the connection's state lives on the heap while it is made, not in this task's
    // for as long as it then waits.
    let conn = match Box::pin(upstream.connect_any(alpn, &[], Dial::Spare)).await {
        Ok(conn) if matches!(conn.origin, Origin::Lean(_)) => conn,
        Ok(_) => return spares.failed(alpn, (false, true)),
        Err(UpstreamError::NoTicket) => return spares.failed(alpn, (false, false)),
        Err(e) => {
            tracing::debug!(error = %e, "no spare upstream connection; none tried for a while");
            return spares.failed(alpn, (true, false));
        }
    };
    let Some(serial) = spares.put(alpn, conn, made_with) else {
        return;
    };
    // Until it ages out, or a client takes it (then this task ends at once).
    let _ = tokio::time::timeout(MAX_AGE, spares.gone(serial)).await;
    let Some(OriginConn {
        origin: Origin::Lean(mut lean),
        ..
    }) = spares.expire(alpn, serial)
    else {
        return;
    };
    spares.metrics.spare(SpareOutcome::Expired);
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, lean.shutdown()).await;
}
