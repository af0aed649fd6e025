//! Writing files so that a reader (or a crash) never sees half of one.
//!
//! Every file hwkey writes (CSRs, key files, certificates, kubeconfigs) goes through
//! [`write_atomic`]: a temporary file in the same directory, fsync, then rename over the target.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Writes `contents` to `path` atomically with the given Unix mode.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".hwkey-")
        .tempfile_in(dir)?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))?;
    tmp.write_all(contents)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Like [`write_atomic`] but refuses to replace an existing file.
pub fn create_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".hwkey-")
        .tempfile_in(dir)?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))?;
    tmp.write_all(contents)?;
    tmp.as_file().sync_all()?;
    tmp.persist_noclobber(path).map_err(|e| e.error)?;
    Ok(())
}
