//! `hwkey proxy`: the settings from flags, environment and `--config` file
//! ([`proxy::settings`]: merged and checked once), then [`proxy::run`].

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use merge::Merge;

use crate::proxy::{self, SettingsInput};

#[derive(Debug, Args)]
#[command(
    long_about = "Accepts kubectl/kubelet connections on loopback TLS and UNIX sockets and re-originates each one to the API server over mTLS signed inside the hardware key. Prints a line starting with 'hwkey proxy: ready' on stderr once listening. SIGHUP reloads the certificate; SIGTERM drains and exits 0."
)]
pub struct ProxyArgs {
    #[command(flatten)]
    settings: SettingsInput,
    /// A TOML or YAML file with the same settings (keys named like the flags, e.g. upstream-ca).
    /// Command-line flags and environment variables win over it.
    #[arg(long, env = "HWKEY_CONFIG")]
    config: Option<PathBuf>,
    /// Read the token PIN from standard input (one line) at start and keep it only in locked,
    /// wiped memory: how `hwkey credential` hands a prompted PIN to the proxy it starts (never
    /// argv, never the environment).
    #[arg(long, env = "HWKEY_PIN_STDIN")]
    pin_stdin: bool,
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    // The proxy holds a logged-in session and maybe a PIN: keep other processes out of it.
    crate::key::pin::protect_process();
    let mut given = args.settings;
    if let Some(path) = &args.config {
        given.merge(SettingsInput::from_file(path)?);
    }
    let mut settings = given.resolve()?;
    if args.pin_stdin {
        let pin = crate::key::pin::read_pin_line(std::io::stdin().lock())?;
        settings.key.uri = settings.key.uri.with_pin_value(pin);
    }
    let upstream = settings.upstream_text();
    proxy::run(settings).with_context(|| format!("proxy to {upstream}"))?;
    Ok(())
}
