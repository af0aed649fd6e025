//! `hwkey approver`: the attesting CSR approver (see `lifecycle::approver`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

#[derive(Debug, Args)]
pub struct ApproverArgs {
    /// A kubeconfig allowed to list CSRs and update their approval (default: in-cluster
    /// service account, or $KUBECONFIG).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// A signerName whose requests this approver decides (repeatable), e.g.
    /// kubernetes.io/kube-apiserver-client-kubelet.
    #[arg(long = "signer-name", required = true)]
    signer_names: Vec<String>,
    /// The registered nodes: one file per node, named after it, holding `hwkey attest enroll`'s output.
    #[arg(long)]
    trust: PathBuf,
    /// Requests without TPM evidence: deny them (NoEvidence) or leave them to other approvers.
    #[arg(long, value_enum, default_value = "deny")]
    on_missing_evidence: OnMissing,
    /// Decide the pending requests once and exit (otherwise: keep deciding every --interval).
    #[arg(long)]
    once: bool,
    /// How often pending requests are looked for.
    #[arg(long, default_value = "2s", value_parser = crate::proxy::config::parse_duration)]
    interval: Duration,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OnMissing {
    Deny,
    Ignore,
}

#[cfg(feature = "tpm")]
pub fn run(args: ApproverArgs) -> anyhow::Result<()> {
    use crate::lifecycle::approver::{self, ApproverOptions, OnMissingEvidence};
    use anyhow::Context;
    let options = ApproverOptions {
        signer_names: args.signer_names,
        trust: args.trust,
        on_missing_evidence: match args.on_missing_evidence {
            OnMissing::Deny => OnMissingEvidence::Deny,
            OnMissing::Ignore => OnMissingEvidence::Ignore,
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let config = match &args.kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(file, &Default::default())
                    .await
                    .with_context(|| format!("{} is not a usable kubeconfig", path.display()))?
            }
            None => kube::Config::infer()
                .await
                .context("no in-cluster service account and no usable $KUBECONFIG")?,
        };
        let client =
            crate::lifecycle::client::build(&config, crate::lifecycle::client::Identity::Config)?;
        if args.once {
            for d in approver::decide_pending(&client, &options).await? {
                println!(
                    "{} {}: {} ({})",
                    if d.approved { "approved" } else { "denied" },
                    d.name,
                    d.reason,
                    d.message
                );
            }
            return Ok(());
        }
        approver::run(&client, &options, args.interval).await?;
        Ok(())
    })
}

#[cfg(not(feature = "tpm"))]
pub fn run(_args: ApproverArgs) -> anyhow::Result<()> {
    anyhow::bail!("this hwkey was built without the TPM 2.0 backend, which checks TPM evidence: rebuild it with `cargo build --features tpm`")
}
