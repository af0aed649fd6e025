//! The registered nodes, from a directory or a ConfigMap: what the source holds now decides.
//!
//! - **Content decides.** A source that can be read holds the trust, whatever it holds: every
//!   usable entry is trusted, malformed ones are skipped and reported (a warning, the
//!   `hwkey_approver_trust_invalid_entries` gauge and, for a ConfigMap, a Warning Event), and a
//!   source with no usable entry trusts nobody (reported too). Removing every node takes
//!   effect like removing one.
//! - **A source that cannot be read is not an answer.** A ConfigMap that is missing (deleted,
//!   about to be re-created) or a directory that cannot be read leaves the trust *unavailable*:
//!   requests that need it wait and are retried, none is denied for it.
//! - **Approvals use a fresh reading.** The source is followed (a ConfigMap through kube's
//!   watcher, a directory checked every second) and read again every 30 s, but a watch can die
//!   silently; so before approving, the approver reads the source again unless it was read in
//!   the last [`FRESH_FOR`] ([`Trust::refresh`]). A removed node is never approved once its
//!   removal is in the API server (a mounted ConfigMap directory lags the ConfigMap by the
//!   kubelet's sync, about a minute: docs/ATTESTATION.md).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Event, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::runtime::{watcher, WatchStreamExt};

use super::metrics::ApproverMetrics;
use crate::pki::registration::{self, RegisteredAk, TrustRead};

/// How long a reading of the source is fresh enough to approve on.
pub const FRESH_FOR: Duration = Duration::from_secs(2);

/// How long one reading may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the source is read again whatever its watch says.
const RESYNC: Duration = Duration::from_secs(30);

/// How often a trust directory is checked for changes.
const DIR_POLL: Duration = Duration::from_secs(1);

/// The registered nodes could not be read from a source.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the registered nodes from {origin}: {problem}")]
pub struct TrustError {
    /// The source, as its flag names it.
    pub origin: String,
    /// What went wrong.
    #[source]
    pub problem: TrustProblem,
}

/// Why the registered nodes could not be read, for [`TrustError`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum TrustProblem {
    #[error("the reading task failed: {0}")]
    Panicked(#[source] tokio::task::JoinError),
    #[error("it does not exist: create it with `kubectl -n {namespace} create configmap {name} --from-file=TRUST_DIR`")]
    Missing { namespace: String, name: String },
    #[error("{0}")]
    Api(#[source] kube::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Dir(#[source] crate::pki::PkiError),
}

/// Where the registered nodes are kept: each entry is named after a node and holds what
/// `hwkey attest enroll` printed for it (or what `hwkey attest register` wrote).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrustSource {
    /// One file per node (`--trust DIR`; also a mounted ConfigMap).
    Dir(PathBuf),
    /// One entry per node in a ConfigMap (`--trust-configmap NAMESPACE/NAME`), watched through
    /// the API.
    ConfigMap {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// A binding that could not be written to the trust source.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum RecordError {
    #[error("the trust is {0}, which the approver does not write: TPMs that join by their EK certificate need --trust-configmap")]
    NotAConfigMap(String),
    #[error("{source}{}", api_hint(source))]
    Api {
        #[source]
        source: kube::Error,
    },
    #[error("no answer {1} the trust ConfigMap within {0:?}")]
    Timeout(Duration, &'static str),
    #[error("the trust changed since the decision: {0}")]
    Changed(super::reason::Violation),
}

/// What to do about an API error writing a binding.
fn api_hint(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) if s.code == 403 => " (the approver's account needs get and update on its trust ConfigMap: see deploy/approver-ek.yaml)",
        kube::Error::Api(s) if s.code == 409 => " (it changed meanwhile: the request is decided again on what it holds now)",
        kube::Error::Api(s) if s.code == 413 || s.code == 422 => " (the ConfigMap is full: a ConfigMap holds 1 MiB, about 1,000 bindings; remove the entries of nodes that are gone)",
        _ => "",
    }
}

/// A `--trust-configmap` that is not `NAMESPACE/NAME`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not NAMESPACE/NAME (example: hwkey-system/hwkey-approver-trust)")]
pub struct NotNamespaceName(pub String);

impl TrustSource {
    /// Parses `NAMESPACE/NAME`.
    pub fn config_map(spec: &str) -> Result<TrustSource, NotNamespaceName> {
        match spec.split_once('/') {
            Some((namespace, name))
                if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
            {
                Ok(TrustSource::ConfigMap {
                    namespace: namespace.into(),
                    name: name.into(),
                })
            }
            _ => Err(NotNamespaceName(spec.to_string())),
        }
    }
}

impl std::fmt::Display for TrustSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrustSource::Dir(p) => write!(f, "{}", p.display()),
            TrustSource::ConfigMap { namespace, name } => {
                write!(f, "ConfigMap {namespace}/{name}")
            }
        }
    }
}

/// What a source holds: the registered AKs (per node, or per user for the people policy) and,
/// for the people policy, its allow list's text.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    /// The usable registrations.
    pub aks: Vec<RegisteredAk>,
    /// People's registered PIV devices.
    pub piv: Vec<crate::pki::registration::RegisteredPiv>,
    /// The `_allow` entry's text, if any.
    pub allow: Option<String>,
    /// What a node trust holds for TPMs that join by their EK certificate.
    pub ek: crate::pki::registration::EkEntries,
    /// The names of the entries skipped as malformed (each still holds its node name).
    pub invalid: Vec<String>,
}

/// Whose registrations a source holds: it decides the words and the metrics of a reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrustKind {
    /// Nodes (`--trust`, `--trust-configmap`): the node metrics follow it.
    Nodes,
    /// People (`--people-trust`, `--people-trust-configmap`): an allow list and AKs per user.
    People,
}

/// The trust as the approver knows it now.
#[derive(Debug, Clone)]
pub enum TrustNow {
    /// What the source holds (possibly nothing), and when it was read.
    Known {
        /// The usable registrations and the allow list.
        registry: Arc<Registry>,
        /// When the source was last read (or its watch reported it).
        read_at: Instant,
    },
    /// The source could not be read: decisions that need it wait.
    Unavailable,
}

impl TrustNow {
    /// What the source holds, when known and read within `within`.
    pub fn fresh(&self, within: Duration) -> Option<Arc<Registry>> {
        match self {
            TrustNow::Known { registry, read_at } if read_at.elapsed() <= within => {
                Some(registry.clone())
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct State {
    known: Option<(Arc<Registry>, Instant)>,
    /// What was last reported as wrong, so a report is made once per change.
    reported: Vec<String>,
}

/// The registered nodes, shared by the decision loop and the task that follows the source.
#[derive(Clone)]
pub struct Trust {
    source: TrustSource,
    kind: TrustKind,
    client: kube::Client,
    metrics: Arc<ApproverMetrics>,
    state: Arc<RwLock<State>>,
    /// One reading at a time.
    reading: Arc<tokio::sync::Mutex<()>>,
    /// One binding written at a time: each reads what the one before wrote, so this replica's
    /// own writes never conflict.
    writing: Arc<tokio::sync::Mutex<()>>,
}

/// What one reading of the source found.
enum Reading {
    Entries(TrustRead),
    Missing(TrustProblem),
}

impl Trust {
    /// Reads the source once; fails when it cannot be read (an unreadable source at start is
    /// a mistake to report, not a state to wait in).
    pub async fn load(
        source: TrustSource,
        kind: TrustKind,
        client: &kube::Client,
        metrics: Arc<ApproverMetrics>,
    ) -> Result<Trust, TrustError> {
        let trust = Trust {
            source,
            kind,
            client: client.clone(),
            metrics,
            state: Arc::default(),
            reading: Arc::default(),
            writing: Arc::default(),
        };
        match trust.read().await? {
            Reading::Entries(read) => trust.install(read).await,
            Reading::Missing(problem) => return Err(trust.error(problem)),
        }
        Ok(trust)
    }

    /// The trust now.
    pub fn now(&self) -> TrustNow {
        self.state
            .read()
            .ok()
            .and_then(|s| s.known.clone())
            .map(|(registry, read_at)| TrustNow::Known { registry, read_at })
            .unwrap_or(TrustNow::Unavailable)
    }

    /// Reads the source again unless it was read within `within` (one reading at a time:
    /// callers that waited for another's reading use it).
    pub async fn refresh(&self, within: Duration) -> Result<TrustNow, TrustError> {
        let _one = self.reading.lock().await;
        if self.now().fresh(within).is_some() {
            return Ok(self.now());
        }
        match self.read().await? {
            Reading::Entries(read) => self.install(read).await,
            Reading::Missing(problem) => {
                self.unavailable(&problem);
                return Err(self.error(problem));
            }
        }
        Ok(self.now())
    }

    fn error(&self, problem: TrustProblem) -> TrustError {
        TrustError {
            origin: self.source.to_string(),
            problem,
        }
    }

    /// One reading: the entries, or why the source is missing. An API error (no answer, a
    /// refusal) is an error: the trust stays as it was, not refreshed.
    async fn read(&self) -> Result<Reading, TrustError> {
        match &self.source {
            TrustSource::Dir(dir) => {
                let dir = dir.clone();
                let read = tokio::task::spawn_blocking(move || registration::read_trust_dir(&dir))
                    .await
                    .map_err(|e| self.error(TrustProblem::Panicked(e)))?;
                Ok(match read {
                    Ok(read) => Reading::Entries(read),
                    Err(e) => Reading::Missing(TrustProblem::Dir(e)),
                })
            }
            TrustSource::ConfigMap { namespace, name } => {
                let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
                match tokio::time::timeout(READ_TIMEOUT, api.get_opt(name)).await {
                    Ok(Ok(Some(map))) => Ok(Reading::Entries(from_config_map(&map))),
                    Ok(Ok(None)) => Ok(Reading::Missing(TrustProblem::Missing {
                        namespace: namespace.clone(),
                        name: name.clone(),
                    })),
                    Ok(Err(e)) => Err(self.error(TrustProblem::Api(e))),
                    Err(_) => Err(self.error(TrustProblem::Timeout(READ_TIMEOUT))),
                }
            }
        }
    }

    /// The source is gone: nothing is known until it is back.
    fn unavailable(&self, problem: &TrustProblem) {
        let was_known = self
            .state
            .write()
            .map(|mut s| s.known.take().is_some())
            .unwrap_or(false);
        if self.kind == TrustKind::Nodes {
            self.metrics.trust_available.set(0);
        }
        if was_known {
            tracing::error!(trust = %self.source, problem = %problem, "the trust source cannot be read: requests that need it wait until it is back");
        }
    }

    /// Installs a reading: every usable entry, possibly none (then nobody is trusted).
    async fn install(&self, read: TrustRead) {
        let invalid: Vec<String> = read
            .invalid
            .iter()
            .map(|i| {
                format!(
                    "entry '{}' is skipped: {}",
                    i.entry.escape_debug(),
                    bounded(&i.problem.to_string())
                )
            })
            .collect();
        let duplicates: Vec<String> = read
            .duplicate_aks()
            .into_iter()
            .map(|(ak, nodes)| {
                format!(
                    "AK {ak} is registered for several nodes: {}",
                    nodes.join(", ")
                )
            })
            .collect();
        let mut problems: Vec<String> = invalid.into_iter().chain(duplicates).collect();
        if read.nodes.is_empty() && self.kind == TrustKind::Nodes {
            problems.push(format!(
                "{} holds no usable registration: no node is trusted",
                self.source
            ));
        }
        if self.kind == TrustKind::People {
            if let Some(problem) = allow_problem(read.allow.as_deref()) {
                problems.push(format!("{}: {problem}", self.source));
            }
            self.install_registry(read, problems).await;
            return;
        }
        self.metrics
            .trust_invalid_entries
            .set(i64::try_from(read.invalid.len()).unwrap_or(i64::MAX));
        self.metrics
            .trust_duplicate_aks
            .set(i64::try_from(read.duplicate_aks().len()).unwrap_or(i64::MAX));
        self.metrics
            .registered_nodes
            .set(i64::try_from(read.nodes.len()).unwrap_or(i64::MAX));
        self.metrics.trust_available.set(1);
        self.install_registry(read, problems).await;
    }

    /// Keeps what a reading holds and reports its problems once per change.
    async fn install_registry(&self, read: TrustRead, problems: Vec<String>) {
        let registry = Registry {
            aks: read.nodes,
            piv: read.piv,
            allow: read.allow,
            ek: read.ek,
            invalid: read.invalid.iter().map(|i| i.entry.clone()).collect(),
        };
        let changed = match self.state.write() {
            Ok(mut state) => {
                state.known = Some((Arc::new(registry), Instant::now()));
                let changed = state.reported != problems;
                state.reported = problems.clone();
                changed
            }
            Err(_) => false,
        };
        if changed {
            for problem in &problems {
                tracing::warn!(trust = %self.source, "{problem}");
                self.event(problem).await;
            }
        }
    }

    /// A Warning Event on the trust ConfigMap (nothing for a directory: the log says it).
    async fn event(&self, message: &str) {
        let TrustSource::ConfigMap { namespace, name } = &self.source else {
            return;
        };
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{name}.")),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("ConfigMap".into()),
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            reason: Some("InvalidRegistration".into()),
            message: Some(message.to_string()),
            type_: Some("Warning".into()),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("hwkey-approver".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let params = PostParams::default();
        let create = api.create(&params, &event);
        match tokio::time::timeout(READ_TIMEOUT, create).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot record an Event on the trust ConfigMap")
            }
            Err(_) => tracing::debug!("no answer recording an Event on the trust ConfigMap"),
        }
    }

    /// Follows the source until the task is dropped: a ConfigMap through kube's watcher (its
    /// changes within a second), a directory checked every second, and either read again
    /// every [`RESYNC`] whatever the watch says.
    pub async fn follow(self) {
        let mut resync = tokio::time::interval(RESYNC);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        match self.source.clone() {
            TrustSource::Dir(dir) => {
                let mut poll = tokio::time::interval(DIR_POLL);
                let mut last = None;
                loop {
                    let resynced = tokio::select! {
                        _ = poll.tick() => false,
                        _ = resync.tick() => true,
                    };
                    let d = dir.clone();
                    let now = tokio::task::spawn_blocking(move || fingerprint(&d))
                        .await
                        .unwrap_or_default();
                    if resynced || last.as_ref().is_some_and(|l| *l != now) {
                        self.reread().await;
                    }
                    last = Some(now);
                }
            }
            TrustSource::ConfigMap { namespace, name } => {
                let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &namespace);
                let config = watcher::Config::default()
                    .fields(&format!("metadata.name={name}"))
                    .timeout(30);
                let mut stream = std::pin::pin!(watcher::watcher(api, config).default_backoff());
                let mut seen_in_list = false;
                loop {
                    tokio::select! {
                        _ = resync.tick() => self.reread().await,
                        event = stream.next() => match event {
                            Some(Ok(watcher::Event::Init)) => seen_in_list = false,
                            Some(Ok(watcher::Event::InitApply(_) | watcher::Event::Apply(_))) => {
                                seen_in_list = true;
                                // Read again (a quorum GET); what the event carries is never
                                // installed: a watch may deliver an older version late (an edit
                                // a newer one replaced, a node's removal included), and as a
                                // reading it would count as fresh and be approved against.
                                self.reread().await;
                            }
                            Some(Ok(watcher::Event::InitDone)) if !seen_in_list => {
                                self.unavailable(&TrustProblem::Missing { namespace: namespace.clone(), name: name.clone() });
                            }
                            Some(Ok(watcher::Event::InitDone)) => {}
                            Some(Ok(watcher::Event::Delete(_))) => {
                                self.unavailable(&TrustProblem::Missing { namespace: namespace.clone(), name: name.clone() });
                            }
                            Some(Err(e)) => tracing::warn!(error = %e, "watching the trust ConfigMap failed; retrying with backoff"),
                            None => return,
                        },
                    }
                }
            }
        }
    }

    /// Writes `text` as the entry of `node` (a binding the approver made: a TPM that joined by
    /// its EK certificate), if `still(what the ConfigMap holds now)` agrees. The ConfigMap is
    /// read and replaced with its resourceVersion, so a change between the two fails the write
    /// (409) and the caller decides again on the new content. A directory is never written: it
    /// is an operator's (or a mounted ConfigMap, read-only).
    pub async fn record(
        &self,
        node: &str,
        text: &str,
        still: impl Fn(&TrustRead) -> Result<(), super::reason::Violation>,
    ) -> Result<(), RecordError> {
        let TrustSource::ConfigMap { namespace, name } = &self.source else {
            return Err(RecordError::NotAConfigMap(self.source.to_string()));
        };
        let _one = self.writing.lock().await;
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        let timed = |e| RecordError::Timeout(READ_TIMEOUT, e);
        let mut map = tokio::time::timeout(READ_TIMEOUT, api.get(name))
            .await
            .map_err(|_| timed("reading"))?
            .map_err(|source| RecordError::Api { source })?;
        still(&from_config_map(&map)).map_err(RecordError::Changed)?;
        map.data
            .get_or_insert_with(Default::default)
            .insert(node.to_string(), text.to_string());
        tokio::time::timeout(
            READ_TIMEOUT,
            api.replace(name, &PostParams::default(), &map),
        )
        .await
        .map_err(|_| timed("writing"))?
        .map_err(|source| RecordError::Api { source })?;
        self.reread().await;
        Ok(())
    }

    /// Reads the source again now, logging what fails (the trust stays as it was then).
    async fn reread(&self) {
        if let Err(e) = self.refresh(Duration::ZERO).await {
            tracing::warn!(error = %e, "reading the trust source again failed");
        }
    }
}

/// What is wrong with a people trust's allow list, if anything (then nobody may renew).
fn allow_problem(allow: Option<&str>) -> Option<String> {
    match allow {
        None => Some(format!(
            "it has no '{}' entry: nobody may renew a person's certificate",
            registration::ALLOW_ENTRY
        )),
        Some(text) => super::allow_list::AllowList::parse(text).err().map(|e| {
            format!(
                "its '{}' entry is refused, so nobody may renew: {e}",
                registration::ALLOW_ENTRY
            )
        }),
    }
}

fn from_config_map(map: &ConfigMap) -> TrustRead {
    let data = map.data.clone().unwrap_or_default();
    TrustRead::from_entries(data.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

/// At most 200 characters of a reason taken from a file or ConfigMap, escaped.
fn bounded(text: &str) -> String {
    let escaped = text.escape_debug().to_string();
    match escaped.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &escaped[..at]),
        None => escaped,
    }
}

/// What a directory holds, cheaply: each visible entry's name, size, modification and change
/// times, and where a mounted ConfigMap's `..data` points.
fn fingerprint(dir: &std::path::Path) -> Vec<(String, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<(String, u64, i64, i64)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let meta = std::fs::metadata(e.path()).ok()?;
                    Some((
                        name,
                        meta.len(),
                        meta.mtime_nsec() + meta.mtime() * 1_000_000_000,
                        meta.ctime() * 1_000_000_000 + meta.ctime_nsec(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    if let Ok(target) = std::fs::read_link(dir.join("..data")) {
        out.push((target.to_string_lossy().into_owned(), 0, 0, 0));
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_map_specs_need_a_namespace_and_a_name() {
        assert_eq!(
            TrustSource::config_map("hwkey-system/trust"),
            Ok(TrustSource::ConfigMap {
                namespace: "hwkey-system".into(),
                name: "trust".into()
            })
        );
        for bad in ["trust", "/trust", "ns/", "a/b/c"] {
            let e = TrustSource::config_map(bad).unwrap_err();
            assert!(e.to_string().contains("NAMESPACE/NAME"), "{bad}: {e}");
        }
    }

    /// An API server whose watch delivers an older version of the trust ConfigMap (an edit a
    /// newer one replaced: here the version before a node's removal), while a GET reads the
    /// current one. The old code installed what the event carried as a fresh reading, so the
    /// approver decided against the removed registration for the next seconds (and until the
    /// next event or resync). Now an event only makes the trust read the ConfigMap again.
    #[tokio::test]
    async fn a_stale_watch_event_never_replaces_a_newer_reading() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let config_map = |rv: &str, allow: &str| {
            serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "trust", "namespace": "hwkey-system", "resourceVersion": rv},
                "data": {"_allow": allow},
            })
        };
        let watches = Arc::new(AtomicUsize::new(0));
        let seen = watches.clone();
        let api = tower::service_fn(move |req: hyper::Request<kube::client::Body>| {
            let path = req.uri().path().to_string();
            let query = req.uri().query().unwrap_or_default().to_string();
            let (status, body) = if path.ends_with("/configmaps/trust") {
                (200, config_map("101", "current").to_string())
            } else if path.ends_with("/configmaps") && query.contains("watch=true") {
                seen.fetch_add(1, Ordering::SeqCst);
                let event =
                    serde_json::json!({"type": "MODIFIED", "object": config_map("100", "removed")});
                (200, format!("{event}\n"))
            } else if path.ends_with("/configmaps") {
                let list = serde_json::json!({
                    "apiVersion": "v1", "kind": "ConfigMapList",
                    "metadata": {"resourceVersion": "101"},
                    "items": [config_map("101", "current")],
                });
                (200, list.to_string())
            } else {
                (404, serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}).to_string())
            };
            async move {
                hyper::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            }
        });
        let client = kube::Client::new(api, "default");
        let trust = Trust::load(
            TrustSource::config_map("hwkey-system/trust").expect("source"),
            TrustKind::People,
            &client,
            Arc::new(ApproverMetrics::default()),
        )
        .await
        .expect("load");
        let follower = tokio::spawn(trust.clone().follow());
        let deadline = Instant::now() + Duration::from_secs(20);
        while watches.load(Ordering::SeqCst) < 3 {
            assert!(Instant::now() < deadline, "the watch was never asked");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Whatever the watch delivered, the trust holds the current version.
        let _reading = trust.reading.lock().await;
        let TrustNow::Known { registry, .. } = trust.now() else {
            panic!("no trust")
        };
        assert_eq!(registry.allow.as_deref(), Some("current"));
        follower.abort();
    }

    #[test]
    fn reported_reasons_are_bounded_and_escaped() {
        let long = "x\u{1b}[31m".repeat(100);
        let b = bounded(&long);
        assert!(b.chars().count() <= 201, "{b}");
        assert!(!b.contains('\u{1b}'));
    }
}
