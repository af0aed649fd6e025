//! The proxy's decisions on a spare a relay loop makes for the next UNIX-socket client
//! ([`super::relay_loop`]'s `filling`), with the rules of a spare made on a connection thread
//! ([`super::spare`], [`super::preconnect`]): begun only while clients come in a burst, with a
//! ticket claimed (the loop's attempt, [`Upstream::dial_in_loop`]); counted as any handshake;
//! its failure nobody's (spares rest a while); kept with the certificate and era it was begun
//! with; and closed by the loop that made it if nobody took it within [`MAX_AGE`].

use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConnection;

use super::loop_dial::LoopAttempt;
use super::metrics::SpareOutcome;
use super::origin::{ClientKind, Origin, OriginConn};
use super::relay_loop::{Expiry, LoopSpare, SpareDial, SpareJob, Stage};
use super::rotation::CertEpoch;
use super::sessions::SpareClaim;
use super::spare::MAX_AGE;
use super::threads::Spawner;
use super::upstream::Upstream;

/// After an authenticated UNIX-socket client's upstream connection offering `alpn`: the spare
/// for the next one, if one is wanted ([`super::spare::Spares`]), to make on the loop when it
/// needs no wait; made on a connection thread placed by `spawner` when it would (no ticket in
/// hand, an API server named by a host name or behind a forward proxy).
pub fn spare_for_loop(
    upstream: &Arc<Upstream>,
    alpn: &[u8],
    spawner: &Spawner,
) -> Option<SpareDial> {
    let spares = upstream.spares();
    if !spares.begin(Some(alpn), ClientKind::Unix) {
        return None;
    }
    let made_with = (upstream.epoch(), spares.era());
    let Ok(dial) = upstream.dial_in_loop(Some(alpn), true) else {
        super::preconnect::fill_from_loop(upstream, Some(alpn), ClientKind::Unix, spawner);
        return None;
    };
    let job = LoopFill {
        upstream: upstream.clone(),
        alpn: alpn.to_vec(),
        attempt: Some(dial.attempt),
        made_with,
        _claim: dial.claim,
        told: false,
    };
    Some(SpareDial {
        tcp: dial.tcp,
        session: dial.session,
        within: dial.within,
        job: Box::new(job),
    })
}

/// A spare being made on a loop.
struct LoopFill {
    upstream: Arc<Upstream>,
    alpn: Vec<u8>,
    /// Until its handshake is done.
    attempt: Option<LoopAttempt>,
    /// The certificate and the spares' era it was begun with.
    made_with: (CertEpoch, u64),
    /// Its ticket's claim, held until it is kept or has failed (dropped with this job): a
    /// client that finds no ticket meanwhile waits for the one this spare brings back.
    _claim: Option<SpareClaim>,
    /// The spares were told how it ended (kept or failed); if not when it is dropped (a bug
    /// in the loop, the loop's end), they are told it failed, so spares go on being made.
    told: bool,
}

impl LoopFill {
    fn place(&self) -> (Option<&[u8]>, ClientKind) {
        (Some(&self.alpn), ClientKind::Unix)
    }
}

impl Drop for LoopFill {
    fn drop(&mut self) {
        if !self.told {
            self.upstream.spares().failed(self.place(), (false, false));
        }
    }
}

impl SpareJob for LoopFill {
    fn established(&mut self, session: &ClientConnection) -> bool {
        let Some(attempt) = self.attempt.take() else {
            return false;
        };
        let upstream = &self.upstream;
        match upstream.loop_established(&attempt, Some(&self.alpn), session) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "no spare upstream connection; none tried for a while");
                upstream.spares().failed(self.place(), (true, false));
                self.told = true;
                false
            }
        }
    }

    fn failed(mut self: Box<Self>, stage: Stage, error: std::io::Error) {
        let quiet = match self.attempt.take() {
            Some(attempt) => {
                let alpn = Some(self.alpn.as_slice());
                self.upstream.loop_spare_failed(attempt, alpn, stage, error)
            }
            // Established already: waiting for its ticket, the API server closed it.
            None => true,
        };
        self.upstream.spares().failed(self.place(), (quiet, false));
        self.told = true;
    }

    fn keep(mut self: Box<Self>, spare: LoopSpare) -> Option<(Duration, Expiry)> {
        let conn = OriginConn {
            alpn: spare.session.alpn_protocol().map(<[u8]>::to_vec),
            resumed: spare.session.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
            origin: Origin::Loop(Box::new(spare)),
            sent: 0,
        };
        self.told = true;
        let serial = self
            .upstream
            .spares()
            .put(self.place(), conn, self.made_with)?;
        // Its claim is dropped with this job, here: the expiry holds only what closes it.
        let (upstream, alpn) = (self.upstream.clone(), std::mem::take(&mut self.alpn));
        let expiry: Expiry = Box::new(move || {
            let spares = upstream.spares();
            let Some(conn) = spares.expire((Some(&alpn), ClientKind::Unix), serial) else {
                return;
            };
            spares.metrics.spare(SpareOutcome::Expired);
            if let Origin::Loop(spare) = conn.origin {
                spare.close();
            }
        });
        Some((MAX_AGE, expiry))
    }
}
