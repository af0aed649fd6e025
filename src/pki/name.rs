//! Distinguished names as users type them: `CN=alice,O=devs,O=ops` or `/CN=alice/O=devs`.
//!
//! Kubernetes reads the user from CN and one group from each O, so a subject may repeat O
//! (rcgen's name type cannot, which is why requests are encoded here). Attributes are encoded in
//! the order written, like `openssl req -subj`.

use super::PkiError;

/// One attribute of a name: its OID and value, and whether it must be a PrintableString.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameAttr {
    /// The attribute type's OID.
    pub oid: &'static [u64],
    /// Its short name (`CN`, `O`, …).
    pub short: &'static str,
    /// The value as written.
    pub value: String,
}

/// A distinguished name in encoding order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Name(pub Vec<NameAttr>);

/// The attribute types a subject may hold: short name and OID. The one table both directions use
/// ([`Name::parse`] and [`short_name`]).
const KNOWN: &[(&str, &[u64])] = &[
    ("CN", &[2, 5, 4, 3]),
    ("O", &[2, 5, 4, 10]),
    ("OU", &[2, 5, 4, 11]),
    ("C", &[2, 5, 4, 6]),
    ("ST", &[2, 5, 4, 8]),
    ("L", &[2, 5, 4, 7]),
    ("SERIALNUMBER", &[2, 5, 4, 5]),
    ("DC", &[0, 9, 2342, 19200300, 100, 1, 25]),
    ("EMAILADDRESS", &[1, 2, 840, 113549, 1, 9, 1]),
];

/// The short name ([`Name::parse`]'s) of an attribute type given by its OID's arcs.
pub fn short_name(arcs: &[u64]) -> Option<&'static str> {
    KNOWN.iter().find(|(_, oid)| *oid == arcs).map(|(s, _)| *s)
}

/// What is wrong with a subject's text, for [`PkiError::InvalidSubject`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum SubjectSyntax {
    #[error("'{0}' is not TYPE=value")]
    NotTypeValue(String),
    #[error(
        "unknown attribute type '{0}' (known: CN, O, OU, C, ST, L, DC, serialNumber, emailAddress)"
    )]
    UnknownType(String),
    #[error("{0} has an empty value")]
    Empty(&'static str),
    #[error("C must be a two-letter country code")]
    Country,
    #[error("{0} may hold only letters, digits, spaces and ' ( ) + , - . / : = ? (a PrintableString); '{1}' is not allowed")]
    NotPrintable(&'static str, char),
    #[error("{0} may hold only ASCII characters (an IA5String); '{1}' is not allowed (write internationalized domains in punycode, e.g. xn--…)")]
    NotAscii(&'static str, char),
    #[error("it has no attributes")]
    NoAttributes,
}

impl Name {
    /// Parses `CN=a,O=b` (RFC 4514 style, `\,` escapes a comma) or `/CN=a/O=b` (OpenSSL style).
    pub fn parse(given: &str) -> Result<Name, PkiError> {
        let bad = |problem| PkiError::InvalidSubject {
            given: given.to_string(),
            problem,
        };
        let trimmed = given.trim();
        let (body, sep) = match trimmed.strip_prefix('/') {
            Some(rest) => (rest, '/'),
            None => (trimmed, ','),
        };
        let mut attrs = Vec::new();
        for part in split_escaped(body, sep) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(SubjectSyntax::NotTypeValue(part.to_string())))?;
            let key = k.trim().to_ascii_uppercase();
            let (short, oid) = KNOWN
                .iter()
                .find(|(name, _)| *name == key)
                .ok_or_else(|| bad(SubjectSyntax::UnknownType(k.trim().to_string())))?;
            let value = v.trim().to_string();
            if value.is_empty() {
                return Err(bad(SubjectSyntax::Empty(short)));
            }
            if *short == "C" && value.len() != 2 {
                return Err(bad(SubjectSyntax::Country));
            }
            // The string types these attributes are encoded as allow only some characters
            // (the encoder would panic on others): refuse, naming them.
            match *short {
                "C" | "SERIALNUMBER" => {
                    if let Some(c) = value.chars().find(|c| !is_printable(*c)) {
                        return Err(bad(SubjectSyntax::NotPrintable(short, c)));
                    }
                }
                "DC" | "EMAILADDRESS" => {
                    if let Some(c) = value.chars().find(|c| !c.is_ascii()) {
                        return Err(bad(SubjectSyntax::NotAscii(short, c)));
                    }
                }
                _ => {}
            }
            attrs.push(NameAttr { oid, short, value });
        }
        if attrs.is_empty() {
            return Err(bad(SubjectSyntax::NoAttributes));
        }
        Ok(Name(attrs))
    }

    /// Writes the DER `Name` (a SEQUENCE of single-attribute RDNs).
    pub fn write_der(&self, w: yasna::DERWriter) {
        w.write_sequence(|w| {
            for attr in &self.0 {
                w.next().write_set(|w| {
                    w.next().write_sequence(|w| {
                        w.next()
                            .write_oid(&yasna::models::ObjectIdentifier::from_slice(attr.oid));
                        match attr.short {
                            "C" | "SERIALNUMBER" => w.next().write_printable_string(&attr.value),
                            "DC" | "EMAILADDRESS" => w.next().write_ia5_string(&attr.value),
                            _ => w.next().write_utf8_string(&attr.value),
                        }
                    })
                })
            }
        })
    }
}

/// Characters of an ASN.1 PrintableString.
fn is_printable(c: char) -> bool {
    c.is_ascii_alphanumeric() || " '()+,-./:=?".contains(c)
}

fn split_escaped(s: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(next) = chars.next() {
                if let Some(last) = out.last_mut() {
                    last.push(next);
                }
            }
        } else if c == sep {
            out.push(String::new());
        } else if let Some(last) = out.last_mut() {
            last.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_styles_and_repeated_groups() {
        let a = Name::parse("CN=system:node:n1,O=system:nodes,O=ops").expect("rfc style");
        let b = Name::parse("/CN=system:node:n1/O=system:nodes/O=ops").expect("openssl style");
        assert_eq!(a, b);
        assert_eq!(a.0.len(), 3);
        assert_eq!(a.0[2].value, "ops");
        let c = Name::parse(r"CN=a\,b").expect("escaped comma");
        assert_eq!(c.0[0].value, "a,b");
    }

    #[test]
    fn errors_say_what_is_wrong() {
        for (s, needle) in [
            ("", "no attributes"),
            ("CN", "TYPE=value"),
            ("XX=1", "unknown attribute type 'XX'"),
            ("CN=", "empty value"),
            ("C=USA", "two-letter"),
        ] {
            let e = Name::parse(s).expect_err(s).to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }
}
