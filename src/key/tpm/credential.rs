//! TPM2_MakeCredential in software, for an RSA-2048 or ECC P-256 endorsement key: the
//! verifier's half of
//! credential activation (TPM 2.0 Part 1, "Credential Protection"; what `tpm2_makecredential
//! --tcti none` computes).
//!
//! The verifier encrypts a random secret so that only the TPM holding the EK can recover it, and
//! only for an object of the given name loaded in that same TPM (ActivateCredential checks the
//! HMAC over the name). A node that answers with the secret has thereby shown that the AK it
//! enrolled lives in the TPM whose EK certificate the verifier checked.
//!
//! For the standard EK templates (nameAlg SHA-256, symmetric AES-128-CFB):
//! - RSA-2048 EK: seed = 32 random bytes, RSA-OAEP(SHA-256, label "IDENTITY\0") to the EK →
//!   `encryptedSecret`;
//! - ECC P-256 EK: an ephemeral key pair, seed = KDFe(SHA-256, ECDH x, "IDENTITY", ephemeral x,
//!   EK x, 256), and the ephemeral point is `encryptedSecret`;
//! - symmetric key = KDFa(SHA-256, seed, "STORAGE", name, ∅, 128);
//! - encIdentity = AES-128-CFB(key, IV = 0, TPM2B_DIGEST(secret));
//! - HMAC key = KDFa(SHA-256, seed, "INTEGRITY", ∅, ∅, 256);
//! - credentialBlob = TPM2B_DIGEST(HMAC(HMAC key, encIdentity ‖ name)) ‖ encIdentity.

use num_bigint::BigUint;

use crate::key::HashAlg;
use ring::rand::SecureRandom;
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, SymmetricMode};
use tss_esapi::interface_types::key_bits::AesKeyBits;
use tss_esapi::structures::{Public, SymmetricDefinitionObject};
use tss_esapi::traits::UnMarshall;

/// What the node's TPM needs to run ActivateCredential, and what it must answer.
pub struct Challenge {
    /// `TPM2B_ID_OBJECT` contents: the HMAC and the encrypted secret.
    pub credential_blob: Vec<u8>,
    /// `TPM2B_ENCRYPTED_SECRET` contents: the seed, OAEP-encrypted to the EK.
    pub encrypted_secret: Vec<u8>,
    /// The secret the node must give back.
    pub secret: zeroize::Zeroizing<Vec<u8>>,
}

/// Makes a challenge for the object `name` (the AK's TPM name), to the EK whose marshalled
/// `TPMT_PUBLIC` is `ek_public`: an RSA-2048 or an ECC P-256 EK with the TCG templates'
/// parameters (nameAlg SHA-256, AES-128-CFB).
pub fn make_credential(ek_public: &[u8], name: &[u8]) -> Result<Challenge, CredentialError> {
    let random = ring::rand::SystemRandom::new();
    let mut secret = zeroize::Zeroizing::new(vec![0u8; 32]);
    random
        .fill(&mut secret)
        .map_err(|_| CredentialError::Random)?;
    make_credential_for(ek_public, name, secret)
}

/// As [`make_credential`], for a secret the caller chose: the in-cluster approver derives it
/// (an HMAC of what the challenge is bound to), so that any replica can check the answer
/// without storing it.
pub fn make_credential_for(
    ek_public: &[u8],
    name: &[u8],
    secret: zeroize::Zeroizing<Vec<u8>>,
) -> Result<Challenge, CredentialError> {
    let public = Public::unmarshall(ek_public).map_err(CredentialError::EkPublic)?;
    let (name_alg, attributes, symmetric) = match &public {
        Public::Rsa {
            name_hashing_algorithm,
            object_attributes,
            parameters,
            ..
        } => (
            *name_hashing_algorithm,
            *object_attributes,
            parameters.symmetric_definition_object(),
        ),
        Public::Ecc {
            name_hashing_algorithm,
            object_attributes,
            parameters,
            ..
        } => (
            *name_hashing_algorithm,
            *object_attributes,
            parameters.symmetric_definition_object(),
        ),
        _ => return Err(CredentialError::NotRsaOrEcc),
    };
    if name_alg != HashingAlgorithm::Sha256 {
        return Err(CredentialError::NameAlg(format!("{name_alg:?}")));
    }
    if !(attributes.restricted() && attributes.decrypt()) {
        return Err(CredentialError::NotRestrictedDecryption);
    }
    if symmetric
        != (SymmetricDefinitionObject::Aes {
            key_bits: AesKeyBits::Aes128,
            mode: SymmetricMode::Cfb,
        })
    {
        return Err(CredentialError::Symmetric);
    }
    let random = ring::rand::SystemRandom::new();
    let (seed, encrypted_secret) = match &public {
        Public::Rsa {
            parameters, unique, ..
        } => rsa_seed(parameters, unique, &random)?,
        Public::Ecc {
            parameters, unique, ..
        } => ecc_seed(parameters, unique, &random)?,
        _ => return Err(CredentialError::NotRsaOrEcc),
    };
    let credential_blob = protect(&seed, name, &secret)?;
    Ok(Challenge {
        credential_blob,
        encrypted_secret,
        secret,
    })
}

/// Which EK an encrypted secret was made for, by its shape: an RSA-2048 EK's is the 256-byte
/// OAEP ciphertext, an ECC P-256 EK's a `TPMS_ECC_POINT` of two 32-byte coordinates.
pub fn ek_kind_of(encrypted_secret: &[u8]) -> Option<crate::key::attestation::EkKind> {
    use crate::key::attestation::EkKind;
    match encrypted_secret {
        s if s.len() == 256 => Some(EkKind::Rsa),
        s if s.len() == 68 && s[..2] == [0, 32] && s[34..36] == [0, 32] => Some(EkKind::Ecc),
        _ => None,
    }
}

/// The seed, OAEP-encrypted to an RSA-2048 EK (label "IDENTITY").
fn rsa_seed(
    parameters: &tss_esapi::structures::PublicRsaParameters,
    unique: &tss_esapi::structures::PublicKeyRsa,
    random: &ring::rand::SystemRandom,
) -> Result<(zeroize::Zeroizing<Vec<u8>>, Vec<u8>), CredentialError> {
    let (modulus, exponent) = super::rsa_parts(parameters, unique).map_err(CredentialError::Ek)?;
    if modulus.len() != 256 {
        return Err(CredentialError::ModulusBits(modulus.len() * 8));
    }
    let mut seed = zeroize::Zeroizing::new(vec![0u8; 32]);
    random
        .fill(&mut seed)
        .map_err(|_| CredentialError::Random)?;
    let encrypted = rsa_oaep_sha256(modulus, exponent, b"IDENTITY\0", &seed, random)?;
    Ok((seed, encrypted))
}

/// The seed agreed with an ECC P-256 EK (TPM 2.0 Part 1, "Secret Sharing" with ECDH): an
/// ephemeral key pair; Z the x-coordinate of ECDH(ephemeral, EK); seed = KDFe(SHA-256, Z,
/// "IDENTITY", ephemeral x, EK x, 256). The TPM recomputes Z from the ephemeral point, which is
/// the encrypted secret (`TPMS_ECC_POINT`).
fn ecc_seed(
    parameters: &tss_esapi::structures::PublicEccParameters,
    unique: &tss_esapi::structures::EccPoint,
    random: &ring::rand::SystemRandom,
) -> Result<(zeroize::Zeroizing<Vec<u8>>, Vec<u8>), CredentialError> {
    use ring::agreement;
    if parameters.ecc_curve() != tss_esapi::interface_types::ecc::EccCurve::NistP256 {
        return Err(CredentialError::Curve(format!(
            "{:?}",
            parameters.ecc_curve()
        )));
    }
    let (ek_x, ek_y) = (unique.x().value(), unique.y().value());
    if ek_x.len() > 32 || ek_y.len() > 32 {
        return Err(CredentialError::EkPoint);
    }
    let mut point = vec![4u8];
    for c in [ek_x, ek_y] {
        point.extend(std::iter::repeat_n(0, 32 - c.len()));
        point.extend_from_slice(c);
    }
    let ephemeral = agreement::EphemeralPrivateKey::generate(&agreement::ECDH_P256, random)
        .map_err(|_| CredentialError::Random)?;
    let ephemeral_public = ephemeral
        .compute_public_key()
        .map_err(|_| CredentialError::Random)?;
    let (eph_x, eph_y) = ephemeral_public.as_ref()[1..].split_at(32);
    let peer = agreement::UnparsedPublicKey::new(&agreement::ECDH_P256, point);
    let seed =
        agreement::agree_ephemeral(ephemeral, &peer, |z| kdfe(z, b"IDENTITY", eph_x, ek_x, 256))
            .map_err(|_| CredentialError::EkPoint)?;
    let mut encrypted = Vec::with_capacity(68);
    for c in [eph_x, eph_y] {
        encrypted.extend_from_slice(&u16_len(c)?);
        encrypted.extend_from_slice(c);
    }
    Ok((seed, encrypted))
}

/// The credential blob for `secret` under `seed`, bound to the object `name`: encIdentity =
/// AES-128-CFB(KDFa(seed, "STORAGE", name), IV 0, TPM2B(secret)), then TPM2B(HMAC(KDFa(seed,
/// "INTEGRITY"), encIdentity ‖ name)) ‖ encIdentity.
fn protect(seed: &[u8], name: &[u8], secret: &[u8]) -> Result<Vec<u8>, CredentialError> {
    let mut sym_key = zeroize::Zeroizing::new([0u8; 16]);
    sym_key.copy_from_slice(&kdfa(seed, b"STORAGE", name, &[], 128));
    let mut plain = zeroize::Zeroizing::new(Vec::with_capacity(2 + secret.len()));
    plain.extend_from_slice(&u16_len(secret)?);
    plain.extend_from_slice(secret);
    let enc_identity = aes128_cfb_encrypt(&sym_key, [0; 16], &plain);
    let hmac_key = kdfa(seed, b"INTEGRITY", &[], &[], 256);
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &hmac_key);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(&enc_identity);
    ctx.update(name);
    let outer = ctx.sign();
    let mut credential_blob = Vec::new();
    credential_blob.extend_from_slice(&u16_len(outer.as_ref())?);
    credential_blob.extend_from_slice(outer.as_ref());
    credential_blob.extend_from_slice(&enc_identity);
    Ok(credential_blob)
}

/// KDFe (TPM 2.0 Part 1, 11.4.10.3) with SHA-256: SHA-256(i ‖ Z ‖ label ‖ 0 ‖ partyU ‖ partyV)
/// for i = 1, 2, …, truncated to `bits`.
fn kdfe(
    z: &[u8],
    label: &[u8],
    party_u: &[u8],
    party_v: &[u8],
    bits: u32,
) -> zeroize::Zeroizing<Vec<u8>> {
    let bytes = (bits as usize).div_ceil(8);
    let mut out = zeroize::Zeroizing::new(Vec::with_capacity(bytes + 32));
    let mut counter: u32 = 1;
    while out.len() < bytes {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(&counter.to_be_bytes());
        ctx.update(z);
        ctx.update(label);
        ctx.update(&[0]);
        ctx.update(party_u);
        ctx.update(party_v);
        out.extend_from_slice(ctx.finish().as_ref());
        counter += 1;
    }
    out.truncate(bytes);
    out
}

fn u16_len(bytes: &[u8]) -> Result<[u8; 2], CredentialError> {
    u16::try_from(bytes.len())
        .map(u16::to_be_bytes)
        .map_err(|_| CredentialError::TooLong)
}

/// Why no challenge can be made for an EK, for `hwkey attest challenge`.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CredentialError {
    #[error("the EK public area: {0}")]
    EkPublic(#[source] tss_esapi::Error),
    #[error("the EK is neither an RSA nor an ECC key: credential activation supports the RSA-2048 and ECC P-256 EKs (certificates at NV indexes 0x01c00002 and 0x01c0000a)")]
    NotRsaOrEcc,
    #[error("the EK's curve is {0}, not NIST P-256 (the standard ECC EK template)")]
    Curve(String),
    #[error("the EK's public point is not a NIST P-256 point")]
    EkPoint,
    #[error("the EK's nameAlg is {0}, not SHA-256 (the standard RSA-2048 EK template)")]
    NameAlg(String),
    #[error("the EK is not a restricted decryption key")]
    NotRestrictedDecryption,
    #[error("the EK's symmetric algorithm is not AES-128-CFB (the standard RSA-2048 EK template)")]
    Symmetric,
    #[error("the EK: {0}")]
    Ek(#[source] crate::key::Unusable),
    #[error("the EK's modulus is {0} bits, not 2048")]
    ModulusBits(usize),
    #[error("the system random generator failed")]
    Random,
    #[error("a TPM2B is longer than 65535 bytes")]
    TooLong,
    #[error("the message is too long for the EK's modulus")]
    MessageTooLong,
}

/// KDFa (TPM 2.0 Part 1, 11.4.10.2) with SHA-256: HMAC(key, i ‖ label ‖ 0 ‖ contextU ‖ contextV
/// ‖ bits) for i = 1, 2, …, truncated to `bits`.
fn kdfa(
    key: &[u8],
    label: &[u8],
    context_u: &[u8],
    context_v: &[u8],
    bits: u32,
) -> zeroize::Zeroizing<Vec<u8>> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let bytes = (bits as usize).div_ceil(8);
    let mut out = zeroize::Zeroizing::new(Vec::with_capacity(bytes + 32));
    let mut counter: u32 = 1;
    while out.len() < bytes {
        let mut ctx = ring::hmac::Context::with_key(&key);
        ctx.update(&counter.to_be_bytes());
        ctx.update(label);
        ctx.update(&[0]);
        ctx.update(context_u);
        ctx.update(context_v);
        ctx.update(&bits.to_be_bytes());
        out.extend_from_slice(ctx.sign().as_ref());
        counter += 1;
    }
    out.truncate(bytes);
    out
}

/// AES-128 in CFB mode (full-block feedback, RustCrypto's `cfb-mode`); the TPM's credential
/// protection uses a zero IV. The last block may be partial.
fn aes128_cfb_encrypt(key: &[u8; 16], iv: [u8; 16], plain: &[u8]) -> Vec<u8> {
    use cfb_mode::cipher::KeyIvInit;
    let mut out = plain.to_vec();
    cfb_mode::Encryptor::<aes::Aes128>::new(&(*key).into(), &iv.into()).encrypt(&mut out);
    out
}

/// MGF1 with SHA-256.
fn mgf1(seed: &[u8], len: usize) -> Vec<u8> {
    crate::key::pss::mgf1(HashAlg::Sha256, seed, len)
}

/// RSAES-OAEP-ENCRYPT (RFC 8017, 7.1.1) with SHA-256 and MGF1-SHA-256. Only the public key is
/// used; the message is the random seed.
fn rsa_oaep_sha256(
    modulus: &[u8],
    exponent: u32,
    label: &[u8],
    message: &[u8],
    random: &ring::rand::SystemRandom,
) -> Result<Vec<u8>, CredentialError> {
    const H: usize = 32;
    let k = modulus.len();
    if message.len() + 2 * H + 2 > k {
        return Err(CredentialError::MessageTooLong);
    }
    let l_hash = ring::digest::digest(&ring::digest::SHA256, label);
    // DB = lHash ‖ PS (zeros) ‖ 0x01 ‖ M
    let mut db = zeroize::Zeroizing::new(vec![0u8; k - H - 1]);
    db[..H].copy_from_slice(l_hash.as_ref());
    let one = k - H - 1 - message.len() - 1;
    db[one] = 1;
    db[one + 1..].copy_from_slice(message);
    let mut seed = zeroize::Zeroizing::new(vec![0u8; H]);
    random
        .fill(&mut seed)
        .map_err(|_| CredentialError::Random)?;
    for (d, m) in db.iter_mut().zip(mgf1(&seed, k - H - 1)) {
        *d ^= m;
    }
    for (s, m) in seed.iter_mut().zip(mgf1(&db, H)) {
        *s ^= m;
    }
    let mut em = zeroize::Zeroizing::new(Vec::with_capacity(k));
    em.push(0);
    em.extend_from_slice(&seed);
    em.extend_from_slice(&db);
    let n = BigUint::from_bytes_be(modulus);
    let c = BigUint::from_bytes_be(&em).modpow(&BigUint::from(exponent), &n);
    let c = c.to_bytes_be();
    let mut out = vec![0u8; k - c.len()];
    out.extend_from_slice(&c);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NIST SP 800-38A F.3.13, CFB128-AES128.Encrypt (three blocks, and a partial fourth).
    #[test]
    fn cfb_matches_the_nist_vector() {
        let key: [u8; 16] = hex("2b7e151628aed2a6abf7158809cf4f3c").try_into().unwrap();
        let iv: [u8; 16] = hex("000102030405060708090a0b0c0d0e0f").try_into().unwrap();
        let plain = hex(concat!(
            "6bc1bee22e409f96e93d7e117393172a",
            "ae2d8a571e03ac9c9eb76fac45af8e51",
            "30c81c46a35ce411e5fbc1191a0a52ef",
            "f69f2445df4f9b17ad2b417be66c3710"
        ));
        let cipher = hex(concat!(
            "3b3fd92eb72dad20333449f8e83cfb4a",
            "c8a64537a0b3a93fcde3cdad9f1ce58b",
            "26751f67a3cbb140b1808cf187a4f4df",
            "c04b05357c5d1c0eeac4c66f9ff7f2e6"
        ));
        assert_eq!(aes128_cfb_encrypt(&key, iv, &plain), cipher);
        assert_eq!(aes128_cfb_encrypt(&key, iv, &plain[..50]), cipher[..50]);
    }

    /// KDFa is NIST SP 800-108 counter-mode KDF with HMAC-SHA-256, a 0x00 separator and a
    /// 32-bit length: the vectors come from OpenSSL's KBKDF (`openssl kdf -keylen 16 -kdfopt
    /// digest:SHA2-256 -kdfopt mac:HMAC -kdfopt hexkey:6b6579 -kdfopt hexsalt:<label> -kdfopt
    /// hexinfo:<context> KBKDF`), an implementation independent of this one.
    #[test]
    fn kdfa_matches_openssl_kbkdf() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(&kdfa(b"key", b"STORAGE", b"name", &[], 128)),
            "f326323083f0cc07d4b962f7f32d91b3"
        );
        assert_eq!(
            hex(&kdfa(b"key", b"INTEGRITY", &[], &[], 256)),
            "7cd6cf5ba3f4cc43bd54ef8ae30539c32832e6f0a87452dcb7fd605128b30ec5"
        );
    }

    #[test]
    fn kdfa_truncates_and_counts() {
        let a = kdfa(b"key", b"STORAGE", b"name", &[], 128);
        let b = kdfa(b"key", b"STORAGE", b"name", &[], 256);
        assert_eq!(a.len(), 16);
        assert_eq!(b.len(), 32);
        // The bit count is hashed in, so a shorter output is not a prefix of a longer one.
        assert_ne!(&b[..16], &a[..]);
        assert_eq!(kdfa(b"key", b"INTEGRITY", &[], &[], 512).len(), 64);
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
