//! systemd readiness: `READY=1` / `STOPPING=1` on `$NOTIFY_SOCKET` (sd_notify protocol), so a
//! `Type=notify` unit starts kubelet only once the proxy listens.
//!
//! No libsystemd: the protocol is one datagram to a UNIX socket, possibly in the abstract
//! namespace (`@name`). Without `NOTIFY_SOCKET` (not under systemd) this does nothing.

use std::os::unix::net::UnixDatagram;

/// Sends one sd_notify state line; failures are logged, never fatal.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let result = (|| -> std::io::Result<()> {
        let socket = UnixDatagram::unbound()?;
        let bytes = target.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(state.as_bytes(), &addr)?;
        } else {
            socket.send_to(state.as_bytes(), &target)?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        tracing::warn!(error = %e, "cannot notify systemd ({state})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_ready_to_the_notify_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).expect("bind");
        std::env::set_var("NOTIFY_SOCKET", &path);
        notify("READY=1");
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).expect("a datagram");
        assert_eq!(&buf[..n], b"READY=1");
    }
}
