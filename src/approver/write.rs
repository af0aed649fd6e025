//! Writing a decision to the API server: the condition through the `approval` subresource, a
//! carrier certificate or a Failed condition through `status`, a binding in the trust
//! ConfigMap first. Each write carries the uid and resourceVersion that were read.

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition, CertificateSigningRequestSpec,
    CertificateSigningRequestStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::decision::{Decision, Effect};
use super::ek_join::Binding;
use super::error::ApproverError;
use super::evaluate::{KeptMetadata, Seen};
use super::lease::Validity;
use super::node_addresses::NodeIndex;
use super::policy::serving;
use super::trust::Trust;
use crate::metric_labels::LabelValue;

/// A write in flight: the request's uid and what became of it.
pub type WriteFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = (String, Result<Recorded, ApproverError>)> + Send>,
>;

/// What became of a decision sent to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// The condition is on the request.
    Yes,
    /// Another condition than the one sent is on the request: what the cluster held when it
    /// was written decided otherwise (a serving request's names checked against its Node).
    Instead(Box<Decision>),
    /// The request changed since it was read (another approver or replica decided it, or it
    /// was deleted): nothing was written, and the new state will be seen again.
    Conflict,
}

/// Writes `decision` through the `approval` subresource (PUT: RBAC verb `update`), unless
/// this replica's Lease is out of date. The body is the request as it was read without its
/// bytes (the API server keeps the spec of the stored object on this subresource): its uid and
/// resourceVersion are the precondition, so a write over a changed or re-created request is
/// refused with 409 and reported as [`Recorded::Conflict`].
pub fn write_decision(
    api: Api<CertificateSigningRequest>,
    validity: Option<Validity>,
    trust: Option<Trust>,
    nodes: NodeIndex,
    uid: String,
    seen: Seen,
    (decision, effect): (Decision, Effect),
) -> WriteFuture {
    Box::pin(async move {
        if let Some(v) = &validity {
            if let Err(e) = v.check() {
                return (uid, Err(e));
            }
        }
        let result = match effect {
            Effect::None => record(&api, &seen, &decision).await,
            Effect::Record(binding) => match record_binding(trust.as_ref(), &binding).await {
                Ok(()) => record(&api, &seen, &decision).await,
                Err(source) => Err(ApproverError::Record {
                    node: binding.node.clone(),
                    source,
                }),
            },
            Effect::Issue { pem, approved } => issue(&api, &seen, &decision, &pem, approved).await,
            Effect::Fail => fail(&api, &seen, &decision).await,
            Effect::NodeAddresses(check) => {
                let client = api.clone().into_client();
                match serving::check_node(client, &nodes, &check, decision.clone()).await {
                    Ok(now) if now == decision => record(&api, &seen, &decision).await,
                    Ok(now) => match record(&api, &seen, &now).await {
                        Ok(Recorded::Yes) => Ok(Recorded::Instead(Box::new(now))),
                        other => other,
                    },
                    Err(e) => Err(e),
                }
            }
        };
        (uid, result)
    })
}

/// Records `binding` in the trust ConfigMap if the binding policy still allows it on what the
/// ConfigMap holds at the moment of writing.
async fn record_binding(
    trust: Option<&Trust>,
    binding: &Binding,
) -> Result<(), super::trust::RecordError> {
    let Some(trust) = trust else {
        return Err(super::trust::RecordError::NotAConfigMap(
            "not configured".into(),
        ));
    };
    trust
        .record(&binding.node, &binding.text, |read| {
            let invalid: Vec<String> = read.invalid.iter().map(|i| i.entry.clone()).collect();
            let held = super::binding::Held {
                nodes: &read.nodes,
                invalid: &invalid,
            };
            super::binding::check_binding(
                &binding.node,
                &binding.ek_sha256,
                read.ek.binding.as_deref(),
                held,
            )
            .map(|_| ())
        })
        .await
}

/// Approves a carrier request (unless `approved` already) and writes its certificate through
/// the `status` subresource (RBAC: `update` on certificatesigningrequests/status, `sign` on
/// the signer).
async fn issue(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
    pem: &str,
    approved: bool,
) -> Result<Recorded, ApproverError> {
    let mut current = match api.get(&seen.name).await {
        Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => c,
        Ok(_) => return Ok(Recorded::Conflict),
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Recorded::Conflict),
        Err(source) => {
            return Err(ApproverError::Issue {
                name: seen.name.clone(),
                source,
            })
        }
    };
    if !approved {
        let fresh = Seen {
            metadata: KeptMetadata::Kept {
                annotations: current.metadata.annotations.clone(),
                labels: current.metadata.labels.clone(),
            },
            ..seen.clone()
        };
        if record(api, &fresh, decision).await? == Recorded::Conflict {
            return Ok(Recorded::Conflict);
        }
        current = api
            .get(&seen.name)
            .await
            .map_err(|source| ApproverError::Issue {
                name: seen.name.clone(),
                source,
            })?;
    }
    let status = current.status.get_or_insert_with(Default::default);
    status.certificate = Some(k8s_openapi::ByteString(pem.as_bytes().to_vec()));
    match api
        .replace_status(&seen.name, &PostParams::default(), &current)
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Recorded::Conflict),
        Err(source) => Err(ApproverError::Issue {
            name: seen.name.clone(),
            source,
        }),
    }
}

/// Writes a Failed condition (through `status`, as a signer does) on an approved request that
/// cannot be issued.
async fn fail(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Recorded, ApproverError> {
    let issue_error = |source| ApproverError::Issue {
        name: seen.name.clone(),
        source,
    };
    let mut current = match api.get(&seen.name).await {
        Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => c,
        Ok(_) => return Ok(Recorded::Conflict),
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Recorded::Conflict),
        Err(source) => return Err(issue_error(source)),
    };
    let status = current.status.get_or_insert_with(Default::default);
    status
        .conditions
        .get_or_insert_with(Vec::new)
        .push(CertificateSigningRequestCondition {
            type_: "Failed".into(),
            status: "True".into(),
            reason: Some(decision.reason.as_str().into()),
            message: Some(decision.message.clone()),
            ..Default::default()
        });
    match api
        .replace_status(&seen.name, &PostParams::default(), &current)
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(Recorded::Conflict),
        Err(source) => Err(issue_error(source)),
    }
}

/// The annotations and labels to write back (None: the request changed or is gone).
async fn kept_metadata(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Option<(Option<Labels>, Option<Labels>)>, ApproverError> {
    match &seen.metadata {
        KeptMetadata::Kept {
            annotations,
            labels,
        } => Ok(Some((annotations.clone(), labels.clone()))),
        KeptMetadata::ReadAgain => match api.get(&seen.name).await {
            Ok(c) if c.metadata.uid.as_deref() == Some(seen.uid.as_str()) => {
                Ok(Some((c.metadata.annotations, c.metadata.labels)))
            }
            Ok(_) => Ok(None),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
            Err(source) => Err(ApproverError::Approve {
                name: decision.name.clone(),
                source,
            }),
        },
    }
}

type Labels = std::collections::BTreeMap<String, String>;

/// The PUT itself.
pub async fn record(
    api: &Api<CertificateSigningRequest>,
    seen: &Seen,
    decision: &Decision,
) -> Result<Recorded, ApproverError> {
    let Some((annotations, labels)) = kept_metadata(api, seen, decision).await? else {
        return Ok(Recorded::Conflict);
    };
    let mut conditions = seen.conditions.clone();
    conditions.push(CertificateSigningRequestCondition {
        type_: if decision.approved {
            "Approved".into()
        } else {
            "Denied".into()
        },
        status: "True".into(),
        reason: Some(decision.reason.as_str().into()),
        message: Some(decision.message.clone()),
        ..Default::default()
    });
    let body = CertificateSigningRequest {
        metadata: ObjectMeta {
            name: Some(seen.name.clone()),
            uid: Some(seen.uid.clone()),
            resource_version: Some(seen.resource_version.clone()),
            annotations,
            labels,
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            signer_name: seen.signer.clone(),
            usages: Some(seen.usages.clone()),
            ..Default::default()
        },
        status: Some(CertificateSigningRequestStatus {
            conditions: Some(conditions),
            ..Default::default()
        }),
    };
    match api
        .replace_subresource::<CertificateSigningRequest>(
            "approval",
            &seen.name,
            &PostParams::default(),
            &body,
        )
        .await
    {
        Ok(_) => Ok(Recorded::Yes),
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(Recorded::Conflict),
        Err(source) => Err(ApproverError::Approve {
            name: decision.name.clone(),
            source,
        }),
    }
}
