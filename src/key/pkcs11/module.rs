//! Loading PKCS#11 modules: once per path per process.
//!
//! `C_Initialize` may be called once per process and login state is per process, so every key on
//! the same module must share one [`Pkcs11`] context. A module is finalised only to be
//! initialised again at once ([`reinitialize`]): some modules (SoftHSM) discover tokens only at
//! `C_Initialize`, so a token that was removed and came back is invisible until then. That
//! invalidates every session of every key on the module in this process; each key recovers on
//! its next signature (new session, login, key lookup). It happens at most once per
//! [`REINIT_INTERVAL`] per module.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};

use crate::key::KeyError;

static MODULES: OnceLock<Mutex<HashMap<PathBuf, Pkcs11>>> = OnceLock::new();

/// Returns the initialised context for the module at `path`, loading it on first use.
pub(crate) fn load(path: &Path) -> Result<Pkcs11, KeyError> {
    let modules = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut modules = modules.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ctx) = modules.get(path) {
        return Ok(ctx.clone());
    }
    if !path.exists() {
        return Err(KeyError::ModuleLoad {
            path: path.to_path_buf(),
            reason: "no such file".into(),
        });
    }
    let ctx = Pkcs11::new(path).map_err(|e| KeyError::ModuleLoad {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    // OS_LOCKING_OK: we call the module from many threads (one session per thread at a time).
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
        Err(e) => {
            return Err(KeyError::ModuleLoad {
                path: path.to_path_buf(),
                reason: format!("C_Initialize failed: {}", super::rv::ckr(&e)),
            })
        }
    }
    modules.insert(path.to_path_buf(), ctx.clone());
    Ok(ctx)
}

/// The shortest time between two re-initialisations of one module.
pub(crate) const REINIT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

static LAST_REINIT: OnceLock<Mutex<HashMap<PathBuf, std::time::Instant>>> = OnceLock::new();

/// Finalises and initialises the module again (see the module comment), unless that was done
/// less than [`REINIT_INTERVAL`] ago. Returns whether it was done.
pub(crate) fn reinitialize(path: &Path, ctx: &Pkcs11) -> bool {
    let last = LAST_REINIT.get_or_init(|| Mutex::new(HashMap::new()));
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    if last
        .get(path)
        .is_some_and(|t| t.elapsed() < REINIT_INTERVAL)
    {
        return false;
    }
    last.insert(path.to_path_buf(), std::time::Instant::now());
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
