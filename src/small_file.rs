//! Reading the small files hwkey is pointed at (certificates, CA bundles, config files): regular
//! files only, with a size bound. A path such as `/dev/zero`, a FIFO swapped in where a file
//! was, or a runaway file must fail at once with a clear error — not read until memory runs
//! out, not block the caller for good (a FIFO is opened without waiting for a writer).

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The largest certificate chain, CA bundle or config file hwkey reads: far above any real one
/// (a CA bundle of every public root is about 250 KiB).
pub const MAX_SMALL_FILE: u64 = 4 * 1024 * 1024;

/// Reads `path` whole: a regular file (symbolic links followed) no longer than
/// [`MAX_SMALL_FILE`]; anything else fails with `InvalidData` saying what it is.
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    read_checked(path, |_| Ok(()))
}

/// [`read`] for a file a running proxy reads again (its certificate, its CA bundle), which must
/// also belong to this user or root and be writable by no one else: what is trusted must not
/// be replaceable by another local user.
pub fn read_watched(path: &Path) -> std::io::Result<Vec<u8>> {
    read_checked(path, watched)
}

/// [`read_watched`] for a reader that may be fooled by whoever can write where the file is:
/// the file opened is checked to lie beneath `dir` (after the open, from the descriptor's own
/// path: a link swapped in between a check and the open cannot lead elsewhere).
pub fn read_watched_beneath(path: &Path, dir: &Path) -> std::io::Result<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let (file, meta) = open_regular(path)?;
    let real = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    if !real.starts_with(dir) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "leads to {}, outside {}: put the file itself there",
                real.display(),
                dir.display()
            ),
        ));
    }
    watched(&meta)?;
    read_bounded(file)
}

/// What [`read_watched`] requires of the file.
fn watched(meta: &std::fs::Metadata) -> std::io::Result<()> {
    {
        let me = rustix::process::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(invalid(format!(
                "belongs to uid {}, not to uid {me} or root",
                meta.uid()
            )));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(invalid(format!(
                "is writable by other users (mode {:o}): chmod go-w it",
                meta.mode() & 0o777
            )));
        }
        Ok(())
    }
}

fn invalid(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

/// Opens `path` for reading without waiting (a FIFO is not waited on for a writer) and checks
/// that it is a regular file (symbolic links followed); anything else fails with
/// `InvalidData` saying what it is. For readers that bound and hold the bytes themselves (a
/// PIN file's, wiped after use).
pub fn open_regular(path: &Path) -> std::io::Result<(std::fs::File, std::fs::Metadata)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else if meta.file_type().is_symlink() {
            "a symbolic link"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        return Err(invalid(format!("is {kind}: point it at a file")));
    }
    Ok((file, meta))
}

fn read_checked(
    path: &Path,
    check: impl Fn(&std::fs::Metadata) -> std::io::Result<()>,
) -> std::io::Result<Vec<u8>> {
    let (file, meta) = open_regular(path)?;
    check(&meta)?;
    read_bounded(file)
}

/// The whole of an opened file, at most [`MAX_SMALL_FILE`].
fn read_bounded(file: std::fs::File) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(MAX_SMALL_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "longer than {} MiB: not a certificate, CA bundle or config file",
                MAX_SMALL_FILE / (1024 * 1024)
            ),
        ));
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_to_string(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read(path)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_refused_without_reading_it() {
        let e = read(Path::new("/dev/zero")).expect_err("/dev/zero is no file");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("dir");
        let fifo = dir.path().join("ca.pem");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let e = read(&fifo).expect_err("a FIFO is no file");
        assert!(e.to_string().contains("FIFO"), "{e}");
    }
}
