//! The TSS2 PRIVATE KEY file format shared by tpm2-openssl, tpm2-tss-engine and
//! openssl_tpm2_engine, so a key made by one tool is used by the others.
//!
//! ```text
//! TPMKey ::= SEQUENCE {
//!     type        OBJECT IDENTIFIER,              -- 2.23.133.10.1.3: a loadable key
//!     emptyAuth   [0] EXPLICIT BOOLEAN OPTIONAL,
//!     policy      [1] EXPLICIT SEQUENCE OPTIONAL, -- openssl_tpm2_engine only
//!     secret      [2] EXPLICIT OCTET STRING OPTIONAL,
//!     authPolicy  [3] EXPLICIT SEQUENCE OPTIONAL,
//!     description [4] EXPLICIT UTF8String OPTIONAL,
//!     rsaParent   [5] EXPLICIT BOOLEAN OPTIONAL,
//!     parent      INTEGER,                        -- 0x40000001 or a persistent handle
//!     pubkey      OCTET STRING,                   -- a marshalled TPM2B_PUBLIC
//!     privkey     OCTET STRING }                  -- a marshalled TPM2B_PRIVATE
//! ```
//!
//! We write exactly what tpm2-openssl writes (type, emptyAuth TRUE unless the key has a
//! password, parent, pubkey, privkey) and read the optional fields of the other tools so we can
//! refuse, with a reason, the keys we cannot use (policies, importable keys). The private part is the TPM's encrypted
//! blob: it is useless without the TPM that made it, but files are still written 0600.

use tss_esapi::structures::{Private, Public};
use tss_esapi::traits::{Marshall, UnMarshall};
use yasna::models::ObjectIdentifier;
use yasna::{ASN1Error, ASN1ErrorKind, Tag, TagClass};

use crate::key::Tss2Problem;

/// The PEM label of the format.
pub(crate) const PEM_LABEL: &str = "TSS2 PRIVATE KEY";

const OID_LOADABLE_KEY: &[u64] = &[2, 23, 133, 10, 1, 3];
const OID_IMPORTABLE_KEY: &[u64] = &[2, 23, 133, 10, 1, 4];
const OID_SEALED_DATA: &[u64] = &[2, 23, 133, 10, 1, 5];

/// A loadable TPM key as stored in a file.
#[derive(Debug, Clone)]
pub(crate) struct Tss2Key {
    /// The TPM handle of the parent: [`super::primary::OWNER_HIERARCHY`] or a persistent key.
    pub parent: u32,
    /// The public area.
    pub public: Public,
    /// The private blob, encrypted by the parent.
    pub private: Private,
    /// True when the key has no password (`emptyAuth TRUE`); else its authValue comes from
    /// the URI's `pin-source`.
    pub empty_auth: bool,
}

impl Tss2Key {
    /// The DER encoding, as tpm2-openssl writes it.
    pub(crate) fn to_der(&self) -> Result<Vec<u8>, Tss2Problem> {
        let public = self
            .public
            .marshall()
            .map_err(|e| Tss2Problem::Marshal(Box::new(e)))?;
        let pubkey = tpm2b(&public)?;
        let privkey = tpm2b(self.private.value())?;
        Ok(yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_oid(&ObjectIdentifier::from_slice(OID_LOADABLE_KEY));
                // tpm2-openssl writes emptyAuth only when it is TRUE (absent means FALSE).
                if self.empty_auth {
                    w.next()
                        .write_tagged(Tag::context(0), |w| w.write_bool(true));
                }
                w.next().write_u32(self.parent);
                w.next().write_bytes(&pubkey);
                w.next().write_bytes(&privkey);
            })
        }))
    }

    /// The PEM text of the file (LF line ends, like OpenSSL).
    pub(crate) fn to_pem(&self) -> Result<String, Tss2Problem> {
        Ok(crate::key::der::to_pem(PEM_LABEL, &self.to_der()?))
    }

    /// Reads a key file's contents: PEM (the usual form) or bare DER (tpm2-openssl can write
    /// either). The caller puts the path next to the error.
    pub(crate) fn from_file_bytes(data: &[u8]) -> Result<Tss2Key, Tss2Problem> {
        if data.first() == Some(&0x30) {
            return Self::from_der(data);
        }
        let blocks = pem::parse_many(data).map_err(|e| Tss2Problem::NotPem(Box::new(e)))?;
        match blocks.iter().find(|b| b.tag() == PEM_LABEL) {
            Some(block) => Self::from_der(block.contents()),
            None if blocks.is_empty() => Err(Tss2Problem::NoBlock),
            None => Err(Tss2Problem::OtherBlocks(
                blocks
                    .iter()
                    .map(|b| b.tag().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            )),
        }
    }

    /// Parses the DER structure and checks that hwkey can use the key.
    pub(crate) fn from_der(der: &[u8]) -> Result<Tss2Key, Tss2Problem> {
        let raw = RawKey::parse(der)?;
        check_type(&raw.oid)?;
        let empty_auth = check_auth(&raw.tagged)?;
        let parent = u32::try_from(raw.parent).map_err(|_| Tss2Problem::Parent(raw.parent))?;
        let public = Public::unmarshall(untpm2b(&raw.pubkey, "pubkey")?)
            .map_err(|e| Tss2Problem::Pubkey(Box::new(e)))?;
        let private = Private::try_from(untpm2b(&raw.privkey, "privkey")?)
            .map_err(|e| Tss2Problem::Privkey(Box::new(e)))?;
        Ok(Tss2Key {
            parent,
            public,
            private,
            empty_auth,
        })
    }
}

/// The ASN.1 fields of a key file, before any of them is checked.
struct RawKey {
    oid: ObjectIdentifier,
    tagged: Vec<yasna::models::TaggedDerValue>,
    parent: u64,
    pubkey: Vec<u8>,
    privkey: Vec<u8>,
}

impl RawKey {
    fn parse(der: &[u8]) -> Result<RawKey, Tss2Problem> {
        // BER, not DER: OpenSSL (so tpm2-openssl) encodes emptyAuth TRUE as 0x01, not 0xff.
        yasna::parse_ber(der, |r| {
            r.read_sequence(|r| {
                let oid = r.next().read_oid()?;
                let mut tagged = Vec::new();
                while let Some(t) = r.read_optional(|r| {
                    if r.lookahead_tag()?.tag_class != TagClass::ContextSpecific {
                        return Err(ASN1Error::new(ASN1ErrorKind::Invalid));
                    }
                    r.read_tagged_der()
                })? {
                    tagged.push(t);
                }
                Ok(RawKey {
                    oid,
                    tagged,
                    parent: r.next().read_u64()?,
                    pubkey: r.next().read_bytes()?,
                    privkey: r.next().read_bytes()?,
                })
            })
        })
        .map_err(Tss2Problem::NotAsn1)
    }
}

/// Only loadable keys: importable keys and sealed data are refused by name.
fn check_type(oid: &ObjectIdentifier) -> Result<(), Tss2Problem> {
    if *oid == ObjectIdentifier::from_slice(OID_IMPORTABLE_KEY) {
        return Err(Tss2Problem::Importable);
    }
    if *oid == ObjectIdentifier::from_slice(OID_SEALED_DATA) {
        return Err(Tss2Problem::SealedData);
    }
    if *oid != ObjectIdentifier::from_slice(OID_LOADABLE_KEY) {
        return Err(Tss2Problem::UnknownType(oid.to_string()));
    }
    Ok(())
}

/// Only keys without a policy or import secret; returns whether the password is empty.
fn check_auth(tagged: &[yasna::models::TaggedDerValue]) -> Result<bool, Tss2Problem> {
    let mut empty_auth = false;
    for t in tagged {
        match t.tag().tag_number {
            0 => {
                empty_auth = yasna::parse_ber(t.value(), |r| r.read_bool())
                    .map_err(Tss2Problem::EmptyAuthNotBool)?
            }
            1 | 3 => return Err(Tss2Problem::Policy),
            2 => return Err(Tss2Problem::ImportSecret),
            // description and rsaParent do not change how the key is used.
            _ => {}
        }
    }
    Ok(empty_auth)
}

/// True if `data` is a TSS2 key file of any kind (even one hwkey cannot use), which is what
/// `delete` insists on before it removes a file.
pub(crate) fn is_tss2_file(data: &[u8]) -> bool {
    let der = if data.first() == Some(&0x30) {
        data.to_vec()
    } else {
        match pem::parse_many(data) {
            Ok(blocks) => match blocks.into_iter().find(|b| b.tag() == PEM_LABEL) {
                Some(b) => b.into_contents(),
                None => return false,
            },
            Err(_) => return false,
        }
    };
    let oid = yasna::parse_ber(&der, |r| {
        r.read_sequence(|r| {
            let oid = r.next().read_oid()?;
            // Skip the rest: only the type matters here.
            while r.read_optional(|r| r.read_der())?.is_some() {}
            Ok(oid)
        })
    });
    oid.is_ok_and(|oid| oid.components().starts_with(&[2, 23, 133, 10, 1]))
}

/// Prefixes a TPM2B's size (big-endian u16).
fn tpm2b(body: &[u8]) -> Result<Vec<u8>, Tss2Problem> {
    let size = u16::try_from(body.len()).map_err(|_| Tss2Problem::TooLarge)?;
    let mut out = Vec::with_capacity(body.len() + 2);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// The body of a marshalled TPM2B, which must fill the field exactly.
fn untpm2b<'a>(field: &'a [u8], name: &'static str) -> Result<&'a [u8], Tss2Problem> {
    let (size, body) = field
        .split_first_chunk::<2>()
        .ok_or(Tss2Problem::ShortTpm2b(name))?;
    let size = usize::from(u16::from_be_bytes(*size));
    if body.len() != size {
        return Err(Tss2Problem::Tpm2bSize {
            field: name,
            size,
            got: body.len(),
        });
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::tpm::keygen;
    use crate::key::KeyAlgorithm;

    fn sample() -> Tss2Key {
        Tss2Key {
            parent: 0x4000_0001,
            public: keygen::template(KeyAlgorithm::EcP256, false).expect("template"),
            private: Private::try_from(vec![7u8; 126]).expect("private"),
            empty_auth: true,
        }
    }

    /// A key file is outside input too; mutated, cut or random DER is refused, never
    /// a panic (fixed seed and case count, like the other property tests).
    #[test]
    fn mutated_key_files_never_panic() {
        use proptest::prelude::*;
        let der = sample().to_der().expect("der");
        let config = proptest::test_runner::Config {
            cases: 2000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x0068_776b_6579),
            failure_persistence: None,
            ..Default::default()
        };
        proptest!(config, |(at in 0usize..1024, byte in any::<u8>(), cut in 0usize..1024,
                            random in proptest::collection::vec(any::<u8>(), 0..300))| {
            let mut m = der.clone();
            let i = at % m.len();
            m[i] ^= byte | 1;
            let _ = Tss2Key::from_der(&m);
            let _ = Tss2Key::from_der(&der[..cut % der.len()]);
            let _ = Tss2Key::from_der(&random);
            let _ = crate::key::tpm::evidence::public_key_spki(&random);
            let _ = crate::key::tpm::evidence::check_attestation_key(&m[..cut % m.len()]);
        });
    }

    #[test]
    fn round_trips_and_matches_the_tpm2_openssl_layout() {
        let key = sample();
        let der = key.to_der().expect("der");
        // SEQUENCE { OID 2.23.133.10.1.3, [0] { TRUE }, INTEGER 0x40000001, ... }
        let head = [
            0x06, 0x06, 0x67, 0x81, 0x05, 0x0a, 0x01, 0x03, 0xa0, 0x03, 0x01, 0x01, 0xff, 0x02,
            0x04, 0x40, 0x00, 0x00, 0x01, 0x04,
        ];
        let start = if der[1] & 0x80 != 0 {
            2 + usize::from(der[1] & 0x7f)
        } else {
            2
        };
        assert_eq!(&der[start..start + head.len()], &head);
        let back = Tss2Key::from_der(&der).expect("parse");
        assert_eq!(back.parent, key.parent);
        assert_eq!(back.public, key.public);
        assert_eq!(back.private, key.private);

        let pem = key.to_pem().expect("pem");
        assert!(pem.starts_with("-----BEGIN TSS2 PRIVATE KEY-----\n"));
        assert!(!pem.contains('\r'));
        let back = Tss2Key::from_file_bytes(pem.as_bytes()).expect("pem parse");
        assert_eq!(back.public, key.public);
    }

    #[test]
    fn refuses_keys_it_cannot_use() {
        let key = sample();
        let der = key.to_der().expect("der");
        // emptyAuth FALSE: flip the BOOLEAN.
        let mut no_empty = der.clone();
        let at = no_empty
            .windows(3)
            .position(|w| w == [0x01, 0x01, 0xff])
            .expect("boolean");
        no_empty[at + 2] = 0x00;
        let with_password = Tss2Key::from_der(&no_empty).expect("a key with a password");
        assert!(!with_password.empty_auth);

        let err = Tss2Key::from_file_bytes(
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect_err("wrong label")
        .to_string();
        assert!(err.contains("PRIVATE KEY"), "{err}");
        let err = Tss2Key::from_file_bytes(b"garbage")
            .expect_err("garbage")
            .to_string();
        assert!(err.contains("TSS2 PRIVATE KEY"), "{err}");
    }

    #[test]
    fn tpm2b_sizes_are_checked() {
        assert!(untpm2b(&[0, 3, 1, 2], "x").is_err());
        assert_eq!(untpm2b(&[0, 2, 1, 2], "x").expect("ok"), &[1, 2]);
    }
}
