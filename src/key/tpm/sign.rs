//! Signing with a loaded TPM key.
//!
//! The message is hashed in software (hashing is not secret, and it keeps large messages off
//! the slow TPM link); the TPM gets the digest with a NULL hashcheck ticket, which TPM2_Sign
//! accepts for unrestricted keys. Authorization is the password session with the key's empty
//! auth value: no session is started per signature (an HMAC session per operation costs a
//! TPM2_StartAuthSession and a flush, and cuts the rate roughly by seven on swtpm).
//!
//! * ECDSA: TPM2_Sign ECDSA; the TPM returns r and s, which become a DER `Ecdsa-Sig-Value`.
//! * RSA PKCS#1 v1.5: TPM2_Sign RSASSA.
//! * RSA-PSS: for keys that may decrypt with scheme NULL (hwkey's and tpm2-openssl's RSA keys)
//!   EMSA-PSS is encoded here with salt length = hash length, as TLS 1.3 requires, and the TPM
//!   does the raw RSA private-key operation (TPM2_RSA_Decrypt, scheme NULL). Sign-only keys
//!   use TPM2_Sign RSAPSS, where the TPM picks the salt length.
//!
//! Every RSA signature is verified against the public key before it is returned (a few
//! microseconds next to the TPM's milliseconds): a TPM that used another PSS salt length is
//! reported with a way out instead of failing inside a peer's handshake, and a faulty RSA
//! computation is never released (a wrong RSA-CRT signature can reveal the private key).

use ring::rand::SecureRandom;
use tss_esapi::constants::tss::{TPM2_RH_NULL, TPM2_ST_HASHCHECK};
use tss_esapi::handles::KeyHandle;
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{
    Data, Digest, HashScheme, HashcheckTicket, PublicKeyRsa, RsaDecryptionScheme, Signature,
    SignatureScheme,
};
use tss_esapi::tss2_esys::TPMT_TK_HASHCHECK;
use tss_esapi::Context;

use super::loaded::LoadedKey;
use super::public::{left_pad, KeyInfo, PssMethod};
use crate::key::{der, HashAlg, KeyError, SignScheme};

/// Signs `message` with the key.
pub(crate) fn sign(
    key: &LoadedKey,
    info: &KeyInfo,
    describe: &dyn Fn() -> String,
    scheme: SignScheme,
    message: &[u8],
) -> Result<Vec<u8>, KeyError> {
    let hash = scheme.hash();
    let digest = hash.digest(message);
    let hash_scheme = HashScheme::new(tss_hash(hash));
    if scheme.is_ecdsa() {
        let tss_scheme = SignatureScheme::EcDsa { hash_scheme };
        let signature = key.with_key("Sign", |ctx, handle| {
            tpm_sign(ctx, handle, &digest, tss_scheme)
        })?;
        let Signature::EcDsa(sig) = signature else {
            return Err(unexpected(&signature));
        };
        return Ok(der::ecdsa_rs_to_der(
            sig.signature_r().value(),
            sig.signature_s().value(),
        ));
    }

    let raw = if scheme.is_pss() && info.pss == PssMethod::SoftwareEncoded {
        let encoded = emsa_pss_encode(&digest, hash, info.modulus_len * 8)?;
        key.with_key("RSA_Decrypt (raw RSA for PSS)", |ctx, handle| {
            ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
                let input = PublicKeyRsa::try_from(encoded.as_slice())?;
                ctx.rsa_decrypt(handle, input, RsaDecryptionScheme::Null, Data::default())
            })
        })?
        .value()
        .to_vec()
    } else {
        let tss_scheme = if scheme.is_pss() {
            SignatureScheme::RsaPss { hash_scheme }
        } else {
            SignatureScheme::RsaSsa { hash_scheme }
        };
        let signature = key.with_key("Sign", |ctx, handle| {
            tpm_sign(ctx, handle, &digest, tss_scheme)
        })?;
        match signature {
            Signature::RsaPss(sig) | Signature::RsaSsa(sig) => sig.signature().value().to_vec(),
            other => return Err(unexpected(&other)),
        }
    };
    let signature = left_pad(&raw, info.modulus_len).map_err(|reason| KeyError::Tpm {
        operation: "Sign",
        reason: format!("the TPM returned an RSA result of the wrong size: {reason}"),
    })?;
    check_rsa(info, describe, scheme, message, &signature)?;
    Ok(signature)
}

fn tss_hash(hash: HashAlg) -> HashingAlgorithm {
    match hash {
        HashAlg::Sha256 => HashingAlgorithm::Sha256,
        HashAlg::Sha384 => HashingAlgorithm::Sha384,
        HashAlg::Sha512 => HashingAlgorithm::Sha512,
    }
}

/// TPM2_Sign over a digest with a NULL ticket, under the password session.
fn tpm_sign(
    ctx: &mut Context,
    handle: KeyHandle,
    digest: &[u8],
    scheme: SignatureScheme,
) -> Result<Signature, tss_esapi::Error> {
    ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
        let ticket = HashcheckTicket::try_from(TPMT_TK_HASHCHECK {
            tag: TPM2_ST_HASHCHECK,
            hierarchy: TPM2_RH_NULL,
            digest: Default::default(),
        })?;
        ctx.sign(handle, Digest::try_from(digest)?, scheme, ticket)
    })
}

fn unexpected(signature: &Signature) -> KeyError {
    KeyError::Tpm {
        operation: "Sign",
        reason: format!(
            "the TPM answered with a {:?} signature",
            signature.algorithm()
        ),
    }
}

/// Verifies an RSA signature against the key's own public key (see the module comment).
fn check_rsa(
    info: &KeyInfo,
    describe: &dyn Fn() -> String,
    scheme: SignScheme,
    message: &[u8],
    signature: &[u8],
) -> Result<(), KeyError> {
    if info.modulus_len < 256 || scheme.is_ecdsa() {
        // ring verifies only moduli of 2048 bits and more; smaller keys go unchecked.
        return Ok(());
    }
    if crate::key::verify::verify_key_bits(&info.rsa_public_key, scheme, message, signature) {
        return Ok(());
    }
    let hint = if scheme.is_pss() && info.pss == PssMethod::Tpm {
        "this TPM chose a PSS salt length other than the hash length (TPMs that follow the TCG \
         specification use the maximum), which TLS 1.3 peers reject; create the key with \
         `hwkey key create` (its RSA keys get PSS padding from hwkey) or use an ec-p256 key"
    } else {
        "the TPM computed a wrong signature; the signature was discarded (check the TPM's \
         health with `tpm2_selftest --fulltest`)"
    };
    Err(KeyError::TpmBadSignature {
        key: describe(),
        scheme: scheme.to_string(),
        hint: hint.into(),
    })
}

/// EMSA-PSS-ENCODE (RFC 8017 §9.1.1) with MGF1 of the same hash and a random salt of the hash
/// length; returns the encoded message left-padded to the modulus length.
fn emsa_pss_encode(m_hash: &[u8], hash: HashAlg, mod_bits: usize) -> Result<Vec<u8>, KeyError> {
    let h_len = hash.output_len();
    let mut salt = vec![0u8; h_len];
    ring::rand::SystemRandom::new()
        .fill(&mut salt)
        .map_err(|_| KeyError::Tpm {
            operation: "PSS encoding",
            reason: "the system random number generator failed".into(),
        })?;
    pss_encode_with_salt(m_hash, hash, mod_bits, &salt)
}

fn pss_encode_with_salt(
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
        return Err(KeyError::Tpm {
            operation: "PSS encoding",
            reason: format!("a {mod_bits}-bit RSA key is too small for PSS with this hash"),
        });
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

/// MGF1 (RFC 8017 §B.2.1).
fn mgf1(hash: HashAlg, seed: &[u8], len: usize) -> Vec<u8> {
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

    /// Undoes the encoding step by step. The end-to-end proof (a TPM signature that ring's
    /// PSS verifier accepts) is in tests/tpm_key.rs.
    #[test]
    fn pss_encoding_has_the_rfc_8017_structure() {
        for hash in [HashAlg::Sha256, HashAlg::Sha384, HashAlg::Sha512] {
            let m_hash = hash.digest(b"hello");
            let salt = vec![0x5a; hash.output_len()];
            let em = pss_encode_with_salt(&m_hash, hash, 2048, &salt).expect("encode");
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
        let em = pss_encode_with_salt(&m_hash, HashAlg::Sha256, 2049, &[1u8; 32]).expect("encode");
        assert_eq!(em.len(), 257);
        assert_eq!(em[0], 0, "emLen is one byte shorter than the modulus");
    }
}
