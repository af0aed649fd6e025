//! Which TPM may be which node, for TPMs that join by their EK certificate: the policy in the
//! trust source's `_ek-binding` entry, and the bindings recorded in its node entries
//! (`ekSha256`).
//!
//! - `firstUse` (the default): the first TPM to prove itself for a node name holds that name.
//!   A second TPM for the name is denied (`NodeBoundToAnotherTPM`), and so is one TPM asking
//!   for a second name (`TPMBoundToAnotherNode`). The same TPM re-joins (a reinstalled node).
//! - `allow`: EK public key hashes per node name (a vendor's shipping manifest). A name listed
//!   there admits only its TPMs, and a TPM listed there takes only its names; with
//!   `firstUse: false`, a name not listed admits none.
//! - `deny`: EK hashes refused under any name (a removed node's TPM).
//! - A name whose entry is malformed is held (by whoever it was): fix or remove the entry.
//!
//! A node registered by an operator without an EK (`hwkey attest enroll`) is bound to its AK:
//! no TPM joins under its name until the operator removes the entry.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::reason::{Reason, Violation};
use crate::pki::registration::{check_ek_sha256, RegisteredAk, EK_BINDING_ENTRY};

/// The `_ek-binding` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingPolicy {
    /// Whether a name not on the allow list goes to the first TPM that proves itself for it.
    pub first_use: bool,
    /// EK SubjectPublicKeyInfo SHA-256 hashes (lowercase hex) allowed per node name.
    pub allow: BTreeMap<String, Vec<String>>,
    /// EK hashes refused under any name (a removed node's TPM that must not join again).
    pub deny: Vec<String>,
}

/// An `_ek-binding` entry that cannot be read: no TPM joins until it is fixed.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum BindingError {
    #[error("the {EK_BINDING_ENTRY} entry is not `firstUse: BOOL`, `allow: {{NODE: [EK SHA-256, ...]}}` and `deny: [EK SHA-256, ...]`: {0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("the {EK_BINDING_ENTRY} entry's list for {node}: {source}")]
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
            deny: Vec::new(),
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
    #[serde(default)]
    deny: Vec<String>,
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
        let deny = file
            .deny
            .iter()
            .map(|h| check_ek_sha256(h))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| BindingError::Hash {
                node: "deny".into(),
                source,
            })?;
        Ok(BindingPolicy {
            first_use: file.first_use,
            allow,
            deny,
        })
    }
}

/// What the trust holds that a binding decision reads: the registrations that parse, and the
/// names of the entries that do not (each still holds its name: a malformed entry is not a
/// free name).
#[derive(Debug, Clone, Copy)]
pub struct Held<'a> {
    /// The usable registrations.
    pub nodes: &'a [RegisteredAk],
    /// The names of the entries that were skipped as malformed.
    pub invalid: &'a [String],
}

fn deny(reason: Reason, message: String) -> Violation {
    Violation { reason, message }
}

/// Whether the TPM whose EK hashes to `ek_sha256` may be node `node`, given the policy text
/// (`_ek-binding`) and what the trust holds. Ok(true): it holds the name already (a re-join);
/// Ok(false): it takes a free name.
pub fn check_binding(
    node: &str,
    ek_sha256: &str,
    policy: Option<&str>,
    held: Held<'_>,
) -> Result<bool, Violation> {
    let policy =
        BindingPolicy::parse(policy).map_err(|e| deny(Reason::TpmNotAllowed, e.to_string()))?;
    check_policy(node, ek_sha256, &policy)?;
    let elsewhere: Vec<&str> = held
        .nodes
        .iter()
        .filter(|n| n.node != node && n.ek_sha256.as_deref() == Some(ek_sha256))
        .map(|n| n.node.as_str())
        .collect();
    if !elsewhere.is_empty() {
        return Err(deny(
            Reason::TpmBoundToAnotherNode,
            format!(
                "the TPM with EK {ek_sha256} holds node name {} already: one EK is one node (to rename the node, remove that entry from the trust first)",
                elsewhere.join(", ")
            ),
        ));
    }
    if held.invalid.iter().any(|n| n == node) {
        return Err(deny(
            Reason::NodeBoundToAnotherTpm,
            format!("the trust's entry for node '{node}' is malformed (see the approver's log or the ConfigMap's Events), so nobody can tell which TPM holds the name: fix or remove the entry"),
        ));
    }
    match held.nodes.iter().find(|n| n.node == node) {
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

/// The policy's own word: the deny list, the allow list (for the name, and for the TPM: an EK
/// listed under some names takes only those), and `firstUse`.
fn check_policy(node: &str, ek_sha256: &str, policy: &BindingPolicy) -> Result<(), Violation> {
    if policy.deny.iter().any(|h| h == ek_sha256) {
        return Err(deny(
            Reason::TpmNotAllowed,
            format!("the TPM with EK {ek_sha256} is on the deny list ({EK_BINDING_ENTRY})"),
        ));
    }
    let listed: Vec<&str> = policy
        .allow
        .iter()
        .filter(|(_, hashes)| hashes.iter().any(|h| h == ek_sha256))
        .map(|(name, _)| name.as_str())
        .collect();
    if !listed.is_empty() && !listed.contains(&node) {
        return Err(deny(
            Reason::TpmNotAllowed,
            format!("the TPM with EK {ek_sha256} is on the allow list ({EK_BINDING_ENTRY}) for {} only, not for '{node}'", listed.join(", ")),
        ));
    }
    match policy.allow.get(node) {
        Some(allowed) if !allowed.iter().any(|h| h == ek_sha256) => Err(deny(
            Reason::TpmNotAllowed,
            format!("the TPM with EK {ek_sha256} is not on the allow list of node '{node}' ({EK_BINDING_ENTRY})"),
        )),
        None if !policy.first_use => Err(deny(
            Reason::TpmNotAllowed,
            format!("node '{node}' is not on the allow list ({EK_BINDING_ENTRY}) and firstUse is off"),
        )),
        _ => Ok(()),
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
            addresses: None,
        }
    }

    fn reason(r: Result<bool, Violation>) -> Reason {
        r.expect_err("denied").reason
    }

    fn held(nodes: &[RegisteredAk]) -> Held<'_> {
        Held {
            nodes,
            invalid: &[],
        }
    }

    #[test]
    fn first_use_holds_a_name_for_its_tpm_and_a_tpm_to_its_name() {
        let nodes = [entry("node-a", Some(A)), entry("node-op", None)];
        assert_eq!(check_binding("node-b", B, None, held(&nodes)), Ok(false));
        assert_eq!(check_binding("node-a", A, None, held(&nodes)), Ok(true));
        assert_eq!(
            reason(check_binding("node-a", B, None, held(&nodes))),
            Reason::NodeBoundToAnotherTpm
        );
        assert_eq!(
            reason(check_binding("node-b", A, None, held(&nodes))),
            Reason::TpmBoundToAnotherNode
        );
        let by_operator = check_binding("node-op", B, None, held(&nodes)).expect_err("denied");
        assert_eq!(by_operator.reason, Reason::NodeBoundToAnotherTpm);
        assert!(by_operator.message.contains("operator"), "{by_operator}");
        // A malformed entry still holds its name.
        let invalid = ["node-bad".to_string()];
        let with_bad = Held {
            nodes: &nodes,
            invalid: &invalid,
        };
        assert_eq!(
            reason(check_binding("node-bad", B, None, with_bad)),
            Reason::NodeBoundToAnotherTpm
        );
    }

    #[test]
    fn a_denied_tpm_takes_no_name_and_an_allowed_one_only_its_own() {
        let policy = format!("deny: [\"{B}\"]\nallow:\n  node-a: [\"{A}\"]\n");
        assert_eq!(
            reason(check_binding("node-c", B, Some(&policy), held(&[]))),
            Reason::TpmNotAllowed
        );
        assert_eq!(
            reason(check_binding("node-c", A, Some(&policy), held(&[]))),
            Reason::TpmNotAllowed
        );
        assert_eq!(
            check_binding("node-a", A, Some(&policy), held(&[])),
            Ok(false)
        );
    }

    #[test]
    fn an_allow_list_admits_only_its_tpms_and_first_use_can_be_off() {
        let upper = A.to_ascii_uppercase();
        let policy = format!("allow:\n  node-a: [\"{upper}\"]\n");
        assert_eq!(
            check_binding("node-a", A, Some(&policy), held(&[])),
            Ok(false)
        );
        assert_eq!(
            reason(check_binding("node-a", B, Some(&policy), held(&[]))),
            Reason::TpmNotAllowed
        );
        assert_eq!(
            check_binding("node-c", B, Some(&policy), held(&[])),
            Ok(false)
        );
        let strict = format!("firstUse: false\n{policy}");
        assert_eq!(
            reason(check_binding("node-c", B, Some(&strict), held(&[]))),
            Reason::TpmNotAllowed
        );
        for bad in [
            "allow: {node-a: [zz]}",
            "firstUse: maybe",
            "other: 1",
            "allow: [x]",
        ] {
            assert_eq!(
                reason(check_binding("node-a", A, Some(bad), held(&[]))),
                Reason::TpmNotAllowed,
                "{bad}"
            );
        }
    }
}
