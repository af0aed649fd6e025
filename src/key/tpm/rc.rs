//! TSS response codes, turned into words once, here.
//!
//! tss-esapi's own `Display` ignores the TSS *layer* of a response code, so a TCTI I/O error
//! (0x000a000a) prints as "response code not recognized" and some TCTI/ESAPI codes are even
//! mistaken for TPM codes. We recover the raw 32-bit code, decode the layer ourselves, and only
//! ask tss-esapi to explain codes that really came from the TPM. Callers classify failures with
//! [`tpm_kind`] (which is `None` for anything that did not come from the TPM).

use tss_esapi::constants::response_code::{Tss2ResponseCode, Tss2ResponseCodeKind};
use tss_esapi::Error;

use crate::key::KeyError;
use crate::key::{DeviceError, PinError};

/// TSS2 layer numbers (bits 16..24 of a `TSS2_RC`, tss2_common.h).
const LAYER_TPM: u32 = 0;
const LAYER_TCTI: u32 = 10;
const LAYER_RESMGR_TPM: u32 = 12;
/// `TSS2_ESYS_RC_BAD_TR`: ESAPI does not know the handle.
const ESYS_BAD_TR: u32 = 0x0007_0018;
/// `TSS2_ESYS_RC_BAD_SEQUENCE`: the context's last command never finished (its connection
/// died mid-command); the context is unusable.
const ESYS_BAD_SEQUENCE: u32 = 0x0007_0007;

/// The raw `TSS2_RC`, if the error carries one.
fn raw_rc(err: &Error) -> Option<u32> {
    let Error::Tss2Error(rc) = err else {
        return None;
    };
    // The inner bitfield types print themselves as "Response code value: 0x…" and offer no
    // other accessor for the raw value.
    let text = match rc {
        Tss2ResponseCode::Success => return Some(0),
        Tss2ResponseCode::FormatZero(z) => z.to_string(),
        Tss2ResponseCode::FormatOne(o) => o.to_string(),
    };
    let hex = text.rsplit("0x").next()?;
    u32::from_str_radix(hex.trim(), 16).ok()
}

/// What kind of TPM response this is; `None` for errors from the TSS layers, the TCTI or
/// tss-esapi itself.
pub(crate) fn tpm_kind(err: &Error) -> Option<Tss2ResponseCodeKind> {
    let raw = raw_rc(err)?;
    match (raw >> 16) & 0xff {
        LAYER_TPM | LAYER_RESMGR_TPM => Tss2ResponseCode::from(raw & 0xffff).kind(),
        _ => None,
    }
}

/// True if the TPM refused the key's authValue (TPM_RC_AUTH_FAIL counts toward the dictionary
/// attack lockout; TPM_RC_BAD_AUTH is the same refusal for a noDA object).
pub(crate) fn is_auth_fail(err: &Error) -> bool {
    matches!(
        tpm_kind(err),
        Some(Tss2ResponseCodeKind::AuthFail | Tss2ResponseCodeKind::BadAuth)
    )
}

/// True if the connection to the TPM is gone (the TCTI layer failed, or ESAPI is stuck in a
/// command the dead connection never answered): reconnect.
pub(crate) fn is_connection_lost(err: &Error) -> bool {
    raw_rc(err).is_some_and(|raw| (raw >> 16) & 0xff == LAYER_TCTI || raw == ESYS_BAD_SEQUENCE)
}

/// True if the TPM no longer has the object the command named (after a TPM reset or a
/// resource manager restart): load it again.
pub(crate) fn is_object_gone(err: &Error) -> bool {
    matches!(
        tpm_kind(err),
        Some(Tss2ResponseCodeKind::ReferenceH0 | Tss2ResponseCodeKind::Handle)
    ) || raw_rc(err) == Some(ESYS_BAD_TR)
}

fn layer_name(layer: u32) -> &'static str {
    match layer {
        0 => "TPM",
        6 => "FAPI",
        7 => "ESAPI",
        8 => "SAPI",
        9 => "marshalling",
        10 => "TCTI",
        11 => "resource manager",
        12 => "resource manager (TPM code)",
        _ => "TSS",
    }
}

/// The base codes shared by all TSS layers above the TPM (tss2_common.h `TSS2_BASE_RC_*`).
fn base_rc_name(base: u32) -> &'static str {
    match base {
        1 => "general failure",
        2 => "not implemented",
        3 => "bad context",
        4 => "ABI mismatch",
        5 => "bad reference",
        6 => "insufficient buffer",
        7 => "bad sequence",
        8 => "no connection",
        9 => "try again",
        10 => "I/O error",
        11 => "bad value",
        12 => "not permitted",
        13 => "invalid sessions",
        14 => "no decrypt parameter",
        15 => "no encrypt parameter",
        16 => "bad size",
        17 => "malformed response",
        18 => "insufficient context",
        19 => "insufficient response",
        20 => "incompatible TCTI",
        21 => "not supported",
        22 => "bad TCTI structure",
        23 => "out of memory",
        24 => "bad ESYS_TR handle",
        25 => "multiple decrypt sessions",
        26 => "multiple encrypt sessions",
        27 => "response authorization failed",
        _ => "unknown error",
    }
}

/// A hint for the TPM responses an operator can do something about.
fn hint(kind: Tss2ResponseCodeKind) -> &'static str {
    use Tss2ResponseCodeKind as K;
    match kind {
        K::ObjectMemory => {
            "; the TPM has no free slot for another loaded object (swtpm and TPMs reached without \
             a resource manager hold only 3): close other keys, flush leaked objects with \
             `tpm2_flushcontext -t`, or use a resource manager (device:/dev/tpmrm0, tabrmd)"
        }
        K::Integrity | K::Binding => {
            "; the key blob does not belong to this TPM or parent (another TPM, a TPM that was \
             cleared, or a different parent template)"
        }
        K::Lockout => {
            "; the TPM is in dictionary-attack lockout, so it refuses every password, the \
             right one too (hwkey keeps this one: it was not found wrong). The lockout is the \
             whole TPM's: wrong passwords from any process that can reach it count, another \
             user's through tpm2-abrmd too. Wait for it to recover (`tpm2_getcap \
             properties-variable`: TPM2_PT_LOCKOUT_COUNTER and TPM2_PT_LOCKOUT_INTERVAL), or \
             reset it with the lockout authorization (`tpm2_dictionarylockout --clear-lockout`); \
             on a node, give hwkey the kernel's resource manager (device:/dev/tpmrm0, which \
             only the tss group opens), not a TPM other users reach (docs/SECURITY.md)"
        }
        K::AuthFail | K::BadAuth => {
            "; the authorization value is wrong (a key's password comes from pin-source= on \
             its tpm: URI, the owner hierarchy's from owner-pin-source=)"
        }
        K::Hierarchy => "; the owner hierarchy is disabled on this TPM (enable it in the firmware)",
        K::Initialize => "; the TPM was not started: run `tpm2_startup -c`",
        K::Retry | K::Testing | K::Yielded => "; the TPM is busy: try again",
        _ => "",
    }
}

/// Words for any tss-esapi error, with the raw code for searching and a hint where one helps.
pub(crate) fn describe_error(err: &Error) -> String {
    let Some(raw) = raw_rc(err) else {
        return match err {
            Error::WrapperError(kind) => format!("tss-esapi refused the request: {kind}"),
            other => other.to_string(),
        };
    };
    let layer = (raw >> 16) & 0xff;
    match tpm_kind(err) {
        Some(kind) => format!(
            "{} ({} response code {raw:#x}){}",
            Tss2ResponseCode::from(raw & 0xffff),
            layer_name(layer),
            hint(kind)
        ),
        None if layer == LAYER_TPM || layer == LAYER_RESMGR_TPM => {
            format!("{} response code {raw:#x}", layer_name(layer))
        }
        None => format!(
            "{} {} ({} response code {raw:#x})",
            layer_name(layer),
            base_rc_name(raw & 0xffff),
            layer_name(layer)
        ),
    }
}

/// Why a connection through `tcti` failed, in words an operator can act on: tpm2-abrmd's
/// "no connection" is also what a full daemon answers, and any local user can fill it.
pub(crate) fn connect_reason(tcti: &str, err: &Error) -> String {
    let reason = describe_error(err);
    let tcti_failed = raw_rc(err).is_some_and(|raw| (raw >> 16) & 0xff == LAYER_TCTI);
    if tcti_failed && tcti.trim_start().starts_with("tabrmd") {
        return format!(
            "{reason}; tpm2-abrmd did not take the connection: it is not running (systemctl \
             status tpm2-abrmd), or every connection it serves is taken (its --max-connections, \
             27 by default), which any local user can do. A node's identity should not depend \
             on a daemon others can fill: use the kernel's resource manager, \
             tcti=device:/dev/tpmrm0 (docs/SECURITY.md)"
        );
    }
    reason
}

/// The generic mapping: a TPM operation failed.
pub(crate) fn tpm_error(operation: &'static str) -> impl Fn(Error) -> KeyError {
    move |err| {
        KeyError::Device(DeviceError::Tpm {
            operation,
            reason: describe_error(&err),
            source: Some(Box::new(err)),
        })
    }
}

/// For commands authorized by the owner hierarchy: a refused authorization is the owner
/// password (missing or wrong), said as such; anything else as [`tpm_error`].
pub(crate) fn owner_error(operation: &'static str) -> impl Fn(Error) -> KeyError {
    move |err| {
        if is_auth_fail(&err) {
            KeyError::Pin(PinError::TpmOwnerAuthRefused { operation })
        } else {
            tpm_error(operation)(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcti_errors_name_their_layer() {
        let err = Error::Tss2Error(Tss2ResponseCode::from(0x000a_000a));
        assert_eq!(tpm_kind(&err), None);
        assert!(is_connection_lost(&err));
        assert!(!is_object_gone(&err));
        let text = describe_error(&err);
        assert!(text.contains("TCTI I/O error"), "{text}");
        assert!(text.contains("0xa000a"), "{text}");
    }

    #[test]
    fn tpm_errors_keep_their_meaning() {
        // TPM_RC_HANDLE on handle 1.
        let err = Error::Tss2Error(Tss2ResponseCode::from(0x18b));
        assert_eq!(tpm_kind(&err), Some(Tss2ResponseCodeKind::Handle));
        assert!(is_object_gone(&err));
        assert!(!is_connection_lost(&err));
        // TPM_RC_OBJECT_MEMORY.
        let err = Error::Tss2Error(Tss2ResponseCode::from(0x902));
        assert_eq!(tpm_kind(&err), Some(Tss2ResponseCodeKind::ObjectMemory));
        assert!(describe_error(&err).contains("tpm2_flushcontext"));
    }
}
