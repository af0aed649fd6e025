//! The network side's confinement plan ([`sandbox_plan`]): what it may read, write and connect
//! to once [`super::sandbox::confine`] applies it, derived from the settings alone.

use std::path::PathBuf;

use super::sandbox::Plan;
use super::settings::Settings;

/// What the network side may touch once confined: the system's name-resolution and CA files
/// to read; the state directory and the listeners' directories (their socket files go at the
/// stop) to write; the API servers', the forward proxies' and (when one is named, not an
/// address) DNS's ports to connect to, and UDP only then.
/// Nothing of the certificate's or the CA bundle's directories: the signer side reads those
/// files for reloads and writes a renewed certificate, so a certificate in a home directory
/// does not open `~/.ssh` or `~/.bashrc` to the network side. The secrets (PIN files, the
/// PKCS#11 module, a TPM key file) must be neither readable nor in a directory it writes
/// (checked).
pub fn sandbox_plan(settings: &Settings, socket_files: &[PathBuf]) -> Plan {
    let dir_of = |p: &std::path::Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let read: Vec<PathBuf> = [
        "/etc/hosts",
        "/etc/resolv.conf",
        "/etc/nsswitch.conf",
        "/etc/gai.conf",
        "/etc/host.conf",
        "/run/systemd/resolve",
        "/etc/ssl/certs",
        "/usr/share/ca-certificates",
    ]
    .into_iter()
    .map(PathBuf::from)
    .collect();
    let mut write = vec![settings.state_dir.path().to_path_buf()];
    write.extend(socket_files.iter().map(|p| dir_of(p)));
    let egress = &settings.upstream.egress;
    let named = |host: &str| host.parse::<std::net::IpAddr>().is_err();
    let mut connect: Vec<u16> = Vec::new();
    let mut dns = false;
    for t in &settings.upstream.targets {
        connect.push(t.port);
        dns |= named(&t.host);
        if let Some(p) = egress.proxy_for(&t.host, t.port) {
            connect.push(p.port);
            dns |= named(&p.host);
        }
    }
    if dns {
        connect.push(53);
    }
    let mut forbidden = settings.key.uri.secret_files();
    forbidden.extend(settings.key.uri.key_files());
    if settings.key.uri.presents_pin() {
        forbidden.push(crate::key::pin_memory::memory_secret());
    }
    Plan {
        read,
        write,
        connect,
        dns,
        forbidden,
    }
}
