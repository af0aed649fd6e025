//! A tiny blocking HTTP/1.1 client for the proxy's control socket.
//!
//! The plugin is a short-lived synchronous process; one request with `Connection: close` over a
//! `std` UNIX stream is all it needs, without starting an async runtime.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use zeroize::Zeroizing;

use crate::control_api::{ControlError, LoopbackCredential, ProxyInfo};

use super::ExecError;

/// How long the proxy may take to answer a request: opening a credential's key may wait for a
/// busy machine, never for the token.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// `GET /v1/info`: what the proxy answering on `sock` serves.
pub fn info(sock: &Path) -> Result<ProxyInfo, ExecError> {
    info_within(sock, ANSWER_TIMEOUT)
}

/// `GET /v1/credential`: a fresh loopback credential.
pub fn credential(sock: &Path) -> Result<LoopbackCredential, ExecError> {
    credential_within(sock, ANSWER_TIMEOUT)
}

/// [`info`], waiting at most `timeout` between the answer's bytes.
pub fn info_within(sock: &Path, timeout: Duration) -> Result<ProxyInfo, ExecError> {
    get(sock, "/v1/info", timeout)
}

/// [`credential`], waiting at most `timeout` between the answer's bytes.
pub fn credential_within(sock: &Path, timeout: Duration) -> Result<LoopbackCredential, ExecError> {
    get(sock, "/v1/credential", timeout)
}

/// What went wrong on the control socket, for [`ExecError::Control`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ControlProblem {
    #[error("{0}")]
    Io(#[source] std::io::Error),
    #[error("the answer is not UTF-8")]
    NotUtf8,
    #[error("the answer is longer than {max} bytes: what listens on the control socket is not an hwkey proxy")]
    TooLong { max: usize },
    #[error("the answer is not HTTP")]
    NotHttp,
    #[error("the answer has no status")]
    NoStatus,
    #[error("HTTP {status}: {said}")]
    Refused { status: u16, said: String },
    #[error("the answer to {path} is not what this hwkey expects ({source}): is the running proxy from another hwkey version? Stop it and let kubectl start it again")]
    Unexpected {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The longest answer read: the proxy's are a few KiB (a certificate chain, a key); whatever
/// listens on the socket cannot make the plugin hold more.
pub const MAX_ANSWER: usize = 1 << 20;

/// Reads the whole answer, at most [`MAX_ANSWER`] bytes and `timeout` in all (not per read: a
/// peer dripping a byte at a time cannot hold kubectl for longer). The answer may hold a
/// private key: it is kept in a wiped buffer.
fn read_answer(
    stream: &mut UnixStream,
    timeout: Duration,
) -> Result<Zeroizing<Vec<u8>>, ControlProblem> {
    let deadline = std::time::Instant::now() + timeout;
    let mut raw = Zeroizing::new(Vec::with_capacity(8 * 1024));
    let mut chunk = Zeroizing::new([0u8; 8 * 1024]);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(ControlProblem::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no whole answer within {timeout:?}"),
            )));
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(ControlProblem::Io)?;
        let n = match stream.read(&mut chunk[..]) {
            Ok(0) => return Ok(raw),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ControlProblem::Io(e)),
        };
        if raw.len() + n > MAX_ANSWER {
            return Err(ControlProblem::TooLong { max: MAX_ANSWER });
        }
        raw.extend_from_slice(&chunk[..n]);
    }
}

/// GETs `path` on the control socket and decodes the JSON body of a 200 answer as `T`.
fn get<T: DeserializeOwned>(sock: &Path, path: &str, timeout: Duration) -> Result<T, ExecError> {
    let err = |problem| ExecError::Control {
        path: sock.to_path_buf(),
        problem,
    };
    // Only a socket of our own: another user's socket would hand out that user's credentials.
    crate::state_dir::check_file(sock).map_err(|e| err(ControlProblem::Io(e)))?;
    let mut stream = UnixStream::connect(sock).map_err(|e| err(ControlProblem::Io(e)))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| err(ControlProblem::Io(e)))?;
    // One write: `write!` on the unbuffered stream would send each piece of the format string
    // by itself, and each could wake the proxy for a partial request.
    let request = format!("GET {path} HTTP/1.1\r\nHost: hwkey\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| err(ControlProblem::Io(e)))?;
    let raw = read_answer(&mut stream, timeout).map_err(err)?;
    let text = std::str::from_utf8(&raw).map_err(|_| err(ControlProblem::NotUtf8))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| err(ControlProblem::NotHttp))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| err(ControlProblem::NoStatus))?;
    if status != 200 {
        // The proxy's own words: the text is all there is.
        let said = serde_json::from_str::<ControlError>(body.trim())
            .map(|e| e.error)
            .unwrap_or_else(|_| "no reason given".into());
        return Err(err(ControlProblem::Refused { status, said }));
    }
    serde_json::from_str(body.trim()).map_err(|source| {
        err(ControlProblem::Unexpected {
            path: path.to_string(),
            source,
        })
    })
}
