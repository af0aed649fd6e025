//! Loading PKCS#11 modules: once per path per process.
//!
//! `C_Initialize` may be called once per process and login state is per process, so every key on
//! the same module must share one [`Pkcs11`] context. Modules are never finalised: a process that
//! signs keeps its module until it exits.

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
                reason: format!("C_Initialize failed: {}", super::ckr(&e)),
            })
        }
    }
    modules.insert(path.to_path_buf(), ctx.clone());
    Ok(ctx)
}
