//! The registered nodes, from a directory or a ConfigMap, reloaded when a request names an AK
//! not seen yet (a node registered after the approver started gets in without a restart).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;

use crate::lifecycle::LifecycleError;
use crate::pki::attestation::{self, RegisteredAk};

/// Where the registered nodes are kept: each entry is named after a node and holds what
/// `hwkey attest enroll` printed for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrustSource {
    /// One file per node (`--trust DIR`; also a mounted ConfigMap).
    Dir(PathBuf),
    /// One entry per node in a ConfigMap (`--trust-configmap NAMESPACE/NAME`), read through the
    /// API, so an update is seen at once.
    ConfigMap {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

impl TrustSource {
    /// Parses `NAMESPACE/NAME`.
    pub fn config_map(spec: &str) -> Result<TrustSource, String> {
        match spec.split_once('/') {
            Some((namespace, name))
                if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
            {
                Ok(TrustSource::ConfigMap {
                    namespace: namespace.into(),
                    name: name.into(),
                })
            }
            _ => Err(format!(
                "'{spec}' is not NAMESPACE/NAME (example: hwkey-system/hwkey-approver-trust)"
            )),
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

/// The registered nodes as last read.
#[derive(Debug)]
pub struct Trust {
    source: TrustSource,
    nodes: Vec<RegisteredAk>,
    loaded_at: Option<Instant>,
}

impl Trust {
    /// Nothing read yet: call [`Trust::load`].
    pub fn new(source: TrustSource) -> Trust {
        Trust {
            source,
            nodes: Vec::new(),
            loaded_at: None,
        }
    }

    /// The registered nodes.
    pub fn nodes(&self) -> &[RegisteredAk] {
        &self.nodes
    }

    /// Reads the source again.
    pub async fn load(&mut self, client: &kube::Client) -> Result<(), LifecycleError> {
        self.nodes = match &self.source {
            // One file per node, thousands of them: read off the runtime's thread.
            TrustSource::Dir(dir) => {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || attestation::read_trust_dir(&dir))
                    .await
                    .map_err(|e| LifecycleError::Trust {
                        origin: self.source.to_string(),
                        reason: format!("the reading task failed: {e}"),
                    })??
            }
            TrustSource::ConfigMap { namespace, name } => {
                read_config_map(client, namespace, name).await?
            }
        };
        self.loaded_at = Some(Instant::now());
        Ok(())
    }

    /// Reads the source again unless it was read within [`RELOAD_AT_MOST_EVERY`]; true when it
    /// was read.
    pub async fn reload_if_stale(&mut self, client: &kube::Client) -> Result<bool, LifecycleError> {
        if self
            .loaded_at
            .is_some_and(|at| at.elapsed() < RELOAD_AT_MOST_EVERY)
        {
            return Ok(false);
        }
        self.load(client).await?;
        Ok(true)
    }
}

async fn read_config_map(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<RegisteredAk>, LifecycleError> {
    let bad = |reason: String| LifecycleError::Trust {
        origin: format!("ConfigMap {namespace}/{name}"),
        reason,
    };
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let map = match api.get_opt(name).await {
        Ok(Some(map)) => map,
        Ok(None) => {
            return Err(bad(format!(
                "it does not exist: create it with `kubectl -n {namespace} create configmap {name} --from-file=TRUST_DIR`"
            )))
        }
        Err(e) => return Err(bad(e.to_string())),
    };
    map.data
        .unwrap_or_default()
        .iter()
        .map(|(node, text)| attestation::parse_registration(node, text).map_err(&bad))
        .collect()
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
            assert!(e.contains("NAMESPACE/NAME"), "{bad}: {e}");
        }
    }
}
