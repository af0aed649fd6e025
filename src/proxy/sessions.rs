//! The upstream session store and the ticket gate.
//!
//! Resumption makes a new upstream connection cost no hardware signature, but only when a
//! session ticket is in the store, and TLS 1.3 tickets are single-use. A burst of clients at a
//! cold proxy (kubectl opens several connections at once; kubelet after a restart opens dozens)
//! would each find no ticket and make a full, signed handshake — on a TPM those signatures queue
//! one after another. So every new connection passes this gate first:
//!
//! - it claims a ticket the store holds (a count of tickets received minus tickets claimed) and
//!   resumes; or
//! - if no full handshake is under way, it leads: makes the full handshake whose tickets the
//!   others wait for (the server sends them right after the handshake, and every resumed
//!   handshake brings new ones, so the supply grows with the burst); or
//! - it waits for a ticket or for the lead, at most [`WARMUP_WAIT`], then goes ahead anyway.
//!
//! An upstream that sends no tickets (or uses TLS 1.2 sessions, which are reusable) opens the
//! gate for good, so it never slows connections down: after a successful lead, [`GRACE`] without
//! a ticket means none will come.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::{
    ClientSessionMemoryCache, ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue,
};
use rustls::pki_types::ServerName;
use rustls::NamedGroup;
use tokio::sync::Notify;

/// The longest a connection waits at the gate.
pub const WARMUP_WAIT: Duration = Duration::from_secs(3);
/// How long after a successful full handshake its tickets may take to arrive.
pub const GRACE: Duration = Duration::from_millis(500);
/// rustls's memory cache keeps this many TLS 1.3 tickets per server (oldest dropped first).
const TICKETS_PER_SERVER: usize = 8;

/// rustls's in-memory store, plus the ticket gate.
#[derive(Debug)]
pub struct SessionStore {
    inner: ClientSessionMemoryCache,
    /// Tickets received and not yet claimed by a connection at the gate.
    available: AtomicUsize,
    /// Tickets received since this store was made.
    received: AtomicU64,
    /// A full handshake is under way (or just finished and its tickets are awaited).
    leader: AtomicBool,
    /// The gate is open for good (no tickets from this upstream, or TLS 1.2 sessions).
    bypass: AtomicBool,
    changed: Notify,
}

/// What a connection does after the gate.
#[derive(Debug)]
pub enum Warmup {
    /// Resume with a claimed ticket, or go ahead without waiting any longer.
    Go,
    /// Make the full handshake the others wait for; report its outcome with the guard.
    Leader(LeaderGuard),
}

/// Held by the connection making the leading full handshake.
#[derive(Debug)]
pub struct LeaderGuard {
    store: Arc<SessionStore>,
    succeeded: bool,
}

impl LeaderGuard {
    /// The handshake completed. Its tickets are on their way: the lead is held for [`GRACE`]
    /// more, then released (and if no ticket came, the gate opens for good).
    pub fn succeeded(mut self) {
        self.succeeded = true;
        let store = self.store.clone();
        let seen = store.received.load(Ordering::SeqCst);
        tokio::spawn(async move {
            tokio::time::sleep(GRACE).await;
            if store.received.load(Ordering::SeqCst) == seen && store.available() == 0 {
                tracing::debug!(
                    "the upstream sent no session ticket; not waiting for tickets any more"
                );
                store.bypass.store(true, Ordering::SeqCst);
            }
            store.leader.store(false, Ordering::SeqCst);
            store.changed.notify_waiters();
        });
    }
}

impl Drop for LeaderGuard {
    fn drop(&mut self) {
        if !self.succeeded {
            // Hand the lead to a waiter instead of letting it wait for tickets that will not come.
            self.store.leader.store(false, Ordering::SeqCst);
            self.store.changed.notify_waiters();
        }
    }
}

impl SessionStore {
    /// A store remembering sessions for up to `servers` server names.
    pub fn new(servers: usize) -> SessionStore {
        SessionStore {
            inner: ClientSessionMemoryCache::new(servers),
            available: AtomicUsize::new(0),
            received: AtomicU64::new(0),
            leader: AtomicBool::new(false),
            bypass: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    fn available(&self) -> usize {
        self.available.load(Ordering::SeqCst)
    }

    /// Claims one ticket for the calling connection, if any is left.
    fn claim(&self) -> bool {
        self.available
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Whether a connection nobody waits for yet (a spare, [`super::spare`]) may go for a
    /// ticket: one at least stays for the next client, who would otherwise lead a full handshake
    /// (a signature). None while the gate is open for good: no tickets to count.
    pub fn spare_ticket_ready(&self) -> bool {
        !self.bypass.load(Ordering::SeqCst) && self.available() >= 2
    }

    /// Claims a ticket for a spare, as [`SessionStore::spare_ticket_ready`] allows.
    pub fn claim_for_spare(&self) -> bool {
        !self.bypass.load(Ordering::SeqCst)
            && self
                .available
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n >= 2).then(|| n - 1)
                })
                .is_ok()
    }

    /// Passes the gate: see the module comment.
    pub async fn warm_up(self: &Arc<Self>) -> Warmup {
        let deadline = tokio::time::Instant::now() + WARMUP_WAIT;
        loop {
            if self.bypass.load(Ordering::SeqCst) || self.claim() {
                return Warmup::Go;
            }
            if !self.leader.swap(true, Ordering::SeqCst) {
                return Warmup::Leader(LeaderGuard {
                    store: self.clone(),
                    succeeded: false,
                });
            }
            // Register for the wake-up before looking again, so none is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.bypass.load(Ordering::SeqCst)
                || self.available() > 0
                || !self.leader.load(Ordering::SeqCst)
            {
                continue;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                tracing::debug!("no session ticket within {WARMUP_WAIT:?}; full handshake");
                return Warmup::Go;
            }
        }
    }
}

impl ClientSessionStore for SessionStore {
    fn set_kx_hint(&self, server_name: ServerName<'static>, group: NamedGroup) {
        self.inner.set_kx_hint(server_name, group)
    }

    fn kx_hint(&self, server_name: &ServerName<'_>) -> Option<NamedGroup> {
        self.inner.kx_hint(server_name)
    }

    fn set_tls12_session(&self, server_name: ServerName<'static>, value: Tls12ClientSessionValue) {
        self.inner.set_tls12_session(server_name, value);
        // A TLS 1.2 session can be resumed by any number of connections: no need to ration.
        self.bypass.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn tls12_session(&self, server_name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        self.inner.tls12_session(server_name)
    }

    fn remove_tls12_session(&self, server_name: &ServerName<'static>) {
        self.inner.remove_tls12_session(server_name)
    }

    fn insert_tls13_ticket(
        &self,
        server_name: ServerName<'static>,
        value: Tls13ClientSessionValue,
    ) {
        self.inner.insert_tls13_ticket(server_name, value);
        self.received.fetch_add(1, Ordering::SeqCst);
        let _ = self
            .available
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some((n + 1).min(TICKETS_PER_SERVER))
            });
        self.changed.notify_waiters();
    }

    fn take_tls13_ticket(
        &self,
        server_name: &ServerName<'static>,
    ) -> Option<Tls13ClientSessionValue> {
        self.inner.take_tls13_ticket(server_name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket_arrives(store: &SessionStore) {
        store.received.fetch_add(1, Ordering::SeqCst);
        store.available.fetch_add(1, Ordering::SeqCst);
        store.changed.notify_waiters();
    }

    /// A spare takes a ticket only when one stays for the next client: with one ticket in the
    /// store, a client that came after a spare took it would lead a full handshake (a
    /// signature) it would not have made otherwise. And none while the store counts no
    /// tickets (its gate open for good).
    #[tokio::test]
    async fn a_spare_leaves_a_ticket_for_the_next_client() {
        let store = Arc::new(SessionStore::new(4));
        ticket_arrives(&store);
        assert!(!store.spare_ticket_ready());
        assert!(!store.claim_for_spare());
        ticket_arrives(&store);
        assert!(store.spare_ticket_ready());
        assert!(store.claim_for_spare());
        assert!(!store.claim_for_spare(), "one is left for a client");
        assert!(
            matches!(store.warm_up().await, Warmup::Go),
            "the client resumes"
        );
        ticket_arrives(&store);
        ticket_arrives(&store);
        store.bypass.store(true, Ordering::SeqCst);
        assert!(!store.claim_for_spare(), "no tickets counted: no spare");
    }

    #[tokio::test]
    async fn waiters_claim_the_tickets_the_leader_brings() {
        let store = Arc::new(SessionStore::new(4));
        let leader = store.warm_up().await;
        assert!(matches!(leader, Warmup::Leader(_)));
        let waiter = async { matches!(store.warm_up().await, Warmup::Go) };
        let arrival = async {
            tokio::task::yield_now().await;
            ticket_arrives(&store);
        };
        let (went, ()) = tokio::join!(waiter, arrival);
        assert!(went);
        assert_eq!(store.available(), 0, "the ticket was claimed");
        drop(leader);
    }

    #[tokio::test]
    async fn a_failed_leader_hands_the_lead_over() {
        let store = Arc::new(SessionStore::new(4));
        let first = store.warm_up().await;
        let waiter = async { matches!(store.warm_up().await, Warmup::Leader(_)) };
        let failer = async {
            tokio::task::yield_now().await;
            drop(first);
        };
        let (led, ()) = tokio::join!(waiter, failer);
        assert!(led, "the waiter took the lead");
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_without_tickets_opens_the_gate_for_good() {
        let store = Arc::new(SessionStore::new(4));
        match store.warm_up().await {
            Warmup::Leader(g) => g.succeeded(),
            Warmup::Go => panic!("the first connection leads"),
        }
        // No ticket comes: after the grace period everyone goes straight through.
        tokio::time::sleep(GRACE * 2).await;
        assert!(matches!(store.warm_up().await, Warmup::Go));
        assert!(matches!(store.warm_up().await, Warmup::Go));
    }
}
