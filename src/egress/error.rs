//! The errors of the way out: what was wrong with a proxy's URL or credentials, and what a
//! forward proxy did.

/// What was wrong with the proxy's credentials, for [`EgressError::Credentials`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum CredentialProblem {
    #[error("{0}")]
    Unreadable(String),
    /// Why the text is not a source, in words that never repeat it (see `PinSource::why_not`).
    #[error("{0}")]
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
