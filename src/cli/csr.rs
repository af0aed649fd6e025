//! `hwkey csr`: a PKCS#10 request signed inside the hardware, as PEM or wrapped in a Kubernetes
//! `certificates.k8s.io/v1` CertificateSigningRequest ready for `kubectl apply -f -`.

use std::path::PathBuf;

use clap::Args;

use crate::key::{Key, KeyUri};
use crate::pki::csr::{self, CsrRequest};

#[derive(Debug, Args)]
pub struct CsrArgs {
    /// The key that signs the request.
    #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
    key: KeyUri,
    /// Subject, e.g. "CN=alice,O=devs" (Kubernetes: CN = user, each O = a group).
    #[arg(long)]
    subject: String,
    /// A DNS subject alternative name (repeatable).
    #[arg(long = "dns")]
    dns: Vec<String>,
    /// An IP subject alternative name (repeatable).
    #[arg(long = "ip")]
    ip: Vec<String>,
    /// Write the output here (atomically) instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print a Kubernetes CertificateSigningRequest object with this name instead of PEM.
    #[arg(long = "k8s-name")]
    k8s_name: Option<String>,
    /// signerName of the Kubernetes object (default: kubernetes.io/kube-apiserver-client, or
    /// kubernetes.io/kube-apiserver-client-kubelet for CN=system:node:…).
    #[arg(long, requires = "k8s_name")]
    signer_name: Option<String>,
    /// spec.expirationSeconds of the Kubernetes object.
    #[arg(long, requires = "k8s_name")]
    expiration_seconds: Option<u32>,
    #[command(flatten)]
    policy: super::KeyPolicy,
    #[command(flatten)]
    attest: super::attest::AttestArgs,
}

pub fn run(args: CsrArgs) -> anyhow::Result<()> {
    let request = CsrRequest::parse(&args.subject, &args.dns, &args.ip)?;
    let key = Key::open(&args.key)?;
    key.require_non_extractable(args.policy.required())?;
    // TPM evidence when asked for; a person's key on a YubiKey carries its PIV attestation.
    let der = match csr::build_with_hardware_proof(&key, &request, args.attest.ak_handle())? {
        Some(der) => der,
        None => csr::build(&key, &request)?,
    };
    let pem = csr::request_pem(&der);
    let text = match &args.k8s_name {
        None => pem,
        Some(name) => {
            let signer = args.signer_name.clone().unwrap_or_else(|| {
                if request.names_a_node() {
                    "kubernetes.io/kube-apiserver-client-kubelet".into()
                } else {
                    "kubernetes.io/kube-apiserver-client".into()
                }
            });
            csr::kubernetes_object(name, &pem, &signer, args.expiration_seconds)
        }
    };
    emit(args.out.as_deref(), &text)
}

/// Writes output to `--out` atomically, or to stdout.
fn emit(out: Option<&std::path::Path>, text: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    match out {
        Some(path) => crate::atomic_file::write_atomic(path, text.as_bytes(), 0o644)
            .with_context(|| format!("cannot write {}", path.display())),
        None => {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            stdout.write_all(text.as_bytes())?;
            stdout.flush()?;
            Ok(())
        }
    }
}
