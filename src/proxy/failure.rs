//! The one place the proxy writes HTTP itself: the upstream could not be reached before any byte
//! of the client's was forwarded, so the client is told why, in the protocol it speaks, as a
//! Kubernetes `Status` with code 502 (kubectl prints its message: "Error from server
//! (ServiceUnavailable): hwkey proxy: …").
//!
//! An HTTP/1.1 client gets one response and the connection closes. An HTTP/2 client (kubectl and
//! client-go negotiate h2 on the loopback listener) gets a real HTTP/2 exchange: a bare close
//! would read as "unexpected EOF", which client-go retries six times with back-off and then
//! reports without the cause. Every request on the connection is answered with the same 502 for a
//! short while, then the connection ends with GOAWAY, so a long-lived client reconnects and the
//! upstream is tried again.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::Notify;

use super::error::UpstreamError;
use super::write_through::write_through;

/// How long an HTTP/2 connection keeps answering after its first 502 (requests client-go sent at
/// once on it get the same answer), and the most it is served at all.
const H2_LINGER: Duration = Duration::from_millis(200);
const H2_MAX: Duration = Duration::from_secs(10);

/// The Kubernetes `Status` a client gets when the upstream could not be reached.
fn status_body(e: &UpstreamError) -> String {
    serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("hwkey proxy: {e}"),
        "reason": "ServiceUnavailable",
        "code": 502,
    })
    .to_string()
}

/// Tells the client the upstream could not be reached and closes. `prefix` holds the bytes
/// already read from the client (the HTTP/2 preface on a UNIX socket).
pub(crate) async fn tell_client<C: AsyncRead + AsyncWrite + Unpin + Send>(
    mut client: C,
    prefix: Vec<u8>,
    alpn: Option<&[u8]>,
    e: &UpstreamError,
) {
    let body = status_body(e);
    match alpn {
        Some(b"h2") => serve_h2(Replay::new(prefix, client), body).await,
        None | Some(b"http/1.1") => {
            let response = format!(
                "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = client.write_all(response.as_bytes()).await;
            let _ = client.shutdown().await;
        }
        // A protocol the proxy cannot speak itself: close.
        Some(_) => {
            let _ = client.shutdown().await;
        }
    }
}

async fn serve_h2<C: AsyncRead + AsyncWrite + Unpin + Send>(io: Replay<C>, body: String) {
    let body = Bytes::from(body);
    let answered = Arc::new(Notify::new());
    let service = {
        let answered = answered.clone();
        hyper::service::service_fn(move |_request| {
            let mut response = Response::new(Full::new(body.clone()));
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            answered.notify_one();
            async move { Ok::<_, Infallible>(response) }
        })
    };
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let linger = async {
        answered.notified().await;
        tokio::time::sleep(H2_LINGER).await;
    };
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "HTTP/2 client left before its 502");
            }
            return;
        }
        _ = linger => {}
        _ = tokio::time::sleep(H2_MAX) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
}

/// The client's stream with the bytes already read from it put back in front.
struct Replay<C> {
    prefix: Vec<u8>,
    at: usize,
    inner: C,
}

impl<C> Replay<C> {
    fn new(prefix: Vec<u8>, inner: C) -> Replay<C> {
        Replay {
            prefix,
            at: 0,
            inner,
        }
    }
}

impl<C: AsyncRead + Unpin> AsyncRead for Replay<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let start = self.at;
            buf.put_slice(&self.prefix[start..start + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

write_through!(Replay<C>, inner);
