//! `hwkey approver`: the attesting CSR approver (see `crate::approver`).

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
    /// certificates); kubernetes.io/kubelet-serving (a node's serving certificate for its own
    /// addresses); with --people-trust or --people-trust-configmap,
    /// kubernetes.io/kube-apiserver-client (people renewing their own identity); with
    /// --credential-key, hwkey.dev/tpm-credential (TPMs joining by their EK certificate); any
    /// other refuses to start.
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
    /// `hwkey attest enroll`'s output (a mounted ConfigMap works too). Needed for the kubelet
    /// signer.
    #[arg(long, conflicts_with = "trust_configmap")]
    trust: Option<PathBuf>,
    /// The registered nodes as a ConfigMap, NAMESPACE/NAME, one entry per node (read through the
    /// API: a node added to it is admitted without a restart).
    #[arg(long, value_name = "NAMESPACE/NAME")]
    trust_configmap: Option<String>,
    /// The people who may renew their own certificate (kubernetes.io/kube-apiserver-client): a
    /// directory whose `_allow` file names them (YAML: `users: [...]`, hardware proof only;
    /// `certificateOnly: [...]`, also their current certificate alone), plus one file per
    /// user, named after them, with their hardware: a TPM AK (`hwkey attest enroll`'s output)
    /// or YubiKeys (`piv:` with `serials`). Read again every second: a person removed is
    /// refused from then on.
    #[arg(long, conflicts_with = "people_trust_configmap")]
    people_trust: Option<PathBuf>,
    /// The people trust as a ConfigMap, NAMESPACE/NAME (entries as in --people-trust), read
    /// through the API.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    people_trust_configmap: Option<String>,
    /// The CA bundle of the cluster's client certificates (kube-controller-manager's
    /// --cluster-signing-cert-file): a person renewing with their current certificate
    /// (certificateOnly) attaches it, and it must chain here. Needed with a people trust.
    #[arg(long, value_name = "FILE")]
    people_client_ca: Option<PathBuf>,
    /// The longest lifetime a person's request may ask for (spec.expirationSeconds, API
    /// servers 1.22 and later; older ones issue for their --cluster-signing-duration).
    #[arg(long, default_value = "24h", value_parser = crate::duration::parse_duration)]
    people_max_lifetime: Duration,
    /// TPM manufacturers' CA certificates (PEM bundle; repeatable), beside the trust's
    /// `_ek-ca.pem` entry: with --signer-name hwkey.dev/tpm-credential, a TPM whose EK
    /// certificate chains to one may join as a node by itself (`hwkey bootstrap --attest
    /// --ek-proof`), no operator step per node.
    #[arg(long, value_name = "FILE")]
    ek_ca: Vec<PathBuf>,
    /// The manufacturers' CRLs (PEM bundle or DER; repeatable), beside the trust's
    /// `_ek-crl.pem` entry: a revoked EK certificate (or intermediate) is refused, naming it.
    #[arg(long, value_name = "FILE")]
    ek_crl: Vec<PathBuf>,
    /// The key (at least 32 random bytes, e.g. `head -c 32 /dev/urandom`) the credentials'
    /// secrets are derived with: every replica needs the same (mount one Secret). Needed with
    /// --signer-name hwkey.dev/tpm-credential.
    #[arg(long, value_name = "FILE")]
    credential_key: Option<PathBuf>,
    /// How long a joining node has to answer its credential.
    #[arg(long, default_value = "1h", value_parser = crate::duration::parse_duration)]
    credential_ttl: Duration,
    /// More PIV attestation roots and intermediates (PEM), beside Yubico's shipped ones; may
    /// be given more than once.
    #[arg(long, value_name = "FILE")]
    piv_roots: Vec<PathBuf>,
    /// Trust only the --piv-roots given, not Yubico's shipped roots.
    #[arg(long)]
    no_yubico_piv_roots: bool,
    /// A person's request that carries no proof of the key (no TPM evidence, PIV attestation
    /// or current certificate): with `ignore` (default) it is left to a human approver when
    /// the requester asks for their own name (their enrolment) and denied otherwise
    /// (RequesterNotAllowed); with `deny` it is always denied (NoEvidence).
    #[arg(long, value_enum, default_value = "ignore")]
    people_on_missing_proof: OnMissing,
    /// With --signer-name kubernetes.io/kubelet-serving: approve a node's serving certificate
    /// only when the node holds an attested client identity (its AK registered in the trust).
    #[arg(long)]
    serving_require_attested_node: bool,
    /// With --signer-name kubernetes.io/kubelet-serving: the longest lifetime a serving
    /// request may ask for (spec.expirationSeconds; a request asking none gets the signer's
    /// --cluster-signing-duration).
    #[arg(long, value_parser = crate::duration::parse_duration)]
    serving_max_lifetime: Option<Duration>,
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
    /// Serve /healthz alone on this address, for the liveness probe (e.g. 0.0.0.0:9102): its
    /// own 4 connections, so clients of the metrics port cannot starve the probe.
    #[arg(long, value_name = "ADDR")]
    health_listen: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum OnMissing {
    Deny,
    Ignore,
}

#[cfg(feature = "tpm")]
/// Where a service account's namespace is, in a pod.
const POD_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The approver's settings from the flags, checked by the library.
#[cfg(feature = "tpm")]
fn options(args: &ApproverArgs) -> anyhow::Result<crate::approver::ApproverOptions> {
    let flags = crate::approver::settings::Flags {
        signer_names: args.signer_names.clone(),
        bootstrap_groups: args.bootstrap_groups.clone(),
        evidence_max_age: args.evidence_max_age,
        trust: args.trust.clone(),
        trust_configmap: args.trust_configmap.clone(),
        people_trust: args.people_trust.clone(),
        people_trust_configmap: args.people_trust_configmap.clone(),
        people_client_ca: args.people_client_ca.clone(),
        people_max_lifetime: args.people_max_lifetime,
        people_on_missing_proof: on_missing(args.people_on_missing_proof),
        piv_roots: args.piv_roots.clone(),
        no_yubico_piv_roots: args.no_yubico_piv_roots,
        ek_ca: args.ek_ca.clone(),
        ek_crl: args.ek_crl.clone(),
        credential_key: args.credential_key.clone(),
        credential_ttl: args.credential_ttl,
        on_missing_evidence: on_missing(args.on_missing_evidence),
        serving_require_attested_node: args.serving_require_attested_node,
        serving_max_lifetime: args.serving_max_lifetime,
    };
    Ok(flags.check()?)
}

#[cfg(feature = "tpm")]
fn on_missing(flag: OnMissing) -> crate::approver::OnMissingEvidence {
    match flag {
        OnMissing::Deny => crate::approver::OnMissingEvidence::Deny,
        OnMissing::Ignore => crate::approver::OnMissingEvidence::Ignore,
    }
}

#[cfg(feature = "tpm")]
pub fn run(args: ApproverArgs) -> anyhow::Result<()> {
    use std::sync::Arc;

    use crate::approver::{self, metrics::ApproverMetrics};
    use anyhow::Context;

    let options = options(&args)?;
    let election = election(&args)?;
    // Two workers: the Lease's renewals and the liveness probe never wait for a decision.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let config = kube_config(args.kubeconfig.as_deref()).await?;
        let client = crate::lifecycle::client::build_client(
            &config,
            crate::lifecycle::client::Identity::Config,
        )?;
        let metrics = Arc::new(ApproverMetrics::default());
        if args.once {
            return decide_once(&client, options, metrics).await;
        }
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        for (addr, what, serve) in [
            (args.metrics_listen, "metrics", Listener::Metrics),
            (args.health_listen, "health", Listener::Health),
        ] {
            let Some(addr) = addr else { continue };
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --{what}-listen {addr}"))?;
            eprintln!(
                "hwkey approver: {what} on http://{}/",
                listener.local_addr()?
            );
            let (metrics, stop) = (metrics.clone(), stop.clone());
            tokio::spawn(async move {
                match serve {
                    Listener::Metrics => {
                        approver::metrics::serve_metrics(listener, metrics, stop).await
                    }
                    Listener::Health => {
                        approver::metrics::serve_health(listener, metrics, stop).await
                    }
                }
            });
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
        approver::run(&client, options, election, metrics, stop).await?;
        Ok(())
    })
}

#[cfg(feature = "tpm")]
#[derive(Clone, Copy)]
enum Listener {
    Metrics,
    Health,
}

/// The Lease settings with `--leader-elect` (not with `--once`), checked as client-go checks them.
#[cfg(feature = "tpm")]
fn election(args: &ApproverArgs) -> anyhow::Result<Option<crate::approver::lease::LeaseConfig>> {
    use crate::approver::lease::{self, LeaseConfig};
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
    options: crate::approver::ApproverOptions,
    metrics: std::sync::Arc<crate::approver::metrics::ApproverMetrics>,
) -> anyhow::Result<()> {
    let round = crate::approver::decide_once(client, options, metrics).await?;
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
