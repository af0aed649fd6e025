//! Creating a `certificates.k8s.io/v1` CertificateSigningRequest and waiting for its outcome
//! with a watch (re-established when the server ends it), the way kubelet's certificate manager
//! waits: issued (a certificate appears), denied or failed (a condition), or the caller's
//! deadline.

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, PostParams, WatchEvent, WatchParams};

use super::LifecycleError;

/// What to ask for.
#[derive(Debug, Clone)]
pub struct Submission {
    /// The PEM `CERTIFICATE REQUEST`, signed in the hardware.
    pub csr_pem: String,
    /// The `spec.signerName` (e.g. `kubernetes.io/kube-apiserver-client`).
    pub signer_name: String,
    /// The `spec.usages` (`digital signature`, `client auth`).
    pub usages: Vec<String>,
    /// `spec.expirationSeconds` (honoured by API servers from 1.22 on).
    pub expiration_seconds: Option<i32>,
    /// Whether the user asked for that lifetime (`--expiration-seconds`): only then is an
    /// API server that ignores it worth a note.
    pub expiration_asked: bool,
    /// `metadata.generateName`: the server appends a random suffix.
    pub name_prefix: String,
    /// `metadata.annotations` (a joining TPM's enrollment, or its credential's answer).
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// How a request ended.
#[derive(Debug)]
pub enum Outcome {
    /// The issued certificate chain (PEM).
    Issued(Vec<u8>),
    /// An approver denied it.
    Denied {
        /// The condition's reason.
        reason: String,
        /// The condition's message.
        message: String,
    },
    /// The signer failed it.
    Failed {
        /// The condition's reason.
        reason: String,
        /// The condition's message.
        message: String,
    },
}

/// Creates the request; returns its name.
pub async fn create(
    client: &kube::Client,
    server: &str,
    submission: &Submission,
) -> Result<String, LifecycleError> {
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let object = CertificateSigningRequest {
        metadata: ObjectMeta {
            generate_name: Some(submission.name_prefix.clone()),
            annotations: (!submission.annotations.is_empty())
                .then(|| submission.annotations.clone()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(submission.csr_pem.as_bytes().to_vec()),
            signer_name: submission.signer_name.clone(),
            usages: Some(submission.usages.clone()),
            expiration_seconds: submission.expiration_seconds,
            ..Default::default()
        },
        status: None,
    };
    match api.create(&PostParams::default(), &object).await {
        Ok(created) => created
            .metadata
            .name
            .ok_or_else(|| LifecycleError::Unnamed {
                server: server.to_string(),
            }),
        Err(e) => {
            let hint = match &e {
                kube::Error::Api(s) if s.code == 401 => {
                    ": the API server did not accept the client certificate (expired, or from another CA?) or the bootstrap token"
                }
                kube::Error::Api(s) if s.code == 403 => {
                    ": this identity may not create CertificateSigningRequests; an administrator grants it (e.g. bind the ClusterRole system:node-bootstrapper)"
                }
                _ => "",
            };
            Err(LifecycleError::Create {
                server: server.to_string(),
                source: e,
                hint,
            })
        }
    }
}

/// Waits until the request named `name` is issued, denied or failed, at most `wait`.
pub async fn wait(
    client: &kube::Client,
    name: &str,
    wait: Duration,
) -> Result<Outcome, LifecycleError> {
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let deadline = Instant::now() + wait;
    let watch_err = |source: kube::Error| LifecycleError::Watch {
        name: name.to_string(),
        source,
    };
    loop {
        // Read the current state, then watch for changes from its resourceVersion.
        let current = api.get(name).await.map_err(watch_err)?;
        if let Some(outcome) = outcome_of(&current) {
            return Ok(outcome);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LifecycleError::Timeout {
                name: name.to_string(),
                waited: wait,
            });
        }
        let version = current
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        let params = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(left.as_secs().clamp(1, 290) as u32);
        let stream = api.watch(&params, &version).await.map_err(watch_err)?;
        futures::pin_mut!(stream);
        let watched = tokio::time::timeout(left, async {
            while let Some(event) = stream.try_next().await.map_err(watch_err)? {
                match event {
                    WatchEvent::Added(csr) | WatchEvent::Modified(csr) => {
                        if let Some(outcome) = outcome_of(&csr) {
                            return Ok(Some(outcome));
                        }
                    }
                    WatchEvent::Deleted(_) => {
                        return Err(LifecycleError::Deleted {
                            name: name.to_string(),
                        })
                    }
                    // 410 Gone and friends: read the state again and watch anew.
                    WatchEvent::Error(_) => return Ok(None),
                    WatchEvent::Bookmark(_) => {}
                }
            }
            Ok(None)
        })
        .await;
        match watched {
            Ok(Ok(Some(outcome))) => return Ok(outcome),
            Ok(Ok(None)) | Err(_) => continue,
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// The outcome a request shows, if it has one. A Denied or Failed condition wins over a
/// certificate (a signer may fail after approval).
fn outcome_of(csr: &CertificateSigningRequest) -> Option<Outcome> {
    let status = csr.status.as_ref()?;
    for c in status.conditions.iter().flatten() {
        let reason = c.reason.clone().unwrap_or_else(|| "no reason given".into());
        let message = c.message.clone().unwrap_or_default();
        match c.type_.as_str() {
            "Denied" => return Some(Outcome::Denied { reason, message }),
            "Failed" => return Some(Outcome::Failed { reason, message }),
            _ => {}
        }
    }
    status
        .certificate
        .as_ref()
        .filter(|c| !c.0.is_empty())
        .map(|c| Outcome::Issued(c.0.clone()))
}
