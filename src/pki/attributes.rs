//! The attributes of a PKCS#10 request (RFC 2986 `attributes`), read one way for everyone.
//!
//! The evidence check ([`super::attestation`]) and the approver's policy must see the same
//! attributes, duplicates included, or a request could show one of them an attribute the other
//! does not count. Apart from [`super::csr`] (which writes requests) so that reading does not
//! depend on writing.

/// The attributes of a request, read from its raw `CertificationRequestInfo` (x509-parser keeps
/// no value for attribute types it does not know): each attribute's type and its `values`
/// (DER `SET`), in order, duplicates included. The one reader both the evidence check and the
/// approver's policy use, so they see the same attributes.
pub fn read(
    cri_raw: &[u8],
) -> Result<Vec<(yasna::models::ObjectIdentifier, Vec<u8>)>, yasna::ASN1Error> {
    let mut attributes = Vec::new();
    yasna::parse_der(cri_raw, |r| {
        r.read_sequence(|r| {
            r.next().read_u8()?;
            r.next().read_der()?; // subject
            r.next().read_der()?; // subjectPKInfo
            r.next().read_tagged_implicit(yasna::Tag::context(0), |r| {
                r.read_set_of(|r| {
                    attributes.push(
                        r.read_sequence(|r| Ok((r.next().read_oid()?, r.next().read_der()?)))?,
                    );
                    Ok(())
                })
            })
        })
    })?;
    Ok(attributes)
}
