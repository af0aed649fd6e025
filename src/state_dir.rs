//! The state directory (loopback CA key, control socket, start lock, logs) must belong to the
//! user who runs hwkey and be writable by nobody else: a proxy that loaded a CA key from a
//! directory another user controls would mint loopback credentials that user chose, and a
//! control socket planted by another user would hand out that user's credentials. Files in it
//! are opened without following symbolic links.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The effective uid of this process.
pub fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Creates `dir` (mode 0700) if it does not exist; otherwise checks that it is a real directory
/// owned by this user and writable by no one else. The error says what is wrong and how to fix
/// it.
pub fn ensure_private(dir: &Path) -> io::Result<()> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        }
        Err(e) => Err(e),
        Ok(meta) => check(dir, &meta, true),
    }
}

/// Checks that `path` (a file in a state directory) is not a symlink, belongs to this user, and
/// is writable by no one else.
pub fn check_file(path: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    check(path, &meta, false)
}

fn check(path: &Path, meta: &fs::Metadata, want_dir: bool) -> io::Result<()> {
    let refuse = |what: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, what));
    if meta.file_type().is_symlink() {
        return refuse(format!(
            "{} is a symbolic link; hwkey's state must be a real {} owned by you",
            path.display(),
            if want_dir { "directory" } else { "file" }
        ));
    }
    if want_dir && !meta.is_dir() {
        return refuse(format!("{} is not a directory", path.display()));
    }
    let me = own_uid();
    if meta.uid() != me {
        return refuse(format!(
            "{} belongs to uid {}, not to uid {me} who runs hwkey: use a state directory of your own (--state-dir), or `chown` it if it really is yours",
            path.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "{} is writable by other users (mode {:o}): chmod go-w it",
            path.display(),
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

/// Reads a file of a state directory without following symbolic links, after checking its
/// owner and mode.
pub fn read_private(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is a symbolic link; hwkey's state files must be real files owned by you",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    check(path, &f.metadata()?, false)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out)?;
    Ok(out)
}
