//! Direct clients: the baseline every figure is measured against (rustls with an in-memory
//! key), HTTP/1.1 and h2 over any stream.

use super::*;

/// A rustls client configuration offering Go's cipher suite order (as kubectl does): `roots` PEM, client certificate and key PEM, ALPN list, and
/// whether TLS 1.3 sessions are cached for resumption.
pub(crate) fn client_config(
    roots: &[u8],
    cert: &[u8],
    key: &[u8],
    alpn: &[&[u8]],
    resume: bool,
) -> Arc<ClientConfig> {
    client_config_on(
        support::upstream::go_provider(),
        roots,
        cert,
        key,
        alpn,
        resume,
    )
}

/// [`client_config`] on another crypto provider (hwkey's own, for a floor that originates TLS
/// as the proxy does: the same suites and key exchange).
pub(crate) fn client_config_on(
    provider: Arc<rustls::crypto::CryptoProvider>,
    roots: &[u8],
    cert: &[u8],
    key: &[u8],
    alpn: &[&[u8]],
    resume: bool,
) -> Arc<ClientConfig> {
    let mut store = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(roots) {
        store.add(c.expect("root PEM")).expect("add root");
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .expect("client certificate PEM");
    let key = PrivateKeyDer::from_pem_slice(key).expect("client key PEM");
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(store)
        .with_client_auth_cert(chain, key)
        .expect("client certificate");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    if !resume {
        config.resumption = Resumption::disabled();
    }
    Arc::new(config)
}

/// `config` (one that does not resume) as kubectl's stand-in: it asks for no session ticket.
/// kubectl's ClientHello offers no PSK key exchange mode (client-go sets no session cache), so
/// no server sends it a ticket; rustls always offers the mode, and asking for none (RFC 9149,
/// which the proxy's and the floor's loopback listener and the test upstream honour) makes
/// this client cost a server what kubectl costs it.
pub(crate) fn as_kubectl(config: &Arc<ClientConfig>) -> Arc<ClientConfig> {
    let mut config = (**config).clone();
    config.send_ticket_request = Some(rustls::client::TicketRequest {
        new_session_count: 0,
        resumption_count: 0,
    });
    Arc::new(config)
}

pub(crate) async fn tls_connect(config: &Arc<ClientConfig>, port: u16) -> TlsStream<TcpStream> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("TCP connect");
    tcp.set_nodelay(true).expect("nodelay");
    tls_over(config, tcp).await
}

/// TLS to the upstream over the UNIX socket at `path` (a byte relay in front of it).
pub(crate) async fn tls_connect_unix(
    config: &Arc<ClientConfig>,
    path: &Path,
) -> TlsStream<UnixStream> {
    let unix = UnixStream::connect(path).await.expect("UNIX connect");
    tls_over(config, unix).await
}

/// A TLS client handshake with the upstream (named 127.0.0.1) over `io`.
async fn tls_over<S: AsyncRead + AsyncWrite + Unpin>(
    config: &Arc<ClientConfig>,
    io: S,
) -> TlsStream<S> {
    tokio_rustls::TlsConnector::from(config.clone())
        .connect(
            ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into()),
            io,
        )
        .await
        .expect("TLS handshake")
}

pub(crate) fn resumed(s: &TlsStream<TcpStream>) -> bool {
    s.get_ref().1.handshake_kind() == Some(HandshakeKind::Resumed)
}

/// One HTTP/1.1 keep-alive GET on `s`; returns the body length. Hand-written (no client
/// library) so the client costs the same few microseconds on every path.
pub(crate) async fn http1_get<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    path: &str,
    buf: &mut [u8],
) -> u64 {
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(request.as_bytes())
        .await
        .expect("write request");
    // A TLS stream may keep records it could not write yet until flushed.
    s.flush().await.expect("flush request");
    let mut filled = 0;
    let head_end = loop {
        let n = s.read(&mut buf[filled..]).await.expect("read response");
        assert!(n > 0, "connection closed before the response head");
        filled += n;
        if let Some(i) = buf[..filled].windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        assert!(filled < buf.len(), "response head too large");
    };
    let head = std::str::from_utf8(&buf[..head_end]).expect("UTF-8 head");
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "unexpected response: {head}"
    );
    let length: u64 = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .expect("Content-Length");
    let mut got = (filled - head_end) as u64;
    while got < length {
        let n = s.read(buf).await.expect("read body");
        assert!(n > 0, "connection closed in the body");
        got += n as u64;
    }
    length
}

/// An HTTP/2 connection (hyper) over `io`; the connection task runs on the current runtime.
pub(crate) async fn h2_client<S>(io: S) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

pub(crate) async fn h2_get(
    sender: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    uri: &str,
) -> u64 {
    let req = hyper::Request::get(uri)
        .body(Empty::new())
        .expect("request");
    let resp = sender.send_request(req).await.expect("h2 request");
    assert_eq!(resp.status(), 200);
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("h2 body")
        .to_bytes();
    body.len() as u64
}
