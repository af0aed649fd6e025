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
//!
//! Every decision is Go's, detail for detail (IPv4-mapped IPv6 addresses are IPv4, a trailing
//! dot makes another name, non-ASCII names are compared in their IDNA form, a domain entry is
//! also matched against an IP host's text): a request client-go would send direct must not
//! reach a forward proxy through hwkey, and the other way round. The differential test
//! `proxy::no_proxy_oracle` compares thousands of decisions with Go's own.

use std::net::IpAddr;

/// One `NO_PROXY` entry, as Go's `httpproxy` keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// An address (IPv4-mapped IPv6 kept as IPv4, as Go's `IP.Equal` compares) and the port
    /// as written ("" for any port).
    Ip(IpAddr, String),
    /// A network in Go's reading of it (see [`go_network`]); no port.
    Cidr(IpAddr, u8),
    /// `.domain` (lower case, with the leading dot, in ASCII where IDNA can write it), whether
    /// `domain` itself matches too, and the port as written ("" for any port).
    Domain(String, bool, String),
}

/// A parsed `NO_PROXY` list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NoProxy {
    all: bool,
    entries: Vec<Entry>,
    /// The list as given (for [`NoProxy::as_written`]).
    text: String,
}

impl NoProxy {
    /// Parses a `NO_PROXY` value entry by entry as Go's `httpproxy.config.init` does
    /// (differentially tested against Go: `tests/it/proxy/no_proxy_oracle.rs`).
    pub fn parse(list: &str) -> NoProxy {
        let mut out = NoProxy {
            text: list.to_string(),
            ..NoProxy::default()
        };
        for raw in list.split(',') {
            let item = raw.trim().to_lowercase();
            if item.is_empty() {
                continue;
            }
            if item == "*" {
                out.all = true;
                return out;
            }
            if let Some(net) = parse_cidr(&item) {
                out.entries.push(net);
                continue;
            }
            let (host, port) = match split_host_port(&item) {
                Some((h, p)) => {
                    if h.is_empty() {
                        continue;
                    }
                    let h = h
                        .strip_prefix('[')
                        .and_then(|h| h.strip_suffix(']'))
                        .unwrap_or(h);
                    (h.to_string(), p.to_string())
                }
                None => (item.clone(), String::new()),
            };
            if let Ok(ip) = host.parse::<IpAddr>() {
                out.entries.push(Entry::Ip(ip.to_canonical(), port));
                continue;
            }
            if host.is_empty() {
                continue;
            }
            let host = host
                .strip_prefix('*')
                .filter(|h| h.starts_with('.'))
                .unwrap_or(&host);
            let (dotted, itself) = match host.starts_with('.') {
                true => (host.to_string(), false),
                false => (format!(".{host}"), true),
            };
            let dotted = super::idna::to_ascii(&dotted).unwrap_or(dotted);
            out.entries.push(Entry::Domain(dotted, itself, port));
        }
        out
    }

    /// The list as it was given.
    pub fn as_written(&self) -> &str {
        &self.text
    }

    /// Whether a connection to `host`:`port` goes direct, as Go's `httpproxy.config.useProxy`
    /// decides (`host` as parsed from the URL, brackets of an IPv6 literal removed or not).
    pub fn excludes(&self, host: &str, port: u16) -> bool {
        if self.all {
            return true;
        }
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = host.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
        let host = host.trim().to_lowercase();
        let port = port.to_string();
        let port_ok = |want: &String| want.is_empty() || *want == port;
        self.entries.iter().any(|e| match e {
            Entry::Ip(want, p) => ip == Some(*want) && port_ok(p),
            Entry::Cidr(net, bits) => ip.is_some_and(|ip| in_network(ip, *net, *bits)),
            Entry::Domain(dotted, itself, p) => {
                (host.ends_with(dotted.as_str()) || (*itself && host == dotted[1..])) && port_ok(p)
            }
        })
    }
}

/// Go never sends requests for these through the environment's proxy: the host `localhost`
/// exactly as written, and loopback addresses (IPv4-mapped ones included).
pub fn is_local(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host == "localhost" {
        return true;
    }
    host.parse::<IpAddr>()
        .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Go's `net.SplitHostPort`: `host:port` or `[host]:port` (the brackets kept for the caller);
/// None when there is no port or the host has a colon outside brackets.
fn split_host_port(item: &str) -> Option<(&str, &str)> {
    let colon = item.rfind(':')?;
    let (host, port) = (&item[..colon], &item[colon + 1..]);
    if let Some(inner) = host.strip_prefix('[') {
        let inner = inner.strip_suffix(']')?;
        if inner.contains(['[', ']']) {
            return None;
        }
        return Some((host, port));
    }
    if host.contains([':', '[', ']']) || port.contains(['[', ']']) {
        return None;
    }
    Some((host, port))
}

/// Go's `net.ParseCIDR` and the network it keeps (see [`go_network`]).
fn parse_cidr(item: &str) -> Option<Entry> {
    let (addr, bits) = item.split_once('/')?;
    // Go's dtoi: decimal digits only (no sign), leading zeros allowed.
    if bits.is_empty() || !bits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let bits = bits.bytes().try_fold(0u32, |n, b| {
        n.checked_mul(10)?.checked_add(u32::from(b - b'0'))
    })?;
    let bits = u8::try_from(bits).ok()?;
    let ip: IpAddr = addr.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if bits > max {
        return None;
    }
    let (net, bits) = go_network(ip, bits);
    Some(Entry::Cidr(net, bits))
}

/// The network Go's `IPNet.Contains` compares with: the address masked; an IPv6 network that
/// is IPv4-mapped after masking (possible from /96 up) is the IPv4 network of the mask's
/// last 32 bits.
fn go_network(ip: IpAddr, bits: u8) -> (IpAddr, u8) {
    match ip {
        IpAddr::V4(v4) => (IpAddr::V4(mask4(v4.into(), bits).into()), bits),
        IpAddr::V6(v6) => {
            let masked = std::net::Ipv6Addr::from(mask6(v6.into(), bits));
            match masked.to_ipv4_mapped() {
                Some(v4) => (IpAddr::V4(v4), bits.saturating_sub(96)),
                None => (IpAddr::V6(masked), bits),
            }
        }
    }
}

fn mask4(a: u32, bits: u8) -> u32 {
    a & u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0)
}

fn mask6(a: u128, bits: u8) -> u128 {
    a & u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0)
}

/// `ip` (IPv4-mapped already made IPv4) in the network of [`go_network`]; families differ:
/// never.
fn in_network(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(b)) => mask4(a.into(), bits) == u32::from(b),
        (IpAddr::V6(a), IpAddr::V6(b)) => mask6(a.into(), bits) == u128::from(b),
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
        assert!(n.excludes("API.example.com", 443));
        // Go keeps a trailing dot: it is another name.
        assert!(!n.excludes("api.example.com.", 443));
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
        // IPv4-mapped IPv6 is the IPv4 address, for entries and for networks.
        assert!(n.excludes("::ffff:10.9.9.9", 1) && n.excludes("::ffff:192.168.1.7", 1));
        assert!(!NoProxy::parse("").excludes("example.com", 443));
        assert!(NoProxy::parse("a, *").excludes("anything", 1));
        assert!(NoProxy::parse("*.b.example").excludes("a.b.example", 1));
    }

    #[test]
    fn loopback_and_localhost_are_local() {
        assert!(is_local("localhost") && is_local("127.0.0.2") && is_local("[::1]"));
        assert!(!is_local("10.0.0.1") && !is_local("localhost.example"));
        assert!(is_local("::ffff:127.0.0.1") && !is_local("LOCALHOST"));
    }
}
