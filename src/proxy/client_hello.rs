//! A loopback client's ClientHello, read before its TLS session exists: the proxy picks the
//! application protocol from the client's offer ([`super::upstream`] says why it must be picked
//! before the upstream is reached), and makes the session for it with the bytes read.

use rustls::server::Acceptor;
use tokio::net::TcpStream;

use super::unbuffered::tls_error;

/// Reads a loopback client's ClientHello for the protocols it offers (the protocol is chosen
/// before the session is made, [`super::upstream`]): the bytes read, which the session is
/// given next, and the offer. The socket is read once at once (kubectl's ClientHello is
/// usually there by the time its connection reaches this thread, and the runtime would first
/// wait for the readiness it learns from its next `epoll_wait`); after that, as the runtime
/// reads: a read that finds nothing clears the readiness the runtime recorded (a direct read
/// does not, and waiting on it again would return at once, and spin).
pub async fn read_client_hello(stream: &TcpStream) -> std::io::Result<(Vec<u8>, Vec<Vec<u8>>)> {
    let mut acceptor = Acceptor::default();
    let mut read = Vec::new();
    let mut chunk = vec![0u8; 4096];
    let mut direct = true;
    loop {
        let got = if std::mem::take(&mut direct) {
            match rustix::io::read(stream, &mut chunk) {
                Ok(n) => Ok(n),
                Err(rustix::io::Errno::AGAIN) => continue,
                Err(rustix::io::Errno::INTR) => {
                    direct = true;
                    continue;
                }
                Err(e) => Err(e.into()),
            }
        } else {
            stream.readable().await?;
            match stream.try_read(&mut chunk) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => other,
            }
        };
        let n = match got? {
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the client closed the connection before its ClientHello",
                ))
            }
            n => n,
        };
        read.extend_from_slice(&chunk[..n]);
        let mut rest = &chunk[..n];
        while !rest.is_empty() {
            acceptor.read_tls(&mut rest)?;
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let offered = accepted
                    .client_hello()
                    .alpn()
                    .map(|list| list.map(<[u8]>::to_vec).collect())
                    .unwrap_or_default();
                return Ok((read, offered));
            }
            Ok(None) => {}
            Err((e, mut alert)) => {
                let mut bytes = Vec::new();
                let _ = alert.write_all(&mut bytes);
                let _ = stream.try_write(&bytes);
                return Err(tls_error(e));
            }
        }
    }
}
