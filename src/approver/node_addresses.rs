//! A node's names and addresses as the serving policy compares them ([`Addresses`]: Go's
//! reading), and every Node's, so that no node gets a name or address another Node holds
//! ([`NodeIndex`]): a node writes its own `status.addresses`, and could otherwise claim another
//! node's IP or name for itself.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;

use super::decision::NodeCheck;
use super::reason::{bounded, violation, Reason, Violation};
use crate::pki::san::{self, Names};

/// How long a reading of every Node serves the decisions that follow it.
pub const FRESH_FOR: Duration = Duration::from_secs(2);

/// The most addresses of one Node that are read (a node may pad its own status).
pub const MAX_ADDRESSES: usize = 64;

/// A node's names and addresses, normalized for comparison.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addresses {
    /// Host names (`Hostname`, `InternalDNS`, `ExternalDNS`), lower case, no trailing dot.
    pub dns: Vec<String>,
    /// IP addresses (`InternalIP`, `ExternalIP`), IPv4-mapped ones as IPv4.
    pub ips: Vec<IpAddr>,
}

impl Addresses {
    /// A Node's `status.addresses` (all five types; others, and values that are no host name
    /// or address, match nothing), the first [`MAX_ADDRESSES`] of them.
    pub fn of_node(node: &Node) -> Addresses {
        let mut out = Addresses::default();
        let listed = node
            .status
            .iter()
            .flat_map(|s| s.addresses.iter().flatten());
        for a in listed.take(MAX_ADDRESSES) {
            match a.type_.as_str() {
                "Hostname" | "InternalDNS" | "ExternalDNS" => out.add_dns(&a.address),
                "InternalIP" | "ExternalIP" => out.add_ip(&a.address),
                _ => {}
            }
        }
        out
    }

    /// Addresses registered in the trust: each an IP address or a host name.
    pub fn of_strings<'a>(values: impl Iterator<Item = &'a str>) -> Addresses {
        let mut out = Addresses::default();
        for v in values {
            if v.parse::<IpAddr>().is_ok() {
                out.add_ip(v);
            } else {
                out.add_dns(v);
            }
        }
        out
    }

    fn add_dns(&mut self, name: &str) {
        if let Some(n) = san::normalize_host(name) {
            self.dns.push(n);
        }
    }

    fn add_ip(&mut self, ip: &str) {
        if let Ok(ip) = ip.parse::<IpAddr>() {
            self.ips.push(san::canonical(ip));
        }
    }

    /// Every name of `check` is one of these (`whose`: where they come from, for the message).
    pub fn check(&self, check: &NodeCheck, whose: &str) -> Result<String, Violation> {
        let not_owned = |what: String| {
            violation(
                Reason::SubjectAltNameNotOwned,
                format!(
                    "{what} is not an address of node '{}' ({whose}): a node's serving certificate names its own addresses only",
                    check.node
                ),
            )
        };
        for name in &check.names.dns {
            let normal = san::normalize_host(name);
            if !normal.is_some_and(|n| self.dns.contains(&n)) {
                return Err(not_owned(format!("DNS name '{}'", bounded(name))));
            }
        }
        for ip in &check.names.ips {
            if !self.ips.contains(ip) {
                return Err(not_owned(format!("IP address {ip}")));
            }
        }
        Ok(format!(
            "{} (the node's addresses {whose})",
            describe_names(&check.names)
        ))
    }
}

/// The names as one list of keys (host names normalized, IP addresses in Go's form).
fn keys(names: &Names) -> impl Iterator<Item = String> + '_ {
    let dns = names.dns.iter().filter_map(|d| san::normalize_host(d));
    dns.chain(names.ips.iter().map(IpAddr::to_string))
}

/// Which Nodes hold each name and address: their own name and their status addresses.
#[derive(Debug, Default)]
pub struct Owners {
    by_key: HashMap<String, HashSet<String>>,
}

impl Owners {
    fn add(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        let own = Addresses::of_node(node);
        let keys = own
            .dns
            .into_iter()
            .chain(san::normalize_host(&name))
            .chain(own.ips.iter().map(IpAddr::to_string));
        for key in keys {
            self.by_key.entry(key).or_default().insert(name.clone());
        }
    }

    /// No name of `check` is another Node's name or address.
    pub fn none_of_others(&self, check: &NodeCheck) -> Result<(), Violation> {
        for key in keys(&check.names) {
            let other = self
                .by_key
                .get(&key)
                .and_then(|owners| owners.iter().find(|o| **o != check.node));
            if let Some(other) = other {
                return Err(violation(
                    Reason::SubjectAltNameNotOwned,
                    format!(
                        "'{}' is also node '{}''s name or address: a name two nodes claim is no node's own (a node writes its own status)",
                        bounded(&key),
                        bounded(other)
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// When every Node was read, and what they hold.
type Reading = (Instant, Arc<Owners>);

/// Every Node's names and addresses, read again when older than [`FRESH_FOR`] and shared by the
/// decisions written meanwhile (a LIST in pages, keeping only names and addresses).
#[derive(Debug, Clone, Default)]
pub struct NodeIndex {
    read: Arc<tokio::sync::Mutex<Option<Reading>>>,
}

impl NodeIndex {
    /// The owners of every name, fresh within [`FRESH_FOR`].
    pub async fn read(&self, client: &kube::Client) -> Result<Arc<Owners>, kube::Error> {
        let mut held = self.read.lock().await;
        if let Some((at, owners)) = held.as_ref() {
            if at.elapsed() < FRESH_FOR {
                return Ok(owners.clone());
            }
        }
        let api: kube::Api<Node> = kube::Api::all(client.clone());
        let mut owners = Owners::default();
        let mut params = kube::api::ListParams::default().limit(500);
        loop {
            let page = api.list(&params).await?;
            page.items.iter().for_each(|n| owners.add(n));
            match page.metadata.continue_ {
                Some(next) if !next.is_empty() => params = params.continue_token(&next),
                _ => break,
            }
        }
        let owners = Arc::new(owners);
        *held = Some((Instant::now(), owners.clone()));
        Ok(owners)
    }
}

/// The names, for a message.
pub fn describe_names(names: &Names) -> String {
    let ips: Vec<String> = names.ips.iter().map(IpAddr::to_string).collect();
    format!(
        "every name is the node's: DNS {}, IP {}",
        bounded(&format!("{:?}", names.dns)),
        bounded(&format!("{ips:?}"))
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// What node-a asks for: DNS names and IP addresses (as Go reads them).
    pub(crate) fn check(dns: &[&str], ips: &[&str]) -> NodeCheck {
        NodeCheck {
            node: "node-a".into(),
            names: Names {
                dns: dns.iter().map(|d| d.to_string()).collect(),
                ips: ips
                    .iter()
                    .map(|i| san::canonical(i.parse().expect("ip")))
                    .collect(),
            },
            proof: String::new(),
        }
    }
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};

    fn node(name: &str, addresses: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.status = Some(NodeStatus {
            addresses: Some(
                addresses
                    .iter()
                    .map(|(t, a)| NodeAddress {
                        type_: t.to_string(),
                        address: a.to_string(),
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        n
    }

    /// Node A writes node B's IP and name into its own status: its request for them is
    /// refused, naming node B; its own names pass.
    #[test]
    fn a_name_another_node_holds_is_no_nodes_own() {
        let mut owners = Owners::default();
        owners.add(&node(
            "node-a",
            &[
                ("Hostname", "node-a"),
                ("InternalIP", "10.0.0.1"),
                ("InternalIP", "10.0.0.2"),
                ("Hostname", "Node-B."),
            ],
        ));
        owners.add(&node("node-b", &[("InternalIP", "10.0.0.2")]));
        let ask = check;
        assert!(owners
            .none_of_others(&ask(&["node-a"], &["10.0.0.1"]))
            .is_ok());
        for bad in [ask(&[], &["::ffff:10.0.0.2"]), ask(&["NODE-B"], &[])] {
            let v = owners.none_of_others(&bad).expect_err("another node's");
            assert_eq!(v.reason, Reason::SubjectAltNameNotOwned);
            assert!(v.message.contains("node 'node-b'"), "{v}");
        }
    }

    #[test]
    fn a_padded_status_is_read_only_up_to_its_cap() {
        let many: Vec<(String, String)> = (0..1000)
            .map(|i| ("Hostname".to_string(), format!("n{i}")))
            .collect();
        let refs: Vec<(&str, &str)> = many.iter().map(|(t, a)| (t.as_str(), a.as_str())).collect();
        assert_eq!(
            Addresses::of_node(&node("node-a", &refs)).dns.len(),
            MAX_ADDRESSES
        );
    }
}
