//! Key and certificate files on disk.
//!
//! Writes go through [`crate::atomic_file`], so a reader (another hwkey, tpm2-openssl) sees the
//! old file or the complete new one, never a torn one; a new key file is linked "no clobber",
//! which makes "refuse if it exists" race-free. The certificate chain of `k.pem` lives beside it
//! as `k.crt.pem`. Reading a key file maps "missing" to `KeyNotFound` with the key files that
//! are there, so a typo in a path is easy to see.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::tss2_pem::{self, Tss2Key};
use crate::key::{DeviceError, LocateError};
use crate::key::{KeyError, Malformation};

/// Where the certificate chain of the key file `key` is kept: `<key without .pem>.crt.pem`.
pub(crate) fn chain_path(key: &Path) -> PathBuf {
    let name = key
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".pem").unwrap_or(&name);
    key.with_file_name(format!("{stem}.crt.pem"))
}

/// True for file names that may be key files in a listed directory (not chains, not temps).
pub(crate) fn may_be_key_file(path: &Path) -> bool {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy()) else {
        return false;
    };
    !name.starts_with('.') && !name.ends_with(".crt.pem") && path.is_file()
}

/// The PEM text of a chain (DER certificates, leaf first).
pub(crate) fn chain_pem(chain: &[Vec<u8>]) -> String {
    chain
        .iter()
        .map(|der| crate::key::der::to_pem("CERTIFICATE", der))
        .collect()
}

/// Reads the chain stored beside a key file, if there is one.
pub(crate) fn read_chain(path: &Path) -> Result<Option<Vec<Vec<u8>>>, KeyError> {
    let data = match fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(KeyError::io("read the certificate chain", path, e)),
    };
    let malformed = |problem| KeyError::Malformed {
        what: format!("certificate chain {}", path.display()),
        problem,
    };
    let blocks =
        pem::parse_many(&data).map_err(|e| malformed(Malformation::NotPem(Box::new(e))))?;
    let certs: Vec<Vec<u8>> = blocks
        .into_iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| b.into_contents())
        .collect();
    if certs.is_empty() {
        return Err(malformed(Malformation::NoCertificateBlock));
    }
    Ok(Some(certs))
}

/// Reads and parses a key file; a missing file is `KeyNotFound` listing its neighbours.
pub(crate) fn read_key_file(path: &Path) -> Result<Tss2Key, KeyError> {
    let data = fs::read(path).map_err(|e| missing_or_io(path, e))?;
    Tss2Key::from_file_bytes(&data).map_err(|problem| {
        KeyError::Device(DeviceError::Tss2Pem {
            path: path.to_path_buf(),
            problem,
        })
    })
}

pub(crate) fn missing_or_io(path: &Path, e: io::Error) -> KeyError {
    if e.kind() != io::ErrorKind::NotFound {
        return KeyError::io("read the TPM key file", path, e);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let present = key_files_in(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| {
            fs::read(p)
                .map(|d| tss2_pem::is_tss2_file(&d))
                .unwrap_or(false)
        })
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    KeyError::Locate(LocateError::KeyNotFound {
        what: format!("TPM key file {}", path.display()),
        place: format!("this machine (directory {})", dir.display()),
        present,
    })
}

/// Candidate key files in a directory, sorted.
pub(crate) fn key_files_in(dir: &Path) -> Result<Vec<PathBuf>, KeyError> {
    let entries = fs::read_dir(dir).map_err(|e| KeyError::io("list the directory", dir, e))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| may_be_key_file(p))
        .collect();
    paths.sort();
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_sits_beside_the_key() {
        assert_eq!(
            chain_path(Path::new("/k/alice.pem")),
            Path::new("/k/alice.crt.pem")
        );
        assert_eq!(
            chain_path(Path::new("/k/alice.key")),
            Path::new("/k/alice.key.crt.pem")
        );
    }
}
