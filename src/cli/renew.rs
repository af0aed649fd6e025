//! `hwkey renew`: renew the certificate of a hardware key through the Kubernetes CSR API.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::key::KeyUri;
use crate::lifecycle::renew::{self, RenewOptions};
use crate::lifecycle::{context, DEFAULT_WAIT};

#[derive(Debug, Args)]
pub struct RenewArgs {
    /// The hardware key (default: from --kubeconfig's hwkey context).
    #[arg(long, env = "HWKEY_KEY")]
    key: Option<String>,
    /// The current certificate's PEM file; the renewed one replaces it (the old one is kept as
    /// FILE.prev). Default: the certificate stored with the key.
    #[arg(long, env = "HWKEY_CERT")]
    cert: Option<PathBuf>,
    /// The API server URL (default: the upstream of --kubeconfig's context).
    #[arg(long)]
    server: Option<String>,
    /// The API server's CA bundle (default: from --kubeconfig, else the system roots).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Name to verify the API server certificate against.
    #[arg(long)]
    tls_server_name: Option<String>,
    /// Forward proxy to the API server (http://, https:// or socks5://HOST:PORT, no
    /// credentials). Default: the --kubeconfig's, else HTTPS_PROXY unless NO_PROXY excludes it.
    #[arg(long)]
    proxy_url: Option<String>,
    /// A kubeconfig written by `hwkey kubeconfig`: key, certificate, API server and CA come from
    /// its context's hwkey extension.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The context of --kubeconfig (default: its current context).
    #[arg(long, requires = "kubeconfig")]
    context: Option<String>,
    /// Subject to request (default: the current certificate's), e.g. "CN=alice,O=devs".
    #[arg(long)]
    subject: Option<String>,
    /// signerName (default: kubernetes.io/kube-apiserver-client-kubelet for
    /// CN=system:node:*,O=system:nodes, else kubernetes.io/kube-apiserver-client).
    #[arg(long)]
    signer_name: Option<String>,
    /// spec.expirationSeconds (API servers older than 1.22 ignore it).
    #[arg(long)]
    expiration_seconds: Option<u32>,
    /// How long to wait for the request to be issued (e.g. 30s, 15m).
    #[arg(long, default_value = "15m")]
    wait: String,
    /// For an RSA key on a token without RSA-PSS or raw RSA: use TLS 1.2.
    #[arg(long, env = "HWKEY_ALLOW_TLS12_FALLBACK")]
    allow_tls12_fallback: bool,
    #[command(flatten)]
    policy: super::KeyPolicy,
    #[command(flatten)]
    attest: super::attest::AttestArgs,
}

pub fn run(args: RenewArgs) -> anyhow::Result<()> {
    let from_kubeconfig = match &args.kubeconfig {
        Some(path) => Some(context::read_extension(path, args.context.as_deref())?),
        None => None,
    };
    let key: KeyUri = match args.key {
        Some(text) => text.parse()?,
        None => from_kubeconfig
            .as_ref()
            .and_then(|c| c.key.clone())
            .context("no key: pass --key URI or --kubeconfig FILE (a kubeconfig written by `hwkey kubeconfig`)")?,
    };
    let server = args
        .server
        .or_else(|| {
            from_kubeconfig
                .as_ref()
                .and_then(|c| c.upstream.as_ref().map(|u| u.to_string()))
        })
        .context("no API server: pass --server https://HOST:6443 or --kubeconfig FILE")?;
    let wait = crate::duration::parse_duration(&args.wait)?;
    let proxy_url = match args.proxy_url {
        Some(url) => {
            crate::egress::ForwardProxy::parse_argv(&url).context("--proxy-url")?;
            Some(url)
        }
        None => from_kubeconfig
            .as_ref()
            .and_then(|c| c.upstream_proxy.clone()),
    };
    let options = RenewOptions {
        proxy_url,
        key,
        cert: args
            .cert
            .or_else(|| from_kubeconfig.as_ref().and_then(|c| c.cert.clone())),
        server,
        ca: args
            .ca
            .or_else(|| from_kubeconfig.as_ref().and_then(|c| c.upstream_ca.clone())),
        tls_server_name: args.tls_server_name.or_else(|| {
            from_kubeconfig
                .as_ref()
                .and_then(|c| c.tls_server_name.clone())
        }),
        subject: args.subject,
        signer_name: args.signer_name,
        expiration_seconds: args.expiration_seconds,
        wait: if wait.is_zero() { DEFAULT_WAIT } else { wait },
        allow_tls12_fallback: args.allow_tls12_fallback,
        require_non_extractable: args.policy.required(),
        attest: args.attest.ak_handle(),
    };
    let renewed = renew::renew(&options)?;
    for note in &renewed.notes {
        eprintln!("hwkey: note: {note}");
    }
    eprintln!(
        "renewed: {} (serial {}), valid until {}; CertificateSigningRequest {}; installed in {}",
        renewed.issued.subject,
        renewed.issued.serial,
        renewed.issued.not_after,
        renewed.csr_name,
        renewed.installed
    );
    Ok(())
}
