//! `hwkey proxy`: the settings from flags, environment and `--config` file
//! ([`proxy::settings`]: merged and checked once); the signer side started with what it serves
//! ([`crate::signer`]); then this process becomes the network side, `hwkey-net`, which links
//! no PKCS#11 or TSS code and never sees the PIN ([`proxy::run`]).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{anyhow, Context};
use clap::Args;
use merge::Merge;

use crate::proxy::{self, NetworkSideSettings, SettingsInput};
use crate::signer::{SignerConfig, Supervisor};

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

impl ProxyArgs {
    /// What was given: the command line and the environment laid over the `--config` file.
    fn given(&self) -> anyhow::Result<SettingsInput> {
        let mut given = self.settings.clone();
        if let Some(path) = &self.config {
            given.merge(SettingsInput::from_file(path)?);
        }
        Ok(given)
    }
}

/// `hwkey-net proxy`'s arguments: none it reads. Its settings arrive from `hwkey proxy` on the
/// supervisor's socket ([`NetworkSideSettings`]), so the network side parses no argument,
/// environment variable or file of its own, and a PIN written in any of them never reaches it.
#[derive(Debug, Args)]
pub struct NetworkSideArgs {
    /// The arguments `hwkey proxy` was started with (PINs redacted), for process lists only.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    given: Vec<std::ffi::OsString>,
}

/// `hwkey proxy`: starts the signer side, then becomes `hwkey-net` (same pid; the settings on
/// the supervisor's socket, the arguments only for process lists and with PINs redacted, the
/// PIN's environment variables removed).
pub fn run(args: ProxyArgs, log_format: &str) -> anyhow::Result<()> {
    // The PIN (read below) and the signer side's socket: keep other processes out.
    crate::key::pin::protect_process();
    let given = args.given()?;
    let mut settings = given.clone().resolve()?;
    if args.pin_stdin {
        let pin = crate::key::pin::read_pin_line(std::io::stdin().lock())?;
        settings.key.uri = settings.key.uri.with_pin_value(pin);
    }
    let rotation = settings.renewal.as_ref().is_some_and(|r| r.rotate_key);
    let config = SignerConfig::for_proxy(
        settings.key.uri.clone(),
        rotation.then_some(&settings.state_dir),
        settings.key.cert.clone(),
        settings.upstream.ca.clone(),
        settings.key.allow_tls12_fallback,
        settings.key.require_non_extractable,
    )?;
    let network_settings = NetworkSideSettings::new(&given);
    drop(given);
    let supervisor = Supervisor::start_with(&config, Some(&network_settings))?;
    let network = network_side()?;
    let control = supervisor
        .into_control()
        .ok_or_else(|| anyhow!("the signer supervisor has no socket"))?;
    let mut command = Command::new(&network);
    command
        .arg("proxy")
        .arg("--")
        .args(shown_arguments())
        .stdin(Stdio::from(control))
        .env("HWKEY_LOG_FORMAT", log_format);
    for var in settings.key.uri.pin_env_vars() {
        command.env_remove(var);
    }
    for var in ["HWKEY_PIN_STDIN", "HWKEY_KEY", "HWKEY_CONFIG"] {
        command.env_remove(var);
    }
    if let Some(tunables) = copy_tunables(std::env::var_os(GLIBC_TUNABLES).as_deref()) {
        command.env(GLIBC_TUNABLES, tunables);
    }
    let error = command.exec();
    Err(anyhow!(
        "cannot run the proxy's network side {}: {error} (it is installed with hwkey: /usr/libexec/hwkey/hwkey-net; HWKEY_NET_BIN names another)",
        network.display()
    ))
}

/// The environment variable glibc's dynamic loader reads its tunables from.
const GLIBC_TUNABLES: &str = "GLIBC_TUNABLES";

/// The tunable that makes glibc's `memcpy` copy with vector loops below 2 MiB instead of
/// `rep movsb`.
const REP_MOVSB: &str = "glibc.cpu.x86_rep_movsb_threshold";

/// The network side's glibc tunables: `existing` (the user's) with [`REP_MOVSB`] at 2 MiB
/// unless it sets it already; None on other targets.
///
/// Why: glibc copies 2 KiB and more with `rep movsb` on CPUs that report it fast, and on the
/// AMD EPYC machines of docs/BENCHMARKS.md a 16 KiB `rep movsb` whose destination lies a few
/// bytes past its source, modulo 4 KiB, ran at half speed. rustls seals each record of the
/// loopback relay with exactly that copy: the plaintext it opened and the record it allocates
/// next are neighbours on the heap, 21 bytes apart modulo 4 KiB. The same number of bytes
/// copied took twice as long, and CPU per GB of a loopback download rose by a fifth; with
/// vector loops it fell below what it was before (docs/BENCHMARKS.md, "Loopback connections
/// on rustls's unbuffered API").
fn copy_tunables(existing: Option<&std::ffi::OsStr>) -> Option<std::ffi::OsString> {
    if !cfg!(all(target_arch = "x86_64", target_env = "gnu")) {
        return None;
    }
    let setting = format!("{REP_MOVSB}=2097152");
    match existing {
        Some(t) if t.to_string_lossy().contains(REP_MOVSB) => None,
        Some(t) if !t.is_empty() => {
            let mut joined = t.to_os_string();
            joined.push(":");
            joined.push(&setting);
            Some(joined)
        }
        _ => Some(setting.into()),
    }
}

/// This process's arguments but the subcommand's name, each as process lists may show it.
fn shown_arguments() -> Vec<std::ffi::OsString> {
    let mut args: Vec<_> = std::env::args_os().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "proxy") {
        args.remove(at);
    }
    args.into_iter().map(redacted).collect()
}

/// An argument as process lists may show it: any `pin-value` in it hidden.
fn redacted(arg: std::ffi::OsString) -> std::ffi::OsString {
    match arg.to_str() {
        Some(text) => crate::key::uri::redact(text).into(),
        None => arg,
    }
}

/// `hwkey-net proxy`: the network side, with the signer supervisor and the settings on
/// standard input.
pub fn run_network_side(_args: NetworkSideArgs) -> anyhow::Result<()> {
    crate::key::pin::protect_process();
    let (supervisor, given) = Supervisor::from_stdin_with::<NetworkSideSettings>().context(
        "hwkey-net is the network side of `hwkey proxy` and is started by it; run `hwkey proxy`",
    )?;
    let settings = given.resolve()?;
    let upstream = settings.upstream_text();
    proxy::run(settings, supervisor).with_context(|| format!("proxy to {upstream}"))?;
    Ok(())
}

/// Where `hwkey-net` is: `HWKEY_NET_BIN`, else beside this executable, else where the package
/// installs it.
fn network_side() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("HWKEY_NET_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let beside = std::env::current_exe()
        .context("finding this executable")?
        .with_file_name("hwkey-net");
    if beside.is_file() {
        return Ok(beside);
    }
    Ok(PathBuf::from("/usr/libexec/hwkey/hwkey-net"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The network side gets the tunable, after the user's own, and a threshold the user set is
    /// left as it is.
    #[test]
    #[cfg(all(target_arch = "x86_64", target_env = "gnu"))]
    fn the_network_side_copies_with_vector_loops_and_keeps_the_users_tunables() {
        let ours = "glibc.cpu.x86_rep_movsb_threshold=2097152";
        assert_eq!(copy_tunables(None), Some(ours.into()));
        assert_eq!(copy_tunables(Some("".as_ref())), Some(ours.into()));
        assert_eq!(
            copy_tunables(Some("glibc.malloc.arena_max=2".as_ref())),
            Some(format!("glibc.malloc.arena_max=2:{ours}").into())
        );
        assert_eq!(
            copy_tunables(Some("glibc.cpu.x86_rep_movsb_threshold=4096".as_ref())),
            None
        );
    }
}
