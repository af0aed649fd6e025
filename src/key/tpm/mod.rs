//! TPM 2.0 backend (tss-esapi): keys named `tpm:path=/k.pem` (a TSS2 PRIVATE KEY file, the
//! format of tpm2-openssl, so keys move freely between hwkey and OpenSSL) or
//! `tpm:handle=0x81…` (a persistent key).
//!
//! The folder: `context` owns the one ESAPI context per TCTI, `loaded` keeps a key loaded (and
//! reloads it after a TPM reset), `primary` re-creates the storage key that key files hang
//! under (tpm2-openssl's template), `tss2_pem` is the file format, `keygen` creates keys,
//! `sign` signs, `public` turns a public area into an algorithm and an SPKI, `files` names and
//! reads the files beside a key, and `rc` maps TSS errors to [`KeyError`], once.
//!
//! Lifecycle: a [`TpmKey`] loads its key once, when it is opened, and keeps it loaded until it
//! is dropped (then it is flushed). The storage primary is flushed right after loading: swtpm
//! and TPMs used without a resource manager hold only three transient objects. A persistent
//! key takes no transient slot at all. Deleting a key file needs no TPM: the file is the only
//! copy of the key (its private part is encrypted by the TPM and useless anywhere else).
//!
//! Concurrency: signatures from many threads queue on the context's mutex (the TPM signs one
//! at a time anyway). On swtpm and the Microsoft simulator the TCP connection stays open while a
//! key is open, and other processes (tpm2-tools, openssl) wait until it closes; through the
//! kernel's resource manager (`device:/dev/tpmrm0`) they do not.

pub(crate) mod attest;
mod context;
pub mod credential;
pub mod evidence;
mod files;
mod handles;
mod keygen;
mod loaded;
mod names;
mod persistent;
mod primary;
mod public;
pub(crate) use public::rsa_parts;
mod rc;
mod sign;
mod tss2_pem;

use std::fs;
use std::io;

use tss_esapi::handles::KeyHandle;
use tss_esapi::structures::Public;

use super::{
    KeyAlgorithm, KeyBackend, KeyError, KeyListing, KeyUri, SignScheme, TpmUri, Tss2Problem,
};
use crate::atomic_file;
use crate::key::pin_memory::Record;
use crate::key::uri::TpmKeyLocation;
use crate::key::{CapabilityError, DeviceError, LocateError, PinError};
use context::Tpm;
use loaded::{KeyAuth, LoadedKey, Source};
use names::location_desc;
use public::KeyInfo;
use tss2_pem::Tss2Key;

/// A key inside a TPM, loaded and ready to sign.
#[derive(Debug)]
pub struct TpmKey {
    loaded: LoadedKey,
    location: TpmKeyLocation,
    info: KeyInfo,
}

/// Opens the key a URI names and loads it into the TPM.
pub fn open(uri: &TpmUri) -> Result<TpmKey, KeyError> {
    let location = uri.key.clone().ok_or(LocateError::NoKeySelected)?;
    let tcti = uri.tcti();
    match &location {
        TpmKeyLocation::Path(path) => {
            let file = files::read_key_file(path)?;
            let info = KeyInfo::from_public(&file.public).map_err(|e| {
                KeyError::Device(DeviceError::Tss2Pem {
                    path: path.clone(),
                    problem: Tss2Problem::Unusable(e),
                })
            })?;
            let auth = if file.empty_auth {
                None
            } else {
                Some(key_auth(uri, &location)?)
            };
            let tpm = connect(uri)?;
            let (handle, generation) = tpm.with_conn(|conn| {
                let handle = loaded::load_key_file(&mut conn.ctx, &file)?;
                Ok::<_, KeyError>((handle, conn.generation()))
            })?;
            Ok(TpmKey {
                loaded: LoadedKey::new(tpm, Source::File(file), handle, generation, auth),
                location,
                info,
            })
        }
        TpmKeyLocation::Handle(h) => {
            let tpm = connect(uri)?;
            let (object, public, generation) = tpm.with_conn(|conn| {
                let (object, public) = persistent::open_persistent(&mut conn.ctx, *h, &tcti)?;
                Ok::<_, KeyError>((object, public, conn.generation()))
            })?;
            let info = KeyInfo::from_public(&public).map_err(|problem| {
                KeyError::Device(DeviceError::TpmKeyUnusable {
                    key: location_desc(&location),
                    problem,
                })
            });
            // Closes the ESYS handle on drop, also if the key is unusable.
            let source = Source::Persistent { handle: *h, public };
            let auth = match uri.pin {
                Some(_) => Some(key_auth(uri, &location)?),
                None => None,
            };
            let loaded = LoadedKey::new(tpm, source, KeyHandle::from(object), generation, auth);
            Ok(TpmKey {
                loaded,
                location,
                info: info?,
            })
        }
    }
}

/// The TPM a URI names, with the owner-hierarchy password from its `owner-pin-source` set for
/// the commands the owner authorizes (CreatePrimary, EvictControl).
fn connect(uri: &TpmUri) -> Result<std::sync::Arc<Tpm>, KeyError> {
    let tpm = Tpm::connect(&uri.tcti())?;
    if let Some(source) = &uri.owner_pin {
        let password = source.read()?;
        tpm.with_conn(|conn| {
            conn.set_owner_auth(zeroize::Zeroizing::new(password.as_bytes().to_vec()))
        })?;
    }
    Ok(tpm)
}

/// The password of a key from the URI's `pin-source`, unless the TPM refused that password
/// before (in any process): the dictionary-attack lockout counts every wrong one.
fn key_auth(uri: &TpmUri, location: &TpmKeyLocation) -> Result<KeyAuth, KeyError> {
    let key = location_desc(location);
    let Some(source) = &uri.pin else {
        return Err(KeyError::Pin(PinError::TpmAuthRequired { key }));
    };
    let password = source.read()?;
    let identity = format!("tpm\n{}\n{key}", uri.tcti());
    // Fail closed, as for a PKCS#11 PIN: a TPM counts every wrong password towards its
    // dictionary-attack lockout.
    let record = Record::for_source(&identity, source, &password).map_err(|e| {
        KeyError::Pin(PinError::Memory {
            dir: crate::key::pin_memory::memory_dir(),
            reason: e.to_string(),
        })
    })?;
    let record = Some(record);
    if let Some(r) = record.as_ref().filter(|r| r.exists()) {
        return Err(KeyError::Pin(PinError::TpmAuthRemembered {
            key,
            source_desc: crate::key::pin_memory::describe_source(source),
            record: r.path().to_path_buf(),
        }));
    }
    Ok(KeyAuth {
        value: zeroize::Zeroizing::new(password.as_bytes().to_vec()),
        key,
        record,
        source: source.clone(),
        refused: std::sync::atomic::AtomicBool::new(false),
        accepted: std::sync::atomic::AtomicBool::new(false),
        identity,
    })
}

/// Makes sure the TPM the URI names has an attestation key at `ak_handle` (creating it once) and
/// returns what an operator registers for it.
pub fn enroll(
    uri: &TpmUri,
    ak_handle: u32,
    ek: Option<crate::key::attestation::EkKind>,
) -> Result<crate::key::attestation::Enrollment, KeyError> {
    let tpm = connect(uri)?;
    tpm.with_conn(|conn| {
        conn.ensure_connected()?;
        attest::enroll(&mut conn.ctx, ak_handle, tpm.tcti(), ek)
    })
}

/// TPM2_ActivateCredential with the AK at `ak_handle` and the EK of the TPM the URI names (the
/// one the challenge was made for: RSA-2048 or ECC P-256)
/// (see `key::tpm::credential`): the secret a verifier encrypted for that AK.
pub fn activate(
    uri: &TpmUri,
    ak_handle: u32,
    credential_blob: &[u8],
    encrypted_secret: &[u8],
) -> Result<zeroize::Zeroizing<Vec<u8>>, KeyError> {
    let tpm = connect(uri)?;
    tpm.with_conn(|conn| {
        conn.ensure_connected()?;
        attest::activate(
            &mut conn.ctx,
            ak_handle,
            tpm.tcti(),
            credential_blob,
            encrypted_secret,
        )
    })
}

/// Creates a key in the TPM and stores it where the URI says; refuses (and changes nothing)
/// if that file or persistent handle is taken.
pub fn create(uri: &TpmUri, alg: KeyAlgorithm) -> Result<TpmKey, KeyError> {
    keygen::check_creatable(alg)?;
    let location = uri.key.clone().ok_or(LocateError::NoKeySelected)?;
    let tcti = uri.tcti();
    match &location {
        TpmKeyLocation::Path(path) => {
            let place = "this machine".to_string();
            let what = location_desc(&location);
            let exists = || KeyError::from(LocateError::KeyExists { what, place });
            if fs::symlink_metadata(path).is_ok() {
                return Err(exists());
            }
            // A key with a password (pin-source on the URI): dictionary-attack protected, the
            // file says so (no emptyAuth TRUE), and the password is needed to sign.
            let auth = match uri.pin {
                Some(_) => Some(key_auth(uri, &location)?),
                None => None,
            };
            let parent = uri.parent.unwrap_or(primary::OWNER_HIERARCHY);
            let tpm = connect(uri)?;
            let (new, generation) = tpm.with_conn(|conn| {
                let value = auth.as_ref().map(|a| a.value.as_slice());
                let new = keygen::create_and_load(&mut conn.ctx, alg, value, parent)?;
                Ok::<_, KeyError>((new, conn.generation()))
            })?;
            let file = Tss2Key {
                parent,
                public: new.public,
                private: new.private,
                empty_auth: auth.is_none(),
            };
            let info = created_info(&file.public);
            let pem = file.to_pem().map_err(|e| DeviceError::Tpm {
                operation: "encoding the TSS2 key file",
                reason: e.to_string(),
                source: Some(Box::new(e)),
            });
            // From here on the key is flushed on drop, also if anything below fails.
            let loaded = LoadedKey::new(tpm, Source::File(file), new.handle, generation, auth);
            let info = info?;
            atomic_file::create_atomic(path, pem?.as_bytes(), 0o600).map_err(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    exists()
                } else {
                    KeyError::io("write the TPM key file", path, e)
                }
            })?;
            Ok(TpmKey {
                loaded,
                location,
                info,
            })
        }
        TpmKeyLocation::Handle(h) => {
            if uri.parent.is_some() {
                return Err(KeyError::InvalidUri {
                    uri: uri.to_string(),
                    reason: "parent= applies to key files (path=); a persistent key (handle=) is \
                             made under the owner's storage key"
                        .into(),
                });
            }
            let tpm = connect(uri)?;
            let (object, public, generation) = tpm.with_conn(|conn| {
                let (object, public) =
                    persistent::create_persistent(&mut conn.ctx, alg, *h, &tcti)?;
                Ok::<_, KeyError>((object, public, conn.generation()))
            })?;
            let info = created_info(&public);
            let source = Source::Persistent { handle: *h, public };
            let loaded = LoadedKey::new(tpm, source, KeyHandle::from(object), generation, None);
            Ok(TpmKey {
                loaded,
                location,
                info: info?,
            })
        }
    }
}

fn created_info(public: &Public) -> Result<KeyInfo, KeyError> {
    KeyInfo::from_public(public).map_err(|e| {
        KeyError::Device(DeviceError::Tpm {
            operation: "Create (signing key)",
            reason: format!("the TPM made a key hwkey cannot use: {e}"),
            source: Some(Box::new(e)),
        })
    })
}

/// Lists keys: the TSS2 key files in a directory (`tpm:path=/dir`), or the persistent signing
/// keys in the TPM (`tpm:?tcti=…`).
pub fn list(uri: &TpmUri) -> Result<Vec<KeyListing>, KeyError> {
    let listing = |location: TpmKeyLocation, algorithm, has_certificate| KeyListing {
        uri: KeyUri::Tpm(TpmUri {
            key: Some(location),
            tcti: uri.tcti.clone(),
            pin: None,
            owner_pin: uri.owner_pin.clone(),
            parent: None,
        }),
        algorithm,
        has_certificate,
    };
    match &uri.key {
        Some(TpmKeyLocation::Path(dir)) if dir.is_dir() => {
            let mut out = Vec::new();
            for path in files::key_files_in(dir)? {
                let Ok(data) = fs::read(&path) else { continue };
                let Ok(file) = Tss2Key::from_file_bytes(&data) else {
                    continue;
                };
                match KeyInfo::from_public(&file.public) {
                    Ok(info) => {
                        let has_cert = files::chain_path(&path).exists();
                        out.push(listing(
                            TpmKeyLocation::Path(path),
                            info.algorithm,
                            has_cert,
                        ));
                    }
                    Err(reason) => {
                        tracing::debug!("skipping {}: {reason}", path.display());
                    }
                }
            }
            Ok(out)
        }
        Some(TpmKeyLocation::Path(path)) => {
            let file = files::read_key_file(path)?;
            let info = KeyInfo::from_public(&file.public).map_err(|e| {
                KeyError::Device(DeviceError::Tss2Pem {
                    path: path.clone(),
                    problem: Tss2Problem::Unusable(e),
                })
            })?;
            let has_cert = files::chain_path(path).exists();
            Ok(vec![listing(
                TpmKeyLocation::Path(path.clone()),
                info.algorithm,
                has_cert,
            )])
        }
        Some(TpmKeyLocation::Handle(_)) | None => {
            let tpm = connect(uri)?;
            let keys = tpm.with(persistent::persistent_signing_keys)?;
            Ok(keys
                .into_iter()
                .map(|(h, alg)| listing(TpmKeyLocation::Handle(h), alg, false))
                .collect())
        }
    }
}

/// Deletes a key: removes the key file and the chain beside it, or evicts the persistent key.
/// Returns what it removed.
pub fn delete(uri: &TpmUri) -> Result<Vec<String>, KeyError> {
    let location = uri.key.clone().ok_or(LocateError::NoKeySelected)?;
    match &location {
        TpmKeyLocation::Path(path) => {
            // Never remove a file that is not a TSS2 key, whatever the URI says.
            let data = fs::read(path).map_err(|e| files::missing_or_io(path, e))?;
            if !tss2_pem::is_tss2_file(&data) {
                return Err(KeyError::Device(DeviceError::Tss2Pem {
                    path: path.clone(),
                    problem: Tss2Problem::NotTss2File,
                }));
            }
            fs::remove_file(path).map_err(|e| KeyError::io("remove the TPM key file", path, e))?;
            let mut removed = vec![location_desc(&location)];
            let chain = files::chain_path(path);
            match fs::remove_file(&chain) {
                Ok(()) => removed.push(format!("certificate chain {}", chain.display())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(KeyError::io("remove the certificate chain", chain, e)),
            }
            Ok(removed)
        }
        TpmKeyLocation::Handle(h) => {
            let tcti = uri.tcti();
            let tpm = connect(uri)?;
            tpm.with(|ctx| persistent::evict_persistent(ctx, *h, &tcti))?;
            Ok(vec![location_desc(&location)])
        }
    }
}

/// Stores a certificate chain (DER, leaf first) beside a key file as `<key>.crt.pem`.
pub fn store_chain(uri: &TpmUri, chain: &[Vec<u8>]) -> Result<String, KeyError> {
    let location = uri.key.clone().ok_or(LocateError::NoKeySelected)?;
    match &location {
        TpmKeyLocation::Path(path) => {
            if chain.is_empty() {
                return Err(KeyError::Malformed {
                    what: "certificate chain".into(),
                    problem: crate::key::Malformation::Empty,
                });
            }
            fs::metadata(path).map_err(|e| files::missing_or_io(path, e))?;
            let chain_path = files::chain_path(path);
            atomic_file::write_atomic(&chain_path, files::chain_pem(chain).as_bytes(), 0o644)
                .map_err(|e| KeyError::io("write the certificate chain", &chain_path, e))?;
            Ok(chain_path.display().to_string())
        }
        TpmKeyLocation::Handle(_) => Err(KeyError::Capability(CapabilityError::TpmNoChainStore {
            key: location_desc(&location),
        })),
    }
}

impl KeyBackend for TpmKey {
    fn algorithm(&self) -> KeyAlgorithm {
        self.info.algorithm
    }

    fn certify(
        &self,
        ak_handle: u32,
        qualifying_data: &[u8],
    ) -> Result<crate::key::attestation::TpmEvidence, KeyError> {
        let tcti = self.loaded.tcti().to_string();
        self.loaded
            .with_loaded(|ctx, key| attest::certify(ctx, key, ak_handle, &tcti, qualifying_data))
    }

    fn protection(&self) -> Result<crate::key::Protection, KeyError> {
        let f = self.info.fixed;
        Ok(crate::key::Protection::from_tpm(
            f.fixed_tpm,
            f.fixed_parent,
            f.sensitive_data_origin,
        ))
    }

    fn spki_der(&self) -> &[u8] {
        &self.info.spki
    }

    fn sign(&self, scheme: SignScheme, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        sign::sign(
            &self.loaded,
            &self.info,
            &|| self.describe(),
            scheme,
            message,
        )
    }

    fn describe(&self) -> String {
        format!(
            "{} (TCTI '{}')",
            location_desc(&self.location),
            self.loaded.tcti()
        )
    }

    fn stored_chain(&self) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
        match &self.location {
            TpmKeyLocation::Path(p) => files::read_chain(&files::chain_path(p)),
            TpmKeyLocation::Handle(_) => Ok(None),
        }
    }

    fn signing_path(&self) -> crate::key::SigningPath {
        match self.info.pss {
            public::PssMethod::SoftwareEncoded => crate::key::SigningPath::SoftwarePss {
                mechanism: "TPM2_RSA_Decrypt",
            },
            public::PssMethod::Tpm | public::PssMethod::NotRsa => crate::key::SigningPath::Native,
        }
    }
}
