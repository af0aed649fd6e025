//! An X.509 certificate read once, strictly, so that a decision about it rests on what Go reads.
//!
//! kube-apiserver authenticates a client certificate with Go's `x509.ParseCertificate` and
//! takes the user from `pkix.Name` (the last CN, every O as a group). A certificate attached to
//! a request as proof (a person's current certificate) is therefore read here with the same
//! narrow, canonical subset of DER the request reader accepts ([`super::request`]), and refused
//! in words otherwise: x509-parser stops at an empty RDN (an empty `SET` once let it show
//! `CN=alice` where Go reads a second CN after it).
//!
//! - DER only, nothing left over at any level; version 3; no unique identifiers;
//! - issuer and subject: a SEQUENCE of SETs with one attribute each, UTF8String or
//!   PrintableString values, canonical (the subject read as the request's is);
//! - validity: UTCTime `YYMMDDHHMMSSZ` or GeneralizedTime `YYYYMMDDHHMMSSZ` (the forms Go
//!   writes);
//! - extensions: each at most once (Go refuses duplicates too); the ones Go parses are read
//!   here with Go's rules (key usage, extended key usage, basic constraints, subject and
//!   authority key identifiers: a malformed one makes Go refuse the whole certificate, so it is
//!   refused here too), and those a person's client certificate has no use for (subject
//!   alternative names, name constraints, CRL distribution points, policies, authority
//!   information access) are refused; any other critical extension is refused (Go's verifier
//!   would not use the certificate);
//! - the signature algorithm one hwkey verifies (ECDSA P-256/P-384, RSA PKCS#1 v1.5).
//!
//! `tests/it/approver/cert_oracle.rs` compares this reading with Go's on mutated certificates
//! (`hsm-fixtures/csr-oracle.go --cert`, built with the Go that builds kube-controller-manager):
//! whenever this reader accepts, Go reads the same subject, key, validity and extensions. Some
//! fields it does not decide on are not checked as strictly as newer Go versions do (a negative
//! serial number, policy mappings): they cannot change what a decision reads.

use std::ops::Range;

use yasna::models::ObjectIdentifier;

use super::request::{
    children, expect_tag, read_algorithm_with, read_extension_list, read_subject, strict_der,
    structure, tlv, Extension, Malformed, SubjectAttribute,
};
use crate::key::SignScheme;

/// The largest certificate read at all (a person's certificate is under 2 KiB).
pub const MAX_CERTIFICATE_BYTES: usize = 16 * 1024;

/// Key usage.
const OID_KEY_USAGE: &[u64] = &[2, 5, 29, 15];
/// Basic constraints.
const OID_BASIC_CONSTRAINTS: &[u64] = &[2, 5, 29, 19];
/// Extended key usage.
const OID_EXT_KEY_USAGE: &[u64] = &[2, 5, 29, 37];
/// Subject key identifier.
const OID_SUBJECT_KEY_ID: &[u64] = &[2, 5, 29, 14];
/// Authority key identifier.
const OID_AUTHORITY_KEY_ID: &[u64] = &[2, 5, 29, 35];

/// Extensions Go parses (and refuses the certificate when malformed) that an attached client
/// certificate has no use for: refused rather than read a second way.
const REFUSED: [(&[u64], &str); 5] = [
    (&[2, 5, 29, 17], "subject alternative names"),
    (&[2, 5, 29, 30], "name constraints"),
    (&[2, 5, 29, 31], "CRL distribution points"),
    (&[2, 5, 29, 32], "certificate policies"),
    (&[1, 3, 6, 1, 5, 5, 7, 1, 1], "authority information access"),
];

/// Extended key usage: TLS client authentication.
const OID_CLIENT_AUTH: &[u64] = &[1, 3, 6, 1, 5, 5, 7, 3, 2];
/// Extended key usage: any.
const OID_ANY_EKU: &[u64] = &[2, 5, 29, 37, 0];

/// What a certificate is read for: the extensions each may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// A client certificate kube-apiserver would authenticate: read as Go reads it, and the
    /// extensions a person's certificate has no use for refused.
    Client,
    /// A certificate of an attestation chain (a YubiKey's attestation certificates and the
    /// chain to Yubico's roots): no Go component reads these, so distribution points, policies
    /// and authority information access are allowed; an unknown critical extension is not.
    AttestationChain,
}

/// A certificate, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certificate {
    der: Vec<u8>,
    tbs: Range<usize>,
    issuer_der: Range<usize>,
    subject_der: Range<usize>,
    spki: Range<usize>,
    serial: Vec<u8>,
    /// The subject's RDNs, in order, one attribute each.
    pub subject: Vec<SubjectAttribute>,
    /// notBefore, Unix seconds.
    pub not_before: i64,
    /// notAfter, Unix seconds.
    pub not_after: i64,
    /// The extensions, in order.
    pub extensions: Vec<Extension>,
    scheme: SignScheme,
    signature: Vec<u8>,
}

impl Certificate {
    /// Reads a client certificate's DER strictly (see the module doc).
    pub fn from_der(der: &[u8]) -> Result<Certificate, Malformed> {
        Certificate::read(der, Profile::Client)
    }

    /// Reads a certificate of an attestation chain as strictly, with that profile's
    /// extensions ([`Profile::AttestationChain`]).
    pub fn from_der_in_chain(der: &[u8]) -> Result<Certificate, Malformed> {
        Certificate::read(der, Profile::AttestationChain)
    }

    fn read(der: &[u8], profile: Profile) -> Result<Certificate, Malformed> {
        if der.len() > MAX_CERTIFICATE_BYTES {
            return Err(Malformed::TooLarge(der.len()));
        }
        strict_der(der)?;
        let outer = children(der, 0..der.len())?;
        let [cert] = outer.as_slice() else {
            return Err(structure("the certificate is not one SEQUENCE"));
        };
        expect_tag(cert, 0x30, "the certificate")?;
        let parts = children(der, cert.content.clone())?;
        let [tbs, algorithm, signature] = parts.as_slice() else {
            return Err(structure(
                "a certificate is SEQUENCE { tbsCertificate, algorithm, signature }",
            ));
        };
        expect_tag(tbs, 0x30, "tbsCertificate")?;
        let fields = children(der, tbs.content.clone())?;
        let [version, serial, inner_algorithm, issuer, validity, subject, spki, rest @ ..] =
            fields.as_slice()
        else {
            return Err(structure(
                "tbsCertificate is SEQUENCE { [0] version, serial, algorithm, issuer, validity, subject, key, [3] extensions }",
            ));
        };
        check_version_and_serial(der, version, serial)?;
        for (t, what) in [
            (inner_algorithm, "the inner signature algorithm"),
            (issuer, "issuer"),
            (validity, "validity"),
            (subject, "subject"),
            (spki, "subjectPublicKeyInfo"),
        ] {
            expect_tag(t, 0x30, what)?;
        }
        if der[inner_algorithm.whole.clone()] != der[algorithm.whole.clone()] {
            return Err(structure(
                "the signature algorithm inside tbsCertificate differs from the outer one",
            ));
        }
        let extensions = match rest {
            [] => Vec::new(),
            [ext] if ext.tag == 0xa3 => read_extensions(&der[ext.content.clone()], profile)?,
            _ => {
                return Err(structure(
                    "after the key, only [3] extensions may follow (no unique identifiers)",
                ))
            }
        };
        read_subject(&der[issuer.whole.clone()])?;
        let names = read_subject(&der[subject.whole.clone()])?;
        let (not_before, not_after) = read_validity(der, validity.content.clone())?;
        let scheme = read_algorithm_with(
            &der[algorithm.whole.clone()],
            profile == Profile::AttestationChain,
        )?;
        let sig = yasna::parse_der(&der[signature.whole.clone()], |r| r.read_bitvec_bytes())
            .map_err(|e| structure(format!("signature: {e}")))?;
        if sig.1 % 8 != 0 {
            return Err(structure("the signature BIT STRING has unused bits"));
        }
        Ok(Certificate {
            der: der.to_vec(),
            tbs: tbs.whole.clone(),
            issuer_der: issuer.whole.clone(),
            subject_der: subject.whole.clone(),
            spki: spki.whole.clone(),
            serial: der[serial.content.clone()].to_vec(),
            subject: names,
            not_before,
            not_after,
            extensions,
            scheme,
            signature: sig.0,
        })
    }

    /// The whole certificate's DER.
    pub fn der(&self) -> &[u8] {
        &self.der
    }

    /// The issuer's DER (its whole TLV).
    pub fn issuer_der(&self) -> &[u8] {
        &self.der[self.issuer_der.clone()]
    }

    /// The subject's DER (its whole TLV).
    pub fn subject_der(&self) -> &[u8] {
        &self.der[self.subject_der.clone()]
    }

    /// The SubjectPublicKeyInfo's DER (its whole TLV).
    pub fn spki_der(&self) -> &[u8] {
        &self.der[self.spki.clone()]
    }

    /// The serial number in hex (its DER content bytes).
    pub fn serial_hex(&self) -> String {
        self.serial.iter().map(|b| format!("{b:02x}")).collect()
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

    /// The extension of type `oid`, if present (each is present at most once).
    pub fn extension(&self, oid: &[u64]) -> Option<&Extension> {
        let oid = ObjectIdentifier::from_slice(oid);
        self.extensions.iter().find(|e| e.oid == oid)
    }

    /// Whether the certificate may be used for TLS client authentication: no extended key
    /// usage, or one that lists client auth or any. An EKU that does not parse is an error.
    pub fn allows_client_auth(&self) -> Result<bool, Malformed> {
        let Some(eku) = self.extension(OID_EXT_KEY_USAGE) else {
            return Ok(true);
        };
        let purposes = yasna::parse_der(&eku.value, |r| r.collect_sequence_of(|r| r.read_oid()))
            .map_err(|e| Malformed::Extensions(format!("extended key usage: {e}")))?;
        let (client, any) = (
            ObjectIdentifier::from_slice(OID_CLIENT_AUTH),
            ObjectIdentifier::from_slice(OID_ANY_EKU),
        );
        Ok(purposes.iter().any(|p| *p == client || *p == any))
    }

    /// What basic constraints say: Some(cA) when the extension is there, None when absent.
    pub fn is_ca(&self) -> Option<bool> {
        self.extension(OID_BASIC_CONSTRAINTS)
            .and_then(|e| basic_constraints(&e.value))
    }

    /// Whether the certificate is valid at `now` (Unix seconds).
    pub fn valid_at(&self, now: i64) -> bool {
        self.not_before <= now && now <= self.not_after
    }

    /// The subject's last CN (the one Go reports), or "".
    pub fn common_name(&self) -> &str {
        self.subject_values(&[2, 5, 4, 3])
            .last()
            .copied()
            .unwrap_or_default()
    }

    /// Whether `issuer` (its subject names this certificate's issuer, byte for byte) signed
    /// this certificate.
    pub fn is_signed_by(&self, issuer: &Certificate) -> bool {
        issuer.subject_der() == self.issuer_der()
            && crate::key::verify::verify_signature(
                issuer.spki_der(),
                self.scheme,
                &self.der[self.tbs.clone()],
                &self.signature,
            )
            .unwrap_or(false)
    }
}

/// `[0] EXPLICIT INTEGER 2` (v3), and a serial number in DER.
fn check_version_and_serial(
    der: &[u8],
    version: &super::request::Tlv,
    serial: &super::request::Tlv,
) -> Result<(), Malformed> {
    expect_tag(version, 0xa0, "version (v3, explicit)")?;
    let v = yasna::parse_der(&der[version.content.clone()], |r| r.read_u64())
        .map_err(|e| structure(format!("version: {e}")))?;
    if v != 2 {
        return Err(Malformed::Version(v));
    }
    expect_tag(serial, 0x02, "serialNumber")?;
    check_serial(&der[serial.content.clone()])
}

/// Validity ::= SEQUENCE { notBefore Time, notAfter Time }.
fn read_validity(der: &[u8], range: Range<usize>) -> Result<(i64, i64), Malformed> {
    let times = children(der, range)?;
    let [from, to] = times.as_slice() else {
        return Err(structure("validity is SEQUENCE { notBefore, notAfter }"));
    };
    Ok((
        read_time(from.tag, &der[from.content.clone()])?,
        read_time(to.tag, &der[to.content.clone()])?,
    ))
}

/// A Time in the forms Go writes: UTCTime `YYMMDDHHMMSSZ` (years 1950–2049) or GeneralizedTime
/// `YYYYMMDDHHMMSSZ`. Unix seconds.
fn read_time(tag: u8, text: &[u8]) -> Result<i64, Malformed> {
    let bad = || {
        structure(
            "a validity time is not YYMMDDHHMMSSZ (UTCTime) or YYYYMMDDHHMMSSZ (GeneralizedTime)",
        )
    };
    let (year, rest) = match (tag, text.len()) {
        (0x17, 13) => {
            let yy = i32::from(digits(&text[..2]).ok_or_else(bad)?);
            (if yy < 50 { 2000 + yy } else { 1900 + yy }, &text[2..])
        }
        (0x18, 15) => (i32::from(digits(&text[..4]).ok_or_else(bad)?), &text[4..]),
        _ => return Err(bad()),
    };
    if rest.last() != Some(&b'Z') {
        return Err(bad());
    }
    let field = |i: usize| digits(&rest[i..i + 2]).ok_or_else(bad);
    let (month, day, hour, minute, second) =
        (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    let month =
        time::Month::try_from(u8::try_from(month).map_err(|_| bad())?).map_err(|_| bad())?;
    let date = time::Date::from_calendar_date(year, month, u8::try_from(day).map_err(|_| bad())?)
        .map_err(|_| bad())?;
    let at = date
        .with_hms(
            u8::try_from(hour).map_err(|_| bad())?,
            u8::try_from(minute).map_err(|_| bad())?,
            u8::try_from(second).map_err(|_| bad())?,
        )
        .map_err(|_| bad())?;
    Ok(at.assume_utc().unix_timestamp())
}

/// ASCII decimal digits as a number; None for anything else.
fn digits(text: &[u8]) -> Option<u16> {
    text.iter().try_fold(0u16, |n, b| {
        b.is_ascii_digit().then(|| n * 10 + u16::from(b - b'0'))
    })
}

/// Extensions ::= SEQUENCE OF Extension, each at most once; critical only if known.
fn read_extensions(der: &[u8], profile: Profile) -> Result<Vec<Extension>, Malformed> {
    let outer = tlv(der, 0, der.len())?;
    if outer.tag != 0x30 || outer.whole.end != der.len() {
        return Err(structure("[3] extensions holds one SEQUENCE OF Extension"));
    }
    let extensions = read_extension_list(der)?;
    for (i, e) in extensions.iter().enumerate() {
        if extensions[..i].iter().any(|o| o.oid == e.oid) {
            return Err(Malformed::Extensions(format!(
                "extension {} appears twice",
                e.oid
            )));
        }
        check_extension(e, profile)?;
    }
    Ok(extensions)
}

/// One extension by Go's rules: the ones Go parses must parse as Go reads them; the ones a
/// person's certificate has no use for, and unknown critical ones, are refused.
fn check_extension(e: &Extension, profile: Profile) -> Result<(), Malformed> {
    let is = |oid: &[u64]| e.oid == ObjectIdentifier::from_slice(oid);
    let bad = |what: &str| Malformed::Extensions(format!("{what} ({}) is malformed", e.oid));
    let unused = REFUSED.iter().find(|(oid, _)| is(oid));
    if unused.is_some() && profile == Profile::AttestationChain {
        return Ok(());
    }
    if let Some((_, name)) = unused {
        return Err(Malformed::Extensions(format!(
            "the certificate carries {name} ({}), which a person's client certificate has no use for",
            e.oid
        )));
    }
    if is(OID_KEY_USAGE) {
        key_usage_bits(&e.value).ok_or_else(|| bad("key usage"))?;
    } else if is(OID_EXT_KEY_USAGE) {
        yasna::parse_der(&e.value, |r| r.collect_sequence_of(|r| r.read_oid()))
            .map_err(|_| bad("extended key usage"))?;
    } else if is(OID_BASIC_CONSTRAINTS) {
        basic_constraints(&e.value).ok_or_else(|| bad("basic constraints"))?;
    } else if is(OID_SUBJECT_KEY_ID) {
        yasna::parse_der(&e.value, |r| r.read_bytes())
            .map_err(|_| bad("subject key identifier"))?;
    } else if is(OID_AUTHORITY_KEY_ID) {
        check_authority_key_id(&e.value).ok_or_else(|| bad("authority key identifier"))?;
    } else if e.critical {
        return Err(Malformed::Extensions(format!(
            "extension {} is critical and unknown: Go's verifier would not accept the certificate",
            e.oid
        )));
    }
    Ok(())
}

/// BasicConstraints ::= SEQUENCE { cA BOOLEAN DEFAULT FALSE, pathLen INTEGER OPTIONAL }: cA.
fn basic_constraints(value: &[u8]) -> Option<bool> {
    yasna::parse_der(value, |r| {
        r.read_sequence(|r| {
            let ca = r.read_default(false, |r| r.read_bool())?;
            r.read_optional(|r| r.read_u64())?;
            Ok(ca)
        })
    })
    .ok()
}

/// A key usage BIT STRING as Go reads it (cryptobyte's rules: 0–7 unused bits, zero, and none
/// in an empty string): its bytes.
fn key_usage_bits(value: &[u8]) -> Option<Vec<u8>> {
    let outer = tlv(value, 0, value.len()).ok()?;
    if outer.tag != 0x03 || outer.whole.end != value.len() {
        return None;
    }
    let content = &value[outer.content];
    let (&unused, bits) = content.split_first()?;
    let last = bits.last().copied();
    let clean = match last {
        None => unused == 0,
        Some(b) => unused <= 7 && b & ((1u8 << unused) - 1) == 0,
    };
    clean.then(|| bits.to_vec())
}

/// AuthorityKeyIdentifier ::= SEQUENCE { [0] keyIdentifier OPTIONAL, [1] issuer OPTIONAL,
/// [2] serial OPTIONAL }, in DER.
fn check_authority_key_id(value: &[u8]) -> Option<()> {
    let outer = tlv(value, 0, value.len()).ok()?;
    if outer.tag != 0x30 || outer.whole.end != value.len() {
        return None;
    }
    let fields = children(value, outer.content).ok()?;
    let mut last = None;
    for f in &fields {
        let slot = match f.tag {
            0x80 => 0,
            0xa1 => 1,
            0x82 => 2,
            _ => return None,
        };
        if last.is_some_and(|l| l >= slot) {
            return None;
        }
        last = Some(slot);
    }
    Some(())
}

/// A serial number in DER: at least one byte, minimal (no leading zero byte before a byte
/// under 0x80, no 0xff before one at or above it).
fn check_serial(content: &[u8]) -> Result<(), Malformed> {
    let minimal = match content {
        [] => false,
        [0x00, next, ..] => *next >= 0x80,
        [0xff, next, ..] => *next < 0x80,
        _ => true,
    };
    if minimal {
        Ok(())
    } else {
        Err(structure("the serial number is not a minimal DER INTEGER"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issue(subject: &[(rcgen::DnType, &str)]) -> (Vec<u8>, Vec<u8>) {
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "test CA");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        for (t, v) in subject {
            dn.push(t.clone(), *v);
        }
        params.distinguished_name = dn;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = rcgen::Issuer::from_ca_cert_der(ca_cert.der(), &ca_key).expect("issuer");
        (
            params
                .signed_by(&key, &issuer)
                .expect("sign")
                .der()
                .to_vec(),
            ca_cert.der().to_vec(),
        )
    }

    #[test]
    fn a_client_certificate_is_read_with_its_parts_and_chains_to_its_ca() {
        use rcgen::DnType::*;
        let (der, ca) = issue(&[(OrganizationName, "devs"), (CommonName, "alice")]);
        let cert = Certificate::from_der(&der).expect("read");
        let ca = Certificate::from_der(&ca).expect("CA");
        assert_eq!(cert.subject_values(&[2, 5, 4, 3]), ["alice"]);
        assert_eq!(cert.subject_values(&[2, 5, 4, 10]), ["devs"]);
        assert!(cert.allows_client_auth().expect("EKU"));
        assert!(cert.is_signed_by(&ca));
        assert!(!ca.is_signed_by(&cert));
        assert!(cert.not_before < cert.not_after);
        let x = x509_parser::parse_x509_certificate(&der)
            .expect("x509-parser")
            .1;
        assert_eq!(cert.not_after, x.validity().not_after.timestamp());
        assert_eq!(cert.spki_der(), x.public_key().raw);
    }

    #[test]
    fn trailing_bytes_and_other_versions_are_refused() {
        use rcgen::DnType::*;
        let (der, _) = issue(&[(CommonName, "alice")]);
        let mut trailing = der.clone();
        trailing.push(0);
        assert!(Certificate::from_der(&trailing).is_err());
        // [0] { INTEGER 2 } → INTEGER 1 (v2).
        let v3 = [0xa0u8, 0x03, 0x02, 0x01, 0x02];
        let at = der.windows(5).position(|w| w == v3).expect("version");
        let mut v2 = der.clone();
        v2[at + 4] = 1;
        assert_eq!(Certificate::from_der(&v2), Err(Malformed::Version(1)));
    }

    #[test]
    fn times_are_read_in_the_forms_go_writes_only() {
        assert_eq!(read_time(0x17, b"700101000000Z"), Ok(0));
        assert_eq!(read_time(0x17, b"491231235959Z"), Ok(2_524_607_999));
        assert_eq!(read_time(0x18, b"20500101000000Z"), Ok(2_524_608_000));
        for (tag, text) in [
            (0x17, &b"7001010000Z"[..]),
            (0x17, b"700101000000+0100"),
            (0x17, b"701301000000Z"),
            (0x17, b"700132000000Z"),
            (0x17, b"700101240000Z"),
            (0x18, b"19700101000000.5Z"),
            (0x04, b"700101000000Z"),
            (0x17, b"70010100000aZ"),
        ] {
            assert!(
                read_time(tag, text).is_err(),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }
}
