//! Binding the proxy's sockets before any thread exists: the sandbox ([`super::sandbox`]) is
//! set up on the main thread after binding and before the runtimes start, so the listeners are
//! bound as std sockets here and handed to the runtime later ([`StdBound::into_tokio`]).

use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::error::StartError;
use crate::endpoint::ListenAddr;

/// A bound listener of either kind, before or after it is handed to the runtime: one enum for
/// every listener kind, so a new kind is one arm here and its accept.
#[derive(Debug)]
pub enum Socket<U, T> {
    /// A UNIX socket (removed on exit).
    Unix {
        /// The bound socket.
        listener: U,
        /// Its path.
        path: PathBuf,
    },
    /// A TCP socket (loopback TLS).
    Tcp {
        /// The bound socket.
        listener: T,
        /// The address it got (port 0 resolved).
        addr: SocketAddr,
    },
}

/// A listener bound outside any runtime.
pub type StdBound = Socket<std::os::unix::net::UnixListener, std::net::TcpListener>;

/// A bound listener in the runtime, not yet accepting.
pub type Bound = Socket<tokio::net::UnixListener, tokio::net::TcpListener>;

impl<U, T> Socket<U, T> {
    /// What it listens on, with the real port when port 0 was asked for.
    pub fn addr(&self) -> ListenAddr {
        match self {
            Socket::Unix { path, .. } => ListenAddr::Unix(path.clone()),
            Socket::Tcp { addr, .. } => ListenAddr::Tcp(*addr),
        }
    }

    /// The socket file to remove at exit, if any.
    pub fn socket_path(&self) -> Option<&Path> {
        match self {
            Socket::Unix { path, .. } => Some(path),
            Socket::Tcp { .. } => None,
        }
    }
}

impl StdBound {
    /// The listener for the runtime this is called in.
    pub fn into_tokio(self) -> Result<Bound, StartError> {
        self.nonblocking_into(
            tokio::net::UnixListener::from_std,
            tokio::net::TcpListener::from_std,
        )
    }

    /// The listener made non-blocking and handed to `unix` or `tcp` (its registration with the
    /// runtime: [`StdBound::into_tokio`], or the accept loop's own, `super::accept`), with a
    /// failure named by its address.
    pub(crate) fn nonblocking_into<U, T>(
        self,
        unix: impl FnOnce(std::os::unix::net::UnixListener) -> std::io::Result<U>,
        tcp: impl FnOnce(std::net::TcpListener) -> std::io::Result<T>,
    ) -> Result<Socket<U, T>, StartError> {
        let addr = self.addr();
        let err = |source| StartError::Bind {
            addr: addr.clone(),
            source,
        };
        match self {
            Socket::Unix { listener, path } => {
                listener.set_nonblocking(true).map_err(err)?;
                Ok(Socket::Unix {
                    listener: unix(listener).map_err(err)?,
                    path,
                })
            }
            Socket::Tcp { listener, addr: a } => {
                listener.set_nonblocking(true).map_err(err)?;
                Ok(Socket::Tcp {
                    listener: tcp(listener).map_err(err)?,
                    addr: a,
                })
            }
        }
    }
}

/// Binds a listener. Refuses non-loopback TCP addresses unless `unsafe_listen`. A UNIX socket
/// is mode 0600, or 0666 when `shared` (`--allow-uid` names another user): the file's mode is
/// checked by `connect` before the peer-uid check can run, so at 0600 an allowed user got
/// "Permission denied" and never reached it; at 0666 every local user reaches the peer-uid
/// check (`SO_PEERCRED`, set by the kernel), which admits exactly the allowed uids, as on the
/// loopback TCP port every local user can reach anyway.
pub fn bind(addr: &ListenAddr, unsafe_listen: bool, shared: bool) -> Result<StdBound, StartError> {
    let err = |source| StartError::Bind {
        addr: addr.clone(),
        source,
    };
    match addr {
        ListenAddr::Tcp(a) => {
            if !a.ip().is_loopback() && !unsafe_listen {
                return Err(StartError::NonLoopbackListen { addr: addr.clone() });
            }
            let listener = std::net::TcpListener::bind(a).map_err(|source| {
                if source.kind() == std::io::ErrorKind::AddrInUse {
                    if let Some(uid) = listening_uid(*a) {
                        return StartError::PortTaken {
                            addr: addr.clone(),
                            uid,
                            own: uid == rustix::process::geteuid().as_raw(),
                            source,
                        };
                    }
                }
                err(source)
            })?;
            let bound = listener.local_addr().map_err(err)?;
            Ok(StdBound::Tcp {
                listener,
                addr: bound,
            })
        }
        ListenAddr::Unix(path) => Ok(StdBound::Unix {
            listener: bind_unix(path, if shared { 0o666 } else { 0o600 })?,
            path: path.clone(),
        }),
    }
}

/// Binds a UNIX socket with `mode` (0600 unless other users are allowed), replacing a stale
/// socket file but never a live one.
///
/// Between bind and chmod the file briefly has the umask's mode; the peer-uid check closes
/// connections from other users anyway.
pub fn bind_unix(path: &Path, mode: u32) -> Result<std::os::unix::net::UnixListener, StartError> {
    let addr = ListenAddr::Unix(path.to_path_buf());
    let bind_err = |source: std::io::Error| StartError::Bind {
        addr: addr.clone(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(StartError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(StartError::SocketInUse {
                path: path.to_path_buf(),
            });
        }
        std::fs::remove_file(path).map_err(bind_err)?;
    }
    if let Some(parent) = path.parent() {
        if !parent.as_os_str().is_empty() && !parent.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(bind_err)?;
        }
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(bind_err)?;
    Ok(listener)
}

/// The uid that owns the socket listening on `addr` (from `/proc/net/tcp` or `tcp6`): who took
/// a port a person's proxy wants, so the error can say whether it is theirs.
fn listening_uid(addr: std::net::SocketAddr) -> Option<u32> {
    const LISTEN: &str = "0A";
    let (table, local) = match addr {
        std::net::SocketAddr::V4(a) => (
            "/proc/net/tcp",
            format!(
                "{:08X}:{:04X}",
                u32::from_le_bytes(a.ip().octets()),
                a.port()
            ),
        ),
        std::net::SocketAddr::V6(a) => {
            let words: String = a
                .ip()
                .octets()
                .chunks(4)
                .map(|w| format!("{:08X}", u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
                .collect();
            ("/proc/net/tcp6", format!("{words}:{:04X}", a.port()))
        }
    };
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&LISTEN))
            .then(|| fields.get(7)?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner of a listening port is found (here: this process's own listener).
    #[test]
    fn the_owner_of_a_taken_port_is_named() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = held.local_addr().expect("addr");
        assert_eq!(
            listening_uid(addr),
            Some(rustix::process::geteuid().as_raw())
        );
        let e = bind(&ListenAddr::Tcp(addr), false, false).expect_err("taken");
        let text = e.to_string();
        assert!(
            text.contains("already listens") && text.contains("--port"),
            "{text}"
        );
    }
}
