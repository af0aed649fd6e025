//! The signer: the key in a process of its own, which signs only handshakes, requests for its
//! own identity and health checks.
//!
//! `hwkey proxy` parses its settings, then forks the [`supervisor`] while it still has one
//! thread and before it reads any network byte. The supervisor starts a signer process
//! ([`server`]) for each request of the network side: only a signer loads the PKCS#11 module or
//! the TSS libraries, reads the PIN source and holds sessions and the PIN memory. The network
//! side talks to its signer over a `socketpair` ([`protocol`]: typed, versioned, one JSON
//! message per datagram) through a [`remote`] key, which the proxy uses like any other
//! [`crate::key::Key`]. Each signature states its purpose and the signer checks the message
//! against it ([`policy`]); a compromised network side can make handshakes, never sign a CSR
//! for another name, a JWT or arbitrary data.

pub mod config;
pub mod error;
pub mod policy;
pub mod protocol;
pub mod remote;
pub mod server;
pub mod supervisor;

pub use config::SignerConfig;
pub use error::SignerError;
pub use remote::SignerClient;
pub use supervisor::Supervisor;

/// Opens `key` in a signer process of its own, as the proxy does: for the one-shot commands
/// that sign with the identity (`hwkey probe`, `hwkey renew`), so the PKCS#11 module, the TSS
/// libraries and the PIN are never in the process that speaks to the network, and the same
/// policy decides what is signed (TLS 1.2 transcripts only with `tls12`, the command's
/// `--allow-tls12-fallback`). `cert` is the identity's certificate file (else the chain
/// stored with the key). The key holds its link to the signer; the signer side ends with it.
pub fn open_key(
    key: &crate::key::KeyUri,
    cert: Option<&std::path::Path>,
    require_non_extractable: bool,
    tls12: bool,
) -> Result<crate::key::Key, crate::key::KeyError> {
    let config = SignerConfig {
        key: key.clone(),
        rotation_state: None,
        cert: cert.map(std::path::Path::to_path_buf),
        identity: None,
        upstream_ca: None,
        // As the proxy: TLS 1.2 transcripts only with --allow-tls12-fallback.
        tls12,
        require_non_extractable,
    };
    let supervisor = Supervisor::start(&config).map_err(|e| remote::signer_error(&e))?;
    remote::SignerLink::open(supervisor, remote::DEFAULT_DEADLINE).map(|(_, key)| key)
}
