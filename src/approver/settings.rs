//! The approver's settings as given (`hwkey approver`'s flags, [`Flags`]) and their check: each
//! policy's settings are complete and consistent before anything is read from the cluster, or
//! the approver does not start and says which flag to change ([`SettingsError`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::ek_join::{JoinSettings, CREDENTIAL_SIGNER};
use super::rules::{OnMissingEvidence, Rules};
use super::rules::{PeopleRules, ServingRules};
use super::trust::{NotNamespaceName, TrustSource};
use super::{check_signers, ApproverError, ApproverOptions, Settings};
use crate::pki::csr::{CLIENT_SIGNER, KUBELET_SIGNER, SERVING_SIGNER};

/// The approver's flags, unchecked.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--signer-name` (repeatable).
    pub signer_names: Vec<String>,
    /// `--bootstrap-group` (repeatable).
    pub bootstrap_groups: Vec<String>,
    /// `--evidence-max-age`.
    pub evidence_max_age: Duration,
    /// `--trust DIR`.
    pub trust: Option<PathBuf>,
    /// `--trust-configmap NAMESPACE/NAME`.
    pub trust_configmap: Option<String>,
    /// `--people-trust DIR`.
    pub people_trust: Option<PathBuf>,
    /// `--people-trust-configmap NAMESPACE/NAME`.
    pub people_trust_configmap: Option<String>,
    /// `--people-client-ca FILE`.
    pub people_client_ca: Option<PathBuf>,
    /// `--people-max-lifetime`.
    pub people_max_lifetime: Duration,
    /// `--people-on-missing-proof`.
    pub people_on_missing_proof: OnMissingEvidence,
    /// `--piv-roots FILE` (repeatable).
    pub piv_roots: Vec<PathBuf>,
    /// `--no-yubico-piv-roots`.
    pub no_yubico_piv_roots: bool,
    /// `--ek-ca FILE` (repeatable).
    pub ek_ca: Vec<PathBuf>,
    /// `--ek-crl FILE` (repeatable).
    pub ek_crl: Vec<PathBuf>,
    /// `--credential-key FILE`.
    pub credential_key: Option<PathBuf>,
    /// `--credential-ttl`.
    pub credential_ttl: Duration,
    /// `--on-missing-evidence`.
    pub on_missing_evidence: OnMissingEvidence,
    /// `--serving-require-attested-node`.
    pub serving_require_attested_node: bool,
    /// `--serving-max-lifetime`.
    pub serving_max_lifetime: Option<Duration>,
}

/// Why the approver's settings are refused, and which flag to change.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum SettingsError {
    #[error("{0}")]
    Policy(#[from] ApproverError),
    #[error("--{flag}-configmap: {source}")]
    ConfigMapName {
        flag: &'static str,
        #[source]
        source: NotNamespaceName,
    },
    #[error("--signer-name {KUBELET_SIGNER} needs the registered nodes: pass --trust DIR or --trust-configmap NAMESPACE/NAME")]
    NodesTrustMissing,
    #[error("a people trust is given but --signer-name {CLIENT_SIGNER} is not: add it, or drop the people trust")]
    PeopleSignerMissing,
    #[error("a people trust needs --people-client-ca FILE: the CA of the cluster's client certificates, which a same-key renewal's certificate must chain to")]
    PeopleClientCaMissing,
    #[error("--people-client-ca: {0}")]
    PeopleClientCa(#[source] crate::pki::error::PkiError),
    #[error("the people trust and the nodes' trust are one source: a user's AK entry would also register a node of that name; give the people their own directory or ConfigMap")]
    SameSource,
    #[error("--people-max-lifetime {0:?} is below the 10 minutes Kubernetes accepts for spec.expirationSeconds")]
    PeopleMaxLifetime(Duration),
    #[error("--evidence-max-age {0:?} is out of range: use 1s to 50m (decided requests are kept an hour, and a reused copy must still find its original)")]
    EvidenceMaxAge(Duration),
    #[error("--piv-roots {path}: {source}")]
    PivRootsRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--piv-roots {path}: give a PEM bundle of PIV attestation roots and intermediates: {source}")]
    PivRoots {
        path: PathBuf,
        #[source]
        source: crate::pki::piv::PivRootsError,
    },
    #[error("--no-yubico-piv-roots needs --piv-roots FILE: with no root, no PIV attestation could ever hold")]
    NoPivRoots,
    #[error("--ek-ca, --ek-crl and --credential-key are for TPMs that join by their EK certificate: add --signer-name {CREDENTIAL_SIGNER}, or drop them")]
    EkFlagsWithoutSigner,
    #[error("--signer-name {CREDENTIAL_SIGNER} needs --signer-name {KUBELET_SIGNER}: a joining node answers its credential in its kubelet client request")]
    EkJoinNeedsKubelet,
    #[error("--signer-name {CREDENTIAL_SIGNER} needs --trust-configmap: the approver records each TPM's binding to its node name there")]
    EkJoinNeedsConfigMap,
    #[error("--signer-name {CREDENTIAL_SIGNER} needs --credential-key FILE: 32 random bytes or more, the same for every replica (e.g. a Secret made with `head -c 32 /dev/urandom`)")]
    CredentialKeyMissing,
    #[error("--{flag} {}: cannot read it: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--credential-key {} holds {len} bytes: make it 32 random bytes or more (`head -c 32 /dev/urandom > FILE`)", path.display())]
    CredentialKeyShort { path: PathBuf, len: usize },
    #[error("--credential-ttl {0:?} is out of range: use 5s to 24h")]
    CredentialTtl(Duration),
    #[error("--ek-ca {}: not a PEM bundle holding a CERTIFICATE", path.display())]
    EkCa { path: PathBuf },
    #[error("--ek-crl {}: {source}", path.display())]
    EkCrl {
        path: PathBuf,
        #[source]
        source: Box<crate::pki::ek_crl::CrlError>,
    },
    #[error("--serving-require-attested-node and --serving-max-lifetime are for kubelet serving certificates: add --signer-name {SERVING_SIGNER}, or drop them")]
    ServingFlagsWithoutSigner,
    #[error("--serving-require-attested-node needs the registered nodes: pass --trust DIR or --trust-configmap NAMESPACE/NAME")]
    ServingNeedsTrust,
    #[error("--serving-max-lifetime {0:?} is below the 10 minutes Kubernetes accepts for spec.expirationSeconds")]
    ServingMaxLifetime(Duration),
}

/// The shortest lifetime Kubernetes accepts for `spec.expirationSeconds`.
const MIN_LIFETIME: Duration = Duration::from_secs(600);

impl Flags {
    /// The options these flags make, or the first thing wrong with them.
    pub fn check(&self) -> Result<ApproverOptions, SettingsError> {
        let trust = source(&self.trust, &self.trust_configmap, "trust")?;
        let people = source(
            &self.people_trust,
            &self.people_trust_configmap,
            "people-trust",
        )?;
        if self.named(KUBELET_SIGNER) && trust.is_none() {
            return Err(SettingsError::NodesTrustMissing);
        }
        if people.is_some() && !self.named(CLIENT_SIGNER) {
            return Err(SettingsError::PeopleSignerMissing);
        }
        if trust.is_some() && trust == people {
            return Err(SettingsError::SameSource);
        }
        if self.evidence_max_age > Duration::from_secs(50 * 60) || self.evidence_max_age.is_zero() {
            return Err(SettingsError::EvidenceMaxAge(self.evidence_max_age));
        }
        let rules = Rules {
            on_missing_evidence: self.on_missing_evidence,
            bootstrap_groups: self.bootstrap_groups.clone(),
            evidence_max_age: self.evidence_max_age,
            people: self.people_rules(people.is_some())?,
            ek_join: self.ek_join(&trust)?,
            serving: self.serving(trust.is_some())?,
        };
        check_signers(&self.signer_names, &rules)?;
        Ok(ApproverOptions {
            settings: Settings {
                signer_names: self.signer_names.clone(),
                rules,
            },
            trust,
            people,
        })
    }

    fn named(&self, signer: &str) -> bool {
        self.signer_names.iter().any(|s| s == signer)
    }

    /// The people policy's rules, when a people trust is given.
    fn people_rules(&self, configured: bool) -> Result<Option<PeopleRules>, SettingsError> {
        if !configured {
            return Ok(None);
        }
        let Some(path) = &self.people_client_ca else {
            return Err(SettingsError::PeopleClientCaMissing);
        };
        if self.people_max_lifetime < MIN_LIFETIME {
            return Err(SettingsError::PeopleMaxLifetime(self.people_max_lifetime));
        }
        Ok(Some(PeopleRules {
            client_cas: crate::pki::same_key::ClientCas::from_pem_file(path)
                .map_err(SettingsError::PeopleClientCa)?,
            max_lifetime: self.people_max_lifetime,
            expiration_known: super::lifetime::LifetimeSupport::new(true),
            piv_roots: self.piv_roots()?,
            on_missing_proof: self.people_on_missing_proof,
        }))
    }

    /// Yubico's shipped PIV roots (unless `--no-yubico-piv-roots`) plus each `--piv-roots`.
    fn piv_roots(&self) -> Result<crate::pki::piv::PivRoots, SettingsError> {
        use crate::pki::piv::PivRoots;
        if self.no_yubico_piv_roots && self.piv_roots.is_empty() {
            return Err(SettingsError::NoPivRoots);
        }
        let mut roots = if self.no_yubico_piv_roots {
            PivRoots::none()
        } else {
            PivRoots::yubico()
        };
        for path in &self.piv_roots {
            let text = crate::small_file::read_to_string(path).map_err(|source| {
                SettingsError::PivRootsRead {
                    path: path.clone(),
                    source,
                }
            })?;
            let more = PivRoots::from_pem(&text).map_err(|source| SettingsError::PivRoots {
                path: path.clone(),
                source,
            })?;
            roots.add(more);
        }
        Ok(roots)
    }

    /// The serving policy's rules, when its signer is named.
    fn serving(&self, trust: bool) -> Result<Option<ServingRules>, SettingsError> {
        if !self.named(SERVING_SIGNER) {
            if self.serving_require_attested_node || self.serving_max_lifetime.is_some() {
                return Err(SettingsError::ServingFlagsWithoutSigner);
            }
            return Ok(None);
        }
        if self.serving_require_attested_node && !trust {
            return Err(SettingsError::ServingNeedsTrust);
        }
        if let Some(max) = self.serving_max_lifetime.filter(|m| *m < MIN_LIFETIME) {
            return Err(SettingsError::ServingMaxLifetime(max));
        }
        Ok(Some(ServingRules {
            require_attested_node: self.serving_require_attested_node,
            max_lifetime: self.serving_max_lifetime,
        }))
    }

    /// The settings for TPMs that join by their EK certificate, when the carrier signer is
    /// named.
    fn ek_join(
        &self,
        trust: &Option<TrustSource>,
    ) -> Result<Option<Arc<JoinSettings>>, SettingsError> {
        let configured =
            !self.ek_ca.is_empty() || !self.ek_crl.is_empty() || self.credential_key.is_some();
        if !self.named(CREDENTIAL_SIGNER) {
            return match configured {
                true => Err(SettingsError::EkFlagsWithoutSigner),
                false => Ok(None),
            };
        }
        if !self.named(KUBELET_SIGNER) {
            return Err(SettingsError::EkJoinNeedsKubelet);
        }
        if !matches!(trust, Some(TrustSource::ConfigMap { .. })) {
            return Err(SettingsError::EkJoinNeedsConfigMap);
        }
        let Some(key_path) = &self.credential_key else {
            return Err(SettingsError::CredentialKeyMissing);
        };
        let key = zeroize::Zeroizing::new(read("credential-key", key_path)?);
        if key.len() < 32 {
            return Err(SettingsError::CredentialKeyShort {
                path: key_path.clone(),
                len: key.len(),
            });
        }
        if self.credential_ttl < Duration::from_secs(5)
            || self.credential_ttl > Duration::from_secs(24 * 3600)
        {
            return Err(SettingsError::CredentialTtl(self.credential_ttl));
        }
        Ok(Some(Arc::new(JoinSettings {
            ca_pem: self.ek_cas()?,
            crls: self.ek_crls()?,
            key,
            ttl: self.credential_ttl,
        })))
    }

    /// The `--ek-ca` bundles, one after the other.
    fn ek_cas(&self) -> Result<Vec<u8>, SettingsError> {
        let mut ca_pem = Vec::new();
        for path in &self.ek_ca {
            let bytes = read("ek-ca", path)?;
            let holds_one = ::pem::parse_many(&bytes)
                .is_ok_and(|certs| certs.iter().any(|c| c.tag() == "CERTIFICATE"));
            if !holds_one {
                return Err(SettingsError::EkCa { path: path.clone() });
            }
            ca_pem.extend_from_slice(&bytes);
            ca_pem.push(b'\n');
        }
        Ok(ca_pem)
    }

    /// The `--ek-crl` files.
    fn ek_crls(&self) -> Result<Vec<crate::pki::ek_crl::EkCrls>, SettingsError> {
        let mut crls = Vec::new();
        for path in &self.ek_crl {
            let bytes = read("ek-crl", path)?;
            crls.push(crate::pki::ek_crl::EkCrls::parse(&bytes).map_err(|source| {
                SettingsError::EkCrl {
                    path: path.clone(),
                    source: Box::new(source),
                }
            })?);
        }
        Ok(crls)
    }
}

/// A trust source from a directory or a ConfigMap flag.
fn source(
    dir: &Option<PathBuf>,
    map: &Option<String>,
    flag: &'static str,
) -> Result<Option<TrustSource>, SettingsError> {
    match (dir, map) {
        (Some(dir), _) => Ok(Some(TrustSource::Dir(dir.clone()))),
        (None, Some(spec)) => TrustSource::config_map(spec)
            .map(Some)
            .map_err(|source| SettingsError::ConfigMapName { flag, source }),
        (None, None) => Ok(None),
    }
}

/// A small file named by `--flag`.
fn read(flag: &'static str, path: &std::path::Path) -> Result<Vec<u8>, SettingsError> {
    crate::small_file::read(path).map_err(|source| SettingsError::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(signers: &[&str]) -> Flags {
        Flags {
            signer_names: signers.iter().map(|s| s.to_string()).collect(),
            evidence_max_age: Duration::from_secs(900),
            people_max_lifetime: Duration::from_secs(86_400),
            credential_ttl: Duration::from_secs(3600),
            trust: Some("/nonexistent/trust".into()),
            ..Flags::default()
        }
    }

    #[test]
    fn each_policy_needs_its_settings_and_says_which_flag() {
        let serving_only = Flags {
            trust: None,
            ..flags(&[SERVING_SIGNER])
        };
        let options = serving_only.check().expect("serving alone needs no trust");
        assert!(options.settings.rules.serving.is_some());
        for (flags, want) in [
            (
                Flags {
                    trust: None,
                    ..flags(&[KUBELET_SIGNER])
                },
                "--trust DIR",
            ),
            (
                Flags {
                    trust: None,
                    serving_require_attested_node: true,
                    ..flags(&[SERVING_SIGNER])
                },
                "--serving-require-attested-node needs",
            ),
            (
                Flags {
                    serving_max_lifetime: Some(Duration::from_secs(3600)),
                    ..flags(&[KUBELET_SIGNER])
                },
                "add --signer-name kubernetes.io/kubelet-serving",
            ),
            (
                Flags {
                    serving_max_lifetime: Some(Duration::from_secs(60)),
                    ..flags(&[SERVING_SIGNER])
                },
                "below the 10 minutes",
            ),
            (flags(&["example.com/x"]), "no approval policy"),
            (flags(&[CLIENT_SIGNER]), "no approval policy"),
            (
                Flags {
                    evidence_max_age: Duration::from_secs(3600),
                    ..flags(&[KUBELET_SIGNER])
                },
                "--evidence-max-age",
            ),
            (
                flags(&[KUBELET_SIGNER, CREDENTIAL_SIGNER]),
                "--trust-configmap",
            ),
            (
                Flags {
                    trust_configmap: Some("no-slash".into()),
                    trust: None,
                    ..flags(&[KUBELET_SIGNER])
                },
                "--trust-configmap",
            ),
        ] {
            let e = flags.check().expect_err(want).to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
