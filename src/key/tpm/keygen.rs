//! Creating signing keys inside the TPM, under the owner-hierarchy storage key.
//!
//! Attributes of every key: fixedTPM | fixedParent | sensitiveDataOrigin (the private key was
//! born in this TPM and can never leave it, not even by duplication), userWithAuth with an
//! empty auth value (the key file or handle is the credential, as with tpm2-openssl's default),
//! noDA (an empty-auth key gains nothing from dictionary-attack protection, and its use must
//! not count toward a lockout) and sign. Scheme NULL, so the signer picks the hash per call.
//!
//! RSA keys also get `decrypt` (tpm2-openssl's own RSA keys have it too): the TPM's TPM2_Sign
//! RSAPSS lets the TPM choose the salt length, and TPMs that follow the TCG specification use
//! the maximum, which TLS 1.3 peers (rustls, ring, Go) reject. With `decrypt` and scheme NULL
//! hwkey encodes PSS with salt = hash length itself and has the TPM do only the raw RSA
//! private-key operation (see `sign.rs`). The price is that the key can also decrypt, which
//! adds no power: an unrestricted NULL-scheme signing key can already sign any digest.

use tss_esapi::attributes::ObjectAttributesBuilder;
use tss_esapi::constants::EccCurveIdentifier;
use tss_esapi::handles::KeyHandle;
use tss_esapi::interface_types::algorithm::{HashingAlgorithm, PublicAlgorithm};
use tss_esapi::interface_types::ecc::EccCurve;
use tss_esapi::interface_types::key_bits::RsaKeyBits;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{
    Auth, EccPoint, EccScheme, KeyDerivationFunctionScheme, Private, Public, PublicBuilder,
    PublicEccParametersBuilder, PublicKeyRsa, PublicRsaParametersBuilder, RsaExponent, RsaScheme,
    SymmetricDefinitionObject,
};
use tss_esapi::Context;

use super::{primary, rc};
use crate::key::CapabilityError;
use crate::key::{KeyAlgorithm, KeyError};

/// Refuses, before any TPM command, the algorithms hwkey never creates in a TPM.
pub(crate) fn check_creatable(alg: KeyAlgorithm) -> Result<(), KeyError> {
    match alg {
        KeyAlgorithm::EcP256 | KeyAlgorithm::EcP384 | KeyAlgorithm::Rsa { bits: 2048 } => Ok(()),
        KeyAlgorithm::Rsa { .. } => Err(KeyError::Capability(
            CapabilityError::UnsupportedAlgorithm {
                backend: "TPM",
                algorithm: alg.to_string(),
                hint: "TPM 2.0 chips are only required to implement RSA-2048 (and RSA is slow \
                   inside a TPM): use ec-p256 (recommended) or rsa-2048"
                    .into(),
            },
        )),
    }
}

/// Checks that this TPM implements the algorithm (P-384 is optional in the PC Client profile).
pub(crate) fn check_supported(ctx: &mut Context, alg: KeyAlgorithm) -> Result<(), KeyError> {
    let wanted = match alg {
        KeyAlgorithm::EcP256 => EccCurveIdentifier::NistP256,
        KeyAlgorithm::EcP384 => EccCurveIdentifier::NistP384,
        KeyAlgorithm::Rsa { .. } => return Ok(()),
    };
    let curves = primary::ecc_curves(ctx)?;
    if curves.contains(&wanted) {
        return Ok(());
    }
    Err(KeyError::Capability(
        CapabilityError::UnsupportedAlgorithm {
            backend: "TPM",
            algorithm: alg.to_string(),
            hint: format!(
                "this TPM does not implement that curve (it has: {}); use ec-p256 or rsa-2048",
                if curves.is_empty() {
                    "no ECC curves".to_string()
                } else {
                    curves
                        .iter()
                        .map(|c| format!("{c:?}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        },
    ))
}

/// The public template of a new signing key; a key with a password is dictionary-attack
/// protected (no `noDA`), a key without one is not (it would gain nothing).
pub(crate) fn template(alg: KeyAlgorithm, with_password: bool) -> Result<Public, KeyError> {
    let build = || -> Result<Public, tss_esapi::Error> {
        let attributes = ObjectAttributesBuilder::new()
            .with_fixed_tpm(true)
            .with_fixed_parent(true)
            .with_sensitive_data_origin(true)
            .with_user_with_auth(true)
            .with_no_da(!with_password)
            .with_sign_encrypt(true)
            .with_decrypt(matches!(alg, KeyAlgorithm::Rsa { .. }))
            .build()?;
        let builder = PublicBuilder::new()
            .with_name_hashing_algorithm(HashingAlgorithm::Sha256)
            .with_object_attributes(attributes);
        match alg {
            KeyAlgorithm::EcP256 | KeyAlgorithm::EcP384 => {
                let curve = if alg == KeyAlgorithm::EcP256 {
                    EccCurve::NistP256
                } else {
                    EccCurve::NistP384
                };
                // The builder's is_signing_key flag only adds a check that refuses scheme
                // NULL; the sign attribute itself is in the object attributes above.
                let parameters = PublicEccParametersBuilder::new()
                    .with_symmetric(SymmetricDefinitionObject::Null)
                    .with_ecc_scheme(EccScheme::Null)
                    .with_curve(curve)
                    .with_key_derivation_function_scheme(KeyDerivationFunctionScheme::Null)
                    .build()?;
                builder
                    .with_public_algorithm(PublicAlgorithm::Ecc)
                    .with_ecc_parameters(parameters)
                    .with_ecc_unique_identifier(EccPoint::default())
                    .build()
            }
            KeyAlgorithm::Rsa { .. } => {
                let parameters = PublicRsaParametersBuilder::new()
                    .with_symmetric(SymmetricDefinitionObject::Null)
                    .with_scheme(RsaScheme::Null)
                    .with_key_bits(RsaKeyBits::Rsa2048)
                    .with_exponent(RsaExponent::ZERO_EXPONENT)
                    .with_is_signing_key(true)
                    .with_is_decryption_key(true)
                    .build()?;
                builder
                    .with_public_algorithm(PublicAlgorithm::Rsa)
                    .with_rsa_parameters(parameters)
                    .with_rsa_unique_identifier(PublicKeyRsa::default())
                    .build()
            }
        }
    };
    build().map_err(rc::tpm_error("building the key template"))
}

/// A key the TPM just made, loaded and ready to sign.
pub(crate) struct NewKey {
    pub public: Public,
    pub private: Private,
    pub handle: KeyHandle,
}

/// Creates a key under `parent` (the owner storage key, [`primary::OWNER_HIERARCHY`], or a
/// persistent storage key) and loads it; a created storage key is flushed again before this
/// returns. On an error nothing stays loaded.
pub(crate) fn create_and_load(
    ctx: &mut Context,
    alg: KeyAlgorithm,
    password: Option<&[u8]>,
    parent: u32,
) -> Result<NewKey, KeyError> {
    check_supported(ctx, alg)?;
    let template = template(alg, password.is_some())?;
    let auth = password
        .map(|p| Auth::try_from(p.to_vec()))
        .transpose()
        .map_err(rc::tpm_error("the key's password"))?;
    primary::with_parent(ctx, parent, |ctx, parent| {
        ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
            let created = ctx
                .create(parent, template, auth.clone(), None, None, None)
                .map_err(rc::tpm_error("Create (signing key)"))?;
            let handle = ctx
                .load(
                    parent,
                    created.out_private.clone(),
                    created.out_public.clone(),
                )
                .map_err(rc::tpm_error("Load (new signing key)"))?;
            Ok(NewKey {
                public: created.out_public,
                private: created.out_private,
                handle,
            })
        })
    })
}
