//! How connections to the API server leave this host: straight, or through the explicit
//! proxy, or through the environment's proxy unless `NO_PROXY` excludes the host.

use std::sync::Arc;

use super::error::EgressError;
use super::forward_proxy::{ForwardProxy, ProxyCredentials};
use super::no_proxy::{self, NoProxy};
use super::tunnel::{self, Tunnel};
use crate::endpoint::UpstreamTarget;

/// How connections to the API server leave this host.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    /// A proxy for every connection (the cluster's `proxy-url`, or a flag).
    pub(super) explicit: Option<Arc<ForwardProxy>>,
    /// The environment's proxy, for hosts `no_proxy` does not exclude.
    pub(super) env: Option<Arc<ForwardProxy>>,
    /// The hosts the environment's proxy is not used for.
    pub(super) no_proxy: NoProxy,
}

impl Egress {
    /// Straight to the API server.
    pub fn direct() -> Egress {
        Egress::default()
    }

    /// Through `proxy` for every host (a cluster's `proxy-url`: client-go proxies even
    /// loopback then).
    pub fn through(proxy: ForwardProxy) -> Egress {
        Egress {
            explicit: Some(Arc::new(proxy)),
            ..Egress::default()
        }
    }

    /// The environment's choice, as Go's `http.ProxyFromEnvironment` for an `https://` URL:
    /// `HTTPS_PROXY` (or `https_proxy`), a bare `host:port` taken as `http://`, except for the
    /// hosts `NO_PROXY` (or `no_proxy`) excludes and for localhost/loopback.
    pub fn from_env() -> Result<Egress, EgressError> {
        Egress::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`Egress::from_env`] with the variables from `lookup`: the differential test against
    /// Go asks thousands of environments in one process this way.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Egress, EgressError> {
        let var = |upper: &str, lower: &str| {
            lookup(upper)
                .filter(|v| !v.is_empty())
                .or_else(|| lookup(lower).filter(|v| !v.is_empty()))
        };
        let env = match var("HTTPS_PROXY", "https_proxy") {
            None => None,
            Some(v) => {
                let url = if v.contains("://") {
                    v
                } else {
                    format!("http://{v}")
                };
                Some(Arc::new(ForwardProxy::parse(&url).map_err(|e| {
                    EgressError::InEnvironment {
                        var: "HTTPS_PROXY",
                        source: Box::new(e),
                    }
                })?))
            }
        };
        Ok(Egress {
            explicit: None,
            env,
            no_proxy: NoProxy::parse(&var("NO_PROXY", "no_proxy").unwrap_or_default()),
        })
    }

    /// An explicit proxy if there is one, else the environment's (client-go's order).
    pub fn explicit_or_env(proxy: Option<ForwardProxy>) -> Result<Egress, EgressError> {
        match proxy {
            Some(p) => Ok(Egress::through(p)),
            None => Egress::from_env(),
        }
    }

    /// Uses `credentials` for the proxy (they replace any from its URL).
    pub fn with_credentials(mut self, credentials: ProxyCredentials) -> Egress {
        for p in [&mut self.explicit, &mut self.env].into_iter().flatten() {
            let mut proxy = (**p).clone();
            proxy.credentials = Some(credentials.clone());
            *p = Arc::new(proxy);
        }
        self
    }

    /// How connections to each of `targets` leave, in words without credentials:
    /// `HOST:PORT direct` or `HOST:PORT through URL`, comma-separated. The exec plugin compares
    /// a running proxy's with its own before reusing that proxy: a proxy started from another
    /// shell's environment (HTTPS_PROXY, NO_PROXY) must not carry this one's traffic another
    /// way, while a difference that changes no route (a loopback API server) is no reason to
    /// refuse it.
    pub fn routes<'a>(&self, targets: impl Iterator<Item = &'a UpstreamTarget>) -> String {
        targets
            .map(|t| match self.proxy_for(&t.host, t.port) {
                Some(p) => format!("{} through {p}", t.authority()),
                None => format!("{} direct", t.authority()),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The proxy a connection to `host`:`port` goes through, if any.
    pub fn proxy_for(&self, host: &str, port: u16) -> Option<&ForwardProxy> {
        if let Some(p) = &self.explicit {
            return Some(p);
        }
        let p = self.env.as_ref()?;
        if no_proxy::is_local(host) || self.no_proxy.excludes(host, port) {
            return None;
        }
        Some(p)
    }

    /// Opens a stream to `host`:`port`, through the proxy [`Egress::proxy_for`] names.
    pub async fn dial(&self, host: &str, port: u16) -> Result<Tunnel, EgressError> {
        match self.proxy_for(host, port) {
            None => Tunnel::direct(host, port).await,
            Some(proxy) => tunnel::through(proxy, host, port).await,
        }
    }
}
