//! Whether a key's private half can leave its device, as the device reports it, and the policy
//! that refuses keys that could (`--require-non-extractable`, on by default).
//!
//! Why a policy and not just hwkey's own key creation: hwkey also opens keys it did not make
//! (pkcs11-tool, tpm2-tools, tpm2-openssl, a vendor's tool). A key generated outside the device
//! and imported, or one marked extractable, has (or may have) a copy elsewhere, and a node
//! identity bound to it proves nothing about the machine holding it.

use super::KeyError;
use crate::key::CapabilityError;

/// How a key's protection is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assurance {
    /// The PKCS#11 token's own attributes (`CKA_EXTRACTABLE`, `CKA_NEVER_EXTRACTABLE`, …): the
    /// token's word, which nobody else can check. A vendor attestation (e.g. a PIV attestation
    /// certificate chain) would be a stronger variant here.
    TokenAttributes,
    /// The TPM object's attributes (`fixedTPM`, `fixedParent`, `sensitiveDataOrigin`), which the
    /// TPM can certify to a third party (TPM2_Certify with an attestation key).
    TpmAttributes,
}

/// What the device says about a key's private half.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protection {
    /// The device's attributes as `(name, value)`, for `hwkey key info`.
    pub attributes: Vec<(&'static str, bool)>,
    /// Why the private key could leave the device (or may exist outside it); empty when it
    /// cannot.
    pub exportable: Vec<String>,
    /// How this is known.
    pub assurance: Assurance,
}

impl Protection {
    /// Judges a PKCS#11 private key by its attributes (as `pkcs11::protection` reads them).
    pub fn from_pkcs11(attributes: Vec<(&'static str, bool)>) -> Protection {
        let value = |name: &str| attributes.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let mut exportable = Vec::new();
        if value("CKA_EXTRACTABLE") == Some(true) {
            exportable.push("CKA_EXTRACTABLE is true: the token would export it wrapped".into());
        }
        if value("CKA_NEVER_EXTRACTABLE") == Some(false) {
            exportable.push(
                "CKA_NEVER_EXTRACTABLE is false: it was extractable (or imported) at some point"
                    .into(),
            );
        }
        if value("CKA_SENSITIVE") == Some(false) {
            exportable.push("CKA_SENSITIVE is false: the token reveals it in plaintext".into());
        }
        if value("private value readable") == Some(true) {
            exportable.push("the token returned the private value when asked".into());
        }
        Protection {
            attributes,
            exportable,
            assurance: Assurance::TokenAttributes,
        }
    }

    /// Whether the key asks for the PIN at every signature (`CKA_ALWAYS_AUTHENTICATE`).
    pub fn pin_always(&self) -> bool {
        self.attributes
            .iter()
            .any(|(name, value)| *name == "CKA_ALWAYS_AUTHENTICATE" && *value)
    }

    /// Judges a TPM object by its attributes.
    pub fn from_tpm(
        fixed_tpm: bool,
        fixed_parent: bool,
        sensitive_data_origin: bool,
    ) -> Protection {
        let mut exportable = Vec::new();
        if !fixed_tpm {
            exportable.push(
                "fixedTPM is clear: the key can be duplicated to another TPM (or was imported)"
                    .into(),
            );
        }
        Protection {
            attributes: vec![
                ("fixedTPM", fixed_tpm),
                ("fixedParent", fixed_parent),
                ("sensitiveDataOrigin", sensitive_data_origin),
            ],
            exportable,
            assurance: Assurance::TpmAttributes,
        }
    }

    /// The `--require-non-extractable` policy: an error naming every reason the key of
    /// `describe` could leave its device.
    pub fn require_non_extractable(&self, describe: &str) -> Result<(), KeyError> {
        if self.exportable.is_empty() {
            return Ok(());
        }
        Err(KeyError::Capability(CapabilityError::Extractable {
            key: describe.to_string(),
            reasons: self.exportable.join("; "),
        }))
    }
}

/// `--require-non-extractable`, shared by every command that makes or uses a hardware identity.
#[derive(Debug, Default, Clone, Copy, clap::Args)]
pub struct KeyPolicy {
    /// Refuse a key that could leave its device: a PKCS#11 key with CKA_EXTRACTABLE true,
    /// CKA_NEVER_EXTRACTABLE false or CKA_SENSITIVE false; a TPM key without fixedTPM (default
    /// true).
    #[arg(
        long,
        env = "HWKEY_REQUIRE_NON_EXTRACTABLE",
        action = clap::ArgAction::Set,
        value_name = "true|false"
    )]
    pub require_non_extractable: Option<bool>,
}

impl KeyPolicy {
    /// The policy in force: on unless turned off.
    pub fn required(self) -> bool {
        self.require_non_extractable.unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_key_created_by_hwkey_passes_and_an_extractable_one_does_not() {
        let good = Protection::from_pkcs11(vec![
            ("CKA_SENSITIVE", true),
            ("CKA_EXTRACTABLE", false),
            ("CKA_NEVER_EXTRACTABLE", true),
            ("CKA_ALWAYS_SENSITIVE", true),
            ("private value readable", false),
        ]);
        assert!(good.require_non_extractable("k").is_ok());
        let bad = Protection::from_pkcs11(vec![
            ("CKA_SENSITIVE", true),
            ("CKA_EXTRACTABLE", true),
            ("CKA_NEVER_EXTRACTABLE", false),
        ]);
        let e = bad.require_non_extractable("k").unwrap_err().to_string();
        assert!(e.contains("CKA_EXTRACTABLE is true"), "{e}");
        assert!(e.contains("CKA_NEVER_EXTRACTABLE is false"), "{e}");
        assert!(e.contains("--require-non-extractable=false"), "{e}");
    }

    #[test]
    fn a_duplicable_tpm_key_is_refused() {
        assert!(Protection::from_tpm(true, true, true)
            .require_non_extractable("k")
            .is_ok());
        let e = Protection::from_tpm(false, false, true)
            .require_non_extractable("k")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fixedTPM is clear"), "{e}");
    }
}
