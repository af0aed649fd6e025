//! The storage key (parent) that key files hang under.
//!
//! A TSS2 key file whose parent is 0x40000001 (the owner hierarchy) names no stored key: its
//! parent is re-created on every use with TPM2_CreatePrimary. The TPM derives a primary key
//! deterministically from the hierarchy's seed and the *template*, so the template has to match
//! byte for byte the one tpm2-openssl uses, or keys would not load across tools. This is
//! tpm2-openssl's `primaryEccTemplate` (src/tpm2-provider-pkey.c; identical from 1.0.0 to
//! 1.3.x, so Debian 12's 1.1.1 has it too):
//!
//! * ECC NIST P-256, nameAlg SHA-256, empty authPolicy, empty auth value;
//! * fixedTPM | fixedParent | sensitiveDataOrigin | userWithAuth | noDA | restricted | decrypt;
//! * symmetric AES-128-CFB, scheme NULL, KDF NULL;
//! * `unique` **empty** (x and y of size 0). The TCG provisioning guidance's SRK template fills
//!   `unique` with 32 zero bytes each and therefore yields a *different* key.
//!
//! On a TPM without ECC P-256 tpm2-openssl falls back to `primaryRsaTemplate` (RSA-2048,
//! exponent 0, same attributes and symmetric, empty unique); so do we.
//!
//! CreatePrimary is authorized by the owner hierarchy: with an empty password, or the one from
//! `owner-pin-source=` on the URI (set on the connection, see `context::Conn::set_owner_auth`).
//!
//! A file may also name a persistent parent (0x81xxxxxx), e.g. an SRK made by tpm2-tools (and
//! `key create` makes one with `parent=0x81…` on the URI); it is used with an empty auth value.
//! hwkey checks that a storage key is there and never touches the handle: a missing key, a key
//! that is not a storage key, or a blob that does not load under it is said as such. A created primary occupies a transient slot only while a key
//! is created or loaded under it: [`with_parent`] always flushes it before returning.

use tss_esapi::attributes::ObjectAttributesBuilder;
use tss_esapi::constants::response_code::Tss2ResponseCodeKind;
use tss_esapi::constants::{CapabilityType, EccCurveIdentifier};
use tss_esapi::handles::{KeyHandle, ObjectHandle, PersistentTpmHandle, TpmHandle};
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, PublicAlgorithm};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::resource_handles::Hierarchy;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{
    CapabilityData, EccPoint, Public, PublicBuilder, PublicEccParametersBuilder, PublicKeyRsa,
    PublicRsaParametersBuilder, RsaExponent, SymmetricDefinitionObject,
};
use tss_esapi::Context;

use super::rc;
use crate::key::{DeviceError, LocateError};
use crate::key::{KeyError, ParentProblem};

/// The owner hierarchy handle, as TSS2 key files write it for "the standard primary".
pub(crate) const OWNER_HIERARCHY: u32 = 0x4000_0001;

/// The storage-key attributes shared by both of tpm2-openssl's primary templates.
fn storage_attributes() -> Result<tss_esapi::attributes::ObjectAttributes, tss_esapi::Error> {
    ObjectAttributesBuilder::new()
        .with_fixed_tpm(true)
        .with_fixed_parent(true)
        .with_sensitive_data_origin(true)
        .with_user_with_auth(true)
        .with_no_da(true)
        .with_restricted(true)
        .with_decrypt(true)
        .build()
}

/// tpm2-openssl's `primaryEccTemplate`.
pub(crate) fn ecc_template() -> Result<Public, tss_esapi::Error> {
    PublicBuilder::new()
        .with_public_algorithm(PublicAlgorithm::Ecc)
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(storage_attributes()?)
        .with_ecc_parameters(
            PublicEccParametersBuilder::new_restricted_decryption_key(
                SymmetricDefinitionObject::AES_128_CFB,
                EccCurve::NistP256,
            )
            .build()?,
        )
        .with_ecc_unique_identifier(EccPoint::default())
        .build()
}

/// tpm2-openssl's `primaryRsaTemplate`.
pub(crate) fn rsa_template() -> Result<Public, tss_esapi::Error> {
    PublicBuilder::new()
        .with_public_algorithm(PublicAlgorithm::Rsa)
        .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
        .with_object_attributes(storage_attributes()?)
        .with_rsa_parameters(
            PublicRsaParametersBuilder::new_restricted_decryption_key(
                SymmetricDefinitionObject::AES_128_CFB,
                RsaKeyBits::Rsa2048,
                RsaExponent::ZERO_EXPONENT,
            )
            .build()?,
        )
        .with_rsa_unique_identifier(PublicKeyRsa::default())
        .build()
}

/// The ECC curves the TPM implements.
pub(crate) fn ecc_curves(ctx: &mut Context) -> Result<Vec<EccCurveIdentifier>, KeyError> {
    let (data, _) = ctx
        .execute_without_session(|ctx| ctx.get_capability(CapabilityType::EccCurves, 0, 64))
        .map_err(rc::tpm_error("GetCapability(ECC curves)"))?;
    match data {
        CapabilityData::EccCurves(list) => Ok(list.into_inner()),
        _ => Ok(Vec::new()),
    }
}

/// A loaded parent: either a primary we created (flushed after use) or a persistent key
/// (whose ESYS handle is merely closed).
enum Parent {
    Primary(KeyHandle),
    Persistent(ObjectHandle),
}

impl Parent {
    fn key_handle(&self) -> KeyHandle {
        match self {
            Parent::Primary(h) => *h,
            Parent::Persistent(h) => KeyHandle::from(*h),
        }
    }
}

fn load_parent(ctx: &mut Context, parent: u32) -> Result<Parent, KeyError> {
    if parent == OWNER_HIERARCHY {
        let template = if ecc_curves(ctx)?.contains(&EccCurveIdentifier::NistP256) {
            ecc_template()
        } else {
            rsa_template()
        }
        .map_err(rc::tpm_error("building the storage key template"))?;
        let primary = ctx
            .execute_with_session(Some(AuthSession::Password), |ctx| {
                ctx.create_primary(Hierarchy::Owner, template, None, None, None, None)
            })
            .map_err(rc::owner_error("CreatePrimary (owner storage key)"))?;
        return Ok(Parent::Primary(primary.key_handle));
    }
    if parent >> 24 == 0x81 {
        return open_persistent_parent(ctx, parent).map(Parent::Persistent);
    }
    Err(KeyError::Device(DeviceError::Tpm {
        source: None,
        operation: "loading the parent key",
        reason: format!(
            "parent {parent:#010x} is neither the owner hierarchy (0x40000001) nor a persistent \
             key (0x81xxxxxx)"
        ),
    }))
}

/// A persistent storage key named as a parent, made by another tool (an SRK at 0x81000001 is
/// usual): it must be there and be a storage key. hwkey only reads it, never replaces it.
fn open_persistent_parent(ctx: &mut Context, parent: u32) -> Result<ObjectHandle, KeyError> {
    let present = super::handles::persistent_handles(ctx)?;
    if !present.contains(&parent) {
        let present = present
            .iter()
            .map(|h| format!("{h:#010x}"))
            .collect::<Vec<_>>();
        return Err(KeyError::Locate(LocateError::TpmParent {
            parent,
            problem: ParentProblem::Missing {
                present: if present.is_empty() {
                    "none".into()
                } else {
                    present.join(", ")
                },
            },
        }));
    }
    let handle =
        PersistentTpmHandle::new(parent).map_err(rc::tpm_error("naming the persistent parent"))?;
    let mut object = ctx
        .execute_without_session(|ctx| ctx.tr_from_tpm_public(TpmHandle::Persistent(handle)))
        .map_err(rc::tpm_error("opening the persistent parent key"))?;
    let public = ctx
        .execute_without_session(|ctx| ctx.read_public(KeyHandle::from(object)))
        .map(|(public, _, _)| public);
    let storage = match &public {
        Ok(public) => {
            let a = public.object_attributes();
            a.restricted() && a.decrypt() && !a.sign_encrypt()
        }
        Err(_) => false,
    };
    if !storage {
        let _ = ctx.tr_close(&mut object);
        public.map_err(rc::tpm_error("ReadPublic (persistent parent)"))?;
        return Err(KeyError::Locate(LocateError::TpmParent {
            parent,
            problem: ParentProblem::NotAStorageKey,
        }));
    }
    Ok(object)
}

/// Whether a failed Load under `parent` means the blob belongs to another parent: said in
/// words for a persistent parent (another tool may have replaced it).
pub(crate) fn load_error(parent: u32) -> impl Fn(tss_esapi::Error) -> KeyError {
    move |e| {
        let foreign = matches!(
            rc::tpm_kind(&e),
            Some(Tss2ResponseCodeKind::Integrity | Tss2ResponseCodeKind::Binding)
        );
        if foreign && parent >> 24 == 0x81 {
            KeyError::Locate(LocateError::TpmParent {
                parent,
                problem: ParentProblem::NotTheParent,
            })
        } else {
            rc::tpm_error("Load (key file)")(e)
        }
    }
}

fn release(ctx: &mut Context, parent: Parent) {
    let result = match parent {
        Parent::Primary(h) => ctx.flush_context(h.into()),
        Parent::Persistent(mut h) => ctx.tr_close(&mut h),
    };
    if let Err(e) = result {
        tracing::warn!(
            "could not release the TPM parent key: {}",
            rc::describe_error(&e)
        );
    }
}

/// Loads the parent a key file names, runs `f` under it, and releases the parent before
/// returning, whatever `f` returned (a TPM without a resource manager cannot spare the slot).
pub(crate) fn with_parent<T>(
    ctx: &mut Context,
    parent: u32,
    f: impl FnOnce(&mut Context, KeyHandle) -> Result<T, KeyError>,
) -> Result<T, KeyError> {
    let loaded = load_parent(ctx, parent)?;
    let result = f(ctx, loaded.key_handle());
    release(ctx, loaded);
    result
}
