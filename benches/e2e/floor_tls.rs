//! The floors' upstream side: a TLS client connection to the upstream with the proxy's suites,
//! shared by the epoll floor ([`super::floor`]) and the io_uring one ([`super::uring_floor`]).

use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::ClientConfig;

/// A TLS client connection to the upstream, its handshake done (blocking).
pub(super) fn handshake(
    config: &Arc<ClientConfig>,
    upstream: &mut std::net::TcpStream,
) -> rustls::ClientConnection {
    let name = ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into());
    let mut tls = rustls::ClientConnection::new(config.clone(), name).expect("floor TLS");
    while tls.is_handshaking() {
        tls.complete_io(upstream).expect("floor TLS handshake");
    }
    tls
}
