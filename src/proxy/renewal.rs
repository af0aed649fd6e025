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
//! failed. Two requests are never closer than [`renewal_floor`] (a minute, and 10 % of the
//! lifetime), whatever the signer returns: a signer that caps NotAfter, or returns the same
//! certificate, would otherwise get a CSR after every answer. A certificate that expires no
//! later than the one in use is not installed (a failure, with a warning). An installed
//! certificate must complete one upstream handshake and request, else the previous one is put
//! back. Task: one renewal task; the CSR signature and writes to a token run on blocking threads.
//!
//! [`HardwareCertResolver`]: crate::key::tls::HardwareCertResolver

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use super::error::UpstreamError;
use super::metrics::{Metrics, RenewalFailure};
use super::parts::Parts;
use super::settings::Settings;
use super::upstream::Upstream;
use crate::backoff::Backoff;
use crate::key::{Key, KeyUri};
use crate::lifecycle::csr_api::Submission;
use crate::lifecycle::issued::{self, Issued, Target};
use crate::lifecycle::renew::{prepare, subject_text, submit, Ask, SubjectProblem};
use crate::lifecycle::{client, LifecycleError, DEFAULT_WAIT};
use crate::state_dir::CURRENT_KEY_FILE;
use crate::stop::stopped;

/// First retry delay after a failed renewal; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest pause between renewal attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5 * 60);

/// What the renewal task needs.
pub struct Renewal {
    /// The connector whose identity is renewed (and which the renewal's client uses).
    pub upstream: Arc<Upstream>,
    /// Renewals counted.
    pub metrics: Arc<Metrics>,
    /// The last failure, for `/healthz`.
    pub status: Arc<RenewalStatus>,
    /// The settings.
    pub settings: RenewSettings,
    /// The certificate file's renewal lock, opened before the network side was confined.
    pub lock: Option<crate::lifecycle::renewal_lock::LockFile>,
    /// Reads the upstream CA bundle (the network side is confined away from its directory).
    pub files: Arc<crate::signer::remote::SignerLink>,
}

impl Renewal {
    /// The renewal's component (`--renew`), reporting into `status`; `None` without `--renew`.
    pub fn build(
        settings: &Settings,
        parts: &Parts,
        status: Arc<RenewalStatus>,
    ) -> Option<Renewal> {
        let r = settings.renewal.as_ref()?;
        Some(Renewal {
            upstream: parts.upstream.clone(),
            metrics: parts.metrics.clone(),
            status,
            settings: RenewSettings {
                key: settings.key.uri.clone(),
                cert: settings.key.cert.clone(),
                upstream_ca: settings.upstream.ca.clone(),
                tls_server_name: settings.upstream.tls_server_name.clone(),
                versions: parts.versions,
                rotate_key: r.rotate_key,
                attest: r.attest,
                state_dir: settings.state_dir.clone(),
            },
            lock: parts.renew_lock.clone(),
            files: parts.link.clone(),
        })
    }
}

/// The last renewal failure, cleared by a success: `/healthz` reports "degraded" when the
/// certificate is also past 90 % of its lifetime.
#[derive(Debug, Default)]
pub struct RenewalStatus(std::sync::Mutex<Option<String>>);

impl RenewalStatus {
    fn set(&self, error: Option<String>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = error;
    }

    /// The last failure, if the last attempt failed.
    pub fn last_error(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// What the renewal needs from the settings.
#[derive(Debug, Clone)]
pub struct RenewSettings {
    /// The configured key (with `--rotate-key`, the one never deleted).
    pub key: KeyUri,
    /// The `--cert` file (None: the key's store).
    pub cert: Option<PathBuf>,
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
    pub state_dir: crate::state_dir::StateDir,
}

/// The least time between two renewal requests for a certificate of `lifetime`: a minute,
/// and 10 % of the lifetime.
pub fn renewal_floor(lifetime: Duration) -> Duration {
    (lifetime / 10).max(Duration::from_secs(60))
}

/// Waits until `floor` has passed since `last` (the previous request); false when stopped.
async fn respect_floor(
    last: Option<std::time::Instant>,
    floor: Duration,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let Some(last) = last else { return true };
    let left = floor.saturating_sub(last.elapsed());
    if left.is_zero() {
        return true;
    }
    tracing::info!(
        in_secs = left.as_secs(),
        "waiting out the renewal floor (one request per {}s at most)",
        floor.as_secs()
    );
    tokio::select! {
        biased;
        _ = stopped(stop) => false,
        _ = tokio::time::sleep(left) => true,
    }
}

/// Renews until `stop`.
pub async fn run(renewal: Arc<Renewal>, mut stop: watch::Receiver<bool>) {
    let mut last_request: Option<std::time::Instant> = None;
    loop {
        let wait = renewal.next_renewal();
        tracing::info!(
            in_secs = wait.as_secs(),
            "next certificate renewal scheduled"
        );
        tokio::select! {
            biased;
            _ = stopped(&mut stop) => return,
            _ = tokio::time::sleep(wait) => {}
        }
        if !renewal.until_renewed(&mut last_request, &mut stop).await {
            return;
        }
    }
}

impl Renewal {
    /// How long until the next renewal: a random point in 70–90 % of the lifetime of the
    /// certificate in use (now, when it cannot be read).
    fn next_renewal(&self) -> Duration {
        match self
            .upstream
            .chain()
            .first()
            .and_then(|leaf| validity(leaf))
        {
            Some((not_before, not_after)) => {
                let lifetime = (not_after - not_before).max(0) as f64;
                let at = not_before as f64 + lifetime * jitter();
                Duration::from_secs_f64((at - now_unix()).max(0.0))
            }
            None => Duration::ZERO,
        }
    }

    /// The lifetime of the certificate in use.
    fn lifetime(&self) -> Duration {
        self.upstream
            .chain()
            .first()
            .and_then(|leaf| validity(leaf))
            .map(|(from, to)| Duration::from_secs(u64::try_from(to - from).unwrap_or(0)))
            .unwrap_or_default()
    }

    /// Renews, retrying with backoff (never closer than the floor) until it works; false when
    /// stopped first.
    async fn until_renewed(
        &self,
        last_request: &mut Option<std::time::Instant>,
        stop: &mut watch::Receiver<bool>,
    ) -> bool {
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        loop {
            if !respect_floor(*last_request, renewal_floor(self.lifetime()), stop).await {
                return false;
            }
            *last_request = Some(std::time::Instant::now());
            let failed = match renew_once(self, &self.settings).await {
                Ok(issued) => {
                    self.metrics.renewal_succeeded(now_unix());
                    self.status.set(None);
                    tracing::info!(
                        subject = %issued.subject,
                        serial = %issued.serial,
                        not_after = %issued.not_after,
                        "certificate renewed and installed; new connections use it"
                    );
                    return true;
                }
                Err(e) => e,
            };
            self.metrics.renewal_failed(reason_label(&failed));
            if matches!(failed, LifecycleError::NotLonger { .. }) {
                tracing::warn!("the signer caps certificate lifetimes: renewing again will not extend this identity; ask for a signer CA that lives longer");
            }
            self.status.set(Some(failed.to_string()));
            let retry_in = backoff.next_delay();
            tracing::error!(error = %failed, retry_in_secs = retry_in.as_secs(), "certificate renewal failed; the current certificate stays in use");
            tokio::select! {
                biased;
                _ = stopped(stop) => return false,
                _ = tokio::time::sleep(retry_in) => {}
            }
        }
    }
}

/// One renewal: sign, submit, wait, check, write, install, prove. With `--rotate-key`, the key
/// made for it is deleted on every failure after it was made (a smart card fills up with
/// orphans otherwise).
async fn renew_once(shared: &Renewal, settings: &RenewSettings) -> Result<Issued, LifecycleError> {
    // One renewal of the certificate file at a time, `hwkey renew` included (a non-blocking
    // flock: a busy lock fails this attempt, retried with the back-off).
    let _one_renewal = shared.lock.as_ref().map(|l| l.take()).transpose()?;
    let current = shared.upstream.key();
    // With --rotate-key the request is for a fresh key made in the same device; it is still
    // authenticated with the current key and certificate.
    let key = if settings.rotate_key {
        let from = current.clone();
        let created = tokio::task::spawn_blocking(move || from.create_next())
            .await
            .map_err(|source| LifecycleError::Panicked {
                task: "creating the key",
                source,
            })??;
        tracing::info!(key = %created.describe(), "created the next hardware key (--rotate-key)");
        Arc::new(created)
    } else {
        current.clone()
    };
    let rotated = !Arc::ptr_eq(&key, &current);
    let result = install_and_prove(shared, settings, &current, &key).await;
    if result.is_err() && rotated {
        tracing::info!(key = %key.describe(), "deleting the key made for the failed renewal");
        discard_key(key).await;
    }
    result
}

/// Signs a request for `key` (the subject of the certificate in use), submits it authenticated
/// with the current certificate, and checks what is issued: a client certificate for `key`
/// that expires later than the one in use.
async fn request_certificate(
    shared: &Renewal,
    settings: &RenewSettings,
    key: &Arc<Key>,
) -> Result<Issued, LifecycleError> {
    let previous_chain = shared.upstream.chain();
    let leaf = previous_chain.first().ok_or(LifecycleError::Subject {
        problem: SubjectProblem::NoCertificate,
    })?;
    let subject = subject_text(leaf)?;
    let current_not_after = validity(leaf).map(|(_, to)| to);
    let signing_key = key.clone();
    let attest = settings.attest;
    // The certificate in use proves the key only when the request is for that same key.
    let same_key = Arc::ptr_eq(key, &shared.upstream.key()).then(|| leaf.to_vec());
    let current_lifetime = crate::lifecycle::renew::person_lifetime(leaf);
    let submission = tokio::task::spawn_blocking(move || {
        prepare(
            &signing_key,
            &Ask {
                subject: &subject,
                signer_name: None,
                expiration_seconds: None,
                wait: DEFAULT_WAIT,
                attest,
                current_certificate: same_key.as_deref(),
                current_lifetime,
            },
        )
    })
    .await
    .map_err(|source| LifecycleError::Panicked {
        task: "the CSR signature",
        source,
    })??;
    let (name, pem) = submit_to_one(shared, settings, &submission).await?;
    let issued = issued::check_issued(&name, &pem, key)?;
    if let Some(current) = current_not_after {
        if issued.not_after_unix <= current {
            return Err(LifecycleError::NotLonger {
                issued: issued.not_after.clone(),
                current: time::OffsetDateTime::from_unix_timestamp(current)
                    .map(|t| t.to_string())
                    .unwrap_or_else(|_| current.to_string()),
            });
        }
    }
    Ok(issued)
}

/// Submits the request to the API servers in the proxy's order (the ones up first), moving
/// on only while the request could not be created because a server was unreachable (never
/// after one answered: a second request for one renewal is never made on purpose). An
/// unreachable server is marked down for traffic too.
async fn submit_to_one(
    shared: &Renewal,
    settings: &RenewSettings,
    submission: &Submission,
) -> Result<(String, Vec<u8>), LifecycleError> {
    let mut last = None;
    let roots = upstream_roots(shared, settings).await?;
    for (i, server) in shared.upstream.renewal_servers() {
        let client = api_client(shared, settings, &server, roots.clone())?;
        let mut notes = Vec::new();
        match submit(&client, &server, submission, DEFAULT_WAIT, &mut notes).await {
            Err(e) if unreachable(&e) => {
                tracing::warn!(%server, error = %e, "renewal: API server unreachable; trying the next");
                shared.upstream.renewal_failed(i, &e);
                last = Some(e);
            }
            other => return other,
        }
    }
    Err(last.unwrap_or(LifecycleError::InvalidServer {
        url: String::new(),
        problem: "no API server is configured",
    }))
}

/// True when creating the request failed before any API server answered it.
fn unreachable(e: &LifecycleError) -> bool {
    matches!(e, LifecycleError::Create { source, .. } if !matches!(source, kube::Error::Api(_)))
}

/// A client for the CSR API over the proxy's own way to `server`, authenticated with the
/// certificate in use (the handshake signed in the hardware).
fn api_client(
    shared: &Renewal,
    settings: &RenewSettings,
    server: &str,
    roots: Option<Vec<Vec<u8>>>,
) -> Result<kube::Client, LifecycleError> {
    let config = client::config_with_roots(server, roots, settings.tls_server_name.clone())?;
    client::build_via(
        &config,
        client::Identity::Hardware {
            resolver: shared.upstream.resolver().clone(),
            versions: settings.versions,
        },
        Some(shared.upstream.egress().clone()),
    )
}

/// The upstream CA's certificates for the renewal's client, read once per renewal by the
/// signer side (the network side is confined away from the bundle's directory), off the
/// runtime: a signer call blocks.
async fn upstream_roots(
    shared: &Renewal,
    settings: &RenewSettings,
) -> Result<Option<Vec<Vec<u8>>>, LifecycleError> {
    let Some(path) = settings.upstream_ca.clone() else {
        return Ok(None);
    };
    let files = shared.files.clone();
    let read = tokio::task::spawn_blocking(move || {
        files.read_watched(crate::signer::protocol::WatchedFile::UpstreamCa)
    })
    .await
    .map_err(|source| LifecycleError::Panicked {
        task: "reading the upstream CA bundle",
        source,
    })?;
    let chain = crate::pki::cert::parse_chain(&read?, &path)?;
    Ok(Some(chain.into_iter().map(|c| c.to_vec()).collect()))
}

/// The part of [`renew_once`] after the key is chosen: request, install, prove.
async fn install_and_prove(
    shared: &Renewal,
    settings: &RenewSettings,
    current: &Arc<Key>,
    key: &Arc<Key>,
) -> Result<Issued, LifecycleError> {
    let previous_chain = shared.upstream.chain();
    let issued = request_certificate(shared, settings, key).await?;
    let target = match &settings.cert {
        Some(_) => Target::SignerFile(key.clone()),
        None => Target::KeyStore(key.clone()),
    };
    let to_install = issued.clone();
    let install_target = target.clone();
    tokio::task::spawn_blocking(move || issued::install(&install_target, &to_install))
        .await
        .map_err(|source| LifecycleError::Panicked {
            task: "the install",
            source,
        })??;
    shared.metrics.reload(true);
    if Arc::ptr_eq(key, current) {
        // Use it now, without waiting for the file watch; then prove the API server takes it.
        shared.upstream.install_chain(issued.chain.clone())?;
        if let Err(refused) = upstream_accepts(shared).await {
            roll_back(shared, &target, &previous_chain, None).await?;
            return Err(LifecycleError::RefusedUpstream {
                source: Box::new(refused),
            });
        }
        return Ok(issued);
    }
    switch_key(shared, settings, current, key, &issued, &previous_chain).await?;
    Ok(issued)
}

/// Key rotation: switch, prove the new key and certificate upstream, remember the new key for
/// restarts, and delete the previous key only if this rotation series made it.
async fn switch_key(
    shared: &Renewal,
    settings: &RenewSettings,
    current: &Arc<Key>,
    key: &Arc<Key>,
    issued: &Issued,
    previous_chain: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<(), LifecycleError> {
    shared
        .upstream
        .install_key(key.clone(), issued.chain.clone())?;
    // The signer records the key in use for restarts; without that record a restart would
    // pair the new certificate with the old key, so the rotation stops here.
    if let Err(e) = mark_in_use(key).await {
        let old_target = match &settings.cert {
            Some(_) => Target::SignerFile(current.clone()),
            None => Target::KeyStore(current.clone()),
        };
        roll_back(shared, &old_target, previous_chain, Some(current)).await?;
        return Err(e);
    }
    if let Err(refused) = upstream_accepts(shared).await {
        let old_target = match &settings.cert {
            Some(_) => Target::SignerFile(current.clone()),
            None => Target::KeyStore(current.clone()),
        };
        roll_back(shared, &old_target, previous_chain, Some(current)).await?;
        return Err(LifecycleError::RefusedUpstream {
            source: Box::new(refused),
        });
    }
    retire_previous_key(current, &settings.key, key.uri()).await;
    Ok(())
}

/// Deletes the key a rotation replaced, unless it is the configured key (`--key`, which other
/// proxies, `renew --kubeconfig` and `doctor` may name): a rotation deletes only keys a
/// rotation made.
async fn retire_previous_key(previous: &Arc<Key>, configured: &KeyUri, new: &KeyUri) {
    if previous.uri().without_pin().to_string() == configured.without_pin().to_string() {
        tracing::warn!(
            kept = %previous.uri().without_pin(),
            now = %new.without_pin(),
            "the configured key is kept (other proxies or kubeconfigs may use it); this proxy signs with the new key, recorded in {CURRENT_KEY_FILE}: update --key (and kubeconfigs naming the old key) to the new one, then delete the old key by hand"
        );
        return;
    }
    let old = previous.clone();
    match tokio::task::spawn_blocking(move || old.destroy()).await {
        Ok(Ok(removed)) => {
            tracing::info!(removed = ?removed, "deleted the previous hardware key (--rotate-key)")
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "cannot delete the previous hardware key; delete it by hand")
        }
        Err(e) => tracing::error!(error = %e, "deleting the previous hardware key panicked"),
    }
}

/// One upstream connection with the certificate in use, a full handshake (the session store
/// was emptied at install) and one request: any HTTP answer means the API server took the
/// client certificate (TLS 1.3 reports a refused one only after the client's Finished, so the
/// handshake alone proves nothing).
async fn upstream_accepts(shared: &Renewal) -> Result<(), Refused> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut conn = shared.upstream.connect(Some(b"http/1.1")).await?;
        conn.stream
            .write_all(b"GET /version HTTP/1.1\r\nHost: kubernetes\r\nConnection: close\r\n\r\n")
            .await
            .map_err(Refused::Send)?;
        let mut head = [0u8; 12];
        conn.stream
            .read_exact(&mut head)
            .await
            .map_err(Refused::NoAnswer)?;
        if head.starts_with(b"HTTP/1.") {
            Ok(())
        } else {
            Err(Refused::NotHttp)
        }
    };
    tokio::time::timeout(UPSTREAM_CHECK_TIMEOUT, attempt)
        .await
        .map_err(|_| Refused::Timeout)?
}

/// How long [`upstream_accepts`] waits for its answer.
const UPSTREAM_CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// How the API server refused a renewed certificate (see [`upstream_accepts`]).
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("{0}")]
    Connect(#[from] UpstreamError),
    #[error("{0}")]
    Send(#[source] std::io::Error),
    #[error("no answer to a request: {0}")]
    NoAnswer(#[source] std::io::Error),
    #[error("the answer is not HTTP")]
    NotHttp,
    #[error("no answer within {UPSTREAM_CHECK_TIMEOUT:?}")]
    Timeout,
}

/// Puts the previous certificate (and, after a key rotation, the previous key) back in use and
/// where it was stored.
async fn roll_back(
    shared: &Renewal,
    target: &Target,
    chain: &[rustls::pki_types::CertificateDer<'static>],
    key: Option<&Arc<Key>>,
) -> Result<(), LifecycleError> {
    match key {
        Some(k) => {
            shared.upstream.install_key(k.clone(), chain.to_vec())?;
            if let Err(e) = mark_in_use(k).await {
                tracing::error!(error = %e, "cannot tell the signer which key is in use");
            }
        }
        None => shared.upstream.install_chain(chain.to_vec())?,
    }
    let target = target.clone();
    let chain = chain.to_vec();
    tokio::task::spawn_blocking(move || issued::install_chain(&target, &chain))
        .await
        .map_err(|source| LifecycleError::Panicked {
            task: "the roll-back",
            source,
        })??;
    tracing::error!(
        "the API server refused the renewed certificate: the previous one is back in use"
    );
    Ok(())
}

/// Tells the key's signer it is the key in use (so it is never deleted); off the runtime, as
/// every call to the signer.
async fn mark_in_use(key: &Arc<Key>) -> Result<(), LifecycleError> {
    let key = key.clone();
    tokio::task::spawn_blocking(move || key.mark_in_use())
        .await
        .map_err(|source| LifecycleError::Panicked {
            task: "telling the signer which key is in use",
            source,
        })?
        .map_err(LifecycleError::from)
}

/// Deletes a key made for a rotation whose request failed.
async fn discard_key(key: Arc<Key>) {
    let _ = tokio::task::spawn_blocking(move || key.destroy()).await;
}

/// A short label for the failures metric.
fn reason_label(e: &LifecycleError) -> RenewalFailure {
    match e {
        LifecycleError::Denied { .. } => RenewalFailure::Denied,
        LifecycleError::Failed { .. } => RenewalFailure::Failed,
        LifecycleError::Timeout { .. } => RenewalFailure::Timeout,
        LifecycleError::Create { .. }
        | LifecycleError::Unnamed { .. }
        | LifecycleError::Watch { .. }
        | LifecycleError::Deleted { .. }
        | LifecycleError::Client { .. } => RenewalFailure::Api,
        LifecycleError::BadIssued { .. } => RenewalFailure::BadCertificate,
        LifecycleError::NotLonger { .. } => RenewalFailure::Capped,
        LifecycleError::RefusedUpstream { .. } => RenewalFailure::RefusedUpstream,
        LifecycleError::Install { .. } => RenewalFailure::Install,
        LifecycleError::Key(_) | LifecycleError::Pki(_) => RenewalFailure::Key,
        _ => RenewalFailure::Other,
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
