//! Serving the small local HTTP/1.1 endpoints (the proxy's admin listener and control socket,
//! the approver's metrics listener) with the same limits: a cap on connections at once, a
//! deadline for the request headers, one request per connection and a deadline for the whole
//! connection. Another local user (or a stuck client of one's own) can then hold at most the
//! cap's descriptors, each for at most the deadlines (350 idle control-socket connections once
//! held 350 descriptors forever).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits of one endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// How long a client may take to send its request headers.
    pub header_timeout: Duration,
    /// The longest a connection lives (its one request included).
    pub connection_timeout: Duration,
}

/// One endpoint's connection slots.
#[derive(Debug, Clone)]
pub struct Endpoint {
    limits: Limits,
    slots: Arc<Semaphore>,
}

impl Endpoint {
    /// An endpoint with `limits`.
    pub fn new(limits: Limits) -> Endpoint {
        Endpoint {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
        }
    }

    /// A slot for a new connection, or None at the cap (close the connection).
    pub fn admit(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// Serves one request on `io` with `handler`, within the deadlines. The caller holds the
    /// connection's place (a slot from [`Endpoint::admit`], or another admission) until this
    /// returns.
    pub async fn serve<I, F, Fut>(&self, io: I, handler: F)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let service = hyper::service::service_fn(move |req| {
            let handler = handler.clone();
            async move { Ok::<_, Infallible>(handler(req).await) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(self.limits.header_timeout)
            .keep_alive(false)
            .serve_connection(TokioIo::new(io), service);
        let _ = tokio::time::timeout(self.limits.connection_timeout, connection).await;
    }
}
