//! Loading PKCS#11 modules: once per path per process.
//!
//! `C_Initialize` may be called once per process and login state is per process, so every key on
//! the same module must share one [`Pkcs11`] context. A module is finalised only to be
//! initialised again at once ([`reinitialize`]): some modules (SoftHSM) discover tokens only at
//! `C_Initialize`, so a token that was removed and came back is invisible until then. That
//! invalidates every session of every key on the module in this process; each key recovers on
//! its next signature (new session, login, key lookup). It happens at most once per
//! [`REINIT_INTERVAL`] per module.
//!
//! `C_Finalize` while another thread is inside a call of the same module is undefined
//! behaviour (PKCS#11 v2.40, 5.4): SoftHSM frees the objects that call is using. Every call
//! therefore runs inside the process's gate ([`Calls::enter`], shared, re-entrant per
//! thread), and [`reinitialize`] takes the gate alone: it waits until no call is in flight and
//! lets none start until the module is initialised again. Sessions opened before a re-initialisation are
//! never closed afterwards (their handles may name new sessions): see [`Calls::generation`].
use std::cell::Cell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};

use crate::key::KeyError;
use crate::key::LocateError;

/// A loaded module: its context and its generation.
type Loaded = (Pkcs11, Arc<Calls>);

static MODULES: OnceLock<Mutex<HashMap<PathBuf, Loaded>>> = OnceLock::new();

/// A module's place in the gate every PKCS#11 call of this process passes (see the module
/// comment), and its generation. The gate is one for all modules: two paths may lead to one
/// library instance (p11-kit's proxy, a pass-through module in front of SoftHSM), and
/// finalising it through one path frees what calls through the other are using.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    generation: AtomicU64,
}

#[derive(Debug, Default)]
struct Gate {
    /// Threads inside calls (each counted once however deeply it re-entered).
    callers: usize,
    /// A re-initialisation runs.
    exclusive: bool,
    /// Re-initialisations waiting: new callers wait behind them.
    waiting: usize,
}

static GATE: Mutex<Gate> = Mutex::new(Gate {
    callers: 0,
    exclusive: false,
    waiting: 0,
});
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// How deeply this thread is inside the gate.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// This thread's place inside the gate; leaving it when dropped. Not `Send`: the depth is the
/// thread's own.
#[derive(Debug)]
pub(crate) struct CallGuard {
    _thread_bound: PhantomData<*const ()>,
}

fn lock_gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(|p| p.into_inner())
}

impl Calls {
    /// Enters the gate (at once when this thread is already inside; else once no
    /// re-initialisation runs or waits).
    pub(crate) fn enter(&self) -> CallGuard {
        let depth = DEPTH.with(|d| {
            let depth = d.get();
            d.set(depth + 1);
            depth
        });
        if depth == 0 {
            let mut gate = lock_gate();
            while gate.exclusive || gate.waiting > 0 {
                gate = CHANGED.wait(gate).unwrap_or_else(|p| p.into_inner());
            }
            gate.callers += 1;
        }
        CallGuard {
            _thread_bound: PhantomData,
        }
    }

    /// Counts re-initialisations of this module: a session opened in an earlier generation is
    /// dead, and its handle may name a session opened since, so it is never closed.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Whether this thread is inside the gate (then it cannot wait for the gate alone).
    fn inside_here(&self) -> bool {
        DEPTH.with(|d| d.get() > 0)
    }

    /// Runs `f` with no PKCS#11 call in flight and none starting; this module's generation
    /// moves on (every session opened before is dead once `f` finalised the module).
    fn alone<R>(&self, f: impl FnOnce() -> R) -> R {
        let mut gate = lock_gate();
        gate.waiting += 1;
        while gate.exclusive || gate.callers > 0 {
            gate = CHANGED.wait(gate).unwrap_or_else(|p| p.into_inner());
        }
        gate.waiting -= 1;
        gate.exclusive = true;
        drop(gate);
        let out = f();
        self.generation.fetch_add(1, Ordering::SeqCst);
        lock_gate().exclusive = false;
        CHANGED.notify_all();
        out
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        let outermost = DEPTH.with(|d| {
            let depth = d.get().saturating_sub(1);
            d.set(depth);
            depth == 0
        });
        if outermost {
            lock_gate().callers -= 1;
            CHANGED.notify_all();
        }
    }
}

/// Returns the initialised context for the module at `path` and its gate, loading it on
/// first use.
pub(crate) fn load(path: &Path) -> Result<(Pkcs11, Arc<Calls>), KeyError> {
    let modules = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut modules = modules.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((ctx, calls)) = modules.get(path) {
        return Ok((ctx.clone(), calls.clone()));
    }
    if !path.exists() {
        return Err(KeyError::Locate(LocateError::ModuleLoad {
            path: path.to_path_buf(),
            reason: "no such file".into(),
        }));
    }
    let ctx = Pkcs11::new(path).map_err(|e| {
        KeyError::Locate(LocateError::ModuleLoad {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    })?;
    // OS_LOCKING_OK: we call the module from many threads (one session per thread at a time).
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
        Err(e) => {
            return Err(KeyError::Locate(LocateError::ModuleLoad {
                path: path.to_path_buf(),
                reason: format!("C_Initialize failed: {}", super::rv::ckr(&e)),
            }))
        }
    }
    let calls = Arc::new(Calls::default());
    modules.insert(path.to_path_buf(), (ctx.clone(), calls.clone()));
    Ok((ctx, calls))
}

/// The shortest time between two re-initialisations of one module.
pub(crate) const REINIT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

static LAST_REINIT: OnceLock<Mutex<HashMap<PathBuf, std::time::Instant>>> = OnceLock::new();

/// Finalises and initialises the module again (see the module comment), unless that was done
/// less than [`REINIT_INTERVAL`] ago, or this thread is inside a call of the module itself
/// (it would wait for itself). Waits until no call of the module is in flight. Returns whether
/// it was done.
pub(crate) fn reinitialize(path: &Path, ctx: &Pkcs11, calls: &Arc<Calls>) -> bool {
    if calls.inside_here() {
        tracing::debug!(module = %path.display(), "not re-initialising from inside a call of the module");
        return false;
    }
    {
        let last = LAST_REINIT.get_or_init(|| Mutex::new(HashMap::new()));
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        if last
            .get(path)
            .is_some_and(|t| t.elapsed() < REINIT_INTERVAL)
        {
            return false;
        }
        last.insert(path.to_path_buf(), std::time::Instant::now());
    }
    calls.alone(|| reinitialize_now(path, ctx))
}

fn reinitialize_now(path: &Path, ctx: &Pkcs11) -> bool {
    if let Err(e) = ctx.clone().finalize() {
        tracing::warn!(module = %path.display(), error = %super::rv::ckr(&e), "C_Finalize failed");
    }
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {
            tracing::warn!(module = %path.display(), "PKCS#11 module re-initialised to find a token that came back");
            true
        }
        Err(e) => {
            tracing::error!(module = %path.display(), error = %super::rv::ckr(&e), "C_Initialize failed after C_Finalize");
            false
        }
    }
}
