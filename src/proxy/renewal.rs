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
use crate::key::{Key, KeyUri};
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
    /// The key in use (the CSR is for it, or for its successor with key rotation).
    pub key: KeyUri,
    /// The `--cert` file (None: the key's store).
    pub cert: Option<PathBuf>,
    /// `https://HOST:PORT` of the API server.
    pub server: String,
    /// The API server's CA bundle.
    pub upstream_ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    /// The TLS versions the key can sign for.
    pub versions: &'static [&'static rustls::SupportedProtocolVersion],
    /// `--rotate-key`: a fresh hardware key per renewal.
    pub rotate_key: bool,
    /// `--attest`: the attestation key's handle; the request carries TPM2_Certify evidence.
    pub attest: Option<u32>,
    /// Where `current-key` is kept.
    pub state_dir: PathBuf,
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
    let current = shared.key();
    // With --rotate-key the request is for a fresh key made in the same device; it is still
    // authenticated with the current key and certificate.
    let key = if settings.rotate_key {
        let uri = next_key_uri(current.uri())?;
        let algorithm = current.algorithm();
        let created = tokio::task::spawn_blocking(move || Key::create(&uri, algorithm))
            .await
            .map_err(|e| LifecycleError::Kubelet(format!("creating the key panicked: {e}")))??;
        tracing::info!(key = %created.describe(), "created the next hardware key (--rotate-key)");
        Arc::new(created)
    } else {
        current.clone()
    };
    let signing_key = key.clone();
    let attest = settings.attest;
    let submission = tokio::task::spawn_blocking(move || {
        prepare(
            &signing_key,
            &Ask {
                subject: &subject,
                signer_name: None,
                expiration_seconds: None,
                wait: DEFAULT_WAIT,
                attest,
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
    let submitted = submit(
        &client,
        &settings.server,
        &submission,
        DEFAULT_WAIT,
        &mut notes,
    )
    .await;
    let (name, pem) = match submitted {
        Ok(done) => done,
        Err(e) => {
            if !Arc::ptr_eq(&key, &current) {
                discard_key(key.uri().clone()).await;
            }
            return Err(e);
        }
    };
    let issued = issued::check(&name, &pem, &key)?;
    let target = match &settings.cert {
        Some(p) => Target::File(p.clone()),
        None => Target::KeyStore(key.uri().clone()),
    };
    let to_install = issued.clone();
    tokio::task::spawn_blocking(move || issued::install(&target, &to_install))
        .await
        .map_err(|e| LifecycleError::Kubelet(format!("the install panicked: {e}")))??;
    shared.metrics.reload(true);
    if Arc::ptr_eq(&key, &current) {
        // Use it now, without waiting for the file watch.
        shared.install_chain(issued.chain.clone())?;
        return Ok(issued);
    }
    // Key rotation: switch, remember the new key for restarts, and delete the old key once a
    // handshake with the new one went through.
    shared.install_key(key.clone(), issued.chain.clone())?;
    let pointer = settings.state_dir.join(CURRENT_KEY_FILE);
    crate::atomic_file::write_atomic(
        &pointer,
        format!("{}\n", key.uri().without_pin()).as_bytes(),
        0o600,
    )
    .map_err(|source| LifecycleError::Install {
        path: pointer,
        source,
    })?;
    match tokio::time::timeout(
        std::time::Duration::from_secs(15),
        shared.upstream.connect(Some(b"http/1.1")),
    )
    .await
    {
        Ok(Ok(_)) => {
            let old = current.uri().clone();
            drop(current);
            match tokio::task::spawn_blocking(move || crate::key::delete(&old)).await {
                Ok(Ok(removed)) => {
                    tracing::info!(removed = ?removed, "deleted the previous hardware key (--rotate-key)")
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "cannot delete the previous hardware key; delete it by hand")
                }
                Err(e) => {
                    tracing::error!(error = %e, "deleting the previous hardware key panicked")
                }
            }
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "the new key did not complete an upstream handshake yet; the previous key is kept")
        }
        Err(_) => tracing::error!(
            "the new key did not complete an upstream handshake in time; the previous key is kept"
        ),
    }
    Ok(issued)
}

/// The file in the state directory naming the key in use after a rotation, so a restarted
/// proxy signs with it (see [`current_key`]).
pub const CURRENT_KEY_FILE: &str = "current-key";

/// The key the proxy should use: the one a rotation left in `STATE/current-key`, with the
/// configured PIN source, else `configured`.
pub fn current_key(configured: &KeyUri, state_dir: &std::path::Path) -> KeyUri {
    let Ok(text) = std::fs::read_to_string(state_dir.join(CURRENT_KEY_FILE)) else {
        return configured.clone();
    };
    match text.trim().parse::<KeyUri>() {
        Ok(KeyUri::Pkcs11(mut u)) => {
            if let KeyUri::Pkcs11(c) = configured {
                u.pin = c.pin.clone();
            }
            tracing::info!(key = %u, "using the key the last rotation left in {CURRENT_KEY_FILE}");
            KeyUri::Pkcs11(u)
        }
        Ok(other) => {
            tracing::info!(key = %other, "using the key the last rotation left in {CURRENT_KEY_FILE}");
            other
        }
        Err(e) => {
            tracing::error!(error = %e, "ignoring an unreadable {CURRENT_KEY_FILE}");
            configured.clone()
        }
    }
}

/// The URI of the next key of a rotation: the label (PKCS#11) or file name (TPM) with a
/// `-r<unix time>` suffix in place of the previous one.
pub fn next_key_uri(current: &KeyUri) -> Result<KeyUri, LifecycleError> {
    let stamp = now_unix() as u64;
    let base = |name: &str| -> String {
        match name.rsplit_once("-r") {
            Some((b, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => b.to_string(),
            _ => name.to_string(),
        }
    };
    match current {
        KeyUri::Pkcs11(u) => {
            let label = u.object.as_deref().ok_or_else(|| {
                LifecycleError::Kubelet(
                    "--rotate-key needs a key named by object= (its label)".into(),
                )
            })?;
            Ok(KeyUri::Pkcs11(
                u.with_key(Some(format!("{}-r{stamp}", base(label))), None),
            ))
        }
        KeyUri::Tpm(t) => match &t.key {
            Some(crate::key::TpmKeyLocation::Path(p)) => {
                let file = p.file_name().and_then(|f| f.to_str()).unwrap_or("key");
                let stem = file
                    .strip_suffix(".tpm.pem")
                    .or_else(|| file.strip_suffix(".pem"))
                    .unwrap_or(file);
                let mut t = t.clone();
                t.key = Some(crate::key::TpmKeyLocation::Path(
                    p.with_file_name(format!("{}-r{stamp}.tpm.pem", base(stem))),
                ));
                Ok(KeyUri::Tpm(t))
            }
            _ => Err(LifecycleError::Kubelet(
                "--rotate-key needs a TPM key file (tpm:path=…), not a persistent handle".into(),
            )),
        },
    }
}

/// Deletes a key made for a rotation whose request failed.
async fn discard_key(uri: KeyUri) {
    let _ = tokio::task::spawn_blocking(move || crate::key::delete(&uri)).await;
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
