//! TPM2_Certify evidence: an attestation key (AK) certifies that the TLS key lives in this TPM.
//!
//! The AK is a restricted signing key (ECDSA P-256, SHA-256) under the endorsement key, made the
//! way `tpm2_createak` makes one (tss-esapi's `abstraction::ak`), once, and kept at a persistent
//! handle, so every later certification names the same AK the operator registered. A restricted
//! key signs only structures the TPM itself produced (`TPMS_ATTEST` beginning with
//! `TPM_GENERATED_VALUE`), so its signature over a `TPMS_ATTEST` of type certify proves the TPM
//! holds an object of the certified name.

use tss_esapi::abstraction::{ak, ek, AsymmetricAlgorithmSelection};
use tss_esapi::handles::{KeyHandle, ObjectHandle, PersistentTpmHandle};
use tss_esapi::interface_types::algorithm::{
    AsymmetricAlgorithm, HashingAlgorithm, SignatureSchemeAlgorithm,
};
use tss_esapi::interface_types::dynamic_handles::Persistent;
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::resource_handles::Provision;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{Data, Public, SignatureScheme};
use tss_esapi::traits::Marshall;
use tss_esapi::Context;

use super::rc;
use crate::key::attestation::{Enrollment, TpmEvidence};
use crate::key::{KeyAlgorithm, KeyError};

fn tpm_err(operation: &'static str) -> impl Fn(tss_esapi::Error) -> KeyError {
    rc::tpm_error(operation)
}

/// The AK at persistent handle `h`: opened if it is there (it must be a restricted signing key),
/// else created under a fresh EK and made persistent (the transient EK and AK are flushed).
/// Returns its ESYS handle, which the caller closes ([`close`]), and its public area.
pub(crate) fn ensure_ak(
    ctx: &mut Context,
    h: u32,
    tcti: &str,
) -> Result<(ObjectHandle, Public), KeyError> {
    match super::persistent::open_persistent(ctx, h, tcti) {
        Ok((object, public)) => {
            let a = public.object_attributes();
            if !(a.restricted() && a.sign_encrypt()) {
                close(ctx, object);
                return Err(KeyError::TpmKeyUnusable {
                    key: format!("TPM persistent object {h:#010x}"),
                    reason: "it is not an attestation key (a restricted signing key); choose another --ak-handle".into(),
                });
            }
            Ok((object, public))
        }
        Err(KeyError::KeyNotFound { .. }) => create_ak(ctx, h),
        Err(e) => Err(e),
    }
}

/// Releases an ESYS handle of a persistent object (the object stays in the TPM).
pub(crate) fn close(ctx: &mut Context, mut object: ObjectHandle) {
    let _ = ctx.tr_close(&mut object);
}

fn create_ak(ctx: &mut Context, h: u32) -> Result<(ObjectHandle, Public), KeyError> {
    let persistent = PersistentTpmHandle::new(h).map_err(tpm_err("the AK handle"))?;
    let ek_handle = ek::create_ek_object(ctx, AsymmetricAlgorithm::Ecc, None)
        .map_err(tpm_err("CreatePrimary (EK)"))?;
    let result = ak::create_ak(
        ctx,
        ek_handle,
        HashingAlgorithm::Sha256,
        SignatureSchemeAlgorithm::EcDsa,
        None,
        None,
    )
    .map_err(tpm_err("Create (AK)"))
    .and_then(|created| {
        let public = created.out_public.clone();
        let loaded = ak::load_ak(
            ctx,
            ek_handle,
            None,
            created.out_private,
            created.out_public,
        )
        .map_err(tpm_err("Load (AK)"))?;
        let stored = ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
            ctx.evict_control(
                Provision::Owner,
                ObjectHandle::from(loaded),
                Persistent::Persistent(persistent),
            )
        });
        let _ = ctx.flush_context(ObjectHandle::from(loaded));
        Ok((stored.map_err(tpm_err("EvictControl (AK)"))?, public))
    });
    let _ = ctx.flush_context(ObjectHandle::from(ek_handle));
    result
}

/// TPM2_Certify of `key` by the AK at `ak_handle` with `qualifying_data` (the caller binds the
/// evidence to its request with it).
pub(crate) fn certify(
    ctx: &mut Context,
    key: KeyHandle,
    ak_handle: u32,
    tcti: &str,
    qualifying_data: &[u8],
) -> Result<TpmEvidence, KeyError> {
    let (ak, ak_public) = ensure_ak(ctx, ak_handle, tcti)?;
    let result = certify_with(ctx, key, KeyHandle::from(ak), ak_public, qualifying_data);
    close(ctx, ak);
    result
}

fn certify_with(
    ctx: &mut Context,
    key: KeyHandle,
    ak: KeyHandle,
    ak_public: Public,
    qualifying_data: &[u8],
) -> Result<TpmEvidence, KeyError> {
    let (key_public, _, _) = ctx
        .execute_without_session(|ctx| ctx.read_public(key))
        .map_err(tpm_err("ReadPublic (key)"))?;
    let data = Data::try_from(qualifying_data.to_vec()).map_err(tpm_err("qualifying data"))?;
    let (attest, signature) = ctx
        .execute_with_sessions(
            (
                Some(AuthSession::Password),
                Some(AuthSession::Password),
                None,
            ),
            |ctx| ctx.certify(ObjectHandle::from(key), ak, data, SignatureScheme::Null),
        )
        .map_err(tpm_err("Certify"))?;
    Ok(TpmEvidence {
        attest: attest
            .marshall()
            .map_err(tpm_err("marshalling TPMS_ATTEST"))?,
        signature: signature
            .marshall()
            .map_err(tpm_err("marshalling TPMT_SIGNATURE"))?,
        key_public: key_public
            .marshall()
            .map_err(tpm_err("marshalling TPMT_PUBLIC (key)"))?,
        ak_public: ak_public
            .marshall()
            .map_err(tpm_err("marshalling TPMT_PUBLIC (AK)"))?,
    })
}

/// What an operator registers for this TPM: the AK (made if missing) and the EK.
pub(crate) fn enroll(
    ctx: &mut Context,
    ak_handle: u32,
    tcti: &str,
) -> Result<Enrollment, KeyError> {
    let (ak, ak_public) = ensure_ak(ctx, ak_handle, tcti)?;
    close(ctx, ak);
    let ak_public_bytes = ak_public
        .marshall()
        .map_err(tpm_err("marshalling TPMT_PUBLIC (AK)"))?;
    let ek_handle = ek::create_ek_object(ctx, AsymmetricAlgorithm::Ecc, None)
        .map_err(tpm_err("CreatePrimary (EK)"))?;
    let ek_public = ctx
        .execute_without_session(|ctx| ctx.read_public(ek_handle))
        .map_err(tpm_err("ReadPublic (EK)"));
    let _ = ctx.flush_context(ObjectHandle::from(ek_handle));
    let (ek_public, _, _) = ek_public?;
    let ek_certificate = [
        AsymmetricAlgorithmSelection::Ecc(EccCurve::NistP256),
        AsymmetricAlgorithmSelection::Rsa(RsaKeyBits::Rsa2048),
    ]
    .into_iter()
    .find_map(|alg| ek::retrieve_ek_pubcert(ctx, alg).ok());
    Ok(Enrollment {
        ak_name: crate::key::attestation::name_of(&ak_public_bytes)?,
        ak_spki: ecc_spki(&ak_public)?,
        ak_public: ak_public_bytes,
        ek_spki: ecc_spki(&ek_public)?,
        ek_certificate,
    })
}

/// The SubjectPublicKeyInfo of a P-256 public area (the AK's or the EK's).
pub(crate) fn ecc_spki(public: &Public) -> Result<Vec<u8>, KeyError> {
    let malformed = |reason: String| KeyError::Malformed {
        what: "an attestation or endorsement key's public area".into(),
        reason,
    };
    match public {
        Public::Ecc { unique, .. } => {
            super::public::ec_spki(KeyAlgorithm::EcP256, unique).map_err(malformed)
        }
        _ => Err(malformed("not an ECC key".into())),
    }
}
