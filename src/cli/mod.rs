//! The command line: one module per subcommand. This is the only place that uses `anyhow`; the
//! library's typed errors are turned into a one-line message and a non-zero exit code here.

mod approver;
mod attest;
mod bootstrap;
mod cert;
mod credential;
mod csr;
mod doctor;
mod key;
mod kubeconfig;
mod manual;
mod probe;
mod proxy;
mod renew;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// hwkey: Kubernetes client certificates whose private keys never leave a PKCS#11 token or TPM.
#[derive(Debug, Parser)]
#[command(name = "hwkey", version, long_version = manual::LONG_VERSION, about, long_about = None)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "HWKEY_LOG_FORMAT"
    )]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    /// The name `--log-format` takes.
    fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create, list, inspect and delete hardware keys.
    #[command(subcommand)]
    Key(key::KeyCommand),
    /// Make a PKCS#10 certificate request signed inside the hardware.
    Csr(csr::CsrArgs),
    /// Store or inspect the certificate of a hardware key.
    #[command(subcommand)]
    Cert(cert::CertCommand),
    /// One HTTPS GET with mTLS signed by the hardware key, reporting the handshake.
    Probe(probe::ProbeArgs),
    /// Let kubectl/kubelet reach the API server with the hardware key (TLS-offload proxy).
    Proxy(Box<proxy::ProxyArgs>),
    /// client-go exec plugin: prints an ExecCredential for the hwkey proxy (used by kubectl).
    Credential(credential::CredentialArgs),
    /// Write or merge a kubeconfig in which kubectl or kubelet works through hwkey.
    Kubeconfig(kubeconfig::KubeconfigArgs),
    /// Check a key, its certificate and a kubeconfig step by step, saying what to fix.
    Doctor(doctor::DoctorArgs),
    /// Renew a hardware key's certificate through the Kubernetes CSR API.
    Renew(renew::RenewArgs),
    /// kubelet TLS bootstrapping with the node key in hardware.
    Bootstrap(bootstrap::BootstrapArgs),
    /// TPM attestation: enroll a node's attestation key, verify the evidence in a request.
    #[command(subcommand)]
    Attest(attest::AttestCommand),
    /// Approve CertificateSigningRequests whose key is proven to be in a registered node's TPM.
    Approver(approver::ApproverArgs),
    /// Write the man pages (hwkey.1 and one per subcommand).
    Man(manual::ManArgs),
    /// Print a shell completion script (bash, zsh, fish, …).
    Completions(manual::CompletionsArgs),
    /// (internal) The signer's supervisor, which `hwkey proxy` starts.
    #[command(name = "signer-supervisor", hide = true)]
    SignerSupervisor,
    /// (internal) A signer, which the supervisor starts.
    #[command(hide = true)]
    Signer,
}

/// Runs the CLI and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::SignerSupervisor => {
            return ExitCode::from(crate::signer::supervisor::supervisor_main())
        }
        Command::Signer => return ExitCode::from(crate::signer::supervisor::signer_main()),
        Command::Key(c) => key::run(c),
        Command::Csr(a) => csr::run(a),
        Command::Cert(c) => cert::run(c),
        Command::Probe(a) => probe::run(a),
        Command::Proxy(a) => proxy::run(*a, cli.log_format.name()),
        Command::Credential(a) => credential::run(a),
        Command::Kubeconfig(a) => kubeconfig::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::Renew(a) => renew::run(a),
        Command::Bootstrap(a) => bootstrap::run(a),
        Command::Attest(c) => attest::run(c),
        Command::Approver(a) => approver::run(a),
        Command::Man(a) => manual::man(a, <Cli as clap::CommandFactory>::command()),
        Command::Completions(a) => manual::completions(a, <Cli as clap::CommandFactory>::command()),
    };
    exit_code(result)
}

pub use crate::key::pin::EXIT_PIN_REFUSED;

/// The `hwkey-credential` binary: exactly `hwkey credential`, in a binary that links neither
/// the TSS nor OpenSSL. client-go starts the exec plugin for every kubectl invocation, and
/// starting the full `hwkey` binary costs about 5 ms of CPU (page faults and eager symbol
/// binding of its shared libraries; docs/BENCHMARKS.md). Returns the exit status, which the
/// binary exits with itself: it starts without std's runtime (src/bin/hwkey-credential.rs).
pub fn credential_main() -> u8 {
    #[derive(Parser)]
    #[command(
        name = "hwkey-credential",
        version,
        about = "The client-go exec plugin of hwkey (same as `hwkey credential`)"
    )]
    struct CredentialCli {
        /// Log format on stderr (stdout holds only the ExecCredential).
        #[arg(long, value_enum, default_value = "text", env = "HWKEY_LOG_FORMAT")]
        log_format: LogFormat,
        #[command(flatten)]
        args: credential::CredentialArgs,
    }
    let cli = CredentialCli::parse();
    init_logging(cli.log_format);
    exit_status(credential::run(cli.args))
}

/// The `hwkey-net` binary: the proxy's network side, which `hwkey proxy` becomes once it has
/// started the signer side (its settings from `hwkey proxy`, on the supervisor's socket). It links
/// no PKCS#11 or TSS code.
pub fn net_main() -> ExitCode {
    #[derive(Parser)]
    #[command(
        name = "hwkey-net",
        version,
        about = "The network side of `hwkey proxy` (started by it, with the signer's supervisor on standard input)"
    )]
    struct NetCli {
        /// Log format on stderr.
        #[arg(
            long,
            global = true,
            value_enum,
            default_value = "text",
            env = "HWKEY_LOG_FORMAT"
        )]
        log_format: LogFormat,
        #[command(subcommand)]
        command: NetCommand,
    }
    #[derive(Subcommand)]
    enum NetCommand {
        /// The proxy (settings from `hwkey proxy`; the arguments only for process lists).
        Proxy(proxy::NetworkSideArgs),
    }
    let cli = NetCli::parse();
    init_logging(cli.log_format);
    let NetCommand::Proxy(args) = cli.command;
    exit_code(proxy::run_network_side(args))
}

/// Prints the error on one line and picks the exit code: the PIN-refused code when a PIN was
/// rejected anywhere in the chain, else 1.
fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    ExitCode::from(exit_status(result))
}

/// [`exit_code`] as the number: 0, the PIN-refused code or 1.
fn exit_status(result: anyhow::Result<()>) -> u8 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("hwkey: error: {}", one_line(&e));
            if pin_refused(&e) {
                EXIT_PIN_REFUSED
            } else {
                1
            }
        }
    }
}

/// True when the error chain holds a PIN rejection, wherever a layer wrapped it: every layer
/// wraps the one below as its `source`, so the key layer's error is in the chain itself.
fn pin_refused(e: &anyhow::Error) -> bool {
    use crate::exec::ExecError;
    use crate::key::KeyError;
    e.chain().any(|cause| {
        cause
            .downcast_ref::<KeyError>()
            .is_some_and(KeyError::is_pin_refusal)
            || matches!(
                cause.downcast_ref::<ExecError>(),
                Some(ExecError::ProxyPinRefused { .. })
            )
    })
}

/// The error and its causes on one line, leaving out a cause whose text the message above it
/// already includes (our error types print their source inline).
fn one_line(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn init_logging(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("HWKEY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // tss-esapi logs every failed unmarshal at ERROR with the input's content: evidence any
    // cluster user can put in a request. hwkey reports each refusal once, at its own level and
    // bounded; tss-esapi's lines appear only when HWKEY_LOG names them.
    // cryptoki logs an ERROR for every mechanism of a token's list it has no name for (SoftHSM
    // lists about thirty): a successful command must not print errors.
    for crate_name in ["tss_esapi", "cryptoki"] {
        let named = std::env::var("HWKEY_LOG").is_ok_and(|v| v.contains(crate_name));
        if named {
            continue;
        }
        if let Ok(off) = format!("{crate_name}=off").parse() {
            filter = filter.add_directive(off);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

pub(crate) use crate::key::KeyPolicy;
pub(crate) use crate::key::KeyUriParser;

#[cfg(test)]
mod tests {
    use super::{one_line, pin_refused};
    use crate::key::{KeyError, LocateError, PinError};
    use crate::pki::PkiError;
    use crate::proxy::StartError;

    fn refused() -> KeyError {
        KeyError::Pin(PinError::Incorrect { token: "t".into() })
    }

    /// Exit 77 (PIN refused) whatever layer wraps the key layer's refusal, and the message is
    /// the refusal's once; any other error exits 1.
    #[test]
    fn a_pin_refusal_is_found_under_every_layer_and_printed_once() {
        let text = refused().to_string();
        let wrapped: Vec<anyhow::Error> = vec![
            refused().into(),
            StartError::Key(refused()).into(),
            StartError::Pki(PkiError::Key(refused())).into(),
            crate::lifecycle::LifecycleError::Pki(PkiError::Key(refused())).into(),
            crate::exec::ExecError::Key(refused()).into(),
            crate::probe::ProbeError::Key(refused()).into(),
            anyhow::Error::from(StartError::Pki(PkiError::Key(refused()))).context("proxy to x"),
        ];
        for e in &wrapped {
            assert!(pin_refused(e), "{e:?}");
            assert_eq!(one_line(e).matches(&text).count(), 1, "{}", one_line(e));
            assert!(
                e.chain().any(|c| c.downcast_ref::<KeyError>().is_some()),
                "the key layer's error is in the chain: {e:?}"
            );
        }
        let other = KeyError::Locate(LocateError::NoKeySelected);
        assert!(!pin_refused(&StartError::Key(other).into()));
        assert!(!pin_refused(
            &StartError::Pki(PkiError::Key(KeyError::Locate(LocateError::NoModule))).into()
        ));
    }
}
