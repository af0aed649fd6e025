//! Issue 34: the approver decides on exactly the identity Go reads. kube-controller-manager
//! signs from Go's `x509.ParseCertificateRequest`, so the property is checked against Go
//! itself (`hsm-fixtures/csr-oracle.go`), on requests mutated the ways an attacker would try:
//! empty, multi-valued, duplicated and reordered RDNs, other string types and attribute
//! types, long-form and indefinite lengths, bytes left inside SETs and SEQUENCEs and after the
//! request, extra and duplicated attributes and extensions, explicit and true criticality,
//! subject alternative names, another version.
//!
//! **Whenever the approver's policy accepts a request, Go reads exactly the identity the
//! policy checked**: one CN `system:node:NODE` (the one the policy named), O exactly
//! `[system:nodes]`, no other name field and no SAN, the very subject and key bytes the TPM
//! evidence binds, the same extensions, and the same verdict on the request's signature. A
//! fixed seed and 3,000 DER cases plus 1,000 PEM cases in the suite; `HWKEY_ORACLE_CASES`
//! runs more.

use support::oracle::{GoOracle, GoReading};
use support::requests::{self as rq, tag, Length, Node, RequestTree, SoftwareKey};

use hwkey::approver::policy;
use hwkey::pki::request::Request;

/// SplitMix64: a fixed, transparent sequence (a failure prints the case's bytes).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// The RDNs of a node's subject, each `(type, string tag, value)`.
fn node_rdns(node: &str) -> Vec<Node> {
    vec![
        rq::Node::rdn(rq::O, tag::UTF8, "system:nodes"),
        rq::Node::rdn(rq::CN, tag::UTF8, &format!("system:node:{node}")),
    ]
}

/// A request as kubelet or hwkey would make it: subject, key usage and client-auth EKU.
fn base(key: &SoftwareKey) -> RequestTree {
    RequestTree::new(
        Node::seq(node_rdns("node-a")),
        &key.spki(),
        vec![rq::extension_request(vec![
            rq::extension(rq::KEY_USAGE, None, rq::node_key_usage()),
            rq::extension(rq::EXT_KEY_USAGE, None, rq::client_auth_eku()),
        ])],
    )
}

/// The children of the info's subject, attributes, or a constructed node.
pub(super) fn children(node: &mut Node) -> Option<&mut Vec<Node>> {
    match node {
        Node::Cons(_, c, _, _) => Some(c),
        _ => None,
    }
}

fn subject(tree: &mut RequestTree) -> &mut Vec<Node> {
    children(&mut children(&mut tree.info).expect("info")[1]).expect("subject")
}

fn attributes(tree: &mut RequestTree) -> &mut Vec<Node> {
    children(&mut children(&mut tree.info).expect("info")[3]).expect("attributes")
}

/// How many constructed elements `node` holds, itself included.
pub(super) fn count_constructed(node: &Node) -> usize {
    match node {
        Node::Cons(_, c, _, _) => 1 + c.iter().map(count_constructed).sum::<usize>(),
        _ => 0,
    }
}

/// The children (type, value) of the attribute of RDN `i` in `rdns`, if it has that shape.
pub(super) fn atv_of(rdns: &mut [Node], i: usize) -> Option<&mut Vec<Node>> {
    rdns.get_mut(i)
        .and_then(children)
        .and_then(|a| a.get_mut(0))
        .and_then(children)
}

/// The `n`-th constructed element of `node`, depth first.
pub(super) fn nth_constructed<'a>(node: &'a mut Node, n: &mut usize) -> Option<&'a mut Node> {
    if !matches!(node, Node::Cons(..)) {
        return None;
    }
    if *n == 0 {
        return Some(node);
    }
    *n -= 1;
    match node {
        Node::Cons(_, c, _, _) => c.iter_mut().find_map(|child| nth_constructed(child, n)),
        _ => None,
    }
}

pub(super) const VALUES: &[&str] = &[
    "system:node:node-a",
    "system:node:node-b",
    "system:nodes",
    "system:masters",
    "system:node:",
    "system:node:node-a ",
    "SYSTEM:NODE:NODE-A",
    "system:node:node-a\u{0}",
    "system:node:n\u{e9}ud",
    "",
];

/// One random mutation of `tree` (`trailing`: bytes to put after the whole request).
fn mutate(rng: &mut Rng, tree: &mut RequestTree, trailing: &mut Vec<u8>) {
    match rng.below(22) {
        // The subject.
        0 => {
            let s = subject(tree);
            let at = rng.below(s.len() + 1);
            s.insert(at, Node::set(vec![]));
        }
        1 => {
            let s = subject(tree);
            if !s.is_empty() {
                let i = rng.below(s.len());
                let copy = s[i].clone();
                s.insert(rng.below(s.len() + 1), copy);
            }
        }
        2 => {
            let s = subject(tree);
            if s.len() >= 2 {
                let b = s.remove(1);
                if let (Some(a), Node::Cons(_, mut bc, _, _)) = (children(&mut s[0]), b) {
                    a.append(&mut bc);
                }
            }
        }
        3 | 4 => {
            let t = [
                tag::PRINTABLE,
                tag::IA5,
                tag::T61,
                tag::BMP,
                tag::UNIVERSAL,
                tag::OCTET_STRING,
                tag::UTF8,
            ][rng.below(7)];
            let s = subject(tree);
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                if let Some(Node::Prim(_, value)) = atv.get(1).cloned() {
                    let text = String::from_utf8_lossy(&value).into_owned();
                    atv[1] = Node::string(t, &text);
                }
            }
        }
        5 => {
            let oid: &[u64] = [
                rq::CN,
                rq::O,
                rq::OU,
                &[2, 5, 4, 5],
                &[2, 5, 4, 6],
                &[1, 2, 3],
            ][rng.below(6)];
            let s = subject(tree);
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                atv[0] = Node::oid(oid);
            }
        }
        6 | 7 => {
            let value = VALUES[rng.below(VALUES.len())];
            let t = if rng.chance(50) {
                tag::UTF8
            } else {
                tag::PRINTABLE
            };
            let oid = if rng.chance(60) { rq::CN } else { rq::O };
            let s = subject(tree);
            let at = rng.below(s.len() + 1);
            if rng.chance(50) && !s.is_empty() {
                let i = rng.below(s.len());
                s[i] = Node::rdn(oid, t, value);
            } else {
                s.insert(at, Node::rdn(oid, t, value));
            }
        }
        8 => {
            let s = subject(tree);
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
        9 => {
            // An extra element inside an attribute, or the value as a constructed element.
            let s = subject(tree);
            let i = rng.below(s.len().max(1));
            if let Some(atv) = atv_of(s, i) {
                atv.push(Node::string(tag::UTF8, "system:node:node-b"));
            }
        }
        10 => {
            // The subject as a SET, or its RDN SETs as SEQUENCEs.
            let info = children(&mut tree.info).expect("info");
            if let Node::Cons(t, _, _, _) = &mut info[1] {
                *t = tag::SET;
            }
        }
        // The attributes.
        11 => attributes(tree).push(rq::extension_request(vec![rq::extension(
            rq::SAN,
            None,
            rq::dns_san("kubernetes.default.svc"),
        )])),
        12 => {
            let a = attributes(tree);
            if let Some(ext) = a
                .get_mut(0)
                .and_then(children)
                .and_then(|x| x.get_mut(1))
                .and_then(children)
                .and_then(|v| v.get_mut(0))
                .and_then(children)
            {
                let which = rng.below(4);
                ext.push(match which {
                    0 => rq::extension(rq::SAN, None, rq::dns_san("node-b")),
                    1 => rq::extension(rq::EXT_KEY_USAGE, None, rq::client_auth_eku()),
                    2 => rq::extension(
                        &[2, 5, 29, 19],
                        Some(true),
                        vec![0x30, 0x03, 0x01, 0x01, 0xff],
                    ),
                    _ => rq::extension(rq::KEY_USAGE, Some(true), rq::node_key_usage()),
                });
            }
        }
        13 => {
            let a = attributes(tree);
            if let Some(ext) = a
                .get_mut(0)
                .and_then(children)
                .and_then(|x| x.get_mut(1))
                .and_then(children)
                .and_then(|v| v.get_mut(0))
                .and_then(children)
            {
                if let Some(first) = ext.get_mut(0).and_then(children) {
                    let explicit =
                        Node::Prim(tag::BOOLEAN, vec![if rng.chance(50) { 0 } else { 0xff }]);
                    first.insert(1, explicit);
                }
            }
        }
        14 => {
            // A second value in the extension request's SET.
            let a = attributes(tree);
            if let Some(values) = a
                .get_mut(0)
                .and_then(children)
                .and_then(|x| x.get_mut(1))
                .and_then(children)
            {
                values.push(Node::seq(vec![rq::extension(
                    rq::SAN,
                    None,
                    rq::dns_san("node-b"),
                )]));
            }
        }
        15 => {
            let at = rng.below(attributes(tree).len() + 1);
            attributes(tree).insert(
                at,
                Node::seq(vec![
                    Node::oid(rq::CHALLENGE_PASSWORD),
                    Node::set(vec![Node::string(tag::UTF8, "secret")]),
                ]),
            );
        }
        16 => {
            let a = attributes(tree);
            if !a.is_empty() {
                if rng.chance(50) {
                    a.clear();
                } else if let Some(values) = a
                    .get_mut(0)
                    .and_then(children)
                    .and_then(|x| x.get_mut(1))
                    .and_then(children)
                {
                    values.clear();
                }
            }
        }
        // Encodings.
        17 | 18 => {
            let mut n = rng.below(count_constructed(&tree.info).max(1));
            if let Some(Node::Cons(_, _, form, trailing)) = nth_constructed(&mut tree.info, &mut n)
            {
                match rng.below(3) {
                    0 => *form = Length::Long,
                    1 => *form = Length::Indefinite,
                    _ => trailing.extend_from_slice(&[0x05, 0x00]),
                }
            }
        }
        19 => trailing.extend_from_slice(&[0x00]),
        20 => {
            // Version 1, or 0 written in two bytes.
            let info = children(&mut tree.info).expect("info");
            info[0] = Node::Prim(
                tag::INTEGER,
                if rng.chance(50) { vec![1] } else { vec![0, 0] },
            );
        }
        _ => {
            // A SAN of another kind in the one extension request.
            let a = attributes(tree);
            if let Some(ext) = a
                .get_mut(0)
                .and_then(children)
                .and_then(|x| x.get_mut(1))
                .and_then(children)
                .and_then(|v| v.get_mut(0))
                .and_then(children)
            {
                let kinds = [0x81u8, 0x86, 0x87];
                let k = kinds[rng.below(3)];
                let value = if k == 0x87 {
                    vec![10, 0, 0, 1]
                } else {
                    b"x@example.com".to_vec()
                };
                ext.push(rq::extension(
                    rq::SAN,
                    None,
                    Node::seq(vec![Node::Prim(k, value)]).encode(),
                ));
            }
        }
    }
}

/// One generated case: the request's DER.
fn case(rng: &mut Rng, key: &SoftwareKey) -> Vec<u8> {
    let mut tree = base(key);
    let mut trailing = Vec::new();
    // 0 to 3 mutations; a fifth of the cases stay as they are (and must be read alike).
    let n = if rng.chance(20) { 0 } else { 1 + rng.below(3) };
    for _ in 0..n {
        mutate(rng, &mut tree, &mut trailing);
    }
    tree.signed(|info| key.sign(info), &trailing)
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks the property for one accepted request; the differences found, in words.
fn differences(request: &Request, node: &str, go: &GoReading) -> Vec<String> {
    let mut diffs = Vec::new();
    let mut differ = |what: &str, ours: String, theirs: String| {
        if ours != theirs {
            diffs.push(format!("{what}: hwkey {ours:?}, Go {theirs:?}"));
        }
    };
    differ("parse", String::new(), go.error.clone());
    differ("CN", format!("system:node:{node}"), go.common_name.clone());
    differ(
        "O",
        "[\"system:nodes\"]".into(),
        format!("{:?}", go.organization),
    );
    let others = [
        &go.organizational_unit,
        &go.country,
        &go.locality,
        &go.province,
        &go.street_address,
        &go.postal_code,
        &go.dns_names,
        &go.emails,
        &go.ips,
        &go.uris,
    ];
    differ(
        "other name fields and SANs",
        "[]".into(),
        format!(
            "{:?}",
            others.iter().flat_map(|v| v.iter()).collect::<Vec<_>>()
        ),
    );
    differ("serialNumber", String::new(), go.serial_number.clone());
    differ(
        "raw subject (what evidence binds)",
        hex(request.subject_der()),
        go.raw_subject.clone(),
    );
    differ("raw key", hex(request.spki_der()), go.raw_spki.clone());
    differ(
        "issued key",
        hex(request.spki_der()),
        go.issued_spki.clone(),
    );
    let ours: Vec<(String, String)> = request
        .subject
        .iter()
        .map(|a| (a.oid.to_string(), a.value.clone()))
        .collect();
    let theirs: Vec<(String, String)> = go
        .rdns
        .iter()
        .flat_map(|set| {
            set.iter().map(|a| {
                (
                    a.oid.clone(),
                    a.value.clone().unwrap_or_else(|| "(not a string)".into()),
                )
            })
        })
        .collect();
    differ("RDNs", format!("{ours:?}"), format!("{theirs:?}"));
    differ(
        "one attribute per RDN",
        "true".into(),
        go.rdns.iter().all(|s| s.len() == 1).to_string(),
    );
    let ours: Vec<String> = request
        .extensions
        .iter()
        .map(|e| e.oid.to_string())
        .collect();
    let theirs: Vec<String> = go.extensions.iter().map(|e| e.id.clone()).collect();
    differ("extensions", format!("{ours:?}"), format!("{theirs:?}"));
    differ(
        "signature verdict",
        request.signature_verifies().to_string(),
        go.signature_valid.to_string(),
    );
    diffs
}

pub(super) fn cases() -> usize {
    std::env::var("HWKEY_ORACLE_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(3000)
}

#[test]
fn whenever_the_policy_accepts_a_request_go_reads_the_identity_it_checked() {
    let oracle = GoOracle::build();
    let key = SoftwareKey::generate();
    let mut rng = Rng(0x6877_6b65_7934);
    let requests: Vec<Vec<u8>> = (0..cases()).map(|_| case(&mut rng, &key)).collect();
    let readings = oracle.read_der(&requests);
    let (mut accepted, mut go_parsed, mut failures) = (0, 0, Vec::new());
    for (der, go) in requests.iter().zip(&readings) {
        go_parsed += usize::from(go.error.is_empty());
        let Ok(request) = Request::from_der(der.clone()) else {
            continue;
        };
        let Ok(identity) = policy::check_node_client(&request, None) else {
            continue;
        };
        accepted += 1;
        let diffs = differences(&request, &identity.node, go);
        if !diffs.is_empty() {
            failures.push(format!("request {}:\n  {}", hex(der), diffs.join("\n  ")));
        }
    }
    eprintln!(
        "csr oracle: {} cases, Go parsed {go_parsed}, hwkey's policy accepted {accepted}, {} difference(s)",
        requests.len(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} accepted request(s) that Go reads differently:\n{}",
        failures.len(),
        failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Not vacuous: a good share of the cases is accepted (and so compared), and a good share
    // is refused.
    assert!(
        accepted * 10 >= requests.len() && accepted * 10 <= requests.len() * 9,
        "{accepted} of {} accepted: the generator no longer covers both sides",
        requests.len()
    );
}

/// The PEM around a request: what the API server's pem.Decode finds must be the block hwkey
/// reads, or hwkey must refuse it.
#[test]
fn whenever_hwkey_reads_a_request_block_go_decodes_the_same_one() {
    let oracle = GoOracle::build();
    let key = SoftwareKey::generate();
    let mut rng = Rng(0x0070_656d);
    let other = base(&SoftwareKey::generate()).signed(|i| key.sign(i), &[]);
    let texts: Vec<Vec<u8>> = (0..cases() / 3)
        .map(|_| {
            let der = base(&key).signed(|i| key.sign(i), &[]);
            let mut text = rq::pem(&der).into_bytes();
            let junk: &[&[u8]] = &[
                b"x",
                b" ",
                b"\n",
                b"\r\n",
                b"-----BEGIN X-----\n",
                b"a: b\n",
                b"\t",
                b"=",
            ];
            for _ in 0..rng.below(3) {
                let at = rng.below(text.len() + 1);
                let piece = junk[rng.below(junk.len())];
                text.splice(at..at, piece.iter().copied());
            }
            if rng.chance(10) {
                let second = rq::pem(&other).into_bytes();
                if rng.chance(50) {
                    text.extend(second);
                } else {
                    text.splice(0..0, second);
                }
            }
            text
        })
        .collect();
    let readings = oracle.read_pem(&texts);
    let (mut accepted, mut failures) = (0, Vec::new());
    for (text, go) in texts.iter().zip(&readings) {
        let Ok(request) = Request::from_pem(text) else {
            continue;
        };
        accepted += 1;
        if !go.error.is_empty()
            || go.raw_subject != hex(request.subject_der())
            || go.raw_spki != hex(request.spki_der())
        {
            failures.push(format!(
                "{:?}: Go {:?}",
                String::from_utf8_lossy(text),
                go.error
            ));
        }
    }
    eprintln!(
        "csr oracle (PEM): {} cases, hwkey read {accepted}, {} difference(s)",
        texts.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        accepted > 0 && accepted < texts.len(),
        "{accepted} of {}",
        texts.len()
    );
}
