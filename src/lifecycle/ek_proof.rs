//! `hwkey bootstrap --attest --ek-proof`: the node's half of joining by the TPM's EK
//! certificate (docs/ATTESTATION.md, "Zero-touch bootstrap").
//!
//! 1. Make sure the TPM has its AK, and read the enrollment (AK, EK, EK certificate and the
//!    NV intermediates).
//! 2. Request a carrier certificate (`hwkey.dev/tpm-credential`) with TPM2_Certify evidence
//!    of the node key and the enrollment; wait for it with the bootstrap token.
//! 3. TPM2_ActivateCredential with the EK and the AK: the secret comes out only in this TPM.
//! 4. The caller then requests the kubelet client certificate, annotated with the carrier's
//!    name and the answer ([`Answer::annotations`]).

use std::collections::BTreeMap;

use super::csr_api::{Outcome, Submission};
use super::{client, LifecycleError};
use crate::key::attestation::EkKind;
use crate::key::Key;
use crate::pki::csr::{self, CsrRequest};
use crate::pki::ek_join;
use crate::pki::name::Name;

/// The answer to the approver's credential.
pub struct Answer {
    /// The carrier request's name.
    pub carrier: String,
    /// The secret the TPM released.
    pub secret: zeroize::Zeroizing<Vec<u8>>,
}

impl Answer {
    /// The kubelet request's annotations that carry it.
    pub fn annotations(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                ek_join::ANNOTATION_CARRIER.to_string(),
                self.carrier.clone(),
            ),
            (
                ek_join::ANNOTATION_ANSWER.to_string(),
                hex::encode(&self.secret[..]),
            ),
        ])
    }
}

/// What the proof is for.
pub struct Proof<'a> {
    /// The node key's URI (names the TPM).
    pub uri: &'a crate::key::KeyUri,
    /// The node's name.
    pub node_name: &'a str,
    /// The node's subject (`CN=system:node:NAME,O=system:nodes`).
    pub subject: &'a str,
    /// The AK's persistent handle.
    pub ak_handle: u32,
    /// The EK to prove with (None: RSA when its certificate is in NV, else ECC).
    pub ek: Option<EkKind>,
    /// How long to wait for the carrier certificate.
    pub wait: std::time::Duration,
}

/// Proves the TPM of `key` by its EK certificate, as the bootstrap identity of `config`.
pub fn prove(
    key: &Key,
    proof: &Proof<'_>,
    config: &kube::Config,
) -> Result<Answer, LifecycleError> {
    let ak_handle = proof.ak_handle;
    let enrollment = crate::key::enroll(proof.uri, ak_handle, proof.ek)?;
    if enrollment.ek_certificate.is_none() {
        return Err(LifecycleError::EkProof(
            "this TPM has no EK certificate in NV for that EK: it cannot prove itself by its manufacturer; register the node as an operator instead (hwkey attest enroll, docs/ATTESTATION.md)".into(),
        ));
    }
    let request = CsrRequest {
        subject: Name::parse(proof.subject)?,
        ..Default::default()
    };
    let csr_der = csr::build_attested(key, &request, ak_handle)?;
    let submission = Submission {
        csr_pem: csr::request_pem(&csr_der),
        signer_name: ek_join::CREDENTIAL_SIGNER.to_string(),
        usages: ek_join::CARRIER_USAGES
            .iter()
            .map(|u| u.to_string())
            .collect(),
        expiration_seconds: None,
        expiration_asked: false,
        name_prefix: format!("hwkey-carrier-{}-", proof.node_name),
        annotations: BTreeMap::from([(
            ek_join::ANNOTATION_ENROLLMENT.to_string(),
            enrollment.to_yaml(ak_handle),
        )]),
    };
    let server = config.cluster_url.to_string();
    let runtime = client::runtime()?;
    let (carrier, pem) = runtime.block_on(async {
        let client = client::build_client(config, client::Identity::Config)?;
        let name = super::csr_api::create(&client, &server, &submission).await?;
        tracing::info!(csr = %name, "carrier request created; waiting for the approver's credential");
        match super::csr_api::wait(&client, &name, proof.wait).await? {
            Outcome::Issued(pem) => Ok((name, pem)),
            Outcome::Denied { reason, message } => Err(LifecycleError::Denied { name, reason, message }),
            Outcome::Failed { reason, message } => Err(LifecycleError::Failed { name, reason, message }),
        }
    })?;
    let credential = ek_join::credential_of(&pem)
        .map_err(|e| LifecycleError::EkProof(format!("carrier request {carrier}: {e}")))?;
    // In the TPM, on this thread: no runtime is running now.
    let secret = crate::key::activate(
        proof.uri,
        ak_handle,
        &credential.credential_blob,
        &credential.encrypted_secret,
    )
    .map_err(|e| {
        LifecycleError::EkProof(format!(
            "the TPM did not release the credential of carrier request {carrier}: {e} (its EK or the AK at {ak_handle:#010x} is not the one enrolled)"
        ))
    })?;
    tracing::info!(csr = %carrier, "credential activated in the TPM");
    Ok(Answer { carrier, secret })
}
