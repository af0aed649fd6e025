//! SOCKS5 (RFC 1928) CONNECT, with user/password authentication (RFC 1929) when there are
//! credentials. The API server's name goes to the proxy as a name (remote DNS, as Go's SOCKS5
//! dialer does), an IP literal as an address.

use std::net::IpAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use zeroize::Zeroizing;

use super::{authority, ForwardProxy, ProxyProblem};

const VERSION: u8 = 5;
const NO_AUTH: u8 = 0;
const USER_PASSWORD: u8 = 2;

/// Asks the SOCKS5 server (already connected on `stream`) for a connection to `host`:`port`.
pub(super) async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    proxy: &ForwardProxy,
    host: &str,
    port: u16,
) -> Result<(), ProxyProblem> {
    authenticate(stream, proxy).await?;
    request(stream, host, port).await
}

/// The method negotiation, and user/password authentication when the server picks it.
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    proxy: &ForwardProxy,
) -> Result<(), ProxyProblem> {
    let io = ProxyProblem::Io;
    // Offer user/password only when there are credentials, so a server that wants them says so.
    let (greeting, offered): (&[u8], &'static str) = match proxy.credentials {
        Some(_) => (&[VERSION, 2, NO_AUTH, USER_PASSWORD], "none, user/password"),
        None => (&[VERSION, 1, NO_AUTH], "none"),
    };
    stream.write_all(greeting).await.map_err(io)?;
    let mut choice = [0u8; 2];
    stream.read_exact(&mut choice).await.map_err(io)?;
    if choice[0] != VERSION {
        return Err(ProxyProblem::Protocol("it is not a SOCKS5 server"));
    }
    match (choice[1], &proxy.credentials) {
        (NO_AUTH, _) => {}
        (USER_PASSWORD, Some(c)) => {
            let (user, password) = (c.user.as_bytes(), c.password.as_bytes());
            let (Ok(ulen), Ok(plen)) = (u8::try_from(user.len()), u8::try_from(password.len()))
            else {
                return Err(ProxyProblem::Protocol(
                    "the user or password is longer than SOCKS5 allows (255 bytes)",
                ));
            };
            let mut auth = Zeroizing::new(Vec::with_capacity(3 + user.len() + password.len()));
            auth.push(1);
            auth.push(ulen);
            auth.extend_from_slice(user);
            auth.push(plen);
            auth.extend_from_slice(password);
            stream.write_all(&auth).await.map_err(io)?;
            let mut status = [0u8; 2];
            stream.read_exact(&mut status).await.map_err(io)?;
            if status[1] != 0 {
                return Err(ProxyProblem::SocksAuth);
            }
        }
        _ => return Err(ProxyProblem::SocksMethods { offered }),
    }
    Ok(())
}

/// CONNECT to `host`:`port` and its reply.
async fn request<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    host: &str,
    port: u16,
) -> Result<(), ProxyProblem> {
    let io = ProxyProblem::Io;
    let mut request = vec![VERSION, 1, 0];
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => {
            request.push(1);
            request.extend_from_slice(&ip.octets());
        }
        Ok(IpAddr::V6(ip)) => {
            request.push(4);
            request.extend_from_slice(&ip.octets());
        }
        Err(_) => {
            let name = host.as_bytes();
            let len = u8::try_from(name.len())
                .map_err(|_| ProxyProblem::Protocol("the API server's name is over 255 bytes"))?;
            request.push(3);
            request.push(len);
            request.extend_from_slice(name);
        }
    }
    request.extend_from_slice(&port.to_be_bytes());
    stream.write_all(&request).await.map_err(io)?;
    let mut reply = [0u8; 4];
    stream.read_exact(&mut reply).await.map_err(io)?;
    if reply[0] != VERSION {
        return Err(ProxyProblem::Protocol("its reply is not SOCKS5"));
    }
    if reply[1] != 0 {
        return Err(ProxyProblem::SocksRefused {
            code: reply[1],
            target: authority(host, port),
        });
    }
    // The bound address, which nothing here needs: read past it.
    let rest = match reply[3] {
        1 => 4 + 2,
        4 => 16 + 2,
        3 => {
            let mut len = [0u8; 1];
            stream.read_exact(&mut len).await.map_err(io)?;
            usize::from(len[0]) + 2
        }
        _ => {
            return Err(ProxyProblem::Protocol(
                "its reply has an unknown address type",
            ))
        }
    };
    let mut skip = vec![0u8; rest];
    stream.read_exact(&mut skip).await.map_err(io)?;
    Ok(())
}
