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
pub mod error;
pub mod launcher;
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
