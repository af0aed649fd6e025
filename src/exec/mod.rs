//! The exec credential front end: `hwkey credential`, a client-go exec plugin.
//!
//! client-go refuses a credential without `clientKeyData`, so the default answer is a
//! short-lived *loopback* certificate and its throw-away key, minted by the local `hwkey proxy`
//! (which holds the hardware key and re-originates TLS to the API server). The hardware key is
//! never in the answer. `--cert-only` answers in the KEP-2718 shape instead: the hardware chain
//! and `proxyConfig`, no key.
//!
//! Flow: parse `KUBERNETES_EXEC_INFO` ([`credential`]) → resolve settings from arguments and
//! hwkey's settings for the cluster (the exec block's `HWKEY_EXEC_CLUSTER`, or an older
//! kubeconfig's extension client-go passes) ([`settings`]) → ask the proxy's
//! control socket for a credential ([`control_client`]); its answer names the proxy, which must
//! be the one these settings want. Only when that request fails: make sure the proxy for that
//! cluster runs, starting it detached under a lock if not ([`launcher`]), and ask again → print
//! one JSON object.

pub mod control_client;
pub mod credential;
pub mod error;
pub mod launcher;
mod pin_prompt;
pub mod settings;

use std::path::PathBuf;

use base64::Engine;

use self::credential::{ExecCredential, ExecCredentialStatus, ExecInfo, ProxyConfig};
use self::settings::Settings;

pub use self::error::ExecError;
pub use self::launcher::proxy_binary;

pub use crate::kubeconfig::{is_plugin_binary, PLUGIN_BINARY};

/// What a generated kubeconfig's exec block runs: `hwkey-credential` when it is installed next
/// to this binary (it starts about 5 ms faster on every kubectl invocation, since it links
/// neither the TSS nor OpenSSL), else this binary itself.
pub fn plugin_command() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let plugin = exe.with_file_name(PLUGIN_BINARY);
    Ok(if plugin.is_file() { plugin } else { exe })
}

/// Produces the credential for one exec-plugin invocation.
///
/// kubectl runs the plugin once per process, so this is on the path of every `kubectl get`.
/// With the proxy already running (the common case) it costs one control request: the answer
/// names the proxy that gave it (`/v1/credential` carries `/v1/info`'s fields), and that is
/// checked as a start would check it. Any failure of that one request takes the full path:
/// the PIN if a start needs one, then the check-and-start under the start lock, then the
/// request again, so every error is the full path's, precise one.
pub fn run(info: &ExecInfo, settings: &Settings) -> Result<ExecCredential, ExecError> {
    let sock = settings.control_socket();
    let answer = match ask(&sock, settings.cert_only, QUICK_ANSWER) {
        Ok(answer) => {
            launcher::same_proxy(settings, answer.info())?;
            answer
        }
        Err(_) => {
            let pin = settings::pin_for(settings, info.interactive)?;
            launcher::ensure_proxy(settings, pin)?;
            ask(&sock, settings.cert_only, control_client::ANSWER_TIMEOUT)?
        }
    };
    Ok(answer.into_credential(info.api_version))
}

/// How long the first request waits for an answer. A running proxy answers in well under a
/// millisecond; one silent for this long is stopped or stuck, and the full path (which waits
/// [`control_client::ANSWER_TIMEOUT`] and says which) takes over, so a stuck proxy costs the
/// user this much more than before the first request existed, not another 30 s.
const QUICK_ANSWER: std::time::Duration = std::time::Duration::from_secs(3);

/// What the control socket answered: the proxy's info (`--cert-only`) or a credential.
enum Answer {
    Info(crate::control_api::ProxyInfo),
    Credential(crate::control_api::LoopbackCredential),
}

/// One control request: `/v1/info` for `--cert-only` (no key is minted that would be thrown
/// away), else `/v1/credential`.
fn ask(
    sock: &std::path::Path,
    cert_only: bool,
    timeout: std::time::Duration,
) -> Result<Answer, ExecError> {
    Ok(if cert_only {
        Answer::Info(control_client::info_within(sock, timeout)?)
    } else {
        Answer::Credential(control_client::credential_within(sock, timeout)?)
    })
}

impl Answer {
    /// The proxy that answered.
    fn info(&self) -> &crate::control_api::ProxyInfo {
        match self {
            Answer::Info(info) => info,
            Answer::Credential(cred) => &cred.info,
        }
    }

    /// The ExecCredential for client-go: the hardware chain and `proxyConfig` in the KEP-2718
    /// shape (`--cert-only`), else the loopback certificate and its throw-away key.
    fn into_credential(self, api_version: credential::ApiVersion) -> ExecCredential {
        match self {
            Answer::Info(answer) => ExecCredential::new(
                api_version,
                ExecCredentialStatus {
                    client_certificate_data: Some(answer.certificate_chain_pem),
                    proxy_config: Some(ProxyConfig {
                        url: answer.server.unwrap_or_default(),
                        certificate_authority_data: base64::engine::general_purpose::STANDARD
                            .encode(answer.certificate_authority_pem),
                    }),
                    ..Default::default()
                },
            ),
            Answer::Credential(answer) => ExecCredential::new(
                api_version,
                ExecCredentialStatus {
                    expiration_timestamp: Some(expiry_before(answer.expiration_unix)),
                    client_certificate_data: Some(answer.client_certificate_pem),
                    client_key_data: Some(answer.client_key_pem),
                    ..Default::default()
                },
            ),
        }
    }
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
