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
//! We write exactly what tpm2-openssl writes (type, emptyAuth TRUE, parent, pubkey, privkey) and
//! read the optional fields of the other tools so we can refuse, with a reason, the keys we
//! cannot use (passwords, policies, importable keys). The private part is the TPM's encrypted
//! blob: it is useless without the TPM that made it, but files are still written 0600.

use tss_esapi::structures::{Private, Public};
use tss_esapi::traits::{Marshall, UnMarshall};
use yasna::models::ObjectIdentifier;
use yasna::{ASN1Error, ASN1ErrorKind, Tag, TagClass};

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
}

impl Tss2Key {
    /// The DER encoding, as tpm2-openssl writes it.
    pub(crate) fn to_der(&self) -> Result<Vec<u8>, String> {
        let public = self
            .public
            .marshall()
            .map_err(|e| format!("cannot marshal the public area: {e}"))?;
        let pubkey = tpm2b(&public)?;
        let privkey = tpm2b(self.private.value())?;
        Ok(yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_oid(&ObjectIdentifier::from_slice(OID_LOADABLE_KEY));
                w.next()
                    .write_tagged(Tag::context(0), |w| w.write_bool(true));
                w.next().write_u32(self.parent);
                w.next().write_bytes(&pubkey);
                w.next().write_bytes(&privkey);
            })
        }))
    }

    /// The PEM text of the file (LF line ends, like OpenSSL).
    pub(crate) fn to_pem(&self) -> Result<String, String> {
        Ok(crate::key::der::to_pem(PEM_LABEL, &self.to_der()?))
    }

    /// Reads a key file's contents: PEM (the usual form) or bare DER (tpm2-openssl can write
    /// either). The error is a reason, to be put next to the path by the caller.
    pub(crate) fn from_file_bytes(data: &[u8]) -> Result<Tss2Key, String> {
        if data.first() == Some(&0x30) {
            return Self::from_der(data);
        }
        let blocks = pem::parse_many(data).map_err(|e| format!("not PEM: {e}"))?;
        match blocks.iter().find(|b| b.tag() == PEM_LABEL) {
            Some(block) => Self::from_der(block.contents()),
            None if blocks.is_empty() => {
                Err(format!("no -----BEGIN {PEM_LABEL}----- block in the file"))
            }
            None => Err(format!(
                "no -----BEGIN {PEM_LABEL}----- block; the file holds: {}",
                blocks
                    .iter()
                    .map(|b| b.tag().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    /// Parses the DER structure and checks that hwkey can use the key.
    pub(crate) fn from_der(der: &[u8]) -> Result<Tss2Key, String> {
        // BER, not DER: OpenSSL (so tpm2-openssl) encodes emptyAuth TRUE as 0x01, not 0xff.
        let raw = yasna::parse_ber(der, |r| {
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
                let parent = r.next().read_u64()?;
                let pubkey = r.next().read_bytes()?;
                let privkey = r.next().read_bytes()?;
                Ok((oid, tagged, parent, pubkey, privkey))
            })
        })
        .map_err(|e| format!("not the TSS2 key ASN.1 structure: {e}"))?;
        let (oid, tagged, parent, pubkey, privkey) = raw;

        if oid == ObjectIdentifier::from_slice(OID_IMPORTABLE_KEY) {
            return Err(
                "it is an importable key (2.23.133.10.1.4), which must be imported into \
                        the TPM before use; hwkey reads loadable keys (2.23.133.10.1.3)"
                    .into(),
            );
        }
        if oid == ObjectIdentifier::from_slice(OID_SEALED_DATA) {
            return Err("it holds sealed data (2.23.133.10.1.5), not a key".into());
        }
        if oid != ObjectIdentifier::from_slice(OID_LOADABLE_KEY) {
            return Err(format!(
                "unknown key type {oid}; hwkey reads loadable keys (2.23.133.10.1.3)"
            ));
        }

        let mut empty_auth = false;
        for t in &tagged {
            match t.tag().tag_number {
                0 => {
                    empty_auth = yasna::parse_ber(t.value(), |r| r.read_bool())
                        .map_err(|e| format!("emptyAuth is not a BOOLEAN: {e}"))?
                }
                1 | 3 => {
                    return Err(
                        "the key requires a policy session (policy/authPolicy fields); \
                                hwkey only uses keys with an empty password and no policy"
                            .into(),
                    )
                }
                2 => {
                    return Err(
                        "the key has an import secret (an importable key); import it first".into(),
                    )
                }
                // description and rsaParent do not change how the key is used.
                _ => {}
            }
        }
        if !empty_auth {
            return Err(
                "the key has a password (emptyAuth is not TRUE); hwkey only uses keys \
                        with an empty password: create the key without one"
                    .into(),
            );
        }

        let parent = u32::try_from(parent)
            .map_err(|_| format!("parent {parent:#x} is not a 32-bit TPM handle"))?;
        let public = Public::unmarshall(untpm2b(&pubkey, "pubkey")?)
            .map_err(|e| format!("pubkey is not a TPM2B_PUBLIC: {e}"))?;
        let private = Private::try_from(untpm2b(&privkey, "privkey")?)
            .map_err(|e| format!("privkey is not a TPM2B_PRIVATE: {e}"))?;
        Ok(Tss2Key {
            parent,
            public,
            private,
        })
    }
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
fn tpm2b(body: &[u8]) -> Result<Vec<u8>, String> {
    let size =
        u16::try_from(body.len()).map_err(|_| "a TPM2B body over 65535 bytes".to_string())?;
    let mut out = Vec::with_capacity(body.len() + 2);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// The body of a marshalled TPM2B, which must fill the field exactly.
fn untpm2b<'a>(field: &'a [u8], name: &str) -> Result<&'a [u8], String> {
    let (size, body) = field
        .split_first_chunk::<2>()
        .ok_or_else(|| format!("{name} is shorter than a TPM2B size field"))?;
    let size = usize::from(u16::from_be_bytes(*size));
    if body.len() != size {
        return Err(format!(
            "{name} says it holds {size} bytes but {} follow",
            body.len()
        ));
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
            public: keygen::template(KeyAlgorithm::EcP256).expect("template"),
            private: Private::try_from(vec![7u8; 126]).expect("private"),
        }
    }

    /// Issue 21: a key file is outside input too; mutated, cut or random DER is refused, never
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
        let err = Tss2Key::from_der(&no_empty).expect_err("password key");
        assert!(err.contains("password"), "{err}");

        let err = Tss2Key::from_file_bytes(
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect_err("wrong label");
        assert!(err.contains("PRIVATE KEY"), "{err}");
        let err = Tss2Key::from_file_bytes(b"garbage").expect_err("garbage");
        assert!(err.contains("TSS2 PRIVATE KEY"), "{err}");
    }

    #[test]
    fn tpm2b_sizes_are_checked() {
        assert!(untpm2b(&[0, 3, 1, 2], "x").is_err());
        assert_eq!(untpm2b(&[0, 2, 1, 2], "x").expect("ok"), &[1, 2]);
    }
}
