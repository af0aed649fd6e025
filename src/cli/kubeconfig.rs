//! `hwkey kubeconfig`: write a kubeconfig in which kubectl (or kubelet) works through hwkey.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use crate::key::KeyUri;
use crate::kubeconfig::{self, Consumer, KubeconfigError, Request};

#[derive(Debug, Args)]
pub struct KubeconfigArgs {
    /// Name of the cluster, user and context entries.
    #[arg(long, value_parser = parse_entry_name)]
    name: String,
    /// The hardware key.
    #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
    key: KeyUri,
    /// The key's certificate chain (default: the one stored with the key).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// The API server, e.g. https://10.0.0.1:6443.
    #[arg(long)]
    server: String,
    /// The API server's CA bundle.
    #[arg(long)]
    ca: PathBuf,
    /// Name to verify the API server's certificate against.
    #[arg(long)]
    tls_server_name: Option<String>,
    /// Forward proxy to the API server (http://, https:// or socks5://HOST:PORT), no
    /// credentials (argv is visible in `ps`). Default: the `proxy-url` of the cluster entry
    /// this replaces. Credentials: write the entry's proxy-url in the kubeconfig first.
    #[arg(long)]
    proxy_url: Option<String>,
    /// Kubeconfig to write or merge into (default: $KUBECONFIG's first file, else ~/.kube/config).
    #[arg(long)]
    out: Option<PathBuf>,
    /// kubectl (interactive PIN prompt allowed) or kubelet (never interactive).
    #[arg(long = "for", value_enum, default_value = "kubectl")]
    consumer: Consumer,
    /// The exec block's client.authentication.k8s.io version: v1, or v1beta1 for client-go
    /// older than 1.22 (kubelet 1.20/1.21).
    #[arg(long, value_enum, default_value = "v1")]
    exec_api_version: crate::kubeconfig::ExecApiVersion,
    /// Loopback port of the proxy (default: kept from an earlier run, else a free one).
    #[arg(long)]
    port: Option<u16>,
    /// The proxy's state directory (default: ~/.kube/cache/hwkey/NAME; kubelet: /var/lib/hwkey/NAME).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// How long a proxy started by `hwkey credential` stays up without clients (default 30m).
    #[arg(long, value_parser = crate::duration::parse_duration)]
    idle_exit: Option<std::time::Duration>,
    /// The proxy `hwkey credential` starts renews the certificate through the CSR API before
    /// it expires (hwkey proxy --renew), while kubectl is used: with an approver's
    /// self-renewal policy for people, nobody approves by hand.
    #[arg(long)]
    renew: bool,
    /// With --renew (TPM keys): every renewal carries fresh TPM evidence, the hardware proof an
    /// approver asks of a person at every issuance (hwkey proxy --renew --attest).
    #[command(flatten)]
    attest: super::attest::AttestArgs,
}

/// A name for the kubeconfig entries, which also names the default state directory
/// (`~/.kube/cache/hwkey/NAME`, `/var/lib/hwkey/NAME`): names kubectl takes, slashes included
/// (EKS names its contexts by ARN), but none that leaves that directory or names it itself.
fn parse_entry_name(name: &str) -> Result<String, BadEntryName> {
    let escapes = name.starts_with('/') || name.split('/').any(|part| part == "." || part == "..");
    if name.is_empty() || escapes || name.chars().any(char::is_control) {
        return Err(BadEntryName);
    }
    Ok(name.to_string())
}

/// Why `--name` was refused (clap prints it after the option's name).
#[derive(Debug, thiserror::Error)]
#[error("a name must be non-empty, free of control characters, not start with '/' and have no '.' or '..' between slashes: it also names the proxy's state directory (~/.kube/cache/hwkey/NAME, for kubelet /var/lib/hwkey/NAME), which it must not leave")]
struct BadEntryName;

/// The longest path a UNIX socket can be bound at (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Refuses a state directory whose control socket could never be bound: the kubeconfig would be
/// written, and every kubectl run would then fail starting the proxy.
fn check_socket_path(socket: &Path) -> anyhow::Result<()> {
    let len = socket.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        anyhow::bail!(
            "the proxy's control socket would be {} ({len} bytes), longer than a UNIX socket path can be ({MAX_SOCKET_PATH}): give a shorter --state-dir (the default is ~/.kube/cache/hwkey/NAME, so a long --name makes it long)",
            socket.display()
        );
    }
    Ok(())
}

fn absolute(
    what: &'static str,
    path: &Path,
    hint: &'static str,
) -> Result<PathBuf, KubeconfigError> {
    std::fs::canonicalize(path).map_err(|_| KubeconfigError::MissingFile {
        what,
        path: path.to_path_buf(),
        hint,
    })
}

pub fn run(args: KubeconfigArgs) -> anyhow::Result<()> {
    crate::proxy::settings::check_attest(args.attest.ak_handle().is_some(), args.renew, &args.key)?;
    let upstream: crate::endpoint::UpstreamTarget = args.server.parse()?;
    if let Some(url) = &args.proxy_url {
        crate::egress::ForwardProxy::parse_argv(url).context("--proxy-url")?;
    }
    let upstream_ca = absolute(
        "--ca",
        &args.ca,
        "give the API server's CA bundle (e.g. /etc/kubernetes/pki/ca.crt)",
    )?;
    let cert = match &args.cert {
        Some(c) => Some(absolute("--cert", c, "give the certificate issued for the hardware key, or leave --cert out to use the one stored with the key")?),
        None => None,
    };
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"));
    // The first file of $KUBECONFIG that is named at all: client-go skips empty entries
    // (`KUBECONFIG=:~/.kube/config`, or set to nothing).
    let out = match args.out {
        Some(o) => o,
        None => std::env::var_os("KUBECONFIG")
            .and_then(|k| std::env::split_paths(&k).find(|p| !p.as_os_str().is_empty()))
            .unwrap_or_else(|| home.join(".kube").join("config")),
    };
    // Absolute: the plugin runs from wherever kubectl is run, and a relative state directory
    // in the kubeconfig would make a new proxy and CA in each of those places.
    let state_dir = match args.state_dir {
        Some(dir) => std::path::absolute(&dir)
            .with_context(|| format!("--state-dir {}: cannot make it absolute", dir.display()))?,
        None => crate::state_dir::StateDir::kubeconfig_default(
            &args.name,
            args.consumer == Consumer::Kubelet,
        )
        .to_path_buf(),
    };
    check_socket_path(&crate::state_dir::StateDir::new(state_dir.clone()).control_socket())?;
    let command = crate::exec::plugin_command().context("cannot find the hwkey binary's path")?;
    let request = Request {
        name: args.name.clone(),
        key: args.key,
        cert,
        upstream,
        upstream_ca,
        tls_server_name: args.tls_server_name,
        upstream_proxy: args.proxy_url,
        port: args.port,
        state_dir,
        idle_exit: args.idle_exit,
        renew: args.renew,
        attest: args.attest.ak_handle(),
        command,
        consumer: args.consumer,
        exec_api_version: args.exec_api_version,
    };
    let server = kubeconfig::write(&request, &out)?;
    eprintln!(
        "wrote context '{}' to {}: kubectl talks to the hwkey proxy at {server}, which signs with {}",
        args.name,
        out.display(),
        request.key
    );
    Ok(())
}
