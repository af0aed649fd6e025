//! Starting the proxy: open the key, bind every socket, build each component from the handles
//! it uses, run until a stop cause, drain.
//!
//! The key is opened on the calling thread, before any runtime exists (a PIN prompt or a slow
//! token never stalls a runtime). [`run`] builds every runtime itself, all multi-thread, so a
//! current-thread runtime (where `block_in_place` is impossible) cannot happen: the main runtime
//! (one worker: accept, control, admin, reload, renewal) and the connection threads
//! ([`super::threads`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use super::admin::{self, Admin};
use super::admission::Admission;
use super::bind::{self, StdBound};
use super::bridge::Bridge;
use super::control::{self, Control};
use super::error::StartError;
use super::lifetime::{self, Activity, StopReason};
use super::listener::{self, Bound, Clients, LocalTls};
use super::metrics::Metrics;
use super::relay_loop::RelayLoops;
use super::reload::{self, Reloader};
use super::renewal::{self, RenewSettings, Renewal, RenewalStatus};
use super::settings::{AdminSettings, Settings};
use super::threads::{ConnectionThreads, Spawner};
use super::upstream::{Identity, Upstream};
use super::{limits, notify, sandbox};
use crate::endpoint::ListenAddr;
use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::Key;
use crate::pki::cert;
use crate::pki::loopback_ca::LoopbackCa;
use crate::signer::remote::SignerLink;
use crate::signer::{SignerConfig, Supervisor};

/// Runs the proxy until a stop cause (signal, lock owner gone, idle), then drains and returns
/// why it stopped. Its key is served by the signer side behind `supervisor`
/// ([`signer_config`] says what it serves).
pub fn run(settings: Settings, supervisor: Supervisor) -> Result<StopReason, StartError> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let prepared = prepare(&settings, supervisor)?;
    let connections = ConnectionThreads::new(cores).map_err(StartError::Runtime)?;
    let loops = Arc::new(RelayLoops::start(cores).map_err(StartError::Runtime)?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("hwkey-proxy")
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let result = runtime.block_on(serve(
        settings,
        prepared,
        connections.spawner(),
        loops.clone(),
    ));
    runtime.shutdown_timeout(Duration::from_secs(1));
    connections.shutdown(Duration::from_secs(1));
    // The connection tasks are gone, and with them every relayed connection's task: the loops
    // close what is left.
    loops.shutdown();
    result
}

/// Everything made on the main thread before any other thread exists.
struct Prepared {
    opened: Opened,
    bound: BoundSet,
    sockets: SocketFiles,
    lock: Option<(PathBuf, std::fs::File)>,
    renew_lock: Option<crate::lifecycle::renewal_lock::LockFile>,
    sandbox: sandbox::Report,
}

/// Binds every socket, opens the lock file, greets the signer and reads the chain, the trust
/// and the loopback CA; then confines this process ([`sandbox`]) before any other thread
/// exists.
fn prepare(settings: &Settings, supervisor: Supervisor) -> Result<Prepared, StartError> {
    let mut sockets = SocketFiles::default();
    let bound = BoundSet::bind(settings, &mut sockets)?;
    let lock = match settings.lifetime.lock_file.as_ref() {
        Some(p) => Some((p.clone(), lifetime::open_lock_file(p)?)),
        None => None,
    };
    let opened = open(settings, supervisor)?;
    let renew_lock = match (&settings.renewal, &settings.key.cert) {
        (Some(_), Some(cert)) => Some(
            crate::lifecycle::renewal_lock::LockFile::open(cert).map_err(StartError::RenewLock)?,
        ),
        _ => None,
    };
    let sandbox = sandbox::confine(settings.sandbox, &sandbox_plan(settings, &bound))?;
    Ok(Prepared {
        opened,
        bound,
        sockets,
        lock,
        renew_lock,
        sandbox,
    })
}

/// What the network side may touch once confined: the system's name-resolution and CA files
/// to read; the state directory and the listeners' directories (their socket files go at the
/// stop) to write; the API servers', the forward proxies' and (when one is named, not an
/// address) DNS's ports to connect to, and UDP only then.
/// Nothing of the certificate's or the CA bundle's directories: the signer side reads those
/// files for reloads and writes a renewed certificate, so a certificate in a home directory
/// does not open `~/.ssh` or `~/.bashrc` to the network side. The secrets (PIN files, the
/// PKCS#11 module, a TPM key file) must be neither readable nor in a directory it writes
/// (checked).
fn sandbox_plan(settings: &Settings, bound: &BoundSet) -> sandbox::Plan {
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
    write.extend(bound.socket_paths().into_iter().map(|p| dir_of(&p)));
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
    sandbox::Plan {
        read,
        write,
        connect,
        dns,
        forbidden,
    }
}

/// What is opened before any runtime exists.
struct Opened {
    /// The signer, which also reads the watched files for the reloader.
    link: Arc<SignerLink>,
    identity: Identity,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    roots: rustls::RootCertStore,
    ca: LoopbackCa,
}

/// Opens the key in use (with `--rotate-key`, the one a rotation left), its chain, the
/// upstream trust and the loopback CA; refuses, in words, a key that cannot sign any handshake
/// the upstream could accept.
fn open(settings: &Settings, supervisor: Supervisor) -> Result<Opened, StartError> {
    // The key holds the link to its signer (and its restarts) for as long as it is used.
    // A signature must come within half the handshake timeout, so a stalled signer (stopped,
    // waiting for a touch, a stalled TPM) fails the request with a 502 naming it instead of
    // holding it, and a thread, for as long as the stall lasts.
    let (link, key) = SignerLink::open(supervisor, settings.upstream.handshake_timeout / 2)?;
    let key = Arc::new(key);
    let versions = crate::key::tls::protocol_versions(&key, settings.key.allow_tls12_fallback)?;
    let chain = cert::chain_for_key(&key, settings.key.cert.as_deref())?;
    cert::ensure_matches(&chain[0], &key)?;
    let resolver = Arc::new(HardwareCertResolver::new(
        HardwareSigningKey::new(key.clone()),
        chain,
    )?);
    let opened = Opened {
        link,
        identity: Identity { key, resolver },
        versions,
        roots: crate::pki::tls::root_store(settings.upstream.ca.as_deref())
            .map_err(StartError::UpstreamCa)?,
        ca: LoopbackCa::load_or_create(&settings.state_dir)?,
    };
    Ok(opened)
}

/// What the proxy's signer serves: its key (with `--rotate-key`, the one the last rotation
/// left, within the series), its identity's certificate, and the key policy. Checks that a
/// rotation can name a next key before anything starts.
pub fn signer_config(settings: &Settings) -> Result<SignerConfig, StartError> {
    let rotation = settings.renewal.as_ref().is_some_and(|r| r.rotate_key);
    if rotation {
        let uri = crate::key::rotation::current_key(&settings.key.uri, &settings.state_dir);
        crate::key::rotation::next_key_uri(&uri).map_err(StartError::RotateKey)?;
    }
    Ok(SignerConfig {
        key: settings.key.uri.clone(),
        rotation_state: rotation.then(|| settings.state_dir.path().to_path_buf()),
        cert: settings.key.cert.clone(),
        identity: None,
        upstream_ca: settings.upstream.ca.clone(),
        // TLS 1.2 is offered, and its transcripts signed, only with --allow-tls12-fallback:
        // a TLS 1.2 transcript is a much looser shape than a TLS 1.3 CertificateVerify.
        tls12: settings.key.allow_tls12_fallback,
        require_non_extractable: settings.key.require_non_extractable,
    })
}

/// The tasks of a running proxy: awaited at the stop, but the reloader, which is aborted.
struct Running {
    tasks: Vec<JoinHandle<()>>,
    reloader: JoinHandle<Result<(), StartError>>,
}

async fn serve(
    settings: Settings,
    prepared: Prepared,
    connections: Spawner,
    loops: Arc<RelayLoops>,
) -> Result<StopReason, StartError> {
    let Prepared {
        opened,
        bound,
        sockets,
        lock,
        renew_lock,
        sandbox,
    } = prepared;
    let metrics = Arc::new(Metrics::default());
    metrics.sandbox(&sandbox);
    let key = opened.identity.key.clone();
    let signer_side = opened.link.supervisor_gone()?;
    let upstream = Arc::new(Upstream::new(
        &settings.upstream,
        opened.identity,
        opened.roots,
        opened.versions,
        metrics.clone(),
    )?);
    // Bound before announcing readiness; the socket files go when `sockets` drops (any early
    // return, and the stop, before draining).
    let bound = bound.into_tokio()?;
    let activity = Arc::new(Activity::new(metrics.clone()));
    let parts = Parts {
        upstream,
        metrics,
        activity: activity.clone(),
        connections,
        loops,
        versions: opened.versions,
        ca: opened.ca,
        link: opened.link,
        renew_lock,
    };
    let (stop_tx, stop) = watch::channel(false);
    let announced = bound.addrs();
    let running = spawn(&settings, parts, bound, &stop)?;
    announce_ready(&settings, &announced, &key);
    let idle = settings.lifetime.idle_exit;
    let reason = lifetime::wait_for_stop(activity.clone(), lock, idle, signer_side).await;
    notify::stopping();
    let _ = stop_tx.send(true);
    drop(sockets);
    for t in running.tasks {
        let _ = t.await;
    }
    running.reloader.abort();
    let reason = reason?;
    drain(&activity, settings.lifetime.drain_timeout, &reason).await;
    Ok(reason)
}

/// What the components are built from.
struct Parts {
    upstream: Arc<Upstream>,
    metrics: Arc<Metrics>,
    activity: Arc<Activity>,
    connections: Spawner,
    /// The relay loops of established UNIX-socket connections.
    loops: Arc<RelayLoops>,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    ca: LoopbackCa,
    link: Arc<SignerLink>,
    renew_lock: Option<crate::lifecycle::renewal_lock::LockFile>,
}

/// Builds each component from the handles it uses and starts its task: the client accept
/// loop, the control socket, the admin listener, the renewal (`--renew`) and the reloader.
fn spawn(
    settings: &Settings,
    parts: Parts,
    bound: Listeners,
    stop: &watch::Receiver<bool>,
) -> Result<Running, StartError> {
    let addrs = bound.client_addrs();
    let clients = clients(settings, &parts, &addrs)?;
    let status = Arc::new(RenewalStatus::default());
    let admin = settings
        .admin
        .as_ref()
        .map(|section| admin_of(section, &parts, status.clone()));
    let renewal = renewal_of(settings, &parts, status);
    let reloader = Reloader {
        upstream: parts.upstream.clone(),
        metrics: parts.metrics.clone(),
        cert: settings.key.cert.clone(),
        upstream_ca: settings.upstream.ca.clone(),
        interval: settings.reload.interval,
        files: parts.link.clone(),
    };
    let control = control(settings, parts, &addrs);
    let mut tasks = vec![
        tokio::spawn(listener::accept_loop(
            Arc::new(clients),
            bound.clients,
            stop.clone(),
        )),
        tokio::spawn(control::serve(
            Arc::new(control),
            bound.control,
            stop.clone(),
        )),
    ];
    if let (Some(a), Some(admin)) = (bound.admin, admin) {
        tasks.push(tokio::spawn(admin::serve(Arc::new(admin), a, stop.clone())));
    }
    if let Some(r) = renewal {
        tasks.push(tokio::spawn(renewal::run(Arc::new(r), stop.clone())));
    }
    let reloader = tokio::spawn(reload::watch(Arc::new(reloader), stop.clone()));
    Ok(Running { tasks, reloader })
}

/// The client connections' component (and the bridge they use).
fn clients(
    settings: &Settings,
    parts: &Parts,
    bound: &[ListenAddr],
) -> Result<Clients, StartError> {
    let c = &settings.clients;
    Ok(Clients {
        awaiting: Arc::new(Semaphore::new(listener::AWAITING_ADMISSION)),
        local_tls: LocalTls::new(&parts.ca, &listener::loopback_names(bound))?,
        preauth: Admission::new(
            listener::PREAUTH_BUDGET,
            listener::PREAUTH_RESERVED,
            vec![listener::own_uid()],
            c.allow_uids.clone(),
        ),
        slots: Arc::new(Semaphore::new(limits::fit_connections(
            c.max_connections.max(1),
            parts.connections.threads() + 1,
            parts.loops.len(),
        ))),
        allowed_uids: c.allow_uids.clone(),
        handshake_timeout: c.handshake_timeout,
        metrics: parts.metrics.clone(),
        activity: parts.activity.clone(),
        connections: parts.connections.clone(),
        bridge: Bridge {
            upstream: parts.upstream.clone(),
            metrics: parts.metrics.clone(),
            idle_timeout: c.idle_timeout,
            rotation_close: c.rotation_close,
            relay_loops: Some(parts.loops.clone()),
        },
    })
}

/// The control socket's component: the loopback CA it mints with, and what it announces (the
/// first loopback TLS listener's URL and the UNIX sockets).
fn control(settings: &Settings, parts: Parts, bound: &[ListenAddr]) -> Control {
    let loopback_url = bound.iter().find_map(|a| match a {
        ListenAddr::Tcp(s) => Some(format!("https://{s}")),
        ListenAddr::Unix(_) => None,
    });
    let unix_sockets = bound
        .iter()
        .filter_map(|a| match a {
            ListenAddr::Unix(p) => Some(p.clone()),
            ListenAddr::Tcp(_) => None,
        })
        .collect();
    Control {
        ca: parts.ca,
        credential_validity: settings.clients.credential_validity,
        loopback_url,
        unix_sockets,
        allowed_uids: settings.clients.allow_uids.clone(),
        activity: parts.activity,
        metrics: parts.metrics,
        upstream: parts.upstream,
    }
}

fn admin_of(section: &AdminSettings, parts: &Parts, renewal: Arc<RenewalStatus>) -> Admin {
    Admin {
        upstream: parts.upstream.clone(),
        metrics: parts.metrics.clone(),
        health: admin::HealthState::default(),
        admission: Admission::new(
            admin::ADMIN_MAX_CONNECTIONS,
            admin::ADMIN_RESERVED,
            admin::owner_uids(),
            admin::allowed_uids(section),
        ),
        settings: section.clone(),
        renewal,
    }
}

fn renewal_of(settings: &Settings, parts: &Parts, status: Arc<RenewalStatus>) -> Option<Renewal> {
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

/// Waits for open connections to finish, at most `timeout`, and says how the proxy stopped.
async fn drain(activity: &Activity, timeout: Duration, reason: &StopReason) {
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

/// The ready line (tests and supervisors wait for it; it holds no secret), the log line and
/// systemd's READY=1.
fn announce_ready(settings: &Settings, bound: &Announced, key: &Key) {
    let listen_text: Vec<String> = bound.clients.iter().map(ToString::to_string).collect();
    let via = settings
        .upstream
        .targets
        .first()
        .and_then(|u| settings.upstream.egress.proxy_for(&u.host, u.port))
        .map(|p| format!(" via={p}"))
        .unwrap_or_default();
    let upstreams = settings.upstream_text();
    eprintln!(
        "hwkey proxy: ready: listen={} control=unix:{} admin={} upstream={}{via} key={}",
        listen_text.join(","),
        settings.state_dir.control_socket().display(),
        bound
            .admin
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "none".into()),
        upstreams,
        key.describe(),
    );
    tracing::info!(listen = %listen_text.join(","), upstream = %upstreams, "proxy ready");
    notify::ready();
}

/// Every socket the proxy listens on, bound before any thread exists.
struct BoundSet {
    clients: Vec<StdBound>,
    control: std::os::unix::net::UnixListener,
    admin: Option<StdBound>,
}

/// The same sockets, in the runtime.
struct Listeners {
    clients: Vec<Bound>,
    control: tokio::net::UnixListener,
    admin: Option<Bound>,
}

/// What the ready line names.
struct Announced {
    clients: Vec<ListenAddr>,
    admin: Option<ListenAddr>,
}

impl BoundSet {
    fn bind(settings: &Settings, sockets: &mut SocketFiles) -> Result<BoundSet, StartError> {
        let unsafe_listen = settings.clients.unsafe_listen;
        // Another user allowed (root needs no file permission): the sockets admit by peer uid.
        let me = crate::state_dir::own_uid();
        let others = |uids: &[u32]| uids.iter().any(|&u| u != me && u != 0);
        let mut clients = Vec::new();
        for addr in &settings.clients.listen {
            let shared = others(&settings.clients.allow_uids);
            clients.push(sockets.track(bind::bind(addr, unsafe_listen, shared)?));
        }
        // The control socket hands out loopback credentials: the proxy's own user's alone, in
        // its private state directory.
        let control_path = settings.state_dir.control_socket();
        let control = bind::bind_unix(&control_path, 0o600)?;
        sockets.0.push(control_path);
        let admin = match &settings.admin {
            Some(a) => {
                // As its peer check: the admin UNIX socket admits the proxy's own uids alone.
                let shared = others(&a.allow_uids);
                Some(sockets.track(bind::bind(&a.listen, unsafe_listen, shared)?))
            }
            None => None,
        };
        Ok(BoundSet {
            clients,
            control,
            admin,
        })
    }

    /// The UNIX socket files of the client and admin listeners.
    fn socket_paths(&self) -> Vec<PathBuf> {
        self.clients
            .iter()
            .chain(self.admin.iter())
            .filter_map(|b| b.socket_path().map(std::path::Path::to_path_buf))
            .collect()
    }

    /// The listeners for the runtime this is called in.
    fn into_tokio(self) -> Result<Listeners, StartError> {
        let control_addr = ListenAddr::Unix(PathBuf::new());
        self.control
            .set_nonblocking(true)
            .map_err(|source| StartError::Bind {
                addr: control_addr.clone(),
                source,
            })?;
        Ok(Listeners {
            clients: self
                .clients
                .into_iter()
                .map(StdBound::into_tokio)
                .collect::<Result<_, _>>()?,
            control: tokio::net::UnixListener::from_std(self.control).map_err(|source| {
                StartError::Bind {
                    addr: control_addr,
                    source,
                }
            })?,
            admin: self.admin.map(StdBound::into_tokio).transpose()?,
        })
    }
}

impl Listeners {
    /// The client listeners' addresses (ports resolved).
    fn client_addrs(&self) -> Vec<ListenAddr> {
        self.clients.iter().map(Bound::addr).collect()
    }

    fn addrs(&self) -> Announced {
        Announced {
            clients: self.client_addrs(),
            admin: self.admin.as_ref().map(Bound::addr),
        }
    }
}

/// The UNIX socket files the proxy created, removed when this is dropped (so no exit path
/// leaves a socket file that nobody answers on).
#[derive(Default)]
struct SocketFiles(Vec<PathBuf>);

impl SocketFiles {
    /// Remembers `bound`'s socket file, if it has one.
    fn track(&mut self, bound: StdBound) -> StdBound {
        if let Some(p) = bound.socket_path() {
            self.0.push(p.to_path_buf());
        }
        bound
    }
}

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
