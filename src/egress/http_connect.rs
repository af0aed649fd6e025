//! HTTP CONNECT (RFC 9110 §9.3.6): ask the proxy for a tunnel, with Basic credentials when
//! there are some, and read its answer's head. The answer is parsed (status line, then headers
//! up to the blank line), never searched as text; anything but 2xx is an error naming the
//! status. The proxy must send nothing after the head before the client speaks (the API
//! server's TLS starts with the client), so bytes after it are a protocol error.

use base64::Engine;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use zeroize::Zeroizing;

use super::{authority, ForwardProxy, ProxyProblem};

/// The longest answer head accepted.
const MAX_HEAD: usize = 16 * 1024;

/// Asks `proxy` (already connected on `stream`) for a tunnel to `host`:`port`.
pub(super) async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    proxy: &ForwardProxy,
    host: &str,
    port: u16,
) -> Result<(), ProxyProblem> {
    let target = authority(host, port);
    let mut request = Zeroizing::new(format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: hwkey/{}\r\n",
        env!("CARGO_PKG_VERSION")
    ));
    if let Some(c) = &proxy.credentials {
        let pair = Zeroizing::new(format!("{}:{}", c.user, c.password.as_str()));
        let token =
            Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(pair.as_bytes()));
        request.push_str("Proxy-Authorization: Basic ");
        request.push_str(&token);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(ProxyProblem::Io)?;
    stream.flush().await.map_err(ProxyProblem::Io)?;
    let head = read_head(stream).await?;
    let (status, reason) = status_line(&head)?;
    if (200..300).contains(&status) {
        return Ok(());
    }
    Err(ProxyProblem::Status {
        status,
        reason,
        target,
        sent_credentials: proxy.credentials.is_some(),
    })
}

/// Reads up to and including the blank line that ends the head; nothing after it.
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>, ProxyProblem> {
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    // One byte at a time: a read past the head would swallow the API server's first bytes.
    // The head is a few hundred bytes, once per connection.
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Err(ProxyProblem::Protocol(
                "its answer's head is longer than 16 KiB",
            ));
        }
        let n = stream.read(&mut byte).await.map_err(ProxyProblem::Io)?;
        if n == 0 {
            return Err(ProxyProblem::Protocol(
                "it closed the connection before answering CONNECT",
            ));
        }
        head.push(byte[0]);
    }
    Ok(head)
}

/// `HTTP/1.x NNN reason` → (NNN, reason).
fn status_line(head: &[u8]) -> Result<(u16, String), ProxyProblem> {
    let line_end = head
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(head.len());
    let line = std::str::from_utf8(&head[..line_end])
        .map_err(|_| ProxyProblem::Protocol("its status line is not text"))?;
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !matches!(version, "HTTP/1.1" | "HTTP/1.0") {
        return Err(ProxyProblem::Protocol(
            "its answer to CONNECT is not an HTTP/1.x status line",
        ));
    }
    let status = parts
        .next()
        .filter(|s| s.len() == 3)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or(ProxyProblem::Protocol(
            "its status code is not three digits",
        ))?;
    let reason: String = parts
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| !c.is_control())
        .take(80)
        .collect();
    Ok((status, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_are_parsed_not_searched() {
        assert_eq!(
            status_line(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .expect("200")
                .0,
            200
        );
        let (s, r) =
            status_line(b"HTTP/1.0 407 Proxy Authentication Required\r\nX: HTTP/1.1 200\r\n\r\n")
                .expect("407");
        assert_eq!((s, r.as_str()), (407, "Proxy Authentication Required"));
        assert!(status_line(b"SSH-2.0 200 OK\r\n\r\n").is_err());
        assert!(status_line(b"HTTP/1.1 2000 OK\r\n\r\n").is_err());
        assert!(status_line(b"HTTP/1.1  200 OK\r\n\r\n").is_err());
    }
}
