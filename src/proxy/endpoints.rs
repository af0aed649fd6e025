//! The API servers the proxy may use (`--upstream` given several times, as kubespray's and
//! k3s/rke2's node-local load balancers have them): which one a new connection tries first,
//! and which are marked down.
//!
//! Choice: round robin over the endpoints that are up, so every API server shares the load and
//! a returning one is used again at once. A connection that cannot be made to an endpoint
//! (refused, TLS handshake failed, timed out) marks it down for a backoff (1 s doubling to
//! 30 s) and the same client connection tries the next endpoint: nothing has been forwarded
//! yet, so the retry is invisible to the client. When every endpoint is down, all are tried,
//! the one due back first. A connection already relaying is never moved.
//!
//! Each endpoint keeps its own resumption tickets: API servers do not share ticket keys, and a
//! ticket presented to the wrong one would cost a full handshake (a hardware signature).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::ClientConfig;

use super::error::UpstreamError;
use super::metrics::EndpointMetrics;
use super::sessions::SessionStore;
use crate::backoff::Backoff;
use crate::endpoint::UpstreamTarget;

/// How many servers' sessions one endpoint's store remembers (one; headroom for name changes).
const SESSION_STORE_SERVERS: usize = 32;
/// First and longest time an endpoint stays marked down after a failure.
const FIRST_DOWN: Duration = Duration::from_secs(1);
const MAX_DOWN: Duration = Duration::from_secs(30);

/// One generation of client configs sharing a session store (a certificate reload or a CA
/// rotation starts a new one).
pub(crate) struct Generation {
    pub(crate) configs: Mutex<HashMap<Option<Vec<u8>>, Arc<ClientConfig>>>,
    pub(crate) store: Arc<SessionStore>,
}

impl Generation {
    fn new() -> Generation {
        Generation {
            configs: Mutex::new(HashMap::new()),
            store: Arc::new(SessionStore::new(SESSION_STORE_SERVERS)),
        }
    }
}

/// One API server.
pub(crate) struct Endpoint {
    pub(crate) target: UpstreamTarget,
    pub(crate) server_name: ServerName<'static>,
    generation: RwLock<Arc<Generation>>,
    health: Mutex<Health>,
    metrics: EndpointMetrics,
    /// It has agreed to HTTP/2 in a handshake: a client's first HTTP/2 bytes may go with the
    /// next handshake's `Finished`, before the protocol is checked ([`super::upstream`]).
    agreed_h2: AtomicBool,
}

struct Health {
    down_until: Option<Instant>,
    backoff: Backoff,
}

impl Endpoint {
    pub(crate) fn new(
        target: UpstreamTarget,
        server_name: ServerName<'static>,
        metrics: EndpointMetrics,
    ) -> Endpoint {
        Endpoint {
            target,
            server_name,
            generation: RwLock::new(Arc::new(Generation::new())),
            agreed_h2: AtomicBool::new(false),
            health: Mutex::new(Health {
                down_until: None,
                backoff: Backoff::new(FIRST_DOWN, MAX_DOWN),
            }),
            metrics,
        }
    }

    /// The current generation of configs and tickets.
    pub(crate) fn generation(&self) -> Arc<Generation> {
        self.generation
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Starts a new generation: no resumable session survives.
    pub(crate) fn reset_sessions(&self) {
        *self.generation.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Generation::new());
    }

    /// Whether it has agreed to HTTP/2 in a handshake since the proxy started.
    pub(crate) fn agreed_h2(&self) -> bool {
        self.agreed_h2.load(Ordering::Relaxed)
    }

    /// Remembers that it agreed to HTTP/2.
    pub(crate) fn agree_h2(&self) {
        self.agreed_h2.store(true, Ordering::Relaxed);
    }

    /// A connection to it worked: it is up (again).
    pub(crate) fn succeeded(&self) {
        self.metrics.connections.inc();
        let mut h = self.health();
        if h.down_until.take().is_some() {
            tracing::info!(endpoint = %self.target.authority(), "API server endpoint is back");
        }
        h.backoff.reset();
        self.metrics.up.set(1);
    }

    /// A connection to it failed: marked down for the next backoff.
    pub(crate) fn failed(&self, error: &dyn std::fmt::Display) {
        self.metrics.failures.inc();
        let mut h = self.health();
        let wait = h.backoff.next_delay();
        h.down_until = Some(Instant::now() + wait);
        self.metrics.up.set(0);
        tracing::warn!(
            endpoint = %self.target.authority(),
            retry_in_ms = wait.as_millis() as u64,
            %error,
            "API server endpoint marked down; new connections go to the others"
        );
    }

    /// When it is due back (None: up).
    fn down_until(&self, now: Instant) -> Option<Instant> {
        self.health().down_until.filter(|t| *t > now)
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a relay loop's attempt at a connection leaves for the connection thread that goes on
/// with it ([`super::loop_dial`]): the round robin's turn it took, and the endpoint it failed
/// on with the failure.
#[derive(Debug, Default)]
pub struct Attempted {
    /// The turn taken (None: none yet).
    pub turn: Option<usize>,
    /// The endpoint tried, and what it failed with.
    pub failed: Option<(usize, UpstreamError)>,
}

/// The endpoints and the round-robin position.
pub(crate) struct Endpoints {
    pub(crate) list: Vec<Endpoint>,
    next: AtomicUsize,
}

impl Endpoints {
    pub(crate) fn new(list: Vec<Endpoint>) -> Endpoints {
        Endpoints {
            list,
            next: AtomicUsize::new(0),
        }
    }

    /// The order a new connection tries them in: the endpoints that are up, round robin;
    /// if none is, every endpoint, the one due back first.
    pub(crate) fn order(&self) -> Vec<usize> {
        self.order_at(self.turn())
    }

    /// Takes a turn of the round robin: a relay loop's attempt takes it before it looks at the
    /// first endpoint ([`super::upstream::Upstream::dial_in_loop`]), and a connection thread
    /// that goes on for it uses the same turn ([`Endpoints::order_at`]), so each connection
    /// moves the round robin by one, and two loops at once never take the same turn.
    pub(crate) fn turn(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// [`Endpoints::order`] for a turn already taken.
    pub(crate) fn order_at(&self, turn: usize) -> Vec<usize> {
        let n = self.list.len();
        let start = turn % n.max(1);
        let now = Instant::now();
        let up: Vec<usize> = (0..n)
            .map(|i| (start + i) % n)
            .filter(|&i| self.list[i].down_until(now).is_none())
            .collect();
        if !up.is_empty() {
            return up;
        }
        let mut all: Vec<(Instant, usize)> = (0..n)
            .map(|i| (self.list[i].down_until(now).unwrap_or(now), i))
            .collect();
        all.sort();
        all.into_iter().map(|(_, i)| i).collect()
    }

    /// Every endpoint starts a new generation.
    pub(crate) fn reset_sessions(&self) {
        for e in &self.list {
            e.reset_sessions();
        }
    }
}

/// Whether `e` says this process (or this host) ran out of something.
fn local_resource_error(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EADDRNOTAVAIL)
    )
}

/// Whether an attempt failed because of the endpoint (it is marked down and the next one is
/// tried): TCP, the tunnel or the TLS handshake. A protocol the upstream refused is not the
/// endpoint's fault, nor is a hardware signature that failed (another endpoint would only ask
/// the hardware again).
pub(crate) fn endpoint_failure(e: &UpstreamError) -> bool {
    match e {
        // Out of descriptors, buffers, memory or local ports: this process's trouble, not the
        // API server's. Marking it down turned a moment of "too many open files" into up to
        // 37 s of traffic sent elsewhere (or nowhere).
        UpstreamError::Connect { source, .. } => !local_resource_error(source),
        UpstreamError::Via { .. } => true,
        UpstreamError::Handshake { source, .. } => !crate::key::tls::is_signature_failure(source),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(n: usize) -> Endpoints {
        let metrics = super::super::metrics::Metrics::default();
        Endpoints::new(
            (0..n)
                .map(|i| {
                    let target: UpstreamTarget =
                        format!("https://10.0.0.{i}:6443").parse().unwrap();
                    let name = ServerName::try_from(format!("10.0.0.{i}")).unwrap();
                    Endpoint::new(target, name, metrics.endpoint(&i.to_string()))
                })
                .collect(),
        )
    }

    /// A turn of the round robin is its taker's alone: connections that start at once on two
    /// relay loops (each takes its turn before it dials) try different API servers first, and
    /// a connection thread that goes on in the same turn tries the same one the loop did.
    /// When a loop read the position and moved it only once it had dialled, two loops at once
    /// both went to the same API server, and so did the next two.
    #[test]
    fn connections_starting_at_once_take_turns_of_their_own() {
        let e = endpoints(2);
        let (a, b) = (e.turn(), e.turn());
        assert_ne!(e.order_at(a)[0], e.order_at(b)[0]);
        let c = e.turn();
        assert_eq!(e.order_at(c)[0], e.order_at(a)[0]);
        // Each connection moves the round robin by one: the next plain order is the turn after.
        assert_eq!(e.order()[0], e.order_at(b)[0]);
    }

    /// A connect that failed for want of a local resource does not mark the API server down;
    /// a refused or unreachable one does.
    #[test]
    fn a_local_resource_error_is_not_the_api_servers_failure() {
        let connect = |errno| UpstreamError::Connect {
            addr: "10.0.0.1:6443".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        for local in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::EADDRNOTAVAIL,
        ] {
            assert!(!endpoint_failure(&connect(local)), "{local}");
        }
        for remote in [libc::ECONNREFUSED, libc::EHOSTUNREACH, libc::ETIMEDOUT] {
            assert!(endpoint_failure(&connect(remote)), "{remote}");
        }
    }
}
