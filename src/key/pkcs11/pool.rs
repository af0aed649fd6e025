//! A pool of logged-in sessions so that signatures run in parallel on the token.
//!
//! A PKCS#11 session is `Send` but not `Sync`, and one session runs one operation at a time, so
//! each signer borrows a whole session for the duration of one signature. Sessions are opened on
//! demand up to a cap and kept afterwards: nothing is opened per signature on the hot path, and
//! because at least one session stays open the process stays logged in (closing the last session
//! logs out).
//!
//! Smart cards and some HSMs allow an application only a few sessions: the cap is the smaller
//! of hwkey's and the token's `ulMaxSessionCount`, and a token that refuses one more
//! (`CKR_SESSION_COUNT`, e.g. because another application holds sessions too) shrinks the cap
//! to the sessions this key already has; signers then wait for one of those instead of failing.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use cryptoki::session::Session;

use super::module::CallGuard;
use super::token::{Token, TokenSession};
use crate::key::DeviceError;
use crate::key::{KeyError, SessionStats};

/// The sessions of one key.
#[derive(Debug)]
pub(crate) struct SessionPool {
    state: Mutex<PoolState>,
    freed: Condvar,
    max: AtomicUsize,
    opened: AtomicU64,
    peak_in_use: AtomicU64,
    recovered: AtomicU64,
}

#[derive(Debug, Default)]
struct PoolState {
    idle: Vec<TokenSession>,
    in_use: usize,
}

/// A session borrowed from the pool; it goes back when dropped unless discarded. The borrower
/// is inside the module's gate for as long as it holds the session.
pub(crate) struct PooledSession<'a> {
    pool: &'a SessionPool,
    session: Option<TokenSession>,
    _calls: CallGuard,
}

impl SessionPool {
    /// A pool that opens at most `max` sessions at once.
    pub(crate) fn new(max: usize) -> SessionPool {
        SessionPool {
            state: Mutex::new(PoolState::default()),
            freed: Condvar::new(),
            max: AtomicUsize::new(max.max(1)),
            opened: AtomicU64::new(0),
            peak_in_use: AtomicU64::new(0),
            recovered: AtomicU64::new(0),
        }
    }

    /// Puts an already open, logged-in session into the pool.
    pub(crate) fn adopt(&self, session: TokenSession) {
        let mut state = self.lock();
        self.opened.fetch_add(1, Ordering::Relaxed);
        state.idle.push(session);
        self.freed.notify_one();
    }

    /// Borrows a session: an idle one, else a new one while under the cap, else waits.
    pub(crate) fn get(&self, token: &Token) -> Result<PooledSession<'_>, KeyError> {
        let calls = token.enter();
        let mut state = self.lock();
        loop {
            if let Some(session) = state.idle.pop() {
                if !session.is_current() {
                    // Opened before the module was re-initialised: dead (and forgotten).
                    drop(session);
                    continue;
                }
                state.in_use += 1;
                self.note_peak(state.in_use);
                return Ok(PooledSession {
                    pool: self,
                    session: Some(session),
                    _calls: calls,
                });
            }
            if state.in_use + state.idle.len() < self.max() {
                // Reserve the slot, then open outside the lock: opening may be slow.
                state.in_use += 1;
                self.note_peak(state.in_use);
                drop(state);
                match token.try_open_session() {
                    Ok(Some(session)) => {
                        self.opened.fetch_add(1, Ordering::Relaxed);
                        return Ok(PooledSession {
                            pool: self,
                            session: Some(session),
                            _calls: calls,
                        });
                    }
                    Ok(None) => {
                        state = self.lock();
                        state.in_use -= 1;
                        self.shrink_to(state.in_use + state.idle.len(), token)?;
                        continue;
                    }
                    Err(e) => {
                        self.release_slot();
                        return Err(e);
                    }
                }
            }
            state = self.freed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The most sessions this pool opens.
    pub(crate) fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// The token refused another session: keep the `have` sessions this key has (waiting for
    /// one of them), or fail if it has none.
    fn shrink_to(&self, have: usize, token: &Token) -> Result<(), KeyError> {
        if have == 0 {
            return Err(KeyError::Device(DeviceError::SessionLimit {
                token: token.place(),
            }));
        }
        if self.max.swap(have, Ordering::Relaxed) != have {
            tracing::warn!(
                "{} refused another session (CKR_SESSION_COUNT); this key now signs with at most {have} at once",
                token.place()
            );
        }
        Ok(())
    }

    /// Drops every idle session: after a token reset they are all dead.
    pub(crate) fn discard_idle(&self) {
        let idle = std::mem::take(&mut self.lock().idle);
        // Closing dead sessions fails harmlessly; dropping them is all that matters.
        drop(idle);
    }

    /// Counts one recovery from an invalidated session.
    pub(crate) fn note_recovered(&self) {
        self.recovered.fetch_add(1, Ordering::Relaxed);
    }

    /// The pool's counters.
    pub(crate) fn stats(&self) -> SessionStats {
        SessionStats {
            opened: self.opened.load(Ordering::Relaxed),
            peak_in_use: self.peak_in_use.load(Ordering::Relaxed),
            recovered: self.recovered.load(Ordering::Relaxed),
        }
    }

    fn note_peak(&self, in_use: usize) {
        self.peak_in_use.fetch_max(in_use as u64, Ordering::Relaxed);
    }

    fn release_slot(&self) {
        let mut state = self.lock();
        state.in_use -= 1;
        self.freed.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PooledSession<'_> {
    /// The borrowed session.
    pub(crate) fn session(&self) -> &Session {
        // Invariant: `session` is Some until drop or discard, which consume self.
        self.session
            .as_deref()
            .unwrap_or_else(|| unreachable!("a pooled session is present until dropped"))
    }

    /// Throws the session away instead of returning it (the token invalidated it).
    pub(crate) fn discard(mut self) {
        self.session.take();
        self.pool.release_slot();
    }
}

impl Drop for PooledSession<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            let mut state = self.pool.lock();
            state.in_use -= 1;
            state.idle.push(session);
            self.pool.freed.notify_one();
        }
    }
}
