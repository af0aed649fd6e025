//! The proxy under stress, in one home: another local user's floods (`floods`), load on the
//! data path during reloads and drains (`load`), the hardware or the upstream going away
//! (`faults`), and the proxy's own limits (`limits`).

mod faults;
#[cfg(feature = "pkcs11")]
mod floods;
#[cfg(feature = "pkcs11")]
mod limits;
#[cfg(feature = "pkcs11")]
mod load;

/// Descriptors open in process `pid`: the signal a flood or a limit test reads instead of a clock.
#[cfg(feature = "pkcs11")]
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// A rustls client config holding a loopback credential (software key), resumption on.
#[cfg(feature = "pkcs11")]
fn loopback_client(cred: &serde_json::Value) -> std::sync::Arc<rustls::ClientConfig> {
    support::proxy::loopback_client_config(cred)
}

/// GET /version over loopback TLS: (status code or "" when the proxy closed, resumed?).
#[cfg(feature = "pkcs11")]
fn loopback_get(config: &std::sync::Arc<rustls::ClientConfig>, port: u16) -> (String, bool) {
    let mut conn = rustls::ClientConnection::new(
        config.clone(),
        rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name"),
    )
    .expect("client");
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    tcp.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok();
    use std::io::{Read as _, Write as _};
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    let _ = tls.write_all(b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let mut text = Vec::new();
    let _ = tls.read_to_end(&mut text);
    let resumed = conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let text = String::from_utf8_lossy(&text).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (status, resumed)
}
