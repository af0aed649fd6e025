//! Which TPM may be which node, for TPMs that join by their EK certificate: the policy in the
//! trust source's `_ek-binding` entry, and the bindings recorded in its node entries
//! (`ekSha256`).
//!
//! - `firstUse` (the default): the first TPM to prove itself for a node name holds that name.
//!   A second TPM for the name is denied (`NodeBoundToAnotherTPM`), and so is one TPM asking
//!   for a second name (`TPMBoundToAnotherNode`). The same TPM re-joins (a reinstalled node).
//! - `allow`: EK public key hashes per node name (a vendor's shipping manifest). A name listed
//!   there admits only its TPMs; with `firstUse: false`, a name not listed admits none.
//!
//! A node registered by an operator without an EK (`hwkey attest enroll`) is bound to its AK:
//! no TPM joins under its name until the operator removes the entry.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::policy::{Reason, Violation};
use crate::pki::registration::{check_ek_sha256, RegisteredAk, EK_BINDING_ENTRY};

/// The `_ek-binding` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingPolicy {
    /// Whether a name not on the allow list goes to the first TPM that proves itself for it.
    pub first_use: bool,
    /// EK SubjectPublicKeyInfo SHA-256 hashes (lowercase hex) allowed per node name.
    pub allow: BTreeMap<String, Vec<String>>,
}

/// An `_ek-binding` entry that cannot be read: no TPM joins until it is fixed.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum BindingError {
    #[error("the {EK_BINDING_ENTRY} entry is not `firstUse: BOOL` and `allow: {{NODE: [EK SHA-256, ...]}}`: {0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("the {EK_BINDING_ENTRY} entry's allow list for {node}: {source}")]
    Hash {
        node: String,
        #[source]
        source: crate::pki::registration::RegistrationError,
    },
}

impl Default for BindingPolicy {
    fn default() -> Self {
        BindingPolicy {
            first_use: true,
            allow: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BindingFile {
    #[serde(default = "yes")]
    first_use: bool,
    #[serde(default)]
    allow: BTreeMap<String, Vec<String>>,
}

fn yes() -> bool {
    true
}

impl BindingPolicy {
    /// Reads the `_ek-binding` entry (None: the default, `firstUse` alone).
    pub fn parse(text: Option<&str>) -> Result<BindingPolicy, BindingError> {
        let Some(text) = text else {
            return Ok(BindingPolicy::default());
        };
        let file: BindingFile = serde_yaml_ng::from_str(text).map_err(BindingError::Yaml)?;
        let mut allow = BTreeMap::new();
        for (node, hashes) in file.allow {
            let hashes = hashes
                .iter()
                .map(|h| check_ek_sha256(h))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| BindingError::Hash {
                    node: node.clone(),
                    source,
                })?;
            allow.insert(node, hashes);
        }
        Ok(BindingPolicy {
            first_use: file.first_use,
            allow,
        })
    }
}

/// Whether the TPM whose EK hashes to `ek_sha256` may be node `node`, given the policy text
/// (`_ek-binding`) and the recorded registrations. Ok(true): it holds the name already (a
/// re-join); Ok(false): it takes a free name.
pub fn check(
    node: &str,
    ek_sha256: &str,
    policy: Option<&str>,
    nodes: &[RegisteredAk],
) -> Result<bool, Violation> {
    let deny = |reason, message: String| Violation { reason, message };
    let policy =
        BindingPolicy::parse(policy).map_err(|e| deny(Reason::TpmNotAllowed, e.to_string()))?;
    match policy.allow.get(node) {
        Some(allowed) if !allowed.iter().any(|h| h == ek_sha256) => {
            return Err(deny(
                Reason::TpmNotAllowed,
                format!("the TPM with EK {ek_sha256} is not on the allow list of node '{node}' ({EK_BINDING_ENTRY})"),
            ))
        }
        None if !policy.first_use => {
            return Err(deny(
                Reason::TpmNotAllowed,
                format!("node '{node}' is not on the allow list ({EK_BINDING_ENTRY}) and firstUse is off"),
            ))
        }
        _ => {}
    }
    let elsewhere: Vec<&str> = nodes
        .iter()
        .filter(|n| n.node != node && n.ek_sha256.as_deref() == Some(ek_sha256))
        .map(|n| n.node.as_str())
        .collect();
    if !elsewhere.is_empty() {
        return Err(deny(
            Reason::TpmBoundToAnotherNode,
            format!(
                "the TPM with EK {ek_sha256} holds node name {} already: one TPM is one node (to rename the node, remove that entry from the trust first)",
                elsewhere.join(", ")
            ),
        ));
    }
    match nodes.iter().find(|n| n.node == node) {
        None => Ok(false),
        Some(n) if n.ek_sha256.as_deref() == Some(ek_sha256) => Ok(true),
        Some(n) => Err(deny(
            Reason::NodeBoundToAnotherTpm,
            match &n.ek_sha256 {
                Some(other) => format!("node '{node}' is held by the TPM with EK {other}, not this one ({ek_sha256}); if the node moved to new hardware, remove its entry from the trust once and it joins again"),
                None => format!("node '{node}' is registered by an operator (AK {}); remove its entry from the trust to let a TPM join as it by its EK certificate", hex::encode(&n.ak_name)),
            },
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn entry(node: &str, ek: Option<&str>) -> RegisteredAk {
        RegisteredAk {
            node: node.into(),
            ak_name: vec![0, 11, 1],
            ek_sha256: ek.map(str::to_string),
        }
    }

    fn reason(r: Result<bool, Violation>) -> Reason {
        r.expect_err("denied").reason
    }

    #[test]
    fn first_use_holds_a_name_for_its_tpm_and_a_tpm_to_its_name() {
        let nodes = [entry("node-a", Some(A)), entry("node-op", None)];
        assert_eq!(check("node-b", B, None, &nodes), Ok(false));
        assert_eq!(check("node-a", A, None, &nodes), Ok(true));
        assert_eq!(
            reason(check("node-a", B, None, &nodes)),
            Reason::NodeBoundToAnotherTpm
        );
        assert_eq!(
            reason(check("node-b", A, None, &nodes)),
            Reason::TpmBoundToAnotherNode
        );
        let by_operator = check("node-op", B, None, &nodes).expect_err("denied");
        assert_eq!(by_operator.reason, Reason::NodeBoundToAnotherTpm);
        assert!(by_operator.message.contains("operator"), "{by_operator}");
    }

    #[test]
    fn an_allow_list_admits_only_its_tpms_and_first_use_can_be_off() {
        let upper = A.to_ascii_uppercase();
        let policy = format!("allow:\n  node-a: [\"{upper}\"]\n");
        assert_eq!(check("node-a", A, Some(&policy), &[]), Ok(false));
        assert_eq!(
            reason(check("node-a", B, Some(&policy), &[])),
            Reason::TpmNotAllowed
        );
        assert_eq!(check("node-c", B, Some(&policy), &[]), Ok(false));
        let strict = format!("firstUse: false\n{policy}");
        assert_eq!(
            reason(check("node-c", B, Some(&strict), &[])),
            Reason::TpmNotAllowed
        );
        for bad in [
            "allow: {node-a: [zz]}",
            "firstUse: maybe",
            "other: 1",
            "allow: [x]",
        ] {
            assert_eq!(
                reason(check("node-a", A, Some(bad), &[])),
                Reason::TpmNotAllowed,
                "{bad}"
            );
        }
    }
}
