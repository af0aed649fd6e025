//! The way out to the API server: directly, or through the forward proxy a user sits behind
//! (an HTTP CONNECT proxy, `http://` or `https://`, or SOCKS5), chosen as client-go chooses:
//! the cluster's `proxy-url` first, else `HTTPS_PROXY`/`https_proxy` unless `NO_PROXY`/
//! `no_proxy` excludes the host (see [`no_proxy`]).
//!
//! The proxy's credentials (Basic for CONNECT, RFC 1929 user/password for SOCKS5) come from the
//! URL's userinfo where the URL sits in a file or the environment, or from a file or an
//! environment variable of their own (`user:password`); never from argv. They are never
//! printed: a proxy is always shown as `scheme://host:port`.
//!
//! Every tunnel is set up before the API server's TLS handshake starts, so the hardware key
//! never signs anything for a proxy; the API server's certificate is verified end to end
//! through the tunnel as without one.

pub mod connector;
mod http_connect;
pub mod no_proxy;
mod socks5;
mod tunnel;

use std::fmt;
use std::sync::Arc;

use percent_encoding::percent_decode_str;
use zeroize::Zeroizing;

pub use connector::EgressConnector;
pub use no_proxy::NoProxy;
pub use tunnel::Tunnel;

use crate::key::pin::PinSource;

/// The protocol spoken to a forward proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyScheme {
    /// HTTP CONNECT over plain TCP.
    Http,
    /// HTTP CONNECT inside TLS to the proxy.
    Https,
    /// SOCKS5; the API server's name is resolved by the proxy (remote DNS), as Go does.
    Socks5,
}

/// A proxy's user and password.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyCredentials {
    /// The user name.
    pub user: String,
    /// The password; wiped when dropped.
    pub password: Zeroizing<String>,
}

impl fmt::Debug for ProxyCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProxyCredentials({}, <redacted>)", self.user)
    }
}

impl ProxyCredentials {
    /// Parses a credentials source: `file:PATH` (or an absolute path) or `env:VAR`.
    pub fn source(text: &str) -> Result<PinSource, EgressError> {
        PinSource::parse(text).ok_or_else(|| EgressError::Credentials {
            problem: CredentialProblem::Source(text.to_string()),
        })
    }

    /// Reads `user:password` (one line) from a file or an environment variable.
    pub fn read(source: &PinSource) -> Result<ProxyCredentials, EgressError> {
        let text = source.read().map_err(|e| EgressError::Credentials {
            problem: CredentialProblem::Unreadable(e.to_string()),
        })?;
        let (user, password) = text.split_once(':').ok_or(EgressError::Credentials {
            problem: CredentialProblem::NoColon,
        })?;
        Ok(ProxyCredentials {
            user: user.to_string(),
            password: Zeroizing::new(password.to_string()),
        })
    }
}

/// A forward proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct ForwardProxy {
    /// How to talk to it.
    pub scheme: ProxyScheme,
    /// Its host (an IPv6 literal without brackets).
    pub host: String,
    /// Its port (default 80, 443 or 1080 by scheme).
    pub port: u16,
    /// Its credentials, if it wants them.
    pub credentials: Option<ProxyCredentials>,
}

impl fmt::Display for ForwardProxy {
    /// `scheme://host:port`, never the credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            ProxyScheme::Http => "http",
            ProxyScheme::Https => "https",
            ProxyScheme::Socks5 => "socks5",
        };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Debug for ForwardProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ForwardProxy({self}, credentials: {})",
            self.credentials.is_some()
        )
    }
}

/// What is wrong with a proxy URL, for [`EgressError::InvalidProxyUrl`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum UrlProblem {
    #[error("it must start with http://, https://, socks5:// or socks5h://")]
    Scheme,
    #[error("it names no host")]
    NoHost,
    #[error("its port is not a number from 1 to 65535")]
    Port,
    #[error(
        "it has a path, query or fragment; a proxy URL is scheme://[user:password@]host[:port]"
    )]
    Path,
    #[error("its user or password is not valid percent-encoded UTF-8")]
    Userinfo,
    #[error("it holds a user and password, which a command line shows to every user of the machine (`ps`): put them in a file and name it with the proxy-auth setting (file:PATH or env:VAR holding user:password)")]
    CredentialsOnCommandLine,
}

impl ForwardProxy {
    /// Parses `scheme://[user[:password]@]host[:port][/]`. The scheme is required (Go's
    /// environment reading assumes `http://` for a bare host; so does this for `HTTPS_PROXY`,
    /// see [`Egress::from_env`]).
    pub fn parse(url: &str) -> Result<ForwardProxy, EgressError> {
        let fail = |problem| EgressError::InvalidProxyUrl { problem };
        let (scheme, rest) = url
            .trim()
            .split_once("://")
            .ok_or(fail(UrlProblem::Scheme))?;
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "http" => ProxyScheme::Http,
            "https" => ProxyScheme::Https,
            "socks5" | "socks5h" => ProxyScheme::Socks5,
            _ => return Err(fail(UrlProblem::Scheme)),
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains(['/', '?', '#']) {
            return Err(fail(UrlProblem::Path));
        }
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (host, port) = split_host_port(hostport).ok_or(fail(UrlProblem::Port))?;
        if host.is_empty() {
            return Err(fail(UrlProblem::NoHost));
        }
        let port = match port {
            Some(p) => p,
            None => match scheme {
                ProxyScheme::Http => 80,
                ProxyScheme::Https => 443,
                ProxyScheme::Socks5 => 1080,
            },
        };
        let credentials = match userinfo {
            None => None,
            Some(u) => {
                let decode = |s: &str| {
                    percent_decode_str(s)
                        .decode_utf8()
                        .map(|c| c.into_owned())
                        .map_err(|_| fail(UrlProblem::Userinfo))
                };
                let (user, password) = u.split_once(':').unwrap_or((u, ""));
                Some(ProxyCredentials {
                    user: decode(user)?,
                    password: Zeroizing::new(decode(password)?),
                })
            }
        };
        Ok(ForwardProxy {
            scheme,
            host: host.to_ascii_lowercase(),
            port,
            credentials,
        })
    }

    /// Like [`ForwardProxy::parse`], for a URL given on the command line: credentials in it
    /// are refused (they would show in `ps`).
    pub fn parse_argv(url: &str) -> Result<ForwardProxy, EgressError> {
        let proxy = ForwardProxy::parse(url)?;
        if proxy.credentials.is_some() {
            return Err(EgressError::InvalidProxyUrl {
                problem: UrlProblem::CredentialsOnCommandLine,
            });
        }
        Ok(proxy)
    }
}

/// `host[:port]` or `[v6][:port]` → (host, port).
fn split_host_port(s: &str) -> Option<(&str, Option<u16>)> {
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p != 0);
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        return match tail.strip_prefix(':') {
            Some(p) => Some((host, Some(port(p)?))),
            None if tail.is_empty() => Some((host, None)),
            None => None,
        };
    }
    match s.rsplit_once(':') {
        Some((host, p)) => Some((host, Some(port(p)?))),
        None => Some((s, None)),
    }
}

/// How connections to the API server leave this host.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    /// A proxy for every connection (the cluster's `proxy-url`, or a flag).
    explicit: Option<Arc<ForwardProxy>>,
    /// The environment's proxy, for hosts `no_proxy` does not exclude.
    env: Option<Arc<ForwardProxy>>,
    no_proxy: NoProxy,
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
        let var = |upper: &str, lower: &str| {
            std::env::var(upper)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| std::env::var(lower).ok().filter(|v| !v.is_empty()))
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

/// What was wrong with the proxy's credentials, for [`EgressError::Credentials`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CredentialProblem {
    #[error("{0}")]
    Unreadable(String),
    #[error("'{0}' is not file:/absolute/path or env:VAR")]
    Source(String),
    #[error("it must hold user:password")]
    NoColon,
}

/// What a forward proxy did, for [`EgressError::Proxy`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ProxyProblem {
    #[error("cannot connect to it: {0}")]
    Connect(#[source] std::io::Error),
    #[error("the TLS handshake with it failed: {0}")]
    Tls(#[source] std::io::Error),
    #[error("it answered {status} {reason} to CONNECT {target}{}", status_hint(*.status, *.sent_credentials))]
    Status {
        status: u16,
        reason: String,
        target: String,
        sent_credentials: bool,
    },
    #[error("its SOCKS5 server refused CONNECT {target}: {}", socks_reply(*.code))]
    SocksRefused { code: u8, target: String },
    #[error("it accepts none of the SOCKS5 authentication methods offered ({offered}){}", if *.offered == "none" { ": it wants a user and password (the proxy-auth setting)" } else { "" })]
    SocksMethods { offered: &'static str },
    #[error("it refused the user and password (SOCKS5 user/password authentication): check the proxy-auth setting")]
    SocksAuth,
    #[error("it broke the protocol: {0}")]
    Protocol(&'static str),
    #[error("the connection to it failed: {0}")]
    Io(#[source] std::io::Error),
}

fn status_hint(status: u16, sent_credentials: bool) -> &'static str {
    match (status, sent_credentials) {
        (407, false) => " (Proxy Authentication Required: give the proxy's user and password with the proxy-auth setting, file:PATH or env:VAR holding user:password)",
        (407, true) => " (Proxy Authentication Required: it refused the user and password given: check them)",
        (403, _) => " (its rules forbid this destination)",
        (502..=504, _) => " (it could not reach the API server)",
        _ => "",
    }
}

fn socks_reply(code: u8) -> &'static str {
    match code {
        1 => "general failure",
        2 => "not allowed by its rules",
        3 => "network unreachable",
        4 => "host unreachable",
        5 => "connection refused by the API server's host",
        6 => "TTL expired",
        7 => "command not supported",
        8 => "address type not supported",
        _ => "an unknown reply code",
    }
}

/// Errors of the way out.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum EgressError {
    #[error("invalid forward proxy URL: {problem}")]
    InvalidProxyUrl { problem: UrlProblem },
    #[error("{var}: {source}")]
    InEnvironment {
        var: &'static str,
        #[source]
        source: Box<EgressError>,
    },
    #[error("the forward proxy's credentials: {problem}")]
    Credentials { problem: CredentialProblem },
    #[error("cannot connect to {addr}: {source}")]
    Direct {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("forward proxy {proxy}: {problem}")]
    Proxy {
        proxy: String,
        #[source]
        problem: ProxyProblem,
    },
}

impl EgressError {
    /// Whether the proxy (not the API server) is what failed.
    pub fn via_proxy(&self) -> bool {
        matches!(self, EgressError::Proxy { .. })
    }
}

/// `host:port`, with brackets around an IPv6 literal: what CONNECT and error messages name.
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_urls_parse_and_never_print_credentials() {
        let p = ForwardProxy::parse("http://al%40ice:p%3Ass@Proxy.Example:3128/").expect("url");
        assert_eq!(
            (p.scheme, p.host.as_str(), p.port),
            (ProxyScheme::Http, "proxy.example", 3128)
        );
        let c = p.credentials.clone().expect("credentials");
        assert_eq!((c.user.as_str(), c.password.as_str()), ("al@ice", "p:ss"));
        assert_eq!(p.to_string(), "http://proxy.example:3128");
        assert!(!format!("{p:?}").contains("p:ss"));
        assert_eq!(ForwardProxy::parse("https://[::1]").expect("v6").port, 443);
        assert_eq!(
            ForwardProxy::parse("socks5h://s").expect("socks").port,
            1080
        );
        for bad in [
            "proxy:3128",
            "ftp://p",
            "http://",
            "http://p:0",
            "http://p:x",
            "http://p/x",
        ] {
            assert!(ForwardProxy::parse(bad).is_err(), "{bad}");
        }
        let argv = ForwardProxy::parse_argv("http://u:p@proxy:1").expect_err("refused");
        assert!(argv.to_string().contains("ps"), "{argv}");
    }

    #[test]
    fn an_explicit_proxy_takes_everything_and_the_environment_skips_local_and_no_proxy() {
        let p = ForwardProxy::parse("http://proxy:3128").expect("url");
        let e = Egress::through(p.clone());
        assert!(e.proxy_for("127.0.0.1", 6443).is_some());
        let env = Egress {
            explicit: None,
            env: Some(Arc::new(p)),
            no_proxy: NoProxy::parse(".internal"),
        };
        assert!(env.proxy_for("127.0.0.1", 6443).is_none());
        assert!(env.proxy_for("localhost", 6443).is_none());
        assert!(env.proxy_for("api.internal", 6443).is_none());
        assert!(env.proxy_for("api.example", 6443).is_some());
        assert!(Egress::direct().proxy_for("api.example", 6443).is_none());
    }
}
