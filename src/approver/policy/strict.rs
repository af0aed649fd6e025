//! The strict reader's rules every policy shares: a subject of CN and O only, exactly one CN;
//! no request attribute but one extension request and hwkey's evidence; no extension but key
//! usage, extended key usage and (for a serving certificate) subject alternative names, each
//! once.

use yasna::models::ObjectIdentifier;

use crate::approver::reason::{bounded, bounded_list, violation, Reason, Violation};
use crate::pki::attestation::OID_EVIDENCE;
use crate::pki::request::{
    Request, OID_COMMON_NAME, OID_EXTENSION_REQUEST, OID_EXT_KEY_USAGE, OID_KEY_USAGE,
    OID_ORGANIZATION, OID_SUBJECT_ALT_NAME,
};

/// What the certificate is for: it decides the extended key usage and whether names may be
/// asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A client certificate: client auth, no subject alternative name.
    Client,
    /// A serving certificate: server auth, subject alternative names (read by the policy).
    Server,
}

impl Purpose {
    fn eku(self) -> (&'static [u64], &'static str) {
        match self {
            Purpose::Client => (&[1, 3, 6, 1, 5, 5, 7, 3, 2], "client auth"),
            Purpose::Server => (&[1, 3, 6, 1, 5, 5, 7, 3, 1], "server auth"),
        }
    }
}

/// The one CN and the O values of a subject that holds nothing else (`whose`: "a node's", "a
/// person's", for the message); the reader already refused empty and multi-valued RDNs and
/// other string types.
pub fn cn_and_o<'r>(
    request: &'r Request,
    whose: &str,
) -> Result<(&'r str, Vec<&'r str>), Violation> {
    let refuse = |m: String| violation(Reason::SubjectNotAllowed, m);
    let (cn, o) = (
        ObjectIdentifier::from_slice(OID_COMMON_NAME),
        ObjectIdentifier::from_slice(OID_ORGANIZATION),
    );
    if let Some(other) = request.subject.iter().find(|a| a.oid != cn && a.oid != o) {
        return Err(refuse(format!(
            "the subject has attribute {} ('{}'): {whose} subject is CN and O only",
            other.oid,
            bounded(&other.value)
        )));
    }
    let cns = request.subject_values(OID_COMMON_NAME);
    let [one] = cns.as_slice() else {
        return Err(refuse(format!(
            "the subject must have exactly one CN, not {} ({}): Kubernetes would take the last",
            cns.len(),
            bounded_list(&cns)
        )));
    };
    Ok((one, request.subject_values(OID_ORGANIZATION)))
}

/// The request's attributes: at most one extension request and one evidence attribute, each
/// with exactly one value.
pub fn check_attributes(request: &Request) -> Result<(), Violation> {
    let (ext, evidence) = (
        ObjectIdentifier::from_slice(OID_EXTENSION_REQUEST),
        ObjectIdentifier::from_slice(OID_EVIDENCE),
    );
    let mut seen = Vec::new();
    for attribute in &request.attributes {
        if seen.contains(&&attribute.oid) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {} twice", attribute.oid),
            ));
        }
        seen.push(&attribute.oid);
        if attribute.oid != ext && attribute.oid != evidence {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request has attribute {}: only an extension request and hwkey's TPM evidence are allowed", attribute.oid),
            ));
        }
        if attribute.values.len() != 1 {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!(
                    "attribute {} must hold exactly one value, not {}",
                    attribute.oid,
                    attribute.values.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Requested extensions: key usage (digital signature, key encipherment at most) and extended
/// key usage (the purpose's alone); a subject alternative name only for a serving certificate
/// (its value is returned, for the policy to read); a second copy or anything else is refused.
pub fn check_extensions(request: &Request, purpose: Purpose) -> Result<Option<&[u8]>, Violation> {
    let mut names = None;
    let oid = ObjectIdentifier::from_slice;
    let mut seen = Vec::new();
    for extension in &request.extensions {
        let id = &extension.oid;
        if seen.contains(&id) {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("extension {id} is requested twice"),
            ));
        }
        seen.push(id);
        if *id == oid(OID_SUBJECT_ALT_NAME) && purpose == Purpose::Server {
            names = Some(extension.value.as_slice());
        } else if *id == oid(OID_SUBJECT_ALT_NAME) {
            return Err(violation(
                Reason::SubjectAltNameNotAllowed,
                format!(
                    "the request names subject alternative names ({}): a client certificate of this kind has none",
                    san_kinds(&extension.value)
                ),
            ));
        } else if *id == oid(OID_KEY_USAGE) {
            check_key_usage(&extension.value)?;
        } else if *id == oid(OID_EXT_KEY_USAGE) {
            check_extended_key_usage(&extension.value, purpose)?;
        } else {
            return Err(violation(
                Reason::ExtensionNotAllowed,
                format!("the request asks for extension {id}: only key usage and extended key usage are allowed"),
            ));
        }
    }
    Ok(names)
}

fn malformed_extension(e: yasna::ASN1Error) -> Violation {
    violation(
        Reason::MalformedRequest,
        format!("a requested extension does not parse: {e}"),
    )
}

/// A requested key usage: digital signature and key encipherment at most.
fn check_key_usage(value: &[u8]) -> Result<(), Violation> {
    let (bytes, _) =
        yasna::parse_der(value, |r| r.read_bitvec_bytes()).map_err(malformed_extension)?;
    // Bit 0 digitalSignature (0x80 of the first byte), bit 2 keyEncipherment (0x20).
    let extra = bytes
        .iter()
        .enumerate()
        .any(|(i, b)| if i == 0 { b & !0xa0 != 0 } else { *b != 0 });
    if extra {
        return Err(violation(
            Reason::UsagesNotAllowed,
            "the requested key usage has bits beyond digital signature and key encipherment",
        ));
    }
    Ok(())
}

/// A requested extended key usage: the purpose's alone.
fn check_extended_key_usage(value: &[u8], purpose: Purpose) -> Result<(), Violation> {
    let (want, name) = purpose.eku();
    let purposes = yasna::parse_der(value, |r| r.collect_sequence_of(|r| r.read_oid()))
        .map_err(malformed_extension)?;
    if purposes != [ObjectIdentifier::from_slice(want)] {
        let names: Vec<String> = purposes.iter().map(|p| p.to_string()).collect();
        return Err(violation(
            Reason::UsagesNotAllowed,
            format!(
                "the requested extended key usage is [{}], not {name} alone",
                names.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The kinds of names in a GeneralNames value, for the denial message.
fn san_kinds(value: &[u8]) -> String {
    let mut kinds = Vec::new();
    let _ = yasna::parse_der(value, |r| {
        r.read_sequence_of(|r| {
            let tag = r.lookahead_tag()?;
            kinds.push(match tag.tag_number {
                1 => "email",
                2 => "DNS",
                6 => "URI",
                7 => "IP",
                _ => "other",
            });
            r.read_der().map(|_| ())
        })
    });
    if kinds.is_empty() {
        "unreadable".into()
    } else {
        kinds.join(", ")
    }
}

/// `spec.usages`: {digital signature, the purpose's auth}, plus key encipherment at most, each
/// once.
pub fn check_usages(usages: &[String], purpose: Purpose) -> Result<(), Violation> {
    let (_, auth) = purpose.eku();
    let mut sorted: Vec<&str> = usages.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    let mut want = vec!["digital signature", auth];
    want.sort_unstable();
    let mut with_encipherment = vec!["digital signature", "key encipherment", auth];
    with_encipherment.sort_unstable();
    if sorted == want || sorted == with_encipherment {
        return Ok(());
    }
    let kind = match purpose {
        Purpose::Client => "a client",
        Purpose::Server => "a serving",
    };
    Err(violation(
        Reason::UsagesNotAllowed,
        format!(
            "usages {} are not {kind} certificate's: [digital signature, {auth}], optionally key encipherment",
            bounded(&format!("{usages:?}"))
        ),
    ))
}
