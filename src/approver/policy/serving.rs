//! `kubernetes.io/kubelet-serving`: a kubelet's serving certificate (`serverTLSBootstrap:
//! true`), which nothing in Kubernetes approves. Approved only for the node's own names and
//! addresses, so no node can get a certificate for another node's IP or name and sit between
//! the API server and that kubelet (`kubectl logs/exec`).
//!
//! What the request alone decides ([`judge`]):
//!
//! 1. the requester is `system:node:N` in group `system:nodes`, and the subject is exactly
//!    `CN=system:node:N, O=system:nodes`;
//! 2. usages are server auth and digital signature, key encipherment at most; no extension
//!    but key usage, extended key usage (server auth alone) and subject alternative names; no
//!    attribute but one extension request and hwkey's evidence;
//! 3. at least one name, each a DNS name (a host name, no wildcard) or an IP address, read as
//!    Go reads them ([`crate::pki::san`]);
//! 4. a lifetime asked for is at most `--serving-max-lifetime`;
//! 5. TPM evidence, if the request carries it, holds and is fresh.
//!
//! What the cluster decides when the decision is written ([`settle`], [`check_node`]): with
//! `--serving-require-attested-node`, N's AK is registered in the trust; evidence, if any, is
//! by N's registered AK (reported: the serving key is in the same TPM); and every name is one
//! of N's addresses: those registered for N in the trust when its entry lists `addresses`,
//! else `Node N`'s `status.addresses` as the API server holds them at that moment (no DNS
//! lookup), and none of them another Node's name or address (a node writes its own status, so
//! it could claim another's). DNS names compare ASCII case-insensitively with a trailing dot
//! read as the same name (Go's clients match a dotted name only when asked for the dotted
//! name, so it is the node's own either way); IP addresses as Go's `net.IP.Equal` (an
//! IPv4-mapped IPv6 address is its IPv4 address).

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Node;

use super::node_client::check_node_subject;
use super::strict::{self, Purpose};
use super::verdict::{Pending, Settling};
use crate::approver::decision::{Decided, Decision, Effect, NodeCheck};
use crate::approver::error::ApproverError;
use crate::approver::evaluate::{self, Seen, ServingCandidate};
use crate::approver::node_addresses::{describe_names, Addresses, NodeIndex};
use crate::approver::reason::bounded;
use crate::approver::reason::{violation, Reason, Violation};
use crate::approver::rules::{Rules, ServingRules};
use crate::approver::trust::Registry;
use crate::pki::attestation;
use crate::pki::request::Request;
use crate::pki::san;

/// The most names a serving request may ask for (kubelet asks for its node's addresses).
pub const MAX_NAMES: usize = 64;

/// Judges a serving request by itself.
pub fn judge(
    csr: &CertificateSigningRequest,
    rules: &Rules,
    now: i64,
) -> Result<Option<Pending>, Violation> {
    let Some(serving) = &rules.serving else {
        return Ok(None);
    };
    let request = Request::from_pem(&csr.spec.request.0)?;
    let node = check_node_subject(&request)?;
    check_requester(csr, &node)?;
    strict::check_attributes(&request)?;
    let value = strict::check_extensions(&request, Purpose::Server)?;
    strict::check_usages(
        &csr.spec.usages.clone().unwrap_or_default(),
        Purpose::Server,
    )?;
    let Some(value) = value else {
        return Err(violation(
            Reason::SubjectAltNameNotAllowed,
            "the request names no DNS name or IP address: a serving certificate names the node's own",
        ));
    };
    let names = san::read_names(value).map_err(|e| {
        let reason = match e {
            san::Refused::Malformed(_) => Reason::MalformedRequest,
            _ => Reason::SubjectAltNameNotAllowed,
        };
        violation(reason, e.to_string())
    })?;
    if names.dns.len() + names.ips.len() > MAX_NAMES {
        return Err(violation(
            Reason::SubjectAltNameNotAllowed,
            format!(
                "the request names {} DNS names and IP addresses: a serving certificate names at most {MAX_NAMES}",
                names.dns.len() + names.ips.len()
            ),
        ));
    }
    check_lifetime(csr, serving)?;
    let attested = if request.attributes_of(attestation::OID_EVIDENCE).is_empty() {
        None
    } else {
        Some(Box::new(evaluate::attested(
            csr,
            &request,
            node.clone(),
            0,
            rules,
            now,
        )?))
    };
    Ok(Some(Pending::Serving(Box::new(ServingCandidate {
        node,
        names,
        attested,
    }))))
}

/// The node itself, as the API server authenticated it (its user and its group).
fn check_requester(csr: &CertificateSigningRequest, node: &str) -> Result<(), Violation> {
    let user = csr.spec.username.clone().unwrap_or_default();
    let groups = csr.spec.groups.clone().unwrap_or_default();
    if user == format!("system:node:{node}") && groups.iter().any(|g| g == "system:nodes") {
        return Ok(());
    }
    Err(violation(
        Reason::RequesterNotAllowed,
        format!(
            "{} (groups {}) may not ask for system:node:{node}'s serving certificate: only that node itself, in group system:nodes, may",
            bounded(&user),
            bounded(&format!("{groups:?}"))
        ),
    ))
}

/// A lifetime asked for is at most the maximum.
fn check_lifetime(csr: &CertificateSigningRequest, rules: &ServingRules) -> Result<(), Violation> {
    let (Some(max), Some(asked)) = (rules.max_lifetime, csr.spec.expiration_seconds) else {
        return Ok(());
    };
    if u64::try_from(asked).map_or(true, |s| s > max.as_secs()) {
        return Err(violation(
            Reason::LifetimeNotAllowed,
            format!(
                "the request asks for {asked} s: a serving certificate is issued for at most {} s",
                max.as_secs()
            ),
        ));
    }
    Ok(())
}

/// The decision for a serving request against the trust (`nodes`, when configured): names
/// registered for the node decide now; otherwise the Node's addresses decide when it is
/// written ([`Effect::NodeAddresses`]).
pub fn settle(
    s: &mut Settling<'_>,
    seen: Box<Seen>,
    candidate: ServingCandidate,
    nodes: Option<&Registry>,
) -> Decided {
    let registered = nodes.map_or(&[][..], |n| &n.aks[..]);
    let require = s
        .rules
        .serving
        .as_ref()
        .is_some_and(|r| r.require_attested_node);
    let proof = match proof_of(&candidate, registered, require) {
        Ok(p) => p,
        Err(v) => return Decided::denied(seen, v),
    };
    let check = NodeCheck {
        node: candidate.node,
        names: candidate.names,
        proof,
    };
    if nodes.is_some_and(|n| n.invalid.contains(&check.node)) {
        return Decided::denied(seen, violation(
            Reason::SubjectAltNameNotOwned,
            format!("node '{}''s trust entry is malformed (see the approver's log and the hwkey_approver_trust_invalid_entries metric): the names registered for it cannot be read, and its own status does not stand in for them", check.node),
        ));
    }
    let listed = registered
        .iter()
        .find(|r| r.node == check.node)
        .and_then(|r| r.addresses.as_ref());
    let (checked, effect) = match listed {
        Some(addresses) => {
            let owned = Addresses::of_strings(addresses.iter().map(String::as_str));
            (
                owned.check(&check, "registered for it in the trust"),
                Effect::None,
            )
        }
        None => (
            Ok(describe_names(&check.names)),
            Effect::NodeAddresses(Box::new(check.clone())),
        ),
    };
    match checked {
        Ok(message) => Decided {
            decision: Decision {
                name: seen.name.clone(),
                approved: true,
                reason: Reason::NodeAddressesVerified,
                message: format!("{message}{}", check.proof),
            },
            seen,
            granted: None,
            effect,
        },
        Err(v) => Decided::denied(seen, v),
    }
}

/// What proves the node's hardware, for the message: its serving key attested by its
/// registered AK, or its client identity attested; a denial when evidence is carried but not
/// by the node's AK, or when an attested node is required and this one is not.
fn proof_of(
    candidate: &ServingCandidate,
    registered: &[crate::pki::registration::RegisteredAk],
    require: bool,
) -> Result<String, Violation> {
    let node = &candidate.node;
    let has_ak = registered.iter().any(|r| r.node == *node);
    if require && !has_ak {
        return Err(violation(
            Reason::NodeNotAttested,
            format!("node '{node}' holds no attested client identity (no AK is registered for it in the trust): this approver issues serving certificates only to attested nodes"),
        ));
    }
    Ok(match &candidate.attested {
        Some(attested) => {
            let a = attestation::admit_as(attested.attested.clone(), node, registered, "node")
                .map_err(|r| violation(Reason::of(r.refusal), r.message))?;
            format!(
                "; the serving key is in node '{node}''s TPM (attestation key {})",
                a.ak_name
            )
        }
        None if has_ak => "; the node's client identity is attested, the serving key is not".into(),
        None => String::new(),
    })
}

/// The decision when it is written: `decision` if every name is one of the Node's addresses
/// as the API server holds them now and none is another Node's name or address (`others`,
/// read within [`crate::approver::node_addresses::FRESH_FOR`]), else the denial; a Node that is gone denies.
pub async fn check_node(
    client: kube::Client,
    others: &NodeIndex,
    check: &NodeCheck,
    decision: Decision,
) -> Result<Decision, ApproverError> {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let read_error = |source| ApproverError::ReadNode {
        node: check.node.clone(),
        source,
    };
    let Some(node) = nodes.get_opt(&check.node).await.map_err(read_error)? else {
        return Ok(Decision {
            approved: false,
            reason: Reason::NodeNotFound,
            message: format!(
                "node '{}' does not exist (deleted while its request waited, or never registered): a serving certificate is issued for a registered node's addresses",
                check.node
            ),
            ..decision
        });
    };
    let owners = others.read(&client).await.map_err(read_error)?;
    let checked = Addresses::of_node(&node)
        .check(check, "in its status")
        .and_then(|m| owners.none_of_others(check).map(|()| m));
    Ok(match checked {
        Ok(m) => Decision {
            message: format!("{m}{}", check.proof),
            ..decision
        },
        Err(v) => Decision::denied(&decision.name, v),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::approver::node_addresses::tests::check;

    /// Names compare as Go's VerifyHostname and net.IP.Equal do; anything else is not the
    /// node's.
    #[test]
    fn a_name_is_the_nodes_when_go_would_take_it_for_one_of_its_addresses() {
        let owned = Addresses::of_strings(
            [
                "Node-A.example.",
                "10.0.0.1",
                "::ffff:10.0.0.9",
                "2001:db8::1",
            ]
            .into_iter(),
        );
        for ok in [
            check(&["node-a.example"], &["10.0.0.1"]),
            check(&["NODE-A.EXAMPLE."], &["::ffff:10.0.0.1"]),
            check(&[], &["10.0.0.9", "2001:db8:0:0::1"]),
        ] {
            assert!(owned.check(&ok, "test").is_ok(), "{ok:?}");
        }
        for bad in [
            check(&["node-b.example"], &[]),
            check(&["node-a.example.com"], &[]),
            check(&["node-a"], &[]),
            check(&[], &["10.0.0.2"]),
            check(&[], &["::a00:1"]),
        ] {
            let v = owned.check(&bad, "test").expect_err("not the node's");
            assert_eq!(v.reason, Reason::SubjectAltNameNotOwned, "{bad:?}");
        }
    }

    #[test]
    fn a_nodes_status_counts_all_five_address_types_and_nothing_else() {
        use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
        let node = Node {
            status: Some(NodeStatus {
                addresses: Some(
                    [
                        ("Hostname", "node-a"),
                        ("InternalDNS", "node-a.internal"),
                        ("ExternalDNS", "node-a.example"),
                        ("InternalIP", "10.0.0.1"),
                        ("ExternalIP", "203.0.113.1"),
                        ("SomethingElse", "evil.example"),
                        ("InternalIP", "not-an-ip"),
                    ]
                    .iter()
                    .map(|(t, a)| NodeAddress {
                        type_: t.to_string(),
                        address: a.to_string(),
                    })
                    .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        };
        let owned = Addresses::of_node(&node);
        assert_eq!(
            owned.dns,
            ["node-a", "node-a.internal", "node-a.example"].map(String::from)
        );
        assert_eq!(owned.ips.len(), 2);
        assert!(owned.check(&check(&["evil.example"], &[]), "test").is_err());
    }

    #[test]
    fn usages_are_a_serving_certificates() {
        let u = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let check_usages = |u: &[String]| strict::check_usages(u, Purpose::Server);
        assert!(check_usages(&u(&["server auth", "digital signature"])).is_ok());
        assert!(check_usages(&u(&[
            "key encipherment",
            "server auth",
            "digital signature"
        ]))
        .is_ok());
        for bad in [
            &["digital signature", "client auth"][..],
            &["digital signature", "server auth", "client auth"],
            &["server auth"],
            &["digital signature", "server auth", "server auth"],
        ] {
            assert!(check_usages(&u(bad)).is_err(), "{bad:?}");
        }
    }

    /// A trust whose node-a entry is malformed: its own status does not stand in.
    fn settled_with_invalid() -> Decided {
        settled_in((&["node-a"], &[]), None, false, false, true)
    }

    /// Settles `names` for node-a against a trust where node-a's entry lists `addresses`
    /// (None: no list) and whose AK is registered (`attested`).
    fn settled(
        names: (&[&str], &[&str]),
        addresses: Option<&[&str]>,
        attested: bool,
        require: bool,
    ) -> Decided {
        settled_in(names, addresses, attested, require, false)
    }

    fn settled_in(
        names: (&[&str], &[&str]),
        addresses: Option<&[&str]>,
        attested: bool,
        require: bool,
        invalid: bool,
    ) -> Decided {
        let rules = Rules {
            on_missing_evidence: crate::approver::reason::OnMissingEvidence::Deny,
            bootstrap_groups: Vec::new(),
            evidence_max_age: std::time::Duration::from_secs(900),
            people: None,
            ek_join: None,
            serving: Some(ServingRules {
                require_attested_node: require,
                max_lifetime: None,
            }),
        };
        let registry = Registry {
            aks: attested
                .then(|| crate::pki::registration::RegisteredAk {
                    node: "node-a".into(),
                    ak_name: vec![0, 11, 1],
                    ek_sha256: None,
                    addresses: addresses.map(|a| a.iter().map(|s| s.to_string()).collect()),
                })
                .into_iter()
                .collect(),
            invalid: if invalid {
                vec!["node-a".into()]
            } else {
                Vec::new()
            },
            ..Registry::default()
        };
        let (mut index, mut carriers) = Default::default();
        let mut s = Settling {
            rules: &rules,
            index: &mut index,
            carriers: &mut carriers,
            now: 0,
        };
        let seen = Seen {
            uid: "u".into(),
            name: "serving-a".into(),
            resource_version: "1".into(),
            requester: "system:node:node-a".into(),
            signer: crate::pki::csr::SERVING_SIGNER.into(),
            usages: Vec::new(),
            conditions: Vec::new(),
            metadata: crate::approver::evaluate::KeptMetadata::ReadAgain,
        };
        let candidate = ServingCandidate {
            node: "node-a".into(),
            names: check(names.0, names.1).names,
            attested: None,
        };
        settle(&mut s, Box::new(seen), candidate, Some(&registry))
    }

    /// A trust entry's `addresses:` decide at once, with no Node read; without one, the Node's
    /// status decides when the decision is written; an attested node may be required.
    #[test]
    fn registered_addresses_decide_at_once_and_the_node_status_otherwise() {
        let listed: &[&str] = &["node-a.example", "10.0.0.1"];
        let ok = settled(
            (&["NODE-A.example."], &["10.0.0.1"]),
            Some(listed),
            true,
            false,
        );
        assert!(ok.decision.approved, "{:?}", ok.decision);
        assert!(matches!(ok.effect, Effect::None));
        assert!(ok
            .decision
            .message
            .contains("registered for it in the trust"));
        // The Node's status may say more; the registered list is all that counts.
        let beyond = settled(
            (&["node-a.example"], &["10.0.0.7"]),
            Some(listed),
            true,
            false,
        );
        assert_eq!(beyond.decision.reason, Reason::SubjectAltNameNotOwned);
        assert!(!beyond.decision.approved);
        let later = settled((&["node-a"], &[]), None, true, false);
        assert!(matches!(later.effect, Effect::NodeAddresses(_)));
        assert!(later
            .decision
            .message
            .contains("client identity is attested"));
        let malformed = settled_with_invalid();
        assert_eq!(malformed.decision.reason, Reason::SubjectAltNameNotOwned);
        assert!(malformed.decision.message.contains("malformed"));
        let unattested = settled((&["node-a"], &[]), None, false, true);
        assert_eq!(unattested.decision.reason, Reason::NodeNotAttested);
        assert!(matches!(unattested.effect, Effect::None));
    }
}
