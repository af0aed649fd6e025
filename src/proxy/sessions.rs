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
//!   handshake brings new ones: Go's server one, so the supply stays even, others more); or
//! - it waits for a ticket, for the lead, or for a spare connection's handshake under way
//!   ([`super::spare`]: it brings a ticket back), at most [`WARMUP_WAIT`], then goes ahead
//!   anyway. A spare's handshake is waited for alone at most [`SPARE_PATIENCE`]: later, one
//!   waiter leads and the others wait for its tickets, so a spare that stalled (an API server
//!   that accepted it and never answered) costs one signature, not one per waiting client.
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

use super::error::UpstreamError;

/// The longest a connection waits at the gate.
pub const WARMUP_WAIT: Duration = Duration::from_secs(3);
/// The least a connection waits at the gate for spares' handshakes alone (no lead under way)
/// before it leads a full handshake itself, if nobody does: four times the API server's last
/// resumed handshake ([`SessionStore::resumed_in`]), at least this and at most
/// [`WARMUP_WAIT`]. A spare's resumed handshake takes two round trips and its ticket comes with
/// the second, so a spare that late has stalled (an API server that accepted it and never
/// answers); waiting on until [`WARMUP_WAIT`] would send every waiter ahead at once, each with
/// a full handshake (a signature each, queued on a TPM), where one lead serves them all.
pub const SPARE_PATIENCE: Duration = Duration::from_secs(1);
/// The longest a spare waits for a ticket to claim ([`SessionStore::claim_for_spare`]).
pub const TICKET_WAIT: Duration = Duration::from_secs(1);
/// How long after a successful full handshake its tickets may take to arrive.
pub const GRACE: Duration = Duration::from_millis(500);
thread_local! {
    /// Whether the last ticket rustls asked this thread's store for was there
    /// ([`taking_ticket`]).
    static TOOK: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `start` (a client session's start: rustls takes a ticket from its store for the
/// ClientHello) and says whether it took one. A relay loop resumes or gives the connection to
/// its task: a ClientHello without a ticket would only make a full handshake it must refuse.
pub fn taking_ticket<R>(start: impl FnOnce() -> R) -> (R, bool) {
    TOOK.with(|t| t.set(None));
    let started = start();
    (started, TOOK.with(|t| t.take()) == Some(true))
}

/// How long relay loops leave resumption to the connection threads after one was refused.
pub const LOOPS_REST: Duration = Duration::from_secs(60);
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
    /// Spares ([`super::spare`]) resuming with a claimed ticket: each brings one back, which a
    /// client waits for rather than lead a full handshake.
    spares: AtomicUsize,
    /// No relay loop resumes with this store before this ([`super::idle::now_ms`]): its API
    /// server refused a loop's resumption lately ([`SessionStore::loops_refused`]).
    loops_rest_until: AtomicU64,
    /// How long the last resumed handshake with this store's API server took, in
    /// milliseconds ([`SessionStore::resumed_in`]).
    resumed_ms: AtomicU64,
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

/// A spare's claim on a ticket ([`SessionStore::claim_for_spare`]); dropped when its
/// handshake is over. A claim dropped before its handshake started gives the ticket back.
#[derive(Debug)]
pub struct SpareClaim {
    store: Arc<SessionStore>,
    started: bool,
}

impl SpareClaim {
    /// The handshake that takes the ticket from the store starts now: it goes on as a
    /// connection with a ticket does.
    pub fn start(&mut self) -> Warmup {
        self.started = true;
        Warmup::Go
    }
}

impl Drop for SpareClaim {
    fn drop(&mut self) {
        if !self.started {
            self.store.available.fetch_add(1, Ordering::SeqCst);
        }
        self.store.spares.fetch_sub(1, Ordering::SeqCst);
        self.store.changed.notify_waiters();
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
            spares: AtomicUsize::new(0),
            loops_rest_until: AtomicU64::new(0),
            resumed_ms: AtomicU64::new(0),
            changed: Notify::new(),
        }
    }

    fn available(&self) -> usize {
        self.available.load(Ordering::SeqCst)
    }

    /// A connection resumed a session from this store in `took`: the gate waits for a spare's
    /// handshake alone for four times that ([`SPARE_PATIENCE`]), so an API server far away
    /// (hundreds of milliseconds per round trip) gets the time its spares need.
    pub fn resumed_in(&self, took: Duration) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        self.resumed_ms.store(ms, Ordering::Relaxed);
    }

    /// How long a connection at the gate waits for spares alone ([`SPARE_PATIENCE`]).
    fn spare_patience(&self) -> Duration {
        let last = Duration::from_millis(self.resumed_ms.load(Ordering::Relaxed));
        last.saturating_mul(4).clamp(SPARE_PATIENCE, WARMUP_WAIT)
    }

    /// Claims one ticket for the calling connection, if any is left.
    fn claim(&self) -> bool {
        self.available
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Claims a ticket for a connection nobody waits for yet (a spare, [`super::spare`]),
    /// waiting up to `within` for one (the client connection just made brings one back with
    /// its first answer). None while the gate is open for good: no tickets counted, no spare.
    /// Until the claim is dropped (the spare's handshake over, and the ticket its server sends
    /// back taken in), a client that finds no ticket waits for that one instead of leading a
    /// full handshake: a spare never makes a client sign.
    pub async fn claim_for_spare(self: &Arc<Self>, within: Duration) -> Option<SpareClaim> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.bypass.load(Ordering::SeqCst) {
                return None;
            }
            if self.claim() {
                self.spares.fetch_add(1, Ordering::SeqCst);
                return Some(SpareClaim {
                    store: self.clone(),
                    started: false,
                });
            }
            tokio::time::timeout_at(deadline, changed).await.ok()?;
        }
    }

    /// Claims a ticket the store holds now, for a connection that resumes without waiting
    /// (a relay loop's, which never waits at the gate: [`super::relay_loop`]). False while the
    /// store counts none, and while the gate is open for good (no ticket would be counted).
    pub fn try_claim(&self) -> bool {
        let resting = super::idle::now_ms() < self.loops_rest_until.load(Ordering::Relaxed);
        !resting && !self.bypass.load(Ordering::SeqCst) && self.claim()
    }

    /// [`SessionStore::try_claim`] for a spare a relay loop makes ([`super::loop_spare`]):
    /// counted as a spare coming, as [`SessionStore::claim_for_spare`]'s is, until the claim is
    /// dropped, so a client that finds no ticket meanwhile waits for the one the spare's
    /// handshake brings back rather than lead a full handshake. None when the store holds no
    /// ticket now.
    pub fn try_claim_for_spare(self: &Arc<Self>) -> Option<SpareClaim> {
        if !self.try_claim() {
            return None;
        }
        self.spares.fetch_add(1, Ordering::SeqCst);
        Some(SpareClaim {
            store: self.clone(),
            started: false,
        })
    }

    /// A relay loop's resumption was refused (the API server wanted a full handshake, which
    /// the loop leaves to a connection thread): for [`LOOPS_REST`], no loop tries one with
    /// this store, so a server that stopped resuming costs each connection one attempt
    /// at most once a minute, not every time.
    pub fn loops_refused(&self) {
        let until = super::idle::now_ms().saturating_add(LOOPS_REST.as_millis() as u64);
        self.loops_rest_until.store(until, Ordering::Relaxed);
    }

    /// Gives back a ticket [`SessionStore::try_claim`] claimed for a connection that never
    /// started its handshake (no more than the store keeps).
    pub fn give_back(&self) {
        let _ = self
            .available
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some((n + 1).min(TICKETS_PER_SERVER))
            });
        self.changed.notify_waiters();
    }

    /// A spare's claim when `spare` (a connection that is not one: none).
    pub async fn claim_if(
        self: &Arc<Self>,
        spare: bool,
        within: Duration,
    ) -> Result<Option<SpareClaim>, UpstreamError> {
        match spare {
            true => match self.claim_for_spare(within).await {
                Some(claim) => Ok(Some(claim)),
                None => Err(UpstreamError::NoTicket),
            },
            false => Ok(None),
        }
    }

    /// Passes the gate: see the module comment.
    pub async fn warm_up(self: &Arc<Self>) -> Warmup {
        let arrived = tokio::time::Instant::now();
        let deadline = arrived + WARMUP_WAIT;
        let patience = arrived + self.spare_patience();
        loop {
            if self.bypass.load(Ordering::SeqCst) || self.claim() {
                return Warmup::Go;
            }
            // A spare's handshake under way brings a ticket: wait for it rather than lead,
            // for as long as a resumed handshake may take.
            let spare_coming = self.spares.load(Ordering::SeqCst) > 0;
            let patient = spare_coming && tokio::time::Instant::now() < patience;
            if !patient && !self.leader.swap(true, Ordering::SeqCst) {
                return Warmup::Leader(LeaderGuard {
                    store: self.clone(),
                    succeeded: false,
                });
            }
            // Register for the wake-up before looking again, so none is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let may_lead =
                self.spares.load(Ordering::SeqCst) == 0 || tokio::time::Instant::now() >= patience;
            if self.bypass.load(Ordering::SeqCst)
                || self.available() > 0
                || (!self.leader.load(Ordering::SeqCst) && may_lead)
            {
                continue;
            }
            // While only spares are awaited, wake when patience ends too (then lead if nobody
            // does).
            let wake = if patient {
                patience.min(deadline)
            } else {
                deadline
            };
            if tokio::time::timeout_at(wake, changed).await.is_err() && wake == deadline {
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
        let ticket = self.inner.take_tls13_ticket(server_name);
        TOOK.with(|t| t.set(Some(ticket.is_some())));
        ticket
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

    /// `spare` (holding the store's last ticket) starts its handshake; a client comes meanwhile
    /// and finds no ticket: it waits for the one the spare brings back, and resumes. Nobody
    /// leads a full handshake (a signature) the spare would have caused.
    async fn client_waits_for(store: &Arc<SessionStore>, mut spare: SpareClaim) {
        let _ = spare.start();
        assert_eq!(store.available(), 0);
        let client = async { store.warm_up().await };
        let spare_done = async {
            tokio::task::yield_now().await;
            ticket_arrives(store);
            drop(spare);
        };
        let (client, ()) = tokio::join!(client, spare_done);
        assert!(matches!(client, Warmup::Go), "the client resumes");
        assert!(
            !store.leader.load(Ordering::SeqCst),
            "a client led a full handshake while a spare was bringing a ticket"
        );
    }

    /// A client that finds no ticket while a spare's handshake is under way (it took the last
    /// one) waits for the ticket that handshake brings, and resumes: it does not lead a full
    /// handshake (a signature) the spare would have caused. With the gate open for good (no
    /// tickets counted), no spare at all.
    #[tokio::test]
    async fn a_client_waits_for_the_ticket_a_spare_brings_back() {
        let store = Arc::new(SessionStore::new(4));
        let brief = Duration::from_millis(10);
        assert!(
            store.claim_for_spare(brief).await.is_none(),
            "no ticket, no spare"
        );
        ticket_arrives(&store);
        let spare = store
            .claim_for_spare(brief)
            .await
            .expect("a ticket for the spare");
        client_waits_for(&store, spare).await;
        // A claim given up before its handshake (the dial failed) gives its ticket back.
        ticket_arrives(&store);
        drop(store.claim_for_spare(brief).await);
        assert_eq!(store.available(), 1);
        store.bypass.store(true, Ordering::SeqCst);
        assert!(
            store.claim_for_spare(brief).await.is_none(),
            "no tickets counted: no spare"
        );
    }

    /// A spare a relay loop makes claims its ticket without waiting, and counts as a spare
    /// coming as a connection thread's does: a client that finds no ticket while its handshake
    /// is under way waits for the ticket it brings back rather than lead a full handshake. Its
    /// claim given up before its handshake gives the ticket back; none is claimed while the
    /// store holds no ticket, or while loops rest.
    #[tokio::test]
    async fn a_client_waits_for_the_ticket_a_loops_spare_brings_back() {
        let store = Arc::new(SessionStore::new(4));
        assert!(store.try_claim_for_spare().is_none(), "no ticket, no spare");
        ticket_arrives(&store);
        let spare = store.try_claim_for_spare().expect("a ticket for the spare");
        client_waits_for(&store, spare).await;
        ticket_arrives(&store);
        drop(
            store
                .try_claim_for_spare()
                .expect("a ticket for the next spare"),
        );
        assert_eq!(
            store.available(),
            1,
            "a claim given up gives its ticket back"
        );
        store.loops_refused();
        assert!(store.try_claim_for_spare().is_none(), "loops rest");
    }

    /// A spare whose handshake stalls (an API server that accepted it and never answers) does
    /// not send every waiting client into a full handshake of its own (a signature each) when
    /// the gate's wait ends: after [`SPARE_PATIENCE`] one of them leads, and the others wait
    /// for its tickets and resume.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_spare_makes_one_waiting_client_lead_not_every_one_sign() {
        let store = Arc::new(SessionStore::new(4));
        ticket_arrives(&store);
        let mut spare = store.try_claim_for_spare().expect("a ticket for the spare");
        let _ = spare.start();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.warm_up().await })
            })
            .collect();
        // Past the patience, well before the gate's own wait ends.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let (done, waiting): (Vec<_>, Vec<_>) = waiters.into_iter().partition(|w| w.is_finished());
        assert_eq!(
            done.len(),
            1,
            "one client leads once the stalled spare has had its time; the others wait for it"
        );
        let lead = done
            .into_iter()
            .next()
            .expect("the lead")
            .await
            .expect("joined");
        let Warmup::Leader(guard) = lead else {
            panic!("the client that went ahead goes as the leader, not on its own: {lead:?}");
        };
        // The lead's handshake brings its tickets: the others resume with them.
        guard.succeeded();
        ticket_arrives(&store);
        ticket_arrives(&store);
        for w in waiting {
            let went = w.await.expect("joined");
            assert!(matches!(went, Warmup::Go), "a waiter resumes: {went:?}");
        }
        assert_eq!(store.available(), 0, "each waiter claimed a ticket");
        drop(spare);
    }

    /// An API server far away (its last resumed handshake took 600 ms) gets four times that
    /// for a spare before a waiting client leads: at 1.5 s the client still waits, and the
    /// spare's ticket arriving then lets it resume with no full handshake.
    #[tokio::test(start_paused = true)]
    async fn a_far_api_servers_spare_is_waited_for_longer() {
        let store = Arc::new(SessionStore::new(4));
        store.resumed_in(Duration::from_millis(600));
        ticket_arrives(&store);
        let mut spare = store.try_claim_for_spare().expect("a ticket for the spare");
        let _ = spare.start();
        let waiter = {
            let store = store.clone();
            tokio::spawn(async move { store.warm_up().await })
        };
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(
            !waiter.is_finished(),
            "the client waits for a far server's spare"
        );
        ticket_arrives(&store);
        drop(spare);
        let went = waiter.await.expect("joined");
        assert!(matches!(went, Warmup::Go), "the client resumes: {went:?}");
        assert!(!store.leader.load(Ordering::SeqCst), "nobody led");
    }

    /// A spare waits for the ticket the client connection just made brings back.
    #[tokio::test]
    async fn a_spare_waits_for_a_ticket_to_come() {
        let store = Arc::new(SessionStore::new(4));
        let spare = async { store.claim_for_spare(Duration::from_secs(5)).await };
        let arrival = async {
            tokio::task::yield_now().await;
            ticket_arrives(&store);
        };
        let (spare, ()) = tokio::join!(spare, arrival);
        assert!(spare.is_some());
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
