//! How TPM keys and TPMs are named in messages.

use crate::key::TpmKeyLocation;

/// "TPM key file /k.pem" / "TPM persistent key 0x81000101".
pub(super) fn location_desc(location: &TpmKeyLocation) -> String {
    match location {
        TpmKeyLocation::Path(p) => format!("TPM key file {}", p.display()),
        TpmKeyLocation::Handle(h) => format!("TPM persistent key {h:#010x}"),
    }
}

pub(super) fn tpm_place(tcti: &str) -> String {
    format!("the TPM at TCTI '{tcti}'")
}
