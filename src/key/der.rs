//! The few DER structures the key layer builds or reads itself: SubjectPublicKeyInfo for EC and
//! RSA keys, ECDSA signature conversion, and the DER wrapping of `CKA_EC_POINT`.
//!
//! Hardware hands out raw pieces (an EC point, a modulus, r||s); TLS and X.509 want DER. These
//! conversions are the only place that knows both shapes.

use super::{KeyAlgorithm, KeyError, Malformation};

const OID_EC_PUBLIC_KEY: &[u64] = &[1, 2, 840, 10045, 2, 1];
const OID_RSA_ENCRYPTION: &[u64] = &[1, 2, 840, 113549, 1, 1, 1];
const OID_P256: &[u64] = &[1, 2, 840, 10045, 3, 1, 7];
const OID_P384: &[u64] = &[1, 3, 132, 0, 34];

/// Builds the SPKI of an EC key from its uncompressed point (`04 || X || Y`).
pub fn ec_spki(alg: KeyAlgorithm, point: &[u8]) -> Result<Vec<u8>, KeyError> {
    let curve = match alg {
        KeyAlgorithm::EcP256 => OID_P256,
        KeyAlgorithm::EcP384 => OID_P384,
        KeyAlgorithm::Rsa { .. } => {
            return Err(KeyError::Malformed {
                what: "EC public key".into(),
                problem: Malformation::NoEcPoint,
            })
        }
    };
    let expected = 1 + 2 * alg.ec_scalar_len().unwrap_or(0);
    if point.len() != expected || point[0] != 0x04 {
        return Err(KeyError::Malformed {
            what: "EC public key".into(),
            problem: Malformation::PointLength {
                alg: alg.to_string(),
                expected,
                got: point.len(),
            },
        });
    }
    Ok(yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_sequence(|w| {
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(
                        OID_EC_PUBLIC_KEY,
                    ));
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(curve));
            });
            w.next().write_bitvec_bytes(point, point.len() * 8);
        })
    }))
}

/// Builds the SPKI of an RSA key from its modulus and public exponent (big-endian, unsigned).
pub fn rsa_spki(modulus: &[u8], exponent: &[u8]) -> Vec<u8> {
    let rsa_public_key = rsa_public_key(modulus, exponent);
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_sequence(|w| {
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(
                        OID_RSA_ENCRYPTION,
                    ));
                w.next().write_null();
            });
            w.next()
                .write_bitvec_bytes(&rsa_public_key, rsa_public_key.len() * 8);
        })
    })
}

/// The PKCS#1 `RSAPublicKey` structure (what an RSA SPKI's BIT STRING holds).
pub fn rsa_public_key(modulus: &[u8], exponent: &[u8]) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_bigint_bytes(strip_zeros(modulus), true);
            w.next().write_bigint_bytes(strip_zeros(exponent), true);
        })
    })
}

fn strip_zeros(b: &[u8]) -> &[u8] {
    let first = b
        .iter()
        .position(|&x| x != 0)
        .unwrap_or(b.len().saturating_sub(1));
    &b[first..]
}

/// What an SPKI says about its key: the algorithm and the BIT STRING contents (the EC point or
/// the PKCS#1 `RSAPublicKey`, which is what rcgen calls `der_bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpkiInfo {
    /// The key's algorithm, from the SPKI's algorithm identifier and parameters.
    pub algorithm: KeyAlgorithm,
    /// The SPKI's BIT STRING contents (EC point or PKCS#1 RSA public key).
    pub key_bits: Vec<u8>,
}

/// Reads an SPKI, recognising P-256, P-384 and RSA keys.
pub fn parse_spki(spki: &[u8]) -> Result<SpkiInfo, KeyError> {
    use x509_parser::prelude::FromDer;
    let bad = |problem| KeyError::Malformed {
        what: "SubjectPublicKeyInfo".into(),
        problem,
    };
    let (_, info) = x509_parser::x509::SubjectPublicKeyInfo::from_der(spki)
        .map_err(|e| bad(Malformation::NotDer(e.into())))?;
    let oid = info.algorithm.algorithm.to_id_string();
    let key_bits = info.subject_public_key.data.to_vec();
    let algorithm = match oid.as_str() {
        "1.2.840.10045.2.1" => {
            let params = info
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|o| o.to_id_string())
                .unwrap_or_default();
            match params.as_str() {
                "1.2.840.10045.3.1.7" => KeyAlgorithm::EcP256,
                "1.3.132.0.34" => KeyAlgorithm::EcP384,
                other => return Err(bad(Malformation::UnsupportedCurve(other.to_string()))),
            }
        }
        "1.2.840.113549.1.1.1" => {
            let (modulus, _) = parse_rsa_public_key(&key_bits)?;
            KeyAlgorithm::Rsa {
                bits: (modulus.len() * 8) as u32,
            }
        }
        other => return Err(bad(Malformation::UnsupportedAlgorithm(other.to_string()))),
    };
    Ok(SpkiInfo {
        algorithm,
        key_bits,
    })
}

/// Splits a PKCS#1 `RSAPublicKey` into (modulus, exponent), leading zeros removed.
pub fn parse_rsa_public_key(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>), KeyError> {
    yasna::parse_der(der, |r| {
        r.read_sequence(|r| {
            let (n, _) = r.next().read_bigint_bytes()?;
            let (e, _) = r.next().read_bigint_bytes()?;
            Ok((strip_zeros(&n).to_vec(), strip_zeros(&e).to_vec()))
        })
    })
    .map_err(|e| KeyError::Malformed {
        what: "RSA public key".into(),
        problem: Malformation::Asn1(e),
    })
}

/// Converts a raw `r || s` ECDSA signature (what PKCS#11 and the TPM return) to DER.
pub fn ecdsa_raw_to_der(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    if raw.is_empty() || !raw.len().is_multiple_of(2) {
        return Err(KeyError::Malformed {
            what: "ECDSA signature".into(),
            problem: Malformation::OddSignature(raw.len()),
        });
    }
    let (r, s) = raw.split_at(raw.len() / 2);
    Ok(ecdsa_rs_to_der(r, s))
}

/// Encodes separate ECDSA scalars r and s (unsigned big-endian) as `Ecdsa-Sig-Value`.
pub fn ecdsa_rs_to_der(r: &[u8], s: &[u8]) -> Vec<u8> {
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_bigint_bytes(strip_zeros(r), true);
            w.next().write_bigint_bytes(strip_zeros(s), true);
        })
    })
}

/// Accepts `CKA_EC_POINT` in both shapes seen in the wild: the DER OCTET STRING the standard
/// asks for, and the raw point some modules return.
pub fn unwrap_ec_point(alg: KeyAlgorithm, value: &[u8]) -> Result<Vec<u8>, KeyError> {
    let raw_len = 1 + 2 * alg.ec_scalar_len().unwrap_or(0);
    if value.len() == raw_len && value[0] == 0x04 {
        return Ok(value.to_vec());
    }
    yasna::parse_der(value, |r| r.read_bytes()).map_err(|e| KeyError::Malformed {
        what: "CKA_EC_POINT".into(),
        problem: Malformation::NotAPoint(e),
    })
}

/// Wraps a PEM label around DER, with Unix line endings (like OpenSSL): hwkey's one PEM
/// encoder, for keys, certificates, requests and TSS2 key files alike.
pub fn to_pem(label: &str, der: &[u8]) -> String {
    pem::encode_config(
        &pem::Pem::new(label, der.to_vec()),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}

/// The SubjectPublicKeyInfo (DER) of a certificate.
pub fn cert_spki(cert: &[u8]) -> Result<Vec<u8>, KeyError> {
    let (_, c) = x509_parser::parse_x509_certificate(cert).map_err(|e| KeyError::Malformed {
        what: "certificate".into(),
        problem: Malformation::Certificate(e.into()),
    })?;
    Ok(c.tbs_certificate.subject_pki.raw.to_vec())
}

/// True when two SPKIs hold the same public key (compares algorithm and key bits, so encodings
/// that differ only in optional parameters still match).
pub fn same_public_key(a: &[u8], b: &[u8]) -> bool {
    match (parse_spki(a), parse_spki(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Orders certificates found with a key: the one for `spki` first, then each issuer in turn,
/// then anything left over. Token searches return objects in no particular order.
pub fn order_chain(spki: &[u8], mut certs: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    fn names(cert: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
        let (_, c) = x509_parser::parse_x509_certificate(cert).ok()?;
        Some((
            c.tbs_certificate.subject.as_raw().to_vec(),
            c.tbs_certificate.issuer.as_raw().to_vec(),
        ))
    }
    let mut out = Vec::new();
    let Some(leaf) = certs
        .iter()
        .position(|c| cert_spki(c).is_ok_and(|s| same_public_key(&s, spki)))
    else {
        return certs;
    };
    out.push(certs.remove(leaf));
    while let Some((_, issuer)) = out.last().and_then(|c| names(c)) {
        let Some(next) = certs
            .iter()
            .position(|c| names(c).is_some_and(|(subject, _)| subject == issuer))
        else {
            break;
        };
        let next = certs.remove(next);
        let self_signed = names(&next).is_some_and(|(s, i)| s == i);
        out.push(next);
        if self_signed {
            break;
        }
    }
    out.extend(certs);
    out
}

/// The certificates written back to back in `bytes` (DER, as a TPM's EK chain NV index holds
/// them), up to the first thing that is not one (padding, or the end).
pub fn split_der_certificates(bytes: &[u8]) -> Vec<Vec<u8>> {
    use x509_parser::prelude::FromDer as _;
    let mut out = Vec::new();
    let mut rest = bytes;
    while let Ok((after, _)) = x509_parser::certificate::X509Certificate::from_der(rest) {
        let used = rest.len() - after.len();
        if used == 0 {
            break;
        }
        out.push(rest[..used].to_vec());
        rest = after;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ecdsa_der_has_positive_integers() {
        let mut raw = vec![0x80u8; 32];
        raw.extend(std::iter::repeat_n(0x01, 32));
        let der = ecdsa_raw_to_der(&raw).expect("der");
        // SEQUENCE, len, INTEGER 33 bytes (leading zero for the high bit), INTEGER 32 bytes.
        assert_eq!(der[2], 0x02);
        assert_eq!(der[3], 33);
        assert_eq!(der[4], 0x00);
    }

    #[test]
    fn ec_point_accepts_raw_and_wrapped() {
        let mut point = vec![0x04u8];
        point.extend([7u8; 64]);
        let wrapped = yasna::construct_der(|w| w.write_bytes(&point));
        assert_eq!(
            unwrap_ec_point(KeyAlgorithm::EcP256, &point).expect("raw"),
            point
        );
        assert_eq!(
            unwrap_ec_point(KeyAlgorithm::EcP256, &wrapped).expect("wrapped"),
            point
        );
    }

    #[test]
    fn spki_round_trips() {
        let mut point = vec![0x04u8];
        point.extend([9u8; 96]);
        let spki = ec_spki(KeyAlgorithm::EcP384, &point).expect("spki");
        let info = parse_spki(&spki).expect("parse");
        assert_eq!(info.algorithm, KeyAlgorithm::EcP384);
        assert_eq!(info.key_bits, point);

        let spki = rsa_spki(&[0x00, 0xc1, 0x02, 0x03], &[0x01, 0x00, 0x01]);
        let info = parse_spki(&spki).expect("parse rsa");
        let (n, e) = parse_rsa_public_key(&info.key_bits).expect("pkcs1");
        assert_eq!(n, vec![0xc1, 0x02, 0x03]);
        assert_eq!(e, vec![0x01, 0x00, 0x01]);
    }
}
