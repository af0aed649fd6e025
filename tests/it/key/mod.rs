//! The key layer on real hardware: the contract every backend meets, PKCS#11 tokens (SoftHSMv2,
//! p11-kit, tpm2-pkcs11) and TPMs (swtpm), their command-line tools, PINs and passwords,
//! certificate import and attestation.

#[cfg(feature = "tpm")]
mod attestation;
#[cfg(feature = "pkcs11")]
mod cert_import;
mod contract;
#[cfg(feature = "pkcs11")]
mod p11kit;
#[cfg(feature = "pkcs11")]
mod pin_safety;
#[cfg(feature = "pkcs11")]
mod piv_attestation;
#[cfg(feature = "pkcs11")]
mod pkcs11;
#[cfg(feature = "pkcs11")]
mod pkcs11_cli;
mod policy;
#[cfg(feature = "pkcs11")]
mod rsa_mechanisms;
#[cfg(feature = "tpm")]
mod shared_tpm;
#[cfg(feature = "tpm")]
mod tpm;
#[cfg(feature = "pkcs11")]
mod tpm2_pkcs11;
#[cfg(feature = "tpm")]
mod tpm_cli;
#[cfg(feature = "tpm")]
mod tpm_hierarchy;
#[cfg(feature = "tpm")]
mod tpm_password;
