//! A forward proxy as the user names it: its scheme, address and credentials, parsed once and
//! never printed with the credentials.

use std::fmt;

use percent_encoding::percent_decode_str;
use zeroize::Zeroizing;

use super::error::{CredentialProblem, EgressError, UrlProblem};
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
            problem: CredentialProblem::Source(PinSource::why_not(text)),
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

/// `host:port`, with brackets around an IPv6 literal: what CONNECT and error messages name.
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
