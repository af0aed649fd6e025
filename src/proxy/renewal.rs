//! `--renew`: the proxy's certificate manager. At a random point in 70–90 % of the current
//! certificate's lifetime (the jitter kubelet's certificate manager uses, so a fleet does not
//! renew at once), a CSR for the same subject is signed in the hardware and submitted through
//! the CSR API, authenticated with the current certificate over the proxy's own upstream
//! settings (target, CA, server name, the same [`HardwareCertResolver`]). The issued chain is
//! checked, written where the proxy read it (the `--cert` file, the old one kept as `FILE.prev`,
//! or the key's store), and installed at once: new upstream connections use it, connections
//! opened with the old one end per [`super::rotation`].
//!
//! Failures are retried with capped exponential backoff while the current certificate is
//! valid (and after, in case the signer comes back); the proxy never exits because a renewal
//! failed. Task: one renewal task; the CSR signature and writes to a token run on blocking
//! threads.
//!
//! [`HardwareCertResolver`]: crate::key::tls::HardwareCertResolver

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use super::listener::stopped;
use super::Shared;
use crate::key::KeyUri;
use crate::lifecycle::issued::{self, Issued, Target};
use crate::lifecycle::renew::{prepare, subject_text, submit, Ask};
use crate::lifecycle::{client, LifecycleError, DEFAULT_WAIT};

/// First retry delay after a failed renewal; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest pause between renewal attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5 * 60);

/// What the renewal task needs besides [`Shared`].
#[derive(Debug, Clone)]
pub struct RenewSettings {
    pub key: KeyUri,
    /// The `--cert` file (None: the key's store).
    pub cert: Option<PathBuf>,
    /// `https://HOST:PORT` of the API server.
    pub server: String,
    pub upstream_ca: Option<PathBuf>,
    pub tls_server_name: Option<String>,
    pub versions: &'static [&'static rustls::SupportedProtocolVersion],
}

/// Renews until `stop`.
pub async fn run(shared: Arc<Shared>, settings: RenewSettings, mut stop: watch::Receiver<bool>) {
    loop {
        let chain = shared.upstream.resolver().chain();
        let wait = match chain.first().and_then(|leaf| validity(leaf)) {
            Some((not_before, not_after)) => {
                let lifetime = (not_after - not_before).max(0) as f64;
                let at = not_before as f64 + lifetime * jitter();
                Duration::from_secs_f64((at - now_unix()).max(0.0))
            }
            None => Duration::ZERO,
        };
        tracing::info!(
            in_secs = wait.as_secs(),
            "next certificate renewal scheduled"
        );
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let mut backoff = FIRST_BACKOFF;
        loop {
            shared.metrics.renewal_attempt();
            match renew_once(&shared, &settings).await {
                Ok(issued) => {
                    shared.metrics.renewal_succeeded(now_unix());
                    *shared
                        .renewal_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = None;
                    tracing::info!(
                        subject = %issued.subject,
                        serial = %issued.serial,
                        not_after = %issued.not_after,
                        "certificate renewed and installed; new connections use it"
                    );
                    break;
                }
                Err(e) => {
                    shared.metrics.renewal_failed(reason_label(&e));
                    *shared
                        .renewal_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    tracing::error!(error = %e, retry_in_secs = backoff.as_secs(), "certificate renewal failed; the current certificate stays in use");
                    tokio::select! {
                        biased;
                        _ = stopped(&mut stop) => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

/// One renewal: sign, submit, wait, check, write, install.
async fn renew_once(
    shared: &Arc<Shared>,
    settings: &RenewSettings,
) -> Result<Issued, LifecycleError> {
    let chain = shared.upstream.resolver().chain();
    let leaf = chain.first().ok_or_else(|| LifecycleError::Subject {
        reason: "the proxy holds no certificate".into(),
    })?;
    let subject = subject_text(leaf)?;
    let key = shared.key.clone();
    let submission = tokio::task::spawn_blocking(move || {
        prepare(
            &key,
            &Ask {
                subject: &subject,
                signer_name: None,
                expiration_seconds: None,
                wait: DEFAULT_WAIT,
            },
        )
    })
    .await
    .map_err(|e| LifecycleError::Kubelet(format!("the CSR signature panicked: {e}")))??;
    let config = client::config_for(
        &settings.server,
        settings.upstream_ca.as_deref(),
        settings.tls_server_name.clone(),
    )?;
    let client = client::build(
        &config,
        client::Identity::Hardware {
            resolver: shared.upstream.resolver().clone(),
            versions: settings.versions,
        },
    )?;
    let mut notes = Vec::new();
    let (name, pem) = submit(
        &client,
        &settings.server,
        &submission,
        DEFAULT_WAIT,
        &mut notes,
    )
    .await?;
    let issued = issued::check(&name, &pem, &shared.key)?;
    let target = match &settings.cert {
        Some(p) => Target::File(p.clone()),
        None => Target::KeyStore(settings.key.clone()),
    };
    let to_install = issued.clone();
    tokio::task::spawn_blocking(move || issued::install(&target, &to_install))
        .await
        .map_err(|e| LifecycleError::Kubelet(format!("the install panicked: {e}")))??;
    // Use it now, without waiting for the file watch.
    shared.install_chain(issued.chain.clone())?;
    shared.metrics.reload(true);
    Ok(issued)
}

/// A short label for the failures metric.
fn reason_label(e: &LifecycleError) -> &'static str {
    match e {
        LifecycleError::Denied { .. } => "denied",
        LifecycleError::Failed { .. } => "failed",
        LifecycleError::Timeout { .. } => "timeout",
        LifecycleError::Create { .. }
        | LifecycleError::Watch { .. }
        | LifecycleError::Client { .. } => "api",
        LifecycleError::BadIssued { .. } => "bad_certificate",
        LifecycleError::Install { .. } => "install",
        LifecycleError::Key(_) | LifecycleError::Pki(_) => "key",
        _ => "other",
    }
}

/// (NotBefore, NotAfter) of a certificate, in Unix seconds.
fn validity(cert: &[u8]) -> Option<(i64, i64)> {
    let (_, c) = x509_parser::parse_x509_certificate(cert).ok()?;
    let v = c.validity();
    Some((v.not_before.timestamp(), v.not_after.timestamp()))
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A uniformly random point in [0.7, 0.9).
fn jitter() -> f64 {
    let mut b = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    0.7 + 0.2 * (f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_renewal_point_falls_in_70_to_90_percent_of_the_lifetime() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.7..0.9).contains(&j), "{j}");
        }
    }
}
