//! Where `hwkey credential` finds its settings: its own arguments first, then hwkey's settings
//! for the cluster, as the exec block's env hands them over ([`crate::kubeconfig::CLUSTER_ENV`],
//! what `hwkey kubeconfig` writes) or client-go passes an older kubeconfig's
//! `client.authentication.k8s.io/exec` extension as `spec.cluster.config` (with
//! `provideClusterInfo: true`), so one kubeconfig holds everything.
//!
//! The extension's fields are [`HwkeyExtension`]'s, the type `hwkey kubeconfig` writes.

use std::path::PathBuf;
use std::time::Duration;

use zeroize::Zeroizing;

use super::credential::ExecInfo;
use super::ExecError;
use crate::endpoint::UpstreamTarget;
use crate::key::KeyUri;
use crate::kubeconfig::HwkeyExtension;
use crate::state_dir::StateDir;

/// How long a proxy the plugin started lives without clients when nothing says otherwise.
pub const DEFAULT_IDLE_EXIT: Duration = Duration::from_secs(30 * 60);

/// Settings given on the plugin's command line (each optional).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// The key URI (`pkcs11:` or `tpm:`).
    pub key: Option<String>,
    /// The certificate chain file, when not stored with the key.
    pub cert: Option<PathBuf>,
    /// The real API server (`https://HOST:PORT`).
    pub upstream: Option<String>,
    /// The CA bundle of the API server.
    pub upstream_ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    /// The proxy's state directory.
    pub state_dir: Option<PathBuf>,
    /// The loopback listener the started proxy uses (`tcp:127.0.0.1:PORT`).
    pub listen: Option<String>,
    /// How long the started proxy lives without clients.
    pub idle_exit: Option<String>,
    /// Print only the hardware chain and `proxyConfig` (KEP-2718), no key.
    pub cert_only: bool,
}

/// Everything needed to find or start the proxy for one cluster.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The hardware key the proxy signs with.
    pub key: KeyUri,
    /// Its certificate chain file, when not stored with the key.
    pub cert: Option<PathBuf>,
    /// The real API server.
    pub upstream: UpstreamTarget,
    /// The CA bundle of the API server (default: the system roots).
    pub upstream_ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    /// The forward proxy to the API server (handed to the proxy in its environment: the URL
    /// may hold credentials, which argv would show).
    pub upstream_proxy: Option<String>,
    /// The proxy's state directory (control socket, loopback CA, logs).
    pub state_dir: StateDir,
    /// `tcp:127.0.0.1:PORT`: where the proxy must listen (the kubeconfig's `server`).
    pub listen: String,
    /// The kubeconfig's server URL (for messages).
    pub server: String,
    /// How long the started proxy lives without clients (`--idle-exit`).
    pub idle_exit: Duration,
    /// Print only the hardware chain and `proxyConfig` (KEP-2718), no key.
    pub cert_only: bool,
    /// The started proxy renews its certificate (the extension's `renew`).
    pub renew: bool,
    /// Its renewals carry TPM evidence by the AK at this handle (the extension's
    /// `attestAkHandle`).
    pub attest: Option<u32>,
}

impl Settings {
    /// Merges arguments over the cluster extension.
    pub fn resolve(info: &ExecInfo, args: &Overrides) -> Result<Settings, ExecError> {
        let ext = match info.cluster.as_ref().and_then(|c| c.config.as_ref()) {
            Some(config) => HwkeyExtension::from_json(config).map_err(ExecError::BadExtension)?,
            None => HwkeyExtension::default(),
        };
        let key = match &args.key {
            Some(text) => text.parse()?,
            None => ext.key.ok_or(ExecError::MissingSetting {
                what: "key URI",
                hint: "pass --key URI, or generate the kubeconfig with `hwkey kubeconfig` (it hands the plugin the key in the exec block's HWKEY_EXEC_CLUSTER env)",
            })?,
        };
        let upstream = match &args.upstream {
            Some(text) => text.parse()?,
            None => ext.upstream.ok_or(ExecError::MissingSetting {
                what: "upstream API server",
                hint: "pass --upstream https://APISERVER:6443 or regenerate the kubeconfig with `hwkey kubeconfig --server`",
            })?,
        };
        let server = info
            .cluster
            .as_ref()
            .map(|c| c.server.clone())
            .filter(|s| !s.is_empty());
        let listen = match (&args.listen, &server) {
            (Some(l), _) => l.clone(),
            (None, Some(server)) => listen_from_server(server)?,
            (None, None) => {
                return Err(ExecError::MissingSetting {
                    what: "proxy address",
                    hint: "regenerate the kubeconfig with `hwkey kubeconfig` (its exec block hands the plugin the cluster's server, the proxy's loopback address, in HWKEY_EXEC_CLUSTER), or pass --listen tcp:127.0.0.1:PORT",
                })
            }
        };
        let server =
            server.unwrap_or_else(|| format!("https://{}", listen.trim_start_matches("tcp:")));
        let idle_exit = match &args.idle_exit {
            Some(text) => crate::duration::parse_duration(text)?,
            None => ext.idle_exit.unwrap_or(DEFAULT_IDLE_EXIT),
        };
        Ok(Settings {
            key,
            cert: args.cert.clone().or(ext.cert),
            upstream,
            upstream_ca: args.upstream_ca.clone().or(ext.upstream_ca),
            tls_server_name: args.tls_server_name.clone().or(ext.tls_server_name),
            upstream_proxy: ext.upstream_proxy,
            state_dir: match args.state_dir.clone().or(ext.state_dir) {
                Some(dir) => StateDir::new(dir),
                None => StateDir::plugin_default(&listen),
            },
            listen,
            server,
            idle_exit,
            cert_only: args.cert_only,
            renew: ext.renew,
            attest: ext.attest_ak_handle,
        })
    }

    /// The proxy's control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.state_dir.control_socket()
    }
}

/// `https://127.0.0.1:7443` → `tcp:127.0.0.1:7443`; anything not on loopback is refused, because
/// then the kubeconfig does not point at an hwkey proxy.
pub fn listen_from_server(server: &str) -> Result<String, ExecError> {
    let bad = |problem| ExecError::InvalidServer {
        given: server.to_string(),
        problem,
    };
    let uri: hyper::Uri = server.parse().map_err(|_| bad("not a URL"))?;
    if uri.scheme_str() != Some("https") {
        return Err(bad("the proxy's address must be https://127.0.0.1:PORT"));
    }
    let host = uri.host().ok_or_else(|| bad("no host"))?;
    let ip: std::net::IpAddr = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map_err(|_| bad("must be a loopback IP address such as 127.0.0.1 (the hwkey proxy's address), not a name"))?;
    if !ip.is_loopback() {
        return Err(bad("not a loopback address: the kubeconfig's server must be the local hwkey proxy (see `hwkey kubeconfig`)"));
    }
    let port = uri.port_u16().unwrap_or(443);
    Ok(match ip {
        std::net::IpAddr::V4(v4) => format!("tcp:{v4}:{port}"),
        std::net::IpAddr::V6(v6) => format!("tcp:[{v6}]:{port}"),
    })
}

/// The PIN to hand the proxy when the key URI has no source for it: prompted on the terminal
/// when client-go says the session is interactive, otherwise an error saying what to add.
/// TPM keys and URIs with a `pin-source` need nothing here.
pub fn pin_for(
    settings: &Settings,
    interactive: bool,
) -> Result<Option<Zeroizing<String>>, ExecError> {
    let KeyUri::Pkcs11(uri) = &settings.key else {
        return Ok(None);
    };
    if uri.pin.is_some() {
        return Ok(None);
    }
    if super::control_client::info(&settings.control_socket()).is_ok() {
        // A running proxy already holds its login; only a start needs the PIN. (A socket file
        // alone proves nothing: a killed proxy leaves one behind.)
        return Ok(None);
    }
    if !interactive {
        return Err(ExecError::PinNeeded {
            key: settings.key.to_string(),
        });
    }
    let prompt = format!("PIN for token '{}': ", uri.token_desc());
    let pin = super::pin_prompt::prompt_pin(&prompt).map_err(ExecError::PinPrompt)?;
    Ok(Some(Zeroizing::new(pin)))
}
