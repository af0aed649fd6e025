//! A requested subject alternative name extension, read strictly: only DNS names and IP
//! addresses, each as Go's `crypto/x509` reads it and as kube-controller-manager's signer will
//! copy it into the certificate.
//!
//! Go reads a request's SANs with `parseSANExtension`: a DNS name is the IA5 bytes as they are
//! (no case folding, a trailing dot kept), an IP address is 4 or 16 bytes, and the signer
//! writes an IP back in its 4-byte form whenever it is an IPv4 address, so a 16-byte
//! `::ffff:a.b.c.d` *is* `a.b.c.d` in the issued certificate. Go ignores name types it does not
//! know (other names, directory names) and a constructed tag of a known type; this reader
//! refuses all of them, and every name a serving certificate has no use for (e-mail, URI), so
//! what it accepts Go reads identically (`tests/it/approver/san_oracle.rs` checks that against
//! Go itself).

use std::net::IpAddr;

/// The names a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// DNS names exactly as written (Go's reading).
    pub dns: Vec<String>,
    /// IP addresses as the certificate will hold them (an IPv4-mapped IPv6 address is IPv4).
    pub ips: Vec<IpAddr>,
}

/// Why a subject alternative name extension is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum Refused {
    #[error("the subject alternative names do not parse as DER GeneralNames ({0})")]
    Malformed(String),
    #[error("the subject alternative name extension names nothing")]
    Empty,
    #[error("the request names {0}: a serving certificate names DNS names and IP addresses only")]
    Kind(&'static str),
    #[error("DNS name '{0}' is a wildcard: a serving certificate names the node's own names only")]
    Wildcard(String),
    #[error("DNS name '{0}' is not a host name (letters, digits and hyphens in dot-separated labels of 1 to 63, at most 253 in all, the last not all digits)")]
    NotAHostName(String),
    #[error("an IP address of {0} bytes: an address is 4 (IPv4) or 16 (IPv6) bytes")]
    IpLength(usize),
}

/// The DNS names and IP addresses of a requested subjectAltName extension's value.
pub fn read_names(value: &[u8]) -> Result<Names, Refused> {
    let mut names = Names {
        dns: Vec::new(),
        ips: Vec::new(),
    };
    let (tag, body, rest) = tlv(value)?;
    if tag != 0x30 || !rest.is_empty() {
        return Err(Refused::Malformed("not exactly one SEQUENCE".into()));
    }
    let mut body = body;
    while !body.is_empty() {
        let (tag, content, rest) = tlv(body)?;
        body = rest;
        match tag {
            0x82 => names.dns.push(dns_name(content)?),
            0x87 => names.ips.push(ip_address(content)?),
            0x81 | 0xa1 => return Err(Refused::Kind("an e-mail address")),
            0x86 | 0xa6 => return Err(Refused::Kind("a URI")),
            0xa0 => return Err(Refused::Kind("an other name")),
            0xa4 => return Err(Refused::Kind("a directory name")),
            0xa2 | 0xa7 => return Err(Refused::Kind("a constructed DNS name or IP address")),
            _ => return Err(Refused::Kind("a name of another type")),
        }
    }
    if names.dns.is_empty() && names.ips.is_empty() {
        return Err(Refused::Empty);
    }
    Ok(names)
}

/// One DER TLV (single-byte tag, minimal definite length): (tag, content, what follows).
fn tlv(input: &[u8]) -> Result<(u8, &[u8], &[u8]), Refused> {
    let bad = |m: &str| Refused::Malformed(m.into());
    let [tag, first, rest @ ..] = input else {
        return Err(bad("truncated"));
    };
    if tag & 0x1f == 0x1f {
        return Err(bad("a high tag number"));
    }
    let (len, rest) = match *first {
        n if n < 0x80 => (usize::from(n), rest),
        0x81 => match rest {
            [n, rest @ ..] if *n >= 0x80 => (usize::from(*n), rest),
            _ => return Err(bad("a length not in its shortest form")),
        },
        0x82 => match rest {
            [a, b, rest @ ..] if *a != 0 => (usize::from(*a) << 8 | usize::from(*b), rest),
            _ => return Err(bad("a length not in its shortest form")),
        },
        _ => return Err(bad("an indefinite or oversized length")),
    };
    if rest.len() < len {
        return Err(bad("truncated"));
    }
    Ok((*tag, &rest[..len], &rest[len..]))
}

/// A DNS name: a host name of ASCII letters, digits, hyphens and dots (one trailing dot
/// allowed), no wildcard.
fn dns_name(content: &[u8]) -> Result<String, Refused> {
    let shown = || shown(content);
    if content.contains(&b'*') {
        return Err(Refused::Wildcard(shown()));
    }
    let text = std::str::from_utf8(content).map_err(|_| Refused::NotAHostName(shown()))?;
    // A last label of digits reads as an IPv4 address to some clients (inet_aton's 10.1).
    let numeric = |n: String| {
        n.rsplit('.')
            .next()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
    };
    if normalize_host(text).is_none_or(numeric) {
        return Err(Refused::NotAHostName(shown()));
    }
    Ok(text.to_string())
}

/// At most 64 characters of a name, escaped, for a message.
fn shown(content: &[u8]) -> String {
    let text = String::from_utf8_lossy(content);
    let escaped: String = text.escape_debug().take(64).collect();
    if text.escape_debug().nth(64).is_some() {
        format!("{escaped}…")
    } else {
        escaped
    }
}

/// A host name as names are compared: ASCII lower case, without one trailing dot; None when
/// it is not a host name (non-ASCII, an empty or over-long label, a hyphen at a label's edge,
/// any other character).
pub fn normalize_host(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return None;
    }
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    name.split('.')
        .all(label_ok)
        .then(|| name.to_ascii_lowercase())
}

/// An IP address as the issued certificate holds it.
fn ip_address(content: &[u8]) -> Result<IpAddr, Refused> {
    match content.len() {
        4 => {
            let mut a = [0u8; 4];
            a.copy_from_slice(content);
            Ok(IpAddr::from(a))
        }
        16 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(content);
            Ok(canonical(IpAddr::from(a)))
        }
        n => Err(Refused::IpLength(n)),
    }
}

/// An address as Go compares and writes it: an IPv4-mapped IPv6 address is its IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(items: &[(u8, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (tag, content) in items {
            body.push(*tag);
            body.push(u8::try_from(content.len()).expect("short"));
            body.extend_from_slice(content);
        }
        let mut out = vec![0x30, u8::try_from(body.len()).expect("short")];
        out.extend(body);
        out
    }

    #[test]
    fn dns_names_and_addresses_are_read_as_go_writes_them() {
        let mapped = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];
        let read = read_names(&names(&[
            (0x82, b"Node-A.example."),
            (0x87, &[10, 0, 0, 1]),
            (0x87, &mapped),
        ]))
        .expect("names");
        assert_eq!(read.dns, ["Node-A.example."]);
        assert_eq!(
            read.ips,
            [
                "10.0.0.1".parse::<IpAddr>().expect("ip"),
                "10.0.0.2".parse().expect("ip")
            ]
        );
        assert_eq!(
            normalize_host("Node-A.example.").as_deref(),
            Some("node-a.example")
        );
    }

    #[test]
    fn other_kinds_wildcards_bad_lengths_and_encodings_are_refused() {
        for (value, want) in [
            (names(&[(0x81, b"a@b.c")]), "e-mail"),
            (names(&[(0x86, b"https://x")]), "URI"),
            (names(&[(0xa0, &[0x06, 0x01, 0x2a])]), "other name"),
            (names(&[(0x82, b"*.example")]), "wildcard"),
            (names(&[(0x82, b"a..b")]), "not a host name"),
            (names(&[(0x82, b"")]), "not a host name"),
            (names(&[(0x82, b"10.0.0.2")]), "not a host name"),
            (
                names(&[(0x82, "b\u{fc}cher".as_bytes())]),
                "not a host name",
            ),
            (names(&[(0x87, &[10, 0, 0])]), "3 bytes"),
            (names(&[]), "names nothing"),
            (vec![0x30, 0x81, 0x02, 0x82, 0x00], "shortest form"),
            ([names(&[(0x82, b"a")]), vec![0]].concat(), "exactly one"),
        ] {
            let e = super::read_names(&value).expect_err(want).to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
