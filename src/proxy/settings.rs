//! The proxy's settings: one type for the flags (each with its `HWKEY_*` environment variable)
//! and the `--config` file, merged once and validated once, then handed to each component as
//! its own typed section.
//!
//! - [`SettingsInput`] is what was given: every setting once, as an `Option` (or an empty list,
//!   or `false`), with its flag, its environment variable and its file key (the flag's long
//!   name: `upstream-ca: /etc/kubernetes/ca.crt`) on the same field. clap reads the command
//!   line and the environment into it, serde reads the file into it (unknown keys are an
//!   error, so a typo is not silently ignored), and a derived `Merge` (the `merge` crate) lays
//!   the command line over the file, field by field: command line, then environment, then the
//!   file, then the defaults. A list given on the command line or in the environment replaces
//!   the file's. (clap + serde on one struct rather than figment: the values keep their types
//!   from the start — a PIN in a key URI never passes through a generic value tree — and the
//!   merge is one derived function.)
//! - [`SettingsInput::resolve`] applies the defaults, checks every range and every combination,
//!   and returns [`Settings`]: one section per component (the key, the upstream, the clients,
//!   the admin listener, the lifetime, the renewal, reloading). A component reads its section
//!   and nothing else.
//!
//! A new setting is one field here, one line of [`SettingsInput::resolve`], and the line where
//! its component reads it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use merge::Merge;
use serde::{Deserialize, Serialize};

use super::rotation::RotationClose;
use super::sandbox::SandboxMode;
use crate::duration::parse_duration;
use crate::egress::Egress;
use crate::endpoint::{ListenAddr, UpstreamTarget};
use crate::key::{KeyUri, KeyUriParser};
use crate::pki::tls::KeyExchange;
use crate::state_dir::StateDir;

/// Default `--handshake-timeout`: local plus upstream handshake, each.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `--drain-timeout`.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `--max-connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default `--reload-interval` (how often the cert file is compared).
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Default `--health-cache`: how long one `/healthz` answer stands.
pub const DEFAULT_HEALTH_CACHE: Duration = Duration::from_secs(5);
/// Default `--credential-validity`: loopback credential lifetime when the client asks for none.
pub const DEFAULT_CREDENTIAL_VALIDITY: Duration = Duration::from_secs(600);

/// Every setting as given on the command line, in the environment or in the `--config` file.
#[derive(Debug, Default, Clone, clap::Args, Deserialize, Serialize, Merge)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct SettingsInput {
    /// The hardware key that signs upstream handshakes (pkcs11:… or tpm:…).
    #[arg(long, env = "HWKEY_KEY", value_parser = KeyUriParser)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::option::deserialize",
        serialize_with = "crate::serde_text::option::serialize"
    )]
    pub key: Option<KeyUri>,
    /// Certificate chain (PEM) of the key; default: the one stored with the key. Reloaded when
    /// the file changes.
    #[arg(long, env = "HWKEY_CERT")]
    pub cert: Option<PathBuf>,
    /// The API server, e.g. https://10.0.0.1:6443. Repeatable (the environment variable
    /// takes a comma-separated list): new connections go round robin to the API servers that
    /// are up; one that fails is marked down (1 s, doubling to 30 s) and the connection is
    /// retried on the next.
    #[arg(long, env = "HWKEY_UPSTREAM", value_delimiter = ',')]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::list::one_or_many",
        serialize_with = "crate::serde_text::list::serialize"
    )]
    #[merge(strategy = merge::vec::overwrite_empty)]
    pub upstream: Vec<UpstreamTarget>,
    /// CA bundle that signs the API server's certificate; default: the system roots.
    #[arg(long, env = "HWKEY_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// Forward proxy to the API server: http://HOST:PORT or https://… (CONNECT), socks5://…
    /// Default: HTTPS_PROXY / https_proxy unless NO_PROXY excludes the API server. No
    /// credentials here (argv is visible in `ps`): see --upstream-proxy-auth, or give the URL
    /// in HWKEY_UPSTREAM_PROXY or the config file.
    #[arg(long = "upstream-proxy", id = "upstream_proxy")]
    #[serde(skip)]
    pub upstream_proxy_flag: Option<String>,
    /// `upstream-proxy` in the config file: its URL may carry credentials (a file is not argv).
    #[arg(skip)]
    #[serde(rename = "upstream-proxy")]
    pub upstream_proxy_file: Option<String>,
    /// file:PATH or env:VAR holding the forward proxy's user:password.
    #[arg(long, env = "HWKEY_UPSTREAM_PROXY_AUTH")]
    pub upstream_proxy_auth: Option<String>,
    /// TLS 1.3 key exchange offered to the API server: hybrid (X25519MLKEM768 first, X25519
    /// second; an API server without the hybrid picks X25519 with no extra round trip) or
    /// classical (X25519 first). Default: hybrid.
    #[arg(long, value_enum, env = "HWKEY_KEY_EXCHANGE")]
    pub key_exchange: Option<KeyExchange>,
    /// Name to verify the API server's certificate against (default: the upstream host).
    #[arg(long, env = "HWKEY_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// Where clients connect: unix:PATH (mode 0600, peer uid checked) or
    /// tcp:127.0.0.1:PORT (TLS, loopback client certificate required). Repeatable; the
    /// environment variable takes a comma-separated list.
    #[arg(long, env = "HWKEY_LISTEN", value_delimiter = ',')]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::list::deserialize",
        serialize_with = "crate::serde_text::list::serialize"
    )]
    #[merge(strategy = merge::vec::overwrite_empty)]
    pub listen: Vec<ListenAddr>,
    /// Admin listener for /healthz and /metrics: tcp:127.0.0.1:PORT or unix:PATH.
    #[arg(long, env = "HWKEY_ADMIN")]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::option::deserialize",
        serialize_with = "crate::serde_text::option::serialize"
    )]
    pub admin: Option<ListenAddr>,
    /// Also give this uid the admin port's details (repeatable; comma-separated in the
    /// environment): `/healthz` with reasons and `/metrics`, as the proxy's own uid and root
    /// get them. Other local users get only the last health status, and never cause a check.
    #[arg(
        long = "admin-allow-uid",
        env = "HWKEY_ADMIN_ALLOW_UID",
        value_delimiter = ','
    )]
    #[serde(default)]
    #[merge(strategy = merge::vec::overwrite_empty)]
    pub admin_allow_uid: Vec<u32>,
    /// How long one /healthz answer stands (default 5s, 1s to 1h): probes within it get that
    /// answer at no cost, and when it runs out concurrent probes share one new check.
    #[arg(long, env = "HWKEY_HEALTH_CACHE", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub health_cache: Option<Duration>,
    /// Directory for the loopback CA and the control socket (default:
    /// $XDG_STATE_HOME/hwkey or ~/.local/state/hwkey).
    #[arg(long, env = "HWKEY_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Exit (after draining) when the process holding an flock on this file goes away.
    #[arg(long, env = "HWKEY_LOCK_FILE")]
    pub lock_file: Option<PathBuf>,
    /// Exit after this long without client connections, e.g. 15m (default: never).
    #[arg(long, env = "HWKEY_IDLE_EXIT", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub idle_exit: Option<Duration>,
    /// Limit for the local and for the upstream handshake, each (default 10s).
    #[arg(long, env = "HWKEY_HANDSHAKE_TIMEOUT", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub handshake_timeout: Option<Duration>,
    /// Close a connection after this long without a byte either way (default: never; watches
    /// may be quiet for long).
    #[arg(long, env = "HWKEY_IDLE_TIMEOUT", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub idle_timeout: Option<Duration>,
    /// On SIGTERM, how long open connections may take to finish (default 30s).
    #[arg(long, env = "HWKEY_DRAIN_TIMEOUT", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub drain_timeout: Option<Duration>,
    /// Most client connections open at once; more wait to be accepted (default 4096).
    #[arg(long, env = "HWKEY_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Also accept UNIX-socket peers with this uid (repeatable; comma-separated in the
    /// environment). The proxy's own uid is always accepted.
    #[arg(long = "allow-uid", env = "HWKEY_ALLOW_UID", value_delimiter = ',')]
    #[serde(default)]
    #[merge(strategy = merge::vec::overwrite_empty)]
    pub allow_uid: Vec<u32>,
    /// Allow --listen / --admin on non-loopback addresses (exposes the local hop: avoid).
    #[arg(long, env = "HWKEY_UNSAFE_LISTEN")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub unsafe_listen: bool,
    /// Make no upstream connection ahead of a client. By default, while local clients (loopback
    /// TLS or UNIX socket) come less than 3 s apart (kubectl in a script), one upstream connection is made ahead for
    /// the next one, so its request goes at once; it only resumes a session (no signature) and
    /// is closed after 3 s unused.
    #[arg(long, env = "HWKEY_NO_PRECONNECT")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub no_preconnect: bool,
    /// For an RSA key on a token without RSA-PSS and without raw RSA (CKM_RSA_X_509): connect
    /// upstream over TLS 1.2 with PKCS#1 v1.5 signatures instead of refusing to start.
    #[arg(long, env = "HWKEY_ALLOW_TLS12_FALLBACK")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub allow_tls12_fallback: bool,
    /// Renew the certificate through the Kubernetes CSR API at 70-90 % of its lifetime, signed
    /// in the hardware, and use the new one at once (see `hwkey renew`).
    #[arg(long, env = "HWKEY_RENEW")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub renew: bool,
    /// With --renew: make a fresh hardware key for each renewal and delete the previous one
    /// once the new certificate is in use (the key in use is kept in STATE/current-key).
    #[arg(long, env = "HWKEY_ROTATE_KEY")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub rotate_key: bool,
    /// With --renew and a TPM key: each renewal request carries TPM2_Certify evidence, so an
    /// attesting approver (`hwkey approver`) can tell the key lives in this TPM.
    #[arg(long, env = "HWKEY_ATTEST")]
    #[serde(default)]
    #[merge(strategy = merge::bool::overwrite_false)]
    pub attest: bool,
    /// With --attest: the attestation key's persistent handle (made there once if missing;
    /// default 0x81010002).
    #[arg(long, env = "HWKEY_AK_HANDLE", value_parser = crate::key::attestation::parse_persistent_handle)]
    #[serde(default, deserialize_with = "handle")]
    pub ak_handle: Option<u32>,
    /// When connections opened with a replaced certificate are closed: at its expiry (default;
    /// they survive reloads) or immediately (what kubelet does after a rotation).
    #[arg(long, value_enum, env = "HWKEY_ROTATION_CLOSE")]
    pub rotation_close: Option<RotationClose>,
    /// Default lifetime of loopback credentials from the control socket (default 10m).
    #[arg(long, env = "HWKEY_CREDENTIAL_VALIDITY", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub credential_validity: Option<Duration>,
    /// How often the --cert file is checked for changes (default 2s).
    #[arg(long, env = "HWKEY_RELOAD_INTERVAL", value_parser = parse_duration)]
    #[serde(
        default,
        deserialize_with = "crate::serde_text::duration::deserialize",
        serialize_with = "crate::serde_text::duration::serialize"
    )]
    pub reload_interval: Option<Duration>,
    /// Refuse a key that could leave its device: a PKCS#11 key with CKA_EXTRACTABLE true,
    /// CKA_NEVER_EXTRACTABLE false or CKA_SENSITIVE false; a TPM key without fixedTPM (default
    /// true).
    #[arg(long, env = "HWKEY_REQUIRE_NON_EXTRACTABLE", action = clap::ArgAction::Set, value_name = "true|false")]
    pub require_non_extractable: Option<bool>,
    /// How the network side confines itself (Landlock and a seccomp filter): auto (as far as
    /// the kernel allows, saying what is not enforced; the default), required (refuse to start
    /// without both), off (debugging).
    #[arg(long, value_enum, env = "HWKEY_SANDBOX")]
    pub sandbox: Option<SandboxMode>,
}

/// The settings as `hwkey proxy` hands them to its network side (`hwkey-net`), which reads no
/// argument, environment variable or file for them: what was given, merged and checked once,
/// before the signer side starts. A key URI travels in its text form, which never holds a
/// `pin-value`: a PIN written in the URI or the configuration file, or read from standard input,
/// stays with the signer side.
#[derive(Debug, Serialize, Deserialize)]
pub struct NetworkSideSettings {
    given: SettingsInput,
    /// `--upstream-proxy` from the command line (the file's travels in `given`: the two are
    /// checked differently).
    upstream_proxy_flag: Option<String>,
}

impl NetworkSideSettings {
    /// What the network side is given: `given` without any PIN.
    pub fn new(given: &SettingsInput) -> NetworkSideSettings {
        let mut given = given.clone();
        given.key = given.key.as_ref().map(KeyUri::without_pin_value);
        let upstream_proxy_flag = given.upstream_proxy_flag.take();
        NetworkSideSettings {
            given,
            upstream_proxy_flag,
        }
    }

    /// The settings, resolved as `hwkey proxy` resolved them.
    pub fn resolve(self) -> Result<Settings, SettingsError> {
        let mut given = self.given;
        given.upstream_proxy_flag = self.upstream_proxy_flag;
        given.resolve()
    }
}

/// serde: an optional persistent TPM handle, written as text (`"0x81010002"`) or a number.
fn handle<'de, D>(d: D) -> Result<Option<u32>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Handle {
        Number(u32),
        Text(String),
    }
    Option::<Handle>::deserialize(d)?
        .map(|h| {
            let text = match h {
                Handle::Number(n) => n.to_string(),
                Handle::Text(s) => s,
            };
            crate::key::attestation::parse_persistent_handle(&text)
                .map_err(serde::de::Error::custom)
        })
        .transpose()
}

/// The settings, resolved: one section per component.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The hardware key and the policy it is opened under.
    pub key: KeySettings,
    /// The API servers and the way to them.
    pub upstream: UpstreamSettings,
    /// The client listeners and the local hop.
    pub clients: ClientSettings,
    /// The `/healthz` and `/metrics` listener, if any.
    pub admin: Option<AdminSettings>,
    /// When the proxy stops.
    pub lifetime: LifetimeSettings,
    /// Renewal through the CSR API (`--renew`), if on.
    pub renewal: Option<RenewalSettings>,
    /// Watching the certificate and CA files.
    pub reload: ReloadSettings,
    /// The loopback CA and the control socket.
    pub state_dir: StateDir,
    /// How the network side confines itself.
    pub sandbox: SandboxMode,
}

/// The key section.
#[derive(Debug, Clone)]
pub struct KeySettings {
    /// The hardware key (with `--rotate-key`, as configured: the key in use may be a newer one).
    pub uri: KeyUri,
    /// Its certificate chain file; None: the chain stored with the key.
    pub cert: Option<PathBuf>,
    /// Refuse a key the device says could leave it.
    pub require_non_extractable: bool,
    /// Let a PKCS#1-only RSA key connect over TLS 1.2.
    pub allow_tls12_fallback: bool,
}

/// The upstream section.
#[derive(Debug, Clone)]
pub struct UpstreamSettings {
    /// The API servers (at least one).
    pub targets: Vec<UpstreamTarget>,
    /// Their CA bundle; None: the system roots.
    pub ca: Option<PathBuf>,
    /// Straight, or through a forward proxy.
    pub egress: Egress,
    /// The TLS 1.3 key exchange offered.
    pub key_exchange: KeyExchange,
    /// The name their certificates are checked against (default: each one's host).
    pub tls_server_name: Option<String>,
    /// How long one connection attempt may take.
    pub handshake_timeout: Duration,
    /// Make an upstream connection ahead for the next loopback client while clients come in a
    /// burst (`proxy::spare`).
    pub preconnect: bool,
}

/// The clients section: listeners, the local hop's rules, connection limits.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// The client listeners (at least one).
    pub listen: Vec<ListenAddr>,
    /// UNIX-socket (and control-socket) peers allowed besides the proxy's own uid.
    pub allow_uids: Vec<u32>,
    /// Non-loopback listeners allowed.
    pub unsafe_listen: bool,
    /// Most client connections open at once.
    pub max_connections: usize,
    /// How long the local handshake may take.
    pub handshake_timeout: Duration,
    /// Close a bridged connection after this long without a byte (None: never).
    pub idle_timeout: Option<Duration>,
    /// Default lifetime of loopback credentials.
    pub credential_validity: Duration,
    /// When connections opened with a replaced certificate are closed.
    pub rotation_close: RotationClose,
}

/// The admin section.
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// Where `/healthz` and `/metrics` are served.
    pub listen: ListenAddr,
    /// Peers admitted like the proxy's own uid (`--allow-uid`).
    pub allow_uids: Vec<u32>,
    /// Monitoring uids that get the details (`--admin-allow-uid`).
    pub monitor_uids: Vec<u32>,
    /// How long one `/healthz` answer stands.
    pub health_cache: Duration,
}

/// The lifetime section.
#[derive(Debug, Clone)]
pub struct LifetimeSettings {
    /// Exit when the holder of an flock on this file goes away.
    pub lock_file: Option<PathBuf>,
    /// Exit after this long without clients.
    pub idle_exit: Option<Duration>,
    /// On SIGTERM, how long open connections may take to finish.
    pub drain_timeout: Duration,
}

/// The renewal section (`--renew`).
#[derive(Debug, Clone)]
pub struct RenewalSettings {
    /// A fresh hardware key per renewal.
    pub rotate_key: bool,
    /// The attestation key's persistent handle, when requests carry TPM evidence.
    pub attest: Option<u32>,
}

/// The reload section.
#[derive(Debug, Clone)]
pub struct ReloadSettings {
    /// How often the certificate and CA files are compared.
    pub interval: Duration,
}

/// Settings that cannot be used, each saying what to fix.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum SettingsError {
    #[error("no --key given: the hardware key URI (pkcs11:… or tpm:…)")]
    NoKey,

    #[error("no --upstream given: the API server URL, e.g. https://10.0.0.1:6443")]
    NoUpstream,

    #[error("no --listen address given: add e.g. --listen unix:/run/hwkey/proxy.sock or --listen tcp:127.0.0.1:6443")]
    NoListener,

    #[error("refusing to listen on {addr}: it is not a loopback address and the local hop would be exposed; pass --unsafe-listen if you really mean it")]
    NonLoopbackListen { addr: ListenAddr },

    #[error("--attest needs --renew: the evidence goes into the renewal requests")]
    AttestNeedsRenew,

    #[error("--attest needs a TPM key (tpm:…): only a TPM can certify that the key lives in it; drop --attest for PKCS#11 keys")]
    AttestNeedsTpm,

    #[error("--rotate-key needs --renew: keys are rotated when the certificate is renewed")]
    RotateKeyNeedsRenew,

    #[error("{what} must be more than 0 (e.g. 10s)")]
    ZeroDuration { what: &'static str },

    #[error("{what} = {given} cannot work: use {range}")]
    OutOfRange {
        what: &'static str,
        given: String,
        range: String,
    },

    #[error("{what}: {source}")]
    Egress {
        what: &'static str,
        #[source]
        source: crate::egress::EgressError,
    },

    #[error("cannot read config file {path}: {source}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid config file {path}: {problem}")]
    BadConfig {
        path: PathBuf,
        #[source]
        problem: Box<ConfigProblem>,
    },
}

/// Why a `--config` file does not parse, for [`SettingsError::BadConfig`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ConfigProblem {
    #[error("{0}")]
    Toml(#[source] toml::de::Error),
    #[error("{0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("neither TOML ({toml}) nor YAML ({yaml}); name the file .toml or .yaml for a precise message")]
    Neither {
        toml: toml::de::Error,
        #[source]
        yaml: serde_yaml_ng::Error,
    },
}

impl SettingsInput {
    /// Reads a `--config` file: TOML (`.toml`) or YAML (`.yaml`, `.yml`); other names are tried
    /// as TOML, then YAML. Keys are the flags' long names.
    pub fn from_file(path: &Path) -> Result<SettingsInput, SettingsError> {
        let text = crate::small_file::read_to_string(path).map_err(|source| {
            SettingsError::ReadConfig {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let bad = |problem| SettingsError::BadConfig {
            path: path.to_path_buf(),
            problem: Box::new(problem),
        };
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        match ext.as_str() {
            "toml" => toml::from_str(&text).map_err(|e| bad(ConfigProblem::Toml(e))),
            "yaml" | "yml" => {
                serde_yaml_ng::from_str(&text).map_err(|e| bad(ConfigProblem::Yaml(e)))
            }
            _ => toml::from_str(&text).or_else(|toml| {
                serde_yaml_ng::from_str(&text)
                    .map_err(|yaml| bad(ConfigProblem::Neither { toml, yaml }))
            }),
        }
    }

    /// Applies the defaults and checks every value and combination.
    pub fn resolve(self) -> Result<Settings, SettingsError> {
        self.check_ranges()?;
        let key = self.check_combinations()?;
        let handshake_timeout = positive("handshake-timeout", self.handshake_timeout)?
            .unwrap_or(DEFAULT_HANDSHAKE_TIMEOUT);
        Ok(Settings {
            key: KeySettings {
                uri: key,
                cert: self.cert.clone(),
                require_non_extractable: self.require_non_extractable.unwrap_or(true),
                allow_tls12_fallback: self.allow_tls12_fallback,
            },
            upstream: UpstreamSettings {
                targets: self.upstream.clone(),
                ca: self.upstream_ca.clone(),
                egress: self.egress()?,
                key_exchange: self.key_exchange.unwrap_or_default(),
                tls_server_name: self.tls_server_name.clone(),
                handshake_timeout,
                preconnect: !self.no_preconnect,
            },
            clients: ClientSettings {
                listen: self.listen.clone(),
                allow_uids: self.allow_uid.clone(),
                unsafe_listen: self.unsafe_listen,
                max_connections: self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
                handshake_timeout,
                idle_timeout: self.idle_timeout.filter(|d| !d.is_zero()),
                credential_validity: positive("credential-validity", self.credential_validity)?
                    .unwrap_or(DEFAULT_CREDENTIAL_VALIDITY),
                rotation_close: self.rotation_close.unwrap_or_default(),
            },
            admin: self.admin.clone().map(|listen| AdminSettings {
                listen,
                allow_uids: self.allow_uid.clone(),
                monitor_uids: self.admin_allow_uid.clone(),
                health_cache: self.health_cache.unwrap_or(DEFAULT_HEALTH_CACHE),
            }),
            lifetime: LifetimeSettings {
                lock_file: self.lock_file.clone(),
                idle_exit: self.idle_exit,
                drain_timeout: self.drain_timeout.unwrap_or(DEFAULT_DRAIN_TIMEOUT),
            },
            renewal: self.renew.then(|| RenewalSettings {
                rotate_key: self.rotate_key,
                attest: self.attest.then(|| {
                    self.ak_handle
                        .unwrap_or(crate::key::attestation::DEFAULT_AK_HANDLE)
                }),
            }),
            reload: ReloadSettings {
                interval: self.reload_interval.unwrap_or(DEFAULT_RELOAD_INTERVAL),
            },
            state_dir: match self.state_dir {
                Some(dir) => StateDir::new(dir),
                None => StateDir::proxy_default(),
            },
            sandbox: self.sandbox.unwrap_or_default(),
        })
    }

    /// What must be given, and what must go together; the key.
    fn check_combinations(&self) -> Result<KeyUri, SettingsError> {
        let key = self.key.clone().ok_or(SettingsError::NoKey)?;
        if self.upstream.is_empty() {
            return Err(SettingsError::NoUpstream);
        }
        if self.listen.is_empty() {
            return Err(SettingsError::NoListener);
        }
        for addr in self.listen.iter().chain(self.admin.iter()) {
            if !addr.is_local() && !self.unsafe_listen {
                return Err(SettingsError::NonLoopbackListen { addr: addr.clone() });
            }
        }
        if self.rotate_key && !self.renew {
            return Err(SettingsError::RotateKeyNeedsRenew);
        }
        check_attest(self.attest, self.renew, &key)?;
        Ok(key)
    }

    fn egress(&self) -> Result<Egress, SettingsError> {
        egress(
            self.upstream_proxy_flag.as_deref(),
            self.upstream_proxy_auth.as_deref(),
            self.upstream_proxy_file.as_deref(),
        )
    }

    /// Settings that cannot work are refused up front: a 1 ns handshake timeout refuses every
    /// client, a 1 ns idle-exit exits at once, no connection slot serves nobody, and a drain
    /// longer than a day overflows the clock. Zero durations are [`positive`]'s business.
    fn check_ranges(&self) -> Result<(), SettingsError> {
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        const DAY: u64 = 24 * 3600;
        for (what, given, min, max) in [
            (
                "handshake-timeout",
                self.handshake_timeout,
                ms(100),
                s(3600),
            ),
            ("idle-exit", self.idle_exit, s(1), s(365 * DAY)),
            ("idle-timeout", self.idle_timeout, s(1), s(365 * DAY)),
            ("drain-timeout", self.drain_timeout, s(0), s(DAY)),
            (
                "credential-validity",
                self.credential_validity,
                s(10),
                s(DAY),
            ),
            ("reload-interval", self.reload_interval, ms(100), s(DAY)),
            (
                "health-cache",
                positive("health-cache", self.health_cache)?,
                s(1),
                s(3600),
            ),
        ] {
            if let Some(d) = given.filter(|d| !d.is_zero() && (*d < min || *d > max)) {
                return Err(SettingsError::OutOfRange {
                    what,
                    given: humantime::format_duration(d).to_string(),
                    range: format!(
                        "{} to {}",
                        humantime::format_duration(min),
                        humantime::format_duration(max)
                    ),
                });
            }
        }
        if self.max_connections == Some(0) {
            return Err(SettingsError::OutOfRange {
                what: "max-connections",
                given: "0".into(),
                range: "1 or more".into(),
            });
        }
        Ok(())
    }
}

/// The way to the API server (the proxy's, and `hwkey probe`'s): `flag` (`--upstream-proxy`:
/// no credentials on argv), else `HWKEY_UPSTREAM_PROXY`, else `file` (the config file's
/// `upstream-proxy`), else the environment's `HTTPS_PROXY` with `NO_PROXY`; credentials from
/// `auth` (`file:PATH` or `env:VAR`) replace any in the URL.
pub fn egress(
    flag: Option<&str>,
    auth: Option<&str>,
    file: Option<&str>,
) -> Result<Egress, SettingsError> {
    use crate::egress::{ForwardProxy, ProxyCredentials};
    let wrap = |what| move |source| SettingsError::Egress { what, source };
    let env = std::env::var("HWKEY_UPSTREAM_PROXY")
        .ok()
        .filter(|v| !v.is_empty());
    let proxy = match (flag, env, file) {
        (Some(url), _, _) => Some(ForwardProxy::parse_argv(url).map_err(wrap("--upstream-proxy"))?),
        (None, Some(url), _) => {
            Some(ForwardProxy::parse(&url).map_err(wrap("HWKEY_UPSTREAM_PROXY"))?)
        }
        (None, None, Some(url)) => Some(ForwardProxy::parse(url).map_err(wrap("upstream-proxy"))?),
        (None, None, None) => None,
    };
    let egress = Egress::explicit_or_env(proxy).map_err(wrap("HTTPS_PROXY"))?;
    Ok(match auth {
        Some(source) => {
            let source = ProxyCredentials::source(source)
                .map_err(wrap("--upstream-proxy-auth (hwkey probe: --proxy-auth)"))?;
            egress.with_credentials(
                ProxyCredentials::read(&source)
                    .map_err(wrap("--upstream-proxy-auth (hwkey probe: --proxy-auth)"))?,
            )
        }
        None => egress,
    })
}

/// A duration that must not be zero: a zero handshake timeout refuses every client, a zero
/// credential validity mints certificates that are expired on arrival.
fn positive(what: &'static str, d: Option<Duration>) -> Result<Option<Duration>, SettingsError> {
    match d {
        Some(d) if d.is_zero() => Err(SettingsError::ZeroDuration { what }),
        other => Ok(other),
    }
}

impl Settings {
    /// The API servers, comma-separated (for messages).
    pub fn upstream_text(&self) -> String {
        self.upstream
            .targets
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `--attest` (TPM evidence in renewal requests) needs `--renew` and a TPM key: the proxy's
/// flags and `hwkey kubeconfig --renew --attest` (which starts the proxy with them) say so alike.
pub fn check_attest(attest: bool, renew: bool, key: &KeyUri) -> Result<(), SettingsError> {
    if attest && !renew {
        return Err(SettingsError::AttestNeedsRenew);
    }
    if attest && !matches!(key, KeyUri::Tpm(_)) {
        return Err(SettingsError::AttestNeedsTpm);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    /// What the network side receives resolves to the same settings as `hwkey proxy`'s, every
    /// setting given, but with no PIN: not in the key URI, not anywhere in the message.
    #[test]
    fn the_network_side_receives_the_same_settings_without_the_pin() {
        let (_dir, path) = file(
            "all.toml",
            r#"
key = "pkcs11:token=k%20y;object=a;id=%01%ff?module-path=/m.so&pin-value=s3cr3t-pin"
cert = "/c.pem"
upstream = ["https://10.0.0.1:6443", "https://[fd00::1]", "https://api.example:443"]
upstream-ca = "/ca.pem"
upstream-proxy = "http://u:p@proxy.example:3128"
key-exchange = "classical"
tls-server-name = "kubernetes"
listen = ["unix:/run/x.sock", "tcp:127.0.0.1:6443"]
admin = "tcp:[::1]:9100"
admin-allow-uid = [5]
health-cache = "7s"
state-dir = "/s"
lock-file = "/l"
idle-exit = "15m"
handshake-timeout = "1m 30s"
idle-timeout = "2h"
drain-timeout = 45
max-connections = 9
allow-uid = [1, 2]
allow-tls12-fallback = true
renew = true
rotate-key = true
rotation-close = "immediate"
credential-validity = "5m"
reload-interval = "3s"
require-non-extractable = false
sandbox = "required"
"#,
        );
        let given = SettingsInput::from_file(&path).expect("parse");
        let mut flagged = given.clone();
        flagged.upstream_proxy_flag = Some("http://proxy.example:3128".into());
        for given in [given, flagged] {
            let wire = serde_json::to_string(&NetworkSideSettings::new(&given)).expect("encode");
            assert!(!wire.contains("s3cr3t"), "{wire}");
            let there: NetworkSideSettings = serde_json::from_str(&wire).expect("decode");
            let there = there.resolve().expect("resolve there");
            let mut here = given.resolve().expect("resolve here");
            here.key.uri = here.key.uri.without_pin_value();
            assert_eq!(format!("{there:?}"), format!("{here:?}"));
        }
    }

    #[test]
    fn file_config_toml_and_yaml() {
        let (_d, t) = file(
            "p.toml",
            "upstream = \"https://127.0.0.1:6443\"\nlisten = [\"unix:/tmp/a\"]\nallow-uid = [1000]\n",
        );
        let c = SettingsInput::from_file(&t).expect("toml");
        assert_eq!(c.listen, vec![ListenAddr::Unix("/tmp/a".into())]);
        assert_eq!(c.allow_uid, vec![1000]);
        assert_eq!(c.upstream.first().map(|u| u.port), Some(6443));
        let (_d, y) = file("p.yaml", "upstream-ca: /ca.pem\nmax-connections: 7\n");
        assert_eq!(
            SettingsInput::from_file(&y).expect("yaml").max_connections,
            Some(7)
        );
        let (_d, typo) = file("p.yaml", "upstream_typo: x\n");
        assert!(SettingsInput::from_file(&typo).is_err());
        // Flags that only the command line has are not file keys.
        let (_d, cli) = file("p.toml", "pin-stdin = true\n");
        assert!(SettingsInput::from_file(&cli).is_err());
    }

    #[test]
    fn file_values_are_typed_with_the_flags_syntax() {
        let (_d, t) = file(
            "p.toml",
            "idle-exit = \"1h30m\"\nhandshake-timeout = 5\ndrain-timeout = \"1h 2m\"\nadmin = \"tcp:127.0.0.1:0\"\n",
        );
        let c = SettingsInput::from_file(&t).expect("parses");
        assert_eq!(c.idle_exit, Some(Duration::from_secs(5400)));
        assert_eq!(c.handshake_timeout, Some(Duration::from_secs(5)));
        assert_eq!(c.drain_timeout, Some(Duration::from_secs(3720)));
        assert!(matches!(c.admin, Some(ListenAddr::Tcp(_))));
        let (_d, t) = file("p.toml", "upstream = \"http://x:1\"\n");
        let e = SettingsInput::from_file(&t).unwrap_err().to_string();
        assert!(e.contains("https://") && e.contains("upstream"), "{e}");
        let (_d, t) = file("p.toml", "idle-exit = \"ten minutes\"\n");
        let e = SettingsInput::from_file(&t).unwrap_err().to_string();
        assert!(e.contains("ten minutes") && e.contains("idle-exit"), "{e}");
    }

    #[test]
    fn attestation_keys_are_persistent_handles() {
        let (_d, t) = file("p.toml", "attest = true\nak-handle = \"0x81010003\"\n");
        let c = SettingsInput::from_file(&t).expect("parses");
        assert_eq!((c.attest, c.ak_handle), (true, Some(0x8101_0003)));
        let (_d, t) = file("p.toml", "ak-handle = 2164326403\n");
        assert_eq!(
            SettingsInput::from_file(&t).expect("parses").ak_handle,
            Some(0x8101_0003)
        );
        let (_d, t) = file("p.toml", "ak-handle = \"0x80000001\"\n");
        let e = SettingsInput::from_file(&t).unwrap_err().to_string();
        assert!(
            e.contains("0x81000000-0x81ffffff") && e.contains("ak-handle"),
            "{e}"
        );
    }

    fn minimal() -> SettingsInput {
        SettingsInput {
            key: Some("pkcs11:token=t;object=o".parse().expect("uri")),
            upstream: vec!["https://127.0.0.1:6443".parse().expect("url")],
            listen: vec!["unix:/tmp/p.sock".parse().expect("addr")],
            ..SettingsInput::default()
        }
    }

    #[test]
    fn the_command_line_wins_over_the_file_field_by_field() {
        let mut cli = minimal();
        cli.handshake_timeout = Some(Duration::from_secs(3));
        let file = SettingsInput {
            handshake_timeout: Some(Duration::from_secs(20)),
            drain_timeout: Some(Duration::from_secs(40)),
            listen: vec!["tcp:127.0.0.1:1".parse().expect("addr")],
            renew: true,
            ..SettingsInput::default()
        };
        cli.merge(file);
        let s = cli.resolve().expect("valid");
        assert_eq!(s.upstream.handshake_timeout, Duration::from_secs(3));
        assert_eq!(s.lifetime.drain_timeout, Duration::from_secs(40));
        assert_eq!(
            s.clients.listen.len(),
            1,
            "the command line's list replaces the file's"
        );
        assert!(matches!(s.clients.listen[0], ListenAddr::Unix(_)));
        assert!(s.renewal.is_some());
    }

    #[test]
    fn combinations_and_ranges_are_checked_once() {
        let with = |f: fn(&mut SettingsInput)| {
            let mut s = minimal();
            f(&mut s);
            s.resolve().map(|_| ()).map_err(|e| e.to_string())
        };
        assert!(with(|_| {}).is_ok());
        for (f, want) in [
            (
                (|s: &mut SettingsInput| s.rotate_key = true) as fn(&mut SettingsInput),
                "needs --renew",
            ),
            (|s| s.attest = true, "needs --renew"),
            (
                |s| {
                    s.attest = true;
                    s.renew = true;
                },
                "needs a TPM key",
            ),
            (
                |s| s.handshake_timeout = Some(Duration::ZERO),
                "more than 0",
            ),
            (
                |s| s.handshake_timeout = Some(Duration::from_nanos(1)),
                "cannot work",
            ),
            (|s| s.max_connections = Some(0), "1 or more"),
            (|s| s.health_cache = Some(Duration::ZERO), "more than 0"),
            (
                |s| s.health_cache = Some(Duration::from_secs(7200)),
                "cannot work",
            ),
            (
                |s| s.listen = vec!["tcp:0.0.0.0:1".parse().expect("addr")],
                "not a loopback",
            ),
            (|s| s.key = None, "no --key"),
        ] {
            let e = with(f).expect_err(want);
            assert!(e.contains(want), "{e}");
        }
    }
}
