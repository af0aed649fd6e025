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
//! Threads: `connect` runs on the connection's task. The hardware signature of a full
//! handshake happens inside rustls on that task's worker thread, under `block_in_place` (see
//! [`crate::key::tls`]), so other connections keep moving on the remaining workers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use rustls::client::Resumption;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, HandshakeKind, RootCertStore};
use tokio_rustls::client::TlsStream;

use super::config::UpstreamTarget;
use super::metrics::{Metrics, UpstreamStage};
use super::readahead::ReadAhead;
use super::sessions::{SessionStore, Warmup};
use super::ProxyError;
use crate::egress::{Egress, EgressError, Tunnel};
use crate::key::tls::HardwareCertResolver;
use crate::pki::tls::KeyExchange;

/// The application protocols the proxy bridges (what kubectl, client-go and kubelet speak).
pub const SERVED_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// How many servers' sessions the store remembers (there is one upstream; headroom for
/// name changes across reloads is all that is needed).
const SESSION_STORE_SERVERS: usize = 32;

/// An established upstream connection.
pub struct UpstreamConn {
    /// The TLS stream to the API server (its socket read in large reads). Boxed: the
    /// connection's task moves it a few times on its way to the relay, and each move of a
    /// 1 KiB value would otherwise keep its own slot in the task's state for the connection's
    /// whole life (issue 12, memory per idle connection).
    pub stream: Box<TlsStream<ReadAhead<Tunnel>>>,
    /// The protocol the upstream agreed to (None: no ALPN).
    pub alpn: Option<Vec<u8>>,
    /// Whether the handshake resumed a session (no signature made).
    pub resumed: bool,
}

/// One generation of client configs sharing a session store.
struct Generation {
    configs: Mutex<HashMap<Option<Vec<u8>>, Arc<ClientConfig>>>,
    store: Arc<SessionStore>,
}

/// The upstream connector, shared by all connection tasks.
pub struct Upstream {
    target: UpstreamTarget,
    egress: Egress,
    kx: KeyExchange,
    server_name: ServerName<'static>,
    resolver: Arc<HardwareCertResolver>,
    roots: RwLock<Arc<RootCertStore>>,
    versions: &'static [&'static rustls::SupportedProtocolVersion],
    generation: RwLock<Arc<Generation>>,
    refused_alpn: Mutex<HashSet<Vec<u8>>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("target", &self.target)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// Where the upstream is and how connections get there.
#[derive(Debug, Clone)]
pub struct Route {
    /// The API server's address.
    pub target: UpstreamTarget,
    /// Straight, or through a forward proxy.
    pub egress: Egress,
    /// The TLS 1.3 key exchange offered.
    pub key_exchange: KeyExchange,
}

impl Upstream {
    /// A connector along `route`, verifying the API server's certificate against `roots`
    /// under `server_name` (default: the target's host).
    pub fn new(
        route: Route,
        server_name: Option<&str>,
        resolver: Arc<HardwareCertResolver>,
        roots: RootCertStore,
        versions: &'static [&'static rustls::SupportedProtocolVersion],
        metrics: Arc<Metrics>,
    ) -> Result<Upstream, ProxyError> {
        let Route {
            target,
            egress,
            key_exchange: kx,
        } = route;
        let name = server_name.unwrap_or(&target.host).to_string();
        let server_name =
            ServerName::try_from(name.clone()).map_err(|_| ProxyError::InvalidServerName {
                given: name.clone(),
            })?;
        Ok(Upstream {
            target,
            egress,
            kx,
            server_name,
            resolver,
            roots: RwLock::new(Arc::new(roots)),
            versions,
            generation: RwLock::new(Arc::new(new_generation())),
            refused_alpn: Mutex::new(HashSet::new()),
            metrics,
        })
    }

    /// The API server's address.
    pub fn target(&self) -> &UpstreamTarget {
        &self.target
    }

    /// How connections reach the API server (the renewal's client goes the same way).
    pub fn egress(&self) -> &Egress {
        &self.egress
    }

    /// Opens a stream to the API server: straight, or through the forward proxy.
    pub async fn dial(&self) -> Result<Tunnel, ProxyError> {
        let addr = self.target.authority();
        match self.egress.dial(&self.target.host, self.target.port).await {
            Ok(t) => Ok(t),
            Err(EgressError::Direct { source, .. }) => {
                Err(ProxyError::UpstreamConnect { addr, source })
            }
            Err(source) => Err(ProxyError::UpstreamVia { addr, source }),
        }
    }

    /// The resolver holding the hardware key and its current chain.
    pub fn resolver(&self) -> &Arc<HardwareCertResolver> {
        &self.resolver
    }

    /// Forgets all resumable sessions: the next connection makes a full handshake (and
    /// presents the current certificate). Connections already open are not touched.
    pub fn reset_sessions(&self) {
        *self.generation.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new_generation());
    }

    /// Trusts `roots` for the API server from now on (a CA rotation): new connections verify
    /// against them, so the resumable sessions (verified under the old trust) are dropped.
    /// Connections already open are not touched.
    pub fn set_roots(&self, roots: RootCertStore) {
        *self.roots.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(roots);
        self.reset_sessions();
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

    /// Opens a TCP connection and completes the TLS handshake offering exactly `alpn`.
    /// The caller applies the handshake timeout.
    pub async fn connect(&self, alpn: Option<&[u8]>) -> Result<UpstreamConn, ProxyError> {
        let addr = self.target.authority();
        let tcp = match self.dial().await {
            Ok(t) => t,
            Err(e) => {
                self.metrics.upstream_error(UpstreamStage::Connect);
                return Err(e);
            }
        };
        let generation = self.current_generation();
        let config = self.config_for(&generation, alpn)?;
        // A cold store: one connection warms it, the others wait for its ticket (sessions.rs).
        let warmup = generation.store.warm_up().await;
        let started = Instant::now();
        let stream = match tokio_rustls::TlsConnector::from(config)
            .connect(self.server_name.clone(), ReadAhead::new(tcp))
            .await
        {
            Ok(s) => {
                if let Warmup::Leader(guard) = warmup {
                    guard.succeeded();
                }
                s
            }
            Err(source) => {
                let text = crate::error_chain::error_chain(&source);
                if let (Some(p), true) = (alpn, text.contains("NoApplicationProtocol")) {
                    self.refuse_alpn(p);
                    self.metrics.upstream_error(UpstreamStage::Alpn);
                    return Err(ProxyError::UpstreamAlpn {
                        addr,
                        asked: String::from_utf8_lossy(p).into_owned(),
                        got: "a no_application_protocol alert".into(),
                    });
                }
                self.metrics.upstream_error(UpstreamStage::Handshake);
                return Err(ProxyError::UpstreamHandshake { addr, source });
            }
        };
        let took = started.elapsed();
        let (_, conn) = stream.get_ref();
        let resumed = conn.handshake_kind() == Some(HandshakeKind::Resumed);
        self.metrics.upstream_handshake(resumed, took);
        let got = conn.alpn_protocol().map(<[u8]>::to_vec);
        if let Some(asked) = alpn {
            // RFC 7301: a server that answers without any protocol simply does not do ALPN,
            // and such servers (older ones, some load balancers) speak HTTP/1.1. An h2 client
            // still gets the clean failure below and HTTP/1.1 on its next connection.
            let no_alpn_http1 = got.is_none() && asked == b"http/1.1";
            if got.as_deref() != Some(asked) && !no_alpn_http1 {
                self.refuse_alpn(asked);
                self.metrics.upstream_error(UpstreamStage::Alpn);
                return Err(ProxyError::UpstreamAlpn {
                    addr,
                    asked: String::from_utf8_lossy(asked).into_owned(),
                    got: got
                        .map(|g| String::from_utf8_lossy(&g).into_owned())
                        .unwrap_or_else(|| "no protocol".into()),
                });
            }
        }
        tracing::debug!(
            upstream = %addr,
            resumed,
            group = %crate::pki::tls::group_name(conn),
            retry = conn.handshake_kind() == Some(HandshakeKind::FullWithHelloRetryRequest),
            ms = took.as_millis() as u64,
            "upstream handshake done"
        );
        Ok(UpstreamConn {
            stream: Box::new(stream),
            alpn: got,
            resumed,
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
                upstream = %self.target,
                protocol = %String::from_utf8_lossy(p),
                "the upstream does not speak this protocol; clients will be offered the next one they support"
            );
        }
    }

    fn current_generation(&self) -> Arc<Generation> {
        self.generation
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn config_for(
        &self,
        generation: &Generation,
        alpn: Option<&[u8]>,
    ) -> Result<Arc<ClientConfig>, ProxyError> {
        let mut configs = generation.configs.lock().unwrap_or_else(|p| p.into_inner());
        let key = alpn.map(<[u8]>::to_vec);
        if let Some(c) = configs.get(&key) {
            return Ok(c.clone());
        }
        let roots = self.roots.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut config =
            crate::pki::tls::client_config(self.versions, roots, self.resolver.clone(), self.kx)
                .map_err(|e| ProxyError::UpstreamTls {
                    addr: self.target.authority(),
                    source: e,
                })?;
        config.alpn_protocols = key.iter().cloned().collect();
        config.resumption = Resumption::store(generation.store.clone());
        let config = Arc::new(config);
        configs.insert(key, config.clone());
        Ok(config)
    }
}

fn new_generation() -> Generation {
    Generation {
        configs: Mutex::new(HashMap::new()),
        store: Arc::new(SessionStore::new(SESSION_STORE_SERVERS)),
    }
}
