//! Checking TPM2_Certify evidence ([`crate::key::attestation::TpmEvidence`]): the verifier's side.

use tss_esapi::structures::{Attest, AttestInfo, Public, Signature};
use tss_esapi::traits::UnMarshall;

use super::attest::ecc_spki;
use super::public::KeyInfo;
use crate::key::attestation::{name_of, EvidenceInvalid, TpmEvidence};
use crate::key::der;

fn invalid(reason: impl Into<String>) -> EvidenceInvalid {
    EvidenceInvalid(reason.into())
}

/// Checks that `ak_public` (`TPMT_PUBLIC`) is an attestation key (restricted, signing,
/// fixedTPM, fixedParent) and returns its TPM name.
pub fn check_attestation_key(ak_public: &[u8]) -> Result<Vec<u8>, EvidenceInvalid> {
    let public = Public::unmarshall(ak_public)
        .map_err(|e| invalid(format!("the AK's TPMT_PUBLIC does not parse: {e}")))?;
    let a = public.object_attributes();
    if !(a.restricted() && a.sign_encrypt() && a.fixed_tpm() && a.fixed_parent()) {
        return Err(invalid(
            "the AK is not a restricted, fixedTPM, fixedParent signing key (not an attestation key)",
        ));
    }
    name_of(ak_public).map_err(|e| invalid(e.to_string()))
}

/// The SubjectPublicKeyInfo (DER) of a key's `TPMT_PUBLIC` (RSA, or ECC P-256).
pub fn public_key_spki(tpmt_public: &[u8]) -> Result<Vec<u8>, EvidenceInvalid> {
    let public = Public::unmarshall(tpmt_public)
        .map_err(|e| invalid(format!("the TPMT_PUBLIC does not parse: {e}")))?;
    super::attest::public_spki(&public).map_err(|e| invalid(e.to_string()))
}

/// Checks evidence against the key it should prove and the data it must be bound to:
/// the AK's signature over `TPMS_ATTEST`; that it is a certify statement for the name of
/// `key_public`; that `key_public` holds `expected_spki`; that the key can never leave the
/// TPM (`fixedTPM`, `fixedParent`, `sensitiveDataOrigin`) and signs; and that the TPM put
/// `qualifying_data` into it. Whether the AK is trusted is the caller's question (its name is
/// returned).
pub fn verify_certify(
    evidence: &TpmEvidence,
    expected_spki: &[u8],
    qualifying_data: &[u8],
) -> Result<Vec<u8>, EvidenceInvalid> {
    let attest = Attest::unmarshall(&evidence.attest)
        .map_err(|e| invalid(format!("TPMS_ATTEST does not parse: {e}")))?;
    let signature = Signature::unmarshall(&evidence.signature)
        .map_err(|e| invalid(format!("TPMT_SIGNATURE does not parse: {e}")))?;
    let ak_public = Public::unmarshall(&evidence.ak_public)
        .map_err(|e| invalid(format!("the AK's TPMT_PUBLIC does not parse: {e}")))?;
    let key_public = Public::unmarshall(&evidence.key_public)
        .map_err(|e| invalid(format!("the key's TPMT_PUBLIC does not parse: {e}")))?;

    // 1. The AK is an attestation key, and it signed exactly these bytes.
    check_ak_signature(evidence, &ak_public, &signature)?;

    // 2. It is a certify statement about the included public area.
    let AttestInfo::Certify { info } = attest.attested() else {
        return Err(invalid("TPMS_ATTEST is not a TPM2_Certify statement"));
    };
    let key_name = name_of(&evidence.key_public).map_err(|e| invalid(e.to_string()))?;
    if info.name().value() != key_name.as_slice() {
        return Err(invalid(
            "the certified name is not the name of the included TPMT_PUBLIC",
        ));
    }

    // 3. Bound to this request.
    if attest.extra_data().value() != qualifying_data {
        return Err(invalid(
            "the evidence was made for another request (qualifying data differs): replayed?",
        ));
    }

    // 4. The certified key is the request's key, and it can never leave the TPM.
    check_certified_key(&key_public, expected_spki)?;
    name_of(&evidence.ak_public).map_err(|e| invalid(e.to_string()))
}

/// The AK is an attestation key (restricted, fixedTPM, signing), and its ECDSA signature over
/// `TPMS_ATTEST` verifies.
fn check_ak_signature(
    evidence: &TpmEvidence,
    ak_public: &Public,
    signature: &Signature,
) -> Result<(), EvidenceInvalid> {
    let ak_attributes = ak_public.object_attributes();
    if !(ak_attributes.restricted() && ak_attributes.sign_encrypt() && ak_attributes.fixed_tpm()) {
        return Err(invalid(
            "the signing key is not a restricted, fixedTPM signing key (not an attestation key)",
        ));
    }
    let ak_spki = ecc_spki(ak_public).map_err(|e| invalid(e.to_string()))?;
    let der_signature = match signature {
        Signature::EcDsa(s) => {
            der::ecdsa_rs_to_der(s.signature_r().value(), s.signature_s().value())
        }
        other => {
            return Err(invalid(format!(
                "the AK's signature is {:?}, not ECDSA",
                other.algorithm()
            )))
        }
    };
    let verified = crate::key::verify::verify_signature(
        &ak_spki,
        crate::key::SignScheme::EcdsaP256Sha256,
        &evidence.attest,
        &der_signature,
    )
    .map_err(|e| invalid(e.to_string()))?;
    if !verified {
        return Err(invalid(
            "the AK's signature over TPMS_ATTEST does not verify",
        ));
    }
    Ok(())
}

/// The certified key is a usable signing key, is the request's key, and can never leave its
/// TPM (fixedTPM, fixedParent, sensitiveDataOrigin).
fn check_certified_key(key_public: &Public, expected_spki: &[u8]) -> Result<(), EvidenceInvalid> {
    let info = KeyInfo::from_public(key_public).map_err(|reason| {
        invalid(format!(
            "the certified key is not a usable signing key: {reason}"
        ))
    })?;
    if !der::same_public_key(&info.spki, expected_spki) {
        return Err(invalid("the certified key is not the key of the request"));
    }
    let a = key_public.object_attributes();
    for (set, name) in [
        (a.fixed_tpm(), "fixedTPM"),
        (a.fixed_parent(), "fixedParent"),
        (a.sensitive_data_origin(), "sensitiveDataOrigin"),
    ] {
        if !set {
            return Err(invalid(format!(
                "the certified key lacks {name}: it could exist outside this TPM"
            )));
        }
    }
    Ok(())
}
