//! `hwkey proxy`: flags, environment and `--config` file merged into a typed
//! [`ProxyConfig`], then [`proxy::run`].
//!
//! Precedence: command line, then environment (`HWKEY_*`), then the config file, then the
//! defaults. List flags (`--listen`, `--allow-uid`) given on the command line or in the
//! environment replace the file's list.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::key::KeyUri;
use crate::proxy::{
    self, config::parse_duration, FileConfig, ListenAddr, ProxyConfig, UpstreamTarget,
};
use crate::state_dir::StateDir;

#[derive(Debug, Args)]
#[command(
    long_about = "Accepts kubectl/kubelet connections on loopback TLS and UNIX sockets and re-originates each one to the API server over mTLS signed inside the hardware key. Prints a line starting with 'hwkey proxy: ready' on stderr once listening. SIGHUP reloads the certificate; SIGTERM drains and exits 0."
)]
pub struct ProxyArgs {
    /// The hardware key that signs upstream handshakes (pkcs11:… or tpm:…).
    #[arg(long, env = "HWKEY_KEY", value_parser = super::KeyUriParser)]
    key: Option<KeyUri>,
    /// Certificate chain (PEM) of the key; default: the one stored with the key. Reloaded when
    /// the file changes.
    #[arg(long, env = "HWKEY_CERT")]
    cert: Option<PathBuf>,
    /// The API server, e.g. https://10.0.0.1:6443. Repeatable (the environment variable
    /// takes a comma-separated list): new connections go round robin to the API servers that
    /// are up; one that fails is marked down (1 s, doubling to 30 s) and the connection is
    /// retried on the next.
    #[arg(long, env = "HWKEY_UPSTREAM", value_delimiter = ',')]
    upstream: Vec<UpstreamTarget>,
    /// CA bundle that signs the API server's certificate; default: the system roots.
    #[arg(long, env = "HWKEY_UPSTREAM_CA")]
    upstream_ca: Option<PathBuf>,
    /// Forward proxy to the API server: http://HOST:PORT or https://… (CONNECT), socks5://…
    /// Default: HTTPS_PROXY / https_proxy unless NO_PROXY excludes the API server. No
    /// credentials here (argv is visible in `ps`): see --upstream-proxy-auth, or give the URL
    /// in HWKEY_UPSTREAM_PROXY or the config file.
    #[arg(long)]
    upstream_proxy: Option<String>,
    /// file:PATH or env:VAR holding the forward proxy's user:password.
    #[arg(long, env = "HWKEY_UPSTREAM_PROXY_AUTH")]
    upstream_proxy_auth: Option<String>,
    /// TLS 1.3 key exchange offered to the API server: hybrid (X25519MLKEM768 first, X25519
    /// second; an API server without the hybrid picks X25519 with no extra round trip) or
    /// classical (X25519 first). Default: hybrid.
    #[arg(long, value_enum, env = "HWKEY_KEY_EXCHANGE")]
    key_exchange: Option<crate::pki::tls::KeyExchange>,
    /// Name to verify the API server's certificate against (default: the upstream host).
    #[arg(long, env = "HWKEY_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
    /// Where clients connect: unix:PATH (mode 0600, peer uid checked) or
    /// tcp:127.0.0.1:PORT (TLS, loopback client certificate required). Repeatable; the
    /// environment variable takes a comma-separated list.
    #[arg(long, env = "HWKEY_LISTEN", value_delimiter = ',')]
    listen: Vec<ListenAddr>,
    /// Admin listener for /healthz and /metrics: tcp:127.0.0.1:PORT or unix:PATH.
    #[arg(long, env = "HWKEY_ADMIN")]
    admin: Option<ListenAddr>,
    /// Directory for the loopback CA and the control socket (default:
    /// $XDG_STATE_HOME/hwkey or ~/.local/state/hwkey).
    #[arg(long, env = "HWKEY_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// A TOML or YAML file with the same settings (keys named like the flags, e.g. upstream-ca).
    #[arg(long, env = "HWKEY_CONFIG")]
    config: Option<PathBuf>,
    /// Exit (after draining) when the process holding an flock on this file goes away.
    #[arg(long, env = "HWKEY_LOCK_FILE")]
    lock_file: Option<PathBuf>,
    /// Exit after this long without client connections, e.g. 15m (default: never).
    #[arg(long, env = "HWKEY_IDLE_EXIT", value_parser = parse_duration)]
    idle_exit: Option<Duration>,
    /// Limit for the local and for the upstream handshake, each (default 10s).
    #[arg(long, env = "HWKEY_HANDSHAKE_TIMEOUT", value_parser = parse_duration)]
    handshake_timeout: Option<Duration>,
    /// Close a connection after this long without a byte either way (default: never; watches
    /// may be quiet for long).
    #[arg(long, env = "HWKEY_IDLE_TIMEOUT", value_parser = parse_duration)]
    idle_timeout: Option<Duration>,
    /// On SIGTERM, how long open connections may take to finish (default 30s).
    #[arg(long, env = "HWKEY_DRAIN_TIMEOUT", value_parser = parse_duration)]
    drain_timeout: Option<Duration>,
    /// Most client connections open at once; more wait to be accepted (default 4096).
    #[arg(long, env = "HWKEY_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Also accept UNIX-socket peers with this uid (repeatable; comma-separated in the
    /// environment). The proxy's own uid is always accepted.
    #[arg(long = "allow-uid", env = "HWKEY_ALLOW_UID", value_delimiter = ',')]
    allow_uid: Vec<u32>,
    /// Allow --listen / --admin on non-loopback addresses (exposes the local hop: avoid).
    #[arg(long, env = "HWKEY_UNSAFE_LISTEN")]
    unsafe_listen: bool,
    /// For an RSA key on a token without RSA-PSS and without raw RSA (CKM_RSA_X_509): connect
    /// upstream over TLS 1.2 with PKCS#1 v1.5 signatures instead of refusing to start.
    #[arg(long, env = "HWKEY_ALLOW_TLS12_FALLBACK")]
    allow_tls12_fallback: bool,
    /// Read the token PIN from standard input (one line) at start and keep it only in locked,
    /// wiped memory: how `hwkey credential` hands a prompted PIN to the proxy it starts (never
    /// argv, never the environment).
    #[arg(long, env = "HWKEY_PIN_STDIN")]
    pin_stdin: bool,
    /// Renew the certificate through the Kubernetes CSR API at 70-90 % of its lifetime, signed
    /// in the hardware, and use the new one at once (see `hwkey renew`).
    #[arg(long, env = "HWKEY_RENEW")]
    renew: bool,
    /// With --renew: make a fresh hardware key for each renewal and delete the previous one
    /// once the new certificate is in use (the key in use is kept in STATE/current-key).
    #[arg(long, env = "HWKEY_ROTATE_KEY")]
    rotate_key: bool,
    /// With --renew and a TPM key: each renewal request carries TPM2_Certify evidence, so an
    /// attesting approver (`hwkey approver`) can tell the key lives in this TPM.
    #[arg(long, env = "HWKEY_ATTEST")]
    attest: bool,
    /// With --attest: the attestation key's persistent handle (made there once if missing;
    /// default 0x81010002).
    #[arg(long, env = "HWKEY_AK_HANDLE", value_parser = super::attest::parse_handle)]
    ak_handle: Option<u32>,
    /// When connections opened with a replaced certificate are closed: at its expiry (default;
    /// they survive reloads) or immediately (what kubelet does after a rotation).
    #[arg(long, value_enum, env = "HWKEY_ROTATION_CLOSE")]
    rotation_close: Option<proxy::rotation::RotationClose>,
    /// Default lifetime of loopback credentials from the control socket (default 10m).
    #[arg(long, env = "HWKEY_CREDENTIAL_VALIDITY", value_parser = parse_duration)]
    credential_validity: Option<Duration>,
    /// How often the --cert file is checked for changes (default 2s).
    #[arg(long, env = "HWKEY_RELOAD_INTERVAL", value_parser = parse_duration)]
    reload_interval: Option<Duration>,
    #[command(flatten)]
    policy: super::KeyPolicy,
}

/// Merges flags, environment and the config file into a typed config.
fn resolve(args: ProxyArgs) -> anyhow::Result<ProxyConfig> {
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    check_ranges(&args, &file)?;
    let key = args.key.or(file.key).ok_or(proxy::ProxyError::NoKey)?;
    let upstreams = flags_or_file(args.upstream, file.upstream);
    if upstreams.is_empty() {
        return Err(proxy::ProxyError::NoUpstream.into());
    }
    let egress = egress(
        args.upstream_proxy.as_deref(),
        args.upstream_proxy_auth.or(file.upstream_proxy_auth),
        file.upstream_proxy.as_deref(),
    )?;
    Ok(ProxyConfig {
        key,
        cert: args.cert.or(file.cert),
        upstreams,
        upstream_ca: args.upstream_ca.or(file.upstream_ca),
        egress,
        key_exchange: args.key_exchange.or(file.key_exchange).unwrap_or_default(),
        tls_server_name: args.tls_server_name.or(file.tls_server_name),
        listen: flags_or_file(args.listen, file.listen),
        admin: args.admin.or(file.admin),
        state_dir: match args.state_dir.or(file.state_dir) {
            Some(dir) => StateDir::new(dir),
            None => StateDir::proxy_default(),
        },
        lock_file: args.lock_file.or(file.lock_file),
        idle_exit: args.idle_exit.or(file.idle_exit),
        handshake_timeout: positive(
            "handshake-timeout",
            args.handshake_timeout.or(file.handshake_timeout),
        )?
        .unwrap_or(proxy::DEFAULT_HANDSHAKE_TIMEOUT),
        idle_timeout: args.idle_timeout.or(file.idle_timeout),
        drain_timeout: args
            .drain_timeout
            .or(file.drain_timeout)
            .unwrap_or(proxy::DEFAULT_DRAIN_TIMEOUT),
        max_connections: args
            .max_connections
            .or(file.max_connections)
            .unwrap_or(proxy::DEFAULT_MAX_CONNECTIONS),
        allow_uids: flags_or_file(args.allow_uid, file.allow_uid),
        unsafe_listen: args.unsafe_listen || file.unsafe_listen.unwrap_or(false),
        allow_tls12_fallback: args.allow_tls12_fallback
            || file.allow_tls12_fallback.unwrap_or(false),
        renew: args.renew || file.renew.unwrap_or(false),
        rotate_key: args.rotate_key || file.rotate_key.unwrap_or(false),
        attest: (args.attest || file.attest.unwrap_or(false)).then(|| {
            args.ak_handle
                .or(file.ak_handle)
                .unwrap_or(crate::key::attestation::DEFAULT_AK_HANDLE)
        }),
        rotation_close: args
            .rotation_close
            .or(file.rotation_close)
            .unwrap_or_default(),
        credential_validity: positive(
            "credential-validity",
            args.credential_validity.or(file.credential_validity),
        )?
        .unwrap_or(proxy::control::DEFAULT_VALIDITY),
        require_non_extractable: args
            .policy
            .require_non_extractable
            .or(file.require_non_extractable)
            .unwrap_or(true),
        reload_interval: args
            .reload_interval
            .or(file.reload_interval)
            .unwrap_or(proxy::DEFAULT_RELOAD_INTERVAL),
    })
}

/// The way to the API server: `--upstream-proxy` (no credentials on argv), else
/// `HWKEY_UPSTREAM_PROXY`, else the config file's `upstream-proxy`, else the environment's
/// `HTTPS_PROXY` with `NO_PROXY`; credentials from `auth` replace any in the URL.
pub(crate) fn egress(
    flag: Option<&str>,
    auth: Option<String>,
    file: Option<&str>,
) -> anyhow::Result<crate::egress::Egress> {
    use crate::egress::{Egress, ForwardProxy, ProxyCredentials};
    let env = std::env::var("HWKEY_UPSTREAM_PROXY")
        .ok()
        .filter(|v| !v.is_empty());
    let proxy = match (flag, env.as_deref(), file) {
        (Some(url), _, _) => Some(ForwardProxy::parse_argv(url).context("--upstream-proxy")?),
        (None, Some(url), _) => Some(ForwardProxy::parse(url).context("HWKEY_UPSTREAM_PROXY")?),
        (None, None, Some(url)) => Some(ForwardProxy::parse(url).context("upstream-proxy")?),
        (None, None, None) => None,
    };
    let egress = Egress::explicit_or_env(proxy)?;
    Ok(match auth {
        Some(source) => {
            let source = ProxyCredentials::source(&source).context("upstream-proxy-auth")?;
            egress.with_credentials(ProxyCredentials::read(&source).context("upstream-proxy-auth")?)
        }
        None => egress,
    })
}

/// A list setting: the flags' values when any were given, else the config file's.
fn flags_or_file<T>(flags: Vec<T>, file: Vec<T>) -> Vec<T> {
    if flags.is_empty() {
        file
    } else {
        flags
    }
}

/// A duration that must not be zero: a zero handshake timeout refuses every client, a zero
/// credential validity mints certificates that are expired on arrival.
fn positive(
    what: &'static str,
    d: Option<std::time::Duration>,
) -> Result<Option<std::time::Duration>, proxy::ProxyError> {
    match d {
        Some(d) if d.is_zero() => Err(proxy::ProxyError::ZeroDuration { what }),
        other => Ok(other),
    }
}

/// Settings that cannot work are refused up front (issue 22, findings 9 and 11): a 1 ns
/// handshake timeout refuses every client, a 1 ns idle-exit exits at once, no connection slot
/// serves nobody, and a drain longer than a day overflows the clock (it panicked at SIGTERM).
/// Zero durations are [`proxy::ProxyError::ZeroDuration`]'s business.
fn check_ranges(args: &ProxyArgs, file: &FileConfig) -> anyhow::Result<()> {
    use std::time::Duration;
    let within = |what: &'static str, d: Option<Duration>, min: Duration, max: Duration| match d {
        Some(d) if !d.is_zero() && (d < min || d > max) => Err(proxy::ProxyError::OutOfRange {
            what,
            given: humantime::format_duration(d).to_string(),
            range: format!(
                "{} to {}",
                humantime::format_duration(min),
                humantime::format_duration(max)
            ),
        }),
        _ => Ok(()),
    };
    let (ms, s) = (Duration::from_millis, Duration::from_secs);
    const DAY: u64 = 24 * 3600;
    for (what, given, min, max) in [
        (
            "handshake-timeout",
            args.handshake_timeout.or(file.handshake_timeout),
            ms(100),
            s(3600),
        ),
        (
            "idle-exit",
            args.idle_exit.or(file.idle_exit),
            s(1),
            s(365 * DAY),
        ),
        (
            "idle-timeout",
            args.idle_timeout.or(file.idle_timeout),
            s(1),
            s(365 * DAY),
        ),
        (
            "drain-timeout",
            args.drain_timeout.or(file.drain_timeout),
            s(0),
            s(DAY),
        ),
        (
            "credential-validity",
            args.credential_validity.or(file.credential_validity),
            s(10),
            s(DAY),
        ),
        (
            "reload-interval",
            args.reload_interval.or(file.reload_interval),
            ms(100),
            s(DAY),
        ),
    ] {
        within(what, given, min, max)?;
    }
    if let Some(0) = args.max_connections.or(file.max_connections) {
        return Err(proxy::ProxyError::OutOfRange {
            what: "max-connections",
            given: "0".into(),
            range: "1 or more".into(),
        }
        .into());
    }
    Ok(())
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    // The proxy holds a logged-in session and maybe a PIN: keep other processes out of it.
    crate::key::pin::protect_process();
    let pin_stdin = args.pin_stdin;
    let mut config = resolve(args)?;
    if pin_stdin {
        let pin = crate::key::pin::read_pin_line(std::io::stdin().lock())?;
        config.key = config.key.with_pin_value(pin);
    }
    let upstream = config.upstream_text();
    proxy::run(config).with_context(|| format!("proxy to {upstream}"))?;
    Ok(())
}
