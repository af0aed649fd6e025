//! TPM2_Certify evidence: an attestation key (AK) certifies that the TLS key lives in this TPM.
//!
//! The AK is a restricted signing key (ECDSA P-256, SHA-256) under the endorsement key, made the
//! way `tpm2_createak` makes one (tss-esapi's `abstraction::ak`), once, and kept at a persistent
//! handle, so every later certification names the same AK the operator registered. A restricted
//! key signs only structures the TPM itself produced (`TPMS_ATTEST` beginning with
//! `TPM_GENERATED_VALUE`), so its signature over a `TPMS_ATTEST` of type certify proves the TPM
//! holds an object of the certified name.

use tss_esapi::abstraction::{ak, ek, AsymmetricAlgorithmSelection};
use tss_esapi::constants::SessionType;
use tss_esapi::handles::{AuthHandle, SessionHandle};
use tss_esapi::handles::{KeyHandle, ObjectHandle, PersistentTpmHandle};
use tss_esapi::interface_types::algorithm::{
    AsymmetricAlgorithm, HashingAlgorithm, SignatureSchemeAlgorithm,
};
use tss_esapi::interface_types::dynamic_handles::Persistent;
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::resource_handles::Provision;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::interface_types::session_handles::PolicySession;
use tss_esapi::structures::{
    Data, EncryptedSecret, IdObject, Public, SignatureScheme, SymmetricDefinition,
};
use tss_esapi::traits::Marshall;
use tss_esapi::Context;

use super::rc;
use crate::key::attestation::{EkKind, Enrollment, TpmEvidence};
use crate::key::{DeviceError, LocateError};
use crate::key::{KeyAlgorithm, KeyError, Malformation};

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
                return Err(KeyError::Device(DeviceError::TpmKeyUnusable {
                    key: format!("TPM persistent object {h:#010x}"),
                    problem: crate::key::Unusable::NotAttestationKey,
                }));
            }
            Ok((object, public))
        }
        Err(KeyError::Locate(LocateError::KeyNotFound { .. })) => create_ak(ctx, h),
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
        Ok((
            stored.map_err(super::rc::owner_error("EvictControl (AK)"))?,
            public,
        ))
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
    let mut evidence = result?;
    evidence.ek_certificate = enrollment_ek(ctx, None).1;
    Ok(evidence)
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
        made_at: None,
        ek_certificate: None,
    })
}

/// The endorsement key an enrollment describes: the one asked for (with its certificate if the
/// manufacturer stored one); by default the RSA-2048 EK when its certificate is there, else
/// the ECC P-256 EK (with its certificate if there is one).
fn enrollment_ek(
    ctx: &mut Context,
    ek: Option<EkKind>,
) -> (AsymmetricAlgorithmSelection, Option<Vec<u8>>) {
    if let Some(kind) = ek {
        let alg = ek_algorithm(kind);
        return (alg, ek::retrieve_ek_pubcert(ctx, alg).ok());
    }
    [EkKind::Rsa, EkKind::Ecc]
        .into_iter()
        .map(ek_algorithm)
        .find_map(|alg| {
            ek::retrieve_ek_pubcert(ctx, alg)
                .ok()
                .map(|c| (alg, Some(c)))
        })
        .unwrap_or((ek_algorithm(EkKind::Ecc), None))
}

/// The TCG template's algorithm of an EK kind.
fn ek_algorithm(kind: EkKind) -> AsymmetricAlgorithmSelection {
    match kind {
        EkKind::Rsa => AsymmetricAlgorithmSelection::Rsa(RsaKeyBits::Rsa2048),
        EkKind::Ecc => AsymmetricAlgorithmSelection::Ecc(EccCurve::NistP256),
    }
}

/// What an operator registers for this TPM: the AK (made if missing) and the EK.
pub(crate) fn enroll(
    ctx: &mut Context,
    ak_handle: u32,
    tcti: &str,
    ek: Option<EkKind>,
) -> Result<Enrollment, KeyError> {
    let (ak, ak_public) = ensure_ak(ctx, ak_handle, tcti)?;
    close(ctx, ak);
    let ak_public_bytes = ak_public
        .marshall()
        .map_err(tpm_err("marshalling TPMT_PUBLIC (AK)"))?;
    let (ek_alg, ek_certificate) = enrollment_ek(ctx, ek);
    let ek_handle =
        ek::create_ek_object_2(ctx, ek_alg, None).map_err(tpm_err("CreatePrimary (EK)"))?;
    let ek_public = ctx
        .execute_without_session(|ctx| ctx.read_public(ek_handle))
        .map_err(tpm_err("ReadPublic (EK)"));
    let _ = ctx.flush_context(ObjectHandle::from(ek_handle));
    let (ek_public, _, _) = ek_public?;
    Ok(Enrollment {
        ak_name: crate::key::attestation::name_of(&ak_public_bytes)?,
        ak_spki: ecc_spki(&ak_public)?,
        ak_public: ak_public_bytes,
        ek_spki: public_spki(&ek_public)?,
        ek_public: ek_public
            .marshall()
            .map_err(tpm_err("marshalling TPMT_PUBLIC (EK)"))?,
        ek_intermediates: if ek_certificate.is_some() {
            ek_chain_from_nv(ctx)
        } else {
            Vec::new()
        },
        ek_certificate,
    })
}

/// The EK certificate chain's range of NV indices (TCG EK Credential Profile 2.x, 2.2.1.5).
const EK_CHAIN_NV: (u32, u32) = (0x01c0_0100, 0x01c0_01ff);

/// The certificates the manufacturer stored in the EK chain's NV range, in index order; each
/// index may hold several DER certificates back to back. An index that cannot be read or does
/// not hold certificates is skipped (the verifier's bundle may still complete the chain).
fn ek_chain_from_nv(ctx: &mut Context) -> Vec<Vec<u8>> {
    let indices = super::handles::nv_indices(ctx, EK_CHAIN_NV.0, EK_CHAIN_NV.1).unwrap_or_default();
    let mut out = Vec::new();
    for index in indices {
        let Ok(handle) = tss_esapi::handles::NvIndexTpmHandle::new(index) else {
            continue;
        };
        let read = ctx
            .execute_without_session(|ctx| {
                ctx.tr_from_tpm_public(tss_esapi::handles::TpmHandle::NvIndex(handle))
            })
            .and_then(|object| {
                let auth =
                    tss_esapi::interface_types::resource_handles::NvAuth::NvIndex(object.into());
                ctx.execute_with_nullauth_session(|ctx| {
                    tss_esapi::abstraction::nv::read_full(ctx, auth, handle)
                })
            });
        if let Ok(bytes) = read {
            out.extend(crate::key::der::split_der_certificates(&bytes));
        }
    }
    out
}

/// TPM2_ActivateCredential: recovers the secret a verifier encrypted to this TPM's EK (RSA-2048
/// or ECC P-256, as the challenge says by its shape) for the AK at `ak_handle` (see
/// `key::tpm::credential`). The TPM releases it only if the AK it names
/// is loaded here, which is what the verifier wants to know.
pub(crate) fn activate(
    ctx: &mut Context,
    ak_handle: u32,
    tcti: &str,
    credential_blob: &[u8],
    encrypted_secret: &[u8],
) -> Result<zeroize::Zeroizing<Vec<u8>>, KeyError> {
    let malformed = |what: &str, e: tss_esapi::Error| KeyError::Malformed {
        what: what.into(),
        problem: Malformation::Tpm(Box::new(e)),
    };
    let id_object = IdObject::try_from(credential_blob.to_vec())
        .map_err(|e| malformed("the challenge's credential blob", e))?;
    let secret = EncryptedSecret::try_from(encrypted_secret.to_vec())
        .map_err(|e| malformed("the challenge's encrypted secret", e))?;
    let kind =
        super::credential::ek_kind_of(encrypted_secret).ok_or_else(|| KeyError::Malformed {
            what: "the challenge's encrypted secret".into(),
            problem: Malformation::NotAnEkSecret,
        })?;
    let (ak, _) = super::persistent::open_persistent(ctx, ak_handle, tcti)?;
    let ek = ek::create_ek_object_2(ctx, ek_algorithm(kind), None)
        .map_err(tpm_err("CreatePrimary (EK)"));
    let result = ek.and_then(|ek| {
        let r = activate_with(ctx, KeyHandle::from(ak), ek, id_object, secret);
        let _ = ctx.flush_context(ObjectHandle::from(ek));
        r
    });
    close(ctx, ak);
    result
}

fn activate_with(
    ctx: &mut Context,
    ak: KeyHandle,
    ek: KeyHandle,
    id_object: IdObject,
    secret: EncryptedSecret,
) -> Result<zeroize::Zeroizing<Vec<u8>>, KeyError> {
    // The EK's authPolicy is PolicySecret(TPM_RH_ENDORSEMENT): a policy session satisfies it.
    let session = ctx
        .start_auth_session(
            None,
            None,
            None,
            SessionType::Policy,
            SymmetricDefinition::AES_128_CFB,
            HashingAlgorithm::Sha256,
        )
        .map_err(tpm_err("StartAuthSession (policy)"))?
        .ok_or_else(|| KeyError::Malformed {
            what: "StartAuthSession".into(),
            problem: Malformation::NoSession,
        })?;
    let result = PolicySession::try_from(session)
        .map_err(tpm_err("the policy session"))
        .and_then(|policy| {
            ctx.execute_with_nullauth_session(|ctx| {
                ctx.policy_secret(
                    policy,
                    AuthHandle::Endorsement,
                    Default::default(),
                    Default::default(),
                    Default::default(),
                    None,
                )
            })
            .map_err(tpm_err("PolicySecret (endorsement)"))
        })
        .and_then(|_| {
            ctx.execute_with_sessions((Some(AuthSession::Password), Some(session), None), |ctx| {
                ctx.activate_credential(ak, ek, id_object, secret)
            })
            .map_err(tpm_err("ActivateCredential"))
        })
        .map(|digest| zeroize::Zeroizing::new(digest.value().to_vec()));
    let _ = ctx.flush_context(SessionHandle::from(session).into());
    result
}

/// The SubjectPublicKeyInfo of an EK's public area (RSA or ECC P-256).
pub(crate) fn public_spki(public: &Public) -> Result<Vec<u8>, KeyError> {
    match public {
        Public::Rsa {
            parameters, unique, ..
        } => {
            let (modulus, exponent) =
                super::public::rsa_parts(parameters, unique).map_err(|e| KeyError::Malformed {
                    what: "an endorsement key's public area".into(),
                    problem: Malformation::Unusable(e),
                })?;
            Ok(crate::key::der::rsa_spki(modulus, &exponent.to_be_bytes()))
        }
        _ => ecc_spki(public),
    }
}

/// The SubjectPublicKeyInfo of a P-256 public area (the AK's or the EK's).
pub(crate) fn ecc_spki(public: &Public) -> Result<Vec<u8>, KeyError> {
    let malformed = |problem| KeyError::Malformed {
        what: "an attestation or endorsement key's public area".into(),
        problem,
    };
    match public {
        Public::Ecc { unique, .. } => super::public::ec_spki(KeyAlgorithm::EcP256, unique)
            .map_err(|e| malformed(Malformation::Unusable(e))),
        _ => Err(malformed(Malformation::NotEcc)),
    }
}
