//! Reading what `hwkey kubeconfig` wrote: a context's cluster carries the hwkey extension
//! (`client.authentication.k8s.io/exec`: `key`, `cert`, `upstream`, `upstreamCA`,
//! `tlsServerName`), so `hwkey renew --kubeconfig FILE [--context NAME]` needs no other flag.

use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

use super::LifecycleError;
use crate::kubeconfig::EXEC_EXTENSION;

/// The hwkey settings of one kubeconfig context.
#[derive(Debug, Clone)]
pub struct HwkeyContext {
    /// The key URI.
    pub key: String,
    /// The certificate file, when not stored with the key.
    pub cert: Option<PathBuf>,
    /// The real API server.
    pub upstream: String,
    /// The API server's CA bundle.
    pub upstream_ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
}

/// Reads context `context` (default: the current one) of the kubeconfig at `path`.
pub fn read(path: &Path, context: Option<&str>) -> Result<HwkeyContext, LifecycleError> {
    let bad = |reason: String| LifecycleError::Kubeconfig {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let doc: Value = serde_yaml_ng::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let context = match context {
        Some(c) => c.to_string(),
        None => doc
            .get("current-context")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| bad("no current-context: pass --context NAME".into()))?,
    };
    let named = |list: &str, name: &str| {
        doc.get(list)
            .and_then(Value::as_sequence)
            .and_then(|items| {
                items
                    .iter()
                    .find(|i| i.get("name").and_then(Value::as_str) == Some(name))
            })
            .cloned()
    };
    let ctx = named("contexts", &context)
        .ok_or_else(|| bad(format!("context '{context}' is not defined")))?;
    let cluster_name = ctx
        .get("context")
        .and_then(|c| c.get("cluster"))
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("context '{context}' names no cluster")))?
        .to_string();
    let cluster = named("clusters", &cluster_name)
        .ok_or_else(|| bad(format!("cluster '{cluster_name}' is not defined")))?;
    let ext = cluster
        .get("cluster")
        .and_then(|c| c.get("extensions"))
        .and_then(Value::as_sequence)
        .and_then(|exts| {
            exts.iter()
                .find(|e| e.get("name").and_then(Value::as_str) == Some(EXEC_EXTENSION))
        })
        .and_then(|e| e.get("extension"))
        .ok_or_else(|| {
            bad(format!(
                "cluster '{cluster_name}' has no {EXEC_EXTENSION} extension: it was not written by `hwkey kubeconfig`; pass --key, --server and --ca instead"
            ))
        })?;
    let field = |name: &str| ext.get(name).and_then(Value::as_str).map(str::to_string);
    Ok(HwkeyContext {
        key: field("key").ok_or_else(|| bad("the hwkey extension has no 'key'".into()))?,
        cert: field("cert").map(PathBuf::from),
        upstream: field("upstream")
            .ok_or_else(|| bad("the hwkey extension has no 'upstream'".into()))?,
        upstream_ca: field("upstreamCA").map(PathBuf::from),
        tls_server_name: field("tlsServerName"),
    })
}
