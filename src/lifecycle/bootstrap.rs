//! `hwkey bootstrap`: kubelet TLS bootstrapping with the key in hardware.
//!
//! kubelet's own bootstrap mints a software key. Here the key is created (or found) in the
//! PKCS#11 token or TPM, a CSR for `CN=system:node:NAME, O=system:nodes` is signed inside it and
//! submitted with the bootstrap token (kube-controller-manager's csrapproving controller approves
//! it for the `system:bootstrappers` group), and the issued certificate is installed; then the
//! kubelet kubeconfig is written the way `hwkey kubeconfig --for kubelet` writes it. Idempotent:
//! a valid node certificate for this key and node already present means there is nothing to do.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::context::KubeconfigProblem;
use super::issued::Target;
#[cfg(feature = "tpm")]
use super::renew::submit_and_install;
use super::renew::{request_and_install, Ask, Renewed};
use super::{client, LifecycleError, KUBELET_SIGNER};
use crate::key::LocateError;
use crate::key::{Key, KeyAlgorithm, KeyError, KeyUri};
use crate::kubeconfig::{self, Consumer, ExecApiVersion, Request};
use crate::pki::cert;

/// What `hwkey bootstrap` needs.
#[derive(Debug, Clone)]
pub struct BootstrapOptions {
    /// A kubeconfig with the API server, its CA and a bootstrap token.
    pub bootstrap_kubeconfig: PathBuf,
    /// The node's name: the identity asked for is `system:node:NAME`.
    pub node_name: String,
    /// The hardware key the node identity is for.
    pub key: KeyUri,
    /// Create the key with this algorithm when it does not exist yet.
    pub create_key: Option<KeyAlgorithm>,
    /// Where the node certificate goes (None: the key's own store).
    pub cert: Option<PathBuf>,
    /// The kubelet kubeconfig to write.
    pub out: PathBuf,
    /// The proxy's state directory (loopback CA, control socket).
    pub state_dir: PathBuf,
    /// The proxy's loopback port the kubeconfig points at (None: the file's, else a free one).
    pub port: Option<u16>,
    /// How long to wait for the CSR to be approved and issued.
    pub wait: Duration,
    /// The hwkey binary the kubelet kubeconfig's exec block runs.
    pub command: PathBuf,
    /// The exec block's version (None: from the API server's version, see
    /// [`ExecApiVersion::for_cluster`]).
    pub exec_api_version: Option<ExecApiVersion>,
    /// Refuse a key the device says could leave it (`--require-non-extractable`).
    pub require_non_extractable: bool,
    /// Carry TPM2_Certify evidence by the attestation key at this persistent handle (`--attest`).
    pub attest: Option<u32>,
    /// Prove the TPM by its EK certificate first (`--ek-proof`): the approver then trusts the
    /// AK with no operator step, and binds the node name to this TPM. The EK to use (None: the
    /// RSA EK when its certificate is in NV, else the ECC EK).
    pub ek_proof: Option<Option<crate::key::attestation::EkKind>>,
}

/// What bootstrapping did.
#[derive(Debug, Clone)]
pub enum Bootstrapped {
    /// A valid node certificate was already there; only missing files were written.
    AlreadyDone {
        /// The existing certificate's subject.
        subject: String,
        /// Its NotAfter, RFC 3339.
        not_after: String,
    },
    /// A certificate was requested and installed.
    Issued(Renewed),
}

/// Bootstraps the node identity.
pub fn bootstrap(options: &BootstrapOptions) -> Result<Bootstrapped, LifecycleError> {
    check_node_name(&options.node_name)?;
    let subject = format!("CN=system:node:{},O=system:nodes", options.node_name);
    let key = std::sync::Arc::new(open_or_create(&options.key, options.create_key)?);
    key.require_non_extractable(options.require_non_extractable)?;
    let (config, ca_file) = read_bootstrap_kubeconfig(options)?;

    if let Some((subject, not_after)) = current_node_cert(&key, options)? {
        write_kubelet_kubeconfig(options, &config, &ca_file)?;
        return Ok(Bootstrapped::AlreadyDone { subject, not_after });
    }
    let target = match &options.cert {
        Some(p) => Target::File(p.clone()),
        None => Target::KeyStore(key.clone()),
    };
    let ask = Ask {
        subject: &subject,
        signer_name: Some(KUBELET_SIGNER),
        expiration_seconds: None,
        wait: options.wait,
        attest: options.attest,
        current_certificate: None,
        current_lifetime: None,
    };
    let renewed = match (options.ek_proof, options.attest) {
        #[cfg(feature = "tpm")]
        (Some(ek), Some(ak_handle)) => {
            let proof = super::ek_proof::Proof {
                uri: &options.key,
                node_name: &options.node_name,
                subject: &subject,
                ak_handle,
                ek,
                wait: options.wait,
            };
            let answer = super::ek_proof::prove(&key, &proof, &config)?;
            let mut submission = super::renew::prepare(&key, &ask)?;
            submission.annotations = answer.annotations();
            submit_and_install(&key, &submission, options.wait, &config, client::Identity::Config, &target)?
        }
        #[cfg(not(feature = "tpm"))]
        (Some(_), Some(_)) => {
            return Err(LifecycleError::EkProof(
                "this hwkey was built without the TPM 2.0 backend: rebuild it with `cargo build --features tpm`".into(),
            ))
        }
        (Some(_), None) => {
            return Err(LifecycleError::EkProof(
                "--ek-proof needs --attest: the EK proves the attestation key, which certifies the node key".into(),
            ))
        }
        (None, _) => request_and_install(&key, &ask, &config, client::Identity::Config, &target)?,
    };
    write_kubelet_kubeconfig(options, &config, &ca_file)?;
    Ok(Bootstrapped::Issued(renewed))
}

/// The exec apiVersion for the cluster's kubelets, from the API server's `/version` (readable
/// with the bootstrap token). When it cannot be read, `v1beta1`: every client-go since 1.11
/// understands it.
fn cluster_exec_api_version(config: &kube::Config) -> ExecApiVersion {
    let version = super::client::runtime().ok().and_then(|rt| {
        rt.block_on(async {
            let client = client::build_client(config, client::Identity::Config).ok()?;
            client.apiserver_version().await.ok()
        })
    });
    match version {
        Some(v) => ExecApiVersion::for_cluster(&v.major, &v.minor),
        None => ExecApiVersion::V1beta1,
    }
}

/// Node names are DNS subdomains (lowercase letters, digits, '-', '.').
fn check_node_name(name: &str) -> Result<(), LifecycleError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && !name.starts_with(['-', '.'])
        && !name.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(LifecycleError::Kubelet(format!(
            "invalid --node-name '{name}': a node name is a DNS subdomain (lowercase letters, digits, '-' and '.', e.g. worker-1)"
        )))
    }
}

fn open_or_create(uri: &KeyUri, create: Option<KeyAlgorithm>) -> Result<Key, LifecycleError> {
    match Key::open(uri) {
        Ok(k) => Ok(k),
        Err(KeyError::Locate(LocateError::KeyNotFound { .. })) if create.is_some() => {
            create_key(uri, create)
        }
        Err(KeyError::Io { ref source, .. })
            if create.is_some() && source.kind() == std::io::ErrorKind::NotFound =>
        {
            create_key(uri, create)
        }
        Err(e @ (KeyError::Locate(LocateError::KeyNotFound { .. }) | KeyError::Io { .. })) => {
            Err(LifecycleError::Kubelet(format!(
                "{e}; to create the node key now, add --create-key ec-p256"
            )))
        }
        Err(e) => Err(e.into()),
    }
}

fn create_key(uri: &KeyUri, create: Option<KeyAlgorithm>) -> Result<Key, LifecycleError> {
    let algorithm = create.unwrap_or(KeyAlgorithm::EcP256);
    let key = Key::create(uri, algorithm)?;
    tracing::info!(key = %key.describe(), %algorithm, "created the node key");
    Ok(key)
}

/// The node certificate already installed for this key, if it is valid now and names this node.
fn current_node_cert(
    key: &Key,
    options: &BootstrapOptions,
) -> Result<Option<(String, String)>, LifecycleError> {
    let chain = match cert::chain_for_key(key, options.cert.as_deref()) {
        Ok(c) => c,
        Err(_) => return Ok(None),
    };
    if !cert::matches_key(&chain[0], key).unwrap_or(false) {
        return Ok(None);
    }
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(&chain[0]) else {
        return Ok(None);
    };
    let wanted = format!("system:node:{}", options.node_name);
    let names_node = parsed
        .subject()
        .iter_common_name()
        .any(|cn| cn.as_str().ok() == Some(wanted.as_str()));
    if !names_node || !parsed.validity().is_valid() {
        return Ok(None);
    }
    Ok(Some((
        parsed.subject().to_string(),
        parsed.validity().not_after.to_string(),
    )))
}

/// Reads the bootstrap kubeconfig into a kube config (server, CA, token) and a CA file path for
/// the kubelet kubeconfig (the bootstrap file's, or its inline data written to the state dir).
fn read_bootstrap_kubeconfig(
    options: &BootstrapOptions,
) -> Result<(kube::Config, PathBuf), LifecycleError> {
    let path = &options.bootstrap_kubeconfig;
    let bad = |p| super::context::problem(path, p);
    let kubeconfig = super::context::read_file(path)?;
    let (_, cluster) = super::context::cluster(path, &kubeconfig, None, true)?;
    let ca_file = match (
        &cluster.certificate_authority,
        &cluster.certificate_authority_data,
    ) {
        (Some(file), _) => {
            let p = PathBuf::from(file);
            let p = if p.is_relative() {
                path.parent().unwrap_or(Path::new(".")).join(p)
            } else {
                p
            };
            std::fs::canonicalize(&p)
                .map_err(|source| bad(KubeconfigProblem::CaFile { path: p, source }))?
        }
        (None, Some(data)) => {
            use base64::Engine;
            let pem = base64::engine::general_purpose::STANDARD
                .decode(data.trim())
                .map_err(|e| bad(KubeconfigProblem::CaData(e)))?;
            std::fs::create_dir_all(&options.state_dir).map_err(|source| {
                LifecycleError::Install {
                    path: options.state_dir.clone(),
                    source,
                }
            })?;
            let p = crate::state_dir::StateDir::new(options.state_dir.clone()).apiserver_ca();
            crate::atomic_file::write_atomic(&p, &pem, 0o644).map_err(|source| {
                LifecycleError::Install {
                    path: p.clone(),
                    source,
                }
            })?;
            p
        }
        (None, None) => return Err(bad(KubeconfigProblem::NoCa)),
    };
    let runtime = super::client::runtime()?;
    let config = runtime
        .block_on(kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        ))
        .map_err(|e| bad(KubeconfigProblem::Unreadable(e)))?;
    Ok((config, ca_file))
}

fn write_kubelet_kubeconfig(
    options: &BootstrapOptions,
    config: &kube::Config,
    ca_file: &Path,
) -> Result<(), LifecycleError> {
    let exec_api_version = match options.exec_api_version {
        Some(v) => v,
        None => cluster_exec_api_version(config),
    };
    let server = config.cluster_url.to_string();
    let request = Request {
        name: "kubelet".into(),
        key: options.key.clone(),
        cert: options.cert.clone(),
        upstream: server.trim_end_matches('/').parse().map_err(|e| {
            LifecycleError::Kubelet(format!("the bootstrap kubeconfig's server: {e}"))
        })?,
        upstream_ca: ca_file.to_path_buf(),
        tls_server_name: config.tls_server_name.clone(),
        // The bootstrap kubeconfig's proxy-url carries over to the node's proxy.
        upstream_proxy: config.proxy_url.as_ref().map(ToString::to_string),
        port: options.port,
        state_dir: options.state_dir.clone(),
        idle_exit: None,
        renew: false,
        attest: None,
        command: options.command.clone(),
        consumer: Consumer::Kubelet,
        exec_api_version,
    };
    kubeconfig::write(&request, &options.out)
        .map(|_| ())
        .map_err(LifecycleError::KubeletKubeconfig)
}
