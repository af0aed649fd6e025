//! Finding a token by label and logging in to it.
//!
//! Tokens are found by label (or serial), never by slot number: `C_InitToken` renumbers SoftHSM
//! slots. Login is per token per process and happens at most once per session we open; a wrong
//! PIN is tried exactly once and then remembered — on disk, across processes, until the PIN's
//! source changes ([`crate::key::pin_memory`]) — because tokens lock after a few failures. A
//! token that says it has one attempt left (`CKF_USER_PIN_FINAL_TRY`) gets no login at all
//! unless the user allows it (`HWKEY_ALLOW_FINAL_PIN_TRY=1`).

use std::path::PathBuf;
use std::sync::Arc;

use cryptoki::context::Pkcs11;
use cryptoki::error::{Error as CkError, RvError};
use cryptoki::session::{Session, SessionState, UserType};
use cryptoki::slot::{Limit, Slot};
use cryptoki::types::AuthPin;

use super::module::{CallGuard, Calls};
use super::rv::ckr;
use crate::key::pin::PinSource;
use crate::key::pin_memory::{self, Record};
use crate::key::{DeviceError, LocateError, PinError};
use crate::key::{KeyError, Pkcs11Uri};

/// One token in one module, with what is needed to (re)log in.
#[derive(Debug)]
pub(crate) struct Token {
    pub(crate) ctx: Pkcs11,
    /// The module's gate: every call into the module runs inside it (see `module`).
    pub(crate) calls: Arc<Calls>,
    /// The slot id; it can change when the token is removed and comes back
    /// ([`Token::relocate`]).
    slot: std::sync::Mutex<Slot>,
    /// The URI's token selection (label, serial, slot id), kept to find the token again.
    selector: Pkcs11Uri,
    pub(crate) label: String,
    pub(crate) serial: String,
    pub(crate) module: PathBuf,
    pin: Option<PinSource>,
    login_required: bool,
    /// The record of the PIN this token rejected in this process, if any: that PIN is not
    /// presented again here (even should its record on disk go), but a changed PIN is, once.
    pin_rejected: std::sync::Mutex<Option<PathBuf>>,
    /// Held by the thread that logs in: sessions opened at once (the pool) log in one at a
    /// time, and the others then find the token logged in.
    login: std::sync::Mutex<()>,
}

impl Token {
    /// Finds the token a URI selects (by `token=`, `serial=` or `slot-id=`).
    pub(crate) fn find(uri: &Pkcs11Uri) -> Result<Token, KeyError> {
        let module = uri.module()?;
        let (ctx, calls) = super::module::load(&module)?;
        // A token the module did not list may still be there: SoftHSM lists none when, during
        // its C_Initialize, another process was rewriting the token's file (a failed login does
        // that). After a moment for that write, the module is initialised again once, as for a
        // token that came back.
        let mut found = {
            let _calls = calls.enter();
            locate(&ctx, uri, &module)
        };
        if matches!(
            found,
            Err(KeyError::Locate(LocateError::TokenNotFound { .. }))
        ) {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if super::module::reinitialize(&module, &ctx, &calls) {
                let _calls = calls.enter();
                found = locate(&ctx, uri, &module);
            }
        }
        let (slot, label, serial, login_required) = found?;
        Ok(Token {
            ctx,
            calls,
            slot: std::sync::Mutex::new(slot),
            selector: uri.clone(),
            label,
            serial,
            module,
            pin: uri.pin.clone(),
            login_required,
            pin_rejected: std::sync::Mutex::new(None),
            login: std::sync::Mutex::new(()),
        })
    }

    /// The token's slot now.
    pub(crate) fn slot(&self) -> Slot {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks the token up again (same label / serial / slot id) after it was removed and came
    /// back, possibly in another slot; the module must have been re-initialised if it only
    /// scans tokens at C_Initialize (SoftHSM).
    pub(crate) fn relocate(&self) -> Result<(), KeyError> {
        let found = {
            let _calls = self.enter();
            locate(&self.ctx, &self.selector, &self.module)
        };
        let (slot, _, serial, _) = found?;
        if serial != self.serial {
            tracing::warn!(
                token = %self.label,
                old_serial = %self.serial,
                new_serial = %serial,
                "the token came back with another serial number"
            );
        }
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = slot;
        Ok(())
    }

    /// Enters the module's gate: calls made while the guard lives never overlap a
    /// re-initialisation of the module.
    pub(crate) fn enter(&self) -> CallGuard {
        self.calls.enter()
    }

    /// Opens a session and makes sure the user is logged in on it.
    pub(crate) fn open_session(&self, read_write: bool) -> Result<TokenSession, KeyError> {
        let _calls = self.enter();
        let generation = self.calls.generation();
        let session = if read_write {
            self.ctx.open_rw_session(self.slot())
        } else {
            self.ctx.open_ro_session(self.slot())
        }
        .map_err(|e| self.err("C_OpenSession", &e))?;
        let session = TokenSession::new(session, generation, &self.calls);
        self.ensure_login(&session)?;
        Ok(session)
    }

    /// Like [`Token::open_session`] (read-only), but a token that has no session left for this
    /// application (`CKR_SESSION_COUNT`) is `Ok(None)`: the session pool then shrinks to fit.
    pub(crate) fn try_open_session(&self) -> Result<Option<TokenSession>, KeyError> {
        let _calls = self.enter();
        let generation = self.calls.generation();
        let session = match self.ctx.open_ro_session(self.slot()) {
            Ok(s) => TokenSession::new(s, generation, &self.calls),
            Err(CkError::Pkcs11(RvError::SessionCount, _)) => return Ok(None),
            Err(e) => return Err(self.err("C_OpenSession", &e)),
        };
        self.ensure_login(&session)?;
        Ok(Some(session))
    }

    /// How many sessions the token allows one application (`ulMaxSessionCount`), if it says.
    pub(crate) fn session_limit(&self) -> Option<usize> {
        let _calls = self.enter();
        match self
            .ctx
            .get_token_info(self.slot())
            .ok()?
            .max_session_count()
        {
            Limit::Max(n) => usize::try_from(n).ok(),
            Limit::Unavailable | Limit::Infinite => None,
        }
    }

    /// Whether `session` is logged in (login is per token per process: one thread's login
    /// shows in every session).
    fn logged_in(&self, session: &Session) -> Result<bool, KeyError> {
        let state = session
            .get_session_info()
            .map_err(|e| self.err("C_GetSessionInfo", &e))?
            .session_state();
        Ok(matches!(state, SessionState::RoUser | SessionState::RwUser))
    }

    /// Logs in unless this process is already logged in to the token. One attempt, ever, with a
    /// PIN the token rejected: in this process (one thread at a time, checking again under the
    /// lock) and across processes (the token's login lock, [`pin_memory::lock_token`], held from
    /// the record check through `C_Login` and the record write).
    fn ensure_login(&self, session: &Session) -> Result<(), KeyError> {
        if self.logged_in(session)? {
            return Ok(());
        }
        let Some(source) = &self.pin else {
            if self.login_required {
                return Err(KeyError::Pin(PinError::Required {
                    token: self.label.clone(),
                }));
            }
            return Ok(());
        };
        let in_process = self.login.lock().unwrap_or_else(|p| p.into_inner());
        if self.logged_in(session)? {
            return Ok(());
        }
        self.prepare_pin(source, in_process)?
            .present(session, UserType::User)
    }

    /// Readies the re-authentication of one operation on a key with `CKA_ALWAYS_AUTHENTICATE`:
    /// call it before `C_SignInit`, then [`PinAttempt::present`] with
    /// [`UserType::ContextSpecific`] right after it. The PIN comes from the same source, with
    /// the same one-attempt rule as the login (a PIN the token rejected is never presented again,
    /// in any process, until its source changes); everything that may touch the token besides
    /// the login itself (the PIN-attempts check) happens here, so nothing comes between
    /// `C_SignInit` and `C_Login`.
    pub(crate) fn prepare_context_login(&self) -> Result<PinAttempt<'_>, KeyError> {
        let Some(source) = &self.pin else {
            return Err(KeyError::Pin(PinError::Required {
                token: self.label.clone(),
            }));
        };
        let in_process = self.login.lock().unwrap_or_else(|p| p.into_inner());
        self.prepare_pin(source, in_process)
    }

    /// Reads the PIN from `source` and takes the token's login locks (in this process and
    /// across processes), refusing a PIN the token rejected before or the token's last attempt.
    fn prepare_pin<'a>(
        &'a self,
        source: &'a PinSource,
        in_process: std::sync::MutexGuard<'a, ()>,
    ) -> Result<PinAttempt<'a>, KeyError> {
        let pin = source.read()?;
        // Fail closed: a PIN whose rejection could not be remembered is not presented.
        let across_processes = pin_memory::lock_token(&self.identity()).map_err(|e| {
            KeyError::Pin(PinError::Memory {
                dir: pin_memory::memory_dir(),
                reason: e.to_string(),
            })
        })?;
        let record = Record::for_source(&self.identity(), source, &pin).map_err(|e| {
            KeyError::Pin(PinError::Memory {
                dir: pin_memory::memory_dir(),
                reason: e.to_string(),
            })
        })?;
        let rejected_here = self
            .pin_rejected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_deref()
            == Some(record.path());
        if rejected_here {
            return Err(KeyError::Pin(PinError::Incorrect {
                token: self.label.clone(),
            }));
        }
        if record.exists() {
            return Err(KeyError::Pin(PinError::Remembered {
                token: self.label.clone(),
                source_desc: pin_memory::describe_source(source),
                record: record.path().to_path_buf(),
            }));
        }
        record.check_writable().map_err(|e| {
            KeyError::Pin(PinError::Memory {
                dir: pin_memory::memory_dir(),
                reason: e.to_string(),
            })
        })?;
        let record = Some(record);
        self.check_pin_attempts(source, pin.len())?;
        Ok(PinAttempt {
            token: self,
            source,
            pin,
            record,
            _in_process: in_process,
            _across_processes: across_processes,
        })
    }

    /// What identifies this token in the rejected-PIN records: module, serial and label.
    fn identity(&self) -> String {
        format!("{}\n{}\n{}", self.module.display(), self.serial, self.label)
    }

    /// Refuses to spend a token's last PIN attempt unless the user allowed it, and refuses a PIN
    /// of a length the token says it never takes (an empty PIN file, a variable set to nothing:
    /// presented, it would cost one of the token's few attempts for certain); warns when the
    /// token has seen wrong PINs.
    fn check_pin_attempts(&self, source: &PinSource, pin_len: usize) -> Result<(), KeyError> {
        let _calls = self.enter();
        let Ok(info) = self.ctx.get_token_info(self.slot()) else {
            return Ok(());
        };
        let (min, max) = (info.min_pin_length(), info.max_pin_length());
        // A token that reports no usable range (max 0, or below min) is taken at its word only
        // for the minimum; an empty PIN is never one a token with a PIN takes.
        let too_long = max >= min && max > 0 && pin_len > max;
        if pin_len == 0 || pin_len < min || too_long {
            return Err(KeyError::Pin(PinError::Length {
                token: self.label.clone(),
                source_desc: pin_memory::describe_source(source),
                len: pin_len,
                min: min.max(1),
                max,
            }));
        }
        if info.user_pin_final_try()
            && std::env::var("HWKEY_ALLOW_FINAL_PIN_TRY").as_deref() != Ok("1")
        {
            return Err(KeyError::Pin(PinError::FinalTry {
                token: self.label.clone(),
            }));
        }
        if info.user_pin_count_low() {
            tracing::warn!(
                token = %self.label,
                "the token reports wrong PINs since the last good login (CKF_USER_PIN_COUNT_LOW)"
            );
        }
        Ok(())
    }

    /// Maps a PKCS#11 error on this token.
    pub(crate) fn err(&self, operation: &'static str, e: &CkError) -> KeyError {
        pkcs11_err(operation, &self.label, e)
    }

    /// Where this token is, for messages.
    pub(crate) fn place(&self) -> String {
        format!("token '{}' in {}", self.label, self.module.display())
    }
}

/// A session of a token, tied to the module generation it was opened in: once the module was
/// re-initialised its handle is dead and may name a session opened since (another key's), so
/// it is forgotten, never closed. Closing happens inside the module's gate.
#[derive(Debug)]
pub(crate) struct TokenSession {
    session: Option<Session>,
    generation: u64,
    calls: Arc<Calls>,
}

impl TokenSession {
    fn new(session: Session, generation: u64, calls: &Arc<Calls>) -> TokenSession {
        TokenSession {
            session: Some(session),
            generation,
            calls: calls.clone(),
        }
    }

    /// Whether the module was not re-initialised since this session was opened.
    pub(crate) fn is_current(&self) -> bool {
        self.generation == self.calls.generation()
    }
}

impl std::ops::Deref for TokenSession {
    type Target = Session;

    fn deref(&self) -> &Session {
        // Invariant: `session` is Some until drop.
        self.session
            .as_ref()
            .unwrap_or_else(|| unreachable!("a token session is present until dropped"))
    }
}

impl Drop for TokenSession {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let _calls = self.calls.enter();
        if self.is_current() {
            drop(session);
        } else {
            std::mem::forget(session);
        }
    }
}

fn pkcs11_err(operation: &'static str, token: &str, e: &CkError) -> KeyError {
    KeyError::Device(DeviceError::Pkcs11 {
        operation,
        token: token.to_string(),
        reason: ckr(e),
        source: Some(cause(e)),
    })
}

/// cryptoki's error as the cause of a [`KeyError`]: a return value stays a typed
/// `cryptoki::error::Error` (callers match on it); other errors keep their text.
fn cause(e: &CkError) -> crate::key::error::Cause {
    match e {
        CkError::Pkcs11(rv, function) => Box::new(CkError::Pkcs11(*rv, *function)),
        other => other.to_string().into(),
    }
}

/// One PIN, read and checked, ready to be presented once under the token's login locks.
pub(crate) struct PinAttempt<'a> {
    token: &'a Token,
    source: &'a PinSource,
    pin: zeroize::Zeroizing<String>,
    record: Option<Record>,
    _in_process: std::sync::MutexGuard<'a, ()>,
    _across_processes: pin_memory::TokenLock,
}

impl PinAttempt<'_> {
    /// `C_Login(user)` with the PIN; a rejection is remembered so the PIN is never presented
    /// again until its source changes.
    pub(crate) fn present(self, session: &Session, user: UserType) -> Result<(), KeyError> {
        let token = self.token;
        let auth = AuthPin::from(self.pin.as_str());
        match session.login(user, Some(&auth)) {
            Ok(()) | Err(CkError::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => {
                pin_memory::forget_token(&token.identity());
                Ok(())
            }
            Err(CkError::Pkcs11(RvError::PinIncorrect, _)) => {
                if let Some(r) = &self.record {
                    *token.pin_rejected.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(r.path().to_path_buf());
                    r.remember(&token.label, self.source);
                }
                Err(KeyError::Pin(PinError::Incorrect {
                    token: token.label.clone(),
                }))
            }
            Err(CkError::Pkcs11(RvError::PinLocked, _)) => Err(KeyError::Pin(PinError::Locked {
                token: token.label.clone(),
            })),
            Err(e) => Err(token.err("C_Login", &e)),
        }
    }
}

/// Finds the slot of the token `uri` selects: (slot, label, serial, login required).
fn locate(
    ctx: &Pkcs11,
    uri: &Pkcs11Uri,
    module: &std::path::Path,
) -> Result<(Slot, String, String, bool), KeyError> {
    let module = module.to_path_buf();
    let slots = ctx
        .get_slots_with_token()
        .map_err(|e| pkcs11_err("C_GetSlotList", "(none)", &e))?;
    let mut present = Vec::new();
    let mut chosen = Vec::new();
    for slot in slots {
        let info = match ctx.get_token_info(slot) {
            Ok(info) => info,
            Err(_) => continue,
        };
        let label = info.label().trim_end().to_string();
        let serial = info.serial_number().trim_end().to_string();
        let matches = uri.token.as_ref().is_none_or(|t| *t == label)
            && uri.serial.as_ref().is_none_or(|s| *s == serial)
            && uri.slot_id.is_none_or(|id| id == slot.id())
            && uri
                .manufacturer
                .as_ref()
                .is_none_or(|m| m == info.manufacturer_id().trim_end())
            && uri
                .model
                .as_ref()
                .is_none_or(|m| m == info.model().trim_end());
        if !info.token_initialized() {
            continue;
        }
        if matches {
            chosen.push((slot, label.clone(), serial.clone(), info.login_required()));
        }
        present.push(label);
    }
    let selects = uri.token.is_some()
        || uri.serial.is_some()
        || uri.slot_id.is_some()
        || uri.manufacturer.is_some()
        || uri.model.is_some();
    if !selects && present.len() != 1 {
        return Err(KeyError::Locate(LocateError::NoTokenSelected {
            module,
            present,
        }));
    }
    // Two tokens that both fit (one label in two slots, a proxy module listing two modules'
    // tokens): which one signs must not depend on slot order.
    if chosen.len() > 1 {
        return Err(KeyError::Locate(LocateError::AmbiguousToken {
            token: uri.token_desc(),
            module,
            serials: chosen.iter().map(|c| c.2.clone()).collect(),
        }));
    }
    let Some((slot, label, serial, login_required)) = chosen.pop() else {
        return Err(KeyError::Locate(LocateError::TokenNotFound {
            token: uri.token_desc(),
            module,
            present,
        }));
    };
    Ok((slot, label, serial, login_required))
}
