//! Certificate and trust reload: on SIGHUP, and when the `--cert` or the `--upstream-ca` file's
//! contents change (polled, so it works for atomic renames, plain rewrites and mounted secrets
//! alike).
//!
//! A CA rotation goes CA1 → a bundle of CA1 and CA2 → CA2: each new bundle is trusted for new
//! connections (the resumable sessions, verified under the old trust, are dropped). A bundle
//! that does not parse or holds no usable CA is refused and the previous trust stays (never an
//! empty trust store), logged and counted (`hwkey_upstream_ca_reloads_total{result="refused"}`).
//!
//! A renewed certificate for the same key is installed in the [`HardwareCertResolver`] and the
//! upstream session store is emptied, so the next connection makes a full handshake with the
//! new certificate; open connections are not touched. A chain for another key, an expired
//! chain or an unreadable file is refused: the old chain stays, the refusal is logged and
//! counted (`hwkey_cert_reloads_total{result="refused"}`).
//!
//! The files are read by the signer side ([`SignerLink::read_watched`]), which was told their
//! paths before any network input: the network side is confined away from their directories
//! (a person's certificate sits in a home directory beside `~/.ssh`; a CA bundle beside the CA's
//! key).
//!
//! Task: one reload task. Reading a file through the signer, or a chain stored on the token, is
//! a blocking call and runs on a blocking thread.
//!
//! [`HardwareCertResolver`]: crate::key::tls::HardwareCertResolver

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use super::error::StartError;
use super::metrics::Metrics;
use super::parts::Parts;
use super::settings::Settings;
use super::upstream::Upstream;
use crate::pki::cert;
use crate::signer::protocol::WatchedFile;
use crate::signer::remote::SignerLink;
use crate::stop::stopped;

/// What the reload task needs: where the certificate and the CA bundle are, how often to
/// look, and the upstream to install them in.
pub struct Reloader {
    /// The connector whose chain and trust are replaced.
    pub upstream: Arc<Upstream>,
    /// Reloads counted.
    pub metrics: Arc<Metrics>,
    /// `--cert` (None: the chain stored with the key, reloaded on SIGHUP only).
    pub cert: Option<PathBuf>,
    /// `--upstream-ca` (None: the system roots, read once).
    pub upstream_ca: Option<PathBuf>,
    /// How often the files are compared.
    pub interval: Duration,
    /// Reads the watched files.
    pub files: Arc<SignerLink>,
}

impl Reloader {
    /// The reloader: SIGHUP and the watched files (`settings`' certificate and CA bundle,
    /// read by the signer side behind `parts.link`).
    pub fn build(settings: &Settings, parts: &Parts) -> Reloader {
        Reloader {
            upstream: parts.upstream.clone(),
            metrics: parts.metrics.clone(),
            cert: settings.key.cert.clone(),
            upstream_ca: settings.upstream.ca.clone(),
            interval: settings.reload.interval,
            files: parts.link.clone(),
        }
    }
}

/// Runs until `stop`: reloads on SIGHUP and on changes of the watched files every
/// `interval`.
pub async fn watch(
    shared: Arc<Reloader>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), StartError> {
    let mut hup = signal(SignalKind::hangup()).map_err(|source| StartError::Signal {
        name: "SIGHUP",
        source,
    })?;
    let interval = shared.interval;
    let cert_path = shared.cert.clone();
    let upstream_ca = shared.upstream_ca.clone();
    let cert_file = cert_path.as_ref().map(|_| WatchedFile::Certificate);
    let ca_file = upstream_ca.as_ref().map(|_| WatchedFile::UpstreamCa);
    let mut last_seen = snapshot(&shared, cert_file).await;
    let mut last_ca = snapshot(&shared, ca_file).await;
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => return Ok(()),
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading the certificate and the upstream CA bundle");
                super::notify::reloading();
                last_seen = snapshot(&shared, cert_file).await;
                reload(&shared, cert_path.clone()).await;
                if let Some(p) = &upstream_ca {
                    last_ca = snapshot(&shared, ca_file).await;
                    reload_trust_off_runtime(&shared, p).await;
                }
                super::notify::ready();
            }
            _ = tick.tick() => {
                if let Some(p) = &cert_path {
                    let now = snapshot(&shared, cert_file).await;
                    if now.is_some() && now != last_seen {
                        last_seen = now;
                        tracing::info!(file = %p.display(), "certificate file changed: reloading");
                        reload(&shared, cert_path.clone()).await;
                    }
                }
                if let Some(p) = &upstream_ca {
                    let now = snapshot(&shared, ca_file).await;
                    if now.is_some() && now != last_ca {
                        last_ca = now;
                        tracing::info!(file = %p.display(), "upstream CA bundle changed: reloading");
                        reload_trust_off_runtime(&shared, p).await;
                    }
                }
            }
        }
    }
}

/// What a watched file holds now, read by the signer side off the runtime: a regular file of
/// this user or root that no one else may write, within the size bound; None when it is not
/// that (a FIFO swapped in must not stall anything, a device must not be read a gigabyte at a
/// time).
async fn snapshot(shared: &Arc<Reloader>, file: Option<WatchedFile>) -> Option<Vec<u8>> {
    let file = file?;
    let files = shared.files.clone();
    tokio::task::spawn_blocking(move || match files.read_watched(file) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            tracing::debug!(file = ?file, error = %e, "watched file unreadable");
            None
        }
    })
    .await
    .ok()
    .flatten()
}

/// [`reload_trust`] on a blocking thread.
async fn reload_trust_off_runtime(shared: &Arc<Reloader>, path: &std::path::Path) {
    let (shared, path) = (shared.clone(), path.to_path_buf());
    let _ = tokio::task::spawn_blocking(move || reload_trust(&shared, &path)).await;
}

/// Loads the chain (file, or the one stored with the key) and installs it if it is for our key
/// and not expired. Returns whether it was installed.
pub async fn reload(shared: &Reloader, cert_path: Option<PathBuf>) -> bool {
    let key = shared.upstream.key();
    let files = shared.files.clone();
    let loaded = tokio::task::spawn_blocking(move || match cert_path {
        Some(path) => files
            .read_watched(WatchedFile::Certificate)
            .map_err(|e| ReloadRefused::Load(e.into()))
            .and_then(|bytes| cert::parse_chain(&bytes, &path).map_err(ReloadRefused::Load)),
        None => cert::chain_for_key(&key, None).map_err(ReloadRefused::Load),
    })
    .await
    .unwrap_or_else(|e| Err(ReloadRefused::Panicked(e)));
    let result = loaded.and_then(|chain| install(shared, chain));
    match result {
        Ok(serial) => {
            shared.metrics.reload(true);
            tracing::info!(serial = %serial, "certificate reloaded; new connections use it");
            true
        }
        Err(reason) => {
            shared.metrics.reload(false);
            shared.upstream.set_cert_problem(Some(reason.to_string()));
            tracing::error!(reason = %reason, "certificate reload refused; keeping the current certificate");
            false
        }
    }
}

/// Reads the upstream CA bundle again and trusts it for new connections; a bundle that does not
/// load keeps the previous trust. Returns whether it was installed.
pub fn reload_trust(shared: &Reloader, path: &std::path::Path) -> bool {
    let bytes = match shared.files.read_watched(WatchedFile::UpstreamCa) {
        Ok(bytes) => bytes,
        Err(e) => {
            shared.metrics.trust_reload(false);
            shared
                .upstream
                .set_trust_problem(Some(format!("{}: {e}", path.display())));
            tracing::error!(file = %path.display(), error = %e, "the upstream CA bundle is refused; keeping the previous trust");
            return false;
        }
    };
    match crate::pki::tls::root_store_from(&bytes, path) {
        Ok(roots) if !roots.is_empty() => {
            let count = roots.len();
            shared.upstream.set_roots(roots);
            shared.metrics.trust_reload(true);
            tracing::info!(file = %path.display(), cas = count, "upstream CA bundle reloaded; new connections verify the API server against it");
            true
        }
        Ok(_) => {
            shared.metrics.trust_reload(false);
            shared
                .upstream
                .set_trust_problem(Some(format!("{} holds no certificate", path.display())));
            tracing::error!(file = %path.display(), "the upstream CA bundle holds no certificate; keeping the previous trust");
            false
        }
        Err(e) => {
            shared.metrics.trust_reload(false);
            shared.upstream.set_trust_problem(Some(e.to_string()));
            tracing::error!(file = %path.display(), error = %e, "the upstream CA bundle does not load; keeping the previous trust");
            false
        }
    }
}

fn install(
    shared: &Reloader,
    chain: Vec<CertificateDer<'static>>,
) -> Result<String, ReloadRefused> {
    let leaf = chain.first().ok_or(ReloadRefused::Empty)?;
    let summary = cert::summarize(leaf).map_err(ReloadRefused::Load)?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    if summary.not_after_unix < now {
        return Err(ReloadRefused::Expired {
            serial: summary.serial,
            not_after: summary.not_after,
        });
    }
    shared
        .upstream
        .install_chain(chain)
        .map_err(ReloadRefused::Install)?;
    Ok(summary.serial)
}

/// Why a reloaded certificate is not installed (the current one stays).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
enum ReloadRefused {
    #[error("{0}")]
    Load(#[source] crate::pki::PkiError),
    #[error("the reload panicked: {0}")]
    Panicked(#[source] tokio::task::JoinError),
    #[error("the chain is empty")]
    Empty,
    #[error("the certificate (serial {serial}) expired at {not_after}")]
    Expired { serial: String, not_after: String },
    #[error("{0}")]
    Install(#[source] crate::key::KeyError),
}
