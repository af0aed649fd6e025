//! The registered nodes, from a directory or a ConfigMap, followed as they change.
//!
//! The approver decides with the trust as it is now: the ConfigMap is watched through the API
//! and a directory (a mounted ConfigMap's `..data` switch included) is checked every second, so
//! a removed node is refused within seconds, without a restart. A node registered a moment
//! before its request arrives is also found: an unknown AK makes the approver read the source
//! again at once (at most once a second).
//!
//! A malformed entry is skipped and reported (a warning log, the
//! `hwkey_approver_trust_invalid_entries` gauge and, for a ConfigMap, a Warning Event on it);
//! the source fails only when it has entries and none is usable. An AK registered under several
//! nodes is reported the same way (`hwkey_approver_trust_duplicate_aks`).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Event, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};

use super::metrics::ApproverMetrics;
use crate::lifecycle::LifecycleError;
use crate::pki::registration::{self, RegisteredAk, TrustRead};

/// Why the registered nodes could not be read, for [`LifecycleError::Trust`].
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
    #[error("watch: {0}")]
    Watch(#[source] kube::Error),
    #[error("{0}")]
    Unusable(#[source] crate::pki::registration::RegistrationError),
    #[error("the trust lock is poisoned")]
    Poisoned,
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

/// How often an unknown AK may make the approver read its trust source again.
pub const RELOAD_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// How often a trust directory is checked for changes.
const DIR_POLL: Duration = Duration::from_secs(1);

/// The registered nodes as last read, shared with the task that follows the source.
#[derive(Clone)]
pub struct Trust {
    source: TrustSource,
    client: kube::Client,
    metrics: Arc<ApproverMetrics>,
    state: Arc<RwLock<State>>,
}

#[derive(Default)]
struct State {
    nodes: Arc<Vec<RegisteredAk>>,
    loaded_at: Option<Instant>,
    /// What was last reported as wrong, so a report is made once per change.
    reported: Vec<String>,
}

impl Trust {
    /// Reads the source once; fails when it cannot be read or nothing in it is usable.
    pub async fn load(
        source: TrustSource,
        client: &kube::Client,
        metrics: Arc<ApproverMetrics>,
    ) -> Result<Trust, LifecycleError> {
        let trust = Trust {
            source,
            client: client.clone(),
            metrics,
            state: Arc::default(),
        };
        trust.reload().await?;
        Ok(trust)
    }

    /// The registered nodes.
    pub fn nodes(&self) -> Arc<Vec<RegisteredAk>> {
        self.state
            .read()
            .map(|s| s.nodes.clone())
            .unwrap_or_default()
    }

    /// Reads the source again and installs what it holds.
    pub async fn reload(&self) -> Result<(), LifecycleError> {
        let read = match &self.source {
            // One file per node, thousands of them: read off the runtime's thread.
            TrustSource::Dir(dir) => {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || registration::read_trust_dir(&dir))
                    .await
                    .map_err(|e| self.error(TrustProblem::Panicked(e)))??
            }
            TrustSource::ConfigMap { namespace, name } => {
                let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
                match api.get_opt(name).await {
                    Ok(Some(map)) => from_config_map(&map),
                    Ok(None) => {
                        return Err(self.error(TrustProblem::Missing {
                            namespace: namespace.clone(),
                            name: name.clone(),
                        }))
                    }
                    Err(e) => return Err(self.error(TrustProblem::Api(e))),
                }
            }
        };
        self.install(read).await
    }

    /// Reads the source again unless it was read within [`RELOAD_AT_MOST_EVERY`]; true when it
    /// was read.
    pub async fn reload_if_stale(&self) -> Result<bool, LifecycleError> {
        let fresh = self
            .state
            .read()
            .map(|s| {
                s.loaded_at
                    .is_some_and(|at| at.elapsed() < RELOAD_AT_MOST_EVERY)
            })
            .unwrap_or(false);
        if fresh {
            return Ok(false);
        }
        self.reload().await?;
        Ok(true)
    }

    fn error(&self, problem: TrustProblem) -> LifecycleError {
        LifecycleError::Trust {
            origin: self.source.to_string(),
            problem,
        }
    }

    /// Installs a read: reports what is wrong in it, fails when nothing in it is usable (the
    /// previous trust stays then).
    async fn install(&self, read: TrustRead) -> Result<(), LifecycleError> {
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
        self.metrics
            .trust_invalid_entries
            .set(i64::try_from(read.invalid.len()).unwrap_or(i64::MAX));
        self.metrics
            .trust_duplicate_aks
            .set(i64::try_from(duplicates.len()).unwrap_or(i64::MAX));
        let read = read
            .usable()
            .map_err(|e| self.error(TrustProblem::Unusable(e)))?;
        let problems: Vec<String> = invalid.into_iter().chain(duplicates).collect();
        let changed = {
            let mut state = self
                .state
                .write()
                .map_err(|_| self.error(TrustProblem::Poisoned))?;
            state.nodes = Arc::new(read.nodes);
            state.loaded_at = Some(Instant::now());
            self.metrics
                .registered_nodes
                .set(i64::try_from(state.nodes.len()).unwrap_or(i64::MAX));
            let changed = state.reported != problems;
            state.reported = problems.clone();
            changed
        };
        if changed {
            for problem in &problems {
                tracing::warn!(trust = %self.source, "{problem}");
                self.event(problem).await;
            }
        }
        Ok(())
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
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            tracing::debug!(error = %e, "cannot record an Event on the trust ConfigMap");
        }
    }

    /// Follows the source until the task is dropped: a ConfigMap through a watch, a directory
    /// by checking it every second. Errors are logged and retried with backoff; the trust
    /// already installed stays meanwhile.
    pub async fn follow(self) {
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            let result = match &self.source {
                TrustSource::Dir(dir) => self.follow_dir(dir.clone()).await,
                TrustSource::ConfigMap { namespace, name } => {
                    self.follow_config_map(namespace, name).await
                }
            };
            match result {
                Ok(()) => backoff.reset(),
                Err(e) => {
                    tracing::warn!(error = %e, "following the trust source failed; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    async fn follow_dir(&self, dir: PathBuf) -> Result<(), LifecycleError> {
        let mut last = None;
        loop {
            let d = dir.clone();
            let now = tokio::task::spawn_blocking(move || fingerprint(&d))
                .await
                .map_err(|e| self.error(TrustProblem::Panicked(e)))?;
            if last.is_some() && last != Some(now.clone()) {
                self.reload().await?;
            }
            last = Some(now);
            tokio::time::sleep(DIR_POLL).await;
        }
    }

    async fn follow_config_map(&self, namespace: &str, name: &str) -> Result<(), LifecycleError> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(290);
        // Read it again first: changes made while no watch ran are not lost.
        self.reload().await?;
        let version = api
            .get_metadata_opt(name)
            .await
            .map_err(|e| self.error(TrustProblem::Api(e)))?
            .and_then(|m| m.metadata.resource_version)
            .unwrap_or_else(|| "0".into());
        let stream = api
            .watch(&params, &version)
            .await
            .map_err(|e| self.error(TrustProblem::Watch(e)))?;
        futures::pin_mut!(stream);
        while let Some(event) = stream
            .try_next()
            .await
            .map_err(|e| self.error(TrustProblem::Watch(e)))?
        {
            match event {
                WatchEvent::Added(map) | WatchEvent::Modified(map) => {
                    if let Err(e) = self.install(from_config_map(&map)).await {
                        tracing::error!(error = %e, "the trust ConfigMap holds no usable registration: keeping the previous trust");
                    }
                }
                WatchEvent::Deleted(_) => {
                    tracing::error!(trust = %self.source, "the trust ConfigMap was deleted: no node is trusted until it is back");
                    let _ = self.install(TrustRead::default()).await;
                }
                WatchEvent::Error(e) => {
                    tracing::debug!(error = %e.message, "trust watch ended; reading again");
                    return Ok(());
                }
                WatchEvent::Bookmark(_) => {}
            }
        }
        Ok(())
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

    #[test]
    fn reported_reasons_are_bounded_and_escaped() {
        let long = "x\u{1b}[31m".repeat(100);
        let b = bounded(&long);
        assert!(b.chars().count() <= 201, "{b}");
        assert!(!b.contains('\u{1b}'));
    }
}
