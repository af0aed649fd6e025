//! A test certificate authority that issues the certificates the tests present and verify.

use std::fs::{self};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
    PKCS_ECDSA_P256_SHA256,
};

use crate::*;

/// A throw-away EC P-256 certificate authority (software key; tests only).
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    ca_path: PathBuf,
    key_path: PathBuf,
}

/// A fresh random positive 16-byte serial number.
fn random_serial() -> SerialNumber {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("random serial");
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&bytes)
}

/// Converts an x509-parser name into an rcgen name, keeping string types where rcgen can.
fn dn_from_x509(name: &x509_parser::x509::X509Name<'_>) -> DistinguishedName {
    use x509_parser::der_parser::asn1_rs::Tag;
    let mut dn = DistinguishedName::new();
    for rdn in name.iter() {
        for attr in rdn.iter() {
            let oid: Vec<u64> = attr
                .attr_type()
                .iter()
                .expect("attribute OID fits in u64")
                .collect();
            let s = attr
                .as_str()
                .unwrap_or_else(|e| panic!("subject attribute {oid:?} is not a string: {e}"));
            let value = match attr.attr_value().tag() {
                Tag::PrintableString => DnValue::PrintableString(
                    s.try_into().expect("valid PrintableString in CSR subject"),
                ),
                Tag::Ia5String => {
                    DnValue::Ia5String(s.try_into().expect("valid IA5String in CSR subject"))
                }
                _ => DnValue::Utf8String(s.to_string()),
            };
            dn.push(DnType::from_oid(&oid), value);
        }
    }
    dn
}

/// Converts the subjectAltName entries of a CSR into rcgen SANs.
fn sans_from_x509(names: &[x509_parser::extensions::GeneralName<'_>]) -> Vec<SanType> {
    use x509_parser::extensions::GeneralName;
    names
        .iter()
        .map(|name| match name {
            GeneralName::DNSName(s) => SanType::DnsName((*s).try_into().expect("DNS SAN")),
            GeneralName::RFC822Name(s) => SanType::Rfc822Name((*s).try_into().expect("email SAN")),
            GeneralName::URI(s) => SanType::URI((*s).try_into().expect("URI SAN")),
            GeneralName::IPAddress(b) => SanType::IpAddress(match b.len() {
                4 => IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])),
                16 => {
                    let mut a = [0u8; 16];
                    a.copy_from_slice(b);
                    IpAddr::V6(Ipv6Addr::from(a))
                }
                n => panic!("IP SAN with {n} bytes"),
            }),
            other => panic!("TestCa cannot copy SAN {other:?}"),
        })
        .collect()
}

impl TestCa {
    /// Makes a CA (CN "hwkey test CA", CA:TRUE, keyCertSign) and writes DIR/ca.pem and DIR/ca.key.
    pub fn new(dir: &Path) -> TestCa {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate CA key");
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "hwkey test CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        params.serial_number = Some(random_serial());
        let key_pem = key.serialize_pem();
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-sign the test CA");
        let ca_path = dir.join("ca.pem");
        let key_path = dir.join("ca.key");
        fs::write(&ca_path, issuer.pem()).expect("write ca.pem");
        write_private(&key_path, key_pem.as_bytes());
        TestCa {
            issuer,
            ca_path,
            key_path,
        }
    }

    /// The CA certificate in PEM.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA certificate in DER.
    pub fn ca_der(&self) -> Vec<u8> {
        self.issuer.der().to_vec()
    }

    /// Path of ca.pem.
    pub fn ca_path(&self) -> PathBuf {
        self.ca_path.clone()
    }

    /// Path of ca.key (PKCS#8 PEM, mode 0600).
    pub fn key_path(&self) -> PathBuf {
        self.key_path.clone()
    }

    /// Issues a server certificate for `localhost` + 127.0.0.1; writes and returns DIR/server.pem, DIR/server.key.
    pub fn server_cert(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate server key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("server SANs");
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "localhost");
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(365);
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("sign server certificate");
        let cert_path = dir.join("server.pem");
        let key_path = dir.join("server.key");
        fs::write(&cert_path, cert.pem()).expect("write server.pem");
        write_private(&key_path, key.serialize_pem().as_bytes());
        (cert_path, key_path)
    }

    /// Issues a client certificate with a software key for subject `CN=cn[,O=org]`; writes DIR/NAME.pem and DIR/NAME.key.
    pub fn client_cert(
        &self,
        dir: &Path,
        name: &str,
        cn: &str,
        org: Option<&str>,
    ) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).expect("generate client key");
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        if let Some(org) = org {
            dn.push(DnType::OrganizationName, org);
        }
        dn.push(DnType::CommonName, cn);
        params.distinguished_name = dn;
        let cert = self.sign_params(
            params,
            &key,
            Duration::from_secs(300),
            Duration::from_secs(30 * 86400),
        );
        let cert_path = dir.join(format!("{name}.pem"));
        let key_path = dir.join(format!("{name}.key"));
        fs::write(&cert_path, cert).expect("write client cert");
        write_private(&key_path, key.serialize_pem().as_bytes());
        (cert_path, key_path)
    }

    /// Signs a PEM CSR: a clientAuth/digitalSignature cert valid `days` days, subject and SANs copied.
    pub fn sign_csr_pem(&self, csr_pem: &str, days: u32) -> String {
        self.sign_csr_pem_for(csr_pem, Duration::from_secs(u64::from(days) * 86400))
    }

    /// Like [`TestCa::sign_csr_pem`] but valid for `validity` from now (for expiry tests).
    pub fn sign_csr_pem_for(&self, csr_pem: &str, validity: Duration) -> String {
        self.sign_csr_pem_window(csr_pem, Duration::from_secs(300), validity)
    }

    /// Like [`TestCa::sign_csr_pem_for`], with NotBefore `backdate` before now: a certificate
    /// far into its lifetime (renewal due at once) that still has `validity` left.
    pub fn sign_csr_pem_window(
        &self,
        csr_pem: &str,
        backdate: Duration,
        validity: Duration,
    ) -> String {
        let (params, spki) = params_from_csr(csr_pem);
        self.sign_params(params, &spki, backdate, validity)
    }

    /// Like [`TestCa::sign_csr_pem`], for a certificate that expired an hour ago.
    pub fn sign_csr_pem_expired(&self, csr_pem: &str) -> String {
        let (params, spki) = params_from_csr(csr_pem);
        let now = time::OffsetDateTime::now_utc();
        self.sign_params_between(
            params,
            &spki,
            now - Duration::from_secs(7200),
            now - Duration::from_secs(3600),
        )
    }

    /// Signs the CSR file `csr` with `openssl x509 -req` and the extensions in `ext` (an
    /// extfile's text): certificates hwkey must refuse (a CA, serverAuth only, a DNS name with
    /// a terminal escape), made by a foreign tool. Writes `out`.
    pub fn sign_with_extensions(&self, csr: &Path, ext: &str, out: &Path) {
        let ext_path = out.with_extension("cnf");
        fs::write(&ext_path, ext).expect("write extensions");
        crate::run_ok(
            std::process::Command::new("openssl")
                .args(["x509", "-req", "-days", "1", "-in"])
                .arg(csr)
                .arg("-CA")
                .arg(self.ca_path())
                .arg("-CAkey")
                .arg(self.key_path())
                .args(["-CAcreateserial", "-CAserial"])
                .arg(out.with_extension("srl"))
                .arg("-extfile")
                .arg(&ext_path)
                .arg("-out")
                .arg(out),
        );
    }

    /// Signs a PEM CSR like [`TestCa::sign_csr_pem`] and writes the certificate to `out`.
    pub fn sign_csr_to_file(&self, csr_pem: &str, days: u32, out: &Path) {
        fs::write(out, self.sign_csr_pem(csr_pem, days))
            .unwrap_or_else(|e| panic!("write {}: {e}", out.display()));
    }

    /// Signs a PEM CSR file into a certificate file (see [`TestCa::sign_csr_pem`]).
    pub fn sign_csr_file(&self, csr_path: &Path, days: u32, out: &Path) {
        let csr = fs::read_to_string(csr_path)
            .unwrap_or_else(|e| panic!("read {}: {e}", csr_path.display()));
        self.sign_csr_to_file(&csr, days, out);
    }

    /// Adds the client-certificate profile and validity to `params` and signs them for `key`.
    fn sign_params(
        &self,
        params: CertificateParams,
        key: &impl rcgen::PublicKeyData,
        backdate: Duration,
        validity: Duration,
    ) -> String {
        let now = time::OffsetDateTime::now_utc();
        self.sign_params_between(params, key, now - backdate, now + validity)
    }

    /// Adds the client-certificate profile to `params`, valid `not_before..not_after`, and
    /// signs them for `key`.
    fn sign_params_between(
        &self,
        mut params: CertificateParams,
        key: &impl rcgen::PublicKeyData,
        not_before: time::OffsetDateTime,
        not_after: time::OffsetDateTime,
    ) -> String {
        params.not_before = not_before;
        params.not_after = not_after;
        params.serial_number = Some(random_serial());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params
            .signed_by(key, &self.issuer)
            .expect("sign client certificate")
            .pem()
    }
}

/// The subject and SANs of a PEM CSR (whose self-signature must verify), and its public key.
fn params_from_csr(csr_pem: &str) -> (CertificateParams, rcgen::SubjectPublicKeyInfo) {
    use x509_parser::prelude::{FromDer, ParsedExtension, X509CertificationRequest};
    let block = pem::parse(csr_pem).expect("CSR is PEM");
    assert!(
        block.tag() == "CERTIFICATE REQUEST" || block.tag() == "NEW CERTIFICATE REQUEST",
        "expected a CERTIFICATE REQUEST PEM block, got {}",
        block.tag()
    );
    let (_, csr) = X509CertificationRequest::from_der(block.contents()).expect("parse CSR");
    csr.verify_signature()
        .expect("the CSR's self-signature must verify");
    let info = &csr.certification_request_info;
    let mut params = CertificateParams::default();
    params.distinguished_name = dn_from_x509(&info.subject);
    if let Some(exts) = csr.requested_extensions() {
        for ext in exts {
            if let ParsedExtension::SubjectAlternativeName(san) = ext {
                params
                    .subject_alt_names
                    .extend(sans_from_x509(&san.general_names));
            }
        }
    }
    let spki = rcgen::SubjectPublicKeyInfo::from_der(info.subject_pki.raw)
        .expect("CSR public key algorithm supported by rcgen");
    (params, spki)
}
