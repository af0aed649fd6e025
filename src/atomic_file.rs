//! Writing files so that a reader (or a crash) never sees half of one.
//!
//! Every file hwkey writes (CSRs, key files, certificates, kubeconfigs) goes through
//! [`write_atomic`]: a temporary file in the same directory, fsync, then rename over the target.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Writes `contents` to `path` atomically with the given Unix mode.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    write(path, contents, mode, Replace::Yes)
}

/// Like [`write_atomic`] but refuses to replace an existing file (of two racing writers, the
/// first one's file stays).
pub fn create_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    write(path, contents, mode, Replace::No)
}

/// Like [`write_atomic`], keeping what `path` held as `PATH.prev` first (a renewed
/// certificate's predecessor, for a roll-back by hand).
pub fn write_keeping_previous(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    match std::fs::read(path) {
        Ok(previous) => {
            let mut prev = path.as_os_str().to_owned();
            prev.push(".prev");
            write_atomic(Path::new(&prev), &previous, mode)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    write_atomic(path, contents, mode)
}

#[derive(PartialEq, Eq)]
enum Replace {
    Yes,
    No,
}

/// The one implementation: a temporary file beside the target, the mode set before any byte is
/// written, fsync, then rename (or link, when an existing file must stay).
fn write(path: &Path, contents: &[u8], mode: u32, replace: Replace) -> std::io::Result<()> {
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
    match replace {
        Replace::Yes => tmp.persist(path).map_err(|e| e.error)?,
        Replace::No => tmp.persist_noclobber(path).map_err(|e| e.error)?,
    };
    Ok(())
}
