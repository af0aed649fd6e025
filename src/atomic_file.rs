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
///
/// The previous content is read without following a link or waiting on a FIFO, within the
/// small-file bound: whoever can write the directory must not get another file copied into a
/// readable `.prev`, nor stall the writer.
pub fn write_keeping_previous(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    if let Some(previous) = read_previous(path)? {
        let mut prev = path.as_os_str().to_owned();
        prev.push(".prev");
        write_atomic(Path::new(&prev), &previous, mode)?;
    }
    write_atomic(path, contents, mode)
}

/// The largest previous content kept (a certificate chain is a few KiB).
const MAX_PREVIOUS: u64 = 4 * 1024 * 1024;

/// What `path` holds, opened without following a final link or waiting on a FIFO; None when
/// nothing is there.
fn read_previous(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() > MAX_PREVIOUS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} is not a regular file of at most 4 MiB: not replaced",
                path.display()
            ),
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PREVIOUS).read_to_end(&mut bytes)?;
    Ok(Some(bytes))
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
