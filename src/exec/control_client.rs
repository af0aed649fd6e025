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

/// `GET /v1/info`: what the proxy answering on `sock` serves.
pub fn info(sock: &Path) -> Result<ProxyInfo, ExecError> {
    get(sock, "/v1/info")
}

/// `GET /v1/credential`: a fresh loopback credential.
pub fn credential(sock: &Path) -> Result<LoopbackCredential, ExecError> {
    get(sock, "/v1/credential")
}

/// GETs `path` on the control socket and decodes the JSON body of a 200 answer as `T`.
fn get<T: DeserializeOwned>(sock: &Path, path: &str) -> Result<T, ExecError> {
    let err = |reason: String| ExecError::Control {
        path: sock.to_path_buf(),
        reason,
    };
    // Only a socket of our own: another user's socket would hand out that user's credentials.
    crate::state_dir::check_file(sock).map_err(|e| err(e.to_string()))?;
    let mut stream = UnixStream::connect(sock).map_err(|e| err(e.to_string()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| err(e.to_string()))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: hwkey\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| err(e.to_string()))?;
    // The answer may hold a private key: keep it in a wiped buffer.
    let mut raw = Zeroizing::new(Vec::new());
    stream
        .read_to_end(&mut raw)
        .map_err(|e| err(e.to_string()))?;
    let text = std::str::from_utf8(&raw).map_err(|_| err("the answer is not UTF-8".into()))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| err("the answer is not HTTP".into()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| err("the answer has no status".into()))?;
    if status != 200 {
        let reason = serde_json::from_str::<ControlError>(body.trim())
            .map(|e| e.error)
            .unwrap_or_else(|_| "no reason given".into());
        return Err(err(format!("HTTP {status}: {reason}")));
    }
    serde_json::from_str(body.trim()).map_err(|e| {
        err(format!(
            "the answer to {path} is not what this hwkey expects ({e}): is the running proxy from another hwkey version? Stop it and let kubectl start it again"
        ))
    })
}
