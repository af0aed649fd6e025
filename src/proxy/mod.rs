//! `hwkey proxy`: the TLS-offload proxy that lets vanilla kubectl and kubelet use a hardware
//! key. Local clients connect over loopback TLS or a UNIX socket; each connection is
//! re-originated to the API server over mTLS whose CertificateVerify is signed inside the
//! PKCS#11 token or TPM, then bytes are copied both ways (no HTTP parsing).
//!
//! Connection path (one task per connection, on one of the connection threads of
//! [`threads`]: a single-worker runtime per core, so a request wakes no other thread):
//! 1. [`listener`]: accept; authenticate the local peer (loopback-CA client certificate, or
//!    the UNIX peer's uid) and pick the application protocol. A peer that fails stops here.
//! 2. [`upstream`]: TCP + TLS to the API server offering that protocol, resuming a TLS 1.3
//!    session when one is cached (no hardware signature), else a full handshake whose
//!    signature runs under `block_in_place` on the task's connection thread.
//! 3. [`bridge`]: `copy_bidirectional` until both sides close (or the idle timeout).
//!
//! Other tasks, on the main runtime (one worker): one accept loop for the client listeners,
//! [`control`] (loopback credentials), [`admin`] (`/healthz`, `/metrics`), [`reload`] (SIGHUP,
//! file changes) and [`renewal`] (`--renew`); the main task (on the thread that called [`run`])
//! waits in [`lifetime`] for a stop cause, then drains. Blocking work (opening the key, test
//! signatures, reading a chain stored on the token) never runs on a runtime worker without
//! `block_in_place` or `spawn_blocking`; [`run`] builds every runtime itself, all multi-thread,
//! so that a current-thread runtime (where `block_in_place` is impossible) cannot happen.

pub mod admin;
pub mod admission;
pub mod bridge;
pub mod buffers;
pub mod config;
pub mod control;
mod endpoints;
mod failure;
pub mod lifetime;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod notify;
pub mod ratelimit;
pub mod readahead;
pub mod relay;
pub mod reload;
pub mod renewal;
pub mod rotation;
pub mod sessions;
pub mod threads;
pub mod upstream;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Semaphore};

pub use config::{FileConfig, ListenAddr, UpstreamTarget};
pub use lifetime::StopReason;

use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::{Key, KeyError, KeyUri};
use crate::pki::{cert, PkiError};

/// Default `--handshake-timeout`: local plus upstream handshake, each.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `--drain-timeout`.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default `--reload-interval` (how often the cert file is compared).
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Everything the proxy needs, parsed and typed.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The hardware key that signs upstream handshakes.
    pub key: KeyUri,
    /// Certificate chain file; None: the chain stored with the key.
    pub cert: Option<PathBuf>,
    /// The API servers (at least one): new connections go round robin to those that are up
    /// ([`endpoints`]).
    pub upstreams: Vec<UpstreamTarget>,
    /// CA bundle for the upstream's certificate; None: the system roots.
    pub upstream_ca: Option<PathBuf>,
    /// How connections reach the upstream: directly or through a forward proxy.
    pub egress: crate::egress::Egress,
    /// The TLS 1.3 key exchange offered upstream (hybrid post-quantum first by default).
    pub key_exchange: crate::pki::tls::KeyExchange,
    /// Name to verify the upstream certificate against (default: the upstream host).
    pub tls_server_name: Option<String>,
    /// Client listeners (at least one).
    pub listen: Vec<ListenAddr>,
    /// The /healthz and /metrics listener.
    pub admin: Option<ListenAddr>,
    /// Holds the loopback CA and the control socket.
    pub state_dir: crate::state_dir::StateDir,
    /// Exit when the holder of an flock on this file goes away.
    pub lock_file: Option<PathBuf>,
    /// Exit after this long without clients.
    pub idle_exit: Option<Duration>,
    /// Limit for the local and for the upstream handshake, each.
    pub handshake_timeout: Duration,
    /// Close a bridged connection after this long without a byte either way (None: never).
    pub idle_timeout: Option<Duration>,
    /// On SIGTERM, how long open connections may take to finish.
    pub drain_timeout: Duration,
    /// Most client connections open at once (lowered to fit the descriptor limit).
    pub max_connections: usize,
    /// UNIX-socket peers allowed besides the proxy's own uid.
    pub allow_uids: Vec<u32>,
    /// Allow non-loopback TCP listeners.
    pub unsafe_listen: bool,
    /// Let a PKCS#1-only RSA key connect upstream over TLS 1.2 (see
    /// [`crate::key::tls::protocol_versions`]).
    pub allow_tls12_fallback: bool,
    /// Default lifetime of loopback credentials.
    pub credential_validity: Duration,
    /// How often the certificate file is checked for changes.
    pub reload_interval: Duration,
    /// Refuse a key the device says could leave it (`--require-non-extractable`).
    pub require_non_extractable: bool,
    /// Renew the certificate through the CSR API before it expires (`--renew`).
    pub renew: bool,
    /// When connections opened with a replaced certificate are closed.
    pub rotation_close: rotation::RotationClose,
    /// With `renew`: a fresh hardware key per renewal, the previous one deleted once the new
    /// one is in use (`--rotate-key`).
    pub rotate_key: bool,
    /// With `renew`: the persistent handle of the TPM attestation key whose TPM2_Certify
    /// evidence each renewal request carries (`--attest`), None for no evidence.
    pub attest: Option<u32>,
}

/// Errors of the proxy layer, each saying what to fix.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum ProxyError {
    #[error(transparent)]
    Endpoint(#[from] crate::endpoint::EndpointError),

    #[error("refusing to listen on {addr}: it is not a loopback address and the local hop would be exposed; pass --unsafe-listen if you really mean it")]
    NonLoopbackListen { addr: ListenAddr },

    #[error("no --listen address given: add e.g. --listen unix:/run/hwkey/proxy.sock or --listen tcp:127.0.0.1:6443")]
    NoListener,

    #[error("no --upstream given: the API server URL, e.g. https://10.0.0.1:6443")]
    NoUpstream,

    #[error("no --key given: the hardware key URI (pkcs11:… or tpm:…)")]
    NoKey,

    #[error("invalid --tls-server-name '{given}': not a DNS name or IP address")]
    InvalidServerName { given: String },

    #[error(transparent)]
    Duration(#[from] crate::duration::InvalidDuration),

    #[error("--attest needs --renew: the evidence goes into the renewal requests")]
    AttestNeedsRenew,

    #[error("--attest needs a TPM key (tpm:…): only a TPM can certify that the key lives in it; drop --attest for PKCS#11 keys")]
    AttestNeedsTpm,

    #[error("--rotate-key needs --renew: keys are rotated when the certificate is renewed")]
    RotateKeyNeedsRenew,

    #[error("--rotate-key: {0}")]
    RotateKey(String),

    #[error("{what} must be more than 0 (e.g. 10s)")]
    ZeroDuration { what: &'static str },

    #[error("{what} = {given} cannot work: use {range}")]
    OutOfRange {
        what: &'static str,
        given: String,
        range: String,
    },

    #[error("cannot read config file {path}: {source}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid config file {path}: {problem}")]
    BadConfig {
        path: PathBuf,
        #[source]
        problem: Box<config::ConfigProblem>,
    },

    #[error("cannot set up the loopback TLS listener: {0}")]
    LocalTls(String),

    #[error("cannot read the upstream CA bundle: {0}")]
    UpstreamCa(#[source] crate::pki::PkiError),

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

    #[error("cannot connect to the upstream {addr}: {source}")]
    UpstreamConnect {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot reach the upstream {addr}: {source}")]
    UpstreamVia {
        addr: String,
        #[source]
        source: crate::egress::EgressError,
    },

    #[error("TLS handshake with the upstream {addr} failed: {}", crate::error_chain::error_chain(.source))]
    UpstreamHandshake {
        addr: String,
        #[source]
        source: std::io::Error,
    },

    #[error("TLS handshake with the upstream {addr} failed: {source}")]
    UpstreamTls {
        addr: String,
        #[source]
        source: crate::pki::PkiError,
    },

    #[error("the upstream {addr} did not agree to protocol '{asked}' (answered with {got})")]
    UpstreamAlpn {
        addr: String,
        asked: String,
        got: String,
    },

    #[error("the upstream {addr} did not complete a handshake within {after:?}")]
    UpstreamTimeout { addr: String, after: Duration },

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

    #[error(transparent)]
    Key(#[from] KeyError),

    #[error(transparent)]
    Pki(#[from] PkiError),
}

/// What every task of a running proxy shares.
pub struct Shared {
    /// The hardware key in use (replaced by `--rotate-key`; see [`Shared::key`]).
    key: std::sync::RwLock<Arc<Key>>,
    pub(crate) upstream: upstream::Upstream,
    pub(crate) local_tls: listener::LocalTls,
    pub(crate) ca: crate::pki::loopback_ca::LoopbackCa,
    pub(crate) metrics: Arc<metrics::Metrics>,
    pub(crate) activity: Arc<lifetime::Activity>,
    pub(crate) health: admin::HealthState,
    pub(crate) slots: Arc<Semaphore>,
    /// Unauthenticated loopback TLS handshakes in flight, admitted by uid
    /// ([`listener::PREAUTH_BUDGET`], [`admission`]).
    pub(crate) preauth: Arc<admission::Admission>,
    /// Admin connections in flight, admitted by uid ([`admin::ADMIN_MAX_CONNECTIONS`]).
    pub(crate) admin_admission: Arc<admission::Admission>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) allowed_uids: Vec<u32>,
    pub(crate) credential_validity: Duration,
    pub(crate) loopback_url: Option<String>,
    pub(crate) unix_sockets: Vec<PathBuf>,
    /// The certificate generation in use and its NotAfter (see [`rotation`]).
    pub(crate) epoch: watch::Sender<rotation::CertEpoch>,
    pub(crate) rotation_close: rotation::RotationClose,
    /// The last renewal failure (`--renew`), cleared by a success: `/healthz` reports
    /// "degraded" when the certificate is also past 90 % of its lifetime.
    pub(crate) renewal_error: std::sync::Mutex<Option<String>>,
    /// Where connection tasks run ([`threads`]).
    pub(crate) connections: threads::Spawner,
}

impl Shared {
    /// The hardware key in use now.
    pub(crate) fn key(&self) -> Arc<Key> {
        self.key.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Switches to another key and its chain (`--rotate-key`): new upstream connections sign
    /// with it at once; connections opened before end per `--rotation-close`.
    pub(crate) fn install_key(
        &self,
        key: Arc<Key>,
        chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    ) -> Result<(), KeyError> {
        self.upstream
            .resolver()
            .replace_key(HardwareSigningKey::new(key.clone()), chain.clone())?;
        *self.key.write().unwrap_or_else(|p| p.into_inner()) = key;
        self.upstream.reset_sessions();
        rotation::advance(&self.epoch, &chain);
        self.metrics.certificate(rotation::not_after_unix(&chain));
        Ok(())
    }

    /// Installs a chain for new upstream connections: the resolver's chain, an empty session
    /// store (no resumed session presents the old certificate), a new epoch (connections opened
    /// before end per `--rotation-close`), and the certificate metrics.
    pub(crate) fn install_chain(
        &self,
        chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    ) -> Result<(), KeyError> {
        self.upstream.resolver().replace_chain(chain.clone())?;
        self.upstream.reset_sessions();
        rotation::advance(&self.epoch, &chain);
        self.metrics.certificate(rotation::not_after_unix(&chain));
        Ok(())
    }
}

/// Runs the proxy until a stop cause (signal, lock owner gone, idle), then drains and returns
/// why it stopped. Opens the key first, on the calling thread; builds its own runtimes (the main
/// one and the connection threads).
pub fn run(config: ProxyConfig) -> Result<StopReason, ProxyError> {
    if config.listen.is_empty() {
        return Err(ProxyError::NoListener);
    }
    for addr in config.listen.iter().chain(config.admin.iter()) {
        if !addr.is_local() && !config.unsafe_listen {
            return Err(ProxyError::NonLoopbackListen { addr: addr.clone() });
        }
    }
    if config.rotate_key && !config.renew {
        return Err(ProxyError::RotateKeyNeedsRenew);
    }
    if config.attest.is_some() && !config.renew {
        return Err(ProxyError::AttestNeedsRenew);
    }
    if config.attest.is_some() && !matches!(config.key, crate::key::KeyUri::Tpm(_)) {
        return Err(ProxyError::AttestNeedsTpm);
    }
    let mut config = config;
    if config.rotate_key {
        config.key = renewal::current_key(&config.key, &config.state_dir);
        renewal::next_key_uri(&config.key).map_err(|e| ProxyError::RotateKey(e.to_string()))?;
    }
    let key = Arc::new(Key::open(&config.key)?);
    key.require_non_extractable(config.require_non_extractable)?;
    // Refuse now, in words, a key that cannot sign any handshake the upstream could accept.
    let versions = crate::key::tls::protocol_versions(&key, config.allow_tls12_fallback)?;
    let chain = cert::chain_for_key(&key, config.cert.as_deref())?;
    cert::ensure_matches(&chain[0], &key)?;
    let resolver = Arc::new(HardwareCertResolver::new(
        HardwareSigningKey::new(key.clone()),
        chain,
    )?);
    let roots = crate::pki::tls::root_store(config.upstream_ca.as_deref())
        .map_err(ProxyError::UpstreamCa)?;
    let ca = crate::pki::loopback_ca::LoopbackCa::load_or_create(&config.state_dir)?;
    // Connections run on one single-worker runtime per core ([`threads`]); the main runtime
    // accepts, and serves the control socket, the admin listener, renewal and reloads.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let connections = threads::ConnectionThreads::new(cores).map_err(ProxyError::Runtime)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("hwkey-proxy")
        .enable_all()
        .build()
        .map_err(ProxyError::Runtime)?;
    let started = Started {
        key,
        resolver,
        roots,
        ca,
        versions,
        connections: connections.spawner(),
    };
    let result = runtime.block_on(serve(config, started));
    runtime.shutdown_timeout(Duration::from_secs(1));
    connections.shutdown(Duration::from_secs(1));
    result
}

impl ProxyConfig {
    /// The API servers, comma-separated (for messages).
    pub fn upstream_text(&self) -> String {
        self.upstreams
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Where the upstream is and how connections get there.
    fn route(&self) -> upstream::Route {
        upstream::Route {
            targets: self.upstreams.clone(),
            egress: self.egress.clone(),
            key_exchange: self.key_exchange,
            attempt_timeout: self.handshake_timeout,
        }
    }
}

/// What [`run`] opened and built before the main runtime starts.
struct Started {
    key: Arc<Key>,
    resolver: Arc<HardwareCertResolver>,
    roots: rustls::RootCertStore,
    ca: crate::pki::loopback_ca::LoopbackCa,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    connections: threads::Spawner,
}

async fn serve(config: ProxyConfig, started: Started) -> Result<StopReason, ProxyError> {
    let Started {
        key,
        resolver,
        roots,
        ca,
        versions,
        connections,
    } = started;
    let metrics = Arc::new(metrics::Metrics::default());
    let first_chain = resolver.chain();
    metrics.certificate(rotation::not_after_unix(&first_chain));
    let epoch = rotation::first(&first_chain);
    let upstream = upstream::Upstream::new(
        config.route(),
        config.tls_server_name.as_deref(),
        resolver,
        roots,
        versions,
        metrics.clone(),
    )?;

    // Bind everything before announcing readiness. The socket files are removed when `sockets`
    // is dropped: on any early return below, and at the stop, before draining.
    let mut sockets = SocketFiles::default();
    let (listeners, control, admin) = bind_all(&config, &mut sockets)?;
    let bound_addrs: Vec<ListenAddr> = listeners.iter().map(listener::Bound::addr).collect();
    let local_tls = listener::LocalTls::new(&ca, &config::loopback_names(&bound_addrs))?;
    let activity = Arc::new(lifetime::Activity::new(metrics.clone()));
    let shared = Arc::new(shared_state(
        &config,
        Parts {
            key: key.clone(),
            upstream,
            local_tls,
            ca,
            metrics,
            activity: activity.clone(),
            bound: &bound_addrs,
            epoch,
            connections,
        },
    ));

    let (stop_tx, stop_rx) = watch::channel(false);
    let admin_addr = admin.as_ref().map(listener::Bound::addr);
    let (tasks, reloader) = spawn_tasks(
        &shared,
        &config,
        (listeners, control, admin),
        versions,
        &stop_rx,
    );

    let lock = match config
        .lock_file
        .as_ref()
        .map(|p| (p, lifetime::open_lock_file(p)))
    {
        Some((p, Ok(f))) => Some((p.clone(), f)),
        Some((_, Err(e))) => {
            let _ = stop_tx.send(true);
            return Err(e);
        }
        None => None,
    };
    announce_ready(&config, &bound_addrs, admin_addr, &key);

    let reason = lifetime::wait_for_stop(activity.clone(), lock, config.idle_exit).await;
    notify::stopping();
    let _ = stop_tx.send(true);
    drop(sockets);
    for t in tasks {
        let _ = t.await;
    }
    reloader.abort();
    let reason = reason?;
    drain(&activity, config.drain_timeout, &reason).await;
    Ok(reason)
}

/// Waits for open connections to finish, at most `timeout`, and says how the proxy stopped.
async fn drain(activity: &lifetime::Activity, timeout: Duration, reason: &StopReason) {
    tracing::info!(%reason, open = activity.open(), "stopping: draining open connections");
    if lifetime::drain(activity, timeout).await {
        eprintln!("hwkey proxy: stopped ({reason})");
    } else {
        eprintln!(
            "hwkey proxy: stopped ({reason}); {} connection(s) still open after {timeout:?} were closed",
            activity.open(),
        );
    }
}

/// Starts the listeners' accept loops, the control socket, the admin listener, the renewal
/// (with `--renew`) and the certificate reloader (returned apart: it is aborted, not awaited).
fn spawn_tasks(
    shared: &Arc<Shared>,
    config: &ProxyConfig,
    (listeners, control, admin): BoundSet,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    stop: &watch::Receiver<bool>,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    tokio::task::JoinHandle<Result<(), ProxyError>>,
) {
    let mut tasks = vec![
        tokio::spawn(listener::accept_loop(
            shared.clone(),
            listeners,
            stop.clone(),
        )),
        tokio::spawn(control::serve(shared.clone(), control, stop.clone())),
    ];
    if let Some(a) = admin {
        tasks.push(tokio::spawn(admin::serve(shared.clone(), a, stop.clone())));
    }
    if config.renew {
        tasks.push(tokio::spawn(renewal::run(
            shared.clone(),
            renew_settings(config, versions),
            stop.clone(),
        )));
    }
    let reloader = tokio::spawn(reload::watch(
        shared.clone(),
        reload::Watched {
            cert: config.cert.clone(),
            upstream_ca: config.upstream_ca.clone(),
        },
        config.reload_interval,
        stop.clone(),
    ));
    (tasks, reloader)
}

/// What [`serve`] made before the shared state exists.
struct Parts<'a> {
    key: Arc<Key>,
    upstream: upstream::Upstream,
    local_tls: listener::LocalTls,
    ca: crate::pki::loopback_ca::LoopbackCa,
    metrics: Arc<metrics::Metrics>,
    activity: Arc<lifetime::Activity>,
    bound: &'a [ListenAddr],
    epoch: watch::Sender<rotation::CertEpoch>,
    connections: threads::Spawner,
}

/// The state every task of the proxy shares.
fn shared_state(config: &ProxyConfig, parts: Parts<'_>) -> Shared {
    Shared {
        key: std::sync::RwLock::new(parts.key),
        upstream: parts.upstream,
        local_tls: parts.local_tls,
        ca: parts.ca,
        metrics: parts.metrics,
        activity: parts.activity,
        health: admin::HealthState::default(),
        slots: Arc::new(Semaphore::new(limits::fit_connections(
            config.max_connections.max(1),
            parts.connections.threads() + 1,
        ))),
        preauth: admission::Admission::new(
            listener::PREAUTH_BUDGET,
            listener::PREAUTH_RESERVED,
            privileged_uids(&config.allow_uids),
        ),
        admin_admission: admission::Admission::new(
            admin::ADMIN_MAX_CONNECTIONS,
            admin::ADMIN_RESERVED,
            privileged_uids(&config.allow_uids),
        ),
        handshake_timeout: config.handshake_timeout,
        idle_timeout: config.idle_timeout.filter(|d| !d.is_zero()),
        allowed_uids: config.allow_uids.clone(),
        credential_validity: config.credential_validity,
        loopback_url: parts.bound.iter().find_map(|a| match a {
            ListenAddr::Tcp(s) => Some(format!("https://{s}")),
            ListenAddr::Unix(_) => None,
        }),
        unix_sockets: parts
            .bound
            .iter()
            .filter_map(|a| match a {
                ListenAddr::Unix(p) => Some(p.clone()),
                ListenAddr::Tcp(_) => None,
            })
            .collect(),
        epoch: parts.epoch,
        rotation_close: config.rotation_close,
        renewal_error: std::sync::Mutex::new(None),
        connections: parts.connections,
    }
}

/// What the renewal task needs from the proxy's settings.
fn renew_settings(
    config: &ProxyConfig,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
) -> renewal::RenewSettings {
    renewal::RenewSettings {
        key: config.key.clone(),
        cert: config.cert.clone(),
        // The first API server; the others serve the proxied traffic just the same.
        server: config
            .upstreams
            .first()
            .map(|u| format!("https://{}", u.authority()))
            .unwrap_or_default(),
        upstream_ca: config.upstream_ca.clone(),
        tls_server_name: config.tls_server_name.clone(),
        versions,
        rotate_key: config.rotate_key,
        attest: config.attest,
        state_dir: config.state_dir.clone(),
    }
}

/// The ready line (tests and supervisors wait for it; it holds no secret), the log line and
/// systemd's READY=1.
fn announce_ready(
    config: &ProxyConfig,
    bound: &[ListenAddr],
    admin: Option<ListenAddr>,
    key: &Key,
) {
    let listen_text: Vec<String> = bound.iter().map(ToString::to_string).collect();
    let via = config
        .upstreams
        .first()
        .and_then(|u| config.egress.proxy_for(&u.host, u.port))
        .map(|p| format!(" via={p}"))
        .unwrap_or_default();
    let upstreams = config.upstream_text();
    eprintln!(
        "hwkey proxy: ready: listen={} control=unix:{} admin={} upstream={}{via} key={}",
        listen_text.join(","),
        config.state_dir.control_socket().display(),
        admin
            .map(|a| a.to_string())
            .unwrap_or_else(|| "none".into()),
        upstreams,
        key.describe(),
    );
    tracing::info!(listen = %listen_text.join(","), upstream = %upstreams, "proxy ready");
    notify::ready();
}

type BoundSet = (
    Vec<listener::Bound>,
    tokio::net::UnixListener,
    Option<listener::Bound>,
);

fn bind_all(config: &ProxyConfig, sockets: &mut SocketFiles) -> Result<BoundSet, ProxyError> {
    let mut listeners = Vec::new();
    for addr in &config.listen {
        let b = listener::bind(addr, config.unsafe_listen)?;
        if let Some(p) = b.socket_path() {
            sockets.0.push(p.to_path_buf());
        }
        listeners.push(b);
    }
    let control_path = config.state_dir.control_socket();
    let control = listener::bind_unix(&control_path)?;
    sockets.0.push(control_path);
    let admin = match &config.admin {
        Some(a) => {
            let b = listener::bind(a, config.unsafe_listen)?;
            if let Some(p) = b.socket_path() {
                sockets.0.push(p.to_path_buf());
            }
            Some(b)
        }
        None => None,
    };
    Ok((listeners, control, admin))
}

/// The UNIX socket files the proxy created, removed when this is dropped (so no exit path
/// leaves a socket file that nobody answers on).
#[derive(Default)]
struct SocketFiles(Vec<PathBuf>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Err(e) = std::fs::remove_file(p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove socket");
                }
            }
        }
    }
}

/// The proxy's own uid and the `--allow-uid` ones: never turned away by other uids' floods.
fn privileged_uids(allowed: &[u32]) -> Vec<u32> {
    let mut uids = vec![listener::own_uid()];
    uids.extend_from_slice(allowed);
    uids
}
