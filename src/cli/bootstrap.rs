//! `hwkey bootstrap`: kubelet TLS bootstrapping with the node key in hardware.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::key::{KeyAlgorithm, KeyUri};
use crate::lifecycle::bootstrap::{self, BootstrapOptions, Bootstrapped};

#[derive(Debug, Args)]
pub struct BootstrapArgs {
    /// A kubeconfig holding the API server, its CA and a bootstrap token (kubeadm's
    /// bootstrap-kubelet.conf).
    #[arg(long)]
    bootstrap_kubeconfig: PathBuf,
    /// The node's name: the certificate is for CN=system:node:NAME, O=system:nodes.
    #[arg(long)]
    node_name: String,
    /// The node key.
    #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
    key: KeyUri,
    /// Create the key in the hardware with this algorithm if it does not exist (ec-p256 is
    /// recommended).
    #[arg(long)]
    create_key: Option<String>,
    /// Where the node certificate goes (default: stored with the key).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// The kubelet kubeconfig to write (as `hwkey kubeconfig --for kubelet` writes it).
    #[arg(long)]
    out: PathBuf,
    /// The proxy's state directory (default: /var/lib/hwkey/kubelet).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The proxy's loopback port for the kubeconfig's server (match the proxy's
    /// `listen = tcp:127.0.0.1:PORT`; default: the one the file had, else a free one).
    #[arg(long)]
    port: Option<u16>,
    /// The kubelet kubeconfig's exec apiVersion (default: v1beta1 for API servers before 1.24,
    /// whose kubelets may predate client.authentication.k8s.io/v1; else v1).
    #[arg(long, value_enum)]
    exec_api_version: Option<crate::kubeconfig::ExecApiVersion>,
    /// How long to wait for the request to be issued.
    #[arg(long, default_value = "15m")]
    wait: String,
    #[command(flatten)]
    policy: super::KeyPolicy,
    #[command(flatten)]
    attest: super::attest::AttestArgs,
    /// With --attest, on a node whose TPM nobody registered: prove the TPM by its
    /// manufacturer's EK certificate first (the approver checks it, encrypts a credential to
    /// the EK for the AK, and this TPM alone answers it); no operator step per node. Takes the
    /// EK to use (rsa or ecc; default: the RSA EK when its certificate is in NV, else the ECC).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "auto", value_name = "EK")]
    ek_proof: Option<EkChoice>,
}

/// `--ek-proof`'s value.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum EkChoice {
    /// The RSA EK when its certificate is in NV, else the ECC EK.
    Auto,
    /// The RSA-2048 EK.
    Rsa,
    /// The ECC P-256 EK.
    Ecc,
}

pub fn run(args: BootstrapArgs) -> anyhow::Result<()> {
    let create_key = args
        .create_key
        .as_deref()
        .map(str::parse::<KeyAlgorithm>)
        .transpose()?;
    let options = BootstrapOptions {
        bootstrap_kubeconfig: args.bootstrap_kubeconfig,
        node_name: args.node_name,
        key: args.key,
        create_key,
        cert: args.cert,
        out: args.out,
        state_dir: args.state_dir.unwrap_or_else(|| {
            std::path::Path::new(crate::state_dir::SYSTEM_STATE_DIR).join("kubelet")
        }),
        port: args.port,
        exec_api_version: args.exec_api_version,
        wait: crate::duration::parse_duration(&args.wait)?,
        command: crate::exec::plugin_command().context("cannot find the hwkey binary's path")?,
        require_non_extractable: args.policy.required(),
        attest: args.attest.ak_handle(),
        ek_proof: args.ek_proof.map(|c| match c {
            EkChoice::Auto => None,
            EkChoice::Rsa => Some(crate::key::attestation::EkKind::Rsa),
            EkChoice::Ecc => Some(crate::key::attestation::EkKind::Ecc),
        }),
    };
    match bootstrap::bootstrap(&options)? {
        Bootstrapped::AlreadyDone { subject, not_after } => eprintln!(
            "already bootstrapped: {subject}, valid until {not_after}; nothing to do (kubeconfig {})",
            options.out.display()
        ),
        Bootstrapped::Issued(r) => eprintln!(
            "bootstrapped: {} (serial {}), valid until {}; CertificateSigningRequest {}; installed in {}; kubelet kubeconfig {}",
            r.issued.subject,
            r.issued.serial,
            r.issued.not_after,
            r.csr_name,
            r.installed,
            options.out.display()
        ),
    }
    Ok(())
}
