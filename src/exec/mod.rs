//! The exec credential front end: `hwkey credential`, a client-go exec plugin.
//!
//! client-go refuses a credential without `clientKeyData`, so the default answer is a
//! short-lived *loopback* certificate and its throw-away key, minted by the local `hwkey proxy`
//! (which holds the hardware key and re-originates TLS to the API server). The hardware key is
//! never in the answer. `--cert-only` answers in the KEP-2718 shape instead: the hardware chain
//! and `proxyConfig`, no key.
//!
//! Flow: parse `KUBERNETES_EXEC_INFO` ([`credential`]) → resolve settings from arguments and the
//! cluster's `client.authentication.k8s.io/exec` extension ([`settings`]) → make sure the proxy
//! for that cluster runs, starting it detached under a lock if not ([`launcher`]) → ask its
//! control socket for a credential ([`control_client`]) → print one JSON object.

pub mod control_client;
pub mod credential;
pub mod launcher;
pub mod settings;

use std::path::PathBuf;

use base64::Engine;

use self::credential::{ExecCredential, ExecCredentialStatus, ExecInfo, ProxyConfig};
use self::launcher::StartProblem;
use self::settings::Settings;
use crate::key::KeyError;

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

    #[error("the cluster's client.authentication.k8s.io/exec extension is not hwkey's: {0} (regenerate the kubeconfig with `hwkey kubeconfig`)")]
    BadExtension(#[source] serde_json::Error),

    #[error(transparent)]
    Endpoint(#[from] crate::endpoint::EndpointError),

    #[error(transparent)]
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

    #[error("the hwkey proxy for state directory {state_dir} serves {running}, but this kubeconfig asks for {wanted}: stop that proxy (kill {pid}, the pid it reports) or give this context its own state directory (`hwkey kubeconfig --state-dir`)")]
    ProxyMismatch {
        state_dir: PathBuf,
        running: String,
        wanted: String,
        pid: String,
    },

    #[error(transparent)]
    Key(#[from] KeyError),

    #[error("{0}")]
    Internal(String),
}

pub use crate::kubeconfig::{is_plugin_binary, PLUGIN_BINARY};

/// What a generated kubeconfig's exec block runs: `hwkey-credential` when it is installed next
/// to this binary (it starts about 5 ms faster on every kubectl invocation, since it links
/// neither the TSS nor OpenSSL), else this binary itself.
pub fn plugin_command() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let plugin = exe.with_file_name(PLUGIN_BINARY);
    Ok(if plugin.is_file() { plugin } else { exe })
}

/// The binary that runs `hwkey proxy`: this one, or the `hwkey` installed next to
/// `hwkey-credential`.
pub fn proxy_binary() -> Result<PathBuf, StartProblem> {
    let exe = std::env::current_exe().map_err(StartProblem::NoExe)?;
    if !is_plugin_binary(&exe) {
        return Ok(exe);
    }
    let hwkey = exe.with_file_name("hwkey");
    if hwkey.is_file() {
        Ok(hwkey)
    } else {
        Err(StartProblem::NoHwkey(hwkey))
    }
}

/// Produces the credential for one exec-plugin invocation.
pub fn run(info: &ExecInfo, settings: &Settings) -> Result<ExecCredential, ExecError> {
    let pin = settings::pin_for(settings, info.interactive)?;
    launcher::ensure_proxy(settings, pin)?;
    let sock = settings.control_socket();
    if settings.cert_only {
        let answer = control_client::info(&sock)?;
        return Ok(ExecCredential::new(
            info.api_version,
            ExecCredentialStatus {
                client_certificate_data: Some(answer.certificate_chain_pem),
                proxy_config: Some(ProxyConfig {
                    url: answer.server.unwrap_or_default(),
                    certificate_authority_data: base64::engine::general_purpose::STANDARD
                        .encode(answer.certificate_authority_pem),
                }),
                ..Default::default()
            },
        ));
    }
    let answer = control_client::credential(&sock)?;
    Ok(ExecCredential::new(
        info.api_version,
        ExecCredentialStatus {
            expiration_timestamp: Some(expiry_before(answer.expiration_unix)),
            client_certificate_data: Some(answer.client_certificate_pem),
            client_key_data: Some(answer.client_key_pem),
            ..Default::default()
        },
    ))
}

/// client-go must ask again *before* the loopback certificate expires (it ignores NotAfter and
/// uses our timestamp), so answer a minute early, or half the remaining time when that is short.
fn expiry_before(not_after_unix: i64) -> String {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let remaining = (not_after_unix - now).max(0);
    let margin = 60.min(remaining / 2);
    let at = time::OffsetDateTime::from_unix_timestamp(not_after_unix - margin)
        .unwrap_or_else(|_| time::OffsetDateTime::now_utc());
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
