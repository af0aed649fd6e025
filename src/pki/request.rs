//! A PKCS#10 request read once, strictly, so that every check decides on exactly what Go reads.
//!
//! kube-apiserver and kube-controller-manager read `spec.request` with Go's `pem.Decode` and
//! `x509.ParseCertificateRequest`, and the signer issues the certificate from Go's
//! `pkix.Name`, which reads *every* RDN and keeps the last CN. A reader that stops early, skips
//! an empty RDN or tolerates another encoding can be shown one identity while Go issues another
//! (an empty `SET` once hid a second CN from x509-parser). So this reader accepts a narrow,
//! canonical subset of what Go accepts, and refuses everything else in words:
//!
//! - DER only: definite, minimal lengths, low tag numbers, primitive strings, nothing left over
//!   at any level (checked over the whole request before its structure is read);
//! - the subject is a SEQUENCE of SETs with exactly one attribute each, every value a
//!   UTF8String or PrintableString, and re-encoding what was read gives the same bytes;
//! - the attributes are an ordered SET, each with at least one value; the extension request's
//!   extensions are read here too, so no check reads them another way.
//!
//! Checks take a [`Request`], never DER: the evidence binds [`Request::subject_der`], the
//! exact bytes Go reports as `RawSubject` (`tests/it` compares both readers on mutated requests
//! with a Go program: `hsm-fixtures/csr-oracle.go`).

use std::ops::Range;

use yasna::models::ObjectIdentifier;
use yasna::Tag;

use super::request_pem;
use crate::key::SignScheme;

/// The largest `spec.request` read at all: an attested request with an EK certificate is about
/// 3 KiB; anything this large is refused before it is decoded.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// PKCS#9 `extensionRequest`.
pub const OID_EXTENSION_REQUEST: &[u64] = &[1, 2, 840, 113549, 1, 9, 14];
/// `subjectAltName`.
pub const OID_SUBJECT_ALT_NAME: &[u64] = &[2, 5, 29, 17];
/// OID of the key usage extension.
pub const OID_KEY_USAGE: &[u64] = &[2, 5, 29, 15];
/// OID of the extended key usage extension.
pub const OID_EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];
/// OID of the subject's common name.
pub const OID_COMMON_NAME: &[u64] = &[2, 5, 4, 3];
/// OID of the subject's organization.
pub const OID_ORGANIZATION: &[u64] = &[2, 5, 4, 10];

/// Why a request is not one this reader accepts: what was wrong, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum Malformed {
    #[error(
        "spec.request is {0} bytes: requests over {MAX_REQUEST_BYTES} bytes are refused unread"
    )]
    TooLarge(usize),
    #[error("{0}")]
    Pem(#[from] request_pem::NotOneBlock),
    #[error("the request is not DER: {0}")]
    NotDer(&'static str),
    #[error("the request does not have the structure of a PKCS#10 request ({0})")]
    Structure(String),
    #[error("the request's version is {0}, not 0 (v1)")]
    Version(u64),
    #[error("the subject has an empty RDN (a SET with no attribute): Go reads past it, so nothing after it may hide")]
    EmptyRdn,
    #[error("the subject has a multi-valued RDN ({0} attributes in one SET): each attribute must be its own RDN")]
    MultiValuedRdn(usize),
    #[error("subject attribute {oid} is {kind}, not a UTF8String or PrintableString")]
    StringKind { oid: String, kind: String },
    #[error("subject attribute {0} is a PrintableString with characters outside its alphabet")]
    NotPrintable(String),
    #[error("subject attribute {0} is a UTF8String that is not UTF-8")]
    NotUtf8(String),
    #[error("the subject is not in canonical DER (re-encoding it gives other bytes)")]
    NotCanonical,
    #[error("request attribute {0} has no value")]
    EmptyAttribute(String),
    #[error("the requested extensions do not parse: {0}")]
    Extensions(String),
    #[error("the signature algorithm {0} is not one hwkey verifies (ECDSA with SHA-256/384, RSA PKCS#1 with SHA-256/384/512)")]
    SignatureAlgorithm(String),
}

/// How a subject attribute's value is encoded (the only two Go writes and hwkey accepts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringKind {
    /// UTF8String.
    Utf8,
    /// PrintableString.
    Printable,
}

/// One RDN of the subject: exactly one attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectAttribute {
    /// Its type.
    pub oid: ObjectIdentifier,
    /// How its value was encoded.
    pub kind: StringKind,
    /// Its value.
    pub value: String,
}

/// One request attribute: its type and each value's DER (a SET of at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribute {
    /// Its type.
    pub oid: ObjectIdentifier,
    /// The DER of each value, in order.
    pub values: Vec<Vec<u8>>,
}

/// One requested extension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extension {
    /// Its type.
    pub oid: ObjectIdentifier,
    /// Whether it was marked critical.
    pub critical: bool,
    /// The OCTET STRING's contents.
    pub value: Vec<u8>,
}

/// A PKCS#10 request, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    der: Vec<u8>,
    info: Range<usize>,
    subject_der: Range<usize>,
    spki: Range<usize>,
    /// The subject's RDNs, in order, one attribute each.
    pub subject: Vec<SubjectAttribute>,
    /// The request attributes, in order.
    pub attributes: Vec<Attribute>,
    /// The extensions of every extension-request attribute, in order (duplicates included:
    /// the policies refuse them).
    pub extensions: Vec<Extension>,
    /// How many extension-request attributes there are.
    pub extension_requests: usize,
    scheme: SignScheme,
    signature: Vec<u8>,
}

impl Request {
    /// Reads `spec.request`: one PEM block ([`request_pem`]), at most [`MAX_REQUEST_BYTES`].
    pub fn from_pem(spec_request: &[u8]) -> Result<Request, Malformed> {
        if spec_request.len() > MAX_REQUEST_BYTES {
            return Err(Malformed::TooLarge(spec_request.len()));
        }
        Request::from_der(request_pem::single_request_block(spec_request)?)
    }

    /// Reads a request's DER strictly (see the module doc).
    pub fn from_der(der: Vec<u8>) -> Result<Request, Malformed> {
        if der.len() > MAX_REQUEST_BYTES {
            return Err(Malformed::TooLarge(der.len()));
        }
        strict_der(&der)?;
        let outer = children(&der, 0..der.len())?;
        let [request] = outer.as_slice() else {
            return Err(structure("the request is not one SEQUENCE"));
        };
        let parts = children(&der, request.content.clone())?;
        let [info, algorithm, signature] = parts.as_slice() else {
            return Err(structure(
                "a request is SEQUENCE { info, algorithm, signature }",
            ));
        };
        let fields = children(&der, info.content.clone())?;
        let [version, subject, spki, attributes] = fields.as_slice() else {
            return Err(structure(
                "the request info is SEQUENCE { version, subject, key, [0] attributes }",
            ));
        };
        expect_tag(version, 0x02, "version")?;
        expect_tag(subject, 0x30, "subject")?;
        expect_tag(spki, 0x30, "subjectPublicKeyInfo")?;
        expect_tag(attributes, 0xa0, "attributes")?;
        let v = yasna::parse_der(&der[version.whole.clone()], |r| r.read_u64())
            .map_err(|e| structure(format!("version: {e}")))?;
        if v != 0 {
            return Err(Malformed::Version(v));
        }
        let names = read_subject(&der[subject.whole.clone()])?;
        let attrs = read_attributes(&der[attributes.whole.clone()])?;
        let (extensions, extension_requests) = read_extensions(&attrs)?;
        let scheme = read_algorithm(&der[algorithm.whole.clone()])?;
        let sig = yasna::parse_der(&der[signature.whole.clone()], |r| r.read_bitvec_bytes())
            .map_err(|e| structure(format!("signature: {e}")))?;
        if sig.1 % 8 != 0 {
            return Err(structure("the signature BIT STRING has unused bits"));
        }
        Ok(Request {
            info: info.whole.clone(),
            subject_der: subject.whole.clone(),
            spki: spki.whole.clone(),
            subject: names,
            attributes: attrs,
            extensions,
            extension_requests,
            scheme,
            signature: sig.0,
            der,
        })
    }

    /// The whole request's DER.
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    /// The subject's DER (its whole TLV): what Go reports as `RawSubject`, and what evidence
    /// must be bound to.
    pub fn subject_der(&self) -> &[u8] {
        &self.der[self.subject_der.clone()]
    }

    /// The SubjectPublicKeyInfo's DER (its whole TLV).
    pub fn spki_der(&self) -> &[u8] {
        &self.der[self.spki.clone()]
    }

    /// Whether the request's own signature verifies with its own key (proof of possession).
    pub fn signature_verifies(&self) -> bool {
        crate::key::verify::verify_signature(
            self.spki_der(),
            self.scheme,
            &self.der[self.info.clone()],
            &self.signature,
        )
        .unwrap_or(false)
    }

    /// The values of the subject attributes of type `oid`, in order.
    pub fn subject_values(&self, oid: &[u64]) -> Vec<&str> {
        let oid = ObjectIdentifier::from_slice(oid);
        self.subject
            .iter()
            .filter(|a| a.oid == oid)
            .map(|a| a.value.as_str())
            .collect()
    }

    /// The attributes of type `oid`.
    pub fn attributes_of(&self, oid: &[u64]) -> Vec<&Attribute> {
        let oid = ObjectIdentifier::from_slice(oid);
        self.attributes.iter().filter(|a| a.oid == oid).collect()
    }
}

pub(super) fn structure(what: impl Into<String>) -> Malformed {
    Malformed::Structure(what.into())
}

/// One DER element of a buffer: its first (tag) byte and where its content and whole are.
#[derive(Debug, Clone)]
pub(super) struct Tlv {
    pub(super) tag: u8,
    pub(super) content: Range<usize>,
    pub(super) whole: Range<usize>,
}

/// Reads the element starting at `at` in `der`, ending no later than `end`: a low tag number,
/// a definite length in its shortest form.
pub(super) fn tlv(der: &[u8], at: usize, end: usize) -> Result<Tlv, Malformed> {
    let byte = |i: usize| {
        if i < end {
            Ok(der[i])
        } else {
            Err(Malformed::NotDer("an element runs past its container"))
        }
    };
    let tag = byte(at)?;
    if tag & 0x1f == 0x1f {
        return Err(Malformed::NotDer(
            "a high tag number (none belongs in a request)",
        ));
    }
    let first = byte(at + 1)?;
    let (length, header) = match first {
        0x80 => return Err(Malformed::NotDer("an indefinite length (BER, not DER)")),
        l if l < 0x80 => (usize::from(l), 2),
        l => {
            let n = usize::from(l & 0x7f);
            if n > 3 {
                return Err(Malformed::NotDer("a length field longer than 3 bytes"));
            }
            let mut length = 0usize;
            for i in 0..n {
                length = (length << 8) | usize::from(byte(at + 2 + i)?);
            }
            if byte(at + 2)? == 0 || length < 0x80 {
                return Err(Malformed::NotDer("a length not in its shortest form"));
            }
            (length, 2 + n)
        }
    };
    let start = at + header;
    let stop = start
        .checked_add(length)
        .filter(|s| *s <= end)
        .ok_or(Malformed::NotDer("an element runs past its container"))?;
    Ok(Tlv {
        tag,
        content: start..stop,
        whole: at..stop,
    })
}

/// The elements that exactly fill `range` of `der`.
pub(super) fn children(der: &[u8], range: Range<usize>) -> Result<Vec<Tlv>, Malformed> {
    let mut out = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let t = tlv(der, at, range.end)?;
        at = t.whole.end;
        out.push(t);
    }
    Ok(out)
}

/// Walks every element of `der`: DER lengths throughout, constructed encodings only where
/// DER has them (SEQUENCE, SET, context tags), and no bytes left over at any level.
pub(super) fn strict_der(der: &[u8]) -> Result<(), Malformed> {
    fn walk(der: &[u8], range: Range<usize>, depth: usize) -> Result<(), Malformed> {
        if depth > 32 {
            return Err(Malformed::NotDer("nested more than 32 levels deep"));
        }
        for t in children(der, range)? {
            let constructed = t.tag & 0x20 != 0;
            let universal = t.tag & 0xc0 == 0;
            if constructed {
                if universal && t.tag != 0x30 && t.tag != 0x31 {
                    return Err(Malformed::NotDer("a constructed string (BER, not DER)"));
                }
                walk(der, t.content, depth + 1)?;
            } else if universal && (t.tag == 0x10 || t.tag == 0x11) {
                return Err(Malformed::NotDer("a primitive SEQUENCE or SET"));
            }
        }
        Ok(())
    }
    walk(der, 0..der.len(), 0)
}

pub(super) fn expect_tag(t: &Tlv, tag: u8, what: &str) -> Result<(), Malformed> {
    if t.tag == tag {
        Ok(())
    } else {
        Err(structure(format!(
            "{what} has tag 0x{:02x}, not 0x{tag:02x}",
            t.tag
        )))
    }
}

/// The subject: a SEQUENCE of SETs with exactly one attribute each, a UTF8String or
/// PrintableString value; re-encoded, it must be the same bytes.
pub(super) fn read_subject(subject: &[u8]) -> Result<Vec<SubjectAttribute>, Malformed> {
    let sets = children(subject, tlv(subject, 0, subject.len())?.content)?;
    let mut names = Vec::with_capacity(sets.len());
    for set in &sets {
        expect_tag(set, 0x31, "an RDN")?;
        let members = children(subject, set.content.clone())?;
        let [atv] = members.as_slice() else {
            return Err(if members.is_empty() {
                Malformed::EmptyRdn
            } else {
                Malformed::MultiValuedRdn(members.len())
            });
        };
        names.push(read_name_attribute(&subject[atv.whole.clone()])?);
    }
    let again = yasna::construct_der(|w| {
        w.write_sequence(|w| {
            for a in &names {
                w.next().write_set(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_oid(&a.oid);
                        match a.kind {
                            StringKind::Utf8 => w.next().write_utf8_string(&a.value),
                            StringKind::Printable => w.next().write_printable_string(&a.value),
                        }
                    })
                })
            }
        })
    });
    if again != subject {
        return Err(Malformed::NotCanonical);
    }
    Ok(names)
}

fn read_name_attribute(atv: &[u8]) -> Result<SubjectAttribute, Malformed> {
    let (oid, tag, bytes) = yasna::parse_der(atv, |r| {
        r.read_sequence(|r| {
            let oid = r.next().read_oid()?;
            let value = r.next().read_tagged_der()?;
            Ok((oid, value.tag(), value.value().to_vec()))
        })
    })
    .map_err(|e| structure(format!("a subject attribute: {e}")))?;
    let (kind, value) = match (tag.tag_class, tag.tag_number) {
        (yasna::TagClass::Universal, 12) => (
            StringKind::Utf8,
            String::from_utf8(bytes).map_err(|_| Malformed::NotUtf8(oid.to_string()))?,
        ),
        (yasna::TagClass::Universal, 19) => {
            let printable = bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || b" '()+,-./:=?".contains(b));
            if !printable {
                return Err(Malformed::NotPrintable(oid.to_string()));
            }
            (
                StringKind::Printable,
                String::from_utf8(bytes).map_err(|_| Malformed::NotPrintable(oid.to_string()))?,
            )
        }
        (class, number) => {
            return Err(Malformed::StringKind {
                oid: oid.to_string(),
                kind: format!("{class:?} tag {number}"),
            })
        }
    };
    Ok(SubjectAttribute { oid, kind, value })
}

/// `[0] IMPLICIT SET OF Attribute`, in DER order, each with at least one value.
fn read_attributes(der: &[u8]) -> Result<Vec<Attribute>, Malformed> {
    let mut attributes = Vec::new();
    yasna::parse_der(der, |r| {
        r.read_tagged_implicit(Tag::context(0), |r| {
            r.read_set_of(|r| {
                attributes.push(r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    let values = r.next().collect_set_of(|r| r.read_der())?;
                    Ok(Attribute { oid, values })
                })?);
                Ok(())
            })
        })
    })
    .map_err(|e| structure(format!("the attributes (a DER SET, in order): {e}")))?;
    if let Some(empty) = attributes.iter().find(|a| a.values.is_empty()) {
        return Err(Malformed::EmptyAttribute(empty.oid.to_string()));
    }
    Ok(attributes)
}

/// The extensions of every extension request (each value: `SEQUENCE OF Extension`).
/// `Extensions ::= SEQUENCE OF Extension` (a request's extension request, a certificate's
/// `[3]`), in order, duplicates included.
pub(super) fn read_extension_list(der: &[u8]) -> Result<Vec<Extension>, Malformed> {
    yasna::parse_der(der, |r| {
        r.collect_sequence_of(|r| {
            r.read_sequence(|r| {
                let oid = r.next().read_oid()?;
                let critical = r.read_default(false, |r| r.read_bool())?;
                let value = r.next().read_bytes()?;
                Ok(Extension {
                    oid,
                    critical,
                    value,
                })
            })
        })
    })
    .map_err(|e| Malformed::Extensions(e.to_string()))
}

fn read_extensions(attributes: &[Attribute]) -> Result<(Vec<Extension>, usize), Malformed> {
    let wanted = ObjectIdentifier::from_slice(OID_EXTENSION_REQUEST);
    let mut extensions = Vec::new();
    let mut requests = 0;
    for attribute in attributes.iter().filter(|a| a.oid == wanted) {
        for value in &attribute.values {
            requests += 1;
            extensions.extend(read_extension_list(value)?);
        }
    }
    Ok((extensions, requests))
}

/// The signature algorithm: ECDSA with SHA-256/384 (no parameters) or RSA PKCS#1 v1.5 with
/// SHA-256/384/512 (NULL parameters).
pub(super) fn read_algorithm(der: &[u8]) -> Result<SignScheme, Malformed> {
    read_algorithm_with(der, false)
}

/// Like [`read_algorithm`]; with `rsa_params_may_be_absent`, an RSA PKCS#1 algorithm without
/// its NULL parameters is read too (Go ignores them; a certificate of Yubico's chain has none).
pub(super) fn read_algorithm_with(
    der: &[u8],
    rsa_params_may_be_absent: bool,
) -> Result<SignScheme, Malformed> {
    let (oid, params) = yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            let oid = r.next().read_oid()?;
            let params = r.read_optional(|r| r.read_der())?;
            Ok((oid, params))
        })
    })
    .map_err(|e| structure(format!("the signature algorithm: {e}")))?;
    let components: &[u64] = oid.components();
    let null = params.as_deref() == Some(&[0x05, 0x00][..])
        || (rsa_params_may_be_absent && params.is_none());
    let scheme = match (components, params.is_none(), null) {
        ([1, 2, 840, 10045, 4, 3, 2], true, _) => SignScheme::EcdsaP256Sha256,
        ([1, 2, 840, 10045, 4, 3, 3], true, _) => SignScheme::EcdsaP384Sha384,
        ([1, 2, 840, 113549, 1, 1, 11], _, true) => SignScheme::RsaPkcs1Sha256,
        ([1, 2, 840, 113549, 1, 1, 12], _, true) => SignScheme::RsaPkcs1Sha384,
        ([1, 2, 840, 113549, 1, 1, 13], _, true) => SignScheme::RsaPkcs1Sha512,
        _ => return Err(Malformed::SignatureAlgorithm(oid.to_string())),
    };
    Ok(scheme)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(subject: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            dn.push(t.clone(), *v);
        }
        params.distinguished_name = dn;
        params
            .serialize_request(&key)
            .expect("request")
            .der()
            .to_vec()
    }

    #[test]
    fn a_well_formed_request_is_read_with_its_raw_parts() {
        use rcgen::DnType::*;
        let der = request(&[
            (OrganizationName, "system:nodes"),
            (CommonName, "system:node:a"),
        ]);
        let r = Request::from_der(der.clone()).expect("read");
        assert_eq!(r.subject_values(OID_COMMON_NAME), ["system:node:a"]);
        assert_eq!(r.subject_values(OID_ORGANIZATION), ["system:nodes"]);
        assert!(r.signature_verifies());
        assert_eq!(r.der(), der.as_slice());
        assert_eq!(r.subject_der()[0], 0x30);
        assert_eq!(r.spki_der()[0], 0x30);
    }

    /// Replaces the first occurrence of `from` in `der` by `to`, fixing no lengths.
    fn patched(der: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
        let at = der
            .windows(from.len())
            .position(|w| w == from)
            .expect("pattern");
        [&der[..at], to, &der[at + from.len()..]].concat()
    }

    #[test]
    fn ber_lengths_and_trailing_bytes_are_refused() {
        use rcgen::DnType::*;
        let der = request(&[(CommonName, "system:node:a")]);
        let mut trailing = der.clone();
        trailing.push(0);
        assert!(matches!(
            Request::from_der(trailing),
            Err(Malformed::NotDer(_) | Malformed::Structure(_))
        ));
        // The outer SEQUENCE's length, re-written in a longer form than needed.
        let long = [&[0x30, 0x82, 0x00][..], &[der[1]], &der[2..]].concat();
        assert!(matches!(Request::from_der(long), Err(Malformed::NotDer(_))));
        // An indefinite length.
        let indefinite = [&[0x30, 0x80][..], &der[2..], &[0, 0]].concat();
        assert!(matches!(
            Request::from_der(indefinite),
            Err(Malformed::NotDer(_))
        ));
        // The CN as a T61String (tag 20) instead of a UTF8String.
        let t61 = patched(
            &der,
            &[0x06, 0x03, 0x55, 0x04, 0x03, 0x0c],
            &[0x06, 0x03, 0x55, 0x04, 0x03, 0x14],
        );
        assert!(matches!(
            Request::from_der(t61),
            Err(Malformed::StringKind { .. })
        ));
    }

    #[test]
    fn oversized_requests_are_refused_unread() {
        let big = vec![b'x'; MAX_REQUEST_BYTES + 1];
        assert_eq!(
            Request::from_pem(&big),
            Err(Malformed::TooLarge(MAX_REQUEST_BYTES + 1))
        );
    }
}
