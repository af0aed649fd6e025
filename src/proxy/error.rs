//! The proxy's errors, by when they happen: [`StartError`] (the proxy cannot start or keep
//! running: a port in use, a key that does not open, a signal that cannot be watched) and
//! [`UpstreamError`] (one connection to the API server failed: the client gets a 502 naming
//! it). Settings that cannot work are [`super::settings::SettingsError`], before anything runs.

use std::path::PathBuf;
use std::time::Duration;

use crate::endpoint::ListenAddr;
use crate::key::KeyError;
use crate::pki::PkiError;

/// Why the proxy cannot start, or stopped running, each saying what to fix.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum StartError {
    #[error("{0}")]
    Settings(#[from] super::settings::SettingsError),

    #[error("{0}")]
    Signer(#[source] crate::signer::SignerError),

    #[error("--renew: {0}")]
    RenewLock(#[source] crate::lifecycle::renewal_lock::RenewalLockError),

    #[error("{why}; the proxy stops so that its service manager (or the next kubectl) starts a whole new one")]
    SignerSideGone { why: String },

    #[error("{0}")]
    Sandbox(#[from] super::sandbox::SandboxError),

    #[error("invalid --tls-server-name '{given}': not a DNS name or IP address")]
    InvalidServerName { given: String },

    #[error("cannot set up the loopback TLS listener: {0}")]
    LocalTls(#[source] rustls::Error),

    #[error("cannot read the upstream CA bundle: {0}")]
    UpstreamCa(#[source] PkiError),

    #[error("refusing to listen on {addr}: it is not a loopback address and the local hop would be exposed; pass --unsafe-listen if you really mean it")]
    NonLoopbackListen { addr: ListenAddr },

    #[error("cannot listen on {addr}: {source}: {}", if *.own { format!("a process of yours (uid {uid}) already listens there: another hwkey proxy? stop it (its state directory's proxy.pid), or pick another port (hwkey kubeconfig --port N, or --listen)") } else { format!("another user's process (uid {uid}) already listens there, perhaps to stand in for your proxy: pick another port (hwkey kubeconfig --port N, or --listen), or ask an administrator to stop it") })]
    PortTaken {
        addr: ListenAddr,
        uid: u32,
        own: bool,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: ListenAddr,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },

    #[error("another process already listens on {path} (another hwkey proxy?)")]
    SocketInUse { path: PathBuf },

    #[error("cannot watch for {name}: {source}")]
    Signal {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot open the lock file {path}: {source}")]
    LockFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),

    #[error("{0}")]
    Key(#[from] KeyError),

    #[error("{0}")]
    Pki(#[from] PkiError),
}

/// Why one connection to the API server failed.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong"
)]
pub enum UpstreamError {
    #[error("cannot connect to the upstream {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot reach the upstream {addr}: {source}")]
    Via {
        addr: String,
        #[source]
        source: crate::egress::EgressError,
    },

    #[error("TLS handshake with the upstream {addr} failed: {}", crate::error_chain::error_chain(.source))]
    Handshake {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("TLS handshake with the upstream {addr} failed: {source}")]
    Tls {
        addr: String,
        #[source]
        source: PkiError,
    },

    #[error("the upstream {addr} did not agree to protocol '{asked}' (answered with {got})")]
    Alpn {
        addr: String,
        asked: String,
        got: String,
    },

    #[error("the upstream {addr} did not complete a handshake within {after:?}")]
    Timeout { addr: String, after: Duration },

    #[error("no API server is configured")]
    NoEndpoint,

    #[error("no session ticket to resume with (a spare connection is made only by resuming)")]
    NoTicket,
}
