//! YubiKey PIV attestation: proof that a key was generated in a YubiKey (or a compatible PIV
//! token) and cannot leave it, carried in a request and checked by the approver.
//!
//! What a device gives, as Yubico documents it: for a key generated in a PIV slot, an
//! *attestation certificate* (subject `CN=YubiKey PIV Attestation 9c`, the slot's public key)
//! signed by the device's own *f9 certificate* (`CN=Yubico PIV Attestation`), which Yubico
//! signed: directly by `Yubico PIV Root CA Serial 263751` (firmware before 5.7.4; the root was
//! re-issued in 2018 with the same key and subject), or, from 5.7.4, through intermediates the
//! device does not carry up to `Yubico Attestation Root 1`. Facts about the key sit in
//! extensions under 1.3.6.1.4.1.41482.3: `.3` firmware (3 bytes), `.7` serial (a DER INTEGER),
//! `.8` PIN policy then touch policy (1 byte each), `.9` form factor (1 byte).
//!
//! In a request, inside hwkey's evidence attribute (`id-aa-evidence`, see
//! [`super::attestation`]): one bundle, one statement of type hwkey-piv-attestation
//! (2.25.231984930622501349305922061980282871705) whose statement is the attestation
//! certificate, and the bundle's `certs` holding exactly the f9 certificate.
//!
//! [`verify_attestation`] is strict where a chain can be bent (every certificate read by the strict
//! reader: DER only, nothing after it, no unknown critical extension; each link's signature;
//! validity now; exactly one f9), and accepts the quirks of real devices (an f9 certificate
//! without basic constraints). The roots are Yubico's public ones, shipped as data
//! ([`PivRoots::yubico`]); operators add or replace them (`--piv-roots`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::certificate::Certificate;
use super::request::Malformed;

/// DER of the statement type: a UUID OID (2.25.…), since the LAMPS draft registers no type for
/// a PIV attestation.
pub const OID_PIV_ATTESTATION_DER: &[u8] = &[
    0x06, 0x14, 0x69, 0x82, 0xdd, 0x86, 0xd6, 0x89, 0xbc, 0xd6, 0x82, 0xac, 0xf7, 0x87, 0x80, 0xb2,
    0xa5, 0xb8, 0xf7, 0xad, 0xbf, 0x19,
];
const HINT: &str = "hwkey PIV attestation";

/// Yubico's attestation extensions.
const OID_FIRMWARE: &[u64] = &[1, 3, 6, 1, 4, 1, 41482, 3, 3];
const OID_SERIAL: &[u64] = &[1, 3, 6, 1, 4, 1, 41482, 3, 7];
const OID_POLICY: &[u64] = &[1, 3, 6, 1, 4, 1, 41482, 3, 8];
const OID_FORM_FACTOR: &[u64] = &[1, 3, 6, 1, 4, 1, 41482, 3, 9];

/// The longest path from the f9 certificate to a root (5.7.4's chain has two intermediates).
const MAX_INTERMEDIATES: usize = 4;

/// Yubico's public PIV attestation roots and intermediates (PEM), shipped with hwkey.
const YUBICO_PEM: &str = include_str!("yubico_piv_roots.pem");

/// The request attribute (DER `Attribute`) carrying a PIV attestation: `attestation` (the
/// slot's attestation certificate) and `f9` (the device's attestation certificate), DER.
pub fn attribute(attestation: &[u8], f9: &[u8]) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next()
                .write_oid(&yasna::models::ObjectIdentifier::from_slice(
                    super::attestation::OID_EVIDENCE,
                ));
            w.next().write_set(|w| {
                w.next().write_sequence(|w| {
                    w.next().write_sequence(|w| {
                        w.next().write_sequence(|w| {
                            w.next().write_sequence(|w| {
                                w.next().write_der(OID_PIV_ATTESTATION_DER);
                                w.next().write_der(attestation);
                                w.next().write_utf8_string(HINT);
                            });
                        });
                        w.next().write_sequence(|w| w.next().write_der(f9));
                    });
                });
            });
        })
    })
}

pub use super::piv_policy::{Firmware, PinPolicy, TouchPolicy};

/// A YubiKey form factor (`.9`), as Yubico numbers them.
pub fn form_factor_name(byte: u8) -> String {
    let base = match byte & 0x0f {
        1 => "USB-A keychain",
        2 => "USB-A nano",
        3 => "USB-C keychain",
        4 => "USB-C nano",
        5 => "USB-C and Lightning",
        6 => "USB-A biometric keychain",
        7 => "USB-C biometric keychain",
        _ => return format!("unknown (0x{byte:02x})"),
    };
    let mut name = base.to_string();
    if byte & 0x80 != 0 {
        name.push_str(", FIPS");
    }
    if byte & 0x40 != 0 {
        name.push_str(", CSPN");
    }
    name
}

/// What a verified attestation proves about a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PivFacts {
    /// The device's serial number.
    pub serial: u64,
    /// Its firmware.
    pub firmware: Firmware,
    /// The slot's PIN policy.
    pub pin_policy: PinPolicy,
    /// The slot's touch policy.
    pub touch_policy: TouchPolicy,
    /// The form factor byte, when the attestation has one (firmware 5.2.4 and later).
    pub form_factor: Option<u8>,
    /// The slot, from the attestation certificate's CN (`9c`), when it names one.
    pub slot: Option<String>,
    /// The attested public key (SubjectPublicKeyInfo DER).
    pub spki: Vec<u8>,
    /// The CN of the root the chain ends at.
    pub root: String,
}

/// Why an attestation proves nothing: what did not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum PivRefusal {
    #[error("the {which} certificate is refused: {problem}")]
    Unreadable {
        which: &'static str,
        problem: Malformed,
    },
    #[error("the attestation certificate is not signed by the device's attestation certificate (f9, '{f9}')")]
    NotSignedByF9 { f9: String },
    #[error("the device's attestation certificate says it is not a CA (basic constraints cA=false): it cannot vouch for a key")]
    F9NotCa,
    #[error("the certificate given as the device's (f9) is a slot's attestation ('{name}': it has a serial or policy extension): a slot's key attests nothing")]
    F9IsASlotAttestation { name: String },
    #[error("no path from '{issuer}' to a trusted PIV attestation root ({roots}): not a Yubico device, or its root is not configured (--piv-roots)")]
    NoPathToRoot { issuer: String, roots: String },
    #[error("the certificate '{which}' is not valid now (valid {from} to {to}, Unix seconds)")]
    NotValidNow { which: String, from: i64, to: i64 },
    #[error("the attestation certificate has no {what} extension ({oid})")]
    Missing { what: &'static str, oid: String },
    #[error("the attestation certificate's {what} extension is malformed")]
    Malformed { what: &'static str },
    #[error("the attested key is not the request's")]
    AnotherKey,
}

/// The PIV attestation roots (self-signed) and the intermediates a device does not carry,
/// and the chains already verified against them ([`PivRoots::verify`]).
#[derive(Debug, Clone)]
pub struct PivRoots {
    roots: Vec<Certificate>,
    intermediates: Vec<Certificate>,
    verified: Arc<Mutex<HashMap<[u8; 32], Verified>>>,
}

/// A chain that verified: what it proves and when every certificate of its path is valid.
#[derive(Debug, Clone)]
struct Verified {
    facts: PivFacts,
    from: i64,
    to: i64,
}

/// Verified chains remembered at most (each a few hundred bytes); beyond, the memory starts
/// over. Only chains that verified are remembered, so an attacker fills it with nothing of use.
const VERIFIED_MAX: usize = 4096;

/// A roots file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum PivRootsError {
    #[error("it is not PEM: {0}")]
    Pem(#[source] pem::PemError),
    #[error("it holds no CERTIFICATE")]
    Empty,
    #[error("certificate {index} is refused: {problem}")]
    Unreadable { index: usize, problem: Malformed },
    #[error("certificate {index} ('{name}') is self-issued but its signature does not verify with its own key")]
    BadSelfSignature { index: usize, name: String },
}

impl PivRoots {
    /// Yubico's public roots and intermediates, as shipped.
    pub fn yubico() -> PivRoots {
        // The shipped data is tested (pki::piv::tests): it always reads.
        PivRoots::from_pem(YUBICO_PEM).unwrap_or_else(|_| PivRoots::none())
    }

    /// No roots at all (then [`PivRoots::add`]).
    pub fn none() -> PivRoots {
        PivRoots {
            roots: Vec::new(),
            intermediates: Vec::new(),
            verified: Arc::default(),
        }
    }

    /// Reads a PEM bundle: self-issued certificates are roots (their signature must verify),
    /// the others intermediates.
    pub fn from_pem(text: &str) -> Result<PivRoots, PivRootsError> {
        let blocks = pem::parse_many(text).map_err(PivRootsError::Pem)?;
        let mut out = PivRoots::none();
        for (index, block) in blocks
            .iter()
            .filter(|b| b.tag() == "CERTIFICATE")
            .enumerate()
        {
            let cert = Certificate::from_der_in_chain(block.contents())
                .map_err(|problem| PivRootsError::Unreadable { index, problem })?;
            if cert.issuer_der() == cert.subject_der() {
                if !cert.is_signed_by(&cert) {
                    return Err(PivRootsError::BadSelfSignature {
                        index,
                        name: cert.common_name().to_string(),
                    });
                }
                out.roots.push(cert);
            } else {
                out.intermediates.push(cert);
            }
        }
        if out.roots.is_empty() && out.intermediates.is_empty() {
            return Err(PivRootsError::Empty);
        }
        Ok(out)
    }

    /// Adds `other`'s roots and intermediates (what was verified before is verified again).
    pub fn add(&mut self, other: PivRoots) {
        self.roots.extend(other.roots);
        self.intermediates.extend(other.intermediates);
        self.verified = Arc::default();
    }

    /// [`verify_attestation`], remembering the chains that verified: a person's attestation is the same
    /// bytes at every renewal, so the chain's signatures are checked once and its validity
    /// against `now` every time. The same answer as [`verify_attestation`], at the cost of a hash.
    pub fn verify(&self, attestation: &[u8], f9: &[u8], now: i64) -> Result<PivFacts, PivRefusal> {
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        hash.update(&(attestation.len() as u64).to_be_bytes());
        hash.update(attestation);
        hash.update(f9);
        let mut key = [0u8; 32];
        key.copy_from_slice(hash.finish().as_ref());
        let known = self.verified.lock().ok().and_then(|v| v.get(&key).cloned());
        if let Some(v) = known {
            if v.from <= now && now <= v.to {
                return Ok(v.facts);
            }
        }
        let (facts, from, to) = verify_with_window(attestation, f9, self, now)?;
        if let Ok(mut v) = self.verified.lock() {
            if v.len() >= VERIFIED_MAX {
                v.clear();
            }
            v.insert(
                key,
                Verified {
                    facts: facts.clone(),
                    from,
                    to,
                },
            );
        }
        Ok(facts)
    }

    /// The roots' CNs, for messages.
    pub fn names(&self) -> Vec<String> {
        self.roots
            .iter()
            .map(|r| r.common_name().to_string())
            .collect()
    }
}

/// Checks `attestation` (the slot's certificate) and `f9` (the device's) against `roots` at
/// `now` (Unix seconds): the facts it proves about the attested key.
pub fn verify_attestation(
    attestation: &[u8],
    f9: &[u8],
    roots: &PivRoots,
    now: i64,
) -> Result<PivFacts, PivRefusal> {
    verify_with_window(attestation, f9, roots, now).map(|(facts, _, _)| facts)
}

/// [`verify_attestation`], and the window in which every certificate of the path is valid.
fn verify_with_window(
    attestation: &[u8],
    f9: &[u8],
    roots: &PivRoots,
    now: i64,
) -> Result<(PivFacts, i64, i64), PivRefusal> {
    let read = |which: &'static str, der: &[u8]| {
        Certificate::from_der_in_chain(der)
            .map_err(|problem| PivRefusal::Unreadable { which, problem })
    };
    let leaf = read("attestation", attestation)?;
    let device = read("device (f9)", f9)?;
    if !leaf.is_signed_by(&device) {
        return Err(PivRefusal::NotSignedByF9 {
            f9: device.common_name().to_string(),
        });
    }
    // Real f9 certificates may lack basic constraints (YubiKey 4); one that denies being a CA
    // is refused, and so is a slot's attestation posing as the f9: its key is a slot key any
    // holder of the device can sign with, so a leaf under it could say anything.
    if device.is_ca() == Some(false) {
        return Err(PivRefusal::F9NotCa);
    }
    if device.extension(OID_SERIAL).is_some() || device.extension(OID_POLICY).is_some() {
        return Err(PivRefusal::F9IsASlotAttestation {
            name: device.common_name().to_string(),
        });
    }
    let mut path: Vec<&Certificate> = vec![&leaf, &device];
    let root = climb(&device, roots, now, &mut path)?;
    let (mut from, mut to) = (i64::MIN, i64::MAX);
    for cert in path.iter().copied().chain([root]) {
        if !cert.valid_at(now) {
            return Err(PivRefusal::NotValidNow {
                which: cert.common_name().to_string(),
                from: cert.not_before,
                to: cert.not_after,
            });
        }
        (from, to) = (from.max(cert.not_before), to.min(cert.not_after));
    }
    Ok((facts(&leaf, root)?, from, to))
}

/// From `start` up to a root through at most [`MAX_INTERMEDIATES`] intermediates (each a CA,
/// each used once), appending the intermediates to `path`. The root is found by signature, not
/// by name: a root of the same name with another key is no root. Of two issuers with one key
/// and name (the 263751 root's two issues, a re-issued intermediate), one valid at `now` is
/// preferred.
fn climb<'a>(
    start: &'a Certificate,
    roots: &'a PivRoots,
    now: i64,
    path: &mut Vec<&'a Certificate>,
) -> Result<&'a Certificate, PivRefusal> {
    let mut current = start;
    let valid_first = |found: Vec<&'a Certificate>| {
        found
            .iter()
            .find(|c| c.valid_at(now))
            .or(found.first())
            .copied()
    };
    for _ in 0..=MAX_INTERMEDIATES {
        let issuers = roots.roots.iter().filter(|r| current.is_signed_by(r));
        if let Some(root) = valid_first(issuers.collect()) {
            return Ok(root);
        }
        let next = valid_first(
            roots
                .intermediates
                .iter()
                .filter(|i| {
                    i.is_ca() == Some(true)
                        && !path.iter().any(|p| p.der() == i.der())
                        && current.is_signed_by(i)
                })
                .collect(),
        );
        match next {
            Some(i) => {
                path.push(i);
                current = i;
            }
            None => break,
        }
    }
    Err(PivRefusal::NoPathToRoot {
        issuer: current.common_name().to_string(),
        roots: roots.names().join(", "),
    })
}

/// The facts in the attestation certificate's extensions.
fn facts(leaf: &Certificate, root: &Certificate) -> Result<PivFacts, PivRefusal> {
    let value = |what: &'static str, oid: &[u64]| {
        leaf.extension(oid)
            .map(|e| e.value.as_slice())
            .ok_or_else(|| PivRefusal::Missing {
                what,
                oid: oid.iter().map(u64::to_string).collect::<Vec<_>>().join("."),
            })
    };
    let firmware = match value("firmware", OID_FIRMWARE)? {
        [a, b, c] => Firmware(*a, *b, *c),
        _ => return Err(PivRefusal::Malformed { what: "firmware" }),
    };
    let serial = yasna::parse_der(value("serial", OID_SERIAL)?, |r| r.read_u64())
        .map_err(|_| PivRefusal::Malformed { what: "serial" })?;
    let (pin_policy, touch_policy) = match value("policy", OID_POLICY)? {
        [pin, touch] => (
            PinPolicy::from_byte(*pin).ok_or(PivRefusal::Malformed { what: "PIN policy" })?,
            TouchPolicy::from_byte(*touch).ok_or(PivRefusal::Malformed {
                what: "touch policy",
            })?,
        ),
        _ => return Err(PivRefusal::Malformed { what: "policy" }),
    };
    let form_factor = match leaf.extension(OID_FORM_FACTOR).map(|e| e.value.as_slice()) {
        None => None,
        Some([b]) => Some(*b),
        Some(_) => {
            return Err(PivRefusal::Malformed {
                what: "form factor",
            })
        }
    };
    let slot = leaf
        .common_name()
        .strip_prefix("YubiKey PIV Attestation ")
        .filter(|s| s.len() == 2 && s.chars().all(|c| c.is_ascii_hexdigit()))
        .map(str::to_string);
    Ok(PivFacts {
        serial,
        firmware,
        pin_policy,
        touch_policy,
        form_factor,
        slot,
        spki: leaf.spki_der().to_vec(),
        root: root.common_name().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der(pem_text: &str) -> Vec<u8> {
        pem::parse(pem_text).expect("PEM").into_contents()
    }

    const F9_543: &str = include_str!("../../tests/data/yubikey/f9-5.4.3.pem");
    const ATTESTATION_543: &str = include_str!("../../tests/data/yubikey/attestation-9a-5.4.3.pem");
    const F9_437: &str = include_str!("../../tests/data/yubikey/f9-4.3.7.pem");
    const ATTESTATION_437: &str = include_str!("../../tests/data/yubikey/attestation-9a-4.3.7.pem");
    const U2F_ROOT: &str =
        include_str!("../../tests/data/yubikey/yubico-u2f-root-ca-457200631.pem");

    const F9_574: &str = include_str!("../../tests/data/yubikey/f9-5.7.4.pem");
    const ATTESTATION_574: &str = include_str!("../../tests/data/yubikey/attestation-9c-5.7.4.pem");
    const ATTESTATION_574_2: &str =
        include_str!("../../tests/data/yubikey/attestation-9c-5.7.4-second-device.pem");

    /// 2026-01-01, inside every certificate's validity.
    const NOW: i64 = 1_767_225_600;

    #[test]
    fn yubicos_shipped_roots_read_and_verify_themselves() {
        let roots = PivRoots::yubico();
        let mut names = roots.names();
        names.sort();
        assert_eq!(
            names,
            [
                "Yubico Attestation Root 1",
                "Yubico PIV Root CA Serial 263751",
                "Yubico PIV Root CA Serial 263751"
            ]
        );
        assert_eq!(roots.intermediates.len(), 5);
        // The 2016 root and its 2018 re-issue: one key, two certificates.
        let [a, b] = [&roots.roots[0], &roots.roots[1]];
        assert_eq!(a.spki_der(), b.spki_der());
        assert_ne!(a.der(), b.der());
    }

    #[test]
    fn a_real_yubikey_attestation_holds_with_what_it_says() {
        let facts = verify_attestation(
            &der(ATTESTATION_543),
            &der(F9_543),
            &PivRoots::yubico(),
            NOW,
        )
        .expect("a YubiKey 5's attestation");
        assert_eq!(
            (
                facts.serial,
                facts.firmware,
                facts.pin_policy,
                facts.touch_policy
            ),
            (
                15_732_500,
                Firmware(5, 4, 3),
                PinPolicy::Once,
                TouchPolicy::Never
            )
        );
        assert_eq!(
            facts.form_factor.map(form_factor_name).as_deref(),
            Some("USB-C nano")
        );
        assert_eq!(facts.slot.as_deref(), Some("9a"));
        assert_eq!(facts.root, "Yubico PIV Root CA Serial 263751");
        let attested = Certificate::from_der_in_chain(&der(ATTESTATION_543)).expect("read");
        assert_eq!(facts.spki, attested.spki_der());
    }

    #[test]
    fn a_real_attestation_fails_outside_its_chains_validity_and_with_its_parts_swapped() {
        let roots = PivRoots::yubico();
        let (leaf, f9) = (der(ATTESTATION_543), der(F9_543));
        // 2052-05-01: after the root and the device certificates expire.
        let late = verify_attestation(&leaf, &f9, &roots, 2_597_788_800).expect_err("expired");
        assert!(matches!(late, PivRefusal::NotValidNow { .. }), "{late}");
        let early = verify_attestation(&leaf, &f9, &roots, 1_000_000_000).expect_err("not yet");
        assert!(matches!(early, PivRefusal::NotValidNow { .. }), "{early}");
        let swapped = verify_attestation(&f9, &leaf, &roots, NOW).expect_err("swapped");
        assert!(
            matches!(swapped, PivRefusal::NotSignedByF9 { .. }),
            "{swapped}"
        );
        let mut trailing = leaf.clone();
        trailing.push(0);
        let refused = verify_attestation(&trailing, &f9, &roots, NOW).expect_err("trailing byte");
        assert!(
            matches!(refused, PivRefusal::Unreadable { .. }),
            "{refused}"
        );
        // The device certificate of another YubiKey (signed by another root) does not sign it.
        let other =
            verify_attestation(&leaf, &der(F9_437), &roots, NOW).expect_err("another device");
        assert!(matches!(other, PivRefusal::NotSignedByF9 { .. }), "{other}");
    }

    /// A YubiKey 4 (its f9 has no extensions at all, and chains to the U2F root): no path to
    /// the shipped roots; with the U2F root added the chain holds, and the attestation is
    /// refused for having no serial to register.
    #[test]
    fn a_yubikey_4_chains_only_to_a_root_added_and_has_no_serial() {
        let (leaf, f9) = (der(ATTESTATION_437), der(F9_437));
        let refused =
            verify_attestation(&leaf, &f9, &PivRoots::yubico(), NOW).expect_err("U2F root");
        assert!(
            matches!(refused, PivRefusal::NoPathToRoot { .. }),
            "{refused}"
        );
        let mut roots = PivRoots::yubico();
        roots.add(PivRoots::from_pem(U2F_ROOT).expect("the U2F root"));
        let refused = verify_attestation(&leaf, &f9, &roots, NOW).expect_err("no serial");
        assert!(
            matches!(refused, PivRefusal::Missing { what: "serial", .. }),
            "{refused}"
        );
    }

    #[test]
    fn a_roots_file_must_hold_certificates_that_verify() {
        assert!(matches!(
            PivRoots::from_pem("no PEM here"),
            Err(PivRootsError::Empty)
        ));
        // The U2F root with one byte of its signature changed.
        let mut bad = der(U2F_ROOT);
        let last = bad.len() - 1;
        bad[last] ^= 1;
        let text = pem::encode(&pem::Pem::new("CERTIFICATE", bad));
        assert!(matches!(
            PivRoots::from_pem(&text),
            Err(PivRootsError::BadSelfSignature { .. })
        ));
    }

    /// Firmware 5.7.4: the f9 certificate is issued by an intermediate the device does not
    /// carry; the path goes through two shipped intermediates to "Yubico Attestation Root 1".
    /// Two devices share the f9 certificate: the serial tells them apart.
    #[test]
    fn a_5_7_4_attestation_chains_through_the_shipped_intermediates() {
        let roots = PivRoots::yubico();
        let f9 = der(F9_574);
        let facts = verify_attestation(&der(ATTESTATION_574), &f9, &roots, NOW).expect("5.7.4");
        assert_eq!(
            (
                facts.serial,
                facts.firmware,
                facts.pin_policy,
                facts.touch_policy
            ),
            (
                38_906_327,
                Firmware(5, 7, 4),
                PinPolicy::Always,
                TouchPolicy::Always
            )
        );
        assert_eq!(facts.slot.as_deref(), Some("9c"));
        assert_eq!(facts.root, "Yubico Attestation Root 1");
        let second =
            verify_attestation(&der(ATTESTATION_574_2), &f9, &roots, NOW).expect("second device");
        assert_eq!(second.serial, 38_906_331);
        // Root 1 alone, without the intermediates: no path.
        let root_only: String = YUBICO_PEM
            .split("Subject: ")
            .find(|part| part.starts_with("CN = Yubico Attestation Root 1"))
            .expect("Root 1 in the shipped file")
            .to_string();
        let refused = verify_attestation(
            &der(ATTESTATION_574),
            &f9,
            &PivRoots::from_pem(&root_only).expect("Root 1"),
            NOW,
        )
        .expect_err("no intermediates");
        assert!(
            matches!(refused, PivRefusal::NoPathToRoot { .. }),
            "{refused}"
        );
    }

    /// The roots remember a verified chain; its validity is checked against the time of each
    /// use, and a chain that did not verify is not remembered.
    #[test]
    fn a_remembered_chain_is_checked_against_the_time_of_each_use() {
        let roots = PivRoots::yubico();
        let (leaf, f9) = (der(ATTESTATION_543), der(F9_543));
        let first = roots.verify(&leaf, &f9, NOW).expect("verified");
        assert_eq!(roots.verify(&leaf, &f9, NOW + 1), Ok(first));
        let late = roots
            .verify(&leaf, &f9, 2_597_788_800)
            .expect_err("expired");
        assert!(matches!(late, PivRefusal::NotValidNow { .. }), "{late}");
        let swapped = roots.verify(&f9, &leaf, NOW).expect_err("swapped");
        assert!(
            matches!(swapped, PivRefusal::NotSignedByF9 { .. }),
            "{swapped}"
        );
        assert_eq!(roots.verified.lock().map(|v| v.len()).unwrap_or(0), 1);
    }

    /// Two issues of one root (one key, one name), the first expired: the chain goes through
    /// the one valid now, as it does for the 263751 root's 2016 and 2018 issues.
    #[test]
    fn of_two_issues_of_a_root_the_valid_one_is_used() {
        let day = time::Duration::days(1);
        let now = time::OffsetDateTime::from_unix_timestamp(NOW).expect("time");
        let root_key = rcgen::KeyPair::generate().expect("key");
        let issue = |from, to| {
            let mut p = rcgen::CertificateParams::default();
            p.distinguished_name
                .push(rcgen::DnType::CommonName, "Test PIV Root");
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            (p.not_before, p.not_after) = (from, to);
            p.self_signed(&root_key).expect("root")
        };
        let (old, new) = (
            issue(now - day * 400, now - day),
            issue(now - day, now + day * 400),
        );
        let f9_key = rcgen::KeyPair::generate().expect("key");
        let mut f9 = rcgen::CertificateParams::default();
        f9.distinguished_name
            .push(rcgen::DnType::CommonName, "Yubico PIV Attestation");
        (f9.not_before, f9.not_after) = (now - day, now + day * 400);
        let issuer = rcgen::Issuer::from_ca_cert_der(new.der(), &root_key).expect("issuer");
        let f9 = f9.signed_by(&f9_key, &issuer).expect("f9");
        let slot_key = rcgen::KeyPair::generate().expect("key");
        let mut leaf = rcgen::CertificateParams::default();
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, "YubiKey PIV Attestation 9a");
        (leaf.not_before, leaf.not_after) = (now - day, now + day * 400);
        let ext = |arc: u64, v: Vec<u8>| {
            rcgen::CustomExtension::from_oid_content(&[1, 3, 6, 1, 4, 1, 41482, 3, arc], v)
        };
        leaf.custom_extensions = vec![
            ext(3, vec![5, 4, 3]),
            ext(7, yasna::construct_der(|w| w.write_u64(7))),
            ext(8, vec![2, 2]),
        ];
        let issuer = rcgen::Issuer::from_ca_cert_der(f9.der(), &f9_key).expect("issuer");
        let leaf = leaf.signed_by(&slot_key, &issuer).expect("leaf");
        let roots = PivRoots::from_pem(&format!("{}{}", old.pem(), new.pem())).expect("roots");
        let facts =
            verify_attestation(leaf.der(), f9.der(), &roots, NOW).expect("through the valid issue");
        assert_eq!(facts.serial, 7);
    }

    #[test]
    fn policies_are_ordered_by_strength() {
        assert!(PinPolicy::Never < PinPolicy::Once && PinPolicy::Once < PinPolicy::Always);
        assert!(
            TouchPolicy::Never < TouchPolicy::Cached && TouchPolicy::Cached < TouchPolicy::Always
        );
        assert_eq!(TouchPolicy::from_byte(2), Some(TouchPolicy::Always));
        assert_eq!(TouchPolicy::from_byte(3), Some(TouchPolicy::Cached));
        assert_eq!(PinPolicy::from_byte(0), None);
        assert_eq!("5.7.4".parse(), Ok(Firmware(5, 7, 4)));
        assert!("5.7".parse::<Firmware>().is_err());
    }
}
