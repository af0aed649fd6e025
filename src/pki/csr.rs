//! PKCS#10 certificate signing requests signed inside the hardware.
//!
//! Encoded here with yasna rather than rcgen because Kubernetes subjects repeat O (one per group)
//! and rcgen's name type cannot; the signature is still made by [`Key::sign`].

use std::net::IpAddr;

use super::name::Name;
use super::PkiError;
use crate::key::{der, Key, KeyAlgorithm, SignScheme};

/// The signer of kubelet client certificates (node identities).
pub const KUBELET_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The signer of other client certificates (people, controllers).
pub const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// The signer of kubelets' serving certificates (`serverTLSBootstrap: true`), which nothing in
/// Kubernetes approves.
pub const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";

pub use super::request::{OID_EXTENSION_REQUEST, OID_SUBJECT_ALT_NAME};
const OID_ECDSA_SHA256: &[u64] = &[1, 2, 840, 10045, 4, 3, 2];
const OID_ECDSA_SHA384: &[u64] = &[1, 2, 840, 10045, 4, 3, 3];
const OID_RSA_SHA256: &[u64] = &[1, 2, 840, 113549, 1, 1, 11];

/// What a request asks for.
#[derive(Debug, Clone, Default)]
pub struct CsrRequest {
    /// The subject (O may repeat: Kubernetes groups).
    pub subject: Name,
    /// dNSName subjectAltNames (ASCII; punycode for IDNs).
    pub dns_names: Vec<String>,
    /// iPAddress subjectAltNames.
    pub ip_addresses: Vec<IpAddr>,
}

impl CsrRequest {
    /// Builds a request from command-line strings, validating each.
    pub fn parse(subject: &str, dns: &[String], ips: &[String]) -> Result<CsrRequest, PkiError> {
        let ip_addresses = ips
            .iter()
            .map(|s| {
                s.parse().map_err(|_| PkiError::InvalidIp {
                    given: s.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        for name in dns {
            // A dNSName is an IA5String: ASCII only (the encoder would panic on others).
            if let Some(c) = name.chars().find(|c| !c.is_ascii() || c.is_ascii_control()) {
                return Err(PkiError::InvalidDns {
                    given: name.clone(),
                    bad: c,
                });
            }
            if name.is_empty() {
                return Err(PkiError::EmptyDns {
                    given: name.clone(),
                });
            }
        }
        Ok(CsrRequest {
            subject: Name::parse(subject)?,
            dns_names: dns.to_vec(),
            ip_addresses,
        })
    }

    /// Whether the subject is a node's (`CN=system:node:…`).
    pub fn names_a_node(&self) -> bool {
        self.subject
            .0
            .iter()
            .any(|a| a.short == "CN" && a.value.starts_with("system:node:"))
    }
}

/// The signature algorithm a key uses for requests and certificates: ECDSA with the curve's
/// hash, or RSA PKCS#1 v1.5 with SHA-256 (what every CA accepts).
fn scheme_and_oid(alg: KeyAlgorithm) -> (SignScheme, &'static [u64]) {
    match alg {
        KeyAlgorithm::EcP256 => (SignScheme::EcdsaP256Sha256, OID_ECDSA_SHA256),
        KeyAlgorithm::EcP384 => (SignScheme::EcdsaP384Sha384, OID_ECDSA_SHA384),
        KeyAlgorithm::Rsa { .. } => (SignScheme::RsaPkcs1Sha256, OID_RSA_SHA256),
    }
}

/// Builds and signs a CSR; returns its DER.
pub fn build(key: &Key, request: &CsrRequest) -> Result<Vec<u8>, PkiError> {
    build_with(key, request, None)
}

/// Like [`build`], with TPM2_Certify evidence of the key by the attestation key at persistent
/// handle `ak_handle`, bound to this request's subject and key (see [`super::attestation`]).
pub fn build_attested(
    key: &Key,
    request: &CsrRequest,
    ak_handle: u32,
) -> Result<Vec<u8>, PkiError> {
    let subject = yasna::construct_der(|w| request.subject.write_der(w));
    let made_at = super::attestation::unix_now();
    let mut evidence = key.certify_request(ak_handle, &subject, made_at)?;
    evidence.made_at = Some(made_at);
    build_with_evidence(key, request, &evidence)
}

/// Like [`build`], carrying `evidence` as it is. [`build_attested`] makes evidence for this
/// very request; evidence made for another one is refused by the verifier (`EvidenceInvalid`).
pub fn build_with_evidence(
    key: &Key,
    request: &CsrRequest,
    evidence: &crate::key::attestation::TpmEvidence,
) -> Result<Vec<u8>, PkiError> {
    build_with(
        key,
        request,
        Some(super::attestation::evidence_attribute(evidence)),
    )
}

/// Like [`build`], carrying `current_cert` (DER), the certificate this very key holds now, so
/// an approver can renew the identity without TPM evidence ([`super::same_key`]).
pub fn build_renewal(
    key: &Key,
    request: &CsrRequest,
    current_cert: &[u8],
) -> Result<Vec<u8>, PkiError> {
    build_with(key, request, Some(super::same_key::attribute(current_cert)))
}

/// Like [`build`], carrying the key's PIV attestation (`attestation`, the slot's certificate,
/// and `f9`, the device's), so an approver can tell the key is in a YubiKey ([`super::piv`]).
pub fn build_piv(
    key: &Key,
    request: &CsrRequest,
    attestation: &[u8],
    f9: &[u8],
) -> Result<Vec<u8>, PkiError> {
    build_with(key, request, Some(super::piv::attribute(attestation, f9)))
}

/// The hardware proof a request carries without being asked: with `ak_handle`, TPM evidence;
/// else, for a person's subject, the key's PIV attestation when its device has one (a
/// YubiKey's); else nothing. A node's request carries no PIV attestation: kubelet's signer
/// admits TPM evidence only.
pub fn build_with_hardware_proof(
    key: &Key,
    request: &CsrRequest,
    ak_handle: Option<u32>,
) -> Result<Option<Vec<u8>>, PkiError> {
    if let Some(handle) = ak_handle {
        return build_attested(key, request, handle).map(Some);
    }
    if request.names_a_node() {
        return Ok(None);
    }
    // Reading the attestation objects is a convenience: a token (or a signer of an older
    // hwkey) that cannot answer leaves the request with the proof it would have had without.
    match key.piv_attestation() {
        Ok(Some(p)) => build_piv(key, request, &p.attestation, &p.device).map(Some),
        Ok(None) => Ok(None),
        Err(e) => {
            tracing::warn!(key = %key.describe(), error = %e, "cannot read the token's PIV attestation objects; the request carries none");
            Ok(None)
        }
    }
}

fn build_with(
    key: &Key,
    request: &CsrRequest,
    evidence: Option<Vec<u8>>,
) -> Result<Vec<u8>, PkiError> {
    let (scheme, sig_oid) = scheme_and_oid(key.algorithm());
    let info = yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_u8(0);
            request.subject.write_der(w.next());
            // The SPKI is already DER: splice it in as is.
            w.next().write_der(key.spki_der());
            w.next().write_tagged_implicit(yasna::Tag::context(0), |w| {
                // SET OF Attribute: DER sorts the encodings (a verifier reading DER refuses
                // another order).
                w.write_set_of(|w| {
                    if let Some(attribute) = &evidence {
                        w.next().write_der(attribute);
                    }
                    if request.dns_names.is_empty() && request.ip_addresses.is_empty() {
                        return;
                    }
                    w.next().write_sequence(|w| {
                        w.next()
                            .write_oid(&yasna::models::ObjectIdentifier::from_slice(
                                OID_EXTENSION_REQUEST,
                            ));
                        w.next().write_set(|w| {
                            w.next().write_sequence(|w| {
                                write_san_extension(w.next(), request);
                            })
                        })
                    })
                })
            });
        })
    });
    let signature = key.sign_for(crate::key::Purpose::CertificateRequest, scheme, &info)?;
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_der(&info);
            w.next().write_sequence(|w| {
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(sig_oid));
                if !key.algorithm().is_ec() {
                    w.next().write_null();
                }
            });
            w.next().write_bitvec_bytes(&signature, signature.len() * 8);
        })
    }))
}

fn write_san_extension(w: yasna::DERWriter, request: &CsrRequest) {
    let names = yasna::construct_der(|w| {
        w.write_sequence(|w| {
            for dns in &request.dns_names {
                w.next()
                    .write_tagged_implicit(yasna::Tag::context(2), |w| w.write_ia5_string(dns));
            }
            for ip in &request.ip_addresses {
                let bytes = match ip {
                    IpAddr::V4(v4) => v4.octets().to_vec(),
                    IpAddr::V6(v6) => v6.octets().to_vec(),
                };
                w.next()
                    .write_tagged_implicit(yasna::Tag::context(7), |w| w.write_bytes(&bytes));
            }
        })
    });
    w.write_sequence(|w| {
        w.next()
            .write_oid(&yasna::models::ObjectIdentifier::from_slice(
                OID_SUBJECT_ALT_NAME,
            ));
        w.next().write_bytes(&names);
    });
}

/// The CSR as PEM (`CERTIFICATE REQUEST`).
pub fn request_pem(csr_der: &[u8]) -> String {
    der::to_pem("CERTIFICATE REQUEST", csr_der)
}

/// Wraps a CSR in a `certificates.k8s.io/v1` CertificateSigningRequest (YAML): usages `digital
/// signature` and `client auth`, as the kube-apiserver client signers require, plus `key
/// encipherment` for the kubelet signer (kube-controller-manager before 1.22 signs node client
/// certificates only with exactly those three); `server auth` instead of `client auth` for the
/// kubelet serving signer.
pub fn kubernetes_object(
    name: &str,
    csr_pem: &str,
    signer_name: &str,
    expiration_seconds: Option<u32>,
) -> String {
    use base64::Engine;
    let request = base64::engine::general_purpose::STANDARD.encode(csr_pem);
    let mut spec = serde_json::json!({
        "request": request,
        "signerName": signer_name,
        "usages": match signer_name {
            KUBELET_SIGNER => &["digital signature", "key encipherment", "client auth"][..],
            SERVING_SIGNER => &["digital signature", "key encipherment", "server auth"][..],
            _ => &["digital signature", "client auth"][..],
        },
    });
    if let Some(s) = expiration_seconds {
        spec["expirationSeconds"] = s.into();
    }
    let object = serde_json::json!({
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": spec,
    });
    serde_yaml_ng::to_string(&object).unwrap_or_default()
}
