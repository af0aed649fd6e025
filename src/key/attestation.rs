//! Evidence that a key lives in a TPM (TPM2_Certify by an attestation key), and its check.
//!
//! The types hold the TPM's own marshalled structures, exactly as the TPM produced them, so the
//! evidence can be checked by anyone with tpm2-tools too (`tpm2_print -t TPMS_ATTEST`,
//! `tpm2_verifysignature`). Making evidence needs the `tpm` backend; so does checking it (the
//! structures are parsed with tss-esapi).

use super::{KeyError, Malformation};

/// The qualifying data that binds evidence to a request's subject and key, and to the time it
/// was made (`made_at`, Unix seconds): what TPM2_Certify signs as `extraData`.
pub fn qualifying_data(subject_der: &[u8], spki_der: &[u8], made_at: u64) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(subject_der);
    ctx.update(spki_der);
    ctx.update(&made_at.to_be_bytes());
    ctx.finish().as_ref().to_vec()
}

/// Now, in Unix seconds: the `madeAt` of new evidence.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// TPM2_Certify output for one key, plus what a verifier needs to check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpmEvidence {
    /// `TPMS_ATTEST` (type `TPM_ST_ATTEST_CERTIFY`) as the TPM marshalled it.
    pub attest: Vec<u8>,
    /// `TPMT_SIGNATURE` by the AK over `attest`.
    pub signature: Vec<u8>,
    /// `TPMT_PUBLIC` of the certified key: its name is in `attest`, its key is the CSR's.
    pub key_public: Vec<u8>,
    /// `TPMT_PUBLIC` of the AK.
    pub ak_public: Vec<u8>,
    /// When the evidence was made (Unix seconds), bound into the qualifying data by the request
    /// builder; None from the TPM layer and in evidence made before freshness was checked.
    pub made_at: Option<u64>,
    /// The TPM's EK certificate (DER) when it has one in NV: for auditors and for verifiers
    /// that know the TPM by it. Nothing in the evidence's check depends on it.
    pub ek_certificate: Option<Vec<u8>>,
}

/// What `hwkey attest enroll` prints for an operator to register a node's TPM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrollment {
    /// The AK's TPM name (nameAlg || hash of its public area): what the verifier looks up.
    pub ak_name: Vec<u8>,
    /// The AK's `TPMT_PUBLIC`.
    pub ak_public: Vec<u8>,
    /// The AK's SubjectPublicKeyInfo (DER).
    pub ak_spki: Vec<u8>,
    /// The endorsement key's SubjectPublicKeyInfo (DER): the RSA-2048 EK when the TPM holds its
    /// certificate, else the ECC P-256 EK.
    pub ek_spki: Vec<u8>,
    /// That EK's `TPMT_PUBLIC`: what credential activation encrypts to.
    pub ek_public: Vec<u8>,
    /// The EK certificate from the TPM's NV index (DER), when the manufacturer stored one.
    pub ek_certificate: Option<Vec<u8>>,
    /// The certificates of the EK certificate's chain the manufacturer stored in NV (TCG EK
    /// Credential Profile: indices 0x01c00100 to 0x01c001ff, DER, one or more each): the
    /// intermediates between the EK certificate and the vendor's root.
    pub ek_intermediates: Vec<Vec<u8>>,
}

impl Enrollment {
    /// The enrollment as `hwkey attest enroll` prints it (YAML; what an operator stores as
    /// TRUST_DIR/NODE_NAME, and what a joining node's carrier request carries).
    pub fn to_yaml(&self, ak_handle: u32) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let indent = |pem: String| pem.lines().map(|l| format!("  {l}\n")).collect::<String>();
        let mut out = format!(
            "# hwkey attest enroll: store this file as TRUST_DIR/NODE_NAME for the approver\n\
             akHandle: {ak_handle:#010x}\n\
             akName: {}\n\
             akPublic: {}\n\
             akPublicKeyPem: |\n{}\
             ekPublic: {}\n\
             ekPublicKeyPem: |\n{}",
            hex::encode(&self.ak_name),
            b64.encode(&self.ak_public),
            indent(super::der::to_pem("PUBLIC KEY", &self.ak_spki)),
            b64.encode(&self.ek_public),
            indent(super::der::to_pem("PUBLIC KEY", &self.ek_spki)),
        );
        if let Some(cert) = &self.ek_certificate {
            out.push_str("ekCertificatePem: |\n");
            out.push_str(&indent(super::der::to_pem("CERTIFICATE", cert)));
        }
        if !self.ek_intermediates.is_empty() {
            let pems: String = self
                .ek_intermediates
                .iter()
                .map(|c| super::der::to_pem("CERTIFICATE", c))
                .collect();
            out.push_str("ekIntermediatesPem: |\n");
            out.push_str(&indent(pems));
        }
        out
    }
}

/// The TPM name of an object from its marshalled `TPMT_PUBLIC`: nameAlg (2 bytes, big-endian)
/// followed by the nameAlg digest of the whole structure.
pub fn name_of(tpmt_public: &[u8]) -> Result<Vec<u8>, KeyError> {
    let malformed = |problem| KeyError::Malformed {
        what: "a TPMT_PUBLIC".into(),
        problem,
    };
    let alg = tpmt_public
        .get(2..4)
        .ok_or_else(|| malformed(Malformation::TooShort))?;
    let digest = match u16::from_be_bytes([alg[0], alg[1]]) {
        0x000B => ring::digest::digest(&ring::digest::SHA256, tpmt_public),
        0x000C => ring::digest::digest(&ring::digest::SHA384, tpmt_public),
        0x000D => ring::digest::digest(&ring::digest::SHA512, tpmt_public),
        other => return Err(malformed(Malformation::NameAlg(other))),
    };
    let mut name = alg.to_vec();
    name.extend_from_slice(digest.as_ref());
    Ok(name)
}

/// Which endorsement key an enrollment describes and credential activation uses. A TPM has
/// an RSA-2048 and an ECC P-256 EK (TCG EK Credential Profile, templates L-1 and L-2); some
/// ship a certificate for only one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EkKind {
    /// The RSA-2048 EK (certificate at NV index 0x01c00002).
    Rsa,
    /// The ECC NIST P-256 EK (certificate at NV index 0x01c0000a).
    Ecc,
}

/// Where `hwkey attest enroll` makes the attestation key when no handle is given: the first
/// persistent handle after the ones tpm2-tools' examples use for the EK and SRK.
pub const DEFAULT_AK_HANDLE: u32 = 0x8101_0002;

/// [`DEFAULT_AK_HANDLE`] as the flags write it.
pub const DEFAULT_AK_HANDLE_TEXT: &str = "0x81010002";

/// A TPM handle that does not parse, or is not a persistent one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum HandleError {
    #[error("{0:#010x} is not a persistent handle: use 0x81000000-0x81ffffff (e.g. 0x81010002)")]
    NotPersistent(u32),
    #[error("'{0}' is not a TPM handle (e.g. 0x81010002)")]
    NotAHandle(String),
}

/// Parses a persistent TPM handle written in hex (`0x81010002`) or decimal.
pub fn parse_persistent_handle(s: &str) -> Result<u32, HandleError> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    match parsed {
        Ok(h) if (0x8100_0000..=0x81FF_FFFF).contains(&h) => Ok(h),
        Ok(h) => Err(HandleError::NotPersistent(h)),
        Err(_) => Err(HandleError::NotAHandle(s.to_string())),
    }
}

/// Why evidence does not hold. Each names the check that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EvidenceInvalid(pub String);
