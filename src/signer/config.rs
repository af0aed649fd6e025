//! What a signer serves ([`SignerConfig`]), decided on the signer's side of the split by the
//! process that starts the supervisor, before any network input; and the one typed message it
//! travels as to the supervisor and each signer ([`SignerConfigWire`], sent in the protocol's
//! versioned envelope).

use std::path::PathBuf;

use crate::key::KeyUri;

/// What a signer serves: decided by the process that started it, before any network input.
#[derive(Debug, Clone)]
pub struct SignerConfig {
    /// The configured key (`--key`, with its PIN source): the root of the rotation series,
    /// never deleted.
    pub key: KeyUri,
    /// With `--rotate-key`, the state directory whose `current-key` names the key the last
    /// rotation left (used when it belongs to the configured key's series).
    pub rotation_state: Option<PathBuf>,
    /// Where the identity's certificate is (else the chain stored with the key): read once, by
    /// the process that starts the supervisor, into `identity`; afterwards only written, by a
    /// signer, for [`crate::signer::protocol::Request::InstallCertificate`].
    pub cert: Option<PathBuf>,
    /// The identity's chain (DER, leaf first) as `cert` held before any network input. Every
    /// signer enforces its subject, whatever the file holds later: the network side may be
    /// able to write where the certificate is, and asks for new signers at will.
    pub identity: Option<Vec<Vec<u8>>>,
    /// The upstream CA bundle (`--upstream-ca`), read for the network side's reloads.
    pub upstream_ca: Option<PathBuf>,
    /// Sign TLS 1.2 handshakes too.
    pub tls12: bool,
    /// Refuse a key the device says could leave it.
    pub require_non_extractable: bool,
}

/// [`SignerConfig`] as the supervisor and the signers receive it: the key's URI as text (which
/// never shows a PIN value) and the PIN value apart, when it is held in memory.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct SignerConfigWire {
    key: String,
    pin_value: Option<zeroize::Zeroizing<String>>,
    rotation_state: Option<PathBuf>,
    cert: Option<PathBuf>,
    #[serde(default, with = "super::protocol::b64_opt_list")]
    identity: Option<Vec<Vec<u8>>>,
    #[serde(default)]
    upstream_ca: Option<PathBuf>,
    tls12: bool,
    require_non_extractable: bool,
}

impl From<&SignerConfig> for SignerConfigWire {
    fn from(c: &SignerConfig) -> SignerConfigWire {
        SignerConfigWire {
            key: c.key.to_string(),
            pin_value: c.key.pin_value(),
            rotation_state: c.rotation_state.clone(),
            cert: c.cert.clone(),
            identity: c.identity.clone(),
            upstream_ca: c.upstream_ca.clone(),
            tls12: c.tls12,
            require_non_extractable: c.require_non_extractable,
        }
    }
}

impl TryFrom<SignerConfigWire> for SignerConfig {
    type Error = super::SignerError;

    fn try_from(w: SignerConfigWire) -> Result<SignerConfig, super::SignerError> {
        let bad = |_| {
            super::SignerError::Unexpected("a key URI in the configuration that does not parse")
        };
        let mut key: KeyUri = w.key.parse().map_err(bad)?;
        if let Some(pin) = w.pin_value {
            key = key.with_pin_value(pin);
        }
        Ok(SignerConfig {
            key,
            rotation_state: w.rotation_state,
            cert: w.cert,
            identity: w.identity,
            upstream_ca: w.upstream_ca,
            tls12: w.tls12,
            require_non_extractable: w.require_non_extractable,
        })
    }
}

impl SignerConfig {
    /// What a proxy's signer serves: `key` (with `rotation_state`, `--rotate-key`'s state
    /// directory, the key the last rotation left within `key`'s series), the identity's
    /// certificate and the key policy. Made by the process that starts the supervisor, before
    /// any network input; checks that a rotation can name a next key before anything starts.
    pub fn for_proxy(
        key: KeyUri,
        rotation_state: Option<&crate::state_dir::StateDir>,
        cert: Option<PathBuf>,
        upstream_ca: Option<PathBuf>,
        tls12: bool,
        require_non_extractable: bool,
    ) -> Result<SignerConfig, super::SignerError> {
        if let Some(state) = rotation_state {
            let current = crate::key::rotation::current_key(&key, state);
            crate::key::rotation::next_key_uri(&current).map_err(super::SignerError::RotateKey)?;
        }
        Ok(SignerConfig {
            key,
            rotation_state: rotation_state.map(|s| s.path().to_path_buf()),
            cert,
            identity: None,
            upstream_ca,
            // TLS 1.2 is offered, and its transcripts signed, only when asked for: a TLS 1.2
            // transcript is a much looser shape than a TLS 1.3 CertificateVerify.
            tls12,
            require_non_extractable,
        })
    }

    /// Reads the identity's chain from `cert`, unless it was read already: done once, by the
    /// process that starts the supervisor (and by the supervisor for a configuration without
    /// it), before the network side exists.
    pub fn load_identity(&mut self) -> Result<(), crate::pki::PkiError> {
        if let (None, Some(path)) = (&self.identity, &self.cert) {
            let chain = crate::pki::cert::load_chain(path)?;
            self.identity = Some(chain.into_iter().map(|c| c.to_vec()).collect());
        }
        Ok(())
    }
}
