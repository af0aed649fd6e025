//! The people trust's `_allow` entry: who may renew their own identity, by name, and with
//! which proof.

use serde::Deserialize;

/// Who may renew (the people trust's `_allow` entry, YAML), by name, and with which proof.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AllowList {
    /// People who may renew their own identity, with hardware proof only (TPM evidence by an
    /// AK, or a YubiKey's PIV attestation, registered under their name).
    #[serde(default)]
    pub users: Vec<String>,
    /// People who may also renew with their current certificate alone: possession of the key,
    /// not proof that hardware holds it. An administrator's explicit opt-in, person by person.
    #[serde(default)]
    pub certificate_only: Vec<String>,
    /// Groups a listed person's certificate may carry that must be named to be carried
    /// (`system:masters`). A group admits nobody (see the module's header).
    #[serde(default)]
    pub groups: Vec<String>,
}

/// Which proofs admit a person, from the allow list's words for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    /// Hardware proof only (listed under `users`).
    Hardware,
    /// Hardware proof, or the current certificate alone (listed under `certificateOnly`).
    HardwareOrCertificate,
}

impl AllowList {
    /// Reads the `_allow` entry.
    pub fn parse(text: &str) -> Result<AllowList, AllowListError> {
        let list: AllowList = serde_yaml_ng::from_str(text).map_err(AllowListError::Yaml)?;
        if list
            .users
            .iter()
            .chain(&list.certificate_only)
            .chain(&list.groups)
            .any(String::is_empty)
        {
            return Err(AllowListError::EmptyName);
        }
        Ok(list)
    }

    /// Which proofs admit `user`, or None when the list does not name them. Only a name
    /// admits: never a group, which for a person with a client certificate is that
    /// certificate's own O.
    pub fn admits(&self, user: &str) -> Option<Admitted> {
        if self.certificate_only.iter().any(|u| u == user) {
            Some(Admitted::HardwareOrCertificate)
        } else if self.users.iter().any(|u| u == user) {
            Some(Admitted::Hardware)
        } else {
            None
        }
    }
}

/// Why a people trust's `_allow` entry is refused (then nobody may renew).
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum AllowListError {
    #[error("it is not YAML with 'users' and 'groups' lists: {0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("it lists an empty name")]
    EmptyName,
}
