//! Reading kubeconfigs: what `hwkey kubeconfig` wrote (a context's cluster carries the hwkey
//! extension, so `hwkey renew --kubeconfig FILE [--context NAME]` needs no other flag) and the
//! bootstrap kubeconfig kubelet TLS bootstrapping starts from. Both are read with kube's
//! [`Kubeconfig`], as client-go would read them.

use std::path::{Path, PathBuf};

use kube::config::{Cluster, Kubeconfig, KubeconfigError};

use super::LifecycleError;
use crate::kubeconfig::{HwkeyExtension, SETTINGS_EXTENSION};

/// What is wrong with a kubeconfig, for [`LifecycleError::Kubeconfig`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum KubeconfigProblem {
    #[error("{0}")]
    Unreadable(#[source] KubeconfigError),
    #[error("no current-context: pass --context NAME")]
    NoCurrentContext,
    #[error("context '{0}' is not defined")]
    NoContext(String),
    #[error("it names no cluster")]
    NoCluster,
    #[error("cluster '{0}' is not defined")]
    NoClusterNamed(String),
    #[error("cluster '{0}' has no {SETTINGS_EXTENSION} extension: it was not written by `hwkey kubeconfig`; pass --key, --server and --ca instead")]
    NoExtension(String),
    #[error("the hwkey extension of cluster '{cluster}' does not parse: {source}")]
    BadExtension {
        cluster: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the hwkey extension has no '{0}'")]
    MissingField(&'static str),
    #[error("CA file {}: {source}", .path.display())]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("certificate-authority-data is not base64: {0}")]
    CaData(#[source] base64::DecodeError),
    #[error("it names no certificate-authority for the API server; add certificate-authority or certificate-authority-data")]
    NoCa,
}

/// Reads the kubeconfig at `path` with kube's reader.
pub fn read_file(path: &Path) -> Result<Kubeconfig, LifecycleError> {
    Kubeconfig::read_from(path).map_err(|e| problem(path, KubeconfigProblem::Unreadable(e)))
}

/// The error for a problem with the kubeconfig at `path`.
pub fn problem(path: &Path, problem: KubeconfigProblem) -> LifecycleError {
    LifecycleError::Kubeconfig {
        path: path.to_path_buf(),
        problem,
    }
}

/// The cluster context `context` names (default: the current one; with no current context, the
/// file's first cluster when `first_if_none`), and that cluster's name.
pub fn cluster(
    path: &Path,
    kubeconfig: &Kubeconfig,
    context: Option<&str>,
    first_if_none: bool,
) -> Result<(String, Cluster), LifecycleError> {
    let bad = |p| problem(path, p);
    let context = context
        .map(str::to_string)
        .or(kubeconfig.current_context.clone());
    let cluster_name = match context {
        Some(context) => kubeconfig
            .contexts
            .iter()
            .find(|c| c.name == context)
            .ok_or_else(|| bad(KubeconfigProblem::NoContext(context.clone())))?
            .context
            .as_ref()
            .map(|c| c.cluster.clone())
            .ok_or_else(|| bad(KubeconfigProblem::NoCluster))?,
        None if first_if_none => kubeconfig
            .clusters
            .first()
            .map(|c| c.name.clone())
            .ok_or_else(|| bad(KubeconfigProblem::NoCluster))?,
        None => return Err(bad(KubeconfigProblem::NoCurrentContext)),
    };
    let cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| bad(KubeconfigProblem::NoClusterNamed(cluster_name.clone())))?;
    Ok((cluster_name, cluster))
}

/// The hwkey extension of context `context` (default: the current one) of the kubeconfig at
/// `path`; it names at least the key and the upstream.
pub fn read_extension(
    path: &Path,
    context: Option<&str>,
) -> Result<HwkeyExtension, LifecycleError> {
    let kubeconfig = read_file(path)?;
    let (name, cluster) = cluster(path, &kubeconfig, context, false)?;
    let ext = match HwkeyExtension::of_cluster(&cluster) {
        None => return Err(problem(path, KubeconfigProblem::NoExtension(name))),
        Some(Err(source)) => {
            return Err(problem(
                path,
                KubeconfigProblem::BadExtension {
                    cluster: name,
                    source,
                },
            ))
        }
        Some(Ok(ext)) => ext,
    };
    if ext.key.is_none() {
        return Err(problem(path, KubeconfigProblem::MissingField("key")));
    }
    if ext.upstream.is_none() {
        return Err(problem(path, KubeconfigProblem::MissingField("upstream")));
    }
    Ok(ext)
}
