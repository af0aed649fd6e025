//! Accepting a client's connection without registering it with the accepting runtime.
//!
//! tokio's listeners register every socket they accept with the runtime that accepted it. The
//! proxy hands each one at once to a connection thread ([`super::threads`]), so that
//! registration was undone in the same breath: two `epoll_ctl` calls per connection on the
//! accept thread, for nothing. Here the listeners are waited on through [`AsyncFd`], and the
//! accept is a plain `accept4` with `SOCK_NONBLOCK | SOCK_CLOEXEC`: the socket comes out
//! non-blocking and unregistered, and the connection thread registers it where it is used, if
//! ever ([`super::unix_client`]).

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::task::{ready, Context, Poll};

use rustix::net::SocketFlags;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::bind::{Socket, StdBound};
use super::error::StartError;

/// A client listener, waited on by the accept loop's runtime.
pub type ClientBound = Socket<AsyncFd<UnixListener>, AsyncFd<TcpListener>>;

/// What one accept produced: a socket that is non-blocking and registered nowhere.
pub enum Accepted {
    /// A UNIX-socket client.
    Unix(io::Result<UnixStream>),
    /// A loopback TCP client, with its address.
    Tcp(io::Result<(TcpStream, SocketAddr)>),
}

impl StdBound {
    /// The listener for the accept loop, in the runtime this is called in.
    pub fn into_accepting(self) -> Result<ClientBound, StartError> {
        self.nonblocking_into(register, |listener| {
            // Inherited by every socket accepted from it (Linux copies it): small writes (a
            // handshake flight, a response) go out at once, without a call per socket.
            rustix::net::sockopt::set_tcp_nodelay(&listener, true)?;
            register(listener)
        })
    }
}

/// Registers a listener with the current runtime, for reading.
#[allow(unsafe_code)]
fn register<L: std::os::fd::AsRawFd>(listener: L) -> io::Result<AsyncFd<L>> {
    // SAFETY: `register_with_interest` asks that the descriptor stay open and the same while
    // registered. The listener owns its descriptor and closes it only when dropped, and the
    // `AsyncFd` owns the listener (dropped with it, never taken back or replaced).
    Ok(unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }?)
}

/// Polls every listener, starting at `first` so that a busy listener cannot starve the others.
pub fn poll_any(
    listeners: &[ClientBound],
    first: usize,
    cx: &mut Context<'_>,
) -> Poll<(usize, Accepted)> {
    let n = listeners.len();
    for k in 0..n {
        let i = (first + k) % n;
        match &listeners[i] {
            Socket::Unix { listener, .. } => {
                if let Poll::Ready(r) = poll_accept(listener, cx, accept_unix) {
                    return Poll::Ready((i, Accepted::Unix(r)));
                }
            }
            Socket::Tcp { listener, .. } => {
                if let Poll::Ready(r) = poll_accept(listener, cx, accept_tcp) {
                    return Poll::Ready((i, Accepted::Tcp(r)));
                }
            }
        }
    }
    Poll::Pending
}

/// One accept on `listener` once it is readable; its readiness is cleared when the queue is
/// empty, and a signal's interruption is retried.
fn poll_accept<L, S>(
    listener: &AsyncFd<L>,
    cx: &mut Context<'_>,
    accept: fn(&L) -> io::Result<S>,
) -> Poll<io::Result<S>>
where
    L: std::os::fd::AsRawFd,
{
    loop {
        let mut guard = ready!(listener.poll_read_ready(cx))?;
        match guard.try_io(|l| accept(l.get_ref())) {
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
            Ok(r) => return Poll::Ready(r),
            Err(_would_block) => continue,
        }
    }
}

const FLAGS: SocketFlags = SocketFlags::NONBLOCK.union(SocketFlags::CLOEXEC);

fn accept_unix(listener: &UnixListener) -> io::Result<UnixStream> {
    Ok(UnixStream::from(rustix::net::accept_with(listener, FLAGS)?))
}

fn accept_tcp(listener: &TcpListener) -> io::Result<(TcpStream, SocketAddr)> {
    let (fd, peer) = rustix::net::acceptfrom_with(listener, FLAGS)?;
    let peer = peer
        .and_then(|a| SocketAddr::try_from(a).ok())
        .ok_or_else(|| io::Error::other("an accepted TCP connection has no peer address"))?;
    Ok((TcpStream::from(fd), peer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// What the connection thread is given: a socket that is already non-blocking (so it needs
    /// no `ioctl` of its own) and closed on exec, from both kinds of listener, with the TCP
    /// peer's real address and `TCP_NODELAY` (so it needs no `setsockopt` of its own).
    #[tokio::test]
    async fn accepted_sockets_are_non_blocking_and_carry_their_peer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let unix = StdBound::Unix {
            listener: UnixListener::bind(&path).unwrap(),
            path: path.clone(),
        };
        let tcp_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp_listener.local_addr().unwrap();
        let tcp = StdBound::Tcp {
            listener: tcp_listener,
            addr,
        };
        let listeners = vec![
            unix.into_accepting().unwrap(),
            tcp.into_accepting().unwrap(),
        ];
        let mut unix_peer = std::os::unix::net::UnixStream::connect(&path).unwrap();
        let tcp_peer = std::net::TcpStream::connect(addr).unwrap();
        let mut got = Vec::new();
        for first in 0..2 {
            got.push(std::future::poll_fn(|cx| poll_any(&listeners, first, cx)).await);
        }
        for (_, accepted) in got {
            let fd = match accepted {
                Accepted::Unix(s) => {
                    let mut s = s.unwrap();
                    let mut b = [0u8; 1];
                    let e = s.read(&mut b).unwrap_err();
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "non-blocking");
                    unix_peer.write_all(b"x").unwrap();
                    s.read_exact(&mut b).unwrap();
                    std::os::fd::OwnedFd::from(s)
                }
                Accepted::Tcp(r) => {
                    let (s, peer) = r.unwrap();
                    assert_eq!(peer, tcp_peer.local_addr().unwrap());
                    assert!(s.nodelay().unwrap(), "TCP_NODELAY, from the listener");
                    let mut b = [0u8; 1];
                    let e = (&s).read(&mut b).unwrap_err();
                    assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "non-blocking");
                    std::os::fd::OwnedFd::from(s)
                }
            };
            let fd_flags = rustix::io::fcntl_getfd(&fd).unwrap();
            assert!(fd_flags.contains(rustix::io::FdFlags::CLOEXEC));
        }
    }
}
