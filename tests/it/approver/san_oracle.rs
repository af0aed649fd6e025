//! The serving policy's reading of subject alternative names against Go's own
//! (`hsm-fixtures/csr-oracle.go`): kube-controller-manager issues a kubelet's serving
//! certificate from `x509.ParseCertificateRequest`'s DNSNames and IPAddresses, re-encoded by
//! `x509.CreateCertificate`, so what the approver compares with the node's addresses must be
//! exactly what ends up in the certificate.
//!
//! **Whenever hwkey's SAN reader accepts a request's names, Go parses the request, reads the
//! same DNS names and IP addresses, no e-mail address and no URI, and the certificate it would
//! issue holds exactly those names, each IP address in the form hwkey compared** (a 16-byte
//! `::ffff:a.b.c.d` is issued as the 4-byte `a.b.c.d`). Generated cases: DNS names in every
//! case and with dots, empty and over-long labels, wildcards, IDNA (`xn--` and raw UTF-8), NUL
//! and other bytes; IP addresses of every length, IPv4-mapped and -compatible; e-mail, URI,
//! other, directory and registered-ID names, constructed and high tags; duplicates, an empty
//! list, long-form and indefinite lengths, bytes after the list. A fixed seed, 3,000 cases in
//! the suite; `HWKEY_ORACLE_CASES` runs more.

use std::net::IpAddr;

use support::oracle::GoOracle;
use support::requests::{self as rq, tag, Node, RequestTree, SoftwareKey};

use super::oracle::{cases, hex, Rng};
use hwkey::pki::request::{Request, OID_SUBJECT_ALT_NAME};
use hwkey::pki::san;

const DNS: &[&[u8]] = &[
    b"node-a",
    b"NODE-A",
    b"Node-A.Example.Com.",
    b"node-a.",
    b"node-a..",
    b".node-a",
    b"*.node-a",
    b"node-*.example",
    b"xn--bcher-kva.example",
    "b\u{fc}cher.example".as_bytes(),
    b"",
    b".",
    b"node_a",
    b"node-a\x00",
    b"-node-a",
    b"node-a-",
    b"a b",
    b"10.0.0.1",
    b"\xff\xfe",
];

/// One GeneralName: tag byte and content.
fn name(rng: &mut Rng) -> (u8, Vec<u8>) {
    match rng.below(14) {
        0..=4 => (0x82, dns(rng)),
        5..=8 => (0x87, ip(rng)),
        9 => (0x81, b"root@node-a".to_vec()),
        10 => (0x86, b"https://node-a:10250/".to_vec()),
        11 => {
            let t = [0xa0, 0xa4, 0x88, 0xa3, 0xa5, 0xa2, 0xa7, 0x83][rng.below(8)];
            let inner = Node::Prim(tag::IA5, b"node-a".to_vec()).encode();
            (t, inner)
        }
        12 => (
            0x82,
            format!("{}.example", "a".repeat(60 + rng.below(10))).into_bytes(),
        ),
        _ => (0x82, vec![b'a'; 250 + rng.below(10)]),
    }
}

fn dns(rng: &mut Rng) -> Vec<u8> {
    DNS[rng.below(DNS.len())].to_vec()
}

fn ip(rng: &mut Rng) -> Vec<u8> {
    let v4 = [10, 0, 0, 1 + rng.below(3) as u8];
    match rng.below(8) {
        0 | 1 => v4.to_vec(),
        2 => [&[0u8; 10][..], &[0xff, 0xff], &v4].concat(),
        3 => [&[0u8; 12][..], &v4].concat(),
        4 => "2001:db8::1"
            .parse::<std::net::Ipv6Addr>()
            .expect("v6")
            .octets()
            .to_vec(),
        5 => vec![0u8; 16],
        6 => vec![10; [0, 3, 5, 15, 17][rng.below(5)]],
        _ => [&[0u8; 10][..], &[0xff, 0xfe], &v4].concat(),
    }
}

/// A short definite length, sometimes in a long form DER forbids, or indefinite.
fn length(rng: &mut Rng, len: usize) -> Vec<u8> {
    match (rng.below(40), len) {
        (0, l) => vec![0x81, l as u8],
        (1, l) => vec![0x82, 0, l as u8],
        (_, l) if l < 0x80 => vec![l as u8],
        (_, l) if l < 0x100 => vec![0x81, l as u8],
        (_, l) => vec![0x82, (l >> 8) as u8, l as u8],
    }
}

/// A subjectAltName value: a list of names, sometimes duplicated, empty, or badly encoded.
fn san_value(rng: &mut Rng) -> Vec<u8> {
    let mut body = Vec::new();
    let count = [0, 1, 1, 2, 2, 3, 4][rng.below(7)];
    let mut last: Option<Vec<u8>> = None;
    for _ in 0..count {
        let element = match (&last, rng.chance(10)) {
            (Some(l), true) => l.clone(),
            _ => {
                let (t, content) = name(rng);
                let mut e = vec![t];
                e.extend(length(rng, content.len()));
                e.extend(content);
                e
            }
        };
        body.extend(&element);
        last = Some(element);
    }
    let outer = if rng.chance(3) { 0x31 } else { 0x30 };
    let mut value = vec![outer];
    if rng.chance(2) {
        value.push(0x80);
        value.extend(&body);
        value.extend([0, 0]);
    } else {
        value.extend(length(rng, body.len()));
        value.extend(&body);
    }
    if rng.chance(3) {
        value.push(0);
    }
    value
}

/// A node's serving request carrying `value` as its subjectAltName.
fn request(key: &SoftwareKey, value: Vec<u8>) -> Vec<u8> {
    RequestTree::new(
        Node::seq(vec![
            Node::rdn(rq::O, tag::UTF8, "system:nodes"),
            Node::rdn(rq::CN, tag::UTF8, "system:node:node-a"),
        ]),
        &key.spki(),
        vec![rq::extension_request(vec![rq::extension(
            rq::SAN,
            None,
            value,
        )])],
    )
    .signed(|info| key.sign(info), &[])
}

/// The SAN value of `der`'s request as hwkey's policy reads it (None: refused before).
fn ours(der: &[u8]) -> Option<Result<san::Names, san::Refused>> {
    let request = Request::from_der(der.to_vec()).ok()?;
    let oid = yasna::models::ObjectIdentifier::from_slice(OID_SUBJECT_ALT_NAME);
    let [extension] = request.extensions.as_slice() else {
        return None;
    };
    (extension.oid == oid).then(|| san::read_names(&extension.value))
}

/// What differs between hwkey's accepted reading and Go's.
fn differences(names: &san::Names, go: &support::oracle::GoReading) -> Vec<String> {
    let mut diffs = Vec::new();
    if !go.error.is_empty() {
        return vec![format!("Go refuses the request: {}", go.error)];
    }
    let ips: Vec<String> = names.ips.iter().map(IpAddr::to_string).collect();
    for (what, a, b) in [
        (
            "DNS names",
            format!("{:?}", names.dns),
            format!("{:?}", go.dns_names),
        ),
        ("IP addresses", format!("{ips:?}"), format!("{:?}", go.ips)),
        ("e-mail addresses", "[]".into(), format!("{:?}", go.emails)),
        ("URIs", "[]".into(), format!("{:?}", go.uris)),
    ] {
        if a != b {
            diffs.push(format!("{what}: hwkey {a}, Go {b}"));
        }
    }
    // The certificate Go would issue holds exactly the names hwkey compared, IPv4 in 4 bytes.
    let issued = hex_decode(&go.issued_san);
    match san::read_names(&issued) {
        Ok(read) if read == *names => {
            for ip in names.ips.iter().filter(|ip| ip.is_ipv4()) {
                let four = match ip {
                    IpAddr::V4(v4) => v4.octets(),
                    IpAddr::V6(_) => unreachable!(),
                };
                let mut needle = vec![0x87, 4];
                needle.extend(four);
                if !issued.windows(6).any(|w| w == needle) {
                    diffs.push(format!("issued: {ip} is not in its 4-byte form"));
                }
            }
        }
        other => diffs.push(format!("issued SAN {}: {other:?}", go.issued_san)),
    }
    diffs
}

fn hex_decode(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .filter_map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok())
        .collect()
}

#[test]
fn whenever_hwkey_accepts_a_requests_names_go_reads_and_issues_exactly_those() {
    let oracle = GoOracle::build();
    let key = SoftwareKey::generate();
    let mut rng = Rng(0x7361_6e73);
    let requests: Vec<Vec<u8>> = (0..cases())
        .map(|_| request(&key, san_value(&mut rng)))
        .collect();
    let readings = oracle.read_der(&requests);
    let (mut accepted, mut refused, mut go_refused, mut failures) = (0, 0, 0, Vec::new());
    let mut mapped = 0;
    for (der, go) in requests.iter().zip(&readings) {
        go_refused += usize::from(!go.error.is_empty());
        match ours(der) {
            Some(Ok(names)) => {
                accepted += 1;
                let v4_in_16 = [0x87, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
                mapped += usize::from(der.windows(14).any(|w| w == v4_in_16));
                let diffs = differences(&names, go);
                if !diffs.is_empty() {
                    failures.push(format!("request {}:\n  {}", hex(der), diffs.join("\n  ")));
                }
            }
            Some(Err(_)) | None => refused += 1,
        }
    }
    eprintln!(
        "san oracle: {} cases, hwkey accepted {accepted} and refused {refused}, Go refused {go_refused}, {} difference(s)",
        requests.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} accepted request(s) whose names Go reads or issues differently:\n{}",
        failures.len(),
        failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Not vacuous: both sides are covered, and so is the 16-byte form of an IPv4 address.
    assert!(
        accepted * 10 >= requests.len() && refused * 10 >= requests.len(),
        "{accepted} accepted, {refused} refused of {}",
        requests.len()
    );
    assert!(
        mapped > 0,
        "no accepted case held an IPv4 address in 16 bytes"
    );
}
