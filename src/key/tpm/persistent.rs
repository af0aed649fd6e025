//! Persistent keys (`tpm:handle=0x81…`): finding, creating, listing and evicting them.
//!
//! Presence is always checked through the TPM's handle list (TPM2_GetCapability) before an
//! object is opened, so a missing handle is a clean `KeyNotFound` listing what is there (and
//! libtss2 prints no errors). Only unrestricted signing keys are ever evicted: a storage key at
//! a persistent handle may be the parent of keys hwkey knows nothing about.

use tss_esapi::constants::response_code::Tss2ResponseCodeKind;
use tss_esapi::handles::{ObjectHandle, PersistentTpmHandle, TpmHandle};
use tss_esapi::interface_types::dynamic_handles::Persistent;
use tss_esapi::interface_types::resource_handles::Provision;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::Public;
use tss_esapi::Context;

use super::handles::persistent_handles;
use super::names::{location_desc, tpm_place};
use super::public::KeyInfo;
use super::{keygen, rc};
use crate::key::uri::TpmKeyLocation;
use crate::key::{DeviceError, LocateError};
use crate::key::{KeyAlgorithm, KeyError};

fn persistent_handle(h: u32) -> Result<PersistentTpmHandle, KeyError> {
    PersistentTpmHandle::new(h).map_err(rc::tpm_error("naming the persistent handle"))
}

fn handle_list(handles: &[u32]) -> Vec<String> {
    handles.iter().map(|h| format!("{h:#010x}")).collect()
}

/// Opens a persistent object; a missing one is `KeyNotFound` listing the handles present.
pub(crate) fn open_persistent(
    ctx: &mut Context,
    h: u32,
    tcti: &str,
) -> Result<(ObjectHandle, Public), KeyError> {
    let handle = persistent_handle(h)?;
    // Asking the handle list first keeps libtss2 from printing errors for a missing handle.
    let present = persistent_handles(ctx)?;
    let not_found = |present: &[u32]| {
        KeyError::Locate(LocateError::KeyNotFound {
            what: location_desc(&TpmKeyLocation::Handle(h)),
            place: tpm_place(tcti),
            present: handle_list(present),
        })
    };
    if !present.contains(&h) {
        return Err(not_found(&present));
    }
    let mut object = match ctx
        .execute_without_session(|ctx| ctx.tr_from_tpm_public(TpmHandle::Persistent(handle)))
    {
        Ok(o) => o,
        Err(e) if rc::tpm_kind(&e) == Some(Tss2ResponseCodeKind::Handle) => {
            return Err(not_found(&present))
        }
        Err(e) => return Err(rc::tpm_error("ReadPublic (persistent key)")(e)),
    };
    match ctx.execute_without_session(|ctx| ctx.read_public(object.into())) {
        Ok((public, _, _)) => Ok((object, public)),
        Err(e) => {
            let _ = ctx.tr_close(&mut object);
            Err(rc::tpm_error("ReadPublic (persistent key)")(e))
        }
    }
}

/// True if something is stored at the persistent handle.
fn persistent_exists(ctx: &mut Context, h: u32) -> Result<bool, KeyError> {
    Ok(persistent_handles(ctx)?.contains(&h))
}

/// Creates a key and makes it persistent at `h`; the transient copy is flushed either way.
pub(crate) fn create_persistent(
    ctx: &mut Context,
    alg: KeyAlgorithm,
    h: u32,
    tcti: &str,
) -> Result<(ObjectHandle, Public), KeyError> {
    let exists = || {
        KeyError::Locate(LocateError::KeyExists {
            what: format!("persistent handle {h:#010x}"),
            place: tpm_place(tcti),
        })
    };
    let persistent = persistent_handle(h)?;
    if persistent_exists(ctx, h)? {
        return Err(exists());
    }
    let new = keygen::create_and_load(ctx, alg, None, super::primary::OWNER_HIERARCHY)?;
    let evicted = ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
        ctx.evict_control(
            Provision::Owner,
            new.handle.into(),
            Persistent::Persistent(persistent),
        )
    });
    if let Err(e) = ctx.flush_context(new.handle.into()) {
        tracing::warn!(
            "could not flush the new key's transient copy: {}",
            rc::describe_error(&e)
        );
    }
    match evicted {
        Ok(object) => Ok((object, new.public)),
        Err(e) if rc::tpm_kind(&e) == Some(Tss2ResponseCodeKind::NvDefined) => Err(exists()),
        Err(e) => Err(rc::owner_error("EvictControl (make the key persistent)")(e)),
    }
}

/// Evicts a persistent *signing* key. Storage keys and other objects are refused: other keys
/// may depend on them.
pub(crate) fn evict_persistent(ctx: &mut Context, h: u32, tcti: &str) -> Result<(), KeyError> {
    let (mut object, public) = open_persistent(ctx, h, tcti)?;
    if let Err(problem) = KeyInfo::from_public(&public) {
        let _ = ctx.tr_close(&mut object);
        return Err(KeyError::Device(DeviceError::TpmKeyUnusable {
            key: location_desc(&TpmKeyLocation::Handle(h)),
            problem: crate::key::Unusable::NotDeletable(Box::new(problem)),
        }));
    }
    let persistent = persistent_handle(h)?;
    let result = ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
        ctx.evict_control(Provision::Owner, object, Persistent::Persistent(persistent))
    });
    if let Err(e) = result {
        let _ = ctx.tr_close(&mut object);
        return Err(rc::owner_error("EvictControl (delete the persistent key)")(
            e,
        ));
    }
    Ok(())
}

/// The persistent keys hwkey can sign with, and their algorithms.
pub(crate) fn persistent_signing_keys(
    ctx: &mut Context,
) -> Result<Vec<(u32, KeyAlgorithm)>, KeyError> {
    let mut out = Vec::new();
    for h in persistent_handles(ctx)? {
        let Ok(handle) = PersistentTpmHandle::new(h) else {
            continue;
        };
        let Ok(mut object) = ctx
            .execute_without_session(|ctx| ctx.tr_from_tpm_public(TpmHandle::Persistent(handle)))
        else {
            continue;
        };
        let public = ctx.execute_without_session(|ctx| ctx.read_public(object.into()));
        let _ = ctx.tr_close(&mut object);
        if let Ok((public, _, _)) = public {
            if let Ok(info) = KeyInfo::from_public(&public) {
                out.push((h, info.algorithm));
            }
        }
    }
    Ok(out)
}
