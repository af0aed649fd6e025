//! PKCS#10 requests built by hand, for the attack and differential tests: an ASN.1 tree whose
//! every element can be encoded the odd ways an attacker would try (long-form and indefinite
//! lengths, bytes left over inside a SET or SEQUENCE), then signed over exactly the bytes it
//! encodes to. No parser of hwkey's is used to build them.

/// How an element's length is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// The shortest definite form (DER).
    Der,
    /// A long form with a leading zero byte (`0x82 0x00 NN`): BER, not DER.
    Long,
    /// Indefinite, closed by an end-of-contents (BER; constructed elements only).
    Indefinite,
}

/// One ASN.1 element.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A primitive element: its tag byte and contents.
    Prim(u8, Vec<u8>),
    /// A constructed element: its tag byte, children, how its length is written, and bytes
    /// appended after its children inside it.
    Cons(u8, Vec<Node>, Length, Vec<u8>),
    /// Bytes already encoded, taken as they are.
    Raw(Vec<u8>),
}

/// Tag bytes used below.
pub mod tag {
    /// BOOLEAN.
    pub const BOOLEAN: u8 = 0x01;
    /// INTEGER.
    pub const INTEGER: u8 = 0x02;
    /// BIT STRING.
    pub const BIT_STRING: u8 = 0x03;
    /// OCTET STRING.
    pub const OCTET_STRING: u8 = 0x04;
    /// NULL.
    pub const NULL: u8 = 0x05;
    /// OBJECT IDENTIFIER.
    pub const OID: u8 = 0x06;
    /// UTF8String.
    pub const UTF8: u8 = 0x0c;
    /// PrintableString.
    pub const PRINTABLE: u8 = 0x13;
    /// T61String.
    pub const T61: u8 = 0x14;
    /// IA5String.
    pub const IA5: u8 = 0x16;
    /// UniversalString.
    pub const UNIVERSAL: u8 = 0x1c;
    /// BMPString.
    pub const BMP: u8 = 0x1e;
    /// SEQUENCE.
    pub const SEQUENCE: u8 = 0x30;
    /// SET.
    pub const SET: u8 = 0x31;
    /// `[0]` constructed (a request's attributes).
    pub const CONTEXT_0: u8 = 0xa0;
}

fn length(out: &mut Vec<u8>, len: usize, form: Length) {
    match form {
        Length::Der | Length::Indefinite if len < 0x80 => out.push(len as u8),
        Length::Long => {
            out.extend_from_slice(&[0x83, 0x00]);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            let bytes = (len as u32).to_be_bytes();
            let skip = bytes.iter().take_while(|b| **b == 0).count();
            out.push(0x80 | (4 - skip) as u8);
            out.extend_from_slice(&bytes[skip..]);
        }
    }
}

impl Node {
    /// The element's encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Node::Raw(bytes) => out.extend_from_slice(bytes),
            Node::Prim(t, content) => {
                out.push(*t);
                length(&mut out, content.len(), Length::Der);
                out.extend_from_slice(content);
            }
            Node::Cons(t, children, form, trailing) => {
                let mut inner: Vec<u8> = children.iter().flat_map(Node::encode).collect();
                inner.extend_from_slice(trailing);
                out.push(*t);
                if *form == Length::Indefinite {
                    out.push(0x80);
                    out.extend_from_slice(&inner);
                    out.extend_from_slice(&[0, 0]);
                } else {
                    length(&mut out, inner.len(), *form);
                    out.extend_from_slice(&inner);
                }
            }
        }
        out
    }

    /// A constructed element in DER.
    pub fn cons(t: u8, children: Vec<Node>) -> Node {
        Node::Cons(t, children, Length::Der, Vec::new())
    }

    /// A SEQUENCE in DER.
    pub fn seq(children: Vec<Node>) -> Node {
        Node::cons(tag::SEQUENCE, children)
    }

    /// A SET in DER (children in the order given).
    pub fn set(children: Vec<Node>) -> Node {
        Node::cons(tag::SET, children)
    }

    /// An OBJECT IDENTIFIER.
    pub fn oid(arcs: &[u64]) -> Node {
        let mut content = vec![(arcs[0] * 40 + arcs[1]) as u8];
        for arc in &arcs[2..] {
            let mut groups = vec![(arc & 0x7f) as u8];
            let mut rest = arc >> 7;
            while rest > 0 {
                groups.push(0x80 | (rest & 0x7f) as u8);
                rest >>= 7;
            }
            groups.reverse();
            content.extend(groups);
        }
        Node::Prim(tag::OID, content)
    }

    /// A string of type `t` holding `text` (BMPString as UTF-16, UniversalString as UTF-32).
    pub fn string(t: u8, text: &str) -> Node {
        let content = match t {
            tag::BMP => text.encode_utf16().flat_map(u16::to_be_bytes).collect(),
            tag::UNIVERSAL => text
                .chars()
                .flat_map(|c| (c as u32).to_be_bytes())
                .collect(),
            _ => text.as_bytes().to_vec(),
        };
        Node::Prim(t, content)
    }

    /// One subject RDN with one attribute (`oid` = `text` as a string of type `t`).
    pub fn rdn(oid: &[u64], t: u8, text: &str) -> Node {
        Node::set(vec![Node::seq(vec![Node::oid(oid), Node::string(t, text)])])
    }
}

/// Common name.
pub const CN: &[u64] = &[2, 5, 4, 3];
/// Organization.
pub const O: &[u64] = &[2, 5, 4, 10];
/// Organizational unit.
pub const OU: &[u64] = &[2, 5, 4, 11];
/// PKCS#9 extensionRequest.
pub const EXTENSION_REQUEST: &[u64] = &[1, 2, 840, 113549, 1, 9, 14];
/// PKCS#9 challengePassword.
pub const CHALLENGE_PASSWORD: &[u64] = &[1, 2, 840, 113549, 1, 9, 7];
/// subjectAltName.
pub const SAN: &[u64] = &[2, 5, 29, 17];
/// keyUsage.
pub const KEY_USAGE: &[u64] = &[2, 5, 29, 15];
/// extKeyUsage.
pub const EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];

/// One requested extension (`critical`: None leaves the DEFAULT out, as DER requires for false).
pub fn extension(oid: &[u64], critical: Option<bool>, value: Vec<u8>) -> Node {
    let mut children = vec![Node::oid(oid)];
    if let Some(c) = critical {
        children.push(Node::Prim(tag::BOOLEAN, vec![if c { 0xff } else { 0 }]));
    }
    children.push(Node::Prim(tag::OCTET_STRING, value));
    Node::seq(children)
}

/// The value of an extKeyUsage of client auth alone.
pub fn client_auth_eku() -> Vec<u8> {
    Node::seq(vec![Node::oid(&[1, 3, 6, 1, 5, 5, 7, 3, 2])]).encode()
}

/// The value of a keyUsage of digital signature and key encipherment.
pub fn node_key_usage() -> Vec<u8> {
    Node::Prim(tag::BIT_STRING, vec![0x05, 0xa0]).encode()
}

/// A SAN value with one dNSName.
pub fn dns_san(name: &str) -> Vec<u8> {
    Node::seq(vec![Node::Prim(0x82, name.as_bytes().to_vec())]).encode()
}

/// An extensionRequest attribute holding `extensions`.
pub fn extension_request(extensions: Vec<Node>) -> Node {
    Node::seq(vec![
        Node::oid(EXTENSION_REQUEST),
        Node::set(vec![Node::seq(extensions)]),
    ])
}

/// A request's parts, to be encoded and signed.
#[derive(Debug, Clone)]
pub struct RequestTree {
    /// The whole CertificationRequestInfo: `SEQUENCE { version, subject, spki, [0] attrs }`.
    pub info: Node,
}

impl RequestTree {
    /// A request for `subject` (a Name element) and `spki` (DER) with `attributes`.
    pub fn new(subject: Node, spki: &[u8], attributes: Vec<Node>) -> RequestTree {
        RequestTree {
            info: Node::seq(vec![
                Node::Prim(tag::INTEGER, vec![0]),
                subject,
                Node::Raw(spki.to_vec()),
                Node::cons(tag::CONTEXT_0, attributes),
            ]),
        }
    }

    /// The request's DER: the info as encoded, an ECDSA-with-SHA256 algorithm and `sign`'s
    /// signature over exactly the info's bytes. `trailing` goes after the request.
    pub fn signed(&self, sign: impl FnOnce(&[u8]) -> Vec<u8>, trailing: &[u8]) -> Vec<u8> {
        let info = self.info.encode();
        let signature = sign(&info);
        let mut bits = vec![0u8];
        bits.extend_from_slice(&signature);
        let mut der = Node::seq(vec![
            Node::Raw(info),
            Node::seq(vec![Node::oid(&[1, 2, 840, 10045, 4, 3, 2])]),
            Node::Prim(tag::BIT_STRING, bits),
        ])
        .encode();
        der.extend_from_slice(trailing);
        der
    }
}

/// A software P-256 key that signs requests (ECDSA, DER signatures).
pub struct SoftwareKey {
    pair: ring::signature::EcdsaKeyPair,
    rng: ring::rand::SystemRandom,
}

impl SoftwareKey {
    /// A new key.
    pub fn generate() -> SoftwareKey {
        let rng = ring::rand::SystemRandom::new();
        let alg = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
        let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("key");
        let pair =
            ring::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("key");
        SoftwareKey { pair, rng }
    }

    /// Its SubjectPublicKeyInfo (DER).
    pub fn spki(&self) -> Vec<u8> {
        use ring::signature::KeyPair;
        let point = self.pair.public_key().as_ref().to_vec();
        let mut bits = vec![0u8];
        bits.extend(point);
        Node::seq(vec![
            Node::seq(vec![
                Node::oid(&[1, 2, 840, 10045, 2, 1]),
                Node::oid(&[1, 2, 840, 10045, 3, 1, 7]),
            ]),
            Node::Prim(tag::BIT_STRING, bits),
        ])
        .encode()
    }

    /// An ECDSA signature over `message`.
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.pair
            .sign(&self.rng, message)
            .expect("sign")
            .as_ref()
            .to_vec()
    }
}

/// `der` as a PEM CERTIFICATE REQUEST.
pub fn pem(der: &[u8]) -> String {
    pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der.to_vec()))
}
