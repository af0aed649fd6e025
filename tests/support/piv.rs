//! YubiKey PIV attestations made the way a YubiKey makes them (Yubico's documented format),
//! over keys in SoftHSM: a local root standing in for Yubico's (optionally through the
//! intermediates of firmware 5.7.4), a device certificate `CN=Yubico PIV Attestation` (slot
//! f9, with or without basic constraints), and slot attestation certificates
//! `CN=YubiKey PIV Attestation 9a` with the four extensions under 1.3.6.1.4.1.41482.3, their
//! validity copied from the f9 certificate. [`PivDevice::install`] writes them into a token as
//! YubiKey's PKCS#11 module (ykcs11) exposes them: certificate objects labelled "X.509
//! Certificate for PIV Attestation 9a" (sharing the key's `CKA_ID`) and "X.509 Certificate for
//! PIV Attestation".

use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DnType, IsCa, Issuer, KeyPair,
    SubjectPublicKeyInfo,
};

use crate::softhsm::SoftHsm;

/// PIN policy byte: once per session.
pub const PIN_ONCE: u8 = 2;
/// Touch policy bytes.
pub const TOUCH_NEVER: u8 = 1;
/// A touch for every signature.
pub const TOUCH_ALWAYS: u8 = 2;
/// A touch remembered for 15 s.
pub const TOUCH_CACHED: u8 = 3;

/// How a device's chain is made.
#[derive(Debug, Clone)]
pub struct ChainShape {
    /// The root's CN (a stand-in for "Yubico PIV Root CA Serial 263751").
    pub root_cn: &'static str,
    /// Intermediates between the root and the f9 certificate (0 before firmware 5.7.4, 2 after).
    pub intermediates: usize,
    /// Whether the f9 certificate carries basic constraints (YubiKey 4's do not).
    pub f9_basic_constraints: bool,
    /// Whether the whole chain expired yesterday.
    pub expired: bool,
}

impl Default for ChainShape {
    fn default() -> ChainShape {
        ChainShape {
            root_cn: "Test PIV Root CA",
            intermediates: 0,
            f9_basic_constraints: true,
            expired: false,
        }
    }
}

/// What a slot's attestation says.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    /// The slot, lowercase hex (`9a`).
    pub slot: &'static str,
    /// The device serial.
    pub serial: u64,
    /// PIN policy byte (1 never, 2 once, 3 always).
    pub pin: u8,
    /// Touch policy byte (1 never, 2 always, 3 cached).
    pub touch: u8,
    /// Firmware (major, minor, patch).
    pub firmware: [u8; 3],
}

impl Slot {
    /// Slot 9a of device `serial`, firmware 5.4.3, PIN once, touch `touch`.
    pub fn new(serial: u64, touch: u8) -> Slot {
        Slot {
            slot: "9a",
            serial,
            pin: PIN_ONCE,
            touch,
            firmware: [5, 4, 3],
        }
    }
}

/// A stand-in YubiKey: its chain's certificates and the f9 key.
pub struct PivDevice {
    /// The root (PEM) and the intermediates (PEM, root side first): `--piv-roots` material.
    root_pem: String,
    intermediates_pem: Vec<String>,
    f9: rcgen::Certificate,
    f9_key: KeyPair,
    window: (time::OffsetDateTime, time::OffsetDateTime),
}

fn ca_params(cn: &str, window: (time::OffsetDateTime, time::OffsetDateTime)) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    (params.not_before, params.not_after) = window;
    params
}

impl PivDevice {
    /// A device whose chain has `shape`.
    pub fn new(shape: &ChainShape) -> PivDevice {
        let now = time::OffsetDateTime::now_utc();
        let window = if shape.expired {
            (
                now - time::Duration::days(400),
                now - time::Duration::days(1),
            )
        } else {
            (
                now - time::Duration::days(30),
                now + time::Duration::days(3650),
            )
        };
        let root_key = KeyPair::generate().expect("root key");
        let root = ca_params(shape.root_cn, window)
            .self_signed(&root_key)
            .expect("root");
        let root_pem = root.pem();
        let (mut issuer_der, mut issuer_key) = (root.der().to_vec(), root_key);
        let mut intermediates_pem = Vec::new();
        for i in 0..shape.intermediates {
            let key = KeyPair::generate().expect("intermediate key");
            let issuer =
                Issuer::from_ca_cert_der(&issuer_der.clone().into(), &issuer_key).expect("issuer");
            let cert = ca_params(&format!("Test Attestation Intermediate {i}"), window)
                .signed_by(&key, &issuer)
                .expect("intermediate");
            intermediates_pem.push(cert.pem());
            (issuer_der, issuer_key) = (cert.der().to_vec(), key);
        }
        let f9_key = KeyPair::generate().expect("f9 key");
        let mut params = ca_params("Yubico PIV Attestation", window);
        if !shape.f9_basic_constraints {
            params.is_ca = IsCa::NoCa;
        }
        params.custom_extensions = vec![CustomExtension::from_oid_content(
            &[1, 3, 6, 1, 4, 1, 41482, 3, 3],
            vec![5, 4, 3],
        )];
        let issuer = Issuer::from_ca_cert_der(&issuer_der.into(), &issuer_key).expect("issuer");
        let f9 = params.signed_by(&f9_key, &issuer).expect("f9");
        PivDevice {
            root_pem,
            intermediates_pem,
            f9,
            f9_key,
            window,
        }
    }

    /// The root and intermediates as a `--piv-roots` bundle.
    pub fn roots_pem(&self) -> String {
        let mut out = self.root_pem.clone();
        for i in &self.intermediates_pem {
            out.push_str(i);
        }
        out
    }

    /// The root alone (PEM).
    pub fn root_only_pem(&self) -> String {
        self.root_pem.clone()
    }

    /// The f9 certificate (DER).
    pub fn f9_der(&self) -> Vec<u8> {
        self.f9.der().to_vec()
    }

    /// The attestation certificate (DER) of `slot` for the key `spki` (DER), with
    /// `extra` extensions after Yubico's four.
    pub fn attest_with(&self, spki: &[u8], slot: Slot, extra: Vec<CustomExtension>) -> Vec<u8> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(
            DnType::CommonName,
            format!("YubiKey PIV Attestation {}", slot.slot),
        );
        (params.not_before, params.not_after) = self.window;
        let yubico = |arc: u64, content: Vec<u8>| {
            CustomExtension::from_oid_content(&[1, 3, 6, 1, 4, 1, 41482, 3, arc], content)
        };
        params.custom_extensions = vec![
            yubico(3, slot.firmware.to_vec()),
            yubico(7, yasna::construct_der(|w| w.write_u64(slot.serial))),
            yubico(8, vec![slot.pin, slot.touch]),
            yubico(9, vec![0x03]),
        ];
        params.custom_extensions.extend(extra);
        let issuer = Issuer::from_ca_cert_der(self.f9.der(), &self.f9_key).expect("issuer");
        let key = SubjectPublicKeyInfo::from_der(spki).expect("SPKI");
        params
            .signed_by(&key, &issuer)
            .expect("attestation")
            .der()
            .to_vec()
    }

    /// [`PivDevice::attest_with`] with Yubico's four extensions only.
    pub fn attest(&self, spki: &[u8], slot: Slot) -> Vec<u8> {
        self.attest_with(spki, slot, Vec::new())
    }

    /// Writes `attestation` (for the key with `CKA_ID` `id_hex` on token `token`) and this
    /// device's f9 certificate into `hsm` as ykcs11 shows them.
    pub fn install(
        &self,
        hsm: &SoftHsm,
        token: &str,
        id_hex: &str,
        slot: &str,
        attestation: &[u8],
    ) {
        let label = format!("X.509 Certificate for PIV Attestation {slot}");
        hsm.write_certificate(token, attestation, &label, id_hex);
        hsm.write_certificate(
            token,
            &self.f9_der(),
            "X.509 Certificate for PIV Attestation",
            "19",
        );
    }
}
