//! systemd notifications over `$NOTIFY_SOCKET` (the `sd-notify` crate, no libsystemd): `READY=1`
//! once the proxy listens (a `Type=notify` unit starts kubelet only then), `RELOADING=1` with
//! `MONOTONIC_USEC` while a SIGHUP reload runs and `READY=1` after it (what `Type=notify-reload`
//! units and `systemctl reload` wait for), `STOPPING=1` when draining. Without `NOTIFY_SOCKET`
//! (not under systemd) these do nothing; a failure is logged, never fatal.

use sd_notify::NotifyState;

use super::settings::Settings;
use super::sockets::Announced;
use crate::key::Key;

/// The proxy listens and serves.
pub fn ready() {
    send("READY=1", &[NotifyState::Ready]);
}

/// A reload (SIGHUP) started; call [`ready`] when it is over, whatever its result.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send("RELOADING=1", &[NotifyState::Reloading, now]),
        Err(e) => tracing::warn!(error = %e, "cannot read the monotonic clock for RELOADING=1"),
    }
}

/// The proxy is draining and will exit.
pub fn stopping() {
    send("STOPPING=1", &[NotifyState::Stopping]);
}

fn send(what: &str, states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "cannot notify systemd ({what})");
    }
}

/// The ready line (tests and supervisors wait for it; it holds no secret), the log line and
/// systemd's READY=1.
pub fn announce_ready(settings: &Settings, bound: &Announced, key: &Key) {
    let listen_text: Vec<String> = bound.clients.iter().map(ToString::to_string).collect();
    let via = settings
        .upstream
        .targets
        .first()
        .and_then(|u| settings.upstream.egress.proxy_for(&u.host, u.port))
        .map(|p| format!(" via={p}"))
        .unwrap_or_default();
    let upstreams = settings.upstream_text();
    eprintln!(
        "hwkey proxy: ready: listen={} control=unix:{} admin={} upstream={}{via} key={}",
        listen_text.join(","),
        settings.state_dir.control_socket().display(),
        bound
            .admin
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "none".into()),
        upstreams,
        key.describe(),
    );
    tracing::info!(listen = %listen_text.join(","), upstream = %upstreams, "proxy ready");
    ready();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn sends_ready_and_reloading_to_the_notify_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).expect("bind");
        std::env::set_var("NOTIFY_SOCKET", &path);
        ready();
        reloading();
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 256];
        let n = receiver.recv(&mut buf).expect("a datagram");
        assert_eq!(&buf[..n], b"READY=1\n");
        let n = receiver.recv(&mut buf).expect("a datagram");
        let text = std::str::from_utf8(&buf[..n]).expect("utf-8");
        assert!(text.starts_with("RELOADING=1\nMONOTONIC_USEC="), "{text}");
    }
}
