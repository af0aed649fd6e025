//! The exec front end's errors: each is printed as one line on stderr, which kubectl shows.

use std::path::PathBuf;

use super::{control_client, credential, launcher};
use crate::key::KeyError;
use crate::kubeconfig::CLUSTER_ENV;

/// Errors of the exec front end. Each is printed as one line on stderr (kubectl shows it).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum ExecError {
    #[error("KUBERNETES_EXEC_INFO is not a valid ExecCredential: {problem} (hwkey credential is meant to be run by kubectl; see `hwkey kubeconfig`)")]
    MalformedExecInfo {
        #[source]
        problem: credential::ExecInfoProblem,
    },

    #[error("the plugin's cluster settings ({CLUSTER_ENV}, or an older kubeconfig's client.authentication.k8s.io/exec extension) are not hwkey's: {0} (regenerate the kubeconfig with `hwkey kubeconfig`)")]
    BadExtension(#[source] serde_json::Error),

    #[error("{CLUSTER_ENV} (the kubeconfig's exec env) is not the cluster JSON `hwkey kubeconfig` writes: {0} (regenerate the kubeconfig with `hwkey kubeconfig`)")]
    BadClusterEnv(#[source] serde_json::Error),

    #[error("{0}")]
    Endpoint(#[from] crate::endpoint::EndpointError),

    #[error("{0}")]
    Duration(#[from] crate::duration::InvalidDuration),

    #[error("unsupported exec credential apiVersion '{given}': use client.authentication.k8s.io/v1 or client.authentication.k8s.io/v1beta1 in the kubeconfig's exec block")]
    UnknownApiVersion { given: String },

    #[error("no {what}: {hint}")]
    MissingSetting {
        what: &'static str,
        hint: &'static str,
    },

    #[error("invalid cluster server '{given}': {problem}")]
    InvalidServer {
        given: String,
        problem: &'static str,
    },

    #[error("cannot read the PIN from the terminal: {0}")]
    PinPrompt(#[source] std::io::Error),

    #[error("the key {key} needs a PIN and kubectl runs this plugin non-interactively: add pin-source=file:/path or pin-source=env:VAR to the key URI")]
    PinNeeded { key: String },

    #[error("cannot start hwkey proxy for {server}: {problem}{log}")]
    ProxyStart {
        server: String,
        #[source]
        problem: launcher::StartProblem,
        log: String,
    },

    #[error("cannot start hwkey proxy for {server}: it exited because the token's PIN was refused; nothing retries it: the PIN is not presented again until its source changes{log}")]
    ProxyPinRefused { server: String, log: String },

    #[error("the hwkey proxy's control socket {path} did not answer: {problem}")]
    Control {
        path: PathBuf,
        #[source]
        problem: control_client::ControlProblem,
    },

    #[error("the hwkey proxy for state directory {state_dir} serves {running}, but this kubectl (its kubeconfig and its environment: HTTPS_PROXY, NO_PROXY) asks for {wanted}: stop that proxy (kill {pid}, the pid it reports) or give this context its own state directory (`hwkey kubeconfig --state-dir`)")]
    ProxyMismatch {
        state_dir: PathBuf,
        running: String,
        wanted: String,
        pid: String,
    },

    #[error("{0}")]
    Key(#[from] KeyError),

    #[error("{0}")]
    Internal(String),
}
