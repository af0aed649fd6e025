//! The upstream side of a connection a relay loop opens itself ([`super::relay_loop`], for a
//! UNIX-socket client): which API server, whether its session can resume without a wait, and
//! what the attempt's end means, with the same rules and counts as [`Upstream::connect_any`].
//!
//! A loop never waits for the hardware, for a ticket or for a name to resolve, so it takes
//! only what needs none of them: an API server named by its address, reached straight (no
//! forward proxy), with a session ticket in the store now. Anything else, and an attempt that
//! fails, goes on on a connection thread as before.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rustls::ClientConnection;

use super::endpoints::endpoint_failure;
use super::endpoints::Attempted;
use super::error::UpstreamError;
use super::metrics::UpstreamStage;
use super::relay_loop::Stage;
use super::sessions::{taking_ticket, SpareClaim};
use super::upstream::Upstream;

/// A relay loop's attempt: a TCP connect under way and a session to resume, to one endpoint.
pub struct LoopDial {
    /// The TCP connection, non-blocking, its connect under way.
    pub tcp: std::net::TcpStream,
    /// The session, its ClientHello (with the ticket) queued.
    pub session: Box<ClientConnection>,
    /// The client's first bytes may go with the proxy's `Finished` ([`Upstream::connect_sending`]).
    pub early: bool,
    /// The attempt's deadline.
    pub within: Duration,
    /// What the attempt's end is told with.
    pub attempt: LoopAttempt,
    /// A spare's claim on its ticket: while it is held, a client that finds no ticket waits
    /// for the one this handshake brings back.
    pub claim: Option<SpareClaim>,
}

/// Which endpoint an attempt went to, in which turn of the round robin, and when it started.
pub struct LoopAttempt {
    turn: usize,
    endpoint: usize,
    addr: String,
    started: Instant,
}

/// What a connection whose attempt on a loop did not end in a relay does on its task.
pub enum LoopNext {
    /// Connects as any new connection does, in the turn the loop took and past the endpoint
    /// it failed on ([`Upstream::connect_any_after`]).
    Task(Attempted),
    /// Tells the client why (a 502): nothing else is tried.
    Tell(UpstreamError),
}

impl Upstream {
    /// A relay loop's attempt for a client offering `alpn`, when one needs no wait: the
    /// endpoint whose turn it is, named by its address and reached straight, with a ticket
    /// claimed and in the session's ClientHello. Otherwise the turn taken (None: none), for
    /// the connection's task.
    ///
    /// A spare's attempt (`for_spare`) holds its claim as a spare coming ([`LoopDial::claim`]).
    pub fn dial_in_loop(
        &self,
        alpn: Option<&[u8]>,
        for_spare: bool,
    ) -> Result<LoopDial, Option<usize>> {
        let turn = self.endpoints.turn();
        let i = *self.endpoints.order_at(turn).first().ok_or(Some(turn))?;
        let endpoint = &self.endpoints.list[i];
        let target = &endpoint.target;
        let direct = self.egress.proxy_for(&target.host, target.port).is_none();
        let ip = target.host.parse::<IpAddr>().ok().filter(|_| direct);
        let ip = ip.ok_or(Some(turn))?;
        let generation = endpoint.generation();
        // Claimed first: a store with no ticket (a new generation, after a certificate or CA
        // reload) leaves building its first config to the task.
        let mut claim = None;
        if for_spare {
            claim = Some(generation.store.try_claim_for_spare().ok_or(Some(turn))?);
        } else if !generation.store.try_claim() {
            return Err(Some(turn));
        }
        let addr = target.authority();
        let config = self.config_for(&generation, alpn, &addr).map_err(|_| {
            // A spare's claim gives its ticket back as it is dropped.
            if claim.is_none() {
                generation.store.give_back();
            }
            Some(turn)
        })?;
        // rustls takes the ticket out of the store into its ClientHello here. None there
        // though the count said one (a connection that passed the gate without a claim took
        // it): the claim took one off the count, which comes right one such look at a time.
        let (session, took) =
            taking_ticket(|| ClientConnection::new(config, endpoint.server_name.clone()));
        if let Some(claim) = claim.as_mut() {
            claim.start();
        }
        let session = session.ok().filter(|_| took).ok_or(Some(turn))?;
        // A connect that fails at once costs the ticket the session took: its task connects
        // again, and reports what fails there.
        let tcp = crate::egress::connect_started(SocketAddr::new(ip, target.port));
        let tcp = tcp.map_err(|e| {
            tracing::debug!(upstream = %addr, error = %e, "could not start a connect on a relay loop");
            Some(turn)
        })?;
        Ok(LoopDial {
            tcp,
            session: Box::new(session),
            early: alpn != Some(b"h2".as_slice()) || endpoint.agreed_h2(),
            within: self.attempt_timeout,
            claim,
            attempt: LoopAttempt {
                turn,
                endpoint: i,
                addr,
                started: Instant::now(),
            },
        })
    }

    /// The attempt's handshake is done: counted, and its protocol checked.
    pub fn loop_established(
        &self,
        attempt: &LoopAttempt,
        alpn: Option<&[u8]>,
        state: &rustls::CommonState,
    ) -> Result<(), UpstreamError> {
        let endpoint = &self.endpoints.list[attempt.endpoint];
        let (resumed, got) = self.established(&attempt.addr, alpn, state, attempt.started)?;
        if resumed {
            let took = attempt.started.elapsed();
            endpoint.generation().store.resumed_in(took);
        }
        if got.as_deref() == Some(b"h2".as_slice()) {
            endpoint.agree_h2();
        }
        endpoint.succeeded();
        Ok(())
    }

    /// The attempt failed at `stage` with `error`, before any byte went upstream: counted as
    /// a connection's attempt is, the endpoint marked down when it was its fault, and what the
    /// connection's task does next.
    pub fn loop_failed(
        &self,
        attempt: LoopAttempt,
        alpn: Option<&[u8]>,
        stage: Stage,
        error: std::io::Error,
    ) -> LoopNext {
        let LoopAttempt {
            turn,
            endpoint: i,
            addr,
            ..
        } = attempt;
        let endpoint = &self.endpoints.list[i];
        let again = |failed| {
            LoopNext::Task(Attempted {
                turn: Some(turn),
                failed,
            })
        };
        if stage == Stage::Local {
            tracing::debug!(upstream = %addr, error = %error, "a relay loop could not make its attempt; connecting on the task");
            return again(None);
        }
        if crate::key::tls::is_signature_refused(&error) {
            tracing::debug!(upstream = %addr, "the API server did not resume the session; connecting where the key may sign");
            endpoint.generation().store.loops_refused();
            return again(None);
        }
        let e = self.loop_error(addr, alpn, stage, error);
        // A timeout is always the endpoint's, as in `connect_any`.
        if stage != Stage::Timeout && !endpoint_failure(&e) {
            return LoopNext::Tell(e);
        }
        endpoint.failed(&e);
        again(Some((i, e)))
    }

    /// A spare's attempt on a loop failed ([`super::relay_loop::SpareJob::failed`]): counted
    /// as a connection's attempt is, but nobody's failure (no endpoint is marked down, no
    /// other tried). Whether spares should rest a while: not after a failure of the loop's
    /// own.
    pub fn loop_spare_failed(
        &self,
        attempt: LoopAttempt,
        alpn: Option<&[u8]>,
        stage: Stage,
        error: std::io::Error,
    ) -> bool {
        let addr = attempt.addr;
        if stage == Stage::Local {
            tracing::debug!(upstream = %addr, error = %error, "a relay loop could not make a spare");
            return false;
        }
        if crate::key::tls::is_signature_refused(&error) {
            tracing::debug!(upstream = %addr, "the API server did not resume a spare's session");
            self.endpoints.list[attempt.endpoint]
                .generation()
                .store
                .loops_refused();
            return true;
        }
        let e = self.loop_error(addr, alpn, stage, error);
        tracing::debug!(error = %e, "no spare upstream connection; none tried for a while");
        true
    }

    /// What an attempt's failure at `stage` is, counted.
    fn loop_error(
        &self,
        addr: String,
        alpn: Option<&[u8]>,
        stage: Stage,
        error: std::io::Error,
    ) -> UpstreamError {
        match stage {
            Stage::Timeout => {
                self.metrics.upstream_error(UpstreamStage::Timeout);
                UpstreamError::Timeout {
                    addr,
                    after: self.attempt_timeout,
                }
            }
            Stage::Connect => {
                self.metrics.upstream_error(UpstreamStage::Connect);
                UpstreamError::Connect {
                    addr,
                    source: error,
                }
            }
            Stage::Handshake | Stage::Local => self.handshake_error(addr, alpn, error),
        }
    }
}
