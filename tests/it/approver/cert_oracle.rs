//! Issue 50, finding 4: a certificate attached to a request (a person's current certificate,
//! the same-key proof) is read as kube-apiserver reads it. The approver's strict certificate
//! reader (`hwkey::pki::certificate`) is compared with Go's `x509.ParseCertificate`
//! (`hsm-fixtures/csr-oracle.go --cert`) on certificates mutated the ways an attacker would
//! try: empty, multi-valued, duplicated and reordered RDNs (an empty RDN once hid a CN from
//! x509-parser), other string and attribute types, other time forms, duplicated, unknown
//! critical and explicitly non-critical extensions, unique identifiers, another version,
//! long-form and indefinite lengths and bytes left over anywhere.
//!
//! **Whenever hwkey reads a certificate, Go reads the same one**: no parse error, the same RDNs
//! (so the same last CN and O list, the user and groups kube-apiserver authenticates), the same
//! subject and key bytes, the same validity and the same extensions. A fixed seed and 3,000
//! cases in the suite; `HWKEY_ORACLE_CASES` runs more.

use support::oracle::{GoOracle, GoReading};
use support::requests::{self as rq, tag, Length, Node, SoftwareKey};

use hwkey::pki::certificate::Certificate;

use super::oracle::{
    atv_of, cases, children, count_constructed, hex, nth_constructed, Rng, VALUES,
};

/// `tbsCertificate` of a person's client certificate as kube-controller-manager issues it.
fn base_tbs(key: &SoftwareKey) -> Node {
    Node::seq(vec![
        Node::cons(tag::CONTEXT_0, vec![Node::Prim(tag::INTEGER, vec![2])]),
        Node::Prim(tag::INTEGER, vec![0x01, 0x23]),
        Node::seq(vec![Node::oid(&[1, 2, 840, 10045, 4, 3, 2])]),
        Node::seq(vec![Node::rdn(rq::CN, tag::UTF8, "cluster CA")]),
        Node::seq(vec![
            Node::Prim(0x17, b"250101000000Z".to_vec()),
            Node::Prim(0x18, b"20991231235959Z".to_vec()),
        ]),
        Node::seq(vec![
            Node::rdn(rq::O, tag::UTF8, "devs"),
            Node::rdn(rq::CN, tag::UTF8, "alice"),
        ]),
        Node::Raw(key.spki()),
        Node::cons(
            0xa3,
            vec![Node::seq(vec![
                rq::extension(rq::KEY_USAGE, Some(true), vec![0x03, 0x02, 0x05, 0xa0]),
                rq::extension(rq::EXT_KEY_USAGE, None, rq::client_auth_eku()),
            ])],
        ),
    ])
}

/// Field `i` of the base layout (0 version, … 4 validity, 5 subject), wherever a removed
/// version moved it.
fn field(tbs: &mut Node, i: usize) -> Option<&mut Node> {
    let f = children(tbs)?;
    let versioned = matches!(f.first(), Some(Node::Cons(tag::CONTEXT_0, ..)));
    let at = if versioned { i } else { i.checked_sub(1)? };
    f.get_mut(at)
}

/// The subject's RDNs; None once mutations moved it out of reach.
fn subject(tbs: &mut Node) -> Option<&mut Vec<Node>> {
    field(tbs, 5).and_then(children)
}

/// The extensions SEQUENCE, when the certificate still has one.
fn extensions(tbs: &mut Node) -> Option<&mut Vec<Node>> {
    children(tbs)?
        .iter_mut()
        .find(|n| matches!(n, Node::Cons(0xa3, ..)))
        .and_then(children)
        .and_then(|e| e.get_mut(0))
        .and_then(children)
}

/// Times in the forms Go writes and in others it may or may not take.
const TIMES: &[(u8, &[u8])] = &[
    (0x17, b"250101000000Z"),
    (0x17, b"2501010000Z"),
    (0x17, b"250101000000+0100"),
    (0x17, b"491231235959Z"),
    (0x17, b"500101000000Z"),
    (0x17, b"251301000000Z"),
    (0x18, b"20250101000000Z"),
    (0x18, b"20250101000000.5Z"),
    (0x18, b"19991231235959Z"),
    (0x18, b"2025010100Z"),
    (0x04, b"250101000000Z"),
];

/// One random mutation of the certificate's `tbs` (`trailing`: bytes after the certificate).
fn mutate(rng: &mut Rng, tbs: &mut Node, trailing: &mut Vec<u8>) {
    match rng.below(20) {
        0 => {
            let Some(s) = subject(tbs) else { return };
            let at = rng.below(s.len() + 1);
            s.insert(at, Node::set(vec![]));
        }
        1 => {
            let Some(s) = subject(tbs) else { return };
            if !s.is_empty() {
                let copy = s[rng.below(s.len())].clone();
                s.insert(rng.below(s.len() + 1), copy);
            }
        }
        2 => {
            let Some(s) = subject(tbs) else { return };
            if s.len() >= 2 {
                let b = s.remove(1);
                if let (Some(a), Node::Cons(_, mut bc, _, _)) = (children(&mut s[0]), b) {
                    a.append(&mut bc);
                }
            }
        }
        3 => {
            let t = [
                tag::PRINTABLE,
                tag::IA5,
                tag::T61,
                tag::BMP,
                tag::UNIVERSAL,
                tag::OCTET_STRING,
                tag::UTF8,
            ][rng.below(7)];
            let Some(s) = subject(tbs) else { return };
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                if let Some(Node::Prim(_, value)) = atv.get(1).cloned() {
                    atv[1] = Node::string(t, &String::from_utf8_lossy(&value));
                }
            }
        }
        4 => {
            let oid: &[u64] = [rq::CN, rq::O, rq::OU, &[2, 5, 4, 5], &[1, 2, 3]][rng.below(5)];
            let Some(s) = subject(tbs) else { return };
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                atv[0] = Node::oid(oid);
            }
        }
        5 | 6 => {
            let value = ["alice", "root", "system:masters", "bob"]
                .get(rng.below(5))
                .copied()
                .unwrap_or(VALUES[rng.below(VALUES.len())]);
            let t = if rng.chance(50) {
                tag::UTF8
            } else {
                tag::PRINTABLE
            };
            let oid = if rng.chance(60) { rq::CN } else { rq::O };
            let Some(s) = subject(tbs) else { return };
            let at = rng.below(s.len() + 1);
            if rng.chance(50) && !s.is_empty() {
                let i = rng.below(s.len());
                s[i] = Node::rdn(oid, t, value);
            } else {
                s.insert(at, Node::rdn(oid, t, value));
            }
        }
        7 => {
            let Some(s) = subject(tbs) else { return };
            if !s.is_empty() {
                let i = rng.below(s.len());
                if rng.chance(50) {
                    s.remove(i);
                } else {
                    let j = rng.below(s.len());
                    s.swap(i, j);
                }
            }
        }
        8 => {
            let Some(s) = subject(tbs) else { return };
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                atv.push(Node::string(tag::UTF8, "root"));
            }
        }
        9 | 10 => {
            let (t, text) = TIMES[rng.below(TIMES.len())];
            let which = rng.below(2);
            if let Some(times) = field(tbs, 4).and_then(children) {
                times[which] = Node::Prim(t, text.to_vec());
            }
        }
        11 => {
            if let Some(e) = extensions(tbs).filter(|e| !e.is_empty()) {
                let copy = e[rng.below(e.len())].clone();
                e.push(copy);
            }
        }
        12 => {
            if let Some(e) = extensions(tbs) {
                e.push(match rng.below(3) {
                    0 => rq::extension(&[1, 2, 3, 4], Some(true), vec![0x05, 0x00]),
                    1 => rq::extension(&[1, 2, 3, 4], None, vec![0x05, 0x00]),
                    _ => rq::extension(rq::SAN, None, rq::dns_san("alice.example.com")),
                });
            }
        }
        13 => {
            if let Some(first) = extensions(tbs)
                .and_then(|e| e.get_mut(1))
                .and_then(children)
            {
                let explicit =
                    Node::Prim(tag::BOOLEAN, vec![if rng.chance(50) { 0 } else { 0xff }]);
                first.insert(1, explicit);
            }
        }
        14 => {
            let f = children(tbs).expect("tbs");
            if rng.chance(50) {
                f.retain(|n| !matches!(n, Node::Cons(0xa3, ..)));
            } else if let Some(e) = extensions(tbs) {
                e.clear();
            }
        }
        15 => {
            let f = children(tbs).expect("tbs");
            match rng.below(3) {
                0 => f[0] = Node::cons(tag::CONTEXT_0, vec![Node::Prim(tag::INTEGER, vec![0])]),
                1 => {
                    f.remove(0);
                }
                _ => {
                    let at = f.len().min(7);
                    f.insert(at, Node::Prim(0x81, vec![0x00, 0x01]));
                }
            }
        }
        16 | 17 => {
            let mut n = rng.below(count_constructed(tbs).max(1));
            if let Some(Node::Cons(_, _, form, trailing)) = nth_constructed(tbs, &mut n) {
                match rng.below(3) {
                    0 => *form = Length::Long,
                    1 => *form = Length::Indefinite,
                    _ => trailing.extend_from_slice(&[0x05, 0x00]),
                }
            }
        }
        18 => trailing.push(0x00),
        _ => {
            // Another extended key usage: server auth only, or a value that is no SEQUENCE.
            if let Some(e) = extensions(tbs) {
                let value = if rng.chance(50) {
                    Node::seq(vec![Node::oid(&[1, 3, 6, 1, 5, 5, 7, 3, 1])]).encode()
                } else {
                    vec![0x05, 0x00]
                };
                if let Some(slot) = e.get_mut(1) {
                    *slot = rq::extension(rq::EXT_KEY_USAGE, None, value);
                }
            }
        }
    }
}

/// The certificate's DER: `tbs` signed by `ca`, then `trailing`.
fn signed(tbs: &Node, ca: &SoftwareKey, trailing: &[u8]) -> Vec<u8> {
    let tbs = tbs.encode();
    let mut bits = vec![0u8];
    bits.extend(ca.sign(&tbs));
    let mut der = Node::seq(vec![
        Node::Raw(tbs),
        Node::seq(vec![Node::oid(&[1, 2, 840, 10045, 4, 3, 2])]),
        Node::Prim(tag::BIT_STRING, bits),
    ])
    .encode();
    der.extend_from_slice(trailing);
    der
}

/// Where hwkey's reading of an accepted certificate and Go's differ, in words.
fn differences(cert: &Certificate, go: &GoReading) -> Vec<String> {
    let mut diffs = Vec::new();
    let mut differ = |what: &str, ours: String, theirs: String| {
        if ours != theirs {
            diffs.push(format!("{what}: hwkey {ours:?}, Go {theirs:?}"));
        }
    };
    differ("parse", String::new(), go.error.clone());
    let ours: Vec<Vec<(String, Option<String>)>> = cert
        .subject
        .iter()
        .map(|a| vec![(a.oid.to_string(), Some(a.value.clone()))])
        .collect();
    let theirs: Vec<Vec<(String, Option<String>)>> = go
        .rdns
        .iter()
        .map(|rdn| {
            rdn.iter()
                .map(|a| (a.oid.clone(), a.value.clone()))
                .collect()
        })
        .collect();
    differ("RDNs", format!("{ours:?}"), format!("{theirs:?}"));
    let cns = cert.subject_values(&[2, 5, 4, 3]);
    differ(
        "CN (the user)",
        cns.last().copied().unwrap_or_default().to_string(),
        go.common_name.clone(),
    );
    differ(
        "O (the groups)",
        format!("{:?}", cert.subject_values(&[2, 5, 4, 10])),
        format!("{:?}", go.organization),
    );
    differ("subject", hex(cert.subject_der()), go.raw_subject.clone());
    differ("key", hex(cert.spki_der()), go.raw_spki.clone());
    differ(
        "validity",
        format!("{}..{}", cert.not_before, cert.not_after),
        format!("{}..{}", go.not_before, go.not_after),
    );
    differ(
        "extensions",
        format!(
            "{:?}",
            cert.extensions
                .iter()
                .map(|e| (e.oid.to_string(), e.critical, hex(&e.value)))
                .collect::<Vec<_>>()
        ),
        format!(
            "{:?}",
            go.extensions
                .iter()
                .map(|e| (e.id.clone(), e.critical, e.value.clone()))
                .collect::<Vec<_>>()
        ),
    );
    diffs
}

#[test]
fn whenever_hwkey_reads_an_attached_certificate_go_reads_the_same_identity() {
    let oracle = GoOracle::build();
    let (key, ca) = (SoftwareKey::generate(), SoftwareKey::generate());
    let mut rng = Rng(0x6869_7665_6365_7274);
    let n = cases();
    let certificates: Vec<Vec<u8>> = (0..n)
        .map(|_| {
            let mut tbs = base_tbs(&key);
            let mut trailing = Vec::new();
            let mutations = if rng.chance(15) { 0 } else { 1 + rng.below(3) };
            for _ in 0..mutations {
                mutate(&mut rng, &mut tbs, &mut trailing);
            }
            signed(&tbs, &ca, &trailing)
        })
        .collect();
    let go = oracle.read_certificates(&certificates);
    let (mut accepted, mut refused, mut failures) = (0, 0, Vec::new());
    for (der, go) in certificates.iter().zip(&go) {
        match Certificate::from_der(der) {
            Ok(cert) => {
                accepted += 1;
                let diffs = differences(&cert, go);
                if !diffs.is_empty() {
                    failures.push(format!("{}\n  {}", hex(der), diffs.join("\n  ")));
                }
            }
            Err(_) => refused += 1,
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} certificates hwkey reads otherwise than Go (first 3):\n{}",
        failures.len(),
        failures[..failures.len().min(3)].join("\n")
    );
    // Both sides of the property are exercised: many certificates read, many refused.
    assert!(accepted >= n / 10, "only {accepted} of {n} read");
    assert!(refused >= n / 10, "only {refused} of {n} refused");
    // The base certificate itself is read (and alike).
    let plain = signed(&base_tbs(&key), &ca, &[]);
    let cert = Certificate::from_der(&plain).expect("the base certificate");
    assert_eq!(cert.subject_values(&[2, 5, 4, 3]), ["alice"]);
}
