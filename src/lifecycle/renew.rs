//! `hwkey renew`: one renewal of a hardware identity through the CSR API, authenticating with
//! the current certificate (which must still be valid). The subject is copied from the current
//! certificate unless one is given; the request is signed in the hardware; the issued
//! certificate is checked and installed where the current one was read from.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::csr_api::{self, Outcome, Submission};
use super::issued::{self, Issued, Target};
use super::{client, LifecycleError};
use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::{Key, KeyUri};
use crate::pki::cert;
use crate::pki::csr::{self, CsrRequest};
use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER};
use crate::pki::name::Name;

/// What `hwkey renew` needs.
#[derive(Debug, Clone)]
pub struct RenewOptions {
    /// The forward proxy to the API server (the kubeconfig extension's, or a flag's); None:
    /// `HTTPS_PROXY` unless `NO_PROXY` excludes the server.
    pub proxy_url: Option<String>,
    /// The hardware key (the CSR is for it, and the API client signs with it).
    pub key: KeyUri,
    /// The current certificate's file, where the new one goes; None: the key's own store.
    pub cert: Option<PathBuf>,
    /// The API server, e.g. `https://10.0.0.1:6443`.
    pub server: String,
    /// Its CA bundle (None: the system roots).
    pub ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    /// The subject to ask for (default: the current certificate's).
    pub subject: Option<String>,
    /// The signer to ask (default `kubernetes.io/kube-apiserver-client`, or the kubelet signer for nodes).
    pub signer_name: Option<String>,
    /// The lifetime asked for (`spec.expirationSeconds`); the signer may shorten it.
    pub expiration_seconds: Option<u32>,
    /// How long to wait for approval and issuance.
    pub wait: Duration,
    /// Allow TLS 1.2 with PKCS#1 v1.5 for RSA keys that cannot sign RSA-PSS.
    pub allow_tls12_fallback: bool,
    /// Refuse a key the device says could leave it (`--require-non-extractable`).
    pub require_non_extractable: bool,
    /// Carry TPM2_Certify evidence by the attestation key at this persistent handle (`--attest`).
    pub attest: Option<u32>,
}

/// What a renewal produced.
#[derive(Debug, Clone)]
pub struct Renewed {
    /// The CertificateSigningRequest's name.
    pub csr_name: String,
    /// The certificate that was issued and installed.
    pub issued: Issued,
    /// Where it was installed.
    pub installed: String,
    /// Things the user should know (e.g. expirationSeconds ignored by an old server).
    pub notes: Vec<String>,
}

/// Renews the certificate of `options.key`. The key is opened in a signer process of its own
/// (as the proxy's), which signs only the handshakes and a request for this identity.
pub fn renew(options: &RenewOptions) -> Result<Renewed, LifecycleError> {
    // Before the certificate is read: the renewal acts on what it reads.
    let _one_renewal = options
        .cert
        .as_deref()
        .map(super::renewal_lock::RenewalLock::take)
        .transpose()?;
    let key = crate::signer::open_key(
        &options.key,
        options.cert.as_deref(),
        options.require_non_extractable,
        options.allow_tls12_fallback,
    )?;
    let key = Arc::new(key);
    let chain = cert::chain_for_key(&key, options.cert.as_deref())?;
    cert::ensure_matches(&chain[0], &key)?;
    let subject = match &options.subject {
        Some(s) => s.clone(),
        None => subject_text(&chain[0])?,
    };
    let mut config = client::config_for(
        &options.server,
        options.ca.as_deref(),
        options.tls_server_name.clone(),
    )?;
    if let Some(url) = &options.proxy_url {
        config.proxy_url = Some(url.parse().map_err(|_| LifecycleError::InvalidServer {
            url: "(the forward proxy URL)".into(),
            problem: "not a URL",
        })?);
    }
    let versions = crate::key::tls::protocol_versions(&key, options.allow_tls12_fallback)?;
    let current = chain[0].to_vec();
    let resolver = Arc::new(HardwareCertResolver::new(
        HardwareSigningKey::new(key.clone()),
        chain,
    )?);
    let target = match &options.cert {
        Some(path) => Target::File(path.clone()),
        None => Target::KeyStore(key.clone()),
    };
    request_and_install(
        &key,
        &Ask {
            subject: &subject,
            signer_name: options.signer_name.as_deref(),
            expiration_seconds: options.expiration_seconds,
            wait: options.wait,
            attest: options.attest,
            current_certificate: Some(&current),
            current_lifetime: person_lifetime(&current),
        },
        &config,
        client::Identity::Hardware { resolver, versions },
        &target,
    )
}

/// What to ask the CSR API for.
pub(crate) struct Ask<'a> {
    pub subject: &'a str,
    pub signer_name: Option<&'a str>,
    pub expiration_seconds: Option<u32>,
    pub wait: Duration,
    /// Carry TPM2_Certify evidence by the attestation key at this persistent handle.
    pub attest: Option<u32>,
    /// The certificate the signing key holds now (DER): carried in a request to the generic
    /// client signer without `attest`, so an approver's self-renewal policy can see that the
    /// key is the one this identity already holds.
    pub current_certificate: Option<&'a [u8]>,
    /// The lifetime a person's request asks for when `expiration_seconds` is not given (see
    /// [`person_lifetime`]), from the certificate in use, whichever key the request is for.
    pub current_lifetime: Option<u32>,
}

/// Signs a CSR for `ask.subject` with `key` (blocking: the signature is made in the device) and
/// describes the CertificateSigningRequest to create for it.
pub(crate) fn prepare(key: &Key, ask: &Ask<'_>) -> Result<Submission, LifecycleError> {
    let name = Name::parse(ask.subject)?;
    let cn = name
        .0
        .iter()
        .find(|a| a.short == "CN")
        .map(|a| a.value.clone())
        .unwrap_or_default();
    let orgs: Vec<String> = name
        .0
        .iter()
        .filter(|a| a.short == "O")
        .map(|a| a.value.clone())
        .collect();
    let request = CsrRequest {
        subject: name,
        ..Default::default()
    };
    let signer_name = ask
        .signer_name
        .map(str::to_string)
        .unwrap_or_else(|| default_signer(&cn, &orgs).to_string());
    // Hardware proof first (TPM evidence when asked for, a YubiKey's PIV attestation for a
    // person's request); the current certificate only when the key has none.
    let hardware = csr::build_with_hardware_proof(key, &request, ask.attest)?;
    let csr_der = match (hardware, ask.current_certificate) {
        (Some(der), _) => der,
        (None, Some(cert)) if signer_name == CLIENT_SIGNER => {
            csr::build_renewal(key, &request, cert)?
        }
        (None, _) => csr::build(key, &request)?,
    };
    let for_a_person = signer_name == CLIENT_SIGNER;
    Ok(Submission {
        csr_pem: csr::request_pem(&csr_der),
        signer_name,
        usages: CLIENT_USAGES.iter().map(|u| u.to_string()).collect(),
        expiration_asked: ask.expiration_seconds.is_some(),
        expiration_seconds: ask
            .expiration_seconds
            .or(ask.current_lifetime.filter(|_| for_a_person))
            .map(|s| i32::try_from(s).unwrap_or(i32::MAX)),
        name_prefix: format!("hwkey-{}-", k8s_name_part(&cn)),
        annotations: Default::default(),
    })
}

/// Creates the request and waits for it: the issued PEM chain and the request's name, or the
/// denial/failure as an error. Notes what the user should know (an ignored expirationSeconds).
pub(crate) async fn submit(
    client: &kube::Client,
    server: &str,
    submission: &Submission,
    wait: Duration,
    notes: &mut Vec<String>,
) -> Result<(String, Vec<u8>), LifecycleError> {
    if submission.expiration_asked {
        if let Ok(info) = client.apiserver_version().await {
            let minor: u32 = info
                .minor
                .trim_end_matches(|c: char| !c.is_ascii_digit())
                .parse()
                .unwrap_or(u32::MAX);
            if info.major == "1" && minor < 22 {
                notes.push(format!(
                    "--expiration-seconds is ignored by this API server ({}): it issues certificates for its --cluster-signing-duration",
                    info.git_version
                ));
            }
        }
    }
    let csr_name = csr_api::create(client, server, submission).await?;
    tracing::info!(csr = %csr_name, signer = %submission.signer_name, "CertificateSigningRequest created; waiting for it to be issued");
    match csr_api::wait(client, &csr_name, wait).await? {
        Outcome::Issued(pem) => Ok((csr_name, pem)),
        Outcome::Denied { reason, message } => Err(LifecycleError::Denied {
            name: csr_name,
            reason,
            message,
        }),
        Outcome::Failed { reason, message } => Err(LifecycleError::Failed {
            name: csr_name,
            reason,
            message,
        }),
    }
}

/// Signs a CSR for `ask.subject` with `key`, submits it as `identity`, waits for the outcome,
/// checks and installs the certificate at `target`. Shared by renew and bootstrap.
pub(crate) fn request_and_install(
    key: &Key,
    ask: &Ask<'_>,
    config: &kube::Config,
    identity: client::Identity,
    target: &Target,
) -> Result<Renewed, LifecycleError> {
    // Signed in the hardware, on this thread, before any runtime exists.
    let submission = prepare(key, ask)?;
    submit_and_install(key, &submission, ask.wait, config, identity, target)
}

/// Submits `submission` as `identity`, waits for the outcome, checks and installs the
/// certificate at `target`.
pub(crate) fn submit_and_install(
    key: &Key,
    submission: &Submission,
    wait: Duration,
    config: &kube::Config,
    identity: client::Identity,
    target: &Target,
) -> Result<Renewed, LifecycleError> {
    let server = config.cluster_url.to_string();
    let runtime = super::client::runtime()?;
    let mut notes = Vec::new();
    let (csr_name, pem) = runtime.block_on(async {
        let client = client::build_client(config, identity)?;
        submit(&client, &server, submission, wait, &mut notes).await
    })?;
    let issued = issued::check_issued(&csr_name, &pem, key)?;
    let installed = issued::install(target, &issued)?;
    tracing::info!(csr = %csr_name, subject = %issued.subject, not_after = %issued.not_after, installed = %installed, "certificate rotated");
    Ok(Renewed {
        csr_name,
        issued,
        installed,
        notes,
    })
}

/// Why the subject of the certificate in use cannot be copied into a request, for
/// [`LifecycleError::Subject`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum SubjectProblem {
    #[error("the proxy holds no certificate")]
    NoCertificate,
    #[error("unreadable certificate: {0}")]
    Unreadable(#[source] x509_parser::error::X509Error),
    #[error("attribute {0} has no short name hwkey knows")]
    UnknownAttribute(String),
    #[error("{0} is not a string")]
    NotAString(&'static str),
    #[error("{0} holds a backslash")]
    Backslash(&'static str),
    #[error("it is empty")]
    Empty,
}

/// The subject of a certificate as `CN=…,O=…` text that [`Name::parse`] reads back.
pub(crate) fn subject_text(cert_der: &[u8]) -> Result<String, LifecycleError> {
    let bad = |problem| LifecycleError::Subject { problem };
    let (_, parsed) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| bad(SubjectProblem::Unreadable(e.into())))?;
    let mut parts = Vec::new();
    for attr in parsed.subject().iter_attributes() {
        let oid = attr.attr_type();
        let arcs: Vec<u64> = oid.iter().map(Iterator::collect).unwrap_or_default();
        let short = crate::pki::name::short_name(&arcs)
            .ok_or_else(|| bad(SubjectProblem::UnknownAttribute(oid.to_id_string())))?;
        let value = attr
            .as_str()
            .map_err(|_| bad(SubjectProblem::NotAString(short)))?;
        if value.contains('\\') {
            return Err(bad(SubjectProblem::Backslash(short)));
        }
        parts.push(format!("{short}={}", value.replace(',', "\\,")));
    }
    if parts.is_empty() {
        return Err(bad(SubjectProblem::Empty));
    }
    Ok(parts.join(","))
}

/// The lifetime a person's renewal asks for when none is given: the current certificate's (at
/// least the 10 minutes Kubernetes accepts), so the identity keeps its cadence; an approver's
/// self-renewal policy requires a lifetime where the API server knows `spec.expirationSeconds`.
/// None for a certificate that lives over a day: asking for less than it has left would have
/// the proxy refuse each shorter certificate and ask again (the person passes
/// `--expiration-seconds` once, with `hwkey renew`).
pub(crate) fn person_lifetime(cert_der: &[u8]) -> Option<u32> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
    let v = cert.validity();
    let lifetime = v.not_after.timestamp() - v.not_before.timestamp();
    (lifetime <= 86_400).then(|| u32::try_from(lifetime.max(600)).unwrap_or(600))
}

/// A lowercase RFC 1123 fragment of `text` for `metadata.generateName`.
fn k8s_name_part(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' | '.' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    out.truncate(40);
    let trimmed = out.trim_matches(|c| c == '-' || c == '.').to_string();
    if trimmed.is_empty() {
        "client".into()
    } else {
        trimmed
    }
}

/// The usages of a client-certificate request. kube-controller-manager 1.20's auto-approver
/// accepts a kubelet client CSR only with exactly these three (EC keys included); newer servers
/// also accept it without key encipherment.
pub const CLIENT_USAGES: [&str; 3] = ["digital signature", "key encipherment", "client auth"];

/// The signer for a subject: kubelet's when it is a node identity (`CN=system:node:NAME`,
/// `O=system:nodes`), the generic client signer otherwise.
pub fn default_signer(common_name: &str, organizations: &[String]) -> &'static str {
    if common_name.starts_with("system:node:") && organizations.iter().any(|o| o == "system:nodes")
    {
        KUBELET_SIGNER
    } else {
        CLIENT_SIGNER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_persons_renewal_asks_for_the_current_lifetime_unless_it_is_over_a_day() {
        let cert = |hours: i64| {
            let key = rcgen::KeyPair::generate().expect("key");
            let mut params = rcgen::CertificateParams::default();
            let now = time::OffsetDateTime::now_utc();
            params.not_before = now;
            params.not_after = now + time::Duration::hours(hours);
            params.self_signed(&key).expect("cert").der().to_vec()
        };
        assert_eq!(person_lifetime(&cert(8)), Some(8 * 3600));
        assert_eq!(person_lifetime(&cert(24 * 365)), None);
        assert_eq!(person_lifetime(&cert(0)), Some(600));
        assert_eq!(person_lifetime(b"not a certificate"), None);
    }

    #[test]
    fn generated_names_are_valid_kubernetes_names() {
        assert_eq!(k8s_name_part("system:node:Node-1"), "system-node-node-1");
        assert_eq!(k8s_name_part("::"), "client");
        assert!(k8s_name_part(&"a".repeat(100)).len() <= 40);
    }
}
