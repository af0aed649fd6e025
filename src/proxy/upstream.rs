//! The connector to the API server: mTLS with the hardware key, ALPN chosen per connection,
//! and TLS 1.3 session resumption so that most connections need no hardware signature.
//!
//! All connections share one rustls session store: after the first full handshake the
//! server's tickets let the following connections resume (a PSK handshake, no
//! CertificateVerify, no signature). rustls wants one `ClientConfig` per ALPN list, so there is
//! one per protocol asked for, all built on the same store and the same
//! [`HardwareCertResolver`]. A certificate reload starts a new generation of configs with an
//! empty store: a resumed session would otherwise keep presenting the old certificate.
//!
//! ALPN: the local client's protocol is chosen (and told to the client) *before* the upstream
//! connection, because the local client must authenticate first (a TLS 1.3 client sends its
//! certificate only after the server has picked the protocol) and an unauthenticated peer must
//! never cause an upstream connection. The upstream is then offered exactly that protocol. If
//! it refuses it, the protocol is remembered as unsupported, this one connection fails cleanly,
//! and later clients get the next protocol of their list. An upstream that answers with no
//! protocol at all does not do ALPN (RFC 7301); HTTP/1.1 clients proceed over it.
//!
//! Several API servers: see [`super::endpoints`] (round robin over the healthy ones, each with
//! its own tickets; a failed connection is retried on the next one before the client sees it).
//!
//! The upstream also holds the proxy's identity: the hardware key in use and its certificate
//! chain (in the [`HardwareCertResolver`]), and the certificate *epoch* connections are tied to
//! ([`super::rotation`]). Installing a renewed chain, or a rotated key with its chain, is one
//! operation here ([`Upstream::install_chain`], [`Upstream::install_key`]): the resolver, an
//! empty session store (no resumed session presents the old certificate), a new epoch and the
//! certificate metrics change together.
//!
//! Threads: `connect` runs on the connection's task. The hardware signature of a full
//! handshake happens inside rustls on that task's worker thread, under `block_in_place` (see
//! [`crate::key::tls`]), so other connections keep moving on the remaining workers.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustls::client::Resumption;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, HandshakeKind, RootCertStore};
use tokio::sync::watch;

use super::endpoints::{endpoint_failure, Attempted, Endpoint, Endpoints, Generation};
use super::error::{StartError, UpstreamError};
use super::metrics::{Metrics, UpstreamStage};
pub use super::origin::{ClientKind, Dial, Origin, OriginConn, UpstreamConn};
use super::rotation::{self, CertEpoch};
use super::sessions::{Warmup, TICKET_WAIT};
use super::settings::UpstreamSettings;
use super::spare::Spares;
use crate::egress::{Egress, EgressError, Tunnel};
use crate::endpoint::UpstreamTarget;
use crate::key::tls::{HardwareCertResolver, HardwareSigningKey};
use crate::key::{Key, KeyError};
use crate::pki::tls::KeyExchange;

/// The application protocols the proxy bridges (what kubectl, client-go and kubelet speak).
pub const SERVED_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The proxy's identity: the hardware key in use and the resolver presenting it with its chain.
pub struct Identity {
    /// The key (replaced by `--rotate-key`).
    pub key: Arc<Key>,
    /// Presents the key's chain and signs with it.
    pub resolver: Arc<HardwareCertResolver>,
}

/// The upstream connector, shared by all connection tasks.
pub struct Upstream {
    pub(super) endpoints: Endpoints,
    pub(super) egress: Egress,
    kx: KeyExchange,
    pub(super) attempt_timeout: Duration,
    key: RwLock<Arc<Key>>,
    resolver: Arc<HardwareCertResolver>,
    epoch: watch::Sender<CertEpoch>,
    roots: RwLock<Arc<RootCertStore>>,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    refused_alpn: Mutex<HashSet<Vec<u8>>>,
    /// Why the last reload of the CA bundle was refused (the previous trust stays); None once
    /// one loads.
    trust_problem: Mutex<Option<String>>,
    /// Why the last certificate reload was refused (the previous chain stays in use).
    cert_problem: Mutex<Option<String>>,
    spares: Spares,
    pub(super) metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("targets", &self.describe())
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// A connector to `settings`' API servers, verifying each one's certificate against
    /// `roots` under the configured server name (default: that endpoint's host), presenting
    /// `identity`.
    pub fn new(
        settings: &UpstreamSettings,
        identity: Identity,
        roots: RootCertStore,
        versions: &'static [&'static rustls::SupportedProtocolVersion],
        metrics: Arc<Metrics>,
    ) -> Result<Upstream, StartError> {
        let mut list = Vec::with_capacity(settings.targets.len());
        for target in &settings.targets {
            let name = settings
                .tls_server_name
                .as_deref()
                .unwrap_or(&target.host)
                .to_string();
            let server_name = ServerName::try_from(name.clone())
                .map_err(|_| StartError::InvalidServerName { given: name })?;
            let m = metrics.endpoint(&target.authority());
            list.push(Endpoint::new(target.clone(), server_name, m));
        }
        let chain = identity.resolver.chain();
        metrics.certificate(rotation::not_after_unix(&chain));
        Ok(Upstream {
            endpoints: Endpoints::new(list),
            egress: settings.egress.clone(),
            kx: settings.key_exchange,
            attempt_timeout: settings.handshake_timeout,
            key: RwLock::new(identity.key),
            resolver: identity.resolver,
            epoch: rotation::first(&chain),
            roots: RwLock::new(Arc::new(roots)),
            versions,
            refused_alpn: Mutex::new(HashSet::new()),
            trust_problem: Mutex::new(None),
            cert_problem: Mutex::new(None),
            spares: Spares::new(settings.preconnect, metrics.clone()),
            metrics,
        })
    }

    /// The hardware key in use now.
    pub fn key(&self) -> Arc<Key> {
        self.key.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The certificate chain in use now.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.resolver.chain()
    }

    /// The certificate generation in use now.
    pub fn epoch(&self) -> CertEpoch {
        *self.epoch.borrow()
    }

    /// Follows the certificate generations (a connection ends when its own is retired).
    pub fn epochs(&self) -> watch::Receiver<CertEpoch> {
        self.epoch.subscribe()
    }

    /// Installs a chain for new connections: the resolver's chain, an empty session store (no
    /// resumed session presents the old certificate), a new epoch (connections opened before
    /// end per `--rotation-close`), and the certificate metrics.
    pub fn install_chain(&self, chain: Vec<CertificateDer<'static>>) -> Result<(), KeyError> {
        self.resolver.replace_chain(chain.clone())?;
        self.installed(&chain);
        Ok(())
    }

    /// Switches to another key and its chain (`--rotate-key`), as one step: a handshake never
    /// pairs a key with another key's certificate.
    pub fn install_key(
        &self,
        key: Arc<Key>,
        chain: Vec<CertificateDer<'static>>,
    ) -> Result<(), KeyError> {
        self.resolver
            .replace_key(HardwareSigningKey::new(key.clone()), chain.clone())?;
        *self.key.write().unwrap_or_else(|p| p.into_inner()) = key;
        self.installed(&chain);
        Ok(())
    }

    fn installed(&self, chain: &[CertificateDer<'static>]) {
        self.set_cert_problem(None);
        self.reset_sessions();
        rotation::advance(&self.epoch, chain);
        self.metrics.certificate(rotation::not_after_unix(chain));
    }

    /// The first API server (the one renewals and messages name).
    pub fn target(&self) -> &UpstreamTarget {
        &self.endpoints.list[0].target
    }

    /// The API servers a renewal tries, in the order a new connection would (the ones that
    /// are up first): index and `https://HOST:PORT`.
    pub fn renewal_servers(&self) -> Vec<(usize, String)> {
        self.endpoints
            .order()
            .into_iter()
            .map(|i| {
                (
                    i,
                    format!("https://{}", self.endpoints.list[i].target.authority()),
                )
            })
            .collect()
    }

    /// A renewal could not reach endpoint `i`: it is marked down like a failed connection,
    /// so traffic and the next attempt go to the others.
    pub fn renewal_failed(&self, i: usize, error: &dyn std::fmt::Display) {
        if let Some(endpoint) = self.endpoints.list.get(i) {
            endpoint.failed(error);
        }
    }

    /// Every API server, in the order given.
    pub fn targets(&self) -> impl Iterator<Item = &UpstreamTarget> {
        self.endpoints.list.iter().map(|e| &e.target)
    }

    /// `https://a:6443,https://b:6443`.
    pub fn describe(&self) -> String {
        self.targets()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How connections reach the API server (the renewal's client goes the same way).
    pub fn egress(&self) -> &Egress {
        &self.egress
    }

    /// Opens a stream to `target`: straight, or through the forward proxy.
    pub async fn dial(&self, target: &UpstreamTarget) -> Result<Tunnel, UpstreamError> {
        let addr = target.authority();
        match self.egress.dial(&target.host, target.port).await {
            Ok(t) => Ok(t),
            Err(EgressError::Direct { source, .. }) => Err(UpstreamError::Connect { addr, source }),
            Err(source) => Err(UpstreamError::Via { addr, source }),
        }
    }

    /// Whether connections to `target` go through an `https://` forward proxy.
    fn through_https_proxy(&self, target: &UpstreamTarget) -> bool {
        let proxy = self.egress.proxy_for(&target.host, target.port);
        proxy.is_some_and(|p| p.scheme == crate::egress::ProxyScheme::Https)
    }

    /// The resolver holding the hardware key and its current chain.
    pub fn resolver(&self) -> &Arc<HardwareCertResolver> {
        &self.resolver
    }

    /// Forgets all resumable sessions: the next connection makes a full handshake (and
    /// presents the current certificate). Connections already open are not touched.
    pub fn reset_sessions(&self) {
        self.endpoints.reset_sessions();
        // After: a spare begun in between has the new sessions and trust, or is dropped.
        self.spares.retire();
    }

    /// Trusts `roots` for the API server from now on (a CA rotation): new connections verify
    /// against them, so the resumable sessions (verified under the old trust) are dropped.
    /// Connections already open are not touched.
    pub fn set_roots(&self, roots: RootCertStore) {
        *self.roots.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(roots);
        self.set_trust_problem(None);
        self.reset_sessions();
    }

    /// Records why a CA bundle was not loaded (the previous trust stays in use): `/healthz`
    /// says "degraded" until one loads.
    pub fn set_trust_problem(&self, problem: Option<String>) {
        *self.trust_problem.lock().unwrap_or_else(|p| p.into_inner()) = problem;
    }

    /// Records why a certificate file was not reloaded (the previous chain stays in use):
    /// `/healthz` says "degraded" until a chain is installed.
    pub fn set_cert_problem(&self, problem: Option<String>) {
        *self.cert_problem.lock().unwrap_or_else(|p| p.into_inner()) = problem;
    }

    /// Why the last certificate reload was refused, if it was.
    pub fn cert_problem(&self) -> Option<String> {
        self.cert_problem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why the last CA bundle was not loaded, if it was not.
    pub fn trust_problem(&self) -> Option<String> {
        self.trust_problem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Picks the protocol for a client that offered `offered` (its preference order): the
    /// first one the proxy serves ([`SERVED_ALPN`]) that the upstream has not refused. None
    /// when it offered nothing usable. Only served protocols ever reach the per-protocol
    /// config caches, so ClientHellos with made-up ALPN strings cannot grow them.
    pub fn choose_alpn(&self, offered: &[Vec<u8>]) -> Option<Vec<u8>> {
        let refused = self.refused_alpn.lock().unwrap_or_else(|p| p.into_inner());
        offered
            .iter()
            .filter(|p| SERVED_ALPN.contains(&p.as_slice()))
            .find(|p| !refused.contains(*p))
            .cloned()
    }

    /// Connects to an API server offering exactly `alpn`: the endpoints in
    /// [`Endpoints::order`], each attempt within the attempt timeout; an endpoint that fails
    /// is marked down and the next one is tried. Fails with the last endpoint's error.
    pub async fn connect(&self, alpn: Option<&[u8]>) -> Result<UpstreamConn, UpstreamError> {
        self.connect_sending(alpn, &[]).await
    }

    /// [`Upstream::connect`], with `first` (a client's first bytes) sent as soon as the
    /// handshake allows, in the same write as the proxy's last handshake flight (its
    /// `Finished`): one write for the proxy and one read for the API server, where writing
    /// them after the handshake took two of each. rustls holds them until the server is
    /// authenticated and the handshake complete, so they never reach a server that is not the
    /// one configured. They go before the ALPN check, so HTTP/2 bytes go early only to an API
    /// server that has agreed to `h2` before: one that does not do HTTP/2 (a plain HTTP/1.1
    /// server, or a balancer that would take HTTP/2 without agreeing to it) gets none of a
    /// request the proxy then answers with a 502, and that a client would send again. An
    /// HTTP/1.1 client is served by a server that agrees to nothing, so its bytes always may.
    pub async fn connect_sending(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
    ) -> Result<UpstreamConn, UpstreamError> {
        self.connect_sending_after(alpn, first, Attempted::default())
            .await
    }

    /// [`Upstream::connect_sending`] for a connection a relay loop began
    /// ([`Upstream::connect_any_after`]).
    pub async fn connect_sending_after(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
        attempted: Attempted,
    ) -> Result<UpstreamConn, UpstreamError> {
        let conn = self
            .connect_any_after(alpn, first, Dial::Buffered, attempted)
            .await?;
        conn.into_buffered()
            .ok_or_else(|| UpstreamError::Handshake {
                addr: self.describe(),
                source: std::io::Error::other("an unbuffered session where none was asked for"),
            })
    }

    /// The spare connections made ahead for local clients.
    pub fn spares(&self) -> &Spares {
        &self.spares
    }

    /// [`Upstream::connect_sending`] made as `how` says (a spare: [`super::preconnect`]).
    pub(super) async fn connect_any(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
        how: Dial,
    ) -> Result<OriginConn, UpstreamError> {
        self.connect_any_after(alpn, first, how, Attempted::default())
            .await
    }

    /// [`Upstream::connect_any`] for a connection a relay loop began ([`Upstream::dial_in_loop`]):
    /// in the round robin's turn it took, and, when its attempt failed on an endpoint, the
    /// others in turn (that one's failure when none is left).
    pub(super) async fn connect_any_after(
        &self,
        alpn: Option<&[u8]>,
        first: &[u8],
        how: Dial,
        attempted: Attempted,
    ) -> Result<OriginConn, UpstreamError> {
        let order = match attempted.turn {
            Some(turn) => self.endpoints.order_at(turn),
            None => self.endpoints.order(),
        };
        let (skip, mut last) = attempted
            .failed
            .map_or((None, None), |(i, e)| (Some(i), Some(e)));
        for i in order.into_iter().filter(|&i| Some(i) != skip) {
            let endpoint = &self.endpoints.list[i];
            let attempt = tokio::time::timeout(
                self.attempt_timeout,
                self.connect_to(endpoint, alpn, first, how),
            );
            let error = match attempt.await {
                Ok(Ok(conn)) => {
                    endpoint.succeeded();
                    return Ok(conn);
                }
                Ok(Err(e)) if !endpoint_failure(&e) => return Err(e),
                Ok(Err(e)) => e,
                Err(_) => {
                    self.metrics.upstream_error(UpstreamStage::Timeout);
                    UpstreamError::Timeout {
                        addr: endpoint.target.authority(),
                        after: self.attempt_timeout,
                    }
                }
            };
            // A spare's failure is nobody's: no endpoint is marked down, no other one tried.
            if how.spare() {
                return Err(error);
            }
            endpoint.failed(&error);
            last = Some(error);
        }
        Err(last.unwrap_or(UpstreamError::NoEndpoint))
    }

    /// One attempt: TCP (or a tunnel) and the TLS handshake with `endpoint`, as `how` says.
    async fn connect_to(
        &self,
        endpoint: &Endpoint,
        alpn: Option<&[u8]>,
        first: &[u8],
        how: Dial,
    ) -> Result<OriginConn, UpstreamError> {
        let addr = endpoint.target.authority();
        let generation = endpoint.generation();
        if how.spare() && self.through_https_proxy(&endpoint.target) {
            // Its outer TLS session's handshake is not one a spare's refusal covers.
            return Err(UpstreamError::Handshake {
                addr,
                source: std::io::Error::other("no spare connection through an https:// proxy"),
            });
        }
        // A spare only resumes (spare.rs): held until its handshake is over.
        let mut claim = generation.store.claim_if(how.spare(), TICKET_WAIT).await?;
        let tcp = match self.dial(&endpoint.target).await {
            Ok(t) => t,
            Err(e) => {
                self.metrics.upstream_error(UpstreamStage::Connect);
                return Err(e);
            }
        };
        let config = self.config_for(&generation, alpn, &addr)?;
        // A cold store: one connection warms it, the others wait for its ticket (sessions.rs).
        let warmup = match claim.as_mut() {
            Some(c) => c.start(),
            None => generation.store.warm_up().await,
        };
        let started = Instant::now();
        let early = alpn != Some(b"h2".as_slice()) || endpoint.agreed_h2();
        // Sealed after the proxy's `Finished`, in its write (see connect_sending).
        let going = if early { first } else { &[] };
        let name = endpoint.server_name.clone();
        let (origin, sent) = match super::origin::handshake(tcp, config, name, going, how).await {
            Ok(done) => done,
            Err(source) => return Err(self.handshake_error(addr, alpn, source)),
        };
        if let Warmup::Leader(guard) = warmup {
            guard.succeeded();
        }
        let (resumed, got) = self.established(&addr, alpn, origin.state(), started)?;
        if resumed {
            generation.store.resumed_in(started.elapsed());
        }
        if got.as_deref() == Some(b"h2".as_slice()) {
            endpoint.agree_h2();
        }
        Ok(OriginConn {
            origin,
            alpn: got,
            resumed,
            sent,
        })
    }

    /// Counts and logs a completed handshake, and checks the protocol the upstream chose:
    /// whether it resumed, and that protocol.
    pub(super) fn established(
        &self,
        addr: &str,
        alpn: Option<&[u8]>,
        conn: &rustls::CommonState,
        started: Instant,
    ) -> Result<(bool, Option<Vec<u8>>), UpstreamError> {
        let took = started.elapsed();
        let resumed = conn.handshake_kind() == Some(HandshakeKind::Resumed);
        self.metrics.upstream_handshake(resumed, took);
        let got = conn.alpn_protocol().map(<[u8]>::to_vec);
        self.check_alpn(addr, alpn, got.as_deref())?;
        tracing::debug!(
            upstream = %addr,
            resumed,
            group = %crate::pki::tls::group_name(conn),
            retry = conn.handshake_kind() == Some(HandshakeKind::FullWithHelloRetryRequest),
            ms = took.as_millis() as u64,
            "upstream handshake done"
        );
        Ok((resumed, got))
    }

    pub(super) fn handshake_error(
        &self,
        addr: String,
        alpn: Option<&[u8]>,
        source: std::io::Error,
    ) -> UpstreamError {
        let text = crate::error_chain::error_chain(&source);
        if let (Some(p), true) = (alpn, text.contains("NoApplicationProtocol")) {
            self.refuse_alpn(p);
            self.metrics.upstream_error(UpstreamStage::Alpn);
            return UpstreamError::Alpn {
                addr,
                asked: String::from_utf8_lossy(p).into_owned(),
                got: "a no_application_protocol alert".into(),
            };
        }
        self.metrics.upstream_error(UpstreamStage::Handshake);
        UpstreamError::Handshake { addr, source }
    }

    /// RFC 7301: a server that answers without any protocol simply does not do ALPN, and such
    /// servers (older ones, some load balancers) speak HTTP/1.1. An h2 client still gets the
    /// clean failure below and HTTP/1.1 on its next connection.
    fn check_alpn(
        &self,
        addr: &str,
        asked: Option<&[u8]>,
        got: Option<&[u8]>,
    ) -> Result<(), UpstreamError> {
        let Some(asked) = asked else { return Ok(()) };
        let no_alpn_http1 = got.is_none() && asked == b"http/1.1";
        if got == Some(asked) || no_alpn_http1 {
            return Ok(());
        }
        self.refuse_alpn(asked);
        self.metrics.upstream_error(UpstreamStage::Alpn);
        Err(UpstreamError::Alpn {
            addr: addr.to_string(),
            asked: String::from_utf8_lossy(asked).into_owned(),
            got: got
                .map(|g| String::from_utf8_lossy(g).into_owned())
                .unwrap_or_else(|| "no protocol".into()),
        })
    }

    fn refuse_alpn(&self, p: &[u8]) {
        let fresh = self
            .refused_alpn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p.to_vec());
        if fresh {
            tracing::warn!(
                upstream = %self.describe(),
                protocol = %String::from_utf8_lossy(p),
                "the upstream does not speak this protocol; clients will be offered the next one they support"
            );
        }
    }

    pub(super) fn config_for(
        &self,
        generation: &Generation,
        alpn: Option<&[u8]>,
        addr: &str,
    ) -> Result<Arc<ClientConfig>, UpstreamError> {
        let mut configs = generation.configs.lock().unwrap_or_else(|p| p.into_inner());
        let key = alpn.map(<[u8]>::to_vec);
        if let Some(c) = configs.get(&key) {
            return Ok(c.clone());
        }
        // Every protocol's config shares the first one's verifier and resolver: rustls resumes
        // a session only with the very ones that made it, and the store is shared.
        let mut config = match configs.values().next() {
            Some(first) => (**first).clone(),
            None => {
                let roots = self.roots.read().unwrap_or_else(|p| p.into_inner()).clone();
                let resolver = self.resolver.clone();
                crate::pki::tls::client_config(self.versions, roots, resolver, self.kx).map_err(
                    |e| UpstreamError::Tls {
                        addr: addr.to_string(),
                        source: e,
                    },
                )?
            }
        };
        config.alpn_protocols = key.iter().cloned().collect();
        config.resumption = Resumption::store(generation.store.clone());
        let config = Arc::new(config);
        configs.insert(key, config.clone());
        Ok(config)
    }
}
