//! A key object in use by a [`super::TpmKey`], and its recovery when the TPM forgets it.
//!
//! The key is loaded once and then used for every signature. If the TPM loses it (the
//! connection broke because swtpm or the resource manager restarted, or the TPM was reset), the
//! next operation reconnects if needed, loads the key again from what was read when it was
//! opened (the file's blob, or the persistent handle, whose public key must not have changed)
//! and retries once. If the TPM is still down, the reconnect fails, the connection is marked
//! broken, and later operations fail fast until a reconnect (tried again with backoff) works:
//! the dead context is never used again. Retrying is safe: the operations run here (Sign, RSA_Decrypt) change
//! nothing in the TPM.
//!
//! The ESYS handle and its generation are atomics only so that `&self` can update them; they
//! are read and written under the TPM lock, never elsewhere.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use tss_esapi::handles::{KeyHandle, ObjectHandle};
use tss_esapi::structures::{Auth, Public};
use tss_esapi::tss2_esys::ESYS_TR;
use tss_esapi::Context;

use super::context::{Conn, Tpm};
use super::tss2_pem::Tss2Key;
use super::{rc, KeyError};
use crate::key::{DeviceError, PinError};

/// Where a key comes from, kept to load it again.
pub(crate) enum Source {
    /// A key file's contents, as read when it was opened.
    File(Tss2Key),
    /// A persistent key and its public area when it was opened.
    Persistent { handle: u32, public: Public },
}

/// Generation value meaning "no valid handle".
const NOT_LOADED: u64 = u64::MAX;

/// A key object the TPM holds for us.
pub(crate) struct LoadedKey {
    tpm: Arc<Tpm>,
    source: Source,
    handle: AtomicU32,
    generation: AtomicU64,
    /// The key's authValue, when it has a password.
    auth: Option<KeyAuth>,
}

/// A TPM key's password and how to remember its refusal: the TPM's dictionary-attack counter
/// counts every wrong one, so a refused password is presented once, across processes.
pub(crate) struct KeyAuth {
    /// The authValue, wiped on drop.
    pub value: zeroize::Zeroizing<Vec<u8>>,
    /// What the error messages call the key.
    pub key: String,
    /// The on-disk record of a refusal (None: only this process remembers).
    pub record: Option<crate::key::pin_memory::Record>,
    /// Where the password came from.
    pub source: crate::key::pin::PinSource,
    /// Set once the TPM refused it.
    pub refused: std::sync::atomic::AtomicBool,
    /// Set once the TPM accepted it: from then on no lock is needed.
    pub accepted: std::sync::atomic::AtomicBool,
    /// What identifies the key in the rejected-password records and their lock.
    pub identity: String,
}

impl fmt::Debug for LoadedKey {
    /// Short on purpose: the key blob is long and says nothing to a reader of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::File(file) => format!("file (parent {:#010x})", file.parent),
            Source::Persistent { handle, .. } => format!("persistent {handle:#010x}"),
        };
        f.debug_struct("LoadedKey")
            .field("tcti", &self.tpm.tcti())
            .field("source", &source)
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish()
    }
}

impl LoadedKey {
    /// Wraps a key that was just loaded (or opened) in connection `generation`; from here on
    /// it is released on drop.
    pub(crate) fn new(
        tpm: Arc<Tpm>,
        source: Source,
        handle: KeyHandle,
        generation: u64,
        auth: Option<KeyAuth>,
    ) -> Self {
        LoadedKey {
            tpm,
            source,
            handle: AtomicU32::new(ESYS_TR::from(handle)),
            generation: AtomicU64::new(generation),
            auth,
        }
    }

    /// A password the TPM refused is not presented again.
    ///
    /// Until the TPM has accepted it, its first presentation happens under the key's lock across
    /// processes, after another look at the records: of several processes with the same new
    /// wrong password, one presents it and the others find its record (the dictionary-attack
    /// counter counts every attempt).
    fn check_auth(&self) -> Result<Option<crate::key::pin_memory::TokenLock>, KeyError> {
        let Some(a) = &self.auth else {
            return Ok(None);
        };
        if a.refused.load(Ordering::SeqCst) {
            return Err(KeyError::Pin(PinError::TpmAuthRejected {
                key: a.key.clone(),
            }));
        }
        if a.accepted.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let lock = crate::key::pin_memory::lock_token(&a.identity).map_err(|e| {
            KeyError::Pin(PinError::Memory {
                dir: crate::key::pin_memory::memory_dir(),
                reason: e.to_string(),
            })
        })?;
        if let Some(r) = a.record.as_ref().filter(|r| r.exists()) {
            a.refused.store(true, Ordering::SeqCst);
            return Err(KeyError::Pin(PinError::TpmAuthRemembered {
                key: a.key.clone(),
                source_desc: crate::key::pin_memory::describe_source(&a.source),
                record: r.path().to_path_buf(),
            }));
        }
        // Fail closed: a refusal that could not be written down would be tried again by the
        // next process, and the TPM counts every wrong password towards its lockout.
        if let Some(r) = &a.record {
            r.check_writable().map_err(|e| {
                KeyError::Pin(PinError::Memory {
                    dir: crate::key::pin_memory::memory_dir(),
                    reason: e.to_string(),
                })
            })?;
        }
        Ok(Some(lock))
    }

    /// The TPM used the key: its password (if any) is right.
    fn auth_accepted(&self) {
        if let Some(a) = &self.auth {
            a.accepted.store(true, Ordering::SeqCst);
        }
    }

    /// After a refusal: remember it (here and on disk) and say so.
    fn auth_refused(&self) -> KeyError {
        let Some(a) = &self.auth else {
            return KeyError::Pin(PinError::TpmAuthRejected {
                key: "the TPM key".into(),
            });
        };
        a.refused.store(true, Ordering::SeqCst);
        if let Some(r) = &a.record {
            r.remember(&a.key, &a.source);
        }
        KeyError::Pin(PinError::TpmAuthRejected { key: a.key.clone() })
    }

    /// The TCTI of the TPM holding the key.
    pub(crate) fn tcti(&self) -> &str {
        self.tpm.tcti()
    }

    /// Runs a side-effect-free operation on the key, reloading it (and reconnecting) once if
    /// the TPM lost it.
    pub(crate) fn with_key<T>(
        &self,
        operation: &'static str,
        f: impl Fn(&mut Context, KeyHandle) -> Result<T, tss_esapi::Error>,
    ) -> Result<T, KeyError> {
        let _first_use = self.check_auth()?;
        self.tpm.with_conn(|conn| {
            conn.ensure_connected()?;
            let handle = self.ensure_loaded(conn)?;
            let err = match f(&mut conn.ctx, handle) {
                Ok(v) => {
                    self.auth_accepted();
                    return Ok(v);
                }
                Err(e) => e,
            };
            if rc::is_auth_fail(&err) {
                return Err(self.auth_refused());
            }
            if rc::is_connection_lost(&err) {
                tracing::warn!(
                    "TPM connection lost during {operation} ({}); reconnecting",
                    rc::describe_error(&err)
                );
                conn.reconnect()?;
            } else if rc::is_object_gone(&err) {
                tracing::warn!(
                    "the TPM lost the key during {operation} ({}); reloading it",
                    rc::describe_error(&err)
                );
                self.forget(conn);
            } else {
                return Err(rc::tpm_error(operation)(err));
            }
            let handle = self.ensure_loaded(conn)?;
            match f(&mut conn.ctx, handle) {
                Ok(v) => {
                    self.auth_accepted();
                    Ok(v)
                }
                // A wrong password found on the retry counts like one found at once: remembered
                // here and on disk, so no process presents it again (the TPM counted it).
                Err(e) if rc::is_auth_fail(&e) => Err(self.auth_refused()),
                Err(e) => Err(rc::tpm_error(operation)(e)),
            }
        })
    }

    /// Runs `f` with the key loaded (reconnecting or reloading first if needed), without a
    /// retry: for rare multi-command operations (certification) whose errors are already
    /// `KeyError`s.
    pub(crate) fn with_loaded<T>(
        &self,
        f: impl FnOnce(&mut Context, KeyHandle) -> Result<T, KeyError>,
    ) -> Result<T, KeyError> {
        let _first_use = self.check_auth()?;
        self.tpm.with_conn(|conn| {
            conn.ensure_connected()?;
            let handle = self.ensure_loaded(conn)?;
            f(&mut conn.ctx, handle)
        })
    }

    /// The key's handle in the current connection, loading the key if it has none.
    fn ensure_loaded(&self, conn: &mut Conn) -> Result<KeyHandle, KeyError> {
        let handle = self.load_if_needed(conn)?;
        // ESAPI keeps an object's authValue per handle, in this process: set it before every
        // use (no TPM command), so a reloaded key has it too.
        if let Some(a) = &self.auth {
            let auth =
                Auth::try_from(a.value.to_vec()).map_err(rc::tpm_error("the key's password"))?;
            conn.ctx
                .tr_set_auth(handle.into(), auth)
                .map_err(rc::tpm_error("setting the key's password"))?;
        }
        Ok(handle)
    }

    fn load_if_needed(&self, conn: &mut Conn) -> Result<KeyHandle, KeyError> {
        if self.generation.load(Ordering::Relaxed) == conn.generation() {
            return Ok(KeyHandle::from(self.handle.load(Ordering::Relaxed)));
        }
        let handle = match &self.source {
            Source::File(file) => load_key_file(&mut conn.ctx, file)?,
            Source::Persistent { handle, public } => {
                let (mut object, now) =
                    super::persistent::open_persistent(&mut conn.ctx, *handle, self.tpm.tcti())?;
                if &now != public {
                    let _ = conn.ctx.tr_close(&mut object);
                    return Err(KeyError::Device(DeviceError::TpmKeyUnusable {
                        key: format!("TPM persistent key {handle:#010x}"),
                        problem: crate::key::Unusable::ReplacedAtHandle,
                    }));
                }
                KeyHandle::from(object)
            }
        };
        self.handle.store(ESYS_TR::from(handle), Ordering::Relaxed);
        self.generation.store(conn.generation(), Ordering::Relaxed);
        tracing::info!("TPM key reloaded on TCTI '{}'", self.tpm.tcti());
        Ok(handle)
    }

    /// Drops the ESAPI record of a key the TPM no longer has.
    fn forget(&self, conn: &mut Conn) {
        if self.generation.load(Ordering::Relaxed) == conn.generation() {
            let mut object = ObjectHandle::from(self.handle.load(Ordering::Relaxed));
            // Closing is local to ESAPI; tss-esapi complains that a loaded object should have
            // been flushed, but the TPM has nothing left to flush.
            let _ = conn.ctx.tr_close(&mut object);
        }
        self.generation.store(NOT_LOADED, Ordering::Relaxed);
    }
}

impl Drop for LoadedKey {
    fn drop(&mut self) {
        let persistent = matches!(self.source, Source::Persistent { .. });
        self.tpm.with_conn(|conn| {
            // A handle of an older connection may name another object in this one.
            if self.generation.load(Ordering::Relaxed) != conn.generation() {
                return;
            }
            let handle = self.handle.load(Ordering::Relaxed);
            let result = if persistent {
                conn.ctx.tr_close(&mut ObjectHandle::from(handle))
            } else {
                conn.ctx.flush_context(ObjectHandle::from(handle))
            };
            if let Err(e) = result {
                tracing::warn!("could not release a TPM key: {}", rc::describe_error(&e));
            }
        });
    }
}

/// Loads a key file's key under its parent; the parent is flushed before this returns.
pub(super) fn load_key_file(ctx: &mut Context, file: &Tss2Key) -> Result<KeyHandle, KeyError> {
    super::primary::with_parent(ctx, file.parent, |ctx, parent| {
        ctx.execute_with_session(
            Some(tss_esapi::interface_types::session_handles::AuthSession::Password),
            |ctx| ctx.load(parent, file.private.clone(), file.public.clone()),
        )
        .map_err(super::primary::load_error(file.parent))
    })
}
