//! Network endpoints as typed values: where a listener accepts connections ([`ListenAddr`]) and
//! the API server connections go to ([`UpstreamTarget`]).
//!
//! Below the proxy because the exec plugin (which starts a proxy for a kubeconfig's server),
//! the lifecycle and the CLI parse them too; one parser means one set of accepted forms.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::str::FromStr;

/// A listen address or upstream URL that does not parse.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum EndpointError {
    #[error("invalid listen address '{given}': {problem} (examples: unix:/run/hwkey/proxy.sock, tcp:127.0.0.1:6443)")]
    InvalidListen {
        given: String,
        #[source]
        problem: AddressProblem,
    },

    #[error("invalid upstream '{given}': {problem} (example: https://10.0.0.1:6443)")]
    InvalidUpstream {
        given: String,
        #[source]
        problem: AddressProblem,
    },
}

/// What is wrong with an address, for [`EndpointError`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum AddressProblem {
    #[error("the socket path is empty")]
    EmptySocketPath,
    #[error("not a HOST:PORT address ({0})")]
    NotHostPort(#[source] std::io::Error),
    #[error("the host name resolves to no address")]
    NoAddress,
    #[error("expected unix:PATH or tcp:HOST:PORT")]
    NoScheme,
    #[error("not a URL")]
    NotAUrl,
    #[error("the upstream must be an https:// URL")]
    NotHttps,
    #[error("a path is not supported: the proxy forwards whole connections")]
    HasPath,
    #[error("no host")]
    NoHost,
    #[error("port '{0}' is out of range: use 1-65535")]
    PortOutOfRange(String),
}

/// Where a listener (client, admin) accepts connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A UNIX socket at this path (created mode 0600, removed on exit).
    Unix(PathBuf),
    /// A TCP address; port 0 picks a free port (printed in the ready line).
    Tcp(SocketAddr),
}

impl ListenAddr {
    /// True for UNIX sockets and loopback TCP addresses.
    pub fn is_local(&self) -> bool {
        match self {
            ListenAddr::Unix(_) => true,
            ListenAddr::Tcp(a) => a.ip().is_loopback(),
        }
    }
}

impl FromStr for ListenAddr {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |problem| EndpointError::InvalidListen {
            given: s.to_string(),
            problem,
        };
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(invalid(AddressProblem::EmptySocketPath));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        if let Some(addr) = s.strip_prefix("tcp:") {
            // A name like localhost:8443 resolves once, here; the first address wins.
            let resolved = addr
                .to_socket_addrs()
                .map_err(|e| invalid(AddressProblem::NotHostPort(e)))?
                .next()
                .ok_or_else(|| invalid(AddressProblem::NoAddress))?;
            return Ok(ListenAddr::Tcp(resolved));
        }
        Err(invalid(AddressProblem::NoScheme))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// The API server the proxy re-originates connections to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTarget {
    /// Host as written in the URL (brackets removed from IPv6 literals).
    pub host: String,
    /// Port (443 when the URL names none).
    pub port: u16,
}

impl UpstreamTarget {
    /// `host:port` for messages and TCP connects (IPv6 in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for UpstreamTarget {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |problem| EndpointError::InvalidUpstream {
            given: s.to_string(),
            problem,
        };
        let uri: hyper::Uri = s.parse().map_err(|_| invalid(AddressProblem::NotAUrl))?;
        if uri.scheme_str() != Some("https") {
            return Err(invalid(AddressProblem::NotHttps));
        }
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(invalid(AddressProblem::HasPath));
        }
        let host = uri
            .host()
            .ok_or_else(|| invalid(AddressProblem::NoHost))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        // The port as written: hyper reads one that does not fit a u16 as "no port" (443).
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
        let after_host = authority
            .rsplit_once(']')
            .map_or(authority, |(_, rest)| rest);
        let port = match after_host.rsplit_once(':') {
            None => 443,
            Some((_, written)) => match written.parse::<u16>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return Err(invalid(AddressProblem::PortOutOfRange(
                        written.escape_debug().to_string(),
                    )))
                }
            },
        };
        Ok(UpstreamTarget { host, port })
    }
}

impl fmt::Display for UpstreamTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "https://{}", self.authority())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addrs() {
        assert_eq!(
            "unix:/run/x.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/run/x.sock".into())
        );
        let tcp: ListenAddr = "tcp:127.0.0.1:8443".parse().unwrap();
        assert!(tcp.is_local());
        let any: ListenAddr = "tcp:0.0.0.0:8443".parse().unwrap();
        assert!(!any.is_local());
        assert!("127.0.0.1:8443".parse::<ListenAddr>().is_err());
    }

    #[test]
    fn upstreams() {
        let u: UpstreamTarget = "https://[::1]:6443".parse().unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.authority(), "[::1]:6443");
        let d: UpstreamTarget = "https://api.example".parse().unwrap();
        assert_eq!(d.port, 443);
        assert!("http://x:1".parse::<UpstreamTarget>().is_err());
        assert!("https://x:1/api".parse::<UpstreamTarget>().is_err());
        // An out-of-range port is refused, never read as "no port" (443).
        for bad in [
            "https://127.0.0.1:99999",
            "https://127.0.0.1:0",
            "https://[::1]:65536",
        ] {
            let e = bad.parse::<UpstreamTarget>().expect_err(bad).to_string();
            assert!(
                e.contains("out of range") || e.contains("port 0"),
                "{bad}: {e}"
            );
        }
        let top: UpstreamTarget = "https://[::1]:65535".parse().unwrap();
        assert_eq!(top.port, 65535);
    }
}
