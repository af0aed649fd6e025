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
use crate::key::DeviceError;
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
        let encoded = crate::key::pss::encode(&digest, hash, info.modulus_len * 8)?;
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
    let signature = left_pad(&raw, info.modulus_len).map_err(|e| {
        KeyError::Device(DeviceError::Tpm {
            operation: "Sign",
            reason: format!("the TPM returned an RSA result of the wrong size: {e}"),
            source: Some(Box::new(e)),
        })
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
    KeyError::Device(DeviceError::Tpm {
        source: None,
        operation: "Sign",
        reason: format!(
            "the TPM answered with a {:?} signature",
            signature.algorithm()
        ),
    })
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
    Err(KeyError::Device(DeviceError::TpmBadSignature {
        key: describe(),
        scheme: scheme.to_string(),
        hint: hint.into(),
    }))
}
