//! EMSA-PSS encoding (RFC 8017 §9.1.1) done by hwkey, for devices that can do the raw RSA
//! private-key operation but not PSS padding: TPMs (whose PSS salt length TLS 1.3 peers
//! reject) and PKCS#11 tokens with `CKM_RSA_X_509` but no `CKM_RSA_PKCS_PSS` (many smart cards
//! and older HSMs). The salt is random and as long as the hash, which is what TLS 1.3 requires;
//! only the padding is computed here: the private-key operation stays in the device, and the
//! caller verifies the result against the public key before it is released.

use ring::rand::SecureRandom;

use super::{HashAlg, KeyError};
use crate::key::CapabilityError;

/// Encodes the digest `m_hash` for a `mod_bits`-bit RSA key with MGF1 of the same hash and a
/// random salt of the hash length; returns the encoded message left-padded to the modulus
/// length (the input of a raw RSA operation).
pub(crate) fn encode(m_hash: &[u8], hash: HashAlg, mod_bits: usize) -> Result<Vec<u8>, KeyError> {
    let mut salt = vec![0u8; hash.output_len()];
    ring::rand::SystemRandom::new()
        .fill(&mut salt)
        .map_err(|_| {
            KeyError::Capability(CapabilityError::PssEncoding {
                reason: "the system random number generator failed".into(),
            })
        })?;
    encode_with_salt(m_hash, hash, mod_bits, &salt)
}

fn encode_with_salt(
    m_hash: &[u8],
    hash: HashAlg,
    mod_bits: usize,
    salt: &[u8],
) -> Result<Vec<u8>, KeyError> {
    let h_len = hash.output_len();
    let k = mod_bits.div_ceil(8);
    let em_bits = mod_bits.saturating_sub(1);
    let em_len = em_bits.div_ceil(8);
    if em_len < h_len + salt.len() + 2 {
        return Err(KeyError::Capability(CapabilityError::PssEncoding {
            reason: format!("a {mod_bits}-bit RSA key is too small for PSS with {hash:?}"),
        }));
    }
    let mut m_prime = vec![0u8; 8];
    m_prime.extend_from_slice(m_hash);
    m_prime.extend_from_slice(salt);
    let h = hash.digest(&m_prime);

    let db_len = em_len - h_len - 1;
    let mut db = vec![0u8; db_len - salt.len() - 1];
    db.push(0x01);
    db.extend_from_slice(salt);
    for (d, m) in db.iter_mut().zip(mgf1(hash, &h, db_len)) {
        *d ^= m;
    }
    // Clear the bits above emBits so the encoded message is below the modulus.
    db[0] &= 0xff >> (8 * em_len - em_bits);

    let mut em = vec![0u8; k - em_len];
    em.extend_from_slice(&db);
    em.extend_from_slice(&h);
    em.push(0xbc);
    Ok(em)
}

/// MGF1 (RFC 8017 §B.2.1); also OAEP's mask function (`key::tpm::credential`).
pub(crate) fn mgf1(hash: HashAlg, seed: &[u8], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + hash.output_len());
    let mut counter: u32 = 0;
    while out.len() < len {
        let mut block = seed.to_vec();
        block.extend_from_slice(&counter.to_be_bytes());
        out.extend(hash.digest(&block));
        counter += 1;
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Undoes the encoding step by step. The end-to-end proofs (device signatures that ring's
    /// and openssl's PSS verifiers accept) are in tests/tpm_key.rs and tests/rsa_mechanisms.rs.
    #[test]
    fn pss_encoding_has_the_rfc_8017_structure() {
        for hash in [HashAlg::Sha256, HashAlg::Sha384, HashAlg::Sha512] {
            let m_hash = hash.digest(b"hello");
            let salt = vec![0x5a; hash.output_len()];
            let em = encode_with_salt(&m_hash, hash, 2048, &salt).expect("encode");
            assert_eq!(em.len(), 256);
            assert_eq!(em[255], 0xbc);
            assert_eq!(em[0] & 0x80, 0, "top bit clear: below the modulus");
            // Unmask DB and find 0x01 || salt at the end.
            let h_len = hash.output_len();
            let h = &em[256 - 1 - h_len..255];
            let mut db = em[..256 - 1 - h_len].to_vec();
            for (d, m) in db.iter_mut().zip(mgf1(hash, h, 256 - 1 - h_len)) {
                *d ^= m;
            }
            db[0] &= 0x7f;
            let (ps, rest) = db.split_at(db.len() - h_len - 1);
            assert!(ps.iter().all(|&b| b == 0));
            assert_eq!(rest[0], 0x01);
            assert_eq!(&rest[1..], &salt[..]);
            let mut m_prime = vec![0u8; 8];
            m_prime.extend_from_slice(&m_hash);
            m_prime.extend_from_slice(&salt);
            assert_eq!(hash.digest(&m_prime), h);
        }
    }

    #[test]
    fn odd_modulus_sizes_are_padded_to_the_modulus_length() {
        let m_hash = HashAlg::Sha256.digest(b"x");
        let em = encode_with_salt(&m_hash, HashAlg::Sha256, 2049, &[1u8; 32]).expect("encode");
        assert_eq!(em.len(), 257);
        assert_eq!(em[0], 0, "emLen is one byte shorter than the modulus");
    }

    #[test]
    fn too_small_keys_are_refused_in_words() {
        let m_hash = HashAlg::Sha512.digest(b"x");
        let err = encode(&m_hash, HashAlg::Sha512, 512).expect_err("512-bit key");
        assert!(err.to_string().contains("too small"), "{err}");
    }
}
