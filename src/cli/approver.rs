//! `hwkey approver`: the attesting CSR approver (see `lifecycle::approver`).

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args};

#[derive(Debug, Args)]
pub struct ApproverArgs {
    /// A kubeconfig allowed to list and watch CSRs and update their approval (default: in-cluster
    /// service account, or $KUBECONFIG).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// A signerName whose requests this approver decides (repeatable). Only signers hwkey has a
    /// policy for are accepted: kubernetes.io/kube-apiserver-client-kubelet (node client
    /// certificates); any other refuses to start.
    #[arg(long = "signer-name", required = true)]
    signer_names: Vec<String>,
    /// A group whose bootstrap-token identities (system:bootstrap:*) may ask for a node's first
    /// certificate (repeatable), e.g. the token's auth-extra-groups
    /// system:bootstrappers:kubeadm:default-node-token. Without one, only nodes renewing their own identity are
    /// approved.
    #[arg(long = "bootstrap-group", value_name = "GROUP")]
    bootstrap_groups: Vec<String>,
    /// How old a request's TPM evidence may be when the request is created (at most 50m: the
    /// API server keeps decided requests an hour, and a copy must meet its original).
    #[arg(long, default_value = "15m", value_parser = crate::duration::parse_duration)]
    evidence_max_age: Duration,
    /// The registered nodes: a directory with one file per node, named after it, holding
    /// `hwkey attest enroll`'s output (a mounted ConfigMap works too).
    #[arg(
        long,
        required_unless_present = "trust_configmap",
        conflicts_with = "trust_configmap"
    )]
    trust: Option<PathBuf>,
    /// The registered nodes as a ConfigMap, NAMESPACE/NAME, one entry per node (read through the
    /// API: a node added to it is admitted without a restart).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    trust_configmap: Option<String>,
    /// Requests without TPM evidence: deny them (NoEvidence) or leave them to other approvers.
    #[arg(long, value_enum, default_value = "deny")]
    on_missing_evidence: OnMissing,
    /// Decide the pending requests once and exit (no watch, no leader election).
    #[arg(long)]
    once: bool,
    /// Elect a leader among replicas on a coordination.k8s.io Lease, so only one decides.
    #[arg(long, default_value_t = true, action = ArgAction::Set, value_name = "BOOL")]
    leader_elect: bool,
    /// The Lease's namespace (default: the service account's namespace in a pod, else
    /// kube-system).
    #[arg(long)]
    leader_elect_namespace: Option<String>,
    /// The Lease's name.
    #[arg(long, default_value = "hwkey-approver")]
    leader_elect_lease_name: String,
    /// How long a leader's Lease stands without renewal before a standby takes over.
    #[arg(long, default_value = "15s", value_parser = crate::duration::parse_duration)]
    leader_elect_lease_duration: Duration,
    /// How long a leader keeps trying to renew before it steps down (< lease duration).
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_duration)]
    leader_elect_renew_deadline: Duration,
    /// How often standbys try to take the Lease and the leader renews it (< renew deadline).
    #[arg(long, default_value = "2s", value_parser = crate::duration::parse_duration)]
    leader_elect_retry_period: Duration,
    /// Serve /metrics (OpenMetrics) and /healthz on this address, e.g. 127.0.0.1:9101 (a pod's
    /// 0.0.0.0:9101 for Prometheus). Metrics hold no secrets.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OnMissing {
    Deny,
    Ignore,
}

#[cfg(feature = "tpm")]
/// Where a service account's namespace is, in a pod.
const POD_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The approver's settings from the flags: the trust source, the signers (each must have a
/// policy) and the decision rules.
#[cfg(feature = "tpm")]
fn options(args: &ApproverArgs) -> anyhow::Result<crate::lifecycle::approver::ApproverOptions> {
    use crate::lifecycle::approver::trust::TrustSource;
    use crate::lifecycle::approver::{self, ApproverOptions};
    let trust = match (&args.trust, &args.trust_configmap) {
        (Some(dir), _) => TrustSource::Dir(dir.clone()),
        (None, Some(spec)) => {
            TrustSource::config_map(spec).map_err(|e| anyhow::anyhow!("--trust-configmap: {e}"))?
        }
        (None, None) => anyhow::bail!("pass --trust DIR or --trust-configmap NAMESPACE/NAME"),
    };
    approver::check_signers(&args.signer_names)?;
    if args.evidence_max_age > Duration::from_secs(50 * 60) || args.evidence_max_age.is_zero() {
        anyhow::bail!(
            "--evidence-max-age {:?} is out of range: use 1s to 50m (decided requests are kept an hour, and a reused copy must still find its original)",
            args.evidence_max_age
        );
    }
    let options = ApproverOptions {
        signer_names: args.signer_names.clone(),
        trust,
        rules: approver::decide::Rules {
            on_missing_evidence: match args.on_missing_evidence {
                OnMissing::Deny => approver::OnMissingEvidence::Deny,
                OnMissing::Ignore => approver::OnMissingEvidence::Ignore,
            },
            bootstrap_groups: args.bootstrap_groups.clone(),
            evidence_max_age: args.evidence_max_age,
        },
    };
    Ok(options)
}

#[cfg(feature = "tpm")]
pub fn run(args: ApproverArgs) -> anyhow::Result<()> {
    use std::sync::Arc;

    use crate::lifecycle::approver::{self, metrics::ApproverMetrics};
    use anyhow::Context;

    let options = options(&args)?;
    let election = election(&args)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let config = kube_config(args.kubeconfig.as_deref()).await?;
        let client =
            crate::lifecycle::client::build(&config, crate::lifecycle::client::Identity::Config)?;
        let metrics = Arc::new(ApproverMetrics::default());
        if args.once {
            return decide_once(&client, options, metrics).await;
        }
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let (leading_tx, leading) = tokio::sync::watch::channel(false);
        if let Some(addr) = args.metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?;
            eprintln!(
                "hwkey approver: metrics on http://{}/metrics",
                listener.local_addr()?
            );
            tokio::spawn(approver::metrics::serve(
                listener,
                metrics.clone(),
                leading,
                stop.clone(),
            ));
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot watch SIGTERM")?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("stopping");
            stop_tx.send_replace(true);
        });
        approver::run(&client, options, election, metrics, leading_tx, stop).await?;
        Ok(())
    })
}

/// The Lease settings with `--leader-elect` (not with `--once`), checked as client-go checks them.
#[cfg(feature = "tpm")]
fn election(args: &ApproverArgs) -> anyhow::Result<Option<crate::lifecycle::lease::LeaseConfig>> {
    use crate::lifecycle::lease::{self, LeaseConfig};
    if !args.leader_elect || args.once {
        return Ok(None);
    }
    let namespace = args.leader_elect_namespace.clone().unwrap_or_else(|| {
        std::fs::read_to_string(POD_NAMESPACE_FILE)
            .map(|n| n.trim().to_string())
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "kube-system".into())
    });
    let config = LeaseConfig {
        namespace,
        name: args.leader_elect_lease_name.clone(),
        identity: lease::default_identity(),
        duration: args.leader_elect_lease_duration,
        renew_deadline: args.leader_elect_renew_deadline,
        retry: args.leader_elect_retry_period,
    };
    config
        .check()
        .map_err(|e| anyhow::anyhow!("leader election: {e}"))?;
    Ok(Some(config))
}

/// The API server and credentials: `--kubeconfig`, else the pod's service account (or
/// `$KUBECONFIG`).
#[cfg(feature = "tpm")]
async fn kube_config(path: Option<&std::path::Path>) -> anyhow::Result<kube::Config> {
    use anyhow::Context;
    Ok(match path {
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
    })
}

/// `--once`: decides every open request, prints each decision, fails if any stays open.
#[cfg(feature = "tpm")]
async fn decide_once(
    client: &kube::Client,
    options: crate::lifecycle::approver::ApproverOptions,
    metrics: std::sync::Arc<crate::lifecycle::approver::metrics::ApproverMetrics>,
) -> anyhow::Result<()> {
    let mut approver = crate::lifecycle::approver::Approver::new(client, options, metrics).await?;
    let round = approver.decide_pending().await?;
    for d in &round.decisions {
        println!(
            "{} {}: {} ({})",
            if d.approved { "approved" } else { "denied" },
            d.name,
            d.reason,
            d.message
        );
    }
    if let Some(first) = round.failures.first() {
        anyhow::bail!(
            "{} request(s) could not be decided and stay open; the first: {first}",
            round.failures.len()
        );
    }
    Ok(())
}

#[cfg(not(feature = "tpm"))]
pub fn run(_args: ApproverArgs) -> anyhow::Result<()> {
    anyhow::bail!("this hwkey was built without the TPM 2.0 backend, which checks TPM evidence: rebuild it with `cargo build --features tpm`")
}
