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

#[cfg(feature = "pkcs11")]
use support::proxy::loopback_get;
