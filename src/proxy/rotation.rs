//! Which certificate a connection was opened with, and when it must end.
//!
//! Every install of a chain (reload, renewal) starts a new *epoch*: a generation number and the
//! leaf's NotAfter. A bridged connection remembers the epoch it was opened in. It is closed when
//! that certificate expires — whatever `--rotation-close` says, so no long watch goes on under
//! an expired identity — and, with `--rotation-close immediate` (what kubelet does after a
//! rotation), as soon as a newer certificate is installed. The client reconnects and gets the
//! new identity. [`super::cutoff`] watches for both.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::CertificateDer;
use tokio::sync::watch;

/// When connections opened under an older certificate are closed.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum RotationClose {
    /// When the certificate they were opened with expires (open connections survive a reload).
    #[default]
    Expiry,
    /// As soon as a newer certificate is installed.
    Immediate,
}

/// The certificate generation in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CertEpoch {
    /// Counts installed certificates; higher is newer.
    pub generation: u64,
    /// The leaf's NotAfter, seconds since the Unix epoch (None: unreadable, never expires here).
    pub not_after_unix: Option<i64>,
}

/// The leaf's NotAfter, in seconds since the Unix epoch.
pub fn not_after_unix(chain: &[CertificateDer<'_>]) -> Option<i64> {
    let leaf = chain.first()?;
    let (_, c) = x509_parser::parse_x509_certificate(leaf).ok()?;
    Some(c.validity().not_after.timestamp())
}

/// The first epoch, for the chain the proxy started with.
pub fn first(chain: &[CertificateDer<'_>]) -> watch::Sender<CertEpoch> {
    watch::Sender::new(CertEpoch {
        generation: 0,
        not_after_unix: not_after_unix(chain),
    })
}

/// Starts a new epoch for a chain that was just installed.
pub fn advance(epoch: &watch::Sender<CertEpoch>, chain: &[CertificateDer<'_>]) {
    let not_after_unix = not_after_unix(chain);
    epoch.send_modify(|e| {
        e.generation += 1;
        e.not_after_unix = not_after_unix;
    });
}

/// How long until the Unix time `t` (zero if past).
pub(crate) fn until_unix(t: i64) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    Duration::from_secs_f64((t as f64 - now).max(0.0))
}
