//! The stream to the API server: a TCP connection, straight or through a tunnel a forward proxy
//! opened (inside TLS to the proxy for an `https://` proxy).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::{
    authority, http_connect, socks5, EgressError, ForwardProxy, ProxyProblem, ProxyScheme,
};

/// A connected stream the API server's TLS runs over.
#[derive(Debug)]
pub enum Tunnel {
    /// Straight TCP, or a CONNECT / SOCKS5 tunnel over TCP.
    Tcp(TcpStream),
    /// A CONNECT tunnel inside TLS to an `https://` proxy.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Tunnel {
    /// A TCP connection straight to `host`:`port`.
    pub async fn direct(host: &str, port: u16) -> Result<Tunnel, EgressError> {
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|source| EgressError::Direct {
                addr: authority(host, port),
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        keepalive(&tcp);
        Ok(Tunnel::Tcp(tcp))
    }

    /// The TCP connection underneath (to the API server, or to the proxy).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Tunnel::Tcp(t) => t,
            Tunnel::Tls(t) => t.get_ref().0,
        }
    }
}

/// Starts a TCP connection straight to `addr` for an event loop that waits for it itself (a
/// relay loop, [`crate::proxy::relay_loop`]): non-blocking, its connect under way (or done: on
/// loopback it usually is), with the options [`Tunnel::direct`] sets.
pub fn connect_started(addr: std::net::SocketAddr) -> io::Result<std::net::TcpStream> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = match addr {
        std::net::SocketAddr::V4(_) => AddressFamily::INET,
        std::net::SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
    let fd = rustix::net::socket_with(family, SocketType::STREAM, flags, None)?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) | Err(rustix::io::Errno::INPROGRESS) => {}
        Err(e) => return Err(e.into()),
    }
    let _ = rustix::net::sockopt::set_tcp_nodelay(&fd, true);
    keepalive(&fd);
    Ok(std::net::TcpStream::from(fd))
}

/// TCP keepalive as Go's dialer sets it (first probe after 15 s idle, then every 15 s, 3 lost
/// probes close it): a peer or path that vanished without a FIN or RST ends the connection
/// instead of leaving a watch or a long request waiting for ever. Best effort: a socket that
/// refuses the options works as before.
fn keepalive(tcp: &impl std::os::fd::AsFd) {
    use rustix::net::sockopt;
    let every = std::time::Duration::from_secs(15);
    let _ = sockopt::set_socket_keepalive(tcp, true);
    let _ = sockopt::set_tcp_keepidle(tcp, every);
    let _ = sockopt::set_tcp_keepintvl(tcp, every);
    let _ = sockopt::set_tcp_keepcnt(tcp, 3);
}

/// Opens a tunnel to `host`:`port` through `proxy`.
pub(super) async fn through(
    proxy: &ForwardProxy,
    host: &str,
    port: u16,
) -> Result<Tunnel, EgressError> {
    let fail = |problem| EgressError::Proxy {
        proxy: proxy.to_string(),
        problem,
    };
    let mut tcp = TcpStream::connect((proxy.host.as_str(), proxy.port))
        .await
        .map_err(|e| fail(ProxyProblem::Connect(e)))?;
    let _ = tcp.set_nodelay(true);
    keepalive(&tcp);
    match proxy.scheme {
        ProxyScheme::Http => {
            http_connect::connect(&mut tcp, proxy, host, port)
                .await
                .map_err(fail)?;
            Ok(Tunnel::Tcp(tcp))
        }
        ProxyScheme::Socks5 => {
            socks5::connect(&mut tcp, proxy, host, port)
                .await
                .map_err(fail)?;
            Ok(Tunnel::Tcp(tcp))
        }
        ProxyScheme::Https => {
            let name = ServerName::try_from(proxy.host.clone())
                .map_err(|_| fail(ProxyProblem::Protocol("its host is not a DNS name or IP")))?;
            let mut tls = tokio_rustls::TlsConnector::from(proxy_tls_config()?)
                .connect(name, tcp)
                .await
                .map_err(|e| fail(ProxyProblem::Tls(e)))?;
            http_connect::connect(&mut tls, proxy, host, port)
                .await
                .map_err(fail)?;
            Ok(Tunnel::Tls(Box::new(tls)))
        }
    }
}

/// TLS to an `https://` proxy: the system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` honoured),
/// no client certificate: the hardware key is for the API server only.
fn proxy_tls_config() -> Result<Arc<rustls::ClientConfig>, EgressError> {
    static CONFIG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    if let Some(c) = CONFIG.get() {
        return Ok(c.clone());
    }
    let roots = crate::pki::tls::root_store(None).map_err(|e| EgressError::Proxy {
        proxy: "(https)".into(),
        problem: ProxyProblem::Tls(io::Error::other(e.to_string())),
    })?;
    let mut config = rustls::ClientConfig::builder_with_provider(crate::pki::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| EgressError::Proxy {
            proxy: "(https)".into(),
            problem: ProxyProblem::Tls(io::Error::other(e)),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(CONFIG.get_or_init(|| Arc::new(config)).clone())
}

impl AsyncRead for Tunnel {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tunnel::Tcp(t) => Pin::new(t).poll_read(cx, buf),
            Tunnel::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Tunnel {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tunnel::Tcp(t) => Pin::new(t).poll_write(cx, buf),
            Tunnel::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tunnel::Tcp(t) => Pin::new(t).poll_flush(cx),
            Tunnel::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tunnel::Tcp(t) => Pin::new(t).poll_shutdown(cx),
            Tunnel::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tunnel::Tcp(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Tunnel::Tls(t) => Pin::new(t.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Tunnel::Tcp(t) => t.is_write_vectored(),
            Tunnel::Tls(t) => t.is_write_vectored(),
        }
    }
}

impl hyper_util::client::legacy::connect::Connection for Tunnel {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        // A CONNECT or SOCKS tunnel carries the API server's own TLS: to hyper it is a plain
        // connection to the server (not an HTTP proxy that wants absolute-form requests).
        hyper_util::client::legacy::connect::Connected::new()
    }
}
