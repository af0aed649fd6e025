//! `hwkey man`, `hwkey completions` and `hwkey --version`: man pages and shell completions made
//! from the same clap definitions as `--help` (so they never drift from it), and the build
//! facts a bug report needs.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[cfg(all(feature = "pkcs11", feature = "tpm"))]
macro_rules! backends {
    () => {
        "pkcs11 (cryptoki), tpm (tss-esapi)"
    };
}
#[cfg(all(feature = "pkcs11", not(feature = "tpm")))]
macro_rules! backends {
    () => {
        "pkcs11 (cryptoki)"
    };
}
#[cfg(all(not(feature = "pkcs11"), feature = "tpm"))]
macro_rules! backends {
    () => {
        "tpm (tss-esapi)"
    };
}
#[cfg(not(any(feature = "pkcs11", feature = "tpm")))]
macro_rules! backends {
    () => {
        "none"
    };
}

/// `hwkey --version`: the version, the git commit it was built from, the backends compiled in
/// and the TLS provider.
pub(crate) const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit: ",
    env!("HWKEY_GIT_COMMIT"),
    "\nbackends: ",
    backends!(),
    "\nTLS: rustls (ring: cipher suites, signatures, X25519; aws-lc-rs: X25519MLKEM768)"
);

/// Where to write the man pages.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// Directory for hwkey.1 and one page per subcommand (hwkey-proxy.1, hwkey-key-create.1,
    /// …); created if missing. Install them under /usr/share/man/man1.
    #[arg(long)]
    out: PathBuf,
}

/// Which shell to complete for.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell. E.g. `source <(hwkey completions bash)`.
    shell: clap_complete::Shell,
}

/// Writes the man pages of `cli` (the whole command line, from its definition).
pub fn man(args: ManArgs, cli: clap::Command) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    clap_mangen::generate_to(cli, &args.out)
        .with_context(|| format!("cannot write the man pages to {}", args.out.display()))?;
    eprintln!("wrote the man pages to {}", args.out.display());
    Ok(())
}

/// Prints the completion script of `cli` on stdout.
pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> anyhow::Result<()> {
    clap_complete::generate(args.shell, &mut cmd, "hwkey", &mut std::io::stdout());
    Ok(())
}
