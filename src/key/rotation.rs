//! The keys of a rotation series (`hwkey proxy --rotate-key`): how the next key is named, which
//! key a proxy restarted mid-series uses, and which keys belong to a series at all. A signer
//! creates and deletes keys only within the series of the key it was configured with, so a
//! compromised network side cannot make it open, replace or destroy any other key.
//!
//! A series key is the configured key's label (PKCS#11, same token and module) or file name
//! (TPM, same directory and TPM) with a `-r<unix time>` suffix.

use super::{KeyError, KeyUri};
use crate::state_dir::{StateDir, CURRENT_KEY_FILE};

/// The URI of the next key of a rotation after `current`: its label or file name with a fresh
/// `-r<unix time>` suffix in place of any previous one.
pub fn next_key_uri(current: &KeyUri) -> Result<KeyUri, KeyError> {
    current.next_in_series(super::attestation::unix_now())
}

/// Whether `candidate` belongs to the rotation series of `configured`: the same device (token
/// and module; TPM and directory) and the configured name with a `-r<digits>` suffix, or the
/// configured key itself.
pub fn in_series(configured: &KeyUri, candidate: &KeyUri) -> bool {
    candidate.in_series_of(configured)
}

/// Whether `a` and `b` name the same key, whatever their spelling: the same URI without PIN, or
/// TPM key files that are one file (the same path once `.` parts and repeated slashes are
/// dropped, or the same file once links are followed). What protects the configured key from
/// deletion must not be fooled by a spelling that [`in_series`] accepts.
pub fn same_key(a: &KeyUri, b: &KeyUri) -> bool {
    a.same_key_as(b)
}

/// The key a proxy uses: the one a rotation left in `STATE/current-key` (with the configured
/// PIN source) when it belongs to the configured key's series, else `configured`.
pub fn current_key(configured: &KeyUri, state_dir: &StateDir) -> KeyUri {
    // As a state file: not through a symbolic link, not waiting on a FIFO, not another user's.
    let text = match crate::state_dir::read_private(&state_dir.current_key()) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return configured.clone(),
        Err(e) => {
            tracing::error!(error = %e, "ignoring {CURRENT_KEY_FILE}");
            return configured.clone();
        }
    };
    let left = match text.trim().parse::<KeyUri>() {
        Ok(uri) => uri.key_of(configured),
        Err(e) => {
            tracing::error!(error = %e, "ignoring an unreadable {CURRENT_KEY_FILE}");
            return configured.clone();
        }
    };
    if !in_series(configured, &left) {
        tracing::error!(key = %left.without_pin(), configured = %configured.without_pin(), "ignoring {CURRENT_KEY_FILE}: it names a key outside the configured key's rotation series");
        return configured.clone();
    }
    let uri = left;
    tracing::info!(key = %uri.without_pin(), "using the key the last rotation left in {CURRENT_KEY_FILE}");
    uri
}

/// Records `key` as the one in use in `state_dir`'s pointer: its URI without any password
/// source (readers take only which key from it, see [`current_key`]; operators read it to
/// update `--key`).
pub fn record_current(state_dir: &StateDir, key: &KeyUri) -> std::io::Result<()> {
    let shown = key.for_pointer();
    crate::atomic_file::write_atomic(
        &state_dir.current_key(),
        format!("{shown}\n").as_bytes(),
        0o600,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(s: &str) -> KeyUri {
        s.parse().expect("URI")
    }

    /// `current-key` is read as a state file: a pointer that is a symbolic link (to a file of
    /// another user's making) or a FIFO is ignored, with the configured key used instead; a
    /// real pointer is followed.
    #[test]
    fn the_current_key_pointer_is_a_real_file_of_the_state_directory() {
        use std::os::unix::fs::PermissionsExt;
        let configured = uri("pkcs11:token=kube;object=alice?module-path=/m.so");
        let rotated = "pkcs11:token=kube;object=alice-r7?module-path=/m.so\n";
        let dir = tempfile::tempdir().expect("dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        let state = StateDir::new(dir.path());
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, rotated).expect("write");
        std::os::unix::fs::symlink(&elsewhere, state.current_key()).expect("link");
        assert_eq!(
            current_key(&configured, &state),
            configured,
            "a link was followed"
        );
        std::fs::remove_file(state.current_key()).expect("unlink");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            state.current_key(),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
        let (tx, rx) = std::sync::mpsc::channel();
        let (c, s) = (configured.clone(), state.clone());
        std::thread::spawn(move || drop(tx.send(current_key(&c, &s))));
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a FIFO was waited on");
        assert_eq!(got, configured);
        std::fs::remove_file(state.current_key()).expect("unlink");
        crate::atomic_file::write_atomic(&state.current_key(), rotated.as_bytes(), 0o600)
            .expect("write");
        assert_eq!(
            current_key(&configured, &state).to_string(),
            uri(rotated.trim()).to_string()
        );
    }

    #[test]
    fn the_series_is_the_configured_name_with_a_rotation_suffix_on_the_same_device() {
        let c = uri("pkcs11:token=kube;object=alice?module-path=/m.so");
        assert!(in_series(&c, &c));
        assert!(in_series(
            &c,
            &uri("pkcs11:token=kube;object=alice-r123?module-path=/m.so")
        ));
        for outside in [
            "pkcs11:token=kube;object=bob-r123?module-path=/m.so",
            "pkcs11:token=kube;object=alice-rx?module-path=/m.so",
            "pkcs11:token=other;object=alice-r123?module-path=/m.so",
            "pkcs11:token=kube;object=alice-r123?module-path=/other.so",
            "pkcs11:token=kube;object=alice-r123;id=%01?module-path=/m.so",
            "tpm:path=/k/alice-r1.tpm.pem",
        ] {
            assert!(!in_series(&c, &uri(outside)), "{outside}");
        }
        let t = uri("tpm:path=/k/node.tpm.pem?tcti=device:/dev/tpmrm0");
        assert!(in_series(
            &t,
            &uri("tpm:path=/k/node-r5.tpm.pem?tcti=device:/dev/tpmrm0")
        ));
        assert!(!in_series(
            &t,
            &uri("tpm:path=/other/node-r5.tpm.pem?tcti=device:/dev/tpmrm0")
        ));
        assert!(!in_series(
            &t,
            &uri("tpm:path=/k/nodes-r5.tpm.pem?tcti=device:/dev/tpmrm0")
        ));
        assert!(!in_series(
            &t,
            &uri("tpm:path=/k/node-r5.tpm.pem?tcti=swtpm:port=1")
        ));
    }

    #[test]
    fn the_next_key_stays_in_the_series() {
        let c = uri("pkcs11:token=kube;object=alice-r9?module-path=/m.so");
        let next = next_key_uri(&c).expect("next");
        assert!(in_series(
            &uri("pkcs11:token=kube;object=alice?module-path=/m.so"),
            &next
        ));
    }

    /// The pointer names only which key: a pointer that carries its own password source (or a
    /// TPM's owner password, parent or TCTI) does not choose what the signer presents; the
    /// configured key's are used. Before, a TPM pointer kept its own `pin-source`: three
    /// pointers with wrong ones put the TPM into dictionary-attack lockout.
    #[test]
    fn the_pointer_chooses_the_key_never_its_password() {
        let dir = tempfile::tempdir().expect("dir");
        let state = StateDir::new(dir.path());
        let configured = uri(
            "tpm:path=/k/node.tpm.pem?tcti=swtpm:port=2321&pin-source=file:/etc/hwkey/pw&owner-pin-source=file:/etc/hwkey/owner",
        );
        crate::atomic_file::write_atomic(
            &state.current_key(),
            b"tpm:path=/k/node-r3.tpm.pem?tcti=swtpm:port=2321&pin-source=file:/tmp/wrong&owner-pin-source=file:/tmp/wrong2&parent=0x81000009\n",
            0o600,
        )
        .expect("write");
        let got = current_key(&configured, &state);
        let want = uri(
            "tpm:path=/k/node-r3.tpm.pem?tcti=swtpm:port=2321&pin-source=file:/etc/hwkey/pw&owner-pin-source=file:/etc/hwkey/owner",
        );
        assert_eq!(got, want);

        let configured = uri("pkcs11:token=kube;object=alice?module-path=/m.so&pin-source=file:/p");
        crate::atomic_file::write_atomic(
            &state.current_key(),
            b"pkcs11:token=kube;object=alice-r2?module-path=/m.so&pin-source=file:/tmp/wrong\n",
            0o600,
        )
        .expect("write");
        assert_eq!(
            current_key(&configured, &state),
            uri("pkcs11:token=kube;object=alice-r2?module-path=/m.so&pin-source=file:/p")
        );
        // What a rotation records holds no password source, and reads back with the configured
        // one's.
        record_current(
            &state,
            &uri("pkcs11:token=kube;object=alice-r3?module-path=/m.so&pin-source=file:/p"),
        )
        .expect("record");
        let text = std::fs::read_to_string(state.current_key()).expect("read");
        assert!(!text.contains("pin-source"), "{text}");
        assert_eq!(
            current_key(&configured, &state),
            uri("pkcs11:token=kube;object=alice-r3?module-path=/m.so&pin-source=file:/p")
        );
    }
}
