//! Starting the proxy, in order: bind every socket, open the key (on the calling thread, before
//! any runtime exists, so a PIN prompt or a slow token never stalls one), confine, build each
//! component (each builds itself from its settings section and the shared [`Parts`]), run until
//! a stop cause, drain. [`run`] builds every runtime itself, all multi-thread (no current-thread
//! runtime, where `block_in_place` is impossible): the main one (one worker: accept, control,
//! admin, reload, renewal) and the connection threads ([`super::threads`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::admin::{self, Admin};
use super::control::{self, Control};
use super::error::StartError;
use super::lifetime::{self, Activity, StopReason};
use super::listener::Clients;
use super::metrics::Metrics;
use super::opened::Opened;
use super::parts::Parts;
use super::relay_loop::RelayLoops;
use super::reload::{self, Reloader};
use super::renewal::{self, Renewal, RenewalStatus};
use super::sandbox_plan::sandbox_plan;
use super::settings::Settings;
use super::sockets::{BoundSet, Listeners, SocketFiles};
use super::threads::{ConnectionThreads, Spawner};
use super::upstream::Upstream;
use super::{notify, sandbox, unix_open};
use crate::lifecycle::renewal_lock::LockFile;
use crate::signer::Supervisor;

/// Runs the proxy until a stop cause (signal, lock owner gone, idle), then drains and returns
/// why it stopped. Its key is served by the signer side behind `supervisor`
/// ([`crate::signer::SignerConfig::for_proxy`] says what it serves).
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
    // The loops end the connections still relayed, each giving back what it held.
    loops.shutdown();
    result
}

/// Everything made on the main thread before any other thread exists.
struct Prepared {
    opened: Opened,
    bound: BoundSet,
    sockets: SocketFiles,
    lock: Option<(PathBuf, std::fs::File)>,
    renew_lock: Option<LockFile>,
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
    let opened = Opened::open(settings, supervisor)?;
    let renew_lock = match (&settings.renewal, &settings.key.cert) {
        (Some(_), Some(cert)) => Some(LockFile::open(cert).map_err(StartError::RenewLock)?),
        _ => None,
    };
    let plan = sandbox_plan(settings, &bound.socket_paths());
    let sandbox = sandbox::confine(settings.sandbox, &plan)?;
    Ok(Prepared {
        opened,
        bound,
        sockets,
        lock,
        renew_lock,
        sandbox,
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
    let (identity, roots) = (opened.identity, opened.roots);
    let upstream = Upstream::new(
        &settings.upstream,
        identity,
        roots,
        opened.versions,
        metrics.clone(),
    )?;
    // Bound before readiness; the socket files go when `sockets` drops (early return, stop).
    let bound = bound.into_tokio()?;
    let activity = Arc::new(Activity::new(metrics.clone()));
    let parts = Parts {
        upstream: Arc::new(upstream),
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
    notify::announce_ready(&settings, &announced, &key);
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
    lifetime::drain_and_report(&activity, settings.lifetime.drain_timeout, &reason).await;
    Ok(reason)
}

/// Builds each component and starts its task: the client accept loop, the control socket, the
/// admin listener, the renewal (`--renew`) and the reloader.
fn spawn(
    settings: &Settings,
    parts: Parts,
    bound: Listeners,
    stop: &watch::Receiver<bool>,
) -> Result<Running, StartError> {
    let addrs = bound.client_addrs();
    let clients = Clients::build(&settings.clients, &parts, &addrs)?;
    let retire = clients.bridge.retirements(stop.clone()).map(tokio::spawn);
    let status = Arc::new(RenewalStatus::default());
    let admin = (settings.admin.as_ref()).map(|a| Admin::build(a, &parts, status.clone()));
    let renewal = Renewal::build(settings, &parts, status);
    let reloader = Reloader::build(settings, &parts);
    let control = Control::build(&settings.clients, parts, &addrs);
    let mut tasks = vec![
        tokio::spawn(unix_open::accept(
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
    tasks.extend(retire);
    let reloader = tokio::spawn(reload::watch(Arc::new(reloader), stop.clone()));
    Ok(Running { tasks, reloader })
}
