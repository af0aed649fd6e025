//! The TPM's list of persistent handles, asked before any persistent object is opened: a
//! missing handle is then a clean error naming what is there (and libtss2 prints nothing).

use tss_esapi::constants::CapabilityType;
use tss_esapi::structures::CapabilityData;
use tss_esapi::Context;

use super::rc;
use crate::key::KeyError;

/// The NV indices present in `[first, last]` (e.g. the EK certificate chain's range).
pub(crate) fn nv_indices(ctx: &mut Context, first: u32, last: u32) -> Result<Vec<u32>, KeyError> {
    let (data, _) = ctx
        .execute_without_session(|ctx| ctx.get_capability(CapabilityType::Handles, first, 256))
        .map_err(rc::tpm_error("GetCapability(NV indices)"))?;
    let CapabilityData::Handles(list) = data else {
        return Ok(Vec::new());
    };
    Ok(list
        .into_inner()
        .into_iter()
        .map(u32::from)
        .filter(|h| (first..=last).contains(h))
        .collect())
}

/// The persistent handles (0x81xxxxxx) present in the TPM.
pub(crate) fn persistent_handles(ctx: &mut Context) -> Result<Vec<u32>, KeyError> {
    let mut out = Vec::new();
    let mut next: u32 = 0x8100_0000;
    loop {
        let (data, more) = ctx
            .execute_without_session(|ctx| ctx.get_capability(CapabilityType::Handles, next, 64))
            .map_err(rc::tpm_error("GetCapability(handles)"))?;
        let CapabilityData::Handles(list) = data else {
            break;
        };
        let batch: Vec<u32> = list
            .into_inner()
            .into_iter()
            .map(u32::from)
            .filter(|h| h >> 24 == 0x81)
            .collect();
        let Some(&last) = batch.last() else { break };
        out.extend(batch);
        if !more || last == u32::MAX {
            break;
        }
        next = last + 1;
    }
    Ok(out)
}
