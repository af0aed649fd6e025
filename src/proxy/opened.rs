//! What the proxy opens before any runtime exists ([`Opened`]): the key in use behind its
//! signer, the chain, the upstream trust and the loopback CA.

use std::sync::Arc;

use super::error::StartError;
use super::settings::Settings;
use super::upstream::Identity;
use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::pki::cert;
use crate::pki::loopback_ca::LoopbackCa;
use crate::signer::remote::SignerLink;
use crate::signer::Supervisor;

/// What is opened before any runtime exists.
pub struct Opened {
    /// The signer, which also reads the watched files for the reloader.
    pub link: Arc<SignerLink>,
    /// The key in use and the resolver that presents its chain.
    pub identity: Identity,
    /// The TLS versions the key can sign for.
    pub versions: &'static [&'static rustls::SupportedProtocolVersion],
    /// The upstream CA bundle's roots.
    pub roots: rustls::RootCertStore,
    /// The loopback CA, loaded from (or made in) the state directory.
    pub ca: LoopbackCa,
}

impl Opened {
    /// Opens the key in use (with `--rotate-key`, the one a rotation left), its chain, the
    /// upstream trust and the loopback CA; refuses, in words, a key that cannot sign any
    /// handshake the upstream could accept.
    pub fn open(settings: &Settings, supervisor: Supervisor) -> Result<Opened, StartError> {
        // The key holds the link to its signer (and its restarts) for as long as it is used.
        // A signature must come within half the handshake timeout, so a stalled signer
        // (stopped, waiting for a touch, a stalled TPM) fails the request with a 502 naming it
        // instead of holding it, and a thread, for as long as the stall lasts.
        let (link, key) = SignerLink::open(supervisor, settings.upstream.handshake_timeout / 2)?;
        let key = Arc::new(key);
        let versions = crate::key::tls::protocol_versions(&key, settings.key.allow_tls12_fallback)?;
        let chain = cert::chain_for_key(&key, settings.key.cert.as_deref())?;
        cert::ensure_matches(&chain[0], &key)?;
        let resolver = Arc::new(HardwareCertResolver::new(
            HardwareSigningKey::new(key.clone()),
            chain,
        )?);
        Ok(Opened {
            link,
            identity: Identity { key, resolver },
            versions,
            roots: crate::pki::tls::root_store(settings.upstream.ca.as_deref())
                .map_err(StartError::UpstreamCa)?,
            ca: LoopbackCa::load_or_create(&settings.state_dir)?,
        })
    }
}
