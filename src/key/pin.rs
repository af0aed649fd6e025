//! Where a PIN comes from, and reading it without leaving copies behind.
//!
//! PINs never come from argv (visible in `ps`). They are read when needed, held in a
//! [`zeroize::Zeroizing`] buffer for the duration of one login, and never logged.

use std::fmt;
use std::path::PathBuf;

use zeroize::Zeroizing;

use super::KeyError;

/// The `pin-source` (or `pin-value`) of a key URI.
#[derive(Clone, PartialEq, Eq)]
pub enum PinSource {
    /// A file holding the PIN; one trailing newline is ignored.
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
                let bytes =
                    Zeroizing::new(std::fs::read(path).map_err(|e| KeyError::PinUnreadable {
                        source_desc: format!("file {}", path.display()),
                        reason: e.to_string(),
                    })?);
                let text = std::str::from_utf8(&bytes).map_err(|_| KeyError::PinUnreadable {
                    source_desc: format!("file {}", path.display()),
                    reason: "it is not UTF-8 text".into(),
                })?;
                let pin = text.strip_suffix('\n').unwrap_or(text);
                let pin = pin.strip_suffix('\r').unwrap_or(pin);
                Ok(Zeroizing::new(pin.to_string()))
            }
            PinSource::Env(var) => match std::env::var(var) {
                Ok(v) => Ok(Zeroizing::new(v)),
                Err(e) => Err(KeyError::PinUnreadable {
                    source_desc: format!("environment variable {var}"),
                    reason: e.to_string(),
                }),
            },
            PinSource::Value(v) => Ok(v.clone()),
        }
    }
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
                return Err(KeyError::PinUnreadable {
                    source_desc: "standard input".into(),
                    reason: format!("longer than {MAX_PIN_LEN} bytes"),
                })
            }
            Ok(_) => buf.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(KeyError::PinUnreadable {
                    source_desc: "standard input".into(),
                    reason: e.to_string(),
                })
            }
        }
        byte[0] = 0;
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    let text = std::str::from_utf8(&buf).map_err(|_| KeyError::PinUnreadable {
        source_desc: "standard input".into(),
        reason: "it is not UTF-8 text".into(),
    })?;
    if text.is_empty() {
        return Err(KeyError::PinUnreadable {
            source_desc: "standard input".into(),
            reason: "no PIN was written to it".into(),
        });
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
}
