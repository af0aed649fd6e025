//! Generating key pairs on the token: sensitive, non-extractable, persistent.

use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, ObjectClass, ObjectHandle};
use cryptoki::session::Session;

use super::objects::KeyIdent;
use super::token::Token;
use crate::key::CapabilityError;
use crate::key::{KeyAlgorithm, KeyError};

/// Generates a key pair and returns the private key's handle.
///
/// The private key gets `CKA_SENSITIVE=true`, `CKA_EXTRACTABLE=false`, `CKA_TOKEN=true`,
/// `CKA_PRIVATE=true` and only the `CKA_SIGN` usage: it can sign and do nothing else, and the
/// token will never reveal it (`CKA_NEVER_EXTRACTABLE` follows from generating it this way).
pub(crate) fn generate(
    token: &Token,
    session: &Session,
    alg: KeyAlgorithm,
    ident: &KeyIdent,
) -> Result<ObjectHandle, KeyError> {
    let label = ident.label.clone().unwrap_or_default().into_bytes();
    let mut public = vec![
        Attribute::Class(ObjectClass::PUBLIC_KEY),
        Attribute::Token(true),
        Attribute::Private(false),
        Attribute::Verify(true),
        Attribute::Encrypt(false),
        Attribute::Wrap(false),
        Attribute::Label(label.clone()),
        Attribute::Id(ident.id.clone()),
    ];
    let private = vec![
        Attribute::Class(ObjectClass::PRIVATE_KEY),
        Attribute::Token(true),
        Attribute::Private(true),
        Attribute::Sensitive(true),
        Attribute::Extractable(false),
        Attribute::Sign(true),
        Attribute::Decrypt(false),
        Attribute::Unwrap(false),
        Attribute::Derive(false),
        Attribute::Label(label),
        Attribute::Id(ident.id.clone()),
    ];
    let mechanism = match alg {
        KeyAlgorithm::EcP256 | KeyAlgorithm::EcP384 => {
            let params = alg.ec_params_der().unwrap_or_default().to_vec();
            public.push(Attribute::EcParams(params));
            Mechanism::EccKeyPairGen
        }
        KeyAlgorithm::Rsa { bits } => {
            if ![2048, 3072, 4096].contains(&bits) {
                return Err(KeyError::Capability(
                    CapabilityError::UnsupportedAlgorithm {
                        backend: "PKCS#11",
                        algorithm: alg.to_string(),
                        hint: "create rsa-2048, rsa-3072 or rsa-4096 keys".into(),
                    },
                ));
            }
            public.push(Attribute::ModulusBits(u64::from(bits).into()));
            public.push(Attribute::PublicExponent(vec![0x01, 0x00, 0x01]));
            Mechanism::RsaPkcsKeyPairGen
        }
    };
    let (_public, private) = session
        .generate_key_pair(&mechanism, &public, &private)
        .map_err(|e| token.err("C_GenerateKeyPair", &e))?;
    Ok(private)
}
