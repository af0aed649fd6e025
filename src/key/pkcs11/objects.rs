//! Finding objects on a token: private keys, their public halves and their certificates.
//!
//! A key is its private-key object; the public key and certificates belong to it by sharing its
//! `CKA_ID` (or, when the id is empty, its `CKA_LABEL`), the convention pkcs11-tool, OpenSSL and
//! p11-kit follow.

use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::Session;

use super::token::{Token, TokenSession};
use crate::key::{der, KeyAlgorithm, KeyError, Pkcs11Uri};
use crate::key::{CapabilityError, DeviceError, LocateError};

/// What identifies a key object on a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyIdent {
    pub(crate) label: Option<String>,
    pub(crate) id: Vec<u8>,
}

impl KeyIdent {
    /// The template that finds objects of `class` tied to this key.
    pub(crate) fn template(&self, class: ObjectClass) -> Vec<Attribute> {
        let mut t = vec![Attribute::Class(class)];
        if !self.id.is_empty() {
            t.push(Attribute::Id(self.id.clone()));
        } else if let Some(label) = &self.label {
            t.push(Attribute::Label(label.as_bytes().to_vec()));
        }
        t
    }

    /// How the key is shown in lists and messages.
    pub(crate) fn describe(&self) -> String {
        match &self.label {
            Some(l) if self.id.is_empty() => format!("'{l}'"),
            Some(l) => format!("'{l}' (id {})", hex::encode(&self.id)),
            None => format!("id {}", hex::encode(&self.id)),
        }
    }
}

/// The search template for the private key a URI names.
pub(crate) fn private_key_template(uri: &Pkcs11Uri) -> Result<Vec<Attribute>, KeyError> {
    if uri.object.is_none() && uri.id.is_none() {
        return Err(KeyError::Locate(LocateError::NoKeySelected));
    }
    let mut t = vec![Attribute::Class(ObjectClass::PRIVATE_KEY)];
    if let Some(o) = &uri.object {
        t.push(Attribute::Label(o.as_bytes().to_vec()));
    }
    if let Some(id) = &uri.id {
        t.push(Attribute::Id(id.clone()));
    }
    Ok(t)
}

/// Whether a lookup only reads the token or changes objects on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Read,
    Write,
}

/// A private key found on its token, with the logged-in session that found it.
pub(crate) struct FoundKey {
    pub(crate) token: Token,
    pub(crate) session: TokenSession,
    pub(crate) handle: ObjectHandle,
}

/// Finds the token a URI names, opens a logged-in session on it and finds exactly one private
/// key: how every operation on a named key starts. A read takes a session only if the token has
/// one to spare (else [`KeyError::Device(DeviceError::SessionLimit)`], naming the token); a write opens a read-write
/// session.
pub(crate) fn find_key(uri: &Pkcs11Uri, access: Access) -> Result<FoundKey, KeyError> {
    let token = Token::find(uri)?;
    let _calls = token.enter();
    let session = match access {
        Access::Read => token.try_open_session()?.ok_or_else(|| {
            KeyError::Device(DeviceError::SessionLimit {
                token: token.place(),
            })
        })?,
        Access::Write => token.open_session(true)?,
    };
    let handle = find_private_key(&token, &session, uri)?;
    Ok(FoundKey {
        token,
        session,
        handle,
    })
}

/// The public-key objects tied to a key.
pub(crate) fn public_keys(
    token: &Token,
    session: &Session,
    ident: &KeyIdent,
) -> Result<Vec<ObjectHandle>, KeyError> {
    session
        .find_objects(&ident.template(ObjectClass::PUBLIC_KEY))
        .map_err(|e| token.err("C_FindObjects", &e))
}

/// Finds exactly one private key for the URI.
pub(crate) fn find_private_key(
    token: &Token,
    session: &Session,
    uri: &Pkcs11Uri,
) -> Result<ObjectHandle, KeyError> {
    let found = session
        .find_objects(&private_key_template(uri)?)
        .map_err(|e| token.err("C_FindObjects", &e))?;
    match found.as_slice() {
        [one] => Ok(*one),
        [] => Err(KeyError::Locate(LocateError::KeyNotFound {
            what: uri.key_desc(),
            place: token.place(),
            present: private_keys(token, session)?
                .iter()
                .map(|(_, ident)| ident.describe())
                .collect(),
        })),
        many => Err(KeyError::Capability(CapabilityError::Unsupported(format!(
            "{} matches {} private keys on {}: add id=%XX to the URI to choose one",
            uri.key_desc(),
            many.len(),
            token.place()
        )))),
    }
}

/// Every private key on the token, with its label and id.
pub(crate) fn private_keys(
    token: &Token,
    session: &Session,
) -> Result<Vec<(ObjectHandle, KeyIdent)>, KeyError> {
    let handles = session
        .find_objects(&[Attribute::Class(ObjectClass::PRIVATE_KEY)])
        .map_err(|e| token.err("C_FindObjects", &e))?;
    handles
        .into_iter()
        .map(|h| Ok((h, ident(token, session, h)?)))
        .collect()
}

/// The label and id of an object.
pub(crate) fn ident(
    token: &Token,
    session: &Session,
    handle: ObjectHandle,
) -> Result<KeyIdent, KeyError> {
    let attrs = session
        .get_attributes(handle, &[AttributeType::Label, AttributeType::Id])
        .map_err(|e| token.err("C_GetAttributeValue", &e))?;
    let mut ident = KeyIdent {
        label: None,
        id: Vec::new(),
    };
    for a in attrs {
        match a {
            Attribute::Label(l) if !l.is_empty() => {
                ident.label = Some(String::from_utf8_lossy(&l).into_owned())
            }
            Attribute::Id(id) => ident.id = id,
            _ => {}
        }
    }
    Ok(ident)
}

/// The algorithm of a key object (private or public).
pub(crate) fn algorithm(
    token: &Token,
    session: &Session,
    handle: ObjectHandle,
) -> Result<KeyAlgorithm, KeyError> {
    let attrs = session
        .get_attributes(
            handle,
            &[
                AttributeType::KeyType,
                AttributeType::EcParams,
                AttributeType::Modulus,
                AttributeType::ModulusBits,
            ],
        )
        .map_err(|e| token.err("C_GetAttributeValue", &e))?;
    let mut key_type = None;
    let mut params = None;
    let mut bits = None;
    for a in attrs {
        match a {
            Attribute::KeyType(t) => key_type = Some(t),
            Attribute::EcParams(p) => params = Some(p),
            Attribute::Modulus(m) => bits = Some(der_len_bits(&m)),
            Attribute::ModulusBits(b) => {
                bits = bits.or(Some(u64::from(b) as u32));
            }
            _ => {}
        }
    }
    match key_type {
        Some(t) if t == KeyType::EC => params
            .as_deref()
            .and_then(KeyAlgorithm::from_ec_params_der)
            .ok_or_else(|| {
                KeyError::Capability(CapabilityError::Unsupported(format!(
                    "an EC key on {} uses a curve hwkey does not support (only P-256 and P-384)",
                    token.place()
                )))
            }),
        Some(t) if t == KeyType::RSA => Ok(KeyAlgorithm::Rsa {
            bits: bits.unwrap_or(0),
        }),
        other => Err(KeyError::Capability(CapabilityError::Unsupported(format!(
            "a key of type {other:?} on {}: hwkey supports EC (P-256, P-384) and RSA keys",
            token.place()
        )))),
    }
}

fn der_len_bits(modulus: &[u8]) -> u32 {
    let first = modulus
        .iter()
        .position(|&b| b != 0)
        .unwrap_or(modulus.len());
    ((modulus.len() - first) * 8) as u32
}

/// The SPKI of a key: from its public-key object, else its certificate, else the public
/// attributes of the private key itself (RSA's modulus and exponent; `CKA_EC_POINT`, which
/// some tokens keep on EC private keys). Tokens that hold only a private key and a certificate
/// (smart cards, keys imported without their public half) work this way.
pub(crate) fn public_spki(
    token: &Token,
    session: &Session,
    private: ObjectHandle,
    ident: &KeyIdent,
    alg: KeyAlgorithm,
) -> Result<Vec<u8>, KeyError> {
    let publics = public_keys(token, session, ident)?;
    if let Some(public) = publics.first() {
        return spki_from_key_object(token, session, *public, alg);
    }
    for cert in certificates(token, session, ident)? {
        if let Ok(spki) = der::cert_spki(&cert.1) {
            return Ok(spki);
        }
    }
    match spki_from_key_object(token, session, private, alg) {
        Ok(spki) => Ok(spki),
        Err(_) if alg.is_ec() => Err(KeyError::Locate(LocateError::NoPublicKey {
            key: ident.describe(),
            place: token.place(),
        })),
        Err(e) => Err(e),
    }
}

fn spki_from_key_object(
    token: &Token,
    session: &Session,
    handle: ObjectHandle,
    alg: KeyAlgorithm,
) -> Result<Vec<u8>, KeyError> {
    let wanted: &[AttributeType] = if alg.is_ec() {
        &[AttributeType::EcPoint]
    } else {
        &[AttributeType::Modulus, AttributeType::PublicExponent]
    };
    let attrs = session
        .get_attributes(handle, wanted)
        .map_err(|e| token.err("C_GetAttributeValue", &e))?;
    let (mut point, mut modulus, mut exponent) = (None, None, None);
    for a in attrs {
        match a {
            Attribute::EcPoint(p) => point = Some(p),
            Attribute::Modulus(m) => modulus = Some(m),
            Attribute::PublicExponent(e) => exponent = Some(e),
            _ => {}
        }
    }
    let missing = || KeyError::Malformed {
        what: format!("public key on {}", token.place()),
        problem: crate::key::Malformation::NoPublicAttributes,
    };
    if alg.is_ec() {
        let point = der::unwrap_ec_point(alg, &point.ok_or_else(missing)?)?;
        der::ec_spki(alg, &point)
    } else {
        Ok(der::rsa_spki(
            &modulus.ok_or_else(missing)?,
            &exponent.ok_or_else(missing)?,
        ))
    }
}

/// Whether the key asks for the PIN at every use (`CKA_ALWAYS_AUTHENTICATE`; a token that does
/// not know the attribute has no such keys).
pub(crate) fn always_authenticate(
    token: &Token,
    session: &Session,
    key: ObjectHandle,
) -> Result<bool, KeyError> {
    match session.get_attributes(key, &[AttributeType::AlwaysAuthenticate]) {
        Ok(attrs) => Ok(attrs
            .iter()
            .any(|a| matches!(a, Attribute::AlwaysAuthenticate(true)))),
        Err(cryptoki::error::Error::Pkcs11(cryptoki::error::RvError::AttributeTypeInvalid, _)) => {
            Ok(false)
        }
        Err(e) => Err(token.err("C_GetAttributeValue", &e)),
    }
}

/// The label YubiKey's ykcs11 module gives the device's attestation certificate (slot f9);
/// a slot's is this, a space and the slot ("… Attestation 9a").
pub(crate) const PIV_ATTESTATION_LABEL: &str = "X.509 Certificate for PIV Attestation";

/// Every X.509 certificate on the token with a label: (label, DER).
pub(crate) fn labelled_certificates(
    token: &Token,
    session: &Session,
) -> Result<Vec<(String, Vec<u8>)>, KeyError> {
    let handles = session
        .find_objects(&[
            Attribute::Class(ObjectClass::CERTIFICATE),
            Attribute::CertificateType(cryptoki::object::CertificateType::X_509),
        ])
        .map_err(|e| token.err("C_FindObjects", &e))?;
    let mut out = Vec::new();
    for h in handles {
        if let (Some(l), Some(v)) = label_and_value(token, session, h)? {
            out.push((String::from_utf8_lossy(&l).into_owned(), v));
        }
    }
    Ok(out)
}

/// An object's `CKA_LABEL` and `CKA_VALUE`, each if it has one.
type LabelAndValue = (Option<Vec<u8>>, Option<Vec<u8>>);

/// Reads [`LabelAndValue`] of `object`.
fn label_and_value(
    token: &Token,
    session: &Session,
    object: ObjectHandle,
) -> Result<LabelAndValue, KeyError> {
    let attrs = session
        .get_attributes(object, &[AttributeType::Label, AttributeType::Value])
        .map_err(|e| token.err("C_GetAttributeValue", &e))?;
    let (mut label, mut value) = (None, None);
    for a in attrs {
        match a {
            Attribute::Label(l) => label = Some(l),
            Attribute::Value(v) => value = Some(v),
            _ => {}
        }
    }
    Ok((label, value))
}

/// The X.509 certificates tied to a key: (handle, DER). A YubiKey's attestation certificate
/// shares its key's `CKA_ID` but is not the key's certificate (its subject is "YubiKey PIV
/// Attestation 9a"): it is never part of the key's chain, never replaced nor deleted with it.
pub(crate) fn certificates(
    token: &Token,
    session: &Session,
    ident: &KeyIdent,
) -> Result<Vec<(ObjectHandle, Vec<u8>)>, KeyError> {
    let handles = session
        .find_objects(&ident.template(ObjectClass::CERTIFICATE))
        .map_err(|e| token.err("C_FindObjects", &e))?;
    let mut out = Vec::new();
    for h in handles {
        let (label, value) = label_and_value(token, session, h)?;
        let attestation = label.is_some_and(|l| l.starts_with(PIV_ATTESTATION_LABEL.as_bytes()));
        if let (false, Some(v)) = (attestation, value) {
            out.push((h, v));
        }
    }
    Ok(out)
}
