//! Certificate reload: on SIGHUP, and when the `--cert` file's contents change (polled, so it
//! works for atomic renames, plain rewrites and mounted secrets alike).
//!
//! A renewed certificate for the same key is installed in the [`HardwareCertResolver`] and the
//! upstream session store is emptied, so the next connection makes a full handshake with the
//! new certificate; open connections are not touched. A chain for another key, an expired
//! chain or an unreadable file is refused: the old chain stays, the refusal is logged and
//! counted (`hwkey_cert_reloads_total{result="refused"}`).
//!
//! Task: one reload task. Reading a chain stored on the token is a blocking hardware call and
//! runs on a blocking thread.
//!
//! [`HardwareCertResolver`]: crate::key::tls::HardwareCertResolver

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use super::{ProxyError, Shared};
use crate::pki::cert;
use crate::stop::stopped;

/// Runs until `stop`: reloads on SIGHUP and on changes of `cert_path` every `interval`.
pub async fn watch(
    shared: Arc<Shared>,
    cert_path: Option<PathBuf>,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ProxyError> {
    let mut hup = signal(SignalKind::hangup()).map_err(|source| ProxyError::Signal {
        name: "SIGHUP",
        source,
    })?;
    let mut last_seen = match &cert_path {
        Some(p) => std::fs::read(p).ok(),
        None => None,
    };
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => return Ok(()),
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading the certificate");
                super::notify::reloading();
                if let Some(p) = &cert_path {
                    last_seen = std::fs::read(p).ok();
                }
                reload(&shared, cert_path.clone()).await;
                super::notify::ready();
            }
            _ = tick.tick() => {
                let Some(p) = &cert_path else { continue };
                let now = std::fs::read(p).ok();
                if now.is_some() && now != last_seen {
                    last_seen = now;
                    tracing::info!(file = %p.display(), "certificate file changed: reloading");
                    reload(&shared, cert_path.clone()).await;
                }
            }
        }
    }
}

/// Loads the chain (file, or the one stored with the key) and installs it if it is for our key
/// and not expired. Returns whether it was installed.
pub async fn reload(shared: &Shared, cert_path: Option<PathBuf>) -> bool {
    let key = shared.key();
    let loaded = tokio::task::spawn_blocking(move || {
        cert::chain_for_key(&key, cert_path.as_deref()).map_err(ReloadRefused::Load)
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
            tracing::error!(reason = %reason, "certificate reload refused; keeping the current certificate");
            false
        }
    }
}

fn install(shared: &Shared, chain: Vec<CertificateDer<'static>>) -> Result<String, ReloadRefused> {
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
