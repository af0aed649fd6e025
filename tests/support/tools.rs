//! Finding the external tools the tests drive, and small file helpers. A missing tool is a
//! broken test machine: the helpers panic with the package to install, never skip.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use crate::*;

/// Full path of `cmd` if it is on PATH (or, when it contains a `/`, if that file exists).
pub fn find_tool(cmd: &str) -> Option<PathBuf> {
    if cmd.contains('/') {
        let p = PathBuf::from(cmd);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(cmd))
        .find(|p| {
            p.is_file()
                && p.metadata()
                    .map(|m| m.permissions().mode() & 0o111 != 0)
                    .unwrap_or(false)
        })
}

/// Panics (a test failure, never a skip) if `cmd` is not on PATH, naming the apt package.
pub fn require_tool(cmd: &str, apt_package: &str) {
    if find_tool(cmd).is_none() {
        panic!(
            "{cmd} not found: install it with `apt-get install {apt_package}` \
             (or run hsm-fixtures/install-deps.sh)"
        );
    }
}

/// Path of the SoftHSMv2 PKCS#11 module; panics with the install hint if it is missing.
pub fn softhsm_module() -> PathBuf {
    let p = PathBuf::from(SOFTHSM_MODULE);
    if !p.exists() {
        panic!(
            "{SOFTHSM_MODULE} not found: install it with `apt-get install softhsm2` \
             (or run hsm-fixtures/install-deps.sh)"
        );
    }
    p
}

/// A new temporary directory (removed on Drop) whose name starts with `hwkey-test-`.
pub fn temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("hwkey-test-")
        .tempdir()
        .expect("create a temporary directory")
}

/// Reads a whole file to a String, panicking with the path on error.
pub fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
