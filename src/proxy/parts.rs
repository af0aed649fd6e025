//! The handles the proxy's components are built from ([`Parts`]): made once by
//! [`super::start`], each component's `build` takes the ones it uses, so a component's own
//! constants and settings stay in its own module.

use std::sync::Arc;

use super::lifetime::Activity;
use super::metrics::Metrics;
use super::relay_loop::RelayLoops;
use super::threads::Spawner;
use super::upstream::Upstream;
use crate::lifecycle::renewal_lock::LockFile;
use crate::pki::loopback_ca::LoopbackCa;
use crate::signer::remote::SignerLink;

/// What the components are built from.
pub struct Parts {
    /// The connector to the API server, holding the key in use and its chain.
    pub upstream: Arc<Upstream>,
    /// Every component counts into the same metrics.
    pub metrics: Arc<Metrics>,
    /// Open connections and requests: the idle stop and the drain read it.
    pub activity: Arc<Activity>,
    /// The connection threads the client connections run on.
    pub connections: Spawner,
    /// The relay loops of established UNIX-socket connections.
    pub loops: Arc<RelayLoops>,
    /// The TLS versions the key can sign for.
    pub versions: &'static [&'static rustls::SupportedProtocolVersion],
    /// The loopback CA: the local listeners' certificates and the loopback credentials.
    pub ca: LoopbackCa,
    /// The signer, which also reads the watched files for the reloader and the renewal.
    pub link: Arc<SignerLink>,
    /// The renewal's lock on the certificate (`--renew`), taken before confinement.
    pub renew_lock: Option<LockFile>,
}
