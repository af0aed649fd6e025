//! Where a PIN comes from, and reading it without leaving copies behind.
//!
//! PINs never come from argv (visible in `ps`). They are read when needed, held in a
//! [`zeroize::Zeroizing`] buffer for the duration of one login, and never logged.

use std::fmt;
use std::path::PathBuf;

use zeroize::{Zeroize, Zeroizing};

use super::KeyError;
use crate::key::PinError;

/// The `pin-source` (or `pin-value`) of a key URI.
#[derive(Clone, PartialEq, Eq)]
pub enum PinSource {
    /// A file holding the PIN; one trailing newline is ignored. It must be a regular file no
    /// longer than a PIN that no other user can write ([`read_pin_file`]).
    File(PathBuf),
    /// An environment variable holding the PIN.
    Env(String),
    /// A PIN written in the URI itself (`pin-value`); accepted with a warning.
    Value(Zeroizing<String>),
}

impl PinSource {
    /// Parses a source as URIs and settings write it: `env:VAR`, `file:/path`,
    /// `file:///path` or an absolute path. None for anything else (a relative path would
    /// depend on the working directory; `pin-value` is not a source of this syntax).
    pub fn parse(value: &str) -> Option<PinSource> {
        if let Some(var) = value.strip_prefix("env:") {
            return (!var.is_empty()).then(|| PinSource::Env(var.to_string()));
        }
        let path = value
            .strip_prefix("file://")
            .or_else(|| value.strip_prefix("file:"))
            .unwrap_or(value);
        path.starts_with('/')
            .then(|| PinSource::File(PathBuf::from(path)))
    }

    /// Why `value` is not a source, in words that never repeat it: a PIN or a password typed
    /// where its source belongs would otherwise land in a log or a terminal's scroll-back.
    /// Only the shape is described (its length, and which prefix it lacks or misuses).
    pub fn why_not(value: &str) -> String {
        const FORMS: &str = "file:/absolute/path, an absolute path, or env:VAR";
        if value.strip_prefix("env:").is_some() {
            return format!("'env:' names no variable (write env:VAR; forms: {FORMS})");
        }
        if value.starts_with("file:") {
            return format!(
                "a file: source must name an absolute path ({} characters after 'file:' do not start with '/'; forms: {FORMS})",
                value.len() - "file:".len()
            );
        }
        format!(
            "it is not a source: a value of {} characters that starts with neither 'file:', 'env:' nor '/' \
             (not repeated here, in case it is the secret itself: put a secret in a file only you can read \
             and write file:/path, or in an environment variable and write env:VAR; forms: {FORMS})",
            value.chars().count()
        )
    }

    /// Reads the PIN. The result is wiped from memory when dropped.
    pub fn read(&self) -> Result<Zeroizing<String>, KeyError> {
        match self {
            PinSource::File(path) => {
                let bytes = read_pin_file(path).map_err(|e| {
                    KeyError::Pin(PinError::Unreadable {
                        source_desc: format!("file {}", path.display()),
                        reason: e.to_string(),
                    })
                })?;
                let text = std::str::from_utf8(&bytes).map_err(|_| {
                    KeyError::Pin(PinError::Unreadable {
                        source_desc: format!("file {}", path.display()),
                        reason: "it is not UTF-8 text".into(),
                    })
                })?;
                let pin = text.strip_suffix('\n').unwrap_or(text);
                let pin = pin.strip_suffix('\r').unwrap_or(pin);
                if pin.len() > MAX_PIN_LEN {
                    return Err(KeyError::Pin(PinError::Unreadable {
                        source_desc: format!("file {}", path.display()),
                        reason: format!("it is longer than {MAX_PIN_LEN} bytes: not a PIN file"),
                    }));
                }
                Ok(Zeroizing::new(pin.to_string()))
            }
            PinSource::Env(var) => env_pin(var, std::env::var(var)),
            PinSource::Value(v) => Ok(v.clone()),
        }
    }
}

/// The PIN of environment variable `var`, from what [`std::env::var`] returned. Not the error's
/// own text: for a value that is not Unicode, the standard library's message quotes the value,
/// which is the PIN.
fn env_pin(
    var: &str,
    value: Result<String, std::env::VarError>,
) -> Result<Zeroizing<String>, KeyError> {
    let reason = match value {
        Ok(v) => return Ok(Zeroizing::new(v)),
        Err(std::env::VarError::NotPresent) => "it is not set",
        Err(std::env::VarError::NotUnicode(value)) => {
            std::os::unix::ffi::OsStringExt::into_vec(value).zeroize();
            "it is not UTF-8 text"
        }
    };
    Err(KeyError::Pin(PinError::Unreadable {
        source_desc: format!("environment variable {var}"),
        reason: reason.into(),
    }))
}

/// Reads a PIN file: a regular file (a FIFO is refused at once, not waited on while the token's
/// login lock is held), no longer than a PIN with its line ending (not `/dev/zero` read until
/// memory runs out), and writable by no other user (who could otherwise spend the token's PIN
/// attempts by rewriting it): owned by hwkey's user or root (an owner can always make it
/// writable again), not writable by everyone, and by its group only when that is the group
/// hwkey runs as (a user private group, umask 002; `root:hwkey 0660` for the service). Readable
/// by everyone is allowed with a warning, once per file and process: a Kubernetes secret
/// volume's files are 0644 by default (`defaultMode: 0440` avoids it); readable by its group is
/// the documented `root:hwkey 0640`. The bytes are read into one buffer of fixed
/// capacity, wiped when dropped, so no reallocation leaves a copy behind. The error is the
/// reason alone, in words that never include the file's contents.
fn read_pin_file(path: &std::path::Path) -> std::io::Result<Zeroizing<Vec<u8>>> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let (file, meta) = crate::small_file::open_regular(path)?;
    let mode = meta.mode() & 0o777;
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(refuse(format!(
            "it is owned by uid {}, who could change the PIN hwkey presents (and so spend the token's PIN attempts): chown it to uid {me} or root",
            meta.uid()
        )));
    }
    let own_group = meta.gid() == rustix::process::getegid().as_raw();
    if mode & 0o002 != 0 || (mode & 0o020 != 0 && !own_group) {
        return Err(refuse(format!(
            "it is writable by other users (mode {mode:o}, group {}), who could change the PIN hwkey presents: chmod go-w it",
            meta.gid()
        )));
    }
    if mode & 0o004 != 0 && warn_once(path) {
        tracing::warn!(
            file = %path.display(),
            "the PIN file is readable by every user (mode {mode:o}): chmod o-r it (for a Kubernetes secret volume, set defaultMode: 0440 or 0400)"
        );
    }
    // A PIN, a carriage return and a newline, and one byte more to tell a longer file.
    let limit = MAX_PIN_LEN + 2;
    let mut bytes = Zeroizing::new(Vec::with_capacity(limit + 1));
    file.take(limit as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > limit {
        return Err(refuse(format!(
            "it is longer than {MAX_PIN_LEN} bytes and a line ending: not a PIN file"
        )));
    }
    Ok(bytes)
}

/// True the first time `path` is seen in this process: a PIN read for every signature (a key
/// that needs its PIN each time) warns once, not once per handshake.
fn warn_once(path: &std::path::Path) -> bool {
    static WARNED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    if warned.iter().any(|p| p == path) {
        return false;
    }
    warned.push(path.to_path_buf());
    true
}

impl fmt::Debug for PinSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinSource::File(p) => write!(f, "File({})", p.display()),
            PinSource::Env(v) => write!(f, "Env({v})"),
            PinSource::Value(_) => f.write_str("Value(<redacted>)"),
        }
    }
}

/// The exit status of an hwkey process when the token rejected the PIN, or hwkey refused to
/// present a PIN the token rejected before (or its last attempt): supervisors must not restart
/// on it (the systemd unit sets `RestartPreventExitStatus=77`), and the credential plugin does
/// not retry. 77 is sysexits' EX_NOPERM.
pub const EXIT_PIN_REFUSED: u8 = 77;

/// The longest PIN read from a pipe (PKCS#11 PINs are short; this bounds the locked buffer).
const MAX_PIN_LEN: usize = 256;

/// Reads one PIN line from `reader` (a pipe from the process that prompted for it) into a
/// buffer that is locked in RAM where the system allows it (never swapped out) and wiped when
/// dropped. The trailing newline is not part of the PIN.
pub fn read_pin_line(mut reader: impl std::io::Read) -> Result<Zeroizing<String>, KeyError> {
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_PIN_LEN + 1));
    lock_in_ram(buf.as_ptr(), buf.capacity());
    let mut byte = [0u8; 1];
    loop {
        match reader.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if buf.len() == MAX_PIN_LEN => {
                return Err(KeyError::Pin(PinError::Unreadable {
                    source_desc: "standard input".into(),
                    reason: format!("longer than {MAX_PIN_LEN} bytes"),
                }))
            }
            Ok(_) => buf.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(KeyError::Pin(PinError::Unreadable {
                    source_desc: "standard input".into(),
                    reason: e.to_string(),
                }))
            }
        }
        byte[0] = 0;
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    let text = std::str::from_utf8(&buf).map_err(|_| {
        KeyError::Pin(PinError::Unreadable {
            source_desc: "standard input".into(),
            reason: "it is not UTF-8 text".into(),
        })
    })?;
    if text.is_empty() {
        return Err(KeyError::Pin(PinError::Unreadable {
            source_desc: "standard input".into(),
            reason: "no PIN was written to it".into(),
        }));
    }
    let mut pin = Zeroizing::new(String::with_capacity(MAX_PIN_LEN));
    lock_in_ram(pin.as_ptr(), pin.capacity());
    pin.push_str(text);
    Ok(pin)
}

/// Keeps a process that holds a PIN out of reach of other processes of the same user: no core
/// dumps, and no ptrace or /proc/PID/{mem,environ} access (non-dumpable processes' /proc files
/// belong to root). Best effort: logged if the kernel refuses.
pub fn protect_process() {
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(error = %e, "cannot make the process non-dumpable");
    }
}

/// Locks `len` bytes at `ptr` in RAM (best effort: RLIMIT_MEMLOCK may forbid it).
fn lock_in_ram(ptr: *const u8, len: usize) {
    if len == 0 {
        return;
    }
    // The crate's one `unsafe` (Cargo.toml `[lints]` denies it elsewhere), reviewed:
    // SAFETY: mlock reads and writes no memory; it asks the kernel to keep the pages of a live
    // allocation of `len` bytes resident. A failure changes nothing and is ignored on purpose.
    #[allow(unsafe_code)]
    let _ = unsafe { rustix::mm::mlock(ptr.cast_mut().cast(), len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_line_is_read_without_its_newline() {
        assert_eq!(read_pin_line(&b"1234\n"[..]).expect("pin").as_str(), "1234");
        assert_eq!(
            read_pin_line(&b"1234\r\nrest"[..]).expect("pin").as_str(),
            "1234"
        );
        assert_eq!(read_pin_line(&b"1234"[..]).expect("pin").as_str(), "1234");
        assert!(read_pin_line(&b"\n"[..]).is_err());
        assert!(read_pin_line(&[b'1'; 300][..]).is_err());
    }

    /// A private PIN file in a new directory.
    fn pin_file(contents: &[u8], mode: u32) -> (tempfile::TempDir, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("pin");
        std::fs::write(&path, contents).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        (dir, path)
    }

    fn unreadable(source: &PinSource) -> String {
        match source.read() {
            Err(e @ KeyError::Pin(PinError::Unreadable { .. })) => e.to_string(),
            other => panic!("expected PinUnreadable, got {:?}", other.map(|_| "a PIN")),
        }
    }

    #[test]
    fn a_pin_file_is_read_without_its_line_ending() {
        for contents in [&b"1234"[..], b"1234\n", b"1234\r\n"] {
            let (_dir, path) = pin_file(contents, 0o600);
            assert_eq!(PinSource::File(path).read().expect("pin").as_str(), "1234");
        }
        // Readable by others: read, with a warning (a Kubernetes secret volume's default).
        let (_dir, path) = pin_file(b"1234", 0o644);
        assert_eq!(PinSource::File(path).read().expect("pin").as_str(), "1234");
    }

    /// A FIFO with no writer was opened blocking: the read waited for good, and in the proxy
    /// it waited holding the token's login lock.
    #[test]
    fn a_fifo_as_pin_file_is_refused_at_once() {
        let dir = tempfile::tempdir().expect("dir");
        let fifo = dir.path().join("pin");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let source = PinSource::File(fifo.clone());
        std::thread::spawn(move || drop(tx.send(unreadable(&source))));
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the read of a FIFO returned");
        assert!(
            e.contains("not a regular file") && e.contains(&fifo.display().to_string()),
            "{e}"
        );
        assert!(fifo.exists(), "the FIFO is left as it was");
    }

    /// `/dev/zero` was read until memory ran out; a file longer than any PIN was taken whole as
    /// the PIN.
    #[test]
    fn a_device_or_a_long_file_is_no_pin_file() {
        let e = unreadable(&PinSource::File("/dev/zero".into()));
        assert!(e.contains("not a regular file"), "{e}");
        let (_dir, path) = pin_file(&[b'7'; 4096], 0o600);
        let e = unreadable(&PinSource::File(path));
        assert!(e.contains("longer than 256 bytes"), "{e}");
        assert!(!e.contains("7777"), "the message repeats the contents: {e}");
        // 257 and 258 bytes with no line ending are within the read's bound, and no PIN.
        for n in [257, 258] {
            let (_dir, path) = pin_file(&vec![b'7'; n], 0o600);
            let e = unreadable(&PinSource::File(path));
            assert!(e.contains("longer than 256 bytes"), "{n}: {e}");
        }
        let (_dir, path) = pin_file(&[&[b'7'; 256][..], b"\r\n"].concat(), 0o600);
        assert_eq!(PinSource::File(path).read().expect("pin").len(), 256);
    }

    /// Another user who can write the PIN file can make hwkey present PINs of their choosing,
    /// each spending one of the token's attempts. Writable by its group is accepted when that
    /// group is the one hwkey runs as (a user private group with umask 002).
    #[test]
    fn a_pin_file_others_can_write_is_refused() {
        let (_dir, path) = pin_file(b"1234", 0o602);
        let e = unreadable(&PinSource::File(path));
        assert!(
            e.contains("writable by other users") && e.contains("chmod go-w"),
            "{e}"
        );
        // Group-writable, the group another than this process's.
        let (_dir, path) = pin_file(b"1234", 0o620);
        let other = if rustix::process::getegid().as_raw() == 65534 {
            0
        } else {
            65534
        };
        rustix::fs::chown(&path, None, Some(rustix::fs::Gid::from_raw(other))).expect("chgrp");
        let e = unreadable(&PinSource::File(path.clone()));
        assert!(e.contains("writable by other users"), "{e}");
        // The same, the group this process's.
        rustix::fs::chown(&path, None, Some(rustix::process::getegid())).expect("chgrp");
        assert_eq!(PinSource::File(path).read().expect("pin").as_str(), "1234");
    }

    /// Owned by another user (not root), a PIN file is that user's to rewrite whatever its mode
    /// says (chmod is the owner's): it was read, so that user could spend the token's PIN
    /// attempts. Owned by root or by hwkey's user, it is read. (Runs as root, as CI does, to
    /// give a file away.)
    #[test]
    fn a_pin_file_another_user_owns_is_refused() {
        let me = rustix::process::geteuid().as_raw();
        assert_eq!(
            me, 0,
            "this test gives a file to another user: run it as root (CI does)"
        );
        let (_dir, path) = pin_file(b"1234", 0o600);
        rustix::fs::chown(&path, Some(rustix::fs::Uid::from_raw(65534)), None).expect("chown");
        let e = unreadable(&PinSource::File(path.clone()));
        assert!(
            e.contains("owned by uid 65534") && e.contains("chown it to uid 0 or root"),
            "{e}"
        );
        rustix::fs::chown(&path, Some(rustix::fs::Uid::from_raw(0)), None).expect("chown");
        assert_eq!(PinSource::File(path).read().expect("pin").as_str(), "1234");
    }

    /// The standard library's message for a variable that is not Unicode quotes its value: the
    /// PIN went into the error, and from there to stderr and the proxy's log. (What
    /// `std::env::var` returns is given directly: setting a variable in a test process whose
    /// other threads may call `getenv` from C is not safe.)
    #[test]
    fn a_pin_variable_that_is_not_utf8_is_not_repeated() {
        use std::os::unix::ffi::OsStringExt;
        let var = "HWKEY_PIN";
        let value = std::ffi::OsString::from_vec(b"5150\xff4321".to_vec());
        let old_text = std::env::VarError::NotUnicode(value.clone()).to_string();
        assert!(
            old_text.contains("5150"),
            "the standard library's text quotes it: {old_text}"
        );
        let e = env_pin(var, Err(std::env::VarError::NotUnicode(value)))
            .map(|_| "a PIN")
            .expect_err("not UTF-8")
            .to_string();
        assert!(e.contains(var) && e.contains("not UTF-8"), "{e}");
        assert!(
            !e.contains("5150") && !e.contains("4321"),
            "the PIN is in the message: {e}"
        );
        let e = unreadable(&PinSource::Env("HWKEY_TEST_PIN_UNSET".into()));
        assert!(e.contains("not set"), "{e}");
        assert_eq!(
            env_pin(var, Ok("1234".into())).expect("pin").as_str(),
            "1234"
        );
    }
}
