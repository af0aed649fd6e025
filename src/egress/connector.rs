//! [`Egress`] as a hyper connector (a tower service from URI to stream), for the kube clients
//! of `renew`, `bootstrap` and the approver: hyper-rustls wraps it and runs TLS over the
//! tunnel.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;

use super::{Egress, EgressError, Tunnel};

/// Opens connections the way [`Egress`] says, each within a connect timeout.
#[derive(Debug, Clone)]
pub struct EgressConnector {
    egress: Arc<Egress>,
    timeout: Duration,
}

impl EgressConnector {
    /// A connector through `egress`, giving each connection (tunnel included) `timeout`.
    pub fn new(egress: Egress, timeout: Duration) -> EgressConnector {
        EgressConnector {
            egress: Arc::new(egress),
            timeout,
        }
    }
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ConnectError {
    #[error("the URL {0} names no host")]
    NoHost(String),
    #[error("{0}")]
    Egress(#[from] EgressError),
    #[error("connecting to {0} took longer than {1:?}")]
    Timeout(String, Duration),
}

impl tower::Service<hyper::Uri> for EgressConnector {
    type Response = TokioIo<Tunnel>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<TokioIo<Tunnel>, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        let egress = self.egress.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| ConnectError::NoHost(uri.to_string()))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            match tokio::time::timeout(timeout, egress.dial(&host, port)).await {
                Ok(r) => Ok(TokioIo::new(r?)),
                Err(_) => Err(ConnectError::Timeout(
                    super::authority(&host, port),
                    timeout,
                )),
            }
        })
    }
}
