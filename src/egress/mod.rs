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
pub mod error;
pub mod forward_proxy;
mod http_connect;
mod idna;
pub mod no_proxy;
pub mod route;
mod socks5;
mod tunnel;

pub use connector::EgressConnector;
pub use error::{CredentialProblem, EgressError, ProxyProblem, UrlProblem};
pub use forward_proxy::{authority, ForwardProxy, ProxyCredentials, ProxyScheme};
pub use no_proxy::NoProxy;
pub use route::Egress;
pub use tunnel::{connect_started, Tunnel};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

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
