//! The owner of the ESAPI context: exactly one per TCTI in this process, shared by every key,
//! listing and creation that talks to that TPM.
//!
//! Why one per TCTI and not one per key: swtpm and the Microsoft simulator serve a single TCP
//! connection at a time (a second client blocks, forever, until the first disconnects), and
//! without a resource manager all connections share the TPM's three transient-object slots. A
//! second `Context` on the same TPM would therefore hang or starve the first.
//!
//! Concurrency: the `Context` sits behind a `Mutex`. An ESAPI context must never be used by two
//! threads at once, and the TPM executes one command at a time anyway, so callers simply queue
//! on the lock; every critical section is a handful of TPM commands and never calls back into
//! hwkey. The registry of open TPMs holds only `Weak` references: when the last key using a TPM
//! is dropped, the context is finalised and the connection closed.
//!
//! Recovery: when the connection breaks (swtpm or tabrmd restarted, a TPM reset) the context
//! is replaced by a new one and the connection's *generation* goes up. ESYS handles are only
//! meaningful in the generation that made them; `loaded.rs` reloads keys whose generation is
//! stale and never flushes a handle from an older generation (the number may name another
//! object in the new context).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tss_esapi::handles::ObjectHandle;
use tss_esapi::structures::Auth;
use tss_esapi::{Context, TctiNameConf};
use zeroize::Zeroizing;

use super::rc;
use crate::backoff::Backoff;
use crate::key::DeviceError;
use crate::key::KeyError;

/// Open TPMs by canonical TCTI string.
static OPEN: Mutex<BTreeMap<String, Weak<Tpm>>> = Mutex::new(BTreeMap::new());

/// One TPM connection, shared.
pub(crate) struct Tpm {
    /// The TCTI as the user wrote it (for messages).
    tcti: String,
    conn: Mutex<Conn>,
}

/// The context and what is needed to replace it.
pub(crate) struct Conn {
    pub(crate) ctx: Context,
    generation: u64,
    conf: TctiNameConf,
    tcti: String,
    /// Set when a reconnect failed: `ctx` is the dead connection's context and must not be
    /// used again (its last command never finished, so every later call would be ESAPI's "bad
    /// sequence"); the next operation reconnects first.
    broken: Option<Broken>,
    /// The wait between failed reconnects.
    reconnect_backoff: Backoff,
    /// The owner hierarchy's password, set on every context this connection makes.
    owner_auth: Option<Zeroizing<Vec<u8>>>,
}

/// When the last reconnect failed and how long to wait before the next attempt.
#[derive(Debug, Clone, Copy)]
struct Broken {
    at: Instant,
    wait: Duration,
}

/// First pause after a failed reconnect; doubles up to [`MAX_RECONNECT_WAIT`]. Requests in
/// between fail at once (no TPM round trip) instead of queueing on a dead TPM.
const FIRST_RECONNECT_WAIT: Duration = Duration::from_millis(200);
const MAX_RECONNECT_WAIT: Duration = Duration::from_secs(5);

impl Conn {
    /// Counts the contexts made for this TPM; ESYS handles belong to one generation.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Replaces a broken context by a new connection. Every ESYS handle of the old one is void.
    /// A failure marks the connection broken (see [`Conn::ensure_connected`]).
    pub(crate) fn reconnect(&mut self) -> Result<(), KeyError> {
        let ctx = match open_context(&self.tcti, self.conf.clone()) {
            Ok(ctx) => ctx,
            Err(e) => {
                self.broken = Some(Broken {
                    at: Instant::now(),
                    wait: self.reconnect_backoff.next_delay(),
                });
                return Err(e);
            }
        };
        tracing::warn!(
            "reconnected to the TPM at TCTI '{}'; keys will be reloaded",
            self.tcti
        );
        // The old context's Drop tries to flush its objects over the dead connection and logs
        // the failures; the TPM already forgot them.
        self.ctx = ctx;
        self.apply_owner_auth()?;
        self.generation += 1;
        self.broken = None;
        self.reconnect_backoff.reset();
        Ok(())
    }

    /// Uses `password` for the owner hierarchy from now on (ESYS keeps a hierarchy's auth value
    /// per context: it is set again after a reconnect).
    pub(crate) fn set_owner_auth(&mut self, password: Zeroizing<Vec<u8>>) -> Result<(), KeyError> {
        self.owner_auth = Some(password);
        self.apply_owner_auth()
    }

    fn apply_owner_auth(&mut self) -> Result<(), KeyError> {
        let Some(password) = &self.owner_auth else {
            return Ok(());
        };
        let auth = Auth::try_from(password.to_vec()).map_err(|e| {
            KeyError::Device(DeviceError::Tpm {
                operation: "setting the owner-hierarchy password",
                reason: format!("it is too long for this TPM's name algorithm: {e}"),
                source: Some(Box::new(e)),
            })
        })?;
        self.ctx
            .tr_set_auth(ObjectHandle::Owner, auth)
            .map_err(rc::tpm_error("setting the owner-hierarchy password"))
    }

    /// Makes sure the context is a live connection: after a failed reconnect, tries again once
    /// the backoff has passed, and until then fails at once with a clear error.
    pub(crate) fn ensure_connected(&mut self) -> Result<(), KeyError> {
        let Some(b) = self.broken else {
            return Ok(());
        };
        let since = b.at.elapsed();
        if since < b.wait {
            return Err(KeyError::Device(DeviceError::TpmConnect {
                source: None,
                tcti: self.tcti.clone(),
                reason: format!(
                    "the connection to the TPM was lost and reconnecting failed; the next attempt is in {} ms",
                    (b.wait - since).as_millis()
                ),
            }));
        }
        self.reconnect()
    }
}

fn open_context(tcti: &str, conf: TctiNameConf) -> Result<Context, KeyError> {
    Context::new(conf).map_err(|e| {
        KeyError::Device(DeviceError::TpmConnect {
            tcti: tcti.to_string(),
            reason: rc::connect_reason(tcti, &e),
            source: Some(Box::new(e)),
        })
    })
}

impl fmt::Debug for Tpm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tpm").field("tcti", &self.tcti).finish()
    }
}

const KNOWN_TCTIS: &str = "device:/dev/tpmrm0, swtpm:host=127.0.0.1,port=2321, \
                           mssim:host=127.0.0.1,port=2321 or tabrmd[:bus_name=…]";

impl Tpm {
    /// The TPM behind `tcti`, connecting if no key in this process uses it yet.
    ///
    /// The registry lock is held while connecting, so two threads never open two contexts on
    /// the same TPM (which would deadlock on swtpm); connecting is quick or fails quickly except
    /// on an unresponsive network host.
    pub(crate) fn connect(tcti: &str) -> Result<Arc<Tpm>, KeyError> {
        let conf = TctiNameConf::from_str(tcti).map_err(|_| {
            KeyError::Device(DeviceError::TpmConnect {
                source: None,
                tcti: tcti.to_string(),
                reason: format!(
                    "this is not a TCTI configuration hwkey understands (use {KNOWN_TCTIS})"
                ),
            })
        })?;
        let canonical = CString::try_from(conf.clone())
            .ok()
            .and_then(|c| c.into_string().ok())
            .unwrap_or_else(|| tcti.to_string());

        let mut open = OPEN.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tpm) = open.get(&canonical).and_then(Weak::upgrade) {
            return Ok(tpm);
        }
        let ctx = open_context(tcti, conf.clone())?;
        let tpm = Arc::new(Tpm {
            tcti: tcti.to_string(),
            conn: Mutex::new(Conn {
                ctx,
                generation: 0,
                conf,
                tcti: tcti.to_string(),
                broken: None,
                reconnect_backoff: Backoff::new(FIRST_RECONNECT_WAIT, MAX_RECONNECT_WAIT),
                owner_auth: None,
            }),
        });
        open.retain(|_, weak| weak.strong_count() > 0);
        open.insert(canonical, Arc::downgrade(&tpm));
        Ok(tpm)
    }

    /// The TCTI string, as the user gave it.
    pub(crate) fn tcti(&self) -> &str {
        &self.tcti
    }

    /// Runs `f` with exclusive use of the context.
    ///
    /// A panic in another holder poisons the lock but leaves the context usable (each ESAPI
    /// call is complete when it returns), so the poison is ignored.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Context) -> T) -> T {
        self.with_conn(|conn| f(&mut conn.ctx))
    }

    /// Like [`Tpm::with`], with the generation and the means to reconnect.
    pub(crate) fn with_conn<T>(&self, f: impl FnOnce(&mut Conn) -> T) -> T {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut conn)
    }
}
