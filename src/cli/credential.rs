//! `hwkey credential`: the client-go exec plugin. stdout holds exactly one JSON object;
//! everything else goes to stderr.

use std::path::PathBuf;

use clap::Args;

use crate::exec::credential::ExecInfo;
use crate::exec::settings::{Overrides, Settings};

#[derive(Debug, Args)]
#[command(
    long_about = "A client-go exec plugin (client.authentication.k8s.io/v1 and v1beta1). Reads KUBERNETES_EXEC_INFO, makes sure the hwkey proxy for the cluster runs (starting it if needed), and prints an ExecCredential holding a short-lived loopback client certificate and its throw-away key: never the hardware key. Settings come from these flags, else from the exec block's HWKEY_EXEC_CLUSTER env that `hwkey kubeconfig` writes (or an older kubeconfig's client.authentication.k8s.io/exec cluster extension, with provideClusterInfo: true)."
)]
pub struct CredentialArgs {
    /// The hardware key (default: the cluster extension's `key`).
    #[arg(long)]
    key: Option<String>,
    /// The key's certificate chain (default: the extension's `cert`, else the stored one).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// The API server (default: the extension's `upstream`).
    #[arg(long)]
    upstream: Option<String>,
    /// The API server's CA bundle (default: the extension's `upstreamCA`).
    #[arg(long)]
    upstream_ca: Option<PathBuf>,
    /// Name to verify the API server's certificate against.
    #[arg(long)]
    tls_server_name: Option<String>,
    /// The proxy's state directory (default: the extension's `stateDir`).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Where the proxy listens (default: from the cluster's server URL).
    #[arg(long)]
    listen: Option<String>,
    /// How long an auto-started proxy stays up without clients (default 30m).
    #[arg(long)]
    idle_exit: Option<String>,
    /// KEP-2718 shape: the hardware certificate chain and proxyConfig, no key.
    #[arg(long)]
    cert_only: bool,
}

pub fn run(args: CredentialArgs) -> anyhow::Result<()> {
    let info = ExecInfo::from_env()?;
    let overrides = Overrides {
        key: args.key,
        cert: args.cert,
        upstream: args.upstream,
        upstream_ca: args.upstream_ca,
        tls_server_name: args.tls_server_name,
        state_dir: args.state_dir,
        listen: args.listen,
        idle_exit: args.idle_exit,
        cert_only: args.cert_only,
    };
    let settings = Settings::resolve(&info, &overrides)?;
    let credential = crate::exec::run(&info, &settings)?;
    let json = zeroize::Zeroizing::new(credential.to_json()?);
    // One write: stdout's line buffer would pass the object (longer than the buffer) and its
    // newline on in two. Sized up front, so that this copy adds no unwiped one by a regrowth
    // (serializing and reading the answer grow their buffers, as before).
    let mut line = zeroize::Zeroizing::new(Vec::with_capacity(json.len() + 1));
    line.extend_from_slice(json.as_bytes());
    line.push(b'\n');
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(&line)?;
    out.flush()?;
    Ok(())
}
