//! `NO_PROXY` as Go reads it (`golang.org/x/net/http/httpproxy`, which client-go uses through
//! `http.ProxyFromEnvironment`): a comma-separated list of
//!
//! * `*`: no proxy for any host;
//! * an IP address, or a CIDR block (`10.0.0.0/8`), matching IP hosts;
//! * a host name, matching that host and every subdomain (`example.com` matches
//!   `api.example.com`); with a leading dot only the subdomains (`.example.com`);
//! * any of these with `:PORT`, matching that port only.
//!
//! Matching is on the parsed host (lower case, brackets of IPv6 literals removed), never on the
//! URL as text. Like Go, `localhost` and loopback addresses are never proxied through the
//! environment's proxy (an explicit `proxy-url` is another matter: it proxies everything).

use std::net::IpAddr;

/// One `NO_PROXY` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Ip(IpAddr, Option<u16>),
    Cidr(IpAddr, u8),
    /// A domain (lower case, no leading dot) and whether the domain itself matches too.
    Domain(String, bool, Option<u16>),
}

/// A parsed `NO_PROXY` list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NoProxy {
    all: bool,
    entries: Vec<Entry>,
}

impl NoProxy {
    /// Parses a `NO_PROXY` value; entries that are none of the forms above are ignored, as Go
    /// ignores them.
    pub fn parse(list: &str) -> NoProxy {
        let mut out = NoProxy::default();
        for raw in list.split(',') {
            let item = raw.trim().to_ascii_lowercase();
            if item.is_empty() {
                continue;
            }
            if item == "*" {
                out.all = true;
                continue;
            }
            if let Some((net, bits)) = item.split_once('/') {
                if let (Ok(ip), Ok(bits)) = (net.parse::<IpAddr>(), bits.parse::<u8>()) {
                    let max = if ip.is_ipv4() { 32 } else { 128 };
                    if bits <= max {
                        out.entries.push(Entry::Cidr(ip, bits));
                    }
                }
                continue;
            }
            let (host, port) = split_port(&item);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if let Ok(ip) = host.parse::<IpAddr>() {
                out.entries.push(Entry::Ip(ip, port));
                continue;
            }
            // `*.example.com` is written by many as `.example.com`; Go treats both alike.
            let (domain, itself) = match host.strip_prefix("*.").or(host.strip_prefix('.')) {
                Some(d) => (d, false),
                None => (host, true),
            };
            if !domain.is_empty() {
                out.entries
                    .push(Entry::Domain(domain.to_string(), itself, port));
            }
        }
        out
    }

    /// Whether a connection to `host`:`port` goes direct (`host` as parsed from the URL).
    pub fn excludes(&self, host: &str, port: u16) -> bool {
        if self.all {
            return true;
        }
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .trim_end_matches('.')
            .to_ascii_lowercase();
        let ip = host.parse::<IpAddr>().ok();
        self.entries.iter().any(|e| match e {
            Entry::Ip(want, p) => ip == Some(*want) && port_ok(*p, port),
            Entry::Cidr(net, bits) => ip.is_some_and(|ip| in_cidr(ip, *net, *bits)),
            Entry::Domain(d, itself, p) => {
                ip.is_none()
                    && port_ok(*p, port)
                    && ((*itself && host == *d)
                        || host
                            .strip_suffix(d.as_str())
                            .is_some_and(|rest| rest.ends_with('.')))
            }
        })
    }
}

/// Go never sends requests for these through the environment's proxy.
pub fn is_local(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn port_ok(want: Option<u16>, port: u16) -> bool {
    want.is_none_or(|w| w == port)
}

/// `host:port` → (host, Some(port)); a bare IPv6 address is all host.
fn split_port(item: &str) -> (&str, Option<u16>) {
    if let Some(rest) = item.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            return (host, tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match item.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse() {
            Ok(p) => (host, Some(p)),
            Err(_) => (item, None),
        },
        _ => (item, None),
    }
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            u32::from(a) & mask == u32::from(b) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_as_go_matches_them() {
        let n = NoProxy::parse(" Example.com, .corp.local ,10.0.0.0/8, 192.168.1.7, api.x:8443, [::1]:6443, fd00::/8, bogus/99");
        // A domain matches itself and its subdomains, not a lookalike suffix.
        assert!(n.excludes("example.com", 443));
        assert!(n.excludes("API.example.com.", 443));
        assert!(!n.excludes("badexample.com", 443));
        // A leading dot: subdomains only.
        assert!(n.excludes("k8s.corp.local", 6443));
        assert!(!n.excludes("corp.local", 6443));
        // CIDR and exact IPs; a name is never matched against an IP entry.
        assert!(n.excludes("10.1.2.3", 6443));
        assert!(!n.excludes("11.1.2.3", 6443));
        assert!(n.excludes("192.168.1.7", 1));
        assert!(!n.excludes("192.168.1.8", 1));
        assert!(n.excludes("fd12::1", 443));
        assert!(!n.excludes("10.example", 443));
        // With a port: that port only.
        assert!(n.excludes("api.x", 8443));
        assert!(!n.excludes("api.x", 6443));
        assert!(n.excludes("[::1]", 6443));
        assert!(!n.excludes("::1", 443));
        assert!(!NoProxy::parse("").excludes("example.com", 443));
        assert!(NoProxy::parse("a, *").excludes("anything", 1));
        assert!(NoProxy::parse("*.b.example").excludes("a.b.example", 1));
    }

    #[test]
    fn loopback_and_localhost_are_local() {
        assert!(is_local("localhost") && is_local("127.0.0.2") && is_local("[::1]"));
        assert!(!is_local("10.0.0.1") && !is_local("localhost.example"));
    }
}
