//! The UNIX socket's clients, accepted and opened on the relay loops ([`super::relay_loop`]'s
//! `opening`): what the proxy decides for each, on the loop's thread, with the rules the
//! connection thread's path applies ([`super::listener`], [`super::bridge`]).
//!
//! - Admission: the peer's uid, then a connection slot. With none free, the client goes to a
//!   connection thread, which waits for one as before.
//! - The first bytes choose the protocol, as [`super::first_bytes`] does.
//! - The upstream connection: the spare made ahead for this protocol, if there is one; else,
//!   when nothing needs a wait ([`super::loop_dial`]), a connect and a resumed handshake on
//!   the loop; else the connection thread's path.
//! - A failed attempt goes on on a connection thread: the other endpoints, a full handshake
//!   (which may sign), or the 502 that tells the client why.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use rustls::ClientConnection;
use tokio::sync::watch;

use super::accept::ClientBound;
use super::bind::Socket;
use super::bridge::{ending, Held};
use super::endpoints::Attempted;
use super::first_bytes::H2_PREFACE;
use super::listener::{accept_loop, admit_unix_peer, serve_admitted_unix, Clients};
use super::loop_dial::{LoopAttempt, LoopNext};
use super::metrics::{ListenerKind, OpenedOn, Refusal};
use super::origin::{ClientKind, Origin};
use super::preconnect::Looked;
use super::relay_loop::{upstream_parts, OnEnd, OpenJob, Opener, Route, SpareMaker, Stage, Watch};
use super::rotation::CertEpoch;
use super::unix_client::ClientUnixStream;

/// Accepts the clients until `stop`: the UNIX socket's on the relay loops, the loopback
/// listener's on this runtime ([`accept_loop`]). A UNIX socket the loops cannot take (no
/// copy of its descriptor could be made) is accepted here too.
pub async fn accept(
    clients: Arc<Clients>,
    listeners: Vec<ClientBound>,
    stop: watch::Receiver<bool>,
) {
    let loops = clients.bridge.relay_loops.clone();
    let mut here = Vec::new();
    let mut listening = false;
    for bound in listeners {
        let (Some(loops), Socket::Unix { listener, .. }) = (&loops, &bound) else {
            here.push(bound);
            continue;
        };
        let opener = Arc::new(UnixOpener {
            clients: clients.clone(),
        });
        match loops.listen(listener.get_ref(), opener) {
            // The loops hold copies: this one is closed.
            Ok(()) => listening = true,
            Err(e) => {
                tracing::warn!(error = %e, "the relay loops cannot accept the UNIX socket's clients; accepted on the connection threads' path");
                here.push(bound);
            }
        }
    }
    accept_loop(clients, here, stop).await;
    if let (true, Some(loops)) = (listening, loops) {
        loops.unlisten();
    }
}

/// Decides on the UNIX socket's clients for the relay loops.
struct UnixOpener {
    clients: Arc<Clients>,
}

impl Opener for UnixOpener {
    fn admit(&self, client: UnixStream) -> Option<(UnixStream, Box<dyn OpenJob>)> {
        let shared = &self.clients;
        shared.metrics.connection_accepted(ListenerKind::Unix);
        if !admit_unix_peer(shared, &client) {
            return None;
        }
        let Ok(slot) = shared.slots.clone().try_acquire_owned() else {
            // Every slot is taken: it waits for one on a connection thread.
            shared.metrics.unix_opened(OpenedOn::Thread);
            let task_shared = shared.clone();
            shared.connections.spawn(move || async move {
                serve_admitted_unix(&task_shared, ClientUnixStream::accepted(client)).await
            });
            return None;
        };
        let held = Held {
            slot,
            active: shared.activity.enter(),
        };
        let job = Job {
            clients: shared.clone(),
            held,
            alpn: b"http/1.1",
            epoch: shared.bridge.upstream.epoch(),
            attempt: None,
            next: LoopNext::Task(Attempted::default()),
            ahead: false,
        };
        Some((client, Box::new(job)))
    }
}

/// One client's connection while a relay loop opens it.
struct Job {
    clients: Arc<Clients>,
    held: Held,
    /// The protocol its first bytes speak.
    alpn: &'static [u8],
    /// The certificate it is opened with (read before the handshake, as on the task's path).
    epoch: CertEpoch,
    /// The loop's attempt, while there is one.
    attempt: Option<LoopAttempt>,
    /// What its task does if it goes to one.
    next: LoopNext,
    /// Its upstream connection is established: the next client's may be made ahead.
    ahead: bool,
}

impl OpenJob for Job {
    fn first_bytes_within(&self) -> std::time::Duration {
        self.clients.handshake_timeout
    }

    fn route(&mut self, prefix: &[u8]) -> Route {
        if prefix.starts_with(H2_PREFACE) {
            self.alpn = b"h2";
        }
        let upstream = &self.clients.bridge.upstream;
        self.epoch = upstream.epoch();
        let alpn = Some(self.alpn);
        let spare = upstream.spares().take(alpn, ClientKind::Unix, self.epoch);
        if let Some(conn) = spare {
            let route = match conn.origin {
                // Made on a loop: taken as it is.
                Origin::Loop(spare) => Route::Established(spare.tcp, spare.session, spare.records),
                // Made on a connection thread: taken back from its runtime.
                Origin::Buffered(stream) => match upstream_parts(stream) {
                    Ok((tcp, session, records)) => {
                        Route::Established(tcp, Box::new(session), records)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "a spare connection could not move to a relay loop; connecting on the task");
                        return Route::Task;
                    }
                },
                // A loopback client's kind, never kept in this place.
                Origin::Lean(_) => return Route::Task,
            };
            self.ahead = true;
            return route;
        }
        let dial = match upstream.dial_in_loop(alpn, false) {
            Ok(dial) => dial,
            Err(turn) => {
                self.next = LoopNext::Task(Attempted { turn, failed: None });
                return Route::Task;
            }
        };
        self.attempt = Some(dial.attempt);
        Route::Dial {
            tcp: dial.tcp,
            session: dial.session,
            early: dial.early,
            within: dial.within,
        }
    }

    fn established(&mut self, session: &ClientConnection) -> bool {
        let Some(attempt) = self.attempt.take() else {
            return false;
        };
        let upstream = &self.clients.bridge.upstream;
        match upstream.loop_established(&attempt, Some(self.alpn), session) {
            Ok(()) => {
                self.ahead = true;
                true
            }
            Err(e) => {
                self.next = LoopNext::Tell(e);
                false
            }
        }
    }

    fn attempt_failed(&mut self, stage: Stage, error: std::io::Error) {
        if let Some(attempt) = self.attempt.take() {
            let upstream = &self.clients.bridge.upstream;
            self.next = upstream.loop_failed(attempt, Some(self.alpn), stage, error);
        }
    }

    fn spare(&mut self) -> Option<SpareMaker> {
        // After an authenticated client's upstream connection: the next client's, made ahead
        // on this loop while clients come in a burst ([`super::spare`]).
        if !std::mem::take(&mut self.ahead) {
            return None;
        }
        let (upstream, alpn) = (self.clients.bridge.upstream.clone(), self.alpn);
        let spawner = self.clients.connections.clone();
        Some(Box::new(move || {
            super::loop_spare::spare_for_loop(&upstream, alpn, &spawner)
        }))
    }

    fn relay(self: Box<Self>, replayed: u64) -> (Watch, OnEnd) {
        self.clients.metrics.unix_opened(OpenedOn::Loop);
        ending(&self.clients.bridge, self.epoch, replayed, self.held)
    }

    fn on_task(self: Box<Self>, client: UnixStream, prefix: Vec<u8>) {
        let Job {
            clients,
            held,
            alpn,
            next,
            ..
        } = *self;
        clients.metrics.unix_opened(OpenedOn::Thread);
        let spawner = clients.connections.clone();
        spawner.spawn(move || async move {
            let client = ClientUnixStream::accepted(client);
            let bridge = &clients.bridge;
            let alpn = Some(alpn.to_vec());
            let looked = match next {
                LoopNext::Task(attempted) => Looked::After(attempted),
                LoopNext::Tell(e) => {
                    tracing::warn!(error = %e, "upstream connection failed");
                    super::failure::tell_client(client, prefix, alpn.as_deref(), &e).await;
                    return;
                }
            };
            bridge
                .serve_unix_after(client, prefix, alpn, held, looked)
                .await;
        });
    }

    fn abandoned(self: Box<Self>, timed_out: bool, error: &std::io::Error) {
        if timed_out {
            self.clients.metrics.refused(Refusal::HandshakeTimeout);
            tracing::info!("UNIX-socket client sent no request in time; closed");
        } else {
            tracing::debug!(error = %error, "UNIX-socket client went away before sending a request");
        }
    }
}
