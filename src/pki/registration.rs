//! A node's registration: the AK the approver trusts for a node, as an operator stored it (what
//! `hwkey attest enroll` printed) or as `hwkey attest register` wrote it after credential
//! activation.
//!
//! Every reader (the approver, `attest verify`, `attest challenge`, `attest register`) reads it
//! with this one parser, as YAML into typed fields: a field given twice, an unknown field or an
//! `akName` that is not the name of `akPublic` is refused, and the AK's name is always derived
//! from `akPublic`, never taken from text. (A line-based reader once took an `akName:` line hidden
//! inside a block scalar.)
//!
//! A trust source holds one entry per node. A malformed entry is skipped and reported, never
//! fatal for the others: one typo must not lock every node out at the next restart.

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::PkiError;
use crate::key::attestation::name_of;

/// Why an entry is not a usable registration.
#[derive(Debug, Clone, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what is wrong"
)]
pub enum RegistrationError {
    #[error("'{given}' is not a node name (lowercase letters, digits, '-' and '.', as Kubernetes names nodes)")]
    NodeName { given: String },
    #[error("it is not what `hwkey attest enroll` prints: {0}")]
    NotAnEnrollment(#[source] Arc<serde_yaml_ng::Error>),
    #[error("cannot write the registration: {0}")]
    Encode(#[source] Arc<serde_yaml_ng::Error>),
    #[error("akPublic is not base64: {0}")]
    AkPublicEncoding(#[source] base64::DecodeError),
    #[error("akPublic: {0}")]
    AkPublic(#[source] Arc<crate::key::KeyError>),
    #[error("akName {given} is not the name of akPublic ({derived})")]
    NameMismatch { given: String, derived: String },
    #[error("it registers node '{registered}', but it is stored as '{entry}'")]
    NodeMismatch { registered: String, entry: String },
    #[error(
        "'{given}' is not an EK hash (64 hex digits: SHA-256 of the EK's SubjectPublicKeyInfo)"
    )]
    EkSha256 { given: String },
    #[error("no entry is a usable registration: {reasons}")]
    NothingUsable { reasons: String },
    #[error("it is not a PIV registration (piv: with serials, and optionally pinPolicy, touchPolicy, minFirmware): {0}")]
    NotPiv(#[source] Arc<serde_yaml_ng::Error>),
    #[error("its piv entry lists no serial: list the YubiKeys' serial numbers (hwkey attest piv-verify prints them)")]
    NoSerial,
    #[error("its minFirmware: {0}")]
    Firmware(#[source] super::piv_policy::BadFirmware),
    #[error("addresses: '{given}' is neither an IP address nor a host name (a node's serving certificate may name only what is listed)")]
    Address { given: String },
}

/// A registered node: its name (the entry's name) and its AK's TPM name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredAk {
    /// The node the AK belongs to.
    pub node: String,
    /// The AK's TPM name (nameAlg || digest of `akPublic`).
    pub ak_name: Vec<u8>,
    /// SHA-256 of the TPM's EK public key (SubjectPublicKeyInfo DER), hex, lowercase: written
    /// when the approver bound the node to a TPM by its EK certificate (`ekSha256`). A node
    /// registered without it is bound to its AK only.
    pub ek_sha256: Option<String>,
    /// The node's names and addresses for its serving certificate (`addresses`), when the
    /// registration lists them: they then decide instead of the Node's status.
    pub addresses: Option<Vec<String>>,
}

/// A person's registered PIV devices (a people trust entry that starts with `piv:`), and what
/// an attestation from them must show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredPiv {
    /// The person (the entry's name).
    pub user: String,
    /// The devices' serial numbers.
    pub serials: Vec<u64>,
    /// The weakest PIN policy accepted, if one is required.
    pub pin_policy: Option<super::piv_policy::PinPolicy>,
    /// The weakest touch policy accepted, if one is required.
    pub touch_policy: Option<super::piv_policy::TouchPolicy>,
    /// The oldest firmware accepted, if one is required.
    pub min_firmware: Option<super::piv_policy::Firmware>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PivEntry {
    piv: PivFields,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PivFields {
    serials: Vec<u64>,
    #[serde(default)]
    pin_policy: Option<super::piv_policy::PinPolicy>,
    #[serde(default)]
    touch_policy: Option<super::piv_policy::TouchPolicy>,
    #[serde(default)]
    min_firmware: Option<String>,
}

/// Whether an entry's text is a PIV registration: its first line that is not blank or a
/// comment starts with `piv:`.
pub fn is_piv_entry(text: &str) -> bool {
    text.lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.starts_with("piv:"))
}

/// Reads a person's PIV registration: `text` stored as entry `user`.
pub fn parse_piv(user: &str, text: &str) -> Result<RegisteredPiv, RegistrationError> {
    check_node_name(user)?;
    let entry: PivEntry =
        serde_yaml_ng::from_str(text).map_err(|e| RegistrationError::NotPiv(Arc::new(e)))?;
    let fields = entry.piv;
    if fields.serials.is_empty() {
        return Err(RegistrationError::NoSerial);
    }
    let min_firmware = fields
        .min_firmware
        .map(|f| f.parse().map_err(RegistrationError::Firmware))
        .transpose()?;
    Ok(RegisteredPiv {
        user: user.to_string(),
        serials: fields.serials,
        pin_policy: fields.pin_policy,
        touch_policy: fields.touch_policy,
        min_firmware,
    })
}

/// The fields of an enrollment or registration (camelCase YAML keys).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnrollmentFile {
    /// The node this registration is for (written by `attest register`; must equal the entry's
    /// name when present).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Where the AK is kept in the node's TPM (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ak_handle: Option<serde_yaml_ng::Value>,
    /// The AK's TPM name, hex: must be the name of `akPublic` when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ak_name: Option<String>,
    /// The AK's `TPMT_PUBLIC`, base64: what the AK's name is derived from.
    pub ak_public: String,
    /// The AK's public key, PEM (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ak_public_key_pem: Option<String>,
    /// The EK's `TPMT_PUBLIC`, base64 (what credential activation encrypts to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_public: Option<String>,
    /// The EK's public key, PEM (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_public_key_pem: Option<String>,
    /// The EK certificate, PEM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_certificate_pem: Option<String>,
    /// The intermediates of the EK certificate's chain the TPM stored in NV, PEM (the node's
    /// word: used only to build a path to a CA the verifier trusts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_intermediates_pem: Option<String>,
    /// SHA-256 of the EK's SubjectPublicKeyInfo, hex (written by the approver when a TPM
    /// joined by its EK certificate: the binding of the node name to that TPM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_sha256: Option<String>,
    /// How the node was registered (written by `attest register`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registered_by: Option<String>,
    /// The node's host names and IP addresses its serving certificate may name (an operator's
    /// word, instead of the Node's self-reported status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<String>>,
}

impl EnrollmentFile {
    /// Parses an enrollment or registration (YAML).
    pub fn parse(text: &str) -> Result<EnrollmentFile, RegistrationError> {
        serde_yaml_ng::from_str(text).map_err(|e| RegistrationError::NotAnEnrollment(Arc::new(e)))
    }

    /// The AK's `TPMT_PUBLIC`.
    pub fn ak_public(&self) -> Result<Vec<u8>, RegistrationError> {
        base64::engine::general_purpose::STANDARD
            .decode(self.ak_public.trim())
            .map_err(RegistrationError::AkPublicEncoding)
    }

    /// The AK's TPM name, derived from `akPublic`; an `akName` field must agree with it.
    pub fn ak_name(&self) -> Result<Vec<u8>, RegistrationError> {
        let derived = derive_name(&self.ak_public()?)?;
        if let Some(given) = &self.ak_name {
            if !given.trim().eq_ignore_ascii_case(&hex::encode(&derived)) {
                return Err(RegistrationError::NameMismatch {
                    given: given.trim().to_string(),
                    derived: hex::encode(&derived),
                });
            }
        }
        Ok(derived)
    }

    /// The canonical registration `hwkey attest register` writes for `node`: only the fields it
    /// verified (the AK's public area and name), how, and the node's name.
    pub fn canonical(
        node: &str,
        ak_public: &[u8],
        registered_by: &str,
    ) -> Result<String, RegistrationError> {
        EnrollmentFile::canonical_bound(node, ak_public, None, registered_by)
    }

    /// As [`EnrollmentFile::canonical`], binding the node to the TPM whose EK public key has
    /// SHA-256 `ek_sha256` (what the approver writes when a TPM joins by its EK certificate).
    pub fn canonical_bound(
        node: &str,
        ak_public: &[u8],
        ek_sha256: Option<&str>,
        registered_by: &str,
    ) -> Result<String, RegistrationError> {
        let name = derive_name(ak_public)?;
        let fields = EnrollmentFile {
            node: Some(node.to_string()),
            ak_name: Some(hex::encode(&name)),
            ak_public: base64::engine::general_purpose::STANDARD.encode(ak_public),
            ek_sha256: ek_sha256.map(str::to_string),
            registered_by: Some(registered_by.to_string()),
            ..EnrollmentFile::default()
        };
        let yaml = serde_yaml_ng::to_string(&fields)
            .map_err(|e| RegistrationError::Encode(Arc::new(e)))?;
        Ok(format!(
            "# hwkey attest register: the approver trusts this AK for node {node}\n{yaml}"
        ))
    }
}

/// The TPM name of an AK's public area.
fn derive_name(ak_public: &[u8]) -> Result<Vec<u8>, RegistrationError> {
    name_of(ak_public).map_err(|e| RegistrationError::AkPublic(Arc::new(e)))
}

/// Whether `name` can be a node's entry (a file name in a trust directory, a ConfigMap key).
pub fn check_node_name(name: &str) -> Result<(), RegistrationError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(RegistrationError::NodeName {
            given: name.escape_debug().to_string(),
        })
    }
}

/// An EK hash as written: 64 hex digits, taken lowercase.
pub fn check_ek_sha256(given: &str) -> Result<String, RegistrationError> {
    let h = given.trim().to_ascii_lowercase();
    if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(h)
    } else {
        Err(RegistrationError::EkSha256 {
            given: given.escape_debug().to_string(),
        })
    }
}

/// Reads one entry: `text` registered for node `entry`.
pub fn parse_registration(entry: &str, text: &str) -> Result<RegisteredAk, RegistrationError> {
    check_node_name(entry)?;
    let fields = EnrollmentFile::parse(text)?;
    if let Some(node) = &fields.node {
        if node != entry {
            return Err(RegistrationError::NodeMismatch {
                registered: node.escape_debug().to_string(),
                entry: entry.to_string(),
            });
        }
    }
    let ek_sha256 = match &fields.ek_sha256 {
        Some(h) => Some(check_ek_sha256(h)?),
        None => None,
    };
    if let Some(list) = &fields.addresses {
        for given in list {
            if given.parse::<std::net::IpAddr>().is_err()
                && super::san::normalize_host(given).is_none()
            {
                return Err(RegistrationError::Address {
                    given: given.escape_debug().to_string(),
                });
            }
        }
    }
    Ok(RegisteredAk {
        node: entry.to_string(),
        ak_name: fields.ak_name()?,
        ek_sha256,
        addresses: fields.addresses.clone(),
    })
}

/// An entry that was skipped, and why.
#[derive(Debug, Clone)]
pub struct InvalidEntry {
    /// The entry's name (file or ConfigMap key).
    pub entry: String,
    /// What is wrong with it.
    pub problem: EntryProblem,
}

/// Why an entry of a trust source was skipped.
#[derive(Debug, Clone, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum EntryProblem {
    #[error("{0}")]
    Registration(#[from] RegistrationError),
    #[error("{0}")]
    Unreadable(#[source] Arc<std::io::Error>),
}

/// The entry of a people trust source that holds its allow list (`hwkey approver
/// --people-trust`). No node or user entry can have this name: entry names start with a
/// lowercase letter or digit.
pub const ALLOW_ENTRY: &str = "_allow";

/// The entry of a node trust source that holds TPM manufacturers' CA certificates (PEM), beside
/// the approver's `--ek-ca` files: EK certificates that chain to one may join by themselves.
pub const EK_CA_ENTRY: &str = "_ek-ca.pem";

/// The entry that holds the manufacturers' CRLs (PEM), beside `--ek-crl`.
pub const EK_CRL_ENTRY: &str = "_ek-crl.pem";

/// The entry that holds the binding policy of TPMs to node names (`firstUse`, `allow`).
pub const EK_BINDING_ENTRY: &str = "_ek-binding";

/// What a trust source held: the usable registrations and the skipped entries.
#[derive(Debug, Clone, Default)]
pub struct TrustRead {
    /// The registrations that parsed.
    pub nodes: Vec<RegisteredAk>,
    /// The PIV registrations that parsed (people's entries starting with `piv:`).
    pub piv: Vec<RegisteredPiv>,
    /// The entries that did not.
    pub invalid: Vec<InvalidEntry>,
    /// The text of the [`ALLOW_ENTRY`] entry, when there is one (read by the people policy;
    /// a node trust ignores it).
    pub allow: Option<String>,
    /// The EK entries ([`EK_CA_ENTRY`], [`EK_CRL_ENTRY`], [`EK_BINDING_ENTRY`]), as text.
    pub ek: EkEntries,
}

/// What a node trust source holds for TPMs that join by their EK certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EkEntries {
    /// Manufacturers' CA certificates (PEM).
    pub ca: Option<String>,
    /// Manufacturers' CRLs (PEM).
    pub crl: Option<String>,
    /// The binding policy (YAML).
    pub binding: Option<String>,
}

impl TrustRead {
    /// Parses `(entry, text)` pairs, keeping the good ones and reporting the bad.
    pub fn from_entries<'a>(entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> TrustRead {
        let mut read = TrustRead::default();
        for (entry, text) in entries {
            let special = match entry {
                ALLOW_ENTRY => &mut read.allow,
                EK_CA_ENTRY => &mut read.ek.ca,
                EK_CRL_ENTRY => &mut read.ek.crl,
                EK_BINDING_ENTRY => &mut read.ek.binding,
                _ => {
                    read.add_entry(entry, text);
                    continue;
                }
            };
            *special = Some(text.to_string());
        }
        read
    }

    /// One node's or person's entry: parsed, or reported.
    fn add_entry(&mut self, entry: &str, text: &str) {
        let parsed = if is_piv_entry(text) {
            parse_piv(entry, text).map(|p| self.piv.push(p))
        } else {
            parse_registration(entry, text).map(|ak| self.nodes.push(ak))
        };
        if let Err(e) = parsed {
            self.invalid.push(InvalidEntry {
                entry: entry.to_string(),
                problem: e.into(),
            });
        }
    }

    /// Fails when entries exist and none of them is usable (a source that is wholly wrong, not
    /// one typo); an empty source is usable (no node registered yet).
    pub fn usable(self) -> Result<TrustRead, RegistrationError> {
        if self.nodes.is_empty() && self.piv.is_empty() && !self.invalid.is_empty() {
            let reasons: Vec<String> = self
                .invalid
                .iter()
                .map(|i| format!("{}: {}", i.entry, i.problem))
                .collect();
            return Err(RegistrationError::NothingUsable {
                reasons: reasons.join("; "),
            });
        }
        Ok(self)
    }

    /// AKs registered under more than one node: (AK name hex, the nodes). Each pair is still
    /// admitted for its own node only, but one TPM is not two nodes: an operator should look.
    pub fn duplicate_aks(&self) -> Vec<(String, Vec<String>)> {
        let mut by_ak: std::collections::BTreeMap<&[u8], Vec<String>> = Default::default();
        for n in &self.nodes {
            by_ak.entry(&n.ak_name).or_default().push(n.node.clone());
        }
        by_ak
            .into_iter()
            .filter(|(_, nodes)| nodes.len() > 1)
            .map(|(ak, nodes)| (hex::encode(ak), nodes))
            .collect()
    }
}

/// Reads a `--trust` directory: one file per node, named after it. Hidden entries are skipped,
/// so a directory a Kubernetes ConfigMap is mounted on (its `..data` links) reads as the
/// ConfigMap's entries. An unreadable directory is an error; an unreadable or malformed file is
/// a skipped entry.
pub fn read_trust_dir(dir: &Path) -> Result<TrustRead, PkiError> {
    let bad = |source| PkiError::BadTrust {
        path: dir.to_path_buf(),
        source,
    };
    let mut texts = Vec::new();
    let mut unreadable = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let path = entry.path();
        let Some(node) = path
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
        else {
            continue;
        };
        if node.starts_with('.') || !path.is_file() {
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(text) => texts.push((node, text)),
            Err(e) => unreadable.push(InvalidEntry {
                entry: node,
                problem: EntryProblem::Unreadable(Arc::new(e)),
            }),
        }
    }
    let mut read = TrustRead::from_entries(texts.iter().map(|(n, t)| (n.as_str(), t.as_str())));
    read.invalid.extend(unreadable);
    Ok(read)
}

/// Every node registered in `dir` whose AK has `ak_name`: `attest register` refuses an AK that
/// is already registered under another name.
pub fn nodes_with_ak(dir: &Path, ak_name: &[u8]) -> Result<Vec<String>, PkiError> {
    Ok(read_trust_dir(dir)?
        .nodes
        .into_iter()
        .filter(|n| n.ak_name == ak_name)
        .map(|n| n.node)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TPMT_PUBLIC-shaped blob: type ECC, nameAlg SHA-256, then anything.
    const AK_PUBLIC: &[u8] = &[0x00, 0x23, 0x00, 0x0b, 1, 2, 3, 4];

    fn enrollment() -> String {
        let b64 = base64::engine::general_purpose::STANDARD.encode(AK_PUBLIC);
        let name = hex::encode(name_of(AK_PUBLIC).expect("name"));
        format!("# hwkey attest enroll\nakHandle: 0x81010002\nakName: {name}\nakPublic: {b64}\n")
    }

    #[test]
    fn the_name_is_derived_from_the_public_area() {
        let ak = parse_registration("node-a", &enrollment()).expect("parses");
        assert_eq!(ak.ak_name, name_of(AK_PUBLIC).expect("name"));
        let without_name: String = enrollment()
            .lines()
            .filter(|l| !l.starts_with("akName"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(parse_registration("node-a", &without_name).ok(), Some(ak));
    }

    #[test]
    fn hidden_duplicated_or_contradicting_names_are_refused() {
        let fake = "000b".to_string() + &"ab".repeat(32);
        let duplicated = format!("{}akName: {fake}\n", enrollment());
        let e = parse_registration("node-a", &duplicated)
            .expect_err("duplicate")
            .to_string();
        assert!(e.contains("duplicate"), "{e}");
        let contradicting =
            enrollment().replace(&hex::encode(name_of(AK_PUBLIC).expect("name")), &fake);
        let e = parse_registration("node-a", &contradicting)
            .expect_err("contradicts")
            .to_string();
        assert!(e.contains("is not the name of akPublic"), "{e}");
        // A fake name inside a block scalar is text, not a field: the real name counts.
        let hidden = format!("{}akPublicKeyPem: |\n  akName: {fake}\n", enrollment());
        assert_eq!(
            parse_registration("node-a", &hidden)
                .ok()
                .map(|a| a.ak_name),
            Some(name_of(AK_PUBLIC).expect("name"))
        );
        let unknown = format!("{}akNameOverride: {fake}\n", enrollment());
        assert!(parse_registration("node-a", &unknown).is_err());
        let only_name = format!("akName: {fake}\n");
        assert!(parse_registration("node-a", &only_name).is_err());
    }

    #[test]
    fn the_canonical_form_binds_the_node() {
        let text = EnrollmentFile::canonical("node-d", AK_PUBLIC, "EK certificate").expect("yaml");
        assert!(parse_registration("node-d", &text).is_ok());
        let e = parse_registration("node-d2", &text)
            .expect_err("another node")
            .to_string();
        assert!(e.contains("registers node 'node-d'"), "{e}");
    }

    #[test]
    fn a_bad_entry_is_skipped_unless_nothing_is_usable() {
        let good = enrollment();
        let read = TrustRead::from_entries([("node-a", good.as_str()), ("node-b", "akName: zz")]);
        assert_eq!(read.nodes.len(), 1);
        assert_eq!(read.invalid[0].entry, "node-b");
        assert!(read.usable().is_ok());
        let read = TrustRead::from_entries([("node-b", "akName: zz")]);
        assert!(read.usable().is_err());
        assert!(TrustRead::default().usable().is_ok());
        let read = TrustRead::from_entries([("Node_A", good.as_str())]);
        assert!(read.invalid[0]
            .problem
            .to_string()
            .contains("not a node name"));
    }

    #[test]
    fn an_ak_under_two_nodes_is_reported() {
        let good = enrollment();
        let read = TrustRead::from_entries([("node-a", good.as_str()), ("node-b", good.as_str())]);
        assert_eq!(
            read.duplicate_aks(),
            vec![(
                hex::encode(name_of(AK_PUBLIC).expect("name")),
                vec!["node-a".to_string(), "node-b".to_string()]
            )]
        );
    }

    /// A person's YubiKeys: read only as the one documented shape, each field once, and kept
    /// apart from AK registrations.
    #[test]
    fn a_piv_entry_is_read_strictly_and_kept_apart_from_aks() {
        use super::super::piv_policy::{Firmware, PinPolicy, TouchPolicy};
        let text = "# alice's YubiKeys\npiv:\n  serials: [15732500, 7]\n  pinPolicy: once\n  touchPolicy: cached\n  minFirmware: 5.4.0\n";
        assert!(is_piv_entry(text));
        assert_eq!(
            parse_piv("alice", text).expect("parses"),
            RegisteredPiv {
                user: "alice".into(),
                serials: vec![15_732_500, 7],
                pin_policy: Some(PinPolicy::Once),
                touch_policy: Some(TouchPolicy::Cached),
                min_firmware: Some(Firmware(5, 4, 0)),
            }
        );
        for (bad, why) in [
            ("piv:\n  serials: []\n", "no serial"),
            ("piv:\n  serial: [1]\n", "unknown field"),
            (
                "piv:\n  serials: [1]\n  touchPolicy: sometimes\n",
                "unknown policy",
            ),
            (
                "piv:\n  serials: [1]\n  minFirmware: 5.4\n",
                "short firmware",
            ),
            ("piv:\n  serials: [-1]\n", "negative serial"),
            ("piv:\n  serials: [1]\n  serials: [2]\n", "a field twice"),
            (
                "piv:\n  serials: [1]\nakName: 00\n",
                "a second document's field",
            ),
        ] {
            assert!(parse_piv("alice", bad).is_err(), "{why}: {bad}");
        }
        assert!(parse_piv("Alice", text).is_err(), "not an entry name");
        let read = TrustRead::from_entries([
            ("alice", text),
            ("node-a", enrollment().as_str()),
            ("bob", "piv:\n  serials: []\n"),
        ]);
        assert_eq!(read.piv.len(), 1);
        assert_eq!(read.nodes.len(), 1);
        assert_eq!(read.nodes[0].node, "node-a");
        assert_eq!(read.invalid.len(), 1);
        assert_eq!(read.invalid[0].entry, "bob");
        // An AK enrollment is never taken for a PIV entry, nor the other way round.
        assert!(!is_piv_entry(&enrollment()));
        assert!(parse_registration("alice", text).is_err());
    }

    /// A node's `addresses:` are host names or IP addresses, nothing else; they are kept.
    #[test]
    fn registered_addresses_are_host_names_or_ips() {
        let with = |list: &str| format!("{}addresses: {list}\n", enrollment());
        let ok = parse_registration(
            "node-a",
            &with("[node-a.example, 10.0.0.1, \"2001:db8::1\"]"),
        )
        .expect("addresses");
        assert_eq!(ok.addresses.map(|a| a.len()), Some(3));
        for bad in ["[\"*.example\"]", "[\"\"]", "[\"a b\"]", "[\"10.0.0.1/8\"]"] {
            let e = parse_registration("node-a", &with(bad)).expect_err(bad);
            assert!(
                e.to_string()
                    .contains("neither an IP address nor a host name"),
                "{e}"
            );
        }
    }
}
